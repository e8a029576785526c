"""Documents -> sentences -> token ids -> TokenStore, with an optional on-disk cache.

Sentences are contiguous substrings of their document and the vocabularies add no
dummy prefix, so `vocab.decode(store.doc_tokens(d))` is document d exactly.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import itertools
import json
import os
import time
import uuid

import numpy as np

from t5x_like.data.sentences import split_sentences
from t5x_like.data.sources import DataSourceError
from t5x_like.data.store import TokenStore
from t5x_like.fs import PathLike, resolve_path

# Bump when the splitter or the layout of the store changes: old caches become stale.
STORE_FORMAT_VERSION = 2  # 2: doc_source


def build_store(source, vocab, *, cache_dir: PathLike | None = None,
                num_threads: int | None = None,
                batch_sentences: int = 20_000, max_sentence_chars: int = 2000,
                pipelined: bool = True) -> tuple[TokenStore, dict]:
  """Tokenizes every document of `source` into a TokenStore.

  `source` is a sources.DocumentSource or any sequence of strings (a list works; its
  cache key then hashes the texts).

  Each document is split into sentences (sentences.split_sentences), sentences are
  encoded in batches of `batch_sentences` on `num_threads` threads (default: all
  cores), each batch while the next is split (pipelined=False: one after the other, on
  one core: a Beam worker's share). Unusable documents (the source returns "") and
  sentences without tokens
  are dropped and counted. With `cache_dir` (local, relative or absolute, or a URL such
  as gs://...), the store is saved under a key hashing (source identity, vocabulary
  bytes, splitter settings) and loaded on the next call.

  DataSourceError (naming the source) when no document yields a token; nothing is
  written then.

  Returns (store, stats): stats has documents, skipped_documents, sentences,
  dropped_sentences, tokens, characters, seconds, tokens_per_second, cache
  ("off" | "miss" | "hit") and source (the source's bad-input counters).
  """
  npz_path = json_path = None
  if cache_dir is not None:
    key = _cache_key(source, vocab, max_sentence_chars)
    # Through epath: a gs:// cache_dir is a bucket, never a local folder named "gs:".
    cache, name = resolve_path(cache_dir, "cache_dir"), f"tokens-{vocab.family}-{key[:24]}"
    npz_path, json_path = cache / f"{name}.npz", cache / f"{name}.json"
    if npz_path.exists() and json_path.exists():  # the .json is written last
      stats = json.loads(json_path.read_text())
      store = TokenStore.load(npz_path)
      _require_tokens(store, source)
      return store, dict(stats, cache="hit")

  start = time.perf_counter()
  token_chunks, length_chunks, doc_chunks = [], [], []
  stats = dict(documents=0, skipped_documents=0, sentences=0, dropped_sentences=0,
               tokens=0, characters=0)
  pending, pending_docs = [], []  # sentences waiting to be encoded, their doc numbers
  in_flight = collections.deque()  # (future, doc numbers) in submission order

  def collect(job, docs):
    lengths, tokens = job.result()
    kept = lengths > 0
    stats["dropped_sentences"] += int(np.count_nonzero(~kept))
    token_chunks.append(tokens)
    length_chunks.append(lengths[kept])
    doc_chunks.append(docs[kept])

  # Sentencepiece releases the GIL: batch k is encoded while batch k+1 is split.
  with (concurrent.futures.ThreadPoolExecutor(max_workers=1) if pipelined
        else _InlineExecutor()) as pool:
    def flush():
      in_flight.append((pool.submit(_encode_flat, vocab, list(pending), num_threads),
                        np.asarray(pending_docs, np.int64)))
      pending.clear()
      pending_docs.clear()
      while len(in_flight) > 1:
        collect(*in_flight.popleft())

    num_source = len(source)
    for i in range(num_source):
      text = source[i]
      if not text or text.isspace():
        continue
      stats["characters"] += len(text)
      sentences = split_sentences(text, max_chars=max_sentence_chars)
      pending.extend(sentences)
      pending_docs.extend(itertools.repeat(i, len(sentences)))
      if len(pending) >= batch_sentences:
        flush()
    if pending:
      flush()
    while in_flight:
      collect(*in_flight.popleft())

  sentence_doc = np.concatenate(doc_chunks) if doc_chunks else np.zeros(0, np.int64)
  counts = np.bincount(sentence_doc, minlength=num_source)
  doc_source = np.flatnonzero(counts > 0).astype(np.int64)
  stats["skipped_documents"] = num_source - len(doc_source)
  stats["source_documents"] = num_source
  counts = counts[counts > 0]
  lengths = np.concatenate(length_chunks) if length_chunks else np.zeros(0, np.int64)
  tokens = np.concatenate(token_chunks) if token_chunks else np.zeros(0, np.int32)
  store = TokenStore(tokens, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                     np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), doc_source)
  seconds = time.perf_counter() - start
  stats.update(documents=store.num_docs, sentences=store.num_sentences,
               tokens=store.num_tokens, seconds=round(seconds, 3),
               tokens_per_second=round(store.num_tokens / max(seconds, 1e-9)),
               source=source.stats.as_dict() if hasattr(source, "stats") else {})
  _require_tokens(store, source)  # before anything is written
  if npz_path is not None:
    store.save(npz_path)
    # Several processes (hosts on one shared filesystem) may build at once.
    tmp = json_path.with_name(f"{json_path.name}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(stats, indent=1))
    tmp.replace(json_path)
  return store, dict(stats, cache="off" if npz_path is None else "miss")


class _InlineExecutor(contextlib.AbstractContextManager):
  """submit() runs the call at once and returns its finished future."""

  def submit(self, fn, *args):
    future = concurrent.futures.Future()
    future.set_result(fn(*args))
    return future

  def __exit__(self, *exc):
    return False


def _require_tokens(store: TokenStore, source) -> None:
  """DataSourceError naming `source` when the store holds no document."""
  if store.num_docs:
    return
  spec = getattr(source, "spec", None)
  what = f"source {spec!r}: none of its" if spec else "none of the"
  raise DataSourceError(f"{what} {len(source)} documents holds text to tokenize (all empty"
                        " or whitespace only); nothing to train on")


def _encode_flat(vocab, sentences, num_threads):
  """([S] int64 token counts, [N] int32 tokens of all sentences back to back)."""
  ids = vocab.encode_lists(sentences, num_threads)
  lengths = np.fromiter(map(len, ids), np.int64, count=len(ids))
  tokens = np.fromiter(itertools.chain.from_iterable(ids), np.int32, count=int(lengths.sum()))
  return lengths, tokens


def _cache_key(source, vocab, max_sentence_chars) -> str:
  h = hashlib.sha256()
  if hasattr(source, "identity"):
    identity = source.identity()
  else:
    texts = hashlib.sha256()
    for i in range(len(source)):
      texts.update(source[i].encode("utf-8", "surrogatepass") + b"\0")
    identity = "texts:" + texts.hexdigest()
  for part in (identity, vocab.fingerprint, f"v{STORE_FORMAT_VERSION}",
               f"max_sentence_chars={max_sentence_chars}"):
    h.update(part.encode() + b"\0")
  return h.hexdigest()


def tokenization_throughput(vocab=None, source=None, *, family: str = "t5",
                            num_threads: int | None = None, repeats: int = 3) -> dict:
  """Tokens/s of build_store (split + encode + store), best of `repeats`, no cache.

  Defaults: the embedded corpus and the shipped vocabulary of `family`, encoding on
  `num_threads` threads (default all cores) while the main thread splits sentences;
  tokens_per_second_per_core divides by the machine's cores, which all take part.
  """
  from t5x_like.data.sources import EmbeddedCorpus
  from t5x_like.data.vocab import default_vocab
  vocab = default_vocab(family) if vocab is None else vocab
  source = EmbeddedCorpus() if source is None else source
  cores = os.cpu_count() or 1
  threads = num_threads or cores
  texts = list(source)  # read once: time the tokenization, not the disk

  best = None
  for _ in range(max(1, repeats)):
    _, stats = build_store(texts, vocab, num_threads=threads)
    if best is None or stats["seconds"] < best["seconds"]:
      best = stats
  split_start = time.perf_counter()
  for text in texts:
    split_sentences(text)
  split_seconds = time.perf_counter() - split_start
  tps = best["tokens"] / max(best["seconds"], 1e-9)
  return dict(family=vocab.family, vocab_size=vocab.vocab_size, documents=best["documents"],
              sentences=best["sentences"], tokens=best["tokens"],
              characters=best["characters"], seconds=best["seconds"],
              split_seconds=round(split_seconds, 3), num_threads=threads, cores=cores,
              tokens_per_second=round(tps), tokens_per_second_per_core=round(tps / cores))
