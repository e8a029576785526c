"""The supervisor of multi-process runs (t5x_like/host_loss/supervisor.py, restart_policy.py,
`t5x-like supervise`): which exit statuses restart the run, which give up, what it logs,
that it stops the others (SIGKILL past the grace). Real supervised runs of 2 and 4
processes, SIGKILLed and restarted to the same losses, eval rows and final checkpoint
as an uninterrupted run: tests/test_kill_matrix.py (slow tier) and tests/kill_matrix.py.

The default tier starts no process that imports jax: scripted workers, and short bash
processes for the real process handling.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT
from t5x_like.host_loss import restart_policy as policy
from t5x_like.cli import main as cli_main
from t5x_like.commands import supervise as supervise_command
from t5x_like.host_loss.supervisor import (PopenWorker, ScriptedWorker, WorkerSpec, dry_run,
                                 last_committed_step, supervise)
from t5x_like.host_loss.supervisor import main as supervisor_main

# PopenWorker's preexec_fn (PR_SET_PDEATHSIG) runs fork's hooks, where jax (imported by
# conftest, never by the supervisor itself) warns about forking a threaded process.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")

# --------------------------------------------------------------- decisions

# The statuses of the issue and the README's contract, and what each must do.
DECISIONS = [
    (0, "finished"),
    (143, "restart"),  # SIGTERM: preempted, saved
    (-15, "restart"),  # the same, as Popen reports a death by SIGTERM
    (75, "restart"),  # EXIT_PEER_LOST
    (-9, "restart"), (137, "restart"),  # SIGKILL (OOM killer, a lost VM)
    (134, "restart"), (-6, "restart"),  # jax's C++ abort when a peer dies
    (255, "restart"),  # ssh: the host vanished
    (139, "restart"),  # SIGSEGV, from outside or not: bounded by max_restarts
    (3, "restart"),  # host_loss/distributed.py: the processes did not all connect in time
    (2, "give up"),  # user error
    (1, "give up"),  # failure: non-finite loss, bug
    (130, "give up"), (-2, "give up"),  # Ctrl-C
    (42, "give up"),  # unknown: not rerun
]


@pytest.mark.parametrize("status,decision", DECISIONS)
def test_each_status_restarts_gives_up_or_finishes(status, decision):
  assert policy.decide(status) == decision


def test_the_policy_reads_the_statuses_the_processes_exit_with():
  from t5x_like import errors
  assert policy.decide(errors.EXIT_PEER_LOST) == policy.decide(errors.EXIT_START_TIMEOUT) \
      == policy.RESTART
  assert policy.decide(errors.EXIT_USER_ERROR) == policy.GIVE_UP


def test_the_supervisor_imports_neither_jax_nor_absl():
  """The pod launchers run it with a laptop's bare python3."""
  code = ("import sys, t5x_like.host_loss.supervisor; bad = {'jax', 'absl', 'numpy', 'etils'} &"
          " set(sys.modules); assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_restart_line_text():
  line = policy.restart_line(2, 5, 1, -9, policy.resume_text(20))
  assert line == ("supervisor: restart 2/5: process 1 exited 137 (killed by SIGKILL);"
                  " resuming from step 20")
  assert policy.resume_text(None).endswith("starting from step 0")
  assert policy.gave_up_line(0, 2) == ("supervisor: gave up: process 0 exited 2: user"
                                       " error, not restarting")
  assert "exited 255 (ssh lost the host)" in policy.restart_line(1, 3, 3, 255, "x")


def test_a_root_cause_is_named_before_its_consequences():
  assert policy.first_cause([(0, 75), (1, -9)]) == (1, -9)
  assert policy.first_cause([(0, 134), (1, 75)]) == (0, 134)
  assert policy.first_cause([(2, 143), (1, 2)]) == (1, 2)


# ------------------------------------------------------- the loop, scripted


class Script:
  """Starts ScriptedWorkers: outcomes[attempt][process] = return code (after `polls`
  polls), None (runs until SIGTERM) or "hang" (until SIGKILL)."""

  def __init__(self, *attempts, polls=None):
    self.attempts, self.polls = attempts, polls or {}
    self.started: list[list[ScriptedWorker]] = []

  def __call__(self, spec, index):
    if index == 0:
      self.started.append([])
    attempt = len(self.started) - 1
    worker = ScriptedWorker(spec, index, self.attempts[attempt][index],
                            polls=self.polls.get((attempt, index), 0))
    self.started[-1].append(worker)
    return worker


def _run(script, max_restarts=3, step=(20, True), grace=0.0):
  lines = []
  specs = [WorkerSpec(["train", str(i)]) for i in range(len(script.attempts[0]))]
  status = supervise(lambda restart: specs, max_restarts=max_restarts, workdir="w",
                     start=script, stop_grace_s=grace, poll_s=0.001, log=lines.append,
                     read_step=lambda workdir: step)
  return status, [line for line in lines if "started" not in line]


def test_a_killed_worker_restarts_all_and_the_run_finishes():
  script = Script([None, -9], [0, 0])
  status, lines = _run(script)
  assert status == 0 and len(script.started) == 2
  assert script.started[0][0].signals == ["SIGTERM"]  # the survivor was stopped
  assert lines == ["supervisor: restart 1/3: process 1 exited 137 (killed by SIGKILL);"
                   " resuming from step 20",
                   "supervisor: finished: all 2 processes exited 0 (1 restart)"]


@pytest.mark.parametrize("status", [2, 1, 130])
def test_a_user_error_or_failure_stops_every_worker_and_gives_up(status):
  script = Script([None, status, None])
  code, lines = _run(script)
  assert code == status and len(script.started) == 1
  assert [w.signals for w in script.started[0]] == [["SIGTERM"], [], ["SIGTERM"]]
  assert lines == [policy.gave_up_line(1, status)]
  assert "not restarting" in lines[0]
  if status == 2:
    assert "user error, not restarting" in lines[0]


def test_out_of_restarts_stops_with_the_last_status():
  script = Script(*[[None, 143]] * 3)
  code, lines = _run(script, max_restarts=2, step=(None, True))
  assert code == 143 and len(script.started) == 3
  assert [line.split(":")[1].strip() for line in lines] == ["restart 1/2", "restart 2/2",
                                                           "out of restarts (2 used)"]
  assert lines[0].endswith("no committed checkpoint yet: starting from step 0")
  assert lines[-1].endswith("not restarting (no committed checkpoint)")


def test_one_worker_done_waits_for_the_others():
  script = Script([0, 0], polls={(0, 1): 5})
  code, lines = _run(script)
  assert code == 0 and len(script.started) == 1
  assert all(w.signals == [] for w in script.started[0])  # nobody was stopped
  assert lines == ["supervisor: finished: all 2 processes exited 0 (0 restarts)"]


def test_a_survivor_that_hangs_on_sigterm_is_killed_after_the_grace():
  """The survivor of a dead peer may hang in a collective (76 s before jax aborts it):
  the restart does not wait for it past the grace."""
  script = Script(["hang", -9], [0, 0])
  start = time.monotonic()
  code, _ = _run(script, grace=0.3)
  assert code == 0
  assert script.started[0][0].signals == ["SIGTERM", "SIGKILL"]
  assert 0.3 <= time.monotonic() - start < 5


def test_ctrl_c_of_the_supervisor_stops_every_worker():
  script = Script([None, None])
  before = signal.getsignal(signal.SIGINT)  # pytest-xdist's workers ignore SIGINT

  def start(spec, index):
    worker = script(spec, index)
    if index == 1:
      signal.raise_signal(signal.SIGINT)  # as a Ctrl-C, once both run
    return worker

  lines = []
  code = supervise(lambda r: [WorkerSpec(["a"]), WorkerSpec(["b"])], max_restarts=3,
                   start=start, stop_grace_s=0, poll_s=0.001, log=lines.append)
  assert code == 130 and len(script.started) == 1
  assert [w.signals for w in script.started[0]] == [["SIGTERM"], ["SIGTERM"]]
  assert lines[-1].startswith("supervisor: stopped by SIGINT")
  assert signal.getsignal(signal.SIGINT) == before  # restored


def test_dry_run_prints_the_restart_on_a_pod(capsys):
  args = []
  for i in range(3):
    args += ["--worker", f"ssh h{i} 'train'", "--stop", f"ssh h{i} term",
             "--kill", f"ssh h{i} kill"]
  assert supervisor_main(["--dry_run", "--simulate=2:255", *args]) == 0
  out = [line for line in capsys.readouterr().out.splitlines() if not line.startswith(
      "# supervisor: started")]
  assert out == [
      "# dry run: process 2 is made to exit 255 (ssh lost the host) once",
      "+ ssh h0 'train'", "+ ssh h1 'train'", "+ ssh h2 'train'",
      "+ ssh h0 term", "+ ssh h1 term",  # the others: SIGTERM on their hosts
      "+ ssh h0 kill", "+ ssh h1 kill", "+ ssh h2 kill",  # then SIGKILL on every host
      "# supervisor: restart 1/3: process 2 exited 255 (ssh lost the host); resuming from"
      " the last committed checkpoint",
      "+ ssh h0 'train'", "+ ssh h1 'train'", "+ ssh h2 'train'",
      "# supervisor: finished: all 3 processes exited 0 (1 restart)"]


def test_dry_run_of_local_workers_names_the_signals():
  lines = []
  specs = [WorkerSpec(["t5x-like", "train", f"--process_id={i}"]) for i in range(2)]
  assert dry_run(lambda r: specs, max_restarts=1, simulate=(0, 75), echo=lines.append) == 0
  assert "# SIGTERM to process 1" in lines and "# SIGKILL to process 1" not in lines
  assert lines.count("+ t5x-like train --process_id=1") == 2


# --------------------------------------------------- real processes (bash)


def _bash(script: str) -> WorkerSpec:
  return WorkerSpec(["bash", "-c", script])


def test_real_processes_restart_and_a_stubborn_survivor_is_killed(tmp_path):
  """PopenWorker: the survivor ignores SIGTERM (its child too) and is SIGKILLed with its
  process group after the grace; the second start finishes."""
  child = tmp_path / "child.pid"
  attempts = [
      [_bash(f"trap '' TERM; sleep 60 & echo $! > {child}; wait"),
       _bash("sleep 0.2; kill -9 $$")],
      [_bash("exit 0"), _bash("sleep 0.1; exit 0")],
  ]
  lines = []
  start = time.monotonic()
  code = supervise(lambda restart: attempts[restart], max_restarts=2, workdir=None,
                   stop_grace_s=0.5, poll_s=0.02, log=lines.append)
  assert code == 0, lines
  assert time.monotonic() - start < 10
  assert any("restart 1/2: process 1 exited 137 (killed by SIGKILL)" in l for l in lines)
  pid = int(child.read_text())
  time.sleep(0.1)
  assert not os.path.exists(f"/proc/{pid}") or " Z " in open(f"/proc/{pid}/stat").read()


def test_real_process_gives_up_with_its_status():
  lines = []
  code = supervise(lambda restart: [_bash("exit 2"), _bash("sleep 30")], max_restarts=2,
                   stop_grace_s=5, poll_s=0.02, log=lines.append)
  assert code == 2 and "user error, not restarting" in lines[-1]


# ------------------------------------------------------------- the workdir


def _step_dir(root, step, writers=2, manifests=None, commit=True):
  d = root / "checkpoints" / str(step)
  for item in ("state", "extra"):
    (d / item).mkdir(parents=True)
  if commit:
    (d / "commit_success.txt").write_text("ok")
  for k in range(writers if manifests is None else manifests):
    (d / f"checksums.process_{k}.json").write_text(json.dumps({"processes": writers}))


def test_last_committed_step_skips_unfinished_saves(tmp_path):
  assert last_committed_step(str(tmp_path)) == (None, True)
  _step_dir(tmp_path, 10)
  _step_dir(tmp_path, 20, manifests=1)  # process 1 never sealed it
  _step_dir(tmp_path, 30, commit=False)  # orbax never committed it
  (tmp_path / "checkpoints" / "40.corrupt-123").mkdir()
  assert last_committed_step(str(tmp_path)) == (10, True)
  assert last_committed_step(None) == (None, False)


def test_checkpoint_names_match_the_checkpointer():
  from t5x_like.checkpoint import integrity
  from t5x_like.host_loss import supervisor
  assert supervisor.COMMIT_MARKER == integrity.COMMIT_MARKER
  assert supervisor.MANIFEST == integrity.MANIFEST
  assert supervisor.ITEMS == (integrity.STATE, integrity.EXTRA)


# ---------------------------------------------------- `t5x-like supervise`


@pytest.mark.parametrize("argv,words", [
    (["--num_processes=2", "--", "plan", "--config=x"], "'plan' is not supervised"),
    (["--num_processes=2", "--", "train", "--process_id=1"], "--process_id is set by"),
    (["--num_processes=2"], "required"),
    (["--", "train"], "--num_processes"),
    (["--num_processes=0", "--", "train"], "num_processes"),
])
def test_supervise_user_errors_exit_2(capsys, argv, words):
  assert cli_main(["supervise", *argv]) == 2
  err = capsys.readouterr().err
  assert words in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2


def test_supervise_help(capsys):
  assert cli_main(["supervise", "--help"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("usage: t5x-like supervise [flags] -- train|finetune FLAGS...")
  assert "--max_restarts" in out and "--stop_grace_seconds" in out


def test_supervise_builds_one_command_per_process(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1 --xla_force_host_platform_device_count=8")
  env = supervise_command.worker_env(4)
  assert env["XLA_FLAGS"].split() == ["--xla_foo=1", "--xla_force_host_platform_device_count=4"]
  assert env["JAX_PLATFORMS"] == "cpu"
  cmds = supervise_command.worker_commands(["train", "--workdir=w"], 2, 1234)
  assert [c[3:] for c in cmds] == [
      ["train", "--workdir=w", "--coordinator_address=localhost:1234", "--num_processes=2",
       "--process_id=0"],
      ["train", "--workdir=w", "--coordinator_address=localhost:1234", "--num_processes=2",
       "--process_id=1"]]
  assert supervise_command.worker_commands(["train"], 1, 1234) == [
      [sys.executable, "-m", "t5x_like.cli", "train"]]
