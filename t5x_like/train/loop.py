"""The trainer: `train(config, workdir)` runs a whole pretraining, resumably.

One readable loop in banner-marked sections (big_vision style). A run is a function
of (config, seed): params, dropout (folded from the step) and data (a pure function
of the step) all restart exactly from a checkpoint. The workdir (lock, undo guard,
checkpoints, metrics, resume, signals) is train/run_context.py's, the steps
train/runner.py's: both shared with fine-tuning.
"""

from __future__ import annotations

import json
from typing import Callable, Optional

import jax
import ml_collections

from t5x_like import failpoints
from t5x_like.data.loader import make_loader
from t5x_like.data.mixture import Mixture, eval_sets, exhaustion_step
from t5x_like.experiment import (REMAT_AUTO, build_data, build_mesh,
                                 build_model_from_config, config_vocab, global_batch_shapes,
                                 model_name, phase_configs)
from t5x_like.parallel import shard_batch
from t5x_like.parallel.device_memory import local_device_memory
from t5x_like.train import flops as flops_lib
from t5x_like.train.config_check import validate
from t5x_like.train.metrics import perplexity, read_jsonl, summarize_train_metrics
from t5x_like.train.optimizers import make_optimizer
from t5x_like.train.preemption import RunResult
from t5x_like.train.run_context import open_run
from t5x_like.train.runner import Every, StepLoop, device_batches, run_steps
from t5x_like.train.saved_config import write_run_config
from t5x_like.train.state import abstract_train_state, create_train_state
from t5x_like.train.step import make_eval_step, make_train_step
from t5x_like.train.workdir_lock import WorkdirLock

# (config, model, optimizer, schedule, mesh, rules, vocab) -> (model, RematChoice or None)
RematChooser = Callable[..., tuple]


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


def _data_end(phase_config, objective, phases, phase: int) -> tuple[int, Optional[str]]:
  """(the step phase `phase` trains to, the mixture source that ends it early or None):
  with data.mixture_exhausted="stop", the last whole batch before the phase's loader
  (from the phase's first step) reads past a source's first epoch
  (mixture.exhaustion_step)."""
  until_step = phases[phase][0]
  if (phase_config.data.get("mixture_exhausted", "restart") != "stop"
      or not isinstance(objective, Mixture)):
    return until_step, None
  first = phases[phase - 1][0] if phase else 0
  steps, source = exhaustion_step(objective, phase_config.train.batch_size)
  return (first + steps, source) if first + steps < until_step else (until_step, None)


# =============================================================================== train
def train(config: ml_collections.ConfigDict, workdir, *,
          lock: Optional[WorkdirLock] = None,
          choose_remat: Optional[RematChooser] = None) -> RunResult:
  """Trains config's model in workdir (a local path, relative or absolute, or a URL such
  as gs://...); resumes from its latest checkpoint.

  With config.train.phases, runs them in order; a phase starts from the checkpoint the
  previous one saved at its last step, with its own shapes and a fresh data iterator.
  Returns the last eval metrics (RunResult). Raises a UserError (ConfigError, a bad
  data source, a locked workdir, ...) before writing anything to the workdir, and
  NonFiniteLossError on a NaN/inf loss. lock: the workdir's lock when the caller holds
  it (the train command takes it before importing jax); None takes it here.
  choose_remat(config, model, optimizer, schedule, mesh, rules, vocab) -> (model, choice):
  resolves model.remat_policy="auto" (the train command passes plan.remat's
  resolve_config_remat, which compiles the step per policy; plan/ sits above the
  trainer); the choice's summary() is logged. Required for "auto" only.
  """
  if config.model.remat_policy == REMAT_AUTO and choose_remat is None:
    raise ValueError('model.remat_policy="auto" needs choose_remat (the train command'
                     " passes plan.remat.resolve_config_remat)")
  validate(config, jax.device_count(), vocab_size=config_vocab(config).vocab_size,
           device_memory_bytes=local_device_memory())
  tc = config.train
  phases = phase_configs(config)
  with open_run(workdir, total_steps=tc.num_steps, keep=tc.keep_checkpoints,
                async_save=tc.async_checkpoints, lock=lock) as run:

    # -------------------------------------------------------------- data, model, mesh
    vocab, objective, eval_objective, data_stats = build_data(phases[0][1], run.workdir)
    model = build_model_from_config(config, vocab.vocab_size)
    mesh, rules = build_mesh(config)
    batch_shapes = global_batch_shapes(objective, tc.batch_size)
    optimizer, schedule = make_optimizer(config.optimizer, tc.num_steps)
    if choose_remat is not None:  # model.remat_policy="auto", chosen by compiling
      model, remat = choose_remat(config, model, optimizer, schedule, mesh, rules, vocab)
      if remat is not None:
        run.writer.log(remat.summary())
    run.writer.log(f"model {model_name(config)}: {model.num_params():,} params; mesh"
                   f" {dict(mesh.shape)}; {jax.process_count()} process(es); data"
                   f" {json.dumps({k: v for k, v in data_stats.items() if k != 'source'})};"
                   f" bad input {json.dumps(data_stats.get('source', {}))}")

    # -------------------------------------------------------------------- state, resume
    rng = jax.random.key(config.seed)
    zero_stage = config.mesh.zero_stage
    start = run.start(
        abstract_train_state(model, optimizer, mesh, rules, batch_shapes, zero_stage),
        lambda: create_train_state(model, optimizer, mesh, rules, batch_shapes,
                                   jax.random.fold_in(rng, 1), zero_stage))
    if jax.process_index() == 0:  # the workdir names its model: WORKDIR/config.py
      not_saved = write_run_config(run.workdir, config)
      if not_saved:
        run.writer.log(not_saved)
    if start.finished:
      return RunResult(_last_eval(run.writer.jsonl_path), start.step, "already_finished")
    peak_flops = flops_lib.peak_flops_per_device(jax.devices()[0], dtype=model.config.dtype)

    def phase_loop(phase: int, phase_config, objective, eval_objective, batch_shapes,
                   resume_data) -> StepLoop:
      """The StepLoop of one phase: its data, steps, train rows and evaluation."""
      train_step = make_train_step(model, optimizer, schedule,
                                   microbatches=tc.microbatches, mesh=mesh, rules=rules,
                                   state_shardings=start.shardings,
                                   batch_shapes=batch_shapes, zero_stage=zero_stage)
      eval_step = make_eval_step(model, mesh=mesh, rules=rules,
                                 state_shardings=start.shardings, batch_shapes=batch_shapes)
      flops_per_step = flops_lib.train_flops_per_step(model.config, batch_shapes)
      tokens_per_step = tc.batch_size * phase_config.data.length

      def evaluate(state, step: int) -> dict:
        """eval_<metric>; a mixture's per source as eval_<source>/<metric>, and overall
        as the rate-weighted mean of the sources' (the mixture's expectation)."""
        sets = eval_sets(eval_objective)
        out: dict[str, float] = {}
        overall: dict[str, float] = {}
        for name, objective, weight in sets:
          means = mean_eval_metrics(state, objective, step)
          if len(sets) > 1:
            out.update({f"eval_{name}/{k}": v for k, v in means.items()})
          for k, v in means.items():
            overall[k] = overall.get(k, 0.0) + weight * v
        ppl = perplexity(overall)
        if ppl is not None:
          overall["perplexity"] = ppl
        return {**{f"eval_{k}": v for k, v in overall.items()}, **out}

      def mean_eval_metrics(state, objective, step: int) -> dict:
        eval_batches = iter(make_loader(objective, tc.batch_size, seed=config.seed + 1))
        sums: dict[str, float] = {}
        for i in range(tc.eval_batches):
          if i == 1:
            failpoints.kill_at("during_eval", step)  # the kill matrix (tests/kill_matrix.py)
          metrics = jax.device_get(eval_step(state.params,
                                             shard_batch(next(eval_batches), mesh, rules)))
          for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        means = {k: v / tc.eval_batches for k, v in sums.items()}
        ppl = perplexity(means)
        if ppl is not None:
          means["perplexity"] = ppl
        return means

      def scalars(metrics, step: int, seconds: float) -> dict:
        return summarize_train_metrics(
            metrics, step_seconds=seconds, tokens_per_step=tokens_per_step,
            flops_per_step=flops_per_step, num_devices=jax.device_count(),
            peak_per_device=peak_flops)

      batches = device_batches(objective, tc.batch_size, seed=config.seed + 1000 * phase,
                               mesh=mesh, rules=rules, data_state=resume_data,
                               num_workers=phase_config.data.num_workers)
      return StepLoop(train_step, batches, rng, run, Every.of(tc), evaluate, scalars,
                      checkpoint_extra={"phase": phase})

    # --------------------------------------------------------------------------- train
    step, state, eval_metrics = start.step, start.state, {}
    # A checkpoint saved inside a phase carries its iterator; one saved at the previous
    # phase's end carries that phase's, which a new phase does not continue.
    data_phase = (None if start.extra is None else
                  (start.extra["data"], start.extra.get("phase", 0)))
    for phase, (until_step, phase_config) in enumerate(phases):
      if step >= until_step:
        continue
      if phase:
        _, objective, eval_objective, _ = build_data(phase_config, run.workdir)
        batch_shapes = global_batch_shapes(objective, tc.batch_size)
      if len(phases) > 1:
        run.writer.log(f"phase {phase}: steps {step}..{until_step}, length"
                       f" {phase_config.data.length}, {dict(phase_config.data.options)}")
      resume_data = data_phase[0] if data_phase and data_phase[1] == phase else None
      end, exhausted = _data_end(phase_config, objective, phases, phase)
      if step < end:
        step, state, eval_metrics, stopped = run_steps(
            phase_loop(phase, phase_config, objective, eval_objective, batch_shapes,
                       resume_data), state, step, end)
        if stopped:
          return RunResult(eval_metrics, step, "stopped", run.preemption.requested)
      data_phase = None
      if exhausted:
        run.writer.log(f"data.mixture_exhausted='stop': source {exhausted!r} runs past its"
                       f" first epoch in step {end + 1}; the run ends at step {step}")
        return RunResult(eval_metrics or _last_eval(run.writer.jsonl_path), step,
                         "exhausted", exhausted_source=exhausted)
    return RunResult(eval_metrics, step, "finished")
