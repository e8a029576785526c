"""TokenStore: a tokenized corpus in flat arrays, the input of every objective.

Documents are lists of sentences; sentences are runs of token ids (no EOS). Keeping
everything in three flat arrays makes any example a cheap slice, so objectives can
regenerate example i of epoch e without replaying a stream.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Optional

import numpy as np

from t5x_like.fs import PathLike, resolve_path

STREAM_CHUNK_DOCS = 1024  # documents per chunk of the epoch streams (data/streams.py)


@dataclasses.dataclass(frozen=True)
class TokenStore:
  """Flat token arrays.

  tokens: [N] int32, every sentence of every document back to back.
  sentence_offsets: [S + 1] int64; sentence s is tokens[sentence_offsets[s]:sentence_offsets[s+1]].
  doc_sentences: [D + 1] int64; document d is sentences doc_sentences[d] .. doc_sentences[d+1]-1.
  doc_source: [D] int64, each document's index in its source (unusable source documents
  are skipped), or None: 0 .. D-1.
  doc_token_table: [D + 1] int64 token offsets of the documents, or None: read through the
  sentence table (sentence_offsets[doc_sentences]).
  chunk_token_table: [C + 1] int64, doc_token_table at documents 0, K, 2K, ... and D
  (K = STREAM_CHUNK_DOCS, C = ceil(D / K)), or None: gathered.
  Every document has at least one sentence and every sentence at least one token.
  The arrays may be numpy memory maps or other random-access arrays (data/prepared.py).
  """

  tokens: np.ndarray
  sentence_offsets: np.ndarray
  doc_sentences: np.ndarray
  doc_source: Optional[np.ndarray] = None
  doc_token_table: Optional[np.ndarray] = None
  chunk_token_table: Optional[np.ndarray] = None

  def __post_init__(self):
    if self.sentence_offsets[0] != 0 or self.sentence_offsets[-1] != len(self.tokens):
      raise ValueError("TokenStore.sentence_offsets must start at 0 and end at len(tokens)")
    if self.doc_sentences[0] != 0 or self.doc_sentences[-1] != len(self.sentence_offsets) - 1:
      raise ValueError("TokenStore.doc_sentences must start at 0 and end at the sentence count")

  @property
  def num_docs(self) -> int:
    return len(self.doc_sentences) - 1

  @property
  def num_sentences(self) -> int:
    return len(self.sentence_offsets) - 1

  @property
  def num_tokens(self) -> int:
    return len(self.tokens)

  @property
  def doc_offsets(self) -> np.ndarray:
    """[D + 1] token offsets of the documents."""
    return self._doc_token_gather(np.arange(self.num_docs + 1))

  def doc_token_offsets(self, lo: int, hi: int) -> np.ndarray:
    """[hi - lo + 1] token offsets of documents lo .. hi (hi = D: the end)."""
    if self.doc_token_table is not None:
      return np.asarray(self.doc_token_table[lo:hi + 1], np.int64)
    return np.asarray(self.sentence_offsets[np.asarray(self.doc_sentences[lo:hi + 1])],
                      np.int64)

  def doc_token_runs(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """doc_token_offsets(lo[i], hi[i]) for each i [R], concatenated [sum(hi - lo + 1)]:
    on a prepared corpus, one batched read (ShardedArray.read_ranges)."""
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64) + 1
    if hasattr(self.doc_token_table, "read_ranges"):
      return np.asarray(self.doc_token_table.read_ranges(lo, hi), np.int64)
    n = hi - lo
    return self._doc_token_gather(np.repeat(lo - np.cumsum(n) + n, n) + np.arange(n.sum()))

  def chunk_token_offsets(self) -> np.ndarray:
    """[C + 1] token offsets of documents 0, K, 2K, ... and of the end, K =
    STREAM_CHUNK_DOCS: where each chunk of K consecutive documents starts."""
    if self.chunk_token_table is not None:
      return np.asarray(self.chunk_token_table, np.int64)
    return self._doc_token_gather(
        np.append(np.arange(0, self.num_docs, STREAM_CHUNK_DOCS), self.num_docs))

  def _doc_token_gather(self, docs: np.ndarray) -> np.ndarray:
    if self.doc_token_table is not None:
      return np.asarray(self.doc_token_table[docs], np.int64)
    return np.asarray(self.sentence_offsets[np.asarray(self.doc_sentences[docs])], np.int64)

  def doc_tokens(self, d: int) -> np.ndarray:
    lo, hi = self.doc_token_offsets(d, d + 1)
    return self.tokens[lo:hi]

  def source_index(self, d: int) -> int:
    return d if self.doc_source is None else int(self.doc_source[d])

  def sentence(self, s: int) -> np.ndarray:
    return self.tokens[self.sentence_offsets[s]:self.sentence_offsets[s + 1]]

  @classmethod
  def from_documents(cls, documents: list[list[np.ndarray]]) -> "TokenStore":
    """Builds a store from documents given as lists of sentence token arrays.

    Empty sentences and documents left without sentences are skipped.
    """
    sentences = []
    doc_sentences = [0]
    for doc in documents:
      kept = [np.asarray(s, np.int32) for s in doc if len(s)]
      if kept:
        sentences.extend(kept)
        doc_sentences.append(doc_sentences[-1] + len(kept))
    lengths = np.array([len(s) for s in sentences], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.concatenate(sentences).astype(np.int32) if sentences else np.zeros(0, np.int32)
    return cls(tokens, offsets, np.asarray(doc_sentences, np.int64))

  # ------------------------------------------------------------------ files
  def save(self, path: PathLike) -> None:
    """Writes one uncompressed .npz atomically (a rename after the write).

    `path` is local (relative or absolute) or a URL (gs://...), through etils epath. The
    temporary name is unique per writer: the hosts of a multi-host run on one shared
    filesystem may all build and save the same store at once.
    """
    path = resolve_path(path, "token store")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{path.name}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}.npz"
    try:
      with tmp.open("wb") as f:
        np.savez(f, tokens=self.tokens, sentence_offsets=self.sentence_offsets,
                 doc_sentences=self.doc_sentences,
                 doc_source=(np.arange(self.num_docs, dtype=np.int64)
                             if self.doc_source is None else self.doc_source))
      tmp.replace(path)
    except BaseException:  # a failed write or rename leaves no partial file behind
      tmp.unlink(missing_ok=True)
      raise

  @classmethod
  def load(cls, path: PathLike) -> "TokenStore":
    with resolve_path(path, "token store").open("rb") as fh, np.load(fh) as f:
      return cls(f["tokens"], f["sentence_offsets"], f["doc_sentences"], f["doc_source"])


@dataclasses.dataclass(frozen=True)
class HeldOutRule:
  """Which documents (or sentences) of a source are held out, by source position.

  With 100 or more source documents, every round(1 / fraction)-th one (by its index in
  the source) is held out. With fewer (the embedded corpus has 8 books), the last
  `fraction` of the sentences of every document is held out, so each book contributes
  passages to both. One rule for the in-memory split and `t5x-like data prepare`.
  """

  fraction: float
  num_source_docs: int

  def __post_init__(self):
    if not 0.0 < self.fraction < 1.0:
      raise ValueError(f"held-out fraction={self.fraction}: must be in (0, 1)")

  @property
  def by_document(self) -> bool:
    return self.num_source_docs >= 100

  def document_held_out(self, source_index: int) -> bool:
    every = max(2, round(1.0 / self.fraction))
    return source_index % every == every - 1

  def sentence_cut(self, num_sentences: int) -> int:
    """Sentences [0, cut) train, [cut, n) held out (per document, fewer than 100)."""
    if num_sentences <= 1:
      return num_sentences
    return num_sentences - max(1, int(round(num_sentences * self.fraction)))


def split_by_rule(store: TokenStore, rule: HeldOutRule) -> tuple[TokenStore, TokenStore]:
  """(train, held-out) stores of `store` by `rule`; nothing is in both. Each keeps its
  documents' source indices (store.doc_source)."""
  parts: tuple[list, list] = ([], [])
  sources: tuple[list, list] = ([], [])
  for d in range(store.num_docs):
    lo, hi = int(store.doc_sentences[d]), int(store.doc_sentences[d + 1])
    sentences = [store.sentence(s) for s in range(lo, hi)]
    if rule.by_document:
      pieces = ((1 if rule.document_held_out(store.source_index(d)) else 0, sentences),)
    else:
      cut = rule.sentence_cut(hi - lo)
      pieces = ((0, sentences[:cut]), (1, sentences[cut:]))
    for side, kept in pieces:
      if kept:
        parts[side].append(kept)
        sources[side].append(store.source_index(d))
  out = []
  for side in (0, 1):
    built = TokenStore.from_documents(parts[side])
    out.append(TokenStore(built.tokens, built.sentence_offsets, built.doc_sentences,
                          np.asarray(sources[side], np.int64)))
  return out[0], out[1]


def split_held_out(store: TokenStore, fraction: float, num_source_docs: int | None = None
                   ) -> tuple[TokenStore, TokenStore]:
  """(train, held-out) stores by HeldOutRule at `fraction`.

  num_source_docs: documents in the store's source, unusable ones included (default:
  the store's own count); store.doc_source gives each document's source index.
  """
  return split_by_rule(store, HeldOutRule(
      fraction, store.num_docs if num_source_docs is None else num_source_docs))
