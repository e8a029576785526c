"""Random access to the .npy shard files of a prepared corpus (data/prepared.py).

  array = ShardFile(path, entry, crc_block_bytes=16384)  # entry: the manifest's
  array[np.array([5, 6, 7, 900])]                        # one read per run of wanted elements
  whole = ShardedArray([array_0, array_1], lengths, adds, np.int64, tail=N)
  whole.read_ranges(starts, ends)                        # many slices: one read per group

A shard file is read by byte ranges: os.pread on a local file (no page of it is mapped
into the process: a memory map counts every page it faults in, and the kernel maps
whole folios; measured, a 2 GB corpus put 1.4 GB of file pages into the RSS of 31
batches), a kept-open file object on a URL (gs://, etils epath). With a CRC table (the
file's `<name>.crc32` sidecar: one little-endian CRC-32 per `crc_block_bytes` block of
the file), every read covers whole blocks and checks each of them, so damage is found
in whatever a host reads, at the cost of reading it, never by a scan of the corpus.
"""

from __future__ import annotations

import io
import os
import zlib
from typing import Optional, Sequence

import numpy as np

from t5x_like.errors import UserError
from t5x_like.fs import is_url

CRC_BLOCK_BYTES = 1 << 14
CRC_READ_WORDS = 1 << 14  # read_runs reads the CRCs of a span up to this many blocks at once


class PreparedCorpusError(UserError, ValueError):
  """A prepared corpus that cannot be read as it is (missing, damaged, foreign)."""


def block_crcs(data: bytes, block: int = CRC_BLOCK_BYTES) -> bytes:
  """[ceil(len / block)] little-endian uint32 CRC-32 of each block of `data`."""
  view = memoryview(data)
  return np.asarray([zlib.crc32(view[i:i + block]) for i in range(0, len(data), block)],
                    "<u4").tobytes()


def _file_size(path) -> int:
  stat = path.stat()
  return stat.length if hasattr(stat, "length") else stat.st_size


def check_file(path, entry: dict, corpus) -> None:
  """PreparedCorpusError unless `path` exists at the manifest's size."""
  name = entry["name"]
  if not path.exists():
    raise PreparedCorpusError(f"prepared corpus {corpus}: shard file {name} is missing")
  size = _file_size(path)
  if size != entry["bytes"]:
    raise PreparedCorpusError(f"prepared corpus {corpus}: shard file {name} has {size}"
                              f" bytes, the manifest says {entry['bytes']} (truncated or"
                              " replaced)")


class _Reader:
  """Bytes [lo, hi) of one file: os.pread locally, seek + read on a URL; reopened
  after pickling (loader worker processes)."""

  def __init__(self, path):
    self.path, self.url = path, is_url(os.fspath(path))
    self._handle = None

  def __getstate__(self):
    return dict(self.__dict__, _handle=None)

  def __del__(self, _close=os.close):  # os.close may be gone at interpreter exit
    if self._handle is not None and not self.url:
      _close(self._handle)

  def __call__(self, lo: int, hi: int) -> bytes:
    if self._handle is None:
      self._handle = self.path.open("rb") if self.url else os.open(os.fspath(self.path),
                                                                   os.O_RDONLY)
    if self.url:
      self._handle.seek(lo)
      return self._handle.read(hi - lo)
    return os.pread(self._handle, hi - lo, lo)

  def into(self, lo: int, hi: int, buffer: memoryview) -> memoryview:
    """Bytes [lo, hi), read into `buffer` (at least hi - lo bytes) on a local file."""
    if self.url or self._handle is None:
      data = memoryview(self(lo, hi))
      buffer[:len(data)] = data
      return buffer[:len(data)]
    return buffer[:os.preadv(self._handle, [buffer[:hi - lo]], lo)]


class ShardFile:
  """A 1-D .npy shard file's data, indexed by int arrays (any shape); its header is
  read and checked on construction."""

  def __init__(self, path, entry: dict, corpus, *, crc_block_bytes: Optional[int] = None):
    self.name, self.corpus, self.file_bytes = entry["name"], corpus, entry["bytes"]
    self._read = _Reader(path)
    header = self._read(0, min(self.file_bytes, 4096))
    f = io.BytesIO(header)
    try:
      version = np.lib.format.read_magic(f)
      read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                     else np.lib.format.read_array_header_2_0)
      shape, _, dtype = read_header(f)
    except ValueError as e:
      raise PreparedCorpusError(f"prepared corpus {corpus}: shard file {self.name} is not a"
                                f" .npy array ({e})") from None
    if len(shape) != 1:
      raise PreparedCorpusError(f"prepared corpus {corpus}: {self.name} has shape {shape}")
    self.offset, self.dtype, self.length = f.tell(), np.dtype(dtype), shape[0]
    if self.offset + self.length * self.dtype.itemsize != self.file_bytes:
      raise PreparedCorpusError(f"prepared corpus {corpus}: shard file {self.name}: its header"
                                f" says {self.length} {self.dtype} values; the file does not"
                                " hold them")
    self.block = crc_block_bytes
    self._crcs = _Reader(path.parent / entry["crc32"]["name"]) if crc_block_bytes else None

  def __len__(self) -> int:
    return self.length

  def _blocks(self, first: int, last: int) -> bytes:
    """File bytes of CRC blocks [first, last) (the last one may be short), each checked."""
    data = self._read(first * self.block, min(last * self.block, self.file_bytes))
    self._check(memoryview(data), first, self._crcs(4 * first, 4 * last))
    return data

  def _check(self, data: memoryview, first: int, crcs) -> None:
    """PreparedCorpusError unless each block of data (blocks first, first + 1, ...)
    has its CRC-32 in crcs (little-endian uint32 bytes, or a list of ints)."""
    want = np.frombuffer(crcs, "<u4").tolist() if isinstance(crcs, bytes) else crcs
    for j in range(-(-len(data) // self.block)):
      piece = data[j * self.block:(j + 1) * self.block]
      if j >= len(want) or zlib.crc32(piece) != want[j]:
        at = (first + j) * self.block
        raise PreparedCorpusError(
            f"prepared corpus {self.corpus}: shard file {self.name}: bytes {at}..{at + len(piece)}"
            " fail their CRC-32 check (damaged); prepare the corpus again")

  def _checked(self, lo: int, hi: int) -> bytes:
    """File bytes [lo, hi); with CRCs, read as whole blocks and each block checked."""
    if self._crcs is None:
      return self._read(lo, hi)
    first = lo // self.block
    start = lo - first * self.block
    return self._blocks(first, (hi - 1) // self.block + 1)[start:start + hi - lo]

  def read_range(self, lo: int, hi: int) -> np.ndarray:
    """Elements [lo, hi) (0 <= lo <= hi <= len): one read."""
    size = self.dtype.itemsize
    return np.frombuffer(self._checked(self.offset + lo * size, self.offset + hi * size),
                         self.dtype)

  def read_runs(self, starts: np.ndarray, ends: np.ndarray, out: np.ndarray,
                at: np.ndarray, add: int = 0) -> None:
    """out[at[i]:at[i] + ends[i] - starts[i]] = elements [starts[i], ends[i]) + add, for
    each i [R]: one read (of whole CRC blocks, each checked once) per group of runs
    that overlap or touch, into one reused buffer."""
    size, unit = self.dtype.itemsize, self.block or 1
    order = np.argsort(starts, kind="stable")
    lo = self.offset + np.asarray(starts, np.int64)[order] * size  # [R] sorted by start
    hi = np.maximum(self.offset + np.asarray(ends, np.int64)[order] * size, lo)
    first, last = lo // unit, np.maximum(-(-hi // unit), lo // unit + 1)  # [R] units
    new = np.ones(len(order), bool)  # [R] run opens a group
    new[1:] = first[1:] > np.maximum.accumulate(last)[:-1]
    heads = np.flatnonzero(new)
    g_first = first[heads]
    g_last = np.minimum(np.maximum.reduceat(last, heads) if len(heads) else g_first,
                        -(-self.file_bytes // unit))
    spans = list(zip(g_first.tolist(), g_last.tolist()))
    crcs = None
    if self._crcs is not None and spans and spans[-1][1] - spans[0][0] <= CRC_READ_WORDS:
      crcs = np.frombuffer(self._crcs(4 * spans[0][0], 4 * spans[-1][1]), "<u4").tolist()
    buffer = memoryview(bytearray(int((g_last - g_first).max(initial=0)) * unit))
    group = np.cumsum(new) - 1  # [R] each run's group
    runs = zip(group.tolist(), (lo - g_first[group] * unit).tolist(),  # byte in the group
               ((hi - lo) // size).tolist(), np.asarray(at)[order].tolist())
    run = next(runs, None)
    for g, (a, b) in enumerate(spans):
      data = self._read.into(a * unit, min(b * unit, self.file_bytes), buffer)
      if self._crcs is not None:
        self._check(data, a, self._crcs(4 * a, 4 * b) if crcs is None
                    else crcs[a - spans[0][0]:b - spans[0][0]])
      while run is not None and run[0] == g:
        _, skip, n, o = run
        np.add(np.frombuffer(data, self.dtype, n, skip), add, out=out[o:o + n])
        run = next(runs, None)

  def __getitem__(self, idx) -> np.ndarray:
    size, base = self.dtype.itemsize, self.offset
    return gather_runs(idx, self.dtype,
                       lambda lo, hi: self._checked(base + lo * size, base + hi * size))


def sorted_unique(values: np.ndarray) -> np.ndarray:
  """np.unique of a 1-D int array by sorting, with a fast path for increasing input
  (numpy's hash-based unique costs ~70 us even on a thousand values)."""
  if values.size < 2 or (values[1:] > values[:-1]).all():
    return values
  ordered = np.sort(values)
  return ordered[np.concatenate([[True], ordered[1:] != ordered[:-1]])]


def gather_runs(idx, dtype: np.dtype, read) -> np.ndarray:
  """array[idx] (any shape) where read(lo, hi) returns the bytes of elements [lo, hi):
  one read per run of consecutive wanted elements."""
  idx = np.asarray(idx, np.int64)
  flat = idx.reshape(-1)
  if flat.size == 0:
    return np.zeros(idx.shape, dtype)
  wanted = sorted_unique(flat)
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
      start, stop, step = idx.indices(self.length)
      if step == 1:
        return self._range(start, max(start, stop))
      return self[np.arange(start, stop, step)]
    idx = np.asarray(idx, np.int64)
    flat = idx.reshape(-1)
    self.elements_read += flat.size
    out = np.empty(flat.shape, self.dtype)
    part = np.searchsorted(self.starts, flat, side="right") - 1
    for k in sorted_unique(part):
      sel = part == k
      if k == len(self.arrays):  # the tail
        out[sel] = self.tail
        continue
      local = flat[sel] - self.starts[k]
      out[sel] = np.asarray(self.arrays[k][local], self.dtype) + self.adds[k]
    return out.reshape(idx.shape)

  def read_ranges(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Elements [starts[i], ends[i]) for each i [R] (inside the array), concatenated:
    one ShardFile.read_runs per shard they touch."""
    starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    starts, ends = starts[ends > starts], ends[ends > starts]
    self.elements_read += int((ends - starts).sum())
    # each range split at the shard boundaries inside it: pieces [P], in output order
    first = np.searchsorted(self.starts, starts, side="right") - 1
    count = np.searchsorted(self.starts, ends - 1, side="right") - first
    shard = np.repeat(first - np.cumsum(count) + count, count) + np.arange(count.sum())
    lo = np.maximum(np.repeat(starts, count), self.starts[shard])
    hi = np.minimum(np.repeat(ends, count), np.append(self.starts[1:], self.length)[shard])
    shard, lo, hi = shard[hi > lo], lo[hi > lo], hi[hi > lo]  # (empty shards)
    out = np.empty(int((hi - lo).sum()), self.dtype)
    at = np.cumsum(hi - lo) - (hi - lo)  # [P] where each piece goes in `out`
    for k in sorted_unique(shard).tolist():
      sel = shard == k
      if k == len(self.arrays):  # the tail
        out[at[sel]] = self.tail
      else:
        self.arrays[k].read_runs(lo[sel] - self.starts[k], hi[sel] - self.starts[k], out,
                                 at[sel], self.adds[k])
    return out

  def _range(self, lo: int, hi: int) -> np.ndarray:
    """Elements [lo, hi) by one contiguous read per shard they span."""
    self.elements_read += hi - lo
    parts = []
    k = int(np.searchsorted(self.starts, lo, side="right")) - 1
    while lo < hi:
      if k >= len(self.arrays):  # the tail
        parts.append(np.asarray([self.tail], self.dtype))
        break
      end = min(hi, int(self.starts[k + 1]))
      if end > lo:
        local = self.arrays[k].read_range(lo - int(self.starts[k]), end - int(self.starts[k]))
        parts.append(local.astype(self.dtype) + self.adds[k])
      lo, k = end, k + 1
    return np.concatenate(parts) if parts else np.zeros(0, self.dtype)
