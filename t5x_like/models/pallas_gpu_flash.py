"""Flash attention for GPUs in Pallas' Triton lowering, with bias, masks and dropout.

  out_BxTxNxH = flash_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, bias=, q_segments=,
                                kv_segments=, causal=, q_prefix=, kv_prefix=,
                                dropout_rate=, dropout_seeds=, batch_offset=,
                                head_offset=, block_q=None, block_k=None, interpret=False)

softmax(q k^T + bias) v with no scale (the caller scales q), in the models' [B, T, N, H]
layout (no transposes); a jax.custom_vjp whose backward pass runs Pallas kernels too.
Flash attention (Dao et al. 2022; FlashAttention-2, Dao 2023, for the loop order):
each program holds one [block_q, H] query block and loops over key blocks with an
online softmax, so no [T, S] tensor reaches HBM. Written after jax's own
jax/experimental/pallas/ops/gpu/attention.py (which has no bias, dropout or prefix).
Logits and softmax in float32, matmuls on operands in the input dtype with float32
accumulation, output in q's dtype. Float32 inputs: every dot asks for
precision=HIGHEST, which Pallas' Triton lowering turns into IEEE float32 products
(Triton's default for float32 is TF32); bfloat16 / float16 inputs: the default.
- Heads: K key/value heads dividing N are repeated to N before the kernel (jnp.repeat;
  its autodiff sums dk, dv back over each group): [B, S, N, H] in HBM, never [T, S].
- bias: [1 or B, N, T, S], read block by block. Its gradient comes from its own kernel
  (one program per [block_q, block_k] block, looping over the batch): a batch-1 bias
  (T5's relative positions) is summed over the batch in registers, never broadcast.
- Masks: q_segments [B, T] / kv_segments [B, S] int (attend within a segment); causal
  (query t sees keys s <= t; key blocks above the diagonal are skipped); prefix LM:
  q_prefix [B, T] / kv_prefix [B, S] bool, with causal: also prefix sees prefix.
  Rows that may attend to nothing give a finite average of the v they visited.
- Dropout: dropout_seeds int32 [2] (dropout_hash.dropout_seeds); probability
  (b, n, t, s) is kept iff dropout_hash.keep_block(..., b + batch_offset,
  n + head_offset, t, s): the explicit kernel's and the TPU kernel's mask; offsets
  (may be traced) place a shard in the global batch and heads. Row sums use the
  undropped probabilities (dropout after the softmax); the backward pass redraws
  each block.
- Backward: from the forward's row max and row sum ([B, N, T] float32) and
  di = rowsum(do * out), a dk/dv kernel (one program per key block, looping over
  query blocks), a dq kernel (per query block, looping over key blocks) and the dbias
  kernel. Masked logits get no gradient.
Triton wants power-of-two tiles: H must be a power of two in [16, 256]; the blocks are
the largest powers of two <= block_q / block_k (default BLOCKS) dividing T / S, at
least 16 (lengths: multiples of 16). Triton grids are at most 3-D: (blocks, B, N).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from t5x_like.models import dropout_hash
# The block math lives beside it; BLOCKS and unsupported are this module's API too.
from t5x_like.models.pallas_gpu_blocks import (  # noqa: F401
    _F32, _NN, _NT, _TN, BLOCKS, _Cfg, _block, _dot, _dropped, _logits, _opt, _row_hash,
    _skips, _span, unsupported)

Array = jax.Array


# --------------------------------------------------------------------- kernels
# Every kernel gets (scalars, q, k, v, bias, q_seg, kv_seg, q_pre, kv_pre, ...); absent
# operands are None. scalars: int32 [4] = (seed0, seed1, batch_offset, head_offset).
def _fwd_kernel(sc_ref, q_ref, k_ref, v_ref, bias_ref, qseg_ref, kvseg_ref, qpre_ref,
                kvpre_ref, o_ref, m_ref, l_ref, *, cfg: _Cfg, num_k: int):
  i, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  q = q_ref[...]
  rows = _span(i, bq)
  qseg, qpre = _opt(qseg_ref, ...), _opt(qpre_ref, ...)
  row_hash = _row_hash(cfg, sc_ref, b, n, rows)

  def body(j, carry):
    acc, m_prev, l_prev = carry
    keys = pl.ds(j * bk, bk)
    cols = _span(j, bk)
    s, _ = _logits(cfg, q, k_ref[keys, :], _opt(bias_ref, (slice(None), keys)), qseg,
                   _opt(kvseg_ref, keys), qpre, _opt(kvpre_ref, keys), rows, cols)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next[:, None])
    l_next = alpha * l_prev + jnp.sum(p, axis=1)  # undropped
    v = v_ref[keys, :]
    pv = _dot(_dropped(cfg, row_hash, cols, p).astype(v.dtype), v, _NN)
    return alpha[:, None] * acc + pv, m_next, l_next

  upper = num_k
  if _skips(cfg, qpre_ref is not None):
    upper = jnp.minimum(lax.div((i + 1) * bq + bk - 1, bk), num_k)
  acc = jnp.zeros(q.shape, _F32)
  m = jnp.full((bq,), -jnp.inf, _F32)
  l = jnp.zeros((bq,), _F32)
  acc, m, l = lax.fori_loop(0, upper, body, (acc, m, l))
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  m_ref[...] = m
  l_ref[...] = l


def _ds(cfg, q, k, v, do, bias, masks, m, l, di, rows, cols, row_hash):
  """(dropped probabilities, d logits) of one block, float32 [bq, bk]."""
  s, mask = _logits(cfg, q, k, bias, *masks, rows, cols)
  # Row max and sum, not their logsumexp: a fully masked row's m + log(l) rounds to m,
  # and its probabilities would come back as 1 instead of 1 / S.
  p = jnp.exp(s - m[:, None]) * (1.0 / l)[:, None]
  dp = _dropped(cfg, row_hash, cols, _dot(do, v, _NT))
  # di = rowsum(do * out) = rowsum(dp * p) also with dropout (out = dropped p @ v).
  ds = p * (dp - di[:, None])
  return (_dropped(cfg, row_hash, cols, p),
          ds if mask is None else jnp.where(mask, ds, 0.0))


def _dkv_kernel(sc_ref, q_ref, k_ref, v_ref, bias_ref, qseg_ref, kvseg_ref, qpre_ref,
                kvpre_ref, do_ref, m_ref, l_ref, di_ref, dk_ref, dv_ref, *, cfg: _Cfg,
                num_q: int):
  j, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  k, v = k_ref[...], v_ref[...]
  cols = _span(j, bk)
  kvseg, kvpre = _opt(kvseg_ref, ...), _opt(kvpre_ref, ...)

  def body(i, carry):
    dk, dv = carry
    qs = pl.ds(i * bq, bq)
    rows = _span(i, bq)
    q, do = q_ref[qs, :], do_ref[qs, :]
    masks = (_opt(qseg_ref, qs), kvseg, _opt(qpre_ref, qs), kvpre)
    pd, ds = _ds(cfg, q, k, v, do, _opt(bias_ref, (qs, slice(None))), masks, m_ref[qs],
                 l_ref[qs], di_ref[qs], rows, cols, _row_hash(cfg, sc_ref, b, n, rows))
    dv = dv + _dot(pd.astype(do.dtype), do, _TN)
    dk = dk + _dot(ds.astype(q.dtype), q, _TN)
    return dk, dv

  lower = 0
  if _skips(cfg, qpre_ref is not None):
    lower = lax.div(j * bk, bq)  # query blocks wholly above this key block see none of it
  dk, dv = lax.fori_loop(lower, num_q, body, (jnp.zeros(k.shape, _F32),
                                              jnp.zeros(v.shape, _F32)))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(sc_ref, q_ref, k_ref, v_ref, bias_ref, qseg_ref, kvseg_ref, qpre_ref,
               kvpre_ref, do_ref, m_ref, l_ref, di_ref, dq_ref, *, cfg: _Cfg, num_k: int):
  i, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  q, do, m, l, di = q_ref[...], do_ref[...], m_ref[...], l_ref[...], di_ref[...]
  rows = _span(i, bq)
  qseg, qpre = _opt(qseg_ref, ...), _opt(qpre_ref, ...)
  row_hash = _row_hash(cfg, sc_ref, b, n, rows)

  def body(j, dq):
    keys = pl.ds(j * bk, bk)
    k = k_ref[keys, :]
    masks = (qseg, _opt(kvseg_ref, keys), qpre, _opt(kvpre_ref, keys))
    _, ds = _ds(cfg, q, k, v_ref[keys, :], do, _opt(bias_ref, (slice(None), keys)), masks,
                m, l, di, rows, _span(j, bk), row_hash)
    return dq + _dot(ds.astype(k.dtype), k, _NN)

  upper = num_k
  if _skips(cfg, qpre_ref is not None):
    upper = jnp.minimum(lax.div((i + 1) * bq + bk - 1, bk), num_k)
  dq = lax.fori_loop(0, upper, body, jnp.zeros(q.shape, _F32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _dbias_kernel(sc_ref, q_ref, k_ref, v_ref, bias_ref, qseg_ref, kvseg_ref, qpre_ref,
                  kvpre_ref, do_ref, m_ref, l_ref, di_ref, db_ref, *, cfg: _Cfg, heads: int,
                  per_bias: int):
  # grid (bias batch * N, query block i, key block j); each program loops over the
  # per_bias batch rows that share its bias row (B for a batch-1 bias, else 1).
  bn, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bias_b, n = lax.div(bn, heads), lax.rem(bn, heads)
  bq, bk = cfg.block_q, cfg.block_k
  rows, cols = _span(i, bq), _span(j, bk)
  bias = bias_ref[...]

  def body(r, db):
    masks = (_opt(qseg_ref, r), _opt(kvseg_ref, r), _opt(qpre_ref, r), _opt(kvpre_ref, r))
    _, ds = _ds(cfg, q_ref[r], k_ref[r], v_ref[r], do_ref[r], bias, masks, m_ref[r],
                l_ref[r], di_ref[r], rows, cols,
                _row_hash(cfg, sc_ref, bias_b * per_bias + r, n, rows))
    return db + ds

  count = per_bias
  if _skips(cfg, qpre_ref is not None):  # a block above the diagonal has no gradient
    count = jnp.where(j * bk <= i * bq + bq - 1, per_bias, 0)
  db_ref[...] = lax.fori_loop(0, count, body, jnp.zeros((bq, bk), _F32))


# ------------------------------------------------------------------ pallas calls
def _call(kernel, cfg: _Cfg, grid, in_specs, out_specs, out_shape, operands, **kwargs):
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg, **kwargs), grid=grid, in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape, interpret=cfg.interpret,
      name="flash_attention_gpu_" + kernel.__name__.strip("_").removesuffix("_kernel"),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
  )(*operands)


def _specs(ops, at, q_block, k_block, bias_block, row_block):
  """BlockSpecs of (scalars, q, k, v, bias, q_seg, kv_seg, q_pre, kv_pre) for a grid
  whose index maps to (b, n, i, j) through `at`. q_block = (shape fn, query rows per
  block or None: the whole T, and then i is None), k_block alike over S; bias_block
  and row_block give the bias and mask-row block shapes from those row counts."""
  q, k, bias = ops[1], ops[2], ops[4]
  t, s, h = q.shape[1], k.shape[1], q.shape[3]
  bq, bk = q_block[1] or t, k_block[1] or s
  z = lambda x: 0 if x is None else x  # a whole axis is block 0

  def spec(shape, index):
    return pl.BlockSpec(shape, lambda *g: index(*at(*g)))

  bias_spec = None if bias is None else spec(
      bias_block(bq, bk), lambda b, n, i, j: (b if bias.shape[0] > 1 else 0, n, z(i), z(j)))
  qrow = spec(row_block(bq), lambda b, n, i, j: (b, z(i)))
  kvrow = spec(row_block(bk), lambda b, n, i, j: (b, z(j)))
  kv = spec(k_block[0](bk, h), lambda b, n, i, j: (b, z(j), n, 0))
  opt = lambda x, s: None if x is None else s
  return [pl.BlockSpec((4,), lambda *g: (0,)),
          spec(q_block[0](bq, h), lambda b, n, i, j: (b, z(i), n, 0)), kv, kv,
          bias_spec, opt(ops[5], qrow), opt(ops[6], kvrow), opt(ops[7], qrow),
          opt(ops[8], kvrow)]


# Block shapes of one batch row and head: [rows, H], [rows, cols], [rows] in the kernel.
_ONE = lambda rows, h: (None, rows, None, h)
_ONE_BIAS = lambda rows, cols: (None, None, rows, cols)
_ONE_ROW = lambda rows: (None, rows)


def _forward(cfg: _Cfg, ops):
  q, k = ops[1], ops[2]
  b, t, n, h = q.shape
  s = k.shape[1]
  bq = cfg.block_q
  at = lambda i, b, n: (b, n, i, None)
  in_specs = _specs(ops, at, (_ONE, bq), (_ONE, None), _ONE_BIAS, _ONE_ROW)
  stats = jax.ShapeDtypeStruct((b, n, t), _F32)  # row max m and sum l
  row = pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))
  return _call(_fwd_kernel, cfg, (t // bq, b, n), in_specs,
               [pl.BlockSpec((None, bq, None, h), lambda i, b, n: (b, i, n, 0)), row, row],
               [jax.ShapeDtypeStruct(q.shape, q.dtype), stats, stats], ops,
               num_k=s // cfg.block_k)


def _backward(cfg: _Cfg, ops, out, m, l, do):
  q, k, v, bias = ops[1:5]
  b, t, n, h = q.shape
  s = k.shape[1]
  bq, bk = cfg.block_q, cfg.block_k
  do = do.astype(q.dtype)
  di = jnp.swapaxes(jnp.sum(do.astype(_F32) * out.astype(_F32), axis=-1), 1, 2)  # [B, N, T]
  stats = (m, l, di)

  # dk, dv: grid (key block, b, n); whole query rows.
  at = lambda j, b, n: (b, n, None, j)
  specs = _specs(ops, at, (_ONE, None), (_ONE, bk), _ONE_BIAS, _ONE_ROW)
  whole_rows = pl.BlockSpec((None, None, t), lambda j, b, n: (b, n, 0))
  specs += [pl.BlockSpec((None, t, None, h), lambda j, b, n: (b, 0, n, 0))] + [whole_rows] * 3
  kv_out = pl.BlockSpec((None, bk, None, h), lambda j, b, n: (b, j, n, 0))
  dk, dv = _call(_dkv_kernel, cfg, (s // bk, b, n), specs, [kv_out, kv_out],
                 [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
                 ops + [do, *stats], num_q=t // bq)

  # dq: grid (query block, b, n); whole key rows.
  at = lambda i, b, n: (b, n, i, None)
  specs = _specs(ops, at, (_ONE, bq), (_ONE, None), _ONE_BIAS, _ONE_ROW)
  block_rows = pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))
  specs += [pl.BlockSpec((None, bq, None, h), lambda i, b, n: (b, i, n, 0))] + [block_rows] * 3
  dq = _call(_dq_kernel, cfg, (t // bq, b, n), specs,
             pl.BlockSpec((None, bq, None, h), lambda i, b, n: (b, i, n, 0)),
             jax.ShapeDtypeStruct(q.shape, q.dtype), ops + [do, *stats], num_k=s // bk)

  dbias = None
  if bias is not None:
    bias_batch = bias.shape[0]
    per = b // bias_batch  # batch rows per bias row, looped over inside the kernel
    at = lambda bn, i, j: (lax.div(bn, n), lax.rem(bn, n), i, j)
    rows_of = lambda r, h: (per, r, None, h)
    specs = _specs(ops, at, (rows_of, bq), (rows_of, bk), _ONE_BIAS, lambda r: (per, r))
    stat = pl.BlockSpec((per, None, bq), lambda bn, i, j: (lax.div(bn, n), lax.rem(bn, n), i))
    specs += [pl.BlockSpec((per, bq, None, h),
                           lambda bn, i, j: (lax.div(bn, n), i, lax.rem(bn, n), 0))] + [stat] * 3
    dbias = _call(
        _dbias_kernel, cfg, (bias_batch * n, t // bq, s // bk), specs,
        pl.BlockSpec((None, None, bq, bk),
                     lambda bn, i, j: (lax.div(bn, n), lax.rem(bn, n), i, j)),
        jax.ShapeDtypeStruct(bias.shape, _F32), ops + [do, *stats], heads=n, per_bias=per)
    dbias = dbias.astype(bias.dtype)
  return dq, dk, dv, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, *ops):
  return _forward(cfg, list(ops))[0]


def _flash_fwd(cfg, *ops):
  out, m, l = _forward(cfg, list(ops))
  return out, (ops, out, m, l)


def _flash_bwd(cfg, residuals, do):
  ops, out, m, l = residuals
  dq, dk, dv, dbias = _backward(cfg, list(ops), out, m, l, do)
  return (None, dq, dk, dv, dbias) + (None,) * (len(ops) - 5)


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------------ entry
def flash_attention(q_BxTxNxH: Array, k_BxSxKxH: Array, v_BxSxKxH: Array, *,
                    bias: Optional[Array] = None, q_segments: Optional[Array] = None,
                    kv_segments: Optional[Array] = None, causal: bool = False,
                    q_prefix: Optional[Array] = None, kv_prefix: Optional[Array] = None,
                    dropout_rate: float = 0.0, dropout_seeds: Optional[Array] = None,
                    batch_offset=0, head_offset=0, block_q: Optional[int] = None,
                    block_k: Optional[int] = None,
                    num_warps: int = 4, num_stages: int = 2,
                    interpret: bool = False) -> Array:
  """softmax(q k^T + bias) v -> [B, T, N, H] in q's dtype (module docstring)."""
  b, t, n, h = q_BxTxNxH.shape
  _, s, kv_heads, _ = k_BxSxKxH.shape
  if n % kv_heads:
    raise ValueError(f"flash_attention: {n} query heads over {kv_heads} kv heads")
  why = unsupported(h, t, s)
  if why:
    raise ValueError(f"flash_attention: {why}")
  if (q_segments is None) != (kv_segments is None):
    raise ValueError("flash_attention: give both q_segments and kv_segments, or neither")
  if (q_prefix is None) != (kv_prefix is None):
    raise ValueError("flash_attention: give both q_prefix and kv_prefix, or neither")
  if q_prefix is not None and not causal:
    q_prefix = kv_prefix = None  # prefix only widens a causal mask
  if bias is not None and (bias.shape[0] not in (1, b) or bias.shape[1:] != (n, t, s)):
    raise ValueError(f"flash_attention: bias {bias.shape}, expected [1 or {b}, {n}, {t}, {s}]")
  if dropout_rate > 0.0 and dropout_seeds is None:
    raise ValueError("flash_attention: dropout_rate > 0 needs dropout_seeds")
  dropout_hash.keep_threshold(dropout_rate)  # validates the rate
  cfg = _Cfg(causal=bool(causal), rate=float(dropout_rate),
             block_q=_block(t, block_q or BLOCKS[0]), block_k=_block(s, block_k or BLOCKS[1]),
             num_warps=num_warps, num_stages=num_stages,
             interpret=bool(interpret))
  seeds = (jnp.zeros((2,), jnp.int32) if dropout_seeds is None
           else jnp.asarray(dropout_seeds).astype(jnp.int32))
  scalars = jnp.concatenate([seeds, jnp.stack([jnp.asarray(batch_offset, jnp.int32),
                                               jnp.asarray(head_offset, jnp.int32)])])
  dtype = q_BxTxNxH.dtype
  k, v = k_BxSxKxH.astype(dtype), v_BxSxKxH.astype(dtype)
  if kv_heads != n:
    k, v = jnp.repeat(k, n // kv_heads, axis=2), jnp.repeat(v, n // kv_heads, axis=2)
  ints = lambda x: None if x is None else x.astype(jnp.int32)
  return _flash(cfg, scalars, q_BxTxNxH, k, v, bias, ints(q_segments), ints(kv_segments),
                ints(q_prefix), ints(kv_prefix))
