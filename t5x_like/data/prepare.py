"""Tokenize a source once, with Apache Beam, into a prepared corpus (data/prepared.py)
that training reads in place; the pipeline of `t5x-like data prepare` (commands/prepare.py).

  manifest = run_prepare("text:books/*.txt", vocab, "DIR", held_out_fraction=0.02,
                         num_workers=4)

The source's documents are cut into `num_shards` contiguous ranges of source indices;
each Beam element is one range, tokenized by one worker exactly as build_store does
(sentence splitting, the config's vocabulary) and split into train / held-out by
store.HeldOutRule at data.eval_fraction, then written as the range's shard files. A
last step writes manifest.json. Every shard is a function of (source, vocabulary,
range) alone, so the corpus is the same bit for bit whatever the runner and the number
of workers. Then each split's chunk table (the token offset of every
store.STREAM_CHUNK_DOCS-th document) is written from the shards. The DirectRunner with several worker processes is the local default; on
Dataflow, pass `--runner DataflowRunner -- --project P --region R --temp_location
gs://...` and a gs:// --out.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Optional, Sequence

from t5x_like.data.prepared import (MANIFEST, SPLITS, manifest_dict, write_chunk_tables,
                                    write_shard)
from t5x_like.data.sources import source_from_spec
from t5x_like.data.store import HeldOutRule, split_by_rule
from t5x_like.errors import UserError
from t5x_like.fs import PathLike, resolve_path

# Documents per shard by default: shards of ~1-20 MB for books, web pages, articles.
DOCS_PER_SHARD = 2000
RUNNERS = ("DirectRunner", "DataflowRunner", "FlinkRunner", "SparkRunner")


class _Range:
  """Documents [lo, hi) of a source, as a source (build_store's input)."""

  def __init__(self, source, lo: int, hi: int):
    self.source, self.lo, self.hi = source, lo, hi

  def __len__(self):
    return self.hi - self.lo

  def __getitem__(self, i):
    return self.source[self.lo + i]


def shard_ranges(num_docs: int, num_shards: int) -> list[tuple[int, int]]:
  """`num_shards` contiguous [lo, hi) ranges covering 0 .. num_docs, sizes within one."""
  return [(num_docs * k // num_shards, num_docs * (k + 1) // num_shards)
          for k in range(num_shards)]


def prepare_range(source, vocab, index: int, lo: int, hi: int, out: PathLike,
                  rule: HeldOutRule, max_sentence_chars: int = 2000) -> dict:
  """Tokenizes source documents [lo, hi) and writes shard `index` of every split.

  Returns {"index", "shards": {split: manifest entry}, "bad_input": counters}.
  """
  from t5x_like.data.store import TokenStore
  from t5x_like.data.tokenize import build_store
  from t5x_like.data.document_source import DataSourceError
  before = dict(source.stats.as_dict()) if hasattr(source, "stats") else {}
  try:
    store, _ = build_store(_Range(source, lo, hi), vocab, num_threads=1,
                           max_sentence_chars=max_sentence_chars, pipelined=False)
    store = TokenStore(store.tokens, store.sentence_offsets, store.doc_sentences,
                       store.doc_source + lo)
  except DataSourceError:  # no usable document in this range: empty shards
    store = TokenStore.from_documents([])
  after = source.stats.as_dict() if hasattr(source, "stats") else {}
  bad = {k: after.get(k, 0) - before.get(k, 0) for k in after}
  shards = {split: write_shard(out, split, index, part)
            for split, part in zip(SPLITS, split_by_rule(store, rule))}
  return {"index": index, "shards": shards, "bad_input": bad}


def _check_out(out: PathLike, overwrite: bool):
  """The output folder, created; UserError if it holds anything and not `overwrite`."""
  path = resolve_path(out, "--out")
  if path.exists() and not path.is_dir():
    raise UserError(f"--out {os.fspath(out)!r} is a file, not a folder")
  entries = sorted(path.iterdir()) if path.exists() else []
  if entries and not overwrite:
    raise UserError(f"--out {os.fspath(out)!r} is not empty ({len(entries)} entries, e.g."
                    f" {entries[0].name}); pass --overwrite to replace its contents")
  if entries:  # the manifest first: an interrupted overwrite leaves no valid corpus
    (path / MANIFEST).unlink(missing_ok=True)
    for entry in entries:
      if entry.is_dir():
        entry.rmtree()
      else:
        entry.unlink(missing_ok=True)
  path.mkdir(parents=True, exist_ok=True)
  return path


def run_prepare(spec: str, vocab, out: PathLike, *, held_out_fraction: float,
                runner: str = "DirectRunner", num_workers: int = 1,
                num_shards: Optional[int] = None, overwrite: bool = False,
                beam_args: Sequence[str] = (), max_sentence_chars: int = 2000) -> dict:
  """Prepares source `spec` with `vocab` into `out` (held-out split at
  `held_out_fraction`); returns the manifest plus the run's seconds and runner."""
  if runner not in RUNNERS:
    raise UserError(f"--runner={runner!r}: expected one of {', '.join(RUNNERS)}")
  if num_workers < 1 or (num_shards is not None and num_shards < 1):
    raise UserError(f"--num_workers={num_workers} and --num_shards={num_shards}: must be >= 1")
  if spec.startswith("prepared:"):
    raise UserError(f"data.source={spec!r} is already a prepared corpus; `data prepare` reads"
                    " a raw source: use the config's `raw` variant or --config.data.source")
  source = source_from_spec(spec)
  num_docs = len(source)
  rule = HeldOutRule(held_out_fraction, num_docs)
  shards = num_shards or max(1, math.ceil(num_docs / DOCS_PER_SHARD))
  shards = min(shards, num_docs)
  ranges = shard_ranges(num_docs, shards)
  path = _check_out(out, overwrite)
  start = time.perf_counter()
  results = _run_beam(spec, vocab, ranges, os.fspath(path), rule, runner, num_workers,
                      list(beam_args), max_sentence_chars)
  results = sorted(results, key=lambda r: r["index"])
  if [r["index"] for r in results] != list(range(len(ranges))):
    raise RuntimeError(f"data prepare: {len(results)} of {len(ranges)} shards came back")
  bad: dict[str, int] = {}
  for r in results:
    for k, v in r["bad_input"].items():
      bad[k] = bad.get(k, 0) + v
  manifest = manifest_dict(
      source_spec=spec, vocab=vocab, max_sentence_chars=max_sentence_chars,
      held_out_fraction=held_out_fraction, num_source_docs=num_docs,
      shard_ranges=ranges, shards={s: [r["shards"][s] for r in results] for s in SPLITS},
      bad_input=bad)
  if not manifest["totals"]["train"]["documents"]:
    raise UserError(f"data prepare: no document of source {spec!r} yields a token")
  manifest = write_chunk_tables(path, manifest)
  (path / MANIFEST).write_text(json.dumps(manifest, indent=1))
  return dict(manifest, seconds=round(time.perf_counter() - start, 3),
              runner=f"{runner} x{num_workers}")


class _PrepareRange:
  """The Beam DoFn body: (index, (lo, hi)) -> prepare_range's result; the source is
  opened once per worker."""

  def __init__(self, spec, vocab, out, rule, max_sentence_chars):
    self.spec, self.vocab, self.out = spec, vocab, out
    self.rule, self.max_sentence_chars = rule, max_sentence_chars
    self._source = None

  def __call__(self, element):
    index, (lo, hi) = element
    if self._source is None:
      self._source = source_from_spec(self.spec)
    return prepare_range(self._source, self.vocab, index, lo, hi, self.out, self.rule,
                         self.max_sentence_chars)


def _run_beam(spec, vocab, ranges, out, rule, runner, num_workers, beam_args,
              max_sentence_chars) -> list[dict]:
  logging.disable(logging.WARNING)  # Beam's import warns about GCP clients it may not use
  try:
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions
  except ImportError:
    raise UserError("data prepare needs Apache Beam: pip install -e '.[prepare]'") from None
  finally:
    logging.disable(logging.NOTSET)
  options = PipelineOptions(
      beam_args, runner=runner, direct_num_workers=num_workers,
      direct_running_mode="multi_processing" if num_workers > 1 else "in_memory",
      default_sdk_harness_log_level="ERROR")
  # Beam's DirectRunner forwards every worker's start-up warnings: keep its errors only.
  logging.getLogger("apache_beam").setLevel(logging.ERROR)
  fn = _PrepareRange(spec, vocab, out, rule, max_sentence_chars)
  # The shard entries come back through one file in --out (workers may be other machines).
  results_path = os.path.join(out, ".prepare-results")
  with beam.Pipeline(options=options) as p:
    _ = (p | beam.Create(list(enumerate(ranges))) | beam.Reshuffle() | beam.Map(fn)
         | beam.Map(json.dumps) | beam.combiners.ToList()
         | beam.Map(lambda rows, path=results_path: resolve_path(path).write_text(
             "\n".join(rows))))
  results_file = resolve_path(results_path)
  collected = [json.loads(line) for line in results_file.read_text().splitlines() if line]
  results_file.unlink()
  return collected
