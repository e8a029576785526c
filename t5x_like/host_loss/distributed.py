"""Multi-host start-up shared by the commands that train (`train`, `finetune`).

Every process runs the same command; with --num_processes > 1 they meet at
--coordinator_address (jax.distributed), or --distributed=auto lets jax detect the
cluster (Cloud TPU pods, SLURM).

A process lost once the run started (a host gone, a kill) stops the others within
--peer_timeout seconds (jax's coordination-service heartbeat), each with one line naming
it and the last committed checkpoint, and exit status 75: rerun every worker to resume
(peer_guard.py, peer_loss.py; docs/checkpoints-and-faults.md, "A lost host").
"""

from __future__ import annotations

import os
import sys
import threading

from absl import flags

from t5x_like.command_flags import FlagError
from t5x_like.errors import EXIT_START_TIMEOUT

# jax's own default is 100 s. Heartbeats come from a C++ thread of their own (no Python,
# no GIL), so a busy but live process does not miss them; a lost one is noticed this long
# after its last heartbeat.
PEER_TIMEOUT_S = 30


def define_distributed_flags(fv: flags.FlagValues) -> None:
  """--coordinator_address, --num_processes, --process_id, --distributed, --init_timeout."""
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0", flag_values=fv)
  flags.DEFINE_integer("num_processes", 1, "processes in a multi-host run", flag_values=fv)
  flags.DEFINE_integer("process_id", 0, "this process (0 .. num_processes-1)", flag_values=fv)
  flags.DEFINE_enum("distributed", "flags", ["flags", "auto"],
                    "flags: initialise only when --num_processes > 1; auto: let jax detect",
                    flag_values=fv)
  flags.DEFINE_integer("init_timeout", 300, "seconds to wait for every process of a"
                       " multi-host run to connect before giving up", flag_values=fv)
  flags.DEFINE_integer("peer_timeout", PEER_TIMEOUT_S, "seconds without a heartbeat from a"
                       " process of a multi-host run before the others stop (exit 75: rerun"
                       " every worker to resume)", flag_values=fv, lower_bound=1)


class _StartWatchdog:
  """Exits with a clear message when jax.distributed.initialize does not return in time.

  A multi-host run started on only some workers would otherwise block (process 0 waits
  for the missing ones; the others wait for process 0) and then abort in C++ with a bare
  DEADLINE_EXCEEDED; this fires first and says what is wrong.
  """

  def __init__(self, timeout_s: float, describe: str, command: str):
    self._command = command
    self._done = threading.Event()
    self._timeout_s, self._describe = timeout_s, describe
    self._thread = threading.Thread(target=self._watch, daemon=True)
    self._thread.start()

  def _watch(self) -> None:
    if not self._done.wait(self._timeout_s):
      print(f"t5x-like {self._command}: {self._describe} did not all connect within"
            f" {self._timeout_s:.0f} s (--init_timeout). A multi-host run must be started on"
            " every worker (e.g. `launch/tpu.sh run` uses --worker=all): check that all"
            " workers are running the same command and can reach the coordinator.",
            file=sys.stderr, flush=True)
      os._exit(EXIT_START_TIMEOUT)  # pylint: disable=protected-access

  def done(self) -> None:
    self._done.set()


def initialize_distributed(fv: flags.FlagValues, command: str) -> None:
  """jax.distributed.initialize for multi-process runs (CPU processes use gloo), behind
  the peer guard (a lost process: one line, exit 75)."""
  import jax
  # jax's own timeout (which aborts the process) is set past the watchdog's.
  jax_timeout = int(fv.init_timeout) + 60
  if fv.distributed == "auto":
    _guard_peers(fv, command, process_id=None, num_processes=None)
    watchdog = _StartWatchdog(fv.init_timeout, "the hosts of this cluster (auto-detected)",
                               command)
    jax.distributed.initialize(initialization_timeout=jax_timeout,
                               heartbeat_timeout_seconds=int(fv.peer_timeout))
    watchdog.done()
    return
  if fv.num_processes <= 1:
    return
  if not fv.coordinator_address:
    raise FlagError("--num_processes > 1 needs --coordinator_address")
  # Cross-process collectives of the CPU backend (multi-host tests); no effect on TPU/GPU.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  _guard_peers(fv, command, process_id=fv.process_id, num_processes=fv.num_processes)
  who = (f"the {fv.num_processes} processes (this is process {fv.process_id}; coordinator"
         f" {fv.coordinator_address})")
  watchdog = _StartWatchdog(fv.init_timeout, who, command)
  jax.distributed.initialize(fv.coordinator_address, num_processes=fv.num_processes,
                             process_id=fv.process_id, initialization_timeout=jax_timeout,
                             heartbeat_timeout_seconds=int(fv.peer_timeout))
  watchdog.done()


def _guard_peers(fv: flags.FlagValues, command: str, process_id, num_processes) -> None:
  """peer_guard.guard before jax starts (it forks); with --distributed=auto the process
  index is learnt later, so the messages name no process id of their own."""
  from t5x_like.host_loss import peer_guard
  # train and finetune keep their checkpoints in WORKDIR/checkpoints (run_context.py);
  # finetune-suite has one workdir per task: its line names no step.
  workdir = fv.workdir if command in ("train", "finetune") and "workdir" in fv else None
  peer_guard.guard(f"t5x-like {command}", process_id=-1 if process_id is None else process_id,
                   num_processes=num_processes or 0,
                   checkpoint_dir=os.path.join(workdir, "checkpoints") if workdir else None,
                   debug="--debug" in sys.argv)
