"""Device mesh construction: named axes sized from a config, -1 meaning "the rest"."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Mapping, Optional, Sequence, Union

import flax.linen as nn
import jax
from jax.sharding import AxisType, Mesh

from t5x_like.parallel.rules import DEFAULT_RULES, rules_for_mesh

AxisSizes = Union[Mapping[str, int], Sequence[tuple[str, int]]]


def resolve_axis_sizes(axis_sizes: AxisSizes, num_devices: int) -> dict[str, int]:
  """{name: size} with one -1 replaced so that the sizes multiply to num_devices.

  Raises ValueError (naming the axes and the device count) when that is impossible.
  """
  items = list(axis_sizes.items() if isinstance(axis_sizes, Mapping) else axis_sizes)
  names = [str(n) for n, _ in items]
  sizes = [int(s) for _, s in items]
  if not items:
    raise ValueError("make_mesh: no mesh axes given")
  if len(set(names)) != len(names):
    raise ValueError(f"make_mesh: duplicate mesh axis names in {names}")
  shown = dict(zip(names, sizes))
  if sizes.count(-1) > 1:
    raise ValueError(f"make_mesh: at most one axis may be -1, got {shown}")
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"make_mesh: axis sizes must be positive or -1, got {shown}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(f"make_mesh: axes {shown} cannot fill {num_devices} devices: the fixed"
                       f" sizes multiply to {known}, which does not divide {num_devices}")
    sizes[sizes.index(-1)] = num_devices // known
  elif known != num_devices:
    raise ValueError(f"make_mesh: axes {shown} multiply to {known} devices, but there are"
                     f" {num_devices} devices; use -1 for one axis to fill the rest")
  return dict(zip(names, sizes))


def make_mesh(axis_sizes: AxisSizes, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A Mesh over `devices` (default: all) with Auto axis types.

  axis_sizes: {'data': -1, 'fsdp': 2, 'tensor': 1} or [('data', -1), ('model', 2)].
  Auto (not Explicit) axes are what Flax linen's logical partitioning expects.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = resolve_axis_sizes(axis_sizes, len(devices))
  return jax.make_mesh(tuple(sizes.values()), tuple(sizes),
                       axis_types=(AxisType.Auto,) * len(sizes), devices=devices)


@contextlib.contextmanager
def mesh_rules(mesh: Mesh, rules=DEFAULT_RULES) -> Iterator[tuple]:
  """Context: `mesh` set globally and `rules` (restricted to it) active for Flax.

  Inside it `nn.with_logical_constraint` in the models shards activations under jit.
  Yields the restricted rules.
  """
  restricted = rules_for_mesh(rules, mesh.axis_names)
  with jax.set_mesh(mesh), nn.logical_axis_rules(restricted):
    yield restricted


@contextlib.contextmanager
def traced_rules(mesh: Optional[Mesh], rules=DEFAULT_RULES) -> Iterator[None]:
  """mesh_rules for use while tracing under jit (where jax.set_mesh is refused): the
  mesh as the abstract mesh and the rules restricted to it; nothing without a mesh."""
  if mesh is None:
    yield
    return
  restricted = rules_for_mesh(rules, mesh.axis_names)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(restricted):
    yield


MESH_AXES = ("data", "fsdp", "tensor")


def config_axis_sizes(mesh_cfg, num_devices: int) -> tuple[dict[str, int], dict[str, int]]:
  """(within-slice sizes, slice counts) of the ('data', 'fsdp', 'tensor') axes of a
  config's `mesh` section over `num_devices`, without devices (a pod's mesh can be
  checked on a laptop). ValueError naming the mesh keys when they cannot fill them."""
  dcn = {a: int(mesh_cfg.get(f"dcn_{a}", 1)) for a in MESH_AXES}
  bad = {a: n for a, n in dcn.items() if n < 1}
  if bad:
    raise ValueError(f"mesh.dcn_{next(iter(bad))}={next(iter(bad.values()))}: must be >= 1")
  num_slices = math.prod(dcn.values())
  if num_devices % num_slices:
    raise ValueError(f"mesh.dcn_*={dcn} multiply to {num_slices} slices, which does not"
                     f" divide the {num_devices} devices")
  ici = {a: int(mesh_cfg.get(a, 1)) for a in MESH_AXES}
  fixed = math.prod(s for s in ici.values() if s != -1)
  if -1 not in ici.values() and fixed * num_slices > num_devices:
    raise ValueError(f"mesh.data x mesh.fsdp x mesh.tensor = {fixed * num_slices} devices"
                     f" ({ici}, {num_slices} slice(s)) but only {num_devices} are present;"
                     " set one axis to -1 to fill the devices")
  try:
    return resolve_axis_sizes(ici, num_devices // num_slices), dcn
  except ValueError as e:
    raise ValueError(f"mesh.data / mesh.fsdp / mesh.tensor: {e}") from None


def mesh_from_config(mesh_cfg, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """The ('data', 'fsdp', 'tensor') mesh of a config's `mesh` section.

  mesh_cfg.<axis> sizes an axis within a slice (-1: the rest); mesh_cfg.dcn_<axis>
  splits it across slices (multi-slice TPU: the slow data-center network carries
  only those axes). Each mesh axis has size <axis> * dcn_<axis>.
  """
  devices = list(jax.devices() if devices is None else devices)
  ici, dcn = config_axis_sizes(mesh_cfg, len(devices))
  if math.prod(dcn.values()) == 1:
    return make_mesh(ici, devices)
  from jax.experimental import mesh_utils
  array = mesh_utils.create_hybrid_device_mesh(tuple(ici.values()), tuple(dcn.values()),
                                               devices=devices)
  return Mesh(array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
