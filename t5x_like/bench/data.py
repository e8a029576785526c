"""`t5x-like bench data`: tokens/s per core of each objective, and of tokenization.

Objective plus packing is timed in one process through the loader's BatchPlan
(the exact code path of training, minus grain's thread hand-off), so the figure is
per core. Tokenization is timed separately (tokenize.tokenization_throughput).
"""

from __future__ import annotations

import statistics
import time

from t5x_like.data.loader import BatchPlan
from t5x_like.data.pipeline import OBJECTIVES, make_objective
from t5x_like.data.sources import EmbeddedCorpus
from t5x_like.data.tokenize import build_store, tokenization_throughput
from t5x_like.data.vocab import default_vocab


def bench_objective(objective: str, *, length: int | None = None, batch_size: int = 64,
                    steps: int = 30, repeats: int = 5, seed: int = 0,
                    tokenization: bool = True) -> dict:
  """Median tokens/s (one core) of `steps` host batches, over `repeats` runs.

  Tokens are counted as the sequence length of the produced rows (encoder inputs for
  span corruption, max_seq_length for BERT, the decoder length for LM objectives).
  """
  spec = OBJECTIVES[objective]
  length = length or spec.default_length
  vocab = default_vocab(spec.vocab_family)
  store, store_stats = build_store(EmbeddedCorpus(), vocab)
  extra = {"targets_length": length} if spec.needs_targets_length else {}
  obj = make_objective(objective, store, vocab, seed=seed, length=length, **extra)
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
      "examples_per_epoch": obj.num_examples(0), "corpus_tokens": store.num_tokens,
      "objective_tokens_per_second_per_core": round(statistics.median(rates)),
      "objective_runs": [round(x) for x in rates],
  }
  if tokenization:
    tok = tokenization_throughput(vocab, num_threads=1, repeats=1)
    result["tokenization_tokens_per_second_per_core"] = tok["tokens_per_second"]
    result["tokenization"] = tok
  result["corpus_stats"] = {k: v for k, v in store_stats.items() if k != "source"}
  return result
