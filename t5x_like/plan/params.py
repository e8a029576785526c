"""Parameters by group (embeddings, attention, mlp, norms, heads), their logical axes,
the PartitionSpec training gives them on a mesh, and their bytes per device.

  table = param_table(model, mesh, rules, batch_shapes)
  table.total == model.num_params(); table.groups["attention"].rows[...]

Specs come from parallel.param_shardings (the model's logical axis names through the
rule list), the same call create_train_state makes, evaluated on an AbstractMesh so
that no device is needed.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import PartitionSpec

from t5x_like import parallel

GROUPS = ("embeddings", "attention", "mlp", "norms", "heads")
_HEAD_MODULES = ("mlm_transform", "mlm_norm", "mlm_bias", "pooler", "nsp", "logits_dense")


def param_group(path: tuple[str, ...]) -> str:
  """The group of the param at `path` (module names..., leaf name).

  heads: BERT's MLM transform / norm / bias, pooler, NSP classifier, untied logits;
  norms: every other LayerNorm / RMSNorm; attention: self / cross attention and T5's
  relative position tables; mlp: the MLPs; embeddings: token, position, type tables.
  """
  if any(p in _HEAD_MODULES for p in path):
    return "heads"
  if any(p.endswith("norm") for p in path[:-1]):
    return "norms"
  if any("attention" in p or p == "relpos" for p in path):
    return "attention"
  if "mlp" in path:
    return "mlp"
  if any(p.endswith("embed") for p in path):
    return "embeddings"
  raise ValueError(f"param {'/'.join(path)} belongs to no group of {GROUPS}")


def shard_counts(shape: tuple[int, ...], spec: PartitionSpec,
                 mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
  """How many ways each dim of an array `shape` is split by `spec` on a mesh of
  `mesh_shape` ({axis: size})."""
  entries = tuple(spec) + (None,) * (len(shape) - len(spec))
  def ways(entry):
    if entry is None:
      return 1
    return math.prod(mesh_shape[n] for n in ((entry,) if isinstance(entry, str) else entry))
  return tuple(ways(e) for e in entries)


def shard_shape(shape: tuple[int, ...], spec: PartitionSpec,
                mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
  """The per-device block of an array `shape` sharded as `spec`: ceil(dim / shards) per
  dim (XLA pads an uneven split, so the largest block is what a device holds)."""
  return tuple(-(-dim // n) for dim, n in zip(shape, shard_counts(shape, spec, mesh_shape)))


def spec_str(spec: PartitionSpec) -> str:
  """P('fsdp', None) -> "P('fsdp', None)"; the replicated P() -> 'P()'."""
  return "P(" + ", ".join(repr(e) if e is None or isinstance(e, str) else repr(tuple(e))
                          for e in spec) + ")"


@dataclasses.dataclass
class ParamRow:
  """Params that share a name up to the layer index (`layers_*`), shape, axes and spec."""

  name: str  # e.g. encoder/layers_*/self_attention/query/kernel
  shape: tuple[int, ...]
  logical_axes: tuple
  spec: PartitionSpec
  count: int  # how many params match (layers)
  shards: tuple[int, ...]  # ways each dim is split

  @property
  def shard_shape(self) -> tuple[int, ...]:
    return tuple(-(-d // n) for d, n in zip(self.shape, self.shards))

  @property
  def params(self) -> int:
    return self.count * math.prod(self.shape)

  @property
  def bytes_per_device(self) -> int:  # float32
    return 4 * self.count * math.prod(self.shard_shape)

  @property
  def uneven(self) -> bool:
    """A dim does not divide by its shards (XLA pads it)."""
    return any(d % n for d, n in zip(self.shape, self.shards))

  def to_json(self) -> dict:
    return {"name": self.name, "shape": list(self.shape), "count": self.count,
            "params": self.params, "logical_axes": list(self.logical_axes),
            "spec": spec_str(self.spec), "shard_shape": list(self.shard_shape),
            "bytes_per_device": self.bytes_per_device}


@dataclasses.dataclass
class ParamGroup:
  name: str
  rows: list[ParamRow] = dataclasses.field(default_factory=list)

  @property
  def params(self) -> int:
    return sum(r.params for r in self.rows)

  @property
  def bytes_per_device(self) -> int:
    return sum(r.bytes_per_device for r in self.rows)


@dataclasses.dataclass
class ParamTable:
  """All params by group; `shardings` is the tree of NamedShardings training uses."""

  groups: dict[str, ParamGroup]
  abstract_params: Any
  shardings: Any

  @property
  def total(self) -> int:
    return sum(g.params for g in self.groups.values())

  @property
  def bytes_per_device(self) -> int:
    return sum(g.bytes_per_device for g in self.groups.values())


def param_table(model, mesh, rules, batch_shapes: Mapping[str, tuple]) -> ParamTable:
  """Every parameter of `model` with its group, logical axes and spec on `mesh` (a Mesh
  or AbstractMesh)."""
  abstract = model.param_shapes(batch_shapes)
  logical = model.param_axes(batch_shapes)
  shardings = parallel.param_shardings(model, mesh, rules, batch_shapes)
  mesh_shape = dict(mesh.shape)
  is_spec = lambda x: isinstance(x, PartitionSpec)
  groups = {g: ParamGroup(g) for g in GROUPS}
  rows: dict[tuple, ParamRow] = {}
  for (path, leaf), axes, sharding in zip(jax.tree_util.tree_leaves_with_path(abstract),
                                          jax.tree.leaves(logical, is_leaf=is_spec),
                                          jax.tree.leaves(shardings)):
    path_name = jax.tree_util.keystr(path, simple=True, separator="/")
    name = re.sub(r"layers_\d+", "layers_*", path_name)
    shape = tuple(int(d) for d in leaf.shape)
    axes = tuple(axes) + (None,) * (len(shape) - len(axes))
    key = (name, shape, axes, sharding.spec)
    row = rows.get(key)
    if row is None:
      row = rows[key] = ParamRow(name, shape, axes, sharding.spec, 0,
                                 shard_counts(shape, sharding.spec, mesh_shape))
      groups[param_group(tuple(path_name.split("/")))].rows.append(row)
    row.count += 1
  return ParamTable(groups, abstract, shardings)


def tree_bytes_per_device(abstract: Any, shardings: Any, mesh_shape: Mapping[str, int]) -> int:
  """Sum over leaves of the per-device block's bytes (abstract: ShapeDtypeStructs)."""
  total = 0
  for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
    block = shard_shape(tuple(leaf.shape), sharding.spec, mesh_shape)
    total += math.prod(block) * np.dtype(leaf.dtype).itemsize
  return total
