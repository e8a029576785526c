"""The T5 paper's BERT-style objective (iid_denoising): the worked example of adding an
objective (one module and one registry line), checked against the paper's definition."""

import os

import numpy as np
import pytest

from t5x_like.data.iid_denoising import IidDenoising
from t5x_like.data.pipeline import OBJECTIVES, make_objective
from helpers import random_token_store
from references import stream_order
from t5x_like.data.vocab import default_vocab
from t5x_like.train.config_check import ConfigError, validate
from t5x_like.command_flags import load_config_file

V, EOS, LENGTH = 1000, 1, 64


def _store(num_docs=40, seed=0):
  return random_token_store(num_docs, seed, tokens=(2, 900), sentence_lengths=(5, 30),
                            sentences=(2, 8))


def _stream(store, seed, epoch):
  """Documents in the epoch's order (stream_order), concatenated (no separator)."""
  return np.concatenate([store.doc_tokens(d) for d in stream_order(store, seed, epoch)])


def test_targets_are_the_text_and_inputs_corrupt_about_15_percent():
  store = _store()
  objective = IidDenoising(store, seed=3, length=LENGTH, vocab_size=V, eos_id=EOS)
  count = objective.num_examples(1)
  stream = _stream(store, 3, 1)
  assert count == len(stream) // (LENGTH - 1)
  batch = objective.examples(np.arange(count), 1)
  want = np.stack([stream[i * (LENGTH - 1):(i + 1) * (LENGTH - 1)] for i in range(count)])
  np.testing.assert_array_equal(batch["decoder_target_tokens"][:, :-1], want)
  assert (batch["decoder_target_tokens"][:, -1] == EOS).all()
  assert (batch["encoder_input_tokens"][:, -1] == EOS).all()
  np.testing.assert_array_equal(batch["decoder_input_tokens"][:, 1:],
                                batch["decoder_target_tokens"][:, :-1])
  assert (batch["decoder_input_tokens"][:, 0] == 0).all()
  changed = batch["encoder_input_tokens"][:, :-1] != want
  sentinel = batch["encoder_input_tokens"][:, :-1] == V - 1
  # Binomial over count * 63 tokens: 0.15 +- a few standard deviations.
  n = changed.size
  assert abs(changed.mean() - 0.15) < 4 * np.sqrt(0.15 * 0.85 / n)
  # Of the corrupted tokens 90% become the sentinel (a random token rarely equals the
  # original, so the changed ones are about all the corrupted ones).
  assert abs(sentinel.sum() / changed.sum() - 0.9) < 0.05
  for name in ("encoder_segment_ids", "decoder_loss_weights", "decoder_segment_ids"):
    assert (batch[name] == 1).all()


def test_examples_are_a_function_of_seed_epoch_and_index():
  store = _store()
  a = IidDenoising(store, seed=0, length=LENGTH, vocab_size=V, eos_id=EOS)
  b = IidDenoising(store, seed=0, length=LENGTH, vocab_size=V, eos_id=EOS)
  one = a.example(5, 2)
  np.testing.assert_array_equal(one["encoder_input_tokens"],
                                b.examples(np.array([9, 5]), 2)["encoder_input_tokens"][1])
  other = a.example(5, 3)
  assert not np.array_equal(one["encoder_input_tokens"], other["encoder_input_tokens"])


def test_registered_once_and_built_from_its_spec():
  spec = OBJECTIVES["iid_denoising"]
  assert (spec.vocab_family, spec.model_family) == ("t5", "encoder_decoder")
  assert spec.options() == {"noise_density", "random_token_prob"}
  vocab = default_vocab("t5")
  objective = make_objective("iid_denoising", _store(), vocab, seed=0, length=32,
                             noise_density=0.5)
  assert isinstance(objective, IidDenoising) and objective.noise_density == 0.5
  assert objective.feature_shapes()["decoder_target_tokens"] == (32,)


def test_a_t5_config_validates_it_from_the_registry_alone():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  config = load_config_file(os.path.join(root, "configs", "t5_cpu.py"))
  config.data.objective = "iid_denoising"
  config.data.options = {"noise_density": 0.3}
  validate(config, 8)
  config.data.options = {"mean_noise_span_length": 3.0}  # span corruption's, not its
  with pytest.raises(ConfigError, match="data.options.mean_noise_span_length"):
    validate(config, 8)
