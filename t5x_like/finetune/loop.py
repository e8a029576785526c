"""The fine-tuning run: `finetune(config, workdir)` trains a backbone + head on a task.

Sections as in train/loop.py, on the same run context (train/run_context.py: the
workdir lock, checkpoints, metrics, resume) and step runner (train/runner.py): the train
step, the deterministic host-sharded loader with device prefetch, checkpoints with the
loader's position, SIGTERM / SIGINT saves, multi-host. A run is a function of (config,
seed): the rows of step s are rows s*B .. (s+1)*B of the concatenated per-epoch
permutations (encoding.EncodedRows), dropout is folded from the step, so a resumed run
gives the numbers of an uninterrupted one. Writes to workdir: metrics.jsonl /
tensorboard (train loss, dev metrics), checkpoints/ (the train state),
dev_predictions.jsonl, final_metrics.json, and what the data source adds after the
final evaluation (finetune/task_data.py: the task files' test predictions, a
benchmark's submission files).
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Optional

import jax
import ml_collections
import optax

from t5x_like import fs
from t5x_like.errors import UserError
from t5x_like.experiment import build_mesh
from t5x_like.finetune.backbone import load_backbone, resolve_init
from t5x_like.finetune.config_check import validate_finetune
from t5x_like.finetune.encoding import EncodedRows, encode_examples
from t5x_like.finetune.evaluate import Predictor, dev_metrics, prediction_rows
from t5x_like.finetune.layer_decay import layer_depths, scale_by_layer
from t5x_like.finetune.model import FinetuneModel, finetunes_text_to_text
from t5x_like.finetune.splits import FileTaskData
from t5x_like.finetune.steps import resolve_steps
from t5x_like.finetune.task_data import TaskData
from t5x_like.models import model_class
from t5x_like.train.optimizers import make_optimizer
from t5x_like.train.preemption import RunResult
from t5x_like.train.run_context import open_run
from t5x_like.train.runner import Every, StepLoop, device_batches, run_steps
from t5x_like.train.state import abstract_train_state, create_train_state
from t5x_like.train.step import make_train_step
from t5x_like.train.workdir_lock import WorkdirLock


class FinetuneConfigError(UserError, ValueError):
  """A fine-tuning config that cannot run; the message names the key."""


# More than this fraction of the training examples cut by task.max_length: a warning.
TRUNCATION_WARNING_FRACTION = 0.1
_PREDICTS = {"regression": "predicting a score", "span_extraction": "predicting answer spans",
             "text_generation": "generating text"}


def task_phrase(task, num_labels: int) -> str:
  """What the task predicts, for the log: its labels, or what it predicts instead."""
  if task.uses_label_list:
    return f"task {task.name} with {num_labels} labels"
  return f"task {task.name} {_PREDICTS.get(task.name, 'without a label list')}"


def random_init_line(config) -> str:
  """The log line of a backbone initialised at random (no init.checkpoint)."""
  return ("init: random initialisation (no init.checkpoint) of the architecture of"
          f" {config.init.config}; set config.init.checkpoint=WORKDIR to start from a"
          " pretraining run")


def truncation_warning(stats: dict, max_length: int,
                       positions: Optional[int] = None) -> Optional[str]:
  """One log line when more than TRUNCATION_WARNING_FRACTION of the training examples
  (stats: encode_examples's) were cut at max_length tokens; positions: the backbone's
  learned positions (None: not learned), the most task.max_length can be."""
  cut, total = stats.get("truncated", 0), stats["examples"]
  if not total or cut <= TRUNCATION_WARNING_FRACTION * total:
    return None
  if positions is not None and max_length >= positions:
    remedy = (f"task.max_length is at the backbone's {positions} learned positions: a"
              " backbone pretrained on longer sequences keeps more")
  else:
    remedy = "raise task.max_length" + (f" (the backbone has {positions} positions)"
                                        if positions else "")
  return (f"warning: {cut:,} of {total:,} training examples ({100 * cut / total:.0f}%)"
          f" are cut at task.max_length={max_length} tokens; {remedy}")


def answers_lost_warning(stats: dict, task) -> Optional[str]:
  """One log line when some training answers are in no window whole, being longer than
  one (span extraction: stats["answers_lost"] of encode_examples)."""
  lost = stats.get("answers_lost", 0)
  if not lost:
    return None
  return (f"warning: {lost:,} of {stats['examples']:,} training answers are longer than a"
          f" window of task.max_length={task.max_length} tokens; those examples train on"
          " the no-answer span: raise task.max_length")


class _FinalPredictions:
  """finetune/task_data.FinalPredictions of the final weights: the main dev split's are
  the last evaluation's; another split's are made once, when first asked for."""

  def __init__(self, model, predictor, params, main_dev, main_predictions, main_features,
               features: dict):
    self.model, self.predictor, self.params, self.features = model, predictor, params, features
    self.main = main_dev, main_predictions, main_features
    self.made = {}

  def _of(self, key: tuple[str, str], dataset) -> tuple:
    """(predictions, features) of the split."""
    main_dev, main_predictions, main_features = self.main
    if dataset is main_dev:
      return main_predictions, main_features
    if key not in self.made:
      self.made[key] = self.predictor(self.params, self.features[key])
    return self.made[key], self.features[key]

  def rows(self, key: tuple[str, str], dataset) -> list[dict]:
    predictions, features = self._of(key, dataset)
    return prediction_rows(self.model, predictions, dataset, features)

  def metrics(self, key: tuple[str, str], dataset) -> dict[str, float]:
    predictions, features = self._of(key, dataset)
    return dev_metrics(self.model, predictions, features, dataset)


# ============================================================================ finetune
def finetune(config: ml_collections.ConfigDict, workdir, *, data: Optional[TaskData] = None,
             choose_remat: Optional[Callable] = None,
             lock: Optional[WorkdirLock] = None) -> RunResult:
  """Fine-tunes config.init's backbone on data's task in workdir (a path, relative or
  absolute, or a URL such as gs://...; resumes there); returns the final dev metrics
  (RunResult; status 'stopped' after SIGTERM / Ctrl-C: a checkpoint is saved, rerun;
  'already_finished' when the workdir's run had ended: its outputs are written again
  from the last checkpoint). A UserError (bad config, rows, backbone, a locked workdir)
  leaves the workdir as it was.

  data: where the task and its examples come from (finetune/task_data.TaskData;
  default: config.task's CSV / JSONL files; a benchmark's is
  t5x_like.benchmarks.task_data.task_data(config)). choose_remat: for a backbone with
  model.remat_policy="auto", the chooser (plan/remat.resolve_remat's signature: the
  finetune command passes it). lock: the workdir's lock when the caller holds it (the
  finetune command takes it before building anything); None takes it here."""
  data = FileTaskData() if data is None else data
  resolved = resolve_init(config)  # init.config "": the checkpoint's workdir names it
  config = resolved.config
  validate_finetune(config, jax.device_count(), data=data,  # the train checks on its schema
                    pretrain=resolved.pretrain)
  pretrain = resolved.pretrain.config if resolved.pretrain is not None else None
  if pretrain is not None and pretrain.model.remat_policy == "auto" and choose_remat is None:
    raise FinetuneConfigError(  # before anything is written
        f"model.remat_policy='auto' in {config.init.config}: finetune(...) needs"
        " choose_remat=t5x_like.plan.remat.resolve_remat (the finetune command passes it)")
  tc = config.train
  with open_run(workdir, total_steps=tc.num_steps, keep=2, async_save=False,
                lock=lock) as run:

    # ---------------------------------------------------------- backbone, data, mesh
    for note in resolved.notes:
      run.writer.log(note)
    backbone = load_backbone(config, resolved.origin, resolved.pretrain)
    family = backbone.model_config.family
    text_to_text = (model_class(backbone.model_config).finetunes_text_to_text
                    and config.task.text_to_text)
    task = data.task(config, text_to_text)
    if text_to_text != finetunes_text_to_text(backbone.model_config, task):
      raise FinetuneConfigError(f"config.task.text_to_text=False: task {task.name} has no"
                                " head on T5's encoder (classification has)")
    splits = data.splits(config, task, text_to_text)
    train_set, dev_set = splits.train, splits.main_dev
    targets = None
    if text_to_text and task.uses_label_list:
      try:
        targets = task.label_targets(backbone.tokenizer, train_set.labels)
      except ValueError as e:
        raise FinetuneConfigError(f"config.task.target_length: {e}") from None
    encode_kw = dict(family=family, label_names=train_set.labels)
    try:
      train_features, train_stats = encode_examples(train_set.examples, backbone.tokenizer,
                                                    task, training=True, **encode_kw)
      dev_features, dev_stats = encode_examples(dev_set.examples, backbone.tokenizer, task,
                                                **encode_kw)
      extra_features = {  # the other dev splits and the test splits
          (kind, name): encode_examples(dataset.examples, backbone.tokenizer, task,
                                        **encode_kw)[0]
          for kind, group in (("dev", splits.dev), ("test", splits.test))
          for name, dataset in group.items() if dataset is not dev_set}
      model = FinetuneModel(backbone.model_config, task, num_labels=len(train_set.labels),
                            label_targets=targets)
    except ValueError as e:
      raise FinetuneConfigError(f"config.task ({task.name}): {e}") from None
    mesh, rules = build_mesh(config)
    trained = {k: v for k, v in train_features.items() if k not in task.host_features}
    # train.epochs: steps from the rows read (finetune/steps.py), before the run starts
    config, steps_line = resolve_steps(config, len(next(iter(trained.values()))))
    tc = config.train
    run.set_total_steps(tc.num_steps)
    run.writer.log(steps_line)
    batch_shapes = {k: (tc.batch_size, *v.shape[1:]) for k, v in trained.items()}
    optimizer, schedule = make_optimizer(config.optimizer, tc.num_steps)
    if config.optimizer.layer_decay != 1:
      stacks = model_class(model.config).stack_layers(model.config)
      depths = layer_depths(model.param_shapes(batch_shapes), stacks)
      optimizer = optax.chain(optimizer, scale_by_layer(depths, config.optimizer.layer_decay))
    if backbone.remat_auto:  # model.remat_policy="auto": chosen by compiling (plan/remat.py)
      model, remat = choose_remat(
          model, optimizer, schedule, mesh, rules, batch_shapes, microbatches=tc.microbatches,
          rebuild=lambda m, policy: FinetuneModel(
              m.config.replace(remat_policy=policy), task,
              num_labels=len(train_set.labels), label_targets=targets))
      run.writer.log(remat.summary())
    if backbone.params is None:
      run.writer.log(random_init_line(config))
    run.writer.log(f"backbone: {backbone.source}; {model.num_params():,} params;"
                   f" {task_phrase(task, len(train_set.labels))}; train"
                   f" {json.dumps(train_stats)} of {train_set.path}"
                   f" ({train_set.stats['bad_rows']} bad rows skipped); dev"
                   f" {json.dumps(dev_stats)} of {dev_set.path}"
                   f" ({dev_set.stats['bad_rows']} bad rows skipped);"
                   f" {jax.process_count()} process(es)")
    mc = backbone.model_config
    warning = truncation_warning(train_stats, task.max_length,
                                 mc.max_position_embeddings
                                 if mc.position_embedding == "learned" else None)
    for warning in (warning, answers_lost_warning(train_stats, task)):
      if warning:
        run.writer.log(warning)

    # ------------------------------------------------------------------ state, resume
    zero_stage = config.mesh.zero_stage

    def create():
      state, shardings = create_train_state(model, optimizer, mesh, rules, batch_shapes,
                                            jax.random.key(config.seed), zero_stage)
      if backbone.params is not None:
        params = model.load_backbone(state.params, backbone.params)
        state = state.replace(params=jax.device_put(params, shardings.params))
      return state, shardings

    start = run.start(abstract_train_state(model, optimizer, mesh, rules, batch_shapes,
                                           zero_stage), create)
    # A checkpoint of a version before the shared loader: its position is its step.
    data_state = (None if start.extra is None else
                  start.extra.get("data", {"next_index": start.step}))

    # -------------------------------------------------------------------------- train
    predictor = Predictor(model, batch_size=tc.batch_size, mesh=mesh, rules=rules,
                          tokenizer=backbone.tokenizer, label_names=train_set.labels)
    last = {}

    def evaluate(state, step: int) -> dict:
      last["predictions"], last["params"] = predictor(state.params, dev_features), state.params
      result = dev_metrics(model, last["predictions"], dev_features, dev_set)
      run.writer.log(f"step {step}: dev "
                     + ", ".join(f"{k}={v:.4f}" for k, v in result.items()))
      return result

    def scalars(metrics, step: int, seconds: float) -> dict:
      return {"loss": float(metrics["loss"]), "learning_rate": float(schedule(step - 1)),
              "seconds_per_step": seconds}

    if start.finished:  # the outputs again, from the final checkpoint
      started = time.perf_counter()
      step, dev = start.step, evaluate(start.state, start.step)
    else:
      train_step = make_train_step(model, optimizer, schedule, microbatches=tc.microbatches,
                                   mesh=mesh, rules=rules, state_shardings=start.shardings,
                                   batch_shapes=batch_shapes, zero_stage=zero_stage)
      rows = EncodedRows(trained, config.seed, task.padding_groups())
      batches = device_batches(rows, tc.batch_size, seed=config.seed, mesh=mesh, rules=rules,
                               shuffle=False, data_state=data_state)
      started = time.perf_counter()
      step, _, dev, stopped = run_steps(StepLoop(
          train_step, batches, jax.random.key(config.seed + 1), run, Every.of(tc), evaluate,
          scalars, eval_row=lambda result: {f"dev_{k}": v for k, v in result.items()}),
                                        start.state, start.step, tc.num_steps)
      if stopped:
        return RunResult(dev, step, "stopped", run.preemption.requested)

    # ------------------------------------------------------------------------ outputs
    final = dict(dev, step=step, train_examples=len(train_set.examples),
                 dev_examples=len(dev_set.examples), backbone=backbone.source,
                 seconds=round(time.perf_counter() - started, 1))
    # The data source's outputs (every process predicts; process 0 writes).
    predictions = _FinalPredictions(model, predictor, last["params"], dev_set,
                                    last["predictions"], dev_features, extra_features)
    final.update(data.write_outputs(config, splits, predictions, run.workdir,
                                    run.writer.log))
    if jax.process_index() == 0:
      rows = prediction_rows(model, last["predictions"], dev_set, dev_features)
      fs.write_bytes(os.path.join(run.workdir, "dev_predictions.jsonl"),
                     "".join(json.dumps(row) + "\n" for row in rows).encode())
      fs.write_bytes(os.path.join(run.workdir, "final_metrics.json"),
                     json.dumps(final, indent=1).encode())
    return RunResult(final, step, "already_finished" if start.finished else "finished",
                     run.preemption.requested if run.preemption else None)
