"""The trainer: `train(config, workdir)` runs a whole pretraining, resumably.

One readable loop in banner-marked sections (big_vision style). A run is a function
of (config, seed): params, dropout (folded from the step) and data (a pure function
of the step) all restart exactly from a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import ml_collections

from t5x_like.data.loader import make_loader
from t5x_like.experiment import (build_data, build_model_from_config, config_vocab,
                                 global_batch_shapes, model_name, phase_configs)
from t5x_like.fs import resolve_path
from t5x_like.parallel import DEFAULT_RULES, mesh_from_config, shard_batch
from t5x_like.train import flops as flops_lib
from t5x_like.train.checkpoints import Checkpointer
from t5x_like.train.config_check import local_device_memory, validate
from t5x_like.train.metrics import (MetricWriter, perplexity, read_jsonl,
                                    summarize_train_metrics)
from t5x_like.train.optimizers import make_optimizer
from t5x_like.train.preemption import Preemption, RunResult
from t5x_like.train.runner import (StepLoop, device_batches, restore_or_create, run_files,
                                   run_steps)
from t5x_like.train.setup_guard import undo_on_user_error
from t5x_like.train.state import abstract_train_state, create_train_state
from t5x_like.train.step import make_eval_step, make_train_step
from t5x_like.workdir_lock import WorkdirLock


def _last_eval(jsonl_path: str) -> dict:
  """The eval metrics of the last row of metrics.jsonl that has them ({} if none)."""
  try:
    rows = read_jsonl(jsonl_path)
  except FileNotFoundError:
    return {}
  for row in reversed(rows):
    evals = {k: v for k, v in row.items() if k.startswith("eval_")}
    if evals:
      return evals
  return {}


# =============================================================================== train
def train(config: ml_collections.ConfigDict, workdir) -> RunResult:
  """Trains config's model in workdir (a local path, relative or absolute, or a URL such
  as gs://...); resumes from its latest checkpoint.

  With config.train.phases, runs them in order; a phase starts from the checkpoint the
  previous one saved at its last step, with its own shapes and a fresh data iterator.
  Returns the last eval metrics (RunResult). Raises a UserError (ConfigError, a bad
  data source, a locked workdir, ...) before writing anything to the workdir, and
  NonFiniteLossError on a NaN/inf loss.
  """
  validate(config, jax.device_count(), vocab_size=config_vocab(config).vocab_size,
           device_memory_bytes=local_device_memory())
  workdir_path = resolve_path(workdir, "workdir")
  workdir = os.fspath(workdir_path)
  is_main = jax.process_index() == 0
  # The lock first: a refused lock must not undo the holder's files.
  with WorkdirLock(workdir_path, enabled=is_main), \
       undo_on_user_error(workdir_path, enabled=is_main) as setup:
    return _train(config, workdir, setup)


def _train(config, workdir: str, setup) -> RunResult:
  tc = config.train
  phases = phase_configs(config)

  # ---------------------------------------------------------------- data, model, mesh
  vocab, objective, eval_objective, data_stats = build_data(phases[0][1], workdir)
  model = build_model_from_config(config, vocab.vocab_size)
  mesh = mesh_from_config(config.mesh)
  rules = tuple(config.mesh.rules) or DEFAULT_RULES
  batch_shapes = global_batch_shapes(objective, tc.batch_size)
  optimizer, schedule = make_optimizer(config.optimizer, tc.num_steps)

  # ----------------------------------------------------------- state, resume
  rng = jax.random.key(config.seed)
  with run_files(workdir, total_steps=tc.num_steps, keep=tc.keep_checkpoints,
                 async_save=tc.async_checkpoints) as (checkpointer, writer):
    abstract = abstract_train_state(model, optimizer, mesh, rules, batch_shapes)
    start = restore_or_create(
        checkpointer, abstract, lambda: create_train_state(
            model, optimizer, mesh, rules, batch_shapes, jax.random.fold_in(rng, 1)), setup)
    writer.log(f"model {model_name(config)}: {model.num_params():,} params; mesh"
               f" {dict(mesh.shape)}; {jax.process_count()} process(es); data"
               f" {json.dumps({k: v for k, v in data_stats.items() if k != 'source'})};"
               f" bad input {json.dumps(data_stats.get('source', {}))}")
    data_state = None
    if start.extra is None:
      writer.truncate_after(0)  # rows of a run killed before its first checkpoint
    else:
      data_state = start.extra["data"], start.extra.get("phase", 0)
      if start.step >= tc.num_steps:
        writer.log(f"{workdir}: the run already finished at step {start.step}")
        return RunResult(_last_eval(writer.jsonl_path), start.step, "already_finished")
      writer.truncate_after(start.step)  # rows of steps after it are about to be redone
      writer.log(f"resumed from step {start.step}")
    return _run_phases(config, phases, start.step, start.state, data_state, _Run(
        model, optimizer, schedule, mesh, rules, rng, start.shardings, checkpointer, writer,
        Preemption(), flops_lib.peak_flops_per_device(jax.devices()[0],
                                                      dtype=model.config.dtype)),
                       objective, eval_objective, batch_shapes, workdir)


def _run_phases(config, phases, step: int, state, data_state, run: "_Run", objective,
                eval_objective, batch_shapes, workdir: str) -> RunResult:
  """Runs the phases from `step`; the signal handlers are restored on the way out."""
  eval_metrics: dict = {}
  try:
    for phase, (until_step, phase_config) in enumerate(phases):
      if step >= until_step:
        continue
      if phase:
        _, objective, eval_objective, _ = build_data(phase_config, workdir)
        batch_shapes = global_batch_shapes(objective, config.train.batch_size)
      if len(phases) > 1:
        run.writer.log(f"phase {phase}: steps {step}..{until_step}, length"
                       f" {phase_config.data.length}, {dict(phase_config.data.options)}")
      # A checkpoint saved inside this phase carries its iterator; one saved at the
      # previous phase's end carries that phase's, which a new phase does not continue.
      resume_data = data_state[0] if data_state and data_state[1] == phase else None
      step, state, eval_metrics, stopped = run_steps(
          _phase_loop(run, phase_config, phase, objective, eval_objective, batch_shapes,
                      resume_data), state, step, until_step)
      data_state = None
      if stopped:
        return RunResult(eval_metrics, step, "stopped", run.preemption.requested)
  finally:
    run.preemption.restore()
  return RunResult(eval_metrics, step, "finished")


@dataclasses.dataclass(frozen=True)
class _Run:
  """What stays the same across the phases of one run."""
  model: Any
  optimizer: Any
  schedule: Any
  mesh: Any
  rules: Any
  rng: jax.Array
  state_shardings: Any
  checkpointer: Checkpointer
  writer: MetricWriter
  preemption: Preemption
  peak_flops_per_device: float


def _phase_loop(run: _Run, config, phase: int, objective, eval_objective, batch_shapes,
                resume_data) -> StepLoop:
  """The StepLoop of one phase: its data, steps, train rows and evaluation."""
  tc = config.train
  model, mesh, rules = run.model, run.mesh, run.rules
  train_step = make_train_step(model, run.optimizer, run.schedule,
                               microbatches=tc.microbatches, mesh=mesh, rules=rules,
                               state_shardings=run.state_shardings, batch_shapes=batch_shapes)
  eval_step = make_eval_step(model, mesh=mesh, rules=rules,
                             state_shardings=run.state_shardings, batch_shapes=batch_shapes)
  flops_per_step = flops_lib.train_flops_per_step(model.config, batch_shapes)
  tokens_per_step = tc.batch_size * config.data.length

  def evaluate(state, step: int) -> dict:
    eval_batches = iter(make_loader(eval_objective, tc.batch_size, seed=config.seed + 1))
    sums: dict[str, float] = {}
    for _ in range(tc.eval_batches):
      metrics = jax.device_get(eval_step(state.params, shard_batch(next(eval_batches), mesh,
                                                                   rules)))
      for k, v in metrics.items():
        sums[k] = sums.get(k, 0.0) + float(v)
    means = {k: v / tc.eval_batches for k, v in sums.items()}
    ppl = perplexity(means)
    if ppl is not None:
      means["perplexity"] = ppl
    return {f"eval_{k}": v for k, v in means.items()}

  def scalars(metrics, step: int, seconds: float) -> dict:
    return summarize_train_metrics(
        metrics, step_seconds=seconds, tokens_per_step=tokens_per_step,
        flops_per_step=flops_per_step, num_devices=jax.device_count(),
        peak_per_device=run.peak_flops_per_device)

  batches = device_batches(objective, tc.batch_size, seed=config.seed + 1000 * phase,
                           mesh=mesh, rules=rules, data_state=resume_data,
                           num_workers=config.data.num_workers)
  return StepLoop(train_step, batches, run.rng, run.checkpointer, run.writer, run.preemption,
                  evaluate, scalars, log_every=tc.log_every,
                  checkpoint_every=tc.checkpoint_every, eval_every=tc.eval_every,
                  checkpoint_extra=lambda: {"phase": phase})
