"""From a config to the objects of an experiment: the one room where configs are built.

  vocab = config_vocab(config)                        # data.vocab or the objective's
  model = build_model_from_config(config, vocab.vocab_size)
  mesh, rules = build_mesh(config)
  vocab, objective, eval_objective, stats = build_data(config, workdir)
  for until_step, phase_config in phase_configs(config): ...

The trainer, fine-tuning, infer, plan and bench all build through here, so a config
means the same model, vocabulary, objective and phases to each of them. This module
imports the libraries (data, models) and nothing of the commands above them.
"""

from __future__ import annotations

import os
from typing import Optional

import ml_collections

from t5x_like.data.mixture import (SIZE, Mixture, MixtureError, MixtureSource,
                                   parse_mixture, source_names, source_seed)
from t5x_like.data.pipeline import OBJECTIVES, make_objective
from t5x_like.data.prepared import describe, is_prepared_spec, open_prepared, prepared_path
from t5x_like.data.sources import source_from_spec
from t5x_like.data.store import split_held_out
from t5x_like.data.tokenize import build_store
from t5x_like.data.vocab import Vocabulary, default_vocab, load_vocab
from t5x_like.errors import UserError
from t5x_like.models import build_model, preset
from t5x_like.models.config import ModelConfig
from t5x_like.parallel import DEFAULT_RULES, mesh_from_config


REMAT_AUTO = "auto"  # model.remat_policy: chosen by compiling (plan/remat.py)


class ExperimentConfigError(UserError, ValueError):
  """A config that names what does not exist (an objective, a malformed phase)."""


def objective_kwargs(config) -> dict:
  """The objective's keyword arguments of config.data: its options and targets_length."""
  kwargs = dict(config.data.options)
  if config.data.targets_length:
    kwargs["targets_length"] = config.data.targets_length
  return kwargs


def config_vocab(config, *, shapes_only: bool = False) -> Vocabulary:
  """The vocabulary of config.data: data.vocab, or the shipped one of the objective's
  vocabulary family.

  shapes_only: for planning on another machine: a data.vocab that is not here (a bucket
  path, another machine's file) falls back to the family's shipped one when
  model.overrides.vocab_size fixes the model's size (shapes need only its special ids).
  """
  data = config.data
  spec = OBJECTIVES.get(data.objective)
  if spec is None:
    raise ExperimentConfigError(f"data.objective={data.objective!r}: expected one of"
                                f" {sorted(OBJECTIVES)}")
  if not data.vocab:
    return default_vocab(spec.vocab_family)
  try:
    return load_vocab(data.vocab)
  except (FileNotFoundError, OSError):
    if shapes_only and "vocab_size" in config.model.overrides:
      return default_vocab(spec.vocab_family)
    raise


def model_config_from(config, vocab_size: Optional[int]) -> ModelConfig:
  """The ModelConfig of config.model: its preset with dtype, scan, remat, attention
  kernel, `vocab_size` ids (None: the preset's) and then model.overrides, which win.
  The one merge of config.model; raises ValueError / TypeError on an unknown field."""
  m = config.model
  # 'auto' is chosen by compiling (plan/remat.py resolve_remat) where a train step is
  # built; until then, and for what takes no gradients (infer, export), it is 'none'.
  remat = "none" if m.remat_policy == REMAT_AUTO else m.remat_policy
  fields = dict(dtype=m.dtype, scan_layers=m.scan_layers, remat_policy=remat,
                attention_impl=attention_impl(config))
  if vocab_size is not None:
    fields["vocab_size"] = vocab_size
  fields.update(m.overrides)
  return preset(m.preset, **fields)


def attention_impl(config) -> str:
  """config.model.attention_impl ('auto' for configs written before it existed)."""
  return config.model.get("attention_impl", "auto")


def build_model_from_config(config, vocab_size: int):
  """The model of config.model (model_config_from) for `vocab_size` ids;
  model.overrides.vocab_size, when set, wins."""
  return build_model(model_config_from(config, vocab_size))


def mesh_rules(config) -> tuple:
  """The logical-axis rules of config.mesh: mesh.rules, or parallel.DEFAULT_RULES when
  it is empty. The one place that default is applied."""
  return tuple(config.mesh.rules) or DEFAULT_RULES


def build_mesh(config, devices=None) -> tuple:
  """(mesh, rules) of config.mesh over `devices` (None: all of jax.devices())."""
  return mesh_from_config(config.mesh, devices), mesh_rules(config)


def model_name(config) -> str:
  """What runs, for logs: the preset with those of config.model.overrides that change it
  ('gpt2-124m with d_model=64, ...'), not the preset's name alone."""
  base = preset(config.model.preset)
  overrides = sorted((k, v) for k, v in dict(config.model.overrides).items()
                     if getattr(base, k, None) != v)
  if not overrides:
    return config.model.preset
  return f"{config.model.preset} with " + ", ".join(f"{k}={v}" for k, v in overrides)


def build_objective(config, store, vocab: Vocabulary, *, seed: int):
  """config.data's objective over `store` (its length, options and targets_length)."""
  return make_objective(config.data.objective, store, vocab, seed=seed,
                        length=config.data.length, **objective_kwargs(config))


def build_data(config, workdir: str):
  """(vocab, train objective, eval objective, data stats) from config.data; the token
  cache goes to data.cache_dir, else <workdir>/data_cache. A `prepared:DIR` source is
  read in place (data/prepared.py): its train split, and its held-out split unless
  data.eval_source is set. With data.mixture, both objectives are data/mixture.py's
  Mixture of one objective per source (each source's held-out split for eval)."""
  data = config.data
  vocab = config_vocab(config)
  cache_dir = data.cache_dir or os.path.join(workdir, "data_cache")

  def store_of(spec: str, default_split: str, held_out_fraction=None):
    if is_prepared_spec(spec):
      path, split = prepared_path(spec)
      store, manifest = open_prepared(path, vocab, split=split or default_split,
                                      held_out_fraction=held_out_fraction,
                                      verify=data.get("verify_checksums", "blocks"))
      return store, describe(manifest)
    return build_store(source_from_spec(spec), vocab, cache_dir=cache_dir)

  def stores_of(spec: str, eval_source: str):
    """(train store, eval store, stats) of source `spec`."""
    if is_prepared_spec(spec):
      train_store, stats = store_of(spec, "train", None if eval_source else data.eval_fraction)
      eval_store, _ = (store_of(eval_source, "train") if eval_source else
                       store_of(f"prepared:{prepared_path(spec)[0]}#held_out", "held_out"))
      return train_store, eval_store, stats
    store, stats = store_of(spec, "train")
    if eval_source:
      return store, store_of(eval_source, "train")[0], stats
    return (*split_held_out(store, data.eval_fraction, stats.get("source_documents")), stats)

  if data.get("mixture", ""):
    return (vocab, *_mixture_data(config, vocab, stores_of))
  train_store, eval_store, stats = stores_of(data.source, data.eval_source)
  train = build_objective(config, train_store, vocab, seed=config.seed)
  evaluation = build_objective(config, eval_store, vocab, seed=config.seed + 1)
  held_out = (f"data.eval_source={data.eval_source!r}" if data.eval_source else
              f"the held-out data.eval_fraction={data.eval_fraction} of"
              f" data.source={data.source!r}")
  _require_examples(config, ((f"data.source={data.source!r}", train),
                             (held_out, evaluation)), stats)
  return vocab, train, evaluation, stats


def _require_examples(config, objectives, stats: dict) -> None:
  """UserError unless each (where, objective) has an example in epoch 0."""
  data = config.data
  for where, objective in objectives:
    if objective.num_examples(0) <= 0:  # else the loader fails at its first batch
      raise UserError(f"{where}: too little text for one {data.objective} example of"
                      f" data.length={data.length} ({stats.get('tokens', 0):,} tokens in"
                      f" {stats.get('documents', 0)} documents in all); give it more text"
                      f" or a shorter data.length")


def _mixture_data(config, vocab, stores_of):
  """(train Mixture, eval Mixture, stats) of config.data.mixture (data/mixture.py):
  each source's train and held-out stores, rates given or by training tokens."""
  entries = parse_mixture(config.data.mixture)
  names = source_names([spec for spec, _ in entries])
  stores = []
  for spec, _ in entries:
    try:
      stores.append(stores_of(spec, ""))
    except UserError as e:
      raise MixtureError(f"data.mixture[{spec!r}]: {e}") from None
  weights = [train.num_tokens if rate == SIZE else rate
             for (_, rate), (train, _, _) in zip(entries, stores)]
  rates = [w / sum(weights) for w in weights]
  mixtures, stats = [], {"mixture": {}, "source": {}}
  for split, seed in ((0, config.seed), (1, config.seed + 1)):
    sources = []
    for i, ((spec, _), name, rate, store) in enumerate(zip(entries, names, rates, stores)):
      objective = build_objective(config, store[split], vocab, seed=source_seed(seed, i))
      where = (f"data.mixture[{spec!r}]" if split == 0 else
               f"the held-out data.eval_fraction={config.data.eval_fraction} of"
               f" data.mixture[{spec!r}]")
      _require_examples(config, [(where, objective)], store[2])
      sources.append(MixtureSource(name, spec, objective, rate))
    mixtures.append(Mixture(sources, seed=seed))
  for name, spec, rate, (train, _, source_stats) in zip(names, [s for s, _ in entries],
                                                        rates, stores):
    stats["mixture"][name] = {"spec": spec, "rate": round(rate, 6), "tokens": train.num_tokens,
                              "documents": train.num_docs}
    stats["source"][name] = source_stats.get("source", {})
  return mixtures[0], mixtures[1], stats


def global_batch_shapes(objective, batch_size: int) -> dict[str, tuple]:
  """{feature: (batch_size, *per-example shape)} of `objective`."""
  return {k: (batch_size, *shape) for k, shape in sorted(objective.feature_shapes().items())}


def phase_configs(config: ml_collections.ConfigDict) -> list[tuple[int, ml_collections.ConfigDict]]:
  """[(until_step, config of that phase)] from config.train.phases (train/defaults.py).

  Without phases: one phase to num_steps. A phase's config is `config` with data.length
  replaced and data.options updated by the phase's entries.
  """
  phases = list(config.train.phases or ())
  if not phases:
    return [(int(config.train.num_steps), config)]
  out, previous = [], 0
  for i, phase in enumerate(phases):
    phase = dict(phase)
    unknown = sorted(set(phase) - {"until_step", "length", "options"})
    if unknown or "until_step" not in phase:
      raise ExperimentConfigError(f"train.phases[{i}]: expected keys until_step, length,"
                                  f" options; got {sorted(phase)}")
    until = int(phase["until_step"])
    if until <= previous:
      raise ExperimentConfigError(f"train.phases[{i}].until_step={until}: must exceed the"
                                  f" previous phase's ({previous})")
    c = ml_collections.ConfigDict(config.to_dict())
    c.data.length = int(phase.get("length", c.data.length))
    c.data.options.update(dict(phase.get("options", {})))
    out.append((until, c))
    previous = until
  if previous != config.train.num_steps:
    raise ExperimentConfigError(f"train.phases[-1].until_step={previous}: must equal"
                                f" train.num_steps={config.train.num_steps}")
  return out
