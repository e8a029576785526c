"""Classification of a text (or a text pair) into one of the train file's labels.

  encoder (BERT)          [CLS] a [SEP] (b [SEP]); pooled [CLS] (or mean pooling) -> C
  decoder (GPT)           a (eos b) eos; the last real token -> C
  encoder_decoder (T5)    text to text: "prefix: a (pair: b)" -> the label string + eos;
                          the label is generated and matched, and also ranked by
                          likelihood (FinetuneModel's text-to-text path); or, with
                          text_to_text=False, the encoder alone reads "prefix: a (pair:
                          b)" + eos and a head classifies its pooled states (EncT5,
                          Liu et al. 2021); the decoder is not used
Metrics: accuracy and macro F1 in percent (text to text: of the generated labels, and
rank_* of the ranked ones).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from t5x_like.finetune import encoding, heads
from t5x_like.finetune import metrics as metrics_lib
from t5x_like.finetune.task import Example, Task, label_index
from t5x_like.models.config import FAMILIES
from t5x_like.models.layers import compute_dtype


@dataclasses.dataclass(frozen=True)
class Classification(Task):
  """Options: pooler (BERT's pooler first), pooling ('cls': [CLS] / the last token;
  'mean'), and for T5 text_to_text, task_prefix and (text to text) target_length."""

  name: ClassVar[str] = "classification"
  # Every family: a head on its pair encoding, or text to text where it has none.
  families: ClassVar[tuple[str, ...]] = FAMILIES

  pooler: bool = True  # BERT classification through the pooler
  pooling: str = "cls"  # classification reads [CLS] (GPT: the last token) | mean
  target_length: int = 8  # text to text: label tokens + eos
  task_prefix: str = "classify"  # T5: "classify: <text>"
  # T5: generate the label string (True), or a head on the encoder's pooled states
  # (False: the encoder alone, EncT5; pooling="mean" is the one that reads every token)
  text_to_text: bool = True

  def __post_init__(self):
    super().__post_init__()
    if self.pooling not in heads.POOLINGS:
      raise ValueError(f"pooling={self.pooling!r}: expected one of {heads.POOLINGS}")

  def parse(self, record, line, lookup, labels) -> Example:
    text, pair = self.texts(record)
    (label,) = self.row_labels(record)
    return Example(text, pair, label=label_index(label, lookup, labels), line=line)

  def encode(self, example, tokenizer, family, label_names):
    if family in encoding.PAIR_ENCODINGS:
      features, cut = encoding.encode_pair(tokenizer, example, family, self.max_length)
    elif self.text_to_text:
      return encoding.encode_text_to_text(tokenizer, example, label_names, self.max_length,
                                          self.target_length, self.task_prefix)
    else:  # T5's encoder alone
      features, cut = encoding.encode_t5_inputs(tokenizer, example, self.max_length,
                                                self.task_prefix)
    features["labels"] = np.int32(example.label)
    return features, cut

  def label_targets(self, tokenizer, label_names) -> np.ndarray:
    """[C, T] each label string's tokens + eos (text to text)."""
    return encoding.label_targets(tokenizer, label_names, self.target_length)

  def head(self, model_config, num_labels, deterministic):
    return heads.ClassificationHead(
        num_labels, pooler=self.pooler and heads.has_pooler(model_config),
        pooling=self.pooling, dropout_rate=self.dropout_rate(model_config),
        init_std=model_config.init_std, dtype=compute_dtype(model_config),
        deterministic=deterministic)

  def forward(self, head, hidden_BxLxD, valid_BxL, summary_index_B, batch):
    return head(hidden_BxLxD, summary_index_B, valid_BxL)  # [B, C]

  def loss(self, out, batch, normalizers, model_config):
    metrics = heads.label_metrics("classification", out, batch["labels"],
                                  normalizers["labels"], z_loss=model_config.z_loss,
                                  label_smoothing=model_config.label_smoothing)
    metrics["loss"] = metrics["classification_loss"]
    return metrics

  def predict(self, out, batch):
    return jnp.argmax(out, axis=-1).astype(jnp.int32)  # [B]

  def metrics(self, predictions, features, dataset):
    return metrics_lib.label_scores(predictions, features["labels"])

  def prediction_row(self, k, example, predictions, features, dataset):
    predicted = int(predictions[k])
    return {"label": dataset.labels[example.label],
            "prediction": dataset.labels[predicted] if predicted >= 0 else None}


TASK = Classification
