"""Fine-tuning data: CSV (with a header row) or JSONL files -> Examples, by a task.

  task = make_task("classification", text_column="sentence", label_column="label")
  train = read_examples("train.csv", task)                 # labels collected, sorted
  dev = read_examples("dev.jsonl", task, labels=train.labels)

The task (t5x_like/finetune/tasks/) says which columns a row needs and how it becomes
an Example; this module reads the files and handles bad rows.

Bad input raises DataError naming the file and the physical line (1-based, the CSV
header is line 1; a quoted CSV field spanning lines reports the line the row starts
on): a missing column, an empty text, malformed JSON, a label outside the label list,
or whatever else the task refuses (BadRow), or invalid UTF-8. With
task.skip_bad_rows such rows (not invalid UTF-8: that is the file's fault) are
skipped and counted in `stats` instead; nothing is dropped silently.
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
from t5x_like.finetune.task import BadRow, Example, Task

_MAX_REPORTED = 10  # bad rows whose messages stats keeps


class DataError(UserError, ValueError):
  """A bad row: `path`:`line` and what is wrong with it."""

  def __init__(self, path: str, line: int, problem: str):
    super().__init__(f"{path}:{line}: {problem}")
    self.path, self.line, self.problem = path, line, problem


@dataclasses.dataclass
class Dataset:
  """Examples of one file, the label list they index, and what was read / skipped."""

  path: str
  examples: list[Example]
  labels: tuple[str, ...]
  stats: dict[str, Any]
  ids: Optional[list] = None  # a benchmark's example ids (idx), for its submission file
  golds: Optional[list] = None  # a benchmark's gold values (all of SQuAD's answers)
  labeled: bool = True  # False: a test split without labels, predicted only


# ------------------------------------------------------------------ raw rows
def _file_format(path: str, file_format: Optional[str]) -> str:
  if file_format:
    if file_format not in ("csv", "jsonl"):
      raise ValueError(f"file_format={file_format!r}: expected csv or jsonl")
    return file_format
  ext = os.path.splitext(path)[1].lower()
  if ext in (".csv",):
    return "csv"
  if ext in (".jsonl", ".json"):
    return "jsonl"
  raise ValueError(f"{path}: cannot tell the format from the extension {ext!r};"
                   " pass file_format='csv' or 'jsonl'")


def _decode(path: str, data: bytes, line_offset: int = 0) -> str:
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    line = line_offset + data[:e.start].count(b"\n") + 1
    raise DataError(path, line, f"invalid UTF-8 ({e.reason})") from None


def _csv_rows(path: str, required: Sequence[str]) -> Iterator[tuple[int, Any]]:
  """(line, {column: value} or BadRow) per row; blank lines yield (line, None)."""
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
      yield start, BadRow("malformed_csv", f"malformed CSV: {e}")
      continue
    if not fields:
      yield start, None
    elif len(fields) < len(header):
      yield start, BadRow("missing_column",
                           f"row has {len(fields)} fields but the header has {len(header)}:"
                           f" column {header[len(fields)]!r} is missing")
    elif len(fields) > len(header):
      yield start, BadRow("extra_fields", f"row has {len(fields)} fields but the header"
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
        yield number, BadRow("malformed_json", f"malformed JSON: {e.msg} (column {e.colno})")
        continue
      if not isinstance(record, dict):
        yield number, BadRow("malformed_json",
                              f"expected a JSON object, got {type(record).__name__}")
        continue
      yield number, record


# ------------------------------------------------------------------ public
def read_examples(path: str, task: Task, labels: Optional[Sequence[str]] = None,
                  file_format: Optional[str] = None) -> Dataset:
  """Reads one CSV / JSONL file (format from the extension unless file_format says)
  into a Dataset of `task`'s Examples (see the module doc).

  labels: the label list (e.g. the training file's, for a dev file); default
  task.labels, else every label (tag) of this file in sorted order.
  stats: rows, examples, bad_rows, blank_lines, bad_row_reasons {reason: count} and
  bad_row_messages (the first few "path:line: problem").
  """
  path = os.fspath(path)
  task.check_files_options()
  fmt = _file_format(path, file_format)
  rows = list(_csv_rows(path, task.required_columns()) if fmt == "csv" else _jsonl_rows(path))
  return dataset_from_rows(path, rows, task, labels)


def dataset_from_rows(path: str, rows: Sequence[tuple[int, Any]], task: Task,
                      labels: Optional[Sequence[str]] = None) -> Dataset:
  """A Dataset of rows (line, {column: value} | BadRow | None for a blank line) read
  from `path` (a file, or a benchmark's split), as read_examples describes."""
  stats = dict(rows=0, examples=0, bad_rows=0, blank_lines=0,
               bad_row_reasons=collections.Counter(), bad_row_messages=[])

  def bad(line: int, row: BadRow) -> None:
    if not task.skip_bad_rows:
      raise DataError(path, line, row.problem)
    stats["bad_rows"] += 1
    stats["bad_row_reasons"][row.reason] += 1
    if len(stats["bad_row_messages"]) < _MAX_REPORTED:
      stats["bad_row_messages"].append(f"{path}:{line}: {row.problem}")

  label_list = labels if labels is not None else (task.labels or None)
  if label_list is None and task.uses_label_list:
    seen = set()
    for _, record in rows:
      if isinstance(record, dict):
        try:  # labels of rows with usable texts only; bad rows are reported below
          task.texts(record)
          seen.update(task.row_labels(record))
        except BadRow:
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
    if isinstance(record, BadRow):
      bad(line, record)
      continue
    try:
      examples.append(task.parse(record, line, lookup, label_list))
    except BadRow as row:
      bad(line, row)
  stats["examples"] = len(examples)
  stats["bad_row_reasons"] = dict(stats["bad_row_reasons"])
  return Dataset(path, examples, label_list, stats)
