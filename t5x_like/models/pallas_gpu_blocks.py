"""The block math of the Pallas GPU flash-attention kernels (pallas_gpu_flash.py): the
static configuration, supported shapes and block sizes, and what one [block_q, block_k]
block computes (masked logits, the hashed dropout mask of dropout_hash.py, which blocks
a causal or prefix-LM mask skips)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from t5x_like.models import dropout_hash

Array = jax.Array

_MASKED = float(jnp.finfo(jnp.float32).min) * 0.7  # finite: a fully masked row has no NaN
_MIN_BLOCK = 16  # Triton's smallest dot tile
_NN = (((1,), (0,)), ((), ()))  # a @ b
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b
_F32 = jnp.float32
# (block_q, block_k) when flash_attention is given none: untuned first guesses (64 x 64
# keeps a [64, 64] float32 tile and its dropout hash in registers at 4 warps).
BLOCKS = (64, 64)


class _Cfg(NamedTuple):
  """Static configuration of one attention (hashable: a custom_vjp nondiff argument)."""
  causal: bool
  rate: float
  block_q: int
  block_k: int
  num_warps: int
  num_stages: int
  interpret: bool


def unsupported(head_dim: int, q_len: int, kv_len: int) -> str:
  """Why the kernel cannot take these shapes (pallas_gpu_flash.py's docstring), or ""."""
  if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
    return f"head dim {head_dim}: needs a power of two in [16, 256] (Triton tiles)"
  if q_len % _MIN_BLOCK or kv_len % _MIN_BLOCK:
    return f"lengths {q_len} x {kv_len}: need multiples of {_MIN_BLOCK} (Triton tiles)"
  return ""


def _block(length: int, preferred: int) -> int:
  """The largest power of two <= preferred dividing length."""
  block = 1 << (max(preferred, 1).bit_length() - 1)
  while length % block:
    block //= 2
  return block


# ------------------------------------------------------------------- block math
def _dot(a, b, dimension_numbers):
  """a . b with float32 accumulation. Triton multiplies float32 operands in TF32 unless
  the dot asks for more (jax's Pallas Triton lowering: precision DEFAULT or HIGH -> TF32,
  HIGHEST -> IEEE), so float32 operands get HIGHEST: IEEE float32 products. Other
  dtypes (bfloat16, float16) keep the default: their products are exact in float32."""
  precision = lax.Precision.HIGHEST if a.dtype == _F32 else None
  return lax.dot_general(a, b, dimension_numbers, precision=precision,
                         preferred_element_type=_F32)


def _logits(cfg: _Cfg, q, k, bias, qseg, kvseg, qpre, kvpre, rows, cols):
  """(float32 masked logits [bq, bk], boolean mask or None) of one block: q [bq, H],
  k [bk, H], bias [bq, bk] or None, q-side rows [bq] and kv-side columns [bk] of
  segments / prefix flags (or None), global query rows [bq] and key columns [bk]."""
  s = _dot(q, k, _NT)
  if bias is not None:
    s = s + bias.astype(_F32)
  mask = None
  if qseg is not None:
    mask = qseg[:, None] == kvseg[None, :]
  if cfg.causal:
    allowed = rows[:, None] >= cols[None, :]
    if qpre is not None:
      allowed = allowed | ((qpre[:, None] != 0) & (kvpre[None, :] != 0))
    mask = allowed if mask is None else mask & allowed
  return (s if mask is None else jnp.where(mask, s, _MASKED)), mask


def _row_hash(cfg: _Cfg, sc_ref, b, n, rows):
  """Dropout hashes of the query rows [bq, 1] (None without dropout)."""
  if cfg.rate == 0.0:
    return None
  return dropout_hash.row_hash(sc_ref[0], sc_ref[1], b + sc_ref[2], n + sc_ref[3],
                               rows[:, None])


def _dropped(cfg: _Cfg, row_hash, cols, x):
  """x [bq, bk] times the dropout multiplier (0 or 1 / (1 - rate))."""
  if row_hash is None:
    return x
  keep = dropout_hash.keep_from_rows(row_hash, cols[None, :],
                                     dropout_hash.keep_threshold(cfg.rate))
  return jnp.where(keep, x * (1.0 / (1.0 - cfg.rate)), 0.0)


def _skips(cfg: _Cfg, prefix: bool) -> bool:
  """Whether key blocks above the causal diagonal can be skipped (a prefix lets
  queries see later prefix keys)."""
  return cfg.causal and not prefix


def _opt(ref, index):
  return None if ref is None else ref[index]


def _span(start, size):
  return start * size + jnp.arange(size, dtype=jnp.int32)
