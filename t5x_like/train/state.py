"""The train state and its shardings: params and optimizer state created already sharded.

  TrainState(step, params, opt_state)
  create_train_state(model, optimizer, mesh, rules, batch_shapes, rng, zero_stage=0)
      -> (state, shardings)
  abstract_train_state(model, optimizer, mesh, rules, batch_shapes, zero_stage=0)
      -> ShapeDtypeStructs

Param shardings come from the model's logical axis names through the rules. An
optimizer-state leaf that mirrors a param (its tree path ends with the param's path)
follows that param: the same sharding for the same shape (Adam's mu / nu), the
param's spec without the reduced dim for one dim fewer (Adafactor's v_row / v_col).
Everything else (counts, placeholders) is replicated. With zero_stage >= 1
(config.mesh.zero_stage; ZeRO, Rajbhandari et al. 2020) the state mirrors the param's
update shard instead (parallel.zero_shardings): the param's sharding further split over
the batch's mesh axes, so each data-parallel device holds 1 / N of the moments.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import flax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from t5x_like import parallel

Params = Any


@flax.struct.dataclass
class TrainState:
  """step: int32 scalar (updates applied so far); params; opt_state (optax)."""

  step: jax.Array
  params: Params
  opt_state: optax.OptState


def _as_shapes(batch_shapes: Optional[Mapping[str, Any]], model) -> dict[str, tuple]:
  """{feature: shape tuple} from shapes or arrays (default: the model's example)."""
  shapes = batch_shapes or model.example_batch_shapes()
  return {k: tuple(v.shape) if hasattr(v, "shape") else tuple(v) for k, v in shapes.items()}


def _path_key(path) -> tuple:
  return tuple(jax.tree_util.keystr((k,)) for k in path)


def _spec_tuple(spec: PartitionSpec, ndim: int) -> tuple:
  return tuple(spec) + (None,) * (ndim - len(spec))


def _mirrored_sharding(leaf, param, sharding: NamedSharding, mesh: Mesh) -> NamedSharding:
  """Sharding of an opt-state leaf that mirrors `param` (same path suffix)."""
  if leaf.shape == param.shape:
    return sharding
  spec = _spec_tuple(sharding.spec, param.ndim)
  if len(leaf.shape) == param.ndim - 1:
    # A factored statistic: the param's shape with one dim reduced away.
    candidates = [spec[:i] + spec[i + 1:] for i in range(param.ndim)
                  if param.shape[:i] + param.shape[i + 1:] == tuple(leaf.shape)]
    if candidates and all(c == candidates[0] for c in candidates):
      return NamedSharding(mesh, PartitionSpec(*candidates[0]))
  return NamedSharding(mesh, PartitionSpec())


def opt_state_shardings(abstract_opt_state: Any, abstract_params: Params,
                        param_shardings: Any, mesh: Mesh) -> Any:
  """NamedSharding per leaf of an (abstract) optimizer state; see the module doc."""
  params_by_path = {}
  for (path, p), s in zip(jax.tree_util.tree_leaves_with_path(abstract_params),
                          jax.tree.leaves(param_shardings)):
    params_by_path[_path_key(path)] = (p, s)

  def leaf_sharding(path, leaf):
    key = _path_key(path)
    for start in range(len(key)):
      hit = params_by_path.get(key[start:])
      if hit is not None:
        return _mirrored_sharding(leaf, hit[0], hit[1], mesh)
    return NamedSharding(mesh, PartitionSpec())

  return jax.tree_util.tree_map_with_path(leaf_sharding, abstract_opt_state)


def check_zero_stage(zero_stage: int) -> int:
  """zero_stage as an int; ValueError naming mesh.zero_stage for one not in
  parallel.ZERO_STAGES."""
  if zero_stage not in parallel.ZERO_STAGES:
    raise ValueError(f"mesh.zero_stage={zero_stage!r}: expected one of"
                     f" {sorted(parallel.ZERO_STAGES)} (stage 3, parameters sharded too, is"
                     f" mesh.fsdp > 1)")
  return int(zero_stage)


def update_shardings(abstract_params: Params, param_shardings: Any, mesh: Mesh, rules,
                     zero_stage: int) -> Any:
  """Per param, the sharding its optimizer state (and, at stage 2, its gradient) takes:
  the param's own at stage 0, its ZeRO shard (parallel.zero_shardings) from stage 1."""
  if check_zero_stage(zero_stage) == 0:
    return param_shardings
  return parallel.zero_shardings(abstract_params, param_shardings, mesh, rules)


def train_state_shardings(model, optimizer: optax.GradientTransformation, mesh: Mesh,
                          rules=parallel.DEFAULT_RULES,
                          batch_shapes: Optional[Mapping[str, Any]] = None,
                          zero_stage: int = 0) -> TrainState:
  """TrainState of NamedShardings, computed without allocating anything."""
  shapes = _as_shapes(batch_shapes, model)
  abstract_params = model.param_shapes(shapes)
  p_shardings = parallel.param_shardings(model, mesh, rules, shapes)
  abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
  mirrored = update_shardings(abstract_params, p_shardings, mesh, rules, zero_stage)
  return TrainState(step=NamedSharding(mesh, PartitionSpec()), params=p_shardings,
                    opt_state=opt_state_shardings(abstract_opt, abstract_params, mirrored,
                                                  mesh))


def abstract_train_state(model, optimizer: optax.GradientTransformation, mesh: Mesh,
                         rules=parallel.DEFAULT_RULES,
                         batch_shapes: Optional[Mapping[str, Any]] = None,
                         zero_stage: int = 0) -> TrainState:
  """TrainState of jax.ShapeDtypeStruct with .sharding on `mesh` (a restore target)."""
  shapes = _as_shapes(batch_shapes, model)
  shardings = train_state_shardings(model, optimizer, mesh, rules, shapes, zero_stage)
  abstract = jax.eval_shape(lambda: _init_state(model, optimizer, shapes, jax.random.key(0)))
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      abstract, shardings)


def _init_state(model, optimizer, batch_shapes, rng) -> TrainState:
  params = model.init(rng, batch_shapes)
  return TrainState(step=jnp.zeros([], jnp.int32), params=params,
                    opt_state=optimizer.init(params))


def create_train_state(model, optimizer: optax.GradientTransformation, mesh: Mesh,
                       rules=parallel.DEFAULT_RULES,
                       batch_shapes: Optional[Mapping[str, Any]] = None,
                       rng: Optional[jax.Array] = None,
                       zero_stage: int = 0) -> tuple[TrainState, TrainState]:
  """(state, state_shardings): params and optimizer state initialised already sharded.

  One jit of (model.init, optimizer.init) with out_shardings, so no device ever
  holds more than its shards. batch_shapes: {feature: shape} of the global batch
  (default: the model's example shapes); zero_stage: config.mesh.zero_stage.
  """
  shapes = _as_shapes(batch_shapes, model)
  rng = jax.random.key(0) if rng is None else rng
  shardings = train_state_shardings(model, optimizer, mesh, rules, shapes, zero_stage)
  init = jax.jit(lambda r: _init_state(model, optimizer, shapes, r), out_shardings=shardings)
  return init(rng), shardings
