"""Regression: a real-valued score for a text or a text pair (e.g. GLUE's STS-B, a
0-5 similarity), as BertForSequenceClassification with num_labels=1.

Rows: the text (and text pair) columns and a numeric label column. Encoder: pooled
[CLS] (or mean pooling) -> one value; decoder: the last real token -> one value.
Loss: mean squared error. Metrics: Pearson and Spearman correlation (x 100, as GLUE
reports them) and the MSE.

This file is the whole task type (the README's worked example of a new one): rows,
encoding, head, loss, predictions and metrics; the registry finds it by its TASK.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from t5x_like.finetune import encoding, heads
from t5x_like.finetune import metrics as metrics_lib
from t5x_like.finetune.task import BadRow, Example, Task, field
from t5x_like.models.layers import compute_dtype


def _score(value, column: str) -> float:
  try:
    score = float(value)
  except (TypeError, ValueError):
    raise BadRow("bad_value", f"column {column!r} is not a number: {value!r}") from None
  if isinstance(value, bool) or not math.isfinite(score):
    raise BadRow("bad_value", f"column {column!r} is not a finite number: {value!r}")
  return score


@dataclasses.dataclass(frozen=True)
class Regression(Task):
  """Options: pooler and pooling, as classification's."""

  name: ClassVar[str] = "regression"
  families: ClassVar[tuple[str, ...]] = tuple(encoding.PAIR_ENCODINGS)  # a head: no text to text
  uses_label_list: ClassVar[bool] = False

  pooler: bool = True
  pooling: str = "cls"

  def row_labels(self, record):
    return []

  def parse(self, record, line, lookup, labels) -> Example:
    text, pair = self.texts(record)
    score = _score(field(record, self.label_column), self.label_column)
    return Example(text, pair, label=score, line=line)

  def encode(self, example, tokenizer, family, label_names):
    features, cut = encoding.encode_pair(tokenizer, example, family, self.max_length)
    features["labels"] = np.float32(example.label)
    return features, cut

  def head(self, model_config, num_labels, deterministic):
    return heads.ClassificationHead(
        1, pooler=self.pooler and heads.has_pooler(model_config), pooling=self.pooling,
        dropout_rate=self.dropout_rate(model_config), init_std=model_config.init_std,
        dtype=compute_dtype(model_config), deterministic=deterministic)

  def forward(self, head, hidden_BxLxD, valid_BxL, summary_index_B, batch):
    return head(hidden_BxLxD, summary_index_B, valid_BxL)[:, 0]  # [B]

  def normalizers(self, batch):
    return {"rows": jnp.asarray(batch["labels"].shape[0], jnp.float32)}

  def loss(self, out_B, batch, normalizers, model_config):
    squared_B = jnp.square(out_B - batch["labels"].astype(jnp.float32))
    mse = jnp.sum(squared_B) / normalizers["rows"]
    return {"loss": mse, "regression_mse": mse}

  def predict(self, out_B, batch):
    return out_B  # [B] scores

  def metrics(self, predictions, features, dataset):
    predicted = np.asarray(predictions, np.float64)
    gold = np.asarray(features["labels"], np.float64)
    return {"pearson": 100.0 * metrics_lib.pearson(predicted, gold),
            "spearman": 100.0 * metrics_lib.spearman(predicted, gold),
            "mse": float(np.mean(np.square(predicted - gold)))}

  def prediction_row(self, k, example, predictions, features, dataset):
    return {"label": example.label, "prediction": float(predictions[k])}


TASK = Regression
