"""The backbone of a fine-tuning run: its ModelConfig, tokenizer and pretrained params.

  backbone = load_backbone(config)   # config: the finetune config (finetune/defaults.py)
  backbone.model_config, backbone.tokenizer, backbone.params (None = random init)

From a pretraining config (init.config) and, optionally, the checkpoint its `train`
run wrote (init.checkpoint); or from a Hugging Face checkpoint directory (init.hf), in
any form it was saved (BertModel, BertForPreTraining, BertForSequenceClassification,
GPT2Model, T5EncoderModel, ...: t5x_like/hf/backbone.py): what the run's task reads
is loaded (BERT's pooler where its head has one, T5's decoder when text to text), the
rest skipped, and resolve_init's notes say both and what starts at random; with
init.hf_random the checkpoint's architecture and tokenizer start at random.

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
  init.config parsed, where it is set and init.hf is not. With init.hf its notes say
  what of the checkpoint loads, what is skipped and what starts at random (hf_notes;
  names and shapes are checked here, from the files' headers)."""
  init = config.init
  _check_init_keys(init)
  if init.hf:
    return ResolvedInit(config, "config.init.hf", hf_notes(config))
  if init.config:
    return ResolvedInit(config, "config.init.config", (), parse_pretrain_config(init.config))
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


def _check_init_keys(init) -> None:
  """BackboneError for init keys that do not go together."""
  if init.get("hf_random", False) and not init.hf:
    raise BackboneError("config.init.hf_random=true needs config.init.hf: the Hugging Face"
                        " checkpoint directory whose architecture and tokenizer to take")
  if init.hf and init.config:
    raise BackboneError("config.init: set exactly one of init.config (a pretraining config,"
                        " with init.checkpoint for its weights) and init.hf (a Hugging Face"
                        " checkpoint directory)")
  if init.hf and init.checkpoint:
    raise BackboneError("config.init: init.checkpoint goes with init.config, not init.hf")


# ------------------------------------------------------------------ init.hf
class HFTaskUse(NamedTuple):
  """What the run's task reads of a Hugging Face backbone."""
  pooler: bool  # its head may start from BERT's pooler (classification, regression)
  decoder: bool  # T5 text to text: the decoder is trained too
  head: str  # "the classification head" (random at the start); "" text to text
  known: bool = True  # False: a benchmark's task, whose type its registry sets


def hf_task_use(config, model_type: str) -> HFTaskUse:
  """HFTaskUse of config.task on a checkpoint of `model_type`. A benchmark's task type
  is its registry's (t5x_like/benchmarks, above this package): the pooler is then
  loaded where the checkpoint has one (FinetuneModel.load_backbone copies it where
  the head reads one) and the head is "the task's head"."""
  from t5x_like.finetune.tasks import task_from_config
  text_to_text = model_type == "t5" and bool(config.task.text_to_text)
  head = "" if text_to_text else "the task's head"
  if config.benchmark.get("name"):
    return HFTaskUse(model_type == "bert", text_to_text, head, known=False)
  try:
    task = task_from_config(config.task)
    name, pooler = task.name, bool(getattr(task, "pooler", False))
  except (UserError, ValueError, TypeError, KeyError):  # the config check names it
    name, pooler = config.task.name, bool(config.task.get("pooler", False))
  return HFTaskUse(pooler and model_type == "bert", text_to_text,
                   "" if text_to_text else f"the {name} head")


def _hf_import(config, read: bool):
  """hf.load_backbone of init.hf for the run's task: (BackboneImport, HFTaskUse)."""
  from t5x_like import hf
  path = config.init.hf
  use = hf_task_use(config, hf.read_config(path).get("model_type"))
  try:
    imported = hf.load_backbone(path, pooler=use.pooler, decoder=use.decoder, read=read,
                                **_overrides(config))
  except (TypeError, ValueError) as e:
    if isinstance(e, UserError):
      raise
    raise BackboneError(f"config.init.model_overrides: {e}") from None
  if "decoder" in imported.missing:
    raise BackboneError(
        f"config.init.hf={path!r}: {imported.architecture} has no decoder (decoder.block.*),"
        " which text-to-text fine-tuning trains: set --config.task.text_to_text=false to"
        " fine-tune its encoder under a head")
  return imported, use


def _overrides(config) -> dict:
  return dict(config.init.model_overrides)


def _describe(model_config, architecture: str) -> str:
  return (f"{architecture} ({model_config.num_layers} layers, d_model"
          f" {model_config.d_model}, vocab {model_config.vocab_size})")


def _names(parts) -> str:
  parts = list(parts)
  return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


_PART_NAMES = {"lm_head": "output layer (lm_head)"}


def hf_notes(config) -> tuple[str, ...]:
  """The log lines of init.hf (names and shapes checked, no weights read): what loads,
  what is skipped (one line), what starts at random (one line); with init.hf_random,
  one line."""
  from t5x_like import hf
  path = config.init.hf
  if config.init.get("hf_random", False):
    architecture, model_config = _hf_architecture(config)
    notes = [f"init.hf_random: random initialisation of the architecture of {path}, a"
             f" {_describe(model_config, architecture)}, tokenized as it is; no weights"
             " read"]
  else:
    imported, use = _hf_import(config, read=False)
    model_config = imported.config
    notes = [f"init.hf: {path} is a {_describe(model_config, imported.architecture)};"
             f" loading its {_names(_PART_NAMES.get(p, p) for p in imported.loaded)}"
             f" ({sum(imported.loaded.values())} tensors)"]
    groups = hf.skipped_groups(imported)
    if groups:
      notes.append(f"init.hf: skipped {len(imported.skipped)} tensor(s) fine-tuning does not"
                   " use: " + ", ".join(
                       f"{pattern} ({n}{': ' + what if what else ''})"
                       for pattern, n, what in groups))
    where = "" if use.known else ", where the task's head reads one"
    fresh = [f"the {p} (not in the checkpoint{where})" for p in imported.missing]
    if use.head:
      fresh.append(use.head)
    if fresh:
      notes.append(f"init.hf: initialised at random: {', '.join(fresh)}")
  positions = model_config.max_position_embeddings
  if (model_config.position_embedding == "learned"
      and config.task.max_length > positions):
    raise BackboneError(f"config.task.max_length={config.task.max_length} exceeds the"
                        f" {positions} learned positions of config.init.hf={path!r}:"
                        f" set --config.task.max_length={positions} or less")
  return tuple(notes)


def _hf_architecture(config):
  """(architecture, the fine-tuning ModelConfig) of init.hf's config.json."""
  from t5x_like import hf
  from t5x_like.models.model import model_class
  try:
    architecture, model_config = hf.model_config(config.init.hf, **_overrides(config))
  except (TypeError, ValueError) as e:
    if isinstance(e, UserError):
      raise
    raise BackboneError(f"config.init.model_overrides: {e}") from None
  return architecture, model_class(model_config).finetune_config(model_config)


def _hf_backbone(config) -> Backbone:
  """Backbone of init.hf: its weights (what the task reads), or with init.hf_random
  its architecture initialised at random (params drawn here from config.seed, so that
  the run's log and its start match those of a loaded checkpoint)."""
  path = config.init.hf
  if config.init.get("hf_random", False):
    import jax
    from t5x_like.models.model import build_model
    architecture, model_config = _hf_architecture(config)
    params = jax.device_get(jax.jit(build_model(model_config).init)(
        jax.random.key(config.seed)))
    source = (f"random initialisation (init.hf_random) of the architecture of Hugging Face"
              f" checkpoint {path} ({architecture})")
  else:
    imported, _ = _hf_import(config, read=True)
    model_config, params = imported.config, imported.params
    source = f"Hugging Face checkpoint {path} ({imported.architecture})"
  return Backbone(model_config, _hf_tokenizer(config, path, model_config.family), params,
                  source)


def _tokenizer(config, default) -> Tokenizer:
  vocab = config.tokenizer.vocab
  if not vocab:
    return as_tokenizer(default)
  return as_tokenizer(vocab, lowercase=config.tokenizer.lowercase) if vocab.endswith(
      ".txt") else as_tokenizer(vocab)


def _hf_tokenizer(config, path: str, family: str) -> Tokenizer:
  """tokenizer.vocab if set; else the checkpoint's vocab.txt (WordPiece, lower-casing
  as its tokenizer_config.json says) for BERT (the encoder family)."""
  if config.tokenizer.vocab:
    return _tokenizer(config, None)
  vocab_txt = os.path.join(path, "vocab.txt")
  if family == "encoder" and os.path.isfile(vocab_txt):
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
  _check_init_keys(init)
  if init.hf:
    return _hf_backbone(config)
  if not init.config:
    raise BackboneError("config.init: set exactly one of init.config (a pretraining config,"
                        " with init.checkpoint for its weights) and init.hf (a Hugging Face"
                        " checkpoint directory)")
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
