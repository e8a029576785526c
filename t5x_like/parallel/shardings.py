"""Shardings of parameters and batches from logical axis names, and sharded init."""

from __future__ import annotations

import math
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


# ZeRO stages (Rajbhandari et al., "ZeRO: memory optimizations toward training trillion
# parameter models", SC 2020) as config.mesh.zero_stage; stage 3 (parameters sharded
# too) is FSDP through the rules: mesh.fsdp > 1.
ZERO_STAGES = {0: "replicated optimizer state", 1: "optimizer state sharded",
               2: "optimizer state and gradients sharded"}


def batch_mesh_axes(mesh_axis_names, rules=DEFAULT_RULES) -> tuple[str, ...]:
  """The mesh axes the 'batch' rule splits the batch over (('data', 'fsdp') by default)."""
  entry = batch_spec(1, mesh_axis_names, rules)[0]
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def zero_spec(shape: tuple[int, ...], spec: PartitionSpec, axis_sizes: Mapping[str, int],
              free_axes: tuple[str, ...]) -> PartitionSpec:
  """`spec` of an array `shape` further split over `free_axes` (ZeRO's data-parallel
  shards), those of them of size > 1 that `spec` does not use yet: on the largest dim
  they divide, an unsplit one first (where a dim is split already, the new axes go
  after its own). No dim divisible: `spec` unchanged (a small array stays replicated)."""
  entries = list(tuple(spec) + (None,) * (len(shape) - len(spec)))
  used = {a for e in entries if e is not None for a in ((e,) if isinstance(e, str) else e)}
  axes = tuple(a for a in free_axes if a not in used and axis_sizes.get(a, 1) > 1)
  if not axes:
    return spec
  ways = math.prod(axis_sizes[a] for a in axes)

  def split(e):
    return 1 if e is None else math.prod(axis_sizes[a] for a in
                                         ((e,) if isinstance(e, str) else e))
  candidates = [(split(entries[d]) > 1, -(shape[d] // split(entries[d])), d)
                for d in range(len(shape)) if shape[d] % (split(entries[d]) * ways) == 0]
  if not candidates:
    return spec
  _, _, d = min(candidates)
  e = entries[d]
  entries[d] = (axes[0] if len(axes) == 1 else axes) if e is None else (
      ((e,) if isinstance(e, str) else tuple(e)) + axes)
  return PartitionSpec(*entries)


def zero_shardings(abstract_params: Any, param_shardings: Any, mesh: Mesh,
                   rules=DEFAULT_RULES) -> Any:
  """NamedSharding per param of its optimizer-update shard under ZeRO: the param's own
  sharding further split over the batch's mesh axes (zero_spec), so that each
  data-parallel device holds and updates 1 / N of the moments (and, at stage 2, of the
  gradients: a reduce-scatter and an all-gather replace the all-reduce)."""
  sizes = dict(mesh.shape)
  free = batch_mesh_axes(mesh.axis_names, rules)
  return jax.tree.map(
      lambda p, s: NamedSharding(mesh, zero_spec(tuple(p.shape), s.spec, sizes, free)),
      abstract_params, param_shardings)
