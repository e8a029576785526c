"""Text generation, text to text (T5): the target is free text, e.g. SQuAD's answer.

  "question: Who wrote it? context: ..." -> "Mary Shelley" + eos

Rows: the input text (text column; a benchmark writes the whole T5 input there) and the
target text (label column; empty, with allow_no_answer, makes the target eos alone:
SQuAD 2.0's "no answer"). Training is the encoder-decoder loss on the target
(FinetuneModel's text-to-text path, no head); evaluation generates greedily up to
target_length tokens and scores the text with SQuAD's exact match and token F1 against
every gold answer (dataset.golds when the rows carry several, else the row's target;
evaluate-v2.0.py's rules with allow_no_answer, else v1.1's).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from t5x_like.finetune import encoding
from t5x_like.finetune import metrics as metrics_lib
from t5x_like.finetune.task import BadRow, Example, Task, field


@dataclasses.dataclass(frozen=True)
class TextGeneration(Task):
  """Options: target_length (target tokens + eos; longer targets are cut, and counted)."""

  name: ClassVar[str] = "text_generation"
  families: ClassVar[tuple[str, ...]] = ("encoder_decoder",)
  uses_label_list: ClassVar[bool] = False
  generates_text: ClassVar[bool] = True
  label_features: ClassVar[tuple[str, ...]] = ()
  encode_flag: ClassVar[str] = "truncated"

  target_length: int = 8
  allow_no_answer: bool = False  # an empty target allowed; scored by evaluate-v2.0.py

  def row_labels(self, record):
    return []

  def parse(self, record, line, lookup, labels) -> Example:
    text, _ = self.texts(record)
    target = field(record, self.label_column)
    if not isinstance(target, str):
      raise BadRow("bad_value", f"column {self.label_column!r} is not a string: {target!r}")
    if not target.strip() and not self.allow_no_answer:
      raise BadRow("no_answer", f"column {self.label_column!r} is empty: an empty target"
                   " (no answer) needs config.task.allow_no_answer=true (SQuAD 2.0)")
    return Example(text, label=target.strip(), line=line)

  def encode(self, example, tokenizer, family, label_names):
    if tokenizer.eos_id is None:
      raise ValueError(f"{tokenizer!r} has no eos: text to text needs a T5 vocabulary")
    ids = tokenizer.encode(example.text)
    target = tokenizer.encode(example.label) if example.label else []
    cut = len(ids) > self.max_length - 1 or len(target) > self.target_length - 1
    ids = ids[:self.max_length - 1] + [tokenizer.eos_id]
    targets = encoding.pad(target[:self.target_length - 1] + [tokenizer.eos_id],
                           self.target_length)
    return {"encoder_input_tokens": encoding.pad(ids, self.max_length),
            "decoder_input_tokens": np.concatenate([[0], targets[:-1]]).astype(np.int32),
            "decoder_target_tokens": targets,
            "decoder_loss_weights": (targets > 0).astype(np.int32)}, cut

  # The model's own encoder-decoder loss trains it (FinetuneModel, text to text): there
  # is no head, so these are never called for the one family this task has.
  def head(self, model_config, num_labels, deterministic):
    return None

  def forward(self, head, hidden_BxLxD, valid_BxL, summary_index_B, batch):
    raise TypeError("text_generation has no head: FinetuneModel trains it text to text")

  def loss(self, out, batch, normalizers, model_config):
    raise TypeError("text_generation has no head: FinetuneModel trains it text to text")

  def predict(self, out, batch):
    raise TypeError("text_generation predicts by generation (finetune/evaluate.Predictor)")

  def metrics(self, predictions, features, dataset):
    golds = dataset.golds or [example.label for example in dataset.examples]
    return metrics_lib.squad_scores(list(predictions), golds,
                                    "v2.0" if self.allow_no_answer else "v1.1")

  def prediction_row(self, k, example, predictions, features, dataset):
    return {"answer": example.label, "prediction": predictions[k]}


TASK = TextGeneration
