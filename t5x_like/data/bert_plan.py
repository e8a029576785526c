"""One epoch's BERT instances, built for all documents at once with numpy.

Semantics are google-research/bert's create_instances_from_document (see
bert_pretraining.py), but instead of a Python loop over sentences, every document
advances in lockstep: iteration t builds the t-th instance of each document that still
has sentences left, so the Python loop runs (most instances of one document) times.
Extending a chunk to the target length is a searchsorted on the sentence offsets.

Draws: `rng` gives a 64-bit key, then the document order (rng.permutation), then, after
the instances are built, the truncation's Binomial front drops (in plan order). Every
other draw is a counter-based uniform, a pure function of (key, document index,
instance number t within the document, slot) through splitmix64 (`uniforms`), so the
order in which documents are processed does not matter.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from t5x_like.data.store import TokenStore

# slots of the counter-based uniforms (the first two only at t = 0: once per document)
SHORT, SHORT_LEN, CUT, COIN, OTHER, START = range(6)
_PAIR_SLOTS = np.array([CUT, COIN, OTHER, START])
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
NSP_NEGATIVES = ("other_document", "same_document")
_U64 = {k: np.uint64(k) for k in (1, 11, 27, 30, 31, 32)}


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


def uniforms(key: int, doc: np.ndarray, t: int, slot) -> np.ndarray:
  """float64 in [0, 1) of the shape of doc and slot broadcast: splitmix64 output number
  (doc << 32 | t << 3 | slot) + 1 of the stream seeded with `key`, top 53 bits.
  doc: int < 2^32; t < 2^29; slot: int or int array < 8."""
  z = (np.asarray(doc, np.uint64) << _U64[32]) | np.asarray(slot, np.uint64)
  z |= np.uint64(t << 3)  # in place from here: array ops wrap mod 2^64, never warn
  z += _U64[1]
  z *= _GOLDEN
  z += np.uint64(key)
  z ^= z >> _U64[30]
  z *= _MIX1
  z ^= z >> _U64[27]
  z *= _MIX2
  z ^= z >> _U64[31]
  z >>= _U64[11]
  return z * 2.0 ** -53


def randint(u: np.ndarray, lo, hi) -> np.ndarray:
  """Uniform integers in [lo, hi], both ends included, from uniforms u (elementwise)."""
  n = np.asarray(hi, np.int64) - lo + 1
  return lo + np.minimum((u * n).astype(np.int64), n - 1)


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


def targets(key: int, num_docs: int, max_tokens: int, short_seq_prob: float) -> np.ndarray:
  """[D] int64 target length of each document: max_tokens, or with probability
  short_seq_prob a uniform integer in [2, max_tokens]."""
  docs = np.arange(num_docs)
  short = uniforms(key, docs, 0, SHORT) < short_seq_prob
  return np.where(short, randint(uniforms(key, docs, 0, SHORT_LEN), 2, max_tokens), max_tokens)


def _search(offsets: np.ndarray, values: np.ndarray) -> np.ndarray:
  """searchsorted(offsets, values, "left") [n], the values sorted first: a search for
  sorted values stays near the previous one in cache (several times faster)."""
  by_value = np.argsort(values)
  out = np.empty(len(values), np.int64)
  out[by_value] = np.searchsorted(offsets, values[by_value], "left")
  return out


def _sentences_step(offsets, cursor, last, target):
  """nsp=False, one instance per active document: the longest run of whole sentences
  from `cursor` within `target` tokens, at least one. All [A]; -> (a_start, a_end,
  b_start, b_end, label, next cursor) [A]."""
  a_start = offsets[cursor]
  end = np.clip(np.searchsorted(offsets, a_start + target, "right") - 1, cursor + 1, last)
  zero = np.zeros_like(cursor)
  return a_start, offsets[end], zero, zero, zero, end


def _pair_step(offsets, doc_sentences, key, t, doc, cursor, last, target, same_document):
  """nsp=True, the t-th instance of every active document (create_instances_from_document's
  chunk, cut and B). All [A] int64 (doc: document index); -> (a_start, a_end, b_start,
  b_end, label 1 = NotNext, next cursor) [A].

  same_document: a NotNext B starts at a sentence of A's own document outside the chunk
  (uniform over them) and stops before the chunk; a chunk that is its whole document
  takes B from another document, as without the option."""
  a_start = offsets[cursor]
  end = np.minimum(np.searchsorted(offsets, a_start + target, "left"), last)
  size = end - cursor  # the chunk: sentences cursor .. end - 1
  u_cut, u_coin, u_other, u_start = uniforms(key, doc[:, None], t, _PAIR_SLOTS).T
  cut = np.maximum(randint(u_cut, 1, size - 1), 1)  # size 1: randint gives 0, cut 1
  a_end = offsets[cursor + cut]
  not_next = (size == 1) | (u_coin < 0.5)
  b_start, b_end = a_end.copy(), offsets[end]  # IsNext: the rest of the chunk
  n = np.flatnonzero(not_next)
  if len(n):  # NotNext: B from another document, from a random sentence to the target
    num_docs = len(doc_sentences) - 1
    other = doc[n]
    if num_docs > 1:
      other = randint(u_other[n], 0, num_docs - 2)
      other += other >= doc[n]
    o_first, o_last = doc_sentences[other], doc_sentences[other + 1]
    s = randint(u_start[n], o_first, o_last - 1)
    if same_document:
      first = doc_sentences[doc[n]]
      outside = (last[n] - first) - size[n]  # sentences of A's document not in the chunk
      own = outside > 0
      s_own = randint(u_start[n], first, first + np.maximum(outside, 1) - 1)
      s_own += np.where(s_own >= cursor[n], size[n], 0)  # skip over the chunk
      s = np.where(own, s_own, s)
      o_last = np.where(own & (s < cursor[n]), cursor[n], np.where(own, last[n], o_last))
    need = offsets[s] + target[n] - (a_end[n] - a_start[n])
    b_end[n] = offsets[np.clip(_search(offsets, need), s + 1, o_last)]
    b_start[n] = offsets[s]
  next_cursor = np.where(not_next, cursor + cut, end)  # NotNext: unused sentences go back
  return a_start, a_end, b_start, b_end, not_next.astype(np.int64), next_cursor


def instance_spans(offsets: np.ndarray, doc_sentences: np.ndarray, order: np.ndarray,
                   key: int, *, max_tokens: int, short_seq_prob: float, nsp: bool,
                   same_document: bool = False) -> tuple[np.ndarray, ...]:
  """Untruncated instances in (order, then instance number) order.

  offsets: [S + 1], doc_sentences: [D + 1], order: [D] int64 (a permutation of the
  documents) -> (a_start, a_end, b_start, b_end, label) [I] int64 token offsets.
  """
  # documents in index order, so that the chunk searches are (nearly) sorted values
  doc = np.arange(len(order))
  rank = np.empty(len(order), np.int64)  # position of each document in `order`
  rank[order] = doc
  cursor, last = doc_sentences[doc], doc_sentences[doc + 1]
  target = targets(key, len(doc), max_tokens, short_seq_prob)
  ranks, parts = [], []
  t = 0
  while len(doc):
    if nsp:
      *spans, cursor = _pair_step(offsets, doc_sentences, key, t, doc, cursor, last, target,
                                  same_document)
    else:
      *spans, cursor = _sentences_step(offsets, cursor, last, target)
    ranks.append(rank)
    parts.append(spans)
    active = cursor < last
    if not active.all():
      doc, rank, cursor, last, target = (x[active] for x in (doc, rank, cursor, last, target))
    t += 1
  return _document_order(ranks, parts, len(order))


def _document_order(ranks, parts, num_docs) -> tuple[np.ndarray, ...]:
  """The instances of all iterations t (lists of [A_t] arrays) placed at (the first
  instance of their document's rank + t): document order, then instance order."""
  if not parts:
    return tuple(np.zeros(0, np.int64) for _ in range(5))
  rank = np.concatenate(ranks)
  number = np.repeat(np.arange(len(ranks)), [len(r) for r in ranks])
  first = np.concatenate([[0], np.cumsum(np.bincount(rank, minlength=num_docs))[:-1]])
  where = first[rank] + number
  out = []
  for column in zip(*parts):
    values = np.empty(len(where), np.int64)
    values[where] = np.concatenate(column)
    out.append(values)
  return tuple(out)


def build_plan(store: TokenStore, rng: np.random.Generator, *, max_seq_length: int,
               short_seq_prob: float = 0.1, nsp: bool = True,
               nsp_negatives: str = "other_document") -> BertPlan:
  """All instances of one epoch (documents in a permuted order, then instance order).

  nsp_negatives: where a NotNext B comes from: "other_document" (BERT) or
  "same_document" (elsewhere in A's document: a topic-matched negative, so NSP has to
  judge continuity, not topic; see _pair_step).

  Draws from rng: a key (integers in [0, 2^63)), the document order, then the
  truncation's front drops (binomial for A, then for B, over the whole plan).
  """
  if nsp_negatives not in NSP_NEGATIVES:
    raise ValueError(f"nsp_negatives={nsp_negatives!r}: expected one of {NSP_NEGATIVES}")
  max_tokens = max_seq_length - (3 if nsp else 2)
  if max_tokens < 2:
    raise ValueError(f"max_seq_length={max_seq_length} is too short for BERT instances")
  offsets = np.asarray(store.sentence_offsets, np.int64)
  doc_sentences = np.asarray(store.doc_sentences, np.int64)
  if len(doc_sentences) > 1 << 32 or np.diff(doc_sentences, prepend=0).max() >= 1 << 29:
    raise ValueError("BERT plans take fewer than 2^32 documents of fewer than 2^29 sentences")
  key = int(rng.integers(0, 2 ** 63))
  order = rng.permutation(len(doc_sentences) - 1)
  a_start, a_end, b_start, b_end, label = instance_spans(
      offsets, doc_sentences, order, key, max_tokens=max_tokens,
      short_seq_prob=short_seq_prob, nsp=nsp,
      same_document=nsp_negatives == "same_document")
  a_len, b_len = a_end - a_start, b_end - b_start
  if nsp:
    drop_a, drop_b = truncation_drops(a_len, b_len, max_tokens)
  else:
    drop_a, drop_b = np.maximum(a_len - max_tokens, 0), np.zeros_like(a_len)
  front_a = rng.binomial(drop_a, 0.5)
  front_b = rng.binomial(drop_b, 0.5)
  return BertPlan(a_start + front_a, a_len - drop_a, b_start + front_b, b_len - drop_b,
                  label)
