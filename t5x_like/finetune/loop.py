"""The fine-tuning run: `finetune(config, workdir)` trains a backbone + head on a task.

Sections as in train/loop.py. A run is a function of (config, seed): the rows of step s
are rows s*B .. (s+1)*B of the concatenated per-epoch permutations (seeded by epoch),
dropout is folded from the step, so a resumed run gives the numbers of an
uninterrupted one. Writes to workdir: metrics.jsonl / tensorboard (train loss, dev
metrics), checkpoints/ (the train state), dev_predictions.jsonl, final_metrics.json.
"""

from __future__ import annotations

import json
import os
import time

import jax
import ml_collections
import numpy as np

from t5x_like import fs, parallel
from t5x_like.errors import NonFiniteLossError, UserError
from t5x_like.finetune.backbone import load_backbone
from t5x_like.finetune.data import DataConfig, read_examples
from t5x_like.finetune.encoding import encode_examples, label_targets
from t5x_like.finetune.evaluate import Predictor, prediction_rows, task_metrics
from t5x_like.finetune.model import FinetuneModel
from t5x_like.fs import resolve_path
from t5x_like.train.checkpoints import Checkpointer
from t5x_like.train.metrics import MetricWriter
from t5x_like.train.optimizers import make_optimizer
from t5x_like.train.preemption import Preemption, RunResult
from t5x_like.train.setup_guard import undo_on_user_error
from t5x_like.train.state import abstract_train_state, create_train_state
from t5x_like.train.step import make_train_step
from t5x_like.workdir_lock import WorkdirLock

NOT_TRAINED = ("context_offsets",)  # features the loss does not read


class FinetuneConfigError(UserError, ValueError):
  """A fine-tuning config that cannot run; the message names the key."""


def data_config(task) -> DataConfig:
  """The DataConfig of config.task."""
  return DataConfig(task=task.name, text_column=task.text_column,
                    text_pair_column=task.text_pair_column or None,
                    label_column=task.label_column,
                    answer_text_column=task.answer_text_column,
                    answer_start_column=task.answer_start_column,
                    labels=tuple(task.labels) or None, skip_bad_rows=task.skip_bad_rows)


def epoch_rows(step: int, batch_size: int, num_examples: int, seed: int) -> np.ndarray:
  """[batch_size] example indices of `step` (0-based): a pure function of its arguments."""
  rows, position = [], step * batch_size
  while len(rows) < batch_size:
    epoch, offset = divmod(position, num_examples)
    order = np.random.default_rng([seed, epoch]).permutation(num_examples)
    take = min(batch_size - len(rows), num_examples - offset)
    rows.extend(order[offset:offset + take])
    position += take
  return np.asarray(rows, np.int64)


def _check_config(config) -> None:
  task, tc = config.task, config.train
  for key in ("train_file", "dev_file"):
    if not task[key]:
      raise FinetuneConfigError(f"config.task.{key} is required (a CSV or JSONL file)")
    if not os.path.isfile(task[key]):
      raise FinetuneConfigError(f"config.task.{key}={task[key]!r} does not exist")
  if tc.num_steps < 1 or tc.batch_size < 1:
    raise FinetuneConfigError(f"config.train.num_steps={tc.num_steps} and"
                              f" batch_size={tc.batch_size} must be >= 1")
  if jax.process_count() > 1:
    raise FinetuneConfigError("t5x-like finetune runs in one process (multi-host"
                              " fine-tuning is not built yet); use one host's devices")


# ============================================================================ finetune
def finetune(config: ml_collections.ConfigDict, workdir) -> RunResult:
  """Fine-tunes config.init's backbone on config.task in workdir (a path, relative or
  absolute, or a URL such as gs://...; resumes there); returns the final dev metrics
  (RunResult; status 'stopped' after SIGTERM / Ctrl-C: a checkpoint is saved, rerun).
  A UserError (bad config, rows, backbone, a locked workdir) leaves the workdir as it
  was."""
  _check_config(config)
  workdir_path = resolve_path(workdir, "workdir")
  with WorkdirLock(workdir_path), undo_on_user_error(workdir_path) as setup:
    return _finetune(config, os.fspath(workdir_path), setup)


def _finetune(config, workdir: str, setup) -> RunResult:
  task, tc = config.task, config.train

  # ---------------------------------------------------------------- backbone, data
  backbone = load_backbone(config)
  family = backbone.model_config.family
  dcfg = data_config(task)
  train_set = read_examples(task.train_file, dcfg)
  dev_set = read_examples(task.dev_file, dcfg, labels=train_set.labels)
  encode_kw = dict(task=task.name, family=family, max_length=task.max_length,
                   label_names=train_set.labels, target_length=task.target_length,
                   task_prefix=task.task_prefix, max_question_length=task.max_question_length)
  targets = None
  if family == "encoder_decoder":
    try:
      targets = label_targets(backbone.tokenizer, train_set.labels, task.target_length)
    except ValueError as e:
      raise FinetuneConfigError(f"config.task.target_length: {e}") from None
  train_features, train_stats = encode_examples(train_set.examples, backbone.tokenizer,
                                                **encode_kw)
  dev_features, dev_stats = encode_examples(dev_set.examples, backbone.tokenizer, **encode_kw)

  model = FinetuneModel(
      backbone.model_config, task.name, num_labels=len(train_set.labels),
      label_targets=targets,
      pooler=task.pooler, pooling=task.pooling,
      classifier_dropout=None if task.classifier_dropout < 0 else task.classifier_dropout)
  mesh = parallel.mesh_from_config(config.mesh)
  rules = tuple(config.mesh.rules) or parallel.DEFAULT_RULES
  trained = {k: v for k, v in train_features.items() if k not in NOT_TRAINED}
  batch_shapes = {k: (tc.batch_size, *v.shape[1:]) for k, v in trained.items()}
  optimizer, schedule = make_optimizer(config.optimizer, tc.num_steps)

  writer = MetricWriter(workdir, total_steps=tc.num_steps)
  writer.log(f"backbone: {backbone.source}; {model.num_params():,} params; task {task.name}"
             f" with {len(train_set.labels)} labels; train {json.dumps(train_stats)} of"
             f" {task.train_file} ({train_set.stats['bad_rows']} bad rows skipped); dev"
             f" {json.dumps(dev_stats)} of {task.dev_file} ({dev_set.stats['bad_rows']} bad"
             " rows skipped)")

  # ---------------------------------------------------------------- state, resume
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), keep=2, async_save=False)
  abstract = abstract_train_state(model, optimizer, mesh, rules, batch_shapes)
  restored = checkpointer.restore_latest(abstract)
  setup.done()
  if restored is None:
    state, shardings = create_train_state(model, optimizer, mesh, rules, batch_shapes,
                                          jax.random.key(config.seed))
    if backbone.params is not None:
      params = model.load_backbone(jax.device_get(state.params), backbone.params)
      state = state.replace(params=jax.device_put(params, shardings.params))
    step = 0
  else:
    step, state, _ = restored
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    writer.truncate_after(step)
    writer.log(f"resumed from step {step}")

  # ---------------------------------------------------------------- train
  train_step = make_train_step(model, optimizer, schedule, microbatches=tc.microbatches,
                               mesh=mesh, rules=rules, state_shardings=shardings,
                               batch_shapes=batch_shapes)
  predictor = Predictor(model, batch_size=tc.batch_size, mesh=mesh, rules=rules,
                        tokenizer=backbone.tokenizer, label_names=train_set.labels,
                        target_length=task.target_length)
  rng = jax.random.key(config.seed + 1)
  num_train = len(train_set.examples)

  def evaluate(step: int) -> tuple[dict, object]:
    predictions = predictor(state.params, dev_features)
    result = task_metrics(task.name, predictions, dev_features, dev_set)
    writer.write_scalars(step, {f"dev_{k}": v for k, v in result.items()})
    writer.log(f"step {step}: dev " + ", ".join(f"{k}={v:.4f}" for k, v in result.items()))
    return result, predictions

  dev_metrics, predictions, started = None, None, time.perf_counter()
  preemption = Preemption()
  try:
    while step < tc.num_steps:
      rows = epoch_rows(step, tc.batch_size, num_train, config.seed)
      batch = parallel.shard_batch({k: v[rows] for k, v in trained.items()}, mesh, rules)
      state, metrics = train_step(state, batch, rng)
      step += 1
      if step % tc.log_every == 0 or step == tc.num_steps:
        metrics = jax.device_get(metrics)
        if not np.isfinite(float(metrics["loss"])):
          raise NonFiniteLossError(f"non-finite loss {float(metrics['loss'])} at step {step}")
        writer.write_scalars(step, {"loss": float(metrics["loss"]),
                                    "learning_rate": float(schedule(step - 1))})
        writer.progress(step, float(metrics["loss"]))
      if tc.checkpoint_every and step % tc.checkpoint_every == 0:
        checkpointer.save(step, state, {"epoch": step * tc.batch_size / num_train})
      if (tc.eval_every and step % tc.eval_every == 0) or step == tc.num_steps:
        dev_metrics, predictions = evaluate(step)
      if preemption.requested and step < tc.num_steps:
        writer.log(f"{preemption.requested}: saving a checkpoint at step {step} and"
                   " stopping; rerun the same command to resume")
        checkpointer.save(step, state, {"epoch": step * tc.batch_size / num_train},
                          force=True)
        return RunResult(dev_metrics or {}, step, "stopped")
    if dev_metrics is None:  # resumed at the end: evaluate the restored state
      dev_metrics, predictions = evaluate(step)
    checkpointer.save(step, state, {"epoch": step * tc.batch_size / num_train}, force=True)
  finally:
    preemption.restore()
    try:
      checkpointer.wait()
      checkpointer.close()
    finally:
      writer.close()

  # ---------------------------------------------------------------- outputs
  rows = prediction_rows(task.name, predictions, dev_set, dev_features)
  fs.write_bytes(os.path.join(workdir, "dev_predictions.jsonl"),
                 "".join(json.dumps(row) + "\n" for row in rows).encode())
  final = dict(dev_metrics, step=step, train_examples=num_train,
               dev_examples=len(dev_set.examples), backbone=backbone.source,
               seconds=round(time.perf_counter() - started, 1))
  fs.write_bytes(os.path.join(workdir, "final_metrics.json"),
                 json.dumps(final, indent=1).encode())
  return RunResult(final, step, "finished")
