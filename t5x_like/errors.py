"""Errors a user can make and fix, and how every `t5x-like` command reports them.

A `UserError` (a config key or value, a missing file, a data source that yields
nothing, a checkpoint directory, a locked workdir, a full disk) is printed by the
command as one or two lines naming the key, file or path, with exit status 2 and no
traceback (`t5x-like --debug ...` shows it). Anything else is a bug or a failure of
the machine: a traceback and exit status 1.
"""

from __future__ import annotations

USER_ERROR_EXIT = 2


class UserError(Exception):
  """A mistake the user can fix; the message names the key, file or path."""


class NonFiniteLossError(RuntimeError):
  """Training's loss became NaN or infinite (a failure, exit status 1); the message
  names the step."""
