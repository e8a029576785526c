"""SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C) as a request to save and stop.

  preemption = Preemption()     # installs the handlers
  ... after each step: if preemption.requested: save a checkpoint, stop ...
  preemption.restore()          # the previous handlers back

Used by pretraining (train/loop.py) and fine-tuning (finetune/loop.py), through
train/run_context.py; they return a RunResult saying whether they finished or stopped.
Their commands end at once on a second Ctrl-C (exit_at_once_on_interrupt).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator, Optional

from t5x_like.errors import EXIT_FINISHED, EXIT_INTERRUPTED


class Preemption:
  """Turns SIGTERM and SIGINT (Ctrl-C) into a flag the loop checks after each step: the
  run saves a checkpoint and stops. A second SIGINT interrupts at once."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, then: str = "saving a checkpoint after this step, then stopping"):
    self._then = then  # what the process does about it, said when it comes
    self.requested: Optional[str] = None  # the signal's name once one came
    self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    # A request the handlers this one replaces had taken (finetune-suite's, while a run
    # set up) is this run's too: it stops after its first step.
    outer = getattr(self._previous[signal.SIGTERM], "__self__", None)
    if isinstance(outer, Preemption) and not self.requested:
      self.requested = outer.requested
    self._previous_unraisablehook = sys.unraisablehook
    sys.unraisablehook = self._unraisable

  def _handle(self, signum, frame):
    del frame
    if self.requested == "SIGINT" and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.requested = signal.Signals(signum).name
    print(f"\n{self.requested}: {self._then}"
          + (" (Ctrl-C again to stop without saving)" if signum == signal.SIGINT else ""),
          file=sys.stderr, flush=True)

  def _unraisable(self, unraisable) -> None:
    """The second Ctrl-C's KeyboardInterrupt raised inside a __del__ (grain's iterators
    have one) is printed and dropped by Python, and the process went on waiting for the
    save it was to abandon: deliver the interrupt again once that __del__ is over."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt) and self.requested == "SIGINT":
      again = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
      again.daemon = True
      again.start()
      return
    self._previous_unraisablehook(unraisable)

  def restore(self):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    sys.unraisablehook = self._previous_unraisablehook


def stopped_exit_code(signal_name: str) -> int:
  """Exit status of a run stopped by `signal_name` after saving its checkpoint: 128 + the
  signal's number, as a shell reports a process that signal ended (SIGTERM 143, SIGINT
  130), so a launcher tells "preempted, rerun me" (143) from "done" (0)."""
  return 128 + signal.Signals[signal_name].value


@contextlib.contextmanager
def exit_at_once_on_interrupt(command: str) -> Iterator[None]:
  """For the train and finetune commands: a KeyboardInterrupt (a second Ctrl-C, or one
  before training started) ends the process at once, once the `with` blocks inside have
  unwound (the workdir lock released, the metric files closed): one line on stderr and
  exit status 130. A save in flight is abandoned, not waited for (run_context.open_run):
  its background threads end with the process instead of running on into the
  interpreter's shutdown (where they met "cannot schedule new futures after interpreter
  shutdown"). The workdir is then as after a kill: the unfinished
  save is set aside at the rerun, which resumes from the last complete checkpoint."""
  try:
    yield
  except KeyboardInterrupt:
    print(f"t5x-like {command}: interrupted; stopped without saving (a rerun resumes"
          " from the last complete checkpoint)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_INTERRUPTED)  # pylint: disable=protected-access


class RunResult(dict):
  """The last eval metrics (pretraining) or the final dev metrics (fine-tuning), as a
  dict, with how the run ended.

  step: the step reached. status: 'finished' (trained to the end now),
  'already_finished' (the workdir's run had ended; the metrics are its last eval row,
  or in fine-tuning the dev metrics of its final checkpoint) or 'stopped' (by the
  signal `stopped_by`; a checkpoint of `step` is saved and a rerun resumes; a
  fine-tuning 'finished' has `stopped_by` set when the signal came after its last
  step, while it wrote its outputs: finetune-suite stops before its next run) or
  'exhausted' (data.mixture_exhausted="stop": the mixture source `exhausted_source`
  would run past its first epoch in the next step; a checkpoint of `step` is saved).
  exit_code: the command's exit status for it.
  """

  def __init__(self, metrics: dict, step: int, status: str,
               stopped_by: Optional[str] = None, exhausted_source: Optional[str] = None):
    super().__init__(metrics)
    self.step, self.status, self.stopped_by = step, status, stopped_by
    self.exhausted_source = exhausted_source

  @property
  def exit_code(self) -> int:
    if self.status == "stopped":
      return stopped_exit_code(self.stopped_by or "SIGTERM")
    return EXIT_FINISHED
