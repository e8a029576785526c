"""`t5x-like train --config configs/<file>.py[:arg] --workdir DIR [--config.key=value ...]`.

Flags are absl / ml-collections flags so that any config key can be overridden on
the command line. Multi-host: every process runs the same command; with
--num_processes > 1 they meet at --coordinator_address (jax.distributed), or
--distributed=auto lets jax detect the cluster (Cloud TPU pods, SLURM).
"""

from __future__ import annotations

import os
import sys
import threading

from absl import flags
from ml_collections import config_flags

from t5x_like.command_flags import FlagError, parse_flags


def _flags(argv: list[str]) -> flags.FlagValues:
  """argv: the full command line; ml-collections reads --config.key=value overrides from
  it (not from sys.argv, so that in-process calls work)."""
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "experiment config file[:arg]",
                                  flag_values=fv, lock_config=True, sys_argv=argv)
  flags.DEFINE_string("workdir", None, "checkpoints, metrics and data cache", flag_values=fv)
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0", flag_values=fv)
  flags.DEFINE_integer("num_processes", 1, "processes in a multi-host run", flag_values=fv)
  flags.DEFINE_integer("process_id", 0, "this process (0 .. num_processes-1)", flag_values=fv)
  flags.DEFINE_enum("distributed", "flags", ["flags", "auto"],
                    "flags: initialise only when --num_processes > 1; auto: let jax detect",
                    flag_values=fv)
  flags.DEFINE_integer("init_timeout", 300, "seconds to wait for every process of a"
                       " multi-host run to connect before giving up", flag_values=fv)
  return fv


class _StartWatchdog:
  """Exits with a clear message when jax.distributed.initialize does not return in time.

  A multi-host run started on only some workers would otherwise block (process 0 waits
  for the missing ones; the others wait for process 0) and then abort in C++ with a bare
  DEADLINE_EXCEEDED; this fires first and says what is wrong.
  """

  def __init__(self, timeout_s: float, describe: str):
    self._done = threading.Event()
    self._timeout_s, self._describe = timeout_s, describe
    self._thread = threading.Thread(target=self._watch, daemon=True)
    self._thread.start()

  def _watch(self) -> None:
    if not self._done.wait(self._timeout_s):
      print(f"t5x-like train: {self._describe} did not all connect within"
            f" {self._timeout_s:.0f} s (--init_timeout). A multi-host run must be started on"
            " every worker (e.g. `launch/tpu.sh run` uses --worker=all): check that all"
            " workers are running the same command and can reach the coordinator.",
            file=sys.stderr, flush=True)
      os._exit(3)

  def done(self) -> None:
    self._done.set()


def initialize_distributed(fv: flags.FlagValues) -> None:
  """jax.distributed.initialize for multi-process runs (CPU processes use gloo)."""
  import jax
  # jax's own timeout (which aborts the process) is set past the watchdog's.
  jax_timeout = int(fv.init_timeout) + 60
  if fv.distributed == "auto":
    watchdog = _StartWatchdog(fv.init_timeout, "the hosts of this cluster (auto-detected)")
    jax.distributed.initialize(initialization_timeout=jax_timeout)
    watchdog.done()
    return
  if fv.num_processes <= 1:
    return
  if not fv.coordinator_address:
    raise FlagError("--num_processes > 1 needs --coordinator_address")
  # Cross-process collectives of the CPU backend (multi-host tests); no effect on TPU/GPU.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  who = (f"the {fv.num_processes} processes (this is process {fv.process_id}; coordinator"
         f" {fv.coordinator_address})")
  watchdog = _StartWatchdog(fv.init_timeout, who)
  jax.distributed.initialize(fv.coordinator_address, num_processes=fv.num_processes,
                             process_id=fv.process_id, initialization_timeout=jax_timeout)
  watchdog.done()


def main(argv: list[str]) -> int:
  fv = parse_flags("train", argv, _flags, required=("config", "workdir"), doc=__doc__)
  initialize_distributed(fv)
  from t5x_like.errors import NonFiniteLossError
  from t5x_like.train.loop import train
  try:
    result = train(fv.config, fv.workdir)
  except NonFiniteLossError as e:
    print(f"t5x-like train: {e}", file=sys.stderr)
    return 1
  shown = ", ".join(f"{k}={round(v, 4)}" for k, v in sorted(result.items())
                    if k.endswith(("accuracy", "loss", "perplexity")))
  if result.status == "stopped":
    print(f"stopped at step {result.step}: checkpoint saved; rerun the same command to"
          " resume" + (f" (last eval: {shown})" if shown else ""), flush=True)
  elif result.status == "already_finished":
    print(f"already finished at step {result.step} in {fv.workdir}; final eval: "
          + (shown or "none recorded"), flush=True)
  else:
    print(f"final eval: {shown}", flush=True)
  return 0
