"""The step runner shared by pretraining (train/loop.py) and fine-tuning (finetune/loop.py).

  with run_files(workdir, total_steps=..., keep=..., async_save=...) as (checkpointer, writer):
    start = restore_or_create(checkpointer, abstract_state, create, setup)
    batches = device_batches(objective, batch_size, seed=..., mesh=mesh, rules=rules,
                             data_state=start.extra and start.extra["data"])
    step, state, evals, stopped = run_steps(StepLoop(...), start.state, start.step, until)

One loop for both: the train step on device-prefetched batches of the deterministic
host-sharded loader, train rows every log_every steps (a non-finite loss stops the
run), checkpoints (with the loader's state) every checkpoint_every steps, evaluation
every eval_every steps, and on SIGTERM / SIGINT a checkpoint and a clean stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from typing import Any, Callable, NamedTuple, Optional

import jax
import numpy as np

from t5x_like.data.loader import make_loader
from t5x_like.errors import NonFiniteLossError
from t5x_like.parallel import shard_batch
from t5x_like.train.checkpoints import Checkpointer
from t5x_like.train.metrics import MetricWriter
from t5x_like.train.preemption import Preemption
from t5x_like.train.prefetch import DevicePrefetcher

# Fault injection for the kill tests: T5X_LIKE_FAILPOINT="POINT@STEP" SIGKILLs this
# process at POINT ("before_row", "after_row", "after_save") of step STEP.
FAILPOINT_ENV = "T5X_LIKE_FAILPOINT"


def failpoint(point: str, step: int) -> None:
  """Dies by SIGKILL here when T5X_LIKE_FAILPOINT names this point and step."""
  wanted = os.environ.get(FAILPOINT_ENV)
  if wanted and wanted == f"{point}@{step}":
    os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def run_files(workdir: str, *, total_steps: int, keep: int, async_save: bool):
  """(Checkpointer of workdir/checkpoints, MetricWriter of workdir); both closed (after
  pending saves) on the way out, whatever happens."""
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), keep=keep,
                              async_save=async_save)
  writer = MetricWriter(workdir, total_steps=total_steps,
                        is_main_process=jax.process_index() == 0)
  try:
    yield checkpointer, writer
  finally:
    try:
      checkpointer.wait()
      checkpointer.close()
    finally:
      writer.close()


class Start(NamedTuple):
  """Where a run starts: step 0 and a fresh state, or its latest checkpoint."""
  step: int
  state: Any
  shardings: Any  # of the train state
  extra: Optional[dict]  # the checkpoint's extra (None: a fresh start)


def restore_or_create(checkpointer: Checkpointer, abstract_state, create: Callable[[], tuple],
                      setup) -> Start:
  """The latest checkpoint restored into `abstract_state`'s shardings, or
  create() -> (state, shardings) when there is none. setup.done() once the workdir holds
  a run (train/setup_guard.py: from then on nothing is undone)."""
  restored = checkpointer.restore_latest(abstract_state)
  setup.done()
  if restored is None:
    state, shardings = create()
    return Start(0, state, shardings, None)
  step, state, extra = restored
  return Start(step, state, jax.tree.map(lambda x: x.sharding, abstract_state), extra)


def device_batches(objective, batch_size: int, *, seed: int, mesh, rules, shuffle: bool = True,
                   data_state=None, num_workers: int = 0) -> DevicePrefetcher:
  """The loader's batches of `objective` (this host's rows), resumed at `data_state`
  (a checkpoint's "data"), sharded onto the mesh ahead of the step that takes them."""
  host_batches = iter(make_loader(objective, batch_size, seed=seed, shuffle=shuffle,
                                  num_workers=num_workers))
  if data_state is not None:
    host_batches.set_state(data_state)
  return DevicePrefetcher(host_batches, lambda b: shard_batch(b, mesh, rules))


@dataclasses.dataclass
class StepLoop:
  """What run_steps needs. evaluate(state, step) -> eval metrics, and eval_row(metrics)
  -> the scalars they add to the step's row; scalars(metrics, step, seconds per step)
  -> the train row; checkpoint_extra() -> what a checkpoint keeps besides the state and
  the loader's position ("data")."""

  train_step: Callable
  batches: DevicePrefetcher
  rng: jax.Array
  checkpointer: Checkpointer
  writer: MetricWriter
  preemption: Preemption
  evaluate: Callable[[Any, int], dict]
  scalars: Callable[[dict, int, float], dict]
  log_every: int
  checkpoint_every: int = 0
  eval_every: int = 0
  checkpoint_extra: Callable[[], dict] = dict
  eval_row: Callable[[dict], dict] = dict


def run_steps(loop: StepLoop, state, step: int, until_step: int):
  """Steps from `step` to `until_step`: (step, state, last eval metrics, stopped by a
  signal). The end is always evaluated and checkpointed.

  Each step writes at most one metrics row (train scalars and eval metrics together),
  and writes it before the step's checkpoint: a run killed at any moment resumes from
  a checkpoint whose rows are all written, and drops the rows after it
  (MetricWriter.truncate_after), so no row is lost or written twice.
  """
  checkpointer, writer = loop.checkpointer, loop.writer

  def save(step: int, force: bool = False):
    writer.flush()  # a remote metrics file holds every row its checkpoint has seen
    checkpointer.save(step, state, {"data": loop.batches.get_state(), **loop.checkpoint_extra()},
                      force=force)

  eval_metrics: dict = {}
  interval_start, interval_steps = time.perf_counter(), 0
  while step < until_step:
    state, metrics = loop.train_step(state, next(loop.batches), loop.rng)
    step += 1
    checkpointer.poll()  # a save that failed in the background stops the run now
    interval_steps += 1
    at_end = step == until_step
    at_checkpoint = bool(loop.checkpoint_every and step % loop.checkpoint_every == 0)
    stopping = bool(loop.preemption.requested) and not at_end
    row: dict = {}
    if step % loop.log_every == 0 or at_checkpoint or at_end or stopping:
      metrics = jax.device_get(metrics)
      loss = float(metrics["loss"])
      if not np.isfinite(loss):
        raise NonFiniteLossError(
            f"non-finite loss {loss} at step {step}; stopping. The last good checkpoint is"
            f" step {checkpointer.latest_step()}")
      seconds = (time.perf_counter() - interval_start) / interval_steps
      row.update(loop.scalars(metrics, step, seconds))
      writer.progress(step, loss)
      interval_start, interval_steps = time.perf_counter(), 0
    if at_end or (loop.eval_every and step % loop.eval_every == 0):
      eval_metrics = loop.evaluate(state, step)
      row.update(loop.eval_row(eval_metrics))
    failpoint("before_row", step)
    if row:
      writer.write_scalars(step, row)
    failpoint("after_row", step)
    if stopping:
      writer.log(f"{loop.preemption.requested}: saving a checkpoint at step {step} and"
                 " stopping; rerun the same command to resume")
      save(step, force=True)
      return step, state, eval_metrics, True
    if at_checkpoint or at_end:
      save(step, force=at_end)  # the end: the next phase (or a rerun) resumes here
      failpoint("after_save", step)
  return step, state, eval_metrics, False
