"""The three Flax modules: encoder (BERT), decoder (GPT-2) and encoder-decoder (T5).

Each takes a batch dict with the feature names of models/model.py and returns logits.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5x_like.models.masks import mask_spec
from t5x_like.models.config import ModelConfig
from t5x_like.models.layers import (DenseGeneral, Embed, activation, compute_dtype, constrain,
                                    init_std, make_norm, normal_init)
from t5x_like.models.transformer import Stack, decode_step

Array = jax.Array
Batch = dict


def _positions(batch: Batch, key: str, tokens: Array) -> Array:
  if key in batch and batch[key] is not None:
    return batch[key]
  return jnp.broadcast_to(jnp.arange(tokens.shape[1])[None], tokens.shape)


def _encoder_mask(batch: Batch) -> Array:
  """Bidirectional [B, 1, L, L] MaskSpec: real tokens (or packed segments) see their own."""
  tokens = batch["encoder_input_tokens"]
  segments = batch.get("encoder_segment_ids")
  return mask_spec(tokens > 0 if segments is None else segments > 0, q_len=tokens.shape[1],
                   query_segment_BxQ=segments, key_segment_BxK=segments)


def _decoder_positions_and_mask(module: nn.Module, batch: Batch):
  """(decode_index or None, positions [B, T], causal / prefix-LM mask [B, 1, T, S]).

  Padding is not masked by token id (GPT-2's id 0 is a real token): right padding
  cannot reach real positions through a causal mask, and packed rows use segment ids.
  With `decode` (the KV cache), decoder_segment_ids only mark padding (0) that later
  tokens must not see, and decoder_positions, when given, are the new tokens' positions
  (left-padded prompts in t5x_like.infer); packing is not supported there.
  """
  tokens = batch["decoder_input_tokens"]
  if module.decode:
    segments = batch.get("decoder_segment_ids")
    return decode_step(module, *tokens.shape,
                       key_valid_BxT=None if segments is None else segments > 0,
                       positions_BxT=batch.get("decoder_positions"))
  segments = batch.get("decoder_segment_ids")
  batch_size, length = tokens.shape
  mask = mask_spec(None if segments is None else segments > 0, q_len=length, kv_len=length,
                   batch=batch_size, query_segment_BxQ=segments, key_segment_BxK=segments,
                   causal=True, prefix_BxQ=batch.get("decoder_causal_attention"))
  return None, _positions(batch, "decoder_positions", tokens), mask


def _token_embed(cfg: ModelConfig) -> Embed:
  return Embed(cfg.vocab_size, cfg.d_model, embedding_init=normal_init(cfg.init_std),
               dtype=compute_dtype(cfg), name="token_embed")


def _add_learned_positions(cfg: ModelConfig, x: Array, positions: Array) -> Array:
  if cfg.position_embedding != "learned":
    return x
  table = Embed(cfg.max_position_embeddings, cfg.d_model, axes=("abs_pos", "embed"),
                embedding_init=normal_init(cfg.init_std), dtype=compute_dtype(cfg),
                name="position_embed")
  return x + table(positions)


def _logits_dense(cfg: ModelConfig, name: Optional[str] = None) -> Optional[DenseGeneral]:
  """The untied output layer [D, V], or None when logits are tied to the embedding."""
  if cfg.tie_embeddings:
    return None
  return DenseGeneral(features=(cfg.vocab_size,), axes=("embed", "vocab"), use_bias=False,
                      kernel_init=normal_init(init_std(cfg, cfg.d_model)),
                      dtype=compute_dtype(cfg), name=name)


def _output_input(cfg: ModelConfig, x: Array) -> Array:
  """The output layer's input: the final hidden states (T5 v1.0: scaled by d_model^-1/2)."""
  return x * cfg.d_model ** -0.5 if cfg.scale_decoder_output else x


def _output_logits(cfg: ModelConfig, embed: Embed, dense: Optional[DenseGeneral],
                   x: Array) -> Array:
  """[B, T, D] -> [B, T, V] through the tied embedding or the untied `dense`."""
  x = _output_input(cfg, x)
  logits = embed.attend(x) if dense is None else dense(x)
  return constrain(logits, ("batch", "length", "vocab"))


def output_layer(cfg: ModelConfig, params) -> tuple[Array, int]:
  """(the output weights, their vocabulary axis) in `params` of a decoder or
  encoder-decoder module, or of the encoder's MLM head: the tied token embedding [V, D]
  (axis 0) or the untied `logits_dense` kernel [D, V] (axis 1). For the chunked loss
  (models/chunked_loss.py), fed by the modules' `loss_hidden` output."""
  if cfg.tie_embeddings or cfg.family == "encoder":
    return params["token_embed"]["embedding"], 0
  return params["logits_dense"]["kernel"], 1


class EncoderModule(nn.Module):
  """BERT: embeddings (+type, +norm), bidirectional stack, MLM and NSP heads.

  Returns {'hidden': [B, L, D], 'mlm_logits': [B, P or L, V], 'nsp_logits': [B, 2]};
  MLM logits are computed only at `mlm_positions` when the batch has them.
  loss_hidden: 'mlm_hidden' [B, P or L, D] (the tied output layer's input; its bias is
  params['mlm_bias']) replaces 'mlm_logits', for the chunked loss.
  """

  config: ModelConfig
  deterministic: bool = True
  loss_hidden: bool = False

  @nn.compact
  def __call__(self, batch: Batch) -> dict[str, Array]:
    cfg = self.config
    dtype = compute_dtype(cfg)
    tokens = batch["encoder_input_tokens"]
    positions = _positions(batch, "encoder_positions", tokens)
    embed = _token_embed(cfg)
    x = _add_learned_positions(cfg, embed(tokens), positions)
    if cfg.type_vocab_size:
      type_ids = batch.get("encoder_type_ids")
      type_ids = jnp.zeros_like(tokens) if type_ids is None else type_ids
      x = x + Embed(cfg.type_vocab_size, cfg.d_model, axes=("types", "embed"),
                    embedding_init=normal_init(cfg.init_std), dtype=dtype,
                    name="type_embed")(type_ids)
    if cfg.embedding_norm:
      x = make_norm(cfg, "embedding_norm")(x)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=self.deterministic)
    x = constrain(x, ("batch", "length", "embed"))
    x = Stack(cfg, cfg.num_layers, causal=False, deterministic=self.deterministic,
              name="encoder")(x, _encoder_mask(batch), positions)
    out = {"hidden": x}
    if cfg.mlm_head:
      h = x
      if batch.get("mlm_positions") is not None:
        h = jnp.take_along_axis(x, batch["mlm_positions"][..., None].astype(jnp.int32), axis=1)
      h = DenseGeneral(features=(cfg.d_model,), axes=("embed", "mlp"),
                       kernel_init=normal_init(cfg.init_std), dtype=dtype,
                       name="mlm_transform")(h)
      act = "gelu" if cfg.gated_mlp else cfg.mlp_activation
      h = make_norm(cfg, "mlm_norm")(activation(act)(h))
      bias = self.param("mlm_bias", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
                        (cfg.vocab_size,), jnp.float32)
      if self.loss_hidden:
        out["mlm_hidden"] = h
      else:
        out["mlm_logits"] = embed.attend(h) + bias.astype(dtype)
    if cfg.nsp_head:
      pooled = DenseGeneral(features=(cfg.d_model,), axes=("embed", "mlp"),
                            kernel_init=normal_init(cfg.init_std), dtype=dtype,
                            name="pooler")(x[:, 0])
      out["nsp_logits"] = DenseGeneral(features=(2,), axes=("embed", None),
                                       kernel_init=normal_init(cfg.init_std), dtype=dtype,
                                       name="nsp")(jnp.tanh(pooled))
    return out


class DecoderModule(nn.Module):
  """GPT-2: causal (or prefix-LM) decoder-only LM. [B, T] tokens -> [B, T, V] logits.

  return_hidden: return the final hidden states [B, T, D] (after the final norm)
  instead of logits, for fine-tuning heads (t5x_like.finetune).
  loss_hidden: return the output layer's input [B, T, D] (output_layer gives its
  weights) instead of logits, for the chunked loss.
  """

  config: ModelConfig
  deterministic: bool = True
  decode: bool = False
  return_hidden: bool = False
  loss_hidden: bool = False

  @nn.compact
  def __call__(self, batch: Batch) -> Array:
    cfg = self.config
    tokens = batch["decoder_input_tokens"]
    decode_index, positions, mask = _decoder_positions_and_mask(self, batch)
    embed = _token_embed(cfg)
    x = _add_learned_positions(cfg, embed(tokens), positions)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=self.deterministic)
    x = constrain(x, ("batch", "length", "embed"))
    x = Stack(cfg, cfg.num_layers, causal=True, deterministic=self.deterministic,
              decode=self.decode, name="decoder")(x, mask, positions,
                                                  decode_index=decode_index)
    if self.return_hidden:
      return x
    if self.loss_hidden:
      return _output_input(cfg, x)
    return _output_logits(cfg, embed, _logits_dense(cfg, "logits_dense"), x)


class EncoderDecoderModule(nn.Module):
  """T5: shared token embedding, bidirectional encoder, causal decoder with cross-attention.

  __call__(batch) -> [B, T, V]; `encode` and `decode` are exposed for generation.
  loss_hidden: the output layer's input [B, T, D] instead of logits (chunked loss).
  """

  config: ModelConfig
  deterministic: bool = True
  decode: bool = False
  loss_hidden: bool = False

  def setup(self):
    cfg = self.config
    self.token_embed = _token_embed(cfg)
    self.encoder = Stack(cfg, cfg.num_layers, causal=False, deterministic=self.deterministic,
                         name="encoder")
    self.decoder = Stack(cfg, cfg.decoder_layers, causal=True, cross_attention=True,
                         deterministic=self.deterministic, decode=self.decode, name="decoder")
    self.dropout = nn.Dropout(cfg.dropout_rate)
    self.logits_dense = _logits_dense(cfg)

  def _embed(self, tokens: Array, positions: Array) -> Array:
    del positions  # T5 positions enter through the relative bias (or RoPE) in the stacks
    x = self.dropout(self.token_embed(tokens), deterministic=self.deterministic)
    return constrain(x, ("batch", "length", "embed"))

  def encode(self, batch: Batch) -> Array:
    """encoder_input_tokens [B, L] -> encoded [B, L, D]."""
    tokens = batch["encoder_input_tokens"]
    positions = _positions(batch, "encoder_positions", tokens)
    return self.encoder(self._embed(tokens, positions), _encoder_mask(batch), positions)

  @nn.compact  # decode=True creates cache variables here, which needs a compact method
  def decode_logits(self, encoded: Array, batch: Batch) -> Array:
    """encoded [B, L, D] and decoder_input_tokens [B, T] -> logits [B, T, V]."""
    tokens = batch["decoder_input_tokens"]
    segments = batch.get("decoder_segment_ids")
    enc_tokens = batch["encoder_input_tokens"]
    enc_segments = batch.get("encoder_segment_ids")
    decode_index, positions, mask = _decoder_positions_and_mask(self, batch)
    cross_valid = enc_tokens > 0 if enc_segments is None else enc_segments > 0
    if segments is not None and enc_segments is not None:
      cross_mask = mask_spec(cross_valid, query_segment_BxQ=segments,
                             key_segment_BxK=enc_segments)
    else:
      cross_mask = mask_spec(cross_valid, q_len=tokens.shape[1])
    x = self.decoder(self._embed(tokens, positions), mask, positions, encoded, cross_mask,
                     decode_index)
    if self.loss_hidden:
      return _output_input(self.config, x)
    return _output_logits(self.config, self.token_embed, self.logits_dense, x)

  def __call__(self, batch: Batch) -> Array:
    return self.decode_logits(self.encode(batch), batch)
