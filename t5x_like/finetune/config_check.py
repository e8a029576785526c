"""Validation of a fine-tuning config before anything is read or built: the train
command's checks (train/config_check.py) on finetune/defaults.py's schema.

  validate_finetune(config, num_devices=jax.device_count())  # raises a UserError

Every message names the offending key. Checks: unknown keys and wrong types; finite
numbers; the seed; the task and its options (tasks.task_from_config); the task files;
train numbers; the optimizer; the mesh against the device count and the batch against
its shards; and, where config.init.config names the backbone, its model (the
pretraining config's model section with init.model_overrides), its positions against
task.max_length and its parameters against the mesh.
"""

from __future__ import annotations

import os
from typing import Optional

import jax

from t5x_like.experiment import config_vocab
from t5x_like.finetune.defaults import default_finetune_config
from t5x_like.finetune.task import Task
from t5x_like.finetune.splits import run_task
from t5x_like.benchmarks.sources import check_benchmark
from t5x_like.models import build_model, model_class
from t5x_like.models.config import ModelConfig
from t5x_like.train.config_check import (ConfigError, check_fields, check_finite, check_mesh,
                                         check_model, check_optimizer, check_schema,
                                         check_seed, positive)
from t5x_like.command_flags import load_config_file

# Sections whose contents are free-form (checked separately below).
_OPEN = {"init.model_overrides", "mesh.rules"}


def validate_finetune(config, num_devices: Optional[int] = None,
                      platform: Optional[str] = None) -> None:
  """Raises ConfigError (TaskConfigError for config.task's name and options) for the
  first problem found. num_devices: the devices the mesh must fill (default:
  jax.device_count()); platform: where it runs (default: here)."""
  if num_devices is None:
    num_devices = jax.device_count()
  check_schema(config, default_finetune_config(), _OPEN)
  check_finite(config)
  check_seed(config)
  task = run_task(config, text_to_text=False)
  if config.benchmark.name:
    check_benchmark(config.benchmark)
  for key in () if config.benchmark.name else ("train_file", "dev_file"):
    if not config.task[key]:
      raise ConfigError(f"task.{key} is required (a CSV or JSONL file)")
    if not os.path.isfile(config.task[key]):
      raise ConfigError(f"task.{key}={config.task[key]!r} does not exist")
  test_file = "" if config.benchmark.name else config.task.test_file
  if test_file and not os.path.isfile(test_file):
    raise ConfigError(f"task.test_file={test_file!r} does not exist")
  t = config.train
  for key in ("batch_size", "num_steps", "microbatches", "log_every"):
    positive(f"train.{key}", t[key])
  for key in ("eval_every", "checkpoint_every"):
    positive(f"train.{key}", t[key], allow_zero=True)
  if t.batch_size % jax.process_count():
    raise ConfigError(f"train.batch_size={t.batch_size} does not divide over"
                      f" {jax.process_count()} processes")
  # Fine-tuning may leave the loaded weights as they are (learning rate 0), and
  # configs/finetune_books.py's smoke variant warms up over 30 of its 10 steps.
  check_optimizer(config, allow_zero_lr=True, allow_long_warmup=True)
  if not 0 < config.optimizer.layer_decay <= 1:
    raise ConfigError(f"optimizer.layer_decay={config.optimizer.layer_decay}: expected in"
                      " (0, 1] (1 = the same rate for every layer)")
  backbone = backbone_config(config, task, platform)
  check_mesh(config, num_devices, None if backbone is None else build_model(backbone))


def backbone_config(config, task: Task, platform: Optional[str] = None
                    ) -> Optional[ModelConfig]:
  """The fine-tuning backbone's ModelConfig where the config says it (init.config: its
  model section, init.model_overrides, without the pretraining heads), checked; None
  for a Hugging Face checkpoint (init.hf: its config.json says it) or no backbone."""
  init = config.init
  if not init.config or init.hf:
    return None  # finetune/backbone.py says which of the two to set
  where = f"init.config={init.config!r}"
  try:
    pretrain = load_config_file(init.config)
  except FileNotFoundError as e:
    raise ConfigError(f"init.config: {e}") from None
  try:
    vocab_size = config_vocab(pretrain).vocab_size
  except (OSError, ValueError) as e:  # a missing data.vocab, an unknown data.objective
    raise ConfigError(f"{where}: {e}") from None
  try:
    cfg = check_model(pretrain, vocab_size, platform)
  except ConfigError as e:
    raise ConfigError(f"{where}: {e}") from None
  overrides = dict(init.model_overrides)
  check_fields("init.model_overrides", overrides)
  try:
    cfg = cfg.replace(**overrides)
  except (ValueError, TypeError) as e:
    raise ConfigError(f"init.model_overrides: {e}") from None
  if cfg.position_embedding == "learned" and task.max_length > cfg.max_position_embeddings:
    raise ConfigError(f"task.max_length={task.max_length} exceeds the backbone's"
                      f" max_position_embeddings={cfg.max_position_embeddings} ({where});"
                      " shorten it")
  return model_class(cfg).finetune_config(cfg)
