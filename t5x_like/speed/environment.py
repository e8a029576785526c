"""What a benchmark ran on, recorded under "environment" in every `t5x-like bench` JSON.

  result["environment"] = environment()

A figure is only comparable with another taken with the same libraries, device and XLA
flags (the GPU flags of gpu_flags.py are set by the command, not by the user), so every
bench result carries them. The keys are fixed: drivers that collect bench JSONs read
them (jax, jaxlib, backend, device_kind, device_count, xla_flags, python, torch).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from typing import Optional


def environment() -> dict:
  """{jax, jaxlib: versions; backend: jax.default_backend(); device_kind of device 0;
  device_count: all devices; xla_flags: XLA_FLAGS as set now ("" if unset); python:
  its version; torch: its version, None where it is not installed or fails to import}.
  Starts jax's backend if it has not started."""
  import jax
  import jaxlib.version
  return {
      "jax": jax.__version__,
      "jaxlib": jaxlib.version.__version__,
      "backend": jax.default_backend(),
      "device_kind": jax.devices()[0].device_kind,
      "device_count": jax.device_count(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "python": platform.python_version(),
      "torch": torch_version(),
  }


def torch_version() -> Optional[str]:
  """torch.__version__, or None where torch is not installed or fails to import. torch
  is imported only where it is installed (its import takes seconds, and a broken
  install must not fail a JAX benchmark)."""
  module = sys.modules.get("torch")
  if module is None:
    if importlib.util.find_spec("torch") is None:
      return None
    try:
      import torch as module
    except Exception:  # noqa: BLE001  (a broken install: any error means "no torch")
      return None
  return getattr(module, "__version__", None)
