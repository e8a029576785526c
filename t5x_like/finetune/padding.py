"""Batches cut to their longest row: the padding every row of a batch leaves unused is
dropped from its sequence features, so a batch of 12-token sentences costs 16 positions,
not max_length, and T5's 3-token labels cost 8 target positions, not target_length
(Hugging Face's DataCollatorWithPadding pads the same way).

The cut length is the next power of two at or above the longest row's length (at least
8, at most the full length): one compiled step per length, 8, 16, 32, ... up to
max_length (5 of them for 128). It is computed from the rows of the whole global batch,
so every host cuts its part to the same length. A row's real positions are the nonzero
entries of its group's key feature (padding is 0; encoding.py); the cut drops only
zeros, so a model that masks padding sees the same real tokens with fewer padded keys.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

Features = dict[str, np.ndarray]

# (key feature whose nonzero entries are a row's real positions, the features cut with
# it): BERT's and T5's encoder inputs, T5's text-to-text targets (label string + eos; its
# causal decoder never looks past them, so the cut changes no real position's output),
# and a decoder-only backbone's inputs (GPT, where the token id 0 is a real token).
CUT_GROUPS = (("encoder_input_tokens", ("encoder_input_tokens", "encoder_type_ids")),
              ("decoder_loss_weights", ("decoder_input_tokens", "decoder_target_tokens",
                                        "decoder_loss_weights")),
              ("decoder_segment_ids", ("decoder_input_tokens", "decoder_segment_ids")))
MIN_LENGTH = 8


def used_lengths(real_NxL: np.ndarray) -> np.ndarray:
  """[N] int: one past each row's last nonzero entry (0 for an all-zero row)."""
  nonzero = np.asarray(real_NxL) != 0
  length = nonzero.shape[1]
  return np.where(nonzero.any(axis=1), length - np.argmax(nonzero[:, ::-1], axis=1), 0)


def cut_length(used: int, full: int) -> int:
  """The length a batch whose longest row uses `used` of `full` positions is cut to."""
  length = MIN_LENGTH
  while length < used:
    length *= 2
  return min(length, full)


def cut_lengths(rows: Features, groups: Sequence = CUT_GROUPS) -> dict[str, int]:
  """{feature: length} for the `groups` present in `rows` (the global batch's rows, or
  at least their key features): what every row of them leaves unused is cut."""
  lengths = {}
  for key, features in groups:
    if key not in rows:
      continue
    full = rows[key].shape[1]
    used = int(used_lengths(rows[key]).max(initial=0))
    lengths.update({name: cut_length(used, full) for name in features})
  return lengths


def cut(batch: Features, lengths: dict[str, int]) -> Features:
  """`batch` with each feature named in `lengths` cut to that many positions."""
  return {k: v[:, :lengths[k]] if k in lengths else v for k, v in batch.items()}
