"""The epoch stream against a whole stream materialised from its two-level definition:
chunks of K documents visited in a seeded order, each chunk's documents in a seeded
order, each document optionally followed by a separator."""

import numpy as np
import pytest

import t5x_like.data.store as store_module
from t5x_like.data.store import TokenStore
from helpers import random_token_store
from t5x_like.data.streams import EpochStream

SEP = 7
STREAM_KEY = 0x57E4  # the spawn key the streams' order generators start with (spec)


def _rng(seed, epoch, *key):
  return np.random.default_rng(np.random.SeedSequence([seed, epoch],
                                                      spawn_key=(STREAM_KEY, *key)))


def reference(store, seed, epoch, separator, k):
  """(tokens [T], document starts [T] bool, chunk start positions) of the whole stream,
  concatenated document by document in plain Python."""
  num_chunks = -(-store.num_docs // k)
  tokens, starts, chunk_starts = [], [], []
  for c in _rng(seed, epoch).permutation(num_chunks):
    chunk_starts.append(len(tokens))
    lo, hi = c * k, min(c * k + k, store.num_docs)
    for j in _rng(seed, epoch, int(c)).permutation(hi - lo):
      doc = store.doc_tokens(lo + j).tolist() + ([] if separator is None else [separator])
      tokens += doc
      starts += [True] + [False] * (len(doc) - 1)
  return np.array(tokens, np.int32), np.array(starts, bool), chunk_starts


def random_store(num_docs, seed=0):
  return random_token_store(num_docs, seed, tokens=(10, 500), sentence_lengths=(1, 6),
                            sentences=(1, 4))


class CountingStore:
  """A store that counts the document offsets read (doc_token_offsets, doc_token_runs); fails
  on doc_offsets (a read of every document)."""

  def __init__(self, store):
    self.inner = store
    self.offsets_read = 0
    self.tokens = store.tokens

  num_docs = property(lambda self: self.inner.num_docs)
  num_tokens = property(lambda self: self.inner.num_tokens)

  @property
  def doc_offsets(self):
    raise AssertionError("read the offsets of every document")

  def chunk_token_offsets(self):
    return self.inner.chunk_token_offsets()

  def doc_token_offsets(self, lo, hi):
    self.offsets_read += hi - lo + 1
    return self.inner.doc_token_offsets(lo, hi)

  def doc_token_runs(self, lo, hi):
    self.offsets_read += int((np.asarray(hi) - lo + 1).sum())
    return self.inner.doc_token_runs(lo, hi)


def _check_windows(stream, want_tokens, want_starts, starts, length):
  tokens, doc_start = stream.window(np.asarray(starts), length)
  assert tokens.dtype == np.int32 and doc_start.dtype == bool
  assert tokens.shape == doc_start.shape == (len(starts), length)
  for row, s in enumerate(starts):
    np.testing.assert_array_equal(tokens[row], want_tokens[s:s + length])
    np.testing.assert_array_equal(doc_start[row], want_starts[s:s + length])


@pytest.mark.parametrize("k, num_docs", [(1024, 50), (4, 3), (4, 4), (4, 17), (1024, 3 * 1024 + 5)])
@pytest.mark.parametrize("separator", [None, SEP])
def test_random_and_last_windows_equal_the_reference(monkeypatch, k, num_docs, separator):
  monkeypatch.setattr(store_module, "STREAM_CHUNK_DOCS", k)
  store = random_store(num_docs, seed=num_docs)
  want_tokens, want_starts, _ = reference(store, 11, 2, separator, k)
  stream = EpochStream(store, 11, 2, separator)
  assert stream.length == len(want_tokens)
  rng = np.random.default_rng(0)
  for length in sorted({min(n, stream.length) for n in (1, 5, 37)}
                       | {stream.length // 2 + 1, stream.length}):
    starts = rng.integers(0, stream.length - length + 1, 16)
    _check_windows(stream, want_tokens, want_starts, starts, length)
    _check_windows(stream, want_tokens, want_starts, [stream.length - length], length)


def test_windows_straddling_chunk_boundaries(monkeypatch):
  monkeypatch.setattr(store_module, "STREAM_CHUNK_DOCS", 4)
  store = random_store(3 * 4 + 5, seed=1)
  for separator in (None, SEP):
    want_tokens, want_starts, chunk_starts = reference(store, 3, 0, separator, 4)
    assert len(chunk_starts) == 5
    stream = EpochStream(store, 3, 0, separator)
    straddling = [b + d for b in chunk_starts[1:] for d in (-3, -1)
                  if b + d + 6 <= len(want_tokens)]
    assert len(straddling) >= 6
    _check_windows(stream, want_tokens, want_starts, straddling, 6)
    # one window over several whole chunks
    _check_windows(stream, want_tokens, want_starts, [chunk_starts[1] - 1],
                   chunk_starts[4] - chunk_starts[1] + 2)


def test_the_order_is_two_level_and_differs_between_epochs_and_seeds(monkeypatch):
  monkeypatch.setattr(store_module, "STREAM_CHUNK_DOCS", 4)
  store = random_store(40, seed=2)
  streams = {key: EpochStream(store, *key).window([0], 200)[0][0]
             for key in [(0, 0), (0, 1), (1, 0)]}
  assert len({s.tobytes() for s in streams.values()}) == 3
  chunk_order = EpochStream(store, 0, 0).chunk_order
  assert sorted(chunk_order) == list(range(10)) and list(chunk_order) != list(range(10))


def test_construction_reads_only_the_chunk_table(monkeypatch):
  monkeypatch.setattr(store_module, "STREAM_CHUNK_DOCS", 4)
  store = CountingStore(random_store(400, seed=3))
  stream = EpochStream(store, 5, 1, SEP)
  assert store.offsets_read == 0
  want_tokens, want_starts, chunk_starts = reference(store.inner, 5, 1, SEP, 4)
  assert stream.length == len(want_tokens)
  _check_windows(stream, want_tokens, want_starts, [chunk_starts[7]], 3)
  assert store.offsets_read == 4 + 1  # one chunk's documents
  _check_windows(stream, want_tokens, want_starts, [chunk_starts[7] + 1], 2)
  assert store.offsets_read == 4 + 1  # cached


def test_cache_eviction_does_not_change_windows(monkeypatch):
  monkeypatch.setattr(store_module, "STREAM_CHUNK_DOCS", 4)
  store = CountingStore(random_store(100, seed=4))
  cached = EpochStream(store.inner, 9, 3, SEP)
  evicting = EpochStream(store, 9, 3, SEP, cached_chunks=2)
  rng = np.random.default_rng(1)
  for _ in range(20):
    starts = rng.integers(0, cached.length - 30, 8)
    for a, b in zip(cached.window(starts, 30), evicting.window(starts, 30)):
      np.testing.assert_array_equal(a, b)
  assert store.offsets_read > 25 * 5  # chunks were loaded again after eviction
  assert len(evicting._cache) <= 2


def test_windows_outside_the_stream_raise(monkeypatch):
  monkeypatch.setattr(store_module, "STREAM_CHUNK_DOCS", 4)
  stream = EpochStream(random_store(9), 0, 0)
  with pytest.raises(IndexError):
    stream.window(np.array([-1]), 3)
  with pytest.raises(IndexError):
    stream.window(np.array([0, stream.length - 2]), 3)
  tokens, doc_start = stream.window(np.array([], np.int64), 3)
  assert tokens.shape == doc_start.shape == (0, 3)


def test_a_chunk_table_of_another_chunk_size_is_refused(monkeypatch):
  store = random_store(10)
  table = store.chunk_token_offsets()  # K = 1024: one chunk
  monkeypatch.setattr(store_module, "STREAM_CHUNK_DOCS", 4)
  with pytest.raises(ValueError, match="chunk table"):
    EpochStream(TokenStore(store.tokens, store.sentence_offsets, store.doc_sentences,
                           chunk_token_table=table), 0, 0)
