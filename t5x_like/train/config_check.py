"""Validation of a training config before anything is built or compiled.

  validate(config, num_devices=jax.device_count())  # raises ConfigError

(Fine-tuning's validate_finetune, t5x_like/finetune/config_check.py, runs the same
checks on its own schema: check_schema, check_finite, check_seed, check_model,
check_optimizer, check_mesh.)

Every message names the offending key (`train.batch_size`, `mesh.tensor`, ...) and what
would be valid. Checks: unknown keys and wrong types against train/defaults.py's schema;
choices (preset, objective, optimizer, schedule, dtype, remat policy); model overrides
against ModelConfig; objective options against the objective's constructor; numeric
ranges; phases; the mesh against the device count; the global batch against the batch
shards; and every parameter dimension against the mesh axes its logical axis maps to
(e.g. heads over 'tensor').
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import ml_collections
import numpy as np
from jax.sharding import PartitionSpec

from t5x_like import parallel
from t5x_like.data.mixture import EXHAUSTED, parse_mixture
from t5x_like.data.pipeline import OBJECTIVES
from t5x_like.data.prepared import VERIFY_MODES
from t5x_like.data.store import TokenStore
from t5x_like.errors import UserError
from t5x_like.experiment import (REMAT_AUTO, attention_impl, build_objective, config_vocab,
                                 mesh_rules, model_config_from, phase_configs)
from t5x_like.models import Model, build_model
from t5x_like.models.attention_core import choose_kernel
from t5x_like.models.config import ATTENTION_IMPLS, DTYPES, PRESETS, REMAT_POLICIES, ModelConfig
from t5x_like.parallel.mesh import MESH_AXES, config_axis_sizes
from t5x_like.train.defaults import default_config
from t5x_like.train.optimizers import OPTIMIZERS, SCHEDULES
from t5x_like.train.state import check_zero_stage

# Sections whose contents are free-form (checked separately below).
_OPEN = {"model.overrides", "data.options", "mesh.rules", "train.phases"}


class ConfigError(UserError, ValueError):
  """An invalid config; the message names the key."""


def validate(config: ml_collections.ConfigDict, num_devices: Optional[int] = None,
             vocab_size: Optional[int] = None,
             device_memory_bytes: Optional[int] = None,
             platform: Optional[str] = None) -> None:
  """Raises ConfigError for the first problem found.

  num_devices: the devices the mesh must fill (default: jax.device_count()).
  vocab_size: the vocabulary's size when model.overrides has none (None: not checked
  against the mesh).
  device_memory_bytes: one device's memory (e.g. parallel.device_memory.local_device_memory()); a step whose
  activations cannot fit in it is refused. None: not checked.
  platform: where the step will run (tpu | gpu | cpu), for the attention kernel check;
  default jax.default_backend() (plan passes the topology's when it compiles for a TPU
  slice from another host).
  """
  if num_devices is None:
    num_devices = jax.device_count()
  check_schema(config, default_config(), _OPEN)
  check_finite(config)
  check_seed(config)
  model_cfg = check_model(config, vocab_size, platform)
  _check_data(config, model_cfg)
  _check_train(config)
  check_optimizer(config)
  model = build_model(model_cfg)
  mesh_sizes = check_mesh(config, num_devices, model)
  if device_memory_bytes:
    _check_activation_memory(config, model, mesh_sizes, device_memory_bytes)


# ------------------------------------------------------------------------- schema
def check_schema(config, schema, open_keys=frozenset(), prefix: str = "") -> None:
  """Every key of `config` is one of `schema` (ConfigError naming it and the known
  keys), of the default's type; the contents of the sections named in `open_keys`
  (dotted) are free-form."""
  for key in config.keys():
    name = f"{prefix}{key}"
    if key not in schema:
      raise ConfigError(f"unknown config key {name!r}; known keys here:"
                        f" {sorted(schema.keys())}")
    value, default = config[key], schema[key]
    if name in open_keys:
      continue
    if isinstance(default, ml_collections.ConfigDict):
      if not isinstance(value, (ml_collections.ConfigDict, dict)):
        raise ConfigError(f"{name}: expected a section (ConfigDict), got {value!r}")
      check_schema(ml_collections.ConfigDict(value) if isinstance(value, dict) else value,
                   default, open_keys, name + ".")
    elif not _same_type(value, default):
      raise ConfigError(f"{name}={value!r}: expected {type(default).__name__}"
                        f" (like the default {default!r}), got {type(value).__name__}")


def check_finite(config, prefix: str = "") -> None:
  """Every float of the config (open sections included) is finite: a NaN learning rate
  or weight decay would otherwise train to garbage, or to the end."""
  for key in config.keys():
    value, name = config[key], f"{prefix}{key}"
    if isinstance(value, (ml_collections.ConfigDict, dict)):
      check_finite(ml_collections.ConfigDict(value) if isinstance(value, dict) else value,
                   name + ".")
    elif isinstance(value, float) and not math.isfinite(value):
      raise ConfigError(f"{name}={value}: must be a finite number")


def check_seed(config) -> None:
  """config.seed in [0, 2**31)."""
  if not 0 <= config.seed < 2**31:
    raise ConfigError(f"seed={config.seed}: must be in [0, 2**31)")


def _same_type(value: Any, default: Any) -> bool:
  if isinstance(default, bool) or isinstance(value, bool):
    return isinstance(value, bool) and isinstance(default, bool)
  if isinstance(default, float):
    return isinstance(value, (int, float))
  if isinstance(default, (tuple, list)):
    return isinstance(value, (tuple, list))
  return isinstance(value, type(default))


def _choice(name: str, value: Any, options) -> None:
  if value not in options:
    raise ConfigError(f"{name}={value!r}: expected one of {sorted(options)}")


def positive(name: str, value, allow_zero: bool = False) -> None:
  """ConfigError naming `name` unless value > 0 (allow_zero: >= 0)."""
  if value < 0 or (value == 0 and not allow_zero):
    raise ConfigError(f"{name}={value!r}: must be {'>= 0' if allow_zero else '> 0'}")


# -------------------------------------------------------------------------- model
def check_fields(name: str, fields: dict) -> None:
  """Every key of `fields` (the section `name`) is a ModelConfig field."""
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  for key in fields:
    if key not in known:
      raise ConfigError(f"{name}.{key}: not a ModelConfig field; known: {sorted(known)}")


def check_model(config, vocab_size: Optional[int],
                platform: Optional[str] = None) -> ModelConfig:
  """The ModelConfig of config.model (experiment.model_config_from) for `vocab_size`
  ids, checked; platform: where it runs (default: here), for the attention kernel."""
  m = config.model
  _choice("model.preset", m.preset, PRESETS)
  _choice("model.dtype", m.dtype, DTYPES)
  _choice("model.remat_policy", m.remat_policy, REMAT_POLICIES + (REMAT_AUTO,))
  _choice("model.attention_impl", attention_impl(config), ATTENTION_IMPLS)
  overrides = dict(m.overrides)
  check_fields("model.overrides", overrides)
  if vocab_size is not None and overrides.get("vocab_size", vocab_size) < vocab_size:
    raise ConfigError(f"model.overrides.vocab_size={overrides['vocab_size']}: smaller than the"
                      f" vocabulary's {vocab_size} ids (ids past it would index outside the"
                      " embedding); remove it or make it at least that")
  try:
    cfg = model_config_from(config, vocab_size)
  except (ValueError, TypeError) as e:
    raise ConfigError(f"model (preset {m.preset!r} with model.overrides): {e}") from None
  _check_kernel(config, cfg, platform)
  return cfg


def _check_kernel(config, cfg: ModelConfig, platform: Optional[str]) -> None:
  """A configured fused kernel runs every attention call of every phase (auto always can):
  lengths from ObjectiveSpec.attention_lengths, biased (every batch has a padding mask)."""
  try:
    runs = [c.data for _, c in phase_configs(config)]
  except (TypeError, ValueError):  # bad phases: ExperimentConfigError
    runs = [config.data]
  for d in runs:
    try:
      calls = OBJECTIVES[d.objective].attention_lengths(int(d.length), d.targets_length,
                                                        dict(d.options))
    except (KeyError, TypeError, ValueError):
      continue
    for q_len, kv_len in calls:
      try:
        choose_kernel(cfg.attention_impl, backend=platform or jax.default_backend(),
                      dtype=cfg.dtype, head_dim=cfg.dim_per_head, q_len=q_len, kv_len=kv_len,
                      dropout=cfg.attention_dropout_rate > 0, biased=True,
                      device_kind="" if platform else jax.devices()[0].device_kind)
      except ValueError as e:
        raise ConfigError(f"model.{e}") from None


# --------------------------------------------------------------------------- data
def _check_data(config, model_cfg: ModelConfig) -> None:
  d = config.data
  _choice("data.objective", d.objective, OBJECTIVES)
  spec = OBJECTIVES[d.objective]
  family = spec.model_family
  if model_cfg.family != family:
    raise ConfigError(f"data.objective={d.objective!r} trains a {family!r} model, but"
                      f" model.preset={config.model.preset!r} is {model_cfg.family!r}")
  check_data_sources(d)
  lengths = [("data.length", d.length)] + [
      (f"train.phases[{i}].length", dict(p).get("length", d.length))
      for i, p in enumerate(config.train.phases or ())]
  for name, length in lengths:
    if isinstance(length, bool) or not isinstance(length, int):
      raise ConfigError(f"{name}={length!r}: expected an int (tokens per row)")
    positive(name, length)
    if model_cfg.position_embedding == "learned" and length > model_cfg.max_position_embeddings:
      raise ConfigError(f"{name}={length} exceeds the model's max_position_embeddings="
                        f"{model_cfg.max_position_embeddings}; raise"
                        " model.overrides.max_position_embeddings or shorten it")
  if spec.needs_targets_length:
    positive("data.targets_length", d.targets_length)
  if not d.eval_source and not 0.0 < d.eval_fraction < 1.0:
    raise ConfigError(f"data.eval_fraction={d.eval_fraction}: must be in (0, 1) when"
                      " data.eval_source is empty")
  positive("data.num_workers", d.num_workers, allow_zero=True)
  _choice("data.verify_checksums", d.get("verify_checksums", "blocks"), VERIFY_MODES)
  known = spec.option_defaults()
  _type_command_line_options(d.options, spec)
  option_sets = [("data.options", dict(d.options))] + [
      (f"train.phases[{i}].options", dict(dict(p).get("options", {})))
      for i, p in enumerate(config.train.phases or ())]
  for name, options in option_sets:
    for key in options:
      if key not in known:
        raise ConfigError(f"{name}.{key}: not an option of objective {d.objective!r};"
                          f" known: {sorted(known)}")
      default = known[key]
      if default is not None and not _same_type(options[key], default):
        raise ConfigError(f"{name}.{key}={options[key]!r}: expected"
                          f" {type(default).__name__} (like the default {default!r})")
  _check_objective_builds(config)


def _check_objective_builds(config) -> None:
  """Each phase's objective accepts its lengths and options: built once over a small
  store of one document, so that a value its constructor refuses (a noise density of 2,
  lengths too short for a denoiser) is a ConfigError before anything is written. Skipped
  where the vocabulary cannot be read here (checked where it is loaded)."""
  try:
    vocab = config_vocab(config, shapes_only=True)
  except (OSError, ValueError):
    return
  store = TokenStore.from_documents([[np.full(16, 5, np.int32)] * 64])
  try:
    phases = [c for _, c in phase_configs(config)]
  except (TypeError, ValueError):  # bad phases: reported by the phase check
    phases = [config]
  for c in phases:
    try:
      build_objective(c, store, vocab, seed=0)
    except (TypeError, ValueError) as e:
      d = c.data
      raise ConfigError(f"data.objective={d.objective!r} refuses data.length={d.length},"
                        f" data.targets_length={d.targets_length}, data.options="
                        f"{dict(d.options)}: {e}") from None


def _type_command_line_options(options, spec) -> None:
  """data.options' text values (`--config.data.options.NAME=VALUE` keeps a name the
  config file lacks as text: command_flags.FREE_SECTIONS) parsed in place by the
  objective's option types (ObjectiveSpec.typed_option), so everything downstream of
  validation sees typed values. Unknown names are left for the check after it."""
  known = spec.option_defaults()
  for key in list(options.keys()):
    if key not in known:
      continue
    try:
      value = spec.typed_option(key, options[key])
    except ValueError as e:
      raise ConfigError(f"data.options.{e}") from None
    with options.ignore_type():
      options[key] = value


SOURCE_SCHEMES = ("embedded", "text", "jsonl", "tfds", "prepared")


def check_data_sources(d) -> None:
  """data.source, or data.mixture's specs, rates and exhaustion (data/mixture.py)."""
  mixture = d.get("mixture", "")
  _choice("data.mixture_exhausted", d.get("mixture_exhausted", "restart"), EXHAUSTED)
  if not mixture:
    _choice("data.source (scheme)", d.source.split(":", 1)[0], SOURCE_SCHEMES)
    return
  if d.source != "embedded":
    raise ConfigError(f"data.source={d.source!r} and data.mixture are both set: name the"
                      " source in data.mixture, or leave data.mixture empty")
  if d.eval_source:
    raise ConfigError(f"data.eval_source={d.eval_source!r} with data.mixture: a mixture"
                      " holds out data.eval_fraction of each source; leave it empty")
  for spec, _ in parse_mixture(mixture):
    _choice(f"data.mixture[{spec!r}] (scheme)", spec.split(":", 1)[0], SOURCE_SCHEMES)


# ---------------------------------------------------------------- train, optimizer
def _check_train(config) -> None:
  t = config.train
  positive("train.batch_size", t.batch_size)
  positive("train.microbatches", t.microbatches)
  positive("train.num_steps", t.num_steps)
  for key in ("log_every",):
    positive(f"train.{key}", t[key])
  for key in ("eval_every", "checkpoint_every", "eval_batches"):
    positive(f"train.{key}", t[key], allow_zero=True)
  if t.eval_every and not t.eval_batches:
    raise ConfigError("train.eval_batches=0 with train.eval_every > 0: evaluate on >= 1 batch")
  if t.keep_checkpoints is not None:
    positive("train.keep_checkpoints", t.keep_checkpoints)
  try:
    phase_configs(config)
  except (ValueError, TypeError) as e:
    raise ConfigError(str(e)) from None


def check_optimizer(config, *, allow_zero_lr: bool = False,
                    allow_long_warmup: bool = False) -> None:
  """config.optimizer, its schedule against config.train.num_steps. allow_zero_lr: a
  learning rate of 0 (the weights stay as loaded); allow_long_warmup: a linear / cosine
  warmup may outlast the decay steps (the run then only warms up)."""
  o = config.optimizer
  _choice("optimizer.name", o.name, OPTIMIZERS)
  _choice("optimizer.schedule", o.schedule, SCHEDULES)
  positive("optimizer.learning_rate", o.learning_rate, allow_zero=allow_zero_lr)
  positive("optimizer.warmup_steps", o.warmup_steps, allow_zero=True)
  positive("optimizer.decay_steps", o.decay_steps, allow_zero=True)
  positive("optimizer.weight_decay", o.weight_decay, allow_zero=True)
  positive("optimizer.clip_norm", o.clip_norm, allow_zero=True)
  positive("optimizer.eps", o.eps, allow_zero=True)
  for key in ("b1", "b2", "end_learning_rate_fraction", "adafactor_decay_rate"):
    if not 0.0 <= o[key] <= 1.0:
      raise ConfigError(f"optimizer.{key}={o[key]}: must be in [0, 1]")
  decay = o.decay_steps or config.train.num_steps
  if o.schedule in ("linear", "cosine") and o.warmup_steps > decay and not allow_long_warmup:
    raise ConfigError(f"optimizer.warmup_steps={o.warmup_steps} exceeds the decay steps"
                      f" ({decay}: optimizer.decay_steps or train.num_steps)")


# ----------------------------------------------------------------------- the mesh
def check_mesh(config, num_devices: int, model: Optional[Model]) -> dict[str, int]:
  """config.mesh over `num_devices`, config.train's batch over its batch shards and
  every parameter of `model` (None: not known) over the axes config.mesh.rules puts it
  on; returns the mesh's axis sizes."""
  _check_rules(config.mesh.rules)
  try:
    check_zero_stage(config.mesh.get("zero_stage", 0))
  except ValueError as e:
    raise ConfigError(str(e)) from None
  sizes = mesh_axis_sizes(config.mesh, num_devices)
  _check_batch(config, sizes)
  if model is not None:
    _check_param_dims(config, model, sizes)
  return sizes


def mesh_axis_sizes(mesh_cfg, num_devices: int) -> dict[str, int]:
  """{'data': n, 'fsdp': n, 'tensor': n}: each axis = within-slice x across-slice size.

  The arithmetic of parallel.mesh_from_config, without devices (so a pod's mesh can be
  checked on a laptop). Raises ConfigError naming the mesh keys.
  """
  try:
    ici, dcn = config_axis_sizes(mesh_cfg, num_devices)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return {a: ici[a] * dcn[a] for a in MESH_AXES}


def _check_rules(rules) -> None:
  """mesh.rules: (logical axis, mesh axes) pairs over names the models and meshes use."""
  mesh_names = set(MESH_AXES) | set(parallel.TENSOR_AXES)
  for i, rule in enumerate(rules or ()):
    if not isinstance(rule, (tuple, list)) or len(rule) != 2:
      raise ConfigError(f"mesh.rules[{i}]={rule!r}: expected a (logical axis, mesh axes) pair")
    logical, axes = rule
    if logical not in parallel.LOGICAL_AXES:
      raise ConfigError(f"mesh.rules[{i}]: logical axis {logical!r} is not one the models"
                        f" use; known: {sorted(parallel.LOGICAL_AXES)}")
    for axis in (() if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)):
      if axis not in mesh_names:
        raise ConfigError(f"mesh.rules[{i}]: mesh axis {axis!r} is not a mesh axis; known:"
                          f" {sorted(mesh_names)} (or None: replicated)")


def _check_batch(config, mesh: dict[str, int]) -> None:
  t = config.train
  shards = mesh["data"] * mesh["fsdp"]  # rule ("batch", ("data", "fsdp"))
  if t.batch_size % shards:
    raise ConfigError(f"train.batch_size={t.batch_size} does not divide over the {shards}"
                      f" batch shards (mesh data={mesh['data']} x fsdp={mesh['fsdp']}); use a"
                      f" multiple of {shards}")
  if t.batch_size % t.microbatches or (t.batch_size // t.microbatches) % shards:
    raise ConfigError(f"train.microbatches={t.microbatches}: each microbatch of"
                      f" train.batch_size={t.batch_size} must divide over the {shards} batch"
                      f" shards; use a divisor of {t.batch_size // shards}")


def _check_activation_memory(config, model: Model, mesh: dict[str, int],
                             device_bytes: int) -> None:
  """Refuses a step whose activations cannot fit in one device, whatever the remat
  policy: a lower bound of the bytes one microbatch keeps on a device, the residual
  stream saved at every layer input plus one layer's attention scores (every
  attention kernel here materialises them: [rows, heads, L, L] in float32)."""
  rows = max(1, config.train.batch_size // config.train.microbatches
             // (mesh["data"] * mesh["fsdp"]))
  lengths = [("data.length", config.data.length)] + [
      (f"train.phases[{i}].length", int(dict(p).get("length", config.data.length)))
      for i, p in enumerate(config.train.phases or ())]
  name, length = max(lengths, key=lambda x: x[1])
  model_cfg = model.config
  layers = sum(model.stack_layers(model_cfg).values())
  width = 2 if model_cfg.dtype == "bfloat16" else 4
  residual = rows * length * model_cfg.d_model * width * layers
  scores = rows * max(1, model_cfg.num_heads // mesh["tensor"]) * length * length * 4
  if residual + scores > device_bytes:
    gib = 2.0**30
    raise ConfigError(
        f"{name}={length}: one step needs at least {(residual + scores) / gib:,.1f} GiB of"
        f" activations per device ({rows} row(s) per device and microbatch, {layers}"
        f" layers, d_model {model_cfg.d_model}, {model_cfg.num_heads} heads), more than"
        f" the device's {device_bytes / gib:,.1f} GiB; shorten it, or use a smaller"
        " train.batch_size, more train.microbatches or more devices")


def _check_param_dims(config, model: Model, mesh: dict[str, int]) -> None:
  """Every parameter dimension divides over the mesh axes its logical axis maps to."""
  model_cfg = model.config
  if model_cfg.num_heads % mesh["tensor"]:
    valid = [n for n in range(1, model_cfg.num_heads + 1) if model_cfg.num_heads % n == 0]
    raise ConfigError(f"mesh.tensor={mesh['tensor']}: the model's {model_cfg.num_heads}"
                      f" attention heads do not divide over it; valid: {valid}")
  rules = parallel.rules_for_mesh(mesh_rules(config), MESH_AXES)
  mapping = {logical: ((axes,) if isinstance(axes, str) else tuple(axes or ()))
             for logical, axes in rules}
  shapes = jax.tree_util.tree_leaves_with_path(model.param_shapes())
  specs = jax.tree.leaves(model.param_axes(), is_leaf=lambda x: isinstance(x, PartitionSpec))
  for (path, shape), spec in zip(shapes, specs):
    for size, logical in zip(shape.shape, tuple(spec)):
      mesh_axes = mapping.get(logical, ())
      ways = math.prod(mesh[a] for a in mesh_axes)
      if ways > 1 and size % ways:
        keys = " x ".join(f"mesh.{a}={mesh[a]}" for a in mesh_axes)
        raise ConfigError(f"{keys}: parameter {jax.tree_util.keystr(path)} has {logical!r}"
                          f" dimension {size}, which does not divide over {ways} devices;"
                          f" valid: mesh sizes dividing {size}, or another model size")
