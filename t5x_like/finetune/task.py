"""The fine-tuning task interface: one task type, one object, one file.

A task type is a frozen dataclass subclass of Task. Its fields are its options: the
generic ones below (columns, labels, lengths) and any it adds, which become keys of
config.task (finetune/defaults.py collects every registered task's fields). It says,
for one row of a CSV / JSONL file, how to

  parse it      required_columns, row_labels, parse      -> Example (or BadRow)
  encode it     encode(example, tokenizer, family, ...)  -> fixed-length features
  train on it   head, forward, normalizers, loss         (FinetuneModel calls them)
  evaluate it   predict, metrics, prediction_row(s)      (finetune/evaluate.py)

A task that lists the "encoder_decoder" family fine-tunes T5 text to text: its encode
writes the label string as decoder targets and it defines label_targets(tokenizer,
label_names) -> [C, T] (see tasks/classification.py); FinetuneModel then uses the
encoder-decoder loss instead of a head.

Put the file in t5x_like/finetune/tasks/ with a module-level `TASK = YourTask`: the
registry (tasks/__init__.py) finds it, and `config.task.name` selects it.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Optional, Sequence, Union

import flax.linen as nn
import jax
import numpy as np

from t5x_like.finetune import heads, padding

Array = jax.Array
Features = dict[str, np.ndarray]


BATCH_PADDINGS = ("longest", "max_length")


class BadRow(Exception):
  """A row the task cannot use: `reason` (a counter name) and `problem` (a sentence)."""

  def __init__(self, reason: str, problem: str):
    super().__init__(problem)
    self.reason, self.problem = reason, problem


@dataclasses.dataclass(frozen=True)
class Example:
  """One row. label: the task's target (a class index, a score); tags: one label index
  per word of `text` (token classification); answer_*: the answer in text_pair (span
  extraction, answer_start -1 when there is none). line: where the row starts in its
  file."""

  text: str
  text_pair: Optional[str] = None
  label: Any = None
  tags: Optional[tuple[int, ...]] = None
  answer_text: Optional[str] = None
  answer_start: Optional[int] = None
  line: int = 0

  @property
  def words(self) -> list[str]:
    return self.text.split()


# ------------------------------------------------------------------ row fields
def field(record: dict, column: str) -> Any:
  if column not in record or record[column] is None:
    raise BadRow("missing_column", f"column {column!r} is missing")
  return record[column]


def text_field(record: dict, column: str) -> str:
  value = field(record, column)
  if not isinstance(value, str):
    raise BadRow("bad_value", f"column {column!r} is not a string: {value!r}")
  if not value.strip():
    raise BadRow("empty_text", f"column {column!r} is empty")
  return value


def label_string(value: Any, column: str) -> str:
  if isinstance(value, bool) or not isinstance(value, (str, int)):
    raise BadRow("bad_value", f"column {column!r}: a label must be a string, got {value!r}")
  value = str(value).strip()
  if not value:
    raise BadRow("missing_column", f"column {column!r} is empty")
  return value


def label_index(label: str, lookup: dict[str, int], labels: Sequence[str]) -> int:
  if label not in lookup:
    shown = list(labels[:20]) + (["..."] if len(labels) > 20 else [])
    raise BadRow("unknown_label", f"label {label!r} is not in the label list {shown}")
  return lookup[label]


# ------------------------------------------------------------------ the interface
@dataclasses.dataclass(frozen=True)
class Task(abc.ABC):
  """One fine-tuning task type and its options (see the module docstring); a subclass
  implements the abstract methods."""

  name: ClassVar[str] = ""
  families: ClassVar[tuple[str, ...]] = ("encoder",)  # backbone families it encodes for
  uses_label_list: ClassVar[bool] = True  # labels are names mapped to indices
  generates_text: ClassVar[bool] = False  # text to text with free-text targets
  label_features: ClassVar[tuple[str, ...]] = ("labels",)  # targets, not model inputs
  host_features: ClassVar[tuple[str, ...]] = ()  # evaluation only: kept out of training
  encode_flag: ClassVar[str] = "truncated"  # the stat `encode`'s flag counts
  # False: outputs per position (tags, spans), so batches keep max_length positions
  cuts_padding: ClassVar[bool] = True

  text_column: str = "text"
  text_pair_column: str = ""  # "" = single texts
  label_column: str = "label"
  labels: tuple = ()  # () = every label of the train file, sorted
  skip_bad_rows: bool = False  # True: skip and count bad rows instead of stopping
  max_length: int = 128  # encoder / decoder input tokens
  # longest: each batch cut to its longest row, rounded up to a power of two (at least
  # 8; what the rows leave unused is padding) | max_length: max_length every batch
  batch_padding: str = "longest"
  classifier_dropout: float = -1.0  # -1 = the model's dropout_rate

  def __post_init__(self):
    object.__setattr__(self, "labels", tuple(self.labels or ()))
    if self.batch_padding not in BATCH_PADDINGS:
      raise ValueError(f"batch_padding={self.batch_padding!r}: expected one of"
                       f" {', '.join(BATCH_PADDINGS)}")

  def padding_groups(self) -> tuple:
    """The feature groups a batch's unused padding is cut from (padding.CUT_GROUPS), or
    () when every batch keeps max_length positions."""
    return padding.CUT_GROUPS if self.cuts_padding and self.batch_padding == "longest" else ()

  # ---------------------------------------------------------------- rows
  def check_files_options(self) -> None:
    """ValueError when the options cannot read a file (e.g. a required column unset)."""

  def required_columns(self) -> list[str]:
    return [self.text_column] + ([self.text_pair_column] if self.text_pair_column else []) + [
        self.label_column]

  def texts(self, record: dict) -> tuple[str, Optional[str]]:
    """The row's text and text pair (None without a pair column); BadRow if unusable."""
    pair = text_field(record, self.text_pair_column) if self.text_pair_column else None
    return text_field(record, self.text_column), pair

  def row_labels(self, record: dict) -> list[str]:
    """The label strings of a row, collected into the label list (uses_label_list)."""
    return [label_string(field(record, self.label_column), self.label_column)]

  @abc.abstractmethod
  def parse(self, record: dict, line: int, lookup: dict[str, int],
            labels: Sequence[str]) -> Example:
    """An Example, or BadRow naming what is wrong."""

  # ---------------------------------------------------------------- features
  @abc.abstractmethod
  def encode(self, example: Example, tokenizer, family: str, label_names: Sequence[str]
             ) -> tuple[Union[Features, list[Features]], bool]:
    """Fixed-length features of one example (or of each of its rows: a task whose
    example spans several rows, e.g. span extraction's windows, lists them and names
    "example_index" in host_features), and whether anything was cut (encode_flag)."""

  def encode_for_training(self, example: Example, tokenizer, family: str,
                          label_names: Sequence[str]
                          ) -> tuple[Union[Features, list[Features]], bool]:
    """encode for the training split (a task whose training rows may depend on the
    label, e.g. a window around an answer, says so here; evaluation uses encode)."""
    return self.encode(example, tokenizer, family, label_names)

  # ---------------------------------------------------------------- model
  def dropout_rate(self, model_config) -> float:
    return model_config.dropout_rate if self.classifier_dropout < 0 else self.classifier_dropout

  @abc.abstractmethod
  def head(self, model_config, num_labels: int, deterministic: bool) -> nn.Module:
    """The head module (built inside FinetuneModule.setup)."""

  @abc.abstractmethod
  def forward(self, head: nn.Module, hidden_BxLxD: Array, valid_BxL: Array,
              summary_index_B: Optional[Array], batch) -> Any:
    """The head's output on the backbone's final hidden states (logits)."""

  def normalizers(self, batch) -> dict[str, Array]:
    """Loss denominators over the full batch (microbatches share them)."""
    return {"labels": heads.label_normalizer(batch["labels"])}

  @abc.abstractmethod
  def loss(self, out, batch, normalizers, model_config) -> dict[str, Array]:
    """Metrics with 'loss' (the value to minimise)."""

  @abc.abstractmethod
  def predict(self, out, batch) -> Any:
    """Predictions of one batch (arrays, jitted)."""

  # ---------------------------------------------------------------- evaluation
  @abc.abstractmethod
  def metrics(self, predictions, features: Features, dataset) -> dict[str, float]:
    """Dev metrics of every dev row's predictions (host side)."""

  @abc.abstractmethod
  def prediction_row(self, k: int, example: Example, predictions, features: Features,
                     dataset) -> dict:
    """What dev_predictions.jsonl says about dev example k, besides its line."""

  def prediction_rows(self, predictions, features: Features, dataset) -> list[dict]:
    """prediction_row of every example of dataset (a task whose examples span several
    rows answers them all at once)."""
    return [self.prediction_row(k, example, predictions, features, dataset)
            for k, example in enumerate(dataset.examples)]
