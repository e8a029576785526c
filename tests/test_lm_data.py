"""Causal LM and prefix LM examples: the packed stream, segments, positions, shifts."""

import numpy as np
import pytest

from t5x_like.data.lm import CausalLM, PrefixLM
from t5x_like.data.objective import example_rng
import t5x_like.data.store as store_module
from t5x_like.data.store import TokenStore
from helpers import random_token_store
from references import stream_order

EOS = 99


def random_store(num_docs=30, seed=0):
  return random_token_store(num_docs, seed, tokens=(2, 90), sentence_lengths=(1, 15),
                            sentences=(1, 6))


def stream_and_doc_starts(store, seed, epoch):
  """The brief's stream: documents in the epoch's order (stream_order), each + EOS."""
  tokens, starts = [], []
  for d in stream_order(store, seed, epoch):
    doc = list(store.doc_tokens(d)) + [EOS]
    starts += [True] + [False] * (len(doc) - 1)
    tokens += doc
  return np.array(tokens), np.array(starts)


def expected_packed(row, starts):
  """Segments, positions and decoder inputs of one packed row, token by token."""
  segments, positions, inputs = [], [], []
  seg = pos = 0
  for p, (token, start) in enumerate(zip(row, starts)):
    if p == 0 or start:
      seg, pos = seg + 1, 0
      inputs.append(0)
    else:
      pos += 1
      inputs.append(row[p - 1])
    segments.append(seg)
    positions.append(pos)
  return segments, positions, inputs


def test_hand_made_store_packs_as_specified():
  store = TokenStore.from_documents([[[10, 11], [12]], [[20]], [[30, 31, 32, 33]]])
  objective = CausalLM(store, seed=3, length=4, eos_id=EOS)
  stream, _ = stream_and_doc_starts(store, 3, 0)
  assert len(stream) == 11 and objective.num_examples(0) == 2
  order = stream_order(store, 3, 0)
  docs = {0: [10, 11, 12, EOS], 1: [20, EOS], 2: [30, 31, 32, 33, EOS]}
  assert stream.tolist() == sum((docs[d] for d in order), [])
  batch = objective.examples(np.arange(2), 0)
  # written out for this order: documents 2, 1, 0 -> 30 31 32 33 | EOS 20 EOS 10 | 11 12 EOS
  assert order == [2, 1, 0]
  np.testing.assert_array_equal(batch["decoder_target_tokens"],
                                [[30, 31, 32, 33], [EOS, 20, EOS, 10]])
  np.testing.assert_array_equal(batch["decoder_segment_ids"], [[1, 1, 1, 1], [1, 2, 2, 3]])
  np.testing.assert_array_equal(batch["decoder_positions"], [[0, 1, 2, 3], [0, 0, 1, 0]])
  np.testing.assert_array_equal(batch["decoder_input_tokens"],
                                [[0, 30, 31, 32], [0, 0, 20, 0]])
  np.testing.assert_array_equal(batch["decoder_loss_weights"], np.ones((2, 4)))


@pytest.mark.parametrize("chunk_docs", [1024, 4])
def test_rows_concatenate_to_the_stream_with_segments_and_shifts(monkeypatch, chunk_docs):
  monkeypatch.setattr(store_module, "STREAM_CHUNK_DOCS", chunk_docs)  # 1 chunk, 8 chunks
  store = random_store()
  for length in (7, 32):
    objective = CausalLM(store, seed=5, length=length, eos_id=EOS)
    stream, starts = stream_and_doc_starts(store, 5, 2)
    n = objective.num_examples(2)
    assert n == len(stream) // length
    batch = objective.examples(np.arange(n), 2)
    assert all(v.dtype == np.int32 and v.shape == (n, length) for v in batch.values())
    np.testing.assert_array_equal(batch["decoder_target_tokens"].ravel(),
                                  stream[:n * length])
    for i in range(n):
      window = slice(i * length, (i + 1) * length)
      segments, positions, inputs = expected_packed(stream[window], starts[window])
      np.testing.assert_array_equal(batch["decoder_segment_ids"][i], segments)
      np.testing.assert_array_equal(batch["decoder_positions"][i], positions)
      np.testing.assert_array_equal(batch["decoder_input_tokens"][i], inputs)
    assert (batch["decoder_loss_weights"] == 1).all()
    assert batch["decoder_segment_ids"].max() > 1  # documents really get packed


def test_determinism_and_epoch_order():
  store = random_store()
  a = CausalLM(store, seed=3, length=16, eos_id=EOS)
  b = CausalLM(store, seed=3, length=16, eos_id=EOS)
  for key, value in a.example(4, 1).items():
    np.testing.assert_array_equal(value, b.examples(np.array([0, 4]), 1)[key][1])
  assert not np.array_equal(a.examples(np.arange(5), 0)["decoder_target_tokens"],
                            a.examples(np.arange(5), 1)["decoder_target_tokens"])
  assert not np.array_equal(stream_and_doc_starts(store, 3, 0)[0],
                            stream_and_doc_starts(store, 3, 1)[0])


def test_prefix_lm_decoder_only_layout():
  store = random_store()
  L = 24
  objective = PrefixLM(store, seed=2, length=L, eos_id=EOS)
  stream, _ = stream_and_doc_starts(store, 2, 0)
  n = objective.num_examples(0)
  assert n == len(stream) // L
  batch = objective.examples(np.arange(n), 0)
  np.testing.assert_array_equal(batch["decoder_target_tokens"].ravel(), stream[:n * L])
  np.testing.assert_array_equal(batch["decoder_input_tokens"][:, 0], 0)
  np.testing.assert_array_equal(batch["decoder_input_tokens"][:, 1:],
                                batch["decoder_target_tokens"][:, :-1])
  splits = []
  for i in range(n):
    s = int(example_rng(2, 0, i).integers(1, L))  # the split point: uniform in [1, L-1]
    splits.append(s)
    np.testing.assert_array_equal(batch["decoder_loss_weights"][i], np.arange(L) >= s)
    np.testing.assert_array_equal(batch["decoder_causal_attention"][i], np.arange(L) <= s)
  assert (batch["decoder_segment_ids"] == 1).all()
  np.testing.assert_array_equal(batch["decoder_positions"], np.tile(np.arange(L), (n, 1)))
  assert min(splits) >= 1 and max(splits) <= L - 1 and len(set(splits)) > L // 2


def test_prefix_lm_split_is_uniform():
  store = random_store(num_docs=400)
  objective = PrefixLM(store, seed=0, length=8, eos_id=EOS)
  n = objective.num_examples(0)
  splits = objective.examples(np.arange(n), 0)["decoder_loss_weights"].argmax(1)
  counts = np.bincount(splits, minlength=8)
  assert counts[0] == 0 and n > 1000
  expected = n / 7
  assert (np.abs(counts[1:] - expected) < 5 * np.sqrt(expected)).all(), counts


def test_prefix_lm_encoder_decoder_layout():
  store = random_store()
  Li, Lt = 12, 9
  objective = PrefixLM(store, seed=4, inputs_length=Li, targets_length=Lt, eos_id=EOS)
  W = 9  # min(Li, Lt) raw tokens per example
  stream, _ = stream_and_doc_starts(store, 4, 1)
  n = objective.num_examples(1)
  assert n == len(stream) // W
  batch = objective.examples(np.arange(n), 1)
  assert batch["encoder_input_tokens"].shape == (n, Li)
  assert batch["decoder_target_tokens"].shape == (n, Lt)
  for i in range(n):
    s = int(example_rng(4, 1, i).integers(1, W))
    window = stream[i * W:(i + 1) * W]
    enc = list(window[:s]) + [EOS] + [0] * (Li - s - 1)
    dec = list(window[s:]) + [EOS] + [0] * (Lt - (W - s) - 1)
    np.testing.assert_array_equal(batch["encoder_input_tokens"][i], enc)
    np.testing.assert_array_equal(batch["decoder_target_tokens"][i], dec)
    real_dec = np.arange(Lt) <= W - s
    np.testing.assert_array_equal(batch["decoder_input_tokens"][i],
                                  np.where(real_dec, [0] + dec[:-1], 0))
    np.testing.assert_array_equal(batch["decoder_loss_weights"][i], real_dec)
    np.testing.assert_array_equal(batch["decoder_segment_ids"][i], real_dec)
    np.testing.assert_array_equal(batch["decoder_positions"][i],
                                  np.where(real_dec, np.arange(Lt), 0))
    np.testing.assert_array_equal(batch["encoder_segment_ids"][i], np.arange(Li) <= s)
    np.testing.assert_array_equal(batch["encoder_positions"][i],
                                  np.where(np.arange(Li) <= s, np.arange(Li), 0))


def test_prefix_lm_arguments():
  store = random_store()
  with pytest.raises(ValueError, match="either length"):
    PrefixLM(store, 0, eos_id=EOS, length=8, inputs_length=8, targets_length=8)
  with pytest.raises(ValueError, match="either length"):
    PrefixLM(store, 0, eos_id=EOS, inputs_length=8)
