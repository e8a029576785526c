"""Task heads on a backbone's final hidden states, and their weighted losses.

  ClassificationHead       hidden [B, L, D] -> [B, C] from one position per row: BERT's
                           [CLS] through the pooler (dense + tanh, the pretrained one's
                           name and shape), or GPT's last real token
  label_metrics            cross-entropy + accuracy with weights = (labels >= 0)

(Each task type's own head lives in its file under finetune/tasks/.)

Head parameters carry logical axis names like the backbone's (`embed` in, labels
replicated), so the same sharding rules apply.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5x_like.models import losses
from t5x_like.models.layers import DenseGeneral, normal_init
from t5x_like.models.model import model_class

Array = jax.Array

POOLINGS = ("cls", "mean")


def has_pooler(model_config) -> bool:
  """Whether the family's pretraining has a [CLS] pooler a head may start from (BERT)."""
  return model_class(model_config).pretrained_pooler


class ClassificationHead(nn.Module):
  """[B, L, D] -> [B, C] logits from position `index_B` (default 0, [CLS]), or with
  pooling="mean" from the mean over the real tokens (valid_BxL).

  pooler: BERT's pooler first (dense D -> D named 'pooler', tanh), as
  BertForSequenceClassification; then dropout and a dense D -> C named 'classifier'.
  """

  num_labels: int
  pooler: bool = True
  pooling: str = "cls"
  dropout_rate: float = 0.1
  init_std: float = 0.02
  dtype: jnp.dtype = jnp.float32
  deterministic: bool = True

  @nn.compact
  def __call__(self, hidden_BxLxD: Array, index_B: Optional[Array] = None,
               valid_BxL: Optional[Array] = None) -> Array:
    if self.pooling not in POOLINGS:
      raise ValueError(f"pooling={self.pooling!r}: expected one of {POOLINGS}")
    if self.pooling == "mean":
      weights_BxL = valid_BxL.astype(jnp.float32)
      x_BxD = (jnp.einsum("bld,bl->bd", hidden_BxLxD.astype(jnp.float32), weights_BxL)
               / jnp.maximum(jnp.sum(weights_BxL, axis=1, keepdims=True), 1.0)
               ).astype(hidden_BxLxD.dtype)
    elif index_B is None:
      x_BxD = hidden_BxLxD[:, 0]
    else:
      x_BxD = jnp.take_along_axis(hidden_BxLxD, index_B[:, None, None].astype(jnp.int32),
                                  axis=1)[:, 0]
    if self.pooler:
      x_BxD = jnp.tanh(DenseGeneral(features=(hidden_BxLxD.shape[-1],), axes=("embed", "mlp"),
                                    kernel_init=normal_init(self.init_std), dtype=self.dtype,
                                    name="pooler")(x_BxD))
    x_BxD = nn.Dropout(self.dropout_rate)(x_BxD, deterministic=self.deterministic)
    logits_BxC = DenseGeneral(features=(self.num_labels,), axes=("embed", None),
                              kernel_init=normal_init(self.init_std), dtype=self.dtype,
                              name="classifier")(x_BxD)
    return logits_BxC.astype(jnp.float32)


# ------------------------------------------------------------------ losses
def label_weights(labels: Array) -> Array:
  """1.0 where a label is given (>= 0), 0.0 for -1 (ignored positions, padding rows)."""
  return (labels >= 0).astype(jnp.float32)


def label_normalizer(labels: Array) -> Array:
  """The loss denominator over a batch: the number of labels given (at least 1)."""
  return jnp.maximum(jnp.sum(label_weights(labels)), 1.0)


def label_metrics(prefix: str, logits: Array, labels: Array, denominator: Array,
                  z_loss: float = 0.0, label_smoothing: float = 0.0) -> dict[str, Array]:
  """<prefix>_loss, _z_loss (with z_loss), _accuracy (sums over labels >= 0 / denominator) and
  <prefix>_tokens (labels counted). logits [..., C], labels [...] int, -1 = ignore."""
  safe = jnp.maximum(labels, 0).astype(jnp.int32)
  per_label, z_term = losses.cross_entropy(logits, safe, z_loss=z_loss,
                                           label_smoothing=label_smoothing)
  return losses.token_metrics(prefix, logits, safe, label_weights(labels), per_label,
                              z_term if z_loss else None, denominator)
