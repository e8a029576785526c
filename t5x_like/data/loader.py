"""The deterministic, resumable, host-sharded loader (grain).

Global batch `step` is a pure function of (objective, seed, step): positions
[step * G, (step + 1) * G) of the endless sequence of epochs, each epoch a seeded
permutation of the objective's examples (in order for an objective that reads in
order, a mixture: data/mixture.py). Host h of P reads rows
[h * G/P, (h + 1) * G/P) of it and generates only those examples; the permutation is
evaluated at those positions only (data/index_shuffle.py: O(G/P) work and memory per
step, never a table of the epoch's examples). The grain iterator's state is just the
next step, so a restored iterator yields exactly the batches an uninterrupted one would
have.
"""

from __future__ import annotations

import bisect
from typing import Callable, Optional

import grain
from absl import flags
import jax
import numpy as np

from t5x_like.data.index_shuffle import shuffled
from t5x_like.data.objective import Example, Objective

_SHUFFLE_STREAM = 0x5EED  # the epoch permutation's key: (seed, epoch, _SHUFFLE_STREAM)


class EpochSequence:
  """The endless sequence of epochs of an objective, read position by position.

  Position p of the sequence is example `examples_at(e, p - start(e))` of epoch e =
  `epoch_of(p)`; each epoch is read in the seeded permutation keyed by (seed, e,
  stream) (data/index_shuffle.py), or in order without shuffle. Epoch sizes come from
  num_examples(epoch), asked for on demand and remembered.
  """

  def __init__(self, num_examples: Callable[[int], int], *, seed: int, stream: int,
               shuffle: bool = True):
    self.num_examples, self.seed, self.stream, self.shuffle = num_examples, seed, stream, shuffle
    self._epoch_ends = [0]  # cumulative example counts, grown on demand

  def start(self, epoch: int) -> int:
    """The position of epoch `epoch`'s first example."""
    while len(self._epoch_ends) <= epoch:
      self._epoch_ends.append(self._epoch_ends[-1] + self.num_examples(len(self._epoch_ends) - 1))
    return self._epoch_ends[epoch]

  def _grow(self, position: int) -> None:
    """Epoch sizes known through the epoch holding `position`."""
    while self._epoch_ends[-1] <= position:
      self.start(len(self._epoch_ends))

  def epoch_of(self, position: int) -> int:
    self._grow(position)
    return bisect.bisect_right(self._epoch_ends, position) - 1

  def examples_at(self, epoch: int, offsets: np.ndarray) -> np.ndarray:
    """Example indices [M] at reading offsets [M] of `epoch` (its seeded permutation,
    evaluated at those offsets only)."""
    if not self.shuffle:
      return offsets
    size = self.start(epoch + 1) - self.start(epoch)
    return shuffled(offsets, size, (self.seed, epoch, self.stream))

  def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(epoch [M], example index [M]) at `positions` [M] (any order) of the sequence."""
    positions = np.asarray(positions, np.int64)
    epochs = np.zeros(positions.shape, np.int64)
    examples = np.zeros(positions.shape, np.int64)
    if positions.size:
      self._grow(int(positions.max()))
      ends = np.asarray(self._epoch_ends, np.int64)
      epochs = np.searchsorted(ends, positions, side="right") - 1
      for epoch in np.unique(epochs).tolist():
        at = epochs == epoch
        examples[at] = self.examples_at(epoch, positions[at] - ends[epoch])
    return epochs, examples


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
    self.epochs = EpochSequence(self._epoch_size, seed=seed, stream=_SHUFFLE_STREAM,
                                shuffle=shuffle and not objective.reads_in_order)

  @property
  def host_batch_size(self) -> int:
    return self.global_batch_size // self.process_count

  def _epoch_size(self, epoch: int) -> int:
    n = self.objective.num_examples(epoch)
    if n <= 0:
      raise ValueError(f"the objective has no examples in epoch {epoch}: the source is too"
                       " small for the sequence length")
    return n

  @property
  def num_steps(self) -> Optional[int]:
    """Whole global batches in num_epochs (the remainder is dropped); None: endless."""
    if self.num_epochs is None:
      return None
    return self.epochs.start(self.num_epochs) // self.global_batch_size

  def host_runs(self, step: int) -> list[tuple[int, np.ndarray]]:
    """This host's rows of global batch `step` as (epoch, example indices [M]) runs, in
    row order (one run per epoch the rows reach)."""
    position = step * self.global_batch_size + self.process_index * self.host_batch_size
    return self._runs(position, position + self.host_batch_size)

  def global_runs(self, step: int) -> list[tuple[int, np.ndarray]]:
    """Every host's rows of global batch `step`, as host_runs gives them."""
    position = step * self.global_batch_size
    return self._runs(position, position + self.global_batch_size)

  def _runs(self, position: int, end: int) -> list[tuple[int, np.ndarray]]:
    runs = []
    while position < end:
      epoch = self.epochs.epoch_of(position)
      run_end = min(end, self.epochs.start(epoch + 1))
      offsets = np.arange(position, run_end, dtype=np.int64) - self.epochs.start(epoch)
      runs.append((epoch, self.epochs.examples_at(epoch, offsets)))
      position = run_end
    return runs

  def host_examples(self, step: int) -> list[tuple[int, int]]:
    """(epoch, example index) of each row this host reads in global batch `step`."""
    return [(epoch, int(i)) for epoch, indices in self.host_runs(step) for i in indices]

  def host_batch(self, step: int) -> Example:
    """This host's rows of global batch `step`: {feature: [G / P, ...] array}."""
    parts = [self.objective.examples(indices, epoch) for epoch, indices in self.host_runs(step)]
    batch = parts[0] if len(parts) == 1 else {
        k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    if self.objective.fits_batches:
      batch = self.objective.fit_batch(batch, self.global_runs(step))
    return batch


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
