"""One trainer per workdir: a second `t5x-like train` on a workdir in use stops at once
with a message naming the holder (process id, host, start time).

  with WorkdirLock(workdir, enabled=jax.process_index() == 0):
    ...  # train

Local workdirs: <workdir>/workdir.lock is held with fcntl.flock. The kernel releases it
when the holder exits however it exits (kill -9 included), so a lock left by a killed
process is taken over at once and without a race; the file only carries the holder's
details for the message. flock works on local disks and on NFS (Linux emulates it with
POSIX locks there); a filesystem without flock falls back to the protocol below.

URL workdirs (gs://, s3://, ...) have no flock. The lock is an object created with
create-if-absent semantics, holding the holder's details, a random token and a
heartbeat that a daemon thread rewrites every `heartbeat_seconds`. It is stale when the
heartbeat is older than `stale_seconds`, or at once when its holder ran on this machine
(same boot and process namespace) and is gone. A stale lock is taken over through a
marker object named after its token, which only one contender can create; the winner
checks the lock still carries that token, then overwrites it. Limits:
- create-if-absent is atomic on gcsfs (a generation-0 precondition), s3fs
  (If-None-Match) and local files; elsewhere two starts in the same instant may both win;
- staleness compares the holder's clock with the reader's: clocks must agree to well
  under `stale_seconds` (NTP does);
- after a kill -9 on another machine the next trainer is refused until the heartbeat is
  `stale_seconds` old (the message says when);
- a holder stalled longer than `stale_seconds` (no heartbeat) can lose the lock; its
  heartbeat thread then sees another token, stops, sets `lost` and says so on stderr
  (check() raises). A heartbeat is a read then a write, not one atomic operation.

Release (the end of the `with`, also on an exception) removes the lock file or object,
and the workdir itself when the lock created it and it is empty.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import secrets
import socket
import sys
import threading
import time
from typing import Iterator, Optional

from t5x_like import fs
from t5x_like.errors import UserError

LOCK_NAME = "workdir.lock"
HEARTBEAT_SECONDS = 15.0
STALE_SECONDS = 90.0
# flock errors that mean "this filesystem cannot lock", not "someone holds it".
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class WorkdirLockedError(UserError):
  """Another trainer holds the workdir; the message names it and what to do."""


class WorkdirLockLostError(RuntimeError):
  """Another process took over this process's (stale-looking) URL lock."""


def _utc(seconds: float) -> str:
  return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime(
      "%Y-%m-%d %H:%M:%S UTC")


def _read_text(path: str) -> Optional[str]:
  try:
    return fs.read_bytes(path).decode("utf-8", errors="replace")
  except FileNotFoundError:
    return None


def _machine() -> Optional[str]:
  """This boot of this machine and its process namespace: two processes with the same
  value see the same pids (Linux; None elsewhere)."""
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      boot = f.read().strip()
    return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
  except OSError:
    return None


def _process_start(pid: int) -> Optional[str]:
  """The process's start time in clock ticks since boot (None if there is no such
  process): with the pid, it names one process even after the pid is reused."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _holder_gone(holder: dict) -> bool:
  """True when the holder ran in this machine's pid space and is no longer running."""
  machine = _machine()
  if machine is None or holder.get("machine") != machine or "pid" not in holder:
    return False
  return _process_start(int(holder["pid"])) != holder.get("process_start")


class WorkdirLock:
  """Holds <workdir>/workdir.lock while the `with` block runs (see the module docstring).

  workdir: a local path or a URL. enabled: False (processes other than 0 of a multi-host
  run) makes acquire and release do nothing. acquire() raises WorkdirLockedError when
  another process holds the lock. After acquire, `previous` is the details of a stale
  holder that this process took over from (None if the lock was free).
  """

  def __init__(self, workdir: fs.PathLike, *, enabled: bool = True,
               heartbeat_seconds: float = HEARTBEAT_SECONDS,
               stale_seconds: float = STALE_SECONDS):
    self.workdir = os.fspath(fs.resolve_path(workdir, "workdir"))
    self.remote = fs.is_url(self.workdir)
    self.path = (f"{self.workdir.rstrip('/')}/{LOCK_NAME}" if self.remote
                 else os.path.join(self.workdir, LOCK_NAME))
    self.enabled = enabled
    self.heartbeat_seconds, self.stale_seconds = heartbeat_seconds, stale_seconds
    self.previous: Optional[dict] = None
    self.lost = False
    self._fd: Optional[int] = None
    self._info: Optional[dict] = None
    self._created_workdir = False
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None

  @property
  def held(self) -> bool:
    return self._info is not None

  # ------------------------------------------------------------------ acquire
  def acquire(self) -> "WorkdirLock":
    """Takes the lock or raises WorkdirLockedError at once; returns self."""
    if not self.enabled or self.held:
      return self
    self.previous = None
    now = time.time()
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": now,
            "heartbeat": now, "token": secrets.token_hex(8), "machine": _machine(),
            "process_start": _process_start(os.getpid()),
            "command": " ".join(sys.argv)[:500]}
    if not self.remote:
      self._created_workdir = not os.path.isdir(self.workdir)
      fs.make_dirs(self.workdir)
      if self._acquire_flock(info):
        self._info = info
        return self
    self._acquire_object(info)
    self._info = info
    self._stop, self.lost = threading.Event(), False
    self._thread = threading.Thread(target=self._beat, name="workdir-lock-heartbeat",
                                    daemon=True)
    self._thread.start()
    return self

  def _acquire_flock(self, info: dict) -> bool:
    """flock on the local lock file; False when the filesystem has no flock."""
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        os.close(fd)
        raise self._locked_error(self._holder_details(), heartbeat=False) from None
      except OSError as e:
        if e.errno in _NO_FLOCK:
          if os.fstat(fd).st_size == 0:  # made by this open: not a lock of the fallback
            fs.remove(self.path)
          os.close(fd)
          return False
        os.close(fd)
        raise
      # A releaser unlinks the file before unlocking it: a lock won on an unlinked file
      # (opened before the unlink) locks nothing; try again on the current file.
      try:
        same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
      except FileNotFoundError:
        same = False
      if not same:
        os.close(fd)
        continue
      old = os.pread(fd, 1 << 16, 0)
      if old.strip():
        self.previous = _parse(old.decode("utf-8", errors="replace"))
      data = json.dumps(info).encode()
      os.ftruncate(fd, 0)
      os.pwrite(fd, data, 0)
      self._fd = fd
      return True

  def _holder_details(self) -> dict:
    """The holder's details from the lock file. A holder that took over from a killed
    one rewrites them just after winning: wait (1 s at most) for two equal reads
    20 ms apart that name a live process."""
    deadline, last = time.monotonic() + 1.0, None
    while True:
      holder = _parse(_read_text(self.path) or "")
      if (holder and holder == last and not _holder_gone(holder)
          or time.monotonic() > deadline):
        return holder
      last = holder
      time.sleep(0.02)

  def _acquire_object(self, info: dict) -> None:
    """Create-if-absent, else take over a stale lock, else WorkdirLockedError."""
    data = json.dumps(info).encode()
    for _ in range(5):
      try:
        fs.create_exclusive(self.path, data)
        return
      except FileExistsError:
        pass
      text = _read_text(self.path)
      if text is None:
        continue  # released in between
      holder = _parse(text)
      if not self._is_stale(holder):
        raise self._locked_error(holder)
      if self._take_over(holder, data):
        self.previous = holder
        return
    raise self._locked_error(_parse(_read_text(self.path) or ""))

  def _is_stale(self, holder: dict) -> bool:
    if _holder_gone(holder):
      return True
    beat = holder.get("heartbeat")
    if not isinstance(beat, (int, float)):  # unreadable: its age is the file's
      try:
        beat = fs.resolve_path(self.path).stat().mtime
      except (OSError, ValueError):
        return False
    return time.time() - beat > self.stale_seconds

  def _take_over(self, holder: dict, data: bytes) -> bool:
    """Replaces a stale lock; False if another process is taking it over."""
    marker = f"{self.path}.takeover-{holder.get('token', 'unknown')}"
    try:
      fs.create_exclusive(marker, json.dumps({"time": time.time()}).encode())
    except FileExistsError:
      # A contender killed mid-takeover leaves its marker: stale after the same time.
      started = _parse(_read_text(marker) or "").get("time")
      if isinstance(started, (int, float)) and time.time() - started > self.stale_seconds:
        fs.remove(marker)
      time.sleep(0.05)  # the other contender is mid-takeover: let it finish
      return False
    try:
      current = _parse(_read_text(self.path) or "")
      if current.get("token") != holder.get("token"):
        return False  # released or taken over since we read it
      fs.write_bytes(self.path, data)
      return True
    finally:
      fs.remove(marker)

  def _locked_error(self, holder: dict, heartbeat: bool = True) -> WorkdirLockedError:
    """The refusal, naming the holder; `heartbeat`: say when a stale lock frees up."""
    if holder.get("pid") is None:
      who = f"another process (its details in {self.path} are not readable)"
    else:
      who = f"process {holder['pid']} on host {holder.get('host', '?')}"
      if isinstance(holder.get("started"), (int, float)):
        who += f", started {_utc(holder['started'])}"
    msg = (f"workdir {self.workdir} is in use by another trainer: {who}. Wait for it to"
           " finish or stop it, or use another --workdir.")
    beat = holder.get("heartbeat")
    if heartbeat and isinstance(beat, (int, float)):
      age = time.time() - beat
      msg += (f" Its lock's last heartbeat was {age:.0f} s ago: if that process is gone,"
              f" a rerun takes the lock over once it is {self.stale_seconds:.0f} s old"
              f" (in {max(0.0, self.stale_seconds - age):.0f} s).")
    return WorkdirLockedError(msg)

  # -------------------------------------------------------------- heartbeat
  def _beat(self) -> None:
    """Refreshes the URL lock's heartbeat until release; stops if the lock was lost."""
    reported = False
    while not self._stop.wait(self.heartbeat_seconds):
      try:
        current = _parse(_read_text(self.path) or "")
        if current.get("token") != self._info["token"]:
          self.lost = True
          print(f"t5x-like: lost the workdir lock {self.path}: another process"
                f" ({current.get('pid')} on {current.get('host')}) took it over after this"
                " one's heartbeat stopped; two trainers may now write this workdir",
                file=sys.stderr, flush=True)
          return
        self._info["heartbeat"] = time.time()
        fs.write_bytes(self.path, json.dumps(self._info).encode())
        reported = False
      except Exception as e:  # pylint: disable=broad-except
        if not reported:  # a network hiccup: the next beat tries again
          print(f"t5x-like: could not refresh the workdir lock {self.path}: {e}",
                file=sys.stderr, flush=True)
          reported = True

  def check(self) -> None:
    """WorkdirLockLostError if another process took this process's lock over."""
    if self.lost:
      raise WorkdirLockLostError(f"another process took over the workdir lock {self.path}")

  # ------------------------------------------------------------------ release
  def release(self) -> None:
    """Removes the lock (and the workdir if the lock created it and it is empty)."""
    if not self.held:
      return
    if self._fd is not None:
      # Unlink while still locked: a waiter that opened this file finds it unlinked.
      fs.remove(self.path)
      os.close(self._fd)
      self._fd = None
    else:
      self._stop.set()
      if self._thread is not None:
        self._thread.join(timeout=60)  # a heartbeat may be mid-request
        self._thread = None
      try:
        current = _parse(_read_text(self.path) or "")
        if not self.lost and current.get("token") == self._info["token"]:
          fs.remove(self.path)
      except Exception as e:  # pylint: disable=broad-except
        print(f"t5x-like: could not remove the workdir lock {self.path}: {e}; it goes"
              f" stale {self.stale_seconds:.0f} s after its last heartbeat",
              file=sys.stderr, flush=True)
    self._info = None
    if self._created_workdir:
      try:
        os.rmdir(self.workdir)  # only if empty: a setup that failed leaves nothing
      except OSError:
        pass

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


@contextlib.contextmanager
def command_lock(fv) -> Iterator[Optional[WorkdirLock]]:
  """The workdir lock of a `train` / `finetune` command, taken from its flags
  (command_flags.lock_flags: fv.workdir and host_loss/distributed.py's flags, read before the
  config file is loaded) before jax is imported: a second trainer on the workdir is
  refused in a fraction of a second, not after the start-up. Pass it to the loop
  (open_run uses it and does not take another). fv None: no lock here.

  Process 0 holds it; the others of a multi-host run get a disabled one. With
  --distributed=auto no process knows its index before jax starts: None, and the loop
  takes it.
  """
  if fv is None or fv.distributed == "auto":
    yield None
    return
  with WorkdirLock(fv.workdir, enabled=fv.num_processes <= 1 or fv.process_id == 0) as lock:
    yield lock


def _parse(text: str) -> dict:
  """The holder's details; {} for an empty or half-written file."""
  try:
    value = json.loads(text)
  except json.JSONDecodeError:
    return {}
  return value if isinstance(value, dict) else {}
