"""Fine-tuning data: CSV (with a header row) or JSONL files -> Examples.

  cfg = DataConfig(task="classification", text_column="sentence", label_column="label")
  train = read_examples("train.csv", cfg)                 # labels collected, sorted
  dev = read_examples("dev.jsonl", cfg, labels=train.labels)

Tasks and the columns they read:
  classification        text, optional text_pair, label (a string, mapped through the
                        label list: config.labels, the `labels` argument, or every label
                        of the file itself in sorted order)
  token_classification  text (whitespace-separated words), label = one tag per word
                        (JSONL: a list of strings or one space-separated string;
                        CSV: space-separated)
  span_extraction       text (the question), text_pair (the context), answer text and
                        answer start (a character offset into the context, SQuAD-style;
                        an empty answer means "no answer")

Bad input raises DataError naming the file and the physical line (1-based, the CSV
header is line 1; a quoted CSV field spanning lines reports the line the row starts
on): a missing column, an empty text, malformed JSON, a label outside the label list,
a tag count that is not the word count, an answer that is not at its start offset, or
invalid UTF-8. With skip_bad_rows=True such rows (not invalid UTF-8: that is the
file's fault) are skipped and counted in `stats` instead; nothing is dropped silently.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import io
import json
import os
from typing import Any, Iterator, Optional, Sequence

from t5x_like.errors import UserError

TASKS = ("classification", "token_classification", "span_extraction")
_MAX_REPORTED = 10  # bad rows whose messages stats keeps


class DataError(UserError, ValueError):
  """A bad row: `path`:`line` and what is wrong with it."""

  def __init__(self, path: str, line: int, problem: str):
    super().__init__(f"{path}:{line}: {problem}")
    self.path, self.line, self.problem = path, line, problem


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Which task, which columns (CSV header names / JSON keys), how to treat bad rows."""

  task: str = "classification"
  text_column: str = "text"
  text_pair_column: Optional[str] = None
  label_column: str = "label"
  answer_text_column: str = "answer_text"
  answer_start_column: str = "answer_start"
  labels: Optional[tuple[str, ...]] = None  # None: collect from the file, sorted
  skip_bad_rows: bool = False
  file_format: Optional[str] = None  # "csv" | "jsonl"; None: from the file extension

  def __post_init__(self):
    if self.task not in TASKS:
      raise ValueError(f"DataConfig.task={self.task!r}: expected one of {TASKS}")
    if self.task == "span_extraction" and not self.text_pair_column:
      raise ValueError("DataConfig: span_extraction needs text_pair_column (the context)")
    if self.labels is not None:
      object.__setattr__(self, "labels", tuple(self.labels))


@dataclasses.dataclass(frozen=True)
class Example:
  """One row. label: class index (classification); tags: one label index per word of
  `text` (token classification); answer_*: the answer in text_pair (span extraction,
  answer_start -1 when there is none). line: where the row starts in its file."""

  text: str
  text_pair: Optional[str] = None
  label: Optional[int] = None
  tags: Optional[tuple[int, ...]] = None
  answer_text: Optional[str] = None
  answer_start: Optional[int] = None
  line: int = 0

  @property
  def words(self) -> list[str]:
    return self.text.split()


@dataclasses.dataclass
class Dataset:
  """Examples of one file, the label list they index, and what was read / skipped."""

  path: str
  examples: list[Example]
  labels: tuple[str, ...]
  stats: dict[str, Any]


class _BadRow(Exception):
  def __init__(self, reason: str, problem: str):
    super().__init__(problem)
    self.reason, self.problem = reason, problem


# ------------------------------------------------------------------ raw rows
def _file_format(path: str, config: DataConfig) -> str:
  if config.file_format:
    if config.file_format not in ("csv", "jsonl"):
      raise ValueError(f"DataConfig.file_format={config.file_format!r}: expected csv or jsonl")
    return config.file_format
  ext = os.path.splitext(path)[1].lower()
  if ext in (".csv",):
    return "csv"
  if ext in (".jsonl", ".json"):
    return "jsonl"
  raise ValueError(f"{path}: cannot tell the format from the extension {ext!r};"
                   " set DataConfig.file_format to 'csv' or 'jsonl'")


def _decode(path: str, data: bytes, line_offset: int = 0) -> str:
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    line = line_offset + data[:e.start].count(b"\n") + 1
    raise DataError(path, line, f"invalid UTF-8 ({e.reason})") from None


def _csv_rows(path: str, required: Sequence[str]) -> Iterator[tuple[int, Any]]:
  """(line, {column: value} or _BadRow) per row; blank lines yield (line, None)."""
  with open(path, "rb") as f:
    text = _decode(path, f.read())
  if text.startswith("\ufeff"):  # a byte order mark is not part of the first column name
    text = text[1:]
  reader = csv.reader(io.StringIO(text, newline=""))
  try:
    header = next(reader)
  except StopIteration:
    raise DataError(path, 1, "empty file: expected a header row") from None
  absent = [c for c in required if c not in header]
  if absent:
    raise DataError(path, 1, f"header has no column {absent[0]!r} (columns: {header})")
  while True:
    start = reader.line_num + 1
    try:
      fields = next(reader)
    except StopIteration:
      return
    except csv.Error as e:
      yield start, _BadRow("malformed_csv", f"malformed CSV: {e}")
      continue
    if not fields:
      yield start, None
    elif len(fields) < len(header):
      yield start, _BadRow("missing_column",
                           f"row has {len(fields)} fields but the header has {len(header)}:"
                           f" column {header[len(fields)]!r} is missing")
    elif len(fields) > len(header):
      yield start, _BadRow("extra_fields", f"row has {len(fields)} fields but the header"
                           f" has {len(header)}")
    else:
      yield start, dict(zip(header, fields))


def _jsonl_rows(path: str) -> Iterator[tuple[int, Any]]:
  with open(path, "rb") as f:
    for number, raw in enumerate(f, start=1):
      line = _decode(path, raw, number - 1)
      if not line.strip():
        yield number, None
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        yield number, _BadRow("malformed_json", f"malformed JSON: {e.msg} (column {e.colno})")
        continue
      if not isinstance(record, dict):
        yield number, _BadRow("malformed_json",
                              f"expected a JSON object, got {type(record).__name__}")
        continue
      yield number, record


# ------------------------------------------------------------------ fields
def _field(record: dict, column: str) -> Any:
  if column not in record or record[column] is None:
    raise _BadRow("missing_column", f"column {column!r} is missing")
  return record[column]


def _text(record: dict, column: str) -> str:
  value = _field(record, column)
  if not isinstance(value, str):
    raise _BadRow("bad_value", f"column {column!r} is not a string: {value!r}")
  if not value.strip():
    raise _BadRow("empty_text", f"column {column!r} is empty")
  return value


def _label_string(value: Any, column: str) -> str:
  if isinstance(value, bool) or not isinstance(value, (str, int)):
    raise _BadRow("bad_value", f"column {column!r}: a label must be a string, got {value!r}")
  value = str(value).strip()
  if not value:
    raise _BadRow("missing_column", f"column {column!r} is empty")
  return value


def _tag_strings(value: Any, column: str) -> list[str]:
  if isinstance(value, str):
    return value.split()
  if isinstance(value, list):
    return [_label_string(v, column) for v in value]
  raise _BadRow("bad_value", f"column {column!r}: tags must be a list or a string")


def _raw_labels(record: dict, config: DataConfig) -> list[str]:
  """The label strings of a record (one for classification, one per word for tags)."""
  value = _field(record, config.label_column)
  if config.task == "classification":
    return [_label_string(value, config.label_column)]
  if config.task == "token_classification":
    return _tag_strings(value, config.label_column)
  return []


def _index(label: str, lookup: dict[str, int], labels: tuple[str, ...]) -> int:
  if label not in lookup:
    shown = list(labels[:20]) + (["..."] if len(labels) > 20 else [])
    raise _BadRow("unknown_label", f"label {label!r} is not in the label list {shown}")
  return lookup[label]


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
  raise _BadRow("bad_value", f"column {column!r} is not an integer: {value!r}")


def _example(record: dict, line: int, config: DataConfig, lookup: dict[str, int],
             labels: tuple[str, ...]) -> Example:
  text = _text(record, config.text_column)
  pair = _text(record, config.text_pair_column) if config.text_pair_column else None
  if config.task == "classification":
    (label,) = _raw_labels(record, config)
    return Example(text, pair, label=_index(label, lookup, labels), line=line)
  if config.task == "token_classification":
    tags = _raw_labels(record, config)
    words = text.split()
    if len(tags) != len(words):
      raise _BadRow("bad_value", f"{len(tags)} tags for {len(words)} words")
    return Example(text, pair, tags=tuple(_index(t, lookup, labels) for t in tags), line=line)
  answer = _field(record, config.answer_text_column)
  if not isinstance(answer, str):
    raise _BadRow("bad_value", f"column {config.answer_text_column!r} is not a string")
  if not answer.strip():
    return Example(text, pair, answer_text="", answer_start=-1, line=line)
  start = _answer_start(_field(record, config.answer_start_column), config.answer_start_column)
  if start < 0 or pair[start:start + len(answer)] != answer:
    raise _BadRow("bad_value", f"answer {answer!r} is not at character {start} of the context"
                  f" (found {pair[max(start, 0):max(start, 0) + len(answer)]!r})")
  return Example(text, pair, answer_text=answer, answer_start=start, line=line)


# ------------------------------------------------------------------ public
def read_examples(path: str, config: DataConfig,
                  labels: Optional[Sequence[str]] = None) -> Dataset:
  """Reads one CSV / JSONL file into a Dataset (see the module doc).

  labels: the label list (e.g. the training file's, for a dev file); default
  config.labels, else every label (tag) of this file in sorted order.
  stats: rows, examples, bad_rows, blank_lines, bad_row_reasons {reason: count} and
  bad_row_messages (the first few "path:line: problem").
  """
  path = os.fspath(path)
  fmt = _file_format(path, config)
  required = [config.text_column] + ([config.text_pair_column] if config.text_pair_column else [])
  if config.task == "span_extraction":
    required += [config.answer_text_column]
  else:
    required += [config.label_column]
  rows = list(_csv_rows(path, required) if fmt == "csv" else _jsonl_rows(path))
  stats = dict(rows=0, examples=0, bad_rows=0, blank_lines=0,
               bad_row_reasons=collections.Counter(), bad_row_messages=[])

  def bad(line: int, row: _BadRow) -> None:
    if not config.skip_bad_rows:
      raise DataError(path, line, row.problem)
    stats["bad_rows"] += 1
    stats["bad_row_reasons"][row.reason] += 1
    if len(stats["bad_row_messages"]) < _MAX_REPORTED:
      stats["bad_row_messages"].append(f"{path}:{line}: {row.problem}")

  label_list = labels if labels is not None else config.labels
  if label_list is None and config.task != "span_extraction":
    seen = set()
    for _, record in rows:
      if isinstance(record, dict):
        try:  # labels of rows with usable texts only; bad rows are reported below
          _text(record, config.text_column)
          if config.text_pair_column:
            _text(record, config.text_pair_column)
          seen.update(_raw_labels(record, config))
        except _BadRow:
          pass
    label_list = sorted(seen)
  label_list = tuple(label_list or ())
  lookup = {label: i for i, label in enumerate(label_list)}

  examples = []
  for line, record in rows:
    if record is None:
      stats["blank_lines"] += 1
      continue
    stats["rows"] += 1
    if isinstance(record, _BadRow):
      bad(line, record)
      continue
    try:
      examples.append(_example(record, line, config, lookup, label_list))
    except _BadRow as row:
      bad(line, row)
  stats["examples"] = len(examples)
  stats["bad_row_reasons"] = dict(stats["bad_row_reasons"])
  return Dataset(path, examples, label_list, stats)
