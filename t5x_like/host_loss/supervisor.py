"""Runs the N workers of a multi-process run and restarts them all when one is lost.

  status = supervise(specs_for, max_restarts=5, workdir="gs://bucket/run")

Every worker is a command: locally `t5x-like train ... --process_id=i` (`t5x-like
supervise`, t5x_like/commands/supervise.py), on a pod the ssh command that runs the
trainer on host i in the foreground and returns its status (launch/tpu.sh and
launch/gpu.sh `supervise`, through `python3 -m t5x_like.host_loss.supervisor`). When the first
worker ends with a non-zero status, restart_policy.decide names what follows:

- RESTART (143 preempted, 75 a peer was lost, 134 jax's abort, 255 ssh lost the host,
  a death by signal): SIGTERM the others (they save and exit, or hang on their lost
  peer), SIGKILL what remains after `stop_grace_s`, start every worker again (a fresh
  `specs_for(restart)`: a new coordinator port locally), up to `max_restarts` times;
- GIVE_UP (2 user error, 1 failure, 130 Ctrl-C, unknown): stop the others the same way
  and exit with that status.
A worker that exits 0 waits for the others. One line per restart names its cause and
the step resumed from (the workdir's last committed checkpoint); a last line says why
the supervisor stopped. Its own status: 0 finished, else the status that stopped it.

Stdlib only (no jax, no absl): the pod launchers run it on a laptop.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Optional, Sequence

from t5x_like.host_loss import restart_policy as policy

# As t5x_like/checkpoint/integrity.py names them (that module imports jax): a step
# `checkpoints/<step>/` is committed once orbax's marker, both items and every writer's
# checksum manifest are there.
CHECKPOINTS, COMMIT_MARKER, ITEMS = "checkpoints", "commit_success.txt", ("state", "extra")
MANIFEST = "checksums.process_{}.json"


@dataclasses.dataclass
class WorkerSpec:
  """One worker: its command, and on a pod the commands that signal it on its host
  (None: signal the local process)."""
  command: list[str]
  env: Optional[dict] = None
  stop: Optional[list[str]] = None  # asks it to save and stop (SIGTERM on its host)
  kill: Optional[list[str]] = None  # SIGKILL on its host


def shown(argv: Sequence[str]) -> str:
  """A command as a shell line (`bash -c LINE` shows LINE)."""
  argv = list(argv)
  return argv[2] if argv[:2] == ["bash", "-c"] and len(argv) == 3 else shlex.join(argv)


# ------------------------------------------------------------------ workers
def _end_with_parent() -> None:  # pragma: no cover  (runs in the child, before exec)
  """SIGTERM this child when the supervisor dies (Linux prctl PR_SET_PDEATHSIG): a
  killed supervisor leaves no trainer behind; they save and stop."""
  try:
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
  except (OSError, AttributeError):
    pass


class PopenWorker:
  """A worker as a local process in its own session, so that a Ctrl-C of the
  supervisor reaches the supervisor alone (it stops the workers itself)."""

  def __init__(self, spec: WorkerSpec, index: int):
    self.spec, self.index = spec, index
    self._proc = subprocess.Popen(spec.command, env=spec.env, start_new_session=True,
                                  stdin=subprocess.DEVNULL,
                                  preexec_fn=_end_with_parent if sys.platform == "linux"
                                  else None)
    self.pid = self._proc.pid
    self._helpers: list[subprocess.Popen] = []

  def poll(self) -> Optional[int]:
    return self._proc.poll()

  def terminate(self) -> None:
    """SIGTERM: the trainer saves a checkpoint and exits 143."""
    if self.spec.stop:
      self._helpers.append(subprocess.Popen(self.spec.stop, stdin=subprocess.DEVNULL))
    elif self._proc.poll() is None:
      self._proc.send_signal(signal.SIGTERM)  # the trainer only, not its helpers

  def kill(self) -> None:
    """SIGKILL to its whole process group (and on its host, for a pod)."""
    if self.spec.kill:
      self._helpers.append(subprocess.Popen(self.spec.kill, stdin=subprocess.DEVNULL))
    try:
      os.killpg(self._proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass

  def reap(self, timeout_s: float) -> None:
    """Waits for the process and the stop/kill commands (bounded: an ssh to a lost host
    may hang), then kills what is left of them."""
    deadline = time.monotonic() + timeout_s
    for proc in [self._proc, *self._helpers]:
      try:
        proc.wait(max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    self._helpers = []


class ScriptedWorker:
  """A worker that runs nothing, for dry runs and tests: prints what it would run, and
  ends as `outcome` says. outcome: a return code after `polls` polls; None: runs until
  terminate() (then exits 143, as the trainer does); "hang": until kill() (then -9)."""

  def __init__(self, spec: WorkerSpec, index: int, outcome=None, polls: int = 0,
               echo: Callable[[str], None] = lambda line: None):
    self.spec, self.index, self.pid = spec, index, None
    self.outcome, self._polls, self._echo = outcome, polls, echo
    self.returncode: Optional[int] = None
    self.signals: list[str] = []
    echo(f"+ {shown(spec.command)}")

  def poll(self) -> Optional[int]:
    if self.returncode is None and isinstance(self.outcome, int):
      if self._polls <= 0:
        self.returncode = self.outcome
      self._polls -= 1
    return self.returncode

  def terminate(self) -> None:
    self.signals.append("SIGTERM")
    self._echo(f"+ {shown(self.spec.stop)}" if self.spec.stop else
               f"# SIGTERM to process {self.index}")
    if self.returncode is None and self.outcome != "hang":
      self.returncode = 143

  def kill(self) -> None:
    if self.spec.kill:
      self._echo(f"+ {shown(self.spec.kill)}")
    elif self.returncode is None:
      self._echo(f"# SIGKILL to process {self.index}")
    if self.returncode is None:
      self.signals.append("SIGKILL")
      self.returncode = -9

  def reap(self, timeout_s: float) -> None:
    del timeout_s


# ------------------------------------------------------------- the workdir
def last_committed_step(workdir: Optional[str],
                        timeout_s: float = 30.0) -> tuple[Optional[int], bool]:
  """(the newest committed step of workdir/checkpoints or None, whether it could be
  read within timeout_s). URLs go through etils epath where installed (a laptop may
  lack it, or the credentials: then the step is unknown, never a stalled restart)."""
  if not workdir:
    return None, False
  found: list = []
  reader = threading.Thread(target=lambda: found.append(_read_last_step(workdir)),
                            daemon=True)
  reader.start()
  reader.join(timeout_s)
  return found[0] if found else (None, False)


def _read_last_step(workdir: str) -> tuple[Optional[int], bool]:
  try:
    if "://" in workdir:
      from etils import epath  # pathlib's interface, for URLs
      root = epath.Path(workdir) / CHECKPOINTS
    else:
      root = pathlib.Path(workdir) / CHECKPOINTS
    if not root.is_dir():
      return None, True
    for step in sorted((int(p.name) for p in root.iterdir() if p.name.isdigit()),
                       reverse=True):
      if _committed(root / str(step)):
        return step, True
    return None, True
  except Exception:  # noqa: BLE001  (unreadable: the line says so; the trainer decides)
    return None, False


def _committed(step_dir) -> bool:
  """Orbax's commit marker, both items, and the checksum manifest of every writer (the
  writer count is in process 0's manifest)."""
  if not (step_dir / COMMIT_MARKER).exists():
    return False
  if not all((step_dir / item).is_dir() for item in ITEMS):
    return False
  try:
    writers = int(json.loads((step_dir / MANIFEST.format(0)).read_text())["processes"])
  except (OSError, ValueError, KeyError, TypeError):
    return False
  return all((step_dir / MANIFEST.format(k)).exists() for k in range(1, writers))


# ------------------------------------------------------------ the supervisor
class _SignalStop:
  """SIGINT / SIGTERM to the supervisor: stop the workers (they save), then exit."""

  def __init__(self):
    self.name: Optional[str] = None
    self.count = 0
    self._previous = {}
    try:
      for s in (signal.SIGINT, signal.SIGTERM):
        self._previous[s] = signal.signal(s, self._handle)
    except ValueError:  # not the main thread (tests): no handlers
      self._previous = {}

  def _handle(self, signum, frame):
    del frame
    self.name, self.count = self.name or signal.Signals(signum).name, self.count + 1
    print(f"supervisor: {signal.Signals(signum).name}: stopping every process"
          + (" now" if self.count > 1 else " (again to kill them at once)"),
          file=sys.stderr, flush=True)

  def restore(self):
    for s, handler in self._previous.items():
      signal.signal(s, handler)


def _log_to_stderr(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def supervise(specs_for: Callable[[int], list[WorkerSpec]], *, max_restarts: int,
              workdir: Optional[str] = None, start: Callable = PopenWorker,
              stop_grace_s: float = 30.0, restart_delay_s: float = 0.0,
              poll_s: float = 0.2, log: Callable[[str], None] = _log_to_stderr,
              read_step: Callable = last_committed_step) -> int:
  """Runs the workers of specs_for(restart) until all exit 0, one gives up, or
  max_restarts restarts are spent; returns the supervisor's exit status."""
  stop = _SignalStop()
  try:
    restarts = 0
    while True:
      workers = [start(spec, i) for i, spec in enumerate(specs_for(restarts))]
      pids = [w.pid for w in workers if w.pid is not None]
      log(f"supervisor: started {len(workers)} process{'es' if len(workers) > 1 else ''}"
          + (f" (pids {', '.join(map(str, pids))})" if pids else ""))
      ended = _first_end(workers, poll_s, stop)
      if ended is None and not stop.name:
        log(policy.finished_line(len(workers), restarts))
        return 0
      _stop_all(workers, stop_grace_s, poll_s, stop)
      if stop.name:
        log(policy.interrupted_line(stop.name))
        return 128 + signal.Signals[stop.name].value
      process, returncode = ended
      if policy.decide(returncode) == policy.GIVE_UP:
        log(policy.gave_up_line(process, returncode))
        return policy.exit_status(returncode)
      step, known = read_step(workdir)
      if restarts >= max_restarts:
        log(policy.out_of_restarts_line(max_restarts, process, returncode, step, known))
        return policy.exit_status(returncode)
      restarts += 1
      log(policy.restart_line(restarts, max_restarts, process, returncode,
                              policy.resume_text(step, known)))
      deadline = time.monotonic() + restart_delay_s
      while time.monotonic() < deadline and not stop.name:
        time.sleep(min(poll_s, 0.2))
      if stop.name:
        log(policy.interrupted_line(stop.name))
        return 128 + signal.Signals[stop.name].value
  finally:
    stop.restore()


def _first_end(workers, poll_s: float, stop: _SignalStop) -> Optional[tuple[int, int]]:
  """(process, return code) of the first worker to end with a non-zero status; None
  once all exited 0, or when the supervisor was signalled (stop.name is set)."""
  while not stop.name:
    codes = [w.poll() for w in workers]
    ended = [(i, c) for i, c in enumerate(codes) if c is not None and c != 0]
    if ended:
      return policy.first_cause(ended)
    if all(c == 0 for c in codes):
      return None
    time.sleep(poll_s)
  return None


def _stop_all(workers, grace_s: float, poll_s: float, stop: _SignalStop) -> None:
  """SIGTERM what still runs, wait up to grace_s (a second signal cuts it short),
  SIGKILL every worker (a pod: on every host, whatever its ssh said), reap them."""
  signalled = stop.count
  for w in workers:
    if w.poll() is None:
      w.terminate()
  deadline = time.monotonic() + grace_s
  while (any(w.poll() is None for w in workers) and time.monotonic() < deadline
         and stop.count <= max(signalled, 1)):
    time.sleep(poll_s)
  for w in workers:
    w.kill()
  for w in workers:
    w.reap(max(10.0, grace_s))


# --------------------------------------------------------------- dry runs
def dry_run(specs_for: Callable[[int], list[WorkerSpec]], *, max_restarts: int,
            simulate: tuple[int, int], echo: Callable[[str], None] = print) -> int:
  """Prints what supervise() would run when process simulate[0] ends with status
  simulate[1] once, then every worker finishes: the same loop, ScriptedWorkers."""
  process, status = simulate
  echo(f"# dry run: process {process} is made to exit {policy.describe(status)} once")

  def start(spec: WorkerSpec, index: int):
    first = start.calls < len(specs_for(0))
    start.calls += 1
    outcome = (status if index == process else None) if first else 0
    return ScriptedWorker(spec, index, outcome, echo=echo)
  start.calls = 0
  return supervise(specs_for, max_restarts=max_restarts, start=start, stop_grace_s=0,
                   poll_s=0, log=lambda line: echo(f"# {line}"),
                   read_step=lambda workdir: (None, False))


# ------------------------------------------------- `python3 -m t5x_like.host_loss.supervisor`
def main(argv: Optional[Sequence[str]] = None) -> int:
  """The pod launchers' entry: one --worker shell command per host (and its --stop /
  --kill commands), run with bash."""
  parser = argparse.ArgumentParser(
      prog="python3 -m t5x_like.host_loss.supervisor",
      description="Runs one shell command per worker and restarts them all when one is"
                  " lost (see launch/README.md, 'Supervised runs').")
  parser.add_argument("--worker", action="append", required=True, metavar="CMD",
                      help="the command that runs worker i in the foreground (repeat)")
  parser.add_argument("--stop", action="append", default=[], metavar="CMD",
                      help="SIGTERM worker i on its host (one per --worker, or none)")
  parser.add_argument("--kill", action="append", default=[], metavar="CMD",
                      help="SIGKILL worker i on its host (one per --worker, or none)")
  parser.add_argument("--workdir", help="the run's workdir (to name the step resumed)")
  parser.add_argument("--max_restarts", type=int, default=3)
  parser.add_argument("--stop_grace_seconds", type=float, default=30.0)
  parser.add_argument("--restart_delay_seconds", type=float, default=0.0)
  parser.add_argument("--dry_run", action="store_true",
                      help="print the commands, with one simulated restart; run nothing")
  parser.add_argument("--simulate", default=None, metavar="PROCESS:STATUS",
                      help="the dry run's simulated ending [1:137, or 0:137 on one host]")
  args = parser.parse_args(argv)
  n = len(args.worker)
  for name in ("stop", "kill"):
    if getattr(args, name) and len(getattr(args, name)) != n:
      parser.error(f"--{name} given {len(getattr(args, name))} times for {n} --worker")
  if args.max_restarts < 0:
    parser.error(f"--max_restarts must be >= 0, got {args.max_restarts}")
  bash = lambda cmd: ["bash", "-c", cmd]  # noqa: E731
  specs = [WorkerSpec(bash(args.worker[i]),
                      stop=bash(args.stop[i]) if args.stop else None,
                      kill=bash(args.kill[i]) if args.kill else None) for i in range(n)]
  if args.dry_run:
    simulate = args.simulate or f"{min(1, n - 1)}:137"
    try:
      process, status = (int(x) for x in simulate.split(":"))
      assert 0 <= process < n
    except (ValueError, AssertionError):
      parser.error(f"--simulate={simulate}: expected PROCESS:STATUS, PROCESS in 0..{n - 1}")
    return dry_run(lambda restart: specs, max_restarts=args.max_restarts,
                   simulate=(process, status))
  return supervise(lambda restart: specs, max_restarts=args.max_restarts,
                   workdir=args.workdir, stop_grace_s=args.stop_grace_seconds,
                   restart_delay_s=args.restart_delay_seconds)


if __name__ == "__main__":
  sys.exit(main())
