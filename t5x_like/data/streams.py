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
only the chunks it touches (their documents' offsets, store.doc_token_offsets) into a
small LRU cache. Per-host memory and start-up time stay small for any corpus, and
example i stays a cheap, pure function of (seed, epoch, i).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from t5x_like.data import store as token_store
from t5x_like.data.store import TokenStore

STREAM_KEY = 0x57E4  # first spawn-key word of the stream's order generators
CACHED_CHUNKS = 128  # chunks whose document tables a stream keeps (LRU)


def order_rng(seed: int, epoch: int, *key: int) -> np.random.Generator:
  """The generator of the chunk order (no key) or of chunk `key`'s document order."""
  return np.random.default_rng(
      np.random.SeedSequence([seed, epoch], spawn_key=(STREAM_KEY, *key)))


@dataclasses.dataclass(frozen=True)
class _Chunk:
  """One chunk's documents in their epoch order.

  starts: [n] int64 stream offset of each document from the chunk's start.
  sources: [n] int64 token offset of each in the store.
  lengths: [n] int64 tokens of each, separator excluded.
  """

  starts: np.ndarray
  sources: np.ndarray
  lengths: np.ndarray


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

  def _chunk(self, chunk: int) -> _Chunk:
    """Store chunk `chunk`'s table, loaded on first use and kept in the LRU cache."""
    table = self._cache.pop(chunk, None)
    if table is None:
      table = self._load_chunk(chunk)
    self._cache[chunk] = table
    while len(self._cache) > self.cached_chunks:
      del self._cache[next(iter(self._cache))]
    return table

  def _load_chunk(self, chunk: int) -> _Chunk:
    lo = chunk * self.chunk_docs
    hi = min(lo + self.chunk_docs, self.store.num_docs)
    offsets = np.asarray(self.store.doc_token_offsets(lo, hi), np.int64)  # [n + 1]
    order = order_rng(self.seed, self.epoch, chunk).permutation(hi - lo)
    lengths = np.diff(offsets)[order]
    starts = np.zeros(len(order), np.int64)
    np.cumsum((lengths + (self.separator is not None))[:-1], out=starts[1:])
    return _Chunk(starts, offsets[:-1][order], lengths)

  def _touched_places(self, starts: np.ndarray, length: int) -> np.ndarray:
    """[U] sorted places in the chunk order that windows [s, s + length) touch."""
    first = np.searchsorted(self._chunk_starts, starts, side="right") - 1
    last = np.searchsorted(self._chunk_starts, starts + length - 1, side="right") - 1
    counts = last - first + 1
    run_starts = np.cumsum(counts) - counts
    places = np.arange(counts.sum()) - np.repeat(run_starts - first, counts)
    return np.unique(places)

  def _documents(self, places: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stream start [M], store token offset [M] and length [M] of every document of the
    chunks at `places` [U] (sorted), in stream order."""
    tables = [self._chunk(int(c)) for c in self.chunk_order[places]]
    sizes = [len(t.starts) for t in tables]
    starts = np.concatenate([t.starts for t in tables])
    starts += np.repeat(self._chunk_starts[places], sizes)
    return (starts, np.concatenate([t.sources for t in tables]),
            np.concatenate([t.lengths for t in tables]))

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
    doc_starts, sources, lengths = self._documents(self._touched_places(starts, length))
    pos = starts[:, None] + np.arange(length, dtype=np.int64)[None, :]
    doc = np.searchsorted(doc_starts, pos, side="right") - 1
    offset = pos - doc_starts[doc]
    src = sources[doc] + offset
    if self.separator is None:
      tokens = self.store.tokens[src]
    else:
      is_sep = offset == lengths[doc]
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
