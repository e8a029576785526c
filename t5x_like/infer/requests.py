"""The pure side of `t5x-like infer`: JSONL rows in, model features, JSON rows out.

  rows = read_rows("in.jsonl", field="text")             # InputError: "in.jsonl:3: ..."
  items, truncated = encode_rows(rows, vocab, model, mode, limit=..., max_new_tokens=...)
  for chunk, num_real in chunks(items, batch_size): features = *_features(chunk, ...)

`model` is a t5x_like model (or its class); its family's flags pick the layout
(fills_masks: BERT; continues_prompt: the decoder-only family; neither: T5). Per
family and mode, the ids of an Item follow the training layout of that family:
  decoder, generate:  ids = BOS 0, prompt    (causal_lm rows start with the input 0)
  decoder, score:     ids = BOS 0, prompt;   target_ids = target (no eos)
  enc-dec, both:      ids = input, EOS       (span corruption inputs end with EOS);
                      target_ids = target, EOS (score)
  encoder, generate:  ids = CLS, text with every "[MASK]" as mask_id, SEP (type ids 0)
No jax here: everything is numpy and plain Python.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Iterator, NamedTuple, Optional, Sequence

import numpy as np

from t5x_like.errors import UserError

BOS_ID = 0  # the decoder input at the start of every causal_lm row (t5x_like.data.lm)
MASK_TEXT = "[MASK]"


class InputError(UserError, ValueError):
  """A problem with one input line; the message starts with "FILE:LINE: "."""


class Row(NamedTuple):
  line: int  # 1-based physical line of the input file
  text: str
  target: Optional[str] = None


class Item(NamedTuple):
  """One encoded row: model input ids [n] and, when scoring, target ids [m]."""

  row: Row
  ids: np.ndarray
  target_ids: Optional[np.ndarray] = None


# ------------------------------------------------------------------ reading
def _field(obj, name: str, where: str) -> str:
  if not isinstance(obj, dict):
    raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
  if name not in obj:
    raise InputError(f"{where}: no field {name!r} (have {sorted(obj)})")
  if not isinstance(obj[name], str):
    raise InputError(f"{where}: field {name!r} is {type(obj[name]).__name__}, not a string")
  return obj[name]


def read_rows(path: str, field: str = "text", target_field: Optional[str] = None
              ) -> list[Row]:
  """The rows of a JSONL file ("-": stdin), blank lines skipped. InputError names the
  file and 1-based line of a malformed line or a missing / non-string field."""
  name = "<stdin>" if path == "-" else path
  lines = sys.stdin.read().split("\n") if path == "-" else _read_lines(path)
  rows = []
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    where = f"{name}:{number}"
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise InputError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    target = None if target_field is None else _field(obj, target_field, where)
    rows.append(Row(number, _field(obj, field, where), target))
  return rows


def _read_lines(path: str) -> list[str]:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read().split("\n")
  except (OSError, UnicodeDecodeError) as e:
    raise InputError(f"{path}: cannot read it ({e})") from None


# ------------------------------------------------------------------ encoding
def masked_ids(vocab, text: str) -> np.ndarray:
  """[CLS] text [SEP] with each "[MASK]" as vocab.mask_id. A space just before a mask
  goes to the masked word (the training data masks "▁word" pieces, space included)."""
  pieces = text.split(MASK_TEXT)
  ids = [vocab.cls_id]
  for i, piece in enumerate(pieces):
    if i + 1 < len(pieces) and piece.endswith(" "):
      piece = piece[:-1]
    ids.extend(vocab.encode(piece).tolist())
    if i + 1 < len(pieces):
      ids.append(vocab.mask_id)
  return np.asarray(ids + [vocab.sep_id], np.int32)


def _encoder_item(row: Row, vocab, *, limit: int, where: str) -> tuple[Item, bool]:
  """BERT fill-mask: [CLS] text [SEP]; too long is an error (masks would be lost)."""
  ids = masked_ids(vocab, row.text)
  if len(ids) > limit:
    raise InputError(f"{where}: {len(ids)} tokens with [CLS] and [SEP]; the model takes"
                     f" at most {limit} (config.data.length)")
  return Item(row, ids), False


def _encoder_decoder_item(row: Row, vocab, mode: str, *, limit: int) -> tuple[Item, bool]:
  """T5: input cut to limit - 1 tokens, then EOS; score: target, EOS."""
  text_ids = vocab.encode(row.text)
  ids = np.append(text_ids[:limit - 1], vocab.eos_id).astype(np.int32)
  target = None if mode == "generate" else np.append(vocab.encode(row.target),
                                                     vocab.eos_id).astype(np.int32)
  return Item(row, ids, target), len(text_ids) > limit - 1


def _decoder_item(row: Row, vocab, mode: str, *, limit: int, max_new_tokens: int,
                  where: str) -> tuple[Item, bool]:
  """GPT: BOS, prompt. generate: a prompt too long for max_new_tokens more positions
  keeps BOS and its end (the part the model continues); score: too long is an error."""
  text_ids = vocab.encode(row.text)
  ids = np.concatenate([[BOS_ID], text_ids]).astype(np.int32)
  if mode == "generate":
    if not len(text_ids):
      raise InputError(f"{where}: empty prompt")
    room = limit - max_new_tokens + 1  # the cache holds prompt + max_new_tokens - 1
    if len(ids) <= room:
      return Item(row, ids), False
    return Item(row, np.concatenate([ids[:1], ids[len(ids) - room + 1:]])), True
  target = vocab.encode(row.target)
  if not len(target):
    raise InputError(f"{where}: empty target")
  if len(ids) + len(target) - 1 > limit:
    raise InputError(f"{where}: BOS, prompt and target need {len(ids) + len(target) - 1}"
                     f" positions; the model has {limit}")
  return Item(row, ids, target), False


def encode_rows(rows: Sequence[Row], vocab, model, mode: str, *, limit: int,
                max_new_tokens: int = 1, source: str = "input") -> tuple[list[Item], list[int]]:
  """(items, lines of the truncated inputs). limit: the longest model input (decoder:
  prompt + generated tokens or prompt + target; encoders: the encoder input)."""
  items, truncated = [], []
  for row in rows:
    where = f"{source}:{row.line}"
    if model.fills_masks:
      item, cut = _encoder_item(row, vocab, limit=limit, where=where)
    elif model.continues_prompt:
      item, cut = _decoder_item(row, vocab, mode, limit=limit,
                                max_new_tokens=max_new_tokens, where=where)
    else:
      item, cut = _encoder_decoder_item(row, vocab, mode, limit=limit)
    items.append(item)
    if cut:
      truncated.append(row.line)
  return items, truncated


# ------------------------------------------------------------------ batching
def chunks(items: Sequence[Item], batch_size: int) -> Iterator[tuple[list[Item], int]]:
  """(batch_size items, how many are real): the last chunk is filled up with copies of
  its last item (a real input: no all-padding row reaches the model)."""
  for start in range(0, len(items), batch_size):
    chunk = list(items[start:start + batch_size])
    num_real = len(chunk)
    yield chunk + [chunk[-1]] * (batch_size - num_real), num_real


def bucket_width(longest: int, cap: Optional[int] = None, multiple: int = 16) -> int:
  """longest rounded up to a multiple (fewer shapes to compile), at most cap."""
  width = multiple * math.ceil(longest / multiple)
  return width if cap is None else max(longest, min(width, cap))


def right_pad(seqs: Sequence[np.ndarray], width: int, pad_id: int = 0
              ) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [B, width] padded on the right with pad_id, valid [B, width] int32 1/0)."""
  tokens = np.full((len(seqs), width), pad_id, np.int32)
  valid = np.zeros((len(seqs), width), np.int32)
  for b, seq in enumerate(seqs):
    tokens[b, :len(seq)], valid[b, :len(seq)] = seq, 1
  return tokens, valid


def generate_features(chunk: Sequence[Item], model, cap: Optional[int]) -> dict:
  """Decoder: right-padded prompts + decoder_segment_ids; enc-dec: encoder_input_tokens."""
  tokens, valid = right_pad([i.ids for i in chunk],
                            bucket_width(max(len(i.ids) for i in chunk), cap))
  if model.continues_prompt:
    return {"decoder_input_tokens": tokens, "decoder_segment_ids": valid}
  return {"encoder_input_tokens": tokens}


def score_features(chunk: Sequence[Item], model, cap: Optional[int]) -> dict:
  """Teacher-forcing features (targets shifted right, weights on the scored tokens)."""
  if model.continues_prompt:  # one sequence BOS prompt target; only target tokens count
    seqs = [np.concatenate([i.ids, i.target_ids]) for i in chunk]
    inputs = [s[:-1] for s in seqs]
    weights = [(np.arange(len(s) - 1) >= len(i.ids) - 1).astype(np.int32)
               for s, i in zip(seqs, chunk)]
    width = bucket_width(max(len(s) for s in inputs), cap)
    input_tokens, valid = right_pad(inputs, width)
    return {"decoder_input_tokens": input_tokens, "decoder_segment_ids": valid,
            "decoder_target_tokens": right_pad([s[1:] for s in seqs], width)[0],
            "decoder_loss_weights": right_pad(weights, width)[0]}
  targets = [i.target_ids for i in chunk]
  width = bucket_width(max(len(t) for t in targets))
  target_tokens, weights = right_pad(targets, width)
  return {"encoder_input_tokens": generate_features(chunk, model, cap)["encoder_input_tokens"],
          "decoder_input_tokens": right_pad([np.append(BOS_ID, t[:-1]) for t in targets],
                                            width)[0],
          "decoder_target_tokens": target_tokens, "decoder_loss_weights": weights}


def fill_mask_features(chunk: Sequence[Item], mask_id: int, cap: Optional[int]) -> dict:
  """encoder_input_tokens, encoder_type_ids (all 0: one sentence) and mlm_positions
  [B, P] (each row's mask positions, padded with 0; P >= 1)."""
  tokens, _ = right_pad([i.ids for i in chunk],
                        bucket_width(max(len(i.ids) for i in chunk), cap))
  positions = [np.flatnonzero(i.ids == mask_id) for i in chunk]
  mlm_positions, _ = right_pad(positions, max(1, max(len(p) for p in positions)))
  return {"encoder_input_tokens": tokens, "encoder_type_ids": np.zeros_like(tokens),
          "mlm_positions": mlm_positions}


# ------------------------------------------------------------------ output rows
def generation_row(row: Row, tokens: np.ndarray, score: float, vocab) -> dict:
  """{"line", "text", "output", "tokens", "score"}; tokens stop before the first eos."""
  tokens = [int(t) for t in tokens]
  if vocab.eos_id is not None and vocab.eos_id in tokens:
    tokens = tokens[:tokens.index(vocab.eos_id)]
  return {"line": row.line, "text": row.text, "output": vocab.decode(tokens),
          "tokens": tokens, "score": float(score)}


def score_row(row: Row, log_likelihood: float, num_tokens: int) -> dict:
  return {"line": row.line, "text": row.text, "target": row.target,
          "log_likelihood": float(log_likelihood), "num_tokens": int(num_tokens)}


def fill_mask_row(item: Item, top_probs: np.ndarray, top_ids: np.ndarray, vocab) -> dict:
  """top_probs, top_ids: [P, K] for the item's masks in order (extra rows ignored)."""
  num_masks = int(np.sum(item.ids == vocab.mask_id))
  predictions = [[{"token": vocab.piece(int(i)), "id": int(i), "prob": float(p)}
                  for p, i in zip(top_probs[m], top_ids[m])] for m in range(num_masks)]
  return {"line": item.row.line, "text": item.row.text, "predictions": predictions}
