"""Prepared corpora: a source tokenized once into shards, read by every host in place.

  DIR/manifest.json                      written last: the corpus is finished
  DIR/<split>-<k>.tokens.npy             [N_k] int32, shard k's sentences back to back
  DIR/<split>-<k>.sentences.npy          [S_k + 1] int64 token offsets of its sentences
  DIR/<split>-<k>.documents.npy          [D_k + 1] int64 sentence offsets of its documents
  DIR/<split>-<k>.doc_tokens.npy         [D_k + 1] int64 token offsets of its documents
  DIR/<split>-<k>.sources.npy            [D_k] int64 source index of each document
  DIR/<split>.chunks.npy                 [C + 1] int64 token offsets of the split's
                                         documents 0, K, 2K, ... and its end
                                         (K = store.STREAM_CHUNK_DOCS)
  DIR/<file>.crc32                       a CRC-32 per 16 KiB block of <file>

split is "train" and "held_out" (store.split_by_rule at the manifest's held_out_fraction).
Shard k holds the usable documents of source range [lo_k, hi_k), in source order, so
the shards of a split, concatenated, are build_store's TokenStore of that split. The
manifest records the format version, the vocabulary (family, size, fingerprint), the
splitter settings, the source spec, per-shard counts, the bytes and SHA-256 of every
file, and the source's bad-input counters. `.npy` files: a fixed header with dtype and
shape, then the raw array, so any position is one byte offset away, and any other
language reads them.

  store, manifest = open_prepared("DIR", vocab, split="train")   # a TokenStore

Opening reads the manifest and the chunk table and checks what is cheap to check: the
format version, the vocabulary, that every file is there at its recorded size. Nothing
else is read until an example needs it (data/shard_files.py). verify="blocks" (the
default) checks each 16 KiB block a read touches against its CRC-32; verify="full"
also hashes every file (SHA-256, on threads) before opening returns, O(corpus);
verify="none" checks no content. Errors are PreparedCorpusError: one line naming the file.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import os
from typing import Any, Optional, Sequence

import numpy as np

from t5x_like.data.shard_files import (CRC_BLOCK_BYTES, PreparedCorpusError, ShardedArray,
                                       ShardFile, block_crcs, check_file)
from t5x_like.data.store import STREAM_CHUNK_DOCS, TokenStore
from t5x_like.errors import UserError
from t5x_like.fs import PathLike, resolve_path

FORMAT = "t5x_like.prepared"
FORMAT_VERSION = 2
SPLITS = ("train", "held_out")
FILES = ("tokens", "sentences", "documents", "doc_tokens", "sources")
MANIFEST = "manifest.json"
VERIFY_MODES = ("blocks", "full", "none")

__all__ = ["PreparedCorpusError", "ShardedArray", "open_prepared", "read_manifest"]


# ------------------------------------------------------------------------ writing
def shard_name(split: str, index: int, what: str) -> str:
  return f"{split}-{index:05d}.{what}.npy"


def _npy_bytes(array: np.ndarray) -> bytes:
  buf = io.BytesIO()
  np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
  return buf.getvalue()


def write_file(out_dir: PathLike, name: str, array: np.ndarray) -> dict:
  """Writes `name` (.npy) and its CRC-32 sidecar; returns its manifest entry."""
  out = resolve_path(out_dir, "--out")
  data = _npy_bytes(array)
  crcs = block_crcs(data, CRC_BLOCK_BYTES)
  (out / name).write_bytes(data)
  (out / f"{name}.crc32").write_bytes(crcs)
  return {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
          "crc32": {"name": f"{name}.crc32", "bytes": len(crcs),
                    "sha256": hashlib.sha256(crcs).hexdigest()}}


def write_shard(out_dir: PathLike, split: str, index: int, store: TokenStore) -> dict:
  """Writes shard `index` of `split`; returns its manifest entry."""
  arrays = {"tokens": np.asarray(store.tokens, np.int32),
            "sentences": np.asarray(store.sentence_offsets, np.int64),
            "documents": np.asarray(store.doc_sentences, np.int64),
            "doc_tokens": store.doc_offsets,
            "sources": (np.arange(store.num_docs, dtype=np.int64) if store.doc_source is None
                        else np.asarray(store.doc_source, np.int64))}
  files = {what: write_file(out_dir, shard_name(split, index, what), array)
           for what, array in arrays.items()}
  return {"index": index, "documents": store.num_docs, "sentences": store.num_sentences,
          "tokens": store.num_tokens, "files": files}


def write_chunk_tables(out_dir: PathLike, manifest: dict) -> dict:
  """Writes each split's chunk table (read from its shards' doc_tokens) and returns
  the manifest with their entries under "chunks"."""
  chunks = {}
  for split in SPLITS:
    store = _open_split(resolve_path(out_dir, "--out"), manifest, split, check=True,
                        with_chunks=False)
    chunks[split] = write_file(out_dir, f"{split}.chunks.npy", store.chunk_token_offsets())
  return dict(manifest, chunks=dict(chunks, stream_chunk_docs=STREAM_CHUNK_DOCS))


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
          "crc_block_bytes": CRC_BLOCK_BYTES, "held_out_fraction": held_out_fraction,
          "source_documents": num_source_docs,
          "shard_ranges": [list(r) for r in shard_ranges], "totals": totals,
          "bad_input": bad_input,
          "splits": {split: sorted(shards[split], key=lambda s: s["index"])
                     for split in SPLITS}}


# ------------------------------------------------------------------------ reading
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


def open_prepared(path: PathLike, vocab, *, split: str = "train", verify: str = "blocks",
                  held_out_fraction: Optional[float] = None) -> tuple[TokenStore, dict]:
  """(TokenStore over the shards of `split`, manifest); see the module docstring.

  held_out_fraction: when given, it must be the one the corpus was prepared with.
  """
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: expected one of {SPLITS}")
  if verify not in VERIFY_MODES:
    raise UserError(f"data.verify_checksums={verify!r}: expected one of {VERIFY_MODES}")
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
  if verify == "full":
    _verify_sha256(root, _split_entries(manifest, split))
  store = _open_split(root, manifest, split, check=verify != "none")
  if not store.num_docs:
    raise PreparedCorpusError(f"prepared corpus {root}: its {split!r} split holds no document")
  return store, manifest


def _split_entries(manifest: dict, split: str) -> list[dict]:
  """Every file entry of `split` (shard files, the chunk table, their CRC sidecars)."""
  entries = [f for s in manifest["splits"][split] for f in s["files"].values()]
  entries.append(manifest["chunks"][split])
  return entries + [e["crc32"] for e in entries]


def _verify_sha256(root, entries: list[dict]) -> None:
  for e in entries:
    check_file(root / e["name"], e, root)
  with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(entries))) as pool:
    for e, digest in zip(entries, pool.map(lambda e: _sha256(root / e["name"]), entries)):
      if digest != e["sha256"]:
        raise PreparedCorpusError(f"prepared corpus {root}: file {e['name']} fails its SHA-256"
                                  " check (damaged); prepare the corpus again")


def _open_split(root, manifest: dict, split: str, *, check: bool,
                with_chunks: bool = True) -> TokenStore:
  """A TokenStore over the files of `split`; checks that each is there at its size."""
  block = manifest["crc_block_bytes"] if check else None

  def opened(entry: dict) -> ShardFile:
    check_file(root / entry["name"], entry, root)
    check_file(root / entry["crc32"]["name"], entry["crc32"], root)
    return ShardFile(root / entry["name"], entry, root, crc_block_bytes=block)

  shards = manifest["splits"][split]
  parts = {what: [opened(s["files"][what]) for s in shards] for what in FILES}
  tokens_n = [s["tokens"] for s in shards]
  sents_n = [s["sentences"] for s in shards]
  docs_n = [s["documents"] for s in shards]
  token_base = np.concatenate([[0], np.cumsum(tokens_n)]).astype(np.int64)
  sent_base = np.concatenate([[0], np.cumsum(sents_n)]).astype(np.int64)
  chunk_table = None
  chunks = manifest.get("chunks", {})
  if with_chunks and chunks.get("stream_chunk_docs") == STREAM_CHUNK_DOCS:
    table = opened(chunks[split])
    chunk_table = table[np.arange(len(table))]
  return TokenStore(
      ShardedArray(parts["tokens"], tokens_n, [0] * len(shards), np.int32),
      ShardedArray(parts["sentences"], sents_n, token_base[:-1], np.int64,
                   tail=int(token_base[-1])),
      ShardedArray(parts["documents"], docs_n, sent_base[:-1], np.int64,
                   tail=int(sent_base[-1])),
      ShardedArray(parts["sources"], docs_n, [0] * len(shards), np.int64),
      doc_token_table=ShardedArray(parts["doc_tokens"], docs_n, token_base[:-1], np.int64,
                                   tail=int(token_base[-1])),
      chunk_token_table=chunk_table)


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
