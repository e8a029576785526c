"""The train step: gradient accumulation, sharded state, sharded == single device, learning.

Tiny 1-layer models with dropout 0 (so that microbatched and sharded runs see the same
function); compiles are shared through module fixtures to keep the file fast.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from t5x_like import parallel
from t5x_like.models import bert, build_model, t5
from t5x_like.train.defaults import default_config
from t5x_like.train.optimizers import make_optimizer
from t5x_like.train.state import (TrainState, abstract_train_state, create_train_state,
                                  train_state_shardings)
from t5x_like.train.step import make_eval_step, make_train_step

RULES = parallel.DEFAULT_RULES
VOCAB, B, L, P_MLM = 64, 32, 16, 4
LR = 1e-2
STEPS = 5


def _opt_cfg(**kw):
  cfg = default_config().optimizer
  for k, v in kw.items():
    cfg[k] = v
  return cfg


def _bert_batch(seed=0):
  r = np.random.RandomState(seed)
  weights = (r.rand(B, P_MLM) > 0.35).astype(np.int32)
  weights[:8] = 1  # microbatch sums of weights differ (rows m, m + 4, ...: see step.py)
  weights[3::4, :3] = 0
  tokens = r.randint(1, VOCAB, (B, L)).astype(np.int32)
  tokens[::3, 12:] = 0  # padding
  return {"encoder_input_tokens": tokens,
          "encoder_type_ids": (np.arange(L)[None] >= L // 2).astype(np.int32).repeat(B, 0),
          "mlm_positions": r.randint(0, 12, (B, P_MLM)).astype(np.int32),
          "mlm_targets": r.randint(1, VOCAB, (B, P_MLM)).astype(np.int32),
          "mlm_weights": weights,
          "nsp_labels": r.randint(0, 2, (B,)).astype(np.int32)}


def _t5_batch(seed=0):
  r = np.random.RandomState(seed)
  enc = r.randint(1, VOCAB, (B, L)).astype(np.int32)
  targets = r.randint(1, VOCAB, (B, 8)).astype(np.int32)
  weights = np.ones((B, 8), np.int32)
  weights[::5, 4:] = 0
  targets[::5, 4:] = 0
  dec_in = np.concatenate([np.zeros((B, 1), np.int32), targets[:, :-1]], 1)
  return {"encoder_input_tokens": enc, "decoder_input_tokens": dec_in,
          "decoder_target_tokens": targets, "decoder_loss_weights": weights}


def _shapes(batch):
  return {k: v.shape for k, v in batch.items()}


@pytest.fixture(scope="module")
def mesh8():
  return parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


def _place(host_state, model, tx, mesh, batch):
  """A host copy of a state, put onto another mesh (and its shardings)."""
  shardings = train_state_shardings(model, tx, mesh, RULES, _shapes(batch))
  return jax.device_put(host_state, shardings), shardings


def _run(model, tx, sched, mesh, batch, microbatches, steps, state, shardings):
  """(params after each step as numpy, metrics per step, final state)."""
  step = make_train_step(model, tx, sched, microbatches=microbatches, mesh=mesh, rules=RULES,
                         state_shardings=shardings,
                         batch_shardings=parallel.batch_shardings(batch, mesh, RULES))
  sharded = parallel.shard_batch(batch, mesh, RULES)
  history, metrics = [], []
  for _ in range(steps):
    state, m = step(state, sharded, jax.random.key(7))
    history.append(jax.device_get(state.params))
    metrics.append(jax.device_get(m))
  return history, metrics, state


# ------------------------------------------------------------------- BERT runs
@pytest.fixture(scope="module")
def bert_runs(mesh8):
  model = build_model(bert(1, 32, vocab_size=VOCAB, num_heads=2, d_ff=64,
                           max_position_embeddings=L, dropout_rate=0.0,
                           attention_dropout_rate=0.0))
  # BERT's AdamW (no bias correction); linear decay from step 0, no warmup, so
  # lr(s) = 1e-2 * (1 - s / 10).
  tx, sched = make_optimizer(_opt_cfg(name="adamw", schedule="linear", learning_rate=LR,
                                      warmup_steps=0, decay_steps=10, bias_correction=False,
                                      clip_norm=1.0), 10)
  batch = _bert_batch()
  state0, shardings = create_train_state(model, tx, mesh8, RULES, _shapes(batch),
                                         jax.random.key(0))
  host0 = jax.device_get(state0)
  mesh1 = parallel.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  # Microbatches run on a ('data', 'tensor') mesh: on the 2x2x2 mesh XLA miscompiles
  # this BERT's gradient at 2 rows per batch shard (see test_t5_* for 2x2x2 microbatches).
  mesh42 = parallel.make_mesh({"data": 4, "tensor": 2})
  full = _run(model, tx, sched, mesh8, batch, 1, STEPS, state0, shardings)
  single = _run(model, tx, sched, mesh1, batch, 1, STEPS, *_place(host0, model, tx, mesh1,
                                                                   batch))
  micro = _run(model, tx, sched, mesh42, batch, 4, 1, *_place(host0, model, tx, mesh42, batch))
  return dict(model=model, tx=tx, batch=batch, init=host0.params, shardings=shardings,
              full=full, micro=micro, single=single)


def _assert_trees_close(a, b, rtol=1e-5, atol=2e-5):
  # Adam moves every param by ~lr (1e-2) per step whatever the size of its gradient, so
  # float summation-order noise in tiny gradients shows up as ~1e-6 here; a wrong
  # gradient shows up as ~1e-2.
  flat_a = jax.tree_util.tree_leaves_with_path(a)
  flat_b = jax.tree.leaves(b)
  assert len(flat_a) == len(flat_b)
  for (path, x), y in zip(flat_a, flat_b):
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


def _max_change(a, b):
  return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_bert_four_microbatches_of_8_equal_one_batch_of_32(bert_runs):
  full_params, full_metrics = bert_runs["single"][0][0], bert_runs["single"][1][0]
  micro_params, micro_metrics = bert_runs["micro"][0][0], bert_runs["micro"][1][0]
  assert bert_runs["micro"][2].params["mlm_bias"].sharding.mesh.shape == {"data": 4, "tensor": 2}
  # The microbatches really are unequal: their mlm weight sums differ.
  w = bert_runs["batch"]["mlm_weights"]
  sums = [int(w[m::4].sum()) for m in range(4)]
  assert len(set(sums)) > 1, sums
  assert _max_change(full_params, bert_runs["init"]) > 1e-3  # the step moved the params
  _assert_trees_close(micro_params, full_params)
  for name in ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "mlm_tokens", "grad_norm"):
    np.testing.assert_allclose(micro_metrics[name], full_metrics[name], rtol=1e-5, err_msg=name)
  assert full_metrics["mlm_tokens"] == w.sum()
  assert full_metrics["nsp_tokens"] == B


def test_bert_state_sharded_by_rules(bert_runs):
  state = bert_runs["full"][2]
  params, (_, adam, *_) = state.params, state.opt_state
  # DEFAULT_RULES on ('data', 'fsdp', 'tensor'): embed -> fsdp; mlp, heads, vocab -> tensor.
  want = {
      ("token_embed", "embedding"): P("tensor", "fsdp"),  # [vocab, embed]
      ("encoder", "layers_0", "mlp", "wi", "kernel"): P("fsdp", "tensor"),  # [embed, mlp]
      ("encoder", "layers_0", "mlp", "wo", "kernel"): P("tensor", "fsdp"),  # [mlp, embed]
      ("encoder", "layers_0", "self_attention", "query", "kernel"): P("fsdp", "tensor", None),
      ("encoder", "layers_0", "mlp_norm", "scale"): P("fsdp"),  # [embed]
  }

  def get(tree, path):
    for k in path:
      tree = tree[k]
    return tree

  def norm(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(spec))

  for path, spec in want.items():
    for tree in (params, adam.mu, adam.nu):
      x = get(tree, path)
      assert norm(x.sharding.spec, x.ndim) == norm(spec, x.ndim), path
    # Each device really holds only its shard.
    x = get(params, path)
    shard = x.addressable_shards[0].data.shape
    assert np.prod(shard) == np.prod(x.shape) // np.prod(
        [2 for s in norm(spec, x.ndim) if s is not None]), path
  assert state.step.sharding.spec == P() and int(state.step) == STEPS
  assert adam.count.sharding.spec == P()
  # The step's out_shardings are the ones create_train_state returned.
  assert jax.tree.map(lambda x: x.sharding, state) == bert_runs["shardings"]


def test_abstract_train_state_matches_real_state(bert_runs, mesh8):
  model, tx, batch = bert_runs["model"], bert_runs["tx"], bert_runs["batch"]
  abstract = abstract_train_state(model, tx, mesh8, RULES, _shapes(batch))
  real = bert_runs["full"][2]
  assert isinstance(abstract, TrainState)
  assert jax.tree.structure(abstract) == jax.tree.structure(real)
  for a, r in zip(jax.tree.leaves(abstract), jax.tree.leaves(real)):
    assert isinstance(a, jax.ShapeDtypeStruct)
    assert (a.shape, a.dtype, a.sharding) == (r.shape, r.dtype, r.sharding)
  # Onto another mesh (restore onto a different topology): shardings follow it.
  other = parallel.make_mesh({"data": 4, "tensor": 2})
  moved = abstract_train_state(model, tx, other, RULES, _shapes(batch))
  kernel = moved.params["encoder"]["layers_0"]["mlp"]["wi"]["kernel"]
  assert kernel.sharding.mesh.shape == {"data": 4, "tensor": 2}
  assert tuple(kernel.sharding.spec) in ((None, "tensor"),)
  assert tuple(moved.opt_state[1].mu["encoder"]["layers_0"]["mlp"]["wi"]["kernel"]
               .sharding.spec) == (None, "tensor")


def test_sharded_step_equals_single_device_step(bert_runs):
  single_init = bert_runs["init"]
  sharded_hist, sharded_metrics = bert_runs["full"][0], bert_runs["full"][1]
  single_hist, single_metrics = bert_runs["single"][0], bert_runs["single"][1]
  assert bert_runs["single"][2].params["mlm_bias"].sharding.mesh.size == 1
  for step in range(STEPS):
    _assert_trees_close(sharded_hist[step], single_hist[step])
    for name in ("loss", "grad_norm", "mlm_accuracy"):
      np.testing.assert_allclose(sharded_metrics[step][name], single_metrics[step][name],
                                 rtol=1e-5, err_msg=f"{name} at step {step}")
  assert _max_change(sharded_hist[-1], single_init) > 1e-2


def test_loss_falls_and_lr_follows_schedule(bert_runs):
  metrics = bert_runs["full"][1]
  losses = [float(m["loss"]) for m in metrics]
  assert losses[-1] < losses[0] - 1.0, losses  # 4.86 -> 3.18 in 5 steps
  # lr(s) = 1e-2 * (1 - s / 10), the step's lr is that of the update it applies.
  np.testing.assert_allclose([float(m["learning_rate"]) for m in metrics],
                             [1e-2, 9e-3, 8e-3, 7e-3, 6e-3], rtol=1e-6)
  # grad_norm is the norm before clipping at 1.0 (it may exceed 1.0).
  assert all(np.isfinite(m["grad_norm"]) and m["grad_norm"] > 0 for m in metrics)
  tokens = bert_runs["batch"]["encoder_input_tokens"]
  assert metrics[0]["nonpadding_tokens"] == np.count_nonzero(tokens)


def test_batch_not_divisible_by_microbatches_raises(bert_runs, mesh8):
  batch = {k: v[:12] for k, v in bert_runs["batch"].items()}
  step = make_train_step(bert_runs["model"], bert_runs["tx"], lambda s: 0.0, microbatches=8,
                         mesh=mesh8, rules=RULES, state_shardings=bert_runs["shardings"],
                         batch_shapes=_shapes(batch))
  state = bert_runs["full"][2]
  with pytest.raises(ValueError, match="not divisible by microbatches=8"):
    step.lower(state, parallel.shard_batch(batch, mesh8, RULES), jax.random.key(0))


# --------------------------------------------------------------------- T5 runs
def test_t5_four_microbatches_equal_one_batch_and_eval_step(mesh8):
  model = build_model(t5("1.1", 32, 64, 1, 2, vocab_size=VOCAB))  # v1.1: dropout 0
  tx, sched = make_optimizer(_opt_cfg(name="adafactor", schedule="rsqrt", learning_rate=LR,
                                      warmup_steps=10, clip_norm=0.0, weight_decay=0.0), 100)
  batch = _t5_batch()
  state0, shardings = create_train_state(model, tx, mesh8, RULES, _shapes(batch),
                                         jax.random.key(0))
  host0 = jax.device_get(state0)
  init = host0.params
  eval_step = make_eval_step(model, mesh=mesh8, rules=RULES, state_shardings=shardings,
                             batch_shapes=_shapes(batch))
  eval_metrics = jax.device_get(eval_step(state0.params, parallel.shard_batch(batch, mesh8)))
  (full_params,), (full_m,), _ = _run(model, tx, sched, mesh8, batch, 1, 1, state0, shardings)
  (micro_params,), (micro_m,), _ = _run(model, tx, sched, mesh8, batch, 4, 1,
                                        *_place(host0, model, tx, mesh8, batch))
  assert _max_change(full_params, init) > 1e-3
  _assert_trees_close(micro_params, full_params)
  for name in ("loss", "token_accuracy", "token_tokens", "grad_norm"):
    np.testing.assert_allclose(micro_m[name], full_m[name], rtol=1e-5, err_msg=name)
  assert full_m["token_tokens"] == batch["decoder_loss_weights"].sum()
  assert full_m["learning_rate"] == pytest.approx(LR)  # rsqrt: constant for 10 steps
  # The eval step on the initial params computes the same (deterministic) loss.
  np.testing.assert_allclose(eval_metrics["loss"], full_m["loss"], rtol=1e-5)
  assert eval_metrics["decoder_tokens"] == np.count_nonzero(batch["decoder_target_tokens"])


def test_adafactor_factored_state_shardings(mesh8):
  model = build_model(t5("1.1", 128, 256, 1, 2, vocab_size=128))
  tx, _ = make_optimizer(_opt_cfg(name="adafactor", schedule="rsqrt", clip_norm=0.0), 10)
  abstract = abstract_train_state(model, tx, mesh8, RULES)
  wi = "['encoder']['layers_0']['mlp']['wi_0']['kernel']"  # [embed 128, mlp 256]
  leaves = {jax.tree_util.keystr(path): x
            for path, x in jax.tree_util.tree_leaves_with_path(abstract.opt_state)}

  def stat(name):  # e.g. "...v_row['encoder']...['kernel']"
    (key,) = [k for k in leaves if k.endswith(f".{name}{wi}")]
    return leaves[key]

  assert abstract.params["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"].sharding.spec == P(
      "fsdp", "tensor")
  # v_row [128] keeps the embed dim's sharding, v_col [256] the mlp dim's.
  assert stat("v_row").shape == (128,) and stat("v_row").sharding.spec == P("fsdp")
  assert stat("v_col").shape == (256,) and stat("v_col").sharding.spec == P("tensor")
  assert stat("v").shape == (1,) and stat("v").sharding.spec == P()
