"""Issue 43's fine-tuning frictions: a train workdir names its own config (config.py,
read when init.config is left ""), a mismatch names the backbone config and the key to
set, the random arm says so, a regression task says it predicts a score, heavy
truncation is warned about, and `finetune --help` lists the benchmark.* keys.

The default tier checks each piece on its own (no training); the slow tier pretrains
the README's main-job BERT (configs/bert_cpu.py, 2 steps) and fine-tunes
configs/glue.py:stsb from it with only --config.init.checkpoint.
"""

import os
import re
import shutil

import numpy as np
import pytest

from t5x_like import cli
from t5x_like.command_flags import load_config_file
from t5x_like.errors import UserError
from t5x_like.experiment import config_vocab, model_config_from
from t5x_like.finetune.backbone import BackboneError, load_backbone, resolve_init
from t5x_like.finetune.defaults import default_finetune_config
from t5x_like.finetune.loop import random_init_line, task_phrase, truncation_warning
from t5x_like.finetune.tasks.classification import Classification
from t5x_like.finetune.tasks.regression import Regression
from t5x_like.train.saved_config import run_config_text, write_run_config
from helpers import ROOT, config_path, load_config

BERT_CPU = config_path("bert_cpu")
BERT_BASE = config_path("bert_pretrain") + ":base"


def _workdir_with_checkpoint_dirs(tmp_path, config=None):
  """A directory shaped like a train workdir (checkpoints/2000/), with config.py when
  `config` is given."""
  workdir = tmp_path / "bert"
  (workdir / "checkpoints" / "2000").mkdir(parents=True)
  if config is not None:
    assert write_run_config(str(workdir), config) is None
  return str(workdir)


# ------------------------------------------------------------- the saved config
@pytest.mark.parametrize("name, arg", [("bert_cpu", ""), ("bert_pretrain", "base"),
                                       ("t5_cpu", "smoke")])
def test_a_saved_run_config_reads_back_as_the_run_config(name, arg, tmp_path):
  config = load_config(name, arg)
  config.train.num_steps = 7  # an override, as --config.train.num_steps=7 applies it
  write_run_config(str(tmp_path), config)
  saved = load_config_file(str(tmp_path / "config.py"))
  assert saved.to_dict() == config.to_dict()
  vocab_size = config_vocab(config).vocab_size
  assert model_config_from(saved, vocab_size) == model_config_from(config, vocab_size)


def test_a_config_with_a_non_literal_value_is_not_saved(tmp_path):
  config = load_config("bert_cpu")
  config.model.overrides["kernel_init"] = object()  # a value with no literal
  with pytest.raises(ValueError, match="not Python literals"):
    run_config_text(config)
  assert "not written" in write_run_config(str(tmp_path), config)
  assert not os.listdir(tmp_path)


# ------------------------------------------------------------- init.config lookup
@pytest.mark.parametrize("where", ["", "checkpoints", "checkpoints/2000"])
def test_the_benchmark_config_takes_the_workdirs_config(where, tmp_path):
  """configs/glue.py:stsb with only init.checkpoint: the main-job BERT's config.py, and
  its 64 learned positions (configs/bert_cpu.py) cut the recipe's 128 tokens."""
  workdir = _workdir_with_checkpoint_dirs(tmp_path, load_config("bert_cpu"))
  config = load_config("glue", "stsb")
  assert config.init.config == "" and config.task.max_length == 128
  config.init.checkpoint = os.path.join(workdir, where) if where else workdir
  resolved = resolve_init(config)
  assert resolved.config.init.config == os.path.join(workdir, "config.py")
  assert resolved.config.task.max_length == 64
  assert config.task.max_length == 128 and config.init.config == ""  # a copy
  assert any("128 -> 64" in note for note in resolved.notes)
  assert workdir in resolved.origin


def test_without_a_saved_config_the_default_backbone_is_used(tmp_path):
  config = load_config("glue", "stsb")
  config.init.checkpoint = _workdir_with_checkpoint_dirs(tmp_path)  # a run before config.py
  resolved = resolve_init(config)
  assert resolved.config.init.config == BERT_BASE
  assert resolved.config.task.max_length == 128  # BERT-base has 512 positions
  assert "default" in resolved.origin and "no config.py" in resolved.origin
  config.init.checkpoint = ""  # the random arm of the benchmark config
  assert resolve_init(config).config.init.config == BERT_BASE


def test_an_init_config_set_by_the_user_wins(tmp_path):
  workdir = _workdir_with_checkpoint_dirs(tmp_path, load_config("bert_cpu"))
  config = load_config("glue", "stsb")
  config.init.checkpoint = workdir
  config.init.config = BERT_CPU + ":smoke"
  resolved = resolve_init(config)
  assert resolved.config is config and resolved.notes == ()


def test_a_checkpoint_without_config_nor_default_names_init_config(tmp_path):
  config = default_finetune_config()  # init.default_config ""
  config.init.checkpoint = _workdir_with_checkpoint_dirs(tmp_path)
  with pytest.raises(BackboneError) as raised:
    resolve_init(config)
  assert "--config.init.config=" in str(raised.value) and "config.py" in str(raised.value)


def test_a_mismatched_checkpoint_names_the_backbone_config_and_the_key(tmp_path):
  """The issue's case: a checkpoint of a 8,192-id BERT, no config.py beside it, and the
  benchmark's default BERT-base (30,522 ids)."""
  import jax.numpy as jnp
  from t5x_like.checkpoint import Checkpointer
  workdir = _workdir_with_checkpoint_dirs(tmp_path)
  shutil.rmtree(os.path.join(workdir, "checkpoints"))
  with Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False) as ckpt:
    assert ckpt.save(2000, {"params": {"mlm_bias": jnp.zeros(8192)}}, {"step": 2000})
  config = load_config("glue", "stsb")
  config.init.checkpoint = workdir
  with pytest.raises(UserError) as raised:
    load_backbone(config)
  message = str(raised.value)
  assert "mlm_bias saved (8192,) wanted (30522,)" in message
  assert BERT_BASE in message and "--config.init.config=" in message
  assert "\n" not in message


# ------------------------------------------------------------- log lines and help
def test_a_regression_task_says_it_predicts_a_score():
  assert task_phrase(Regression(), 0) == "task regression predicting a score"
  assert task_phrase(Classification(), 3) == "task classification with 3 labels"


def test_the_random_arm_is_named_in_its_log_line():
  config = resolve_init(load_config("glue", "stsb")).config
  assert random_init_line(config).startswith(
      f"init: random initialisation (no init.checkpoint) of the architecture of {BERT_BASE}")


def test_heavy_truncation_is_warned_with_count_percent_and_key():
  line = truncation_warning({"examples": 3668, "truncated": 2793}, 64)
  assert "2,793 of 3,668" in line and "(76%)" in line and "task.max_length" in line
  assert truncation_warning({"examples": 100, "truncated": 10}, 64) is None  # 10%: quiet
  assert truncation_warning({"examples": 100, "truncated": 11}, 64) is not None
  assert truncation_warning({"examples": 100, "answers_lost": 90}, 64) is None
  at_limit = truncation_warning({"examples": 10, "truncated": 9}, 64, positions=64)
  assert "64 learned positions" in at_limit
  assert "raise task.max_length (the backbone has 512" in truncation_warning(
      {"examples": 10, "truncated": 9}, 128, positions=512)


def test_finetune_help_lists_the_benchmark_and_init_keys(capsys):
  assert cli.main(["finetune", "--help"]) == 0
  out = capsys.readouterr().out
  defaults = default_finetune_config()
  for section in ("benchmark", "init"):
    for key in defaults[section]:
      assert f"{section}.{key}" in out, key
  assert "random" in out


# ------------------------------------------------------------- slow: end to end
@pytest.fixture(scope="module")
def stsb_data_dir(tmp_path_factory):
  from tfds_fixtures import build_benchmark
  directory = str(tmp_path_factory.mktemp("tfds"))
  build_benchmark(directory, "glue/stsb", {"train": 24, "validation": 8, "test": 8})
  return directory


@pytest.fixture(scope="module")
def main_job(tmp_path_factory) -> str:
  """The README's main job (configs/bert_cpu.py) cut to 2 steps: its workdir."""
  workdir = str(tmp_path_factory.mktemp("main_job") / "bert")
  assert cli.main(["train", f"--config={BERT_CPU}", f"--workdir={workdir}",
                   "--config.train.num_steps=2", "--config.train.checkpoint_every=2",
                   "--config.train.eval_every=0", "--config.train.log_every=1",
                   "--config.optimizer.warmup_steps=1"]) == 0
  return workdir


_SHORT = ["--config.train.num_steps=2", "--config.train.batch_size=8",
          "--config.train.log_every=1", "--config.benchmark.max_train_examples=16",
          "--config.benchmark.max_eval_examples=8"]


@pytest.mark.slow
def test_the_main_job_bert_fine_tunes_on_glue_stsb_from_its_workdir(
    tmp_path, stsb_data_dir, main_job, capsys):
  bert = main_job
  assert os.path.isfile(os.path.join(bert, "config.py"))
  capsys.readouterr()
  assert cli.main(["finetune", f"--config={config_path('glue')}:stsb",
                   f"--workdir={tmp_path / 'ft'}", f"--config.init.checkpoint={bert}",
                   f"--config.benchmark.data_dir={stsb_data_dir}", *_SHORT]) == 0
  out = capsys.readouterr().out
  assert f"init.config: {bert}/config.py" in out
  assert "task.max_length: 128 -> 64" in out
  assert "task regression predicting a score" in out and "0 labels" not in out
  import json
  with open(tmp_path / "ft" / "final_metrics.json") as f:
    final = json.load(f)
  assert final["step"] == 2 and "checkpoint step 2" in final["backbone"]
  assert np.isfinite(final["official"]["pearson"])


@pytest.mark.slow
def test_a_run_without_config_py_fails_naming_the_backbone_and_the_key(
    tmp_path, stsb_data_dir, main_job, capsys):
  bert = str(tmp_path / "bert")
  shutil.copytree(main_job, bert)
  os.remove(os.path.join(bert, "config.py"))  # as a run of a version before it
  capsys.readouterr()
  assert cli.main(["finetune", f"--config={config_path('glue')}:stsb",
                   f"--workdir={tmp_path / 'ft'}", f"--config.init.checkpoint={bert}",
                   f"--config.benchmark.data_dir={stsb_data_dir}", *_SHORT]) == 2
  err = capsys.readouterr().err
  assert "bert_pretrain.py:base" in err and "--config.init.config=" in err
  assert not os.path.exists(tmp_path / "ft")  # nothing written


@pytest.mark.long
def test_the_random_arm_says_so(tmp_path, stsb_data_dir, main_job, capsys):
  bert = main_job
  capsys.readouterr()
  assert cli.main(["finetune", f"--config={config_path('glue')}:stsb",
                   f"--workdir={tmp_path / 'ft'}",
                   f"--config.init.config={bert}/config.py",  # the same architecture
                   f"--config.benchmark.data_dir={stsb_data_dir}",
                   "--config.task.max_length=8", *_SHORT]) == 0
  out = capsys.readouterr().out
  assert "init: random initialisation (no init.checkpoint)" in out
  # STS-B pairs at 8 tokens: most are cut, and the run says so with the key to raise
  assert re.search(r"warning: \d+ of 16 training examples \(\d+%\) are cut at"
                   r" task.max_length=8 tokens; raise task.max_length", out), out


def test_remat_auto_needs_a_chooser_from_the_caller(tmp_path):
  """finetune/ sits below plan/: the command hands finetune() plan's remat chooser, and
  a backbone that says "auto" without one is refused before anything is written."""
  from t5x_like.finetune.loop import finetune
  bert, pretrain = os.path.join(ROOT, "configs", "bert_cpu.py:smoke"), tmp_path / "auto.py"
  pretrain.write_text("from t5x_like.command_flags import load_config_file\n\n\n"
                      "def get_config():\n"
                      f"  c = load_config_file({bert!r})\n"
                      "  c.model.remat_policy = 'auto'\n  return c\n")
  config = load_config("glue", "rte,smoke")
  config.benchmark.name = ""
  config.task.train_file = config.task.dev_file = str(pretrain)  # exists; never read
  config.init.config = str(pretrain)
  with pytest.raises(ValueError, match="choose_remat"):
    finetune(config, str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()
