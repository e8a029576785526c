"""What a multi-host run's survivors say when a peer process is lost, and how they know.

A pod loses a host (a maintenance event, a preempted VM, an OOM kill); the processes left
cannot go on (every step is a collective over all of them) and must stop so that a
launcher can rerun every worker, which resumes from the last checkpoint all processes
committed. They learn it one of three ways, each recognised here from its text:

  a collective fails           gloo (the CPU backend): "Connection closed by peer" (or
                               the dead peer's bytes read as the wrong collective's,
                               which gloo ends in C++), at once, in a process that was
                               talking to the dead one
  the coordinator is gone      process 0 hosts jax's coordination service: every other
                               process's client fails its next RPC ("Failed to send RPC
                               to coordination service") and jax aborts it in C++
  heartbeats stop              the coordination service misses a process's heartbeats
                               for --peer_timeout seconds and tells every other process
                               ("The following tasks are unhealthy (stopped sending
                               heartbeats):" and the ids), which jax aborts in C++

The survivors print `lost_peer_line` and exit EXIT_PEER_LOST (75). peer_guard.py turns
jax's C++ abort (a page of log and stack on stderr, SIGABRT) into that line.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple, Optional

from t5x_like.errors import EXIT_PEER_LOST

__all__ = ["PeerLoss", "lost_peer_line", "from_text", "from_exception",
           "last_committed_step"]

# jax's C++ warning/error/fatal log lines (glog format) from the coordination service,
# its clients and the preemption notice poller:
# "E1127 05:57:16.740928   10314 coordination_service.cc:1549] ..."
COORDINATION_LOG_LINE = re.compile(
    rb"^[WEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ "
    rb"(?:coordination\w*|client|service|preemption\w*)\.(?:cc|h):\d+\]"
    # gloo's own end: an exception of its TCP transport that nothing caught.
    rb"|^terminate called after throwing an instance of 'gloo::")
_UNHEALTHY = re.compile(r"stopped sending heartbeats\):\s*\n?((?:\s*\d+[,\s]*)+)")
_TASK_TIMEOUT = re.compile(r"Task (\d+) heartbeat timeout")
_COORDINATOR_GONE = ("Failed to send RPC to coordination service",
                     "leader task was preempted/died")
# gloo's TCP transport: a peer's socket closed, or (seen on a survivor when the other
# process was SIGKILLed mid-collective) bytes of the dead peer's next collective read
# as this one's. Both only after a process died; a real mismatch of collectives would
# fail every multi-process run (tests/test_train.py runs one).
_COLLECTIVE_BROKEN = re.compile(
    r"(?:Gloo \w+ failed: |gloo/transport/tcp/pair\.cc:\d+\] ).*?(Connection closed by peer|"
    r"Connection reset by peer|Broken pipe|Received data size doesn't match expected size)")


class PeerLoss(NamedTuple):
  """lost: the lost process's index (None when the message does not say); how: why this
  process knows ('heartbeat', 'the coordinator stopped answering', 'collective failed:
  ...')."""
  lost: Optional[int]
  how: str


def lost_peer_line(command: str, loss: PeerLoss, last_step: Optional[int],
                   checkpoints_known: bool = True) -> str:
  """The one line a survivor prints on stderr before exiting 75. checkpoints_known:
  whether `last_step` was read from the run's checkpoint directory (a command with
  several, finetune-suite, names none)."""
  who = "another process" if loss.lost is None else f"process {loss.lost}"
  step = "none (a rerun starts over)" if last_step is None else f"step {last_step}"
  return (f"{command}: lost contact with {who} ({loss.how});"
          + (f" last committed checkpoint: {step};" if checkpoints_known else "")
          + f" exit {EXIT_PEER_LOST}: rerun on every worker to resume")


def from_text(text: str, process_id: int, num_processes: int) -> Optional[PeerLoss]:
  """The peer loss that `text` (an error message, or jax's log on stderr) reports, or None
  when it reports none. `process_id`, `num_processes`: this process and the run's size
  (a broken collective in a 2-process run can only mean the other one)."""
  match = _UNHEALTHY.search(text)
  if match:
    ids = [int(x) for x in re.findall(r"\d+", match.group(1))]
    others = [i for i in ids if i != process_id] or ids
    return PeerLoss(others[0] if others else None, "heartbeat")
  match = _TASK_TIMEOUT.search(text)
  if match:
    return PeerLoss(int(match.group(1)), "heartbeat")
  if any(marker in text for marker in _COORDINATOR_GONE) and process_id != 0:
    return PeerLoss(0, "the coordinator stopped answering")
  match = _COLLECTIVE_BROKEN.search(text)
  if match:
    other = 1 - process_id if num_processes == 2 else None
    return PeerLoss(other, f"collective failed: {match.group(1).lower()}")
  return None


def from_exception(error: BaseException, process_id: int,
                   num_processes: int) -> Optional[PeerLoss]:
  """`from_text` over an exception and the ones it was raised from or during."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    loss = from_text(str(error), process_id, num_processes)
    if loss is not None:
      return loss
    error = error.__cause__ or error.__context__
  return None


def last_committed_step(directory) -> Optional[int]:
  """The newest step of checkpoint `directory` that every process finished (orbax's
  commit marker and every process's checksums: checkpoint/integrity.py), or None."""
  from etils import epath
  from t5x_like.checkpoint import integrity
  if directory is None:
    return None
  path = epath.Path(os.fspath(directory))
  try:
    steps = sorted((int(p.name) for p in path.iterdir()
                    if integrity.STEP_NAME.match(p.name)), reverse=True)
  except OSError:
    return None
  for step in steps:
    try:
      if integrity.is_finished(path / str(step)):
        return step
    except (OSError, integrity.CorruptCheckpointError):
      continue
  return None
