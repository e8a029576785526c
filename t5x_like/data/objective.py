"""The interface between objectives and the loader.

An objective turns a TokenStore into fixed-shape examples, each a pure function of
(seed, epoch, example index): the loader may ask for any example in any order, on
any host, after any restart, and gets the same arrays.
"""

from __future__ import annotations

import abc

import numpy as np

Example = dict[str, np.ndarray]


def example_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
  """The random generator of one example: seeded from (seed, epoch, index) only."""
  return np.random.default_rng([seed, epoch, index])


class Objective(abc.ABC):
  """Fixed-shape examples from a TokenStore, deterministic in (seed, epoch, index)."""

  seed: int

  @abc.abstractmethod
  def num_examples(self, epoch: int) -> int:
    """How many examples epoch `epoch` has (may differ between epochs)."""

  @abc.abstractmethod
  def example(self, index: int, epoch: int) -> Example:
    """Example `index` of `epoch`: {feature name: array} with shapes fixed by the config."""

  def examples(self, indices: np.ndarray, epoch: int) -> Example:
    """Examples stacked along a new leading batch axis (override to vectorise)."""
    rows = [self.example(int(i), epoch) for i in indices]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

  def feature_shapes(self) -> dict[str, tuple[int, ...]]:
    """Per-example shapes, read off example 0 of epoch 0."""
    return {k: v.shape for k, v in self.example(0, 0).items()}
