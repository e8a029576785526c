"""One builder (issue 30): every command builds its mesh rules, model config and model
class through experiment.py and models/, read from the source; the families are the
model registry's; fine-tuning goes through the train command's validator."""

import math
import os

import pytest

from t5x_like import cli
from t5x_like.errors import UserError
from t5x_like.finetune.config_check import validate_finetune
from t5x_like.models import build_model, model_class, preset
from t5x_like.models.config import FAMILIES
from t5x_like.models.model import (MODEL_CLASSES, DecoderModel, EncoderDecoderModel,
                                   EncoderModel)
from t5x_like.train import flops
from t5x_like.train.config_check import ConfigError
from t5x_like.command_flags import load_config_file
from helpers import ROOT

PACKAGE = os.path.join(ROOT, "t5x_like")
FINETUNE = os.path.join(ROOT, "configs", "finetune_books.py")


def _files_with(text: str) -> dict[str, int]:
  """{path relative to the repository: occurrences of `text`} over the package."""
  out = {}
  for d, _, files in os.walk(PACKAGE):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(d, f)
        count = open(path, encoding="utf-8").read().count(text)
        if count:
          out[os.path.relpath(path, ROOT).replace(os.sep, "/")] = count
  return out


def test_the_default_mesh_rules_are_applied_once():
  assert _files_with("mesh.rules) or") == {"t5x_like/experiment.py": 1}


def test_model_classes_are_looked_up_only_in_models():
  found = {p for p in _files_with("MODEL_CLASSES[")
           if not p.startswith("t5x_like/models/")}
  assert found == set()


def test_the_attention_kernel_default_is_read_once():
  assert set(_files_with('get("attention_impl"')) == {"t5x_like/experiment.py"}


def test_the_families_are_the_registry():
  assert tuple(MODEL_CLASSES) == FAMILIES
  assert [MODEL_CLASSES[f] for f in FAMILIES] == [EncoderModel, DecoderModel,
                                                   EncoderDecoderModel]
  for name, cls in (("bert-base", EncoderModel), ("gpt2-124m", DecoderModel),
                    ("t5-small", EncoderDecoderModel)):
    cfg = preset(name)
    assert model_class(cfg) is cls and type(build_model(cfg)) is cls


def test_flops_take_the_model_or_its_config():
  cfg = preset("gpt2-124m", num_layers=2, d_model=64, num_heads=4, d_ff=128)
  shapes = {"decoder_input_tokens": (2, 16)}
  assert flops.forward_flops(build_model(cfg), shapes) == flops.forward_flops(cfg, shapes)


# ------------------------------------------------------------------ fine-tuning
@pytest.fixture
def task_dir(tmp_path, monkeypatch):
  """configs/finetune_books.py:bert,smoke's files, with the repository as the working
  directory (its init.config is relative to it)."""
  for split in ("train", "dev"):
    (tmp_path / f"{split}.csv").write_text("text,label\nA passage.,austen\nAnother.,dickens\n")
  monkeypatch.chdir(ROOT)
  return str(tmp_path)


def _finetune_config(task_dir: str):
  return load_config_file(f"{FINETUNE}:bert,smoke,dir={task_dir}")


def test_the_finetune_configs_validate(task_dir):
  for variant in ("bert,smoke", "t5,smoke", "bert", "t5"):
    validate_finetune(load_config_file(f"{FINETUNE}:{variant},dir={task_dir}"), 8)


@pytest.mark.parametrize("key, value, words", [
    ("train.batch_size", 6, ["train.batch_size=6", "8 batch shards"]),
    ("optimizer.learning_rate", math.nan, ["optimizer.learning_rate=nan", "finite"]),
    ("seed", -1, ["seed=-1"]),
    ("mesh.tensor", 3, ["mesh.tensor"]),
    ("task.max_length", 4096, ["task.max_length=4096", "max_position_embeddings"]),
    ("init.model_overrides", {"d_modl": 8}, ["init.model_overrides.d_modl"]),
    ("init.model_overrides", {"num_heads": 5}, ["init.model_overrides", "num_heads"]),
    ("task.dev_file", "", ["task.dev_file"]),
    ("task.name", "summarize", ["task.name", "summarize"]),
])
def test_a_bad_finetune_config_is_a_config_error_naming_the_key(task_dir, key, value, words):
  config = _finetune_config(task_dir)
  section, _, name = key.rpartition(".")
  node = config[section] if section else config
  with config.unlocked():
    node[name] = value
  with pytest.raises(UserError) as raised:
    validate_finetune(config, 8)
  message = str(raised.value)
  assert "\n" not in message
  for word in words:
    assert word in message, (word, message)


def test_an_unknown_finetune_key_is_refused(task_dir):
  config = _finetune_config(task_dir)
  with config.unlocked():
    config.train.num_step = 3
  with pytest.raises(ConfigError, match="train.num_step"):
    validate_finetune(config, 8)


def test_the_finetune_command_validates_before_the_run(task_dir, tmp_path, capfd):
  """A batch that does not divide over the 8 devices' batch shards: one line naming
  the key, exit 2, before anything is read or written."""
  workdir = tmp_path / "wd"
  code = cli.main(["finetune", f"--config={FINETUNE}:bert,smoke,dir={task_dir}",
                   f"--workdir={workdir}", "--config.train.batch_size=6"])
  err = capfd.readouterr().err
  lines = [line for line in err.splitlines() if line.strip()]
  assert code == 2 and len(lines) == 1 and "train.batch_size=6" in lines[0], err
  assert not workdir.exists()
