"""The Pallas flash-attention kernel (pallas_flash.py) against a dense jnp reference:
values and gradients (q, k, v, bias) in interpret mode on CPU, and a deviceless
compile for a TPU with libtpu (Mosaic lowering)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.models import dropout_hash
from t5x_like.models.pallas_flash import flash_attention

_MASKED = jnp.finfo(jnp.float32).min * 0.7
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _dense_mask(b, t, s, q_seg=None, kv_seg=None, causal=False, q_pre=None, kv_pre=None):
  """Boolean [B, 1, T, S] (True = may attend)."""
  mask = jnp.ones((b, 1, t, s), bool)
  if q_seg is not None:
    mask = mask & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
  if causal:
    allowed = (jnp.arange(t)[:, None] >= jnp.arange(s)[None, :])[None, None]
    if q_pre is not None:
      allowed = allowed | (q_pre[:, None, :, None] & kv_pre[:, None, None, :])
    mask = mask & allowed
  return mask


def _reference(q, k, v, bias, mask, keep, rate):
  """softmax(q k^T + bias) (dropped) v, softmax in float32, [B, N, T, H]."""
  g = q.shape[1] // k.shape[1]
  k, v = jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1)
  s = jnp.einsum("bnth,bnsh->bnts", q, k, preferred_element_type=jnp.float32)
  if bias is not None:
    s = s + bias.astype(jnp.float32)
  s = jnp.where(mask, s, _MASKED)
  p = jax.nn.softmax(s, axis=-1)
  if keep is not None:
    p = jnp.where(keep, p / (1.0 - rate), 0.0)
  out = jnp.einsum("bnts,bnsh->bnth", p.astype(q.dtype), v, preferred_element_type=jnp.float32)
  return out.astype(q.dtype)


def _segments(b, n, first):
  """int32 [B, n]: two packed segments (lengths differ per row) then padding 0."""
  pos = jnp.arange(n)[None, :]
  cut = jnp.array([first + 16 * i for i in range(b)])[:, None]
  return jnp.where(pos < cut, 1, jnp.where(pos < n - 24, 2, 0)).astype(jnp.int32)


def _check(*, dtype=jnp.float32, b=1, n=2, kv=2, t=128, s=128, h=32, bias_batch=None,
           segments=False, causal=False, prefix=False, rate=0.0, offsets=(0, 0),
           block_q=64, block_k=64, tol=2e-5):
  """The kernel against _reference: values, and gradients of a random projection.

  Everything (inputs, both attentions) is one jitted program: eager ops would each
  compile, which costs more than the kernels do."""

  def both():
    keys = jax.random.split(jax.random.key(t * 7 + s + n + kv + b), 6)
    q = jax.random.normal(keys[0], (b, n, t, h), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, kv, s, h), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, kv, s, h), jnp.float32).astype(dtype)
    ct = jax.random.normal(keys[3], (b, n, t, h), jnp.float32)
    bias = (None if bias_batch is None else
            jax.random.normal(keys[4], (bias_batch, n, t, s), jnp.float32))
    q_seg = kv_seg = q_pre = kv_pre = None
    if segments:
      q_seg = _segments(b, t, 40)
      kv_seg = jnp.where(q_seg == 0, -1, q_seg) if t == s else _segments(b, s, 90)
    if prefix:
      q_pre = kv_pre = jnp.arange(t)[None, :] < jnp.array([[37], [70]])[:b]
    seeds = dropout_hash.dropout_seeds(keys[5])
    mask = _dense_mask(b, t, s, q_seg, kv_seg, causal, q_pre, kv_pre)
    keep = None
    if rate > 0:
      bo, ho = offsets
      keep = dropout_hash.keep_mask(seeds, rate, batch=b + bo, heads=n + ho, q_len=t,
                                    kv_len=s)[bo:, ho:]

    def kernel(q, k, v, bias):
      return flash_attention(q, k, v, bias=bias, q_segments=q_seg, kv_segments=kv_seg,
                             causal=causal, q_prefix=q_pre, kv_prefix=kv_pre,
                             dropout_rate=rate, dropout_seeds=seeds, batch_offset=offsets[0],
                             head_offset=offsets[1], block_q=block_q, block_k=block_k,
                             interpret=True)

    def reference(q, k, v, bias):
      return _reference(q, k, v, bias, mask, keep, rate)

    def with_grads(f, *args):
      loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * ct)
      argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
      return [f(*args), *jax.grad(loss, argnums)(*args)]

    args = (q, k, v, bias)
    # bf16: the reference in float32 from the same (rounded) inputs.
    up = [None if x is None else x.astype(jnp.float32) for x in args]
    return with_grads(kernel, *args), with_grads(reference, *up)

  # Interpret mode's loops make large CPU programs; LLVM's optimisations only cost time.
  got, want = jax.jit(both).lower().compile(_FAST_COMPILE)()
  assert got[0].dtype == dtype and got[0].shape == (b, n, t, h)
  for name, x, ref in zip(["out", "dq", "dk", "dv", "dbias"], got, want):
    assert x.shape == ref.shape, name
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    err = np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-6)
    assert err < tol, f"{name}: relative error {err:.3g}"


def test_no_mask_cross_attention():  # T != S, a batch-B bias
  _check(b=2, t=128, s=256, h=64, bias_batch=2, block_q=64, block_k=128)


def test_segments_causal():  # packing with padding (rows with no key), causal blocks skipped
  _check(b=2, segments=True, causal=True, bias_batch=2)


def test_prefix_lm_gqa_t5_bias_dropout():
  # A batch-1 bias's gradient is summed over the batch inside the kernel; query heads
  # (4) share kv heads (2); dropout rows come from the global batch and heads.
  _check(b=2, n=4, kv=2, causal=True, prefix=True, segments=True, bias_batch=1, rate=0.1,
         offsets=(1, 2))


def test_bfloat16():
  _check(dtype=jnp.bfloat16, b=2, n=4, kv=2, segments=True, causal=True, bias_batch=1,
         rate=0.1, offsets=(2, 4), block_q=128, block_k=128, tol=3e-2)


def test_dropout_mask_is_keep_mask():
  # Equal logits and v = identity: out[b, n, t, s] = keep / ((1 - rate) S), the mask itself.
  b, n, t, s, rate = 1, 2, 128, 128, 0.25
  seeds = dropout_hash.dropout_seeds(jax.random.key(3))
  q = jnp.zeros((b, n, t, s), jnp.float32)
  v = jnp.broadcast_to(jnp.eye(s), (b, n, s, s))
  kernel = jax.jit(lambda bo, ho: flash_attention(
      q, q, v, dropout_rate=rate, dropout_seeds=seeds, batch_offset=bo, head_offset=ho,
      interpret=True) > 0)  # traced offsets, as under shard_map
  everything = dropout_hash.keep_mask(seeds, rate, batch=4, heads=7, q_len=t, kv_len=s)
  moved = np.asarray(kernel(3, 5))
  np.testing.assert_array_equal(moved, np.asarray(everything[3:, 5:]))
  np.testing.assert_array_equal(np.asarray(kernel(0, 0)), np.asarray(everything[:1, :2]))
  assert (moved != np.asarray(everything[:1, :2])).mean() > 0.2
  assert 0.7 < float(everything.mean()) < 0.8


def test_lengths_must_fit_blocks():
  q = jnp.zeros((1, 1, 96, 32))
  with pytest.raises(ValueError, match="T=96, S=96"):
    flash_attention(q, q, q, interpret=True)


@pytest.mark.tpu
def test_compiles_for_tpu():
  """Deviceless AOT compile (Mosaic) for a v5e of forward + grads: bf16, dropout with
  traced offsets, a batch-1 bias, segments, causal."""
  pytest.importorskip("libtpu")
  from t5x_like.plan import tpu  # noqa: PLC0415
  mesh = jax.sharding.Mesh(np.array(tpu.slice_devices("v5e-4")[:1]), ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
  b, n, kv, t, h = 2, 4, 2, 512, 64
  args = [spec((b, n, t, h), jnp.bfloat16), spec((b, kv, t, h), jnp.bfloat16),
          spec((b, kv, t, h), jnp.bfloat16), spec((1, n, t, t), jnp.float32),
          spec((b, t), jnp.int32), spec((2,), jnp.int32), spec((), jnp.int32),
          spec((b, t), jnp.bool_)]

  def loss(q, k, v, bias, seg, seeds, offset, prefix):
    out = flash_attention(q, k, v, bias=bias, q_segments=seg, kv_segments=seg, causal=True,
                          dropout_rate=0.1, dropout_seeds=seeds, batch_offset=offset,
                          head_offset=2 * offset, interpret=False)
    prefixed = flash_attention(q, k, v, causal=True, q_prefix=prefix, kv_prefix=prefix,
                               block_q=256, block_k=256, interpret=False)
    return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(prefixed.astype(jnp.float32))

  compiled = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3))).lower(*args).compile()
  assert compiled is not None
