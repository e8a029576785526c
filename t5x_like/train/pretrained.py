"""A trained model back from its train config and checkpoint, for inference and fine-tuning.

  loaded = load_pretrained(config, "workdir/bert")   # or workdir/checkpoints[/<step>]
  loaded.model, loaded.params, loaded.vocab, loaded.step

The model and vocabulary are built from the same config sections as `train` builds
them (model.*, data.vocab / data.objective), so a config plus its workdir is all that
is needed; only the params are read (not the optimizer state): find_checkpoint names
the step directory, restore_params verifies its checksums and reads the params.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import orbax.checkpoint as ocp
from etils import epath

from t5x_like import fs, parallel
from t5x_like.checkpoint import integrity
from t5x_like.checkpoint.integrity import STATE
from t5x_like.checkpoint.read_leftovers import quiet_read_leftovers
from t5x_like.checkpoint import (CheckpointNotFoundError, IncompatibleCheckpointError,
                                 saved_shapes, wanted_shapes)
from t5x_like.experiment import build_model_from_config, config_vocab, mesh_rules


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
  rules = mesh_rules(config) if rules is None else rules
  shapes = model.example_batch_shapes()
  shardings = parallel.param_shardings(model, mesh, rules, shapes)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          model.param_shapes(shapes), shardings)
  found_step, params = restore_params(checkpoint, abstract, step)
  return Pretrained(model, params, vocab, found_step)


def find_checkpoint(path, step: Optional[int] = None) -> epath.Path:
  """The `<step>/` directory that `path` names: a train workdir (its checkpoints/),
  a checkpoints directory (its newest finished step, or `step`), or a step directory;
  local (relative or absolute) or a URL. CheckpointNotFoundError saying what was looked
  for otherwise."""
  path = fs.resolve_path(path, "checkpoint")
  if (path / STATE).is_dir():
    if step is not None and path.name != str(step):
      raise CheckpointNotFoundError(
          f"{path} is the checkpoint of step {path.name}, not step {step}")
    return path
  if (path / "checkpoints").is_dir():
    path = path / "checkpoints"
  if not path.is_dir():
    raise CheckpointNotFoundError(f"no checkpoint at {path}: expected a train workdir, its"
                                  " checkpoints/ directory, or one step directory")
  steps = sorted(int(p.name) for p in path.iterdir()
                 if integrity.STEP_NAME.match(p.name) and integrity.is_finished(p))
  if not steps:
    raise CheckpointNotFoundError(f"no committed checkpoint step in {path}")
  if step is None:
    return path / str(steps[-1])
  if step not in steps:
    raise CheckpointNotFoundError(
        f"no committed checkpoint step {step} in {path}; have {steps}")
  return path / str(step)


def restore_params(path, abstract_params: Any, step: Optional[int] = None
                   ) -> tuple[int, Any]:
  """(step, params) of a train checkpoint, without its optimizer state.

  path: as find_checkpoint. abstract_params: pytree of jax.ShapeDtypeStruct with
  .sharding (the params are placed so, any mesh). Every file is checked against its
  checksum first (CorruptCheckpointError names the first that differs);
  IncompatibleCheckpointError names the params whose names or shapes differ.
  """
  directory = find_checkpoint(path, step)
  integrity.verify(directory)
  quiet_read_leftovers()  # orbax reads follow, of metadata first
  target = {"params": abstract_params}
  handler = ocp.PyTreeCheckpointHandler()
  try:
    saved, wanted = saved_shapes(directory), wanted_shapes(target)
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
