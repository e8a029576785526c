"""The backbone of a fine-tuning run: its ModelConfig, tokenizer and pretrained params.

  backbone = load_backbone(config)   # config: the finetune config (finetune/defaults.py)
  backbone.model_config, backbone.tokenizer, backbone.params (None = random init)

From a pretraining config (init.config) and, optionally, the checkpoint its `train`
run wrote (init.checkpoint); or from a Hugging Face checkpoint directory (init.hf).

init.config left "" (the benchmark configs leave it so) is resolved by resolve_init:
the config.py that `t5x-like train` saved in init.checkpoint's workdir
(train/saved_config.py), else init.default_config (a benchmark config's BERT-base or
T5 base). A backbone found so, not named by the user, also sets the length: a
task.max_length above its learned positions is cut to them (a log line says so).
resolve_init parses init.config's file once for the run (PretrainConfig); the config
check and load_backbone take it from there.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple, Optional

from t5x_like.checkpoint import IncompatibleCheckpointError
from t5x_like.errors import UserError
from t5x_like.finetune.tokenizer import Tokenizer, as_tokenizer
from t5x_like.models.config import ModelConfig
from t5x_like.train.saved_config import CONFIG_FILE, saved_config_path, train_workdir


class BackboneError(UserError, ValueError):
  """config.init or config.tokenizer names no usable backbone; the message says which key."""


class Backbone(NamedTuple):
  model_config: ModelConfig
  tokenizer: Tokenizer
  params: Optional[Any]  # the pretrained model's params; None: initialise at random
  source: str  # where it came from, for the log
  remat_auto: bool = False  # the pretraining config's model.remat_policy is "auto"


class PretrainConfig(NamedTuple):
  """init.config's pretraining config file, parsed once per run (parse_pretrain_config):
  the config and its vocabulary, or the error that stopped them (the config check
  reports it, naming the key)."""
  spec: str  # init.config: "file.py[:arg]"
  config: Any  # its ConfigDict; None: the file was not found (error)
  vocab: Any  # its vocabulary (experiment.config_vocab); None: see error
  error: Optional[Exception] = None


def parse_pretrain_config(spec: str) -> PretrainConfig:
  """The pretraining config `spec` names and its vocabulary (PretrainConfig)."""
  from t5x_like.command_flags import load_config_file
  from t5x_like.experiment import config_vocab
  try:
    pretrain = load_config_file(spec)
  except FileNotFoundError as e:
    return PretrainConfig(spec, None, None, e)
  try:
    vocab = config_vocab(pretrain)
  except (OSError, ValueError) as e:  # a missing data.vocab, an unknown data.objective
    return PretrainConfig(spec, pretrain, None, e)
  return PretrainConfig(spec, pretrain, vocab)


class ResolvedInit(NamedTuple):
  config: Any  # the finetune config with init.config filled in (see resolve_init)
  origin: str  # where init.config came from, for the log and the errors
  notes: tuple[str, ...]  # lines for the run's log
  pretrain: Optional[PretrainConfig] = None  # init.config parsed; None: no init.config


def resolve_init(config) -> ResolvedInit:
  """config with init.config filled in where it was left "" (and init.hf too): the
  config.py saved by the train run that init.checkpoint names, else
  init.default_config; a copy, with task.max_length cut to that backbone's learned
  positions when it has fewer. Unchanged when init.config or init.hf is set, or when
  there is nothing to fill in (load_backbone then says what to set). Its pretrain:
  init.config parsed, where it is set and init.hf is not."""
  init = config.init
  if init.hf or init.config:
    pretrain = parse_pretrain_config(init.config) if init.config and not init.hf else None
    return ResolvedInit(config, "config.init.config" if init.config else "config.init.hf", (),
                        pretrain)
  saved = saved_config_path(init.checkpoint)
  if saved:
    chosen, origin = saved, f"saved by the train run in {train_workdir(init.checkpoint)}"
  elif init.default_config:
    chosen, origin = init.default_config, "config.init.default_config, this config's default"
    if init.checkpoint:
      origin += f"; {init.checkpoint} holds no {CONFIG_FILE} from `t5x-like train`"
  elif init.checkpoint:
    raise BackboneError(
        f"config.init.checkpoint={init.checkpoint!r}: no {CONFIG_FILE} beside its"
        " checkpoints (train writes it) and config.init.config is unset: set"
        " --config.init.config=FILE.py[:ARG], the pretraining config it was trained with")
  else:
    return ResolvedInit(config, "", ())
  config = config.copy_and_resolve_references()
  config.init.config = chosen
  notes = [f"init.config: {chosen} ({origin})"]
  pretrain = parse_pretrain_config(chosen)
  positions = _learned_positions(pretrain, config.init.model_overrides)
  if positions is not None and config.task.max_length > positions:
    notes.append(f"task.max_length: {config.task.max_length} -> {positions}, the learned"
                 f" positions of {chosen}")
    config.task.max_length = positions
  return ResolvedInit(config, origin, tuple(notes), pretrain)


def _learned_positions(pretrain: PretrainConfig, model_overrides) -> Optional[int]:
  """max_position_embeddings of the pretraining config's model (with
  init.model_overrides) when its positions are learned; None otherwise, or when the
  config does not load (the config check then names the problem)."""
  from t5x_like.experiment import model_config_from
  if pretrain.vocab is None:
    return None
  try:
    model_config = model_config_from(pretrain.config, pretrain.vocab.vocab_size).replace(
        **dict(model_overrides))
  except (OSError, ValueError, TypeError, KeyError, AttributeError):
    return None
  if model_config.position_embedding != "learned":
    return None
  return model_config.max_position_embeddings


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


def load_backbone(config, origin: Optional[str] = None,
                  pretrain: Optional[PretrainConfig] = None) -> Backbone:
  """The backbone named by config.init (see the module docstring). origin, pretrain:
  where init.config came from and its parsed file, when the caller resolved it
  (resolve_init); None resolves (and parses) here."""
  if origin is None:
    config, origin, _, pretrain = resolve_init(config)
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
  from t5x_like.experiment import build_model_from_config
  parsed = (pretrain if pretrain is not None and pretrain.spec == init.config else
            parse_pretrain_config(init.config))
  if parsed.config is None:
    raise BackboneError(f"config.init.config: {parsed.error}") from None
  if parsed.vocab is None:
    raise parsed.error
  pretrain_config, vocab = parsed.config, parsed.vocab
  model_config = build_model_from_config(pretrain_config, vocab.vocab_size).config
  if overrides:
    model_config = model_config.replace(**overrides)
  if not init.checkpoint:
    return Backbone(model_config, _tokenizer(config, vocab), None,
                    f"random initialisation of {init.config}",
                    pretrain_config.model.remat_policy == "auto")
  from t5x_like.train.pretrained import load_pretrained
  try:
    loaded = load_pretrained(pretrain_config, init.checkpoint,
                             step=None if init.step < 0 else int(init.step))
  except IncompatibleCheckpointError as e:
    raise IncompatibleCheckpointError(
        f"{e}; the backbone config was {init.config} ({origin}): set"
        " --config.init.config=FILE.py[:ARG] to the pretraining config that trained"
        f" {init.checkpoint}") from None
  return Backbone(model_config, _tokenizer(config, vocab), loaded.params,
                  f"{init.config} checkpoint step {loaded.step} in {init.checkpoint}",
                  pretrain_config.model.remat_policy == "auto")
