"""`t5x-like finetune-suite` and a benchmark run's outputs (issue 43's frictions): every
task checked before any is trained, a partial suite's score named for what it covers,
submission rows in index order, dev_predictions.jsonl joinable to the dataset by idx,
and the per-task learning-rate grid picked on a held-out split of train.

Datasets are tiny TFDS builds (tests/tfds_fixtures.py), where row k has idx k and its
label is written into the text (k % 2 for RTE), so the expected labels of a row come
from its idx, not from the code under test. The default tier trains nothing; the slow
tier runs the grid end to end through the CLI.
"""

from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest

from helpers import ROOT, cli_command, run_child
from tfds_fixtures import LABELS, build_benchmark
from t5x_like import cli
from t5x_like.benchmarks.registry import BenchmarkError, benchmark
from t5x_like.benchmarks import suite as suite_runner
from t5x_like.benchmarks.suite_table import summarize, table
from t5x_like.benchmarks.task_data import benchmark_splits, benchmark_task, hold_out
from t5x_like.commands import finetune_suite
from t5x_like.finetune.data import Dataset
from t5x_like.finetune.evaluate import prediction_rows
from t5x_like.finetune.task import Example
from t5x_like.finetune.tasks import make_task

SMOKE = f"--config={ROOT}/configs/glue.py:smoke"
RTE = LABELS["glue/rte"]  # row k's label is RTE[k % 2] (tfds_fixtures.example)


@pytest.fixture(scope="module")
def rte_only(tmp_path_factory):
  """A TFDS data dir holding glue/rte only (24 train, 8 dev, 8 test rows)."""
  directory = str(tmp_path_factory.mktemp("tfds_rte"))
  build_benchmark(directory, "glue/rte", {"train": 24, "validation": 8, "test": 8})
  return directory


# ------------------------------------------------------------- every task checked first
def test_suite_checks_every_task_before_training_any(rte_only, tmp_path, capsys):
  workdir = tmp_path / "suite"
  code = cli.main(["finetune-suite", SMOKE, f"--workdir={workdir}", "--tasks=rte,stsb,cola",
                   f"--config.benchmark.data_dir={rte_only}"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2
  assert "2 of the 3 tasks to run cannot run; nothing was trained" in err[0]
  assert [line.split(":")[0].strip() for line in err[1:]] == ["stsb", "cola"]
  assert "glue/stsb" in err[1] and rte_only in err[1] and "glue/cola" in err[2]
  assert not any("Traceback" in line for line in err)
  assert not workdir.exists()  # rte, whose data is there, was not trained either


def test_grid_point_runs_on_a_held_out_split_of_train(tmp_path):
  argv = [SMOKE, f"--workdir={tmp_path}", "--lr_grid=3e-4,1e-4", "--lr_holdout=0.2",
          "--config.seed=7", "--config.optimizer.weight_decay=0.1"]
  fv = finetune_suite.parse_flags("finetune-suite", argv, finetune_suite._flags,
                                  required=("config", "workdir"))
  suite = suite_runner.Suite(suite_runner.SuiteFlags(
      fv.config, fv.workdir, fv.tasks, fv.init, fv.lr_grid, fv.lr_holdout, argv),
      finetune_suite.finetune_config)
  argv = suite.argv_of("mrpc", "1e-4", grid_point=True)
  assert argv[1] == f"--workdir={tmp_path}/lr_grid/mrpc/1e-4"
  config = suite.config_of(argv)
  assert config.benchmark.name == "glue/mrpc"
  assert config.optimizer.learning_rate == pytest.approx(1e-4)
  assert config.optimizer.weight_decay == pytest.approx(0.1)  # the user's override kept
  assert (config.benchmark.holdout_fraction, config.benchmark.holdout_seed,
          config.benchmark.predict_test) == (pytest.approx(0.2), 7, False)
  final = suite.config_of(suite.argv_of("mrpc", "3e-4"))
  assert final.optimizer.learning_rate == pytest.approx(3e-4)
  assert (final.benchmark.holdout_fraction, final.benchmark.predict_test) == (0.0, True)
  with pytest.raises(suite_runner.FlagError, match="--lr_grid: 'fast'"):
    suite_runner.learning_rates(["1e-4", "fast"])


# ------------------------------------------------------------- a partial suite says so
def _rows(scores: dict) -> dict:
  return {task: {"official": official, "score": float(np.mean(list(official.values())))}
          for task, official in scores.items()}


def test_partial_suite_says_how_many_tasks_its_mean_covers():
  rows = _rows({"cola": {"mcc": 20.0}, "mrpc": {"f1": 80.0, "accuracy": 70.0}})
  rows["cola"]["official"]["test_mcc"] = 90.0  # a labelled test split: not in the score
  summary = summarize("glue", rows)
  assert summary["score"] == pytest.approx((20.0 + 75.0) / 2)
  assert summary["score_name"] == "mean of 2 of GLUE's 9 tasks"
  assert (summary["complete"], summary["tasks_covered"], summary["num_tasks_covered"],
          summary["num_suite_tasks"]) == (False, ["cola", "mrpc"], 2, 9)
  printed = table(summary)
  assert printed.splitlines()[-1].split() == ["glue", "mean", "of", "2", "of", "GLUE's", "9",
                                              "tasks", "47.5"]
  assert "GLUE score" not in printed
  every = {t: {benchmark(f"glue/{t}").metrics[0]: 50.0 + k} for k, t in enumerate(
      ["cola", "sst2", "mrpc", "qqp", "stsb", "qnli", "rte", "wnli"])}
  every["mnli"] = {"accuracy_matched": 58.0}
  full = summarize("glue", _rows(every))
  assert (full["score_name"], full["complete"]) == ("GLUE score", True)
  assert full["score"] == pytest.approx(54.0)
  assert "glue  GLUE score" in table(full)
  # SuperGLUE's MultiRC, ReCoRD and WSC have no config: never "the SuperGLUE score"
  superglue = summarize("super_glue", _rows(
      {t: {"accuracy": 60.0} for t in ["boolq", "cb", "copa", "rte", "wic"]}))
  assert superglue["score_name"] == "mean of 5 of SuperGLUE's 8 tasks"


def test_table_shows_each_tasks_pick_and_every_rates_held_out_score():
  rows = _rows({"rte": {"accuracy": 55.0}, "cola": {"mcc": 10.0}})
  rows["rte"]["lr_grid"] = {"learning_rate": "1e-4", "scores": {"3e-4": 50.0, "1e-4": 61.25}}
  lines = table(summarize("glue", rows)).splitlines()
  assert "lr picked (held-out score per lr)" in lines[0]
  assert lines[1].split()[-5:] == ["1e-4", "(3e-4", "50.0,", "1e-4", "61.2)"]
  assert lines[2].split()[-1] == "-"  # cola ran without the grid


def test_pick_learning_rate_takes_the_best_and_the_first_on_a_tie():
  assert suite_runner.pick_learning_rate({"3e-4": 50.0, "1e-4": 62.0, "5e-5": 61.0}) == "1e-4"
  assert suite_runner.pick_learning_rate({"3e-4": 60.0, "1e-4": 60.0}) == "3e-4"


# ------------------------------------------------------------- the held-out split
def _train(n: int) -> Dataset:
  ids = [int(i) for i in np.random.default_rng(1).permutation(n)]  # storage order != idx
  examples = [Example(text=f"row {i}", label=i % 2, line=k) for k, i in enumerate(ids)]
  return Dataset("glue/rte:train", examples, tuple(RTE), {"rows": n, "examples": n},
                 ids=ids, golds=[RTE[i % 2] for i in ids])


def test_hold_out_is_a_seeded_split_of_train_in_its_order():
  train = _train(40)
  rest, held = hold_out(train, 0.25, seed=3)
  assert (len(rest.examples), len(held.examples)) == (30, 10)
  assert sorted(rest.ids + held.ids) == list(range(40))  # disjoint, nothing lost
  for part in (rest, held):
    lines = [e.line for e in part.examples]
    assert lines == sorted(lines)  # the split's own order
    assert part.ids == [train.ids[k] for k in lines]  # ids and golds stay with their rows
    assert part.golds == [RTE[i % 2] for i in part.ids]
    assert part.labels == train.labels and part.stats["examples"] == len(part.examples)
  again, held_again = hold_out(train, 0.25, seed=3)
  assert held_again.ids == held.ids and again.ids == rest.ids
  assert hold_out(train, 0.25, seed=4)[1].ids != held.ids
  for fraction in (0.0, 1.0, 0.999):
    with pytest.raises(BenchmarkError, match="holdout_fraction"):
      hold_out(train, fraction, seed=0)


def test_holdout_config_reads_train_only(rte_only, monkeypatch):
  from helpers import load_config
  from t5x_like.benchmarks import sources
  read, real = [], sources.read_benchmark_split
  monkeypatch.setattr(sources, "read_benchmark_split",
                      lambda bench, split, *a, **kw: read.append(split) or real(
                          bench, split, *a, **kw))
  config = load_config("glue", "rte,smoke")
  config.benchmark.data_dir = rte_only
  config.benchmark.holdout_fraction = 0.25
  task = benchmark_task(config, False)
  splits = benchmark_splits(config, task, False)
  assert read == ["train"]  # never dev, never test
  assert list(splits.dev) == ["holdout"] and splits.test == {}
  assert (len(splits.train.examples), len(splits.main_dev.examples)) == (18, 6)
  assert sorted(splits.train.ids + splits.main_dev.ids) == list(range(24))
  # each held-out row's gold is its own (the fixture's label of its idx)
  assert splits.main_dev.golds == [RTE[i % 2] for i in splits.main_dev.ids]


# ------------------------------------------------------------- submission and dev rows
def test_submission_rows_are_written_in_index_order():
  labels = ["entailment", "not_entailment"]
  rows = [{"prediction": "not_entailment"}, {"prediction": "entailment"},
          {"prediction": "not_entailment"}]
  assert benchmark("glue/rte").submission_lines(rows, [2, 0, 1], labels) == (
      "index\tprediction\n0\tentailment\n1\tnot_entailment\n2\tnot_entailment\n")
  sst2 = [{"prediction": p} for p in ("positive", "negative", "positive")]
  assert benchmark("glue/sst2").submission_lines(sst2, [10, 2, 9], ["negative", "positive"]) == (
      "index\tprediction\n2\t0\n9\t1\n10\t1\n")  # by number, not as text
  assert benchmark("super_glue/cb").submission_lines(
      rows[:2], [5, 3], ["entailment", "not_entailment"]) == (
      '{"idx": 3, "label": "entailment"}\n{"idx": 5, "label": "not_entailment"}\n')


def test_dev_prediction_rows_carry_the_datasets_idx():
  task = make_task("classification", text_column="text", label_column="label")
  dev = _train(6)
  model = types.SimpleNamespace(task=task, text_to_text=False, generates_text=False)
  predicted = np.array([1, 0, 1, 1, 0, 0])
  rows = prediction_rows(model, predicted, dev, {})
  assert [r["idx"] for r in rows] == dev.ids
  assert [r["line"] for r in rows] == list(range(6))
  # joined by idx, each row's gold is the dataset's label of that idx
  assert all(r["label"] == RTE[r["idx"] % 2] for r in rows)
  assert [r["prediction"] for r in rows] == [RTE[p] for p in predicted]
  dev.ids = None  # a CSV / JSONL task file: its line is its key
  assert "idx" not in prediction_rows(model, predicted, dev, {})[0]


# ------------------------------------------------------------- signals between runs
@pytest.mark.parametrize("when", ["after_the_last_step", "between_runs"])
def test_a_signal_stops_the_suite_before_its_next_run(when, rte_only, tmp_path, monkeypatch,
                                                      capsys):
  """SIGTERM after a run's last step (its run returns 'finished' with stopped_by) or
  between two runs (the suite's own handler): the next run does not start; exit 143.
  The runs are stand-ins that return what finetune() returns; the slow twin below
  signals a real run."""
  import signal
  from t5x_like.finetune import loop
  from t5x_like.train.preemption import RunResult
  started = []

  def finetune(config, workdir, **_):  # data=, choose_remat=
    started.append(os.path.relpath(workdir, tmp_path))
    if when == "between_runs":
      signal.raise_signal(signal.SIGTERM)  # no run's handler here: the suite's takes it
      return RunResult({}, 4, "finished")
    return RunResult({}, 4, "finished", "SIGTERM")

  monkeypatch.setattr(loop, "finetune", finetune)
  handler = signal.getsignal(signal.SIGTERM)
  code = cli.main(["finetune-suite", SMOKE, f"--workdir={tmp_path / 'suite'}", "--tasks=rte",
                   "--lr_grid=3e-3,1e-4", f"--config.benchmark.data_dir={rte_only}"])
  out = capsys.readouterr().out
  assert code == 143
  assert started == [os.path.join("suite", "lr_grid", "rte", "3e-3")]  # not 1e-4 nor rte
  assert ("stopped by SIGTERM after rte lr 3e-3 finished: its outputs are written"
          if when == "after_the_last_step" else
          "stopped by SIGTERM before rte lr 1e-4: nothing of it was started") in out, out
  assert "exit 143: rerun the same command to resume" in out
  assert signal.getsignal(signal.SIGTERM) == handler  # the suite's own handler is gone


@pytest.mark.slow  # one real fine-tuning of 4 steps, then the rerun's two: ~40 s
def test_ctrl_c_in_a_runs_last_step_stops_the_suite_and_the_rerun_goes_on(rte_only, tmp_path,
                                                                         monkeypatch):
  """A Ctrl-C right after the last step of the first grid point (failpoints.py sigint@4):
  the run writes its outputs, the suite stops with 130 before the next grid point; the
  rerun skips the finished point and runs the rest."""
  from t5x_like import failpoints
  argv = ["finetune-suite", SMOKE, f"--workdir={tmp_path / 'suite'}", "--tasks=rte",
          "--lr_grid=3e-3,1e-4", f"--config.benchmark.data_dir={rte_only}"]
  monkeypatch.setenv(failpoints.FAILPOINT_ENV, "sigint@4")
  assert cli.main(argv) == 130
  grid = tmp_path / "suite" / "lr_grid" / "rte"
  assert (grid / "3e-3" / "final_metrics.json").exists() and not (grid / "1e-4").exists()
  monkeypatch.delenv(failpoints.FAILPOINT_ENV)
  assert cli.main(argv) == 0
  assert (grid / "1e-4" / "final_metrics.json").exists()
  assert (tmp_path / "suite" / "suite.json").exists()


# ------------------------------------------------------------- the grid, end to end
@pytest.mark.slow  # three fine-tunings of 4 steps (two grid points, one final): ~60 s
def test_lr_grid_picks_on_held_out_train_then_runs_the_task(rte_only, tmp_path):
  workdir = tmp_path / "suite"
  # A grid point that finished before (a resumed suite): read, not run again.
  finished = workdir / "lr_grid" / "rte" / "1e-4"
  finished.mkdir(parents=True)
  (finished / "final_metrics.json").write_text(json.dumps({"score": 99.0}))
  cmd = cli_command("finetune-suite", SMOKE, f"--workdir={workdir}", "--tasks=rte",
                    "--lr_grid=3e-3,1e-4", "--lr_holdout=0.25",
                    f"--config.benchmark.data_dir={rte_only}")
  out = run_child(cmd, devices=1)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "=== glue/rte lr 3e-3" in out.stdout and "lr 1e-4:" not in out.stdout
  point = json.loads((workdir / "lr_grid" / "rte" / "3e-3" / "final_metrics.json").read_text())
  assert (point["train_examples"], point["dev_examples"]) == (18, 6)  # 25% of train held out
  assert point["submissions"] == []  # no test split read
  pick = json.loads((workdir / "lr_grid" / "rte" / "pick.json").read_text())
  assert pick["scores"] == {"3e-3": point["score"], "1e-4": 99.0}
  assert pick["learning_rate"] == "1e-4"
  # the final run: all of train, the dev split, at the picked rate
  final = json.loads((workdir / "rte" / "final_metrics.json").read_text())
  assert (final["train_examples"], final["dev_examples"]) == (24, 8)
  def logged_rates(run_dir):  # the schedule's rate at each logged step
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return {r["step"]: r["learning_rate"] for r in rows if "learning_rate" in r}
  final_rates, point_rates = logged_rates(workdir / "rte"), logged_rates(
      workdir / "lr_grid" / "rte" / "3e-3")
  assert final_rates and final_rates.keys() == point_rates.keys()
  for step, rate in final_rates.items():  # the same schedule, scaled to the picked peak
    assert rate == pytest.approx(point_rates[step] * 1e-4 / 3e-3, rel=1e-4)
  summary = json.loads((workdir / "suite.json").read_text())
  assert summary["tasks"]["rte"]["lr_grid"] == pick
  assert summary["score_name"] == "mean of 1 of GLUE's 9 tasks"
  assert "1e-4 (3e-3" in out.stdout
  # dev_predictions.jsonl joins the dev split by idx; the submission is in index order
  dev = [json.loads(line) for line in open(workdir / "rte" / "dev_predictions.jsonl")]
  assert sorted(r["idx"] for r in dev) == list(range(8))
  assert all(r["label"] == RTE[r["idx"] % 2] for r in dev)
  lines = (workdir / "rte" / "submission" / "RTE.tsv").read_text().splitlines()
  assert [line.split("\t")[0] for line in lines[1:]] == [str(k) for k in range(8)]
  again = run_child(cmd, devices=1)  # finished: nothing runs again
  assert again.returncode == 0 and "===" not in again.stdout
  assert json.loads((workdir / "suite.json").read_text()) == summary
