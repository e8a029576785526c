"""BERT pretraining examples: sentence pairs with NSP and on-the-fly masking (Devlin et al. 2019).

Instances are built as google-research/bert's create_instances_from_document does,
once per epoch into a plan of token-range references into the store (bert_plan.py:
all documents advance in lockstep with numpy, no Python loop over sentences).
default_rng([seed, epoch]) gives a 64-bit key, the document order (a permutation;
the plan lists instances by permuted document, then instance order) and, last, the
truncation's front drops. Every other plan draw (the short-target coin and length,
once per document; each instance's cut, IsNext/NotNext coin, other document and its
start sentence) is a counter-based uniform: splitmix64 of (key, document index,
instance number within the document, slot), so the plan is a pure function of
(seed, epoch) whatever the order in which documents are processed.
Example i of the epoch then applies masking with example_rng(seed, epoch, i), so
any example is regenerated without replaying the epoch.

Deliberate differences from the reference, all distribution-preserving or fixes:
- a NotNext B is drawn uniformly from the *other* documents (the reference retries
  10 times and may, with probability (1/D)^10, keep the same document);
  nsp_negatives="same_document" (not in the reference) draws it from elsewhere in A's
  own document instead, so NSP cannot be solved by topic alone (bert_plan._pair_step);
- the plan's draws are counter-based uniforms (above), not the reference's one
  sequential stream: the same distributions;
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

from typing import Optional

import numpy as np

from t5x_like.data.bert_plan import (  # noqa: F401 (re-exported)
    NSP_NEGATIVES, BertPlan, build_plan, truncation_drops)
from t5x_like.data.objective import (Example, Objective, ObjectiveSpec, example_rng,
                                     require_special_ids)
from t5x_like.data.store import TokenStore


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
               nsp_negatives: str = "other_document",
               whole_word_masking: bool = False, cls_id: int, sep_id: int, mask_id: int,
               pad_id: int = 0, vocab_size: int, word_start: Optional[np.ndarray] = None):
    if whole_word_masking and (word_start is None or len(word_start) < vocab_size):
      raise ValueError("whole_word_masking needs a bool word_start table [vocab_size]"
                       " (True where an id begins a word)")
    self.store, self.seed = store, seed
    self.max_seq_length, self.max_predictions = max_seq_length, max_predictions_per_seq
    self.masked_lm_prob, self.short_seq_prob = masked_lm_prob, short_seq_prob
    if nsp_negatives not in NSP_NEGATIVES:
      raise ValueError(f"nsp_negatives={nsp_negatives!r}: expected one of {NSP_NEGATIVES}")
    self.nsp, self.nsp_negatives = nsp, nsp_negatives
    self.whole_word_masking = whole_word_masking
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
                        short_seq_prob=self.short_seq_prob, nsp=self.nsp,
                        nsp_negatives=self.nsp_negatives)
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
