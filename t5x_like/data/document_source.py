"""The document source contract: `len(source)`, `source[i] -> str`, bad input counted.

One item is one document (a book, a file, a JSON line, a TFDS record); documents
keep their boundaries. Bad input never crashes a source, it is counted in
`source.stats` (and logged with file:line where there is one):
  empty_documents  whitespace-only documents: `source[i]` returns "" (skip it)
  invalid_utf8     documents decoded with U+FFFD replacement characters
  malformed_json   JSONL lines that do not parse, or are not objects: returns ""
  missing_field    JSON lines / records without a string field: returns ""
Each document is counted at most once per reason however often it is read, so after
one full pass the counters describe the whole source. The sources themselves are in
data/sources.py (embedded, TFDS, specs) and data/file_sources.py (text, JSONL).
"""

from __future__ import annotations

import abc
import collections
import hashlib
import logging
import os

from t5x_like.errors import UserError

log = logging.getLogger("t5x_like.data.sources")

_MAX_WARNINGS = 10  # per reason and source; the counters keep counting


class DataSourceError(UserError, ValueError):
  """A source that cannot yield any document; the message (one line) names its spec and
  path or glob. A ValueError too, as bad specs and fields were before."""


class SourceNotFoundError(DataSourceError, FileNotFoundError):
  """No file matches a glob, or no such book or TFDS dataset (a FileNotFoundError too)."""


class SourceStats:
  """Counters of bad input, each document counted at most once per reason."""

  REASONS = ("empty_documents", "invalid_utf8", "malformed_json", "missing_field")

  def __init__(self, name: str, quiet: bool = False):
    self.name, self.quiet = name, quiet
    self._seen = collections.defaultdict(set)

  def record(self, reason: str, index: int, where: str = "") -> None:
    seen = self._seen[reason]
    if index in seen:
      return
    seen.add(index)
    if len(seen) <= _MAX_WARNINGS and not self.quiet:
      log.warning("%s: %s at %s%s", self.name, reason.replace("_", " "), where or f"#{index}",
                  " (further ones are only counted)" if len(seen) == _MAX_WARNINGS else "")

  def as_dict(self) -> dict[str, int]:
    return {r: len(self._seen.get(r, ())) for r in self.REASONS}

  def __repr__(self):
    return f"SourceStats({self.name}: {self.as_dict()})"


class DocumentSource(abc.ABC):
  """Base class: subclasses set `self.stats` and implement __len__, _read, identity."""

  stats: SourceStats

  @property
  @abc.abstractmethod
  def spec(self) -> str:
    """The spec string of this source (source_from_spec form), for messages."""

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

  def location(self, index: int) -> str:
    """Where document `index` comes from, for messages and names: its file, book or
    record."""
    return self._where(index)

  def _where(self, index: int) -> str:
    return f"#{index}"

  def _require_a_document(self) -> None:
    """DataSourceError unless some document is usable; reads up to the first one, so a
    good source costs one read and a bad one fails here, before anything is built."""
    # Counted quietly and apart: the error sums the bad documents up in its one line, and
    # a good source still logs and counts them on its first full pass.
    stats, self.stats = self.stats, SourceStats(self.stats.name, quiet=True)
    try:
      for i in range(len(self)):
        if self[i]:
          return
      raise DataSourceError(self._why_no_document())
    finally:
      self.stats = stats

  def _why_no_document(self) -> str:
    counts = {k: v for k, v in self.stats.as_dict().items() if v}
    return f"source {self.spec!r}: none of its {len(self)} documents is usable ({counts})"

  def _decode(self, data: bytes, index: int) -> str:
    try:
      return data.decode("utf-8")
    except UnicodeDecodeError:
      self.stats.record("invalid_utf8", index, self._where(index))
      return data.decode("utf-8", errors="replace")


def files_identity(kind: str, files: list[str], extra: str = "") -> str:
  """A cache key over the files' paths, sizes and modification times."""
  h = hashlib.sha256(f"{kind}|{extra}".encode())
  for f in files:
    st = os.stat(f)
    h.update(f"{os.path.abspath(f)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
  return f"{kind}:{h.hexdigest()}"
