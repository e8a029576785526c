"""Hugging Face checkpoints: `model, params = load(path)` and `save(model, params, path)`.

Supported: BertForPreTraining, GPT2LMHeadModel, T5ForConditionalGeneration (v1.0 and
v1.1), as local directories with config.json and model.safetensors (or a sharded
model.safetensors.index.json). Weights are read with safetensors' numpy API.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from t5x_like.hf import bert, gpt2, t5
from t5x_like.hf.io import CheckpointError, Weights, read_config, write_checkpoint
from t5x_like.hf.mapping import export_params, import_params
from t5x_like.models.model import Model, build_model

__all__ = ["CheckpointError", "load", "save"]

_BY_MODEL_TYPE = {"bert": bert, "gpt2": gpt2, "t5": t5}


def load(path: str, **config_overrides) -> tuple[Model, Any]:
  """Reads a Hugging Face checkpoint directory -> (our model, its float32 params).

  config_overrides replace fields of the derived ModelConfig that do not change the
  weights (dtype, scan_layers, remat_policy, dropout_rate, ...).
  """
  hf_config = read_config(path)
  model_type = hf_config.get("model_type")
  if model_type not in _BY_MODEL_TYPE:
    raise CheckpointError(
        f"{os.path.join(path, 'config.json')}: model_type={model_type!r} is not supported"
        f" (supported: {sorted(_BY_MODEL_TYPE)})")
  family = _BY_MODEL_TYPE[model_type]
  weights = Weights(path)
  if family is t5:
    config = family.config_from_hf(hf_config, path, weights)
  else:
    config = family.config_from_hf(hf_config, path)
  if config_overrides:
    config = config.replace(**config_overrides)
  resolve = family.resolve_factory(set(weights.names()))
  params = import_params(config, weights, family.spec, resolve)
  weights.report_unused(ignore=family.IGNORED)
  return build_model(config), params


def save(model: Model, params: Any, path: str) -> None:
  """Writes `path`/config.json and model.safetensors that transformers' from_pretrained loads."""
  config = model.config
  if model.hf_model_type not in _BY_MODEL_TYPE:
    raise ValueError(f"{type(model).__name__} has no Hugging Face model type to save as"
                     f" (supported: {sorted(_BY_MODEL_TYPE)})")
  family = _BY_MODEL_TYPE[model.hf_model_type]
  family.check_config(config)
  tensors = export_params(config, jax.device_get(params), family.spec)
  write_checkpoint(path, family.config_to_hf(config), tensors)
