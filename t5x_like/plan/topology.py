"""Topologies (how many devices of which kind) and the mesh a config plans on one.

  topology = parse_topology("v3-32")       # 32 JAX devices (cores) on 4 hosts
  mesh = planned_mesh(config.mesh, topology.num_devices)   # an AbstractMesh

A JAX device is one TensorCore on TPU v2/v3 (two per chip) and one chip from v4 on
(megacore). Slice names count TensorCores for v2/v3/v4/v5p (v4-64 = 32 chips) and
chips for v5e/v6e, as Cloud TPU names them. Nothing here needs the devices to exist.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import jax
from jax.sharding import AbstractMesh, AxisType

from t5x_like.parallel import MESH_AXES
from t5x_like.train.config_check import mesh_axis_sizes
from t5x_like.train import flops as flops_lib

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Family:
  """One accelerator generation: how its slice names count and what a device holds."""

  device_kind: str  # as jax reports it: looks up the peak in train/flops.py
  platform: str  # tpu | gpu | cpu
  memory_bytes: int  # HBM per JAX device
  devices_per_host: int
  cores_per_device: int  # slice-name units per JAX device (v4-64 -> 64 / 2 = 32 devices)


FAMILIES = {
    "v2": Family("TPU v2", "tpu", 8 * GiB, 8, 1),
    "v3": Family("TPU v3", "tpu", 16 * GiB, 8, 1),
    "v4": Family("TPU v4", "tpu", 32 * GiB, 4, 2),
    "v5e": Family("TPU v5 lite", "tpu", 16 * GiB, 4, 1),
    "v5p": Family("TPU v5p", "tpu", 95 * GiB, 4, 2),
    "v6e": Family("TPU v6 lite", "tpu", 32 * GiB, 4, 1),
    "a100": Family("A100", "gpu", 80 * 10**9, 8, 1),
    "h100": Family("H100", "gpu", 80 * 10**9, 8, 1),
    "cpu": Family("cpu", "cpu", 0, 0, 1),  # memory and peak: of this host, measured
}
EXAMPLES = ("v3-32", "v3-128", "v4-64", "v5p-128", "v5e-16", "2xv5e-16", "cpu-8")


@dataclasses.dataclass(frozen=True)
class Topology:
  """num_devices JAX devices of one kind on num_hosts hosts.

  peak_flops: dense bf16 FLOP/s of one device (train/flops.py's table; measured on CPU).
  memory_bytes: what one device can hold (HBM; host RAM / devices on CPU).
  """

  name: str
  platform: str
  device_kind: str
  num_devices: int
  num_hosts: int
  peak_flops: float
  memory_bytes: int
  num_slices: int = 1  # TPU multi-slice ('2xv5e-16'): slices joined by the data-center network

  def devices_present(self) -> bool:
    """Whether this process sees exactly these devices (then the step can be compiled)."""
    try:
      devices = jax.devices(self.platform)
    except RuntimeError:
      return False
    if len(devices) != self.num_devices:
      return False
    return self.platform == "cpu" or self.device_kind.lower() in devices[0].device_kind.lower()


def known_topologies() -> str:
  """The accepted name patterns, for error messages and --help."""
  return (f"<family>-<N> with family one of {sorted(FAMILIES)} (N = TensorCores for v2, v3,"
          f" v4, v5p; chips for v5e, v6e; GPUs for a100, h100; devices for cpu), and K"
          f" slices of a TPU one as Kx<family>-<N>, e.g."
          f" {', '.join(EXAMPLES)}")


def _host_memory_bytes() -> int:
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return 0


def _cpu_peak(num_devices: int, dtype: str) -> float:
  """Measured host matmul FLOP/s shared by `num_devices` fake devices."""
  return flops_lib.measure_matmul_flops("cpu", dtype) / num_devices


def parse_topology(name: str, dtype: str = "bfloat16") -> Topology:
  """'v3-32' -> Topology(num_devices=32, num_hosts=4, ...); ValueError lists the known ones.

  '2xv5e-16': two v5e-16 slices (32 devices, 8 hosts). dtype: the compute dtype, only
  for a CPU topology (whose peak is measured in it).
  """
  match = re.fullmatch(r"(?:(\d+)x)?([a-z0-9]+)-(\d+)", name.strip().lower())
  family = FAMILIES.get(match.group(2)) if match else None
  if family is None:
    raise ValueError(f"unknown topology {name!r}; known: {known_topologies()}")
  slices = int(match.group(1) or 1)
  if slices < 1 or (slices > 1 and family.platform != "tpu"):
    raise ValueError(f"topology {name!r}: K x<slice> is for TPU slices only")
  units = int(match.group(3))
  if units < 1 or units % family.cores_per_device:
    raise ValueError(f"topology {name!r}: {units} is not a multiple of"
                     f" {family.cores_per_device} cores per device")
  num_devices = units // family.cores_per_device
  if family.platform == "cpu":
    return Topology(name, "cpu", "cpu", num_devices, 1, _cpu_peak(num_devices, dtype),
                    _host_memory_bytes() // num_devices)
  peak = flops_lib.table_peak_flops(family.device_kind)
  if family.platform == "gpu" and dtype == "float32":
    peak /= 2  # TF32 tensor cores (see peak_flops_per_device)
  hosts = max(1, math.ceil(num_devices / family.devices_per_host))
  return Topology(name, family.platform, family.device_kind, num_devices * slices,
                  hosts * slices, peak, family.memory_bytes, slices)


def present_topology(dtype: str = "bfloat16") -> Topology:
  """The devices this process sees (all of them, every host)."""
  devices = jax.devices()
  device = devices[0]
  if device.platform == "cpu":
    local = len(jax.local_devices(backend="cpu"))
    memory = _host_memory_bytes() // local
  else:
    stats = device.memory_stats() or {}
    memory = int(stats.get("bytes_limit", 0))
  return Topology(f"{len(devices)} x {device.device_kind}", device.platform,
                  device.device_kind, len(devices), jax.process_count(),
                  flops_lib.peak_flops_per_device(device, dtype), memory)


def planned_mesh(mesh_cfg, num_devices: int) -> AbstractMesh:
  """The ('data', 'fsdp', 'tensor') mesh mesh_from_config would build on num_devices.

  Each axis is mesh.<axis> * mesh.dcn_<axis> (see parallel.mesh_from_config); raises
  ValueError naming the mesh keys when the sizes do not fit the devices.
  """
  shown = ", ".join([f"mesh.{a}={int(mesh_cfg.get(a, 1))}" for a in MESH_AXES] +
                    [f"mesh.dcn_{a}={int(mesh_cfg.get(f'dcn_{a}', 1))}" for a in MESH_AXES
                     if int(mesh_cfg.get(f"dcn_{a}", 1)) != 1])
  try:
    sizes = mesh_axis_sizes(mesh_cfg, num_devices)
  except ValueError as e:
    raise ValueError(f"the mesh ({shown}) does not fit {num_devices} devices: {e}") from None
  return AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                      axis_types=(AxisType.Auto,) * len(MESH_AXES))
