"""Two faults of the train / finetune commands, in real processes:

- a second trainer on a locked workdir is refused before jax is imported (the command
  takes the lock right after parsing its flags: workdir_lock.command_lock), not after
  its whole start-up;
- a second Ctrl-C while the stop's checkpoint is being saved ends the process at once
  with one line and exit 130, no traceback (preemption.exit_at_once_on_interrupt), and
  the rerun resumes from the last complete checkpoint.

The Ctrl-C lands deterministically through the test failpoints (t5x_like/failpoints.py):
sigint@6 is a Ctrl-C after step 6, slow_save@6 stalls the save it asks for.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from t5x_like.failpoints import FAILPOINT_ENV
from t5x_like.train.workdir_lock import LOCK_NAME, WorkdirLock

from helpers import ROOT, xla_flags

BERT = os.path.join(ROOT, "configs", "bert_cpu.py")
GPT = os.path.join(ROOT, "configs", "gpt_cpu.py")
FINETUNE = os.path.join(ROOT, "configs", "finetune_books.py")


def _env(**extra) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags(8))
  env.pop(FAILPOINT_ENV, None)
  env.update(extra)
  return env


# ------------------------------------------------------------------ a locked workdir
# Runs `t5x-like ARGV` in this fresh interpreter as the console command does, then says
# whether jax (or the trainer) was imported by the time it returned.
IN_PROCESS = r"""
import json, sys
from t5x_like import cli
code = cli.main(sys.argv[1:])
print(json.dumps({"code": code, "jax": "jax" in sys.modules,
                  "trainer": any(m in sys.modules for m in
                                 ("t5x_like.train.loop", "t5x_like.finetune.loop"))}))
"""


def test_second_trainer_is_refused_within_2_seconds_before_jax_is_imported(tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')  # the holder's
  command = [sys.executable, "-m", "t5x_like.cli", "train", f"--config={BERT}:smoke",
             f"--workdir={workdir}"]
  with WorkdirLock(workdir):  # the holder: this process
    started = time.monotonic()
    refused = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True,
                             timeout=120)
    seconds = time.monotonic() - started
    probe = subprocess.run([sys.executable, "-c", IN_PROCESS, *command[3:]], cwd=ROOT,
                           env=_env(), capture_output=True, text=True, timeout=120)
    assert sorted(os.listdir(workdir)) == sorted([LOCK_NAME, "metrics.jsonl"])  # kept
  assert refused.returncode == 2, refused.stderr[-3000:]
  lines = [line for line in refused.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr
  assert lines[0].startswith(f"t5x-like train: workdir {workdir} is in use by another"
                             f" trainer: process {os.getpid()} on host"
                             f" {socket.gethostname()}"), lines[0]
  assert seconds < 2.0, f"refused after {seconds:.1f} s"
  outcome = json.loads(probe.stdout.splitlines()[-1])
  assert outcome == {"code": 2, "jax": False, "trainer": False}, (outcome, probe.stderr)
  assert "in use by another trainer" in probe.stderr
  assert sorted(os.listdir(workdir)) == ["metrics.jsonl"]  # the holder released


def test_second_finetune_is_refused_before_jax_is_imported(tmp_path):
  workdir = tmp_path / "ft"
  with WorkdirLock(workdir):
    result = subprocess.run(
        [sys.executable, "-c", IN_PROCESS, "finetune", f"--config={FINETUNE}:bert,smoke",
         f"--workdir={workdir}"], cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=120)
  outcome = json.loads(result.stdout.splitlines()[-1])
  assert outcome == {"code": 2, "jax": False, "trainer": False}, (outcome, result.stderr)
  assert f"process {os.getpid()} on host" in result.stderr
  assert not workdir.exists()  # the lock made it and took it away again


# ------------------------------------------------- a second Ctrl-C during the save
TRAIN_ARGS = ("--config.train.num_steps=12", "--config.train.log_every=1",
              "--config.train.checkpoint_every=4", "--config.train.eval_every=0",
              "--config.train.async_checkpoints=True")


def _train_command(workdir) -> list[str]:
  return [sys.executable, "-m", "t5x_like.cli", "train", f"--config={GPT}:smoke",
          f"--workdir={workdir}", *TRAIN_ARGS]


def _sealed(workdir) -> list[int]:
  """Checkpoint steps whose save finished (orbax's commit marker and our checksums)."""
  directory = os.path.join(workdir, "checkpoints")
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit() and all(
      os.path.exists(os.path.join(directory, d, f))
      for f in ("commit_success.txt", "checksums.process_0.json")))


@pytest.mark.long
def test_second_ctrl_c_during_the_save_exits_130_at_once_in_one_line(tmp_path):
  workdir = str(tmp_path / "run")
  stderr_path = tmp_path / "stderr.txt"
  with open(stderr_path, "w") as stderr:
    proc = subprocess.Popen(_train_command(workdir), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=stderr, text=True,
                            env=_env(**{FAILPOINT_ENV: "sigint@6,slow_save@6"}))
    out = []
    for line in proc.stdout:  # the first Ctrl-C (the failpoint) asks for a save of 6
      out.append(line)
      if "SIGINT: saving a checkpoint at step 6" in line:
        break
    else:
      proc.wait(timeout=60)
      raise AssertionError("".join(out) + stderr_path.read_text()[-3000:])
    time.sleep(0.5)  # the save is under way (stalled for 600 s)
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out.append(proc.stdout.read())
    proc.wait(timeout=60)
    seconds = time.monotonic() - started
  err = stderr_path.read_text()
  assert proc.returncode == 130, (proc.returncode, err[-3000:])
  assert seconds < 10, f"exited {seconds:.1f} s after the second Ctrl-C"
  assert "Traceback" not in err and "cannot schedule" not in err, err[-3000:]
  last = [line for line in err.splitlines() if line.strip()][-1]
  assert last == ("t5x-like train: interrupted; stopped without saving (a rerun resumes"
                  " from the last complete checkpoint)"), err[-3000:]
  assert err.count("t5x-like train: interrupted") == 1
  assert "stopped by SIGINT" not in "".join(out)  # it did not claim a saved checkpoint
  assert _sealed(workdir) == [4]  # step 6's save was abandoned, 4 is whole
  assert not os.path.exists(os.path.join(workdir, LOCK_NAME))  # released on the way out

  rerun = subprocess.run(_train_command(workdir), cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=600)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert "resumed from step 4" in rerun.stdout, rerun.stdout[-3000:]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    steps = [json.loads(line)["step"] for line in f if line.strip()]
  assert steps == list(range(1, 13))  # steps 5 and 6 redone, each row once
  assert _sealed(workdir)[-1] == 12
