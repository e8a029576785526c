"""The array shapes of a saved step and of the state a run wants, by orbax's array names:
what restore compares to tell a checkpoint of another model (IncompatibleCheckpointError).
"""

from __future__ import annotations

from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from t5x_like.checkpoint.integrity import STATE


def saved_shapes(step_dir: epath.Path) -> dict[str, tuple]:
  """{orbax array name ('opt_state.1.0.mu.w'): shape} of a step's saved state."""
  meta = ocp.StandardCheckpointHandler().metadata(step_dir / STATE)
  return {leaf.name: tuple(leaf.shape) for leaf in jax.tree.leaves(meta.tree)}


def wanted_shapes(abstract: Any) -> dict[str, tuple]:
  """{orbax array name: shape} of a pytree, named as saved_shapes names them."""
  return {jax.tree_util.keystr(p, simple=True, separator="."): tuple(x.shape)
          for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
