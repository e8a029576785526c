"""Causal LM and prefix LM examples from the per-epoch document stream.

The stream: the documents of an epoch in its seeded two-level order (chunks of
documents, then the documents within each chunk; streams.py), each followed by `eos_id`,
back to back.

CausalLM (GPT-2 style packing): row i = stream[i*L : (i+1)*L], the partial tail
dropped. Every token is a target; a new segment starts at each document start in the
row, and the decoder input restarts there with 0 (BOS).

PrefixLM, decoder-only (`length=L`): row i = stream[i*L : (i+1)*L] = t_0 .. t_{L-1},
split s uniform in [1, L-1] from example_rng(seed, epoch, i):
  decoder_target_tokens    = t_0 .. t_{L-1}
  decoder_input_tokens     = 0, t_0 .. t_{L-2}
  decoder_causal_attention = 1 at positions 0 .. s (the positions whose *input* is BOS
                             or a prefix token, seqio's PrefixLM convention), else 0
  decoder_loss_weights     = 0 at positions 0 .. s-1, 1 at s .. L-1 (the continuation)
  decoder_segment_ids = 1, decoder_positions = 0 .. L-1 (a window is one segment; a
  document change inside it shows as the EOS).

PrefixLM, encoder-decoder (`inputs_length=Li, targets_length=Lt`): row i =
stream[i*W : (i+1)*W] with W = min(Li, Lt) (as T5's prefix_lm: the split is uniform
over the whole window, so both sides must fit it), s uniform in [1, W-1]:
  encoder_input_tokens  = t_0 .. t_{s-1}, EOS, 0 padding to Li
  decoder_target_tokens = t_s .. t_{W-1}, EOS, 0 padding to Lt
  decoder_input_tokens  = 0, t_s .. t_{W-1}, 0 padding (targets shifted right)
  *_segment_ids = 1 on real tokens, 0 on padding; *_positions = 0, 1, ... on real
  tokens, 0 on padding; decoder_loss_weights = decoder_segment_ids.
All features are int32.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from t5x_like.data.objective import (Example, Objective, ObjectiveSpec, example_rng,
                                     require_special_ids)
from t5x_like.data.streams import StreamCache
from t5x_like.data.store import TokenStore


def packed_features(tokens: np.ndarray, segment_start: np.ndarray) -> Example:
  """Decoder features of packed rows: tokens [B, T], segment_start [B, T] bool (a new
  segment starts there; position 0 always starts one)."""
  batch, length = tokens.shape
  starts = segment_start.copy()
  starts[:, 0] = True
  pos = np.arange(length, dtype=np.int32)[None, :]
  segment_ids = np.cumsum(starts, 1, dtype=np.int32)
  positions = pos - np.maximum.accumulate(np.where(starts, pos, 0), axis=1)
  inputs = np.zeros_like(tokens)
  inputs[:, 1:] = tokens[:, :-1]
  inputs[starts] = 0
  return {
      "decoder_target_tokens": tokens.astype(np.int32),
      "decoder_input_tokens": inputs.astype(np.int32),
      "decoder_loss_weights": np.ones((batch, length), np.int32),
      "decoder_segment_ids": segment_ids,
      "decoder_positions": positions.astype(np.int32),
  }


class CausalLM(Objective):
  """Packed causal-LM rows of `length` tokens: decoder_target_tokens, decoder_input_tokens,
  decoder_loss_weights, decoder_segment_ids, decoder_positions [length]."""

  def __init__(self, store: TokenStore, seed: int, *, length: int, eos_id: int):
    self.store, self.seed, self.length, self.eos_id = store, seed, length, eos_id
    self._streams = StreamCache(store, seed, separator=eos_id)

  def num_examples(self, epoch: int) -> int:
    return self._streams(epoch).length // self.length

  def examples(self, indices: np.ndarray, epoch: int) -> Example:
    indices = np.asarray(indices, np.int64)
    tokens, doc_start = self._streams(epoch).window(indices * self.length, self.length)
    return packed_features(tokens, doc_start)


class PrefixLM(Objective):
  """Prefix-LM examples, decoder-only (`length`) or encoder-decoder (`inputs_length`,
  `targets_length`); the exact layouts are in the module docstring."""

  def __init__(self, store: TokenStore, seed: int, *, eos_id: int,
               length: Optional[int] = None, inputs_length: Optional[int] = None,
               targets_length: Optional[int] = None):
    if (length is None) == (inputs_length is None or targets_length is None):
      raise ValueError("PrefixLM takes either length (decoder-only) or inputs_length and"
                       " targets_length (encoder-decoder)")
    self.store, self.seed, self.eos_id = store, seed, eos_id
    self.length, self.inputs_length, self.targets_length = (length, inputs_length,
                                                           targets_length)
    self.window = length if length is not None else min(inputs_length, targets_length)
    if self.window < 2:
      raise ValueError("PrefixLM needs windows of at least 2 tokens")
    self._streams = StreamCache(store, seed, separator=eos_id)

  @property
  def encoder_decoder(self) -> bool:
    return self.length is None

  def num_examples(self, epoch: int) -> int:
    return self._streams(epoch).length // self.window

  def split_points(self, indices: np.ndarray, epoch: int) -> np.ndarray:
    """[B] prefix lengths, uniform in [1, window - 1] from each example's rng."""
    return np.array([example_rng(self.seed, epoch, int(i)).integers(1, self.window)
                     for i in indices], np.int64)

  def examples(self, indices: np.ndarray, epoch: int) -> Example:
    indices = np.asarray(indices, np.int64)
    W = self.window
    tokens, _ = self._streams(epoch).window(indices * W, W)
    split = self.split_points(indices, epoch)[:, None]
    batch = len(indices)
    if not self.encoder_decoder:
      pos = np.arange(W, dtype=np.int64)[None, :]
      inputs = np.zeros_like(tokens)
      inputs[:, 1:] = tokens[:, :-1]
      return {
          "decoder_target_tokens": tokens,
          "decoder_input_tokens": inputs,
          "decoder_loss_weights": (pos >= split).astype(np.int32),
          "decoder_causal_attention": (pos <= split).astype(np.int32),
          "decoder_segment_ids": np.ones((batch, W), np.int32),
          "decoder_positions": np.broadcast_to(pos.astype(np.int32), (batch, W)).copy(),
      }
    Li, Lt = self.inputs_length, self.targets_length
    enc_pos = np.arange(Li, dtype=np.int64)[None, :]
    enc_real = enc_pos <= split  # s prefix tokens and the EOS
    enc = np.where(enc_pos < split, tokens[:, np.minimum(enc_pos[0], W - 1)], 0)
    enc = np.where(enc_pos == split, self.eos_id, enc)
    dec_pos = np.arange(Lt, dtype=np.int64)[None, :]
    cont = W - split  # continuation tokens, then the EOS
    dec_real = dec_pos <= cont
    dec = np.where(dec_pos < cont, tokens[np.arange(batch)[:, None],
                                          np.minimum(split + dec_pos, W - 1)], 0)
    dec = np.where(dec_pos == cont, self.eos_id, dec)
    dec_in = np.zeros_like(dec)
    dec_in[:, 1:] = dec[:, :-1]
    dec_in = np.where(dec_real, dec_in, 0)
    return {
        "encoder_input_tokens": enc.astype(np.int32),
        "encoder_segment_ids": enc_real.astype(np.int32),
        "encoder_positions": np.where(enc_real, enc_pos, 0).astype(np.int32),
        "decoder_target_tokens": dec.astype(np.int32),
        "decoder_input_tokens": dec_in.astype(np.int32),
        "decoder_loss_weights": dec_real.astype(np.int32),
        "decoder_segment_ids": dec_real.astype(np.int32),
        "decoder_positions": np.where(dec_real, dec_pos, 0).astype(np.int32),
    }


def _causal_lm(store, vocab, *, seed, length, targets_length=None, **options) -> CausalLM:
  del targets_length
  require_special_ids(vocab, CAUSAL_LM, "eos_id")
  return CausalLM(store, seed, length=length, eos_id=vocab.eos_id, **options)


def _prefix_lm(store, vocab, *, seed, length, targets_length=None, **options) -> PrefixLM:
  del targets_length
  require_special_ids(vocab, PREFIX_LM, "eos_id")
  return PrefixLM(store, seed, eos_id=vocab.eos_id, length=length, **options)


def _prefix_lm_encdec(store, vocab, *, seed, length, targets_length=None,
                      **options) -> PrefixLM:
  require_special_ids(vocab, PREFIX_LM_ENCDEC, "eos_id")
  if not targets_length:
    raise ValueError("objective 'prefix_lm_encdec' needs targets_length")
  return PrefixLM(store, seed, eos_id=vocab.eos_id, inputs_length=length,
                  targets_length=targets_length, **options)


_LM_FILLED = frozenset({"length", "inputs_length", "targets_length", "eos_id"})
CAUSAL_LM = ObjectiveSpec("causal_lm", CausalLM, vocab_family="gpt", model_family="decoder",
                          default_length=1024, build=_causal_lm, filled=_LM_FILLED)
PREFIX_LM = ObjectiveSpec("prefix_lm", PrefixLM, vocab_family="gpt", model_family="decoder",
                          default_length=1024, build=_prefix_lm, filled=_LM_FILLED)
PREFIX_LM_ENCDEC = ObjectiveSpec("prefix_lm_encdec", PrefixLM, vocab_family="t5",
                                 model_family="encoder_decoder", default_length=512,
                                 build=_prefix_lm_encdec, filled=_LM_FILLED,
                                 needs_targets_length=True,
                                 decoder_length=lambda length, targets_length, options:
                                 targets_length)
