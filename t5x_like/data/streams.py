"""The per-epoch token stream that span corruption and the LM objectives cut into rows.

Each epoch visits the documents of a TokenStore in an order permuted by
`np.random.default_rng([seed, epoch])` and concatenates their tokens, each document
optionally followed by a separator (EOS for language modelling; none for T5 span
corruption, as in T5's C4 pipeline). The stream is never materialised: a window of
it is gathered from the store through the document boundaries (O(documents) memory
per epoch), so example i stays a cheap, pure function of (seed, epoch, i).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from t5x_like.data.store import TokenStore


class EpochStream:
  """Documents of `store` in epoch `epoch`'s seeded order, back to back.

  length: total stream length in tokens (separators included).
  order: [D] store document index of each stream document.
  """

  def __init__(self, store: TokenStore, seed: int, epoch: int,
               separator: Optional[int] = None):
    self.store = store
    self.separator = separator
    self.order = np.random.default_rng([seed, epoch]).permutation(store.num_docs)
    doc_offsets = store.doc_offsets
    self._doc_len = (doc_offsets[1:] - doc_offsets[:-1])[self.order]  # tokens, no separator
    self._src = doc_offsets[:-1][self.order]  # where each stream document starts in the store
    stride = self._doc_len + (separator is not None)
    self._starts = np.concatenate([[0], np.cumsum(stride)]).astype(np.int64)
    self.length = int(self._starts[-1])

  def window(self, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Stream positions [s, s + length) for each s in starts [B].

    Returns (tokens [B, length] int32, document_start [B, length] bool), the latter True
    where a document's first token sits. Windows must lie inside the stream.
    """
    starts = np.asarray(starts, np.int64)
    if len(starts) and (starts.min() < 0 or starts.max() + length > self.length):
      raise IndexError(f"window of {length} at {starts} outside a stream of {self.length}")
    pos = starts[:, None] + np.arange(length, dtype=np.int64)[None, :]
    doc = np.searchsorted(self._starts, pos, side="right") - 1
    offset = pos - self._starts[doc]
    src = self._src[doc] + offset
    if self.separator is None:
      tokens = self.store.tokens[src]
    else:
      is_sep = offset == self._doc_len[doc]
      tokens = self.store.tokens[np.minimum(src, self.store.num_tokens - 1)]
      tokens = np.where(is_sep, np.int32(self.separator), tokens)
    return tokens.astype(np.int32, copy=False), offset == 0


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
