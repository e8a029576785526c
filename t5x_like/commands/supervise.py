"""`t5x-like supervise --num_processes=N [--max_restarts=R] -- train FLAGS...`: runs N
processes of `t5x-like train` (or `finetune`) on this machine as one multi-process run,
and restarts them all when one is lost (t5x_like/host_loss/supervisor.py; the pod launchers run
the same supervisor with one ssh command per host).

Each process gets --coordinator_address=localhost:PORT (a free port, new at each
restart), --num_processes=N and --process_id=i. A process that ends with 143
(preempted), 75 (a peer was lost), 134 (jax's abort), or by a signal (SIGKILL: 137)
makes the supervisor stop the others and start all N again, resuming from the last
checkpoint; 2 (user error), 1 (failure) or 130 (Ctrl-C) stops everything with that
status. One line per restart names the cause and the step resumed from.

  t5x-like supervise --num_processes=2 --cpu_devices_per_process=4 -- \\
      train --config configs/bert_cpu.py:smoke --workdir workdir/bert
"""

from __future__ import annotations

import os
import re
import socket
import sys

from absl import flags

from t5x_like.command_flags import FlagError, flag_value, parse_flags_and_args

SUPERVISED = ("train", "finetune")  # the commands that take the multi-host flags
_SET_BY_SUPERVISOR = ("coordinator_address", "num_processes", "process_id", "distributed")
_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S*")


def _flags(argv: list[str]) -> flags.FlagValues:
  del argv  # no config of its own
  fv = flags.FlagValues()
  flags.DEFINE_integer("num_processes", None, "processes to run on this machine",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("max_restarts", 3, "restarts before giving up", lower_bound=0,
                       flag_values=fv)
  flags.DEFINE_float("stop_grace_seconds", 30.0, "after a process is lost, how long the"
                     " others get to stop on SIGTERM before SIGKILL", lower_bound=0.0,
                     flag_values=fv)
  flags.DEFINE_float("restart_delay_seconds", 0.0, "pause before each restart",
                     lower_bound=0.0, flag_values=fv)
  flags.DEFINE_integer("cpu_devices_per_process", None, "CPU runs: JAX_PLATFORMS=cpu and"
                       " this many fake devices per process (XLA_FLAGS); unset: the"
                       " environment as it is", lower_bound=1, flag_values=fv)
  return fv


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def worker_env(devices_per_process) -> dict:
  """The workers' environment: this one, with `devices_per_process` fake CPU devices."""
  env = dict(os.environ)
  if devices_per_process:
    flags_ = _DEVICE_COUNT.sub("", env.get("XLA_FLAGS", "")).split()
    env["XLA_FLAGS"] = " ".join(
        [*flags_, f"--xla_force_host_platform_device_count={devices_per_process}"])
    env["JAX_PLATFORMS"] = "cpu"
  return env


def worker_commands(command: list[str], num_processes: int, port: int) -> list[list[str]]:
  """argv of each process: `t5x-like COMMAND...` through this interpreter, with the
  multi-host flags of process i (none for a single process)."""
  base = [sys.executable, "-m", "t5x_like.cli", *command]
  if num_processes == 1:
    return [base]
  return [[*base, f"--coordinator_address=localhost:{port}",
           f"--num_processes={num_processes}", f"--process_id={i}"]
          for i in range(num_processes)]


def main(argv: list[str]) -> int:
  fv, command = parse_flags_and_args("supervise", argv, _flags, required=("num_processes",),
                                     doc=__doc__, positionals="-- train|finetune FLAGS...",
                                     min_positionals=1)
  if command[0] not in SUPERVISED:
    raise FlagError(f"after --: {command[0]!r} is not supervised; expected one of"
                    f" {', '.join(SUPERVISED)} (e.g. -- train --config FILE --workdir DIR)")
  for name in _SET_BY_SUPERVISOR:
    if flag_value(command, name) is not None or f"--no{name}" in command:
      raise FlagError(f"--{name} is set by the supervisor for each process; leave it out"
                      f" of the {command[0]} flags")
  from t5x_like import fs
  from t5x_like.host_loss.supervisor import WorkerSpec, supervise
  workdir = flag_value(command, "workdir")
  if workdir and not fs.is_url(workdir):
    workdir = os.path.abspath(os.path.expanduser(workdir))
  env = worker_env(fv.cpu_devices_per_process)

  def specs_for(restart: int) -> list[WorkerSpec]:
    del restart  # a fresh port each time: the old coordinator's may linger
    return [WorkerSpec(argv_, env=env)
            for argv_ in worker_commands(command, fv.num_processes, _free_port())]

  return supervise(specs_for, max_restarts=fv.max_restarts, workdir=workdir,
                   stop_grace_s=fv.stop_grace_seconds,
                   restart_delay_s=fv.restart_delay_seconds)
