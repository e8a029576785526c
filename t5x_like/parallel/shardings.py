"""Shardings of parameters and batches from logical axis names, and sharded init."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from t5x_like.parallel.rules import DEFAULT_RULES, rules_for_mesh

_is_spec = lambda x: isinstance(x, PartitionSpec)


def logical_to_mesh_specs(logical_specs: Any, mesh_axis_names, rules=DEFAULT_RULES) -> Any:
  """Tree of logical PartitionSpecs -> tree of mesh-axis PartitionSpecs."""
  restricted = rules_for_mesh(rules, mesh_axis_names)
  return jax.tree.map(lambda spec: nn.logical_to_mesh_axes(tuple(spec), restricted),
                      logical_specs, is_leaf=_is_spec)


def logical_to_shardings(logical_specs: Any, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
  """Tree of logical PartitionSpecs (e.g. `model.param_axes()`) -> tree of NamedShardings."""
  specs = logical_to_mesh_specs(logical_specs, mesh.axis_names, rules)
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=_is_spec)


def param_shardings(model, mesh: Mesh, rules=DEFAULT_RULES,
                    batch_shapes: Optional[Mapping[str, Any]] = None) -> Any:
  """NamedSharding of every parameter of `model` (a t5x_like Model), without allocating."""
  return logical_to_shardings(model.param_axes(batch_shapes), mesh, rules)


def batch_spec(ndim: int, mesh_axis_names, rules=DEFAULT_RULES) -> PartitionSpec:
  """PartitionSpec of a [B, ...] feature: dim 0 over the 'batch' rule, the rest replicated."""
  restricted = rules_for_mesh(rules, mesh_axis_names)
  if ndim == 0:
    return PartitionSpec()
  return nn.logical_to_mesh_axes(("batch",) + (None,) * (ndim - 1), restricted)


def batch_shardings(batch: Mapping[str, Any], mesh: Mesh, rules=DEFAULT_RULES) -> dict:
  """{feature: NamedSharding} for a batch dict of arrays or shapes (tuples)."""
  def ndim(value):
    return len(value) if isinstance(value, (tuple, list)) else np.ndim(value)
  return {name: NamedSharding(mesh, batch_spec(ndim(value), mesh.axis_names, rules))
          for name, value in batch.items()}


def shard_batch(local_batch: Mapping[str, Any], mesh: Mesh, rules=DEFAULT_RULES) -> dict:
  """Host-local numpy batch -> global sharded arrays (multi-host safe).

  Each process passes its own slice [B / num_processes, ...] of the global batch;
  the result is [B, ...] sharded along batch. On one host it is a device_put.
  """
  shardings = batch_shardings(local_batch, mesh, rules)
  return {name: jax.make_array_from_process_local_data(shardings[name], np.asarray(value))
          for name, value in local_batch.items()}
