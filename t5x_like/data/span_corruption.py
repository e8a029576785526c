"""T5 span corruption (Raffel et al. 2020, section 3.1.4; seqio's span_corruption) and
the C4-style pipeline around it.

One piece of `n` raw tokens becomes
  inputs  = nonnoise_0, <V-1>, nonnoise_1, <V-2>, ..., nonnoise_{s-1}, <V-s>, EOS
  targets = <V-1>, noise_0, <V-2>, noise_1, ..., <V-s>, noise_{s-1}, EOS
where the `s` noise spans and `s` non-noise spans are random compositions of the
noise / non-noise token counts, laid out alternately, non-noise first.

`SpanCorruption` concatenates the documents of each epoch (seeded order, no
separator), cuts the stream into pieces of the raw length that fills
`inputs_length` exactly, and corrupts piece i with example_rng(seed, epoch, i).
"""

from __future__ import annotations

import numpy as np

from t5x_like.data.objective import (Example, Objective, ObjectiveSpec, example_rng,
                                     require_special_ids, shift_right)
from t5x_like.data.streams import StreamCache
from t5x_like.data.store import TokenStore


def _lengths(n: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
  """(inputs_len, targets_len) of a raw piece of n tokens, as T5's random_spans_helper."""
  noise = int(round(n * noise_density))  # Python round: half to even
  spans = int(round(noise / mean_noise_span_length))
  return (n - noise) + spans + 1, noise + spans + 1


def span_corruption_lengths(inputs_length: int, noise_density: float = 0.15,
                            mean_noise_span_length: float = 3.0) -> tuple[int, int]:
  """(raw_length, targets_length): the largest raw piece whose inputs fit inputs_length.

  512 -> (568, 114), 128 -> (141, 29), 256 -> (284, 58), 1024 -> (1137, 229).
  """
  n = inputs_length - 1
  while _lengths(n + 1, noise_density, mean_noise_span_length)[0] <= inputs_length:
    n += 1
  return n, _lengths(n, noise_density, mean_noise_span_length)[1]


def span_targets_length(inputs_length: int, noise_density: float = 0.15,
                        mean_noise_span_length: float = 3.0) -> int:
  """The decoder's length at inputs_length: span_corruption_lengths' targets_length, or
  more where the mask clamps the noise into [1, n - 1] (tiny densities). 128 -> 29."""
  raw, targets = span_corruption_lengths(inputs_length, noise_density, mean_noise_span_length)
  if raw < 2:
    return targets
  noise, spans = mask_counts(raw, noise_density, mean_noise_span_length)
  return max(targets, noise + spans + 1)


def mask_counts(n: int, noise_density: float, mean_noise_span_length: float,
                max_spans: int | None = None) -> tuple[int, int]:
  """(noise tokens, spans) of the mask of an n-token piece (n >= 2).

  noise is clamped into [1, n-1], spans = max(1, round(noise / mean)). spans is also
  capped at min(noise, n - noise) so that both compositions exist; the cap only bites
  for extreme parameters (e.g. density > 0.5 with short spans), never for T5's. A
  caller with a finite set of sentinels caps spans at max_spans (longer spans).
  """
  noise = min(max(int(round(n * noise_density)), 1), n - 1)
  spans = max(1, int(round(noise / mean_noise_span_length)))
  if max_spans is not None:
    spans = min(spans, max(1, max_spans))
  return noise, min(spans, noise, n - noise)


def _span_draws(rng: np.random.Generator, n: int, noise: int, spans: int) -> np.ndarray:
  """All of a piece's randomness: one uniform key per gap between two noise tokens and
  per gap between two non-noise tokens ([n - 2] floats; none with a single span)."""
  return rng.random(n - 2 if spans > 1 else 0)


def _compositions(keys: np.ndarray, total: int, parts: int) -> np.ndarray:
  """keys [B, total-1] -> [B, parts] positive lengths summing to `total`: the cut points
  are the parts-1 gaps with the smallest keys, a uniformly random set of them, so the
  lengths are a uniformly random composition (T5's _random_segmentation)."""
  batch = keys.shape[0]
  if parts == 1:
    return np.full((batch, 1), total, np.int64)
  cuts = np.sort(np.argpartition(keys, parts - 2, axis=1)[:, :parts - 1], axis=1) + 1
  edges = np.concatenate([np.zeros((batch, 1), np.int64), cuts,
                          np.full((batch, 1), total, np.int64)], 1)
  return np.diff(edges, axis=1)


def _span_lengths(draws: np.ndarray, n: int, noise: int, spans: int) -> np.ndarray:
  """draws [B, n-2] -> [B, 2 * spans] interleaved lengths: nonnoise_0, noise_0, ..."""
  noise_lengths = _compositions(draws[:, :noise - 1], noise, spans)
  nonnoise_lengths = _compositions(draws[:, noise - 1:], n - noise, spans)
  return np.stack([nonnoise_lengths, noise_lengths], 2).reshape(len(draws), 2 * spans)


def _corrupt_batch(tokens: np.ndarray, span_lengths: np.ndarray, *, vocab_size: int,
                   eos_id: int) -> tuple[np.ndarray, np.ndarray]:
  """tokens [B, n] and interleaved span lengths [B, 2s] -> inputs [B, n-noise+s+1],
  targets [B, noise+s+1] (every row has the same counts)."""
  batch, n = tokens.shape
  spans = span_lengths.shape[1] // 2
  noise = int(span_lengths[0, 1::2].sum())
  toggles = np.zeros((batch, n), np.int32)  # 1 where a span (of either kind) starts
  boundaries = np.cumsum(span_lengths, 1)[:, :-1]
  toggles[np.arange(batch)[:, None], boundaries] = 1
  span_index = np.cumsum(toggles, 1)  # 0, 1, 2, ...: even non-noise, odd noise
  is_noise = (span_index & 1).astype(bool)
  sentinel = (vocab_size - 1 - (span_index >> 1)).astype(np.int32)
  toggles[:, 0] = 1
  starts = toggles.astype(bool)
  eos = np.full((batch, 1), eos_id, np.int32)
  # inputs: non-noise tokens, each noise span collapsed onto its sentinel
  keep = ~is_noise | starts
  values = np.where(is_noise & starts, sentinel, tokens)
  inputs = np.concatenate([values[keep].reshape(batch, n - noise + spans), eos], 1)
  # targets: noise tokens, each non-noise span collapsed onto the next span's sentinel
  keep = is_noise | starts
  values = np.where(~is_noise & starts, sentinel, tokens)
  targets = np.concatenate([values[keep].reshape(batch, noise + spans), eos], 1)
  return inputs, targets


def span_corruption(tokens: np.ndarray, rng: np.random.Generator, *, vocab_size: int,
                    noise_density: float = 0.15, mean_noise_span_length: float = 3.0,
                    eos_id: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """Corrupts one piece of token ids [n] (no EOS) -> (inputs, targets), int32 with EOS.

  Sentinels count down from vocab_size - 1. A piece of 1 token has no noise
  (inputs = [x0, EOS], targets = [EOS]), as in T5 which pads the mask to length 2.
  """
  tokens = np.asarray(tokens, np.int32).reshape(-1)
  n = len(tokens)
  if n < 2:
    return (np.concatenate([tokens, [np.int32(eos_id)]]).astype(np.int32),
            np.array([eos_id], np.int32))
  noise, spans = mask_counts(n, noise_density, mean_noise_span_length)
  inputs, targets = corrupt_pieces(tokens[None], [rng], noise, spans,
                                   vocab_size=vocab_size, eos_id=eos_id)
  return inputs[0], targets[0]


def corrupt_pieces(pieces: np.ndarray, rngs, noise: int, spans: int, *, vocab_size: int,
                   eos_id: int) -> tuple[np.ndarray, np.ndarray]:
  """pieces [B, n] (n >= 2), one generator per row -> (inputs [B, n - noise + spans + 1],
  targets [B, noise + spans + 1]): each row's `spans` noise spans of `noise` tokens in
  all, drawn from its generator (the same draws as span_corruption's)."""
  n = pieces.shape[1]
  draws = np.stack([_span_draws(rng, n, noise, spans) for rng in rngs])
  lengths = _span_lengths(draws, n, noise, spans)
  return _corrupt_batch(pieces, lengths, vocab_size=vocab_size, eos_id=eos_id)


def _pad(rows: np.ndarray, length: int) -> np.ndarray:
  out = np.zeros((rows.shape[0], length), np.int32)
  width = min(length, rows.shape[1])
  out[:, :width] = rows[:, :width]
  return out


class SpanCorruption(Objective):
  """T5 span-corruption pretraining examples (t5.data.preprocessors.span_corruption).

  Features (int32): encoder_input_tokens / encoder_segment_ids / encoder_positions
  [inputs_length]; decoder_target_tokens / decoder_input_tokens (targets shifted right,
  0 as BOS) / decoder_loss_weights / decoder_segment_ids / decoder_positions
  [targets_length]. Segment ids are 1 on real tokens and 0 on padding; a full piece
  fills both lengths exactly, so there is no padding (one piece per row).
  """

  def __init__(self, store: TokenStore, seed: int, *, inputs_length: int = 512,
               vocab_size: int, noise_density: float = 0.15,
               mean_noise_span_length: float = 3.0, eos_id: int = 1):
    self.store, self.seed = store, seed
    self.inputs_length = inputs_length
    self.vocab_size, self.eos_id = vocab_size, eos_id
    self.noise_density, self.mean_noise_span_length = noise_density, mean_noise_span_length
    self.raw_length, _ = span_corruption_lengths(inputs_length, noise_density,
                                                 mean_noise_span_length)
    if self.raw_length < 2:
      raise ValueError(f"inputs_length={inputs_length} is too short for span corruption")
    self._noise, self._spans = mask_counts(self.raw_length, noise_density,
                                           mean_noise_span_length)
    self.targets_length = span_targets_length(inputs_length, noise_density,
                                              mean_noise_span_length)
    self._streams = StreamCache(store, seed, separator=None)

  def num_examples(self, epoch: int) -> int:
    return self._streams(epoch).length // self.raw_length

  def examples(self, indices: np.ndarray, epoch: int) -> Example:
    indices = np.asarray(indices, np.int64)
    n = self.raw_length
    pieces, _ = self._streams(epoch).window(indices * n, n)
    rngs = [example_rng(self.seed, epoch, int(i)) for i in indices]
    inputs, targets = corrupt_pieces(pieces, rngs, self._noise, self._spans,
                                     vocab_size=self.vocab_size, eos_id=self.eos_id)
    enc = _pad(inputs, self.inputs_length)
    dec = _pad(targets, self.targets_length)
    enc_real = np.arange(self.inputs_length) < inputs.shape[1]
    dec_real = np.arange(self.targets_length) < targets.shape[1]
    batch = len(indices)
    enc_seg = np.broadcast_to(enc_real.astype(np.int32), (batch, self.inputs_length))
    dec_seg = np.broadcast_to(dec_real.astype(np.int32), (batch, self.targets_length))
    return {
        "encoder_input_tokens": enc,
        "encoder_segment_ids": enc_seg.copy(),
        "encoder_positions": (np.arange(self.inputs_length, dtype=np.int32) * enc_seg),
        "decoder_target_tokens": dec,
        "decoder_input_tokens": shift_right(dec, dec_seg.astype(bool)),
        "decoder_loss_weights": dec_seg.copy(),
        "decoder_segment_ids": dec_seg.copy(),
        "decoder_positions": (np.arange(self.targets_length, dtype=np.int32) * dec_seg),
    }


def _build(store, vocab, *, seed, length, targets_length=None, **options) -> SpanCorruption:
  del targets_length  # the targets' length follows from length and the noise
  require_special_ids(vocab, SPEC, "eos_id")
  return SpanCorruption(store, seed, inputs_length=length, vocab_size=vocab.vocab_size,
                        eos_id=vocab.eos_id, **options)


def _decoder_length(length: int, targets_length: int, options: dict) -> int:
  del targets_length  # follows from length and config.data.options' noise
  noise = {k: options[k] for k in ("noise_density", "mean_noise_span_length") if k in options}
  return span_targets_length(length, **noise)


SPEC = ObjectiveSpec("span_corruption", SpanCorruption, vocab_family="t5",
                     model_family="encoder_decoder", default_length=512, build=_build,
                     filled=frozenset({"inputs_length", "vocab_size", "eos_id"}),
                     decoder_length=_decoder_length)
