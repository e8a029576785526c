"""Validation of a fine-tuning config before anything is read or built: the train
command's checks (train/config_check.py) on finetune/defaults.py's schema.

  validate_finetune(config, num_devices=jax.device_count(), data=data, pretrain=pretrain)
  # raises a UserError

Every message names the offending key. Checks, in one pass: unknown keys and wrong
types; finite numbers; the seed; the task and its options (data.task: the source's
Task); the data source's own checks (data.check: the task files, or the benchmark's
data); train numbers; the optimizer; the mesh against the device count and the batch
against its shards; and, where config.init.config names the backbone, its model (the
pretraining config's model section with init.model_overrides, from the file that
resolve_init parsed), its positions against task.max_length and its parameters
against the mesh.
"""

from __future__ import annotations

from typing import Optional

import jax

from t5x_like.finetune.backbone import PretrainConfig, parse_pretrain_config
from t5x_like.finetune.defaults import default_finetune_config
from t5x_like.finetune.splits import FileTaskData
from t5x_like.finetune.task import Task
from t5x_like.finetune.task_data import TaskData
from t5x_like.models import build_model, model_class
from t5x_like.models.config import ModelConfig
from t5x_like.train.config_check import (ConfigError, check_fields, check_finite, check_mesh,
                                         check_model, check_optimizer, check_schema,
                                         check_seed, positive)

# Sections whose contents are free-form (checked separately below).
_OPEN = {"init.model_overrides", "mesh.rules"}


def validate_finetune(config, num_devices: Optional[int] = None,
                      platform: Optional[str] = None, *, data: Optional[TaskData] = None,
                      pretrain: Optional[PretrainConfig] = None) -> None:
  """Raises ConfigError (TaskConfigError for config.task's name and options; the data
  source's own, e.g. BenchmarkError) for the first problem found. num_devices: the
  devices the mesh must fill (default: jax.device_count()); platform: where it runs
  (default: here); data: the run's data source (default: config.task's files);
  pretrain: init.config parsed (resolve_init's; None: parsed here)."""
  if num_devices is None:
    num_devices = jax.device_count()
  data = FileTaskData() if data is None else data
  check_schema(config, default_finetune_config(), _OPEN)
  check_finite(config)
  check_seed(config)
  task = data.task(config, text_to_text=False)
  data.check(config)
  t = config.train
  for key in ("batch_size", "microbatches", "log_every"):
    positive(f"train.{key}", t[key])
  for key in ("num_steps", "epochs", "max_steps", "eval_every", "checkpoint_every"):
    positive(f"train.{key}", t[key], allow_zero=True)
  if t.num_steps == 0 and t.epochs == 0:
    raise ConfigError("train.num_steps=0 and train.epochs=0: set the steps, or the epochs"
                      " over the training rows (train.epochs > 0 with train.num_steps=0)")
  o = config.optimizer
  if not 0 <= o.warmup_fraction < 1:
    raise ConfigError(f"optimizer.warmup_fraction={o.warmup_fraction}: expected in [0, 1)")
  if o.warmup_fraction > 0 and o.warmup_steps > 0:
    raise ConfigError(f"optimizer.warmup_steps={o.warmup_steps} and optimizer.warmup_fraction"
                      f"={o.warmup_fraction}: set one of them, the other to 0")
  if t.batch_size % jax.process_count():
    raise ConfigError(f"train.batch_size={t.batch_size} does not divide over"
                      f" {jax.process_count()} processes")
  # Fine-tuning may leave the loaded weights as they are (learning rate 0), and
  # configs/finetune_books.py's smoke variant warms up over 30 of its 10 steps.
  check_optimizer(config, allow_zero_lr=True, allow_long_warmup=True)
  if not 0 < config.optimizer.layer_decay <= 1:
    raise ConfigError(f"optimizer.layer_decay={config.optimizer.layer_decay}: expected in"
                      " (0, 1] (1 = the same rate for every layer)")
  backbone = backbone_config(config, task, platform, pretrain)
  check_mesh(config, num_devices, None if backbone is None else build_model(backbone))


def backbone_config(config, task: Task, platform: Optional[str] = None,
                    pretrain: Optional[PretrainConfig] = None) -> Optional[ModelConfig]:
  """The fine-tuning backbone's ModelConfig where the config says it (init.config: its
  model section, init.model_overrides, without the pretraining heads), checked; None
  for a Hugging Face checkpoint (init.hf: its config.json says it) or no backbone.
  pretrain: init.config parsed (None: parsed here)."""
  init = config.init
  if not init.config or init.hf:
    return None  # finetune/backbone.py says which of the two to set
  where = f"init.config={init.config!r}"
  if pretrain is None or pretrain.spec != init.config:
    pretrain = parse_pretrain_config(init.config)
  if pretrain.config is None:  # the file was not found
    raise ConfigError(f"init.config: {pretrain.error}")
  if pretrain.vocab is None:  # a missing data.vocab, an unknown data.objective
    raise ConfigError(f"{where}: {pretrain.error}")
  try:
    cfg = check_model(pretrain.config, pretrain.vocab.vocab_size, platform)
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
