"""Survivors of a lost peer stop with one line and exit 75, also when jax aborts them in C++.

  guard(command, process_id=..., num_processes=..., checkpoint_dir=..., debug=...)

called by each process of a multi-host run before jax.distributed starts (distributed.py).
It forks. The child returns and runs the command, its stderr a pipe to the parent; the
parent stays the process that launchers see (same PID, same exit status) and only:
  - forwards the child's stderr as it comes, holding back jax's coordination-service
    error lines (peer_loss.COORDINATION_LOG_LINE and what follows: the message, then the
    "Check failure stack trace") until the child either dies or lives on HOLD_SECONDS;
  - forwards SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2 to the child (which has a process
    group of its own, so a terminal's Ctrl-C reaches it once, through the parent); a
    SIGKILL of the parent kills the child too (PR_SET_PDEATHSIG);
  - when the child ends, mirrors how it ended (its exit status, or the signal that
    killed it), except when the held-back lines report a lost peer (peer_loss.from_text):
    then it prints peer_loss.lost_peer_line and exits 75 (the held lines only with
    --debug).
Why a second process: when the coordinator (process 0) dies, jax aborts every other
process from a C++ thread within a second (LOG(FATAL): the page of log, then SIGABRT),
and its Python callback for that (missed_heartbeat_callback) cannot be used from Python
in this jax. Nothing inside the process can then still print a line or choose the exit
status; its parent can.

In the child, an uncaught exception that reports a lost peer (gloo's "Connection closed
by peer" in a collective, a coordination-service barrier failing on a dead process)
prints the same line and exits 75 at once, without a traceback (with one under --debug)
and without waiting in jax's shutdown barrier for the dead process.
T5X_LIKE_PEER_GUARD=0 turns the fork off (the excepthook stays).
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import time
from typing import Optional

from t5x_like.host_loss import peer_loss
from t5x_like.errors import EXIT_PEER_LOST

GUARD_ENV = "T5X_LIKE_PEER_GUARD"
HOLD_SECONDS = 10.0  # held-back coordination lines of a child that lives on are shown then
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                     signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1


class StderrFilter:
  """The parent's view of the child's stderr: what to forward now and what to hold.

  feed(data, now) -> bytes to write at once. Complete lines pass unless they are a
  coordination-service error line or come after one (held; with hold=False they pass
  too). A line still being written passes at once (a progress bar's carriage-return
  updates) unless it may be the start of such a line. release_due(now) -> the held bytes
  once `hold_seconds` passed and the child still runs (the lines were not its end).
  `seen` keeps the last TAIL_BYTES of everything fed, to tell why the child ended.
  """

  TAIL_BYTES = 1 << 16

  def __init__(self, hold_seconds: float = HOLD_SECONDS, hold: bool = True):
    self.held = self.seen = b""
    self._pending = b""
    self._hold_since: Optional[float] = None
    self._hold_seconds, self._hold = hold_seconds, hold

  def feed(self, data: bytes, now: float) -> bytes:
    self.seen = (self.seen + data)[-self.TAIL_BYTES:]
    self._pending += data
    out = []
    *lines, self._pending = self._pending.split(b"\n")
    for line in lines:
      line += b"\n"
      if (self._hold and self._hold_since is None
          and peer_loss.COORDINATION_LOG_LINE.match(line)):
        self._hold_since = now
      if self._hold_since is not None:
        self.held += line
      else:
        out.append(line)
    if self._pending and self._hold_since is None and not _may_start_log_line(self._pending):
      out.append(self._pending)
      self._pending = b""
    return b"".join(out)

  def release_due(self, now: float) -> bytes:
    if self._hold_since is None or now - self._hold_since < self._hold_seconds:
      return b""
    released, self.held, self._hold_since = self.held, b"", None
    return released

  def rest(self) -> bytes:
    """Everything not yet written (held lines and an unfinished last line)."""
    rest, self.held, self._pending = self.held + self._pending, b"", b""
    return rest


def _may_start_log_line(text: bytes) -> bool:
  """Whether an unfinished line may become a glog line ('E1127 05:57:16.74...')."""
  return text[:1] in (b"W", b"E", b"F") and (len(text) == 1 or text[1:5].isdigit())


def outcome(status: int, seen: bytes, command: str, process_id: int, num_processes: int,
            checkpoint_dir) -> tuple[int, Optional[str]]:
  """(exit status for the parent, the one line to print or None) for a child that ended
  with wait status `status`, the end of its stderr `seen`. A negative exit
  status -N means: end by signal N, as the child did."""
  if os.WIFSIGNALED(status):
    code = -os.WTERMSIG(status)
  else:
    code = os.WEXITSTATUS(status)
  if code in (0, EXIT_PEER_LOST):
    return code, None
  loss = peer_loss.from_text(seen.decode(errors="replace"), process_id, num_processes)
  if loss is None:
    return code, None
  return EXIT_PEER_LOST, peer_loss.lost_peer_line(
      command, loss, peer_loss.last_committed_step(checkpoint_dir), checkpoint_dir is not None)


def guard(command: str, *, process_id: int, num_processes: int, checkpoint_dir,
          debug: bool) -> None:
  """Installs the excepthook; forks unless T5X_LIKE_PEER_GUARD=0 (see the module
  docstring). Returns in the child; the parent never returns."""
  _install_excepthook(command, process_id, num_processes, checkpoint_dir, debug)
  if os.environ.get(GUARD_ENV) == "0":
    return
  sys.stdout.flush()
  sys.stderr.flush()
  read_end, write_end = os.pipe()
  parent = os.getpid()
  child = os.fork()
  if child == 0:
    os.close(read_end)
    os.dup2(write_end, 2)
    os.close(write_end)
    os.setpgid(0, 0)
    try:
      ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: a killed parent leaves the child
      pass
    if os.getppid() != parent:  # the parent died before prctl took effect
      os._exit(1)  # pylint: disable=protected-access
    return
  os.close(write_end)
  _watch_child(child, read_end, command, process_id, num_processes, checkpoint_dir, debug)


def _watch_child(child: int, read_end: int, command: str, process_id: int,
                 num_processes: int, checkpoint_dir, debug: bool) -> None:
  for signum in FORWARDED_SIGNALS:
    signal.signal(signum, lambda s, _, child=child: _forward(child, s))
  stderr = sys.stderr.fileno()
  filt = StderrFilter(hold=not debug)
  ends_line = [True]  # whether what was written last ended a line

  def write(data: bytes) -> None:
    if data:
      _write(stderr, data)
      ends_line[0] = data.endswith((b"\n", b"\r"))

  status, timeout = None, 1.0
  while True:
    ready, _, _ = select.select([read_end], [], [], timeout)
    if ready:
      data = os.read(read_end, 65536)
      if not data:
        break
      write(filt.feed(data, time.monotonic()))
    elif status is not None:  # the child is gone and its stderr drained
      break
    write(filt.release_due(time.monotonic()))
    if status is None:
      # A process the child started (a data worker) may keep the pipe open past the
      # child's end: its end is what counts.
      ended, wait_status = os.waitpid(child, os.WNOHANG)
      if ended:
        status, timeout = wait_status, 0.2
  if status is None:
    _, status = os.waitpid(child, 0)
  held = filt.rest()
  code, line = outcome(status, filt.seen, command, process_id, num_processes, checkpoint_dir)
  if line is None or debug:
    write(held)
  if line is not None:
    write((b"" if ends_line[0] else b"\n") + (line + "\n").encode())
  sys.stdout.flush()
  if code < 0:  # the child was killed: so is the parent, by the same signal
    if -code != signal.SIGKILL:
      signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
    code = 128 - code
  os._exit(code)  # pylint: disable=protected-access


def _forward(child: int, signum: int) -> None:
  try:
    os.kill(child, signum)
  except ProcessLookupError:
    pass


def _write(fd: int, data: bytes) -> None:
  while data:
    try:
      data = data[os.write(fd, data):]
    except OSError:  # the reader of our stderr is gone: nothing more to show
      return


def _install_excepthook(command: str, process_id: int, num_processes: int, checkpoint_dir,
                        debug: bool) -> None:
  """An uncaught exception that reports a lost peer: the one line and exit 75 at once."""
  previous = sys.excepthook

  def on_exception(kind, error, traceback):
    loss = peer_loss.from_exception(error, process_id, num_processes)
    if loss is None:
      previous(kind, error, traceback)
      return
    if debug:
      previous(kind, error, traceback)
    line = peer_loss.lost_peer_line(command, loss,
                                    peer_loss.last_committed_step(checkpoint_dir),
                                    checkpoint_dir is not None)
    print(("\n" if _progress_bar_open() else "") + line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_PEER_LOST)  # pylint: disable=protected-access

  sys.excepthook = on_exception


def _progress_bar_open() -> bool:
  """Whether a tqdm bar (train/metrics.py) may have left stderr mid-line."""
  tqdm = sys.modules.get("tqdm")
  return bool(tqdm and getattr(getattr(tqdm, "tqdm", None), "_instances", None))
