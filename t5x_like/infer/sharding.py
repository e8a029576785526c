"""Running decoding and scoring under a mesh and logical-axis rules, as training does."""

from __future__ import annotations

import contextlib
from typing import Optional

import flax.linen as nn
import jax
from jax.sharding import Mesh

from t5x_like import parallel


@contextlib.contextmanager
def traced_rules(mesh: Optional[Mesh], rules=parallel.DEFAULT_RULES):
  """While tracing under jit: the mesh as the abstract mesh (jax.set_mesh is refused
  under jit) and the logical rules restricted to it, as train.step does; nothing
  without a mesh."""
  if mesh is None:
    yield
    return
  restricted = parallel.rules_for_mesh(rules, mesh.axis_names)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(restricted):
    yield


def hashable_rules(rules) -> tuple:
  """Rules as nested tuples (a static jit argument must hash)."""
  if isinstance(rules, (list, tuple)):
    return tuple(hashable_rules(r) for r in rules)
  return rules
