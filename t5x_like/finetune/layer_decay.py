"""Layer-wise learning-rate decay for fine-tuning (ELECTRA, Clark et al. 2020; BEiT,
Bao et al. 2022): the task head and the top layer learn at the full rate, each layer
below at `decay` times the one above, the embeddings slowest, so that the pretrained
lower layers move least.

Depths, as BEiT's: the embeddings (and any backbone parameter outside the layer stacks)
0; layer i of the first stack i + 1, then the next stack's layers continue the count
(T5: encoder layers 1..E, decoder layers E + 1..E + D); a stack's own parameters that
are not in a layer (a final norm, T5's shared relative-position table) take the depth
of its top layer; the head (a text-to-text family's untied output layer,
'logits_dense') L + 1, L the layer count of all stacks. A parameter at depth d is
updated at lr x decay^(L + 1 - d): the whole update, Adam's step and the decoupled
weight decay alike. Scanned stacks ('layers', a leading axis of L) get one factor per
layer.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import jax
import numpy as np
import optax

_LAYER = re.compile(r"layers_(\d+)$")


def layer_depths(shapes: Any, stacks: Mapping[str, int]) -> Any:
  """Tree like `shapes` (a FinetuneModel's params or their ShapeDtypeStructs): each
  parameter's depth, an int, or [L, 1, ...] ints for a scanned stack's parameter.
  stacks: {stack module name: its layers} in order from the input ('encoder', then
  'decoder'); a stack the backbone lacks is skipped (T5's encoder under a head)."""
  offsets, total = {}, 0
  for name, layers in stacks.items():
    if name not in shapes["backbone"]:
      continue
    offsets[name] = total
    total += layers

  def depth(path, leaf):
    names = jax.tree_util.keystr(path, simple=True, separator="/").split("/")
    if names[0] != "backbone" or names[1] == "logits_dense":
      return total + 1  # the task head, or a text-to-text family's output layer
    for k, name in enumerate(names[:-1]):
      if name in offsets:
        below, layers, inner = offsets[name], stacks[name], names[k + 1]
        match = _LAYER.match(inner)
        if match:
          return below + int(match.group(1)) + 1
        if inner == "layers":  # scanned: axis 0 is the layer
          return (below + 1 + np.arange(layers)).reshape((layers,) + (1,) * (
              len(leaf.shape) - 1))
        return below + layers
    return 0  # embeddings

  return jax.tree_util.tree_map_with_path(depth, shapes)


def scale_by_layer(depths: Any, decay: float) -> optax.GradientTransformation:
  """Multiplies each update by decay^(top - depth), top = the deepest depth in `depths`
  (the head's). Stateless (optax.EmptyState)."""
  top = max(int(np.max(d)) for d in jax.tree.leaves(depths))
  factors = jax.tree.map(lambda d: np.asarray(float(decay) ** (top - np.asarray(d)),
                                              np.float32), depths)

  def update_fn(updates, state, params=None):
    del params
    return jax.tree.map(lambda u, f: u * f.astype(u.dtype), updates, factors), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
