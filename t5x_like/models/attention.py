"""Multi-head attention (MHA / MQA / GQA), masks, relative position bias and RoPE.

Masks are boolean [B, 1, Q, K] (True = may attend) or their structure, masks.MaskSpec.
The softmax core is attention_core.attend (config.attention_impl: cuDNN flash attention
on GPU, Pallas flash attention on TPU, an explicit bf16 kernel with a custom VJP on CPU
and wherever attention dropout must follow the step's dropout key).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5x_like.models.attention_core import attend
from t5x_like.models.masks import MaskSpec
from t5x_like.models.config import ModelConfig
from t5x_like.models.layers import (DenseGeneral, compute_dtype, constrain, init_std,
                                    normal_init, param_with_axes)

Array = jax.Array


# ------------------------------------------------------------- relative position bias
def relative_position_bucket(relative_position: Array, *, bidirectional: bool,
                             num_buckets: int, max_distance: int) -> Array:
  """T5's bucketing of (key - query) distances: half exact, half log-spaced."""
  ret = jnp.zeros_like(relative_position)
  n = -relative_position
  if bidirectional:
    num_buckets //= 2
    ret = ret + (n < 0).astype(jnp.int32) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  val_if_large = max_exact + (
      jnp.log(jnp.maximum(n, max_exact).astype(jnp.float32) / max_exact) /
      math.log(max_distance / max_exact) * (num_buckets - max_exact)).astype(jnp.int32)
  val_if_large = jnp.minimum(val_if_large, num_buckets - 1)
  return ret + jnp.where(is_small, n, val_if_large)


class RelativePositionBias(nn.Module):
  """T5 relative position bias, one [heads, buckets] table per stack -> [1, N, Q, K]."""

  config: ModelConfig
  bidirectional: bool

  @nn.compact
  def __call__(self, q_len: int, k_len: int, q_offset: Array | int = 0) -> Array:
    cfg = self.config
    std = init_std(cfg, cfg.d_model) if cfg.init_scheme == "t5" else cfg.init_std
    table = param_with_axes(self, "rel_embedding", normal_init(std),
                            (cfg.num_heads, cfg.relative_buckets), ("heads", "relpos_buckets"))
    context = jnp.arange(q_len)[:, None] + q_offset
    memory = jnp.arange(k_len)[None, :]
    buckets = relative_position_bucket(memory - context, bidirectional=self.bidirectional,
                                       num_buckets=cfg.relative_buckets,
                                       max_distance=cfg.relative_max_distance)
    return jnp.take(table, buckets, axis=1)[None]  # [1, N, Q, K]


# ---------------------------------------------------------------------------- RoPE
def apply_rope(x_BxLxNxH: Array, positions_BxL: Array, theta: float) -> Array:
  """Rotary embedding, rotate-half convention (GPT-NeoX / Llama)."""
  half = x_BxLxNxH.shape[-1] // 2
  inv_freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions_BxL.astype(jnp.float32)[:, :, None] * inv_freq  # [B, L, H/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x_BxLxNxH.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxNxH.dtype)


# ----------------------------------------------------------------------- attention
class MultiHeadAttention(nn.Module):
  """Self or cross attention: [B, T, D] queries over [B, S, D] keys -> [B, T, D].

  With `decode=True` (self-attention only) keys and values are written into a
  cache [B, S_max, K, H] at `decode_index` and attention runs over the cache.
  """

  config: ModelConfig
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(self, x_q: Array, x_kv: Array, mask: Union[Array, MaskSpec, None] = None,
               bias: Optional[Array] = None, positions_q: Optional[Array] = None,
               positions_kv: Optional[Array] = None,
               decode_index: Optional[Array] = None) -> Array:
    cfg = self.config
    dtype = compute_dtype(cfg)
    n, kvh, h, d = cfg.num_heads, cfg.kv_heads, cfg.dim_per_head, cfg.d_model

    # K/V heads shard like the query heads under MHA; with GQA/MQA there are only kvh of
    # them (possibly fewer than the tensor-parallel devices), named 'kv_heads'.
    kv_axis = "heads" if kvh == n else "kv_heads"

    def proj(heads, heads_axis, std, name):
      return DenseGeneral(features=(heads, h), axes=("embed", heads_axis, "kv"),
                          use_bias=cfg.use_bias, kernel_init=normal_init(std), dtype=dtype,
                          name=name)

    q_std = init_std(cfg, d * h) if cfg.init_scheme == "t5" else init_std(cfg, d)
    q = proj(n, "heads", q_std, "query")(x_q)
    k = proj(kvh, kv_axis, init_std(cfg, d), "key")(x_kv)
    v = proj(kvh, kv_axis, init_std(cfg, d), "value")(x_kv)
    if cfg.position_embedding == "rope" and positions_q is not None:
      q = apply_rope(q, positions_q, cfg.rope_theta)
      k = apply_rope(k, positions_kv if positions_kv is not None else positions_q,
                     cfg.rope_theta)
    q = constrain(q, ("batch", "length", "heads", "kv"))
    k = constrain(k, ("batch", "length", kv_axis, "kv"))
    v = constrain(v, ("batch", "length", kv_axis, "kv"))

    if self.decode:
      k, v = self._update_cache(k, v, decode_index)

    scale = 1.0 / math.sqrt(h) if cfg.scale_attention else 1.0
    rate = cfg.attention_dropout_rate
    dropout_rng = None
    if not self.deterministic and rate > 0.0:
      dropout_rng = self.make_rng("dropout")
    # Creating parameters needs no fused kernel (and runs at any length, on any host).
    init = self.is_initializing()
    out = attend(q, k, v, bias=bias, mask=mask, scale=scale, dropout_rate=rate,
                 dropout_rng=dropout_rng, impl="explicit" if init else cfg.attention_impl,
                 name=None if init else "/".join(self.path))
    out = constrain(out, ("batch", "length", "heads", "kv"))
    o_std = init_std(cfg, n * h, residual=True)
    return DenseGeneral(features=(d,), axes=("heads", "kv", "embed"), in_dims=2,
                        use_bias=cfg.use_bias, kernel_init=normal_init(o_std), dtype=dtype,
                        name="out")(out)

  def _update_cache(self, k_BxTxKxH: Array, v_BxTxKxH: Array, index: Optional[Array]):
    """Writes this step's keys/values at `index`; returns the whole cache."""
    initialised = self.has_variable("cache", "cached_key")
    cached_k = self.variable("cache", "cached_key", jnp.zeros, k_BxTxKxH.shape, k_BxTxKxH.dtype)
    cached_v = self.variable("cache", "cached_value", jnp.zeros, v_BxTxKxH.shape,
                             v_BxTxKxH.dtype)
    if not initialised:  # init call: the input shape defines the cache size
      return k_BxTxKxH, v_BxTxKxH
    start = (0, index, 0, 0)
    cached_k.value = jax.lax.dynamic_update_slice(cached_k.value,
                                                  k_BxTxKxH.astype(cached_k.value.dtype), start)
    cached_v.value = jax.lax.dynamic_update_slice(cached_v.value,
                                                  v_BxTxKxH.astype(cached_v.value.dtype), start)
    return cached_k.value, cached_v.value
