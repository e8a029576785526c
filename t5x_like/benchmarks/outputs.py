"""A benchmark run's outputs: the official metrics of every dev split and the
submission files of its test splits (benchmarks/registry.py says their formats).

  final.update(benchmark_outputs(bench, splits, workdir, predict=predictions.rows))

workdir/submission/ gets the benchmark's files: GLUE's CoLA.tsv ... (index, prediction),
SuperGLUE's BoolQ.jsonl ... ({"idx", "label"}), SQuAD's predictions.json (id -> answer
text of the dev split, the input of the official evaluation script).
"""

from __future__ import annotations

import os
from typing import Callable

import jax
import numpy as np

from t5x_like import fs
from t5x_like.benchmarks.registry import Benchmark, write_submission
from t5x_like.finetune.data import Dataset
from t5x_like.finetune.task_data import Splits


def benchmark_outputs(bench: Benchmark, splits: Splits, workdir: str, *,
                      predict: Callable[[tuple[str, str], Dataset], list[dict]]) -> dict:
  """{'official': the leaderboard's metrics of the dev splits (test_* too where a test
  split has labels; SQuAD 2.0's HasAns_* / NoAns_* too), 'score': the mean of the dev
  splits' headline metrics (Benchmark.metrics), 'submissions': the files written}.

  predict(("dev" | "test", split), dataset): the split's prediction rows
  (finetune/evaluate.prediction_rows). Every process calls this (prediction is
  collective); process 0 writes the files."""
  labels = splits.train.labels
  rows = {("dev", name): predict(("dev", name), dataset) for name, dataset in splits.dev.items()}
  rows.update({("test", name): predict(("test", name), dataset)
               for name, dataset in splits.test.items()})
  official = bench.official_metrics({name: rows["dev", name] for name in splits.dev}, labels,
                                    {name: d.golds for name, d in splits.dev.items()})
  score = float(np.mean([v for k, v in official.items() if bench.scores(k)]))
  for name, dataset in splits.test.items():
    if dataset.labeled:
      official.update({f"test_{k}": v for k, v in bench.official_metrics(
          {name: rows["test", name]}, labels, {name: dataset.golds}).items()})
  written = []
  if jax.process_index() == 0:
    datasets = {**{("dev", n): d for n, d in splits.dev.items()},
                **{("test", n): d for n, d in splits.test.items()}}
    for (kind, name), dataset in datasets.items():
      path = write_submission(bench, name, rows[kind, name], dataset.ids, labels,
                              os.path.join(workdir, "submission"))
      if path:
        written.append(os.path.relpath(path, workdir) if not fs.is_url(path) else path)
  return {"official": {k: round(v, 3) for k, v in official.items()}, "score": round(score, 3),
          "submissions": written}
