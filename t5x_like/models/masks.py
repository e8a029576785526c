"""Attention masks: the dense boolean [B, 1, Q, K] form and its structure (MaskSpec).

  mask_BxQxK = attention_mask(key_valid_BxK, query_segment_BxQ=, key_segment_BxK=,
                              causal=, prefix_BxQ=)          # dense, True = may attend
  spec = MaskSpec(key_valid=, q_segments=, kv_segments=, causal=, prefix=)
  spec.dense()                                               # the same dense mask

The model passes MaskSpecs to attention so that fused kernels can use the structure
(a causal flag, segment ids) instead of reading a dense mask: see attention_core.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array


def attention_mask(key_valid_BxK: Array, *, query_segment_BxQ: Optional[Array] = None,
                   key_segment_BxK: Optional[Array] = None, causal: bool = False,
                   prefix_BxQ: Optional[Array] = None) -> Array:
  """Boolean [B, 1, Q, K] mask.

  key_valid: keys that exist (not padding). Segment ids (packing) restrict attention
  to the same segment. causal: query i sees keys j <= i; prefix (prefix LM,
  `decoder_causal_attention`) additionally lets prefix tokens see each other.
  """
  mask = key_valid_BxK.astype(bool)[:, None, None, :]
  if query_segment_BxQ is not None:
    mask = mask & (query_segment_BxQ[:, None, :, None] == key_segment_BxK[:, None, None, :])
  if causal:  # self-attention: Q == K
    k_len = key_valid_BxK.shape[1]
    allowed = (jnp.arange(k_len)[:, None] >= jnp.arange(k_len)[None, :])[None, None]
    if prefix_BxQ is not None:
      prefix = prefix_BxQ.astype(bool)
      allowed = allowed | (prefix[:, None, :, None] & prefix[:, None, None, :])
    mask = mask & allowed
  return mask


@flax.struct.dataclass
class MaskSpec:
  """The structure of a [B, 1, Q, K] mask (see attention_mask).

  key_valid [B, K] bool, or None (every key exists); q_segments [B, Q] and
  kv_segments [B, K] int (packing), or None; prefix [B, Q] (prefix LM), or None;
  causal: static. q_len is static too (key_valid may be None).
  """

  q_len: int = flax.struct.field(pytree_node=False)
  kv_len: int = flax.struct.field(pytree_node=False)
  batch: int = flax.struct.field(pytree_node=False)
  key_valid: Optional[Array] = None
  q_segments: Optional[Array] = None
  kv_segments: Optional[Array] = None
  prefix: Optional[Array] = None
  causal: bool = flax.struct.field(pytree_node=False, default=False)

  @property
  def shape(self) -> tuple[int, int, int, int]:
    return (self.batch, 1, self.q_len, self.kv_len)

  @property
  def is_only_causal(self) -> bool:
    """True when the mask is the plain lower triangle (no padding, packing or prefix)."""
    return (self.causal and self.key_valid is None and self.q_segments is None
            and self.prefix is None)

  def key_valid_or_ones(self) -> Array:
    if self.key_valid is not None:
      return self.key_valid.astype(bool)
    return jnp.ones((self.batch, self.kv_len), bool)

  def dense(self) -> Array:
    """Boolean [B, 1, Q, K]."""
    mask = attention_mask(self.key_valid_or_ones(), query_segment_BxQ=self.q_segments,
                          key_segment_BxK=self.kv_segments, causal=self.causal,
                          prefix_BxQ=self.prefix)
    return jnp.broadcast_to(mask, self.shape)


def mask_spec(key_valid_BxK: Optional[Array], *, q_len: Optional[int] = None,
              kv_len: Optional[int] = None, batch: Optional[int] = None,
              query_segment_BxQ: Optional[Array] = None,
              key_segment_BxK: Optional[Array] = None, causal: bool = False,
              prefix_BxQ: Optional[Array] = None) -> MaskSpec:
  """A MaskSpec with attention_mask's arguments; shapes come from the arrays given
  (q_len / kv_len / batch only where no array carries them)."""
  if key_valid_BxK is not None:
    batch, kv_len = key_valid_BxK.shape
  if query_segment_BxQ is not None:
    q_len = query_segment_BxQ.shape[1]
  if q_len is None:
    q_len = kv_len if causal else None
  if None in (q_len, kv_len, batch):
    raise ValueError(f"mask_spec: q_len={q_len}, kv_len={kv_len}, batch={batch}: give the"
                     " shapes no array carries")
  return MaskSpec(q_len=int(q_len), kv_len=int(kv_len), batch=int(batch),
                  key_valid=key_valid_BxK, q_segments=query_segment_BxQ,
                  kv_segments=key_segment_BxK, prefix=prefix_BxQ, causal=causal)
