"""The trainer end to end: exact resume after SIGKILL, SIGTERM, corrupt checkpoints,
multi-host on CPU, learning, and a non-finite loss."""

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from t5x_like.errors import NonFiniteLossError
from t5x_like.models.attention_kernels import PALLAS_INTERPRET_ENV
from t5x_like.train import loop
from t5x_like.train.metrics import read_jsonl
from helpers import ROOT, load_config, train_two_processes, xla_flags

CONFIGS = os.path.join(ROOT, "configs")


_load_config = load_config


def _train_command(config: str, workdir: str, *extra: str) -> list[str]:
  return [sys.executable, "-m", "t5x_like.cli", "train", f"--config={CONFIGS}/{config}",
          f"--workdir={workdir}", *extra]


def _env(devices: int = 8) -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = xla_flags(devices)
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _losses(workdir: str) -> dict[int, float]:
  rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _run(cmd, timeout=600, **kw) -> subprocess.CompletedProcess:
  return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout,
                        cwd=ROOT, **kw)


def _committed_checkpoints(workdir: str) -> list[int]:
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return []
  # Finished saves: orbax's commit marker, then our checksums (written last; a step
  # killed between the two is unfinished and set aside at resume).
  return [int(d) for d in os.listdir(directory)
          if d.isdigit() and all(os.path.exists(os.path.join(directory, d, name)) for name in
                                 ("commit_success.txt", "checksums.process_0.json"))]


def _wait_for_step(workdir: str, proc: subprocess.Popen, step: int, timeout=300,
                   checkpoint: bool = False) -> None:
  """Until metrics.jsonl has `step` (and, with checkpoint, a committed checkpoint)."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    if proc.poll() is not None:
      raise AssertionError(f"run ended before step {step}: {proc.stderr.read()[-3000:]}")
    path = os.path.join(workdir, "metrics.jsonl")
    if (os.path.exists(path) and max(_losses(workdir), default=0) >= step
        and (not checkpoint or _committed_checkpoints(workdir))):
      return
    time.sleep(0.05)
  raise AssertionError(f"step {step} not reached in {timeout}s")


# ---------------------------------------------------------------- exact resume
# BERT through the Pallas kernel (Pallas interpret mode on CPU) with attention dropout
# 0.1 drawn inside the kernel: a resumed run redraws the same masks.
PALLAS_DROPOUT = ("--config.model.attention_impl=pallas", "--config.data.length=128",
                  "--config.model.overrides.max_position_embeddings=128",
                  "--config.model.overrides.attention_dropout_rate=0.1")
# The same through the Pallas GPU (Triton) kernel, also in interpret mode here.
PALLAS_GPU_DROPOUT = ("--config.model.attention_impl=pallas_gpu",
                      "--config.model.overrides.attention_dropout_rate=0.1")


@pytest.mark.parametrize("config, extra", [
    pytest.param("bert_cpu.py:smoke", PALLAS_DROPOUT, marks=pytest.mark.long),
    pytest.param("bert_cpu.py:smoke", PALLAS_GPU_DROPOUT, marks=pytest.mark.long)],
                         ids=["bert-pallas-dropout", "bert-pallas-gpu-dropout"])
def test_sigkill_and_resume_reproduce_every_loss_bit_for_bit(config, extra, tmp_path,
                                                             monkeypatch):
  if extra:
    monkeypatch.setenv(PALLAS_INTERPRET_ENV, "1")
  full = str(tmp_path / "full")
  done = _run(_train_command(config, full, *extra))
  assert done.returncode == 0, done.stderr[-3000:]
  expected = _losses(full)
  assert sorted(expected) == list(range(1, 21))

  killed = str(tmp_path / "killed")
  kill_at = int(np.random.default_rng(abs(hash(config)) % 2**32).integers(7, 15))
  proc = subprocess.Popen(_train_command(config, killed, *extra), env=_env(), cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  _wait_for_step(killed, proc, kill_at, checkpoint=True)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  resumed = _run(_train_command(config, killed, *extra))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from step" in resumed.stdout + resumed.stderr
  got = _losses(killed)
  assert sorted(got) == sorted(expected)
  assert got == expected  # float32 on CPU: identical, not merely close


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_save_a_checkpoint_and_exit_128_plus_signal(signum, tmp_path):
  """SIGINT (Ctrl-C) saves like SIGTERM: no KeyboardInterrupt traceback, no lost steps;
  exit 143 / 130, the status a launcher reads as "stopped, rerun me"."""
  workdir = str(tmp_path / "run")
  proc = subprocess.Popen(_train_command("gpt_cpu.py:smoke", workdir,
                                         "--config.train.num_steps=100000",
                                         "--config.train.checkpoint_every=0"),
                          env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  _wait_for_step(workdir, proc, 3)
  proc.send_signal(signum)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signum, out[-3000:]
  name = signal.Signals(signum).name
  match = [line for line in out.splitlines() if f"{name}: saving a checkpoint at step" in line]
  assert match, out[-3000:]
  assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
  step = int(match[0].split("at step ")[1].split()[0])
  assert os.path.isdir(os.path.join(workdir, "checkpoints", str(step)))
  assert f"stopped by {name} at step {step}: checkpoint saved; exit {128 + signum}" in out
  assert max(_losses(workdir)) == step  # every trained step is in the checkpoint


# ------------------------------------------------------------------------ phases
@pytest.mark.long
def test_two_phase_run_changes_length_and_resumes_from_the_phase_one_checkpoint(tmp_path,
                                                                                  capsys):
  """BERT's recipe in small: phase 1 at length 64, phase 2 at 128 with more predictions.

  Phase 2 run on its own from the phase-1 checkpoint gives the same losses as the
  uninterrupted two-phase run.
  """
  config = _load_config("bert_pretrain", "base,local")
  config.optimizer.decay_steps = 20  # the schedule must not change with num_steps below
  config.train.checkpoint_every = 0
  full = str(tmp_path / "full")
  loop.train(config, full)
  out = capsys.readouterr().out
  assert "phase 1: steps 16..20, length 128, {'max_predictions_per_seq': 20" in out, out
  assert sorted(_committed_checkpoints(full)) == [16, 20]

  split = str(tmp_path / "split")
  first = _load_config("bert_pretrain", "base,local")
  first.optimizer.decay_steps = 20
  first.train.checkpoint_every = 0
  first.train.num_steps = 16
  first.train.phases = first.train.phases[:1]
  loop.train(first, split)
  assert sorted(_committed_checkpoints(split)) == [16]
  loop.train(config, split)  # resumes at 16, runs phase 2
  assert sorted(_committed_checkpoints(split)) == [16, 20]
  assert _losses(split) == _losses(full)


# ------------------------------------------------------------ paths
@pytest.mark.long
def test_relative_and_absolute_workdirs_are_one_run(tmp_path, monkeypatch, caplog):
  """A run started with a relative workdir, resumed through its absolute path, then rerun
  through the relative path once finished: one run, no checkpoint called corrupt."""
  monkeypatch.chdir(tmp_path)
  config = _load_config("gpt_cpu", "smoke")
  config.optimizer.decay_steps = 20  # the schedule must not change with num_steps below
  config.train.num_steps = 10
  first = loop.train(config, "workdir/gpt")
  assert (first.status, first.step) == ("finished", 10)
  assert sorted(_committed_checkpoints("workdir/gpt")) == [5, 10]
  config.train.num_steps = 20
  with caplog.at_level("WARNING"):
    second = loop.train(config, str(tmp_path / "workdir" / "gpt"))
    third = loop.train(config, "workdir/gpt")
  assert (second.status, second.step) == ("finished", 20)
  assert (third.status, third.step) == ("already_finished", 20)
  assert dict(third) == dict(second) and third  # the last eval, read back
  assert "corrupt" not in caplog.text.lower()
  assert sorted(_losses("workdir/gpt")) == list(range(1, 21))
  assert sorted(os.listdir(tmp_path)) == ["workdir"]


# ------------------------------------------------------------ corrupt checkpoint
def test_corrupt_latest_checkpoint_falls_back_to_the_previous(tmp_path, caplog):
  config = _load_config("gpt_cpu", "smoke")
  config.train.num_steps = 10
  config.optimizer.decay_steps = 20  # the schedule must not change with num_steps below
  workdir = str(tmp_path / "run")
  loop.train(config, workdir)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  assert sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())[-2:] == [5, 10]
  # Damage every data file of step 10 (a partial write / bit rot).
  for root, _, files in os.walk(os.path.join(ckpt_dir, "10")):
    for name in files:
      if not name.endswith((".json", "_METADATA", "commit_success.txt")):
        with open(os.path.join(root, name), "wb") as f:
          f.write(b"\0")
  expected = _losses(workdir)
  config.train.num_steps = 12
  with caplog.at_level("WARNING"):
    loop.train(config, workdir)
  assert "10" in caplog.text and "falling back" in caplog.text.lower()
  got = _losses(workdir)
  # Steps 6..10 were recomputed from checkpoint 5 and match the first run.
  for step in range(6, 11):
    assert got[step] == expected[step]
  assert max(got) == 12


# -------------------------------------------------------------------- non-finite
def test_non_finite_loss_stops_naming_the_step_and_keeps_good_checkpoints(tmp_path,
                                                                          monkeypatch):
  config = _load_config("gpt_cpu", "smoke")
  config.train.checkpoint_every = 2
  real_make = loop.make_train_step

  def poisoned_make(*args, **kwargs):
    step_fn = real_make(*args, **kwargs)

    def step(state, batch, rng):
      new_state, metrics = step_fn(state, batch, rng)
      if int(new_state.step) >= 7:  # from step 7 on, the loss is NaN
        metrics = dict(metrics, loss=metrics["loss"] * np.nan)
      return new_state, metrics

    return step

  monkeypatch.setattr(loop, "make_train_step", poisoned_make)
  workdir = str(tmp_path / "run")
  with pytest.raises(NonFiniteLossError, match="at step 7"):
    loop.train(config, workdir)
  steps = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
  assert steps and steps[-1] == 6  # no checkpoint written at or after the bad step


# ---------------------------------------------------------------------- learning
def _unigram_entropy(objective) -> float:
  counts = np.bincount(np.asarray(objective.store.tokens))
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


@pytest.mark.parametrize("name, variant, metric, steps, batch_size, lr, margin", [
    # Margins in nats below the unigram entropy (6.33; eval on held-out text, bf16), set
    # under what each reaches here in CI time (measured 2026-11-22, +-0.1 between runs:
    # BERT MLM 0.45 after 600 steps of 64 rows (0.12 after 300); GPT-2 L2 d128 with
    # dropout 0.30 after 250 of 16 (2026-11-25; 0.68 after 500); T5 1.24 after 150 of
    # 16). MLM learns slowest: a masked position holds nothing about its token, so
    # attention must first learn to read the neighbours;
    # GPT-2's tied output embedding learns slower than T5 v1.1's untied one.
    pytest.param("bert_cpu", "smoke", "mlm_loss", 600, 64, 3e-3, 0.3, marks=pytest.mark.long),
    pytest.param("gpt_cpu", "", "token_loss", 250, 16, 3e-3, 0.15, marks=pytest.mark.long),
    pytest.param("t5_cpu", "smoke", "token_loss", 150, 16, 0.02, 1.0, marks=pytest.mark.long)])
def test_tiny_configs_learn_below_the_unigram_baseline(name, variant, metric, steps,
                                                       batch_size, lr, margin, tmp_path):
  config = _load_config(name, variant)
  config.model.dtype = "bfloat16"
  config.data.length = 64
  config.train.num_steps = steps
  config.train.eval_every = steps
  config.train.eval_batches = 4
  config.train.checkpoint_every = 0
  config.train.log_every = 50
  config.train.batch_size = batch_size
  config.optimizer.learning_rate = lr
  config.optimizer.warmup_steps = 20
  _, objective, _, _ = loop.build_data(config, str(tmp_path))
  baseline = _unigram_entropy(objective)
  result = loop.train(config, str(tmp_path))
  assert result[f"eval_{metric}"] < baseline - margin, (result, baseline)


# -------------------------------------------------------------------- multi-host
def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.long
def test_two_processes_of_four_devices_match_one_of_eight(tmp_path):
  single = str(tmp_path / "single")
  done = _run(_train_command("bert_cpu.py:smoke", single, "--config.train.num_steps=6"))
  assert done.returncode == 0, done.stderr[-3000:]

  multi = str(tmp_path / "multi")
  for code, out in train_two_processes("bert_cpu.py:smoke", multi, "--config.train.num_steps=6"):
    assert code == 0, out[-3000:]
  expected, got = _losses(single), _losses(multi)
  assert sorted(got) == sorted(expected) == list(range(1, 7))
  np.testing.assert_allclose([got[s] for s in range(1, 7)],
                             [expected[s] for s in range(1, 7)], rtol=1e-5)


@pytest.mark.parametrize("process_id", [0, 1])
def test_multi_host_run_started_on_only_some_workers_says_so(process_id, tmp_path):
  """Process 0 alone waits for the missing one; process 1 alone finds no coordinator.

  Either way the run exits with a message instead of hanging (or aborting in C++).
  """
  start = time.time()
  done = subprocess.run(
      _train_command("bert_cpu.py:smoke", str(tmp_path), "--num_processes=2",
                     f"--process_id={process_id}", f"--coordinator_address=localhost:"
                     f"{_free_port()}", "--init_timeout=5"),
      env=_env(devices=4), cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert done.returncode == 3, done.stderr[-3000:]
  assert "the 2 processes" in done.stderr and "did not all connect within 5 s" in done.stderr
  assert "started on every worker" in done.stderr
  assert time.time() - start < 60
  assert not os.path.exists(tmp_path / "checkpoints")
