"""UL2's mixture of denoisers, for encoder-decoders (ul2) and decoders (ul2_decoder)
(Tay et al. 2022, "UL2: Unifying Language Learning Paradigms", section 3.1; the
reference preprocessor is t5.data.preprocessors.ul2_objective).

Every example is made by one denoiser of the mixture:
  R:MEAN:DENSITY, X:MEAN:DENSITY   T5 span corruption (span_corruption.py) with that mean
        span length and noise density: R the regular ones, X the extreme ones (long
        spans or much noise)
  S     prefix LM: the piece split at a uniform point, the prefix to encode, the rest
        (then EOS) to generate, as T5's prefix_lm (lm.py's PrefixLM layout)
and its inputs start with the mode token of its kind, the text "[NLU]" (R), "[NLG]" (X)
or "[S2S]" (S) encoded by the vocabulary, as ul2_objective's optional_task_prefixes
(prepend_prompt) do. `mode_tokens=False` leaves them out.

DEFAULT_DENOISERS is the paper's mixture of seven: R (3, 0.15), R (8, 0.15), X (3, 0.5),
X (8, 0.5), X (64, 0.15), X (64, 0.5) and S. `rates` weighs them (comma-separated, one
per denoiser); empty means equal weights, as ul2_objective's rates=None.

Lengths: each denoiser cuts the largest raw piece whose example fits inputs_length and
targets_length (ul2_objective runs random_spans_helper per denoiser; the decoder-only
row holds inputs and targets together), so no denoiser wastes text. A span denoiser has
at most as many spans as the vocabulary has sentinels (T5's: 100); where
round(noise / MEAN) would be more, its spans are longer than MEAN (the reference would
use ordinary pieces as sentinels past the 100th).

Order: the examples of an epoch come in periods of PERIOD; each period holds every
denoiser's share of PERIOD exactly (largest remainders of the rates), in an order drawn
from (seed, epoch, period), so every period spans the same number of stream tokens and
example i of an epoch stays a cheap, pure function of (seed, epoch, i): its period's
plan, then example_rng(seed, epoch, i) for its spans or its split point.

Two layouts, all features int32, segment ids 1 on real tokens and 0 on padding:
  ul2 (encoder-decoder)   as span corruption's: encoder_* [inputs_length] holds the
                          mode tokens and the inputs, decoder_* [targets_length] the
                          targets
  ul2_decoder (decoder)   one row of `length` as the decoder-only PrefixLM's (lm.py):
                          the mode tokens and the inputs (the prefix, seen both ways:
                          decoder_causal_attention), then the targets, the only tokens
                          with loss; as the UL2 paper trains its decoder-only models
"""

from __future__ import annotations

import dataclasses

import numpy as np

from t5x_like.data.mixture import largest_remainder
from t5x_like.data.objective import (Example, Objective, ObjectiveSpec, example_rng,
                                     require_special_ids, shift_right)
from t5x_like.data.span_corruption import corrupt_pieces, mask_counts
from t5x_like.data.streams import StreamCache
from t5x_like.data.store import TokenStore

DEFAULT_DENOISERS = "R:3:0.15,R:8:0.15,X:3:0.5,X:8:0.5,X:64:0.15,X:64:0.5,S"
MODE_TEXT = {"R": "[NLU]", "X": "[NLG]", "S": "[S2S]"}
PERIOD = 1000  # examples per period of the epoch's plan
PLAN_KEY = 0x0712  # spawn-key word of the periods' order generators
CACHED_PERIODS = 8  # period plans an objective keeps (LRU)


@dataclasses.dataclass(frozen=True)
class Denoiser:
  """One denoiser: kind R, X or S; mean span length and noise density (R, X only)."""

  kind: str
  mean: float = 0.0
  density: float = 0.0

  def __str__(self):
    return self.kind if self.kind == "S" else f"{self.kind}:{self.mean:g}:{self.density:g}"


def parse_denoisers(spec: str) -> list[Denoiser]:
  """"R:3:0.15,X:64:0.5,S" -> Denoisers; ValueError naming the bad entry."""
  out = []
  for entry in (e.strip() for e in spec.split(",")):
    parts = entry.split(":")
    try:
      if parts == ["S"]:
        out.append(Denoiser("S"))
        continue
      if len(parts) != 3 or parts[0] not in ("R", "X"):
        raise ValueError
      mean, density = float(parts[1]), float(parts[2])
    except ValueError:
      raise ValueError(f"denoisers: bad entry {entry!r} in {spec!r}; expected"
                       " R:MEAN:DENSITY, X:MEAN:DENSITY or S, comma-separated") from None
    if not (mean >= 1.0 and 0.0 < density < 1.0):
      raise ValueError(f"denoisers: {entry!r} needs MEAN >= 1 and 0 < DENSITY < 1")
    out.append(Denoiser(parts[0], mean, density))
  return out


def parse_rates(spec: str, count: int) -> np.ndarray:
  """[count] weights summing to 1 from "1,1,2" ("" = equal); ValueError when bad."""
  if not spec.strip():
    return np.full(count, 1.0 / count)
  try:
    rates = np.array([float(r) for r in spec.split(",")])
  except ValueError:
    raise ValueError(f"rates={spec!r}: expected numbers, comma-separated") from None
  if len(rates) != count or not np.all(np.isfinite(rates)) or (rates < 0).any() \
      or rates.sum() <= 0:
    raise ValueError(f"rates={spec!r}: expected {count} non-negative numbers (one per"
                     " denoiser), not all zero")
  return rates / rates.sum()


class UL2(Objective):
  """UL2's mixture of denoisers; the layouts are in the module docstring.

  Features (int32), encoder-decoder: encoder_input_tokens / encoder_segment_ids /
  encoder_positions [inputs_length]; decoder_target_tokens / decoder_input_tokens /
  decoder_loss_weights / decoder_segment_ids / decoder_positions [targets_length].
  Decoder-only: those decoder_* and decoder_causal_attention, all [inputs_length].
  """

  def __init__(self, store: TokenStore, seed: int, *, inputs_length: int,
               targets_length: int | None, vocab_size: int, eos_id: int, max_spans: int,
               mode_ids: dict, denoisers: str = DEFAULT_DENOISERS, rates: str = "",
               mode_tokens: bool = True):
    """targets_length None: the decoder-only layout, one row of inputs_length."""
    self.store, self.seed = store, seed
    self.inputs_length, self.targets_length = inputs_length, targets_length
    self.vocab_size, self.eos_id, self.max_spans = vocab_size, eos_id, max_spans
    self.denoisers = parse_denoisers(denoisers)
    self.rates = parse_rates(rates, len(self.denoisers))
    self.counts = largest_remainder(self.rates, PERIOD)  # examples per period
    starved = [str(d) for d, r, c in zip(self.denoisers, self.rates, self.counts)
               if r > 0 and c == 0]
    if starved:
      raise ValueError(f"rates={rates!r}: {starved} would get no example in {PERIOD}")
    self.modes = [np.asarray(mode_ids[d.kind] if mode_tokens else [], np.int32)
                  for d in self.denoisers]
    self.raw_lengths = np.array([self._raw_length(d, len(m))
                                 for d, m in zip(self.denoisers, self.modes)], np.int64)
    self.period_tokens = int(self.counts @ self.raw_lengths)
    self._streams = StreamCache(store, seed, separator=None)
    self._plans: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

  # ------------------------------------------------------------------ lengths
  @property
  def decoder_only(self) -> bool:
    return self.targets_length is None

  def _fits(self, d: Denoiser, n: int, mode: int) -> bool:
    """Whether a raw piece of n tokens fits inputs_length and targets_length (the
    decoder-only row: prefix and targets together in inputs_length)."""
    if d.kind == "S":  # inputs: s tokens and EOS, targets: n - s tokens and EOS
      if self.decoder_only:
        return mode + n + 2 <= self.inputs_length
      return n <= self.inputs_length - mode and n <= self.targets_length
    noise, spans = mask_counts(n, d.density, d.mean, self.max_spans)
    inputs, targets = mode + n - noise + spans + 1, noise + spans + 1
    if self.decoder_only:
      return inputs + targets <= self.inputs_length
    return inputs <= self.inputs_length and targets <= self.targets_length

  def _raw_length(self, d: Denoiser, mode: int) -> int:
    """The largest raw piece of denoiser d that fits (at least 2 tokens)."""
    if not self._fits(d, 2, mode):
      lengths = (f"length={self.inputs_length} is" if self.decoder_only else
                 f"inputs_length={self.inputs_length} and targets_length="
                 f"{self.targets_length} are")
      raise ValueError(f"denoiser {d}: {lengths} too short for a piece of 2 tokens"
                       + (f" after its {mode} mode tokens" if mode else ""))
    n = 2
    while self._fits(d, n + 1, mode):
      n += 1
    return n

  def spans(self, k: int) -> tuple[int, int]:
    """(noise tokens, spans) of span denoiser k's pieces."""
    d = self.denoisers[k]
    return mask_counts(int(self.raw_lengths[k]), d.density, d.mean, self.max_spans)

  # ------------------------------------------------------------------ the plan
  def _period(self, epoch: int, period: int) -> tuple[np.ndarray, np.ndarray]:
    """(denoiser [PERIOD], stream start [PERIOD]) of each slot of one period."""
    plan = self._plans.pop((epoch, period), None)
    if plan is None:
      slots = np.repeat(np.arange(len(self.denoisers)), self.counts)
      rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch],
                                                         spawn_key=(PLAN_KEY, period)))
      kinds = rng.permutation(slots)
      lengths = self.raw_lengths[kinds]
      plan = kinds, period * self.period_tokens + np.cumsum(lengths) - lengths
    self._plans[(epoch, period)] = plan  # most recently used last
    while len(self._plans) > CACHED_PERIODS:
      del self._plans[next(iter(self._plans))]
    return plan

  def num_examples(self, epoch: int) -> int:
    length = self._streams(epoch).length
    full = length // self.period_tokens
    kinds, starts = self._period(epoch, full)
    tail = int(np.sum(starts + self.raw_lengths[kinds] <= length))
    return full * PERIOD + tail

  def plan(self, indices: np.ndarray, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(denoiser [B], stream start [B]) of examples `indices` of `epoch`."""
    indices = np.asarray(indices, np.int64)
    kinds, starts = np.empty(len(indices), np.int64), np.empty(len(indices), np.int64)
    for period in np.unique(indices // PERIOD):
      here = indices // PERIOD == period
      k, s = self._period(epoch, int(period))
      kinds[here], starts[here] = k[indices[here] % PERIOD], s[indices[here] % PERIOD]
    return kinds, starts

  # ------------------------------------------------------------------ examples
  def examples(self, indices: np.ndarray, epoch: int) -> Example:
    indices = np.asarray(indices, np.int64)
    batch = len(indices)
    kinds, starts = self.plan(indices, epoch)
    prefixes, targets = self._pairs(indices, epoch, kinds, starts)
    if self.decoder_only:
      return self._decoder_rows(prefixes, targets)
    enc = np.zeros((batch, self.inputs_length), np.int32)
    dec = np.zeros((batch, self.targets_length), np.int32)
    enc_len = np.array([len(x) for x in prefixes], np.int64)
    dec_len = np.array([len(y) for y in targets], np.int64)
    for r, (x, y) in enumerate(zip(prefixes, targets)):
      enc[r, :len(x)], dec[r, :len(y)] = x, y
    enc_real = np.arange(self.inputs_length) < enc_len[:, None]
    dec_real = np.arange(self.targets_length) < dec_len[:, None]
    enc_seg, dec_seg = enc_real.astype(np.int32), dec_real.astype(np.int32)
    return {
        "encoder_input_tokens": enc,
        "encoder_segment_ids": enc_seg,
        "encoder_positions": np.arange(self.inputs_length, dtype=np.int32) * enc_seg,
        "decoder_target_tokens": dec,
        "decoder_input_tokens": shift_right(dec, dec_real),
        "decoder_loss_weights": dec_seg.copy(),
        "decoder_segment_ids": dec_seg.copy(),
        "decoder_positions": np.arange(self.targets_length, dtype=np.int32) * dec_seg,
    }

  def _decoder_rows(self, prefixes: list, targets: list) -> Example:
    """One row per example: the prefix then the targets, 0-padded to inputs_length;
    lm.py's decoder-only PrefixLM features with the split at the prefix's end."""
    batch, length = len(prefixes), self.inputs_length
    rows = np.zeros((batch, length), np.int32)
    split = np.array([len(x) for x in prefixes], np.int64)[:, None]
    end = split + np.array([len(y) for y in targets], np.int64)[:, None]
    for r, (x, y) in enumerate(zip(prefixes, targets)):
      rows[r, :len(x) + len(y)] = np.concatenate([x, y])
    pos = np.arange(length, dtype=np.int64)[None, :]
    real = pos < end
    seg = real.astype(np.int32)
    return {
        "decoder_target_tokens": rows,
        "decoder_input_tokens": shift_right(rows, real),
        "decoder_loss_weights": ((pos >= split) & real).astype(np.int32),
        "decoder_causal_attention": (pos <= split).astype(np.int32),
        "decoder_segment_ids": seg,
        "decoder_positions": (pos * seg).astype(np.int32),
    }

  def _pairs(self, indices, epoch, kinds, starts) -> tuple[list, list]:
    """(prefixes, targets): each example's mode tokens and inputs, and its targets,
    as [n_i] int32 arrays."""
    prefixes, targets = [None] * len(indices), [None] * len(indices)
    stream = self._streams(epoch)
    for k in np.unique(kinds):
      rows = np.flatnonzero(kinds == k)
      n = int(self.raw_lengths[k])
      pieces, _ = stream.window(starts[rows], n)
      rngs = [example_rng(self.seed, epoch, int(i)) for i in indices[rows]]
      if self.denoisers[k].kind == "S":
        inputs, outputs = self._prefix_lm(pieces, rngs)
      else:
        noise, spans = self.spans(int(k))
        inputs, outputs = corrupt_pieces(pieces, rngs, noise, spans,
                                         vocab_size=self.vocab_size, eos_id=self.eos_id)
      for r, x, y in zip(rows, inputs, outputs):
        prefixes[r], targets[r] = np.concatenate([self.modes[k], x]), np.asarray(y)
    return prefixes, targets

  def _prefix_lm(self, pieces: np.ndarray, rngs) -> tuple[list, list]:
    """S: each piece t_0 .. t_{n-1} split at s uniform in [1, n - 1] -> inputs
    t_0 .. t_{s-1}, EOS; targets t_s .. t_{n-1}, EOS."""
    n = pieces.shape[1]
    eos = np.array([self.eos_id], np.int32)
    inputs, targets = [], []
    for piece, rng in zip(pieces, rngs):
      s = int(rng.integers(1, n))
      inputs.append(np.concatenate([piece[:s], eos]))
      targets.append(np.concatenate([piece[s:], eos]))
    return inputs, targets


def _build(store, vocab, *, seed, length, targets_length=None, spec=None,
           **options) -> UL2:
  spec = spec or SPEC
  require_special_ids(vocab, spec, "eos_id")
  if spec is SPEC and not targets_length:
    raise ValueError("objective 'ul2' needs targets_length")
  if not vocab.num_sentinels:
    raise ValueError(f"objective {spec.name!r} needs a vocabulary with sentinels;"
                     f" {vocab!r} (family {vocab.family!r}) has none. Use a 't5'"
                     " vocabulary.")
  mode_ids = {kind: vocab.encode(text) for kind, text in MODE_TEXT.items()}
  return UL2(store, seed, inputs_length=length,
             targets_length=targets_length if spec is SPEC else None,
             vocab_size=vocab.vocab_size, eos_id=vocab.eos_id,
             max_spans=vocab.num_sentinels, mode_ids=mode_ids, **options)


def _build_decoder(store, vocab, *, seed, length, targets_length=None, **options) -> UL2:
  del targets_length  # one row of `length`
  return _build(store, vocab, seed=seed, length=length, spec=DECODER_SPEC, **options)


SPEC = ObjectiveSpec("ul2", UL2, vocab_family="t5", model_family="encoder_decoder",
                     default_length=512, build=_build,
                     filled=frozenset({"inputs_length", "targets_length", "vocab_size",
                                       "eos_id", "max_spans", "mode_ids"}),
                     needs_targets_length=True,
                     decoder_length=lambda length, targets_length, options: targets_length)
DECODER_SPEC = ObjectiveSpec("ul2_decoder", UL2, vocab_family="t5", model_family="decoder",
                             default_length=1024, build=_build_decoder, filled=SPEC.filled)
