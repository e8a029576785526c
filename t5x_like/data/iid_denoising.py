"""The T5 paper's "BERT-style" objective for encoder-decoders (Raffel et al. 2020,
section 3.3.1 and Table 4): i.i.d. token corruption, the whole original text as target.

Each piece of `length - 1` raw tokens (plus EOS) becomes
  inputs  = the piece with each token corrupted independently with probability
            noise_density; a corrupted token becomes the sentinel <V-1> (T5's mask),
            or, with probability random_token_prob, a token drawn uniformly from the
            vocabulary (t5.data.preprocessors: iid_noise_mask with
            noise_token_to_random_token_or_sentinel)
  targets = the piece itself
both `length` long, so there is no padding. Example i of an epoch is a function of
(seed, epoch, i) only (data/objective.py).
"""

from __future__ import annotations

import numpy as np

from t5x_like.data.objective import (Example, Objective, ObjectiveSpec, example_rng,
                                     require_special_ids, shift_right)
from t5x_like.data.store import TokenStore
from t5x_like.data.streams import StreamCache


class IidDenoising(Objective):
  """Features (int32, all [length]): encoder_input_tokens, encoder_segment_ids,
  encoder_positions, decoder_target_tokens, decoder_input_tokens (targets shifted right,
  0 as BOS), decoder_loss_weights, decoder_segment_ids, decoder_positions."""

  def __init__(self, store: TokenStore, seed: int, *, length: int, vocab_size: int,
               eos_id: int, noise_density: float = 0.15, random_token_prob: float = 0.1):
    if length < 2:
      raise ValueError(f"length={length}: i.i.d. denoising needs at least 2 positions")
    if not 0.0 <= noise_density <= 1.0 or not 0.0 <= random_token_prob <= 1.0:
      raise ValueError(f"noise_density={noise_density} and random_token_prob="
                       f"{random_token_prob} must be in [0, 1]")
    self.store, self.seed, self.length = store, seed, length
    self.vocab_size, self.eos_id = vocab_size, eos_id
    self.noise_density, self.random_token_prob = noise_density, random_token_prob
    self._streams = StreamCache(store, seed, separator=None)

  def num_examples(self, epoch: int) -> int:
    return self._streams(epoch).length // (self.length - 1)

  def examples(self, indices: np.ndarray, epoch: int) -> Example:
    indices = np.asarray(indices, np.int64)
    n = self.length - 1
    pieces, _ = self._streams(epoch).window(indices * n, n)
    noise, use_random, random_tokens = [], [], []
    for i in indices:
      rng = example_rng(self.seed, epoch, int(i))
      noise.append(rng.random(n) < self.noise_density)
      use_random.append(rng.random(n) < self.random_token_prob)
      random_tokens.append(rng.integers(0, self.vocab_size, n))
    noise, use_random = np.stack(noise), np.stack(use_random)
    corrupt = np.where(use_random, np.stack(random_tokens), self.vocab_size - 1)
    eos = np.full((len(indices), 1), self.eos_id)
    inputs = np.concatenate([np.where(noise, corrupt, pieces), eos], 1).astype(np.int32)
    targets = np.concatenate([pieces, eos], 1).astype(np.int32)
    ones = np.ones_like(targets)
    positions = np.broadcast_to(np.arange(self.length, dtype=np.int32), targets.shape).copy()
    return {"encoder_input_tokens": inputs, "encoder_segment_ids": ones,
            "encoder_positions": positions, "decoder_target_tokens": targets,
            "decoder_input_tokens": shift_right(targets), "decoder_loss_weights": ones.copy(),
            "decoder_segment_ids": ones.copy(), "decoder_positions": positions.copy()}


def _build(store, vocab, *, seed, length, targets_length=None, **options) -> IidDenoising:
  del targets_length  # the targets are the inputs' length
  require_special_ids(vocab, SPEC, "eos_id")
  return IidDenoising(store, seed, length=length, vocab_size=vocab.vocab_size,
                      eos_id=vocab.eos_id, **options)


SPEC = ObjectiveSpec("iid_denoising", IidDenoising, vocab_family="t5",
                     model_family="encoder_decoder", default_length=512, build=_build,
                     filled=frozenset({"length", "vocab_size", "eos_id"}),
                     decoder_length=lambda length, targets_length, options: length)
