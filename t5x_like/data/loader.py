"""The deterministic, resumable, host-sharded loader (grain).

Global batch `step` is a pure function of (objective, seed, step): positions
[step * G, (step + 1) * G) of the endless sequence of epochs, each epoch a seeded
permutation of the objective's examples. Host h of P reads rows
[h * G/P, (h + 1) * G/P) of it and generates only those examples; the permutation is
evaluated at those positions only (data/index_shuffle.py: O(G/P) work and memory per
step, never a table of the epoch's examples). The grain iterator's state is just the
next step, so a restored iterator yields exactly the batches an uninterrupted one would
have.
"""

from __future__ import annotations

import bisect
from typing import Optional

import grain
from absl import flags
import jax
import numpy as np

from t5x_like.data.index_shuffle import shuffled
from t5x_like.data.objective import Example, Objective

_SHUFFLE_STREAM = 0x5EED  # the epoch permutation's key: (seed, epoch, _SHUFFLE_STREAM)


class BatchPlan:
  """Which examples make each global batch, and which rows this host reads."""

  def __init__(self, objective: Objective, global_batch_size: int, *, seed: int,
               shuffle: bool = True, num_epochs: Optional[int] = None,
               process_index: int = 0, process_count: int = 1):
    if global_batch_size <= 0:
      raise ValueError(f"global_batch_size={global_batch_size}: must be positive")
    if global_batch_size % process_count:
      raise ValueError(f"global_batch_size={global_batch_size} does not divide over"
                       f" process_count={process_count} hosts")
    if not 0 <= process_index < process_count:
      raise ValueError(f"process_index={process_index} not in [0, {process_count})")
    self.objective = objective
    self.global_batch_size = global_batch_size
    self.seed = seed
    self.shuffle = shuffle
    self.num_epochs = num_epochs
    self.process_index = process_index
    self.process_count = process_count
    self._epoch_ends = [0]  # cumulative example counts, grown on demand

  @property
  def host_batch_size(self) -> int:
    return self.global_batch_size // self.process_count

  def _epoch_size(self, epoch: int) -> int:
    n = self.objective.num_examples(epoch)
    if n <= 0:
      raise ValueError(f"the objective has no examples in epoch {epoch}: the source is too"
                       " small for the sequence length")
    return n

  def _epoch_of(self, position: int) -> int:
    while self._epoch_ends[-1] <= position:
      self._epoch_ends.append(self._epoch_ends[-1] + self._epoch_size(len(self._epoch_ends) - 1))
    return bisect.bisect_right(self._epoch_ends, position) - 1

  @property
  def num_steps(self) -> Optional[int]:
    """Whole global batches in num_epochs (the remainder is dropped); None: endless."""
    if self.num_epochs is None:
      return None
    self._epoch_of(0)
    total = sum(self._epoch_size(e) for e in range(self.num_epochs))
    return total // self.global_batch_size

  def _epoch_examples(self, epoch: int, offsets: np.ndarray) -> np.ndarray:
    """Example indices [M] at reading positions `offsets` [M] of `epoch` (a seeded
    permutation of its examples, evaluated at those positions only)."""
    if not self.shuffle:
      return offsets
    size = self._epoch_ends[epoch + 1] - self._epoch_ends[epoch]
    return shuffled(offsets, size, (self.seed, epoch, _SHUFFLE_STREAM))

  def host_runs(self, step: int) -> list[tuple[int, np.ndarray]]:
    """This host's rows of global batch `step` as (epoch, example indices [M]) runs, in
    row order (one run per epoch the rows reach)."""
    position = step * self.global_batch_size + self.process_index * self.host_batch_size
    end = position + self.host_batch_size
    runs = []
    while position < end:
      epoch = self._epoch_of(position)
      run_end = min(end, self._epoch_ends[epoch + 1])
      offsets = np.arange(position, run_end, dtype=np.int64) - self._epoch_ends[epoch]
      runs.append((epoch, self._epoch_examples(epoch, offsets)))
      position = run_end
    return runs

  def host_examples(self, step: int) -> list[tuple[int, int]]:
    """(epoch, example index) of each row this host reads in global batch `step`."""
    return [(epoch, int(i)) for epoch, indices in self.host_runs(step) for i in indices]

  def host_batch(self, step: int) -> Example:
    """This host's rows of global batch `step`: {feature: [G / P, ...] array}."""
    parts = [self.objective.examples(indices, epoch) for epoch, indices in self.host_runs(step)]
    if len(parts) == 1:
      return parts[0]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def make_loader(objective: Objective, global_batch_size: int, *, seed: int,
                shuffle: bool = True, num_epochs: Optional[int] = None,
                process_index: Optional[int] = None, process_count: Optional[int] = None,
                num_workers: int = 0, worker_buffer_size: int = 2) -> grain.IterDataset:
  """A grain IterDataset of this host's batches; iterate, and checkpoint with
  `iterator.get_state()` / `iterator.set_state(state)`.

  process_index / process_count default to jax's. num_workers > 0 generates batches
  in worker processes (grain's mp_prefetch); the order stays deterministic.
  """
  plan = BatchPlan(objective, global_batch_size, seed=seed, shuffle=shuffle,
                   num_epochs=num_epochs,
                   process_index=jax.process_index() if process_index is None else process_index,
                   process_count=jax.process_count() if process_count is None else process_count)
  steps = plan.num_steps
  dataset = grain.MapDataset.range(0, steps if steps is not None else 2 ** 62)
  dataset = dataset.map(plan.host_batch).to_iter_dataset(
      grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  if num_workers > 0:
    if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; take their defaults
      flags.FLAGS.mark_as_parsed()
    dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(
        num_workers=num_workers, per_worker_buffer_size=worker_buffer_size))
  return dataset
