"""What the study drivers share: `t5x-like` runs as child processes, log lines, where
the recipes are, and a driver's exit status.

A driver runs every stage as `t5x-like ...` in a child (run_t5x_like), so a stopped
child (SIGTERM, Ctrl-C) saves and the driver says so in one line (exit_with), and a
rerun resumes. The recipes are the repository's configs/, given by --configs
(configs_flag): the package ships no configs/ and never looks for one beside itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Optional

from absl import flags

from t5x_like.command_flags import HelpShown, print_error
from t5x_like.errors import UserError


def log(message: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class ChildStopped(RuntimeError):
  """A `t5x-like` child stopped by SIGTERM or Ctrl-C after saving (exit 143 or 130)."""

  def __init__(self, rc: int, message: str):
    super().__init__(message)
    self.rc = rc


def run_t5x_like(*args: str, log_file: Optional[str] = None) -> None:
  """Runs `t5x-like ARGS` (this interpreter), its output to log_file; raises on failure
  (ChildStopped when the child was stopped and saved: rerun to resume)."""
  command = [sys.executable, "-m", "t5x_like.cli", *args]
  if log_file:
    os.makedirs(os.path.dirname(log_file), exist_ok=True)
  with open(log_file or os.devnull, "w") as out:
    child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
      rc = child.wait()
    except KeyboardInterrupt:  # Ctrl-C reached the child too: let it save and stop
      child.wait()
      raise
  if rc in (130, 143):
    raise ChildStopped(rc, f"`t5x-like {args[0]}` was stopped (exit {rc}; log: {log_file}):"
                           " rerun the same command to resume")
  if rc:
    raise RuntimeError(f"exit {rc}: {' '.join(command)} (log: {log_file})")


def configs_flag(fv: flags.FlagValues) -> None:
  """--configs DIR: the repository's configs/ (run from its root, the default finds it)."""
  flags.DEFINE_string("configs", "configs", "the repository's configs/ folder, whose"
                      " recipes every run uses", flag_values=fv)


def configs_dir(flag_value: str) -> str:
  """The --configs folder as an absolute path; a UserError when it holds no configs."""
  folder = os.path.abspath(flag_value)
  if not os.path.isfile(os.path.join(folder, "bert_cpu.py")):
    raise UserError(f"--configs {flag_value}: no bert_cpu.py there; run from the"
                    " repository's root or pass its configs/ folder")
  return folder


def exit_with(main_fn, prog: str) -> None:
  """A study's __main__: exit with main_fn()'s status; --help exits 0, a UserError is
  one line and exit 2, a stopped child one line and its status (143, 130)."""
  try:
    sys.exit(main_fn())
  except HelpShown:
    sys.exit(0)
  except ChildStopped as e:  # one line, the child's status: a launcher reruns it
    print(f"{prog}: {e}", file=sys.stderr)
    sys.exit(e.rc)
  except UserError as e:
    print_error(prog, e, debug=False)
    sys.exit(2)
