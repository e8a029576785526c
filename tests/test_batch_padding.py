"""Fine-tuning batches cut to their longest row (t5x_like/finetune/padding.py): the
lengths by hand, the same cut on every host, and the models' outputs unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.data.loader import make_loader
from t5x_like.finetune import padding
from t5x_like.finetune.encoding import EncodedRows
from t5x_like.finetune.evaluate import _host_batches
from t5x_like.finetune.model import FinetuneModel
from t5x_like.finetune.tasks import TaskConfigError, make_task, task_from_config
from t5x_like.models import bert, t5


def _padded(lengths, full, start=5):
  """[N, full] rows of `lengths` real tokens (ids >= start), then zeros."""
  rows = np.zeros((len(lengths), full), np.int32)
  for i, n in enumerate(lengths):
    rows[i, :n] = start + np.arange(n)
  return rows


def test_cut_lengths_by_hand():
  np.testing.assert_array_equal(padding.used_lengths(_padded([3, 0, 7, 1], 16)), [3, 0, 7, 1])
  # a zero inside a row (a GPT token id 0) is not its end: the last nonzero entry is
  np.testing.assert_array_equal(padding.used_lengths([[4, 0, 4, 0, 0]]), [3])
  assert [padding.cut_length(n, 128) for n in (0, 1, 8, 9, 16, 17, 64, 65, 128)] == [
      8, 8, 8, 16, 16, 32, 64, 128, 128]
  assert padding.cut_length(90, 100) == 100 and padding.cut_length(5, 6) == 6
  rows = {"encoder_input_tokens": _padded([3, 11], 32), "encoder_type_ids": np.zeros((2, 32)),
          "decoder_target_tokens": np.ones((2, 32))}
  assert padding.cut_lengths(rows) == {"encoder_input_tokens": 16, "encoder_type_ids": 16}
  gpt = {"decoder_segment_ids": _padded([20], 64, start=1) > 0,
         "decoder_input_tokens": np.zeros((1, 64))}
  assert padding.cut_lengths(gpt) == {"decoder_segment_ids": 32, "decoder_input_tokens": 32}
  t5_targets = {"decoder_loss_weights": _padded([3, 9], 32) > 0,
                "decoder_target_tokens": np.ones((2, 32)), "decoder_input_tokens": np.ones((2, 32))}
  assert padding.cut_lengths(t5_targets) == {
      "decoder_loss_weights": 16, "decoder_target_tokens": 16, "decoder_input_tokens": 16}
  cut = padding.cut({**rows, "labels": np.array([0, 1])}, {"encoder_input_tokens": 16})
  assert cut["encoder_input_tokens"].shape == (2, 16) and cut["encoder_type_ids"].shape == (2, 32)


def test_every_host_cuts_its_rows_by_the_whole_global_batch():
  # 16 rows of 64 positions, a global batch of 8 over 2 hosts, rows read in the seeded
  # permutation of epoch 0 (by hand). Global batch 0: host 0's rows use 3 positions and
  # one of host 1's uses 40, so both cut to 64 (no cut); batch 1: every row 3 -> 8.
  order = np.random.default_rng([7, 0]).permutation(16)
  lengths = np.full(16, 3)
  lengths[order[5]] = 40
  features = {"encoder_input_tokens": _padded(lengths, 64),
              "encoder_type_ids": _padded(lengths, 64) > 0,
              "labels": np.arange(16)}
  for host in range(2):
    loader = iter(make_loader(EncodedRows(features, 7, padding.CUT_GROUPS), 8, seed=7,
                              shuffle=False, process_index=host, process_count=2))
    for step, want in enumerate([64, 8]):
      batch = next(loader)
      rows = order[step * 8 + host * 4:step * 8 + (host + 1) * 4]
      np.testing.assert_array_equal(batch["labels"], rows)
      assert batch["encoder_input_tokens"].shape == (4, want), (host, step)
      assert batch["encoder_type_ids"].shape == (4, want)
      np.testing.assert_array_equal(batch["encoder_input_tokens"],
                                    features["encoder_input_tokens"][rows, :want])
  # no groups: the rows keep every position
  loader = iter(make_loader(EncodedRows(features, 7), 8, seed=7, shuffle=False,
                            process_index=0, process_count=1))
  assert next(loader)["encoder_input_tokens"].shape == (8, 64)


def test_evaluation_batches_are_cut_to_their_own_rows():
  features = {"encoder_input_tokens": _padded([3, 4, 30, 2, 1], 64)}
  batches = list(_host_batches(features, 2, padding.CUT_GROUPS))
  assert [(n, b["encoder_input_tokens"].shape) for n, b in batches] == [
      (2, (2, 8)), (2, (2, 32)), (1, (2, 8))]
  assert [b["encoder_input_tokens"].shape for _, b in _host_batches(features, 2)] == [
      (2, 64)] * 3


def test_batch_padding_option():
  assert make_task("classification").padding_groups() == padding.CUT_GROUPS
  assert make_task("classification", batch_padding="max_length").padding_groups() == ()
  assert make_task("token_classification").padding_groups() == ()  # outputs per position
  assert make_task("span_extraction").padding_groups() == ()
  import ml_collections
  with pytest.raises(TaskConfigError, match=r"config.task \(regression\): batch_padding="
                     r"'short': expected one of longest, max_length"):
    task_from_config(ml_collections.ConfigDict({"name": "regression", "batch_padding": "short"}))


@pytest.mark.parametrize("kind", ["bert_cls", "bert_mean", "t5_rank"])
def test_a_cut_batch_gives_the_same_outputs(kind):
  """The full-length batch is the reference (tests/test_finetune.py checks it against
  transformers); the cut batch drops only padding the model masks."""
  if kind.startswith("bert"):
    model = FinetuneModel(bert(2, 32, num_heads=2, d_ff=64, vocab_size=99,
                               max_position_embeddings=64),
                          "classification", num_labels=3,
                          pooling="mean" if kind == "bert_mean" else "cls")
    tokens = _padded([5, 9, 3], 64)
    types = np.where(np.arange(64) >= 4, 1, 0) * (tokens > 0)
    batch = {"encoder_input_tokens": tokens, "encoder_type_ids": types}
  else:
    targets = np.array([[5, 6, 1, 0], [7, 1, 0, 0]])
    model = FinetuneModel(t5("1.1", 32, 64, 1, 2, vocab_size=60), "classification",
                          label_targets=targets)
    batch = {"encoder_input_tokens": _padded([5, 9, 3], 64, start=2)}
  params = jax.jit(model.init)(jax.random.key(0))
  logits = jax.jit(model.logits)
  full = logits(params, {k: jnp.asarray(v) for k, v in batch.items()})
  lengths = padding.cut_lengths(batch)
  assert set(lengths.values()) == {16}
  cut = logits(params, {k: jnp.asarray(v) for k, v in padding.cut(batch, lengths).items()})
  np.testing.assert_allclose(np.asarray(cut), np.asarray(full), rtol=1e-5, atol=1e-5)


def test_a_cut_text_to_text_batch_gives_the_same_loss():
  """T5 text to text: the label strings' targets cut from 16 to 8 positions (and the
  encoder inputs from 64 to 16) give the loss and token metrics of the full batch."""
  targets = np.array([[5, 6, 1] + [0] * 13, [7, 1] + [0] * 14])  # two labels + eos, [2, 16]
  model = FinetuneModel(t5("1.1", 32, 64, 1, 2, vocab_size=60), "classification",
                        label_targets=targets)
  labels = np.array([0, 1, 1])
  batch = {"encoder_input_tokens": _padded([5, 9, 3], 64, start=2),
           "decoder_target_tokens": targets[labels],
           "decoder_input_tokens": np.concatenate([np.zeros((3, 1), int), targets[labels, :-1]], 1),
           "decoder_loss_weights": (targets[labels] > 0).astype(np.int32)}
  lengths = padding.cut_lengths(batch)
  assert lengths == {"encoder_input_tokens": 16, "encoder_type_ids": 16,
                     "decoder_input_tokens": 8, "decoder_target_tokens": 8,
                     "decoder_loss_weights": 8}
  params = jax.jit(model.init)(jax.random.key(0))
  loss = jax.jit(lambda p, b: model.loss_fn(p, b, None))
  as_jax = lambda b: {k: jnp.asarray(v, jnp.int32) for k, v in b.items()}
  (full, full_m), (cut, cut_m) = loss(params, as_jax(batch)), loss(
      params, as_jax(padding.cut(batch, lengths)))
  assert float(full) > 1.0  # an untrained model's loss, not a trivial 0
  np.testing.assert_allclose(float(cut), float(full), rtol=1e-6)
  for name in full_m:
    np.testing.assert_allclose(np.asarray(cut_m[name]), np.asarray(full_m[name]), rtol=1e-6,
                               err_msg=name)
