"""Errors a user can make and fix, and how every `t5x-like` command reports them.

A `UserError` (a config key or value, a missing file, a data source that yields
nothing, a checkpoint directory, a locked workdir, a full disk) is printed by the
command as one or two lines naming the key, file or path, with exit status 2 and no
traceback (`t5x-like --debug ...` shows it). Anything else is a bug or a failure of
the machine: a traceback and exit status 1.

The exit statuses of every command and process live here, below everything (README,
"Exit status"): the trainer returns them, the peer guard and the start-up watchdog exit
with them, the supervisor (host_loss/restart_policy.py) reads them. Standard library
only: the supervisor runs on a laptop without jax.
"""

from __future__ import annotations

EXIT_FINISHED = 0  # trained to the end (now or before)
EXIT_FAILURE = 1  # e.g. a non-finite loss, a crash
EXIT_USER_ERROR = 2  # a UserError: one line naming the key, file or path
EXIT_START_TIMEOUT = 3  # the processes of a multi-host run did not all connect in time
EXIT_PEER_LOST = 75  # another process of a multi-host run was lost (EX_TEMPFAIL): rerun
#   every worker; the run resumes from the last checkpoint every process committed
EXIT_INTERRUPTED = 130  # a second Ctrl-C: stopped at once, without saving
EXIT_JAX_ABORT = 134  # SIGABRT: jax's coordination service aborts a survivor
EXIT_SSH_LOST = 255  # ssh (and gcloud's ssh): the connection or the host went away
# A run stopped by a signal after saving exits 128 + its number (train/preemption.py).


class UserError(Exception):
  """A mistake the user can fix; the message names the key, file or path."""


class NonFiniteLossError(RuntimeError):
  """Training's loss became NaN or infinite (a failure, exit status 1); the message
  names the step."""
