"""Forward matmul FLOPs of the building blocks, which each model family's class composes
(`forward_flops_breakdown`). Conventions: t5x_like/train/flops.py (PaLM / MaxText MFU:
a multiply-add is 2 FLOPs, only matmuls count, at the shapes they run)."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from t5x_like.models.config import ModelConfig

Breakdown = dict[str, float]


def batch_length(batch_shapes: Mapping[str, Any], name: str) -> tuple[int, int]:
  """(batch, length) of feature `name`, given as a shape tuple or an array; KeyError
  when the batch lacks it."""
  value = batch_shapes[name]
  shape = tuple(value) if isinstance(value, (tuple, list)) else np.shape(value)
  return int(shape[0]), int(shape[1])


def attention(cfg: ModelConfig, tokens_q: int, tokens_kv: int, len_kv: int) -> Breakdown:
  """One attention layer: `tokens_q` = B*Tq query tokens, each over `len_kv` keys."""
  d, n, k, h = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head
  return {
      "qo_proj": 2.0 * 2 * tokens_q * d * n * h,  # query and output projections
      "kv_proj": 2.0 * 2 * tokens_kv * d * k * h,
      "attention": 2.0 * 2 * tokens_q * len_kv * n * h,  # QK^T and PV
  }


def mlp(cfg: ModelConfig, tokens: int) -> float:
  matrices = 3 if cfg.gated_mlp else 2
  return 2.0 * matrices * tokens * cfg.d_model * cfg.d_ff


def add(total: Breakdown, part: Breakdown, times: int = 1) -> Breakdown:
  for key, value in part.items():
    total[key] = total.get(key, 0.0) + times * value
  return total


def encoder_stack(cfg: ModelConfig, batch: int, length: int) -> Breakdown:
  """cfg.num_layers bidirectional layers over [batch, length]."""
  tokens = batch * length
  out = add({}, attention(cfg, tokens, tokens, length), cfg.num_layers)
  return add(out, {"mlp": mlp(cfg, tokens)}, cfg.num_layers)


def decoder_stack(cfg: ModelConfig, batch: int, length: int, layers: int,
                  encoder_length: int = 0) -> Breakdown:
  """`layers` causal layers over [batch, length] (full square), with cross-attention
  over `encoder_length` positions when it is > 0, and the output logits."""
  tokens = batch * length
  out = add({}, attention(cfg, tokens, tokens, length), layers)
  if encoder_length:
    add(out, attention(cfg, tokens, batch * encoder_length, encoder_length), layers)
  add(out, {"mlp": mlp(cfg, tokens)}, layers)
  out["logits"] = 2.0 * tokens * cfg.d_model * cfg.vocab_size
  return out
