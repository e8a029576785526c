"""Every config in configs/ loads and validates; invalid configs are rejected before
anything is built, with a message naming the key; the CPU variants of the pretraining
configs train a few steps."""

import dataclasses
import fnmatch
import glob
import os
import re

import pytest

from t5x_like.experiment import config_vocab, model_name
from t5x_like.models.config import ModelConfig
from t5x_like.train import loop
from t5x_like.train.config_check import ConfigError, mesh_axis_sizes, validate
from t5x_like.train.defaults import default_config, parse_arg
from helpers import ROOT, load_config

CONFIGS = os.path.join(ROOT, "configs")

# Every variant of every config, with the devices of the topology it is made for.
VARIANTS = {
    "bert_pretrain": [("base", 32), ("large", 128), ("base,local", 8), ("large,local", 8)],
    "t5_pretrain": [("small", 32), ("base", 32), ("large", 64), ("small,local", 8)],
    "gpt2_pretrain": [("124m", 32), ("355m", 64), ("124m,local", 8)],
    "bert_cpu": [("", 8), ("smoke", 8), ("mini", 8)],
    "gpt_cpu": [("", 8), ("smoke", 8)],
    "t5_cpu": [("", 8), ("smoke", 8), ("mini", 8)],
}
# Fine-tuning configs (t5x-like finetune): their variants.
FINETUNE_VARIANTS = {"finetune_books": ["bert", "t5", "bert,smoke", "t5,smoke"],
                     "glue": ["cola", "mnli,family=t5", "stsb,smoke", "rte,smoke,family=t5"],
                     "superglue": ["boolq", "cb,smoke,family=t5"],
                     "squad": ["v1", "v2,smoke,family=t5"],
                     "text_tasks": ["acceptability", "coherence,family=t5",
                                    "authorship,smoke", "coherence,smoke,family=t5"]}


load = load_config


def test_every_config_file_is_covered():
  files = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(CONFIGS, "*.py"))}
  assert files == set(VARIANTS) | set(FINETUNE_VARIANTS)


@pytest.mark.parametrize("name, arg", [(n, a) for n, vs in FINETUNE_VARIANTS.items()
                                       for a in vs])
def test_finetune_config_names_a_valid_pretraining_config(name, arg, monkeypatch):
  from t5x_like.finetune.defaults import default_finetune_config
  from t5x_like.command_flags import load_config_file
  config = load(name, arg)
  assert set(config.to_dict()) == set(default_finetune_config().to_dict())
  monkeypatch.chdir(ROOT)  # init.config is relative to the repository root
  # the benchmark configs leave init.config "" (a checkpoint's workdir names it)
  pretrain = load_config_file(config.init.config or config.init.default_config)
  validate(pretrain, 8, vocab_size=config_vocab(pretrain).vocab_size)
  assert config.task.max_length <= pretrain.model.overrides.get("max_position_embeddings", 512)


@pytest.mark.parametrize("name, arg, devices",
                         [(n, a, d) for n, vs in VARIANTS.items() for a, d in vs])
def test_config_loads_and_validates(name, arg, devices):
  config = load(name, arg)
  validate(config, devices, vocab_size=config_vocab(config).vocab_size)


def test_published_recipes():
  bert = load("bert_pretrain", "base")
  assert (bert.train.batch_size, bert.train.num_steps) == (256, 1_000_000)
  assert [(p["until_step"], p["length"], p["options"]["max_predictions_per_seq"])
          for p in bert.train.phases] == [(900_000, 128, 20), (1_000_000, 512, 80)]
  assert (bert.optimizer.learning_rate, bert.optimizer.warmup_steps) == (1e-4, 10_000)
  assert mesh_axis_sizes(bert.mesh, 32)["data"] == 32
  assert mesh_axis_sizes(load("bert_pretrain", "large").mesh, 128)["data"] == 128
  t5 = load("t5_pretrain", "large")
  assert (t5.train.batch_size, t5.data.length, t5.optimizer.name) == (256, 512, "adafactor")
  assert load("gpt2_pretrain", "355m").model.preset == "gpt2-355m"


def test_config_argument_parsing():
  assert parse_arg("large,local", size="base", local=False).to_dict() == dict(
      size="large", local=True)
  assert parse_arg("size=small", size="base", local=False).size == "small"
  with pytest.raises(ValueError, match="unknown key 'color'"):
    parse_arg("color=red", size="base", local=False)
  with pytest.raises(ValueError, match="size 'huge'"):
    load("bert_pretrain", "huge")


def _node(c, path: str):
  *sections, key = path.split(".")
  for s in sections:
    c = c[s]
  return c, key


def _set(path: str, value):
  def apply(c):
    node, key = _node(c, path)
    node[key] = value
  return apply


def _add_section_key(c):
  with c.train.unlocked():
    c.train.batchsize = 32  # a typo of batch_size


def _retype(path, value):
  """Bypasses ConfigDict's own type check (as a config built from a plain dict would)."""
  def apply(c):
    node, key = _node(c, path)
    node._fields[key] = value
  return apply


# (what is wrong, mutation of configs/bert_pretrain.py:base on 32 devices, key in message)
INVALID = [
    ("unknown key", _add_section_key, "train.batchsize"),
    ("string batch size", _retype("train.batch_size", "256"), "train.batch_size"),
    ("float steps", _retype("train.num_steps", 1e6), "train.num_steps"),
    ("bool as int", _retype("mesh.data", True), "mesh.data"),
    ("unknown preset", _set("model.preset", "bert-huge"), "model.preset"),
    ("unknown dtype", _set("model.dtype", "float16"), "model.dtype"),
    ("unknown remat", _set("model.remat_policy", "everything"), "model.remat_policy"),
    ("unknown override", _set("model.overrides", {"hidden_size": 768}),
     "model.overrides.hidden_size"),
    ("bad override value", _set("model.overrides", {"num_heads": 7}),
     "ModelConfig.num_heads"),
    ("unknown objective", _set("data.objective", "mlm"), "data.objective"),
    ("objective vs family", _set("data.objective", "causal_lm"), "data.objective"),
    ("unknown source scheme", _set("data.source", "hdfs:/corpus"), "data.source"),
    ("length over positions", _set("data.length", 1024), "data.length"),
    ("unknown objective option", _set("data.options", {"mask_rate": 0.2}),
     "data.options.mask_rate"),
    ("eval fraction", _set("data.eval_fraction", 1.5), "data.eval_fraction"),
    ("batch over data axis", _set("train.batch_size", 100), "train.batch_size"),
    ("microbatches", _set("train.microbatches", 3), "train.microbatches"),
    ("zero steps", _set("train.num_steps", 0), "train.num_steps"),
    ("negative eval_every", _set("train.eval_every", -5), "train.eval_every"),
    ("phases not ending at num_steps", _set("train.num_steps", 999_999), "train.phases"),
    ("phase option typo", _set("train.phases", (
        dict(until_step=1_000_000, length=128, options=dict(max_preds=20)),)),
     "train.phases[0].options.max_preds"),
    ("phase length over positions", _set("train.phases", (
        dict(until_step=1_000_000, length=4096, options={}),)), "train.phases[0].length"),
    ("unknown optimizer", _set("optimizer.name", "sgd"), "optimizer.name"),
    ("unknown schedule", _set("optimizer.schedule", "exponential"), "optimizer.schedule"),
    ("negative lr", _set("optimizer.learning_rate", -1e-4), "optimizer.learning_rate"),
    ("b2 above 1", _set("optimizer.b2", 1.5), "optimizer.b2"),
    ("warmup past decay", _set("optimizer.warmup_steps", 2_000_000), "optimizer.warmup_steps"),
    ("heads over tensor", _set("mesh.tensor", 8), "mesh.tensor"),
    ("mesh larger than devices", lambda c: (_set("mesh.data", 32)(c), _set("mesh.tensor", 2)(c)),
     "mesh.data x mesh.fsdp x mesh.tensor"),
    ("two fill axes", _set("mesh.fsdp", -1), "mesh.data / mesh.fsdp / mesh.tensor"),
    ("mesh not filling devices", _set("mesh.data", 12), "mesh.data"),
    ("slices not dividing devices", _set("mesh.dcn_data", 3), "mesh.dcn_*"),
    ("vocab over tensor", lambda c: (_set("mesh.tensor", 4)(c),
                                     _set("model.overrides", dict(vocab_size=30523))(c)),
     "mesh.tensor=4"),
]


@pytest.mark.parametrize("what, mutate, key", INVALID, ids=[w for w, _, _ in INVALID])
def test_invalid_config_is_rejected_naming_the_key(what, mutate, key):
  config = load("bert_pretrain", "base")
  mutate(config)
  with pytest.raises(ConfigError) as info:
    validate(config, 32, vocab_size=30522)
  assert key in str(info.value), (what, str(info.value))


def _top_keys(c) -> dict[str, str]:
  """{'section.key': repr(value)} of a config, repr so that 1e6 differs from 1000000."""
  out = {}
  for section, node in c.to_dict().items():
    items = node.items() if isinstance(node, dict) else [(None, node)]
    for key, value in items:
      out[section if key is None else f"{section}.{key}"] = repr(value)
  return out


def _in_schema(name: str) -> bool:
  """Whether 'section.key' (the key may be a glob: 'mesh.dcn_*') is in default_config()."""
  schema = default_config()
  section, _, key = name.partition(".")
  return section in schema and bool(fnmatch.filter(list(schema[section].keys()), key))


@pytest.mark.parametrize("what, mutate, key", INVALID, ids=[w for w, _, _ in INVALID])
def test_invalid_case_is_about_keys_of_the_schema(what, mutate, key):
  """No case passes vacuously: the base config is valid, the mutation changes it, and
  the keys it changes and the keys its message names are in the schema of
  train/defaults.py (ModelConfig's fields for overrides); only the unknown-key case
  adds a key the schema lacks, and names it."""
  base = load("bert_pretrain", "base")
  validate(base, 32, vocab_size=30522)  # the rejection is the mutation's doing
  config = load("bert_pretrain", "base")
  mutate(config)
  before, after = _top_keys(base), _top_keys(config)
  changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
  assert changed, what
  unknown = {k for k in changed if not _in_schema(k)}
  if unknown:
    assert mutate is _add_section_key and unknown == changed == {key}, (what, changed)
    return
  # config keys named: a 'section.key' not inside a longer dotted or indexed name
  named = re.findall(r"(?<![\w.\]])[a-z_]+\.[a-z0-9_*]+", key)
  fields = re.findall(r"ModelConfig\.(\w+)", key)
  assert named or fields, (what, key)
  for name in named:
    assert _in_schema(name), (what, name)
  for name in fields:
    assert name in {f.name for f in dataclasses.fields(ModelConfig)}, (what, name)


@pytest.mark.parametrize("where", ["data.length", "train.phases"])
def test_configured_cudnn_is_checked_at_the_decoder_length(where):
  """T5's span corruption at 128 tokens has 29-token targets (T5's random_spans_helper),
  odd, which cuDNN's biased attention cannot take: a config error naming them, not a
  crash at trace time. At 512 the targets are 114 and cuDNN runs."""
  config = load("t5_pretrain", "base")
  config.model.attention_impl = "cudnn"
  validate(config, 8, vocab_size=32128, platform="gpu")  # 512 -> 114
  if where == "data.length":
    config.data.length = 128
  else:
    config.train.phases = [dict(until_step=10, length=128),
                           dict(until_step=config.train.num_steps, length=512)]
  with pytest.raises(ConfigError, match=r"model.attention_impl='cudnn': lengths 29 x 29"):
    validate(config, 8, vocab_size=32128, platform="gpu")


def test_train_rejects_an_invalid_config_before_building_anything(tmp_path):
  config = load("bert_cpu", "smoke")
  config.train.batch_size = 12  # 8 devices
  with pytest.raises(ConfigError, match="train.batch_size=12"):
    loop.train(config, str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w")  # nothing written, nothing compiled


@pytest.mark.long
@pytest.mark.parametrize("name, arg", [("t5_pretrain", "small,local"),
                                       ("gpt2_pretrain", "124m,local")])
def test_cpu_variant_of_each_pretraining_config_trains(name, arg, tmp_path):
  """(bert_pretrain's local variant trains both phases in tests/test_train.py.)"""
  config = load(name, arg)
  config.train.checkpoint_every = 0
  config.train.eval_every = 0
  result = loop.train(config, str(tmp_path))
  assert result["eval_loss"] > 0  # a finite eval after the run


def test_the_model_name_says_what_runs():
  """The GPT smoke config overrides gpt2-124m down to 561,984 params: its log name says so
  (it read 'model gpt2-124m: 561,984 params')."""
  smoke = load("gpt_cpu", "smoke")
  assert model_name(smoke) == (
      "gpt2-124m with attention_dropout_rate=0.0, d_ff=128, d_model=64, dropout_rate=0.0,"
      " max_position_embeddings=64, num_heads=2, num_layers=1")
  assert model_name(load("bert_pretrain", "base")) == "bert-base"
