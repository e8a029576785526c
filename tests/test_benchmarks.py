"""GLUE, SuperGLUE and SQuAD from TFDS (t5x_like/benchmarks/registry.py, tfds_source.py,
outputs.py; configs/glue.py, superglue.py, squad.py; `t5x-like finetune-suite`).

Datasets are built here in array_record with the real datasets' features
(tests/tfds_fixtures.py), or mocked by tfds.testing.mock_data from those features;
nothing is downloaded. Expected metrics come from scikit-learn / scipy and from the
GLUE / SuperGLUE / SQuAD file formats written out by hand, never from the code under
test. The default tier runs two tasks end to end (BERT: pairs, spans); the slow tier
a T5 one and the CLI's bad-input cases; the long tier every config and the suite.
"""

from __future__ import annotations

import glob
import json
import os
import re

import numpy as np
import pytest
import tensorflow_datasets as tfds
from scipy import stats
from sklearn import metrics as sk

from helpers import ROOT, cli_command, load_config, run_child
from tfds_fixtures import build_benchmark, example
from t5x_like.benchmarks.registry import BENCHMARKS, SUITES, benchmark

SIZES = {"train": 24, "validation": 8, "test": 8}
MNLI_SIZES = {"train": 24, "validation_matched": 8, "validation_mismatched": 8,
              "test_matched": 4, "test_mismatched": 4}
CONFIG_FILE = {"glue": "glue", "super_glue": "superglue", "squad": "squad"}


def _sizes(name: str) -> dict:
  if name == "glue/mnli":
    return MNLI_SIZES
  return {"train": 24, "validation": 8} if name.startswith("squad/") else SIZES


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """Every benchmark, built small under one TFDS data dir."""
  directory = str(tmp_path_factory.mktemp("tfds"))
  for name in BENCHMARKS:
    build_benchmark(directory, name, _sizes(name))
  return directory


def _finetune(name: str, family: str, data_dir: str, workdir, **overrides):
  from t5x_like.benchmarks.task_data import task_data
  from t5x_like.finetune.loop import finetune
  suite, task = name.split("/")
  config = load_config(CONFIG_FILE[suite], f"{task},smoke,family={family}")
  config.benchmark.data_dir = data_dir
  for key, value in overrides.items():
    section, field = key.split(".")
    config[section][field] = value
  result = finetune(config, str(workdir), data=task_data(config))
  assert result.status == "finished"
  return result


def _check_outputs(name: str, result, workdir, labeled_tests: bool = False):
  """The official metrics of the benchmark and its submission files, parsed."""
  bench = benchmark(name)
  official = result["official"]
  suffixes = [""] if len(bench.dev_splits) == 1 else ["_matched", "_mismatched"]
  expected = {m + s for m in bench.metrics for s in suffixes}
  breakdown = ({f"{part}_{m}" for part in ("HasAns", "NoAns") for m in bench.metrics}
               if bench.unanswerable else set())  # SQuAD 2.0's, where there are both
  shown = {k for k in official if not k.startswith("test_")}
  assert expected <= shown <= expected | breakdown
  assert result["score"] == pytest.approx(np.mean([official[k] for k in expected]), abs=1e-2)
  assert all(np.isfinite(v) for v in official.values())
  # One unit and one value per name: a dev metric the run reports beside the official
  # ones (percent) is the same figure.
  for key in set(official) & set(result):
    assert result[key] == pytest.approx(official[key], abs=1e-3), key
  for split, file in bench.submission:
    path = os.path.join(workdir, "submission", file)
    with open(path) as f:
      text = f.read()
    size = 8 if split in ("validation", "test") else 4
    if bench.submission_format == "glue_tsv":
      lines = text.splitlines()
      assert lines[0] == "index\tprediction"
      ids = [int(line.split("\t")[0]) for line in lines[1:]]  # in index order
      assert ids == list(range(size))
      values = [line.split("\t")[1] for line in lines[1:]]
      if bench.kind == "regression":
        assert all(0.0 <= float(v) <= 5.0 for v in values)
      elif bench.label_format == "index":
        assert set(values) <= {"0", "1"}
      else:
        assert set(values) <= set(tfds_labels(name))
    elif bench.submission_format == "superglue_jsonl":
      rows = [json.loads(line) for line in text.splitlines()]
      assert sorted(r["idx"] for r in rows) == list(range(size))
      allowed = {"bool": {"true", "false"}, "index": {0, 1},
                 "name": set(tfds_labels(name))}[bench.label_format]
      assert {r["label"] for r in rows} <= allowed
    else:  # SQuAD: id -> answer text for every dev question
      answers = json.loads(text)
      assert sorted(answers) == [f"q{k:05d}" for k in range(size)]
      assert all(isinstance(v, str) for v in answers.values())


def tfds_labels(name: str) -> list[str]:
  from tfds_fixtures import LABELS
  return LABELS[name]


# ------------------------------------------------------------------ end to end
DEFAULT_TIER = [("glue/stsb", "bert"), ("squad/v2.0", "bert")]
SLOW_TIER = [("glue/cola", "t5")]  # T5's compile is the longest
EVERY = [(name, family) for name in BENCHMARKS for family in ("bert", "t5")]


@pytest.mark.parametrize("name,family", DEFAULT_TIER + [
    pytest.param(*p, marks=pytest.mark.slow) for p in SLOW_TIER])
def test_benchmark_end_to_end_on_a_local_build(name, family, data_dir, tmp_path):
  result = _finetune(name, family, data_dir, tmp_path)
  _check_outputs(name, result, tmp_path)


@pytest.mark.long
@pytest.mark.parametrize("name,family", [p for p in EVERY if p not in DEFAULT_TIER + SLOW_TIER])
def test_every_benchmark_config_end_to_end(name, family, data_dir, tmp_path):
  _check_outputs(name, _finetune(name, family, data_dir, tmp_path), tmp_path)


def _mock(data_dir, name):
  """tfds.testing.mock_data: random examples from the dataset's features (its metadata
  under data_dir); SQuAD's random answers are not in their contexts, so its mock
  examples are tfds_fixtures' (as_data_source_fn)."""
  if name.startswith("squad/"):
    def source(builder, split, *unused_args, **unused_kwargs):  # as tfds_fixtures builds
      rng = np.random.default_rng(len(split))
      return [example(name, k, True, rng) for k in range(8)]
    return tfds.testing.mock_data(num_examples=8, as_data_source_fn=source,
                                  policy=tfds.testing.MockPolicy.USE_FILES, data_dir=data_dir)
  return tfds.testing.mock_data(num_examples=8, policy=tfds.testing.MockPolicy.USE_FILES,
                                data_dir=data_dir)


@pytest.mark.parametrize("name,family", [pytest.param("glue/mrpc", "bert",
                                                      marks=pytest.mark.slow),
                                         pytest.param("glue/qnli", "t5", marks=pytest.mark.long)])
def test_benchmark_end_to_end_on_tfds_mock_data(name, family, data_dir, tmp_path):
  with _mock(data_dir, name):  # nothing built under this data dir
    result = _finetune(name, family, str(tmp_path / "no_data"), tmp_path / "run")
  bench = benchmark(name)
  assert result["train_examples"] == 8 and result["dev_examples"] == 8
  # mock test splits have labels: they are scored too
  assert {k for k in result["official"] if k.startswith("test_")} == {
      f"test_{m}" for m in bench.metrics}
  for _, file in bench.submission:
    assert os.path.isfile(tmp_path / "run" / "submission" / file)


@pytest.mark.long
@pytest.mark.parametrize("name,family", EVERY)
def test_every_benchmark_config_on_tfds_mock_data(name, family, data_dir, tmp_path):
  with _mock(data_dir, name):
    result = _finetune(name, family, str(tmp_path / "no_data"), tmp_path / "run")
  assert result["step"] == 4 and set(benchmark(name).metrics) <= {
      k.rsplit("_matched", 1)[0].rsplit("_mismatched", 1)[0] for k in result["official"]}


# ------------------------------------------------------------------ official metrics
def _rows(predicted, gold, labels):
  return [{"label": labels[g], "prediction": labels[p] if p >= 0 else None}
          for p, g in zip(predicted, gold)]


def test_official_metrics_equal_sklearn_and_scipy():
  rng = np.random.default_rng(3)
  gold, predicted = rng.integers(0, 2, 50), rng.integers(0, 2, 50)
  predicted[:3] = -1  # a T5 generation that is no label counts as wrong
  labels = ["not_equivalent", "equivalent"]
  mrpc = benchmark("glue/mrpc").official_metrics({"validation": _rows(predicted, gold, labels)},
                                                 labels, {"validation": None})
  shown = np.where(predicted < 0, 2, predicted)  # "no label": a third class for sklearn
  assert mrpc["f1"] == pytest.approx(100 * sk.f1_score(gold, shown, labels=[1],
                                                       average="micro"))
  assert mrpc["accuracy"] == pytest.approx(100 * sk.accuracy_score(gold, shown))
  predicted = rng.integers(0, 2, 50)
  cola = benchmark("glue/cola").official_metrics(
      {"validation": _rows(predicted, gold, ["unacceptable", "acceptable"])},
      ["unacceptable", "acceptable"], {"validation": None})
  assert cola["mcc"] == pytest.approx(100 * sk.matthews_corrcoef(gold, predicted))
  g3, p3 = rng.integers(0, 3, 60), rng.integers(0, 3, 60)
  names = ["entailment", "contradiction", "neutral"]
  cb = benchmark("super_glue/cb").official_metrics({"validation": _rows(p3, g3, names)}, names,
                                                   {"validation": None})
  assert cb["macro_f1"] == pytest.approx(100 * sk.f1_score(g3, p3, average="macro"))
  assert cb["accuracy"] == pytest.approx(100 * sk.accuracy_score(g3, p3))
  mnli = benchmark("glue/mnli").official_metrics(
      {"validation_matched": _rows(p3, g3, names), "validation_mismatched": _rows(g3, g3, names)},
      names, {"validation_matched": None, "validation_mismatched": None})
  assert mnli == pytest.approx({"accuracy_matched": 100 * sk.accuracy_score(g3, p3),
                                "accuracy_mismatched": 100.0})
  scores, guesses = rng.uniform(0, 5, 40), rng.uniform(0, 5, 40)
  stsb = benchmark("glue/stsb").official_metrics(
      {"validation": [{"label": s, "prediction": f"{p:.1f}"} for s, p in zip(scores, guesses)]},
      [], {"validation": list(scores)})
  rounded = [float(f"{p:.1f}") for p in guesses]
  assert stsb["pearson"] == pytest.approx(100 * stats.pearsonr(rounded, scores)[0])
  assert stsb["spearman"] == pytest.approx(100 * stats.spearmanr(rounded, scores)[0])


def test_squad_official_metrics_take_the_best_gold_answer():
  # (prediction, gold answers, exact match, F1), worked out by hand the official way
  cases = [("The Eiffel Tower", ["Eiffel Tower", "the tower"], 1.0, 1.0),
           ("tower", ["Eiffel Tower", "a tower"], 1.0, 1.0),
           ("Paris, France", ["France"], 0.0, 2 * 0.5 * 1.0 / 1.5),
           ("", [], 1.0, 1.0),  # SQuAD 2.0: no answer, predicted none
           ("in 1889", [], 0.0, 0.0)]
  rows = [{"answer": "", "prediction": p} for p, _, _, _ in cases]
  out = benchmark("squad/v2.0").official_metrics({"validation": rows}, [],
                                                  {"validation": [g for _, g, _, _ in cases]})
  assert out["exact_match"] == pytest.approx(100 * np.mean([c[2] for c in cases]))
  assert out["f1"] == pytest.approx(100 * np.mean([c[3] for c in cases]))


def test_submission_files_in_the_benchmarks_formats():
  labels = ["entailment", "neutral", "contradiction"]
  rows = [{"prediction": "neutral"}, {"prediction": None}, {"prediction": "contradiction"}]
  assert benchmark("glue/mnli").submission_lines(rows, [7, 8, 9], labels) == (
      "index\tprediction\n7\tneutral\n8\tentailment\n9\tcontradiction\n")
  assert benchmark("glue/sst2").submission_lines(
      [{"prediction": "positive"}, {"prediction": "negative"}], [0, 1],
      ["negative", "positive"]) == "index\tprediction\n0\t1\n1\t0\n"
  assert benchmark("glue/stsb").submission_lines(
      [{"prediction": 5.7}, {"prediction": "3.4"}], [0, 1], []) == (
      "index\tprediction\n0\t5.000\n1\t3.400\n")
  assert benchmark("super_glue/boolq").submission_lines(
      [{"prediction": "True"}, {"prediction": "False"}], [0, 1], ["False", "True"]) == (
      '{"idx": 0, "label": "true"}\n{"idx": 1, "label": "false"}\n')
  assert benchmark("super_glue/copa").submission_lines(
      [{"prediction": "choice2"}], [4], ["choice1", "choice2"]) == '{"idx": 4, "label": 1}\n'
  assert json.loads(benchmark("squad/v1.1").submission_lines(
      [{"prediction": "a boat"}, {"prediction": None}], ["q1", "q2"], [])) == {
      "q1": "a boat", "q2": ""}


def test_t5_inputs_are_the_t5_papers_format():
  mnli = benchmark("glue/mnli").record(
      {"premise": b"A man sleeps.", "hypothesis": b"Nobody sleeps.", "label": 2, "idx": 5},
      True, ["entailment", "neutral", "contradiction"])
  assert mnli["text"] == "mnli hypothesis: Nobody sleeps. premise: A man sleeps."
  assert mnli["label"] == "contradiction" and mnli["idx"] == 5
  cola = benchmark("glue/cola").record({"sentence": b"Him go.", "label": 0, "idx": 1}, True,
                                       ["unacceptable", "acceptable"])
  assert cola["text"] == "cola sentence: Him go." and cola["label"] == "unacceptable"
  stsb = benchmark("glue/stsb").record({"sentence1": b"a", "sentence2": b"b", "label": 3.27,
                                        "idx": 0}, True, [])
  assert stsb["label"] == "3.2"  # rounded to a multiple of 0.2
  bert = benchmark("glue/mnli").record({"premise": b"P.", "hypothesis": b"H.", "label": -1,
                                        "idx": 0}, False, ["entailment", "neutral", "x"])
  assert (bert["text"], bert["text_pair"], bert["labeled"]) == ("P.", "H.", False)


# ------------------------------------------------------------------ the suite
@pytest.mark.long  # two CLI runs of two tasks each: ~35 s
def test_finetune_suite_prints_one_table_and_resumes(data_dir, tmp_path):
  cmd = cli_command("finetune-suite", f"--config={ROOT}/configs/glue.py:smoke",
                    f"--workdir={tmp_path}", "--tasks=rte,stsb",
                    f"--config.benchmark.data_dir={data_dir}")
  first = run_child(cmd, devices=1)
  assert first.returncode == 0, first.stderr[-2000:]
  summary = json.loads((tmp_path / "suite.json").read_text())
  assert list(summary["tasks"]) == ["rte", "stsb"]
  task_scores = [summary["tasks"][t]["score"] for t in ("rte", "stsb")]
  assert summary["score"] == pytest.approx(np.mean(task_scores), abs=1e-2)
  assert "glue  mean of 2 of GLUE's 9 tasks" in first.stdout
  mtime = os.path.getmtime(tmp_path / "rte" / "final_metrics.json")
  again = run_child(cmd, devices=1)  # finished tasks are not run again
  assert again.returncode == 0 and "===" not in again.stdout
  assert os.path.getmtime(tmp_path / "rte" / "final_metrics.json") == mtime
  assert json.loads((tmp_path / "suite.json").read_text()) == summary


# ------------------------------------------------------------------ bad input
@pytest.mark.slow  # five CLI processes: ~35 s
def test_bad_benchmark_input_is_one_line_exit_2_and_writes_nothing(data_dir, tmp_path):
  missing_label = str(tmp_path / "broken")
  build_benchmark(missing_label, "glue/rte", SIZES, drop="label")
  os.makedirs(tmp_path / "empty")  # there, holding neither the files nor a build
  cases = [
      (["finetune", f"--config={ROOT}/configs/glue.py:colaa,smoke"], "unknown task 'colaa'"),
      (["finetune", f"--config={ROOT}/configs/glue.py:rte,smoke",
        f"--config.benchmark.data_dir={tmp_path}/empty"],
       f"glue/rte is not built under {tmp_path}/empty: on a machine with internet run"
       f" `tfds build glue/rte --data_dir {tmp_path}/empty --file_format array_record`"),
      (["finetune", f"--config={ROOT}/configs/glue.py:rte,smoke",
        f"--config.benchmark.data_dir={missing_label}"], "has no feature 'label'"),
      (["finetune", f"--config={ROOT}/configs/glue.py:rte,smoke",
        "--config.benchmark.name=glue/nope"], "config.benchmark.name='glue/nope'"),
      (["finetune-suite", f"--config={ROOT}/configs/glue.py:smoke", "--tasks=cola,nope",
        f"--config.benchmark.data_dir={data_dir}"], "--tasks: unknown glue task 'nope'"),
  ]
  for k, (argv, expected) in enumerate(cases):
    workdir = tmp_path / f"run{k}"
    out = run_child(cli_command(argv[0], *argv[1:], f"--workdir={workdir}"), devices=1)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, (argv, out.stderr[-1500:])
    assert len(lines) <= 2 and expected in lines[-1], (argv, out.stderr)
    assert "Traceback" not in out.stderr
    assert not workdir.exists(), argv


# ------------------------------------------------------------------ the docs
def test_the_docs_name_every_argument_and_task_as_the_configs_spell_them():
  """docs/benchmark-tasks.md lists every argument of the configs (cpu, max_steps, ...) and
  each config's tasks; every `configs/glue.py:X` a page or a config's docstring names
  starts with a task or an argument of that config (not squad.py:v1 for v1.1)."""
  from t5x_like.benchmarks.configs import ARGUMENTS
  with open(os.path.join(ROOT, "docs", "benchmark-tasks.md"), encoding="utf-8") as f:
    page = f.read()
  for name in ARGUMENTS:
    assert re.search(f"^\\| `{name}[`=]", page, re.M), name
  files = {"glue": "glue", "superglue": "super_glue", "squad": "squad"}
  for file, suite in files.items():
    row, = [line for line in page.splitlines() if line.startswith(f"| `configs/{file}.py:")]
    assert f"| {', '.join(SUITES[suite])} |" in row, row
  texts = [os.path.join(ROOT, p) for p in ("README.md", "configs/README.md")]
  texts += glob.glob(os.path.join(ROOT, "docs", "*.md"))
  texts += [os.path.join(ROOT, "configs", f"{file}.py") for file in files]
  texts.append(os.path.join(ROOT, "t5x_like", "benchmarks", "configs.py"))
  for path in texts:
    with open(path, encoding="utf-8") as f:
      for file, first in re.findall(r"configs/(glue|superglue|squad)\.py:([\w.]+)", f.read()):
        known = first in SUITES[files[file]] or first in ARGUMENTS or first.isupper()
        assert known or first == "colaa", (path, f"configs/{file}.py:{first}")  # an error's
