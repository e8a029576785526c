"""`t5x-like bench gpu`: every GPU figure of docs/speed.md in one budgeted call.

  results = run_suite("out", rehearse=False, budget=540)

Runs the steps of speed/gpu_steps.py in their order of importance, each as its own
`t5x-like` process with its own timeout, until the budget is spent; what is left is
recorded as skipped. After every step OUT gets (atomically, so a run stopped from
outside still leaves them):

  results.json   every step's status, seconds, command and figures (gpu_report.py),
                 the bench's own JSON, the environment (versions, XLA_FLAGS, device)
  summary.md     the table for docs/speed.md (also printed at the end)
  log.txt        every step's command and its stderr, in order
  traces.tar.gz  the profiles (xplane.pb and the step's HLO), packed at the end;
                 left out (and said so in results.json) above TRACE_LIMIT_BYTES

Nothing else is written under OUT: profiles and the resume check's workdirs live in a
scratch folder that is removed at the end. So OUT holds at most 4 files, one level
deep (a lent GPU machine returns at most 8 files, two folders deep).

rehearse=True runs the same steps on the CPU at smoke shapes (gpu_steps.py): the same
commands, flags and results.json schema, in a few minutes.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from concurrent import futures
from typing import Callable, Optional, Sequence

from t5x_like.speed import gpu_report
from t5x_like.speed.gpu_steps import DETERMINISTIC_FLAG, RESUME_KILL_STEP, Step, suite_steps
from t5x_like.errors import UserError

SCHEMA = 1
RESULT_FILES = ("results.json", "summary.md", "log.txt", "traces.tar.gz")
TRACE_LIMIT_BYTES = 16 * 2**20
# A step is not started with less budget left than this (seconds); packing the traces
# and writing the results are kept this much time too.
MIN_STEP_SECONDS = 20
RESERVE_SECONDS = 10
_OOM_MARKS = ("RESOURCE_EXHAUSTED", "out of memory", "OutOfMemoryError")


class StepRun:
  """One `t5x-like` process: argv after `t5x-like`, its extra env, a timeout. Each call
  writes its command and stderr to the log as one block (steps may run side by side)."""

  def __init__(self, python: str, log: io.TextIOBase, env: Optional[dict[str, str]] = None):
    self.python = python
    self.log = log
    self.env = env or {}  # for every call (the rehearsal's compilation cache)
    self.lock = threading.Lock()

  def __call__(self, args: Sequence[str], env: dict[str, str], timeout: float,
               label: str) -> tuple[Optional[int], str, str, float]:
    """(exit status or None on timeout, stdout, stderr, seconds)."""
    argv = [self.python, "-m", "t5x_like.cli", *args]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
    for key, value in env.items():
      if key == "XLA_FLAGS":  # added to what the caller set, not replacing it
        value = " ".join(filter(None, (full_env.get("XLA_FLAGS", ""), value)))
      full_env[key] = value
    shown = " ".join(f"{k}={v}" for k, v in env.items())
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=full_env,
                            start_new_session=True)  # the timeout stops its children too
    try:
      out, err = proc.communicate(timeout=max(timeout, 1))
      status: Optional[int] = proc.returncode
    except subprocess.TimeoutExpired:
      _stop_group(proc)
      out, err = proc.communicate()
      status = None
    seconds = time.monotonic() - start
    with self.lock:
      self.log.write(f"\n==== {label}: {shown + ' ' if shown else ''}t5x-like"
                     f" {' '.join(args)}\n{err}")
      self.log.write(f"==== {label}: {'timed out' if status is None else f'exit {status}'}"
                     f" after {seconds:.1f} s\n")
      self.log.flush()
    return status, out, err, seconds


def _stop_group(proc: subprocess.Popen) -> None:
  """SIGTERM to the process group, SIGKILL 5 s later if it still runs."""
  for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 30)):
    try:
      os.killpg(proc.pid, sig)
    except ProcessLookupError:
      return
    try:
      proc.wait(timeout=wait)
      return
    except subprocess.TimeoutExpired:
      continue


def _write_atomic(path: str, text: str) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


def _oom_line(text: str) -> Optional[str]:
  for line in text.splitlines():
    if any(mark in line for mark in _OOM_MARKS):
      return line.strip()[:300]
  return None


def _last_lines(text: str, n: int = 3) -> str:
  lines = [l for l in text.strip().splitlines() if l.strip()]
  return " | ".join(lines[-n:])[-600:]


# ------------------------------------------------------------------------ the steps
def compilation_cache_env(scratch: str) -> dict[str, str]:
  """JAX's persistent compilation cache in scratch, for programs of any compile time."""
  return {"JAX_COMPILATION_CACHE_DIR": os.path.join(scratch, "jax_cache"),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def run_bench_step(step: Step, run: StepRun, timeout: float, scratch: str) -> dict:
  """A 'bench' step (and its fallback after running out of memory): its record."""
  args = list(step.args)
  if step.profile:
    args += ["--profile", os.path.join(scratch, f"{step.name}.prof")]
  status, out, err, seconds = run(args, dict(step.env), timeout, step.name)
  record = {"command": args, "seconds": round(seconds, 1)}
  oom = _oom_line(err) if status not in (0, None) else None
  if oom and step.fallback:
    remaining = timeout - seconds
    record["fallback"] = {"flags": list(step.fallback), "because": oom,
                          "first_try_seconds": round(seconds, 1)}
    args = args + list(step.fallback)
    if remaining < MIN_STEP_SECONDS:
      record["fallback"]["ran"] = False
    else:
      status, out, err, more = run(args, dict(step.env), remaining, step.name + " (fallback)")
      record["fallback"]["ran"] = True
      record["command"] = args
      record["seconds"] = round(seconds + more, 1)
  if status is None:
    return {**record, "status": "timeout", "reason": f"stopped after {timeout:.0f} s"}
  if status != 0:
    return {**record, "status": "failed", "exit": status, "reason": _last_lines(err)}
  try:
    result = json.loads(out)
  except json.JSONDecodeError as e:
    return {**record, "status": "failed", "exit": 0,
            "reason": f"stdout is not one JSON object ({e.msg})"}
  return {**record, "status": "ok", "exit": 0, "result": result,
          "figures": gpu_report.figures(step, result)}


def run_compare_step(step: Step, records: dict[str, dict]) -> dict:
  """The fused kernel's losses against the explicit kernel's (gpu_report.compare_losses)
  of the finished steps `records`."""
  missing = [n for n in step.uses if records.get(n, {}).get("status") != "ok"]
  if missing:
    return {"status": "skipped", "reason": f"needs {', '.join(missing)} (not ok)"}
  fused, explicit = (records[n]["result"] for n in step.uses)
  figures = gpu_report.compare_losses(fused, explicit)
  return {"status": "ok" if figures["passed"] else "failed", "figures": figures,
          **({} if figures["passed"] else {"reason": figures["verdict"]})}


def run_resume_step(step: Step, run: StepRun, timeout: float, scratch: str,
                    rehearse: bool) -> dict:
  """A whole `train` run; a run killed (SIGKILL) right after a save, then rerun; the
  two metrics.jsonl must hold the same losses bit for bit."""
  from t5x_like.train.metrics import read_jsonl
  whole, killed = (os.path.join(scratch, f"resume_{n}") for n in ("whole", "killed"))
  kill_at = RESUME_KILL_STEP[rehearse]
  # One compile for the three runs: faster, and the resumed run runs the same program.
  env = {**dict(step.env), **compilation_cache_env(scratch)}
  deadline = time.monotonic() + timeout
  runs = [("whole", whole, {}), ("killed", killed, {"T5X_LIKE_FAILPOINT": f"after_save@{kill_at}"}),
          ("resumed", killed, {})]
  statuses: dict[str, Optional[int]] = {}
  started = time.monotonic()
  for label, workdir, extra in runs:
    left = deadline - time.monotonic()
    if left < 5:
      return {"status": "timeout", "reason": f"{label} run not started: {timeout:.0f} s spent",
              "figures": {"exits": statuses}}
    status, _, err, _ = run(["train", *step.args, "--workdir", workdir], {**env, **extra},
                            left, f"{step.name} {label}")
    statuses[label] = status
    wanted = (-signal.SIGKILL, 128 + signal.SIGKILL) if label == "killed" else (0,)
    if status not in wanted:
      why = "timed out" if status is None else f"exit {status}"
      return {"status": "timeout" if status is None else "failed",
              "reason": f"{label} run: {why} ({_last_lines(err, 2)})",
              "figures": {"exits": statuses}}
  losses = [{r["step"]: r["loss"] for r in read_jsonl(os.path.join(d, "metrics.jsonl"))
             if "loss" in r} for d in (whole, killed)]
  figures = gpu_report.resume_figures(*losses, kill_at=kill_at)
  figures.update(exits=statuses, deterministic_flag=DETERMINISTIC_FLAG)
  return {"status": "ok" if figures["passed"] else "failed", "figures": figures,
          "seconds": round(time.monotonic() - started, 1),
          **({} if figures["passed"] else {"reason": figures["verdict"]})}


# ------------------------------------------------------------------------ the suite
def pack_traces(scratch: str, out_dir: str, limit: int = TRACE_LIMIT_BYTES) -> dict:
  """OUT/traces.tar.gz of every profile folder in scratch (the xplane.pb files and the
  steps' HLO); without the HLO if that is too big; left out above `limit` bytes."""
  profiles = sorted(n for n in os.listdir(scratch) if n.endswith(".prof"))
  if not profiles:
    return {"file": None, "note": "no profiles"}
  members = []
  for name in profiles:
    for root, _, files in sorted(os.walk(os.path.join(scratch, name))):
      for f in sorted(files):
        if f.endswith(".xplane.pb") or f.endswith(".hlo.txt"):
          members.append((os.path.join(root, f), f"{name[:-5]}/{f}"))
  path = os.path.join(out_dir, "traces.tar.gz")
  for keep in (lambda arc: True, lambda arc: arc.endswith(".xplane.pb")):
    chosen = [(src, arc) for src, arc in members if keep(arc)]
    tmp = path + ".tmp"
    with tarfile.open(tmp, "w:gz") as tar:
      for src, arc in chosen:
        tar.add(src, arcname=arc)
    size = os.path.getsize(tmp)
    if size <= limit:
      os.replace(tmp, path)
      return {"file": "traces.tar.gz", "bytes": size, "members": [a for _, a in chosen]}
    os.remove(tmp)
  return {"file": None, "note": f"left out: {size / 2**20:.1f} MiB of traces, over the"
                                f" {limit / 2**20:.0f} MiB limit"}


def _check_out_dir(out_dir: str) -> None:
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise UserError(f"--out={out_dir}: not a folder")
  if os.path.isdir(out_dir) and os.listdir(out_dir):
    raise UserError(f"--out={out_dir}: the folder is not empty (the suite leaves at most"
                    f" {len(RESULT_FILES)} files there: give it an empty one)")
  try:
    os.makedirs(out_dir, exist_ok=True)
  except OSError as e:
    raise UserError(f"--out={out_dir}: cannot create the folder ({e.strerror})") from None


def select_steps(steps: list[Step], only: Sequence[str]) -> list[Step]:
  """The steps named in `only` (all when empty), in the suite's order; UserError for an
  unknown name."""
  if not only:
    return steps
  names = [s.name for s in steps]
  unknown = [n for n in only if n not in names]
  if unknown:
    raise UserError(f"--only: unknown step {unknown[0]!r} (known: {', '.join(names)})")
  return [s for s in steps if s.name in only]


def run_suite(out_dir: str, *, rehearse: bool = False, budget: float = 540,
              only: Sequence[str] = (), configs: str = "configs", commit: str = "",
              python: str = sys.executable, jobs: Optional[int] = None,
              clock: Callable[[], float] = time.monotonic) -> dict:
  """Run the suite into out_dir (module docstring); the results.json dict.

  jobs: steps run side by side, started in the suite's order (default: 1 on a GPU,
  whose figures need it alone; 2 for the rehearsal, whose figures are not timings:
  XLA compiles on one core, so two steps halve the wall time on two cores)."""
  jobs = jobs or (2 if rehearse else 1)
  if jobs < 1:
    raise UserError(f"--jobs={jobs}: give 1 or more (0: the default)")
  if budget < MIN_STEP_SECONDS:
    raise UserError(f"--budget={budget}: give at least {MIN_STEP_SECONDS} seconds")
  if not os.path.isdir(configs):
    raise UserError(f"--configs={configs}: no such folder (run from the repository root,"
                    " or name the folder of the configs)")
  steps = select_steps(suite_steps(rehearse=rehearse, configs=configs), only)
  _check_out_dir(out_dir)
  scratch = tempfile.mkdtemp(prefix="t5x_like_bench_gpu_")
  start = clock()
  results = {"schema": SCHEMA, "mode": "rehearsal" if rehearse else "gpu",
             "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "commit": commit or gpu_report.git_commit(), "budget_seconds": budget,
             "elapsed_seconds": 0.0, "environment": gpu_report.host_environment(),
             "steps": [], "traces": {"file": None, "note": "not packed yet"}}
  records: dict[str, dict] = {}
  done: dict[str, futures.Future] = {}
  lock = threading.Lock()

  def save() -> None:
    with lock:
      results["steps"] = [records[s.name] for s in steps if s.name in records]
      gpu_report.fill_environment(results)
      results["elapsed_seconds"] = round(clock() - start, 1)
      _write_atomic(os.path.join(out_dir, "results.json"), json.dumps(results, indent=1))
      _write_atomic(os.path.join(out_dir, "summary.md"),
                    gpu_report.summary_markdown(results))

  def one(step: Step, run: StepRun) -> None:
    if step.kind == "compare":  # after the steps it reads (started before it)
      futures.wait([done[n] for n in step.uses if n in done])
    left = budget - RESERVE_SECONDS - (clock() - start)
    if step.kind != "compare" and left < MIN_STEP_SECONDS:
      record = {"status": "skipped", "reason": f"budget: {max(left, 0):.0f} s left"}
    elif step.kind == "bench":
      record = run_bench_step(step, run, min(step.timeout, left), scratch)
    elif step.kind == "compare":
      record = run_compare_step(step, records)
    else:
      record = run_resume_step(step, run, min(step.timeout, left), scratch, rehearse)
    records[step.name] = {"name": step.name, "title": step.title, "kind": step.kind,
                          "timeout_seconds": step.timeout, **record}
    print(gpu_report.step_line(records[step.name]), file=sys.stderr, flush=True)
    save()

  try:
    with open(os.path.join(out_dir, "log.txt"), "w") as log, \
         futures.ThreadPoolExecutor(max_workers=jobs) as pool:
      run = StepRun(python, log, compilation_cache_env(scratch) if rehearse else None)
      for step in steps:  # a FIFO pool: a compare's inputs start before it
        done[step.name] = pool.submit(one, step, run)
      for future in done.values():
        future.result()  # a bug in the driver stops it here, with what is saved
    results["traces"] = pack_traces(scratch, out_dir)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
    save()
  return results
