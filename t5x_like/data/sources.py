"""Random-access document sources: `len(source)`, `source[i] -> str`.

One item is one document (a book, a file, a JSON line, a TFDS record); bad input is
counted in `source.stats`, never a crash (data/document_source.py).

A source that cannot yield any document is a DataSourceError (a UserError: one line
naming the spec and the path or glob, with a hint), raised when the source is made:
a bad spec, a glob matching no file (SourceNotFoundError, also a FileNotFoundError),
a directory where a glob belongs, only empty files, JSONL rows that all lack the field
or are not JSON, a missing TFDS dataset, an unknown book. Making a source reads
documents only up to its first usable one.

Specs (`source_from_spec`), for the CLI and configs; paths and globs are local,
relative to the current directory or absolute (~ expanded):
  embedded                           the 8 books of t5x_like.corpus, unwrapped (one
                                     line per paragraph: corpus.unwrap)
  embedded:NAME[,NAME...]            some of them (file stems)
  text:GLOB                          one document per file
  jsonl:GLOB[:FIELD]                 one document per line, FIELD defaults to "text"
  tfds:NAME[/CONFIG][:SPLIT][@DATA_DIR][#FIELD]
                                     split "train", field "text" by default
"""

from __future__ import annotations

import difflib
import glob as globlib
import hashlib
import os
import re

import numpy as np

from t5x_like.data.document_source import (DataSourceError, DocumentSource,
                                           SourceNotFoundError, SourceStats,
                                           files_identity)
from t5x_like.data.file_sources import FIELD_NAME, GLOB_CHARS, JsonlFiles, TextFiles
from t5x_like.fs import is_url

__all__ = ["SPEC_FORMS", "DataSourceError", "SourceNotFoundError", "SourceStats",
           "DocumentSource", "EmbeddedCorpus", "TextFiles", "JsonlFiles", "TfdsSource",
           "source_from_spec"]

SPEC_FORMS = ("embedded", "embedded:NAME[,NAME...]", "text:GLOB", "jsonl:GLOB[:FIELD]",
              "tfds:NAME[/CONFIG][:SPLIT][@DATA_DIR][#FIELD]")


class EmbeddedCorpus(DocumentSource):
  """The embedded public-domain books (t5x_like.corpus), one document per book.

  Each book comes unwrapped (corpus.unwrap): its hard line breaks inside a paragraph
  are layout, not text, and would otherwise be one token in thirteen.
  """

  def __init__(self, books: list[str] | None = None):
    from t5x_like import corpus
    known = corpus.book_names()
    self._named = bool(books)
    self.books = list(books) if books else known
    unknown = [b for b in self.books if b not in known]
    if unknown:
      close = difflib.get_close_matches(unknown[0], known, n=1)
      hint = f"did you mean {close[0]!r}? " if close else ""
      raise SourceNotFoundError(f"no book(s) {unknown} in the embedded corpus (source"
                                f" {self.spec!r}); {hint}known: {', '.join(known)}")
    self.stats = SourceStats("embedded")

  @property
  def spec(self):
    return "embedded:" + ",".join(self.books) if self._named else "embedded"

  def __len__(self):
    return len(self.books)

  def _read(self, index):
    from t5x_like import corpus
    return corpus.unwrap(corpus.read_book(self.books[index]))

  def _where(self, index):
    return self.books[index]

  def identity(self):
    """A hash of the text delivered (unwrapped), so a cache of the wrapped text is
    never reused."""
    h = hashlib.sha256()
    for i, b in enumerate(self.books):
      h.update(b.encode() + b"\0" + self._read(i).encode())
    return f"embedded-unwrapped:{h.hexdigest()}"


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
    self._require_a_document()

  @property
  def spec(self):
    return (f"tfds:{self.name}" + (f":{self.split}" if self.split != "train" else "")
            + (f"@{self.data_dir}" if self.data_dir else "")
            + (f"#{self.field}" if self.field != "text" else ""))

  def _source(self):
    if self._ds is None:
      import tensorflow_datasets as tfds
      data_dir = self.data_dir
      if data_dir is not None and not is_url(data_dir):
        data_dir = os.path.abspath(os.path.expanduser(data_dir))
        if not os.path.isdir(data_dir):
          raise SourceNotFoundError(f"TFDS data_dir {self.data_dir!r} does not exist"
                                    f" (source {self.spec!r})")
      where = f"data_dir {self.data_dir!r}" if self.data_dir else "the default TFDS data dir"
      try:
        self._ds = tfds.data_source(self.name, split=self.split, data_dir=data_dir,
                                    download=False)
      except Exception as e:  # tfds raises many types for "not prepared here"
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SourceNotFoundError(f"TFDS dataset {self.name!r} split {self.split!r} not"
                                  f" found in {where} (source {self.spec!r}):"
                                  f" {first_line[:200]}") from e
      features = getattr(getattr(self._ds, "dataset_info", None), "features", None)
      if features is not None and self.field not in features:
        raise DataSourceError(f"TFDS dataset {self.name!r} has no feature {self.field!r}"
                              f" (source {self.spec!r}); it has {sorted(features.keys())}:"
                              " name one with '#FIELD'")
    return self._ds

  def _why_no_document(self):
    head = (f"no document in TFDS dataset {self.name!r} split {self.split!r}"
            f" (source {self.spec!r})")
    if not len(self):
      return f"{head}: the split has no records"
    counts = {k: v for k, v in self.stats.as_dict().items() if v and k != "invalid_utf8"}
    return f"{head}: the field {self.field!r} of all {len(self)} records is unusable ({counts})"

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
    return files_identity("tfds", files, f"{self.name}:{self.split}:{self.field}:{data_dir}")


# ------------------------------------------------------------------ specs
_TFDS_SPEC = re.compile(r"^(?P<name>[A-Za-z0-9_.]+(/[A-Za-z0-9_.\-]+)?)"
                        r"(:(?P<split>[^@#]+))?(@(?P<data_dir>[^#]+))?(#(?P<field>.+))?$")


def source_from_spec(spec: str) -> DocumentSource:
  """A source from a spec string (forms in SPEC_FORMS, see the module docstring).

  DataSourceError (one line naming the spec and path) for a bad spec or a source that
  yields no document.
  """
  kind, sep, rest = spec.partition(":")
  if kind == "embedded":
    return EmbeddedCorpus([b for b in rest.split(",") if b] if sep else None)
  if kind == "text" and rest:
    return TextFiles(rest)
  if kind == "jsonl" and rest:
    path, colon, field = rest.rpartition(":")
    if colon and FIELD_NAME.match(field) and path:
      return JsonlFiles(path, field)
    return JsonlFiles(rest)
  if kind == "tfds":
    m = _TFDS_SPEC.match(rest)
    if m:
      return TfdsSource(m["name"], m["split"] or "train", m["data_dir"], m["field"] or "text")
  hint = ""
  if ":" not in spec and (GLOB_CHARS.search(spec) or os.sep in spec or os.path.exists(spec)
                          or spec.endswith((".txt", ".jsonl", ".json"))):
    hint = f"; did you mean '{'jsonl' if spec.endswith('.jsonl') else 'text'}:{spec}'?"
  raise DataSourceError(f"bad source spec {spec!r}; valid forms: " + ", ".join(SPEC_FORMS)
                        + hint)
