"""Optimizers and schedules: values from the formulas (BERT optimization.py, Adafactor),
worked by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.models import bert, build_model, t5
from t5x_like.train.defaults import default_config
from t5x_like.train.optimizers import decay_mask, make_optimizer


def _opt(**overrides):
  cfg = default_config().optimizer
  for k, v in overrides.items():
    cfg[k] = v
  return cfg


def _values(schedule, steps):
  return [float(schedule(s)) for s in steps]


# ------------------------------------------------------------------ schedules
def test_linear_schedule_is_berts_decay_measured_from_step_zero():
  _, sched = make_optimizer(_opt(schedule="linear", learning_rate=2.0, warmup_steps=4,
                                 decay_steps=20, end_learning_rate_fraction=0.25), 999)
  # warmup 2 * s / 4; then 0.5 + 1.5 * (1 - s / 20), floor 0.5 (= 0.25 * 2).
  np.testing.assert_allclose(_values(sched, [0, 1, 2, 3, 4, 10, 19, 20, 30]),
                             [0.0, 0.5, 1.0, 1.5, 1.7, 1.25, 0.575, 0.5, 0.5], rtol=1e-6)


def test_linear_schedule_bert_recipe_defaults_decay_to_num_steps():
  # lr 1e-4, 10k warmup, linear decay to 0 at num_steps = 1M (decay_steps 0 = num_steps).
  _, sched = make_optimizer(_opt(schedule="linear", learning_rate=1e-4, warmup_steps=10_000,
                                 decay_steps=0, end_learning_rate_fraction=0.0), 1_000_000)
  np.testing.assert_allclose(_values(sched, [0, 5_000, 9_999, 10_000, 500_000, 1_000_000]),
                             [0.0, 5e-5, 9.999e-5, 9.9e-5, 5e-5, 0.0], rtol=1e-5, atol=1e-12)


def test_rsqrt_schedule_is_t5s_constant_then_inverse_sqrt():
  # T5: 0.01 for 10k steps then 1 / sqrt(step).
  _, sched = make_optimizer(_opt(name="adafactor", schedule="rsqrt", learning_rate=0.01,
                                 warmup_steps=10_000), 10**6)
  np.testing.assert_allclose(_values(sched, [0, 1, 9_999, 10_000, 40_000, 250_000, 10**6]),
                             [0.01, 0.01, 0.01, 0.01, 0.005, 0.002, 0.001], rtol=1e-6)


def test_cosine_schedule():
  _, sched = make_optimizer(_opt(schedule="cosine", learning_rate=1.0, warmup_steps=10,
                                 decay_steps=110, end_learning_rate_fraction=0.1), 999)
  quarter = 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2
  np.testing.assert_allclose(_values(sched, [0, 5, 10, 35, 60, 110, 200]),
                             [0.0, 0.5, 1.0, quarter, 0.55, 0.1, 0.1], rtol=1e-6)


def test_constant_schedule_with_and_without_warmup():
  _, sched = make_optimizer(_opt(schedule="constant", learning_rate=3.0, warmup_steps=3), 10)
  np.testing.assert_allclose(_values(sched, [0, 1, 3, 100]), [0.0, 1.0, 3.0, 3.0], rtol=1e-6)
  _, sched = make_optimizer(_opt(schedule="constant", learning_rate=3.0, warmup_steps=0), 10)
  np.testing.assert_allclose(_values(sched, [0, 7]), [3.0, 3.0])


def test_unknown_names_raise():
  with pytest.raises(ValueError, match="schedule"):
    make_optimizer(_opt(schedule="step"), 10)
  with pytest.raises(ValueError, match="adamw"):
    make_optimizer(_opt(name="sgd"), 10)


# -------------------------------------------------------- weight-decay mask
def _flat_mask(params):
  mask = decay_mask(params)
  return {"/".join(k.key for k in path): v
          for path, v in jax.tree_util.tree_leaves_with_path(mask)}


def test_decay_mask_on_bert_params():
  model = build_model(bert(1, 64, vocab_size=32, num_heads=1, d_ff=64,
                           max_position_embeddings=16))
  mask = _flat_mask(model.param_shapes())
  decayed = {
      "token_embed/embedding", "position_embed/embedding", "type_embed/embedding",
      "encoder/layers_0/self_attention/query/kernel",
      "encoder/layers_0/self_attention/key/kernel",
      "encoder/layers_0/self_attention/value/kernel",
      "encoder/layers_0/self_attention/out/kernel",
      "encoder/layers_0/mlp/wi/kernel", "encoder/layers_0/mlp/wo/kernel",
      "mlm_transform/kernel", "pooler/kernel", "nsp/kernel",
  }
  not_decayed = {
      "embedding_norm/scale", "embedding_norm/bias",
      "encoder/layers_0/self_attention_norm/scale", "encoder/layers_0/self_attention_norm/bias",
      "encoder/layers_0/mlp_norm/scale", "encoder/layers_0/mlp_norm/bias",
      "encoder/layers_0/self_attention/query/bias", "encoder/layers_0/self_attention/key/bias",
      "encoder/layers_0/self_attention/value/bias", "encoder/layers_0/self_attention/out/bias",
      "encoder/layers_0/mlp/wi/bias", "encoder/layers_0/mlp/wo/bias",
      "mlm_transform/bias", "mlm_norm/scale", "mlm_norm/bias", "mlm_bias",
      "pooler/bias", "nsp/bias",
  }
  assert set(mask) == decayed | not_decayed  # every param is classified above
  assert {k for k, v in mask.items() if v} == decayed


def test_decay_mask_on_t5_params_skips_rmsnorm_scales():
  model = build_model(t5("1.1", 32, 64, 1, 2, vocab_size=32))
  mask = _flat_mask(model.param_shapes())
  assert not mask["encoder/final_norm/scale"]
  assert not mask["decoder/layers_0/cross_attention_norm/scale"]
  assert mask["decoder/layers_0/cross_attention/query/kernel"]
  assert mask["encoder/relpos/rel_embedding"]
  assert mask["logits_dense/kernel"] and mask["token_embed/embedding"]
  # 7 RMSNorm scales (encoder: 2 per layer + final; decoder: 3 per layer + final), the
  # only undecayed params of a bias-free model.
  assert sorted(k for k, v in mask.items() if not v) == sorted([
      "encoder/final_norm/scale", "encoder/layers_0/self_attention_norm/scale",
      "encoder/layers_0/mlp_norm/scale", "decoder/final_norm/scale",
      "decoder/layers_0/self_attention_norm/scale", "decoder/layers_0/cross_attention_norm/scale",
      "decoder/layers_0/mlp_norm/scale"])


# ---------------------------------------------------------------- one update
def _tree(rng):
  return {"dense": {"kernel": rng.randn(3, 4).astype(np.float32),
                    "bias": rng.randn(4).astype(np.float32)},
          "out_norm": {"scale": rng.randn(4).astype(np.float32)}}


@pytest.mark.parametrize("bias_correction", [False, True])
def test_adamw_two_steps_match_numpy(bias_correction):
  b1, b2, eps, wd, clip = 0.9, 0.999, 1e-6, 0.01, 1.5
  lrs = [0.1, 0.09]  # linear, no warmup, decay_steps 10: 0.1 * (1 - s / 10)
  tx, _ = make_optimizer(_opt(name="adamw", schedule="linear", learning_rate=0.1,
                              warmup_steps=0, decay_steps=10, weight_decay=wd, b1=b1, b2=b2,
                              eps=eps, bias_correction=bias_correction, clip_norm=clip), 10)
  rng = np.random.RandomState(0)
  params = _tree(rng)
  grads = [_tree(rng), jax.tree.map(lambda x: 0.1 * x, _tree(rng))]  # step 1 clipped, 2 not

  # numpy reference: BERT's AdamWeightDecayOptimizer (+ optional bias correction).
  ref = jax.tree.map(np.array, params)
  m = jax.tree.map(np.zeros_like, ref)
  v = jax.tree.map(np.zeros_like, ref)
  norms = []
  for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
    norm = np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in jax.tree.leaves(g)))
    norms.append(norm)
    scale = min(1.0, clip / norm)
    for path in [("dense", "kernel"), ("dense", "bias"), ("out_norm", "scale")]:
      gi = g[path[0]][path[1]] * scale
      mi = m[path[0]][path[1]] = b1 * m[path[0]][path[1]] + (1 - b1) * gi
      vi = v[path[0]][path[1]] = b2 * v[path[0]][path[1]] + (1 - b2) * gi ** 2
      if bias_correction:
        mi, vi = mi / (1 - b1 ** t), vi / (1 - b2 ** t)
      update = mi / (np.sqrt(vi) + eps)
      if path == ("dense", "kernel"):
        update = update + wd * ref[path[0]][path[1]]
      ref[path[0]][path[1]] = ref[path[0]][path[1]] - lr * update
  assert norms[0] > clip > norms[1]  # the first step really clips

  state = tx.init(params)
  p = jax.tree.map(jnp.asarray, params)
  for g in grads:
    updates, state = tx.update(g, state, p)
    p = jax.tree.map(lambda a, u: a + u, p, updates)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # Without correction the first step moves a param by about lr * (1 - b1) / sqrt(1 - b2)
  # = 3.16 lr, with it by about lr: the variants really differ.
  moved = abs(float(p["out_norm"]["scale"][0] - params["out_norm"]["scale"][0]))
  assert (moved > 2 * sum(lrs)) == (not bias_correction)


def test_adafactor_state_is_factored_for_2d_params():
  tx, _ = make_optimizer(_opt(name="adafactor", schedule="rsqrt", learning_rate=0.01,
                              warmup_steps=10, clip_norm=0.0, weight_decay=0.0,
                              adafactor_decay_rate=0.8), 100)
  rng = np.random.RandomState(0)
  params = {"w": jnp.asarray(rng.randn(128, 256), jnp.float32),
            "b": jnp.asarray(rng.randn(256), jnp.float32)}
  state = tx.init(params)
  leaves = {jax.tree_util.keystr(p): x.shape
            for p, x in jax.tree_util.tree_leaves_with_path(state)}
  row = [k for k in leaves if "v_row" in k and "'w'" in k]
  col = [k for k in leaves if "v_col" in k and "'w'" in k]
  full = [k for k in leaves if k.endswith(".v['w']")]
  assert leaves[row[0]] == (128,) and leaves[col[0]] == (256,) and leaves[full[0]] == (1,)
  assert leaves[[k for k in leaves if k.endswith(".v['b']")][0]] == (256,)  # 1-D: unfactored
  assert sum(np.prod(s) for s in leaves.values()) < 2 * (128 + 256) + 256 + 8

  # Two updates: v_row = beta * mean_col(g1^2) + (1 - beta) * mean_col(g2^2) with T5's
  # decay beta_t = 1 - t^-0.8 (0 at t = 1, 1 - 2^-0.8 at t = 2).
  g1 = {"w": rng.randn(128, 256).astype(np.float32), "b": rng.randn(256).astype(np.float32)}
  g2 = {"w": rng.randn(128, 256).astype(np.float32), "b": rng.randn(256).astype(np.float32)}
  for g in (g1, g2):
    updates, state = tx.update(g, state, params)
  beta = 1 - 2 ** -0.8
  want_row = beta * np.mean(g1["w"] ** 2, 1) + (1 - beta) * np.mean(g2["w"] ** 2, 1)
  got = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(state)}
  np.testing.assert_allclose(got[row[0]], want_row, rtol=1e-5)
  assert all(np.isfinite(u).all() for u in jax.tree.leaves(updates))
