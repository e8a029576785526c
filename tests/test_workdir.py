"""The workdir: one trainer at a time (WorkdirLock, with real processes), and URL workdirs
(gs://) through gcsfs against a local GCS emulator (fake-gcs-server, from the test extra):
the lock, the metric files, and a whole train-and-resume run."""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import google_crc32c
import pytest
from tensorboardX.proto import event_pb2

from t5x_like import fs
from t5x_like.errors import UserError
from t5x_like.train import metrics as metrics_lib
from t5x_like.train.metrics import MetricWriter, read_jsonl
from t5x_like.train.workdir_lock import LOCK_NAME, WorkdirLock, WorkdirLockedError

from helpers import ROOT, xla_flags


# A contender: acquires (once the go file appears, if given: it says "ready" first),
# prints the outcome as one JSON line, then holds until stdin closes (hold=1), releases.
CONTENDER = r"""
import json, os, sys, time
from t5x_like import fs
from t5x_like.train.workdir_lock import WorkdirLock, WorkdirLockedError
workdir, heartbeat, stale, hold, go = sys.argv[1:6]
lock = WorkdirLock(workdir, heartbeat_seconds=float(heartbeat), stale_seconds=float(stale))
if go != "-":
  if fs.is_url(workdir):
    fs.fsspec_filesystem(workdir)  # gcsfs imported and set up before the start line
  print(json.dumps({"ready": True}), flush=True)
  while not os.path.exists(go):
    time.sleep(0.002)
start = time.monotonic()
try:
  lock.acquire()
except WorkdirLockedError as e:
  print(json.dumps({"locked": str(e), "seconds": time.monotonic() - start}), flush=True)
  sys.exit(2)
print(json.dumps({"acquired": True, "previous": lock.previous,
                  "seconds": time.monotonic() - start}), flush=True)
if hold == "1":
  sys.stdin.read()
lock.release()
"""


@pytest.fixture(params=["local", "gs"])
def workdir(request, tmp_path):
  """A fresh workdir: a local folder, or a prefix in the emulator's bucket."""
  if request.param == "local":
    return str(tmp_path / "run")
  request.getfixturevalue("gcs")
  return f"gs://bucket/{request.node.name.replace('[', '-').rstrip(']')}-{time.time_ns()}"


def _lock_path(workdir: str) -> str:
  return f"{workdir}/{LOCK_NAME}"


def _contender(workdir, *, hold=False, go="-", heartbeat=0.2, stale=30.0):
  return subprocess.Popen(
      [sys.executable, "-c", CONTENDER, workdir, str(heartbeat), str(stale),
       "1" if hold else "0", go], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)


def _outcome(proc) -> dict:
  line = proc.stdout.readline()
  assert line, proc.stderr.read()[-3000:]
  return json.loads(line)


# ------------------------------------------------------------------------ the lock
def test_second_process_is_refused_at_once_naming_the_holder(workdir):
  holder = _contender(workdir, hold=True)
  assert _outcome(holder)["acquired"]
  second = _contender(workdir)
  out = _outcome(second)
  assert second.wait(timeout=30) == 2
  assert out["seconds"] < 3.0  # refused, not waiting for anything
  message = out["locked"]
  assert f"process {holder.pid} on host {socket.gethostname()}" in message
  assert workdir in message and "started 20" in message and "--workdir" in message
  holder.stdin.close()
  assert holder.wait(timeout=30) == 0
  assert not fs.exists(_lock_path(workdir))  # released: nothing looks held
  third = _contender(workdir)  # release, then a new process acquires
  out = _outcome(third)
  assert out["acquired"] and out["previous"] is None  # a clean release leaves nothing
  assert third.wait(timeout=30) == 0


def test_lock_of_a_killed_holder_is_taken_over(workdir):
  holder = _contender(workdir, hold=True, stale=600)  # staleness by time is far off
  assert _outcome(holder)["acquired"]
  holder.send_signal(signal.SIGKILL)
  holder.wait(timeout=30)
  assert fs.exists(_lock_path(workdir))  # left behind by kill -9
  successor = _contender(workdir, stale=600)
  out = _outcome(successor)
  assert out["acquired"] and out["previous"]["pid"] == holder.pid
  assert out["seconds"] < 3.0
  assert successor.wait(timeout=30) == 0
  assert not fs.exists(_lock_path(workdir))


@pytest.mark.parametrize("stale_lock", [False, True])
def test_racing_processes_exactly_one_wins(workdir, tmp_path, stale_lock):
  """Four processes acquire at the same instant, on a free lock or on a stale one (a
  holder on another machine whose heartbeat stopped): exactly one gets it."""
  if stale_lock:
    fs.make_dirs(workdir)
    fs.write_bytes(_lock_path(workdir), json.dumps(
        {"pid": 1, "host": "elsewhere", "started": 0.0, "heartbeat": time.time() - 100,
         "token": "dead", "machine": "another-machine"}).encode())
  go = str(tmp_path / "go")
  procs = [_contender(workdir, hold=True, go=go, stale=10) for _ in range(4)]
  assert all(_outcome(proc) == {"ready": True} for proc in procs)
  open(go, "w").close()
  outs = []
  for proc in procs:
    outs.append(_outcome(proc))
    if "locked" in outs[-1]:
      assert proc.wait(timeout=30) == 2
  winners = [p for p, o in zip(procs, outs) if o.get("acquired")]
  assert len(winners) == 1, outs
  if stale_lock:
    assert [o for o in outs if o.get("acquired")][0]["previous"]["pid"] == 1
  assert all(f"process {winners[0].pid} " in o["locked"] for o in outs if "locked" in o)
  winners[0].stdin.close()
  assert winners[0].wait(timeout=30) == 0
  for proc in procs:
    if not proc.stdin.closed:
      proc.stdin.close()
    proc.wait(timeout=30)


def test_release_reacquire_and_release_on_exception(workdir):
  lock = WorkdirLock(workdir)
  with lock:
    assert lock.held and fs.exists(_lock_path(workdir))
    with pytest.raises(WorkdirLockedError):
      WorkdirLock(workdir).acquire()  # another holder in this very process, too
  assert not lock.held and not fs.exists(_lock_path(workdir))
  with pytest.raises(RuntimeError, match="boom"):
    with WorkdirLock(workdir):
      raise RuntimeError("boom")
  assert not fs.exists(_lock_path(workdir))
  with WorkdirLock(workdir) as again:  # re-acquire after release
    assert again.held and again.previous is None
  assert issubclass(WorkdirLockedError, UserError)


def test_disabled_lock_does_nothing(workdir):
  with WorkdirLock(workdir, enabled=False) as lock:
    assert not lock.held
    assert not fs.exists(_lock_path(workdir))
    with WorkdirLock(workdir):  # process 0 of the same run takes it
      pass


def test_lock_removes_the_workdir_it_created_if_left_empty(tmp_path):
  with WorkdirLock(tmp_path / "new"):
    assert os.listdir(tmp_path / "new") == [LOCK_NAME]
  assert not (tmp_path / "new").exists()  # a setup that failed leaves nothing
  with WorkdirLock(tmp_path / "kept"):
    (tmp_path / "kept" / "metrics.jsonl").write_text("")
  assert os.listdir(tmp_path / "kept") == ["metrics.jsonl"]


def test_heartbeat_refreshes_and_a_lost_lock_is_noticed(gcs, capfd):
  workdir = f"gs://bucket/heartbeat-{time.time_ns()}"
  lock = WorkdirLock(workdir, heartbeat_seconds=0.1, stale_seconds=5).acquire()
  first = json.loads(fs.read_bytes(_lock_path(workdir)))["heartbeat"]
  deadline = time.time() + 10
  while json.loads(fs.read_bytes(_lock_path(workdir)))["heartbeat"] == first:
    assert time.time() < deadline, "no heartbeat"
    time.sleep(0.05)
  # Another process took it over (as if this one had stalled past stale_seconds).
  other = {"pid": 7, "host": "other", "started": time.time(), "heartbeat": time.time(),
           "token": "theirs"}
  fs.write_bytes(_lock_path(workdir), json.dumps(other).encode())
  deadline = time.time() + 5
  while not lock.lost and time.time() < deadline:
    time.sleep(0.05)
  assert lock.lost
  with pytest.raises(RuntimeError, match="took over"):
    lock.check()
  lock.release()
  assert json.loads(fs.read_bytes(_lock_path(workdir)))["token"] == "theirs"  # untouched
  assert "lost the workdir lock" in capfd.readouterr().err


def test_fresh_lock_of_another_machine_is_refused_with_its_heartbeat(gcs):
  workdir = f"gs://bucket/foreign-{time.time_ns()}"
  holder = {"pid": 4242, "host": "tpu-vm-7", "started": time.time() - 3600,
            "heartbeat": time.time() - 20, "token": "t", "machine": "another-machine"}
  fs.write_bytes(_lock_path(workdir), json.dumps(holder).encode())
  with pytest.raises(WorkdirLockedError) as info:
    WorkdirLock(workdir, stale_seconds=90).acquire()
  message = str(info.value)
  assert "process 4242 on host tpu-vm-7" in message
  assert "heartbeat was 20 s ago" in message and "(in 70 s)" in message
  holder["heartbeat"] = time.time() - 100  # now stale: taken over
  fs.write_bytes(_lock_path(workdir), json.dumps(holder).encode())
  with WorkdirLock(workdir, stale_seconds=90) as lock:
    assert lock.previous["pid"] == 4242
  assert not fs.exists(_lock_path(workdir))


def test_local_filesystem_without_flock_uses_the_object_protocol(tmp_path, monkeypatch):
  import errno
  import fcntl

  def no_flock(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")

  monkeypatch.setattr(fcntl, "flock", no_flock)
  with WorkdirLock(tmp_path, heartbeat_seconds=0.1) as lock:
    assert lock._thread is not None  # the heartbeat protocol, on a local file
    with pytest.raises(WorkdirLockedError, match="heartbeat was 0 s ago"):
      WorkdirLock(tmp_path).acquire()
  assert os.listdir(tmp_path) == []


# ------------------------------------------------------------- metric files on gs://
def _events(data: bytes) -> list:
  """Events of one TFRecord event file, CRC-32C checked with google-crc32c."""
  def masked(b):
    crc = google_crc32c.value(b)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
  events, offset = [], 0
  while offset < len(data):
    header = data[offset:offset + 8]
    (length,) = struct.unpack("<Q", header)
    assert struct.unpack("<I", data[offset + 8:offset + 12])[0] == masked(header)
    payload = data[offset + 12:offset + 12 + length]
    assert struct.unpack("<I", data[offset + 12 + length:offset + 16 + length])[0] == masked(
        payload)
    events.append(event_pb2.Event.FromString(payload))
    offset += 16 + length
  return events


def _bucket_files(prefix: str) -> dict[str, bytes]:
  bucket = fs.fsspec_filesystem(prefix)
  bucket.invalidate_cache()
  return {p.split(prefix.split("://")[1] + "/", 1)[1]: bucket.cat_file(p)
          for p in bucket.find(prefix)}


def test_metric_writer_on_gs_writes_rows_and_events_and_no_local_folder(
    gcs, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  makedirs = os.makedirs
  monkeypatch.setattr(os, "makedirs", lambda path, *a, **k: (
      pytest.fail(f"os.makedirs({path!r})") if "gs:" in os.fspath(path)
      else makedirs(path, *a, **k)))
  workdir = f"gs://bucket/metrics-{time.time_ns()}"
  with MetricWriter(workdir, total_steps=6, console=False, remote_flush_seconds=0) as w:
    assert w.jsonl_path == f"{workdir}/metrics.jsonl"
    for step in range(1, 6):
      w.write_scalars(step, {"loss": 10.0 + step})
    assert [r["loss"] for r in read_jsonl(w.jsonl_path)] == [11.0, 12.0, 13.0, 14.0, 15.0]
  # Killed mid-write (a torn last line), resumed from the checkpoint of step 3.
  fs.write_bytes(f"{workdir}/metrics.jsonl",
                 fs.read_bytes(f"{workdir}/metrics.jsonl") + b'{"step": 6, "lo')
  with MetricWriter(workdir, total_steps=6, console=False, remote_flush_seconds=0) as w:
    w.truncate_after(3)
    assert [r["step"] for r in read_jsonl(w.jsonl_path)] == [1, 2, 3]
    for step in (4, 5, 6):
      w.write_scalars(step, {"loss": 20.0 + step})
  rows = read_jsonl(f"{workdir}/metrics.jsonl")
  assert [(r["step"], r["loss"]) for r in rows] == [
      (1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0), (5, 25.0), (6, 26.0)]
  files = _bucket_files(workdir)
  event_files = sorted(n for n in files if n.startswith("tensorboard/events.out.tfevents."))
  assert len(event_files) == 2 and set(files) == {"metrics.jsonl", *event_files}
  events = [e for n in event_files for e in _events(files[n])]
  scalars = [(e.step, v.simple_value) for e in events for v in e.summary.value]
  assert scalars == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 14.0), (5, 15.0), (4, 24.0),
                     (5, 25.0), (6, 26.0)]
  purges = [e.step for e in events if e.HasField("session_log")]
  assert purges == [4]  # TensorBoard hides the first run's steps >= 4
  assert os.listdir(tmp_path) == []


def test_metric_writer_on_gs_uploads_at_most_every_flush_interval(gcs, monkeypatch):
  workdir = f"gs://bucket/throttle-{time.time_ns()}"
  monkeypatch.setattr(metrics_lib, "REMOTE_EVENT_FILE_BYTES", 200)
  writer = MetricWriter(workdir, total_steps=9, console=False, remote_flush_seconds=3600)
  writer.write_scalars(1, {"loss": 1.0})  # the first write goes out at once
  for step in range(2, 6):
    writer.write_scalars(step, {"loss": float(step)})
  assert [r["step"] for r in read_jsonl(writer.jsonl_path)] == [1]
  writer.flush()
  assert [r["step"] for r in read_jsonl(writer.jsonl_path)] == [1, 2, 3, 4, 5]
  writer.write_scalars(6, {"loss": 6.0})
  writer.close()  # close flushes
  assert [r["step"] for r in read_jsonl(writer.jsonl_path)] == [1, 2, 3, 4, 5, 6]
  files = _bucket_files(workdir)
  event_files = sorted(n for n in files if n.startswith("tensorboard/"))
  assert len(event_files) == 2  # rolled over past the size limit
  steps = [e.step for n in event_files for e in _events(files[n]) if e.summary.value]
  assert sorted(steps) == [1, 2, 3, 4, 5, 6]


# ------------------------------------------------------------- a whole run on gs://
def _cli(workdir: str, *flags: str) -> list[str]:
  return [sys.executable, "-m", "t5x_like.cli", "train",
          f"--config={ROOT}/configs/gpt_cpu.py:smoke", f"--workdir={workdir}",
          "--config.optimizer.decay_steps=20", *flags]


@pytest.mark.slow
def test_train_on_a_gs_workdir_resumes_and_a_second_trainer_is_refused(gcs, tmp_path):
  """`t5x-like train --workdir gs://bucket/...` (orbax through tensorstore's gcs driver,
  data cache, metrics, lock) for 10 steps; then a rerun to 20 resumes at 10, and a
  third trainer started meanwhile exits 2 naming it. Nothing local is named gs:."""
  workdir = f"gs://bucket/e2e-{time.time_ns()}"
  env = dict(os.environ, XLA_FLAGS=xla_flags(8),
             JAX_PLATFORMS="cpu")
  first = subprocess.run(_cli(workdir, "--config.train.num_steps=10"), cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
  assert first.returncode == 0, first.stderr[-4000:]
  second = subprocess.Popen(_cli(workdir, "--config.train.num_steps=20"),
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while not fs.exists(_lock_path(workdir)):
    assert second.poll() is None and time.time() < deadline, second.stderr.read()[-4000:]
    time.sleep(0.1)
  refused = subprocess.run(_cli(workdir, "--config.train.num_steps=20"),
                           cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
  out, err = second.communicate(timeout=600)
  assert second.returncode == 0, err[-4000:]
  assert refused.returncode == 2, refused.stderr[-4000:]
  assert f"process {second.pid} on host {socket.gethostname()}" in refused.stderr
  assert "Traceback" not in refused.stderr
  assert "resumed from step 10" in out + err
  rows = read_jsonl(f"{workdir}/metrics.jsonl")
  assert [r["step"] for r in rows if "loss" in r] == list(range(1, 21))
  names = set(_bucket_files(workdir))
  assert {"checkpoints/10/commit_success.txt", "checkpoints/20/commit_success.txt"} <= names
  assert any(n.startswith("tensorboard/events.out.tfevents.") for n in names)
  assert any(n.startswith("data_cache/") for n in names)
  assert LOCK_NAME not in names  # released at the end of each run
  assert os.listdir(tmp_path) == []
