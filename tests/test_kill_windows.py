"""Kills at every point around a step that both evaluates and checkpoints, then resumes:
every eval row of an uninterrupted run is there, and metrics.jsonl never holds two rows
for one step (the rows a TensorBoard or pandas reader sees, not only read_jsonl's merge).

The kill is a SIGKILL from inside the process at a named point of the step runner
(T5X_LIKE_FAILPOINT, train/runner.py), so every window is hit on every run.
"""

import json
import os
import subprocess
import sys

import pytest

from t5x_like.train.runner import FAILPOINT_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ("--config.train.num_steps=12", "--config.train.log_every=1",
        "--config.train.checkpoint_every=4", "--config.train.eval_every=8",
        "--config.train.async_checkpoints=False")


def _train(workdir, failpoint=None):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  env.pop(FAILPOINT_ENV, None)
  if failpoint:
    env[FAILPOINT_ENV] = failpoint
  return subprocess.run([sys.executable, "-m", "t5x_like.cli", "train",
                         f"--config={ROOT}/configs/gpt_cpu.py:smoke", f"--workdir={workdir}",
                         *ARGS], env=env, capture_output=True, text=True, timeout=600)


def _raw_rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("whole") / "run")
  assert _train(workdir).returncode == 0
  return _raw_rows(workdir)


@pytest.mark.parametrize("kills", [
    ["before_row@8"], ["after_row@8"], ["after_save@8"],  # the eval + checkpoint step
    ["after_row@4", "after_row@8"], ["before_row@2", "after_save@4", "after_row@12"],
    ["after_save@12"],  # the end: the rerun finds the run finished
])
def test_kills_around_eval_and_checkpoint_lose_no_row_and_write_none_twice(kills, whole,
                                                                           tmp_path):
  workdir = str(tmp_path / "run")
  for kill in kills:
    result = _train(workdir, kill)
    assert result.returncode == -9, (kill, result.returncode, result.stderr[-2000:])
    steps = [r["step"] for r in _raw_rows(workdir)]
    assert len(steps) == len(set(steps)), (kill, steps)
  result = _train(workdir)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "final eval: eval_" in result.stdout, result.stdout
  rows = _raw_rows(workdir)
  steps = [r["step"] for r in rows]
  assert len(steps) == len(set(steps)), steps
  assert [sorted(r) for r in rows] == [sorted(r) for r in whole]  # every row, every key
  timing = ("step_seconds", "tokens_per_second", "tflops_per_second_per_device", "mfu")
  strip = lambda r: {k: v for k, v in r.items() if k not in timing}
  assert [strip(r) for r in rows] == [strip(r) for r in whole]  # float32: exact resume
