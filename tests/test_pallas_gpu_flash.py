"""The Pallas GPU (Triton) flash-attention kernel (pallas_gpu_flash.py) against the
explicit kernel (attention_core's reference): outputs and gradients of q, k, v and a
bias, dropout included (the same hashed mask for one key), in Pallas interpret mode
on CPU; its lowering for CUDA from this CPU host (the Triton custom call); and when
'auto' picks it.

The explicit kernel computes its [B, N, T, S] probabilities with plain jnp (no block
loop, no online softmax), so it is an independent reference for the kernel's block
math; both draw dropout from dropout_hash, which test_attention_kernels.py checks
against its rate and key.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.models import dropout_hash, pallas_gpu_flash
from t5x_like.models.attention_core import attend, choose_kernel, record_kernels, tracing_for
from t5x_like.models.attention_kernels import pallas_interpret
from t5x_like.models.masks import mask_spec
from t5x_like.models.pallas_gpu_flash import flash_attention

B, T, N, H = 2, 64, 2, 16
RATE = 0.1
TRITON = "__gpu$xla.gpu.triton"
_FAST_COMPILE = {"xla_backend_optimization_level": 0}  # interpret mode: big CPU programs


def _segments(b, t, seed):
  """int32 [B, T] (numpy): two packed segments, then padding (0) of a length that
  differs per row."""
  rng = np.random.RandomState(seed)
  pos = np.arange(t)[None, :]
  cut = rng.randint(t // 4, t // 2, (b, 1))
  end = t - rng.randint(1, t // 4, (b, 1))
  return np.where(pos < cut, 1, np.where(pos < end, 2, 0)).astype(np.int32)


def _inputs(dtype, *, b=B, t=T, s=T, n=N, kv=N, h=H, bias_batch=1, seed=0):
  """numpy q, k, v (in dtype), bias [bias_batch, N, T, S] or None, cotangent."""
  rng = np.random.RandomState(seed)
  arr = lambda *shape: rng.randn(*shape).astype(np.float32)
  q, k, v = (x.astype(dtype) for x in (arr(b, t, n, h), arr(b, s, kv, h), arr(b, s, kv, h)))
  bias = None if bias_batch is None else arr(bias_batch, n, t, s)
  return q, k, v, bias, arr(b, t, n, h)


def _errors(got, want):
  """name -> max |got - want| / max |want| of out, dq, dk, dv (and dbias)."""
  return {name: float(np.abs(np.asarray(g, np.float32) - np.asarray(w, np.float32)).max()
                      / np.abs(np.asarray(w, np.float32)).max())
          for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want)}


def _grads(f, spec, inputs):
  """[out, dq, dk, dv, (dbias)] of sum(f(q, k, v, bias) * cot), cot 0 on query rows that
  see no key (their value is unspecified)."""
  q, k, v, bias, cot = inputs
  cot = cot * jnp.any(spec.dense(), -1)[:, 0, :, None, None]

  def loss(*args):
    out = f(*args)
    return jnp.sum(out.astype(jnp.float32) * cot), out

  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  (_, out), g = jax.value_and_grad(loss, argnums, has_aux=True)(q, k, v, bias)
  return [out * (cot != 0), *g]


def _attend_both(make_spec, inputs, *, rate=RATE, scale=H ** -0.5):
  """(pallas_gpu, explicit) outputs and gradients through attend (same dropout key), in
  one jitted program (eager ops would each compile, which costs more than the kernels)."""
  key = jax.random.key(7)

  def both():
    spec = make_spec()
    run = lambda impl: _grads(lambda q, k, v, bias: attend(
        q, k, v, bias=bias, mask=spec, scale=scale, dropout_rate=rate,
        dropout_rng=key if rate else None, impl=impl, name=impl), spec, inputs)
    return run("pallas_gpu"), run("explicit")

  with pallas_interpret(), record_kernels() as kernels:
    got, want = jax.jit(both).lower().compile(_FAST_COMPILE)()
  assert {e["kernel"] for e in kernels.values()} == {"pallas_gpu", "explicit"}, kernels
  return _errors(got, want)


def _packed_causal():
  segments = jnp.asarray(_segments(B, T, 1))
  return mask_spec(segments > 0, query_segment_BxQ=segments, key_segment_BxK=segments,
                   causal=True)


def test_float32_packing_padding_causal_t5_bias_dropout_equals_explicit(monkeypatch):
  """Through attend (mask encoding, scale, dispatch) with small blocks, several per row:
  the online softmax, skipped causal blocks and the dbias kernel's batch loop (a
  batch-1 bias) all run."""
  monkeypatch.setattr(pallas_gpu_flash, "BLOCKS", (16, 32))
  errors = _attend_both(_packed_causal, _inputs(np.float32))
  assert max(errors.values()) < 1e-5, errors


def _kernel_vs_explicit(*, t=T, s=T, n=N, kv=N, bias_batch=1, causal=True, segments=True,
                        prefix=False, rate=RATE, offsets=(0, 0), block_q=16, block_k=32):
  """flash_attention itself against the explicit kernel with the same mask (dense) and
  the global dropout mask of the shard at `offsets`."""
  inputs = _inputs(np.float32, t=t, s=s, n=n, kv=kv, bias_batch=bias_batch, seed=2)
  q_seg = kv_seg = q_pre = None
  if segments:
    q_seg = _segments(B, t, 3)
    kv_seg = np.where(q_seg == 0, -1, q_seg) if t == s else _segments(B, s, 4)
  if prefix:
    q_pre = np.arange(t)[None, :] < np.array([[21], [40]])
  bo, ho = offsets

  def both():
    spec = mask_spec(None, q_len=t, kv_len=s, batch=B, query_segment_BxQ=q_seg,
                     key_segment_BxK=kv_seg, causal=causal, prefix_BxQ=q_pre)
    seeds = dropout_hash.dropout_seeds(jax.random.key(3))
    keep = (None if not rate else dropout_hash.keep_mask(
        seeds, rate, batch=B + bo, heads=n + ho, q_len=t, kv_len=s)[bo:, ho:] / (1.0 - rate))
    kernel = lambda q, k, v, bias: flash_attention(
        q, k, v, bias=bias, q_segments=q_seg, kv_segments=kv_seg, causal=causal,
        q_prefix=q_pre, kv_prefix=q_pre, dropout_rate=rate, dropout_seeds=seeds,
        batch_offset=bo, head_offset=ho, block_q=block_q, block_k=block_k, interpret=True)
    explicit = lambda q, k, v, bias: attend(q, k, v, bias=bias, mask=spec.dense(), scale=1.0,
                                            impl="explicit", keep=keep)
    return _grads(kernel, spec, inputs), _grads(explicit, spec, inputs)

  got, want = jax.jit(both).lower().compile(_FAST_COMPILE)()
  return _errors(got, want)


def test_lowers_to_triton_for_cuda_forward_and_backward():
  """From this CPU host: the kernel (not interpret mode) lowers for CUDA to Triton custom
  calls: one forward; forward, dk/dv, dq and dbias under jax.grad."""
  S = jax.ShapeDtypeStruct
  q = S((B, 128, N, 64), jnp.bfloat16)
  bias, rows, seeds = S((1, N, 128, 128), jnp.float32), S((B, 128), jnp.int32), S((2,), jnp.int32)

  def f(q, k, v, bias, rows, seeds):
    return flash_attention(q, k, v, bias=bias, q_segments=rows, kv_segments=rows, causal=True,
                           q_prefix=rows, kv_prefix=rows, dropout_rate=RATE,
                           dropout_seeds=seeds)

  grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3))
  for fn, calls in ((f, 1), (grad, 4)):
    text = jax.jit(fn).trace(q, q, q, bias, rows, seeds).lower(
        lowering_platforms=("cuda",)).as_text()
    targets = re.findall(r"stablehlo\.custom_call @([^(\s]+)\(", text)
    assert targets.count(TRITON) == calls, targets
    assert "mosaic" not in text


def _kernel_dots(jaxpr, inside=False):
  """[(lhs dtype, precision)] of every dot_general inside a pallas_call of `jaxpr`."""
  dots = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general" and inside:
      dots.append((eqn.invars[0].aval.dtype, eqn.params["precision"]))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
        if hasattr(sub, "eqns"):
          dots += _kernel_dots(sub, inside or eqn.primitive.name == "pallas_call")
  return dots


@pytest.mark.parametrize("dtype, precision", [
    (jnp.float32, (jax.lax.Precision.HIGHEST,) * 2),  # Triton: IEEE, not its TF32 default
    (jnp.bfloat16, None)])
def test_every_kernel_dot_asks_for_ieee_float32_on_float32_inputs(dtype, precision):
  """The dots of the forward, dk/dv, dq and dbias kernels (2 + 4 + 3 + 2), in the jaxpr
  the Triton lowering reads: precision DEFAULT (None) would be TF32 for float32."""
  q = jax.ShapeDtypeStruct((1, 32, 1, 16), dtype)
  bias = jax.ShapeDtypeStruct((1, 1, 32, 32), jnp.float32)
  loss = lambda q, k, v, bias: jnp.sum(
      flash_attention(q, k, v, bias=bias, interpret=True).astype(jnp.float32))
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, q, q, bias).jaxpr
  assert _kernel_dots(jaxpr) == [(jnp.dtype(dtype), precision)] * 11


@pytest.mark.parametrize("backend, dtype, dropout, head_dim, length, want, why", [
    ("gpu", jnp.bfloat16, True, 64, 512, "pallas_gpu", "attention dropout"),
    ("gpu", jnp.bfloat16, False, 64, 512, "cudnn", "cuDNN"),  # no dropout: as before
    ("gpu", jnp.bfloat16, True, 48, 512, "explicit", "power of two"),
    ("gpu", jnp.bfloat16, True, 64, 200, "explicit", "multiples of 16"),
    ("cpu", jnp.bfloat16, True, 64, 512, "explicit", "cpu"),
])
def test_auto_takes_it_on_a_gpu_with_dropout(backend, dtype, dropout, head_dim, length, want,
                                             why):
  choice = choose_kernel("auto", backend=backend, dtype=dtype, head_dim=head_dim,
                         q_len=length, kv_len=length, dropout=dropout)
  assert choice.kernel == want and why in choice.reason, choice


@pytest.mark.parametrize("backend, head_dim, length, message", [
    ("cpu", 64, 512, "needs a GPU"), ("tpu", 64, 512, "needs a GPU"),
    ("gpu", 96, 512, "head dim 96"), ("gpu", 64, 100, "lengths 100 x 100"),
])
def test_configured_pallas_gpu_that_cannot_run_says_why(backend, head_dim, length, message):
  with pytest.raises(ValueError, match=message):
    choose_kernel("pallas_gpu", backend=backend, dtype=jnp.bfloat16, head_dim=head_dim,
                  q_len=length, kv_len=length, dropout=True)
  with pallas_interpret():  # interpret mode runs it anywhere
    assert choose_kernel("pallas_gpu", backend="cpu", dtype=jnp.float32, head_dim=64,
                         q_len=512, kv_len=512, dropout=True).kernel == "pallas_gpu"


# ----------------------------------------------------------------------------- slow tier
@pytest.mark.slow
def test_bfloat16_padding_t5_bias_dropout_within_rounding():
  """Default blocks (one per row here), bf16 operands: within bf16 rounding."""
  def padding():
    return mask_spec(jnp.arange(T)[None, :] < jnp.array([[T], [41]]), q_len=T)
  errors = _attend_both(padding, _inputs(jnp.bfloat16, seed=1))
  assert max(errors.values()) < 2e-2, errors


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    dict(),  # causal packing with padding, batch-1 bias, dropout, small blocks
    dict(prefix=True, n=4, kv=2, bias_batch=2, offsets=(1, 3)),  # prefix LM, GQA, [B] bias
    dict(t=64, s=128, causal=False, bias_batch=2, block_q=32, block_k=64),  # cross attention
    dict(causal=False, segments=False, bias_batch=None, rate=0.0),  # plain
    dict(bias_batch=1, rate=0.3, block_q=64, block_k=16),
])
def test_kernel_more_cases(case):
  errors = _kernel_vs_explicit(**case)
  assert max(errors.values()) < 1e-5, (case, errors)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", ["data", "tensor"])
def test_sharded_equals_explicit(mesh_name):
  """Under jit on the 8 fake devices (mesh and logical rules as a train step), the kernel
  runs in shard_map and each shard draws its global rows of the dropout mask; GQA (2 kv
  heads for 4 query heads, split over 'tensor' too)."""
  from t5x_like import parallel  # noqa: PLC0415
  meshes = {"data": dict(data=8, fsdp=1, tensor=1), "tensor": dict(data=2, fsdp=1, tensor=4)}
  batch, n = 8, 4
  q, k, v, bias, cot = _inputs(np.float32, b=batch, n=n, kv=2, seed=5)
  segments = _segments(batch, T, 6)
  spec = mask_spec(segments > 0, query_segment_BxQ=segments, key_segment_BxK=segments,
                   causal=True)
  mesh = parallel.make_mesh(meshes[mesh_name])

  def run(impl):
    def loss(q, k, v, bias):
      out = attend(q, k, v, bias=bias, mask=spec, scale=H ** -0.5, dropout_rate=RATE,
                   dropout_rng=jax.random.key(11), impl=impl)
      return jnp.sum(out * cot * jnp.any(spec.dense(), -1)[:, 0, :, None, None])
    with parallel.mesh_rules(mesh), record_kernels() as kernels:
      result = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    assert {e["kernel"] for e in kernels.values()} == {impl}, kernels
    return result

  want = run("explicit")
  with pallas_interpret():
    got = run("pallas_gpu")
  errors = _errors([got[0], *got[1]], [want[0], *want[1]])
  assert max(errors.values()) < 2e-5, errors


@pytest.mark.slow
def test_bert_train_step_with_attention_dropout_lowers_to_triton_for_cuda():
  """The whole train step of a tiny bf16 BERT with attention dropout, traced for a GPU
  ('auto' picks the kernel) on the 8-device mesh (shard_map), lowered for CUDA from this
  CPU host: forward, dk/dv and dq kernels are Triton custom calls."""
  from t5x_like import parallel  # noqa: PLC0415
  from t5x_like.models import bert, build_model  # noqa: PLC0415
  from t5x_like.train.defaults import default_config  # noqa: PLC0415
  from t5x_like.train.optimizers import make_optimizer  # noqa: PLC0415
  from t5x_like.train.state import abstract_train_state  # noqa: PLC0415
  from t5x_like.train.step import make_train_step  # noqa: PLC0415
  model = build_model(bert(1, 64, vocab_size=64, num_heads=2, d_ff=128, dtype="bfloat16",
                           max_position_embeddings=T, attention_dropout_rate=RATE))
  shapes = {"encoder_input_tokens": (8, T), "encoder_type_ids": (8, T), "mlm_positions": (8, 4),
            "mlm_targets": (8, 4), "mlm_weights": (8, 4), "nsp_labels": (8,)}
  optimizer, schedule = make_optimizer(default_config().optimizer, 10)
  mesh, rules = parallel.make_mesh({"data": 8}), parallel.DEFAULT_RULES
  state = abstract_train_state(model, optimizer, mesh, rules, shapes)
  rows = parallel.batch_shardings(shapes, mesh, rules)
  batch = {k: jax.ShapeDtypeStruct(v, jnp.int32, sharding=rows[k]) for k, v in shapes.items()}
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated)
  step = make_train_step(model, optimizer, schedule, mesh=mesh, rules=rules, batch_shapes=shapes,
                         state_shardings=jax.tree.map(lambda x: x.sharding, state))
  with tracing_for("gpu"), record_kernels() as kernels:
    text = step.trace(state, batch, key).lower(lowering_platforms=("cuda",)).as_text()
  assert {e["kernel"] for e in kernels.values()} == {"pallas_gpu"}, kernels
  assert re.findall(r"stablehlo\.custom_call @([^(\s]+)\(", text).count(TRITON) == 3
  assert {"fwd", "dkv", "dq"} <= set(re.findall(r"flash_attention_gpu_(\w+)", text))


@pytest.mark.slow
def test_bert_loss_and_grads_with_dropout_equal_explicit():
  """A tiny float32 BERT with the recipe's dropout (hidden and attention 0.1) and padded
  rows: loss and every parameter gradient through the kernel (interpret mode) equal the
  explicit kernel's for one dropout key, since both draw the same attention mask."""
  from t5x_like.models import bert, build_model  # noqa: PLC0415
  make = lambda impl: build_model(bert(1, 32, vocab_size=64, num_heads=2, d_ff=64,
                                       max_position_embeddings=T, attention_impl=impl))
  explicit, fused = make("explicit"), make("pallas_gpu")
  rng = np.random.RandomState(0)
  tokens = rng.randint(2, 64, (B, T)).astype(np.int32)
  tokens[1, 45:] = 0  # padding
  batch = {"encoder_input_tokens": tokens,
           "encoder_type_ids": (np.arange(T)[None] >= 20).astype(np.int32).repeat(B, 0),
           "mlm_positions": rng.randint(0, 45, (B, 4)).astype(np.int32),
           "mlm_targets": rng.randint(2, 64, (B, 4)).astype(np.int32),
           "mlm_weights": np.ones((B, 4), np.int32), "nsp_labels": np.array([0, 1], np.int32)}
  params = explicit.init(jax.random.key(0), {k: v.shape for k, v in batch.items()})
  key = jax.random.key(5)
  run = lambda model: jax.jit(jax.value_and_grad(
      lambda p: model.loss_fn(p, batch, key)[0]))(params)
  want_loss, want_grads = run(explicit)
  with pallas_interpret(), record_kernels() as kernels:
    got_loss, got_grads = run(fused)
  assert {e["kernel"] for e in kernels.values()} == {"pallas_gpu"}, kernels
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-4)
