"""launch/gpu_bench.sh: the wrapper that runs `t5x-like bench gpu` on a GPU host (the
suite itself: tests/test_bench_gpu.py; its rehearsal through this script: slow tier)."""

import os
import subprocess
import sys

import pytest

# Each test starts bash and a Python (seconds apiece): the slow tier. The steps' order is
# checked in-process by tests/test_bench_gpu.py, shellcheck by tests/test_launch.py.
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "launch", "gpu_bench.sh")


def _run(env_extra, *args, cwd=None):
  env = {k: v for k, v in os.environ.items() if k not in ("OUT", "WHEELS", "PYTHON")}
  env.update({"PYTHON": sys.executable, **env_extra})
  return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=env,
                        timeout=120, cwd=cwd)


def test_list_prints_the_steps_in_order_from_anywhere(tmp_path):
  run = _run({}, "--list", cwd=tmp_path)
  assert run.returncode == 0, run.stderr
  names = [l.split()[0] for l in run.stdout.splitlines() if not l.startswith(" ")]
  assert names[:5] == ["peer_gpt2", "peer_bert", "bert", "gpt2", "t5"]
  assert "resume" in names and "compare" in names


def test_without_out_it_exits_2_before_installing_or_running_anything(tmp_path):
  run = _run({}, cwd=tmp_path)
  assert run.returncode == 2
  assert run.stderr.splitlines()[0] == ("gpu_bench.sh: OUT is required: an empty folder"
                                        " for the results")
  assert os.listdir(tmp_path) == []


def test_a_host_missing_modules_without_wheels_is_told_where_they_go(tmp_path):
  """A Python without the project's small dependencies (here: this one without its
  site-packages, -S) and no carried wheels: one line naming the missing modules and
  the wheel folder; nothing written."""
  bare = tmp_path / "bare_python"
  bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
  bare.chmod(0o755)
  run = _run({"PYTHON": str(bare), "OUT": str(tmp_path / "out"),
              "WHEELS": str(tmp_path / "no_wheels")}, cwd=tmp_path)
  assert run.returncode == 1
  line = run.stderr.strip().splitlines()[-1]
  assert "missing modules (grain array_record portpicker ml_collections tensorboardX)" in line
  assert str(tmp_path / "no_wheels") in line
  assert not (tmp_path / "out").exists()
