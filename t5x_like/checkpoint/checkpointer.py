"""Checkpoints: async orbax saves, keep the last K, checksums, resume past bad steps.

Each step directory `<directory>/<step>/` holds two items:
  state/  any pytree of jax arrays (sharded or not); every host writes its own shards.
  extra/  a small JSON dict written by process 0: the data iterator state, a config
          hash, ... It must be the same on every host (t5x_like's loader state is).
and, once orbax has committed it, `checksums.process_<k>.json`: every file's sha256,
each host hashing the files it wrote (see integrity.py). Restoring takes an
abstract state whose leaves carry the target shardings, so a checkpoint saved on one mesh
restores onto any other (or onto one device).

A step is partial when orbax's commit marker, an item directory or a checksum manifest
is missing, and corrupt when a file differs from its checksum or reading it fails on any
host. `restore_latest` logs a warning naming the step, the file and why, and tries the
previous step; the bad directory is renamed aside to `<step>.corrupt-<ns>` (kept intact
for a human; a later save of that step does not collide). Unfinished saves
(`<step>.orbax-checkpoint-tmp*`) are never listed, and deleted only by orbax saving that
very step again or when a full disk interrupted them. Anything else in the directory is
not ours: left alone and reported, and refused outright when it has a step's name (a
save would collide with it).
Multi-host, every host checks the same directory and the hosts agree (allgathers) on
the steps listed and on each verdict, so a step that one host sealed and another did not
(a host lost mid-save) is skipped by all; steps past `keep` are deleted only once every
host has sealed the newer one, so the step before is still there.
Before each save the free space is compared with what the save writes: a full disk is a
one-line CheckpointSpaceError, never a half-written step in place of a good one.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from typing import Any, NamedTuple, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from t5x_like import failpoints, fs
from t5x_like.checkpoint import integrity, space
from t5x_like.checkpoint.read_leftovers import quiet_read_leftovers
from t5x_like.errors import UserError
from t5x_like.checkpoint.integrity import (  # noqa: F401  (the public names)
    COMMIT_MARKER, EXTRA, STATE, TMP_MARKER, CheckpointDirectoryError, CorruptCheckpointError,
    PartialCheckpointError)
from t5x_like.checkpoint.shapes import saved_shapes, wanted_shapes

log = logging.getLogger("t5x_like.checkpoint")  # one logger for checkpoint warnings

CORRUPT_MARKER = ".corrupt-"
_SEAL_TIMEOUT_MS = 1200 * 1000  # as orbax's own save barriers: a host hashing its share
_SEAL_BARRIERS = itertools.count()  # every host saves in the same order: same keys
_DROP_DISK_FULL = space.DropDiskFull()

__all__ = ["Checkpointer", "Restored", "CorruptCheckpointError", "PartialCheckpointError",
           "IncompatibleCheckpointError", "CheckpointNotFoundError", "CheckpointSpaceError",
           "CheckpointDirectoryError", "saved_shapes", "wanted_shapes"]


class Restored(NamedTuple):
  step: int
  state: Any
  extra: dict


class IncompatibleCheckpointError(UserError, ValueError):
  """A readable checkpoint whose arrays do not match the abstract state asked for."""


class CheckpointNotFoundError(UserError, FileNotFoundError):
  """No checkpoint (or not the step asked for) where a command was told to read one."""


class CheckpointSpaceError(UserError):
  """Not enough free disk for a checkpoint; the earlier checkpoints are intact."""


class Checkpointer:
  """An orbax CheckpointManager over `directory` (a local path, relative or absolute, or
  gs://...).

  keep: how many of the newest steps to keep (None keeps all).
  async_save: write in a background thread; `save` returns once arrays are on host.
  Every method is called on every host. CheckpointDirectoryError when `directory` holds
  an entry with a step's name that no Checkpointer wrote.
  """

  def __init__(self, directory, *, keep: Optional[int] = 3, async_save: bool = True):
    if keep is not None and keep < 1:
      raise ValueError(f"Checkpointer: keep must be >= 1 or None, got {keep}")
    self.directory = fs.resolve_path(directory, "checkpoint directory")  # orbax: absolute
    self.keep, self._async = keep, async_save
    integrity.check_entries(self.directory)
    for logger in ("absl", "asyncio"):  # orbax's threads; its futures left unretrieved
      logging.getLogger(logger).addFilter(_DROP_DISK_FULL)
    options = ocp.CheckpointManagerOptions(
        # No preservation policy: steps past `keep` go once the new step is sealed (its
        # checksums written), not when orbax commits it.
        enable_async_checkpointing=async_save,
        # Another process (an eval job) may be mid-save here: never delete tmp dirs.
        cleanup_tmp_directories=False)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=(STATE, EXTRA),
        item_handlers={STATE: ocp.StandardCheckpointHandler(),
                       EXTRA: ocp.JsonCheckpointHandler()})
    self._state_handler = ocp.StandardCheckpointHandler()  # for reads: see `restore`
    self._extra_handler = ocp.JsonCheckpointHandler()
    self._sealing: Optional[_Sealing] = None

  def save(self, step: int, state: Any, extra: dict, *, force: bool = False) -> bool:
    """Saves `state` and the JSON dict `extra` at `step`; True if a save was started.

    False when `step` is already on disk, or orbax's save policy declines it (a step
    not after the latest) and not `force`. Asynchronous saves copy the arrays to host
    before returning, so the caller may donate them right after. CheckpointSpaceError
    when the disk cannot hold it (checked before writing) or filled up while the
    previous asynchronous save was written.
    """
    step = int(step)
    self._settle()
    if step in self._manager.all_steps() or not (force or self._manager.should_save(step)):
      return False
    needed = self._check_space(step, state, extra)
    args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(state),
                                 EXTRA: ocp.args.JsonSave(_jsonable(extra))})
    try:
      started = self._manager.save(step, args=args, force=force, custom_metadata={
          integrity.CHECKSUMS_KEY: integrity.ALGORITHM})
    except Exception as e:  # noqa: BLE001  (a full disk is the user's to fix: one line)
      if space.is_disk_full(e):
        raise self._disk_filled_up(step, needed) from e
      raise
    if started:
      self._sealing = _Sealing(self, step, needed, background=self._async)
      if not self._async:
        self._settle()
    return bool(started)

  def poll(self) -> None:
    """Raises an asynchronous save's failure once it has ended, not at the next save.
    One process only: settling is collective and hosts end at different moments (a
    multi-host run learns it at its next save)."""
    if (self._sealing is not None and jax.process_count() == 1
        and not self._sealing.running()):
      self._settle()

  def wait(self) -> None:
    """Blocks until every started save is committed and sealed (raises its failure)."""
    self._settle()

  def close(self) -> None:
    """Waits for pending saves and releases the manager."""
    try:
      self._settle()
    finally:
      self._manager.close()
      self._state_handler.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, kind, error, traceback) -> None:
    self.close()

  def latest_step(self) -> Optional[int]:
    """The newest step saved or found on disk (not yet validated), or None."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Steps saved or found on disk, ascending (unfinished and quarantined excluded)."""
    return sorted(self._manager.all_steps())

  def restore(self, step: int, abstract_state: Any) -> Restored:
    """The checkpoint at `step`, placed as `abstract_state` says.

    abstract_state: pytree of jax.ShapeDtypeStruct with `.sharding` set (any mesh).
    Raises PartialCheckpointError (never finished), CorruptCheckpointError (a file
    differs from its checksum, or reading failed on some host) or
    IncompatibleCheckpointError (other array names or shapes).
    """
    step = int(step)
    path = self.directory / str(step)
    integrity.verify(path)  # before orbax reads a byte; raises the same on every host
    quiet_read_leftovers()  # orbax reads follow
    restored, error = None, None
    mismatch = self._mismatch(path, abstract_state)  # from the metadata: no array read
    # The item handlers directly, not the manager: its restore ends in a barrier that a
    # host whose read failed would skip, deadlocking the others. Here every host reaches
    # the agreements below whatever happened.
    if not integrity.max_over_hosts(int(mismatch is not None)):
      try:
        restored = Restored(
            step,
            self._state_handler.restore(path / STATE,
                                        args=ocp.args.StandardRestore(abstract_state)),
            self._extra_handler.restore(path / EXTRA, args=ocp.args.JsonRestore()))
      except Exception as e:  # noqa: BLE001  (any read failure means: not usable)
        error = _describe(e)
    outcome = integrity.max_over_hosts(2 if mismatch else 1 if error else 0)
    if outcome == 2:
      raise IncompatibleCheckpointError(
          f"checkpoint step {step} in {self.directory} does not match the state to restore "
          f"({mismatch or 'on another host'}); was the model or optimizer config changed?")
    if outcome == 1:
      raise CorruptCheckpointError(error or "reading it failed on another host")
    return restored

  def restore_latest(self, abstract_state: Any) -> Optional[Restored]:
    """The newest readable checkpoint (see `restore`), or None when there is none.

    Each corrupt or partial step is logged and skipped for the one before. Partial
    steps are renamed aside at once; unreadable ones only once an older step has
    read fine (so a bug in the caller cannot send every checkpoint aside): if none
    does, CorruptCheckpointError is raised rather than starting over.
    """
    self.wait()
    self._manager.reload()
    skipped, unreadable = [], []
    for step in self._steps_every_host_lists():
      try:
        restored = self.restore(step, abstract_state)
      except CorruptCheckpointError as e:
        log.warning("checkpoint step %d in %s is corrupt or partial (%s); falling back "
                    "to the previous checkpoint", step, self.directory, e)
        skipped.append(step)
        if isinstance(e, PartialCheckpointError):
          self._quarantine(step)
        else:
          unreadable.append((step, e))
        continue
      for bad, _ in unreadable:
        self._quarantine(bad)
      if skipped:
        log.warning("restored checkpoint step %d after skipping corrupt step(s) %s",
                    step, skipped)
      return restored
    if unreadable:
      raise CorruptCheckpointError(
          f"no checkpoint in {self.directory} could be read ("
          + "; ".join(f"step {bad}: {e}" for bad, e in unreadable) + "); "
          "move the broken step directories aside to start over")
    return None

  def _steps_every_host_lists(self) -> list[int]:
    """The steps on disk, newest first, that every host lists: a restore is collective,
    and one host's listing that misses or adds a step (racing a write, a stale cache)
    must not send the hosts to different steps (integrity.steps_every_host_lists)."""
    steps = self._manager.all_steps()
    agreed = integrity.steps_every_host_lists(steps)
    if set(agreed) != set(steps):
      log.warning("checkpoints in %s: skipping step(s) %s, not listed by every host",
                  self.directory, sorted(set(steps) - set(agreed)))
    return agreed

  def _quarantine(self, step: int) -> None:
    """Renames `<step>/` aside (process 0) so it is neither listed nor overwritten."""
    src = self.directory / str(step)
    dst = self.directory / f"{step}{CORRUPT_MARKER}{time.time_ns()}"
    if jax.process_index() == 0 and src.exists():
      try:
        src.rename(dst)
        log.warning("moved corrupt checkpoint %s aside to %s", src, dst.name)
      except OSError as e:
        log.warning("could not move corrupt checkpoint %s aside: %s", src, e)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"checkpoints_quarantine_{step}")
    self._manager.reload()

  # ---------------------------------------------------------------- the end of a save
  def _settle(self) -> None:
    """Finishes the save in flight on every host and raises its failure, agreed over
    hosts: CheckpointSpaceError for a full disk (its unfinished step removed)."""
    sealing, self._sealing = self._sealing, None
    if sealing is None:
      return
    error = sealing.join()
    # Orbax raises a failed save once per calling thread, and a failed save leaves some
    # of its threads running, whose errors a later call would raise: drained here.
    error = _call_for_error(self._manager.wait_until_finished, error)
    if error is not None:
      space.join_orbax_writers()
      error = _call_for_error(self._manager.check_for_errors, error)
    outcome = integrity.max_over_hosts(2 if space.is_disk_full(error) else 1 if error else 0)
    if outcome == 2:
      raise self._disk_filled_up(sealing.step, sealing.needed) from error
    if self.keep is not None:
      self._manager.reload()  # process 0 may have dropped steps past `keep`
    if outcome == 1:
      raise error or RuntimeError(f"checkpoint step {sealing.step}: saving it failed on "
                                  "another host")

  def _check_space(self, step: int, state: Any, extra: dict) -> int:
    """The bytes this save needs; CheckpointSpaceError (before writing) if not free."""
    needed = space.needed_bytes(state, extra)
    free = space.free_bytes(self.directory)
    if integrity.max_over_hosts(int(free is not None and free < needed)):
      raise CheckpointSpaceError(space.message(
          step, f"not enough space in {self.directory} (nothing written)", needed, free,
          self._resume_step()))
    return needed

  def _disk_filled_up(self, step: int, needed: int) -> CheckpointSpaceError:
    """Removes the unfinished save of `step` (nothing else) after a full disk stopped it."""
    space.join_orbax_writers()
    if jax.process_index() == 0:
      for path in (self.directory / f"{step}{TMP_MARKER}", self.directory / str(step)):
        # <step>/ only when orbax committed it but the checksums did not fit: unsealed.
        if path.exists() and (path.name != str(step) or integrity.unfinished(path)):
          space.remove_unfinished(path)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"checkpoints_disk_full_{step}")
    self._manager.reload()
    return CheckpointSpaceError(space.message(
        step, f"the disk filled up while writing it to {self.directory} (the unfinished save"
        " is removed)", needed, space.free_bytes(self.directory), self._resume_step()))

  def _resume_step(self) -> Optional[int]:
    steps = [s for s in self._manager.all_steps()
             if integrity.missing_parts(self.directory / str(s)) is None]
    return max(steps, default=None)

  def _prune(self, newest: int) -> None:
    """Deletes (process 0) the committed steps older than the newest `keep`."""
    if self.keep is None:
      return
    steps = sorted(int(p.name) for p in self.directory.iterdir()
                   if integrity.STEP_NAME.match(p.name) and (p / COMMIT_MARKER).exists())
    for old in steps[:-self.keep]:
      if old != newest:
        (self.directory / str(old)).rmtree()

  def _mismatch(self, path: epath.Path, abstract_state: Any) -> Optional[str]:
    """How the saved array names/shapes differ from `abstract_state`; None if not known."""
    try:
      saved = saved_shapes(path)
    except Exception:  # noqa: BLE001  (unreadable metadata: corrupt, not a mismatch)
      return None
    wanted = wanted_shapes(abstract_state)
    parts = [f"{what} {names[:5]}" for what, names in (
        ("missing", sorted(wanted.keys() - saved.keys())),
        ("unexpected", sorted(saved.keys() - wanted.keys())),
        ("shape changed", sorted(k for k in wanted.keys() & saved.keys()
                                 if wanted[k] != saved[k]))) if names]
    return ", ".join(parts) or None


class _Sealing:
  """The end of one save, on a thread of its own when asynchronous: waits for orbax's
  commit, writes this host's checksums, then (process 0, once every host has sealed)
  deletes the steps past `keep`. Every host reaches the barrier, whatever failed."""

  def __init__(self, checkpointer: Checkpointer, step: int, needed: int, background: bool):
    self.step, self.needed, self.error = step, needed, None
    self._ckpt = checkpointer
    self._barrier = f"t5x_like_checkpoint_sealed_{step}_{next(_SEAL_BARRIERS)}"
    self._thread = None
    if background:  # not a daemon: a process exiting mid-seal finishes it first
      self._thread = threading.Thread(target=self._run, name=f"checkpoint_seal_{step}")
      self._thread.start()
    else:
      self._run()

  def running(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def join(self) -> Optional[BaseException]:
    if self._thread is not None:
      self._thread.join()
    return self.error

  def _run(self) -> None:
    ckpt, path = self._ckpt, self._ckpt.directory / str(self.step)
    try:
      failpoints.stall_save(self.step)  # a test's save still being written
      ckpt._manager.wait_until_finished()  # pylint: disable=protected-access
      # A test's kill between orbax's commit and this host's checksums (T5X_LIKE_FAILPOINT
      # =before_seal@STEP): the step must then be unfinished for every host.
      failpoints.kill_at("before_seal", self.step)
      integrity.seal(path, jax.process_index(), jax.process_count())
    except BaseException as e:  # noqa: BLE001  (raised by `Checkpointer._settle`)
      self.error = e
    try:
      if jax.process_count() > 1:  # a key-value barrier: safe off the main thread
        ocp.multihost.get_barrier_sync_fn()(key=self._barrier, timeout_ms=_SEAL_TIMEOUT_MS)
    except Exception as e:  # noqa: BLE001
      self.error = self.error or e
    if jax.process_index() == 0 and self.error is None and not integrity.unfinished(path):
      try:
        ckpt._prune(self.step)  # pylint: disable=protected-access
      except OSError as e:  # an old step left behind is no reason to stop a run
        log.warning("checkpoints in %s: could not delete old steps: %s", ckpt.directory, e)


def _call_for_error(fn, error: Optional[BaseException]) -> Optional[BaseException]:
  """Calls `fn`; `error`, or else what `fn` raised."""
  try:
    fn()
  except Exception as e:  # noqa: BLE001
    return error or e
  return error


def _describe(error: Exception) -> str:
  """One line: the exception type and the start of its message."""
  text = (str(error).strip().splitlines() or [""])[0].split(" See full TensorStore")[0]
  return f"{type(error).__name__}: {text[:300]}"


def _jsonable(extra: dict) -> dict:
  """`extra` as plain JSON types (numpy scalars and arrays become numbers and lists)."""
  def default(x):
    if isinstance(x, (np.generic, np.ndarray)):
      return x.tolist()
    raise TypeError(f"Checkpointer: extra holds {type(x).__name__}, not JSON")
  return json.loads(json.dumps(dict(extra), default=default))
