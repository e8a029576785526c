"""Nothing half-written: a command that fails on a user error while setting up leaves
the workdir as it found it.

  with undo_on_user_error(workdir) as setup:
    ...                  # read the data, build the model, open checkpoints
    setup.done()         # the run has started: whatever happens now stays
    ...

A UserError raised before done() removes what appeared in the workdir meanwhile (the
workdir itself if this call created it; else only its new top-level entries) and
propagates. Other errors leave everything for a human to inspect.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from etils import epath

from t5x_like.errors import UserError


class _Setup:
  def __init__(self):
    self.finished = False

  def done(self) -> None:
    self.finished = True


@contextlib.contextmanager
def undo_on_user_error(workdir: epath.Path, enabled: bool = True) -> Iterator[_Setup]:
  """See the module docstring. enabled=False (non-main hosts) only yields."""
  setup = _Setup()
  existed = workdir.exists()
  before = {p.name for p in workdir.iterdir()} if existed and workdir.is_dir() else set()
  try:
    yield setup
  except UserError:
    if enabled and not setup.finished and workdir.is_dir():
      if not existed:
        workdir.rmtree()
      else:
        for entry in workdir.iterdir():
          if entry.name not in before:
            entry.rmtree() if entry.is_dir() else entry.unlink()
    raise
