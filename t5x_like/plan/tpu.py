"""TPU slices without TPUs: libtpu's topology descriptions, for compiling ahead of time
on a CPU host (deviceless AOT, as MaxText's train_compile.py does).

  devices = slice_devices(parse_topology("v5e-16"))   # 16 TPU v5 lite devices, no chips
  mesh = parallel.mesh_from_config(config.mesh, devices)

Needs libtpu (`pip install 't5x_like[tpu]'`); nothing runs on the devices, they are
only compile targets. Multi-slice topologies ('2xv5e-16') carry slice_index, so
mesh_from_config's hybrid (ICI x DCN) mesh works over them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import tempfile
from typing import Iterator

# Slice name (the N of <family>-N) -> libtpu topology, per family. v2/v3: N TensorCores
# = JAX devices (two per chip, a 2D torus of chips); v4/v5p: N TensorCores = N/2 chips
# of a 3D torus (megacore: one device per chip); v5e/v6e: N chips of a 2D torus; tpu7x:
# N TensorCores = JAX devices, N/2 chips of a 3D torus (two devices a chip, no megacore:
# libtpu's tpu7x:2x2x1 is 8 devices; it refuses 1x1x1, under a host's 2x2x1 chips).
_2D_CHIPS = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
             256: "16x16"}
_3D_CORES = {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4",
             256: "4x4x8", 512: "4x8x8"}
_V3_CORES = {8: "2x2", 32: "4x4", 128: "8x8", 256: "8x16", 512: "16x16"}
SLICES = {
    "v2": (_V3_CORES, {}),
    "v3": (_V3_CORES, {}),
    "v4": (_3D_CORES, {"chip_config_name": "megacore"}),
    "v5p": (_3D_CORES, {"chip_config_name": "megacore"}),
    "v5e": (_2D_CHIPS, {}),
    "v6e": (_2D_CHIPS, {}),
    "tpu7x": (_3D_CORES, {}),
}
EXTRA_HINT = "pip install 't5x_like[tpu]'"


def supported_slices() -> list[str]:
  """Every single-slice name slice_devices accepts: ['v2-8', ..., 'tpu7x-512']."""
  return [f"{family}-{n}" for family, (shapes, _) in SLICES.items() for n in shapes]


def libtpu_available() -> bool:
  """Whether libtpu can be imported (a helper, so tests can simulate its absence)."""
  return importlib.util.find_spec("libtpu") is not None


def libtpu_topology(name: str) -> tuple[str, dict, int]:
  """'2xv5e-16' -> ('v5e:4x4', {}, 2 slices); ValueError listing the supported names."""
  m = re.fullmatch(r"(?:(\d+)x)?([a-z0-9]+)-(\d+)", name.strip().lower())
  shapes, kwargs = SLICES.get(m.group(2), ({}, {})) if m else ({}, {})
  shape = shapes.get(int(m.group(3))) if m else None
  if shape is None:
    raise ValueError(f"no TPU slice {name!r} to compile for; supported:"
                     f" {', '.join(supported_slices())}, and K x any of them for K slices"
                     f" ('2xv5e-16')")
  return f"{m.group(2)}:{shape}", dict(kwargs), int(m.group(1) or 1)


def slice_devices(topology) -> list:
  """The JAX devices of a TPU topology (Topology or its name), as compile targets.

  ValueError when libtpu is missing (naming the extra) or the name has no slice.
  """
  name = getattr(topology, "name", topology)
  if not libtpu_available():
    raise ValueError(f"--compile for {name} needs libtpu: {EXTRA_HINT}")
  libtpu_name, kwargs, num_slices = libtpu_topology(name)
  if num_slices > 1:
    kwargs["num_slices"] = num_slices
  # libtpu holds a lock under /tmp for the process that loaded it; compiling only, any
  # number of processes (test workers, a second plan) may load it side by side.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies
  with _quiet_stderr():
    desc = topologies.get_topology_desc(topology_name=libtpu_name, platform="tpu", **kwargs)
  return list(desc.devices)


def quiet_backend_init() -> None:
  """Start JAX's backends with libtpu's no-TPU-here warnings muted. With libtpu installed
  on a host without TPUs, JAX's first device query tries the TPU plugin, which prints a
  screenful about missing TPU metadata before JAX falls back to CPU."""
  if libtpu_available():
    import jax
    with _quiet_stderr():
      jax.devices()


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
  """Mute fd 2 while libtpu loads: it warns that this host has no TPU metadata (worker
  hostnames, accelerator type), which is the point here. Replayed on an exception."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode="w+b") as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    except BaseException:
      os.dup2(saved, 2)
      captured.seek(0)
      sys.stderr.write(captured.read().decode(errors="replace"))
      raise
    finally:
      os.dup2(saved, 2)
      os.close(saved)
