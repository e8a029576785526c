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


def test_bench_data_prints_tokens_per_second(capsys):
  assert cli.main(["bench", "data", "--objective", "causal_lm", "--length", "128",
                   "--batch", "4", "--steps", "2", "--repeats", "1"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert result["objective"] == "causal_lm" and result["length"] == 128
  assert result["objective_tokens_per_second_per_core"] > 0
  assert result["tokenization_tokens_per_second_per_core"] > 0
