"""`t5x-like data prepare` (Apache Beam) and training on a prepared corpus.

The reference is today's in-memory path: build_store + split_held_out on the same
source; a prepared corpus must hold the same tokens and offsets, whatever the number
of Beam workers, and a run on it must see the same batches.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from t5x_like import cli
from t5x_like.data.loader import BatchPlan
from t5x_like.data.pipeline import make_objective
from t5x_like.data.prepared import open_prepared
from t5x_like.data.sources import JsonlFiles
from t5x_like.data.store import split_held_out
from t5x_like.data.tokenize import build_store
from t5x_like.data.vocab import default_vocab
from helpers import ROOT, xla_flags

CONFIGS = os.path.join(ROOT, "configs")
T5 = f"{CONFIGS}/t5_cpu.py:smoke"
BERT = f"{CONFIGS}/bert_cpu.py:smoke"


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
  """130 documents (passages of the embedded books) over 3 files, with 3 unusable rows:
  enough for the by-document held-out rule (100 or more source documents)."""
  from t5x_like import corpus
  words = corpus.read_book(corpus.book_names()[0]).split()
  folder = tmp_path_factory.mktemp("jsonl")
  rows = [json.dumps({"text": " ".join(words[i * 300:(i + 1) * 300]) + "."})
          for i in range(127)]
  rows[5] = "not json"
  rows[40] = json.dumps({"title": "no text field"})
  rows[77] = json.dumps({"text": "   "})
  rows += [json.dumps({"text": " ".join(words[-300 * k:][:300]) + "."}) for k in (1, 2, 3)]
  for f in range(3):
    (folder / f"part-{f}.jsonl").write_text("\n".join(rows[f::3]) + "\n")
  return f"jsonl:{folder}/*.jsonl"


def _prepare(config, out, *extra):
  return cli.main(["data", "prepare", f"--config={config}", f"--out={out}", *extra])


def _arrays(store):
  return {name: np.asarray(getattr(store, name))
          for name in ("tokens", "sentence_offsets", "doc_sentences")}


def test_prepared_corpus_equals_the_in_memory_store_for_1_and_4_workers(jsonl, tmp_path):
  source_flag = f"--config.data.source={jsonl}"
  assert _prepare(T5, tmp_path / "one", source_flag, "--num_workers=1",
                  "--num_shards=5") == 0
  assert _prepare(T5, tmp_path / "four", source_flag, "--num_workers=4",
                  "--num_shards=5") == 0
  names = sorted(os.listdir(tmp_path / "one"))
  assert names == sorted(os.listdir(tmp_path / "four")) and "manifest.json" in names
  for name in names:  # bit for bit, whatever the number of workers
    assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "four" / name).read_bytes()

  vocab = default_vocab("t5")
  source = JsonlFiles(jsonl[len("jsonl:"):])
  store, stats = build_store(source, vocab)
  train, held = split_held_out(store, 0.02, stats["source_documents"])
  for split, want in (("train", train), ("held_out", held)):
    got, manifest = open_prepared(tmp_path / "four", vocab, split=split)
    for name, array in _arrays(want).items():
      np.testing.assert_array_equal(_arrays(got)[name], array, err_msg=f"{split} {name}")
  assert manifest["source_documents"] == 130
  assert manifest["bad_input"] == {"empty_documents": 1, "invalid_utf8": 0,
                                   "malformed_json": 1, "missing_field": 1}
  assert held.num_docs == 2  # every 50th source document (fraction 0.02)


def test_sentence_rule_and_embedded_books(tmp_path):
  """Fewer than 100 documents: the tail of every document is held out, as in memory."""
  assert _prepare(BERT, tmp_path / "p", "--num_workers=1", "--num_shards=3") == 0
  vocab = default_vocab("bert")
  from t5x_like.data.sources import EmbeddedCorpus
  store, stats = build_store(EmbeddedCorpus(), vocab)
  for split, want in zip(("train", "held_out"), split_held_out(store, 0.02, 8)):
    got, _ = open_prepared(tmp_path / "p", vocab, split=split)
    for name, array in _arrays(want).items():
      np.testing.assert_array_equal(_arrays(got)[name], array, err_msg=f"{split} {name}")


def _train(workdir, config, *extra):
  return subprocess.run(
      [sys.executable, "-m", "t5x_like.cli", "train", f"--config={config}",
       f"--workdir={workdir}", "--config.train.num_steps=4", "--config.train.eval_every=2",
       "--config.train.checkpoint_every=0", "--config.train.log_every=1",
       "--config.optimizer.warmup_steps=2", *extra],
      capture_output=True, text=True, cwd=ROOT, timeout=600)


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [{k: v for k, v in r.items() if "loss" in k or "accuracy" in k} for r in rows]


@pytest.mark.parametrize("config", [pytest.param(T5, marks=pytest.mark.long),
                                    pytest.param(BERT, marks=pytest.mark.long)])
def test_a_run_on_a_prepared_corpus_equals_the_in_memory_run(config, tmp_path, jsonl):
  source = f"--config.data.source={jsonl}" if config == T5 else "--config.data.source=embedded"
  assert _prepare(config, tmp_path / "prepared", source, "--num_workers=1") == 0
  memory = _train(tmp_path / "memory", config, source)
  assert memory.returncode == 0, memory.stderr[-2000:]
  prepared = _train(tmp_path / "run", config,
                    f"--config.data.source=prepared:{tmp_path / 'prepared'}")
  assert prepared.returncode == 0, prepared.stderr[-2000:]
  want, got = _metrics(tmp_path / "memory"), _metrics(tmp_path / "run")
  assert len(want) >= 4 and got == want


def test_each_host_reads_only_its_share(jsonl, tmp_path):
  """Two hosts' loaders over a prepared corpus gather disjoint shares of the tokens the
  single host gathers for the same global batches."""
  vocab = default_vocab("t5")
  assert _prepare(T5, tmp_path / "p", f"--config.data.source={jsonl}", "--num_workers=1",
                  "--num_shards=4") == 0
  read = []
  for index, count in ((0, 1), (0, 2), (1, 2)):
    store, _ = open_prepared(tmp_path / "p", vocab)
    objective = make_objective("span_corruption", store, vocab, seed=3, length=128,
                               targets_length=32)
    plan = BatchPlan(objective, 16, seed=3, process_index=index, process_count=count)
    for step in range(6):
      plan.host_batch(step)
    read.append(store.tokens.elements_read)
  single, host0, host1 = read
  assert host0 + host1 == single
  assert 0.3 * single < host0 < 0.7 * single


@pytest.mark.long
def test_two_processes_on_a_prepared_corpus_match_one(tmp_path, prepared_t5):
  """2 processes x 4 CPU devices (jax.distributed) reading one prepared corpus give the
  losses of 1 process x 8 devices."""
  import socket
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  source = f"--config.data.source=prepared:{prepared_t5}"
  single = _train(tmp_path / "single", T5, source)
  assert single.returncode == 0, single.stderr[-2000:]
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env["XLA_FLAGS"] = xla_flags(4)
  procs = [subprocess.Popen(
      [sys.executable, "-m", "t5x_like.cli", "train", f"--config={T5}",
       f"--workdir={tmp_path / 'multi'}", "--config.train.num_steps=4",
       "--config.train.eval_every=2", "--config.train.checkpoint_every=0",
       "--config.train.log_every=1", "--config.optimizer.warmup_steps=2", source,
       f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}"],
      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  outputs = [p.communicate(timeout=600)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  want, got = _metrics(tmp_path / "single"), _metrics(tmp_path / "multi")
  assert len(got) == len(want) >= 4
  for w, g in zip(want, got):
    assert w.keys() == g.keys()
    np.testing.assert_allclose([g[k] for k in sorted(g)], [w[k] for k in sorted(w)],
                               rtol=1e-5)


# ---------------------------------------------------------------------- bad input
def _damage(kind, corpus):
  shard = corpus / "train-00000.tokens.npy"
  manifest = corpus / "manifest.json"
  if kind == "missing shard":
    shard.unlink()
  elif kind == "truncated shard":
    shard.write_bytes(shard.read_bytes()[:-100])
  elif kind.startswith("flipped byte"):
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
  elif kind == "older format":
    m = json.loads(manifest.read_text())
    m["format_version"] = 0
    manifest.write_text(json.dumps(m))
  elif kind == "no manifest":
    manifest.unlink()
  return {"missing shard": ["train-00000.tokens.npy", "missing"],
          "truncated shard": ["train-00000.tokens.npy", "bytes"],
          "flipped byte": ["train-00000.tokens.npy", "CRC-32"],
          "flipped byte, full check": ["train-00000.tokens.npy", "SHA-256"],
          "older format": ["manifest.json", "format 0", "prepare"],
          "no manifest": ["manifest.json", "did not finish"],
          "other vocabulary": ["manifest.json", "another vocabulary"]}[kind]


@pytest.fixture(scope="module")
def prepared_t5(tmp_path_factory):
  out = tmp_path_factory.mktemp("prepared") / "t5"
  assert _prepare(T5, out, "--config.data.source=embedded:" + _two_books(),
                  "--num_workers=1", "--num_shards=2") == 0
  return out


def _two_books():
  from t5x_like import corpus
  return ",".join(corpus.book_names()[:2])


@pytest.mark.parametrize("kind", [
    "missing shard", "truncated shard",
    pytest.param("flipped byte", marks=pytest.mark.long),  # found mid-run: it compiles a step
    "flipped byte, full check", "older format", "no manifest", "other vocabulary"])
def test_a_damaged_or_foreign_corpus_stops_the_run_in_one_line(kind, prepared_t5, tmp_path,
                                                               capsys):
  import shutil
  corpus = tmp_path / "corpus"
  shutil.copytree(prepared_t5, corpus)
  words = _damage(kind, corpus)
  before = {p: p.stat().st_mtime_ns for p in corpus.iterdir()}
  config = BERT if kind == "other vocabulary" else T5
  full = ["--config.data.verify_checksums=full"] if kind.endswith("full check") else []
  code = cli.main(["train", f"--config={config}", f"--workdir={tmp_path / 'wd'}",
                   f"--config.data.source=prepared:{corpus}", *full])
  err = capsys.readouterr().err.strip()
  assert code == 2, err
  if kind == "flipped byte":  # found when a batch first reads the block: at that step
    assert "Traceback" not in err, err
    err = err.splitlines()[-1]
  assert len(err.splitlines()) <= 2, err
  for word in words:
    assert word in err, (word, err)
  assert {p: p.stat().st_mtime_ns for p in corpus.iterdir()} == before  # nothing rewritten
  if kind != "flipped byte":
    assert not (tmp_path / "wd" / "checkpoints").exists()


def test_prepare_refuses_a_non_empty_folder_unless_asked(tmp_path, capsys):
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("mine")
  assert _prepare(T5, out, "--config.data.source=embedded:" + _two_books()) == 2
  assert "not empty" in capsys.readouterr().err
  assert (out / "keep.txt").read_text() == "mine"
  assert _prepare(T5, out, "--config.data.source=embedded:" + _two_books(), "--overwrite",
                  "--num_workers=1") == 0
  assert not (out / "keep.txt").exists() and (out / "manifest.json").exists()


@pytest.mark.long
def test_prepare_and_train_on_gcs(gcs, prepared_t5, tmp_path):
  """prepare --out gs://... and a run reading prepared:gs://... (a local fake GCS)."""
  url = "gs://bucket/prepared/t5"
  assert _prepare(T5, url, "--config.data.source=embedded:" + _two_books(),
                  "--num_workers=1", "--num_shards=2") == 0
  from t5x_like import fs
  for name in os.listdir(prepared_t5):
    assert fs.resolve_path(f"{url}/{name}").read_bytes() == (prepared_t5 / name).read_bytes()
  local = _train(tmp_path / "local", T5, f"--config.data.source=prepared:{prepared_t5}")
  remote = _train(tmp_path / "remote", T5, f"--config.data.source=prepared:{url}")
  assert local.returncode == 0 and remote.returncode == 0, remote.stderr[-2000:]
  assert _metrics(tmp_path / "local") == _metrics(tmp_path / "remote")


def test_scattered_gathers_equal_numpy_indexing(prepared_t5):
  """Token reads by runs (pread) give plain numpy indexing of the concatenated shards,
  for scattered, repeated and 2-D indices."""
  vocab = default_vocab("t5")
  store, _ = open_prepared(prepared_t5, vocab)
  shards = sorted(prepared_t5.glob("train-*.tokens.npy"))
  whole = np.concatenate([np.load(p) for p in shards])
  rng = np.random.RandomState(0)
  idx = np.concatenate([rng.randint(0, len(whole), 500), [0, 0, len(whole) - 1],
                        np.arange(1000, 1100)])
  np.testing.assert_array_equal(store.tokens[idx], whole[idx])
  np.testing.assert_array_equal(store.tokens[idx.reshape(-1, 3)], whole[idx.reshape(-1, 3)])


@pytest.mark.parametrize("verify", ["blocks", "none"])
def test_batched_range_reads_equal_numpy_slices(prepared_t5, verify):
  """ShardedArray.read_ranges (one read per group of runs): the concatenated slices of
  the whole array, for ranges across shard boundaries, at the end, empty or overlapping;
  store.doc_token_runs: doc_token_offsets of each range, concatenated."""
  store, _ = open_prepared(prepared_t5, default_vocab("t5"), verify=verify)
  rng = np.random.RandomState(1)
  for array in (store.tokens, store.sentence_offsets, store.doc_token_table,
                store.doc_sentences):
    whole = np.asarray(array[np.arange(len(array))])
    cut = int(array.starts[1])  # the first shard boundary
    lo = np.clip(np.concatenate([rng.randint(0, len(whole), 40),
                                 [cut - 3, cut, 0, len(whole) - 2, len(whole), 5, 5]]),
                 0, len(whole))
    hi = np.minimum(lo + np.concatenate([rng.randint(0, 3000, 40), [7, 1, 0, 2, 0, 9, 9]]),
                    len(whole))
    got = array.read_ranges(lo, hi)
    assert got.dtype == whole.dtype
    np.testing.assert_array_equal(got, np.concatenate([whole[a:b] for a, b in zip(lo, hi)]))
  lo = np.array([0, 1, store.num_docs - 1, 0])
  hi = np.minimum(lo + 1, store.num_docs)
  np.testing.assert_array_equal(store.doc_token_runs(lo, hi), np.concatenate(
      [store.doc_token_offsets(a, b) for a, b in zip(lo, hi)]))


@pytest.mark.parametrize("what", ["tokens", "sentences", "doc_tokens"])
def test_a_damaged_block_fails_only_the_reads_that_touch_it(what, prepared_t5, tmp_path):
  """With CRC checks (the default), a flipped byte fails every read touching its 16 KiB
  block and no other; without them it goes unseen."""
  import shutil
  from t5x_like.data.prepared import PreparedCorpusError
  corpus = tmp_path / "corpus"
  shutil.copytree(prepared_t5, corpus)
  vocab = default_vocab("t5")
  clean, _ = open_prepared(corpus, vocab)
  array = {"tokens": clean.tokens, "sentences": clean.sentence_offsets,
           "doc_tokens": clean.doc_token_table}[what]
  shard = corpus / f"train-00000.{what}.npy"
  header = len(shard.read_bytes()) - 8 * len(np.load(shard)) if what != "tokens" else (
      len(shard.read_bytes()) - 4 * len(np.load(shard)))
  itemsize = 4 if what == "tokens" else 8
  n = len(np.load(shard))
  victim = n - 1 if what == "tokens" else n - 2  # shard 0's last (tables: their end is
  # the next shard's start)
  before = np.asarray(array[np.arange(len(array))])
  data = bytearray(shard.read_bytes())
  data[header + victim * itemsize] ^= 0x01
  shard.write_bytes(bytes(data))
  store, _ = open_prepared(corpus, vocab)
  damaged = {"tokens": store.tokens, "sentences": store.sentence_offsets,
             "doc_tokens": store.doc_token_table}[what]
  with pytest.raises(PreparedCorpusError, match=f"train-00000.{what}.npy.*CRC-32"):
    damaged[np.asarray([victim])]
  with pytest.raises(PreparedCorpusError, match=f"train-00000.{what}.npy.*CRC-32"):
    damaged.read_ranges([0, victim], [1, victim + 1])
  block_start = (header + victim * itemsize) // 16384 * 16384
  first_safe = max(0, (block_start - header) // itemsize - 1)
  safe = np.arange(0, first_safe)
  np.testing.assert_array_equal(damaged[safe], before[safe])
  np.testing.assert_array_equal(damaged.read_ranges([0], [first_safe]), before[safe])
  unchecked, _ = open_prepared(corpus, vocab, verify="none")
  seen = {"tokens": unchecked.tokens, "sentences": unchecked.sentence_offsets,
          "doc_tokens": unchecked.doc_token_table}[what]
  assert seen[victim] != before[victim]
