"""The `t5x-like` command: presets listing, the embedded corpus and the data benchmark."""

import json

import pytest

from t5x_like import cli, corpus


def test_models_prints_parameter_counts(capsys):
  assert cli.main(["models", "bert-base", "gpt2-124m"]) == 0
  rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  # BERT-base and GPT-2 small as published (BertForPreTraining / GPT2LMHeadModel).
  assert {r["preset"]: r["params"] for r in rows} == {"bert-base": 110106428,
                                                      "gpt2-124m": 124439808}


def test_embedded_corpus_ships_eight_books():
  names = corpus.book_names()
  assert len(names) == 8 and "melville_moby_dick" in names
  assert corpus.read_book("melville_moby_dick").count("\n\n") > 1000  # paragraphs kept
  with pytest.raises(FileNotFoundError, match="no book 'nope'"):
    corpus.read_book("nope")


def test_bench_data_prints_tokens_per_second_and_its_environment(capsys):
  """Every bench JSON carries "environment" (speed/environment.py), these keys exactly:
  a driver that collects the JSONs reads them."""
  import os
  import platform
  import jax
  import torch
  assert cli.main(["bench", "data", "--objective", "causal_lm", "--length", "128",
                   "--batch", "4", "--steps", "2", "--repeats", "1"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert result["objective"] == "causal_lm" and result["length"] == 128
  assert result["objective_tokens_per_second_per_core"] > 0
  assert result["tokenization_tokens_per_second_per_core"] > 0
  assert result["environment"] == {
      "jax": jax.__version__, "jaxlib": jax.lib.__version__, "backend": "cpu",
      "device_kind": jax.devices()[0].device_kind, "device_count": 8,  # conftest's
      "xla_flags": os.environ["XLA_FLAGS"], "python": platform.python_version(),
      "torch": torch.__version__}
  assert "--xla_force_host_platform_device_count=8" in result["environment"]["xla_flags"]


# ------------------------------------------------------------------ one flag style
HELP_COMMANDS = ["train", "plan", "infer", "finetune", "models", "vocab", "vocab train",
                 "vocab encode", "vocab decode", "task", "task books", "task books-unseen",
                 "task books-within", "bench", "bench data", "bench model", "bench compile",
                 "bench peer", "bench bert-vs-torch", "bench attention", "data",
                 "data prepare"]


# `python3 -m t5x_like.host_loss.supervisor` is no t5x-like command: the pod launchers run it on
# the user's laptop, which may have no absl (it stays stdlib-only: test_supervisor.py).
ARGPARSE_ALLOWED = {"host_loss/supervisor.py"}


def test_no_module_imports_argparse():
  """Every command takes absl flags through t5x_like/command_flags.py (issue 30)."""
  import os
  import re
  root = os.path.dirname(cli.__file__)
  offenders = []
  for folder, _, files in os.walk(root):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        with open(path) as f:
          if re.search(r"^\s*(import argparse|from argparse import)", f.read(), re.M):
            offenders.append(os.path.relpath(path, root))
  assert sorted(set(offenders) - ARGPARSE_ALLOWED) == [], offenders


@pytest.mark.parametrize("command", HELP_COMMANDS)
def test_every_command_help_exits_0(command, capsys):
  assert cli.main([*command.split(), "--help"]) == 0
  out, err = capsys.readouterr()
  assert out.startswith(f"usage: t5x-like {command} "), out[:200]
  assert not err


def test_top_level_help_lists_every_command_with_its_summary(capsys):
  assert cli.main(["--help"]) == 0
  out = capsys.readouterr().out
  for name, (_, summary) in cli.COMMANDS.items():
    assert f"    {name}" in out and summary.split(":")[0] in out, name
  assert set(cli.COMMANDS) >= {"train", "plan", "infer", "finetune", "models", "vocab",
                               "task", "bench", "data"}


@pytest.mark.parametrize("argv, words", [
    (["models", "--bogus"], ["bogus"]),
    (["vocab", "train", "--source", "embedded", "--vocab-size", "700", "--family", "t5"],
     ["--out required"]),
    (["vocab", "decode", "--family", "t5"], ["ID required"]),
    (["task", "books", "--num_blocks=4"], ["--out required"]),
    (["bench", "data", "--objective", "nope"], ["--objective=nope"]),
    (["bench", "attention", "--interpret_pallas=maybe"], ["interpret_pallas"]),
    (["bench", "nope"], ["invalid choice: 'nope'"]),
    (["data", "nope"], ["invalid choice: 'nope'"]),
    ([], ["a command is required"]),
])
def test_usage_errors_are_one_line_exit_2(argv, words, capsys):
  assert cli.main(argv) == 2
  out, err = capsys.readouterr()
  assert err.count("\n") == 1 and not out, err
  for word in words:
    assert word in err, (word, err)


def test_boolean_and_list_flags_keep_their_spellings():
  from t5x_like.commands import bench
  for argv, value in ((["--interpret_pallas"], True), (["--nointerpret_pallas"], False),
                      (["--interpret_pallas=true"], True), ([], False)):
    fv = bench._attention_flags([])
    fv(["x", *argv])
    assert fv.interpret_pallas is value, argv
  fv = bench._data_flags([])
  fv(["x", "--objective", "span_corruption", "--prepared", "--sizes", "50,2000",
      "--workers=1,2"])
  assert (fv.objective, fv.prepared, bench._numbers(fv, "sizes", float),
          bench._numbers(fv, "workers", int)) == ("span_corruption", True, [50.0, 2000.0],
                                                  [1, 2])


# ------------------------------------------- model.overrides: any ModelConfig field
GPT2 = "--config=configs/gpt2_pretrain.py:124m"


@pytest.mark.parametrize("command", ["train", "plan", "infer", "prepare", "bench"])
def test_model_overrides_take_any_model_config_field(command):
  """gpt2_pretrain.py's model.overrides has none of these keys (ml-collections alone
  refuses them); each is parsed by its ModelConfig type, in every form absl takes, for
  every command with a config, and reaches the built model."""
  import importlib
  from t5x_like.command_flags import parse_flags
  from t5x_like.experiment import build_model_from_config
  module = importlib.import_module(f"t5x_like.commands.{command}")
  fv = parse_flags(command, [GPT2, "--config.model.overrides.loss_chunk_rows=0",
                             "--config.model.overrides.num_kv_heads", "4",
                             "--config.model.overrides.head_dim=None",
                             "--noconfig.model.overrides.use_bias",
                             "--config.model.overrides.dropout_rate=0.25",
                             "--config.model.overrides.vocab_size=50304"],
                   module._flags, required=())
  overrides = dict(fv.config.model.overrides)
  assert overrides == dict(attention_dropout_rate=0.0, dropout_rate=0.25, head_dim=None,
                           loss_chunk_rows=0, num_kv_heads=4, use_bias=False,
                           vocab_size=50304)
  assert type(overrides["loss_chunk_rows"]) is int
  assert type(overrides["dropout_rate"]) is float
  cfg = build_model_from_config(fv.config, 50257).config
  assert (cfg.loss_chunk_rows, cfg.num_kv_heads, cfg.use_bias, cfg.vocab_size) == (
      0, 4, False, 50304)


def test_finetune_model_overrides_take_any_model_config_field():
  from t5x_like.command_flags import parse_flags
  from t5x_like.commands import finetune
  fv = parse_flags("finetune", ["--config=configs/finetune_books.py:bert,smoke",
                                "--config.init.model_overrides.loss_chunk_rows=0"],
                   finetune._flags, required=())
  assert dict(fv.config.init.model_overrides) == {"loss_chunk_rows": 0}


# ------------------------------------------- data.options: the objective's options
@pytest.mark.parametrize("command", ["train", "plan", "bench"])
def test_data_options_take_any_option_of_the_objective(command):
  """t5_cpu.py sets no data.options (ml-collections alone refuses new keys): a new name
  is kept as text on the command line, validation types it by the objective's option
  (and writes it back), and a key the file has keeps its type; a bad name or value is
  refused by validation, naming the option."""
  import importlib
  from t5x_like.command_flags import parse_flags
  from t5x_like.train.config_check import ConfigError, validate
  module = importlib.import_module(f"t5x_like.commands.{command}")
  fv = parse_flags(command, ["--config=configs/t5_cpu.py:smoke",
                             "--config.data.objective=ul2", "--config.data.targets_length=32",
                             "--config.data.options.rates", "1",
                             "--config.data.options.denoisers=S",
                             "--noconfig.data.options.mode_tokens"],
                   module._flags, required=())
  assert dict(fv.config.data.options) == dict(rates="1", denoisers="S", mode_tokens="false")
  validate(fv.config, 8)
  assert dict(fv.config.data.options) == dict(rates="1", denoisers="S", mode_tokens=False)
  fv = parse_flags(command, ["--config=configs/bert_pretrain.py:base",
                             "--config.data.options.max_predictions_per_seq=80",
                             "--config.data.options.masked_lm_prob=0.2"],
                   module._flags, required=())
  options = dict(fv.config.data.options)
  assert options["max_predictions_per_seq"] == 80 and options["masked_lm_prob"] == "0.2"
  for bad, words in (("--config.data.options.masked_lm_prob=lots", "masked_lm_prob='lots':"
                      " expected float"),
                     ("--config.data.options.masked_lm_probb=0.2",
                      "data.options.masked_lm_probb: not an option")):
    fv = parse_flags(command, ["--config=configs/bert_cpu.py:smoke", bad], module._flags,
                     required=())
    with pytest.raises(ConfigError, match=words):
      validate(fv.config, 8)


def test_an_objective_refusing_its_options_exits_2_before_writing(tmp_path, capsys):
  workdir = tmp_path / "run"
  assert cli.main(["train", "--config=configs/t5_cpu.py:smoke", f"--workdir={workdir}",
                   "--config.data.objective=iid_denoising",
                   "--config.data.options.noise_density=2"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "noise_density=2.0" in err and "must be in [0, 1]" in err
  assert not workdir.exists()


def test_the_huge_pages_restart_runs_the_interpreters_own_command_line(monkeypatch):
  """The fast twin of the test below: the restart's argv is sys.orig_argv's (a `python
  -c CODE ARGS` start keeps its -c CODE), not sys.argv's."""
  import os
  import sys
  started = ["/usr/bin/python3", "-X", "utf8", "-c", "CODE", "models", "bert-tiny"]
  monkeypatch.setattr(sys, "orig_argv", started)
  monkeypatch.setattr(sys, "argv", ["-c", "models", "bert-tiny"])
  monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
  monkeypatch.delenv("T5X_LIKE_HUGE_PAGES", raising=False)
  monkeypatch.setattr(os, "confstr", lambda name: "glibc 2.36")
  calls = []
  monkeypatch.setattr(os, "execve", lambda path, argv, env: calls.append((path, argv, env)))
  cli._reexec_with_huge_pages()
  (path, argv, env), = calls
  assert argv == [sys.executable, "-X", "utf8", "-c", "CODE", "models", "bert-tiny"]
  assert "glibc.malloc.hugetlb=1" in env["GLIBC_TUNABLES"]


@pytest.mark.slow
@pytest.mark.parametrize("start", [["-m", "t5x_like.cli"],
                                   ["-c", "import sys; from t5x_like.cli import main;"
                                          " sys.exit(main())"]])
def test_the_huge_pages_restart_keeps_a_module_or_code_start(start, tmp_path):
  """The command restarts itself once (GLIBC_TUNABLES); started as `python -m` or
  `python -c` it must restart the same way (sys.argv alone lost the -m / -c)."""
  import os
  import subprocess
  import sys
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES",
                                                          "T5X_LIKE_HUGE_PAGES")}
  env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run = subprocess.run([sys.executable, *start, "models", "bert-tiny"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stderr
  assert json.loads(run.stdout)["params"] == 4433468
