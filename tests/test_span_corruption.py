"""T5 span corruption against t5.data.preprocessors (formulas, the 40-token example,
reconstruction, sentinel order, statistics) and the stream pipeline around it."""

import math

import numpy as np
import pytest

from t5x_like.data.objective import example_rng
from t5x_like.data.span_corruption import (SpanCorruption, _corrupt_batch, span_corruption,
                                           span_corruption_lengths)
from helpers import random_token_store
from references import stream_order

V = 32100
EOS = 1


def spec_lengths(n, density=0.15, mean=3.0):
  """random_spans_helper: (inputs_len, targets_len) of a raw piece of n tokens."""
  noise = round(n * density)
  spans = round(noise / mean)
  return n - noise + spans + 1, noise + spans + 1


def spec_mask_counts(n, density, mean):
  """random_spans_noise_mask: noise clamped into [1, n-1], spans = max(1, round(noise / mean))."""
  noise = min(max(round(n * density), 1), n - 1)
  return noise, max(1, round(noise / mean))


def reconstruct(inputs, targets, first_sentinel):
  """Walks inputs; each sentinel is replaced by the targets run after the same sentinel."""
  assert inputs[-1] == EOS and targets[-1] == EOS
  runs, current = {}, None
  for t in targets[:-1]:
    if t >= first_sentinel:
      current = int(t)
      runs[current] = []
    else:
      runs[current].append(int(t))
  out = []
  for t in inputs[:-1]:
    out.extend(runs.pop(int(t)) if t >= first_sentinel else [int(t)])
  assert not runs  # every target span was used
  return out


@pytest.mark.parametrize("inputs_length,raw,targets", [(512, 568, 114), (128, 141, 29),
                                                       (256, 284, 58), (1024, 1137, 229)])
def test_lengths_match_the_specs_table_and_a_full_piece_fills_them(inputs_length, raw, targets):
  assert span_corruption_lengths(inputs_length) == (raw, targets)
  # random_spans_helper's definition: the largest n whose inputs fit
  assert spec_lengths(raw) == (inputs_length, targets)
  assert spec_lengths(raw + 1)[0] > inputs_length
  inputs, out_targets = span_corruption(np.arange(raw) + 5, np.random.default_rng(0),
                                        vocab_size=V)
  assert (len(inputs), len(out_targets)) == (inputs_length, targets)


def test_the_specs_40_token_example():
  x = np.arange(40) + 100
  expected_inputs = list(x[:15]) + [32099] + list(x[18:37]) + [32098, EOS]
  expected_targets = [32099, *x[15:18], 32098, *x[37:40], EOS]
  assert len(expected_inputs) == 37 and len(expected_targets) == 9
  # the layout built directly: non-noise 15, noise 3, non-noise 19, noise 3
  inputs, targets = _corrupt_batch(x[None], np.array([[15, 3, 19, 3]]), vocab_size=V,
                                   eos_id=EOS)
  assert inputs[0].tolist() == expected_inputs
  assert targets[0].tolist() == expected_targets
  # and the public function draws exactly that layout for some generator
  for seed in range(20000):
    inputs, targets = span_corruption(x, np.random.default_rng(seed), vocab_size=V)
    if inputs[15] == 32099 and inputs[35] == 32098 and targets[4] == 32098:
      assert inputs.tolist() == expected_inputs
      assert targets.tolist() == expected_targets
      break
  else:
    pytest.fail("no generator produced the paper's layout (1 in 165 expected)")


def test_random_pieces_reconstruct_exactly_with_sentinels_counting_down():
  rng = np.random.default_rng(1)
  for _ in range(300):
    n = int(rng.integers(1, 400))
    density = float(rng.uniform(0.02, 0.45))
    mean = float(rng.uniform(1.5, 10.0))
    piece = rng.integers(2, V - 500, n)
    inputs, targets = span_corruption(piece, np.random.default_rng(int(rng.integers(1 << 30))),
                                      vocab_size=V, noise_density=density,
                                      mean_noise_span_length=mean)
    assert inputs.dtype == np.int32 and targets.dtype == np.int32
    assert reconstruct(inputs, targets, V - 500) == piece.tolist()
    if n < 2:
      assert targets.tolist() == [EOS]
      continue
    noise, spans = spec_mask_counts(n, density, mean)
    sentinels = [V - 1 - j for j in range(spans)]
    assert [t for t in inputs if t >= V - 500] == sentinels
    assert [t for t in targets if t >= V - 500] == sentinels
    assert len(inputs) == n - noise + spans + 1 and len(targets) == noise + spans + 1
    assert inputs[0] < V - 500  # starts with non-noise
    assert inputs[-2] == V - spans  # ends with noise: the last sentinel right before EOS
    assert targets[0] == V - 1


def composition_part_pmf(m, k):
  """P(a given part = j) for a uniform composition of m into k positive parts."""
  return {j: math.comb(m - j - 1, k - 2) / math.comb(m - 1, k - 1) for j in range(1, m - k + 2)}


def test_noise_statistics_match_the_parameters():
  rng = np.random.default_rng(2)
  noise_total = token_total = 0
  noise_spans = []
  for i in range(1500):
    n = 568 if i < 1000 else int(rng.integers(50, 600))
    inputs, targets = span_corruption(rng.integers(2, 30000, n), rng, vocab_size=V)
    is_sentinel = targets >= V - 200
    starts = np.flatnonzero(is_sentinel)
    lengths = np.diff(np.append(starts, len(targets) - 1)) - 1
    noise_total += lengths.sum()
    token_total += n
    if n == 568:
      noise_spans.extend(lengths.tolist())
  assert abs(noise_total / token_total - 0.15) < 0.005
  assert abs(np.mean(noise_spans) - 3.0) < 0.1
  # each noise span length is a part of a uniform composition of 85 into 28
  pmf = composition_part_pmf(85, 28)
  counts = np.bincount(noise_spans, minlength=max(pmf) + 1)
  total_variation = 0.5 * sum(abs(counts[j] / len(noise_spans) - p) for j, p in pmf.items())
  assert total_variation < 0.02, total_variation
  assert counts[1] > 0 and counts[5] > 0  # not a constant span length


def make_store(num_docs=40, seed=0):
  return random_token_store(num_docs, seed, tokens=(2, 30000), sentence_lengths=(1, 40),
                            sentences=(1, 20))


def epoch_stream(store, seed, epoch):
  """Documents in the epoch's order (stream_order), concatenated."""
  return np.concatenate([store.doc_tokens(d) for d in stream_order(store, seed, epoch)])


def test_pipeline_pieces_are_the_stream_corrupted_with_the_example_rng():
  store = make_store()
  objective = SpanCorruption(store, seed=7, inputs_length=128, vocab_size=V)
  stream = epoch_stream(store, 7, 1)
  assert objective.num_examples(1) == len(stream) // 141
  batch = objective.examples(np.arange(objective.num_examples(1)), 1)
  rebuilt = []
  for i in range(objective.num_examples(1)):
    piece = stream[i * 141:(i + 1) * 141]
    inputs, targets = span_corruption(piece, example_rng(7, 1, i), vocab_size=V)
    np.testing.assert_array_equal(batch["encoder_input_tokens"][i], inputs)
    np.testing.assert_array_equal(batch["decoder_target_tokens"][i], targets)
    rebuilt.extend(reconstruct(batch["encoder_input_tokens"][i],
                               batch["decoder_target_tokens"][i], V - 200))
  assert rebuilt == stream[:len(rebuilt)].tolist()
  assert batch["encoder_input_tokens"].shape[1:] == (128,)
  assert batch["decoder_target_tokens"].shape[1:] == (29,)
  # full pieces: no padding anywhere
  assert (batch["encoder_segment_ids"] == 1).all() and (batch["decoder_segment_ids"] == 1).all()
  assert (batch["decoder_loss_weights"] == 1).all()
  np.testing.assert_array_equal(batch["encoder_positions"][3], np.arange(128))
  np.testing.assert_array_equal(batch["decoder_positions"][3], np.arange(29))
  targets = batch["decoder_target_tokens"]
  np.testing.assert_array_equal(batch["decoder_input_tokens"][:, 0], 0)
  np.testing.assert_array_equal(batch["decoder_input_tokens"][:, 1:], targets[:, :-1])


def test_examples_are_pure_functions_of_seed_epoch_index():
  store = make_store()
  a = SpanCorruption(store, seed=3, inputs_length=64, vocab_size=V)
  b = SpanCorruption(store, seed=3, inputs_length=64, vocab_size=V)
  for key, value in a.example(5, 2).items():
    np.testing.assert_array_equal(value, b.examples(np.array([9, 5]), 2)[key][1])
  assert not np.array_equal(a.example(5, 2)["encoder_input_tokens"],
                            a.example(5, 3)["encoder_input_tokens"])
  c = SpanCorruption(store, seed=4, inputs_length=64, vocab_size=V)
  assert not np.array_equal(a.example(5, 2)["encoder_input_tokens"],
                            c.example(5, 2)["encoder_input_tokens"])
