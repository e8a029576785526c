"""Checkpoints of a run's state: orbax saves that keep the last K, per-host checksums,
resume past a bad step, free-space checks before each save.

  checkpointer    Checkpointer: save (async), restore_latest onto any mesh, keep, close
  integrity       the checksum manifests, commit markers and the checks on restore
  space           the free space a save needs, and a disk filling up during one
  read_leftovers  quiets orbax's reads still in flight after a failed restore
"""

from t5x_like.checkpoint.checkpointer import (
    CheckpointDirectoryError, Checkpointer, CheckpointNotFoundError, CheckpointSpaceError,
    CorruptCheckpointError, IncompatibleCheckpointError, PartialCheckpointError, Restored,
    saved_shapes, wanted_shapes)

__all__ = ["Checkpointer", "Restored", "CorruptCheckpointError", "PartialCheckpointError",
           "IncompatibleCheckpointError", "CheckpointNotFoundError", "CheckpointSpaceError",
           "CheckpointDirectoryError", "saved_shapes", "wanted_shapes"]
