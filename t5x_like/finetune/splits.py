"""The CSV / JSONL source of a fine-tuning run (finetune/task_data.py's TaskData):

  data = FileTaskData()
  task = data.task(config, text_to_text)        # config.task: task_from_config
  splits = data.splits(config, task, text_to_text)

config.task.train_file and dev_file give one dev split, "dev"; with config.task.test_file
one test split, "test", scored once at the end with the final weights (test_* in
final_metrics.json, its rows in test_predictions.jsonl). A benchmark
(config.benchmark.name) is the other source, t5x_like/benchmarks/task_data.py.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import jax

from t5x_like import fs
from t5x_like.finetune.data import read_examples
from t5x_like.finetune.task import Task
from t5x_like.finetune.task_data import FinalPredictions, Splits
from t5x_like.finetune.tasks import task_from_config
from t5x_like.train.config_check import ConfigError


def run_task(config, text_to_text: bool = False) -> Task:
  """config.task's Task (the files fix nothing of it; text_to_text: the same Task)."""
  del text_to_text
  return task_from_config(config.task)


def load_splits(config, task: Task, text_to_text: bool = False) -> Splits:
  """train, {"dev"}, and {"test"} where config.task.test_file is set."""
  del text_to_text
  train = read_examples(config.task.train_file, task)
  dev = {"dev": read_examples(config.task.dev_file, task, labels=train.labels)}
  test = ({"test": read_examples(config.task.test_file, task, labels=train.labels)}
          if config.task.test_file else {})
  return Splits(train, dev, test)


class FileTaskData:
  """TaskData of config.task's files (module docstring)."""

  def check(self, config) -> None:
    if config.benchmark.name:  # the caller picks the source: this one reads files only
      raise ConfigError(f"benchmark.name={config.benchmark.name!r} is a benchmark: its data"
                        " is t5x_like.benchmarks.task_data.task_data(config)'s (the finetune"
                        " command picks it), not task.train_file's")
    for key in ("train_file", "dev_file"):
      if not config.task[key]:
        raise ConfigError(f"task.{key} is required (a CSV or JSONL file)")
      if not os.path.isfile(config.task[key]):
        raise ConfigError(f"task.{key}={config.task[key]!r} does not exist")
    test_file = config.task.test_file
    if test_file and not os.path.isfile(test_file):
      raise ConfigError(f"task.test_file={test_file!r} does not exist")

  def task(self, config, text_to_text: bool) -> Task:
    return run_task(config, text_to_text)

  def splits(self, config, task: Task, text_to_text: bool) -> Splits:
    return load_splits(config, task, text_to_text)

  def write_outputs(self, config, splits: Splits, predictions: FinalPredictions,
                    workdir: str, log: Callable[[str], None]) -> dict:
    """The test split's metrics (test_*, test_examples); test_predictions.jsonl."""
    if not splits.test:
      return {}
    test_set = splits.test["test"]
    out = {f"test_{k}": v for k, v in predictions.metrics(("test", "test"), test_set).items()}
    out["test_examples"] = len(test_set.examples)
    rows = predictions.rows(("test", "test"), test_set)
    log("test: " + ", ".join(f"{k}={v:.4f}" for k, v in out.items()
                             if k != "test_examples"))
    if jax.process_index() == 0:
      fs.write_bytes(os.path.join(workdir, "test_predictions.jsonl"),
                     "".join(json.dumps(row) + "\n" for row in rows).encode())
    return out
