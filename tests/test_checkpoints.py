"""Checkpointer: sharded round trips, other meshes, keep-K, async, corrupt-step fallback."""

import gc
import json
import logging
import os
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from t5x_like import parallel
from t5x_like.checkpoint import (Checkpointer, CorruptCheckpointError,
                                 IncompatibleCheckpointError)

from helpers import xla_flags

# A failed tensorstore read leaves orbax coroutines unawaited; they warn when collected,
# so collect them inside each test, where this filter applies.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(autouse=True)
def _collect_garbage():
  yield
  gc.collect()


@struct.dataclass
class State:  # the shape of a train state: step, params, optax state (namedtuples inside)
  step: jax.Array
  params: dict
  opt_state: optax.OptState


def _specs(tree):
  """w [64, 128] over (data, model), b [128] over model, scalars replicated."""
  return jax.tree.map(lambda x: P(*("data", "model")[-x.ndim:]) if x.ndim else P(), tree)


def _shardings(tree, target):
  if isinstance(target, jax.Device):
    return jax.tree.map(lambda _: SingleDeviceSharding(target), tree)
  return jax.tree.map(lambda s: NamedSharding(target, s), _specs(tree),
                      is_leaf=lambda s: isinstance(s, P))


def make_state(step, target):
  """A State whose every value depends on `step`, placed on `target` (mesh or device)."""
  # Big enough (32 KiB) that ocdbt keeps w in a data file rather than inline in its index.
  params = {"w": jnp.arange(64 * 128.0).reshape(64, 128) / 7 + step,
            "b": jnp.full(128, -step, jnp.float32)}
  state = State(jnp.int32(step), params, optax.adamw(1e-3).init(params))
  state = state.replace(opt_state=jax.tree.map(lambda x: x + step, state.opt_state))
  return jax.device_put(state, _shardings(state, target))


def abstract_for(target):
  shapes = jax.eval_shape(lambda: make_state(0, jax.devices()[0]))
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      shapes, _shardings(shapes, target))


def assert_state_equal(got, want, target):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w, s in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                     jax.tree.leaves(_shardings(want, target))):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert g.dtype == w.dtype
    assert g.sharding.is_equivalent_to(s, g.ndim), (g.sharding, s)


@pytest.fixture(scope="module")
def mesh42():
  return parallel.make_mesh({"data": 4, "model": 2})


def test_round_trip_keeps_values_shardings_and_extra(tmp_path, mesh42):
  extra = {"data": {"next_index": 17, "seed": 3}, "config_hash": "abc123"}
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    assert ckpt.restore_latest(abstract_for(mesh42)) is None
    assert ckpt.save(10, make_state(10, mesh42), extra)
    assert ckpt.latest_step() == 10 and ckpt.all_steps() == [10]
  ckpt = Checkpointer(tmp_path)
  step, state, got_extra = ckpt.restore_latest(abstract_for(mesh42))
  assert step == 10 and got_extra == extra
  assert_state_equal(state, make_state(10, mesh42), mesh42)
  # w is really split 4 x 2: each device holds a [16, 64] block
  assert state.params["w"].addressable_shards[0].data.shape == (16, 64)
  ckpt.close()


@pytest.mark.parametrize("target", ["2x4", "8x1", "one_device"])
def test_restore_onto_another_mesh(tmp_path, mesh42, target):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(3, make_state(3, mesh42), {})
  dest = (jax.devices()[5] if target == "one_device" else
          parallel.make_mesh({"data": int(target[0]), "model": int(target[2])}))
  with Checkpointer(tmp_path) as ckpt:
    step, state, _ = ckpt.restore(3, abstract_for(dest))
  assert step == 3
  assert_state_equal(state, make_state(3, dest), dest)
  if target == "one_device":
    assert state.params["w"].devices() == {jax.devices()[5]}
  else:
    rows, cols = int(target[0]), int(target[2])
    assert state.params["w"].addressable_shards[0].data.shape == (64 // rows, 128 // cols)


def test_keep_two_keeps_the_last_two(tmp_path, mesh42):
  with Checkpointer(tmp_path, keep=2) as ckpt:
    for step in (1, 2, 3, 4):
      assert ckpt.save(step, make_state(step, mesh42), {"step": step})
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4]
  assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["3", "4"]
  with Checkpointer(tmp_path, keep=2) as ckpt:
    assert ckpt.restore_latest(abstract_for(mesh42)).extra == {"step": 4}


def test_async_save_survives_donation_and_wait_commits(tmp_path, mesh42):
  ckpt = Checkpointer(tmp_path, async_save=True)
  state = make_state(5, mesh42)
  assert ckpt.save(5, state, {"k": 1})
  for leaf in jax.tree.leaves(state):  # what a donating train step does to the buffers
    leaf.delete()
  ckpt.wait()
  assert (tmp_path / "5" / "commit_success.txt").exists()
  assert not ckpt.save(5, make_state(5, mesh42), {"k": 2})  # already on disk: not redone
  ckpt.close()
  with Checkpointer(tmp_path) as again:
    step, restored, extra = again.restore_latest(abstract_for(mesh42))
  assert step == 5 and extra == {"k": 1}
  assert_state_equal(restored, make_state(5, mesh42), mesh42)


def test_extra_with_nested_iterator_state_round_trips(tmp_path, mesh42):
  grain_like = {"next_index": np.int64(4096), "epoch": 2,
                "workers": [{"last_seen_indices": {"0": 11, "1": -1}, "done": False}],
                "window": np.arange(3), "shuffle_seed": 1234567890123, "name": "mlm"}
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(7, make_state(7, mesh42), {"data": grain_like, "config_hash": "f00d", "lr": 1e-4})
  with Checkpointer(tmp_path) as ckpt:
    extra = ckpt.restore(7, abstract_for(mesh42)).extra
  assert extra == {"data": {"next_index": 4096, "epoch": 2,
                            "workers": [{"last_seen_indices": {"0": 11, "1": -1}, "done": False}],
                            "window": [0, 1, 2], "shuffle_seed": 1234567890123, "name": "mlm"},
                   "config_hash": "f00d", "lr": 1e-4}
  assert type(extra["data"]["next_index"]) is int


def _array_data_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
  """The ocdbt data files of the state item (holding w, mu and nu): one, or a few when
  orbax splits the write."""
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  assert files and sum(p.stat().st_size for p in files) > 10_000, files
  return files


def _truncate(step_dir):
  for data in _array_data_files(step_dir):
    os.truncate(data, data.stat().st_size // 2)


def _delete(step_dir):
  for data in _array_data_files(step_dir):
    data.unlink()


def _no_marker(step_dir):
  (step_dir / "commit_success.txt").unlink()


def _bad_json(step_dir):
  (step_dir / "extra" / "metadata").write_text('{"data": {"next_in')


@pytest.mark.parametrize("corrupt", [_truncate, _delete, _no_marker, _bad_json])
def test_corrupt_latest_falls_back_to_previous(tmp_path, mesh42, caplog, corrupt):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    for step in (1, 2, 3):
      ckpt.save(step, make_state(step, mesh42), {"step": step})
  corrupt(tmp_path / "3")
  ckpt = Checkpointer(tmp_path, async_save=False)
  with caplog.at_level(logging.WARNING, logger="t5x_like.checkpoint"):
    step, state, extra = ckpt.restore_latest(abstract_for(mesh42))
  assert step == 2 and extra == {"step": 2}
  assert_state_equal(state, make_state(2, mesh42), mesh42)
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert any("step 3" in m and "corrupt or partial" in m for m in warnings), warnings
  # Moved aside, not deleted, and out of the way of a new save of step 3.
  aside = [p.name for p in tmp_path.iterdir() if p.name.startswith("3.corrupt-")]
  assert len(aside) == 1 and not (tmp_path / "3").exists()
  assert ckpt.all_steps() == [1, 2]
  assert ckpt.save(3, make_state(30, mesh42), {"step": 30})
  assert ckpt.restore_latest(abstract_for(mesh42)).extra == {"step": 30}
  ckpt.close()


def test_only_partial_steps_gives_none(tmp_path, mesh42, caplog):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    for step in (1, 2):
      ckpt.save(step, make_state(step, mesh42), {})
  _no_marker(tmp_path / "2")
  _no_marker(tmp_path / "1")
  with Checkpointer(tmp_path) as ckpt, caplog.at_level(logging.WARNING):
    assert ckpt.restore_latest(abstract_for(mesh42)) is None
    assert ckpt.all_steps() == []
  assert "step 2" in caplog.text and "step 1" in caplog.text
  assert "commit_success.txt" in caplog.text


def test_nothing_readable_raises_and_moves_nothing(tmp_path, mesh42, caplog):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    for step in (1, 2):
      ckpt.save(step, make_state(step, mesh42), {})
  _delete(tmp_path / "2")
  _truncate(tmp_path / "1")
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(CorruptCheckpointError, match="step 2: .*step 1: "):
      ckpt.restore_latest(abstract_for(mesh42))
  # It might be the caller's fault (not the files'): nothing is renamed aside.
  assert sorted(p.name for p in tmp_path.iterdir() if "corrupt" in p.name) == []
  assert (tmp_path / "1").is_dir() and (tmp_path / "2").is_dir()


def test_unfinished_tmp_dir_is_ignored(tmp_path, mesh42, caplog):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    for step in (1, 2):
      ckpt.save(step, make_state(step, mesh42), {"step": step})
  # What a crash mid-save leaves: a tmp directory with part of step 3, never renamed.
  tmp = tmp_path / "3.orbax-checkpoint-tmp-1700000000000000"
  (tmp / "state").mkdir(parents=True)
  (tmp / "state" / "_METADATA").write_text("{")
  with caplog.at_level(logging.WARNING):
    ckpt = Checkpointer(tmp_path, async_save=False)
  assert tmp.name in caplog.text
  assert ckpt.latest_step() == 2 and ckpt.all_steps() == [1, 2]
  assert ckpt.restore_latest(abstract_for(mesh42)).step == 2
  assert ckpt.save(3, make_state(3, mesh42), {"step": 3})
  step, state, _ = ckpt.restore_latest(abstract_for(mesh42))
  assert step == 3
  assert_state_equal(state, make_state(3, mesh42), mesh42)
  assert tmp.exists()  # left for a human: it may belong to another live writer
  ckpt.close()


def test_changed_state_shape_raises_and_keeps_the_checkpoint(tmp_path, mesh42):
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, make_state(1, mesh42), {})
  abstract = abstract_for(mesh42)
  w = abstract.params["w"]
  wider = jax.ShapeDtypeStruct((8, 32), w.dtype, sharding=w.sharding)
  abstract = abstract.replace(params={**abstract.params, "w": wider})
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(IncompatibleCheckpointError, match="params.w"):
      ckpt.restore_latest(abstract)
  assert (tmp_path / "1" / "commit_success.txt").exists()


# -------------------------------------------------------------------- multi-host
_TWO_HOSTS = r'''
import json, os, pathlib, sys
pid, port, directory = int(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
import jax, numpy as np
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from t5x_like import parallel
from t5x_like.checkpoint import Checkpointer
mesh = parallel.make_mesh({"data": 4, "model": 2})
sharding = NamedSharding(mesh, P("data", "model"))
def state(step):
  w = np.arange(64 * 128, dtype=np.float32).reshape(64, 128) / 7 + step
  return {"w": jax.make_array_from_callback(w.shape, sharding, lambda i: w[i])}
abstract = {"w": jax.ShapeDtypeStruct((64, 128), np.float32, sharding=sharding)}
ckpt = Checkpointer(directory, keep=2)  # step 1 goes once step 3 is sealed on both hosts
for step in (1, 2, 3):
  ckpt.save(step, state(step), {"data": {"next": step}})
ckpt.wait()
multihost_utils.sync_global_devices("saved")
if pid == 0:  # only host 1 reads this file back: its shards of step 3 are lost
  data = max((directory / "3" / "state" / "ocdbt.process_1").rglob("*"),
             key=lambda p: p.stat().st_size if p.is_file() else 0)
  os.truncate(data, data.stat().st_size // 2)
multihost_utils.sync_global_devices("corrupted")
step, restored, extra = ckpt.restore_latest(abstract)
ok = all(np.array_equal(s.data, state(step)["w"].addressable_data(i))
         for i, s in enumerate(restored["w"].addressable_shards))
resaved = ckpt.save(3, state(30), {"data": {"next": 30}})
again = ckpt.restore_latest(abstract)
print("RESULT", json.dumps({"step": step, "extra": extra, "values_ok": bool(ok),
                            "resaved": resaved, "again": again.step}), flush=True)
ckpt.close()
'''


def test_two_hosts_agree_when_only_one_fails_to_read(tmp_path):
  """Host 1 cannot read step 3, host 0 can: both fall back to step 2, no deadlock."""
  script = tmp_path / "two_hosts.py"
  script.write_text(_TWO_HOSTS)
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  root = pathlib.Path(__file__).resolve().parent.parent
  env = {**os.environ, "XLA_FLAGS": xla_flags(4),
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root)}
  procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port),
                             str(tmp_path / "ckpt")], env=env, cwd=root, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for i in range(2)]
  try:
    outputs = [p.communicate(timeout=120)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  results = []
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
    results.append(json.loads(out.split("RESULT ", 1)[1].splitlines()[0]))
  for got in results:
    assert got == {"step": 2, "extra": {"data": {"next": 2}}, "values_ok": True,
                   "resaved": True, "again": 3}, got
  for out in outputs:  # both hosts name the file, whichever host hashed it
    assert "checkpoint step 3" in out and "corrupt or partial" in out
    assert "3/state/ocdbt.process_1/d/" in out and "size differs" in out
  directory = tmp_path / "ckpt"
  assert len(list(directory.glob("3.corrupt-*"))) == 1
  assert sorted(p.name for p in directory.iterdir() if p.name.isdigit()) == ["2", "3"]
  # Each host hashed the files it wrote; process 0 the shared ones too.
  listed = [json.loads((directory / "2" / f"checksums.process_{k}.json").read_text())["files"]
            for k in (0, 1)]
  assert listed[1] and all("process_1" in name for name in listed[1]), listed[1]
  assert not any("process_1" in name for name in listed[0])
  assert "commit_success.txt" in listed[0] and "state/ocdbt.process_0/manifest.ocdbt" in listed[0]
