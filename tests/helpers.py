"""What the tests share: the repository's paths, config loading, and the `t5x-like`
command run in-process or in a child process (with its own 8 fake CPU devices)."""

import importlib.util
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")


def config_path(name: str) -> str:
  """configs/<name>.py ('bert_cpu' or 'bert_cpu.py')."""
  return os.path.join(CONFIGS, name if name.endswith(".py") else f"{name}.py")


def load_config(name: str, arg: str = ""):
  """get_config(arg) of configs/<name>.py (`--config=configs/<name>.py:<arg>`)."""
  spec = importlib.util.spec_from_file_location(f"config_{name}", config_path(name))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def xla_flags(devices: int = 8) -> str:
  """XLA_FLAGS for a child process: `devices` fake CPU devices, compiled as the tests'
  own process compiles (tests/conftest.py), so a child's numbers equal the parent's."""
  return (os.environ.get("T5X_LIKE_TEST_XLA_FLAGS", "")
          + f" --xla_force_host_platform_device_count={devices}").strip()


def child_env(devices: int = 8, **extra: str) -> dict:
  """The environment of a child `t5x-like`: CPU only, `devices` fake devices."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices))
  env.update(extra)
  return env


def cli_command(command: str, *args: str) -> list[str]:
  """argv of `t5x-like COMMAND ARGS...` through this interpreter."""
  return [sys.executable, "-m", "t5x_like.cli", *command.split(), *args]


def train_command(config: str, workdir: str, *extra: str) -> list[str]:
  """`t5x-like train --config=configs/CONFIG --workdir=WORKDIR EXTRA...`."""
  return cli_command("train", f"--config={CONFIGS}/{config}", f"--workdir={workdir}", *extra)


def run_child(cmd: list[str], timeout: float = 600, devices: int = 8, env=None,
              **kw) -> subprocess.CompletedProcess:
  """Runs cmd to its end from the repository root; stdout and stderr captured as text."""
  return subprocess.run(cmd, env=env or child_env(devices), capture_output=True, text=True,
                        timeout=timeout, cwd=kw.pop("cwd", ROOT), **kw)


def jsonl_rows(workdir: str) -> list[dict]:
  """Every row of workdir/metrics.jsonl as written (no merging of rewritten steps)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def eval_rows(workdir: str) -> dict[int, dict]:
  """{step: eval metrics} of metrics.jsonl (the last row written for each step)."""
  rows = {}
  for row in jsonl_rows(workdir):
    evals = {k: v for k, v in row.items() if k.startswith("eval")}
    if evals:
      rows[row["step"]] = evals
  return rows


def losses(workdir: str) -> dict[int, float]:
  """{step: loss} of workdir/metrics.jsonl."""
  from t5x_like.train.metrics import read_jsonl
  rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def committed_checkpoints(workdir: str) -> list[int]:
  """Steps of workdir's finished saves: orbax's commit marker, then our checksums
  (written last; a step killed between the two is unfinished and set aside at resume)."""
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return []
  return sorted(int(d) for d in os.listdir(directory)
                if d.isdigit() and all(os.path.exists(os.path.join(directory, d, name))
                                       for name in ("commit_success.txt",
                                                    "checksums.process_0.json")))


def wait_for_step(workdir: str, proc: subprocess.Popen, step: int, timeout: float = 300,
                  checkpoint: bool = False) -> None:
  """Until workdir's metrics.jsonl has `step` (and, with checkpoint, a committed
  checkpoint); fails if proc ends first."""
  deadline = time.time() + timeout
  path = os.path.join(workdir, "metrics.jsonl")
  while time.time() < deadline:
    if proc.poll() is not None:
      err = proc.stderr.read()[-3000:] if proc.stderr else ""
      raise AssertionError(f"run ended before step {step}: {err}")
    if (os.path.exists(path) and max(losses(workdir), default=0) >= step
        and (not checkpoint or committed_checkpoints(workdir))):
      return
    time.sleep(0.05)
  raise AssertionError(f"step {step} not reached in {timeout}s")


def killed_and_resumed(config: str, workdir: str, *flags: str,
                       step: int = 8) -> subprocess.CompletedProcess:
  """`t5x-like train` of config in workdir, SIGKILLed once it has passed `step` with a
  committed checkpoint, then run again to its end (the rerun's CompletedProcess)."""
  import signal
  proc = subprocess.Popen(train_command(config, workdir, *flags), env=child_env(), cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  wait_for_step(workdir, proc, step, checkpoint=True)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  return run_child(train_command(config, workdir, *flags))


def free_port() -> int:
  """A free local TCP port (for a jax.distributed coordinator)."""
  import socket
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def train_two_processes(config: str, workdir: str, *extra: str) -> list[tuple[int, str]]:
  """`t5x-like train` as 2 processes of 4 fake devices each (one coordinator on a free
  port), run to their end: [(exit status, stdout + stderr)] of each."""
  port = free_port()
  procs = [subprocess.Popen(
      train_command(config, workdir, *extra, f"--coordinator_address=localhost:{port}",
                    "--num_processes=2", f"--process_id={i}"),
      env=child_env(devices=4), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True) for i in range(2)]
  outputs = [p.communicate(timeout=600)[0] for p in procs]
  return [(p.returncode, out) for p, out in zip(procs, outputs)]


def random_token_store(num_docs: int, seed: int = 0, *, tokens: tuple[int, int],
                       sentence_lengths: tuple[int, int], sentences: tuple[int, int]):
  """A TokenStore of num_docs documents: each of rng.integers(*sentences) sentences, each
  of rng.integers(*sentence_lengths) token ids drawn from rng.integers(*tokens)."""
  import numpy as np
  from t5x_like.data.store import TokenStore
  rng = np.random.default_rng(seed)
  return TokenStore.from_documents(
      [[rng.integers(*tokens, rng.integers(*sentence_lengths))
        for _ in range(rng.integers(*sentences))] for _ in range(num_docs)])
