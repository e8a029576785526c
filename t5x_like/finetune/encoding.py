"""Examples -> fixed-length int32 features (the batch names of models/model.py), per task.

  classification, encoder (BERT):  [CLS] a [SEP] (b [SEP]), encoder_type_ids 0 / 1,
      the longer side truncated first (BERT's run_classifier); labels [B]
  classification, decoder (GPT):   a (eos b) eos, decoder_segment_ids 1 on real tokens;
      the head reads the last real token; labels [B]
  classification, encoder_decoder (T5, text to text): inputs "prefix: a (pair: b)" + eos,
      targets = the label string's tokens + eos; labels [B] (the class, for evaluation)
  token_classification (encoder):  [CLS] words [SEP]; labels [B, L] = the word's tag on
      its first sub-token, -1 elsewhere (weight 0)
  span_extraction (encoder):       [CLS] question [SEP] context [SEP]; start_positions /
      end_positions [B] = the answer's first / last token, 0 ([CLS]) when there is no
      answer or truncation cut it; context_offsets [B, L, 2] = each context token's
      character span in the context (-1 elsewhere; not a model input)

Padding id is 0 everywhere (the encoder masks padding by token id).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from t5x_like.finetune.data import Example
from t5x_like.finetune.tokenizer import Tokenizer

Features = dict[str, np.ndarray]


def truncate_pair(a: list[int], b: Optional[list[int]], max_total: int
                  ) -> tuple[list[int], Optional[list[int]]]:
  """BERT's _truncate_seq_pair: drop the last token of the longer side (b on a tie)
  until len(a) + len(b) <= max_total."""
  a = list(a)
  if b is None:
    return a[:max_total], None
  b = list(b)
  while len(a) + len(b) > max_total:
    if len(a) > len(b):
      a.pop()
    else:
      b.pop()
  return a, b


def _pad(ids: Sequence[int], length: int, value: int = 0) -> np.ndarray:
  out = np.full(length, value, np.int32)
  out[:len(ids)] = ids
  return out


def _check_encoder_tokenizer(tokenizer: Tokenizer) -> None:
  if tokenizer.cls_id is None or tokenizer.sep_id is None:
    raise ValueError(f"{tokenizer!r} has no [CLS] / [SEP]: encoder features need a BERT vocab")
  if tokenizer.pad_id != 0:
    raise ValueError(f"{tokenizer!r}: padding must be id 0 (the encoder masks token id 0),"
                     f" got pad_id={tokenizer.pad_id}")


def encoder_pair(tokenizer: Tokenizer, a: list[int], b: Optional[list[int]], max_length: int
                 ) -> tuple[Features, bool]:
  """[CLS] a [SEP] (b [SEP]) padded to max_length, and whether anything was cut."""
  _check_encoder_tokenizer(tokenizer)
  specials = 3 if b is not None else 2
  ta, tb = truncate_pair(a, b, max_length - specials)
  truncated = len(ta) < len(a) or (b is not None and len(tb) < len(b))
  tokens = [tokenizer.cls_id] + ta + [tokenizer.sep_id]
  types = [0] * len(tokens)
  if tb is not None:
    tokens += tb + [tokenizer.sep_id]
    types += [1] * (len(tb) + 1)
  return {"encoder_input_tokens": _pad(tokens, max_length),
          "encoder_type_ids": _pad(types, max_length)}, truncated


# ------------------------------------------------------------------ classification
def encode_classification_encoder(tokenizer: Tokenizer, example: Example, max_length: int
                                  ) -> tuple[Features, bool]:
  """encoder_input_tokens, encoder_type_ids [L]; labels []; and whether it was cut."""
  a = tokenizer.encode(example.text)
  b = tokenizer.encode(example.text_pair) if example.text_pair is not None else None
  features, truncated = encoder_pair(tokenizer, a, b, max_length)
  features["labels"] = np.int32(example.label)
  return features, truncated


def encode_classification_decoder(tokenizer: Tokenizer, example: Example, max_length: int
                                  ) -> tuple[Features, bool]:
  """decoder_input_tokens, decoder_segment_ids [L] of a (eos b) eos; labels []. The
  final eos (when the vocab has one) is where the head reads."""
  eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
  a = tokenizer.encode(example.text)
  b = tokenizer.encode(example.text_pair) if example.text_pair is not None else None
  specials = len(eos) * (2 if b is not None else 1)
  ta, tb = truncate_pair(a, b, max_length - specials)
  truncated = len(ta) < len(a) or (b is not None and len(tb) < len(b))
  tokens = ta + eos + (tb + eos if tb is not None else [])
  return {"decoder_input_tokens": _pad(tokens, max_length, tokenizer.pad_id),
          "decoder_segment_ids": _pad([1] * len(tokens), max_length),
          "labels": np.int32(example.label)}, truncated


def text_to_text_input(example: Example, task_prefix: str, pair_prefix: str = "pair") -> str:
  """The T5 input string: "prefix: text" or "prefix: text pair_prefix: text_pair"."""
  text = f"{task_prefix}: {example.text}"
  if example.text_pair is not None:
    text += f" {pair_prefix}: {example.text_pair}"
  return text


def label_targets(tokenizer: Tokenizer, label_names: Sequence[str], target_length: int
                  ) -> np.ndarray:
  """[C, T] int32: each label string's tokens + eos, 0-padded (rank classification)."""
  rows = []
  for name in label_names:
    ids = tokenizer.encode(name) + [tokenizer.eos_id]
    if len(ids) > target_length:
      raise ValueError(f"label {name!r} is {len(ids)} tokens with eos; target_length is"
                       f" {target_length}")
    rows.append(_pad(ids, target_length))
  return np.stack(rows)


def encode_text_to_text(tokenizer: Tokenizer, example: Example, label_names: Sequence[str],
                        max_length: int, target_length: int, task_prefix: str,
                        pair_prefix: str = "pair") -> tuple[Features, bool]:
  """encoder_input_tokens [L]: the input string + eos (cut to max_length);
  decoder_target_tokens, decoder_input_tokens (shifted right), decoder_loss_weights [T]:
  the label string + eos; labels []."""
  if tokenizer.eos_id is None:
    raise ValueError(f"{tokenizer!r} has no eos: text-to-text needs a T5 vocabulary")
  ids = tokenizer.encode(text_to_text_input(example, task_prefix, pair_prefix))
  truncated = len(ids) > max_length - 1
  ids = ids[:max_length - 1] + [tokenizer.eos_id]
  targets = label_targets(tokenizer, [label_names[example.label]], target_length)[0]
  inputs = np.concatenate([[0], targets[:-1]]).astype(np.int32)  # shifted right, 0 = start
  return {"encoder_input_tokens": _pad(ids, max_length),
          "decoder_input_tokens": inputs, "decoder_target_tokens": targets,
          "decoder_loss_weights": (targets > 0).astype(np.int32),
          "labels": np.int32(example.label)}, truncated


# ------------------------------------------------------------------ token classification
def encode_token_classification(tokenizer: Tokenizer, example: Example, max_length: int
                                ) -> tuple[Features, bool]:
  """encoder_input_tokens, encoder_type_ids, labels [L]: each word's tag on its first
  sub-token, -1 elsewhere; words cut by max_length lose their tags."""
  _check_encoder_tokenizer(tokenizer)
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
  return {"encoder_input_tokens": _pad(tokens, max_length),
          "encoder_type_ids": np.zeros(max_length, np.int32),
          "labels": _pad(labels, max_length, -1)}, truncated


# ------------------------------------------------------------------ span extraction
def encode_span_extraction(tokenizer: Tokenizer, example: Example, max_length: int,
                           max_question_length: int = 64) -> tuple[Features, bool]:
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


# ------------------------------------------------------------------ batches
def encode_examples(examples: Sequence[Example], tokenizer: Tokenizer, *, task: str,
                    family: str = "encoder", max_length: int,
                    label_names: Optional[Sequence[str]] = None, target_length: int = 8,
                    task_prefix: str = "classify", pair_prefix: str = "pair",
                    max_question_length: int = 64) -> tuple[Features, dict[str, int]]:
  """Every example encoded and stacked: {feature: [N, ...] int32}, and stats
  {examples, truncated} (span extraction: answers_lost, answers cut by truncation)."""
  if task == "classification" and family == "encoder":
    encode = lambda e: encode_classification_encoder(tokenizer, e, max_length)
  elif task == "classification" and family == "decoder":
    encode = lambda e: encode_classification_decoder(tokenizer, e, max_length)
  elif task == "classification" and family == "encoder_decoder":
    if label_names is None:
      raise ValueError("text-to-text classification needs label_names (the label strings)")
    encode = lambda e: encode_text_to_text(tokenizer, e, label_names, max_length,
                                           target_length, task_prefix, pair_prefix)
  elif task == "token_classification" and family == "encoder":
    encode = lambda e: encode_token_classification(tokenizer, e, max_length)
  elif task == "span_extraction" and family == "encoder":
    encode = lambda e: encode_span_extraction(tokenizer, e, max_length, max_question_length)
  else:
    raise ValueError(f"no encoding for task={task!r} with family={family!r}: token and span"
                     " tasks are encoder-only, classification supports every family")
  rows, flags = [], []
  for example in examples:
    features, flag = encode(example)
    rows.append(features)
    flags.append(flag)
  if not rows:
    raise ValueError("no examples to encode")
  batch = {name: np.stack([r[name] for r in rows]).astype(np.int32) for name in rows[0]}
  stats = {"examples": len(rows)}
  stats["answers_lost" if task == "span_extraction" else "truncated"] = int(sum(flags))
  return batch, stats
