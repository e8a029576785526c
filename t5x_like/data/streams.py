"""The per-epoch token stream that span corruption and the LM objectives cut into rows.

Each epoch puts the documents of a TokenStore back to back, each optionally followed by
a separator (EOS for language modelling; none for T5 span corruption, as in T5's C4
pipeline), in a two-level seeded order. Chunk c holds documents [c*K, (c+1)*K) (K =
store.STREAM_CHUNK_DOCS; the last chunk may be shorter). The epoch visits the C chunks
in the order order_rng(seed, epoch).permutation(C), and the documents of chunk c in the
order order_rng(seed, epoch, c).permutation(documents in c), where

  order_rng(seed, epoch, *key) = default_rng(SeedSequence([seed, epoch],
                                                          spawn_key=(STREAM_KEY, *key)))

(spawn keys keep these generators apart from the examples', objective.example_rng).

Neither the stream nor a per-document table of the epoch is ever built: construction
reads the store's chunk table (store.chunk_token_offsets, O(D / K)), and a window loads
only the chunks it touches into a small LRU cache, all that it misses in one batch: their
documents' offsets in one read (store.doc_token_runs), their generators seeded together
(data/seeding.py; each draws as its order_rng). Per-host memory and start-up time stay
small for any corpus, and example i stays a cheap, pure function of (seed, epoch, i).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from t5x_like.data import store as token_store
from t5x_like.data.seeding import keyed_generators
from t5x_like.data.store import TokenStore

STREAM_KEY = 0x57E4  # first spawn-key word of the stream's order generators
CACHED_CHUNKS = 128  # chunks whose document tables a stream keeps (LRU)


def order_rng(seed: int, epoch: int, *key: int) -> np.random.Generator:
  """The generator of the chunk order (no key) or of chunk `key`'s document order."""
  return np.random.default_rng(
      np.random.SeedSequence([seed, epoch], spawn_key=(STREAM_KEY, *key)))


@dataclasses.dataclass(frozen=True)
class _Chunk:
  """One chunk's n documents in their epoch order, then the chunk's end.

  starts: [n + 1] int64 stream offset of each document from the chunk's start, then the
    chunk's length (separators included).
  sources: [n + 1] int64 token offset of each in the store, then a placeholder.
  """

  starts: np.ndarray
  sources: np.ndarray


class EpochStream:
  """Documents of `store` in epoch `epoch`'s two-level seeded order, back to back.

  length: total stream length in tokens (separators included).
  chunk_order: [C] the store chunk at each place of the epoch's chunk order.
  """

  def __init__(self, store: TokenStore, seed: int, epoch: int,
               separator: Optional[int] = None, cached_chunks: int = CACHED_CHUNKS):
    self.store, self.seed, self.epoch = store, seed, epoch
    self.separator = separator
    self.cached_chunks = max(1, cached_chunks)
    self.chunk_docs = token_store.STREAM_CHUNK_DOCS
    chunk_lengths = self._chunk_lengths()
    self.chunk_order = order_rng(seed, epoch).permutation(len(chunk_lengths))
    # [C + 1] stream position where the i-th visited chunk starts
    self._chunk_starts = np.concatenate(
        [[0], np.cumsum(chunk_lengths[self.chunk_order])]).astype(np.int64)
    self.length = int(self._chunk_starts[-1])
    self._cache: dict[int, _Chunk] = {}  # store chunk -> its table, most recent last

  def _chunk_lengths(self) -> np.ndarray:
    """[C] stream tokens of each store chunk (separators included)."""
    num_docs, k = self.store.num_docs, self.chunk_docs
    num_chunks = -(-num_docs // k)
    offsets = np.asarray(self.store.chunk_token_offsets(), np.int64)
    if len(offsets) != num_chunks + 1:
      raise ValueError(f"the store's chunk table has {len(offsets)} entries; {num_docs}"
                       f" documents in chunks of {k} need {num_chunks + 1}")
    docs = np.minimum(k, num_docs - k * np.arange(num_chunks, dtype=np.int64))
    return np.diff(offsets) + (self.separator is not None) * docs

  def _tables(self, chunks: list[int]) -> list[_Chunk]:
    """The tables of store chunks `chunks` (distinct), the missing ones loaded in one
    batch (_load_chunks); all kept in the LRU cache."""
    missing = [c for c in chunks if c not in self._cache]
    loaded = dict(zip(missing, self._load_chunks(missing))) if missing else {}
    tables = []
    for c in chunks:
      table = self._cache.pop(c, None)
      self._cache[c] = table = loaded[c] if table is None else table
      tables.append(table)
    while len(self._cache) > self.cached_chunks:
      del self._cache[next(iter(self._cache))]
    return tables

  def _load_chunks(self, chunks: list[int]) -> list[_Chunk]:
    """The tables of store chunks `chunks` [M]: their document offsets in one read
    (store.doc_token_runs), their orders from generators seeded in one batch."""
    lo = np.asarray(chunks, np.int64) * self.chunk_docs
    n = np.minimum(lo + self.chunk_docs, self.store.num_docs) - lo  # [M] documents
    offsets = np.asarray(self.store.doc_token_runs(lo, lo + n), np.int64)  # [sum(n + 1)]
    gens = keyed_generators([self.seed, self.epoch], [STREAM_KEY], chunks)
    tables, at, sep = [], 0, self.separator is not None
    for size, gen in zip(n.tolist(), gens):
      order = gen.permutation(size)  # = order_rng(seed, epoch, chunk).permutation(size)
      chunk = offsets[at:at + size + 1]  # [size + 1] its documents' token offsets
      table = np.empty((2, size + 1), np.int64)  # [starts, sources], then the end
      table[1, :size] = chunk[order]
      steps = chunk[order + 1]
      steps -= table[1, :size]
      if sep:
        steps += sep
      table[0, 0] = table[1, size] = 0
      np.cumsum(steps, out=table[0, 1:])
      tables.append(_Chunk(table[0], table[1]))
      at += size + 1
    return tables

  def _touched_places(self, starts: np.ndarray, length: int) -> np.ndarray:
    """[U] sorted places in the chunk order that windows [s, s + length) touch."""
    first = np.searchsorted(self._chunk_starts, starts, side="right") - 1
    last = np.searchsorted(self._chunk_starts, starts + length - 1, side="right") - 1
    counts = last - first + 1
    run_starts = np.cumsum(counts) - counts
    places = np.arange(counts.sum()) - np.repeat(run_starts - first, counts)
    return np.unique(places)

  def _documents(self, places: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stream start [M] and store token offset [M] of every document of the chunks at
    `places` [U] (sorted), in stream order, each chunk's followed by its end (M counts
    them): a position's document is the last start at or before it."""
    tables = self._tables(self.chunk_order[places].tolist())
    starts = np.concatenate([t.starts for t in tables])
    starts += np.repeat(self._chunk_starts[places], [len(t.starts) for t in tables])
    return starts, np.concatenate([t.sources for t in tables])

  def window(self, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Stream positions [s, s + length) for each s in starts [B].

    Returns (tokens [B, length] int32, document_start [B, length] bool), the latter True
    where a document's first token sits. Windows must lie inside the stream.
    """
    starts = np.asarray(starts, np.int64).reshape(-1)
    if len(starts) and (starts.min() < 0 or starts.max() + length > self.length):
      raise IndexError(f"window of {length} at {starts} outside a stream of {self.length}")
    if len(starts) == 0 or length <= 0:
      shape = (len(starts), max(length, 0))
      return np.zeros(shape, np.int32), np.zeros(shape, bool)
    doc_starts, sources = self._documents(self._touched_places(starts, length))
    pos = starts[:, None] + np.arange(length, dtype=np.int64)[None, :]
    doc = np.searchsorted(doc_starts, pos, side="right") - 1
    offset = pos - doc_starts[doc]
    src = sources[doc] + offset
    if self.separator is None:
      tokens = self.store.tokens[src]
    else:  # a document's last position holds its separator
      is_sep = doc_starts[doc + 1] - pos == 1
      tokens = self.store.tokens[np.minimum(src, self.store.num_tokens - 1)]
      tokens = np.where(is_sep, np.int32(self.separator), tokens)
    return np.asarray(tokens).astype(np.int32, copy=False), offset == 0


class StreamCache:
  """The two most recently used epochs' streams (a loader batch may straddle epochs)."""

  def __init__(self, store: TokenStore, seed: int, separator: Optional[int]):
    self.store, self.seed, self.separator = store, seed, separator
    self._streams: dict[int, EpochStream] = {}

  def __call__(self, epoch: int) -> EpochStream:
    stream = self._streams.pop(epoch, None)
    if stream is None:
      stream = EpochStream(self.store, self.seed, epoch, self.separator)
    self._streams[epoch] = stream  # most recently used last
    while len(self._streams) > 2:
      del self._streams[next(iter(self._streams))]
    return stream
