"""Disk space for checkpoints: what a save needs, what is free, and a full disk told as
one line (the Checkpointer raises it as a CheckpointSpaceError, a UserError) once
orbax's threads are done with the unfinished save.

A save is refused before it writes anything when the filesystem under the checkpoints
directory has less free space than the state's arrays (uncompressed) plus a margin; a
disk that fills up anyway (another writer, compression guessed wrong) is recognised in
the error orbax or tensorstore raise, whatever type it has.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading
import time
from typing import Any, Optional

import jax
import numpy as np

from t5x_like import fs

MARGIN = 1 << 20  # orbax metadata, ocdbt manifests, checksums
_DISK_FULL_TEXT = ("No space left on device", "os_error_code='28'", "Disk quota exceeded")


def needed_bytes(state: Any, extra: dict) -> int:
  """About what a save of `state` writes over all hosts: every array once, uncompressed
  (ocdbt may compress: the estimate errs on the safe side), plus metadata."""
  arrays = sum(int(x.nbytes if hasattr(x, "nbytes") else np.asarray(x).nbytes)
               for x in jax.tree.leaves(state))
  return arrays + arrays // 50 + len(json.dumps(extra, default=str)) + MARGIN


def free_bytes(directory) -> Optional[int]:
  """Free bytes on the filesystem of local `directory`; None for a URL (an object store
  has no such number) or when it cannot be told."""
  if fs.is_url(directory):
    return None
  try:
    return shutil.disk_usage(os.fspath(directory)).free
  except OSError:
    return None


def is_disk_full(error: Optional[BaseException]) -> bool:
  """Whether `error` (or one it was raised from) is a full disk or quota."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    if any(text in str(error) for text in _DISK_FULL_TEXT):  # tensorstore: a ValueError
      return True
    error = error.__cause__ or error.__context__
  return False


def message(step: int, what: str, needed: int, free: Optional[int],
            resume_step: Optional[int]) -> str:
  """One line: the step, what happened where, the bytes needed and free, what to do."""
  have = f"{_size(free)} free" if free is not None else "free space unknown"
  resume = (f"resume from step {resume_step}" if resume_step is not None else
            "start over (no earlier checkpoint)")
  return (f"checkpoint step {step}: {what}: needs about {_size(needed)} ({needed:,} bytes),"
          f" {have}; earlier checkpoints are intact: free some space and rerun to {resume}")


def join_orbax_writers(timeout_s: float = 120.0) -> None:
  """Waits for orbax's save threads: a failed save stops waiting at its first failed
  write while the others run on (and would recreate a directory removed meanwhile)."""
  deadline = time.monotonic() + timeout_s
  for thread in threading.enumerate():
    if thread is not threading.current_thread() and (
        type(thread).__name__ == "_SignalingThread" or thread.name == "async_save"):
      threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))  # not its re-raise


def remove_unfinished(path, quiet_s: float = 1.0, timeout_s: float = 60.0) -> None:
  """Removes the directory `path` (an epath) of a failed save and keeps it removed:
  tensorstore's writes still in flight run in threads Python cannot join and may
  recreate their directories, so `path` is removed again until it stayed absent for
  `quiet_s` (at most `timeout_s` in all)."""
  deadline = time.monotonic() + timeout_s
  absent_since = None
  while time.monotonic() < deadline:
    if path.exists():
      absent_since = None
      try:
        path.rmtree()
      except OSError:  # a late write created or removed an entry meanwhile: again
        pass
    elif absent_since is None:
      absent_since = time.monotonic()
    elif time.monotonic() - absent_since >= quiet_s:
      return
    time.sleep(0.02)
  if path.exists():
    logging.getLogger("t5x_like.checkpoint").warning(
        "could not remove the unfinished checkpoint %s: writes kept recreating it", path)


class DropDiskFull(logging.Filter):
  """For absl's and asyncio's loggers: orbax's threads log a full disk as ERROR with
  tracebacks; the Checkpointer reports it once, as one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return not (is_disk_full(error)
                or any(text in record.getMessage() for text in _DISK_FULL_TEXT))


def _size(n: int) -> str:
  for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if n >= scale:
      return f"{n / scale:.1f} {unit}"
  return f"{n} bytes"
