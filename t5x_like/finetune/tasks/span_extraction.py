"""Span extraction (SQuAD-style reading comprehension): the answer's span in a context.

Rows: the question (text column), the context (text_pair_column, required), the answer
text and its start (a character offset into the context; an empty answer means "no
answer"). Encoder only: [CLS] question [SEP] context [SEP]; start_positions /
end_positions [B] = the answer's first / last token, 0 ([CLS]) when there is no answer
or truncation cut it; context_offsets [B, L, 2] = each context token's character span
(-1 elsewhere; evaluation only). Head: a dense D -> 2 (BertForQuestionAnswering's
qa_outputs); loss (start CE + end CE) / 2. Metrics: SQuAD exact match and token F1.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.finetune import heads
from t5x_like.finetune import metrics as metrics_lib
from t5x_like.finetune.encoding import encoder_pair
from t5x_like.finetune.task import BadRow, Example, Task, field
from t5x_like.models.layers import DenseGeneral, compute_dtype, normal_init

Array = jax.Array
_NEG = -1e9  # masked logits: finite, so a row of padding never makes NaNs


class SpanExtractionHead(nn.Module):
  """[B, L, D] -> (start [B, L], end [B, L]) logits; positions where valid_BxL is False
  (padding) get -1e9. One dense D -> 2 named 'span' (BertForQuestionAnswering's qa_outputs)."""

  init_std: float = 0.02
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, hidden_BxLxD: Array, valid_BxL: Array) -> tuple[Array, Array]:
    logits_BxLx2 = DenseGeneral(features=(2,), axes=("embed", None),
                                kernel_init=normal_init(self.init_std), dtype=self.dtype,
                                name="span")(hidden_BxLxD).astype(jnp.float32)
    logits_BxLx2 = jnp.where(valid_BxL[..., None], logits_BxLx2, _NEG)
    return logits_BxLx2[..., 0], logits_BxLx2[..., 1]


def span_metrics(start_logits_BxL: Array, end_logits_BxL: Array, start_B: Array, end_B: Array,
                 denominator: Array) -> dict[str, Array]:
  """BERT's span loss: (start CE + end CE) / 2 as `span_loss`, with the per-end metrics
  span_start_* / span_end_*; span_exact = both ends right. Rows with start -1 are ignored."""
  start = heads.label_metrics("span_start", start_logits_BxL, start_B, denominator)
  end = heads.label_metrics("span_end", end_logits_BxL, end_B, denominator)
  both = ((jnp.argmax(start_logits_BxL, -1) == start_B)
          & (jnp.argmax(end_logits_BxL, -1) == end_B)).astype(jnp.float32)
  out = {**start, **end}
  out["span_loss"] = 0.5 * (start["span_start_loss"] + end["span_end_loss"])
  out["span_exact"] = jnp.sum(both * heads.label_weights(start_B)) / denominator
  return out


def best_spans(start_logits_BxL: Array, end_logits_BxL: Array, max_answer_tokens: int = 30
               ) -> tuple[Array, Array]:
  """(start [B], end [B]) maximising start + end logits with start <= end <
  start + max_answer_tokens."""
  length = start_logits_BxL.shape[1]
  i = jnp.arange(length)[:, None]
  j = jnp.arange(length)[None, :]
  allowed_LxL = (j >= i) & (j < i + max_answer_tokens)
  scores_BxLxL = start_logits_BxL[:, :, None] + end_logits_BxL[:, None, :]
  scores_BxLxL = jnp.where(allowed_LxL[None], scores_BxLxL, -jnp.inf)
  flat = jnp.argmax(scores_BxLxL.reshape(scores_BxLxL.shape[0], -1), axis=-1)
  return (flat // length).astype(jnp.int32), (flat % length).astype(jnp.int32)


def encode_span_extraction(tokenizer, example: Example, max_length: int,
                           max_question_length: int = 64):
  """[CLS] question [SEP] context [SEP]; the answer's token span (0, 0 when none).

  The question is cut to max_question_length tokens, the context to what is left (one
  window: no document stride). Returns (features, answer_lost): answer_lost is True
  when the example had an answer that truncation cut.
  """
  question = tokenizer.encode(example.text)[:max_question_length]
  context, spans = tokenizer.encode_with_offsets(example.text_pair)
  room = max_length - len(question) - 3
  if room <= 0:
    raise ValueError(f"max_length={max_length} leaves no room for the context after a"
                     f" {len(question)}-token question")
  context, spans = context[:room], spans[:room]
  features, _ = encoder_pair(tokenizer, question, context, max_length)
  first = len(question) + 2  # position of the first context token
  offsets = np.full((max_length, 2), -1, np.int32)
  offsets[first:first + len(spans)] = spans
  start = end = 0
  answer_lost = False
  if example.answer_text:
    char_start = example.answer_start
    char_end = char_start + len(example.answer_text)
    hits = [k for k, (lo, hi) in enumerate(spans) if lo < hi and lo < char_end and hi > char_start]
    if hits and spans[hits[-1]][1] >= char_end:
      start, end = first + hits[0], first + hits[-1]
    else:
      answer_lost = True
  features.update(start_positions=np.int32(start), end_positions=np.int32(end),
                  context_offsets=offsets)
  return features, answer_lost


def span_text(context: str, offsets_Lx2: np.ndarray, start: int, end: int) -> str:
  """The context text of tokens start..end (inclusive); "" for [CLS] or non-context."""
  lo, hi = int(offsets_Lx2[start][0]), int(offsets_Lx2[end][1])
  if start == 0 or lo < 0 or hi < 0 or end < start:
    return ""
  return context[lo:hi]


def _answer_start(value: Any, column: str) -> int:
  if isinstance(value, int) and not isinstance(value, bool):
    return value
  if isinstance(value, float) and value.is_integer():
    return int(value)
  if isinstance(value, str):
    try:
      return int(value.strip())
    except ValueError:
      pass
  raise BadRow("bad_value", f"column {column!r} is not an integer: {value!r}")


@dataclasses.dataclass(frozen=True)
class SpanExtraction(Task):
  """Options: the answer columns, max_question_length (question tokens kept) and
  max_answer_tokens (the longest span predicted)."""

  name: ClassVar[str] = "span_extraction"
  cuts_padding: ClassVar[bool] = False  # outputs per position
  uses_label_list: ClassVar[bool] = False
  label_features: ClassVar[tuple[str, ...]] = ("start_positions", "end_positions")
  host_features: ClassVar[tuple[str, ...]] = ("context_offsets",)
  encode_flag: ClassVar[str] = "answers_lost"

  answer_text_column: str = "answer_text"
  answer_start_column: str = "answer_start"
  max_question_length: int = 64  # span extraction: question tokens kept
  max_answer_tokens: int = 30  # span extraction: the longest answer predicted

  def check_files_options(self):
    if not self.text_pair_column:
      raise ValueError("span_extraction needs text_pair_column (the context)")

  def required_columns(self):
    return [self.text_column, self.text_pair_column, self.answer_text_column]

  def row_labels(self, record):
    return []

  def parse(self, record, line, lookup, labels):
    text, pair = self.texts(record)
    answer = field(record, self.answer_text_column)
    if not isinstance(answer, str):
      raise BadRow("bad_value", f"column {self.answer_text_column!r} is not a string")
    if not answer.strip():
      return Example(text, pair, answer_text="", answer_start=-1, line=line)
    start = _answer_start(field(record, self.answer_start_column), self.answer_start_column)
    if start < 0 or pair[start:start + len(answer)] != answer:
      raise BadRow("bad_value", f"answer {answer!r} is not at character {start} of the"
                   f" context (found {pair[max(start, 0):max(start, 0) + len(answer)]!r})")
    return Example(text, pair, answer_text=answer, answer_start=start, line=line)

  def encode(self, example, tokenizer, family, label_names):
    return encode_span_extraction(tokenizer, example, self.max_length,
                                  self.max_question_length)

  def head(self, model_config, num_labels, deterministic):
    return SpanExtractionHead(init_std=model_config.init_std,
                              dtype=compute_dtype(model_config))

  def forward(self, head, hidden_BxLxD, valid_BxL, summary_index_B, batch):
    start_BxL, end_BxL = head(hidden_BxLxD, valid_BxL)
    return {"start_logits": start_BxL, "end_logits": end_BxL}

  def normalizers(self, batch):
    return {"span": heads.label_normalizer(batch["start_positions"])}

  def loss(self, out, batch, normalizers, model_config):
    metrics = span_metrics(out["start_logits"], out["end_logits"], batch["start_positions"],
                           batch["end_positions"], normalizers["span"])
    metrics["loss"] = metrics["span_loss"]
    return metrics

  def predict(self, out, batch):
    """{'start', 'end'} [B]; with context_offsets [B, L, 2] in the batch, only context
    tokens and [CLS] (position 0, "no answer") can start or end the answer."""
    start_BxL, end_BxL = out["start_logits"], out["end_logits"]
    if "context_offsets" in batch:
      allowed_BxL = (jnp.asarray(batch["context_offsets"])[..., 0] >= 0).at[:, 0].set(True)
      start_BxL = jnp.where(allowed_BxL, start_BxL, _NEG)
      end_BxL = jnp.where(allowed_BxL, end_BxL, _NEG)
    start, end = best_spans(start_BxL, end_BxL, self.max_answer_tokens)
    return {"start": start, "end": end}

  def _texts(self, predictions, features, dataset) -> list[str]:
    return [span_text(example.text_pair, offsets, int(s), int(e)) for example, offsets, s, e
            in zip(dataset.examples, features["context_offsets"], predictions["start"],
                   predictions["end"])]

  def metrics(self, predictions, features, dataset):
    return metrics_lib.squad_scores(self._texts(predictions, features, dataset),
                                    [example.answer_text or "" for example in dataset.examples])

  def prediction_row(self, k, example, predictions, features, dataset):
    start, end = int(predictions["start"][k]), int(predictions["end"][k])
    return {"answer": example.answer_text or "", "prediction": span_text(
        example.text_pair, features["context_offsets"][k], start, end)}


TASK = SpanExtraction
