"""Span extraction (SQuAD-style reading comprehension): the answer's span in a context,
as BERT's run_squad.py does it (Devlin et al. 2019; google-research/bert).

Rows: the question (text column), the context (text_pair_column, required), the answer
text and its start (a character offset into the context). An empty answer means "no
answer" and needs task.allow_no_answer (SQuAD 2.0).

Windows (a document stride): the question is cut to max_question_length tokens and the
context is laid out in windows of what max_length leaves (room), each starting
doc_stride tokens after the last (less where needed for windows to overlap by
max_answer_tokens - 1, half a window at most, so that every answer the model can
predict lies whole in some window):
  [CLS] question [SEP] context[s : s + room] [SEP]     one feature row per window
Training rows add one window centred on an answer that is still in none (a longer
one) when it fits a window; evaluation rows never depend on the answer.
start_positions / end_positions [] = the answer's first / last token where the window
holds the whole answer, else 0 ([CLS], "not in this window"); context_offsets [L, 2] =
each context token's character span in the context (-1 elsewhere); max_context [L] = 1
where this window is the token's "max context" one (the most tokens on its shorter
side, run_squad's _check_is_max_context); example_index [] = the row's example.
An answer no window holds whole is counted as `answers_lost` (in training, only one
longer than a window).

Head: a dense D -> 2 (BertForQuestionAnswering's qa_outputs); loss (start CE + end CE)
/ 2. Prediction (run_squad's write_predictions): each window's n_best_size best starts
(context tokens of max context) and ends (context tokens); the best span over all the
example's windows maximises start + end logit with start <= end < start +
max_answer_tokens; its character span is widened to whole words (BERT's basic words:
runs of letters and digits, each punctuation mark or CJK character alone) and cut from
the context. allow_no_answer: "" when the null score (the least [CLS] start + end logit
over the windows) beats the best span by more than null_score_threshold; else the
empty answer is never predicted. Metrics: SQuAD's official exact match and F1
(finetune/metrics.squad_scores: v2.0's rules with allow_no_answer, else v1.1's), over
every gold answer where the dataset carries them (a benchmark), else the row's.
"""

from __future__ import annotations

import dataclasses
import unicodedata
from typing import Any, ClassVar, Optional, Sequence

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
Features = dict[str, np.ndarray]
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


# ------------------------------------------------------------------ windows
def doc_windows(num_tokens: int, room: int, doc_stride: int) -> list[tuple[int, int]]:
  """(start, length) of each window over num_tokens context tokens: run_squad's doc
  spans, each `room` tokens at most, starting min(length, doc_stride) after the last,
  the last one reaching the end (one empty window for an empty context)."""
  windows, start = [], 0
  while True:
    length = min(num_tokens - start, room)
    windows.append((start, length))
    if start + length >= num_tokens:
      return windows
    start += min(length, doc_stride)


def max_context_windows(windows: Sequence[tuple[int, int]], num_tokens: int) -> np.ndarray:
  """[num_tokens]: for each context token, the window where it has the most context:
  max over windows holding it of min(tokens left, tokens right) + 0.01 * length, the
  first on a tie (run_squad's _check_is_max_context)."""
  best = np.full(num_tokens, -1, np.int64)
  best_score = np.full(num_tokens, -np.inf)
  for w, (start, length) in enumerate(windows):
    p = np.arange(start, start + length)
    score = np.minimum(p - start, start + length - 1 - p) + 0.01 * length
    better = score > best_score[p]
    best[p[better]], best_score[p[better]] = w, score[better]
  return best


def answer_tokens(spans: Sequence[tuple[int, int]], char_start: int, char_end: int
                  ) -> Optional[tuple[int, int]]:
  """(first, last) context token covering characters [char_start, char_end), or None
  when the tokens do not reach the answer's end."""
  hits = [k for k, (lo, hi) in enumerate(spans) if lo < hi and lo < char_end and hi > char_start]
  if hits and spans[hits[-1]][1] >= char_end:
    return hits[0], hits[-1]
  return None


def encode_windows(tokenizer, example: Example, max_length: int, max_question_length: int = 64,
                   doc_stride: int = 128, max_answer_tokens: int = 30, training: bool = False
                   ) -> tuple[list[Features], bool]:
  """The example's window rows (module docstring) and whether its answer was lost (it
  has one and no window holds it whole).

  Windows overlap by min(max_answer_tokens - 1, room // 2) tokens at least (the stride
  is at most room minus that), so that every answer the model can predict lies whole
  in some window (room: what max_length leaves after the question). training: an answer still in no window (a
  longer one) gets one more window, centred on it, when it fits one; evaluation rows
  never depend on the answer."""
  question = tokenizer.encode(example.text)[:max_question_length]
  context, spans = tokenizer.encode_with_offsets(example.text_pair)
  room = max_length - len(question) - 3
  if room <= 0:
    raise ValueError(f"max_length={max_length} leaves no room for the context after a"
                     f" {len(question)}-token question")
  answer = None
  if example.answer_text:
    answer = answer_tokens(spans, example.answer_start,
                           example.answer_start + len(example.answer_text))
  overlap = min(max_answer_tokens - 1, room // 2)
  windows = doc_windows(len(context), room, min(doc_stride, room - overlap))
  holds = lambda w: answer is not None and w[0] <= answer[0] and answer[1] < w[0] + w[1]
  if training and answer is not None and not any(map(holds, windows)):
    size = answer[1] - answer[0] + 1
    if size <= room:
      start = min(max(0, answer[0] - (room - size) // 2), max(0, len(context) - room))
      windows.append((start, min(room, len(context) - start)))
  best_window = max_context_windows(windows, len(context))
  first = len(question) + 2  # the position of a window's first context token
  rows, found = [], False
  for w, (start, length) in enumerate(windows):
    features, _ = encoder_pair(tokenizer, question, context[start:start + length], max_length)
    offsets = np.full((max_length, 2), -1, np.int32)
    max_context = np.zeros(max_length, np.int32)
    if length:
      offsets[first:first + length] = spans[start:start + length]
      max_context[first:first + length] = best_window[start:start + length] == w
    begin = end = 0
    if holds((start, length)):
      begin, end, found = first + answer[0] - start, first + answer[1] - start, True
    rows.append({**features, "start_positions": np.int32(begin), "end_positions": np.int32(end),
                 "context_offsets": offsets, "max_context": max_context})
  return rows, bool(example.answer_text) and not found


# ------------------------------------------------------------------ answers
def _is_punctuation(char: str) -> bool:
  """BERT's _is_punctuation: ASCII non-letters / digits and Unicode's P* categories."""
  code = ord(char)
  if 33 <= code <= 47 or 58 <= code <= 64 or 91 <= code <= 96 or 123 <= code <= 126:
    return True
  return unicodedata.category(char).startswith("P")


def _is_cjk(char: str) -> bool:
  """BERT's _is_chinese_char: the CJK ideograph blocks (each its own word)."""
  code = ord(char)
  return (0x4E00 <= code <= 0x9FFF or 0x3400 <= code <= 0x4DBF or 0x20000 <= code <= 0x2A6DF
          or 0x2A700 <= code <= 0x2B73F or 0x2B740 <= code <= 0x2B81F
          or 0x2B820 <= code <= 0x2CEAF or 0xF900 <= code <= 0xFAFF
          or 0x2F800 <= code <= 0x2FA1F)


def _in_word(char: str) -> bool:
  return not (char.isspace() or _is_punctuation(char) or _is_cjk(char))


def whole_words(text: str, start: int, end: int) -> tuple[int, int]:
  """[start, end) widened so it neither starts nor ends inside a word (a run of
  characters that are not whitespace, punctuation or CJK: BERT's basic tokens)."""
  if start < end:
    if _in_word(text[start]):
      while start > 0 and _in_word(text[start - 1]):
        start -= 1
    if _in_word(text[end - 1]):
      while end < len(text) and _in_word(text[end]):
        end += 1
  return start, end


def span_text(context: str, offsets_Lx2: np.ndarray, start: int, end: int) -> str:
  """The context text of tokens start..end (inclusive), widened to whole words; "" for
  [CLS], a position outside the context, or end < start."""
  lo, hi = int(offsets_Lx2[start][0]), int(offsets_Lx2[end][1])
  if start == 0 or lo < 0 or hi < 0 or end < start:
    return ""
  lo, hi = whole_words(context, lo, hi)
  return context[lo:hi]


def best_answers(predictions: dict, features: Features, contexts: Sequence[str],
                 max_answer_tokens: int, allow_no_answer: bool,
                 null_score_threshold: float = 0.0) -> list[str]:
  """One answer per example (module docstring): predictions are SpanExtraction.predict's
  per window row ({start_index, start_logit, end_index, end_logit} [N, K], null_score
  [N]); features the rows' example_index [N] and context_offsets [N, L, 2]."""
  example_of = np.asarray(features["example_index"])
  best = [(-np.inf, 0, 0, 0)] * len(contexts)  # (score, row, start, end)
  null = np.full(len(contexts), np.inf)
  si, sv = np.asarray(predictions["start_index"]), np.asarray(predictions["start_logit"])
  ei, ev = np.asarray(predictions["end_index"]), np.asarray(predictions["end_logit"])
  null_scores = np.asarray(predictions["null_score"])
  for row, k in enumerate(example_of):
    null[k] = min(null[k], float(null_scores[row]))
    length = ei[row][None, :] - si[row][:, None] + 1
    ok = ((sv[row] > _NEG / 2)[:, None] & (ev[row] > _NEG / 2)[None, :] & (length >= 1)
          & (length <= max_answer_tokens))
    if not ok.any():
      continue
    scores = np.where(ok, sv[row][:, None] + ev[row][None, :], -np.inf)
    a, b = np.unravel_index(np.argmax(scores), scores.shape)
    if scores[a, b] > best[k][0]:
      best[k] = (float(scores[a, b]), row, int(si[row][a]), int(ei[row][b]))
  answers = []
  for k, context in enumerate(contexts):
    score, row, start, end = best[k]
    if allow_no_answer and (score == -np.inf or null[k] - score > null_score_threshold):
      answers.append("")
    elif score == -np.inf:
      answers.append("")  # no context token at all
    else:
      answers.append(span_text(context, features["context_offsets"][row], start, end))
  return answers


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
  """Options: the answer columns, max_question_length (question tokens kept),
  doc_stride (tokens between window starts), max_answer_tokens (the longest answer
  predicted), n_best_size (starts and ends kept per window), allow_no_answer (SQuAD
  2.0) and null_score_threshold."""

  name: ClassVar[str] = "span_extraction"
  cuts_padding: ClassVar[bool] = False  # outputs per position
  uses_label_list: ClassVar[bool] = False
  label_features: ClassVar[tuple[str, ...]] = ("start_positions", "end_positions")
  host_features: ClassVar[tuple[str, ...]] = ("context_offsets", "max_context",
                                              "example_index")
  encode_flag: ClassVar[str] = "answers_lost"

  answer_text_column: str = "answer_text"
  answer_start_column: str = "answer_start"
  max_question_length: int = 64  # span extraction: question tokens kept
  doc_stride: int = 128  # span extraction: tokens between window starts (run_squad.py)
  max_answer_tokens: int = 30  # span extraction: the longest answer predicted
  n_best_size: int = 20  # span extraction: starts and ends considered per window
  # Questions may have no answer (SQuAD 2.0; an empty answer in the data, "" predicted
  # by the null-score threshold, scored by evaluate-v2.0.py); text generation too.
  allow_no_answer: bool = False
  null_score_threshold: float = 0.0  # span extraction, allow_no_answer: run_squad's

  def __post_init__(self):
    super().__post_init__()
    for key in ("doc_stride", "max_answer_tokens", "n_best_size"):
      if getattr(self, key) < 1:
        raise ValueError(f"{key}={getattr(self, key)}: must be at least 1")

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
      if not self.allow_no_answer:
        raise BadRow("no_answer", f"column {self.answer_text_column!r} is empty: a question"
                     " without an answer needs config.task.allow_no_answer=true (SQuAD 2.0)")
      return Example(text, pair, answer_text="", answer_start=-1, line=line)
    start = _answer_start(field(record, self.answer_start_column), self.answer_start_column)
    if start < 0 or pair[start:start + len(answer)] != answer:
      raise BadRow("bad_value", f"answer {answer!r} is not at character {start} of the"
                   f" context (found {pair[max(start, 0):max(start, 0) + len(answer)]!r})")
    return Example(text, pair, answer_text=answer, answer_start=start, line=line)

  def encode(self, example, tokenizer, family, label_names):
    return encode_windows(tokenizer, example, self.max_length, self.max_question_length,
                          self.doc_stride, self.max_answer_tokens)

  def encode_for_training(self, example, tokenizer, family, label_names):
    return encode_windows(tokenizer, example, self.max_length, self.max_question_length,
                          self.doc_stride, self.max_answer_tokens, training=True)

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
    """Per window row: {start_index, start_logit} [B, K] the K = n_best_size best
    starts among the context tokens of max context, {end_index, end_logit} [B, K] the
    best ends among the context tokens (a masked candidate's logit is -1e9), and
    null_score [B] = start + end logit of [CLS]."""
    start_BxL, end_BxL = out["start_logits"], out["end_logits"]
    context_BxL = jnp.asarray(batch["context_offsets"])[..., 0] >= 0
    starts_BxL = jnp.where(context_BxL & (jnp.asarray(batch["max_context"]) > 0), start_BxL,
                           _NEG)
    ends_BxL = jnp.where(context_BxL, end_BxL, _NEG)
    k = min(self.n_best_size, start_BxL.shape[1])
    start_logit, start_index = jax.lax.top_k(starts_BxL, k)
    end_logit, end_index = jax.lax.top_k(ends_BxL, k)
    return {"start_index": start_index, "start_logit": start_logit, "end_index": end_index,
            "end_logit": end_logit, "null_score": start_BxL[:, 0] + end_BxL[:, 0]}

  def answers(self, predictions, features, dataset) -> list[str]:
    """The predicted answer of every example of dataset (best_answers)."""
    return best_answers(predictions, features, [e.text_pair for e in dataset.examples],
                        self.max_answer_tokens, self.allow_no_answer,
                        self.null_score_threshold)

  def metrics(self, predictions, features, dataset):
    golds = dataset.golds or [[e.answer_text or ""] for e in dataset.examples]
    return metrics_lib.squad_scores(self.answers(predictions, features, dataset), golds,
                                    "v2.0" if self.allow_no_answer else "v1.1")

  def prediction_rows(self, predictions, features, dataset):
    return [{"answer": example.answer_text or "", "prediction": answer}
            for example, answer in zip(dataset.examples,
                                       self.answers(predictions, features, dataset))]

  def prediction_row(self, k, example, predictions, features, dataset):
    return self.prediction_rows(predictions, features, dataset)[k]


TASK = SpanExtraction
