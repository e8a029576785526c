"""Flash attention for TPU in Pallas (Dao et al. 2022), with bias, masks and dropout.

  out_BxNxTxH = flash_attention(q_BxNxTxH, k_BxKxSxH, v_BxKxSxH, bias=, q_segments=,
                                kv_segments=, causal=, q_prefix=, kv_prefix=,
                                dropout_rate=, dropout_seeds=, batch_offset=,
                                head_offset=, block_q=128, block_k=128, interpret=False)

softmax(q k^T + bias) v with no scale (the caller scales q); a jax.custom_vjp whose
backward pass runs Pallas kernels too. Logits and softmax in float32, matmuls in the
input dtype with float32 accumulation, output in q's dtype.
- Heads: N query heads over K key/value heads (N = G * K); query head n reads kv head
  n // G through the block index maps (nothing is repeated in HBM).
- bias: [1 or B, N, T, S], read block by block; a batch-1 bias (T5's relative
  positions) is never broadcast over the batch, and its gradient is summed over the
  batch inside the dbias kernel (batch is that grid's innermost axis).
- Masks: q_segments [B, T] / kv_segments [B, S] int (attend within a segment); causal
  (query t sees keys s <= t; blocks above the diagonal are skipped); prefix LM:
  q_prefix [B, T] / kv_prefix [B, S] bool, with causal: also prefix sees prefix.
  Rows that may attend to nothing average v (as the explicit kernel's uniform softmax).
- Dropout: dropout_seeds int32 [2] (dropout_hash.dropout_seeds); probability
  (b, n, t, s) is kept iff dropout_hash.keep_block(..., b + batch_offset,
  n + head_offset, t, s), the explicit kernel's mask; the offsets place a shard in the
  global batch and heads (they may be traced). The row sums use the undropped
  probabilities (dropout after the softmax), and the backward pass redraws each block.
- Backward: from the forward's row max and row sum ([B, N, T, 1] float32), kernels for
  dk/dv (summed over each kv head's G query heads in VMEM), dq and dbias. Masked logits
  get no gradient (the explicit kernel's is nonzero only in rows with no allowed key).
T and S must be multiples of block_q and block_k (multiples of 128 on a TPU when
masks or a bias are given); the head dim is taken whole.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from t5x_like.models import dropout_hash

Array = jax.Array

_MASKED = float(jnp.finfo(jnp.float32).min) * 0.7  # finite: a fully masked row has no NaN
_LANES = 128  # q-side mask rows are stored lane-broadcast, [B, T, 128] (Mosaic tiling)
_SUBLANES = 8  # kv-side mask rows are stored sublane-broadcast, [B, 8, S]
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


class _Cfg(NamedTuple):
  """Static configuration of one attention (hashable: a custom_vjp nondiff argument)."""
  causal: bool
  rate: float
  block_q: int
  block_k: int
  groups: int  # G = N // K
  interpret: bool


# ------------------------------------------------------------------- block math
def _runs(cfg: _Cfg, prefix: bool, i, j):
  """Whether block (i, j) has any allowed entry (False only above the causal diagonal)."""
  if not cfg.causal or prefix:  # a prefix lets queries see later prefix keys
    return None
  return j * cfg.block_k <= i * cfg.block_q + cfg.block_q - 1


def _when(cond):
  """pl.when, or plain execution when cond is None (no condition)."""
  return (lambda f: f()) if cond is None else pl.when(cond)


def _lanes(x_BQx128: Array, block_k: int) -> Array:
  """A lane-broadcast [block_q, 128] block as [block_q, block_k]."""
  if block_k % _LANES == 0:
    return jnp.tile(x_BQx128, (1, block_k // _LANES))
  return x_BQx128[:, :block_k]


def _logits(cfg: _Cfg, pos, q, k, bias_ref, qseg_ref, kvseg_ref, qpre_ref, kvpre_ref):
  """(float32 masked logits [block_q, block_k], boolean mask or None) of block
  pos = (b, n, i, j)."""
  _, _, i, j = pos
  bq, bk = cfg.block_q, cfg.block_k
  s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
  if bias_ref is not None:
    s = s + bias_ref[0, 0].astype(jnp.float32)
  mask = None
  if qseg_ref is not None:
    mask = _lanes(qseg_ref[0], bk) == kvseg_ref[0, :1, :]
  if cfg.causal:
    rows = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    cols = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    allowed = rows >= cols
    if qpre_ref is not None:
      allowed = allowed | ((_lanes(qpre_ref[0], bk) != 0) & (kvpre_ref[0, :1, :] != 0))
    mask = allowed if mask is None else mask & allowed
  return (s if mask is None else jnp.where(mask, s, _MASKED)), mask


def _dropped(cfg: _Cfg, sc_ref, pos, x: Array) -> Array:
  """x [block_q, block_k] times the dropout multiplier (0 or 1 / (1 - rate))."""
  if cfg.rate == 0.0:
    return x
  b, n, i, j = pos
  rows = i * cfg.block_q + lax.broadcasted_iota(jnp.int32, (cfg.block_q, 1), 0)
  cols = j * cfg.block_k + lax.broadcasted_iota(jnp.int32, (1, cfg.block_k), 1)
  keep = dropout_hash.keep_block(sc_ref[0], sc_ref[1], dropout_hash.keep_threshold(cfg.rate),
                                 b + sc_ref[2], n + sc_ref[3], rows, cols)
  return jnp.where(keep, x * (1.0 / (1.0 - cfg.rate)), 0.0)


def _ids(order, grid_rank):
  """(b, n, i, j) of the current grid step."""
  return order(*(pl.program_id(a) for a in range(grid_rank)))


# --------------------------------------------------------------------- kernels
# Every kernel gets (scalars, q, k, v, bias, q_seg, kv_seg, q_pre, kv_pre, ...); absent
# operands are None. scalars = (seed0, seed1, batch_offset, head_offset) in SMEM.
def _fwd_kernel(sc, q_ref, k_ref, v_ref, bias_ref, qseg, kvseg, qpre, kvpre,
                o_ref, m_ref, l_ref, m_sc, l_sc, acc_sc, *, cfg, order, num_k):
  pos = _ids(order, 4)
  _, _, i, j = pos

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @_when(_runs(cfg, qpre is not None, i, j))
  def _step():
    v = v_ref[0, 0]
    s, _ = _logits(cfg, pos, q_ref[0, 0], k_ref[0, 0], bias_ref, qseg, kvseg, qpre, kvpre)
    m_prev = m_sc[...]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)  # undropped
    m_sc[...] = m_next
    pv = jnp.dot(_dropped(cfg, sc, pos, p).astype(v.dtype), v,
                 preferred_element_type=jnp.float32)
    acc_sc[...] = alpha * acc_sc[...] + pv

  @pl.when(j == num_k - 1)
  def _store():
    l = l_sc[...]
    o_ref[0, 0] = (acc_sc[...] / l).astype(o_ref.dtype)
    m_ref[0, 0] = m_sc[...]
    l_ref[0, 0] = l


def _ds(cfg, sc, pos, q, k, v, do, m_ref, l_ref, di_ref, masks):
  """(dropped probabilities, d logits) of one block, float32 [block_q, block_k]."""
  s, mask = _logits(cfg, pos, q, k, *masks)
  # Row max and sum, not their logsumexp: a fully masked row's m + log(l) rounds to m,
  # and its probabilities would come back as 1 instead of 1 / S.
  p = jnp.exp(s - m_ref[0, 0]) * (1.0 / l_ref[0, 0])
  dp = _dropped(cfg, sc, pos, lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32))
  # di = rowsum(do * out) = rowsum(dp * p) also with dropout (out = dropped p @ v).
  ds = p * (dp - di_ref[0, 0])
  # Masked logits are constants: no gradient (it is not 0 where a whole row is masked).
  return _dropped(cfg, sc, pos, p), (ds if mask is None else jnp.where(mask, ds, 0.0))


def _dkv_kernel(sc, q_ref, k_ref, v_ref, bias_ref, qseg, kvseg, qpre, kvpre,
                do_ref, m_ref, l_ref, di_ref, dk_ref, dv_ref, dk_sc, dv_sc, *, cfg, order, num_q):
  # grid (b, kv head, key block j, group g, query block i): (g, i) accumulate.
  pos = _ids(order, 5)
  _, _, i, j = pos
  g = pl.program_id(3)

  @pl.when((g == 0) & (i == 0))
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  @_when(_runs(cfg, qpre is not None, i, j))
  def _step():
    q, do = q_ref[0, 0], do_ref[0, 0]
    pd, ds = _ds(cfg, sc, pos, q, k_ref[0, 0], v_ref[0, 0], do, m_ref, l_ref, di_ref,
                 (bias_ref, qseg, kvseg, qpre, kvpre))
    dv_sc[...] += lax.dot_general(pd.astype(do.dtype), do, _TN,
                                  preferred_element_type=jnp.float32)
    dk_sc[...] += lax.dot_general(ds.astype(q.dtype), q, _TN,
                                  preferred_element_type=jnp.float32)

  @pl.when((g == cfg.groups - 1) & (i == num_q - 1))
  def _store():
    dk_ref[0, 0] = dk_sc[...].astype(dk_ref.dtype)
    dv_ref[0, 0] = dv_sc[...].astype(dv_ref.dtype)


def _dq_kernel(sc, q_ref, k_ref, v_ref, bias_ref, qseg, kvseg, qpre, kvpre,
               do_ref, m_ref, l_ref, di_ref, dq_ref, dq_sc, *, cfg, order, num_k):
  pos = _ids(order, 4)
  _, _, i, j = pos

  @pl.when(j == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  @_when(_runs(cfg, qpre is not None, i, j))
  def _step():
    k = k_ref[0, 0]
    _, ds = _ds(cfg, sc, pos, q_ref[0, 0], k, v_ref[0, 0], do_ref[0, 0], m_ref, l_ref,
                di_ref,
                (bias_ref, qseg, kvseg, qpre, kvpre))
    dq_sc[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  @pl.when(j == num_k - 1)
  def _store():
    dq_ref[0, 0] = dq_sc[...].astype(dq_ref.dtype)


def _dbias_kernel(sc, q_ref, k_ref, v_ref, bias_ref, qseg, kvseg, qpre, kvpre,
                  do_ref, m_ref, l_ref, di_ref, db_ref, *, cfg, order, summed):
  # grid (head, query block, key block, b): with a batch-1 bias the output block stays
  # the same over b (innermost, sequential), so the batch sum accumulates in VMEM.
  pos = _ids(order, 4)
  b, _, i, j = pos

  @_when(b == 0 if summed else None)
  def _init():
    db_ref[...] = jnp.zeros(db_ref.shape, jnp.float32)

  @_when(_runs(cfg, qpre is not None, i, j))
  def _step():
    _, ds = _ds(cfg, sc, pos, q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], do_ref[0, 0], m_ref,
                l_ref, di_ref, (bias_ref, qseg, kvseg, qpre, kvpre))
    db_ref[0, 0] += ds


# ------------------------------------------------------------------ pallas calls
def _in_specs(cfg: _Cfg, order, ops, head_dim: int, extra: bool):
  """BlockSpecs of the operands `ops` for a grid whose step maps to (b, n, i, j) by order."""
  bq, bk = cfg.block_q, cfg.block_k
  at = lambda f: (lambda *a: f(*order(*a[:-1])))  # a[-1]: the scalar-prefetch ref
  q_spec = pl.BlockSpec((1, 1, bq, head_dim), at(lambda b, n, i, j: (b, n, i, 0)))
  kv_spec = pl.BlockSpec((1, 1, bk, head_dim),
                         at(lambda b, n, i, j: (b, lax.div(n, jnp.int32(cfg.groups)), j, 0)))
  bias = ops[3]
  bias_spec = None if bias is None else pl.BlockSpec(
      (1, 1, bq, bk), at(lambda b, n, i, j: (b if bias.shape[0] > 1 else 0, n, i, j)))
  qrow = pl.BlockSpec((1, bq, _LANES), at(lambda b, n, i, j: (b, i, 0)))
  kvrow = pl.BlockSpec((1, _SUBLANES, bk), at(lambda b, n, i, j: (b, 0, j)))
  opt = lambda x, spec: None if x is None else spec
  specs = [q_spec, kv_spec, kv_spec, bias_spec, opt(ops[4], qrow), opt(ops[5], kvrow),
           opt(ops[6], qrow), opt(ops[7], kvrow)]
  if extra:  # do [B, N, T, H]; m, l, di [B, N, T, 1]
    row = pl.BlockSpec((1, 1, bq, 1), at(lambda b, n, i, j: (b, n, i, 0)))
    specs += [q_spec, row, row, row]
  return specs


def _call(kernel, cfg, grid, order, semantics, scalars, ops, out_specs, out_shape, scratch,
          **kwargs):
  head_dim = ops[0].shape[-1]
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg, order=order, **kwargs),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=grid,
          in_specs=_in_specs(cfg, order, ops, head_dim, len(ops) > 8),
          out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape, interpret=cfg.interpret,
      name="flash_attention_" + kernel.__name__.strip("_").removesuffix("_kernel"),
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
  )(scalars, *ops)


_IDENTITY = lambda b, n, i, j: (b, n, i, j)


def _forward(cfg: _Cfg, scalars, ops):
  q = ops[0]
  b, n, t, h = q.shape
  s = ops[1].shape[2]
  bq = cfg.block_q
  row = pl.BlockSpec((1, 1, bq, 1), lambda b, n, i, j, sc: (b, n, i, 0))
  stats = jax.ShapeDtypeStruct((b, n, t, 1), jnp.float32)  # row max m and sum l
  return _call(
      _fwd_kernel, cfg, (b, n, t // bq, s // cfg.block_k), _IDENTITY,
      ("parallel", "parallel", "parallel", "arbitrary"), scalars, ops,
      [pl.BlockSpec((1, 1, bq, h), lambda b, n, i, j, sc: (b, n, i, 0)), row, row],
      [jax.ShapeDtypeStruct(q.shape, q.dtype), stats, stats],
      [pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
       pltpu.VMEM((bq, h), jnp.float32)],
      num_k=s // cfg.block_k)


def _backward(cfg: _Cfg, scalars, ops, out, m, l, do):
  q, k, v, bias = ops[:4]
  b, n, t, h = q.shape
  kv_heads, s = k.shape[1], k.shape[2]
  bq, bk = cfg.block_q, cfg.block_k
  do = do.astype(q.dtype)
  di = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
  ops = list(ops) + [do, m, l, di]
  g_ = cfg.groups

  dkv_order = lambda bb, kh, j, g, i: (bb, kh * g_ + g, i, j)
  kv_out = pl.BlockSpec((1, 1, bk, h), lambda bb, kh, j, g, i, sc: (bb, kh, j, 0))
  dk, dv = _call(
      _dkv_kernel, cfg, (b, kv_heads, s // bk, g_, t // bq), dkv_order,
      ("parallel", "parallel", "parallel", "arbitrary", "arbitrary"), scalars, ops,
      [kv_out, kv_out],
      [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      [pltpu.VMEM((bk, h), jnp.float32), pltpu.VMEM((bk, h), jnp.float32)],
      num_q=t // bq)

  dq = _call(
      _dq_kernel, cfg, (b, n, t // bq, s // bk), _IDENTITY,
      ("parallel", "parallel", "parallel", "arbitrary"), scalars, ops,
      pl.BlockSpec((1, 1, bq, h), lambda b, n, i, j, sc: (b, n, i, 0)),
      jax.ShapeDtypeStruct(q.shape, q.dtype), [pltpu.VMEM((bq, h), jnp.float32)],
      num_k=s // bk)

  dbias = None
  if bias is not None:
    summed = bias.shape[0] == 1 and b > 1
    db_order = lambda nn, i, j, bb: (bb, nn, i, j)
    dbias = _call(
        _dbias_kernel, cfg, (n, t // bq, s // bk, b), db_order,
        ("parallel", "parallel", "parallel", "arbitrary"), scalars, ops,
        pl.BlockSpec((1, 1, bq, bk),
                     lambda nn, i, j, bb, sc: (0 if bias.shape[0] == 1 else bb, nn, i, j)),
        jax.ShapeDtypeStruct(bias.shape, jnp.float32), [], summed=summed)
    dbias = dbias.astype(bias.dtype)
  return dq, dk, dv, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, scalars, *ops):
  return _forward(cfg, scalars, ops)[0]


def _flash_fwd(cfg, scalars, *ops):
  out, m, l = _forward(cfg, scalars, ops)
  return out, (scalars, ops, out, m, l)


def _flash_bwd(cfg, residuals, do):
  scalars, ops, out, m, l = residuals
  dq, dk, dv, dbias = _backward(cfg, scalars, ops, out, m, l, do)
  return (None, dq, dk, dv, dbias) + (None,) * (len(ops) - 4)


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------------ entry
def flash_attention(q_BxNxTxH: Array, k_BxKxSxH: Array, v_BxKxSxH: Array, *,
                    bias: Optional[Array] = None, q_segments: Optional[Array] = None,
                    kv_segments: Optional[Array] = None, causal: bool = False,
                    q_prefix: Optional[Array] = None, kv_prefix: Optional[Array] = None,
                    dropout_rate: float = 0.0, dropout_seeds: Optional[Array] = None,
                    batch_offset=0, head_offset=0, block_q: int = 128, block_k: int = 128,
                    interpret: Optional[bool] = None) -> Array:
  """softmax(q k^T + bias) v -> [B, N, T, H] in q's dtype (module docstring)."""
  b, n, t, h = q_BxNxTxH.shape
  _, kv_heads, s, _ = k_BxKxSxH.shape
  if n % kv_heads:
    raise ValueError(f"flash_attention: {n} query heads over {kv_heads} kv heads")
  if t % block_q or s % block_k:
    raise ValueError(f"flash_attention: lengths T={t}, S={s} must be multiples of the"
                     f" blocks block_q={block_q}, block_k={block_k}")
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
  if interpret is None:  # compiled for a TPU (pltpu.force_tpu_interpret_mode() overrides)
    interpret = False
  cfg = _Cfg(causal=bool(causal), rate=float(dropout_rate), block_q=block_q,
             block_k=block_k, groups=n // kv_heads, interpret=bool(interpret))
  seeds = (jnp.zeros((2,), jnp.int32) if dropout_seeds is None
           else jnp.asarray(dropout_seeds).astype(jnp.int32))
  scalars = jnp.concatenate([seeds, jnp.stack([jnp.asarray(batch_offset, jnp.int32),
                                               jnp.asarray(head_offset, jnp.int32)])])
  # Mask rows in the layouts Mosaic tiles: q side lane-broadcast [B, T, 128], kv side
  # sublane-broadcast [B, 8, S] (a [1, block] row of a 1-D array is not a legal block).
  qrow = lambda x: jnp.broadcast_to(x.astype(jnp.int32)[:, :, None], (b, t, _LANES))
  kvrow = lambda x: jnp.broadcast_to(x.astype(jnp.int32)[:, None, :], (b, _SUBLANES, s))
  opt = lambda x, f: None if x is None else f(x)
  dtype = q_BxNxTxH.dtype
  return _flash(cfg, scalars, q_BxNxTxH, k_BxKxSxH.astype(dtype), v_BxKxSxH.astype(dtype),
                bias, opt(q_segments, qrow), opt(kv_segments, kvrow), opt(q_prefix, qrow),
                opt(kv_prefix, kvrow))
