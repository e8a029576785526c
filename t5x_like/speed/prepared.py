"""`t5x-like bench data --prepared`: prepared corpora at two sizes, side by side.

  result = bench_prepared(sizes_mb=(50, 2000), objective="span_corruption")

For each size, a synthetic corpus is written to a scratch folder: the embedded books
over and over, each copy's words shuffled within every line by a seeded generator (new
text with the books' vocabulary and line lengths), cut into documents of 40 lines
(about 2 KB, web-page sized: a 2 GB corpus has about a million), one JSONL file per
copy. Then:
- prepare: `t5x-like data prepare`'s pipeline (DirectRunner) with 1 and with 2 worker
  processes: seconds and characters/s per worker;
- start-up, the median of 5 fresh processes (after os.sync(): the writeback of the
  corpus just written does not run during them): each opens the prepared corpus
  (verify "blocks", the default: each block read is CRC-checked; and "full": every file
  hashed first), builds the objective and makes the first host batch: seconds, and how
  far its peak RSS (VmHWM, reset after the imports) grows over the RSS after the imports
  while it also makes 30 more batches (the data side's memory; Linux /proc), split at
  the end into anonymous memory (what the process allocated) and mapped file pages (the
  corpus pages it touched: page cache, which the kernel reclaims at will);
- throughput: tokens/s of the objective's host batches from the prepared corpus, one
  core (as `bench data`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from t5x_like.speed.environment import environment

_STARTUP = r"""
import json, sys, time
start = time.perf_counter()
from t5x_like.data.loader import BatchPlan
from t5x_like.data.pipeline import OBJECTIVES, make_objective
from t5x_like.data.prepared import open_prepared
from t5x_like.data.vocab import default_vocab
path, objective, verify = sys.argv[1], sys.argv[2], sys.argv[3]
spec = OBJECTIVES[objective]
vocab = default_vocab(spec.vocab_family)
def status_kb(key):
  for line in open("/proc/self/status"):
    if line.startswith(key + ":"):
      return int(line.split()[1])
open("/proc/self/clear_refs", "w").write("5")  # resets the peak (VmHWM) to the current RSS
imported = time.perf_counter()
rss_imports, anon_imports, file_imports = (status_kb(k) for k in ("VmRSS", "RssAnon",
                                                                   "RssFile"))
store, _ = open_prepared(path, vocab, verify=verify)
opened = time.perf_counter()
extra = {"targets_length": spec.default_length} if spec.needs_targets_length else {}
obj = make_objective(objective, store, vocab, seed=0, length=spec.default_length, **extra)
plan = BatchPlan(obj, 64, seed=0)
plan.host_batch(0)
first = time.perf_counter()
steps = 30
for step in range(1, steps + 1):
  plan.host_batch(step)
done = time.perf_counter()
print(json.dumps({
    "open_seconds": round(opened - imported, 4),
    "to_first_batch_seconds": round(first - imported, 4),
    "rss_after_imports_mb": round(rss_imports / 1024, 1),
    "peak_rss_growth_mb": round((status_kb("VmHWM") - rss_imports) / 1024, 1),
    "anon_rss_growth_mb": round((status_kb("RssAnon") - anon_imports) / 1024, 1),
    "file_rss_growth_mb": round((status_kb("RssFile") - file_imports) / 1024, 1),
    "tokens_per_second_per_core": round(steps * 64 * spec.default_length / (done - first)),
    "documents": store.num_docs, "tokens": store.num_tokens}))
"""


DOC_LINES = 40


def write_synthetic_corpus(folder: str, size_mb: float, seed: int = 0) -> dict:
  """JSONL files of about size_mb MB of text in `folder` (module docstring); counts."""
  from t5x_like import corpus
  books = [corpus.read_book(name) for name in corpus.book_names()]
  rng = np.random.default_rng(seed)
  os.makedirs(folder, exist_ok=True)
  written, files, documents = 0, 0, 0
  target = int(size_mb * 1e6)
  while written < target:
    book = books[files % len(books)]
    lines = []
    for line in book.split("\n"):
      words = line.split(" ")
      rng.shuffle(words)
      lines.append(" ".join(words))
    docs = ["\n".join(lines[i:i + DOC_LINES]) for i in range(0, len(lines), DOC_LINES)]
    with open(os.path.join(folder, f"copy-{files:05d}.jsonl"), "w") as f:
      for doc in docs:
        if written >= target:
          break
        if doc.strip():
          f.write(json.dumps({"text": doc}) + "\n")
          written += len(doc.encode())
          documents += 1
    files += 1
  return {"files": files, "documents": documents, "bytes": written}


def _startup(path: str, objective: str, verify: str, runs: int = 5) -> dict:
  """The start-up figures of `runs` fresh processes: the median of each."""
  rows = []
  for _ in range(runs):
    out = subprocess.run([sys.executable, "-c", _STARTUP, path, objective, verify],
                         capture_output=True, text=True, check=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
  return {k: (rows[0][k] if k in ("documents", "tokens") else
              float(np.median([r[k] for r in rows]))) for k in rows[0]}


def bench_prepared(*, sizes_mb=(50, 2000), objective: str = "span_corruption",
                   workers=(1, 2), scratch: str | None = None) -> dict:
  """The JSON of `t5x-like bench data --prepared` (module docstring)."""
  from t5x_like.data.pipeline import OBJECTIVES
  from t5x_like.data.prepare import run_prepare
  from t5x_like.data.vocab import default_vocab
  if objective not in OBJECTIVES:
    raise ValueError(f"objective {objective!r}: expected one of {sorted(OBJECTIVES)}")
  root = tempfile.mkdtemp(prefix="t5x_like_bench_prepared_", dir=scratch)
  result = {"objective": objective, "cores": os.cpu_count(), "sizes": {}}
  try:
    for size in sizes_mb:
      text_dir = os.path.join(root, f"text-{size}")
      made = write_synthetic_corpus(text_dir, size)
      row = {"text_files": made["files"], "text_documents": made["documents"],
             "text_bytes": made["bytes"], "prepare": {}}
      vocab = default_vocab(OBJECTIVES[objective].vocab_family)
      prepared = None
      for n in workers:
        out = os.path.join(root, f"prepared-{size}-{n}")
        start = time.perf_counter()
        manifest = run_prepare(f"jsonl:{text_dir}/*.jsonl", vocab, out, held_out_fraction=0.02,
                               num_workers=n, num_shards=max(4, 2 * n))
        seconds = time.perf_counter() - start
        row["prepare"][f"workers_{n}"] = {
            "seconds": round(seconds, 2),
            "mb_per_second_per_worker": round(made["bytes"] / 1e6 / seconds / n, 2),
            "tokens": manifest["totals"]["train"]["tokens"]}
        if prepared is not None:
          shutil.rmtree(prepared)
        prepared = out
      times = [row["prepare"][f"workers_{n}"]["seconds"] for n in workers]
      row["prepare"]["speedup_last_over_first"] = round(times[0] / times[-1], 2)
      shutil.rmtree(text_dir)
      if hasattr(os, "sync"):  # the corpus just written: its writeback not in the timings
        os.sync()
      row["startup_blocks"] = _startup(prepared, objective, verify="blocks")
      row["startup_full"] = _startup(prepared, objective, verify="full")
      result["sizes"][f"{size}MB"] = row
      shutil.rmtree(prepared)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  result["environment"] = environment()
  return result
