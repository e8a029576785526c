"""The seam between a fine-tuning run and its data: `finetune(config, workdir, data=...)`
takes its data source from the caller through TaskData.

  data.check(config)                          # its checks, inside validate_finetune
  task = data.task(config, text_to_text)      # the Task (finetune/task.py) it is
  splits = data.splits(config, task, text_to_text)   # train, dev {name: Dataset}, test
  final.update(data.write_outputs(config, splits, predictions, workdir, log))  # at the end

Two sources implement it: CSV / JSONL files (finetune/splits.py, FileTaskData) and the
benchmarks (t5x_like/benchmarks/task_data.py: GLUE, SuperGLUE, SQuAD, with their
official metrics and submission files). The run itself knows neither.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

from t5x_like.finetune.data import Dataset
from t5x_like.finetune.task import Task


@dataclasses.dataclass
class Splits:
  """A run's examples: train, its dev splits (the first is evaluated during training)
  and its test splits (predicted once, with the final weights)."""
  train: Dataset
  dev: dict[str, Dataset]
  test: dict[str, Dataset]

  @property
  def main_dev(self) -> Dataset:
    return next(iter(self.dev.values()))


class FinalPredictions(Protocol):
  """The final weights' predictions on the run's splits, made on demand. Every process
  calls (prediction is collective); key: ("dev" | "test", split name)."""

  def rows(self, key: tuple[str, str], dataset: Dataset) -> list[dict]:
    """The split's prediction rows (finetune/evaluate.prediction_rows)."""

  def metrics(self, key: tuple[str, str], dataset: Dataset) -> dict[str, float]:
    """The task's metrics on the split (finetune/evaluate.dev_metrics)."""


class TaskData(Protocol):
  """Where a fine-tuning run's task and examples come from (module docstring)."""

  def check(self, config) -> None:
    """Raises a UserError (ConfigError, BenchmarkError) naming the key of the first
    problem with this source's part of config, before anything is read."""

  def task(self, config, text_to_text: bool) -> Task:
    """The run's Task: config.task's options, with what the source fixes (its type,
    columns)."""

  def splits(self, config, task: Task, text_to_text: bool) -> Splits:
    """The run's Splits, read."""

  def write_outputs(self, config, splits: Splits, predictions: FinalPredictions,
                    workdir: str, log: Callable[[str], None]) -> dict:
    """After the final evaluation: writes this source's files (process 0 only), logs a
    line, and returns what goes into final_metrics.json after the dev metrics."""
