"""The train and eval steps: one jit each, with in/out shardings; the state is donated.

  train_step(state, batch, rng) -> (new_state, metrics)
  eval_step(params, batch) -> metrics

Gradient accumulation: the batch [B, ...] is split into M microbatches [M, B/M, ...]
and a lax.scan sums float32 grads and metrics over them. Every microbatch's loss is
divided by the FULL batch's normalizers (model.loss_normalizers), so the sums are the
full-batch loss, gradient and metrics exactly (up to float summation order).
Microbatch m holds rows m, m + M, m + 2M, ...: a free reshape of a batch sharded
along B, so each microbatch stays spread over every data shard.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from t5x_like import parallel
from t5x_like.train.state import TrainState, check_zero_stage, update_shardings

Batch = Mapping[str, jax.Array]


def _batch_size(batch: Batch) -> int:
  sizes = {name: x.shape[0] for name, x in batch.items() if x.ndim}
  if len(set(sizes.values())) != 1:
    raise ValueError(f"batch features disagree on the batch size: {sizes}")
  return next(iter(sizes.values()))


def split_microbatches(batch: Batch, microbatches: int) -> dict[str, jax.Array]:
  """[B, ...] -> [M, B/M, ...] per feature; microbatch m = rows m, m + M, ... ."""
  batch_size = _batch_size(batch)
  if batch_size % microbatches:
    raise ValueError(f"batch size {batch_size} is not divisible by microbatches="
                     f"{microbatches}; set train.batch_size to a multiple of it")

  def split(x):
    x = x.reshape((batch_size // microbatches, microbatches) + x.shape[1:]).swapaxes(0, 1)
    return nn.with_logical_constraint(x, (None, "batch") + (None,) * (x.ndim - 2))
  return {name: split(x) for name, x in batch.items()}


def token_counts(batch: Batch) -> dict[str, jax.Array]:
  """Non-padding tokens of the batch (float32 scalars), per stack and in total.

  A token is real where its segment id is > 0 when packing ids are present, else where
  its id is non-zero (encoder_input_tokens, decoder_target_tokens).
  """
  def count(segment_name, token_name):
    ids = batch[segment_name] if segment_name in batch else batch[token_name]
    return jnp.sum((ids > 0) if segment_name in batch else (ids != 0), dtype=jnp.float32)

  out = {}
  if "encoder_input_tokens" in batch:
    out["encoder_tokens"] = count("encoder_segment_ids", "encoder_input_tokens")
  if "decoder_target_tokens" in batch:
    out["decoder_tokens"] = count("decoder_segment_ids", "decoder_target_tokens")
  out["nonpadding_tokens"] = sum(out.values(), jnp.zeros((), jnp.float32))
  return out


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def _batch_shardings(mesh, rules, batch_shardings, batch_shapes):
  if batch_shardings is not None:
    return batch_shardings
  if batch_shapes is None:
    raise ValueError("give batch_shardings or batch_shapes")
  shapes = {k: tuple(v.shape) if hasattr(v, "shape") else tuple(v)
            for k, v in batch_shapes.items()}
  return parallel.batch_shardings(shapes, mesh, rules)


def make_train_step(model, optimizer: optax.GradientTransformation,
                    schedule: Callable[[Any], jax.Array], *, microbatches: int = 1,
                    mesh: Mesh, rules=parallel.DEFAULT_RULES, state_shardings: TrainState,
                    batch_shardings: Optional[Mapping[str, NamedSharding]] = None,
                    batch_shapes: Optional[Mapping[str, Any]] = None,
                    zero_stage: int = 0) -> Callable:
  """Jitted train_step(state, batch, rng) -> (new_state, metrics), state donated.

  batch: {feature: [B, ...]} sharded as batch_shardings (or as parallel.batch_shardings
  of batch_shapes). rng: a key, the same every step; the dropout key of microbatch i
  is fold_in(fold_in(rng, state.step), i).
  metrics (replicated device scalars): the model's metrics and loss summed over
  microbatches (= full-batch values), grad_norm (global, before clipping),
  learning_rate (schedule(state.step)) and token_counts(batch).
  zero_stage (config.mesh.zero_stage; state_shardings made with the same): at 2 the
  float32 gradients (and a microbatch accumulator) take the optimizer state's ZeRO
  shards, so the gradient reduction is a reduce-scatter and each device updates its
  shard; the new params are gathered back to their own sharding.
  """
  microbatches = int(microbatches or 1)
  if microbatches < 1:
    raise ValueError(f"microbatches={microbatches}: must be >= 1")
  batch_shardings = _batch_shardings(mesh, rules, batch_shardings, batch_shapes)
  grad_fn = jax.value_and_grad(model.loss_fn, has_aux=True)
  check_zero_stage(zero_stage)

  def train_step(state: TrainState, batch: Batch, rng: jax.Array):
    grad_shardings = (update_shardings(state.params, state_shardings.params, mesh, rules,
                                       zero_stage) if zero_stage >= 2
                      else state_shardings.params)
    with parallel.traced_rules(mesh, rules):
      normalizers = model.loss_normalizers(batch)
      step_rng = jax.random.fold_in(rng, state.step)

      def micro_grads(micro_batch, index):
        (_, metrics), grads = grad_fn(state.params, micro_batch,
                                      jax.random.fold_in(step_rng, index), normalizers)
        return jax.tree.map(lambda g: g.astype(jnp.float32), grads), metrics

      if microbatches == 1:
        grads, metrics = micro_grads(batch, 0)
        if zero_stage >= 2:
          grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
      else:
        micro = split_microbatches(batch, microbatches)
        first = jax.tree.map(lambda x: x[0], micro)
        metric_shapes = jax.eval_shape(
            lambda p, b, r: model.loss_fn(p, b, r, normalizers)[1],
            _abstract(state.params), _abstract(first), _abstract(rng))

        def body(carry, xs):
          index, micro_batch = xs
          grads, metrics = micro_grads(micro_batch, index)
          grads, metrics = jax.tree.map(jnp.add, carry, (grads, metrics))
          # The float32 accumulator lives sharded like the params (FSDP memory), or as
          # the optimizer state's shards at ZeRO stage 2.
          return (jax.lax.with_sharding_constraint(grads, grad_shardings), metrics), None

        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32),
                             (_abstract(state.params), metric_shapes))
        (grads, metrics), _ = jax.lax.scan(body, zeros,
                                           (jnp.arange(microbatches), micro))

      # The scope names the update's ops in the HLO metadata (speed/profile.py's table).
      with jax.named_scope("optimizer_update"):
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
      metrics = {**metrics, "grad_norm": grad_norm,
                 "learning_rate": jnp.asarray(schedule(state.step), jnp.float32),
                 **token_counts(batch)}
      new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics

  return jax.jit(train_step,
                 in_shardings=(state_shardings, batch_shardings, _replicated(mesh)),
                 out_shardings=(state_shardings, _replicated(mesh)),
                 donate_argnums=(0,))


def make_eval_step(model, *, mesh: Mesh, rules=parallel.DEFAULT_RULES,
                   state_shardings: Optional[TrainState] = None,
                   param_shardings: Any = None,
                   batch_shardings: Optional[Mapping[str, NamedSharding]] = None,
                   batch_shapes: Optional[Mapping[str, Any]] = None) -> Callable:
  """Jitted eval_step(params, batch) -> metrics: deterministic loss_fn (no dropout).

  params sharded as param_shardings (or state_shardings.params). metrics: the model's
  metrics over this batch and token_counts(batch), replicated scalars.
  """
  if param_shardings is None:
    if state_shardings is None:
      raise ValueError("give state_shardings or param_shardings")
    param_shardings = state_shardings.params
  batch_shardings = _batch_shardings(mesh, rules, batch_shardings, batch_shapes)

  def eval_step(params, batch: Batch):
    with parallel.traced_rules(mesh, rules):
      _, metrics = model.loss_fn(params, batch, None)
      return {**metrics, **token_counts(batch)}

  return jax.jit(eval_step, in_shardings=(param_shardings, batch_shardings),
                 out_shardings=_replicated(mesh))
