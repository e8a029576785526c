"""A benchmark as the data source of a fine-tuning run (finetune/task_data.py's TaskData),
and the choice of source for a config.

  data = task_data(config)        # BenchmarkTaskData where config.benchmark.name is set,
                                  # else the CSV / JSONL files' FileTaskData
  finetune(config, workdir, data=data)

A benchmark (config.benchmark.name, e.g. "glue/mnli"; registry.py) sets the task type
and columns, and reads its splits from its own files or a TFDS build (sources.py):
train, every dev split (MNLI: matched and mismatched; the first is evaluated during
training), and with config.benchmark.predict_test its test splits, predicted for the
submission files (GLUE's and SuperGLUE's have no labels; one that has them is scored
too). With config.benchmark.holdout_fraction a seeded part of train is the one dev
split, "holdout", and dev and test are not read (hold_out below). After evaluation:
the official metrics and the submission files (outputs.py).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

import ml_collections
import numpy as np

from t5x_like.benchmarks.outputs import benchmark_outputs
from t5x_like.benchmarks.registry import BenchmarkError, benchmark
from t5x_like.benchmarks.sources import check_benchmark
from t5x_like.finetune.data import Dataset
from t5x_like.finetune.splits import FileTaskData
from t5x_like.finetune.task import Task
from t5x_like.finetune.task_data import FinalPredictions, Splits, TaskData
from t5x_like.finetune.tasks import task_from_config


def task_data(config) -> TaskData:
  """The data source config names: its benchmark, else its task files."""
  return BenchmarkTaskData() if config.benchmark.name else FileTaskData()


def benchmark_task(config, text_to_text: bool) -> Task:
  """The benchmark's task type and columns (the rows of registry.py) with config.task's
  other options."""
  bench = benchmark(config.benchmark.name)
  options = config.task.to_dict()
  options.update(name=bench.task_name(text_to_text), text_column="text", label_column="label",
                 text_pair_column="text_pair" if bench.text_pair and not text_to_text else "",
                 task_prefix="", labels=())
  if bench.kind == "span":
    options.update(allow_no_answer=bench.unanswerable)
    if not text_to_text:
      options.update(answer_text_column="answer_text", answer_start_column="answer_start")
  return task_from_config(ml_collections.ConfigDict(options))


def benchmark_splits(config, task: Task, text_to_text: bool) -> Splits:
  """The benchmark's splits (module docstring)."""
  from t5x_like.benchmarks import sources  # looked up at call time: tests count the reads
  bc = config.benchmark
  bench = benchmark(bc.name)
  read = dict(task=task, text_to_text=text_to_text,
              data_dir=sources.benchmark_data_dir(bc.data_dir))
  train = sources.read_benchmark_split(bench, "train", limit=bc.max_train_examples, **read)
  if bc.holdout_fraction > 0:  # a split of train as the dev split; dev, test not read
    train, held_out = hold_out(train, bc.holdout_fraction, bc.holdout_seed)
    return Splits(train, {"holdout": held_out}, {})
  read["labels"] = train.labels
  dev = {split: sources.read_benchmark_split(bench, split, limit=bc.max_eval_examples, **read)
         for split in bench.dev_splits}
  test = {}
  if bc.predict_test:
    for split, _ in bench.submission:
      if split in dev:
        continue
      test[split] = sources.read_benchmark_split(bench, split, limit=bc.max_eval_examples,
                                                 **read)
  return Splits(train, dev, test)


def hold_out(train: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
  """(the rest, the held-out part) of a benchmark's train split: round(fraction * N)
  examples drawn by seed, both parts in the split's order (config.benchmark.holdout_*:
  finetune-suite's learning-rate grid is scored on it, never on dev)."""
  n = len(train.examples)
  size = round(fraction * n)
  if not 0 < fraction < 1 or not 0 < size < n:
    raise BenchmarkError(f"config.benchmark.holdout_fraction={fraction}: holds out {size} of"
                         f" the {n} training examples; expected a fraction in (0, 1) that"
                         " leaves both parts non-empty")
  held = np.zeros(n, bool)
  held[np.random.default_rng(seed).permutation(n)[:size]] = True

  def part(keep: np.ndarray, name: str) -> Dataset:
    index = np.flatnonzero(keep)
    pick = lambda values: None if values is None else [values[k] for k in index]
    return dataclasses.replace(train, path=f"{train.path} ({name}, holdout seed {seed})",
                               examples=pick(train.examples), ids=pick(train.ids),
                               golds=pick(train.golds),
                               stats={**train.stats, "examples": len(index)})
  return part(~held, "rest"), part(held, "held out")


class BenchmarkTaskData:
  """TaskData of config.benchmark (module docstring)."""

  def check(self, config) -> None:
    check_benchmark(config.benchmark)

  def task(self, config, text_to_text: bool) -> Task:
    return benchmark_task(config, text_to_text)

  def splits(self, config, task: Task, text_to_text: bool) -> Splits:
    return benchmark_splits(config, task, text_to_text)

  def write_outputs(self, config, splits: Splits, predictions: FinalPredictions,
                    workdir: str, log: Callable[[str], None]) -> dict:
    """{'official', 'score', 'submissions'} (outputs.py); the submission files."""
    out = benchmark_outputs(benchmark(config.benchmark.name), splits, workdir,
                            predict=predictions.rows)
    log("official metrics: " + json.dumps(out["official"]))
    return out
