"""The backbone of a fine-tuning run: its ModelConfig, tokenizer and pretrained params.

  backbone = load_backbone(config)   # config: the finetune config (finetune/defaults.py)
  backbone.model_config, backbone.tokenizer, backbone.params (None = random init)

From a pretraining config (init.config) and, optionally, the checkpoint its `train`
run wrote (init.checkpoint); or from a Hugging Face checkpoint directory (init.hf).
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple, Optional

from t5x_like.errors import UserError
from t5x_like.finetune.tokenizer import Tokenizer, as_tokenizer
from t5x_like.models.config import ModelConfig


class BackboneError(UserError, ValueError):
  """config.init or config.tokenizer names no usable backbone; the message says which key."""


class Backbone(NamedTuple):
  model_config: ModelConfig
  tokenizer: Tokenizer
  params: Optional[Any]  # the pretrained model's params; None: initialise at random
  source: str  # where it came from, for the log
  remat_auto: bool = False  # the pretraining config's model.remat_policy is "auto"


def _tokenizer(config, default) -> Tokenizer:
  vocab = config.tokenizer.vocab
  if not vocab:
    return as_tokenizer(default)
  return as_tokenizer(vocab, lowercase=config.tokenizer.lowercase) if vocab.endswith(
      ".txt") else as_tokenizer(vocab)


def _hf_tokenizer(config, path: str, hf_model_type: str) -> Tokenizer:
  """tokenizer.vocab if set; else the checkpoint's vocab.txt (WordPiece, lower-casing
  as its tokenizer_config.json says) for BERT."""
  if config.tokenizer.vocab:
    return _tokenizer(config, None)
  vocab_txt = os.path.join(path, "vocab.txt")
  if hf_model_type == "bert" and os.path.isfile(vocab_txt):
    lowercase = config.tokenizer.lowercase
    tok_config = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tok_config):
      with open(tok_config, encoding="utf-8") as f:
        lowercase = bool(json.load(f).get("do_lower_case", lowercase))
    return as_tokenizer(vocab_txt, lowercase=lowercase)
  raise BackboneError(f"config.init.hf={path!r}: no tokenizer found (a BERT checkpoint's"
                      " vocab.txt); set config.tokenizer.vocab to a vocab.txt or"
                      " sentencepiece .model")


def load_backbone(config) -> Backbone:
  """The backbone named by config.init (see the module docstring)."""
  init = config.init
  overrides = dict(init.model_overrides)
  if bool(init.hf) == bool(init.config):
    raise BackboneError("config.init: set exactly one of init.config (a pretraining config,"
                     " with init.checkpoint for its weights) and init.hf (a Hugging Face"
                     " checkpoint directory)")
  if init.hf:
    from t5x_like import hf
    if init.checkpoint:
      raise BackboneError("config.init: init.checkpoint goes with init.config, not init.hf")
    model, params = hf.load(init.hf, **overrides)
    return Backbone(model.config, _hf_tokenizer(config, init.hf, model.hf_model_type),
                    params, f"Hugging Face checkpoint {init.hf}")
  from t5x_like.command_flags import load_config_file
  from t5x_like.experiment import build_model_from_config, config_vocab
  try:
    pretrain = load_config_file(init.config)
  except FileNotFoundError as e:
    raise BackboneError(f"config.init.config: {e}") from None
  vocab = config_vocab(pretrain)
  model_config = build_model_from_config(pretrain, vocab.vocab_size).config
  if overrides:
    model_config = model_config.replace(**overrides)
  if not init.checkpoint:
    return Backbone(model_config, _tokenizer(config, vocab), None,
                    f"random initialisation of {init.config}",
                    pretrain.model.remat_policy == "auto")
  from t5x_like.train.pretrained import load_pretrained
  loaded = load_pretrained(pretrain, init.checkpoint,
                           step=None if init.step < 0 else int(init.step))
  return Backbone(model_config, _tokenizer(config, vocab), loaded.params,
                  f"{init.config} checkpoint step {loaded.step} in {init.checkpoint}",
                  pretrain.model.remat_policy == "auto")
