"""A Hugging Face checkpoint as a fine-tuning backbone, in whatever form it was saved.

  imported = load_backbone(path, pooler=True, decoder=True)
  imported.config    # our ModelConfig, without pretraining heads
  imported.params    # the backbone's params, plus 'pooler' where loaded
                     # (FinetuneModel.load_backbone takes them as they are)
  imported.loaded    # {part: tensors}: embeddings, encoder, pooler, decoder, ...
  imported.skipped   # the checkpoint's tensors fine-tuning has no use for
  imported.missing   # parts the task reads that the checkpoint lacks: they start at random
  skipped_groups(imported)  # the skipped tensors by head, for one log line

Every form transformers saves loads: the bare model (BertModel, GPT2Model, T5Model,
T5EncoderModel), with its pretraining heads (BertForPreTraining, BertForMaskedLM,
GPT2LMHeadModel, T5ForConditionalGeneration) or with a task head
(BertForSequenceClassification, ...ForTokenClassification, ...ForQuestionAnswering,
GPT2ForSequenceClassification, T5ForSequenceClassification, ...). The backbone is
found with or without its prefix ('bert.', 'transformer.'); the heads are skipped
(fine-tuning trains its own), BERT's pooler is loaded where the task reads it and the
checkpoint has one (BertForTokenClassification, ...QuestionAnswering and ...MaskedLM
save none: then it starts at random), T5's decoder where the task trains it.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Optional

from t5x_like.hf import bert, gpt2, t5
from t5x_like.hf.io import CheckpointError, Weights, read_config
from t5x_like.hf.mapping import import_parts
from t5x_like.models.config import ModelConfig
from t5x_like.models.model import model_class

BY_MODEL_TYPE = {"bert": bert, "gpt2": gpt2, "t5": t5}


def family_module(hf_config: dict, path: str):
  """The hf module (bert, gpt2, t5) of a checkpoint's config.json; CheckpointError else."""
  model_type = hf_config.get("model_type")
  if model_type not in BY_MODEL_TYPE:
    raise CheckpointError(
        f"{os.path.join(path, 'config.json')}: model_type={model_type!r} is not supported"
        f" (supported: {sorted(BY_MODEL_TYPE)})")
  return BY_MODEL_TYPE[model_type]


def architecture_name(hf_config: dict) -> str:
  """config.json's architecture (e.g. 'BertModel'), else '<model_type> model'."""
  names = hf_config.get("architectures") or []
  return names[0] if names and isinstance(names[0], str) else (
      f"{hf_config.get('model_type')} model")


class BackboneImport(NamedTuple):
  path: str
  architecture: str  # config.json's, e.g. "BertForSequenceClassification"
  config: ModelConfig  # the fine-tuning backbone's: no pretraining heads
  params: Optional[Any]  # None when read=False
  loaded: dict[str, int]  # part -> tensors, e.g. {"embeddings": 5, "encoder": 32, ...}
  skipped: tuple[str, ...]  # the checkpoint's tensors not loaded (buffers left out)
  missing: tuple[str, ...]  # parts the task reads that the checkpoint lacks ("pooler")
  base_prefix: str  # the family's model prefix ("bert."), for skipped_groups
  heads: dict[str, str]  # the family's known heads: name prefix -> what it is


def model_config(path: str, **config_overrides) -> tuple[str, ModelConfig]:
  """(architecture, our ModelConfig) from `path`/config.json alone, with its pretraining
  heads: what an architecture initialised at random needs (model.safetensors is read
  only where the config depends on it: T5's untied lm_head)."""
  hf_config = read_config(path)
  family = family_module(hf_config, path)
  weights = None
  if family is t5:
    try:
      weights = Weights(path)
    except CheckpointError:
      pass
  config = _config_from_hf(family, hf_config, path, weights)
  return architecture_name(hf_config), _replace(config, config_overrides)


def open_checkpoint(path: str) -> tuple[dict, Any, Weights, ModelConfig]:
  """(config.json, its hf family module, its Weights, our ModelConfig with the
  pretraining heads) of the checkpoint directory `path`; CheckpointError else."""
  hf_config = read_config(path)
  family = family_module(hf_config, path)
  weights = Weights(path)
  return hf_config, family, weights, _config_from_hf(family, hf_config, path, weights)


def _config_from_hf(family, hf_config: dict, path: str, weights: Optional[Weights]
                    ) -> ModelConfig:
  """Our ModelConfig of config.json (T5's reads the weights: is lm_head untied?)."""
  if family is t5:
    return t5.config_from_hf(hf_config, path, weights)
  return family.config_from_hf(hf_config, path)


def _replace(config: ModelConfig, overrides: dict) -> ModelConfig:
  return config.replace(**overrides) if overrides else config


def load_backbone(path: str, *, pooler: bool = True, decoder: bool = True,
                  read: bool = True, **config_overrides) -> BackboneImport:
  """The fine-tuning backbone in the checkpoint directory `path` (BackboneImport).

  pooler: the task's head reads BERT's pooler (loaded where the checkpoint has one).
  decoder: the task trains T5's decoder (text to text; else the encoder alone loads).
  read=False: only names and shapes are checked (from the files' headers), params None.
  config_overrides: ModelConfig fields that do not change the weights (dropout_rate, ...).
  CheckpointError for a directory, config or tensor that does not fit.
  """
  hf_config, family, weights, config = open_checkpoint(path)
  config = _replace(config, config_overrides)
  wanted, optional = family.backbone_parts(pooler=pooler, decoder=decoder)
  # BERT's pooler is a param of the model with its NSP head, whatever the overrides say
  # of the heads (fine-tuning drops them: finetune_config).
  full = config.replace(mlm_head=True, nsp_head=True) if family is bert else config
  params, loaded, missing = import_parts(
      full, weights, family.spec, family.resolve_factory(set(weights.names())),
      family.part_of, wanted, optional, read=read)
  skipped = tuple(n for n in weights.names()
                  if n not in weights.used and not n.endswith(family.BUFFERS))
  return BackboneImport(path, architecture_name(hf_config),
                        model_class(config).finetune_config(config), params, loaded,
                        skipped, missing, family.BASE_PREFIX, dict(family.HEADS))


def skipped_groups(imported: BackboneImport) -> list[tuple[str, int, Optional[str]]]:
  """imported.skipped grouped by head: [(pattern, tensors, what it is or None)], e.g.
  ("cls.predictions.*", 5, "the MLM head"); a group of one tensor by its name."""
  groups: dict[str, list] = {}
  for name in imported.skipped:
    base = imported.base_prefix if name.startswith(imported.base_prefix) else ""
    rest = name[len(base):]
    head = next((h for h in imported.heads if rest.startswith(h)), None)
    if head is not None:
      key, what = base + head + "*", imported.heads[head]
    else:
      key, what = base + rest.split(".", 1)[0] + ".*", None
    groups.setdefault(key, [key, 0, what, name])[1] += 1
  return [(key if n > 1 else first, n, what) for key, n, what, first in groups.values()]
