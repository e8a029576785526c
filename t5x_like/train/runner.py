"""The step runner shared by pretraining (train/loop.py) and fine-tuning (finetune/loop.py).

  with open_run(workdir, total_steps=..., keep=..., async_save=...) as run:  # run_context
    start = run.start(abstract_state, create)
    batches = device_batches(objective, batch_size, seed=..., mesh=mesh, rules=rules,
                             data_state=start.extra and start.extra["data"])
    step, state, evals, stopped = run_steps(
        StepLoop(train_step, batches, rng, run, Every.of(config.train), evaluate, scalars),
        start.state, start.step, until)

One loop for both: the train step on device-prefetched batches of the deterministic
host-sharded loader, train rows every log_every steps (a non-finite loss stops the
run; the console's progress also shows the run's first step, so a slow start is seen
at once), checkpoints (with the loader's state) every checkpoint_every steps,
evaluation every eval_every steps, and on SIGTERM / SIGINT a checkpoint and a clean
stop.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from t5x_like import failpoints
from t5x_like.data.loader import make_loader
from t5x_like.errors import NonFiniteLossError
from t5x_like.parallel import shard_batch
from t5x_like.train.prefetch import DevicePrefetcher
from t5x_like.train.run_context import Run


def device_batches(objective, batch_size: int, *, seed: int, mesh, rules, shuffle: bool = True,
                   data_state=None, num_workers: int = 0) -> DevicePrefetcher:
  """The loader's batches of `objective` (this host's rows), resumed at `data_state`
  (a checkpoint's "data"), sharded onto the mesh ahead of the step that takes them."""
  host_batches = iter(make_loader(objective, batch_size, seed=seed, shuffle=shuffle,
                                  num_workers=num_workers))
  if data_state is not None:
    host_batches.set_state(data_state)
  return DevicePrefetcher(host_batches, lambda b: shard_batch(b, mesh, rules))


class Every(NamedTuple):
  """When run_steps writes a train row, checkpoints and evaluates: every `log`,
  `checkpoint` and `eval` steps (0: never). The last step always does all three."""
  log: int
  checkpoint: int = 0
  eval: int = 0

  @classmethod
  def of(cls, train_config) -> "Every":
    """From config.train's log_every, checkpoint_every and eval_every."""
    return cls(train_config.log_every, train_config.checkpoint_every, train_config.eval_every)

  def logs(self, step: int) -> bool:
    return step % self.log == 0

  def checkpoints(self, step: int) -> bool:
    return bool(self.checkpoint and step % self.checkpoint == 0)

  def evaluates(self, step: int) -> bool:
    return bool(self.eval and step % self.eval == 0)


@dataclasses.dataclass
class StepLoop:
  """What run_steps needs besides the state: train_step(state, batch, rng) -> (state,
  metrics) on `batches`; the run's checkpointer, writer and preemption (`run`); when
  (`every`); evaluate(state, step) -> eval metrics, and eval_row(metrics) -> the scalars
  they add to the step's row; scalars(metrics, step, seconds per step) -> the train
  row; checkpoint_extra: what a checkpoint keeps besides the state and the loader's
  position ("data")."""

  train_step: Callable
  batches: DevicePrefetcher
  rng: jax.Array
  run: Run
  every: Every
  evaluate: Callable[[Any, int], dict]
  scalars: Callable[[dict, int, float], dict]
  eval_row: Callable[[dict], dict] = dict
  checkpoint_extra: dict = dataclasses.field(default_factory=dict)


# Steps dispatched ahead of the device (jit dispatch is asynchronous). Unbounded, the
# host ran up to a log interval ahead, and on fake CPU devices XLA's cap on in-flight
# computations per device then deadlocked a step's all-reduce: one device's launch
# waited for a slot while the others sat in the collective (docs/known-issues.md).
MAX_STEPS_IN_FLIGHT = 2


def run_steps(loop: StepLoop, state, step: int, until_step: int):
  """Steps from `step` to `until_step`: (step, state, last eval metrics, stopped by a
  signal). The end is always evaluated and checkpointed.

  Each step writes at most one metrics row (train scalars and eval metrics together),
  and writes it before the step's checkpoint: a run killed at any moment resumes from
  a checkpoint whose rows are all written, and drops the rows after it
  (MetricWriter.truncate_after), so no row is lost or written twice.
  """
  run, every = loop.run, loop.every
  checkpointer, writer = run.checkpointer, run.writer

  def save(step: int, force: bool = False):
    writer.flush()  # a remote metrics file holds every row its checkpoint has seen
    checkpointer.save(step, state, {"data": loop.batches.get_state(), **loop.checkpoint_extra},
                      force=force)

  eval_metrics: dict = {}
  first_step = step + 1  # shown on the console at once: log_every may be minutes away
  interval_start, interval_steps = time.perf_counter(), 0
  failpoints.kill_soon("first_compile", step + 1)  # the kill matrix (tests/kill_matrix.py)
  in_flight: collections.deque = collections.deque()  # losses of unfinished steps
  while step < until_step:
    state, metrics = loop.train_step(state, next(loop.batches), loop.rng)
    in_flight.append(metrics["loss"])
    if len(in_flight) > MAX_STEPS_IN_FLIGHT:
      in_flight.popleft().block_until_ready()
    step += 1
    failpoints.kill_at("in_step", step)  # dispatched, not finished
    failpoints.interrupt_at(step)
    checkpointer.poll()  # a save that failed in the background stops the run now
    interval_steps += 1
    at_end = step == until_step
    at_checkpoint = every.checkpoints(step)
    stopping = bool(run.preemption.requested) and not at_end
    row: dict = {}
    if every.logs(step) or at_checkpoint or at_end or stopping:
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
    elif step == first_step:  # progress only: the rows keep their log_every steps
      writer.progress(step, float(jax.device_get(metrics["loss"])))
    if at_end or every.evaluates(step):
      eval_metrics = loop.evaluate(state, step)
      row.update(loop.eval_row(eval_metrics))
    failpoints.kill_at("before_row", step)  # the kill tests (t5x_like/failpoints.py)
    if row:
      writer.write_scalars(step, row)
    failpoints.kill_at("after_row", step)
    if stopping:
      writer.log(f"{run.preemption.requested}: saving a checkpoint at step {step} and"
                 " stopping; rerun the same command to resume")
      save(step, force=True)
      return step, state, eval_metrics, True
    if at_checkpoint or at_end:
      save(step, force=at_end)  # the end: the next phase (or a rerun) resumes here
      failpoints.kill_at("after_save", step)
  return step, state, eval_metrics, False
