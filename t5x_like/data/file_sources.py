"""Local file sources: `text:GLOB` (one document per file) and `jsonl:GLOB[:FIELD]` (one
document per non-blank line). Globs are relative to the current directory or absolute
(~ expanded, ** recursive); a glob that matches no file, a directory where a glob
belongs and files with no usable document are DataSourceErrors naming the glob and
what it found.
"""

from __future__ import annotations

import bisect
import collections
import glob as globlib
import json
import os
import re

import numpy as np

from t5x_like.data.document_source import (DataSourceError, DocumentSource,
                                           SourceNotFoundError, SourceStats,
                                           files_identity)
from t5x_like.fs import is_url

GLOB_CHARS = re.compile(r"[*?[]")
FIELD_NAME = re.compile(r"^[A-Za-z_][\w.\-]*$")  # a JSONL field a spec can name


def _glob_files(pattern: str, spec: str) -> tuple[list[str], list[str]]:
  """(files as matched, their absolute paths), sorted; a DataSourceError naming `pattern`."""
  if is_url(pattern):
    raise DataSourceError(f"source {spec!r}: text and jsonl sources read local files, not"
                          f" {pattern!r}; copy the files to a local disk")
  expanded = os.path.expanduser(pattern)
  matches = sorted(globlib.glob(expanded, recursive=True))
  files = [f for f in matches if os.path.isfile(f)]
  if not files:
    raise SourceNotFoundError(_no_files_message(pattern, expanded, matches, spec))
  # Absolute: reads must not depend on the current directory of a later moment.
  return files, [os.path.abspath(f) for f in files]


def _no_files_message(pattern: str, expanded: str, matches: list[str], spec: str) -> str:
  """Why `pattern` matches no file, and what the user probably meant."""
  kind = spec.partition(":")[0]
  respec = lambda new: f"{kind}:{new}{spec[len(kind) + 1 + len(pattern):]}"  # field kept
  if os.path.isdir(expanded):
    glob = os.path.join(pattern, _likely_glob(expanded, kind))
    return (f"{pattern!r} is a directory, not a glob of files (source {spec!r});"
            f" did you mean {respec(glob)!r}?")
  if matches:
    glob = os.path.join(pattern, "*.jsonl" if kind == "jsonl" else "*.txt")
    return (f"{pattern!r} matches only directories, e.g. {matches[0]!r} (source {spec!r});"
            f" did you mean {respec(glob)!r}?")
  where = "" if os.path.isabs(expanded) else f", relative to {os.getcwd()!r}"
  parts = expanded.split(os.sep)
  fixed = next((i for i, part in enumerate(parts) if GLOB_CHARS.search(part)), len(parts) - 1)
  base = os.sep.join(parts[:fixed]) or ("/" if expanded.startswith(os.sep) else ".")
  if not os.path.isdir(base):
    why = f"directory {base!r} does not exist"
  elif fixed == len(parts) - 1 and not GLOB_CHARS.search(parts[-1]):
    why = "no such file"
  else:
    names = sorted(os.listdir(base))
    why = (f"{base!r} holds {_count(len(names), 'entry', 'entries')}, e.g."
           f" {', '.join(map(repr, names[:3]))}" if names else f"directory {base!r} is empty")
  return f"no files match {pattern!r} (source {spec!r}{where}): {why}"


def _count(n: int, one: str, many: str) -> str:
  return f"{n} {one if n == 1 else many}"


def _likely_glob(directory: str, kind: str) -> str:
  """A glob for the files of `directory`: '*.EXT' with its most common extension."""
  default = "*.jsonl" if kind == "jsonl" else "*.txt"
  with os.scandir(directory) as entries:
    names = [e.name for e in entries if e.is_file() and not e.name.startswith(".")]
  if not names:
    return os.path.join("**", default)
  extensions = collections.Counter(os.path.splitext(n)[1] for n in names)
  ext, _ = extensions.most_common(1)[0]
  return "*" + ext if ext else "*"


class TextFiles(DocumentSource):
  """Every file matching `pattern` (sorted) is one UTF-8 document.

  files: the absolute paths; shown_files: as matched (relative when `pattern` is).
  """

  def __init__(self, pattern: str):
    self.pattern = pattern
    self.shown_files, self.files = _glob_files(pattern, self.spec)
    self.stats = SourceStats(self.spec)
    self._require_a_document()

  @property
  def spec(self):
    return f"text:{self.pattern}"

  def __len__(self):
    return len(self.files)

  def _read(self, index):
    with open(self.files[index], "rb") as f:
      return self._decode(f.read(), index)

  def _where(self, index):
    return self.shown_files[index]

  def _why_no_document(self):
    n = len(self.files)
    files = f"its only file {self.shown_files[0]!r} is" if n == 1 else f"all its {n} files are"
    return (f"no document in {self.pattern!r} (source {self.spec!r}): {files} empty or"
            " whitespace only")

  def identity(self):
    return files_identity("text", self.files)


class JsonlFiles(DocumentSource):
  """Every non-blank line of the files matching `pattern` is one JSON document.

  The line offsets are indexed once (a byte scan, no parsing); lines are parsed on
  read, so a malformed line costs nothing until it is reached.
  """

  def __init__(self, pattern: str, field: str = "text"):
    self.pattern, self.field = pattern, field
    self.shown_files, self.files = _glob_files(pattern, self.spec)
    self.stats = SourceStats(f"jsonl:{pattern}")
    self._open = None  # (file number, open binary file)
    self._starts, self._ends, self._line_numbers, self._file_first = [], [], [], [0]
    for path in self.files:
      starts, ends, numbers = _nonblank_lines(path)
      self._starts.append(starts)
      self._ends.append(ends)
      self._line_numbers.append(numbers)
      self._file_first.append(self._file_first[-1] + len(starts))
    self._require_a_document()

  @property
  def spec(self):
    return f"jsonl:{self.pattern}" + (f":{self.field}" if self.field != "text" else "")

  def __len__(self):
    return self._file_first[-1]

  def _locate(self, index):
    f = bisect.bisect_right(self._file_first, index) - 1
    return f, index - self._file_first[f]

  def _where(self, index):
    f, j = self._locate(index)
    return f"{self.shown_files[f]}:{self._line_numbers[f][j]}"

  def _parse(self, index):
    """(the decoded line, its JSON value or None where it does not parse)."""
    f, j = self._locate(index)
    if self._open is None or self._open[0] != f:  # keep one file open: reads go in order
      if self._open is not None:
        self._open[1].close()
      self._open = (f, open(self.files[f], "rb"))
    fh = self._open[1]
    fh.seek(int(self._starts[f][j]))
    text = self._decode(fh.read(int(self._ends[f][j] - self._starts[f][j])), index)
    try:
      return text, json.loads(text)
    except json.JSONDecodeError:
      return text, None

  def _read(self, index):
    _, record = self._parse(index)
    if not isinstance(record, dict):
      self.stats.record("malformed_json", index, self._where(index))
      return None
    value = record.get(self.field)
    if not isinstance(value, str):
      self.stats.record("missing_field", index,
                        f"{self._where(index)} (field {self.field!r})")
      return None
    return value

  def _why_no_document(self):
    head = f"no document in {self.pattern!r} (source {self.spec!r})"
    n, counts = len(self), self.stats.as_dict()
    if n == 0:
      files = (f"its only file {self.shown_files[0]!r} is" if len(self.files) == 1
               else f"all its {len(self.files)} files are")
      return f"{head}: {files} empty or whitespace only"
    if counts["malformed_json"] == n:  # e.g. a jsonl glob over plain text files
      text, _ = self._parse(0)
      return (f"{head}: {self.shown_files[0]!r} is not JSON lines (line"
              f" {self._line_numbers[0][0]} reads {text[:40]!r}); for plain text use"
              f" 'text:{self.pattern}'")
    if counts["missing_field"] == n:
      record = self._parse(0)[1]  # a JSON object: malformed rows are not counted here
      strings = [k for k, v in record.items() if isinstance(v, str) and FIELD_NAME.match(k)]
      hint = f"; did you mean 'jsonl:{self.pattern}:{strings[0]}'?" if strings else ""
      return (f"{head}: no row has a string field {self.field!r}; the first row has fields"
              f" {sorted(record)[:10]}{hint}")
    if counts["empty_documents"] == n:
      return f"{head}: the field {self.field!r} is empty or whitespace in all {n} rows"
    parts = [_count(counts["malformed_json"], "is not a JSON object", "are not JSON objects"),
             _count(counts["missing_field"], f"lacks a string field {self.field!r}",
                    f"lack a string field {self.field!r}"),
             _count(counts["empty_documents"], "is empty", "are empty")]
    return (f"{head}: none of its {n} rows is usable ("
            + ", ".join(p for p in parts if not p.startswith("0 ")) + ")")

  def identity(self):
    return files_identity("jsonl", self.files, self.field)

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_open"] = None  # file handles do not pickle; reopened on first read
    return state


def _nonblank_lines(path: str):
  """Byte [start, end) offsets and 1-based numbers of the non-blank lines of a file."""
  data = np.fromfile(path, np.uint8)
  newlines = np.flatnonzero(data == ord("\n"))
  starts = np.concatenate([[0], newlines + 1])
  ends = np.concatenate([newlines, [len(data)]])
  numbers = np.arange(1, len(starts) + 1)
  visible = np.isin(data, np.frombuffer(b" \t\r\n\x0b\x0c", np.uint8), invert=True)
  visible_before = np.concatenate([[0], np.cumsum(visible)])
  keep = visible_before[ends] > visible_before[starts]
  return starts[keep], ends[keep], numbers[keep]
