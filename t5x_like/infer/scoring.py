"""score(): log-likelihood of given targets from one full forward (no cache).

  score(model, params, batch) -> {'token_log_likelihood': [B, T], 'log_likelihood': [B]}

batch: the training layout of the decoder-only and encoder-decoder families
(decoder_input_tokens = targets shifted right, decoder_target_tokens; T5 also
encoder_input_tokens). Which targets count: decoder_loss_weights when given, else
decoder_segment_ids > 0, else all of them. token_log_likelihood is
log_softmax(logits)[target] * weight; log_likelihood sums it per example.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from t5x_like import parallel
from t5x_like.infer.sharding import hashable_rules

Array = jax.Array


def target_weights(batch: Mapping[str, Array]) -> Array:
  """[B, T] float32 weights of decoder_target_tokens (see the module docstring)."""
  targets = batch["decoder_target_tokens"]
  if batch.get("decoder_loss_weights") is not None:
    return jnp.asarray(batch["decoder_loss_weights"], jnp.float32)
  if batch.get("decoder_segment_ids") is not None:
    return (jnp.asarray(batch["decoder_segment_ids"]) > 0).astype(jnp.float32)
  return jnp.ones(targets.shape, jnp.float32)


def token_log_likelihood(logits_BxTxV: Array, targets_BxT: Array) -> Array:
  """log_softmax(logits)[target], float32 [B, T]."""
  log_probs_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(log_probs_BxTxV, targets_BxT[..., None].astype(jnp.int32),
                             axis=-1)[..., 0]


@functools.partial(jax.jit, static_argnames=("model", "mesh", "rules"))
def _score(model, params, batch, *, mesh, rules) -> dict[str, Array]:
  with parallel.traced_rules(mesh, rules):
    forward = {k: v for k, v in batch.items()
               if k not in ("decoder_target_tokens", "decoder_loss_weights")}
    logits_BxTxV = model.logits(params, forward)
    per_token_BxT = (token_log_likelihood(logits_BxTxV, batch["decoder_target_tokens"])
                     * target_weights(batch))
    return {"token_log_likelihood": per_token_BxT,
            "log_likelihood": jnp.sum(per_token_BxT, axis=-1)}


def score(model, params: Any, batch: Mapping[str, Array], *, mesh: Optional[Mesh] = None,
          rules=parallel.DEFAULT_RULES) -> dict[str, Array]:
  """Log-likelihood of batch['decoder_target_tokens'], per token [B, T] and summed [B]."""
  if not model.scores:
    raise ValueError(f"model family {model.config.family!r} does not score sequences")
  features = {k: jnp.asarray(v) for k, v in batch.items() if v is not None}
  return _score(model, params, features, mesh=mesh, rules=hashable_rules(rules))
