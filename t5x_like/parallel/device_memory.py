"""How much memory one local device has: the figure a config's activations are checked
against (train/config_check.py) and that model.remat_policy="auto" must fit
(plan/remat.py).

  local_device_memory()   # 80 GiB on an H100, the host's RAM / 8 with 8 fake CPU devices
"""

from __future__ import annotations

import os
from typing import Optional

import jax


def local_device_memory() -> Optional[int]:
  """Bytes of memory of one local device: the accelerator's limit, or on CPU the host's
  physical memory shared by the local (fake) devices; None when unknown."""
  device = jax.local_devices()[0]
  stats = device.memory_stats() if device.platform != "cpu" else None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  try:
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None
  return host // jax.local_device_count()
