"""BERT pretraining examples: sentence pairs with NSP and on-the-fly masking (Devlin et al. 2019).

Instances are built as google-research/bert's create_instances_from_document does,
once per epoch (documents in an order permuted by default_rng([seed, epoch]), all
draws from that generator) into a plan of token-range references into the store.
Example i of the epoch then applies masking with example_rng(seed, epoch, i), so
any example is regenerated without replaying the epoch.

Deliberate differences from the reference, all distribution-preserving or fixes:
- a NotNext B is drawn uniformly from the *other* documents (the reference retries
  10 times and may, with probability (1/D)^10, keep the same document);
- truncation draws the number of front drops of each side as Binomial(drops, 1/2)
  instead of one coin per dropped token (the same distribution);
- whole-word masking never joins a word across [CLS]/[SEP] (the reference lets a
  continuation piece at the start of B join the last word of A);
- masking draws all of an example's randomness as one block of uniforms (ranking
  keys for the shuffle, the 80/10/10 choice, the random ids) instead of a stream of
  scalar draws: the same distributions, vectorised over a batch.
As in the reference: the 10% random replacements are uniform over [0, vocab_size),
special ids included (`vocab_words[randint(0, len(vocab_words) - 1)]`), and the
short-sequence target length is drawn once per document (as create_instances_from_document does).

Without NSP (nsp=False, RoBERTa's DOC-SENTENCES), an instance is the longest run of
whole consecutive sentences of one document within the target length
(max_seq_length - 2, or the short target); a sentence longer than that stands alone,
truncated front/back at random. The row is [CLS] A [SEP], type ids all 0, and there
is no `nsp_labels` feature (the model then skips the NSP loss).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Optional

import numpy as np

from t5x_like.data.objective import (Example, Objective, ObjectiveSpec, example_rng,
                                     require_special_ids)
from t5x_like.data.store import TokenStore


@dataclasses.dataclass(frozen=True)
class BertPlan:
  """One epoch's instances as token ranges of store.tokens (after truncation).

  a_start, a_len, b_start, b_len, nsp_label: [I] int64 (b_len = 0 without NSP).
  """

  a_start: np.ndarray
  a_len: np.ndarray
  b_start: np.ndarray
  b_len: np.ndarray
  nsp_label: np.ndarray

  def __len__(self) -> int:
    return len(self.a_start)


class _Uniforms:
  """Scalar uniforms from a numpy generator, drawn in blocks (scalar calls are slow)."""

  def __init__(self, rng: np.random.Generator, block: int = 1 << 16):
    self._rng, self._block = rng, block
    self._buf: list[float] = []
    self._i = 0

  def __call__(self) -> float:
    if self._i == len(self._buf):
      self._buf, self._i = self._rng.random(self._block).tolist(), 0
    self._i += 1
    return self._buf[self._i - 1]

  def randint(self, lo: int, hi: int) -> int:
    """Uniform integer in [lo, hi], both ends included (Python's random.randint)."""
    return lo + int(self() * (hi - lo + 1))


def truncation_drops(len_a: np.ndarray, len_b: np.ndarray, max_tokens: int
                     ) -> tuple[np.ndarray, np.ndarray]:
  """Tokens dropped from A and from B by the reference's truncate_seq_pair, which drops
  one token at a time from the longer side (B on ties) until len_a + len_b <= max_tokens."""
  len_a, len_b = np.asarray(len_a, np.int64), np.asarray(len_b, np.int64)
  excess = np.maximum(len_a + len_b - max_tokens, 0)
  only_a = len_a - len_b >= excess  # A stays strictly longer for every drop
  only_b = len_b - len_a >= excess - 1  # B stays at least as long for every drop
  drop_a = np.where(only_a, excess, np.where(only_b, 0, len_a - (max_tokens + 1) // 2))
  return drop_a, excess - drop_a


def build_plan(store: TokenStore, rng: np.random.Generator, *, max_seq_length: int,
               short_seq_prob: float = 0.1, nsp: bool = True) -> BertPlan:
  """All instances of one epoch (documents in a permuted order, then sentence order)."""
  u = _Uniforms(rng)
  num_docs = store.num_docs
  offsets = store.sentence_offsets.tolist()
  doc_sentences = store.doc_sentences.tolist()
  max_tokens = max_seq_length - (3 if nsp else 2)
  if max_tokens < 2:
    raise ValueError(f"max_seq_length={max_seq_length} is too short for BERT instances")
  a_start, a_end, b_start, b_end, label = [], [], [], [], []
  for d in rng.permutation(num_docs).tolist():
    first, last = doc_sentences[d], doc_sentences[d + 1]
    target = max_tokens
    if u() < short_seq_prob:
      target = u.randint(2, max_tokens)
    i = first
    if not nsp:  # whole sentences up to the target, the overflowing one starts the next
      while i < last:
        start = i
        i += 1
        while i < last and offsets[i + 1] - offsets[start] <= target:
          i += 1
        a_start.append(offsets[start])
        a_end.append(offsets[i])
      continue
    chunk = i  # first sentence of the current chunk
    while i < last:
      if i < last - 1 and offsets[i + 1] - offsets[chunk] < target:
        i += 1
        continue
      size = i - chunk + 1  # sentences chunk..i
      cut = 1 if size < 2 else u.randint(1, size - 1)
      a_start.append(offsets[chunk])
      a_end.append(offsets[chunk + cut])
      if size == 1 or u() < 0.5:  # NotNext: B from another document
        other = d
        if num_docs > 1:
          other = u.randint(0, num_docs - 2)
          other += other >= d
        o_first, o_last = doc_sentences[other], doc_sentences[other + 1]
        s = o_first + u.randint(0, o_last - o_first - 1)
        need = offsets[s] + target - (a_end[-1] - a_start[-1])
        # the first sentence whose end reaches `need`, at least one, at most the last
        end = min(bisect.bisect_left(offsets, need, s + 1, o_last), o_last)
        b_start.append(offsets[s])
        b_end.append(offsets[end])
        label.append(1)
        i = chunk + cut  # the chunk's unused sentences go back for the next instance
      else:
        b_start.append(offsets[chunk + cut])
        b_end.append(offsets[i + 1])
        label.append(0)
        i += 1
      chunk = i
  a_start = np.asarray(a_start, np.int64)
  a_len = np.asarray(a_end, np.int64) - a_start
  if nsp:
    b_start = np.asarray(b_start, np.int64)
    b_len = np.asarray(b_end, np.int64) - b_start
    drop_a, drop_b = truncation_drops(a_len, b_len, max_tokens)
  else:
    b_start = np.zeros_like(a_start)
    b_len = np.zeros_like(a_start)
    drop_a, drop_b = np.maximum(a_len - max_tokens, 0), np.zeros_like(a_len)
  front_a = rng.binomial(drop_a, 0.5)
  front_b = rng.binomial(drop_b, 0.5)
  return BertPlan(a_start + front_a, a_len - drop_a, b_start + front_b, b_len - drop_b,
                  np.asarray(label if nsp else np.zeros(len(a_start)), np.int64))


def num_to_predict(length: np.ndarray, masked_lm_prob: float,
                   max_predictions_per_seq: int) -> np.ndarray:
  """min(max_predictions, max(1, round(length * prob))), round half to even."""
  k = np.rint(np.asarray(length) * masked_lm_prob).astype(np.int64)
  return np.minimum(max_predictions_per_seq, np.maximum(1, k))


class BertPretraining(Objective):
  """BERT MLM (+ NSP) examples, int32 features:

  encoder_input_tokens, encoder_type_ids, encoder_segment_ids (1 real, 0 pad)
  [max_seq_length]; mlm_positions, mlm_targets, mlm_weights [max_predictions_per_seq]
  (sorted by position, padded with position 0 / weight 0); nsp_labels [] (0 IsNext,
  1 NotNext; only with nsp=True).
  """

  def __init__(self, store: TokenStore, seed: int, *, max_seq_length: int = 128,
               max_predictions_per_seq: int = 20, masked_lm_prob: float = 0.15,
               short_seq_prob: float = 0.1, nsp: bool = True,
               whole_word_masking: bool = False, cls_id: int, sep_id: int, mask_id: int,
               pad_id: int = 0, vocab_size: int, word_start: Optional[np.ndarray] = None):
    if whole_word_masking and (word_start is None or len(word_start) < vocab_size):
      raise ValueError("whole_word_masking needs a bool word_start table [vocab_size]"
                       " (True where an id begins a word)")
    self.store, self.seed = store, seed
    self.max_seq_length, self.max_predictions = max_seq_length, max_predictions_per_seq
    self.masked_lm_prob, self.short_seq_prob = masked_lm_prob, short_seq_prob
    self.nsp, self.whole_word_masking = nsp, whole_word_masking
    self.cls_id, self.sep_id, self.mask_id, self.pad_id = cls_id, sep_id, mask_id, pad_id
    self.vocab_size = vocab_size
    self.word_start = None if word_start is None else np.asarray(word_start, bool)
    self._plans: dict[int, BertPlan] = {}

  def plan(self, epoch: int) -> BertPlan:
    """The instances of `epoch` (the two most recently used epochs are cached)."""
    plan = self._plans.pop(epoch, None)
    if plan is None:
      plan = build_plan(self.store, np.random.default_rng([self.seed, epoch]),
                        max_seq_length=self.max_seq_length,
                        short_seq_prob=self.short_seq_prob, nsp=self.nsp)
    self._plans[epoch] = plan
    while len(self._plans) > 2:
      del self._plans[next(iter(self._plans))]
    return plan

  def num_examples(self, epoch: int) -> int:
    return len(self.plan(epoch))

  def examples(self, indices: np.ndarray, epoch: int) -> Example:
    indices = np.asarray(indices, np.int64)
    plan = self.plan(epoch)
    L, P = self.max_seq_length, self.max_predictions
    la, lb = plan.a_len[indices][:, None], plan.b_len[indices][:, None]
    a0, b0 = plan.a_start[indices][:, None], plan.b_start[indices][:, None]
    pos = np.arange(L, dtype=np.int64)[None, :]
    n = la + lb + (3 if self.nsp else 2)  # real tokens of each row
    in_a = (pos >= 1) & (pos <= la)
    in_b = (pos >= la + 2) & (pos < la + 2 + lb)
    src = np.where(in_a, a0 + pos - 1, np.where(in_b, b0 + pos - la - 2, 0))
    original = np.where(in_a | in_b, self.store.tokens[src], self.pad_id)
    original[:, 0] = self.cls_id
    original = np.where((pos == la + 1) | (pos == n - 1), self.sep_id, original)
    original = original.astype(np.int32)
    real = pos < n
    candidate = in_a | in_b

    # all of an example's randomness in one draw: ranking keys, 80/10/10, random ids
    draws = np.stack([example_rng(self.seed, epoch, int(i)).random(L + 2 * P)
                      for i in indices])
    keys, action, replacement = draws[:, :L], draws[:, L:L + P], draws[:, L + P:]
    budget = np.minimum(num_to_predict(n[:, 0], self.masked_lm_prob, P),
                        candidate.sum(1))
    if self.whole_word_masking:
      chosen = self._choose_whole_words(original, candidate, keys, budget)
    else:
      ranked = np.argsort(np.where(candidate, keys, 2.0), axis=1, kind="stable")[:, :P]
      chosen = np.where(np.arange(P)[None] < budget[:, None], ranked, L)
    chosen = np.sort(chosen, axis=1)  # real picks by position, then the L fillers
    weights = chosen < L
    positions = np.where(weights, chosen, 0)
    rows = np.arange(len(indices))[:, None]
    targets = np.where(weights, original[rows, positions], 0).astype(np.int32)
    new = np.where(action < 0.8, self.mask_id,
                   np.where(action < 0.9, targets,
                            (replacement * self.vocab_size).astype(np.int64)))
    inputs = original.copy()
    r, c = np.nonzero(weights)
    inputs[r, positions[r, c]] = new[r, c]
    features = {
        "encoder_input_tokens": inputs,
        "encoder_type_ids": (in_b | (pos == n - 1) & self.nsp).astype(np.int32),
        "encoder_segment_ids": real.astype(np.int32),
        "mlm_positions": positions.astype(np.int32),
        "mlm_targets": targets,
        "mlm_weights": weights.astype(np.int32),
    }
    if self.nsp:
      features["nsp_labels"] = plan.nsp_label[indices].astype(np.int32)
    return features

  def _choose_whole_words(self, original: np.ndarray, candidate: np.ndarray,
                          keys: np.ndarray, budget: np.ndarray) -> np.ndarray:
    """[B, P] positions of the picked words' tokens (L-filled): words ranked by the key
    of their first token, taken in order, a word that would overflow the budget skipped.

    Vectorised over the batch: tokens are sorted by their word's key (stably, so a
    word's tokens stay together in order); the words that fit form a prefix of that
    order, and the few later words that still fit the remainder are found one round
    at a time for all rows at once.
    """
    batch, L = original.shape
    rows = np.arange(batch)[:, None]
    pos = np.arange(L)[None, :]
    prev_candidate = np.zeros_like(candidate)
    prev_candidate[:, 1:] = candidate[:, :-1]
    starts = candidate & (self.word_start[original] | ~prev_candidate)
    first = np.maximum.accumulate(np.where(starts, pos, 0), axis=1)  # word's first position
    token_key = np.where(candidate, keys[rows, first], 2.0)
    order = np.argsort(token_key, axis=1, kind="stable")  # candidates first, word by word
    is_start = starts[rows, order]
    word = np.cumsum(is_start, 1) - 1  # word rank of each sorted token (-1: none)
    # [B, L] per word rank: its first sorted index and its length (unused ranks: L, L)
    word_begin = np.full((batch, L + 1), L, np.int64)
    r, c = np.nonzero(is_start)
    word_begin[r, word[r, c]] = c
    num_words = is_start.sum(1)
    ends = np.where(np.arange(L + 1)[None] < num_words[:, None] - 1,
                    np.roll(word_begin, -1, axis=1), candidate.sum(1)[:, None])
    word_len = np.where(np.arange(L + 1)[None] < num_words[:, None], ends - word_begin, L + 1)
    word_end = word_begin + word_len
    taken = word_end <= budget[:, None]  # the prefix of words that fit
    used = np.where(taken, word_end, 0).max(1)
    left = budget - used
    pointer = taken.sum(1)  # first word rank not in the prefix
    ranks = np.arange(L + 1)[None]
    while True:  # the next later word that fits what is left, for every row at once
      fits = (ranks >= pointer[:, None]) & (word_len <= left[:, None])
      found = fits.any(1) & (left > 0)
      if not found.any():
        break
      nxt = np.argmax(fits, 1)
      f = np.flatnonzero(found)
      taken[f, nxt[f]] = True
      left[f] -= word_len[f, nxt[f]]
      pointer[f] = nxt[f] + 1
    picked = candidate[rows, order] & taken[rows, np.maximum(word, 0)]
    return np.sort(np.where(picked, order, L), axis=1)[:, :self.max_predictions]


def _build(store, vocab, *, seed, length, targets_length=None, **options) -> BertPretraining:
  del targets_length  # pairs fill max_seq_length
  require_special_ids(vocab, SPEC, "cls_id", "sep_id", "mask_id")
  word_start = vocab.word_start_mask() if options.get("whole_word_masking") else None
  return BertPretraining(store, seed, max_seq_length=length, cls_id=vocab.cls_id,
                         sep_id=vocab.sep_id, mask_id=vocab.mask_id, pad_id=vocab.pad_id,
                         vocab_size=vocab.vocab_size, word_start=word_start, **options)


SPEC = ObjectiveSpec("bert_mlm", BertPretraining, vocab_family="bert", model_family="encoder",
                     default_length=128, build=_build,
                     filled=frozenset({"max_seq_length", "cls_id", "sep_id", "mask_id",
                                       "pad_id", "vocab_size", "word_start"}))
