"""Kill one process of a multi-process `t5x-like train` and time the survivors' stop.

  .venv/bin/python tests/peer_loss_runs.py --processes 2 --kills 5 [--victim random]

Each kill: N processes of 8/N fake CPU devices train configs/bert_cpu.py:smoke (200 steps, a
checkpoint every 10); once the checkpoint of step 10 is committed by every process, one
process (random, or --victim) is SIGKILLed and every survivor is timed from the kill to its
exit. Prints one row per survivor and the median and worst over all of them; --json FILE
writes the rows. tests/test_peer_loss.py's slow tests use `start_run` and `kill_and_time`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import ROOT, child_env, free_port, train_command  # noqa: E402

CONFIG = "bert_cpu.py:smoke"
# What a survivor's stderr must not show: jax's C++ abort, a Python traceback.
NOISE = ("Check failure", "client.h", "coordination_service", "Traceback")
STEPS_FLAGS = ("--config.train.num_steps=200", "--config.train.checkpoint_every=10")


def start_run(workdir: str, processes: int, *extra: str, env_per_process=None,
              steps_flags=STEPS_FLAGS) -> list[subprocess.Popen]:
  """`t5x-like train` as `processes` processes sharing 8 fake devices (4 each for 2, 2
  each for 4: the smoke config's batch of 8 over them); stderr piped."""
  port = free_port()
  procs = []
  for i in range(processes):
    env = child_env(devices=max(1, 8 // processes), **((env_per_process or {}).get(i, {})))
    procs.append(subprocess.Popen(
        train_command(CONFIG, workdir, *steps_flags, *extra,
                      f"--coordinator_address=localhost:{port}",
                      f"--num_processes={processes}", f"--process_id={i}"),
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
  return procs


def wait_for_commit(workdir: str, procs: list[subprocess.Popen], step: int,
                    timeout: float = 600) -> None:
  """Until the checkpoint of `step` is committed by every process; fails if one ends."""
  from t5x_like.host_loss.peer_loss import last_committed_step
  deadline = time.time() + timeout
  while time.time() < deadline:
    ended = [i for i, p in enumerate(procs) if p.poll() is not None]
    if ended:
      raise AssertionError(f"process {ended[0]} ended first: "
                           + procs[ended[0]].stderr.read().decode()[-3000:])
    if (last_committed_step(os.path.join(workdir, "checkpoints")) or 0) >= step:
      return
    time.sleep(0.1)
  raise AssertionError(f"no committed checkpoint of step {step} in {timeout}s")


def kill_and_time(procs: list[subprocess.Popen], victim: int,
                  timeout: float = 300) -> list[dict]:
  """SIGKILLs procs[victim]; [{process, seconds, status, last_line, stderr, clean}] of
  each survivor: seconds from the kill to its exit (None if it outlived `timeout`), clean:
  no NOISE on its stderr."""
  import threading
  outputs = {}

  def drain(i, p):  # stderr must be read while waiting (a full pipe blocks the child)
    outputs[i] = p.stderr.read().decode(errors="replace")

  readers = [threading.Thread(target=drain, args=(i, p)) for i, p in enumerate(procs)
             if i != victim]
  for r in readers:
    r.start()
  killed_at = time.monotonic()
  procs[victim].send_signal(signal.SIGKILL)
  rows = []
  for i, p in enumerate(procs):
    if i == victim:
      p.wait()
      continue
    try:
      p.wait(timeout=max(0.0, timeout - (time.monotonic() - killed_at)))
      seconds = time.monotonic() - killed_at
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()
      seconds = None
    rows.append({"process": i, "seconds": seconds, "status": p.returncode})
  for r in readers:
    r.join()
  for row in rows:
    err = outputs.get(row["process"], "")
    lines = [line for line in err.splitlines() if line.strip()]
    row.update(last_line=lines[-1] if lines else "", stderr=err,
               clean=not any(noise in err for noise in NOISE))
  return rows


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--kills", type=int, default=5)
  parser.add_argument("--victim", default="random", help="a process index or 'random'")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", help="write the rows to this file")
  args = parser.parse_args()
  rng = random.Random(args.seed)
  rows = []
  for kill in range(args.kills):
    victim = (rng.randrange(args.processes) if args.victim == "random"
              else int(args.victim))
    with tempfile.TemporaryDirectory() as workdir:
      procs = start_run(workdir, args.processes)
      wait_for_commit(workdir, procs, 10)
      for row in kill_and_time(procs, victim):
        row.update(kill=kill, victim=victim, processes=args.processes)
        rows.append(row)
        print(f"kill {kill}: victim {victim}, process {row['process']}: exit {row['status']}"
              f"{'' if row['clean'] else ' (C++ log or traceback on stderr)'}"
              f" after {row['seconds'] if row['seconds'] is None else round(row['seconds'], 2)}"
              f" s: {row['last_line']}", flush=True)
  for name, group in (("all", rows), ("process 0 (the coordinator) killed",
                                      [r for r in rows if r["victim"] == 0]),
                       ("another process killed", [r for r in rows if r["victim"] != 0])):
    times = [r["seconds"] for r in group if r["seconds"] is not None]
    if times:
      print(f"{name}: {len(group)} survivors of {len({r['kill'] for r in group})} kills"
            f" ({args.processes} processes): median {statistics.median(times):.2f} s, worst"
            f" {max(times):.2f} s; exit statuses {sorted({r['status'] for r in group})}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump([{k: v for k, v in r.items() if k != "stderr"} for r in rows], f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
