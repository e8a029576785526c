"""A multi-host run that loses a process: the survivors stop in bounded time with one line
and exit 75, and the checkpoint a dying host leaves half-sealed is skipped by every host.

The default tier checks the pieces (the line, reading jax's messages, the parent's stderr
filter and exit status, the guard's fork with a fake child); the slow tier kills real
processes of a 2-process `t5x-like train` (tests/peer_loss_runs.py measures more).
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import ROOT, jsonl_rows
from t5x_like import errors
from t5x_like.host_loss import peer_guard, peer_loss
from t5x_like.checkpoint import integrity
from t5x_like.train import preemption

# jax 0.10.2's own text (copied from survivors' stderr on this machine), not ours.
HEARTBEAT_ABORT = textwrap.dedent("""\
    E1127 05:57:16.741588   10339 coordination_service_agent.cc:289] Polled an error from coordination service (this can be an error from this or another task).
    F1127 05:57:16.741780   10339 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
    2
    The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further.

    RPC: /xla.coordination.CoordinationService/PollForError [type.googleapis.com/tensorflow.CoordinationServiceError='']
    *** Check failure stack trace: ***
        @     0x7f0f91840634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
        @     0x7f0f8d9040ee  xla::CoordinationServiceAgent::SetError()
    """)
COORDINATOR_ABORT = textwrap.dedent("""\
    F1127 05:54:44.722497   9541 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was preempted/died/restarted unexpectedly or this task is experiencing network issues. Check earlier logs from 1) this task, 2) the leader (usually slice 0 task 0), and 3) cluster scheduler to debug further.
    Additional GRPC error information from remote target coordination_service while calling /xla.coordination.CoordinationService/PollForError:
    :UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}
    *** Check failure stack trace: ***
    """)
GLOO_ERROR = ("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:547]"
              " Connection closed by peer [127.0.0.1]:27358")
GLOO_TERMINATE = textwrap.dedent("""\
    terminate called after throwing an instance of 'gloo::EnforceNotMet'
      what():  [enforce fail at external/gloo/gloo/transport/tcp/pair.cc:459] op.preamble.length <= op.nbytes. 1024 vs 16. Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?
    """)
LINE = re.compile(r"^t5x-like train: lost contact with process (\d) \((.+)\); last committed"
                  r" checkpoint: step (\d+); exit 75: rerun on every worker to resume$")


# ------------------------------------------------------------------------ the pieces
def test_the_peer_lost_status_is_75_and_no_other_status_of_the_contract():
  assert errors.EXIT_PEER_LOST == 75
  others = {errors.EXIT_FINISHED, errors.EXIT_FAILURE, errors.EXIT_USER_ERROR,
            errors.EXIT_START_TIMEOUT, errors.EXIT_INTERRUPTED, errors.EXIT_JAX_ABORT,
            errors.EXIT_SSH_LOST, preemption.stopped_exit_code("SIGTERM")}
  assert 75 not in others and len(others) == 8


def test_the_line_names_the_process_how_and_the_step():
  line = peer_loss.lost_peer_line("t5x-like train", peer_loss.PeerLoss(1, "heartbeat"), 10)
  assert line == ("t5x-like train: lost contact with process 1 (heartbeat); last committed"
                  " checkpoint: step 10; exit 75: rerun on every worker to resume")
  unknown = peer_loss.lost_peer_line("t5x-like finetune",
                                     peer_loss.PeerLoss(None, "collective failed: x"), None)
  assert "lost contact with another process (collective failed: x)" in unknown
  assert "last committed checkpoint: none (a rerun starts over)" in unknown
  suite = peer_loss.lost_peer_line("t5x-like finetune-suite", peer_loss.PeerLoss(0, "h"),
                                   None, checkpoints_known=False)
  assert suite == ("t5x-like finetune-suite: lost contact with process 0 (h); exit 75:"
                   " rerun on every worker to resume")


@pytest.mark.parametrize("text, me, count, want", [
    (HEARTBEAT_ABORT, 0, 3, (2, "heartbeat")),
    (HEARTBEAT_ABORT, 1, 3, (2, "heartbeat")),
    ("Barrier failed because: task is set to ERROR: UNAVAILABLE: Task 3 heartbeat timeout.",
     0, 4, (3, "heartbeat")),
    (COORDINATOR_ABORT, 1, 2, (0, "the coordinator stopped answering")),
    (GLOO_ERROR, 0, 2, (1, "collective failed: connection closed by peer")),
    (GLOO_ERROR, 1, 4, (None, "collective failed: connection closed by peer")),
    (GLOO_TERMINATE, 1, 2,
     (0, "collective failed: received data size doesn't match expected size")),
    ("ValueError: non-finite loss at step 3", 0, 2, None),
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate", 1, 2, None),
])
def test_jax_and_gloo_messages_name_the_lost_process(text, me, count, want):
  got = peer_loss.from_text(text, me, count)
  assert (None if got is None else tuple(got)) == want


def test_an_exception_raised_from_a_broken_collective_is_a_peer_loss():
  try:
    try:
      raise ValueError(GLOO_ERROR)
    except ValueError as e:
      raise RuntimeError("while saving a checkpoint") from e
  except RuntimeError as e:
    assert peer_loss.from_exception(e, 0, 2) == (1, "collective failed: connection closed by peer")
  assert peer_loss.from_exception(KeyError("loss"), 0, 2) is None


def _fake_step(directory, step, processes, sealed):
  """A committed orbax step directory (marker, items, metadata saying checksums follow)
  sealed by the processes in `sealed`."""
  path = directory / str(step)
  for item in ("state", "extra"):
    (path / item).mkdir(parents=True)
    (path / item / f"ocdbt.process_{processes - 1}").mkdir()
    (path / item / f"ocdbt.process_{processes - 1}" / "d").write_bytes(b"x" * step)
  (path / integrity.COMMIT_MARKER).write_text("ok")
  (path / integrity.STEP_METADATA).write_text(
      '{"custom_metadata": {"%s": "sha256"}}' % integrity.CHECKSUMS_KEY)
  from etils import epath
  for k in sealed:
    integrity.seal(epath.Path(path), k, processes)


def test_the_last_committed_step_is_the_newest_every_process_sealed(tmp_path):
  assert peer_loss.last_committed_step(tmp_path / "missing") is None
  _fake_step(tmp_path, 10, 2, sealed=[0, 1])
  _fake_step(tmp_path, 20, 2, sealed=[0])  # process 1 died before its checksums
  _fake_step(tmp_path, 30, 2, sealed=[1])  # process 0 did
  (tmp_path / "40.orbax-checkpoint-tmp-1").mkdir()  # orbax never committed it
  assert peer_loss.last_committed_step(tmp_path) == 10
  assert peer_loss.last_committed_step(str(tmp_path)) == 10


def test_hosts_restore_only_the_steps_every_host_lists():
  """A restore is collective: a step one host's listing lacks is skipped by every host."""
  import numpy as np
  assert integrity.agreed_steps(np.array([[30, 20, 10], [20, 10, -1]])) == [20, 10]
  assert integrity.agreed_steps(np.array([[10, 20], [20, 10]])) == [20, 10]
  assert integrity.agreed_steps(np.array([[-1, -1], [10, -1]])) == []


def test_the_parent_holds_back_jax_fatal_lines_and_passes_the_rest():
  filt = peer_guard.StderrFilter(hold_seconds=10)
  assert filt.feed(b"train:  5%|  | 10/200\r", now=0) == b"train:  5%|  | 10/200\r"
  assert filt.feed(b"a warning\nE11", now=0) == b"a warning\n"  # may start a log line
  assert filt.feed(HEARTBEAT_ABORT.encode()[3:], now=1) == b""
  assert filt.held == HEARTBEAT_ABORT.encode()
  assert filt.feed(b"later\n", now=2) == b""  # after the fatal line: held too
  assert filt.release_due(now=5) == b""
  assert filt.release_due(now=12) == HEARTBEAT_ABORT.encode() + b"later\n"  # lived on
  assert filt.feed(b"Epoch done\n", now=13) == b"Epoch done\n"
  assert HEARTBEAT_ABORT.encode() in filt.seen
  warning = (b"W1127 06:17:12.096099   22071 preemption_sync_manager.cc:147] Failed to"
             b" retrieve preemption notice from coordination service: UNAVAILABLE\n")
  assert filt.feed(warning, now=14) == b"" and filt.held == warning
  assert filt.feed(b"Warnings are words\n", now=30) == b""
  gloo = peer_guard.StderrFilter()
  assert gloo.feed(GLOO_TERMINATE.encode(), now=0) == b"" and gloo.held
  shown = peer_guard.StderrFilter(hold=False)  # --debug: everything passes
  assert shown.feed(COORDINATOR_ABORT.encode(), now=0) == COORDINATOR_ABORT.encode()


def _status(code=None, signum=None):
  """A wait status as os.waitpid reports it."""
  return signum if signum is not None else code << 8


def test_the_parent_turns_a_peer_loss_abort_into_75_and_mirrors_everything_else(tmp_path):
  _fake_step(tmp_path, 10, 2, sealed=[0, 1])
  args = ("t5x-like train", 0, 2, tmp_path)
  code, line = peer_guard.outcome(_status(signum=signal.SIGABRT), HEARTBEAT_ABORT.encode(),
                                  *args)
  assert code == 75 and LINE.match(line).groups() == ("2", "heartbeat", "10")
  code, line = peer_guard.outcome(_status(signum=signal.SIGABRT),
                                  COORDINATOR_ABORT.encode(), "t5x-like train", 1, 2, tmp_path)
  assert code == 75 and LINE.match(line).group(1) == "0"
  assert peer_guard.outcome(_status(signum=signal.SIGABRT), b"F1127 other.cc:1] x", *args) \
      == (-signal.SIGABRT, None)
  assert peer_guard.outcome(_status(signum=signal.SIGKILL), b"", *args) == (-9, None)
  for code in (0, 1, 2, 75, 143):
    assert peer_guard.outcome(_status(code), HEARTBEAT_ABORT.encode() if code in (0, 75)
                              else b"", *args) == (code, None)


# A child that guard() forks, then behaves as the test says (argv[1]).
_GUARDED = textwrap.dedent("""\
    import os, signal, sys, time
    from t5x_like.host_loss import peer_guard
    peer_guard.guard("t5x-like train", process_id=1, num_processes=2,
                     checkpoint_dir=sys.argv[2], debug="--debug" in sys.argv)
    what = sys.argv[1]
    print("child pid", os.getpid(), flush=True)
    sys.stderr.write("a normal line\\n"); sys.stderr.flush()
    if what == "abort":
      sys.stderr.write(sys.argv[3]); sys.stderr.flush(); os.abort()
    if what == "gloo":
      raise ValueError(sys.argv[3])
    if what == "exit":
      sys.exit(3)
    if what == "kill":
      os.kill(os.getpid(), signal.SIGKILL)
    if what == "grandchild":  # keeps the stderr pipe open past the child's end
      import subprocess; subprocess.Popen(["sleep", "30"]); sys.exit(4)
    if what == "term":
      signal.signal(signal.SIGTERM, lambda *_: (sys.stderr.write("got SIGTERM\\n"), os._exit(143)))
      time.sleep(30)
    """)


def _guarded(tmp_path, what, *extra, signal_after=None):
  proc = subprocess.Popen([sys.executable, "-c", _GUARDED, what, str(tmp_path), *extra],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  if signal_after:
    time.sleep(signal_after)
    proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=60)
  return proc.returncode, out, err


def test_a_guarded_child_aborted_by_jax_for_a_lost_peer_ends_in_one_line_and_75(tmp_path):
  _fake_step(tmp_path, 10, 2, sealed=[0, 1])
  code, out, err = _guarded(tmp_path, "abort", COORDINATOR_ABORT)
  assert code == 75, err
  assert "child pid" in out
  lines = err.splitlines()
  assert lines[0] == "a normal line" and len(lines) == 2, err
  assert LINE.match(lines[1]).groups() == ("0", "the coordinator stopped answering", "10")


def test_a_guarded_child_whose_collective_broke_exits_75_without_a_traceback(tmp_path):
  _fake_step(tmp_path, 10, 2, sealed=[0, 1])
  code, _, err = _guarded(tmp_path, "gloo", GLOO_ERROR)
  assert code == 75, err
  assert err.splitlines()[0] == "a normal line" and "Traceback" not in err
  assert LINE.match(err.splitlines()[-1]).group(1) == "0"  # the other of 2
  code, _, err = _guarded(tmp_path, "gloo", GLOO_ERROR, "--debug")
  assert code == 75 and "Traceback" in err and LINE.match(err.splitlines()[-1])


def test_a_guarded_child_keeps_its_status_output_and_signals(tmp_path):
  code, _, err = _guarded(tmp_path, "exit")
  assert (code, err) == (3, "a normal line\n")
  code, _, err = _guarded(tmp_path, "term", signal_after=1.5)
  assert (code, err) == (143, "a normal line\ngot SIGTERM\n")
  code, _, err = _guarded(tmp_path, "abort", "F1127 05:54:44.72 9541 other.cc:1] not ours\n")
  assert code == -signal.SIGABRT and "not ours" in err
  code, _, err = _guarded(tmp_path, "kill")
  assert (code, err) == (-signal.SIGKILL, "a normal line\n")
  start = time.monotonic()
  proc = subprocess.Popen([sys.executable, "-c", _GUARDED, "grandchild", str(tmp_path)],
                          cwd=ROOT, stderr=subprocess.PIPE)
  assert proc.wait(timeout=20) == 4 and time.monotonic() - start < 15
  proc.stderr.close()


# ------------------------------------------------------------ real processes (slow)
def _checkpoint_dir(workdir):
  return os.path.join(workdir, "checkpoints")


@pytest.mark.parametrize("victim", [pytest.param(1, marks=pytest.mark.slow),
                                    pytest.param(0, marks=pytest.mark.long)])
def test_a_host_killed_between_two_hosts_seals_stops_the_other_and_both_resume(
    victim, tmp_path):
  """Process `victim` dies by SIGKILL after orbax committed step 20 but before its own
  checksums: step 20 is half-sealed. The survivor exits 75 within --peer_timeout with one
  line naming it and step 10; the rerun of both skips step 20 together (set aside), resumes
  from 10 and trains steps 11.. to the same losses as before the kill."""
  from peer_loss_runs import start_run
  workdir = str(tmp_path / "run")
  steps = ("--config.train.num_steps=30", "--config.train.checkpoint_every=10")
  procs = start_run(workdir, 2, "--peer_timeout=10", steps_flags=steps,
                    env_per_process={victim: {"T5X_LIKE_FAILPOINT": "before_seal@20"}})
  victim_proc, survivor = procs[victim], procs[1 - victim]
  victim_proc.wait(timeout=900)
  died = time.monotonic()
  assert victim_proc.returncode == -signal.SIGKILL, victim_proc.stderr.read()[-3000:]
  err = survivor.stderr.read().decode()
  survivor.wait(timeout=120)
  seconds = time.monotonic() - died
  assert survivor.returncode == 75, err[-3000:]
  assert seconds < 10 + 15, seconds
  last = err.rstrip("\n").rsplit("\n", 1)[-1]
  assert LINE.match(last).groups()[0::2] == (str(victim), "10"), last
  for noise in ("Check failure", "client.h", "Traceback", "coordination_service"):
    assert noise not in err, err[-3000:]

  step20 = os.path.join(_checkpoint_dir(workdir), "20")
  assert os.path.exists(os.path.join(step20, integrity.COMMIT_MARKER))
  assert not os.path.exists(os.path.join(step20, f"checksums.process_{victim}.json"))
  assert peer_loss.last_committed_step(_checkpoint_dir(workdir)) == 10
  before = {r["step"]: r["loss"] for r in jsonl_rows(workdir) if "loss" in r}
  assert max(before) >= 20

  rerun = start_run(workdir, 2, "--peer_timeout=10", steps_flags=steps)
  outputs = [p.communicate(timeout=900)[1].decode() for p in rerun]
  assert [p.returncode for p in rerun] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
  assert sorted(os.listdir(_checkpoint_dir(workdir)))[:1] == ["10"]
  assert any(name.startswith("20.corrupt-") for name in os.listdir(_checkpoint_dir(workdir)))
  rows = jsonl_rows(workdir)
  after = {}
  for r in rows:
    if "loss" in r:
      after[r["step"]] = r["loss"]  # the rewritten rows win
  assert sorted(after) == list(range(1, 31))
  assert [after[s] for s in range(11, 21)] == [before[s] for s in range(11, 21)]
