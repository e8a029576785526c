"""Every test sees 8 fake CPU devices (set before jax is imported anywhere)."""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA compilation cache per test session, inherited by the subprocesses
# the tests start: the many runs of the same smoke configs compile each program once.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE_DIR = tempfile.mkdtemp(prefix="t5x_like_xla_cache_")
  atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.05")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402  (after XLA_FLAGS)

assert jax.device_count() == 8, jax.devices()
