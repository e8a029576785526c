"""SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C) as a request to save and stop.

  preemption = Preemption()     # installs the handlers
  ... after each step: if preemption.requested: save a checkpoint, stop ...
  preemption.restore()          # the previous handlers back

Used by pretraining (train/loop.py) and fine-tuning (finetune/loop.py), which return
a RunResult saying whether they finished or stopped.
"""

from __future__ import annotations

import signal
import sys
from typing import Optional


class Preemption:
  """Turns SIGTERM and SIGINT (Ctrl-C) into a flag the loop checks after each step: the
  run saves a checkpoint and stops. A second SIGINT interrupts at once."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.requested: Optional[str] = None  # the signal's name once one came
    self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

  def _handle(self, signum, frame):
    del frame
    if self.requested == "SIGINT" and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.requested = signal.Signals(signum).name
    print(f"\n{self.requested}: saving a checkpoint after this step, then stopping"
          + (" (Ctrl-C again to stop without saving)" if signum == signal.SIGINT else ""),
          file=sys.stderr, flush=True)

  def restore(self):
    for s, handler in self._previous.items():
      signal.signal(s, handler)


class RunResult(dict):
  """The last eval metrics (pretraining) or the final dev metrics (fine-tuning), as a
  dict, with how the run ended.

  step: the step reached. status: 'finished' (trained to the end now),
  'already_finished' (the workdir's run had ended; the metrics are its last eval row)
  or 'stopped' (a signal; a checkpoint of `step` is saved and a rerun resumes).
  """

  def __init__(self, metrics: dict, step: int, status: str):
    super().__init__(metrics)
    self.step, self.status = step, status
