"""What the supervisor (t5x_like/host_loss/supervisor.py) does when one worker of a multi-process
run ends, and the lines it logs: pure functions of exit statuses, no processes, no jax.

  decide(137)  -> RESTART   (stop the others, start every worker again)
  decide(2)    -> GIVE_UP   (stop the others, stop with that status)
  decide(0)    -> FINISHED  (this one is done; wait for the others)

The statuses are the trainer's contract (README, "Exit status"; t5x_like/errors.py)
plus what a dead process or host looks like from outside: a negative
Popen return code or 128 + N (killed by signal N), 134 (jax's C++ abort when the
coordination service loses a peer), 255 (ssh: the connection to the host was lost).
This module stays importable without jax or absl: the pod launchers run it on a laptop
(`python3 -m t5x_like.host_loss.supervisor`).
"""

from __future__ import annotations

import signal
from typing import Optional

from t5x_like.errors import (EXIT_FAILURE, EXIT_FINISHED, EXIT_INTERRUPTED, EXIT_JAX_ABORT,
                             EXIT_PEER_LOST, EXIT_SSH_LOST, EXIT_START_TIMEOUT,
                             EXIT_USER_ERROR)

RESTART, GIVE_UP, FINISHED = "restart", "give up", "finished"

# status -> (decision, why), for the statuses that are not "killed by signal N".
_KNOWN = {
    EXIT_FINISHED: (FINISHED, "finished"),
    EXIT_FAILURE: (GIVE_UP, "failure (a non-finite loss or a bug: see its log)"),
    EXIT_USER_ERROR: (GIVE_UP, "user error"),
    EXIT_INTERRUPTED: (GIVE_UP, "interrupted by Ctrl-C"),
    143: (RESTART, "stopped by SIGTERM, preempted"),
    EXIT_PEER_LOST: (RESTART, "a peer was lost"),
    EXIT_JAX_ABORT: (RESTART, "aborted by jax: a peer was lost"),
    EXIT_SSH_LOST: (RESTART, "ssh lost the host"),
    EXIT_START_TIMEOUT: (RESTART, "the processes did not all connect (--init_timeout)"),
}


def normalize(returncode: int) -> int:
  """The status a shell would report: Popen's -N (killed by signal N) becomes 128 + N."""
  return 128 - returncode if returncode < 0 else returncode


def _signal_name(status: int) -> Optional[str]:
  """'SIGKILL' for 137; None where status is not 128 + a signal number."""
  if not 128 < status < 128 + 65:
    return None
  try:
    return signal.Signals(status - 128).name
  except ValueError:
    return f"signal {status - 128}"


def decide(returncode: int) -> str:
  """RESTART, GIVE_UP or FINISHED for a worker that ended with `returncode` (a Popen
  return code or a shell status). Unknown statuses give up: rerunning a bug we cannot
  name would only repeat it."""
  status = normalize(returncode)
  if status in _KNOWN:
    return _KNOWN[status][0]
  if _signal_name(status):  # killed from outside (OOM killer, a lost VM): rerun
    return RESTART
  return GIVE_UP


def reason(returncode: int) -> str:
  """Why a worker ended: 'killed by SIGKILL', 'user error', 'a peer was lost'."""
  status = normalize(returncode)
  if status in _KNOWN:
    return _KNOWN[status][1]
  name = _signal_name(status)
  return f"killed by {name}" if name else "unknown status: a failure"


def describe(returncode: int) -> str:
  """'137 (killed by SIGKILL)', '2 (user error)', '75 (a peer was lost)'."""
  return f"{normalize(returncode)} ({reason(returncode)})"


def first_cause(ended: list[tuple[int, int]]) -> tuple[int, int]:
  """Of the (process, return code) that ended in the same poll, the one to name: a
  status that is not a consequence of another's death (75, 134, 3 follow a lost peer)
  first, then the lowest process index."""
  consequences = {EXIT_PEER_LOST, EXIT_JAX_ABORT, EXIT_START_TIMEOUT}
  return min(ended, key=lambda e: (normalize(e[1]) in consequences, e[0]))


def resume_text(step: Optional[int], known: bool = True) -> str:
  """How a restart resumes, from the workdir's last committed step."""
  if not known:
    return "resuming from the last committed checkpoint"
  if step is None:
    return "no committed checkpoint yet: starting from step 0"
  return f"resuming from step {step}"


def restart_line(restart: int, max_restarts: int, process: int, returncode: int,
                 resume: str) -> str:
  """`supervisor: restart 2/5: process 1 exited 137 (killed by SIGKILL); resuming from
  step 20`."""
  return (f"supervisor: restart {restart}/{max_restarts}: process {process} exited"
          f" {describe(returncode)}; {resume}")


def finished_line(processes: int, restarts: int) -> str:
  return (f"supervisor: finished: all {processes} processes exited 0"
          f" ({restarts} restart{'' if restarts == 1 else 's'})")


def gave_up_line(process: int, returncode: int) -> str:
  """`supervisor: gave up: process 0 exited 2: user error, not restarting`."""
  return (f"supervisor: gave up: process {process} exited {normalize(returncode)}:"
          f" {reason(returncode)}, not restarting")


def out_of_restarts_line(max_restarts: int, process: int, returncode: int,
                         step: Optional[int], known: bool = True) -> str:
  """`supervisor: out of restarts (5 used): process 1 exited 137 (killed by SIGKILL);
  not restarting (last committed step: 20)`."""
  last = (f"last committed step: {step}" if step is not None else
          "no committed checkpoint" if known else "last committed step: unknown")
  return (f"supervisor: out of restarts ({max_restarts} used): process {process} exited"
          f" {describe(returncode)}; not restarting ({last})")


def interrupted_line(signal_name: str) -> str:
  return f"supervisor: stopped by {signal_name}: every process was stopped (a rerun resumes)"


def exit_status(returncode: int) -> int:
  """The supervisor's own exit status when it stops for `returncode` (0..255)."""
  return normalize(returncode) & 0xFF
