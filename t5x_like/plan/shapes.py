"""The phases of a config and the global batch shapes of each, without reading its data.

  phases = plan_phases(config)   # [Phase(name, steps, length, batch_shapes), ...]

Shapes come from the objective itself (objective.feature_shapes()) built over a tiny
synthetic TokenStore, so the config's real source (a TFDS dataset, files) is never
opened: shapes depend only on (objective, length, options) and the vocabulary's
special ids.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections
import numpy as np

from t5x_like.data.store import TokenStore
from t5x_like.data.vocab import Vocabulary
from t5x_like.experiment import build_objective, global_batch_shapes, phase_configs


@dataclasses.dataclass(frozen=True)
class Phase:
  """Steps [first_step, until_step) trained on batches of `batch_shapes`.

  batch_shapes: {feature: (global batch, ...)} as the loader would deliver them.
  """

  index: int
  first_step: int
  until_step: int
  length: int
  batch_shapes: dict
  config: ml_collections.ConfigDict

  @property
  def steps(self) -> int:
    return self.until_step - self.first_step


def model_vocab_size(config, vocab: Vocabulary) -> int:
  """config.model.overrides.vocab_size when set, else the vocabulary's size."""
  return int(config.model.overrides.get("vocab_size", vocab.vocab_size))


def synthetic_store(length: int, vocab: Vocabulary, seed: int = 0) -> TokenStore:
  """A small random corpus: 4 documents of 16-token sentences, each document several
  times `length` tokens long, so every objective can cut its first example from it."""
  rng = np.random.default_rng(seed)
  sentences = max(8, math.ceil(4 * length / 16))
  low = 5 if vocab.family == "bert" else 3  # above the special ids
  docs = [[rng.integers(low, vocab.vocab_size, 16) for _ in range(sentences)]
          for _ in range(4)]
  return TokenStore.from_documents(docs)


def batch_shapes_for(config, vocab: Vocabulary) -> dict[str, tuple]:
  """{feature: (config.train.batch_size, *per-example shape)} of config's objective."""
  objective = build_objective(config, synthetic_store(config.data.length, vocab), vocab,
                              seed=config.seed)
  return global_batch_shapes(objective, int(config.train.batch_size))


def plan_phases(config, vocab: Vocabulary) -> list[Phase]:
  """One Phase per config.train.phases entry (as training runs them), else one."""
  phases, first = [], 0
  for index, (until, phase_config) in enumerate(phase_configs(config)):
    phases.append(Phase(index, first, int(until), int(phase_config.data.length),
                        batch_shapes_for(phase_config, vocab), phase_config))
    first = int(until)
  return phases
