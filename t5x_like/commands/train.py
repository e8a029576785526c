"""`t5x-like train --config configs/<file>.py[:arg] --workdir DIR [--config.key=value ...]`.

Flags are absl / ml-collections flags so that any config key can be overridden on
the command line. Multi-host: every process runs the same command; with
--num_processes > 1 they meet at --coordinator_address (jax.distributed), or
--distributed=auto lets jax detect the cluster (Cloud TPU pods, SLURM).
"""

from __future__ import annotations

import sys

from absl import flags
from ml_collections import config_flags

from t5x_like.command_flags import lock_flags, parse_flags
from t5x_like.host_loss.distributed import define_distributed_flags, initialize_distributed
from t5x_like.train.preemption import exit_at_once_on_interrupt
from t5x_like.train.workdir_lock import command_lock


def _flags(argv: list[str]) -> flags.FlagValues:
  """argv: the full command line; ml-collections reads --config.key=value overrides from
  it (not from sys.argv, so that in-process calls work)."""
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "experiment config file[:arg]",
                                  flag_values=fv, lock_config=True, sys_argv=argv)
  flags.DEFINE_string("workdir", None, "checkpoints, metrics and data cache", flag_values=fv)
  define_distributed_flags(fv)
  return fv


def main(argv: list[str]) -> int:
  # The lock before the config file is loaded (it may import jax through the libraries
  # it names) and before jax starts: a second train on the workdir is refused at once.
  with exit_at_once_on_interrupt("train"), command_lock(lock_flags(argv)) as lock:
    fv = parse_flags("train", argv, _flags, required=("config", "workdir"), doc=__doc__)
    return _train(fv, lock)


def _train(fv: flags.FlagValues, lock) -> int:
  initialize_distributed(fv, "train")
  from t5x_like.errors import NonFiniteLossError
  from t5x_like.plan.remat import resolve_config_remat
  from t5x_like.train.loop import train
  try:  # the trainer sits below plan/: the command hands it plan's remat chooser
    result = train(fv.config, fv.workdir, lock=lock, choose_remat=resolve_config_remat)
  except NonFiniteLossError as e:
    print(f"t5x-like train: {e}", file=sys.stderr)
    return 1
  shown = ", ".join(f"{k}={round(v, 4)}" for k, v in sorted(result.items())
                    if k.endswith(("accuracy", "loss", "perplexity")) and "/" not in k)
  if result.status == "stopped":
    print(f"stopped by {result.stopped_by} at step {result.step}: checkpoint saved; exit"
          f" {result.exit_code}: rerun the same command to resume"
          + (f" (last eval: {shown})" if shown else ""), flush=True)
  elif result.status == "exhausted":
    print(f"data exhausted at step {result.step}: mixture source"
          f" {result.exhausted_source!r} would read past its first epoch in the next step"
          f" (data.mixture_exhausted='stop'); checkpoint saved; final eval: "
          + (shown or "none recorded"), flush=True)
  elif result.status == "already_finished":
    print(f"already finished at step {result.step} in {fv.workdir}; final eval: "
          + (shown or "none recorded"), flush=True)
  else:
    print(f"finished at step {result.step}; final eval: {shown or 'none recorded'}",
          flush=True)
  return result.exit_code
