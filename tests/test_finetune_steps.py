"""The step budget of a fine-tuning run (t5x_like/finetune/steps.py): train.epochs count the
training rows the run read, not the benchmark's published size; the benchmark configs'
cpu cap (max_steps) and smoke steps stay; the run logs its steps and epochs, and a
rerun of a finished run is seen as finished."""

from __future__ import annotations

import json
import os

import pytest

from helpers import load_config
from t5x_like.finetune.steps import resolve_steps


def test_benchmark_configs_count_epochs_at_run_time():
  three = load_config("superglue", "cb")
  assert (three.train.num_steps, three.train.epochs, three.train.max_steps) == (0, 3.0, 0)
  assert (three.optimizer.warmup_steps, three.optimizer.warmup_fraction) == (0, 0.1)
  cpu = load_config("glue", "sst2,cpu,epochs=2,max_steps=700")
  assert (cpu.train.num_steps, cpu.train.epochs, cpu.train.max_steps) == (0, 2.0, 700)
  smoke = load_config("glue", "rte,smoke")  # a fixed handful of steps
  assert (smoke.train.num_steps, smoke.optimizer.warmup_steps,
          smoke.optimizer.warmup_fraction) == (4, 1, 0.0)


def test_epochs_are_passes_over_the_rows_read():
  config = load_config("superglue", "cb,epochs=2")  # CB's published train: 250 examples
  resolved, line = resolve_steps(config, 70)  # a user's file of 70
  assert (resolved.train.num_steps, resolved.optimizer.warmup_steps) == (5, 1)  # ceil(140/32)
  assert config.train.num_steps == 0  # the config given is left as it was
  assert line == ("steps: 5 of batch 32 (train.epochs=2; warmup 0.1 of them) = 2.29 epochs"
                  " of the 70 training rows; warmup 1 step")
  resolved, _ = resolve_steps(config, 3200)
  assert (resolved.train.num_steps, resolved.optimizer.warmup_steps) == (200, 20)
  config.train.max_steps = 150  # cpu's cap
  resolved, line = resolve_steps(config, 3200)
  assert resolved.train.num_steps == 150 and "at most train.max_steps=150" in line
  config.train.num_steps = 40  # the steps set: the epochs are not counted
  resolved, line = resolve_steps(config, 3200)
  assert (resolved.train.num_steps, resolved.optimizer.warmup_steps) == (40, 4)
  assert line.startswith("steps: 40 of batch 32 (train.num_steps;") and "0.40 epochs" in line


def test_steps_without_either_or_two_warmups_are_refused():
  from t5x_like.finetune.config_check import validate_finetune
  from t5x_like.benchmarks.task_data import BenchmarkTaskData
  from t5x_like.train.config_check import ConfigError

  class NoData(BenchmarkTaskData):
    def check(self, config):
      pass

  config = load_config("superglue", "cb,smoke")
  config.train.num_steps, config.train.epochs = 0, 0.0
  with pytest.raises(ConfigError, match=r"^train.num_steps=0 and train.epochs=0: set"):
    validate_finetune(config, 8, data=NoData())
  config.train.epochs = 1.0
  config.optimizer.warmup_fraction = 0.1  # and smoke's warmup_steps=1
  with pytest.raises(ConfigError, match=r"^optimizer.warmup_steps=1 and optimizer"
                                        r".warmup_fraction=0.1: set one of them"):
    validate_finetune(config, 8, data=NoData())
  config.optimizer.warmup_steps = 0
  validate_finetune(config, 8, data=NoData())


def _cb_files(directory, train_rows: int) -> str:
  os.makedirs(directory / "CB")
  labels = ["entailment", "contradiction", "neutral"]
  rows = [{"premise": f"The cat sat {k}.", "hypothesis": f"A cat {k}.", "idx": k,
           "label": labels[k % 3]} for k in range(train_rows)]
  for split, split_rows in (("train", rows), ("val", rows[:4]), ("test", rows[:2])):
    (directory / "CB" / f"{split}.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in split_rows))
  return str(directory)


def test_a_finetune_run_trains_the_epochs_of_its_own_file(tmp_path, capsys):
  """2 epochs of a 12-example CB file at batch 8: 3 steps (the published 250 would give
  63); said in the log; the rerun finds the run finished."""
  from t5x_like.benchmarks.task_data import task_data
  from t5x_like.finetune.loop import finetune
  config = load_config("superglue", "cb,smoke")
  config.benchmark.data_dir = _cb_files(tmp_path / "cb", 12)
  config.benchmark.predict_test = False
  config.train.num_steps, config.train.epochs = 0, 2.0
  result = finetune(config, str(tmp_path / "run"), data=task_data(config))
  assert (result.status, result.step) == ("finished", 3)
  assert ("steps: 3 of batch 8 (train.epochs=2) = 2.00 epochs of the 12 training rows;"
          " warmup 1 step") in capsys.readouterr().out
  again = finetune(config, str(tmp_path / "run"), data=task_data(config))
  assert (again.status, again.step) == ("already_finished", 3)
