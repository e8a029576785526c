"""Model-level behaviour: losses against numpy formulas, masks in effect, bf16, validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.models import ModelConfig, bert, build_model, gpt2, t5


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_bert_loss_follows_specs_formula():
  """MLM: sum(w * nll) / (sum(w) + 1e-5) at mlm_positions; NSP: mean CE; total = sum."""
  model = build_model(bert(2, 64, vocab_size=97, dropout_rate=0.0, attention_dropout_rate=0.0))
  params = model.init(jax.random.key(0))
  rng = np.random.default_rng(0)
  tokens = rng.integers(5, 97, (3, 16))
  positions = np.array([[1, 4, 9, 0], [2, 3, 5, 7], [8, 0, 0, 0]])
  weights = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], np.float32)
  targets = rng.integers(5, 97, positions.shape)
  nsp = np.array([0, 1, 1])
  batch = {"encoder_input_tokens": tokens, "encoder_type_ids": np.zeros_like(tokens),
           "mlm_positions": positions, "mlm_targets": targets, "mlm_weights": weights,
           "nsp_labels": nsp}
  loss, metrics = model.loss_fn(params, jax.tree.map(jnp.asarray, batch), jax.random.key(1))

  full = model.logits(params, batch)  # logits at every position
  mlm_logp = _log_softmax(np.take_along_axis(np.asarray(full["mlm_logits"]),
                                             positions[..., None], 1))
  nll = -np.take_along_axis(mlm_logp, targets[..., None], -1)[..., 0]
  mlm = (nll * weights).sum() / (weights.sum() + 1e-5)
  nsp_loss = -_log_softmax(full["nsp_logits"])[np.arange(3), nsp].mean()
  np.testing.assert_allclose(metrics["mlm_loss"], mlm, rtol=1e-5)
  np.testing.assert_allclose(metrics["nsp_loss"], nsp_loss, rtol=1e-5)
  np.testing.assert_allclose(loss, mlm + nsp_loss, rtol=1e-5)
  assert metrics["mlm_tokens"] == weights.sum()
  predicted = np.argmax(mlm_logp, -1)
  np.testing.assert_allclose(metrics["mlm_accuracy"],
                             ((predicted == targets) * weights).sum() / (weights.sum() + 1e-5),
                             rtol=1e-6)


def test_decoder_loss_weights_and_z_loss():
  model = build_model(gpt2(2, 64, vocab_size=53, z_loss=1e-2, dropout_rate=0.0,
                           attention_dropout_rate=0.0))
  params = model.init(jax.random.key(0))
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, 53, (2, 10))
  targets = rng.integers(0, 53, (2, 10))
  weights = (rng.random((2, 10)) > 0.3).astype(np.float32)
  batch = {"decoder_input_tokens": tokens, "decoder_target_tokens": targets,
           "decoder_loss_weights": weights}
  loss, metrics = model.loss_fn(params, jax.tree.map(jnp.asarray, batch), None)
  logits = np.asarray(model.logits(params, batch), np.float64)
  log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  nll = -np.take_along_axis(_log_softmax(logits), targets[..., None], -1)[..., 0]
  expected = ((nll + 1e-2 * log_z ** 2) * weights).sum() / weights.sum()
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  assert metrics["token_tokens"] == weights.sum()


def test_prefix_lm_attention_is_bidirectional_only_on_the_prefix():
  model = build_model(gpt2(2, 64, vocab_size=50))
  params = model.init(jax.random.key(0))
  tokens = np.arange(1, 11)[None]
  prefix = np.array([[1, 1, 1, 1, 0, 0, 0, 0, 0, 0]])

  def logits(toks):
    return np.asarray(model.logits(params, {"decoder_input_tokens": toks,
                                            "decoder_causal_attention": prefix}))

  base = logits(tokens)
  changed_prefix = tokens.copy()
  changed_prefix[0, 3] = 40  # last prefix token: earlier prefix positions see it
  assert np.abs(logits(changed_prefix)[0, :3] - base[0, :3]).max() > 1e-4
  changed_target = tokens.copy()
  changed_target[0, 6] = 40  # a causal position: nothing before it may change
  np.testing.assert_allclose(logits(changed_target)[0, :6], base[0, :6], atol=1e-6)


def test_packed_segments_do_not_see_each_other():
  """Two examples packed in one row give the logits they give alone."""
  model = build_model(t5("1.1", 64, 96, 2, 4, vocab_size=61, head_dim=16))
  params = model.init(jax.random.key(0))
  enc_a, enc_b = np.array([5, 6, 7, 8]), np.array([9, 10, 11])
  dec_a, dec_b = np.array([0, 12, 13]), np.array([0, 14, 15, 16])
  packed = {
      "encoder_input_tokens": np.concatenate([enc_a, enc_b, [0]])[None],
      "encoder_segment_ids": np.array([[1, 1, 1, 1, 2, 2, 2, 0]]),
      "decoder_input_tokens": np.concatenate([dec_a, dec_b, [0]])[None],
      "decoder_segment_ids": np.array([[1, 1, 1, 2, 2, 2, 2, 0]]),
  }
  logits = jax.jit(model.logits)  # two compiles, not an eager forward's hundreds
  out = np.asarray(logits(params, packed))
  alone_b = np.asarray(logits(params, {"encoder_input_tokens": enc_b[None],
                                       "decoder_input_tokens": dec_b[None]}))
  # T5's relative bias depends only on distances, so segment b gives the same logits.
  np.testing.assert_allclose(out[0, 3:7], alone_b[0], atol=1e-5)


@pytest.mark.parametrize("make", [
    lambda **kw: bert(2, 64, vocab_size=77, **kw),
    lambda **kw: gpt2(2, 64, vocab_size=77, **kw),
    lambda **kw: t5("1.1", 64, 96, 2, 4, vocab_size=77, head_dim=16, **kw),
])
def test_bfloat16_compute_tracks_float32(make):
  f32 = build_model(make())
  bf16 = build_model(make(dtype="bfloat16"))
  params = f32.init(jax.random.key(0))
  for leaf in jax.tree.leaves(bf16.init(jax.random.key(0))):
    assert leaf.dtype == jnp.float32  # parameters stay float32
  batch = {k: jnp.asarray(np.random.default_rng(0).integers(1, 2 if "type" in k else 77, v))
           for k, v in f32.example_batch_shapes(2, 12).items()}
  ref, low = jax.tree.map(np.asarray, (f32.logits(params, batch), bf16.logits(params, batch)))
  for r, lo in zip(jax.tree.leaves(ref), jax.tree.leaves(low)):
    assert lo.dtype == jnp.bfloat16
    scale = np.abs(r).max()
    assert np.abs(lo.astype(np.float32) - r).max() < 0.05 * scale


@pytest.mark.parametrize("bad, field", [
    (dict(family="gpt"), "family"),
    (dict(mlp_activation="gelu2"), "mlp_activation"),
    (dict(d_model=100, num_heads=3), "num_heads"),
    (dict(num_heads=12, num_kv_heads=5), "num_kv_heads"),
    (dict(dtype="float16"), "dtype"),
    (dict(family="decoder", mlm_head=True), "mlm_head"),
    (dict(dropout_rate=1.5), "dropout_rate"),
])
def test_config_rejects_bad_fields_by_name(bad, field):
  with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
    ModelConfig(**bad)
