"""The vectorised BERT plan (data/bert_plan.py) against a sequential reference.

The reference is create_instances_from_document written as the plain per-document,
per-sentence loop, drawing the same counter-based uniforms (splitmix64, re-implemented
here on Python ints) and the same generator draws (key, permutation, binomials).
"""

import numpy as np
import pytest

from t5x_like.data import bert_plan
from t5x_like.data.bert_plan import (COIN, CUT, OTHER, SHORT, SHORT_LEN, START,
                                     instance_spans, targets, uniforms)
from t5x_like.data.bert_pretraining import build_plan
from t5x_like.data.store import TokenStore
from references import spec_truncate

MASK64 = (1 << 64) - 1


def splitmix_uniform(key, doc, t, slot):
  """Output number (doc << 32 | t << 3 | slot) + 1 of splitmix64 seeded with key."""
  z = (key + (((doc << 32) | (t << 3) | slot) + 1) * 0x9E3779B97F4A7C15) & MASK64
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
  z ^= z >> 31
  return (z >> 11) * 2.0 ** -53


def spec_randint(u, lo, hi):
  return lo + min(int(u * (hi - lo + 1)), hi - lo)


def reference_spans(offsets, doc_sentences, order, key, max_tokens, short_seq_prob, nsp):
  """create_instances_from_document, one document and one sentence at a time."""
  num_docs = len(doc_sentences) - 1
  out = []
  for d in order:
    u = lambda t, slot, d=d: splitmix_uniform(key, d, t, slot)  # noqa: E731
    first, last = doc_sentences[d], doc_sentences[d + 1]
    target = max_tokens
    if u(0, SHORT) < short_seq_prob:
      target = spec_randint(u(0, SHORT_LEN), 2, max_tokens)
    i, t = first, 0
    if not nsp:
      while i < last:
        start = i
        i += 1
        while i < last and offsets[i + 1] - offsets[start] <= target:
          i += 1
        out.append((offsets[start], offsets[i], 0, 0, 0))
      continue
    chunk = i
    while i < last:
      if i < last - 1 and offsets[i + 1] - offsets[chunk] < target:
        i += 1
        continue
      size = i - chunk + 1
      cut = 1 if size < 2 else spec_randint(u(t, CUT), 1, size - 1)
      a = (offsets[chunk], offsets[chunk + cut])
      if size == 1 or u(t, COIN) < 0.5:
        other = d
        if num_docs > 1:
          other = spec_randint(u(t, OTHER), 0, num_docs - 2)
          other += other >= d
        o_first, o_last = doc_sentences[other], doc_sentences[other + 1]
        s = spec_randint(u(t, START), o_first, o_last - 1)
        end = s + 1
        while end < o_last and offsets[end] - offsets[s] < target - (a[1] - a[0]):
          end += 1
        out.append(a + (offsets[s], offsets[end], 1))
        i = chunk + cut
      else:
        out.append(a + (offsets[chunk + cut], offsets[i + 1], 0))
        i += 1
      chunk = i
      t += 1
  return np.array(out, np.int64).reshape(-1, 5)


def reference_plan(store, seed, max_seq_length, short_seq_prob, nsp):
  rng = np.random.default_rng(seed)
  key = int(rng.integers(0, 2 ** 63))
  order = rng.permutation(store.num_docs)
  max_tokens = max_seq_length - (3 if nsp else 2)
  spans = reference_spans(store.sentence_offsets.tolist(), store.doc_sentences.tolist(),
                          order.tolist(), key, max_tokens, short_seq_prob, nsp)
  a_len, b_len = spans[:, 1] - spans[:, 0], spans[:, 3] - spans[:, 2]
  drops = np.array([spec_truncate(a, b, max_tokens) if nsp else (max(a - max_tokens, 0), 0)
                    for a, b in zip(a_len.tolist(), b_len.tolist())], np.int64).reshape(-1, 2)
  front_a = rng.binomial(drops[:, 0], 0.5)
  front_b = rng.binomial(drops[:, 1], 0.5)
  return (spans[:, 0] + front_a, a_len - drops[:, 0], spans[:, 2] + front_b,
          b_len - drops[:, 1], spans[:, 4])


def random_store(seed, num_docs, sentences, lengths):
  """Documents of rng.integers(*sentences) sentences of rng.integers(*lengths) tokens."""
  rng = np.random.default_rng(seed)
  docs = [[np.ones(int(n), np.int32) for n in rng.integers(*lengths, int(k))]
          for k in rng.integers(*sentences, num_docs)]
  return TokenStore.from_documents(docs)


STORES = {
    "many_short_docs": random_store(1, 400, (1, 8), (1, 30)),
    "few_long_docs": random_store(2, 3, (300, 600), (1, 50)),
    "single_sentence_docs": random_store(3, 150, (1, 2), (1, 80)),
    "one_doc": random_store(4, 1, (200, 201), (1, 40)),
    "very_long_sentences": random_store(5, 60, (1, 12), (1, 1500)),
    "mixed": random_store(6, 120, (1, 60), (1, 200)),
}


@pytest.mark.parametrize("store_name", sorted(STORES))
@pytest.mark.parametrize("nsp", [True, False])
@pytest.mark.parametrize("short_seq_prob", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("max_seq_length", [16, 128, 512])
def test_vectorised_plan_is_the_sequential_loop(store_name, nsp, short_seq_prob,
                                                max_seq_length):
  store = STORES[store_name]
  seed = [len(store_name), int(nsp), int(10 * short_seq_prob), max_seq_length]
  plan = build_plan(store, np.random.default_rng(seed), max_seq_length=max_seq_length,
                    short_seq_prob=short_seq_prob, nsp=nsp)
  expected = reference_plan(store, seed, max_seq_length, short_seq_prob, nsp)
  got = (plan.a_start, plan.a_len, plan.b_start, plan.b_len, plan.nsp_label)
  for name, g, e in zip(("a_start", "a_len", "b_start", "b_len", "nsp_label"), got, expected):
    assert g.dtype == np.int64, name
    np.testing.assert_array_equal(g, e, err_msg=name)
  limit = max_seq_length - (3 if nsp else 2)
  assert (plan.a_len >= 1).all() and (plan.a_len + plan.b_len <= limit).all()
  assert (plan.b_len >= 1).all() if nsp else (plan.b_len == 0).all()


def test_an_empty_store_has_an_empty_plan():
  empty = TokenStore(np.zeros(0, np.int32), np.zeros(1, np.int64), np.zeros(1, np.int64))
  assert len(build_plan(empty, np.random.default_rng(0), max_seq_length=64)) == 0


def test_uniforms_are_splitmix64_and_uniform():
  key = 0x1234_5678_9ABC_DEF0
  docs = np.arange(0, 2 ** 32, 2 ** 20 + 7)
  for t, slot in [(0, 0), (5, START), (2 ** 29 - 1, 7)]:
    expected = [splitmix_uniform(key, d, t, slot) for d in docs.tolist()]
    np.testing.assert_array_equal(uniforms(key, docs, t, slot), expected)
  u = uniforms(key, np.arange(200_000), 3, CUT)
  counts = np.bincount((u * 20).astype(int), minlength=20)
  assert u.min() >= 0 and u.max() < 1
  assert ((counts - 10_000) ** 2 / 10_000).sum() < 80  # chi2, 19 dof: mean 19, sd 6
  assert abs(np.corrcoef(u, uniforms(key, np.arange(200_000), 3, COIN))[0, 1]) < 0.02


BIG = random_store(7, 3000, (1, 30), (5, 60))


def untruncated(store, seed, max_seq_length=128, short_seq_prob=0.0, nsp=True,
                same_document=False):
  rng = np.random.default_rng(seed)
  key, order = int(rng.integers(0, 2 ** 63)), rng.permutation(store.num_docs)
  return key, instance_spans(store.sentence_offsets, store.doc_sentences, order, key,
                             max_tokens=max_seq_length - (3 if nsp else 2),
                             short_seq_prob=short_seq_prob, nsp=nsp,
                             same_document=same_document)


def test_nsp_labels_and_cuts_are_balanced_on_multi_sentence_chunks():
  offsets, doc_sentences = BIG.sentence_offsets, BIG.doc_sentences
  sentence = lambda x: np.searchsorted(offsets, x, side="right") - 1  # noqa: E731
  labels, cut_of_3 = [], []
  for seed in range(3):
    _, (a_start, a_end, _, _, label) = untruncated(BIG, seed)
    first = sentence(a_start)
    last = doc_sentences[np.searchsorted(doc_sentences, first, side="right")]
    size = np.minimum(np.searchsorted(offsets, a_start + 125), last) - first
    assert (label[size == 1] == 1).all()
    labels.append(label[size >= 2])
    cut_of_3.append(sentence(a_end)[size == 3] - first[size == 3])
  labels, cuts = np.concatenate(labels), np.concatenate(cut_of_3)
  n, m = len(labels), len(cuts)
  assert n > 20_000 and m > 2_000
  assert abs(labels.sum() - n / 2) < 5 * np.sqrt(n / 4), (labels.mean(), n)
  assert set(cuts.tolist()) == {1, 2}
  assert abs((cuts == 1).sum() - m / 2) < 5 * np.sqrt(m / 4), ((cuts == 1).mean(), m)


@pytest.mark.parametrize("short_seq_prob", [0.0, 0.1, 0.5, 1.0])
def test_short_targets_are_drawn_once_per_document_with_short_seq_prob(short_seq_prob):
  n, max_tokens = 50_000, 125
  got = targets(99, n, max_tokens, short_seq_prob)
  assert got.min() >= 2 and got.max() <= max_tokens
  p = short_seq_prob * (1 - 1 / (max_tokens - 1))  # a short target may be max_tokens
  short = (got < max_tokens).sum()
  assert abs(short - n * p) <= 5 * np.sqrt(n * p * (1 - p)), (short / n, p)
  if short_seq_prob == 1.0:  # uniform over [2, max_tokens]
    counts = np.bincount(got, minlength=max_tokens + 1)[2:]
    assert ((counts - n / 124) ** 2 / (n / 124)).sum() < 123 + 5 * np.sqrt(2 * 123)


def test_short_targets_shorten_the_instances_of_their_documents():
  store = random_store(8, 2000, (20, 21), (3, 8))  # ~100 tokens a document
  plan = build_plan(store, np.random.default_rng(1), max_seq_length=512, short_seq_prob=0.3,
                    nsp=False)
  doc = np.searchsorted(store.doc_offsets, plan.a_start, side="right") - 1
  split = np.bincount(doc, minlength=store.num_docs) > 1  # only a short target splits one
  length = np.diff(store.doc_offsets)
  p = 0.3 * (length - 2) / 509  # the short target is in [2, length - 1] of [2, 510]
  assert abs(split.sum() - p.sum()) < 5 * np.sqrt((p * (1 - p)).sum()), (split.mean(), p.mean())


@pytest.mark.parametrize("nsp", [True, False])
def test_instances_fit_and_tile_each_document_in_order(nsp):
  store = random_store(9, 500, (1, 30), (1, 200))
  plan = build_plan(store, np.random.default_rng(2), max_seq_length=64, nsp=nsp)
  assert (plan.a_len + plan.b_len <= 64 - (3 if nsp else 2)).all()
  _, (a_start, a_end, b_start, b_end, label) = untruncated(store, 2, 64, 0.1, nsp)
  # A, and B when IsNext, cover every document once, back to back, in document order
  keep = (label == 0) & (b_end > b_start)  # IsNext B (none without NSP)
  starts = np.stack([a_start, np.where(keep, b_start, -1)], 1).ravel()
  ends = np.stack([a_end, np.where(keep, b_end, -1)], 1).ravel()
  starts, ends = starts[starts >= 0], ends[ends >= 0]
  doc = np.searchsorted(store.doc_offsets, starts, side="right") - 1
  first = np.r_[True, doc[1:] != doc[:-1]]
  assert len(np.unique(doc[first])) == store.num_docs  # each document in one run
  np.testing.assert_array_equal(starts[first], store.doc_offsets[doc[first]])
  np.testing.assert_array_equal(starts[~first], ends[np.flatnonzero(~first) - 1])
  last = np.r_[first[1:], True]
  np.testing.assert_array_equal(ends[last], store.doc_offsets[doc[last] + 1])


def test_not_next_b_is_another_document_and_is_next_b_follows_a():
  store = BIG
  doc_of = lambda x: np.searchsorted(store.doc_offsets, x, side="right") - 1  # noqa: E731
  _, (a_start, a_end, b_start, b_end, label) = untruncated(store, 5, 128, 0.1)
  assert (b_end > b_start).all() and (a_end > a_start).all()
  is_next = label == 0
  np.testing.assert_array_equal(b_start[is_next], a_end[is_next])
  np.testing.assert_array_equal(doc_of(b_end[is_next] - 1), doc_of(a_start[is_next]))
  other, own = doc_of(b_start[~is_next]), doc_of(a_start[~is_next])
  assert (other != own).all()
  np.testing.assert_array_equal(doc_of(b_end[~is_next] - 1), other)
  # the other document is uniform over the other documents: about as many draws of
  # documents before as after their own, relative to the document count
  below = (other < own).mean()
  expected = (own / (store.num_docs - 1)).mean()
  assert abs(below - expected) < 5 * np.sqrt(0.25 / len(own))
  plan = build_plan(store, np.random.default_rng(5), max_seq_length=128)
  b_doc, a_doc = doc_of(plan.b_start), doc_of(plan.a_start)
  assert (b_doc[plan.nsp_label == 1] != a_doc[plan.nsp_label == 1]).all()
  assert (b_doc[plan.nsp_label == 0] == a_doc[plan.nsp_label == 0]).all()
  assert (plan.b_start >= plan.a_start + plan.a_len)[plan.nsp_label == 0].all()


def test_same_document_negatives_come_from_elsewhere_in_a_s_document():
  """nsp_negatives="same_document": the same A spans, labels and IsNext Bs as BERT's
  plan; a NotNext B starts at a sentence of A's document outside A's chunk, uniformly
  over those sentences, and stays out of the chunk; a chunk that is its whole
  document takes B from another document."""
  store = BIG
  offsets, doc_sentences = store.sentence_offsets, store.doc_sentences
  sentence = lambda x: np.searchsorted(offsets, x, side="right") - 1  # noqa: E731
  doc_of = lambda x: np.searchsorted(store.doc_offsets, x, side="right") - 1  # noqa: E731
  _, bert = untruncated(store, 4)
  _, (a_start, a_end, b_start, b_end, label) = untruncated(store, 4, same_document=True)
  for got, want in zip((a_start, a_end, label), (bert[0], bert[1], bert[4])):
    np.testing.assert_array_equal(got, want)
  is_next = label == 0
  np.testing.assert_array_equal(b_start[is_next], bert[2][is_next])
  np.testing.assert_array_equal(b_end[is_next], bert[3][is_next])
  doc = doc_of(a_start)
  first, last = doc_sentences[doc], doc_sentences[doc + 1]
  cursor = sentence(a_start)
  end = np.minimum(np.searchsorted(offsets, a_start + 125), last)  # the chunk's end
  outside = (last - first) - (end - cursor)
  own, elsewhere = ~is_next & (outside > 0), ~is_next & (outside == 0)
  assert own.sum() > 5_000 and elsewhere.sum() > 100
  assert (doc_of(b_start[elsewhere]) != doc[elsewhere]).all()
  s, e = sentence(b_start[own]), sentence(b_end[own] - 1)
  assert (doc_of(b_start[own]) == doc[own]).all()
  np.testing.assert_array_equal(offsets[s], b_start[own])  # whole sentences
  before = s < cursor[own]
  assert (e[before] < cursor[own][before]).all()  # B stops before the chunk
  assert (s[~before] >= end[own][~before]).all() and (e <= last[own] - 1).all()
  rank = np.where(before, s - first[own], s - first[own] - (end - cursor)[own])
  u = (rank + 0.5) / outside[own]  # uniform over the outside sentences: mean 1/2
  assert (rank >= 0).all() and (rank < outside[own]).all()
  assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / len(u))
  plan = build_plan(store, np.random.default_rng(4), max_seq_length=128,
                    nsp_negatives="same_document")
  assert (plan.a_len + plan.b_len <= 125).all() and (plan.b_len >= 1).all()
  with pytest.raises(ValueError, match="nsp_negatives='shuffled'"):
    build_plan(store, np.random.default_rng(4), max_seq_length=128,
               nsp_negatives="shuffled")


def test_plan_is_a_function_of_the_generator_and_visits_documents_in_permuted_order():
  store = STORES["mixed"]
  one = build_plan(store, np.random.default_rng([3, 0]), max_seq_length=128)
  two = build_plan(store, np.random.default_rng([3, 0]), max_seq_length=128)
  other = build_plan(store, np.random.default_rng([3, 1]), max_seq_length=128)
  np.testing.assert_array_equal(one.a_start, two.a_start)
  np.testing.assert_array_equal(one.nsp_label, two.nsp_label)
  assert not np.array_equal(one.a_start, other.a_start)
  rng = np.random.default_rng([3, 0])
  rng.integers(0, 2 ** 63)
  order = rng.permutation(store.num_docs)
  doc = np.searchsorted(store.doc_offsets, one.a_start, side="right") - 1
  runs = doc[np.r_[True, doc[1:] != doc[:-1]]]
  np.testing.assert_array_equal(runs, order)


def test_python_iterations_are_instances_of_the_longest_document(monkeypatch):
  calls = []
  step = bert_plan._pair_step
  monkeypatch.setattr(bert_plan, "_pair_step", lambda *a: calls.append(1) or step(*a))
  store = STORES["many_short_docs"]
  plan = build_plan(store, np.random.default_rng(0), max_seq_length=128)
  doc = np.searchsorted(store.doc_offsets, plan.a_start, side="right") - 1
  assert len(calls) == np.bincount(doc).max() < store.num_sentences / 20


def test_not_next_b_document_is_uniform_over_the_other_documents():
  store = random_store(10, 6, (400, 401), (5, 60))
  own, other = [], []
  for seed in range(10):
    _, (a_start, _, b_start, _, label) = untruncated(store, seed, 64)
    doc_of = lambda x: np.searchsorted(store.doc_offsets, x, side="right") - 1  # noqa: E731
    own.append(doc_of(a_start[label == 1]))
    other.append(doc_of(b_start[label == 1]))
  own, other = np.concatenate(own), np.concatenate(other)
  counts = np.zeros((6, 6))
  np.add.at(counts, (own, other), 1)
  assert (np.diag(counts) == 0).all()
  for d in range(6):  # chi2 over the 5 other documents, 4 dof: mean 4, sd 2.8
    row = np.delete(counts[d], d)
    assert row.sum() > 800
    assert ((row - row.mean()) ** 2 / row.mean()).sum() < 4 + 5 * np.sqrt(8), (d, row)
