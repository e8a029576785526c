"""The run context shared by pretraining and fine-tuning (train/run_context.py): the lock
(its own, or the one the command took), the undo guard, the resume (restore or create,
the rows after the checkpoint dropped, "resumed from step N", an ended run), the signal
handlers, and a KeyboardInterrupt that abandons a save in flight. Also the schedule of
the step runner (runner.Every) and a rerun of a finished fine-tuning."""

import gc
import json
import os
import pathlib
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from t5x_like import cli
from t5x_like.errors import UserError
from t5x_like.failpoints import FAILPOINT_ENV, SLOW_SAVE_SECONDS_ENV
from t5x_like.train.metrics import read_jsonl
from t5x_like.train.run_context import open_run
from t5x_like.train.runner import Every
from t5x_like.train.workdir_lock import LOCK_NAME, WorkdirLock, WorkdirLockedError
from helpers import ROOT

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(autouse=True)
def _collect_garbage():
  yield
  gc.collect()


def _state(step: int):
  sharding = SingleDeviceSharding(jax.devices()[0])
  return jax.device_put({"w": jnp.arange(8.0) + step}, sharding)


def _abstract():
  sharding = SingleDeviceSharding(jax.devices()[0])
  return {"w": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding)}


def _create():
  state = _state(0)
  return state, jax.tree.map(lambda x: x.sharding, state)


def _open(workdir, **kw):
  kw = dict(dict(total_steps=10, keep=3, async_save=False), **kw)
  return open_run(workdir, **kw)


# ---------------------------------------------------------------------------- the lock
def test_takes_the_lock_and_releases_it(tmp_path):
  workdir = tmp_path / "run"
  with _open(workdir) as run:
    assert run.workdir == str(workdir)
    assert os.path.exists(workdir / LOCK_NAME)
    with pytest.raises(WorkdirLockedError):
      WorkdirLock(workdir).acquire()
  assert not os.path.exists(workdir / LOCK_NAME)


def test_uses_the_lock_the_caller_holds_and_leaves_it_held(tmp_path):
  """The command's lock (taken before jax): not taken again, not released."""
  workdir = tmp_path / "run"
  with WorkdirLock(workdir) as lock:
    with _open(workdir, lock=lock) as run:
      run.start(_abstract(), _create)
    assert lock.held and os.path.exists(workdir / LOCK_NAME)
    with pytest.raises(ValueError, match="not"):
      with _open(tmp_path / "other", lock=lock):
        pass
  assert not os.path.exists(workdir / LOCK_NAME)


def test_a_refused_lock_undoes_nothing_of_the_holder(tmp_path):
  workdir = tmp_path / "run"
  with WorkdirLock(workdir):
    (workdir / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(WorkdirLockedError):
      with _open(workdir):
        pass
    assert sorted(os.listdir(workdir)) == sorted([LOCK_NAME, "metrics.jsonl"])


def test_a_user_error_before_the_start_leaves_the_workdir_as_it_was(tmp_path):
  kept = tmp_path / "kept"
  kept.mkdir()
  (kept / "notes.txt").write_text("mine")
  for workdir in (tmp_path / "new", kept):
    with pytest.raises(UserError, match="bad data"):
      with _open(workdir) as run:
        (pathlib.Path(run.workdir) / "data_cache").mkdir()
        raise UserError("bad data")
  assert not (tmp_path / "new").exists()
  assert os.listdir(kept) == ["notes.txt"]


# -------------------------------------------------------------------------- the resume
def test_start_creates_then_resumes_and_drops_the_rows_after_the_checkpoint(tmp_path,
                                                                           capsys):
  workdir = tmp_path / "run"
  with _open(workdir) as run:
    start = run.start(_abstract(), _create)
    assert (start.step, start.extra, start.finished) == (0, None, False)
    for step in range(1, 6):
      run.writer.write_scalars(step, {"loss": float(step)})
    run.writer.flush()
    run.checkpointer.save(3, _state(3), {"data": {"next_index": 3}}, force=True)
  assert "resumed" not in capsys.readouterr().out

  with _open(workdir) as run:
    start = run.start(_abstract(), _create)
    assert (start.step, start.extra, start.finished) == (3, {"data": {"next_index": 3}},
                                                         False)
    np.testing.assert_array_equal(start.state["w"], np.arange(8.0) + 3)
    assert start.shardings["w"] == _abstract()["w"].sharding
  assert "resumed from step 3" in capsys.readouterr().out
  assert [r["step"] for r in read_jsonl(str(workdir / "metrics.jsonl"))] == [1, 2, 3]


def test_a_run_at_its_last_step_is_finished_and_keeps_its_rows(tmp_path, capsys):
  workdir = tmp_path / "run"
  with _open(workdir, total_steps=4) as run:
    run.start(_abstract(), _create)
    for step in range(1, 5):
      run.writer.write_scalars(step, {"loss": float(step)})
    run.checkpointer.save(4, _state(4), {"data": {}}, force=True)
  with _open(workdir, total_steps=4) as run:
    start = run.start(_abstract(), _create)
  assert start.finished and start.step == 4
  out = capsys.readouterr().out
  assert f"{workdir}: the run already finished at step 4" in out and "resumed" not in out
  assert [r["step"] for r in read_jsonl(str(workdir / "metrics.jsonl"))] == [1, 2, 3, 4]


def test_signal_handlers_are_installed_at_the_start_and_restored_at_the_end(tmp_path):
  before = signal.getsignal(signal.SIGTERM)
  with _open(tmp_path / "run") as run:
    assert signal.getsignal(signal.SIGTERM) == before  # building data: not yet
    run.start(_abstract(), _create)
    assert run.preemption is not None and not run.preemption.requested
    assert signal.getsignal(signal.SIGTERM) != before
  assert signal.getsignal(signal.SIGTERM) == before


# --------------------------------------------------------- a second Ctrl-C mid-save
def test_keyboard_interrupt_abandons_the_save_in_flight(tmp_path, monkeypatch):
  """The way out does not wait for a stalled save (the command then ends the process:
  tests/test_faults.py); in a process that goes on, the save ends in the background."""
  workdir = tmp_path / "run"
  with _open(workdir, async_save=True) as run:
    run.start(_abstract(), _create)
    run.checkpointer.save(2, _state(2), {"data": {}}, force=True)
  monkeypatch.setenv(FAILPOINT_ENV, "slow_save@4")
  monkeypatch.setenv(SLOW_SAVE_SECONDS_ENV, "8")
  started = time.monotonic()
  with pytest.raises(KeyboardInterrupt):
    with _open(workdir, async_save=True) as run:
      run.start(_abstract(), _create)
      run.checkpointer.save(4, _state(4), {"data": {}}, force=True)
      raise KeyboardInterrupt
  assert time.monotonic() - started < 6
  assert run.abandoned
  assert not os.path.exists(workdir / LOCK_NAME)
  assert not os.path.exists(workdir / "checkpoints" / "4" / "checksums.process_0.json")
  with _open(workdir) as run:  # step 4 is not sealed yet: set aside
    assert run.start(_abstract(), _create).step == 2


def test_a_lost_peer_abandons_the_save_in_flight(tmp_path, monkeypatch):
  """An error that reports a lost peer (gloo's broken collective) leaves at once: the
  save in flight would wait for the dead process in its barriers (issue 44)."""
  workdir = tmp_path / "run"
  monkeypatch.setenv(FAILPOINT_ENV, "slow_save@4")
  monkeypatch.setenv(SLOW_SAVE_SECONDS_ENV, "8")
  started = time.monotonic()
  lost = RuntimeError("Gloo allgather failed: [gloo/transport/tcp/pair.cc:534] Read error"
                      " [127.0.0.1]:2345: Connection reset by peer")
  with pytest.raises(RuntimeError, match="Connection reset by peer"):
    with _open(workdir, async_save=True) as run:
      run.start(_abstract(), _create)
      run.checkpointer.save(4, _state(4), {"data": {}}, force=True)
      raise lost
  assert time.monotonic() - started < 6
  assert run.abandoned
  assert not os.path.exists(workdir / "checkpoints" / "4" / "checksums.process_0.json")


def test_any_other_error_still_waits_for_the_save(tmp_path):
  with pytest.raises(ValueError):
    with _open(tmp_path / "run", async_save=True) as run:
      run.start(_abstract(), _create)
      run.checkpointer.save(2, _state(2), {"data": {}}, force=True)
      raise ValueError("a bug")
  assert not run.abandoned
  assert os.path.exists(tmp_path / "run" / "checkpoints" / "2" / "checksums.process_0.json")
  for thread in threading.enumerate():
    if thread.name.startswith("checkpoint_seal_"):
      thread.join(timeout=60)


# ------------------------------------------------------------------- the step runner
def test_every_says_when_to_log_checkpoint_and_evaluate():
  every = Every(log=2, checkpoint=3)
  assert [s for s in range(1, 7) if every.logs(s)] == [2, 4, 6]
  assert [s for s in range(1, 7) if every.checkpoints(s)] == [3, 6]
  assert not any(every.evaluates(s) for s in range(1, 7))  # 0: never

  class Train:
    log_every, checkpoint_every, eval_every = 5, 0, 10
  assert Every.of(Train) == Every(5, 0, 10)


# ------------------------------------------------------- a finished fine-tuning rerun
@pytest.mark.long
def test_rerun_of_a_finished_finetune_writes_the_same_outputs(tmp_path, capsys):
  task = str(tmp_path / "books")
  assert cli.main(["task", "books", "--out", task, "--num_blocks", "4", "--block_words",
                   "100", "--passage_words", "16"]) == 0
  command = ["finetune", f"--config={ROOT}/configs/finetune_books.py:bert,smoke,dir={task}",
             f"--workdir={tmp_path / 'ft'}",
             f"--config.init.config={ROOT}/configs/bert_cpu.py:smoke",
             "--config.train.num_steps=3", "--config.train.checkpoint_every=0"]
  assert cli.main(command) == 0
  read = lambda name: (tmp_path / "ft" / name).read_text()
  first_metrics, first_predictions = json.loads(read("final_metrics.json")), read(
      "dev_predictions.jsonl")
  capsys.readouterr()
  assert cli.main(command) == 0  # was a KeyError: no dev predictions without a step
  out = capsys.readouterr().out
  assert "the run already finished at step 3" in out and "final dev metrics" in out
  again = json.loads(read("final_metrics.json"))
  assert {k: v for k, v in again.items() if k != "seconds"} == {
      k: v for k, v in first_metrics.items() if k != "seconds"}
  assert read("dev_predictions.jsonl") == first_predictions


# ------------------------------------------- a second Ctrl-C dropped inside a __del__
def test_a_second_ctrl_c_dropped_inside_a_del_is_delivered_again():
  """Python prints and drops an exception raised inside __del__: a second Ctrl-C landing
  there (a grain iterator's finalizer) once left the run waiting on a stalled save."""
  from t5x_like.train.preemption import Preemption

  class RaisesInDel:
    def __del__(self):
      raise KeyboardInterrupt  # as the signal handler does when the signal lands here

  before = signal.getsignal(signal.SIGINT)  # pytest-xdist's workers ignore SIGINT
  preemption = Preemption()
  try:
    os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: a request to save and stop
    time.sleep(0.05)
    assert preemption.requested == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
      RaisesInDel()  # the second one, dropped
      time.sleep(5)
  finally:
    preemption.restore()
  assert signal.getsignal(signal.SIGINT) == before


def test_handlers_installed_over_others_keep_the_stop_they_took():
  """finetune-suite's handlers take a SIGTERM that comes while a run sets up; the run's
  own handlers, installed over them, must see it (else the run trains to its end)."""
  from t5x_like.train.preemption import Preemption
  before = signal.getsignal(signal.SIGTERM)
  suite = Preemption(then="stopping before the suite's next run")
  try:
    quiet = Preemption()
    quiet.restore()
    assert quiet.requested is None  # the control: with no stop taken, none is inherited
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    assert suite.requested == "SIGTERM"
    run = Preemption()
    try:
      assert run.requested == "SIGTERM"
    finally:
      run.restore()
    assert signal.getsignal(signal.SIGTERM) == suite._handle
  finally:
    suite.restore()
  assert signal.getsignal(signal.SIGTERM) == before
