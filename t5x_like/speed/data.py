"""`t5x-like bench data`: tokens/s per core of each objective, and of tokenization.

Objective plus packing is timed in one process through the loader's BatchPlan
(the exact code path of training, minus grain's thread hand-off), so the figure is
per core. Tokenization is timed separately (tokenize.tokenization_throughput).
"""

from __future__ import annotations

import atexit
import shutil
import statistics
import tempfile
import time

from t5x_like.speed.environment import environment
from t5x_like.data.loader import BatchPlan
from t5x_like.data.pipeline import OBJECTIVES, make_objective
from t5x_like.data.sources import EmbeddedCorpus
from t5x_like.data.tokenize import build_store, tokenization_throughput
from t5x_like.data.vocab import default_vocab


def bench_objective(objective: str, *, length: int | None = None, batch_size: int = 64,
                    steps: int = 30, repeats: int = 5, seed: int = 0,
                    tokenization: bool = True, mixture: str = "") -> dict:
  """Median tokens/s (one core) of `steps` host batches, over `repeats` runs.

  Tokens are counted as the sequence length of the produced rows (encoder inputs for
  span corruption, max_seq_length for BERT, the decoder length for LM objectives).
  mixture: a data.mixture ("SPEC=RATE,...", data/mixture.py) read as training reads it,
  instead of the embedded corpus.
  """
  spec = OBJECTIVES[objective]
  length = length or spec.default_length
  vocab = default_vocab(spec.vocab_family)
  extra = {"targets_length": length} if spec.needs_targets_length else {}
  if mixture:
    obj, store_stats = _mixture_objective(objective, length, mixture, seed, extra)
    corpus_tokens = sum(m["tokens"] for m in store_stats["mixture"].values())
  else:
    store, store_stats = build_store(EmbeddedCorpus(), vocab)
    obj = make_objective(objective, store, vocab, seed=seed, length=length, **extra)
    corpus_tokens = store.num_tokens
  plan = BatchPlan(obj, batch_size, seed=seed)
  plan.host_batch(0)  # per-epoch plans and streams are built once, like in training
  rates = []
  for r in range(repeats):
    start = time.perf_counter()
    for step in range(1 + r * steps, 1 + (r + 1) * steps):
      plan.host_batch(step)
    rates.append(steps * batch_size * length / (time.perf_counter() - start))
  result = {
      "objective": objective, "length": length, "batch_size": batch_size,
      "examples_per_epoch": obj.num_examples(0), "corpus_tokens": corpus_tokens,
      "objective_tokens_per_second_per_core": round(statistics.median(rates)),
      "objective_runs": [round(x) for x in rates],
  }
  if tokenization:
    tok = tokenization_throughput(vocab, num_threads=1, repeats=1)
    result["tokenization_tokens_per_second_per_core"] = tok["tokens_per_second"]
    result["tokenization"] = tok
  result["corpus_stats"] = {k: v for k, v in store_stats.items() if k != "source"}
  result["environment"] = environment()
  return result


def _mixture_objective(objective: str, length: int, mixture: str, seed: int, extra: dict):
  """(the mixture's train objective, its stats), built from a default config with
  data.mixture = `mixture` by experiment.build_data, as training builds it."""
  from t5x_like.experiment import build_data
  from t5x_like.train.config_check import check_data_sources
  from t5x_like.train.defaults import default_config
  config = default_config()
  config.seed = seed
  config.data.objective, config.data.length, config.data.mixture = objective, length, mixture
  config.data.targets_length = extra.get("targets_length", 0)
  config.data.options = {}
  check_data_sources(config.data)
  cache = tempfile.mkdtemp(prefix="t5x_like_bench_mixture_")  # the tokenized sources
  atexit.register(shutil.rmtree, cache, ignore_errors=True)
  _, obj, _, stats = build_data(config, cache)
  return obj, stats
