"""What a fine-tuning run reads: its task and its splits, from files or a benchmark.

  task = run_task(config, text_to_text)      # config.task, or the benchmark's task type
  data = load_splits(config, task, text_to_text)
  data.train, data.dev {name: Dataset}, data.test {name: Dataset}, data.benchmark

Files (config.task.train_file / dev_file, CSV or JSONL): one dev split, "dev", and with
config.task.test_file one test split, "test", scored once at the end. A
benchmark (config.benchmark.name, e.g. "glue/mnli"; benchmarks/registry.py) reads its
splits from its own files or a TFDS build (benchmarks/sources.py): train, every dev
split (MNLI: matched and mismatched; the first is evaluated during training), and with
config.benchmark.predict_test its test splits, predicted for the submission files
(GLUE's and SuperGLUE's have no labels; one that has them is scored too). With
config.benchmark.holdout_fraction a seeded part of train is the one dev split,
"holdout", and dev and test are not read (hold_out below).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import ml_collections

from t5x_like.benchmarks.registry import Benchmark, benchmark
from t5x_like.finetune.data import Dataset, read_examples
from t5x_like.finetune.task import Task
from t5x_like.finetune.tasks import task_from_config


@dataclasses.dataclass
class Splits:
  train: Dataset
  dev: dict[str, Dataset]
  test: dict[str, Dataset]
  benchmark: Optional[Benchmark] = None

  @property
  def main_dev(self) -> Dataset:
    return next(iter(self.dev.values()))


def run_task(config, text_to_text: bool) -> Task:
  """config.task's Task; for a benchmark, the benchmark's task type and columns (the
  rows of benchmarks/registry.py) with config.task's other options."""
  if not config.benchmark.name:
    return task_from_config(config.task)
  bench = benchmark(config.benchmark.name)
  options = config.task.to_dict()
  options.update(name=bench.task_name(text_to_text), text_column="text", label_column="label",
                 text_pair_column="text_pair" if bench.text_pair and not text_to_text else "",
                 task_prefix="", labels=())
  if bench.kind == "span" and not text_to_text:
    options.update(answer_text_column="answer_text", answer_start_column="answer_start")
  return task_from_config(ml_collections.ConfigDict(options))


def load_splits(config, task: Task, text_to_text: bool) -> Splits:
  """The run's splits (module docstring)."""
  if not config.benchmark.name:
    train = read_examples(config.task.train_file, task)
    dev = {"dev": read_examples(config.task.dev_file, task, labels=train.labels)}
    test = ({"test": read_examples(config.task.test_file, task, labels=train.labels)}
            if config.task.test_file else {})
    return Splits(train, dev, test)
  from t5x_like.benchmarks.sources import benchmark_data_dir, read_benchmark_split
  bc = config.benchmark
  bench = benchmark(bc.name)
  read = dict(task=task, text_to_text=text_to_text, data_dir=benchmark_data_dir(bc.data_dir))
  train = read_benchmark_split(bench, "train", limit=bc.max_train_examples, **read)
  if bc.holdout_fraction > 0:  # a split of train as the dev split; dev, test not read
    train, held_out = hold_out(train, bc.holdout_fraction, bc.holdout_seed)
    return Splits(train, {"holdout": held_out}, {}, bench)
  read["labels"] = train.labels
  dev = {split: read_benchmark_split(bench, split, limit=bc.max_eval_examples, **read)
         for split in bench.dev_splits}
  test = {}
  if bc.predict_test:
    for split, _ in bench.submission:
      if split in dev:
        continue
      test[split] = read_benchmark_split(bench, split, limit=bc.max_eval_examples, **read)
  return Splits(train, dev, test, bench)


def hold_out(train: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
  """(the rest, the held-out part) of a benchmark's train split: round(fraction * N)
  examples drawn by seed, both parts in the split's order (config.benchmark.holdout_*:
  finetune-suite's learning-rate grid is scored on it, never on dev)."""
  import numpy as np
  from t5x_like.benchmarks.registry import BenchmarkError
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
