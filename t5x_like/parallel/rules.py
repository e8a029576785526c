"""Logical axis rules: which mesh axes each logical axis name is sharded over.

Every parameter and large activation of the models names its dims with logical
axes (models/layers.py); a rule list maps them to mesh axes. Flax reads the rules in
order of priority: for each dim the first rule whose mesh axes exist and are not
yet used by another dim of the same array wins; a dim without a rule is
replicated. So the activation [batch, length, embed] keeps embed unsharded when
batch already took 'fsdp', while the parameter [vocab, embed] shards embed over it.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

MeshAxes = Optional[Union[str, tuple[str, ...]]]
Rules = tuple[tuple[str, MeshAxes], ...]

# The tensor-parallel mesh axis is 'tensor' in this framework; 'model' is accepted
# as well (the usual name of a 2-D ('data', 'model') mesh). Rules name both and
# `rules_for_mesh` keeps whichever the mesh has.
TENSOR_AXES = ("tensor", "model")


def _tensor_parallel(name: str) -> Rules:
  return tuple((name, axis) for axis in TENSOR_AXES)


DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    *_tensor_parallel("vocab"),
    *_tensor_parallel("heads"),
    *_tensor_parallel("mlp"),
    ("embed", "fsdp"),
    ("kv_heads", None),
    ("kv", None),
    ("length", None),
    ("layers", None),
    ("abs_pos", None),
    ("types", None),
    ("relpos_buckets", None),
)

# Every logical axis name the models use (None dims are always replicated).
LOGICAL_AXES = ("batch", "length", "embed", "heads", "kv", "kv_heads", "mlp", "vocab",
                "layers", "abs_pos", "types", "relpos_buckets")


def rules_for_mesh(rules: Iterable[Sequence], mesh_axis_names: Sequence[str]) -> Rules:
  """`rules` restricted to the axes of a mesh.

  Mesh axes the mesh lacks are dropped from each rule; a rule left with no mesh axis
  is removed entirely (not turned into "replicated"), so that a later fallback rule
  for the same logical name still applies. Rules mapping to None are kept.
  A single remaining axis is returned as a plain string.
  """
  names = set(mesh_axis_names)
  out = []
  for logical, axes in rules:
    if axes is None:
      out.append((logical, None))
      continue
    kept = tuple(a for a in ((axes,) if isinstance(axes, str) else tuple(axes)) if a in names)
    if not kept:
      continue
    out.append((logical, kept[0] if len(kept) == 1 else kept))
  return tuple(out)
