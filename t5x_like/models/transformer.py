"""Transformer blocks and stacks (optionally scanned over layers and rematerialised)."""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5x_like.models.attention import MultiHeadAttention, RelativePositionBias
from t5x_like.models.config import ModelConfig
from t5x_like.models.layers import Mlp, constrain, make_norm

Array = jax.Array

REMAT_POLICIES = {
    "full": None,  # save nothing, recompute the whole block
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class Block(nn.Module):
  """One layer: self-attention, optional cross-attention, MLP; pre- or post-norm.

  x: [B, T, D] -> [B, T, D]. With `scanned`, returns (x, None) for nn.scan.
  """

  config: ModelConfig
  cross_attention: bool = False
  deterministic: bool = True
  decode: bool = False
  scanned: bool = False

  @nn.compact
  def __call__(self, x: Array, mask: Optional[Array], bias: Optional[Array],
               positions: Optional[Array], encoded: Optional[Array],
               cross_mask: Optional[Array], decode_index: Optional[Array]):
    cfg = self.config
    drop = lambda y: nn.Dropout(cfg.dropout_rate)(y, deterministic=self.deterministic)

    def sublayer(x, name, fn):
      if cfg.pre_norm:
        return x + drop(fn(make_norm(cfg, f"{name}_norm")(x)))
      return make_norm(cfg, f"{name}_norm")(x + drop(fn(x)))

    x = sublayer(x, "self_attention", lambda h: MultiHeadAttention(
        cfg, self.deterministic, self.decode, name="self_attention")(
            h, h, mask, bias, positions, decode_index=decode_index))
    if self.cross_attention:
      x = sublayer(x, "cross_attention", lambda h: MultiHeadAttention(
          cfg, self.deterministic, name="cross_attention")(h, encoded, cross_mask))
    x = sublayer(x, "mlp", lambda h: Mlp(cfg, self.deterministic, name="mlp")(h))
    x = constrain(x, ("batch", "length", "embed"))
    return (x, None) if self.scanned else x


class Stack(nn.Module):
  """num_layers Blocks, a relative position bias shared by the stack, a final norm.

  x: [B, T, D] embeddings -> [B, T, D]. mask: [B, 1, T, S] boolean.
  """

  config: ModelConfig
  num_layers: int
  causal: bool = False
  cross_attention: bool = False
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(self, x: Array, mask: Array, positions: Optional[Array] = None,
               encoded: Optional[Array] = None, cross_mask: Optional[Array] = None,
               decode_index: Optional[Array] = None) -> Array:
    cfg = self.config
    bias = None
    if cfg.position_embedding == "relative":
      bias = RelativePositionBias(cfg, bidirectional=not self.causal, name="relpos")(
          x.shape[1], mask.shape[-1], 0 if decode_index is None else decode_index)

    block = Block
    if cfg.remat_policy != "none":
      block = nn.remat(Block, policy=REMAT_POLICIES[cfg.remat_policy],
                       prevent_cse=not cfg.scan_layers)
    args = (mask, bias, positions, encoded, cross_mask, decode_index)
    kw = dict(cross_attention=self.cross_attention, deterministic=self.deterministic,
              decode=self.decode)
    if cfg.scan_layers:
      scanned = nn.scan(block, variable_axes={"params": 0, "cache": 0},
                        split_rngs={"params": True, "dropout": True},
                        in_axes=(nn.broadcast,) * len(args), length=self.num_layers,
                        metadata_params={nn.PARTITION_NAME: "layers"})
      x, _ = scanned(cfg, scanned=True, name="layers", **kw)(x, *args)
    else:
      for i in range(self.num_layers):
        x = block(cfg, name=f"layers_{i}", **kw)(x, *args)
    if cfg.final_norm:
      x = make_norm(cfg, "final_norm")(x)
      x = nn.Dropout(cfg.dropout_rate)(x, deterministic=self.deterministic)
    return x


def decode_step(module: nn.Module, batch: int, length: int, *,
                key_valid_BxT: Optional[Array] = None, positions_BxT: Optional[Array] = None):
  """Cache bookkeeping for incremental decoding, kept by the family module.

  The cache holds `index` (next slot) and `key_valid` [B, S] (filled slots); S is
  the length seen at init. Returns (index, positions [B, T], mask [B, 1, T, S]) for
  the `length` new tokens and advances the index. At init it returns a plain
  causal mask over the init length.

  key_valid_BxT: which of the new tokens are real (default all); padding written into
  the cache is never attended to by later tokens (left-padded prompts). A query always
  sees its own slot, so that padding rows stay finite. positions_BxT: the positions of
  the new tokens (default: their slots).
  """
  initialising = not module.has_variable("cache", "index")
  index_var = module.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
  valid_var = module.variable("cache", "key_valid", jnp.zeros, (batch, length), jnp.bool_)
  positions = jnp.broadcast_to(jnp.arange(length)[None], (batch, length))
  if initialising:
    causal = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
    return jnp.zeros((), jnp.int32), positions, causal[None, None]
  index = index_var.value
  cache_len = valid_var.value.shape[1]
  slots = jnp.arange(cache_len)
  if key_valid_BxT is None:
    new_BxS = ((slots >= index) & (slots < index + length))[None, :]
  else:
    new_BxS = jax.lax.dynamic_update_slice(jnp.zeros((batch, cache_len), jnp.bool_),
                                           key_valid_BxT.astype(jnp.bool_), (0, index))
  valid_var.value = valid_var.value | new_BxS
  index_var.value = index + length
  q_pos = index + jnp.arange(length)
  causal = slots[None, :] <= q_pos[:, None]  # [T, S]
  own_slot = slots[None, :] == q_pos[:, None]
  mask = (valid_var.value[:, None, None, :] & causal[None, None]) | own_slot[None, None]
  if positions_BxT is None:
    positions_BxT = positions + index
  return index, positions_BxT, mask
