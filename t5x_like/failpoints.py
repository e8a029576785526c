"""Fault injection for the tests: T5X_LIKE_FAILPOINT="POINT@STEP[:I][,POINT@STEP ...]".

  before_row, after_row, after_save   SIGKILL this process at that point of step STEP
                                      (train/runner.py; tests/test_kill_windows.py)
  sigint                              a Ctrl-C (SIGINT to itself) right after the train
                                      step of step STEP (runner.py)
  slow_save                           the save of step STEP stalls for
                                      T5X_LIKE_SLOW_SAVE_SECONDS (default 600) while it is
                                      being written (checkpoints.py; tests/test_faults.py)
  before_seal                         SIGKILL after orbax committed step STEP, before
                                      this host wrote its checksums (checkpointer.py;
                                      tests/test_peer_loss.py)
  in_step                             SIGKILL right after step STEP's train step was
                                      dispatched, while it runs (runner.py)
  during_eval                         SIGKILL after the first eval batch of step STEP
                                      (train/loop.py)
  first_compile                       SIGKILL T5X_LIKE_FAILPOINT_DELAY seconds (default
                                      0.5) after the first train step call of a process
                                      that starts at step STEP-1, i.e. while it compiles
                                      (runner.py; tests/kill_matrix.py)

For multi-process runs (tests/kill_matrix.py), an item POINT@STEP:I fires in jax process
I only, and with T5X_LIKE_FAILPOINT_ONCE=DIR each item fires once across restarts: the
first to create DIR/ITEM fires, and writes there its pid and the time. With
train.async_checkpoints (the default), after_save kills while the save is still written.

Unset (always, outside tests) they cost one environment lookup each.
"""

from __future__ import annotations

import os
import signal
import time

FAILPOINT_ENV = "T5X_LIKE_FAILPOINT"
SLOW_SAVE_SECONDS_ENV = "T5X_LIKE_SLOW_SAVE_SECONDS"
ONCE_ENV = "T5X_LIKE_FAILPOINT_ONCE"
DELAY_ENV = "T5X_LIKE_FAILPOINT_DELAY"


def armed(point: str, step: int) -> bool:
  """Whether T5X_LIKE_FAILPOINT names `point` at `step`."""
  wanted = os.environ.get(FAILPOINT_ENV)
  if not wanted:
    return False
  for item in wanted.split(","):
    where, _, process = item.partition(":")
    if (where == f"{point}@{int(step)}" and (not process or _process_index() == int(process))
        and _first_time(item)):
      return True
  return False


def _process_index() -> int:
  import jax  # pylint: disable=import-outside-toplevel  (the trainer's, already imported)
  return jax.process_index()


def _first_time(item: str) -> bool:
  """True once per item and T5X_LIKE_FAILPOINT_ONCE directory (always when unset)."""
  directory = os.environ.get(ONCE_ENV)
  if not directory:
    return True
  try:
    fd = os.open(os.path.join(directory, item), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
  except FileExistsError:
    return False
  os.write(fd, f"pid {os.getpid()} at {time.time():.3f}\n".encode())
  os.close(fd)
  return True


def kill_at(point: str, step: int) -> None:
  """Dies by SIGKILL here when T5X_LIKE_FAILPOINT names this point and step."""
  if armed(point, step):
    os.kill(os.getpid(), signal.SIGKILL)


def kill_soon(point: str, step: int) -> None:
  """SIGKILL from a timer thread T5X_LIKE_FAILPOINT_DELAY seconds from now, whatever the
  main thread is doing then (a compile), when T5X_LIKE_FAILPOINT names point@step."""
  if armed(point, step):
    import threading  # pylint: disable=import-outside-toplevel
    timer = threading.Timer(float(os.environ.get(DELAY_ENV, "0.5")),
                            lambda: os.kill(os.getpid(), signal.SIGKILL))
    timer.daemon = True
    timer.start()


def interrupt_at(step: int) -> None:
  """A Ctrl-C delivered to this thread now when T5X_LIKE_FAILPOINT names sigint@step."""
  if armed("sigint", step):
    signal.raise_signal(signal.SIGINT)


def stall_save(step: int) -> None:
  """Sleeps while the save of `step` is written when T5X_LIKE_FAILPOINT names
  slow_save@step."""
  if armed("slow_save", step):
    time.sleep(float(os.environ.get(SLOW_SAVE_SECONDS_ENV, "600")))
