"""BERT pretraining examples against create_pretraining_data.py (google-research/bert).

The test store gives every token position its own id (id = OFFSET + position), so an
example's provenance is read off its ids: a run of consecutive ids is a contiguous
span of the store, and the document of an id is found from the store's offsets.
"""

import numpy as np
import pytest

from t5x_like.data.bert_pretraining import BertPretraining, build_plan, truncation_drops
from t5x_like.data.store import TokenStore
from references import spec_truncate

PAD, CLS, SEP, MASK = 0, 1, 2, 3
OFFSET = 10


def unique_store(num_docs=600, seed=0, max_sentence=40):
  rng = np.random.default_rng(seed)
  docs, next_id = [], OFFSET
  for _ in range(num_docs):
    doc = []
    for _ in range(int(rng.integers(1, 40))):
      n = int(rng.integers(1, max_sentence))
      doc.append(np.arange(next_id, next_id + n))
      next_id += n
    docs.append(doc)
  return TokenStore.from_documents(docs)


STORE = unique_store()
VOCAB = OFFSET + STORE.num_tokens


def make(store=STORE, **kwargs):
  args = dict(seed=0, max_seq_length=128, max_predictions_per_seq=20, cls_id=CLS,
              sep_id=SEP, mask_id=MASK, vocab_size=OFFSET + store.num_tokens)
  args.update(kwargs)
  return BertPretraining(store, **args)


def unmasked(batch):
  """The original rows: mlm_targets put back at mlm_positions."""
  tokens = batch["encoder_input_tokens"].copy()
  r, c = np.nonzero(batch["mlm_weights"])
  tokens[r, batch["mlm_positions"][r, c]] = batch["mlm_targets"][r, c]
  return tokens


def doc_of(token_ids, store=STORE):
  return np.searchsorted(store.doc_offsets, np.asarray(token_ids) - OFFSET, side="right") - 1


def split_row(row):
  """[CLS] A [SEP] B [SEP] pad... -> (A, B, n real tokens); asserts the layout."""
  assert row[0] == CLS
  seps = np.flatnonzero(row == SEP)
  assert len(seps) == 2, row
  n = seps[1] + 1
  assert (row[n:] == PAD).all()
  return row[1:seps[0]], row[seps[0] + 1:seps[1]], n


@pytest.fixture(scope="module")
def nsp_batches():
  objective = make()
  return objective, [objective.examples(np.arange(objective.num_examples(e)), e)
                     for e in range(3)]


def test_rows_are_cls_a_sep_b_sep_with_right_type_ids_and_provenance(nsp_batches):
  objective, batches = nsp_batches
  batch = batches[0]
  labels = batch["nsp_labels"]
  assert set(batch) == {"encoder_input_tokens", "encoder_type_ids", "encoder_segment_ids",
                        "mlm_positions", "mlm_targets", "mlm_weights", "nsp_labels"}
  assert batch["encoder_input_tokens"].shape[1:] == (128,) and labels.shape[1:] == ()
  originals = unmasked(batch)
  for row, types, segments, label in zip(originals, batch["encoder_type_ids"],
                                         batch["encoder_segment_ids"], labels):
    a, b, n = split_row(row)
    assert len(a) >= 1 and len(b) >= 1 and n <= 128
    expected_types = np.zeros(128, np.int32)
    expected_types[len(a) + 2:n] = 1
    np.testing.assert_array_equal(types, expected_types)
    np.testing.assert_array_equal(segments, np.arange(128) < n)
    assert (np.diff(a) == 1).all() and (np.diff(b) == 1).all()  # contiguous store spans
    doc_a, doc_b = doc_of(a), doc_of(b)
    assert (doc_a == doc_a[0]).all() and (doc_b == doc_b[0]).all()
    if label == 0:  # IsNext: B follows A in the same document
      assert doc_a[0] == doc_b[0] and b[0] > a[-1]
    else:  # NotNext: B from another document
      assert label == 1 and doc_a[0] != doc_b[0]


def test_nsp_labels_are_balanced():
  # sentences of 70 tokens: every chunk is 2 sentences (>= 125 tokens) except a lone
  # last sentence of a document, which is always NotNext and is left out here
  rng = np.random.default_rng(4)
  store = TokenStore.from_documents([[rng.integers(OFFSET, 1000, 70) for _ in range(100)]
                                     for _ in range(60)])
  labels = []
  last_sentence = store.sentence_offsets[store.doc_sentences[1:] - 1]
  for epoch in range(3):
    plan = build_plan(store, np.random.default_rng([9, epoch]), max_seq_length=128,
                      short_seq_prob=0.0)
    doc = np.searchsorted(store.doc_offsets, plan.a_start, side="right") - 1
    lone = plan.a_start >= last_sentence[doc]
    assert (plan.nsp_label[lone] == 1).all()
    labels.append(plan.nsp_label[~lone])
  labels = np.concatenate(labels)
  n = len(labels)
  assert n > 10000
  assert abs(labels.sum() - n / 2) < 5 * np.sqrt(n / 4), (labels.mean(), n)


def test_single_sentence_chunks_are_always_not_next():
  rng = np.random.default_rng(3)
  single = TokenStore.from_documents([[rng.integers(OFFSET, 100, 30)] for _ in range(50)])
  plan = build_plan(single, np.random.default_rng(0), max_seq_length=128)
  assert (plan.nsp_label == 1).all() and len(plan) == 50


def test_masking_never_touches_special_tokens_or_padding(nsp_batches):
  _, batches = nsp_batches
  for batch in batches:
    originals = unmasked(batch)
    inputs = batch["encoder_input_tokens"]
    weights = batch["mlm_weights"].astype(bool)
    positions = batch["mlm_positions"]
    real = batch["encoder_segment_ids"].astype(bool)
    rows = np.arange(len(inputs))[:, None]
    picked = originals[rows, positions][weights]
    assert not np.isin(picked, [CLS, SEP, PAD]).any()
    assert real[rows, positions][weights].all()
    # specials and padding keep their ids in the inputs
    special = np.isin(originals, [CLS, SEP]) | ~real
    np.testing.assert_array_equal(inputs[special], originals[special])
    # outside the picked positions nothing changed
    changed = inputs != originals
    marked = np.zeros_like(changed)
    marked[np.nonzero(weights)[0], positions[weights]] = True
    assert not (changed & ~marked).any()
    # sorted, distinct positions; padding slots have position 0 and weight 0
    for p, w in zip(positions, weights):
      k = w.sum()
      assert w[:k].all() and not w[k:].any()
      assert (np.diff(p[:k]) > 0).all() and (p[k:] == 0).all()


def test_80_10_10_split_over_100k_predictions(nsp_batches):
  _, batches = nsp_batches
  inputs, targets = [], []
  for batch in batches:
    w = batch["mlm_weights"].astype(bool)
    rows = np.arange(len(w))[:, None]
    inputs.append(batch["encoder_input_tokens"][rows, batch["mlm_positions"]][w])
    targets.append(batch["mlm_targets"][w])
  inputs, targets = np.concatenate(inputs), np.concatenate(targets)
  n = len(inputs)
  assert n >= 100_000, n
  masked = inputs == MASK
  kept = inputs == targets
  random = ~masked & ~kept
  # a random id equals the original or [MASK] with probability 1/VOCAB each: negligible
  for count, p in [(masked.sum(), 0.8), (kept.sum(), 0.1), (random.sum(), 0.1)]:
    assert abs(count - n * p) < 5 * np.sqrt(n * p * (1 - p)), (count, n * p)
  # random ids are uniform over [0, vocab_size)
  ids = inputs[random]
  assert ids.min() >= 0 and ids.max() < VOCAB
  assert abs(ids.mean() - (VOCAB - 1) / 2) < 5 * VOCAB / np.sqrt(12 * len(ids))


def spec_num_to_predict(n, prob, max_predictions):
  return min(max_predictions, max(1, round(n * prob)))


def test_num_to_predict_follows_the_formula(nsp_batches):
  assert spec_num_to_predict(128, 0.15, 10 ** 9) == 19
  assert spec_num_to_predict(512, 0.15, 10 ** 9) == 77
  _, batches = nsp_batches
  batch = batches[0]
  n = batch["encoder_segment_ids"].sum(1)
  got = batch["mlm_weights"].sum(1)
  expected = np.array([spec_num_to_predict(int(x), 0.15, 20) for x in n])
  np.testing.assert_array_equal(got, expected)
  assert (got[n == 128] == 19).all() and (n == 128).sum() > 100
  # 512 unconstrained by max_predictions: full rows predict 77
  big = make(max_seq_length=512, max_predictions_per_seq=80)
  batch = big.examples(np.arange(min(200, big.num_examples(0))), 0)
  n = batch["encoder_segment_ids"].sum(1)
  got = batch["mlm_weights"].sum(1)
  np.testing.assert_array_equal(got, [spec_num_to_predict(int(x), 0.15, 80) for x in n])
  assert (got[n == 512] == 77).all() and (n == 512).any()
  # a tight max_predictions caps it
  small = make(max_predictions_per_seq=7)
  batch = small.examples(np.arange(300), 0)
  n = batch["encoder_segment_ids"].sum(1)
  np.testing.assert_array_equal(batch["mlm_weights"].sum(1),
                                [spec_num_to_predict(int(x), 0.15, 7) for x in n])


def words_of(row, n, word_start):
  """Word index per position (-1 for specials/padding): a word starts at a word-start
  id or right after a special token; continuation pieces join the preceding word."""
  words = np.full(len(row), -1)
  w = -1
  for p in range(n):
    if row[p] in (CLS, SEP):
      continue
    if word_start[row[p]] or row[p - 1] in (CLS, SEP):
      w += 1
    words[p] = w
  return words


def test_whole_word_masking_never_splits_a_word():
  word_start = np.random.default_rng(5).random(VOCAB) < 0.5  # many multi-piece words
  objective = make(whole_word_masking=True, word_start=word_start)
  batch = objective.examples(np.arange(600), 0)
  originals = unmasked(batch)
  at_budget = 0
  for row, positions, weights, n in zip(originals, batch["mlm_positions"],
                                        batch["mlm_weights"], batch["encoder_segment_ids"].sum(1)):
    words = words_of(row, n, word_start)
    picked = positions[weights.astype(bool)]
    assert (words[picked] >= 0).all()
    picked_words = np.unique(words[picked])
    # every picked word is picked whole
    np.testing.assert_array_equal(np.sort(picked), np.flatnonzero(np.isin(words, picked_words)))
    budget = spec_num_to_predict(int(n), 0.15, 20)
    assert len(picked) <= budget
    at_budget += len(picked) == budget
  assert at_budget > 0.9 * 600


def greedy_whole_words(words, keys, budget):
  """create_masked_lm_predictions literally: shuffle the words (by key), take them in
  order, skipping a word that would overflow the budget."""
  taken = []
  for w in sorted(words, key=lambda w: keys[w[0]]):
    if len(taken) >= budget:
      break
    if len(taken) + len(w) > budget:
      continue
    taken.extend(w)
  return sorted(taken)


def test_vectorised_whole_word_choice_is_the_sequential_greedy():
  rng = np.random.default_rng(6)
  L, P = 64, 12
  word_start = rng.random(100) < 0.4
  word_start[[CLS, SEP]] = True
  objective = BertPretraining(STORE, 0, max_seq_length=L, max_predictions_per_seq=P,
                              cls_id=CLS, sep_id=SEP, mask_id=MASK, vocab_size=100,
                              whole_word_masking=True, word_start=word_start)
  B = 200
  original = rng.integers(OFFSET, 100, (B, L))
  lengths = rng.integers(5, L + 1, B)
  candidate = np.arange(L)[None] < lengths[:, None] - 1
  candidate[:, 0] = False
  sep = rng.integers(2, 60, B)
  candidate[np.arange(B), np.minimum(sep, lengths - 2)] = False  # a [SEP] inside
  original = np.where(candidate, original, SEP)
  original[:, 0] = CLS
  keys = rng.random((B, L))
  budget = rng.integers(1, P + 1, B)
  got = objective._choose_whole_words(original, candidate, keys, budget)
  for b in range(B):
    word_ids = words_of(original[b], L, word_start)
    words = [list(np.flatnonzero(word_ids == w)) for w in range(word_ids.max() + 1)]
    expected = greedy_whole_words(words, keys[b], int(budget[b]))
    assert got[b][got[b] < L].tolist() == expected


def test_truncation_counts_match_the_token_by_token_loop():
  la, lb = np.meshgrid(np.arange(1, 60), np.arange(1, 60))
  la, lb = la.ravel(), lb.ravel()
  for max_tokens in (2, 7, 30, 61):
    drop_a, drop_b = truncation_drops(la, lb, max_tokens)
    expected = np.array([spec_truncate(a, b, max_tokens) for a, b in zip(la, lb)])
    np.testing.assert_array_equal(drop_a, expected[:, 0])
    np.testing.assert_array_equal(drop_b, expected[:, 1])


def test_truncation_cuts_both_ends_at_random():
  # long sentences force truncation; A and B lose tokens at the front and at the back
  store = unique_store(num_docs=40, seed=8, max_sentence=300)
  objective = make(store=store, max_seq_length=64)
  batch = objective.examples(np.arange(objective.num_examples(0)), 0)
  front = back = 0
  starts = set((store.sentence_offsets[:-1] + OFFSET).tolist())
  ends = set((store.sentence_offsets[1:] - 1 + OFFSET).tolist())
  for row in unmasked(batch):
    a, b, n = split_row(row)
    assert n <= 64
    front += a[0] not in starts
    back += a[-1] not in ends
  assert front > 20 and back > 20


def test_without_nsp_rows_are_cls_a_sep_of_whole_sentences():
  objective = make(nsp=False)
  batch = objective.examples(np.arange(objective.num_examples(0)), 0)
  assert "nsp_labels" not in batch
  assert (batch["encoder_type_ids"] == 0).all()
  starts = set((STORE.sentence_offsets[:-1] + OFFSET).tolist())
  ends = set((STORE.sentence_offsets[1:] - 1 + OFFSET).tolist())
  covered = 0
  for row in unmasked(batch):
    assert row[0] == CLS
    seps = np.flatnonzero(row == SEP)
    assert len(seps) == 1
    a = row[1:seps[0]]
    assert (row[seps[0] + 1:] == PAD).all() and 1 <= len(a) <= 126
    assert (np.diff(a) == 1).all() and (doc_of(a) == doc_of(a)[0]).all()
    assert a[0] in starts and a[-1] in ends  # sentences are never cut (all < 40 tokens)
    covered += len(a)
  assert covered == STORE.num_tokens  # DOC-SENTENCES: every token used once per epoch


def test_examples_are_pure_functions_of_seed_epoch_index():
  a, b = make(seed=3), make(seed=3)
  for key, value in a.example(11, 1).items():
    np.testing.assert_array_equal(value, b.examples(np.array([4, 11]), 1)[key][1])
  assert not np.array_equal(a.example(11, 0)["encoder_input_tokens"],
                            a.example(11, 1)["encoder_input_tokens"])
  c = make(seed=4)
  assert not np.array_equal(a.example(11, 1)["encoder_input_tokens"],
                            c.example(11, 1)["encoder_input_tokens"])
