"""Examples -> fixed-length int32 features (the batch names of models/model.py): the
pieces tasks build their encodings from, and `encode_examples` for a whole file.

  encoder pair (BERT):     [CLS] a [SEP] (b [SEP]), encoder_type_ids 0 / 1, the longer
                           side truncated first (BERT's run_classifier)
  decoder pair (GPT):      a (eos b) eos, decoder_segment_ids 1 on real tokens
  text to text (T5):       inputs "prefix: a (pair: b)" + eos, targets = the label
                           string's tokens + eos
  T5's encoder alone:      the same inputs, no targets (a head on the encoder's states)

Padding id is 0 everywhere (the encoder masks padding by token id).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from t5x_like.data.objective import Objective
from t5x_like.finetune import padding
from t5x_like.finetune.task import Example, Task
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


def pad(ids: Sequence[int], length: int, value: int = 0) -> np.ndarray:
  out = np.full(length, value, np.int32)
  out[:len(ids)] = ids
  return out


def check_encoder_tokenizer(tokenizer: Tokenizer) -> None:
  if tokenizer.cls_id is None or tokenizer.sep_id is None:
    raise ValueError(f"{tokenizer!r} has no [CLS] / [SEP]: encoder features need a BERT vocab")
  if tokenizer.pad_id != 0:
    raise ValueError(f"{tokenizer!r}: padding must be id 0 (the encoder masks token id 0),"
                     f" got pad_id={tokenizer.pad_id}")


def encoder_pair(tokenizer: Tokenizer, a: list[int], b: Optional[list[int]], max_length: int
                 ) -> tuple[Features, bool]:
  """[CLS] a [SEP] (b [SEP]) padded to max_length, and whether anything was cut."""
  check_encoder_tokenizer(tokenizer)
  specials = 3 if b is not None else 2
  ta, tb = truncate_pair(a, b, max_length - specials)
  truncated = len(ta) < len(a) or (b is not None and len(tb) < len(b))
  tokens = [tokenizer.cls_id] + ta + [tokenizer.sep_id]
  types = [0] * len(tokens)
  if tb is not None:
    tokens += tb + [tokenizer.sep_id]
    types += [1] * (len(tb) + 1)
  return {"encoder_input_tokens": pad(tokens, max_length),
          "encoder_type_ids": pad(types, max_length)}, truncated


# ------------------------------------------------------------------ text (pairs)
def encode_encoder_pair(tokenizer: Tokenizer, example: Example, max_length: int
                        ) -> tuple[Features, bool]:
  """encoder_input_tokens, encoder_type_ids [L] of [CLS] text [SEP] (pair [SEP]), and
  whether it was cut."""
  a = tokenizer.encode(example.text)
  b = tokenizer.encode(example.text_pair) if example.text_pair is not None else None
  return encoder_pair(tokenizer, a, b, max_length)


def encode_decoder_pair(tokenizer: Tokenizer, example: Example, max_length: int
                        ) -> tuple[Features, bool]:
  """decoder_input_tokens, decoder_segment_ids [L] of text (eos pair) eos. The final eos
  (when the vocab has one) is where a head reads."""
  eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
  a = tokenizer.encode(example.text)
  b = tokenizer.encode(example.text_pair) if example.text_pair is not None else None
  specials = len(eos) * (2 if b is not None else 1)
  ta, tb = truncate_pair(a, b, max_length - specials)
  truncated = len(ta) < len(a) or (b is not None and len(tb) < len(b))
  tokens = ta + eos + (tb + eos if tb is not None else [])
  return {"decoder_input_tokens": pad(tokens, max_length, tokenizer.pad_id),
          "decoder_segment_ids": pad([1] * len(tokens), max_length)}, truncated


PAIR_ENCODINGS = {"encoder": encode_encoder_pair, "decoder": encode_decoder_pair}


def encode_pair(tokenizer: Tokenizer, example: Example, family: str, max_length: int
                ) -> tuple[Features, bool]:
  """The text (pair) as the `family`'s model reads it (PAIR_ENCODINGS), and whether it
  was cut."""
  return PAIR_ENCODINGS[family](tokenizer, example, max_length)


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
    rows.append(pad(ids, target_length))
  return np.stack(rows)


def encode_t5_inputs(tokenizer: Tokenizer, example: Example, max_length: int,
                     task_prefix: str, pair_prefix: str = "pair") -> tuple[Features, bool]:
  """encoder_input_tokens [L]: "prefix: text (pair: text_pair)" + eos, cut to max_length;
  and whether it was cut."""
  if tokenizer.eos_id is None:
    raise ValueError(f"{tokenizer!r} has no eos: T5's inputs need a T5 vocabulary")
  ids = tokenizer.encode(text_to_text_input(example, task_prefix, pair_prefix))
  truncated = len(ids) > max_length - 1
  ids = ids[:max_length - 1] + [tokenizer.eos_id]
  return {"encoder_input_tokens": pad(ids, max_length)}, truncated


def encode_text_to_text(tokenizer: Tokenizer, example: Example, label_names: Sequence[str],
                        max_length: int, target_length: int, task_prefix: str,
                        pair_prefix: str = "pair") -> tuple[Features, bool]:
  """encoder_input_tokens [L] (encode_t5_inputs); decoder_target_tokens,
  decoder_input_tokens (shifted right), decoder_loss_weights [T]: the label string +
  eos; labels []."""
  if label_names is None:
    raise ValueError("text to text needs label_names (the label strings)")
  features, truncated = encode_t5_inputs(tokenizer, example, max_length, task_prefix,
                                         pair_prefix)
  targets = label_targets(tokenizer, [label_names[example.label]], target_length)[0]
  inputs = np.concatenate([[0], targets[:-1]]).astype(np.int32)  # shifted right, 0 = start
  return {**features, "decoder_input_tokens": inputs, "decoder_target_tokens": targets,
          "decoder_loss_weights": (targets > 0).astype(np.int32),
          "labels": np.int32(example.label)}, truncated


# ------------------------------------------------------------------ batches
def encode_examples(examples: Sequence[Example], tokenizer: Tokenizer, task: Task, *,
                    family: str = "encoder", label_names: Optional[Sequence[str]] = None,
                    training: bool = False) -> tuple[Features, dict[str, int]]:
  """Every example encoded by `task` for a `family` backbone and stacked:
  {feature: [N, ...]}, and stats {examples, <task.encode_flag>: count}. A task whose
  examples span several rows (Task.encode) gives every row, with example_index [N] and
  stats["rows"]. training: the training split's rows (Task.encode_for_training)."""
  if family not in task.families:
    raise ValueError(f"task {task.name!r} has no encoding for the {family!r} family"
                     f" (it supports {', '.join(task.families)})")
  rows, flags = [], []
  for k, example in enumerate(examples):
    encode = task.encode_for_training if training else task.encode
    features, flag = encode(example, tokenizer, family, label_names)
    if isinstance(features, list):
      rows.extend({**row, "example_index": np.int32(k)} for row in features)
    else:
      rows.append(features)
    flags.append(flag)
  if not rows:
    raise ValueError("no examples to encode")
  batch = {name: np.stack([r[name] for r in rows]) for name in rows[0]}
  stats = {"examples": len(flags), task.encode_flag: int(sum(flags))}
  if "example_index" in batch:
    stats["rows"] = len(rows)
  return batch, stats


class EncodedRows(Objective):
  """Encoded rows {feature: [N, ...]} as an Objective for the training loader (use it
  with shuffle=False): epoch e reads the rows in the seeded permutation
  default_rng([seed, e]), so global batch s holds rows s*B .. (s+1)*B - 1 of the
  concatenated per-epoch permutations, on any host, after any restart. padding_groups
  (Task.padding_groups): each batch is cut to its longest row (finetune/padding.py)."""

  def __init__(self, features: Features, seed: int, padding_groups: Sequence = ()):
    self.features, self.seed = features, seed
    self.padding_groups = tuple(padding_groups)
    self.fits_batches = bool(self.padding_groups)
    self.num_rows = next(iter(features.values())).shape[0]
    self._orders: dict[int, np.ndarray] = {}

  def num_examples(self, epoch: int) -> int:
    return self.num_rows

  def _rows(self, indices: np.ndarray, epoch: int) -> np.ndarray:
    if epoch not in self._orders:
      if len(self._orders) > 1:  # a batch reaches two epochs at most
        self._orders.pop(min(self._orders))
      self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(
          self.num_rows)
    return self._orders[epoch][np.asarray(indices)]

  def examples(self, indices: np.ndarray, epoch: int) -> Features:
    rows = self._rows(indices, epoch)
    return {k: v[rows] for k, v in self.features.items()}

  def fit_batch(self, batch: Features, global_runs) -> Features:
    rows = np.concatenate([self._rows(indices, epoch) for epoch, indices in global_runs])
    keys = [key for key, _ in self.padding_groups if key in self.features]
    lengths = padding.cut_lengths({k: self.features[k][rows] for k in keys},
                                  self.padding_groups)
    return padding.cut(batch, lengths)
