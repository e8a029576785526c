"""Token classification (tagging, e.g. named entities): one label per word.

Rows: `text` (whitespace-separated words) and a label column with one tag per word
(JSONL: a list of strings or one space-separated string; CSV: space-separated).
Encoder only: [CLS] words [SEP]; labels [B, L] = the word's tag on its first
sub-token, -1 elsewhere (weight 0). Head: dropout and a dense D -> C per position.
Metrics: accuracy and macro F1 (percent) over the first sub-token of each word.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.finetune import heads
from t5x_like.finetune import metrics as metrics_lib
from t5x_like.finetune.encoding import check_encoder_tokenizer, pad
from t5x_like.finetune.task import BadRow, Example, Task, field, label_index, label_string
from t5x_like.models.layers import DenseGeneral, compute_dtype, normal_init

Array = jax.Array


class TokenClassificationHead(nn.Module):
  """[B, L, D] -> [B, L, C]: dropout, then a dense D -> C named 'classifier'."""

  num_labels: int
  dropout_rate: float = 0.1
  init_std: float = 0.02
  dtype: jnp.dtype = jnp.float32
  deterministic: bool = True

  @nn.compact
  def __call__(self, hidden_BxLxD: Array) -> Array:
    x = nn.Dropout(self.dropout_rate)(hidden_BxLxD, deterministic=self.deterministic)
    logits = DenseGeneral(features=(self.num_labels,), axes=("embed", None),
                          kernel_init=normal_init(self.init_std), dtype=self.dtype,
                          name="classifier")(x)
    return logits.astype(jnp.float32)


def encode_token_classification(tokenizer, example: Example, max_length: int):
  """encoder_input_tokens, encoder_type_ids, labels [L]: each word's tag on its first
  sub-token, -1 elsewhere; words cut by max_length lose their tags. And whether any
  word was cut."""
  check_encoder_tokenizer(tokenizer)
  tokens, labels = [tokenizer.cls_id], [-1]
  pieces = tokenizer.encode_words(example.words)
  budget = max_length - 1  # room for [SEP]
  truncated = False
  for word_ids, tag in zip(pieces, example.tags):
    if len(tokens) >= budget:
      truncated = True
      break
    word_ids = word_ids[:budget - len(tokens)]
    tokens += word_ids
    labels += [tag] + [-1] * (len(word_ids) - 1)
  tokens.append(tokenizer.sep_id)
  labels.append(-1)
  return {"encoder_input_tokens": pad(tokens, max_length),
          "encoder_type_ids": np.zeros(max_length, np.int32),
          "labels": pad(labels, max_length, -1)}, truncated


@dataclasses.dataclass(frozen=True)
class TokenClassification(Task):
  name: ClassVar[str] = "token_classification"
  cuts_padding: ClassVar[bool] = False  # outputs per position

  def row_labels(self, record):
    value = field(record, self.label_column)
    if isinstance(value, str):
      return value.split()
    if isinstance(value, list):
      return [label_string(v, self.label_column) for v in value]
    raise BadRow("bad_value", f"column {self.label_column!r}: tags must be a list or a string")

  def parse(self, record, line, lookup, labels):
    text, pair = self.texts(record)
    tags = self.row_labels(record)
    if len(tags) != len(text.split()):
      raise BadRow("bad_value", f"{len(tags)} tags for {len(text.split())} words")
    return Example(text, pair, tags=tuple(label_index(t, lookup, labels) for t in tags),
                   line=line)

  def encode(self, example, tokenizer, family, label_names):
    return encode_token_classification(tokenizer, example, self.max_length)

  def head(self, model_config, num_labels, deterministic):
    return TokenClassificationHead(num_labels, dropout_rate=self.dropout_rate(model_config),
                                   init_std=model_config.init_std,
                                   dtype=compute_dtype(model_config),
                                   deterministic=deterministic)

  def forward(self, head, hidden_BxLxD, valid_BxL, summary_index_B, batch):
    return head(hidden_BxLxD)  # [B, L, C]

  def loss(self, out, batch, normalizers, model_config):
    metrics = heads.label_metrics("tagging", out, batch["labels"], normalizers["labels"],
                                  z_loss=model_config.z_loss,
                                  label_smoothing=model_config.label_smoothing)
    metrics["loss"] = metrics["tagging_loss"]
    return metrics

  def predict(self, out, batch):
    return jnp.argmax(out, axis=-1).astype(jnp.int32)  # [B, L]

  def metrics(self, predictions, features, dataset):
    return metrics_lib.label_scores(predictions, features["labels"])

  def prediction_row(self, k, example, predictions, features, dataset):
    keep = features["labels"][k] >= 0
    return {"tags": [dataset.labels[t] for t in features["labels"][k][keep]],
            "prediction": [dataset.labels[t] for t in predictions[k][keep]]}


TASK = TokenClassification
