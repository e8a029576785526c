"""Checkpoints: async orbax saves, keep the last K, resume past corrupt or partial steps.

Each step directory `<directory>/<step>/` holds two items:
  state/  any pytree of jax arrays (sharded or not); every host writes its own shards.
  extra/  a small JSON dict written by process 0: the data iterator state, a config
          hash, ... It must be the same on every host (t5x_like's loader state is).
Restoring takes an abstract state whose leaves carry the target shardings, so a
checkpoint saved on one mesh restores onto any other (or onto one device).

A step is partial when orbax's commit marker or an item directory is missing, and
corrupt when reading it fails on any host. `restore_latest` logs a warning naming the
step and why, and tries the previous step; the bad directory is renamed aside to
`<step>.corrupt-<ns>` (kept for a human; a later save of that step does not collide).
Unfinished saves (`<step>.orbax-checkpoint-tmp-*`) are never listed and never deleted.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, NamedTuple, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)

STATE, EXTRA = "state", "extra"
COMMIT_MARKER = "commit_success.txt"  # orbax writes it last, just before the final rename
TMP_MARKER = ".orbax-checkpoint-tmp"  # an unfinished save: orbax never lists it as a step
CORRUPT_MARKER = ".corrupt-"


class Restored(NamedTuple):
  step: int
  state: Any
  extra: dict


class CorruptCheckpointError(RuntimeError):
  """A step directory that is partial or cannot be read."""


class PartialCheckpointError(CorruptCheckpointError):
  """A step directory whose save never committed (no marker, an item missing)."""


class IncompatibleCheckpointError(ValueError):
  """A readable checkpoint whose arrays do not match the abstract state asked for."""


class Checkpointer:
  """An orbax CheckpointManager over `directory` (a local path or gs://...).

  keep: how many of the newest steps to keep (None keeps all).
  async_save: write in a background thread; `save` returns once arrays are on host.
  Every method is called on every host.
  """

  def __init__(self, directory, *, keep: Optional[int] = 3, async_save: bool = True):
    if keep is not None and keep < 1:
      raise ValueError(f"Checkpointer: keep must be >= 1 or None, got {keep}")
    self.directory = epath.Path(directory)
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(keep) if keep else None,
        enable_async_checkpointing=async_save,
        # Another process (an eval job) may be mid-save here: never delete tmp dirs.
        cleanup_tmp_directories=False)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=(STATE, EXTRA),
        item_handlers={STATE: ocp.StandardCheckpointHandler(),
                       EXTRA: ocp.JsonCheckpointHandler()})
    self._state_handler = ocp.StandardCheckpointHandler()  # for reads: see `restore`
    self._extra_handler = ocp.JsonCheckpointHandler()
    unfinished = sorted(p.name for p in self.directory.iterdir() if TMP_MARKER in p.name
                        ) if self.directory.exists() else []
    if unfinished and jax.process_index() == 0:
      log.warning("checkpoints in %s: ignoring unfinished save(s) %s (interrupted, or in "
                  "progress in another process)", self.directory, unfinished)

  def save(self, step: int, state: Any, extra: dict, *, force: bool = False) -> bool:
    """Saves `state` and the JSON dict `extra` at `step`; True if a save was started.

    False when `step` is already on disk, or orbax's save policy declines it (a step
    not after the latest) and not `force`. Asynchronous saves copy the arrays to host
    before returning, so the caller may donate them right after.
    """
    step = int(step)
    if step in self._manager.all_steps():
      return False
    args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(state),
                                 EXTRA: ocp.args.JsonSave(_jsonable(extra))})
    return bool(self._manager.save(step, args=args, force=force))

  def wait(self) -> None:
    """Blocks until every started save is committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager."""
    self._manager.close()
    self._state_handler.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
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
    Raises PartialCheckpointError (never committed), CorruptCheckpointError (reading
    failed on some host) or IncompatibleCheckpointError (other array names or shapes).
    """
    step = int(step)
    path = self.directory / str(step)
    restored, partial, error, mismatch = None, _missing_parts(path), None, None
    if partial is None:
      # The item handlers directly, not the manager: its restore ends in a barrier that
      # a host whose read failed would skip, deadlocking the others. Here every host
      # reaches the one agreement below whatever happened.
      try:
        restored = Restored(
            step,
            self._state_handler.restore(path / STATE,
                                        args=ocp.args.StandardRestore(abstract_state)),
            self._extra_handler.restore(path / EXTRA, args=ocp.args.JsonRestore()))
      except Exception as e:  # noqa: BLE001  (any read failure means: not usable)
        error = _describe(e)
        mismatch = self._mismatch(path, abstract_state)
    outcome = _max_over_hosts(3 if mismatch else 2 if error else 1 if partial else 0)
    if outcome == 3:
      raise IncompatibleCheckpointError(
          f"checkpoint step {step} in {self.directory} does not match the state to restore "
          f"({mismatch or 'on another host'}); was the model or optimizer config changed?")
    if outcome == 2:
      raise CorruptCheckpointError(error or "reading it failed on another host")
    if outcome == 1:
      raise PartialCheckpointError(partial)
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
    for step in sorted(self._manager.all_steps(), reverse=True):
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
          f"move the broken step directories aside to start over")
    return None

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

  def _mismatch(self, path: epath.Path, abstract_state: Any) -> Optional[str]:
    """How the saved array names/shapes differ from `abstract_state`; None if not known."""
    try:
      meta = self._state_handler.metadata(path / STATE)
      saved = {leaf.name: tuple(leaf.shape) for leaf in jax.tree.leaves(meta.tree)}
    except Exception:  # noqa: BLE001  (unreadable metadata: corrupt, not a mismatch)
      return None
    wanted = {_dotted(p): tuple(x.shape)
              for p, x in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
    parts = [f"{what} {names[:5]}" for what, names in (
        ("missing", sorted(wanted.keys() - saved.keys())),
        ("unexpected", sorted(saved.keys() - wanted.keys())),
        ("shape changed", sorted(k for k in wanted.keys() & saved.keys()
                                 if wanted[k] != saved[k]))) if names]
    return ", ".join(parts) or None


def _missing_parts(path: epath.Path) -> Optional[str]:
  """Why `path` is not a complete step directory, or None."""
  if not path.exists():
    return f"{path} does not exist"
  if not (path / COMMIT_MARKER).exists():
    return f"no {COMMIT_MARKER}: the save did not finish"
  for item in (STATE, EXTRA):
    if not (path / item).is_dir():
      return f"item directory '{item}' is missing"
  return None


def _describe(error: Exception) -> str:
  """One line: the exception type and the start of its message."""
  text = (str(error).strip().splitlines() or [""])[0].split(" See full TensorStore")[0]
  return f"{type(error).__name__}: {text[:300]}"


def _max_over_hosts(code: int) -> int:
  """The largest `code` over all processes (one collective when multi-host)."""
  if jax.process_count() == 1:
    return code
  return int(np.max(multihost_utils.process_allgather(np.int32(code))))


def _dotted(path) -> str:
  """A jax key path as orbax names a saved array: 'opt_state.1.0.mu.w'."""
  return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                  for k in path)


def _jsonable(extra: dict) -> dict:
  """`extra` as plain JSON types (numpy scalars and arrays become numbers and lists)."""
  def default(x):
    if isinstance(x, (np.generic, np.ndarray)):
      return x.tolist()
    raise TypeError(f"Checkpointer: extra holds {type(x).__name__}, not JSON")
  return json.loads(json.dumps(dict(extra), default=default))


# ------------------------------------------------------------------ params only
def find_checkpoint(path, step: Optional[int] = None) -> epath.Path:
  """The `<step>/` directory that `path` names: a train workdir (its checkpoints/),
  a checkpoints directory (its newest committed step, or `step`), or a step directory.
  FileNotFoundError saying what was looked for otherwise."""
  path = epath.Path(path)
  if (path / STATE).is_dir():
    if step is not None and path.name != str(step):
      raise ValueError(f"{path} is the checkpoint of step {path.name}, not step {step}")
    return path
  if (path / "checkpoints").is_dir():
    path = path / "checkpoints"
  if not path.is_dir():
    raise FileNotFoundError(f"no checkpoint at {path}: expected a train workdir, its"
                            " checkpoints/ directory, or one step directory")
  steps = sorted(int(p.name) for p in path.iterdir()
                 if p.name.isdigit() and _missing_parts(p) is None)
  if not steps:
    raise FileNotFoundError(f"no committed checkpoint step in {path}")
  if step is None:
    return path / str(steps[-1])
  if step not in steps:
    raise FileNotFoundError(f"no committed checkpoint step {step} in {path}; have {steps}")
  return path / str(step)


def restore_params(path, abstract_params: Any, step: Optional[int] = None
                   ) -> tuple[int, Any]:
  """(step, params) of a train checkpoint, without its optimizer state.

  path: as find_checkpoint. abstract_params: pytree of jax.ShapeDtypeStruct with
  .sharding (the params are placed so, any mesh). IncompatibleCheckpointError names
  the params whose names or shapes differ.
  """
  directory = find_checkpoint(path, step)
  target = {"params": abstract_params}
  handler = ocp.PyTreeCheckpointHandler()
  try:
    saved = {leaf.name: tuple(leaf.shape) for leaf in jax.tree.leaves(
        ocp.StandardCheckpointHandler().metadata(directory / STATE).tree)}
    wanted = {_dotted(p): tuple(x.shape)
              for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
    missing = sorted(wanted.keys() - saved.keys())
    changed = sorted(k for k in wanted.keys() & saved.keys() if wanted[k] != saved[k])
    if missing or changed:
      shown = [f"{k} missing" for k in missing[:5]] + [
          f"{k} saved {saved[k]} wanted {wanted[k]}" for k in changed[:5]]
      raise IncompatibleCheckpointError(
          f"checkpoint {directory} does not hold the params of this model: "
          + "; ".join(shown) + " (another preset, overrides or vocabulary?)")
    restored = handler.restore(directory / STATE, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True))
  finally:
    handler.close()
  return int(directory.name), restored["params"]
