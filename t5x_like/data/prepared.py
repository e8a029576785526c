"""Prepared corpora: a source tokenized once into shards, read by every host in place.

  DIR/manifest.json                      written last: the corpus is finished
  DIR/<split>-<k>.tokens.npy             [N_k] int32, shard k's sentences back to back
  DIR/<split>-<k>.sentences.npy          [S_k + 1] int64 token offsets of its sentences
  DIR/<split>-<k>.documents.npy          [D_k + 1] int64 sentence offsets of its documents
  DIR/<split>-<k>.sources.npy            [D_k] int64 source index of each document

split is "train" and "held_out" (store.split_by_rule at the manifest's held_out_fraction).
Shard k holds the usable documents of source range [lo_k, hi_k), in source order, so
the shards of a split, concatenated, are build_store's TokenStore of that split. The
manifest records the format version, the vocabulary (family, size, fingerprint), the
splitter settings, the source spec, per-shard counts, the bytes and SHA-256 of every
file, and the source's bad-input counters. `.npy` files: a fixed header with dtype and
shape, then the raw array, so any position is one byte offset away: tokens are read by
contiguous runs (os.pread; byte ranges on gs://), offset tables memory-mapped, and any
other language reads them.

  store = open_prepared("DIR", vocab, split="train")   # a TokenStore over the shards

Opening checks everything that is cheap to check before training: the manifest and its
format version, the vocabulary, that every file is there at its recorded size, and
(verify=True, the default) every file's SHA-256, hashed on threads; it reads no token
into memory. Errors are PreparedCorpusError: one line naming the file.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import mmap
import os
from typing import Any, Optional, Sequence

import numpy as np

from t5x_like.data.store import TokenStore
from t5x_like.errors import UserError
from t5x_like.fs import PathLike, is_url, resolve_path

FORMAT = "t5x_like.prepared"
FORMAT_VERSION = 1
SPLITS = ("train", "held_out")
FILES = ("tokens", "sentences", "documents", "sources")
MANIFEST = "manifest.json"


class PreparedCorpusError(UserError, ValueError):
  """A prepared corpus that cannot be read as it is (missing, damaged, foreign)."""


# ------------------------------------------------------------------------ writing
def shard_name(split: str, index: int, what: str) -> str:
  return f"{split}-{index:05d}.{what}.npy"


def _npy_bytes(array: np.ndarray) -> bytes:
  buf = io.BytesIO()
  np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
  return buf.getvalue()


def write_shard(out_dir: PathLike, split: str, index: int, store: TokenStore) -> dict:
  """Writes shard `index` of `split`; returns its manifest entry."""
  out = resolve_path(out_dir, "--out")
  arrays = {"tokens": np.asarray(store.tokens, np.int32),
            "sentences": np.asarray(store.sentence_offsets, np.int64),
            "documents": np.asarray(store.doc_sentences, np.int64),
            "sources": (np.arange(store.num_docs, dtype=np.int64) if store.doc_source is None
                        else np.asarray(store.doc_source, np.int64))}
  files = {}
  for what, array in arrays.items():
    data = _npy_bytes(array)
    name = shard_name(split, index, what)
    (out / name).write_bytes(data)
    files[what] = {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
  return {"index": index, "documents": store.num_docs, "sentences": store.num_sentences,
          "tokens": store.num_tokens, "files": files}


def manifest_dict(*, source_spec: str, vocab, max_sentence_chars: int, held_out_fraction: float,
                  num_source_docs: int, shard_ranges: Sequence[tuple[int, int]],
                  shards: dict[str, list[dict]], bad_input: dict[str, int]) -> dict:
  from t5x_like.data.tokenize import STORE_FORMAT_VERSION
  totals = {split: {k: sum(s[k] for s in shards[split])
                    for k in ("documents", "sentences", "tokens")} for split in SPLITS}
  return {"format": FORMAT, "format_version": FORMAT_VERSION, "source": source_spec,
          "vocab": {"family": vocab.family, "vocab_size": vocab.vocab_size,
                    "fingerprint": vocab.fingerprint, "path": vocab.path},
          "splitter": {"max_sentence_chars": max_sentence_chars,
                       "store_format_version": STORE_FORMAT_VERSION},
          "held_out_fraction": held_out_fraction, "source_documents": num_source_docs,
          "shard_ranges": [list(r) for r in shard_ranges], "totals": totals,
          "bad_input": bad_input,
          "splits": {split: sorted(shards[split], key=lambda s: s["index"])
                     for split in SPLITS}}


# ------------------------------------------------------------------------ reading
class _PreadArray:
  """A local .npy's data read by contiguous runs with os.pread: a batch's windows cost
  a few reads, and no page of the file is mapped into the process (a memory map would
  count every page it faults in, and the kernel maps whole folios: measured, a 2 GB
  corpus put 1.4 GB of file pages into the RSS of 31 batches)."""

  def __init__(self, path: str, offset: int, dtype: np.dtype, length: int):
    self.path, self.offset, self.dtype, self.length = path, offset, dtype, length
    self._fd: Optional[int] = None

  def __len__(self):
    return self.length

  def __getstate__(self):  # loader worker processes reopen the file
    return dict(self.__dict__, _fd=None)

  def __del__(self):
    if self._fd is not None:
      os.close(self._fd)

  def __getitem__(self, idx):
    if self._fd is None:
      self._fd = os.open(self.path, os.O_RDONLY)
    size = self.dtype.itemsize
    return _gather_runs(idx, self.dtype, lambda lo, hi: os.pread(
        self._fd, (hi - lo) * size, self.offset + lo * size))


class _MappedArray:
  """A local .npy memory-mapped for random access (offset tables: a gather touches
  scattered entries); mapped again after pickling (loader worker processes)."""

  def __init__(self, path: str):
    self.path = path
    self._array = None

  def __getstate__(self):
    return dict(self.__dict__, _array=None)

  def _mapped(self) -> np.ndarray:
    if self._array is None:
      self._array = np.load(self.path, mmap_mode="r")
      mapping = getattr(self._array, "_mmap", None)
      if mapping is not None and hasattr(mmap, "MADV_RANDOM"):
        mapping.madvise(mmap.MADV_RANDOM)  # no readahead around scattered reads
    return self._array

  def __len__(self):
    return len(self._mapped())

  def __getitem__(self, idx):
    return self._mapped()[idx]


class _Blocks:
  """Byte-range reads of a remote .npy's data, by runs of wanted elements, through a
  small cache of 1 MiB blocks."""

  BLOCK = 1 << 20

  def __init__(self, path, offset: int, dtype: np.dtype, length: int):
    self.path, self.offset, self.dtype, self.length = path, offset, dtype, length
    self._cache: dict[int, bytes] = {}

  def __len__(self):
    return self.length

  def __getstate__(self):
    return dict(self.__dict__, _cache={})

  def _bytes(self, lo: int, hi: int) -> bytes:
    first, last = lo // self.BLOCK, (hi - 1) // self.BLOCK
    missing = [b for b in range(first, last + 1) if b not in self._cache]
    if missing:
      with self.path.open("rb") as f:
        for b in missing:
          f.seek(self.offset + b * self.BLOCK)
          self._cache[b] = f.read(self.BLOCK)
    data = b"".join(self._cache[b] for b in range(first, last + 1))
    while len(self._cache) > 64:  # evict after the read: one run may span more blocks
      del self._cache[next(iter(self._cache))]
    return data[lo - first * self.BLOCK:hi - first * self.BLOCK]

  def __getitem__(self, idx):
    size = self.dtype.itemsize
    return _gather_runs(idx, self.dtype, lambda lo, hi: self._bytes(lo * size, hi * size))


def _gather_runs(idx, dtype: np.dtype, read) -> np.ndarray:
  """array[idx] (any shape) where read(lo, hi) returns the bytes of elements [lo, hi):
  one read per run of consecutive wanted elements."""
  idx = np.asarray(idx, np.int64)
  flat = idx.reshape(-1)
  if flat.size == 0:
    return np.zeros(idx.shape, dtype)
  wanted = np.unique(flat)
  breaks = np.flatnonzero(np.diff(wanted) != 1) + 1
  starts = wanted[np.concatenate([[0], breaks])]
  ends = wanted[np.concatenate([breaks - 1, [len(wanted) - 1]])] + 1
  values = np.empty(len(wanted), dtype)
  at = 0
  for lo, hi in zip(starts.tolist(), ends.tolist()):
    values[at:at + hi - lo] = np.frombuffer(read(lo, hi), dtype)
    at += hi - lo
  return values[np.searchsorted(wanted, flat)].reshape(idx.shape)


class ShardedArray:
  """A read-only 1-D array made of shard arrays: part k is `arrays[k][:lengths[k]] +
  adds[k]`, then an optional last element `tail`. Indexing by int, slice or an int
  array (any shape) gathers from the shards; nothing is loaded whole."""

  def __init__(self, arrays: list, lengths: Sequence[int], adds: Sequence[int], dtype,
               tail: Optional[int] = None):
    self.arrays, self.adds, self.dtype, self.tail = arrays, list(adds), np.dtype(dtype), tail
    self.starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    self.length = int(self.starts[-1]) + (tail is not None)
    self.elements_read = 0  # how much this process has gathered (tests, benchmarks)

  def __len__(self) -> int:
    return self.length

  @property
  def shape(self) -> tuple[int]:
    return (self.length,)

  def __array__(self, dtype=None, copy=None):
    out = self[np.arange(self.length)]
    return out if dtype is None else out.astype(dtype)

  def tolist(self) -> list:
    return np.asarray(self).tolist()

  def __getitem__(self, idx):
    if isinstance(idx, (int, np.integer)):
      i = int(idx) + (self.length if idx < 0 else 0)
      if not 0 <= i < self.length:
        raise IndexError(f"index {int(idx)} out of range for length {self.length}")
      return self[np.asarray([i])][0]
    if isinstance(idx, slice):
      return self[np.arange(*idx.indices(self.length))]
    idx = np.asarray(idx, np.int64)
    flat = idx.reshape(-1)
    self.elements_read += flat.size
    out = np.empty(flat.shape, self.dtype)
    part = np.searchsorted(self.starts, flat, side="right") - 1
    for k in np.unique(part):
      sel = part == k
      if k == len(self.arrays):  # the tail
        out[sel] = self.tail
        continue
      local = flat[sel] - self.starts[k]
      out[sel] = np.asarray(self.arrays[k][local], self.dtype) + self.adds[k]
    return out.reshape(idx.shape)


def _open_npy(path, entry: dict):
  """A random-access reader of a shard file (by byte ranges on a URL, by pread for local
  tokens, memory-mapped for local offset tables), its header checked against the
  manifest."""
  name = entry["name"]
  if not path.exists():
    raise PreparedCorpusError(f"prepared corpus {path.parent}: shard file {name} is missing")
  size = path.stat().length if hasattr(path.stat(), "length") else path.stat().st_size
  if size != entry["bytes"]:
    raise PreparedCorpusError(f"prepared corpus {path.parent}: shard file {name} has {size}"
                              f" bytes, the manifest says {entry['bytes']} (truncated or"
                              " replaced)")
  with path.open("rb") as f:
    try:
      version = np.lib.format.read_magic(f)
      read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                     else np.lib.format.read_array_header_2_0)
      shape, _, dtype = read_header(f)
    except ValueError as e:
      raise PreparedCorpusError(f"prepared corpus {path.parent}: shard file {name} is not a"
                                f" .npy array ({e})") from None
    offset = f.tell()
  if len(shape) != 1:
    raise PreparedCorpusError(f"prepared corpus {path.parent}: {name} has shape {shape}")
  if is_url(os.fspath(path)):
    return _Blocks(path, offset, np.dtype(dtype), shape[0])
  if entry["name"].endswith(".tokens.npy"):
    return _PreadArray(os.fspath(path), offset, np.dtype(dtype), shape[0])
  return _MappedArray(os.fspath(path))


def _sha256(path) -> str:
  h = hashlib.sha256()
  with path.open("rb") as f:
    for chunk in iter(lambda: f.read(1 << 22), b""):
      h.update(chunk)
  return h.hexdigest()


def read_manifest(path: PathLike) -> dict:
  root = resolve_path(path, "prepared corpus")
  file = root / MANIFEST
  if not root.exists():
    raise PreparedCorpusError(f"prepared corpus {os.fspath(path)!r} does not exist")
  if not file.exists():
    raise PreparedCorpusError(f"prepared corpus {os.fspath(path)!r} has no {MANIFEST}: not a"
                              " prepared corpus, or its `t5x-like data prepare` did not finish")
  try:
    manifest = json.loads(file.read_text())
  except (ValueError, UnicodeDecodeError) as e:
    raise PreparedCorpusError(f"{file}: not valid JSON ({e})") from None
  if manifest.get("format") != FORMAT:
    raise PreparedCorpusError(f"{file}: not a t5x_like prepared corpus manifest")
  version = manifest.get("format_version")
  if version != FORMAT_VERSION:
    raise PreparedCorpusError(f"{file}: prepared corpus format {version}; this t5x_like reads"
                              f" format {FORMAT_VERSION}: run `t5x-like data prepare` again")
  return manifest


def open_prepared(path: PathLike, vocab, *, split: str = "train", verify: bool = True,
                  held_out_fraction: Optional[float] = None) -> tuple[TokenStore, dict]:
  """(TokenStore over the shards of `split`, manifest); see the module docstring.

  held_out_fraction: when given, it must be the one the corpus was prepared with.
  """
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: expected one of {SPLITS}")
  root = resolve_path(path, "prepared corpus")
  manifest = read_manifest(path)
  file = root / MANIFEST
  want = manifest["vocab"]
  if want["fingerprint"] != vocab.fingerprint:
    raise PreparedCorpusError(
        f"{file}: prepared with another vocabulary ({want['family']}, {want['vocab_size']}"
        f" ids, {want.get('path') or 'shipped'}) than this run's ({vocab.family},"
        f" {vocab.vocab_size} ids, {vocab.path or 'shipped'}); prepare it again with this"
        " vocabulary")
  if held_out_fraction is not None and held_out_fraction != manifest["held_out_fraction"]:
    raise PreparedCorpusError(
        f"{file}: prepared with held_out_fraction {manifest['held_out_fraction']}; this run"
        f" asks for {held_out_fraction} (data.eval_fraction): prepare again or set it")
  shards = manifest["splits"][split]
  entries = [(root / f["name"], f) for s in shards for f in s["files"].values()]
  opened = {}
  for p, f in entries:
    opened[f["name"]] = _open_npy(p, f)
  if verify:
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(entries) or 1)) as pool:
      for (p, f), digest in zip(entries, pool.map(lambda e: _sha256(e[0]), entries)):
        if digest != f["sha256"]:
          raise PreparedCorpusError(f"prepared corpus {root}: shard file {f['name']} fails"
                                    " its SHA-256 check (damaged); prepare it again")
  parts = {what: [opened[s["files"][what]["name"]] for s in shards] for what in FILES}
  tokens_n = [s["tokens"] for s in shards]
  sents_n = [s["sentences"] for s in shards]
  docs_n = [s["documents"] for s in shards]
  token_base = np.concatenate([[0], np.cumsum(tokens_n)]).astype(np.int64)
  sent_base = np.concatenate([[0], np.cumsum(sents_n)]).astype(np.int64)
  store = TokenStore(
      ShardedArray(parts["tokens"], tokens_n, [0] * len(shards), np.int32),
      ShardedArray(parts["sentences"], sents_n, token_base[:-1], np.int64,
                   tail=int(token_base[-1])),
      ShardedArray(parts["documents"], docs_n, sent_base[:-1], np.int64,
                   tail=int(sent_base[-1])),
      ShardedArray(parts["sources"], docs_n, [0] * len(shards), np.int64))
  if not store.num_docs:
    raise PreparedCorpusError(f"prepared corpus {root}: its {split!r} split holds no document")
  return store, manifest


def is_prepared_spec(spec: str) -> bool:
  return spec.startswith("prepared:")


def prepared_path(spec: str) -> tuple[str, str]:
  """'prepared:DIR[#SPLIT]' -> (DIR, SPLIT or "")."""
  path, _, split = spec[len("prepared:"):].partition("#")
  if split and split not in SPLITS:
    raise PreparedCorpusError(f"source {spec!r}: split {split!r}; expected one of {SPLITS}")
  return path, split


def describe(manifest: dict) -> dict[str, Any]:
  """The counts a run logs about its prepared corpus."""
  return {"prepared": manifest["source"], **manifest["totals"]["train"],
          "source": manifest["bad_input"]}
