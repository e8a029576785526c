"""Topologies (how many devices of which kind) and the mesh a config plans on one.

  topology = parse_topology("v3-32")       # 32 JAX devices (cores) on 4 hosts
  mesh = planned_mesh(config.mesh, topology.num_devices)   # an AbstractMesh

A JAX device is one TensorCore on TPU v2/v3 and TPU7x (two per chip) and one chip on
v4/v5p (megacore) and v5e/v6e (one TensorCore). Slice names count TensorCores for
v2/v3/v4/v5p/tpu7x (v4-64 = 32 chips, tpu7x-8 = 4 chips) and chips for v5e/v6e, as Cloud
TPU names them. Nothing here needs the devices to exist.
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
  """One accelerator generation: how its slice names count and what a device holds.

  hbm_bandwidth, ici_bandwidth: bytes/s of one JAX device (a TensorCore on v2/v3 and
  TPU7x, half a chip's) to its HBM and over the interconnect (ICI; NVLink on GPUs) in
  one direction, all links together; for plan/roofline.py. 0: unknown.
  """

  device_kind: str  # as jax reports it: looks up the peak in train/flops.py
  platform: str  # tpu | gpu | cpu
  memory_bytes: int  # HBM per JAX device
  devices_per_host: int
  cores_per_device: int  # slice-name units per JAX device (v4-64 -> 64 / 2 = 32 devices)
  hbm_bandwidth: float = 0.0
  ici_bandwidth: float = 0.0


GB = 10**9
# Bandwidths per chip from the vendors' spec sheets (one JAX device on TPU v2/v3 is half
# a chip: the two TensorCores share its HBM and links):
#   v2, v3: Jouppi et al., "A domain-specific supercomputer for training deep neural
#     networks", CACM 63(7), 2020, Table 3: HBM 700 / 900 GB/s; 4 ICI links of 496 /
#     656 Gbit/s per chip.
#   v4: cloud.google.com/tpu/docs/v4: HBM2 1200 GBps; 6 ICI links, 2400 Gbps per chip
#     (Jouppi et al., "TPU v4", ISCA 2023).
#   v5e: cloud.google.com/tpu/docs/v5e: HBM2 819 GBps; Interchip Interconnect BW 1600 Gbps.
#   v5p: cloud.google.com/tpu/docs/v5p: HBM2e 2765 GBps; Interchip Interconnect BW 4800 Gbps.
#   v6e: cloud.google.com/tpu/docs/v6e: HBM 1640 GBps; ICI bandwidth 3584 Gbps.
#   A100 SXM 80GB: NVIDIA A100 datasheet: HBM2e 2,039 GB/s; NVLink 600 GB/s (both
#     directions, so 300 one way).
#   H100 SXM: NVIDIA H100 datasheet: HBM3 3.35 TB/s; NVLink 900 GB/s (450 one way).
#   H200 SXM: NVIDIA H200 datasheet: HBM3e 4.8 TB/s, 141 GB; NVLink 900 GB/s.
#   TPU7x (Ironwood): docs.cloud.google.com/tpu/docs/tpu7x ("TPU7x (Ironwood)", System
#     architecture table), per chip: peak BF16 2307 TFLOPs (FP8 4614), HBM 192 GiB,
#     HBM bandwidth 7380 GB/s, 2 TensorCores (and 4 SparseCores), bidirectional ICI
#     1200 GB/s (600 one way), 4 chips per VM. Each TensorCore is its own JAX device (the
#     page's "Dual-chiplet architecture": the programming model gives "two TPU devices"
#     per chip, not one megacore; libtpu's tpu7x:2x2x1 has 8 devices, device_kind
#     'TPU7x', one core each), so a device gets half of each:
#     1153.5 TFLOP/s, 96 GiB, 3690 GB/s, 300 GB/s one way; 8 devices per host. Slice
#     names count TensorCores: tpu7x-8 is 2x2x1 (4 chips), as in Google's xpk
#     (AI-Hypercomputer/xpk src/xpk/core/system_characteristics.py: device_type
#     f"tpu7x-{chips * 2}" for topology 2x2x1 ..., 4 chips per VM).
FAMILIES = {
    "v2": Family("TPU v2", "tpu", 8 * GiB, 8, 1, 700 * GB / 2, 4 * 496e9 / 8 / 2),
    "v3": Family("TPU v3", "tpu", 16 * GiB, 8, 1, 900 * GB / 2, 4 * 656e9 / 8 / 2),
    "v4": Family("TPU v4", "tpu", 32 * GiB, 4, 2, 1200 * GB, 2400e9 / 8),
    "v5e": Family("TPU v5 lite", "tpu", 16 * GiB, 4, 1, 819 * GB, 1600e9 / 8),
    "v5p": Family("TPU v5p", "tpu", 95 * GiB, 4, 2, 2765 * GB, 4800e9 / 8),
    "v6e": Family("TPU v6 lite", "tpu", 32 * GiB, 4, 1, 1640 * GB, 3584e9 / 8),
    "tpu7x": Family("TPU7x", "tpu", 192 * GiB // 2, 8, 1, 7380 * GB / 2, 1200 * GB / 2 / 2),
    "a100": Family("A100", "gpu", 80 * 10**9, 8, 1, 2039 * GB, 300 * GB),
    "h100": Family("H100", "gpu", 80 * 10**9, 8, 1, 3350 * GB, 450 * GB),
    "h200": Family("H200", "gpu", 141 * 10**9, 8, 1, 4800 * GB, 450 * GB),
    "cpu": Family("cpu", "cpu", 0, 0, 1),  # memory and peak: of this host, measured
}
EXAMPLES = ("v3-32", "v3-128", "v4-64", "v5p-128", "v5e-16", "tpu7x-64", "2xv5e-16", "cpu-8")


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
  hbm_bandwidth: float = 0.0  # bytes/s per device (Family's; 0: unknown, as on CPU)
  ici_bandwidth: float = 0.0

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
          f" v4, v5p, tpu7x; chips for v5e, v6e; GPUs for a100, h100, h200; devices for cpu),"
          f" and K slices of a TPU one as Kx<family>-<N>, e.g."
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
                  hosts * slices, peak, family.memory_bytes, slices, family.hbm_bandwidth,
                  family.ici_bandwidth)


def family_of(device_kind: str) -> Family | None:
  """The Family whose device_kind names `device_kind` ('TPU v5 lite', 'NVIDIA H100 80GB
  HBM3'), longest name first; None for an unknown one."""
  for family in sorted(FAMILIES.values(), key=lambda f: -len(f.device_kind)):
    if family.platform != "cpu" and family.device_kind.lower() in device_kind.lower():
      return family
  if "tpu v5" in device_kind.lower():  # v5p devices report 'TPU v5'
    return FAMILIES["v5p"]
  return None


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
  family = family_of(device.device_kind) if device.platform != "cpu" else None
  return Topology(f"{len(devices)} x {device.device_kind}", device.platform,
                  device.device_kind, len(devices), jax.process_count(),
                  flops_lib.peak_flops_per_device(device, dtype), memory,
                  hbm_bandwidth=family.hbm_bandwidth if family else 0.0,
                  ici_bandwidth=family.ici_bandwidth if family else 0.0)


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
