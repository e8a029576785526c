"""The attention core softmax(q k^T * scale + bias) v, with masks and dropout.

  out_BxTxNxH = attend(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, bias=, mask=, keep=, scale=,
                       impl="auto")

Two implementations:
- "xla_sdpa": jax.nn.dot_product_attention (cuDNN flash attention on GPU where it
  applies). It cannot apply dropout to the probabilities.
- "explicit": every matmul, forward and backward, is a 16-bit x 16-bit -> float32 product
  (a custom VJP, like layers.dot): plain autodiff of a float32-accumulating einsum
  upcasts the backward matmuls to float32, and XLA's generic attention lowering is slow
  on CPU. Softmax and its gradient run in float32; the probabilities are kept for the
  backward pass in the compute dtype. Dropout multiplies the probabilities by `keep`.
"auto" is xla_sdpa on GPU without dropout, explicit otherwise.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array

from t5x_like.models.config import ATTENTION_IMPLS as IMPLS

_MASKED = jnp.finfo(jnp.float32).min * 0.7  # masked logits (finite: no inf - inf)


def _grouped(q_BxTxNxH: Array, kv_heads: int) -> Array:
  b, t, n, h = q_BxTxNxH.shape
  return q_BxTxNxH.reshape(b, t, kv_heads, n // kv_heads, h)


def _einsum(spec: str, a: Array, b: Array) -> Array:
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _probs(q, k, bias, mask, scale):
  """float32 softmax probabilities [B, K, G, T, S]."""
  b, t, n, _ = q.shape
  kv = k.shape[2]
  logits = _einsum("btkgh,bskh->bkgts", _grouped(q, kv), k) * scale
  s = logits.shape[-1]
  logits = logits.reshape(b, n, t, s)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  if mask is not None:
    logits = jnp.where(mask, logits, _MASKED)
  return jax.nn.softmax(logits, axis=-1).reshape(b, kv, n // kv, t, s)


def _dropped(p, keep, dtype):
  """Probabilities [B, K, G, T, S] times the dropout multiplier [B, N, T, S], in dtype."""
  if keep is None:
    return p.astype(dtype)
  return (p * keep.reshape(p.shape).astype(jnp.float32)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _explicit(q, k, v, bias, mask, keep, scale):
  return _explicit_fwd(q, k, v, bias, mask, keep, scale)[0]


def _explicit_fwd(q, k, v, bias, mask, keep, scale):
  dtype = q.dtype
  p = _probs(q, k, bias, mask, scale)
  out = _einsum("bkgts,bskh->btkgh", _dropped(p, keep, dtype), v)
  out = out.reshape(q.shape).astype(dtype)
  return out, (q, k, v, p.astype(dtype), bias, mask, keep)


def _explicit_bwd(scale, residuals, g_BxTxNxH):
  q, k, v, p, bias, mask, keep = residuals
  dtype = q.dtype
  kv = k.shape[2]
  g = _grouped(g_BxTxNxH.astype(dtype), kv)
  dv = _einsum("bkgts,btkgh->bskh", _dropped(p, keep, dtype), g)
  dp = _einsum("btkgh,bskh->bkgts", g, v)  # float32
  if keep is not None:
    dp = dp * keep.reshape(dp.shape).astype(jnp.float32)
  p32 = p.astype(jnp.float32)
  ds = p32 * (dp - jnp.sum(dp * p32, axis=-1, keepdims=True))  # d logits, float32
  ds_lp = ds.astype(dtype)
  dq = (_einsum("bkgts,bskh->btkgh", ds_lp, k) * scale).reshape(q.shape).astype(q.dtype)
  dk = (_einsum("bkgts,btkgh->bskh", ds_lp, _grouped(q, kv)) * scale).astype(k.dtype)
  dbias = None
  if bias is not None:
    b, n, t, s = ds.shape[0], ds.shape[1] * ds.shape[2], ds.shape[3], ds.shape[4]
    ds_n = ds.reshape(b, n, t, s)
    summed = tuple(i for i, size in enumerate(bias.shape) if size == 1 and ds_n.shape[i] != 1)
    dbias = jnp.sum(ds_n, axis=summed, keepdims=True).astype(bias.dtype)
  return (dq, dk, dv.astype(v.dtype), dbias, None, None)


_explicit.defvjp(_explicit_fwd, _explicit_bwd)


def resolve_impl(impl: str, dropout: bool) -> str:
  """The implementation `impl` stands for on this backend (see the module docstring)."""
  if impl not in IMPLS:
    raise ValueError(f"attention impl {impl!r}: expected one of {IMPLS}")
  if impl == "auto":
    return "xla_sdpa" if jax.default_backend() == "gpu" and not dropout else "explicit"
  if impl == "xla_sdpa" and dropout:
    raise ValueError("attention impl 'xla_sdpa' cannot apply attention dropout; use"
                     " 'explicit' or 'auto'")
  return impl


def attend(q_BxTxNxH: Array, k_BxSxKxH: Array, v_BxSxKxH: Array, *,
           bias: Optional[Array] = None, mask: Optional[Array] = None,
           keep: Optional[Array] = None, scale: float = 1.0, impl: str = "auto") -> Array:
  """Attention over S keys for T queries -> [B, T, N, H] in q's dtype.

  bias: [1 or B, N, T, S] added to the logits; mask: boolean [B, 1, T, S] (True = may
  attend); keep: dropout multiplier [B, N, T, S] (0 or 1 / (1 - rate)) on the
  probabilities, or None. Heads: N query heads over K = N / G key/value heads (GQA).
  """
  dtype = q_BxTxNxH.dtype
  k_BxSxKxH, v_BxSxKxH = k_BxSxKxH.astype(dtype), v_BxSxKxH.astype(dtype)
  if resolve_impl(impl, keep is not None) == "xla_sdpa":
    return jax.nn.dot_product_attention(
        q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask=mask, scale=scale,
        bias=None if bias is None else bias.astype(dtype))
  if mask is not None:
    mask = mask.astype(bool)
  return _explicit(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, bias, mask, keep, scale)
