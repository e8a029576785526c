"""Every attention kernel against a plain float32 reference attention.

The reference is written here from the definition softmax(q k^T * scale + bias) v
(autodiffed by JAX, GQA by repeating key/value heads); the kernels are
t5x_like.models.attention_core's explicit and XLA paths and the Pallas TPU flash kernel in
Pallas interpret mode. cuDNN needs a GPU: `t5x-like bench attention` checks it there
with the same comparisons (tests/test_bench_attention.py runs that command on CPU).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like import models
from t5x_like.models.attention_core import (attend, choose_kernel, record_kernels,
                                            tracing_for)
from t5x_like.models.attention_kernels import pallas_interpret
from t5x_like.models.masks import mask_spec

B, T, N, H = 2, 128, 4, 16


def reference(q, k, v, bias, dense_mask, scale, keep=None):
  rep = q.shape[2] // k.shape[2]
  kr, vr = jnp.repeat(k, rep, 2), jnp.repeat(v, rep, 2)
  logits = jnp.einsum("btnh,bsnh->bnts", q, kr, precision="highest") * scale
  if bias is not None:
    logits = logits + bias
  probs = jax.nn.softmax(jnp.where(dense_mask, logits, -1e30), axis=-1)
  if keep is not None:
    probs = probs * keep
  return jnp.einsum("bnts,bsnh->btnh", probs, vr, precision="highest")


def _masks(rng):
  """name -> MaskSpec over [B, T] rows: padding, packing, causal, causal packing, prefix."""
  lengths = np.array([T, 77])
  valid = np.arange(T)[None, :] < lengths[:, None]
  segments = np.where(valid, 1 + (np.arange(T)[None, :] >= 50), 0).astype(np.int32)
  segments[1, 20:40] = 3
  prefix = (np.arange(T)[None, :] < np.array([30, 64])[:, None]).astype(np.int32)
  return {
      "padding": mask_spec(jnp.asarray(valid), q_len=T),
      "packing": mask_spec(jnp.asarray(segments > 0), query_segment_BxQ=jnp.asarray(segments),
                           key_segment_BxK=jnp.asarray(segments)),
      "causal": mask_spec(None, q_len=T, kv_len=T, batch=B, causal=True),
      "causal_packing": mask_spec(jnp.asarray(segments > 0),
                                  query_segment_BxQ=jnp.asarray(segments),
                                  key_segment_BxK=jnp.asarray(segments), causal=True),
      "prefix": mask_spec(None, q_len=T, kv_len=T, batch=B, causal=True,
                          prefix_BxQ=jnp.asarray(prefix)),
  }


def _inputs(kv_heads=2, seed=0):
  rng = np.random.RandomState(seed)
  q = rng.randn(B, T, N, H).astype(np.float32)
  k = rng.randn(B, T, kv_heads, H).astype(np.float32)
  v = rng.randn(B, T, kv_heads, H).astype(np.float32)
  bias = rng.randn(1, N, T, T).astype(np.float32)
  cot = rng.randn(B, T, N, H).astype(np.float32)
  return q, k, v, bias, cot


def _value_and_grads(fn, q, k, v, bias, cot, rows):
  """(out, dq, dk, dv, dbias) of sum(fn(...) * cot) over query rows that see a key."""
  weights = cot * rows[:, :, None, None]

  def loss(q, k, v, bias):
    out = fn(q, k, v, bias)
    return jnp.sum(out.astype(jnp.float32) * weights), out
  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, bias)
  return (np.asarray(out, np.float32) * rows[:, :, None, None],
          *[np.asarray(g, np.float32) for g in grads])


def _compare(impl, mask_name, dtype, tolerance):
  q, k, v, bias, cot = _inputs()
  spec = _masks(None)[mask_name]
  dense = spec.dense()
  rows = np.asarray(dense.any(-1)[:, 0], np.float32)  # [B, T]: queries that see a key
  cast = lambda x: jnp.asarray(x, dtype)
  ours = lambda q, k, v, bias: attend(cast(q), cast(k), cast(v), bias=bias, mask=spec,
                                      scale=H ** -0.5, impl=impl)
  ref = lambda q, k, v, bias: reference(q, k, v, bias, dense, H ** -0.5)
  got = _value_and_grads(ours, q, k, v, bias, cot, rows)
  want = _value_and_grads(ref, q, k, v, bias, cot, rows)
  for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
    scale = np.abs(w).max()
    assert scale > 0, name
    err = np.abs(g - w).max() / scale
    assert err <= tolerance, f"{impl} {mask_name} {dtype.__name__}: {name} off by {err:.2e}"


MASKS = ("padding", "packing", "causal", "causal_packing", "prefix")


@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("impl", ["explicit", "xla"])
def test_xla_and_explicit_float32(impl, mask_name):
  _compare(impl, mask_name, jnp.float32, 1e-5)


@pytest.mark.parametrize("mask_name", MASKS)
def test_pallas_float32_in_interpret_mode(mask_name):
  with pallas_interpret():
    _compare("pallas", mask_name, jnp.float32, 1e-5)


@pytest.mark.parametrize("impl", ["explicit", "xla", "pallas"])
def test_bfloat16_within_rounding(impl):
  """bf16 inputs: every value and gradient within bf16 rounding (3e-2 of the largest
  entry: ~4 roundings of 2^-8) of the float32 reference."""
  with pallas_interpret():
    _compare(impl, "causal_packing", jnp.bfloat16, 3e-2)


def _np_mix(x):
  """MurmurHash3's fmix32 in numpy uint32 (written here from the reference, not imported)."""
  x = x ^ (x >> np.uint32(16))
  x = x * np.uint32(0x85EBCA6B)
  x = x ^ (x >> np.uint32(13))
  x = x * np.uint32(0xC2B2AE35)
  return x ^ (x >> np.uint32(16))


def _np_keep(key, rate, shape, offsets=(0, 0)):
  """The documented mask (models/dropout_hash.py's docstring): probability (b, h, q, k) is
  kept iff the top 24 bits of the hash chain of (seeds, b, h, q, k) are below
  round((1 - rate) 2^24); seeds = jax.random.bits(key, (2,), uint32)."""
  s0, s1 = np.asarray(jax.random.bits(key, (2,), jnp.uint32))
  b, h, q, k = np.meshgrid(*[np.arange(n, dtype=np.uint32) for n in shape], indexing="ij")
  b, h = b + np.uint32(offsets[0]), h + np.uint32(offsets[1])
  with np.errstate(over="ignore"):
    x = _np_mix(s0 ^ _np_mix(s1 + np.uint32(0x9E3779B9)))
    x = _np_mix(x ^ (b * np.uint32(0x27D4EB2F)))
    x = _np_mix(x ^ (h * np.uint32(0x165667B1)))
    x = _np_mix(x ^ (q * np.uint32(0x9E3779B1)))
    x = _np_mix(x ^ (k * np.uint32(0x85EBCA77)))
  return (x >> np.uint32(8)) < np.uint32(round((1 - rate) * 2 ** 24))


def test_explicit_dropout_follows_its_key_and_its_rate():
  """Dropout by rate and key == the fixed-mask reference with the documented hashed mask
  (a numpy reimplementation); over many rows the dropped fraction is the rate (4 sigma)
  and the output is unbiased; another key draws another mask."""
  q, k, v, bias, _ = _inputs(kv_heads=N, seed=3)
  spec = _masks(None)["padding"]
  rate, key = 0.25, jax.random.key(7)
  out = attend(q, k, v, bias=bias, mask=spec, scale=H ** -0.5, dropout_rate=rate,
               dropout_rng=key, impl="explicit")
  keep = _np_keep(key, rate, (B, N, T, T)) / (1 - rate)
  want = reference(q, k, v, bias, spec.dense(), H ** -0.5, keep=keep)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=1e-5)
  # statistics: v = one-hot key index, so out[b, t, n, s] = probs * keep for each key s
  eye = jnp.broadcast_to(jnp.eye(T, dtype=jnp.float32)[None, :, None, :], (B, T, N, T))
  qh = jnp.broadcast_to(q[..., :1], q.shape)  # H = 16 <= T: pad head dim up to T below
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, T - H)))
  dropped = attend(pad(qh), pad(k), eye, mask=spec, scale=0.1, dropout_rate=rate,
                   dropout_rng=key, impl="explicit")
  clean = attend(pad(qh), pad(k), eye, mask=spec, scale=0.1, impl="explicit")
  visible = np.asarray(jnp.broadcast_to(spec.dense()[:, 0, :, None, :], dropped.shape))
  zero = np.asarray(dropped == 0)[visible]
  n = zero.size
  assert abs(zero.mean() - rate) < 4 * np.sqrt(rate * (1 - rate) / n)
  ratio = np.asarray(dropped).sum() / np.asarray(clean).sum()
  assert abs(ratio - 1) < 0.01, ratio
  again = attend(q, k, v, bias=bias, mask=spec, scale=H ** -0.5, dropout_rate=rate,
                 dropout_rng=jax.random.key(8), impl="explicit")
  assert np.abs(np.asarray(again) - np.asarray(out)).max() > 1e-3


# Meshes of the 8 fake CPU devices: pure data parallel, FSDP, tensor parallel.
MESHES = {"data": dict(data=8, fsdp=1, tensor=1), "fsdp": dict(data=2, fsdp=4, tensor=1),
          "tensor": dict(data=2, fsdp=1, tensor=4)}


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("rate", [0.0, 0.2])
def test_sharded_pallas_equals_explicit(mesh_name, rate):
  """Under jit on an 8-device mesh (the step's own set-up: mesh and logical rules), the
  Pallas kernel in shard_map gives the explicit kernel's output and gradients of q, k,
  v and a T5-style [1, N, T, S] bias, dropout included: each shard draws the global
  (batch, head) rows of the one mask. Packed, padded causal rows; GQA (2 key/value
  heads for 4 query heads, repeated only where heads are split over 'tensor')."""
  from t5x_like import parallel  # noqa: PLC0415
  batch = 8
  rng = np.random.RandomState(5)
  q = rng.randn(batch, T, N, H).astype(np.float32)
  k, v = (rng.randn(batch, T, 2, H).astype(np.float32) for _ in range(2))
  bias = rng.randn(1, N, T, T).astype(np.float32)
  cot = rng.randn(batch, T, N, H).astype(np.float32)
  segments = np.where(np.arange(T)[None] < rng.randint(40, 100, (batch, 1)), 1, 2)
  valid = np.arange(T)[None] < rng.randint(100, T + 1, (batch, 1))
  spec = mask_spec(jnp.asarray(valid), query_segment_BxQ=jnp.asarray(segments, jnp.int32),
                   key_segment_BxK=jnp.asarray(segments, jnp.int32), causal=True)
  key = jax.random.key(11)
  mesh = parallel.make_mesh(MESHES[mesh_name])

  def run(impl):
    def loss(q, k, v, bias):
      out = attend(q, k, v, bias=bias, mask=spec, scale=H ** -0.5, dropout_rate=rate,
                   dropout_rng=key if rate else None, impl=impl)
      return jnp.sum(out * cot), out
    with parallel.mesh_rules(mesh), record_kernels() as kernels:
      (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3),
                                                   has_aux=True))(q, k, v, bias)
    assert {e["kernel"] for e in kernels.values()} == {impl}, kernels
    return [np.asarray(x) for x in (out, *grads)]

  want = run("explicit")
  with pallas_interpret():
    got = run("pallas")
  for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
    err = np.abs(g - w).max() / np.abs(w).max()
    assert err <= 2e-5, f"{mesh_name} rate {rate}: {name} off by {err:.2e}"


def test_kernel_follows_the_mesh_platform_not_the_host():
  """Traced under a mesh of TPU devices (an abstract one: compiling for a slice from this
  CPU host), 'auto' picks the TPU kernel; under a CPU mesh, the CPU one."""
  from jax._src.mesh import AbstractDevice  # noqa: PLC0415
  from jax.sharding import AbstractMesh, AxisType  # noqa: PLC0415
  auto = (AxisType.Auto,)
  picked = {}
  for platform in ("tpu", "cpu"):
    mesh = AbstractMesh((4,), ("data",), axis_types=auto,
                        abstract_device=AbstractDevice("TPU v5 lite" if platform == "tpu"
                                                       else "cpu", 1, platform))
    with jax.sharding.use_abstract_mesh(mesh), record_kernels() as kernels:
      jax.eval_shape(lambda x: attend(x, x, x, scale=0.1, impl="auto", name="a"),
                     jax.ShapeDtypeStruct((4, 128, N, H), jnp.bfloat16))
    picked[platform] = kernels["a"]["kernel"]
  assert picked == {"tpu": "pallas", "cpu": "explicit"}, picked


@pytest.mark.parametrize("backend, dtype, dropout, length, want", [
    ("cpu", jnp.bfloat16, False, 512, "explicit"),
    ("cpu", jnp.float32, True, 512, "explicit"),
    ("gpu", jnp.bfloat16, False, 512, "cudnn"),
    ("gpu", jnp.float32, False, 512, "xla"),  # cuDNN flash attention is 16-bit only
    ("gpu", jnp.bfloat16, True, 512, "pallas_gpu"),  # dropout from the step's key
    ("tpu", jnp.bfloat16, False, 512, "pallas"),
    ("tpu", jnp.bfloat16, False, 114, "explicit"),  # not a multiple of the 128 block
    ("tpu", jnp.bfloat16, True, 512, "pallas"),  # dropout inside the kernel
])
def test_auto_picks_per_backend(backend, dtype, dropout, length, want):
  choice = choose_kernel("auto", backend=backend, dtype=dtype, head_dim=64, q_len=length,
                         kv_len=length, dropout=dropout)
  assert choice.kernel == want, choice
  assert choice.reason


@pytest.mark.parametrize("length, biased, want", [
    (29, True, "xla"),  # T5's 29-token targets under a relative-position bias
    (29, False, "cudnn"),  # causal-only: no bias reaches cuDNN
    (30, True, "cudnn"),
])
def test_auto_leaves_cudnn_where_a_bias_meets_an_odd_length(length, biased, want):
  """jax's check_is_flash_attention rejects a training call with a bias (a padding mask
  becomes one) and an odd length: 'Unsupported sequence length Q 29, KV 29', met on an
  H100 by T5's 128-token span corruption. 'auto' must not pick cuDNN there, and a
  configured 'cudnn' says why before tracing reaches jax."""
  choice = choose_kernel("auto", backend="gpu", dtype=jnp.bfloat16, head_dim=64,
                         q_len=length, kv_len=length, dropout=False, biased=biased)
  assert choice.kernel == want, choice
  if want == "xla":
    assert "even lengths" in choice.reason
    with pytest.raises(ValueError, match="29 x 29 with a bias"):
      choose_kernel("cudnn", backend="gpu", dtype=jnp.bfloat16, head_dim=64, q_len=29,
                    kv_len=29, dropout=False, biased=True)


@pytest.mark.parametrize("kind, dtype, want", [
    ("TPU v3", jnp.bfloat16, "explicit"), ("TPU v2", jnp.bfloat16, "explicit"),
    ("TPU v3", jnp.float32, "pallas"), ("TPU v5 lite", jnp.bfloat16, "pallas"),
    ("TPU v4", jnp.bfloat16, "pallas"),
])
def test_auto_knows_that_mosaic_has_no_bf16_matmul_on_v2_and_v3(kind, dtype, want):
  """libtpu's Mosaic rejects bf16 matmul operands on TPU v2/v3 (E2001, jax's own flash
  kernel alike; tests/test_tpu_kernels.py compiles it), so 'auto' keeps the explicit
  kernel there, and a configured 'pallas' says why."""
  choice = choose_kernel("auto", backend="tpu", dtype=dtype, head_dim=64, q_len=512,
                         kv_len=512, dropout=True, device_kind=kind)
  assert choice.kernel == want, choice
  if want == "explicit":
    with pytest.raises(ValueError, match=kind):
      choose_kernel("pallas", backend="tpu", dtype=dtype, head_dim=64, q_len=512,
                    kv_len=512, dropout=False, device_kind=kind)


@pytest.mark.parametrize("impl, backend, dtype, dropout, message", [
    ("cudnn", "cpu", jnp.bfloat16, False, "needs a GPU"),
    ("cudnn", "gpu", jnp.float32, False, "bfloat16 or float16"),
    ("pallas", "cpu", jnp.bfloat16, False, "needs a TPU"),
    ("xla", "gpu", jnp.bfloat16, True, "cannot apply attention dropout"),
])
def test_configured_kernel_that_cannot_run_says_why(impl, backend, dtype, dropout, message):
  with pytest.raises(ValueError, match=message):
    choose_kernel(impl, backend=backend, dtype=dtype, head_dim=64, q_len=512, kv_len=512,
                  dropout=dropout)
  assert choose_kernel("cudnn", backend="gpu", dtype=jnp.bfloat16, head_dim=64, q_len=512,
                       kv_len=512, dropout=True).kernel == "cudnn"  # fused dropout


_TINY = {
    "t5": ("t5-v1_1-small", dict(vocab_size=64, d_model=64, num_heads=4, head_dim=16,
                                 d_ff=128, num_layers=1, num_decoder_layers=1)),
    "gpt2": ("gpt2-124m", dict(vocab_size=64, d_model=64, num_heads=4, d_ff=128,
                               num_layers=1, max_position_embeddings=T)),
}


def _tiny(family, **overrides):
  name, shape = _TINY[family]
  return models.build_model(models.preset(name, **{
      "dtype": "float32", "dropout_rate": 0.0, "attention_dropout_rate": 0.0, **shape,
      **overrides}))


def _loss_and_grads(model, params, batch):
  fn = jax.jit(jax.value_and_grad(lambda p: model.loss_fn(p, batch, None)[0]))
  return fn(params)


@pytest.mark.parametrize("family", ["t5", "gpt2"])
def test_model_loss_and_grads_with_pallas_equal_explicit(family):
  """A whole model (T5: relative bias, cross attention, causal decoder; GPT-2 packed
  rows) gives the same loss and gradients through the Pallas kernel as through the
  explicit one (float32, interpret mode)."""
  explicit = _tiny(family, attention_impl="explicit")
  pallas = _tiny(family, attention_impl="pallas")
  rng = np.random.RandomState(0)
  tokens = lambda: jnp.asarray(rng.randint(2, 50, (B, T)), jnp.int32)
  segments = jnp.asarray(np.where(np.arange(T) < 70, 1, 2)[None].repeat(B, 0), jnp.int32)
  if explicit.config.family == "encoder_decoder":
    batch = {"encoder_input_tokens": tokens().at[1, 100:].set(0),
             "decoder_input_tokens": tokens(), "decoder_target_tokens": tokens(),
             "decoder_loss_weights": jnp.ones((B, T), jnp.float32)}
  else:
    batch = {"decoder_input_tokens": tokens(), "decoder_target_tokens": tokens(),
             "decoder_segment_ids": segments, "decoder_positions": jnp.asarray(
                 np.where(np.arange(T) < 70, np.arange(T), np.arange(T) - 70)[None].repeat(B, 0)),
             "decoder_loss_weights": jnp.ones((B, T), jnp.float32)}
  params = explicit.init(jax.random.key(0), {k: v.shape for k, v in batch.items()})
  want_loss, want_grads = _loss_and_grads(explicit, params, batch)
  with pallas_interpret(), record_kernels() as kernels:
    got_loss, got_grads = _loss_and_grads(pallas, params, batch)
  assert {entry["kernel"] for entry in kernels.values()} == {"pallas"}, kernels
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5,
                               rtol=1e-4)


def test_t5_traced_for_a_gpu_at_odd_lengths_takes_xla_attention():
  """Every T5 attention carries a bias (relative positions) or a padding mask, so at
  odd lengths (the 128-token span corruption's 29-token targets) 'auto' must pick XLA,
  not the cuDNN kernel jax rejects there."""
  model = _tiny("t5", attention_impl="auto", dtype="bfloat16")
  batch = {"encoder_input_tokens": jnp.ones((2, 9), jnp.int32),
           "decoder_input_tokens": jnp.ones((2, 29), jnp.int32)}
  params = model.param_shapes({k: v.shape for k, v in batch.items()})
  with tracing_for("gpu"), record_kernels() as kernels:
    jax.eval_shape(model.logits, params, batch)
  assert len(kernels) == 3 and {e["kernel"] for e in kernels.values()} == {"xla"}, kernels


def test_record_kernels_names_each_attention():
  model = _tiny("t5", num_layers=2, num_decoder_layers=2, attention_impl="auto")
  batch = {"encoder_input_tokens": jnp.ones((1, 8), jnp.int32),
           "decoder_input_tokens": jnp.ones((1, 8), jnp.int32)}
  params = model.param_shapes({k: v.shape for k, v in batch.items()})
  with record_kernels() as kernels:
    jax.eval_shape(model.logits, params, batch)
  names = sorted(kernels)
  assert any("encoder" in n and "self_attention" in n for n in names), names
  assert any("cross_attention" in n for n in names), names
  assert all(entry["kernel"] == "explicit" for entry in kernels.values())  # a CPU
