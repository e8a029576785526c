"""Attention dropout masks from a counter-based hash: the same mask in every kernel.

  seeds = dropout_seeds(dropout_rng)                      # int32 [2]
  keep_BxNxTxS = keep_mask(seeds, rate, batch=, heads=, q_len=, kv_len=)
  keep = keep_block(seeds, threshold, b, h, q_idx, k_idx) # inside a kernel's block

Whether attention probability (b, h, q, k) is kept is a pure function of the step's
dropout key and those four global indices (a counter-based generator, as Salmon et
al. 2011's Philox/Threefry, here with MurmurHash3's 32-bit finaliser as the mixing
function). So the explicit kernel, which builds the whole [B, N, T, S] mask, and the
fused Pallas kernel, which draws each [block_q, block_k] block where it needs it (in
the forward pass and again in the backward pass), apply the same mask; a shard of a
sharded batch draws the rows of the global batch it holds; a resumed run draws the
same masks as an uninterrupted one.

Everything is int32 arithmetic with wrap-around multiplication and logical shifts, which
TPU vector units (Mosaic), XLA on every backend and Pallas interpret mode all do alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

_BITS = 24  # uniform bits compared against the threshold


def _i32(value: int) -> Array:
  """A uint32 constant as the int32 with the same bits."""
  return jnp.int32(value - (1 << 32) if value >= 1 << 31 else value)


def _mix(x: Array) -> Array:
  """MurmurHash3's fmix32 on int32 bits (wrap-around products, logical shifts)."""
  srl = jax.lax.shift_right_logical
  x = x ^ srl(x, jnp.int32(16))
  x = x * _i32(0x85EBCA6B)
  x = x ^ srl(x, jnp.int32(13))
  x = x * _i32(0xC2B2AE35)
  return x ^ srl(x, jnp.int32(16))


def dropout_seeds(dropout_rng: Array) -> Array:
  """int32 [2] seed words of a dropout key (new-style or raw uint32 key)."""
  bits = jax.random.bits(dropout_rng, (2,), jnp.uint32)
  return jax.lax.bitcast_convert_type(bits, jnp.int32)


def keep_threshold(rate: float) -> int:
  """Keep when the 24-bit draw is below this (round((1 - rate) * 2^24))."""
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"attention dropout rate {rate}: must be in [0, 1)")
  return int(round((1.0 - rate) * (1 << _BITS)))


def row_hash(seed0: Array, seed1: Array, b: Array, h: Array, q: Array) -> Array:
  """int32 hash of (seeds, batch, head, query) (broadcasting int32 arrays)."""
  x = _mix(seed0 ^ _mix(seed1 + _i32(0x9E3779B9)))
  x = _mix(x ^ (b * _i32(0x27D4EB2F)))
  x = _mix(x ^ (h * _i32(0x165667B1)))
  return _mix(x ^ (q * _i32(0x9E3779B1)))


def keep_from_rows(rows: Array, k: Array, threshold: int) -> Array:
  """Boolean keep of query rows' hashes `rows` against key positions `k` (broadcast)."""
  x = _mix(rows ^ (k * _i32(0x85EBCA77)))
  return jax.lax.shift_right_logical(x, jnp.int32(32 - _BITS)) < jnp.int32(threshold)


def keep_block(seed0: Array, seed1: Array, threshold: int, b: Array, h: Array,
               q_BQx1: Array, k_1xBK: Array) -> Array:
  """Boolean [BQ, BK] keep mask of one block: global query rows q, key columns k."""
  return keep_from_rows(row_hash(seed0, seed1, b, h, q_BQx1), k_1xBK, threshold)


def keep_mask(seeds: Array, rate: float, *, batch: int, heads: int, q_len: int,
              kv_len: int) -> Array:
  """Boolean [B, N, T, S] keep mask of the whole attention (True = kept)."""
  threshold = keep_threshold(rate)
  b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
  h = jnp.arange(heads, dtype=jnp.int32)[None, :, None, None]
  q = jnp.arange(q_len, dtype=jnp.int32)[None, None, :, None]
  k = jnp.arange(kv_len, dtype=jnp.int32)[None, None, None, :]
  return keep_from_rows(row_hash(seeds[0], seeds[1], b, h, q), k, threshold)
