"""Hugging Face checkpoints: `model, params = load(path)` and `save(model, params, path)`;
`export(model, params)` gives what save writes, in memory (`config_json(model)` its config);
`load_backbone(path, ...)` a fine-tuning backbone from any form the checkpoint was
saved in (hf/backbone.py), `model_config(path)` the architecture alone.

Supported: BertForPreTraining, GPT2LMHeadModel, T5ForConditionalGeneration (v1.0 and
v1.1), as local directories with config.json and model.safetensors (or a sharded
model.safetensors.index.json); `load` takes BERT without its MLM / NSP heads too
(BertModel, BertForMaskedLM, ...: the model has the heads the file has).
Weights are read with safetensors' numpy API.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from t5x_like.hf import bert
from t5x_like.hf.backbone import (BY_MODEL_TYPE as _BY_MODEL_TYPE, BackboneImport,
                                  load_backbone, model_config, open_checkpoint, skipped_groups)
from t5x_like.hf.io import CheckpointError, read_config, write_checkpoint
from t5x_like.hf.mapping import export_params, import_params
from t5x_like.models.model import Model, build_model

__all__ = ["BackboneImport", "CheckpointError", "config_json", "export", "load",
           "load_backbone", "model_config", "save", "skipped_groups"]


def load(path: str, **config_overrides) -> tuple[Model, Any]:
  """Reads a Hugging Face checkpoint directory -> (our model, its float32 params).

  config_overrides replace fields of the derived ModelConfig that do not change the
  weights (dtype, scan_layers, remat_policy, dropout_rate, ...).
  """
  _, family, weights, config = open_checkpoint(path)
  if family is bert:  # the heads the file has (BertModel: none)
    names = weights.names()
    config = config.replace(
        mlm_head=any(n.startswith("cls.predictions.") for n in names),
        nsp_head=any(n.startswith("cls.seq_relationship.") for n in names))
  if config_overrides:
    config = config.replace(**config_overrides)
  resolve = family.resolve_factory(set(weights.names()))
  params = import_params(config, weights, family.spec, resolve)
  weights.report_unused(ignore=family.IGNORED)
  return build_model(config), params


def export(model: Model, params: Any) -> tuple[dict, dict[str, np.ndarray]]:
  """(config.json as a dict, {Hugging Face tensor name: array}) of our model and params:
  what `save` writes. Tied copies (BERT's MLM decoder, GPT-2's lm_head) are left out."""
  family = _family_of(model)
  tensors = export_params(model.config, jax.device_get(params), family.spec)
  return family.config_to_hf(model.config), tensors


def config_json(model: Model) -> dict:
  """config.json (as a dict) of our model as a Hugging Face checkpoint."""
  return _family_of(model).config_to_hf(model.config)


def _family_of(model: Model):
  """The hf module of our model's type; ValueError when the config has no HF twin."""
  if model.hf_model_type not in _BY_MODEL_TYPE:
    raise ValueError(f"{type(model).__name__} has no Hugging Face model type to save as"
                     f" (supported: {sorted(_BY_MODEL_TYPE)})")
  family = _BY_MODEL_TYPE[model.hf_model_type]
  family.check_config(model.config)
  return family


def save(model: Model, params: Any, path: str) -> None:
  """Writes `path`/config.json and model.safetensors that transformers' from_pretrained loads."""
  write_checkpoint(path, *export(model, params))
