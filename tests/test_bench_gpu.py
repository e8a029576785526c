"""`t5x-like bench gpu` (speed/gpu_suite.py, gpu_steps.py, gpu_report.py).

The default tier drives the suite with a fake step runner (no process starts): the order,
the budget, timeouts, the peer's fallback, the files under OUT and the checks' verdicts.
The slow tier runs the real rehearsal through launch/gpu_bench.sh on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from t5x_like.speed import gpu_report, gpu_steps, gpu_suite
from t5x_like.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "configs")


def _model_json(losses, tokens=1000.0):
  return {"train": {"tokens_per_second": tokens, "mfu": 0.3, "step_seconds_median": 0.1,
                    "compile_seconds": 5.0, "losses": losses,
                    "roofline": {"seconds": 0.05, "mfu_ceiling": 0.6},
                    "measured_over_bound": 2.0},
          "attention_kernels": {"encoder/attention": {"kernel": "explicit"}},
          "profile": {"devices": 1, "steps": 3, "source": "x", "classified_by": "names",
                      "step_ms": 10.0, "wall_step_ms": 11.0,
                      "rows": [{"category": "matmuls", "ms_per_step": 6.0, "percent": 60.0,
                                "kernels_per_step": 3},
                               {"category": "loss and logits", "ms_per_step": 4.0,
                                "percent": 40.0, "kernels_per_step": 1}]},
          "environment": {"jax": "0.10.2", "jaxlib": "0.10.2", "backend": "gpu",
                          "device_kind": "NVIDIA H200", "device_count": 1,
                          "xla_flags": "", "python": "3.12", "torch": "2.11"}}


PEER_JSON = {"ours": {"tokens_per_second": 900.0, "mfu": 0.2},
             "torch_compiled": {"tokens_per_second": 1000.0, "mfu": 0.25},
             "ratios": {"ours_over_torch_compiled": 0.9}}


class FakeRun:
  """Stands in for gpu_suite.StepRun: answers each command from a table and advances a
  fake clock by the seconds each one takes."""

  def __init__(self, clock, answers):
    self.clock, self.answers, self.calls = clock, answers, []

  def __call__(self, args, env, timeout, label):
    self.calls.append((label, list(args), dict(env), timeout))
    status, out, err, seconds = self.answers(label, list(args), env)
    if seconds > timeout:
      self.clock.now += timeout
      return None, "", err, timeout
    self.clock.now += seconds
    return status, out, err, seconds


class Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def _answers(label, args, env):
  """Every bench step ok (a peer's first try out of memory), the resume check's runs
  as a real run would end."""
  name = label.split()[0]
  if name == "peer_bert" and "(fallback)" not in label:
    return 1, "", "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory", 30
  if args[:2] == ["bench", "peer"]:
    return 0, json.dumps(PEER_JSON), "", 40
  if args[:2] == ["bench", "model"]:
    return 0, json.dumps(_model_json([10.0, 9.0, 8.0])), "", 30
  if args[:2] == ["bench", "attention"]:
    return 0, json.dumps({"kernels": {"explicit": {"padding": {"out": 0.004,
                                                               "fwd_bwd_ms": 0.5}}}}), "", 20
  if args[0] == "train":  # the resume check: the killed run dies by SIGKILL
    workdir = args[args.index("--workdir") + 1]
    killed = "T5X_LIKE_FAILPOINT" in env
    os.makedirs(workdir, exist_ok=True)
    steps = range(1, 5 if killed else 13)
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
      for s in steps:
        f.write(json.dumps({"step": s, "loss": 10.0 / s}) + "\n")
    return (-9 if killed else 0), "", "", 10
  raise AssertionError(args)


def _run(tmp_path, monkeypatch, answers=_answers, **kw):
  clock = Clock()
  fakes = []

  def make(python, log, env=None):
    fakes.append(FakeRun(clock, answers))
    return fakes[-1]
  monkeypatch.setattr(gpu_suite, "StepRun", make)
  kw.setdefault("jobs", 1)  # one at a time: the fake clock is then exact
  results = gpu_suite.run_suite(str(tmp_path / "out"), rehearse=True, configs=CONFIGS,
                                clock=clock, commit="abc1234", **kw)
  return results, fakes[0]


def test_the_steps_run_most_important_first_and_each_flag_is_a_real_key():
  for rehearse in (False, True):
    steps = gpu_steps.suite_steps(rehearse=rehearse, configs="configs")
    names = [s.name for s in steps]
    assert names[:5] == ["peer_gpt2", "peer_bert", "bert", "gpt2", "t5"]
    assert names.index("compare") > names.index("bert_explicit")
    assert names.index("resume") < names.index("gpt2_full_logits")
    assert len(set(names)) == len(names)
  gpu = {s.name: s for s in gpu_steps.suite_steps(rehearse=False)}
  assert "--compile" in gpu["peer_gpt2"].args and "compiled" in gpu["peer_gpt2"].args
  assert gpu["peer_bert"].fallback == ("--config.train.batch_size=16",)
  assert ("XLA_PYTHON_CLIENT_MEM_FRACTION", gpu_steps.PEER_MEMORY_FRACTION) in gpu["peer_bert"].env
  assert ("XLA_FLAGS", gpu_steps.DETERMINISTIC_FLAG) in gpu["resume"].env
  assert "--config.model.overrides.loss_chunk_rows=0" in gpu["gpt2_full_logits"].args
  # On the GPU the recipes run as written (no smoke flags, `auto` attention).
  assert not any("local" in a or "pallas_gpu" in a for a in gpu["bert"].args)
  assert "--config.train.batch_size=32" in gpu["bert"].args


def test_a_suite_writes_four_files_at_most_with_every_figure(tmp_path, monkeypatch):
  results, run = _run(tmp_path, monkeypatch)
  out = tmp_path / "out"
  assert sorted(os.listdir(out)) == ["log.txt", "results.json", "summary.md"]  # no traces
  on_disk = json.loads((out / "results.json").read_text())
  assert on_disk["steps"] == json.loads(json.dumps(results["steps"]))
  steps = {s["name"]: s for s in on_disk["steps"]}
  assert [s["status"] for s in on_disk["steps"]] == ["ok"] * len(steps)
  assert on_disk["commit"] == "abc1234" and on_disk["mode"] == "rehearsal"
  env = on_disk["environment"]
  assert env["device_kind"] == "NVIDIA H200" and env["jax"] == "0.10.2"
  assert {"xla_flags", "python", "backend", "jaxlib", "torch"} <= set(env)
  bert = steps["bert"]["figures"]
  assert bert["mfu"] == 0.3 and bert["measured_over_bound"] == 2.0
  assert bert["costliest"] == {"category": "matmuls", "percent": 60.0}
  assert steps["peer_gpt2"]["figures"]["ratio"] == 0.9
  assert steps["compare"]["figures"]["passed"]
  assert steps["resume"]["figures"]["passed"]
  assert steps["resume"]["figures"]["exits"] == {"whole": 0, "killed": -9, "resumed": 0}
  # The peer ran out of memory and was run again at the smaller batch, recorded.
  fallback = steps["peer_bert"]["fallback"]
  assert fallback["ran"] and "RESOURCE_EXHAUSTED" in fallback["because"]
  assert steps["peer_bert"]["command"][-1] == fallback["flags"][0]
  summary = (out / "summary.md").read_text()
  assert "| peer_gpt2 |" in summary and "ours / torch compiled 0.900" in summary
  assert "Profile of `bert`" in summary and "fallback --config.train.batch_size=2" in summary
  assert "commit abc1234" in summary


def test_the_budget_skips_what_is_left_and_still_writes_results(tmp_path, monkeypatch):
  results, run = _run(tmp_path, monkeypatch, budget=120)
  status = {s["name"]: s["status"] for s in results["steps"]}
  # 10 s kept back: peer_gpt2 takes 40 s, peer_bert's two tries 30 + 40; nothing is
  # left for bert.
  assert [status[n] for n in ("peer_gpt2", "peer_bert")] == ["ok"] * 2
  assert status["bert"] == "skipped" and status["bert_unrolled"] == "skipped"
  assert status["compare"] == "skipped"  # bert_explicit did not run
  assert all(timeout <= 120 for _, _, _, timeout in run.calls)
  assert "budget" in next(s for s in results["steps"] if s["name"] == "bert")["reason"]
  assert json.loads((tmp_path / "out" / "results.json").read_text())["elapsed_seconds"] <= 120


def test_a_step_past_its_timeout_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
  def slow_gpt2(label, args, env):
    if label == "gpt2":
      return 0, "", "", 10_000
    return _answers(label, args, env)
  results, _ = _run(tmp_path, monkeypatch, slow_gpt2, only=["gpt2", "t5"])
  assert [(s["name"], s["status"]) for s in results["steps"]] == [("gpt2", "timeout"),
                                                                   ("t5", "ok")]


def test_two_jobs_run_side_by_side_and_the_results_keep_the_suite_order(tmp_path,
                                                                      monkeypatch):
  import threading
  import time
  running, most = set(), [0]
  lock = threading.Lock()

  def answers(label, args, env):
    with lock:
      running.add(label)
      most[0] = max(most[0], len(running))
    time.sleep(0.3 if label.startswith("bert") else 0.05)
    with lock:
      running.discard(label)
    return _answers(label, args, env)
  only = ["peer_gpt2", "bert", "gpt2", "bert_explicit", "compare", "attention"]
  results, _ = _run(tmp_path, monkeypatch, answers, only=only, jobs=2)
  assert most[0] == 2
  assert [s["name"] for s in results["steps"]] == only
  assert all(s["status"] == "ok" for s in results["steps"])  # compare waited for both


def test_the_fused_kernels_losses_are_held_to_the_explicit_ones():
  same = gpu_report.compare_losses(_model_json([10.0, 9.0]), _model_json([10.0004, 9.05]))
  assert same["passed"]
  other_mask = gpu_report.compare_losses(_model_json([10.0, 9.0]), _model_json([10.01, 9.0]))
  assert not other_mask["passed"] and "difference 1.00e-02" in other_mask["verdict"]
  drift = gpu_report.compare_losses(_model_json([10.0, 9.0]), _model_json([10.0, 9.2]))
  assert not drift["passed"]


def test_a_resume_passes_only_with_every_loss_equal_bit_for_bit():
  whole = {s: 1.0 / s for s in range(1, 13)}
  assert gpu_report.resume_figures(whole, dict(whole), kill_at=4)["passed"]
  off = dict(whole)
  off[7] += 1e-7
  verdict = gpu_report.resume_figures(whole, off, kill_at=4)
  assert not verdict["passed"] and verdict["differing_steps"] == [7]
  assert not gpu_report.resume_figures(whole, {s: whole[s] for s in range(1, 5)},
                                       kill_at=4)["passed"]


def test_traces_over_the_limit_are_left_out(tmp_path):
  scratch, out = tmp_path / "s", tmp_path / "o"
  (scratch / "bert.prof" / "plugins").mkdir(parents=True)
  out.mkdir()
  (scratch / "bert.prof" / "plugins" / "h.xplane.pb").write_bytes(os.urandom(4096))
  (scratch / "bert.prof" / "train_step.hlo.txt").write_text("HloModule m\n" * 1000)
  packed = gpu_suite.pack_traces(str(scratch), str(out), limit=1 << 20)
  assert sorted(packed["members"]) == ["bert/h.xplane.pb", "bert/train_step.hlo.txt"]
  # Too big with the HLO: the xplane alone; too big even so: left out, and said.
  os.remove(out / "traces.tar.gz")
  packed = gpu_suite.pack_traces(str(scratch), str(out), limit=4500)
  assert packed["members"] == ["bert/h.xplane.pb"]
  os.remove(out / "traces.tar.gz")
  packed = gpu_suite.pack_traces(str(scratch), str(out), limit=100)
  assert packed["file"] is None and "over the" in packed["note"]
  assert os.listdir(out) == []


def test_a_full_out_folder_or_an_unknown_step_is_refused_before_anything_runs(tmp_path,
                                                                            capsys):
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "x").write_text("")
  with pytest.raises(UserError, match="not empty"):
    gpu_suite.run_suite(str(tmp_path / "full"), rehearse=True, configs=CONFIGS)
  with pytest.raises(UserError, match="unknown step 'nope'"):
    gpu_suite.run_suite(str(tmp_path / "new"), rehearse=True, configs=CONFIGS, only=["nope"])
  assert not (tmp_path / "new").exists()
  from t5x_like import cli
  code = cli.main(["bench", "gpu", "--out", str(tmp_path / "full"), "--rehearse",
                   "--configs", CONFIGS])
  err = capsys.readouterr().err
  assert code == 2 and len(err.strip().splitlines()) == 1
  assert "--out=" in err and "not empty" in err


def _files_under(root):
  return [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs]


@pytest.mark.slow
def test_the_rehearsal_runs_every_step_on_the_cpu_within_the_file_limits(tmp_path):
  """launch/gpu_bench.sh --rehearse: every step runs for real at smoke shapes (each
  flag parsed by the command), leaving at most 8 files at most two folders deep, with
  every figure the GPU call fills. (4:14 on 2 quiet cores of an AMD EPYC; in the slow
  tier another test file runs beside it, so the budget leaves room: a step it skips
  fails the test.)"""
  out = tmp_path / "rehearsal"
  env = dict(os.environ, OUT=str(out), COMMIT="test", PYTHON=sys.executable)
  env.pop("XLA_FLAGS", None)  # one CPU device, as a user's machine has
  run = subprocess.run(["bash", os.path.join(REPO, "launch", "gpu_bench.sh"), "--rehearse",
                        "--budget", "900"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=1000)
  results = json.loads((out / "results.json").read_text())
  bad = [(s["name"], s["status"], s.get("reason")) for s in results["steps"]
         if s["status"] != "ok"]
  assert not bad, bad
  assert run.returncode == 0, run.stderr[-2000:]
  files = _files_under(out)
  assert len(files) <= 8 and all(f.count(os.sep) <= 1 for f in files), files
  assert set(files) == {"results.json", "summary.md", "log.txt", "traces.tar.gz"}
  assert run.stdout.startswith("### `t5x-like bench gpu` --rehearse")
  env = results["environment"]
  assert env["backend"] == "cpu" and env["jax"] and env["jaxlib"] and env["torch"]
  steps = {s["name"]: s for s in results["steps"]}
  for name, step in steps.items():
    f = step["figures"]
    if step["kind"] == "bench" and step["command"][1] == "model":
      assert f["tokens_per_second"] > 0 and 0 < f["mfu"] < 1, name
      assert f["measured_over_bound"] > 0 and f["mfu_ceiling"] > 0, name
      if step["result"].get("profile"):
        assert f["costliest"]["category"], name
  assert steps["peer_gpt2"]["figures"]["ratio"] > 0
  assert steps["peer_bert"]["figures"]["ratio"] > 0
  assert steps["bert"]["figures"]["kernels"] == ["pallas_gpu"]
  assert steps["bert_explicit"]["figures"]["kernels"] == ["explicit"]
  assert steps["compare"]["figures"]["passed"], steps["compare"]["figures"]["verdict"]
  assert steps["resume"]["figures"]["passed"], steps["resume"]["figures"]["verdict"]
  # The full-logits override reaches the model, and the loss is the chunked loss's.
  assert steps["gpt2_full_logits"]["result"]["loss_chunk_rows"] == 0
  assert steps["gpt2"]["result"]["loss_chunk_rows"] > 0
  assert steps["gpt2_full_logits"]["result"]["train"]["losses"][0] == pytest.approx(
      steps["gpt2"]["result"]["train"]["losses"][0], rel=1e-4)
  assert results["traces"]["file"] == "traces.tar.gz"
