"""XLA flags for NVIDIA GPUs, set by the `t5x-like` command before jax starts.

  env = with_gpu_flags(os.environ, gpu_present=True)   # XLA_FLAGS gains the kept flags
  nvidia_gpu_present()   # PCI vendor 0x10de or /dev/nvidia0, ... (no jax import)

JAX's GPU performance guide (docs.jax.dev, "GPU performance tips") and NVIDIA's JAX
images recommend flags that XLA does not set by default. A flag is in KEPT only where
a measurement says it helps (docs/speed.md); CANDIDATES are the others of the
guide, measured by `launch/gpu_bench.sh` (each variant with its profile table) before
they may move to KEPT.

A flag the user already names in XLA_FLAGS is left as the user set it.
T5X_LIKE_GPU_XLA_FLAGS overrides the list: "none" sets nothing, "candidates" sets KEPT
and CANDIDATES, anything else is taken as the flags to set (space separated).

A GPU is detected without jax (which must not start before XLA_FLAGS is final): by its
PCI vendor, as jax's hardware_utils does, or by its device files, which a container
passes in even where it hides /sys.
"""

from __future__ import annotations

import glob
import os
from typing import Mapping

PCI_DEVICES = "/sys/bus/pci/devices"
NVIDIA_PCI_VENDOR = "0x10de"

# flag -> the measured gain that keeps it (docs/speed.md). Empty: no GPU profile
# has shown a gain yet, so a GPU run gets XLA's own defaults unless
# T5X_LIKE_GPU_XLA_FLAGS asks for more; `launch/gpu_bench.sh`'s gpt2_flags_candidates /
# gpt2_flags_none pair is the measurement that may move a candidate here.
KEPT: dict[str, str] = {}

# flag -> what it is expected to change; not set until a GPU profile shows a gain.
CANDIDATES: dict[str, str] = {
    # NVIDIA's JAX images set it by default (JAX-Toolbox, "Environment Variables"). It
    # only moves collectives, so a one-GPU step has nothing to reorder: unmeasured here.
    "--xla_gpu_enable_latency_hiding_scheduler=true":
        "overlaps collectives with compute (NVIDIA's JAX images set it)",
    "--xla_gpu_triton_gemm_any=true":
        "Triton GEMMs for every matmul it supports (fusing the epilogue), not only cuBLAS",
}

ENV = "T5X_LIKE_GPU_XLA_FLAGS"


def flag_name(flag: str) -> str:
  """'--xla_gpu_x=true' -> '--xla_gpu_x'."""
  return flag.split("=", 1)[0]


def chosen_flags(env: Mapping[str, str]) -> list[str]:
  """The flags to set on a GPU: KEPT, or what T5X_LIKE_GPU_XLA_FLAGS says."""
  choice = env.get(ENV, "").strip()
  if not choice:
    return list(KEPT)
  if choice == "none":
    return []
  if choice == "candidates":
    return [*KEPT, *CANDIDATES]
  return choice.split()


def with_gpu_flags(env: Mapping[str, str], *, gpu_present: bool) -> dict[str, str]:
  """A copy of env whose XLA_FLAGS carries the chosen GPU flags (where a GPU is
  present), each unless XLA_FLAGS already names it."""
  out = dict(env)
  if not gpu_present:
    return out
  current = out.get("XLA_FLAGS", "").split()
  named = {flag_name(f) for f in current}
  added = [f for f in chosen_flags(env) if flag_name(f) not in named]
  if added:
    out["XLA_FLAGS"] = " ".join([*current, *added])
  return out


# ----------------------------------------------------------------- detection
def pci_vendor_present(vendor: str, pci_root: str = PCI_DEVICES) -> bool:
  """Whether a PCI device of `vendor` ('0x10de': NVIDIA, '0x1ae0': Google's TPUs) is
  listed under pci_root (each device a folder with a `vendor` file)."""
  try:
    names = os.listdir(pci_root)
  except OSError:
    return False
  for name in names:
    try:
      with open(os.path.join(pci_root, name, "vendor")) as f:
        if f.read().strip() == vendor:
          return True
    except OSError:
      continue
  return False


def nvidia_gpu_present(pci_root: str = PCI_DEVICES, dev_root: str = "/dev") -> bool:
  """An NVIDIA GPU on this host: PCI vendor 0x10de under pci_root, or a GPU device file
  dev_root/nvidia0, nvidia1, ... (not nvidiactl or nvidia-uvm, which the driver makes
  without a GPU)."""
  return (pci_vendor_present(NVIDIA_PCI_VENDOR, pci_root)
          or bool(glob.glob(os.path.join(glob.escape(dev_root), "nvidia[0-9]*"))))
