"""Random-access document sources: `len(source)`, `source[i] -> str`.

One item is one document (a book, a file, a JSON line, a TFDS record); documents
keep their boundaries. Bad input never crashes a source, it is counted in
`source.stats` (and logged with file:line where there is one):
  empty_documents  whitespace-only documents: `source[i]` returns "" (skip it)
  invalid_utf8     documents decoded with U+FFFD replacement characters
  malformed_json   JSONL lines that do not parse, or are not objects: returns ""
  missing_field    JSON lines / records without a string field: returns ""
Each document is counted at most once per reason however often it is read, so after
one full pass the counters describe the whole source. A path or glob that matches
nothing raises FileNotFoundError naming it.

Specs (`source_from_spec`), for the CLI and configs:
  embedded                           the 8 books of t5x_like.corpus
  embedded:NAME[,NAME...]            some of them (file stems)
  text:GLOB                          one document per file
  jsonl:GLOB[:FIELD]                 one document per line, FIELD defaults to "text"
  tfds:NAME[/CONFIG][:SPLIT][@DATA_DIR][#FIELD]
                                     split "train", field "text" by default
"""

from __future__ import annotations

import abc
import bisect
import collections
import glob as globlib
import hashlib
import json
import logging
import os
import re

import numpy as np

log = logging.getLogger(__name__)

SPEC_FORMS = ("embedded", "embedded:NAME[,NAME...]", "text:GLOB", "jsonl:GLOB[:FIELD]",
              "tfds:NAME[/CONFIG][:SPLIT][@DATA_DIR][#FIELD]")
_MAX_WARNINGS = 10  # per reason and source; the counters keep counting


class SourceStats:
  """Counters of bad input, each document counted at most once per reason."""

  REASONS = ("empty_documents", "invalid_utf8", "malformed_json", "missing_field")

  def __init__(self, name: str):
    self.name = name
    self._seen = collections.defaultdict(set)

  def record(self, reason: str, index: int, where: str = "") -> None:
    seen = self._seen[reason]
    if index in seen:
      return
    seen.add(index)
    if len(seen) <= _MAX_WARNINGS:
      log.warning("%s: %s at %s%s", self.name, reason.replace("_", " "), where or f"#{index}",
                  " (further ones are only counted)" if len(seen) == _MAX_WARNINGS else "")

  def as_dict(self) -> dict[str, int]:
    return {r: len(self._seen.get(r, ())) for r in self.REASONS}

  def __repr__(self):
    return f"SourceStats({self.name}: {self.as_dict()})"


class DocumentSource(abc.ABC):
  """Base class: subclasses set `self.stats` and implement __len__, _read, identity."""

  stats: SourceStats

  @abc.abstractmethod
  def __len__(self) -> int:
    """Number of documents, usable or not."""

  def __getitem__(self, index: int) -> str:
    """Document `index` as text; "" for an unusable one (counted in `stats`)."""
    n = len(self)
    if not -n <= index < n:
      raise IndexError(f"document {index} out of range for {n} documents")
    index %= n
    text = self._read(index)
    if text and not text.isspace():
      return text
    if text is not None:  # None: already counted as malformed / missing field
      self.stats.record("empty_documents", index, self._where(index))
    return ""

  def __iter__(self):
    """The usable documents, in order (empty and malformed ones are skipped)."""
    for i in range(len(self)):
      text = self[i]
      if text:
        yield text

  @abc.abstractmethod
  def identity(self) -> str:
    """A string that changes whenever the documents may have changed (cache keys)."""

  @abc.abstractmethod
  def _read(self, index: int) -> str | None:
    """Raw text of document `index`; None when it was counted as malformed."""

  def _where(self, index: int) -> str:
    return f"#{index}"

  def _decode(self, data: bytes, index: int) -> str:
    try:
      return data.decode("utf-8")
    except UnicodeDecodeError:
      self.stats.record("invalid_utf8", index, self._where(index))
      return data.decode("utf-8", errors="replace")


def _glob_files(pattern: str) -> list[str]:
  pattern = os.path.expanduser(pattern)
  files = sorted(f for f in globlib.glob(pattern, recursive=True) if os.path.isfile(f))
  if not files:
    raise FileNotFoundError(f"no files match {pattern!r}")
  return files


def _files_identity(kind: str, files: list[str], extra: str = "") -> str:
  h = hashlib.sha256(f"{kind}|{extra}".encode())
  for f in files:
    st = os.stat(f)
    h.update(f"{os.path.abspath(f)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
  return f"{kind}:{h.hexdigest()}"


class EmbeddedCorpus(DocumentSource):
  """The embedded public-domain books (t5x_like.corpus), one document per book."""

  def __init__(self, books: list[str] | None = None):
    from t5x_like import corpus
    known = corpus.book_names()
    self.books = list(books) if books else known
    unknown = [b for b in self.books if b not in known]
    if unknown:
      raise FileNotFoundError(f"no book(s) {unknown} in the embedded corpus; known: {known}")
    self.stats = SourceStats("embedded")

  def __len__(self):
    return len(self.books)

  def _read(self, index):
    from t5x_like import corpus
    return corpus.read_book(self.books[index])

  def _where(self, index):
    return self.books[index]

  def identity(self):
    from t5x_like import corpus
    h = hashlib.sha256()
    for b in self.books:
      h.update(b.encode() + b"\0" + corpus.read_book(b).encode())
    return f"embedded:{h.hexdigest()}"


class TextFiles(DocumentSource):
  """Every file matching `pattern` (sorted) is one UTF-8 document."""

  def __init__(self, pattern: str):
    self.pattern = pattern
    self.files = _glob_files(pattern)
    self.stats = SourceStats(f"text:{pattern}")

  def __len__(self):
    return len(self.files)

  def _read(self, index):
    with open(self.files[index], "rb") as f:
      return self._decode(f.read(), index)

  def _where(self, index):
    return self.files[index]

  def identity(self):
    return _files_identity("text", self.files)


class JsonlFiles(DocumentSource):
  """Every non-blank line of the files matching `pattern` is one JSON document.

  The line offsets are indexed once (a byte scan, no parsing); lines are parsed on
  read, so a malformed line costs nothing until it is reached.
  """

  def __init__(self, pattern: str, field: str = "text"):
    self.pattern, self.field = pattern, field
    self.files = _glob_files(pattern)
    self.stats = SourceStats(f"jsonl:{pattern}")
    self._open = None  # (file number, open binary file)
    self._starts, self._ends, self._line_numbers, self._file_first = [], [], [], [0]
    for path in self.files:
      starts, ends, numbers = _nonblank_lines(path)
      self._starts.append(starts)
      self._ends.append(ends)
      self._line_numbers.append(numbers)
      self._file_first.append(self._file_first[-1] + len(starts))

  def __len__(self):
    return self._file_first[-1]

  def _locate(self, index):
    f = bisect.bisect_right(self._file_first, index) - 1
    return f, index - self._file_first[f]

  def _where(self, index):
    f, j = self._locate(index)
    return f"{self.files[f]}:{self._line_numbers[f][j]}"

  def _read(self, index):
    f, j = self._locate(index)
    if self._open is None or self._open[0] != f:  # keep one file open: reads go in order
      if self._open is not None:
        self._open[1].close()
      self._open = (f, open(self.files[f], "rb"))
    fh = self._open[1]
    fh.seek(int(self._starts[f][j]))
    line = fh.read(int(self._ends[f][j] - self._starts[f][j]))
    text = self._decode(line, index)
    try:
      record = json.loads(text)
    except json.JSONDecodeError:
      record = None
    if not isinstance(record, dict):
      self.stats.record("malformed_json", index, self._where(index))
      return None
    value = record.get(self.field)
    if not isinstance(value, str):
      self.stats.record("missing_field", index,
                        f"{self._where(index)} (field {self.field!r})")
      return None
    return value

  def identity(self):
    return _files_identity("jsonl", self.files, self.field)

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


class TfdsSource(DocumentSource):
  """Records of a TFDS dataset read through `tfds.data_source` (array_record).

  No TensorFlow is needed and nothing is downloaded: the dataset must already be
  prepared under `data_dir` (or the default TFDS data dir).
  """

  def __init__(self, name: str, split: str = "train", data_dir: str | None = None,
               field: str = "text"):
    self.name, self.split, self.data_dir, self.field = name, split, data_dir, field
    self.stats = SourceStats(f"tfds:{name}:{split}")
    self._ds = None
    self._len = len(self._source())

  def _source(self):
    if self._ds is None:
      import tensorflow_datasets as tfds
      if self.data_dir is not None and not os.path.isdir(self.data_dir):
        raise FileNotFoundError(f"TFDS data_dir {self.data_dir!r} does not exist")
      try:
        self._ds = tfds.data_source(self.name, split=self.split, data_dir=self.data_dir,
                                    download=False)
      except Exception as e:  # tfds raises many types for "not prepared here"
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FileNotFoundError(f"TFDS dataset {self.name!r} split {self.split!r} not found"
                                f" in data_dir {self.data_dir!r}: {first_line}") from e
      features = getattr(getattr(self._ds, "dataset_info", None), "features", None)
      if features is not None and self.field not in features:
        raise ValueError(f"TFDS dataset {self.name!r} has no feature {self.field!r};"
                         f" it has {sorted(features.keys())}")
    return self._ds

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_ds"] = None  # reopened lazily in worker processes
    return state

  def __len__(self):
    return self._len

  def _read(self, index):
    record = self._source()[index]
    value = record.get(self.field) if isinstance(record, dict) else None
    if isinstance(value, np.ndarray) and value.ndim == 0:
      value = value.item()
    if isinstance(value, bytes):
      return self._decode(value, index)
    if isinstance(value, str):
      return value
    self.stats.record("missing_field", index, f"#{index} (field {self.field!r})")
    return None

  def identity(self):
    info = getattr(self._source(), "dataset_info", None)
    data_dir = getattr(info, "data_dir", None)
    files = sorted(globlib.glob(os.path.join(str(data_dir), "*"))) if data_dir else []
    return _files_identity("tfds", files, f"{self.name}:{self.split}:{self.field}:{data_dir}")


# ------------------------------------------------------------------ specs
_TFDS_SPEC = re.compile(r"^(?P<name>[A-Za-z0-9_.]+(/[A-Za-z0-9_.\-]+)?)"
                        r"(:(?P<split>[^@#]+))?(@(?P<data_dir>[^#]+))?(#(?P<field>.+))?$")
_FIELD = re.compile(r"^[A-Za-z_][\w.\-]*$")


def source_from_spec(spec: str) -> DocumentSource:
  """A source from a spec string (forms in SPEC_FORMS, see the module docstring)."""
  kind, sep, rest = spec.partition(":")
  if kind == "embedded":
    return EmbeddedCorpus([b for b in rest.split(",") if b] if sep else None)
  if kind == "text" and rest:
    return TextFiles(rest)
  if kind == "jsonl" and rest:
    path, colon, field = rest.rpartition(":")
    if colon and _FIELD.match(field) and path:
      return JsonlFiles(path, field)
    return JsonlFiles(rest)
  if kind == "tfds":
    m = _TFDS_SPEC.match(rest)
    if m:
      return TfdsSource(m["name"], m["split"] or "train", m["data_dir"], m["field"] or "text")
  raise ValueError(f"bad source spec {spec!r}; valid forms: " + ", ".join(SPEC_FORMS))
