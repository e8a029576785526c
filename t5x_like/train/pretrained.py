"""A trained model back from its train config and checkpoint, for inference and fine-tuning.

  loaded = load_pretrained(config, "workdir/bert")   # or workdir/checkpoints[/<step>]
  loaded.model, loaded.params, loaded.vocab, loaded.step

The model and vocabulary are built from the same config sections as `train` builds
them (model.*, data.vocab / data.objective), so a config plus its workdir is all that
is needed; only the params are read (not the optimizer state).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax

from t5x_like import parallel
from t5x_like.train.checkpoints import restore_params
from t5x_like.train.loop import build_model_from_config, config_vocab


class Pretrained(NamedTuple):
  model: Any
  params: Any
  vocab: Any
  step: int


def load_pretrained(config, checkpoint: str, *, mesh=None, rules=None,
                    step: Optional[int] = None) -> Pretrained:
  """Model, params (placed on `mesh` by `rules`; default: config.mesh), vocabulary and
  step of a checkpoint written by `t5x-like train` with `config`."""
  vocab = config_vocab(config)
  model = build_model_from_config(config, vocab.vocab_size)
  mesh = parallel.mesh_from_config(config.mesh) if mesh is None else mesh
  rules = (tuple(config.mesh.rules) or parallel.DEFAULT_RULES) if rules is None else rules
  shapes = model.example_batch_shapes()
  shardings = parallel.param_shardings(model, mesh, rules, shapes)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          model.param_shapes(shapes), shardings)
  found_step, params = restore_params(checkpoint, abstract, step)
  return Pretrained(model, params, vocab, found_step)
