"""Losses and metrics: weighted token cross-entropy with z-loss and label smoothing."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array


def cross_entropy(logits: Array, targets: Array, *, z_loss: float = 0.0,
                  label_smoothing: float = 0.0) -> tuple[Array, Array]:
  """Per-token loss and z-loss term, both [...] float32.

  logits [..., V], integer targets [...]. With label smoothing eps the target
  distribution is 1 - eps on the target and eps / (V - 1) on every other id, and the
  loss is shifted by that distribution's entropy so that a perfect model scores 0
  (as T5X).
  z_loss adds z_loss * log(Z)^2 to keep the softmax normaliser near 1.
  """
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  log_z = jax.nn.logsumexp(logits, axis=-1)
  log_probs = logits - log_z[..., None]
  target_logp = jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32), -1)[..., 0]
  if label_smoothing > 0.0:
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab - 1)
    entropy = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20))
    off_target = jnp.sum(log_probs, axis=-1) - target_logp
    loss = -(confidence * target_logp + low * off_target) - entropy
  else:
    loss = -target_logp
  z_term = z_loss * jnp.square(log_z)
  return loss + z_term, z_term


def token_metrics(prefix: str, logits: Array, targets: Array, weights: Optional[Array],
                  loss: Array, z_term: Optional[Array], denominator: Array
                  ) -> dict[str, Array]:
  """<prefix>_loss, _z_loss (unless z_term is None: no z-loss configured), _accuracy as
  sum(w * value) / denominator, and the <prefix>_tokens count sum(w). A shared
  denominator lets microbatches add up."""
  w = jnp.ones(targets.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  metrics = {f"{prefix}_loss": jnp.sum(loss * w) / denominator}
  if z_term is not None:
    metrics[f"{prefix}_z_loss"] = jnp.sum(z_term * w) / denominator
  metrics[f"{prefix}_accuracy"] = jnp.sum(correct * w) / denominator
  metrics[f"{prefix}_tokens"] = jnp.sum(w)
  return metrics
