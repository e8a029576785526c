"""Fault injection for the tests: T5X_LIKE_FAILPOINT="POINT@STEP[,POINT@STEP ...]".

  before_row, after_row, after_save   SIGKILL this process at that point of step STEP
                                      (train/runner.py; tests/test_kill_windows.py)
  sigint                              a Ctrl-C (SIGINT to itself) right after the train
                                      step of step STEP (runner.py)
  slow_save                           the save of step STEP stalls for
                                      T5X_LIKE_SLOW_SAVE_SECONDS (default 600) while it is
                                      being written (checkpoints.py; tests/test_faults.py)

Unset (always, outside tests) they cost one environment lookup each.
"""

from __future__ import annotations

import os
import signal
import time

FAILPOINT_ENV = "T5X_LIKE_FAILPOINT"
SLOW_SAVE_SECONDS_ENV = "T5X_LIKE_SLOW_SAVE_SECONDS"


def armed(point: str, step: int) -> bool:
  """Whether T5X_LIKE_FAILPOINT names `point` at `step`."""
  wanted = os.environ.get(FAILPOINT_ENV)
  return bool(wanted) and f"{point}@{int(step)}" in wanted.split(",")


def kill_at(point: str, step: int) -> None:
  """Dies by SIGKILL here when T5X_LIKE_FAILPOINT names this point and step."""
  if armed(point, step):
    os.kill(os.getpid(), signal.SIGKILL)


def interrupt_at(step: int) -> None:
  """A Ctrl-C delivered to this thread now when T5X_LIKE_FAILPOINT names sigint@step."""
  if armed("sigint", step):
    signal.raise_signal(signal.SIGINT)


def stall_save(step: int) -> None:
  """Sleeps while the save of `step` is written when T5X_LIKE_FAILPOINT names
  slow_save@step."""
  if armed("slow_save", step):
    time.sleep(float(os.environ.get(SLOW_SAVE_SECONDS_ENV, "600")))
