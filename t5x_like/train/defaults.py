"""The training config schema: every key, its default and its meaning.

Experiment files in configs/ start from `default_config()` and override keys;
`t5x-like train --config configs/x.py --config.train.batch_size=64` overrides more.
"""

from __future__ import annotations

import ml_collections


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0

  # Model: a preset from t5x_like.models.PRESETS plus ModelConfig field overrides.
  # vocab_size is taken from the vocabulary unless set here.
  c.model = ml_collections.ConfigDict()
  c.model.preset = "bert-tiny"
  c.model.overrides = ml_collections.ConfigDict()  # any ModelConfig field
  c.model.dtype = "float32"  # compute dtype (params stay float32): float32 | bfloat16
  c.model.scan_layers = False
  # none | dots | dots_no_batch | full (least to most recomputation) | auto: the first
  # of those whose compiled train step fits 90% of the device (plan/remat.py)
  c.model.remat_policy = "none"
  # auto | explicit | xla | cudnn | pallas | pallas_gpu: the attention kernel
  # (models/attention_core.py; auto picks per backend, `t5x-like bench model` prints each
  # attention's choice)
  c.model.attention_impl = "auto"

  # Data (t5x_like.data): source spec, vocabulary, objective and lengths.
  c.data = ml_collections.ConfigDict()
  c.data.source = "embedded"
  c.data.vocab = ""  # a .model path or directory; "" = the shipped one of the family
  c.data.objective = "bert_mlm"
  c.data.length = 128  # inputs / max_seq_length / decoder length
  c.data.targets_length = 0  # prefix_lm_encdec only
  c.data.options = ml_collections.ConfigDict()  # objective options
  # Mixture of sources (data/mixture.py; seqio's Mixture): "SPEC=RATE,SPEC=RATE" or
  # "{'SPEC': RATE, ...}", each spec any data.source form, each rate a positive number
  # or, for all at once, "size" (proportional to training tokens). "" = data.source.
  # Eval holds out data.eval_fraction of each source, reported per source.
  c.data.mixture = ""
  c.data.mixture_exhausted = "restart"  # restart (next epoch, reshuffled) | stop (end the run)
  c.data.eval_source = ""  # "" = hold out the tail of every training document
  c.data.eval_fraction = 0.02
  c.data.num_workers = 0
  c.data.cache_dir = ""  # "" = <workdir>/data_cache
  # prepared:DIR sources: "blocks" checks every 16 KiB block read against its CRC-32;
  # "full" also hashes every file (SHA-256) at start-up, O(corpus); "none" checks sizes only
  c.data.verify_checksums = "blocks"

  # Train loop.
  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 32  # global
  c.train.microbatches = 1
  c.train.num_steps = 1000
  c.train.log_every = 10
  c.train.eval_every = 200
  c.train.eval_batches = 8
  c.train.checkpoint_every = 200
  c.train.keep_checkpoints = 3
  c.train.async_checkpoints = True
  # Phases (BERT's 128 -> 512 recipe): () = one phase with data.length / data.options;
  # else dicts {"until_step": N, "length": L, "options": {...}} in order, the last ending
  # at num_steps. Each phase overrides data.length and updates data.options until its
  # step; the next resumes from that checkpoint with the new shapes and a fresh iterator.
  c.train.phases = ()

  # Optimizer and schedule (t5x_like.train.optimizers).
  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "adamw"  # adamw | adafactor
  c.optimizer.learning_rate = 1e-4
  c.optimizer.schedule = "linear"  # linear (warmup, linear decay) | rsqrt | cosine | constant
  c.optimizer.warmup_steps = 100
  c.optimizer.decay_steps = 0  # 0 = train.num_steps
  c.optimizer.end_learning_rate_fraction = 0.0  # cosine / linear floor
  c.optimizer.weight_decay = 0.01  # decoupled; never on norms or biases
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.999
  c.optimizer.eps = 1e-6
  c.optimizer.bias_correction = True  # BERT's reference AdamW has none
  c.optimizer.clip_norm = 1.0  # global norm; 0 = off
  c.optimizer.adafactor_decay_rate = 0.8

  # Mesh: axis sizes, -1 fills the rest; dcn_* split axes across slices (multi-slice).
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  c.mesh.dcn_data = 1
  c.mesh.dcn_fsdp = 1
  c.mesh.dcn_tensor = 1
  c.mesh.rules = ()  # () = t5x_like.parallel.DEFAULT_RULES
  # ZeRO: 0 every data-parallel device holds the whole optimizer state; 1 each holds and
  # updates 1 / N of it; 2 the gradients too (reduce-scatter + all-gather in place of the
  # all-reduce). Stage 3 (parameters sharded) is mesh.fsdp > 1. docs/tpu.md.
  c.mesh.zero_stage = 0
  return c


def smoke_schedule(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Shrinks the run of any config to 20 tiny steps (length 64, batch 8), logging and
  checkpointing often: the `:smoke` variant of the CPU configs, for tests."""
  c.data.length = 64
  c.train.batch_size = 8
  c.train.num_steps = 20
  c.train.log_every = 1
  c.train.eval_every = 10
  c.train.eval_batches = 2
  c.train.checkpoint_every = 5
  c.optimizer.warmup_steps = 5
  return c


def parse_arg(arg: str, **defaults) -> ml_collections.ConfigDict:
  """big_vision-style config arguments: "base,local" or "size=base,local=True".

  Each comma-separated item is `key=value` or a bare word. A bare word that is a
  boolean key of `defaults` sets it True; otherwise it sets the first key of
  `defaults` (the main variant). Values take the type of their default.
  """
  out = ml_collections.ConfigDict(dict(defaults))
  keys = list(defaults)
  for item in filter(None, (x.strip() for x in (arg or "").split(","))):
    key, sep, value = item.partition("=")
    if not sep:
      if isinstance(defaults.get(key), bool):
        key, value = key, "True"
      else:
        key, value = keys[0], item
    if key not in defaults:
      raise ValueError(f"config argument {item!r}: unknown key {key!r}; known: {keys}")
    default = defaults[key]
    if isinstance(default, bool):
      if value not in ("True", "False", "true", "false", "1", "0"):
        raise ValueError(f"config argument {key}={value!r}: expected True or False")
      out[key] = value in ("True", "true", "1")
    else:
      out[key] = type(default)(value)
  return out
