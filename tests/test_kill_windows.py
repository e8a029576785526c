"""Kills at every point around the steps that evaluate and checkpoint, one after another
in one chain of reruns: every eval row of an uninterrupted run is there at the end, the
losses are the uninterrupted run's bit for bit, and metrics.jsonl never holds two rows
for one step (the rows a TensorBoard or pandas reader sees, not only read_jsonl's
merge), after each kill as at the end.

The kill is a SIGKILL from inside the process at a named point of the step runner
(T5X_LIKE_FAILPOINT, t5x_like/failpoints.py), so every window is hit on every run. The
chain is the trainer's one kill/resume test (the fine-tuning runner has its own in
tests/test_finetune_cli.py; the Pallas kernel's dropout in tests/test_train.py).
"""

import pytest

from helpers import child_env, jsonl_rows, run_child, train_command
from t5x_like.failpoints import FAILPOINT_ENV

ARGS = ("--config.train.num_steps=12", "--config.train.log_every=1",
        "--config.train.checkpoint_every=4", "--config.train.eval_every=8",
        "--config.train.async_checkpoints=False")
# Before a row, after it (not yet saved), after the save; at a step that checkpoints
# only (4), one that also evaluates (8), and the last (12: the rerun finds it finished).
CHAIN = ("before_row@2", "after_row@4", "after_save@4", "before_row@8", "after_row@8",
         "after_save@8", "after_row@12", "after_save@12")


def _train(workdir, failpoint=None):
  env = child_env()
  env.pop(FAILPOINT_ENV, None)
  if failpoint:
    env[FAILPOINT_ENV] = failpoint
  return run_child(train_command("gpt_cpu.py:smoke", workdir, *ARGS), env=env)


@pytest.mark.long
def test_a_chain_of_kills_around_eval_and_checkpoint_loses_no_row_and_writes_none_twice(
    tmp_path):
  whole_dir = str(tmp_path / "whole")
  assert _train(whole_dir).returncode == 0
  whole = jsonl_rows(whole_dir)
  workdir = str(tmp_path / "run")
  for kill in CHAIN:
    result = _train(workdir, kill)
    assert result.returncode == -9, (kill, result.returncode, result.stderr[-2000:])
    steps = [r["step"] for r in jsonl_rows(workdir)]
    assert len(steps) == len(set(steps)), (kill, steps)
  result = _train(workdir)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "final eval: eval_" in result.stdout, result.stdout
  rows = jsonl_rows(workdir)
  steps = [r["step"] for r in rows]
  assert len(steps) == len(set(steps)), steps
  assert [sorted(r) for r in rows] == [sorted(r) for r in whole]  # every row, every key
  timing = ("step_seconds", "tokens_per_second", "tflops_per_second_per_device", "mfu")
  strip = lambda r: {k: v for k, v in r.items() if k not in timing}
  assert [strip(r) for r in rows] == [strip(r) for r in whole]  # float32: exact resume
