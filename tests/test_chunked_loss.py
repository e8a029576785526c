"""The chunked cross-entropy (models/chunked_loss.py) against losses.cross_entropy +
token_metrics on the full logits, and each family's loss_fn with and without chunking."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.models import bert, build_model, chunked_loss, gpt2, losses, t5
from t5x_like.models.chunked_loss import chunked_cross_entropy, chunked_token_metrics
from t5x_like.models.layers import dot

Z_LOSS, SMOOTHING = 1e-2, 0.1


def _problem(dtype, vocab_axis, with_bias, rows=37, d=16, vocab=50, seed=0):
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(size=(rows, d)), dtype)
  kernel = jnp.asarray(rng.normal(size=(vocab, d) if vocab_axis == 0 else (d, vocab)),
                       jnp.float32)
  bias = jnp.asarray(rng.normal(size=(vocab,)), jnp.float32) if with_bias else None
  targets = jnp.asarray(rng.integers(0, vocab, rows))
  weights = jnp.asarray(rng.random(rows) * (rng.random(rows) > 0.3), jnp.float32)
  return hidden, kernel, bias, targets, weights


def _reference_metrics(hidden, kernel, bias, targets, weights, denominator, *, vocab_axis,
                       dtype):
  """Today's path: the model head's logits (layers.dot in the compute dtype, BERT's bias
  added in it), then losses.cross_entropy and token_metrics."""
  logits = dot(hidden, kernel.T if vocab_axis == 0 else kernel, 1, dtype)
  if bias is not None:
    logits = logits + bias.astype(dtype)
  per_token, z_term = losses.cross_entropy(logits, targets, z_loss=Z_LOSS,
                                           label_smoothing=SMOOTHING)
  return losses.token_metrics("x", logits, targets, weights, per_token, z_term, denominator)


@pytest.mark.parametrize("dtype, vocab_axis, with_bias", [
    (jnp.float32, 0, True), (jnp.float32, 1, False),
    (jnp.bfloat16, 0, True), (jnp.bfloat16, 1, False)])
def test_chunked_metrics_and_grads_equal_full_logits(dtype, vocab_axis, with_bias):
  """37 rows in chunks of 8 (5 chunks, the last padded), label smoothing, z-loss and
  fractional weights: loss, z-loss, accuracy, tokens and the gradients w.r.t. hidden,
  kernel and bias equal today's loss on full logits (float32 tight, bf16 within one
  bf16 rounding of the gradient)."""
  hidden, kernel, bias, targets, weights = _problem(dtype, vocab_axis, with_bias)
  denominator = jnp.sum(weights) + 1.0

  def reference(h, k, b):
    m = _reference_metrics(h, k, b, targets, weights, denominator, vocab_axis=vocab_axis,
                           dtype=dtype)
    return m["x_loss"], m

  def chunked(h, k, b):
    m = chunked_token_metrics("x", h, k, targets, weights, denominator, b,
                              vocab_axis=vocab_axis, chunk_rows=8, z_loss=Z_LOSS,
                              label_smoothing=SMOOTHING, dtype=dtype)
    return m["x_loss"], m

  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))
  (_, want), want_grads = grad(reference)(hidden, kernel, bias)
  (_, got), got_grads = grad(chunked)(hidden, kernel, bias)
  assert set(got) == set(want)
  assert 0.0 < float(want["x_accuracy"]) < 1.0 and float(want["x_z_loss"]) > 0.0
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
  tight = dtype == jnp.float32
  for w, g in zip(jax.tree.leaves(want_grads), jax.tree.leaves(got_grads), strict=True):
    assert g.dtype == w.dtype and g.shape == w.shape
    w, g = np.asarray(w, np.float32), np.asarray(g, np.float32)
    scale = np.abs(w).max()
    assert scale > 1e-3
    np.testing.assert_allclose(g, w, atol=(2e-6 if tight else 1e-2) * scale, rtol=0)


def test_accuracy_takes_the_first_of_tied_maxima():
  """Ids 3 and 5 have the same output row, so they tie for the largest logit: argmax (and
  the chunked accuracy) picks 3, so target 3 is right and target 5 wrong; target 0
  is wrong (logit 0, not the max)."""
  kernel = np.eye(6, dtype=np.float32)
  kernel[5] = kernel[3]
  hidden = np.zeros((3, 6), np.float32)
  hidden[:, 3] = 1.0
  _, _, correct = chunked_cross_entropy(jnp.asarray(hidden), jnp.asarray(kernel),
                                        jnp.array([3, 5, 0]), jnp.array([1.0, 10.0, 100.0]),
                                        vocab_axis=0, chunk_rows=2)
  assert float(correct) == 1.0


def _f32_shapes(text, rows, vocab):
  """Float32 arrays of `rows` x `vocab` (either order) in HLO or jaxpr text."""
  return re.findall(rf"f32\[(?:{rows},{vocab}|{vocab},{rows})\]", text.replace(" ", ""))


def test_no_rows_by_vocab_float32_array_in_the_compiled_gradient():
  """jit(value_and_grad) of the chunked loss over 96 rows in chunks of 16 has no
  f32[96, 211] array in its jaxpr or compiled HLO, where today's loss has several."""
  rows, vocab = 96, 211
  hidden, kernel, _, targets, weights = _problem(jnp.float32, 0, False, rows=rows,
                                                 vocab=vocab)

  def chunked(h, k):
    return chunked_cross_entropy(h, k, targets, weights, vocab_axis=0, chunk_rows=16,
                                 z_loss=Z_LOSS, label_smoothing=SMOOTHING)[0]

  def reference(h, k):
    return _reference_metrics(h, k, None, targets, weights, 1.0, vocab_axis=0,
                              dtype=jnp.float32)["x_loss"]

  for fn, expect_full in ((reference, True), (chunked, False)):
    step = jax.value_and_grad(fn, argnums=(0, 1))
    jaxpr = str(jax.make_jaxpr(step)(hidden, kernel))
    hlo = jax.jit(step).lower(hidden, kernel).compile().as_text()
    assert bool(_f32_shapes(jaxpr, rows, vocab)) == expect_full, fn.__name__
    assert bool(_f32_shapes(hlo, rows, vocab)) == expect_full, fn.__name__
  assert _f32_shapes(hlo, 16, vocab)  # the chunk's logits


# ------------------------------------------------------------------ the families
def _init(model, batch):
  shapes = {k: v.shape for k, v in batch.items()}
  return jax.jit(lambda rng: model.init(rng, shapes))(jax.random.key(0))  # eager: ~20 s


def _full_logits_in(model, params, batch, targets) -> bool:
  """Whether loss_fn's jaxpr holds float32 logits of the targets' shape by the vocab
  (the full-logits path; the chunked one has none)."""
  shape = ",".join(map(str, (*batch[targets].shape, model.config.vocab_size)))
  jaxpr = str(jax.make_jaxpr(lambda p: model.loss_fn(p, batch, None))(params))
  return f"f32[{shape}]" in jaxpr


def _assert_loss_fn_unchanged_by_chunking(config, batch, chunk_rows, targets):
  batch = jax.tree.map(jnp.asarray, batch)
  plain, chunked = (build_model(config.replace(loss_chunk_rows=0)),
                    build_model(config.replace(loss_chunk_rows=chunk_rows)))
  params = _init(plain, batch)
  # the chunked model really chunks (more rows than d_model and than one chunk)
  assert _full_logits_in(plain, params, batch, targets)
  assert not _full_logits_in(chunked, params, batch, targets)

  def run(model):
    # 'rbg' dropout keys compile much faster than threefry on CPU
    fn = lambda p: model.loss_fn(p, batch, jax.random.key(1, impl="rbg"))
    return jax.jit(jax.value_and_grad(fn, has_aux=True))(params)

  (want_loss, want), want_grads = run(plain)
  (got_loss, got), got_grads = run(chunked)
  assert set(got) == set(want)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=2e-6, atol=1e-7, err_msg=name)
  np.testing.assert_allclose(got_loss, want_loss, rtol=2e-6)
  flat_want = jax.tree_util.tree_leaves_with_path(want_grads)
  for (path, w), g in zip(flat_want, jax.tree.leaves(got_grads), strict=True):
    np.testing.assert_allclose(g, w, atol=1e-6 * max(1.0, np.abs(w).max()), rtol=1e-4,
                               err_msg=jax.tree_util.keystr(path))


def _lm_batch(rng, vocab, shape, encoder=False):
  batch = {"decoder_input_tokens": rng.integers(0, vocab, shape),
           "decoder_target_tokens": rng.integers(0, vocab, shape),
           "decoder_loss_weights": (rng.random(shape) > 0.2).astype(np.float32)}
  if encoder:
    batch["encoder_input_tokens"] = rng.integers(1, vocab, shape)
  return batch


def _gpt2_case():
  config = gpt2(1, 32, num_heads=2, d_ff=64, vocab_size=61, max_position_embeddings=16,
                z_loss=Z_LOSS, label_smoothing=SMOOTHING)
  # 4 x 9 rows: more than d_model (32), so the chunked loss runs (chunked_loss.pays)
  return config, _lm_batch(np.random.default_rng(0), 61, (4, 9))


def test_gpt2_loss_metrics_with_chunks_equal_without():
  """The default tier's twin of the gradient tests below: GPT-2's eval loss and metrics
  (the chunked primal, 4 x 9 rows in chunks of 4) equal the full-logits path's; logits()
  (infer, eval) still returns the full [B, T, V] logits."""
  config, batch = _gpt2_case()
  batch = jax.tree.map(jnp.asarray, batch)
  plain, chunked = (build_model(config.replace(loss_chunk_rows=0)),
                    build_model(config.replace(loss_chunk_rows=4)))
  params = _init(plain, batch)
  assert not _full_logits_in(chunked, params, batch, "decoder_target_tokens")
  _, want = jax.jit(lambda p: plain.loss_fn(p, batch, None))(params)
  _, got = jax.jit(lambda p: chunked.loss_fn(p, batch, None))(params)
  assert set(got) == set(want)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=2e-6, err_msg=name)
  inputs = {"decoder_input_tokens": batch["decoder_input_tokens"]}
  logits = chunked.logits(params, inputs)
  assert logits.shape == (4, 9, 61)
  np.testing.assert_array_equal(logits, plain.logits(params, inputs))


@pytest.mark.slow
def test_gpt2_loss_fn_with_chunks_equals_without():
  """Tied embedding, dropout on, z-loss and label smoothing: 4 x 9 rows in chunks of 4."""
  _assert_loss_fn_unchanged_by_chunking(*_gpt2_case(), chunk_rows=4,
                                        targets="decoder_target_tokens")


@pytest.mark.slow
def test_t5_loss_fn_with_chunks_equals_without():
  """The untied [D, V] lm head of T5 v1.1, on hidden states scaled as v1.0's
  (scale_decoder_output), dropout on."""
  config = t5("1.1", 32, 64, 1, 2, vocab_size=59, head_dim=16, dropout_rate=0.1,
              scale_decoder_output=True, z_loss=Z_LOSS, label_smoothing=SMOOTHING)
  batch = _lm_batch(np.random.default_rng(1), 59, (5, 7), encoder=True)
  _assert_loss_fn_unchanged_by_chunking(config, batch, chunk_rows=5,
                                        targets="decoder_target_tokens")


@pytest.mark.slow
def test_bert_loss_fn_with_chunks_equals_without():
  """MLM at mlm_positions with weights (and its output bias), NSP beside it."""
  rng = np.random.default_rng(2)
  config = bert(1, 32, num_heads=2, vocab_size=67, z_loss=Z_LOSS, label_smoothing=SMOOTHING)
  tokens = rng.integers(5, 67, (9, 12))  # 9 x 4 masked rows: more than d_model (32)
  batch = {"encoder_input_tokens": tokens, "encoder_type_ids": np.zeros_like(tokens),
           "mlm_positions": rng.integers(0, 12, (9, 4)),
           "mlm_targets": rng.integers(5, 67, (9, 4)),
           "mlm_weights": np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]] * 3, np.float32),
           "nsp_labels": np.array([0, 1, 1] * 3)}
  _assert_loss_fn_unchanged_by_chunking(config, batch, chunk_rows=5, targets="mlm_targets")


@pytest.mark.slow
def test_chunks_only_where_one_devices_rows_exceed_d_model():
  """The chunks keep a [V, D] float32 weight gradient and its scaled copy: they pay
  only where one device has more rows than d_model and than one chunk."""
  assert not chunked_loss.pays(1024, 40, 1024)  # BERT-large's masked rows on v3-128
  assert chunked_loss.pays(1024, 32 * 1024, 768)  # GPT-2 b32 x 1024 on one GPU
  assert not chunked_loss.pays(0, 32 * 1024, 768)  # switched off
  assert not chunked_loss.pays(1024, 912, 768)  # T5-base's 8 x 114 on v3-32: one chunk
  assert chunked_loss.batch_shards() == 1  # no mesh: one device holds every row


def test_sharded_chunked_loss_equals_single_device_full_logits():
  """On a data x fsdp x tensor = 2 x 2 x 2 mesh under the default rules (rows over
  data+fsdp, the tied embedding's vocab over tensor): the chunked GPT-2 loss and its
  gradients equal the unsharded loss on full logits, and each device's chunk of logits
  is [8 rows, 80 vocab / 2] (loss_chunk_rows counts rows per device)."""
  from t5x_like import parallel
  config = gpt2(1, 32, num_heads=2, d_ff=64, vocab_size=80, max_position_embeddings=16,
                dropout_rate=0.0, attention_dropout_rate=0.0, z_loss=Z_LOSS,
                label_smoothing=SMOOTHING)
  # 16 x 12 rows over 4 batch shards: 48 rows per device, more than d_model and than
  # one chunk of 8 (pays).
  batch = jax.tree.map(jnp.asarray, _lm_batch(np.random.default_rng(3), 80, (16, 12)))
  plain, chunked = (build_model(config.replace(loss_chunk_rows=0)),
                    build_model(config.replace(loss_chunk_rows=8)))
  shapes = {k: v.shape for k, v in batch.items()}
  params = _init(plain, batch)
  grad = lambda model: jax.value_and_grad(lambda p, b: model.loss_fn(p, b, None)[0])
  want_loss, want_grads = jax.jit(grad(plain))(params, batch)

  mesh = parallel.make_mesh([("data", 2), ("fsdp", 2), ("tensor", 2)])
  rules = parallel.DEFAULT_RULES
  param_sh = parallel.param_shardings(chunked, mesh, rules, shapes)
  with parallel.mesh_rules(mesh, rules):
    step = jax.jit(grad(chunked), in_shardings=(param_sh, parallel.batch_shardings(
        batch, mesh, rules)))
    hlo = step.lower(jax.device_put(params, param_sh), batch).compile().as_text()
    got_loss, got_grads = step(jax.device_put(params, param_sh), batch)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  for w, g in zip(jax.tree.leaves(want_grads), jax.tree.leaves(got_grads), strict=True):
    np.testing.assert_allclose(g, w, atol=1e-6 * max(1.0, np.abs(w).max()), rtol=1e-4)
  # a device's chunk: 8 rows (per device) by its 40 of the 80 words; never its 48 rows
  # or the whole batch's [192, 80]
  assert _f32_shapes(hlo, 8, 40)
  assert not _f32_shapes(hlo, 48, 40) and not _f32_shapes(hlo, 192, 80)
