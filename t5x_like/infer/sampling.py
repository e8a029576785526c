"""Choosing the next token from logits: greedy, or sampling with temperature / top-k / top-p.

The filters follow Hugging Face's logits warpers (temperature, then top-k, then top-p):
a filtered-out token gets -inf and can never be drawn.
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp

Array = jax.Array

NEG_INF = -jnp.inf


def top_k_filter(logits_BxV: Array, top_k: int) -> Array:
  """Keeps the top_k largest logits of each row (ties at the k-th value are kept too)."""
  if not top_k or top_k >= logits_BxV.shape[-1]:
    return logits_BxV
  kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][..., -1:]
  return jnp.where(logits_BxV < kth_Bx1, NEG_INF, logits_BxV)


def top_p_filter(logits_BxV: Array, top_p: float) -> Array:
  """Nucleus filter: keeps the smallest set of most likely tokens whose mass reaches top_p.

  A token is dropped when the tokens ranked above it already hold >= top_p of the
  probability, so the most likely token is always kept (HF's min_tokens_to_keep=1).
  """
  if top_p is None or top_p >= 1.0:
    return logits_BxV
  sorted_BxV = jnp.sort(logits_BxV, axis=-1)[..., ::-1]
  probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
  mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
  keep_count_B = jnp.maximum(jnp.sum(mass_before_BxV < top_p, axis=-1), 1)
  threshold_Bx1 = jnp.take_along_axis(sorted_BxV, keep_count_B[:, None] - 1, axis=-1)
  return jnp.where(logits_BxV < threshold_Bx1, NEG_INF, logits_BxV)


def process_logits(logits_BxV: Array, *, temperature: Union[float, Array] = 1.0, top_k: int = 0,
                   top_p: float = 1.0) -> Array:
  """float32 logits divided by temperature, then top-k and top-p filtered."""
  logits_BxV = logits_BxV.astype(jnp.float32) / temperature
  return top_p_filter(top_k_filter(logits_BxV, top_k), top_p)


def choose_token(logits_BxV: Array, rng: Optional[Array], *,
                 temperature: Union[float, Array] = 1.0, top_k: int = 0,
                 top_p: float = 1.0) -> Array:
  """Next token ids [B]: argmax when rng is None or temperature == 0, else a sample.

  temperature may be a traced scalar; top_k and top_p are static (they shape the work).
  """
  greedy_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  if rng is None:
    return greedy_B
  temperature = jnp.asarray(temperature, jnp.float32)
  filtered_BxV = process_logits(logits_BxV, temperature=jnp.maximum(temperature, 1e-30),
                                top_k=top_k, top_p=top_p)
  sampled_B = jax.random.categorical(rng, filtered_BxV, axis=-1).astype(jnp.int32)
  return jnp.where(temperature > 0.0, sampled_B, greedy_B)
