"""The fine-tuning run: `finetune(config, workdir)` trains a backbone + head on a task.

Sections as in train/loop.py, on the same run context (train/run_context.py: the
workdir lock, checkpoints, metrics, resume) and step runner (train/runner.py): the train
step, the deterministic host-sharded loader with device prefetch, checkpoints with the
loader's position, SIGTERM / SIGINT saves, multi-host. A run is a function of (config,
seed): the rows of step s are rows s*B .. (s+1)*B of the concatenated per-epoch
permutations (encoding.EncodedRows), dropout is folded from the step, so a resumed run
gives the numbers of an uninterrupted one. Writes to workdir: metrics.jsonl /
tensorboard (train loss, dev metrics), checkpoints/ (the train state),
dev_predictions.jsonl, final_metrics.json.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import jax
import ml_collections
import optax

from t5x_like import fs
from t5x_like.errors import UserError
from t5x_like.experiment import build_mesh
from t5x_like.finetune.backbone import load_backbone
from t5x_like.finetune.config_check import validate_finetune
from t5x_like.finetune.encoding import EncodedRows, encode_examples
from t5x_like.finetune.evaluate import Predictor, dev_metrics, prediction_rows
from t5x_like.finetune.layer_decay import layer_depths, scale_by_layer
from t5x_like.finetune.model import FinetuneModel, finetunes_text_to_text
from t5x_like.finetune.splits import load_splits, run_task
from t5x_like.benchmarks.outputs import benchmark_outputs
from t5x_like.models import model_class
from t5x_like.plan.remat import resolve_remat
from t5x_like.train.optimizers import make_optimizer
from t5x_like.train.preemption import RunResult
from t5x_like.train.run_context import open_run
from t5x_like.train.runner import Every, StepLoop, device_batches, run_steps
from t5x_like.train.state import abstract_train_state, create_train_state
from t5x_like.train.step import make_train_step
from t5x_like.workdir_lock import WorkdirLock


class FinetuneConfigError(UserError, ValueError):
  """A fine-tuning config that cannot run; the message names the key."""


# ============================================================================ finetune
def finetune(config: ml_collections.ConfigDict, workdir, *,
             lock: Optional[WorkdirLock] = None) -> RunResult:
  """Fine-tunes config.init's backbone on config.task in workdir (a path, relative or
  absolute, or a URL such as gs://...; resumes there); returns the final dev metrics
  (RunResult; status 'stopped' after SIGTERM / Ctrl-C: a checkpoint is saved, rerun;
  'already_finished' when the workdir's run had ended: its outputs are written again
  from the last checkpoint). A UserError (bad config, rows, backbone, a locked workdir)
  leaves the workdir as it was. lock: the workdir's lock when the caller holds it (the
  finetune command takes it before building anything); None takes it here."""
  validate_finetune(config, jax.device_count())  # the train checks on its schema
  tc = config.train
  with open_run(workdir, total_steps=tc.num_steps, keep=2, async_save=False,
                lock=lock) as run:

    # ---------------------------------------------------------- backbone, data, mesh
    backbone = load_backbone(config)
    family = backbone.model_config.family
    text_to_text = (model_class(backbone.model_config).finetunes_text_to_text
                    and config.task.text_to_text)
    task = run_task(config, text_to_text)
    if text_to_text != finetunes_text_to_text(backbone.model_config, task):
      raise FinetuneConfigError(f"config.task.text_to_text=False: task {task.name} has no"
                                " head on T5's encoder (classification has)")
    splits = load_splits(config, task, text_to_text)
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
                                                    task, **encode_kw)
      dev_features, dev_stats = encode_examples(dev_set.examples, backbone.tokenizer, task,
                                                **encode_kw)
      extra_features = {  # the other dev splits and the test splits (benchmarks)
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
    batch_shapes = {k: (tc.batch_size, *v.shape[1:]) for k, v in trained.items()}
    optimizer, schedule = make_optimizer(config.optimizer, tc.num_steps)
    if config.optimizer.layer_decay != 1:
      stacks = model_class(model.config).stack_layers(model.config)
      depths = layer_depths(model.param_shapes(batch_shapes), stacks)
      optimizer = optax.chain(optimizer, scale_by_layer(depths, config.optimizer.layer_decay))
    if backbone.remat_auto:  # model.remat_policy="auto": chosen by compiling (plan/remat.py)
      model, remat = resolve_remat(
          model, optimizer, schedule, mesh, rules, batch_shapes, microbatches=tc.microbatches,
          rebuild=lambda m, policy: FinetuneModel(
              m.config.replace(remat_policy=policy), task,
              num_labels=len(train_set.labels), label_targets=targets))
      run.writer.log(remat.summary())
    run.writer.log(f"backbone: {backbone.source}; {model.num_params():,} params; task"
                   f" {task.name} with {len(train_set.labels)} labels; train"
                   f" {json.dumps(train_stats)} of {train_set.path}"
                   f" ({train_set.stats['bad_rows']} bad rows skipped); dev"
                   f" {json.dumps(dev_stats)} of {dev_set.path}"
                   f" ({dev_set.stats['bad_rows']} bad rows skipped);"
                   f" {jax.process_count()} process(es)")

    # ------------------------------------------------------------------ state, resume
    def create():
      state, shardings = create_train_state(model, optimizer, mesh, rules, batch_shapes,
                                            jax.random.key(config.seed))
      if backbone.params is not None:
        params = model.load_backbone(state.params, backbone.params)
        state = state.replace(params=jax.device_put(params, shardings.params))
      return state, shardings

    start = run.start(abstract_train_state(model, optimizer, mesh, rules, batch_shapes),
                      create)
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
                                   batch_shapes=batch_shapes)
      batches = device_batches(EncodedRows(trained, config.seed), tc.batch_size,
                               seed=config.seed, mesh=mesh, rules=rules, shuffle=False,
                               data_state=data_state)
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
    if splits.benchmark is not None:  # every process predicts; process 0 writes
      final.update(benchmark_outputs(
          splits, model, run.workdir, dev_rows=prediction_rows(
              model, last["predictions"], dev_set, dev_features),
          predict=lambda key, dataset: prediction_rows(
              model, predictor(last["params"], extra_features[key]), dataset,
              extra_features[key])))
      run.writer.log("official metrics: " + json.dumps(final["official"]))
    test_rows = []
    if splits.benchmark is None and splits.test:  # task.test_file: the final weights
      test_set = splits.test["test"]
      test_features = extra_features["test", "test"]
      test_predictions = predictor(last["params"], test_features)
      final.update({f"test_{k}": v for k, v in dev_metrics(
          model, test_predictions, test_features, test_set).items()},
                   test_examples=len(test_set.examples))
      test_rows = prediction_rows(model, test_predictions, test_set, test_features)
      run.writer.log("test: " + ", ".join(f"{k}={final[k]:.4f}" for k in final
                                          if k.startswith("test_") and k != "test_examples"))
    if jax.process_index() == 0:
      rows = prediction_rows(model, last["predictions"], dev_set, dev_features)
      fs.write_bytes(os.path.join(run.workdir, "dev_predictions.jsonl"),
                     "".join(json.dumps(row) + "\n" for row in rows).encode())
      if test_rows:
        fs.write_bytes(os.path.join(run.workdir, "test_predictions.jsonl"),
                       "".join(json.dumps(row) + "\n" for row in test_rows).encode())
      fs.write_bytes(os.path.join(run.workdir, "final_metrics.json"),
                     json.dumps(final, indent=1).encode())
    return RunResult(final, step, "already_finished" if start.finished else "finished")
