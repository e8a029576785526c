"""One run in its workdir, shared by pretraining (train/loop.py) and fine-tuning
(finetune/loop.py): the lock, the undo guard, the checkpoints, the metric files, the
resume, and the signals.

  with open_run(workdir, total_steps=..., keep=..., async_save=...) as run:
    ...                                    # data, model, mesh (a UserError here leaves
                                           # the workdir as it was: train/setup_guard.py)
    start = run.start(abstract_state, create)   # restore the latest checkpoint or
                                           # create(); from here signals save and stop
    if start.finished: ...                 # the workdir's run had ended
    run_steps(StepLoop(..., run=run, ...), start.state, start.step, until)

open_run takes the WorkdirLock (or uses the one a command took before importing jax:
workdir_lock.command_lock), then the undo guard, and opens the Checkpointer of
<workdir>/checkpoints and the MetricWriter of <workdir>. On the way out, whatever
happens, it waits for the saves in flight and closes both, restores the signal
handlers and releases the lock; except after a KeyboardInterrupt (a second Ctrl-C): a
save in flight is then abandoned, not waited for, and the command ends the process at
once (preemption.exit_at_once_on_interrupt), leaving that save unfinished: the rerun
sets it aside and resumes from the last complete checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable, Iterator, NamedTuple, Optional

import jax

from t5x_like.checkpoint import Checkpointer
from t5x_like.fs import resolve_path
from t5x_like.host_loss import peer_loss
from t5x_like.train.metrics import MetricWriter
from t5x_like.train.preemption import Preemption
from t5x_like.train.setup_guard import undo_on_user_error
from t5x_like.train.workdir_lock import WorkdirLock


class Start(NamedTuple):
  """Where a run starts: step 0 and a fresh state, or its latest checkpoint."""
  step: int
  state: Any
  shardings: Any  # of the train state
  extra: Optional[dict]  # the checkpoint's extra (None: a fresh start)
  finished: bool = False  # the checkpoint is at total_steps: the run had ended


@dataclasses.dataclass
class Run:
  """The open run: its workdir (a local path or a URL, resolved), checkpointer, metric
  writer, and once started its Preemption (SIGTERM / SIGINT as a request to stop)."""
  workdir: str
  total_steps: int
  checkpointer: Checkpointer
  writer: MetricWriter
  setup: Any  # train/setup_guard.py: done() once the workdir holds a run
  preemption: Optional[Preemption] = None
  abandoned: bool = False  # a KeyboardInterrupt: the way out waits for no save

  def set_total_steps(self, total_steps: int) -> None:
    """The run's length, where it is known only after open_run (fine-tuning's
    train.epochs count the rows read); before start(), which compares a checkpoint's step
    with it."""
    self.total_steps = self.writer.total_steps = int(total_steps)

  def start(self, abstract_state, create: Callable[[], tuple]) -> Start:
    """The latest checkpoint restored into `abstract_state`'s shardings, or
    create() -> (state, shardings) when there is none. Drops the metric rows after it
    (those of steps about to be redone), says "resumed from step N" (or that the run
    had already finished), and installs the signal handlers."""
    restored = self.checkpointer.restore_latest(abstract_state)
    self.setup.done()  # the workdir holds a run: from here nothing is undone
    if restored is None:
      state, shardings = create()
      start = Start(0, state, shardings, None)
      self.writer.truncate_after(0)  # rows of a run killed before its first checkpoint
    else:
      step, state, extra = restored
      start = Start(step, state, jax.tree.map(lambda x: x.sharding, abstract_state), extra,
                    finished=step >= self.total_steps)
      if start.finished:
        self.writer.log(f"{self.workdir}: the run already finished at step {step}")
      else:
        self.writer.truncate_after(step)  # rows of steps after it are about to be redone
        self.writer.log(f"resumed from step {step}")
    self.preemption = Preemption()
    return start

  def _close(self) -> None:
    """Waits for the saves in flight (unless abandoned) and closes the files; then the
    previous signal handlers are back. A KeyboardInterrupt while waiting (the second
    Ctrl-C during a save) abandons the save."""
    try:
      try:
        if not self.abandoned:
          self.checkpointer.wait()
          self.checkpointer.close()
      except KeyboardInterrupt:
        self.abandoned = True
        raise
      finally:
        self.writer.close()
    finally:
      if self.preemption is not None:
        self.preemption.restore()


@contextlib.contextmanager
def open_run(workdir, *, total_steps: int, keep: Optional[int], async_save: bool,
             lock: Optional[WorkdirLock] = None) -> Iterator[Run]:
  """The Run of `workdir` (a local path, relative or absolute, or a URL such as
  gs://...); see the module docstring.

  lock: the WorkdirLock of this workdir that the caller holds (and releases), e.g. the
  command's, taken before jax was imported; None takes it here (process 0 only).
  """
  workdir_path = resolve_path(workdir, "workdir")
  workdir = os.fspath(workdir_path)
  is_main = jax.process_index() == 0
  with contextlib.ExitStack() as stack:
    if lock is None:
      stack.enter_context(WorkdirLock(workdir_path, enabled=is_main))
    elif lock.workdir != workdir:
      raise ValueError(f"open_run: the lock given is of {lock.workdir}, not {workdir}")
    # The lock first: a refused lock must not undo the holder's files.
    setup = stack.enter_context(undo_on_user_error(workdir_path, enabled=is_main))
    run = Run(workdir, total_steps,
              Checkpointer(os.path.join(workdir, "checkpoints"), keep=keep,
                           async_save=async_save),
              MetricWriter(workdir, total_steps=total_steps, is_main_process=is_main), setup)
    try:
      yield run
    except KeyboardInterrupt:
      run.abandoned = True  # a second Ctrl-C: stop now, without saving
      raise
    except Exception as error:
      if peer_loss.from_exception(error, jax.process_index(), jax.process_count()):
        # A peer process is gone: a save in flight waits for it in barriers that never
        # end. Stop without it (exit 75 next, host_loss/peer_guard.py); a rerun sets the unsealed
        # step aside.
        run.abandoned = True
      raise
    finally:
      run._close()  # pylint: disable=protected-access
