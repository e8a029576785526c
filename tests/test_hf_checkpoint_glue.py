"""The real-checkpoint study's pieces (t5x_like/studies/hf_checkpoint_glue.py and
transformers_arm.py) on a tiny BertModel made here with transformers and a tiny RTE in
GLUE's file layout: the transformers arm reads the batches our loader gives, in the same
order, starts from our classifier (first-step losses equal, dropout off) and follows our
schedule; the table's bars. The slow test runs the driver end to end, three arms."""

import json
import os
import types

import jax
import numpy as np
import pytest
import torch
import transformers

from t5x_like.studies import hf_checkpoint_glue as study
from t5x_like.studies import transformers_arm as arm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BERT = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=24, max_position_embeddings=32, initializer_range=0.5)
WORDS = [f"w{i}" for i in range(35)]


def _checkpoint(path) -> str:
  torch.manual_seed(0)
  transformers.BertModel(transformers.BertConfig(**BERT)).save_pretrained(str(path))
  (path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                                            + WORDS) + "\n")
  return str(path)


def _rte(glue, train_rows: int, dev_rows: int = 6) -> str:
  """GLUE's RTE/train.tsv and dev.tsv of random word pairs (1-4 words each: several cut
  lengths)."""
  rng = np.random.default_rng(1)
  os.makedirs(glue / "RTE")
  for split, n in (("train", train_rows), ("dev", dev_rows)):
    lines = ["index\tsentence1\tsentence2\tlabel"]
    for i in range(n):
      a, b = (" ".join(rng.choice(WORDS, int(rng.integers(1, 5)))) for _ in range(2))
      lines.append(f"{i}\t{a}\t{b}\t{['entailment', 'not_entailment'][i % 2]}")
    (glue / "RTE" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
  return str(glue)


def _args(checkpoint, glue, **kw):
  return types.SimpleNamespace(**{**dict(checkpoint=checkpoint, glue=glue, batch_size=4,
                                         epochs=3.0, num_steps=0, max_length=32, lr=1e-2),
                                  **kw})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """(args, prepared) of the tiny RTE: 10 training rows, batches of 4, 8 steps."""
  tmp = tmp_path_factory.mktemp("hf_glue")
  a = _args(_checkpoint(tmp / "bert"), _rte(tmp / "glue", 10))
  config = study.task_config(os.path.join(REPO, "configs"), "rte",
                             study.recipe_overrides(a, "rte", "ours", seed=3))
  return a, arm.prepare(config)


def test_the_recipe_is_one_config_for_every_arm(tiny):
  a, prepared = tiny
  c = prepared.config
  assert (c.train.num_steps, c.optimizer.warmup_steps) == (8, 1)  # ceil(3 * 10 / 4), 10%
  assert (c.optimizer.learning_rate, c.optimizer.weight_decay, c.task.max_length) == (
      1e-2, 0.01, 32)
  assert c.init.hf == a.checkpoint and not c.init.hf_random and c.seed == 3
  random = study.recipe_overrides(a, "rte", "random", seed=3)
  assert random.pop("init.hf_random") is True
  assert random == study.recipe_overrides(a, "rte", "ours", seed=3)
  flags = study.flag_args(study.recipe_overrides(a, "rte", "random", seed=3))
  assert "--config.init.hf_random=true" in flags
  assert "--config.benchmark.predict_test=false" in flags


def test_batches_are_our_loaders_in_order(tiny):
  """Step s of the transformers arm holds the rows our loader gives at step s (epochs
  2 and 3 start inside batches 2 and 5), cut to the same length."""
  from t5x_like.data.loader import make_loader
  from t5x_like.finetune.encoding import EncodedRows
  _, prepared = tiny
  seed = 3
  rows = EncodedRows(prepared.train, seed, prepared.task.padding_groups())
  loader = iter(make_loader(rows, prepared.batch_size, seed=seed, shuffle=False))
  lengths = set()
  for step in range(prepared.num_steps):
    ours, theirs = next(loader), arm.batch_at(prepared, seed, step)
    assert ours.keys() == theirs.keys()
    for k in ours:
      np.testing.assert_array_equal(ours[k], theirs[k], err_msg=f"step {step} {k}")
    lengths.add(theirs["encoder_input_tokens"].shape[1])
  assert len(lengths) > 1
  assert arm.batch_lengths(prepared, seed)[:2] == [
      arm.batch_at(prepared, seed, s)["encoder_input_tokens"].shape[1] for s in range(2)]
  # epoch e is default_rng([seed, e])'s permutation: rows 8, 9 of epoch 0, then epoch 1's
  order0 = np.random.default_rng([seed, 0]).permutation(10)
  order1 = np.random.default_rng([seed, 1]).permutation(10)
  np.testing.assert_array_equal(arm.batch_rows(10, 4, seed, 2),
                                np.concatenate([order0[8:], order1[:2]]))


def test_our_initial_params_are_the_runs(tiny):
  """The head the transformers arm copies is the one finetune's create_train_state draws."""
  from t5x_like.experiment import build_mesh
  from t5x_like.train.optimizers import make_optimizer
  from t5x_like.train.state import create_train_state
  _, prepared = tiny
  shapes = {k: (prepared.batch_size, *v.shape[1:]) for k, v in prepared.train.items()}
  optimizer, _ = make_optimizer(prepared.config.optimizer, prepared.num_steps)
  mesh, rules = build_mesh(prepared.config)
  state, _ = create_train_state(prepared.model, optimizer, mesh, rules, shapes,
                                jax.random.key(3))
  ours = arm.our_initial_params(prepared, 3)
  np.testing.assert_array_equal(ours["head"]["classifier"]["kernel"],
                                state.params["head"]["classifier"]["kernel"])
  np.testing.assert_array_equal(ours["head"]["pooler"]["kernel"],
                                prepared.backbone.params["pooler"]["kernel"])


def test_the_schedule_is_ours():
  from t5x_like.train.optimizers import linear_schedule
  schedule = linear_schedule(2.0, 3, 20)
  for step in range(22):
    assert arm.linear_rate(step, 20, 3) * 2.0 == pytest.approx(float(schedule(step)),
                                                               abs=1e-6)


def test_the_transformers_arm_trains_from_our_head(tiny, tmp_path):
  """Two steps: the first-step losses (dropout off, our classifier in torch) agree; the
  step rows, the official metrics (our metric code) and the predictions are written."""
  a, prepared = tiny
  two = arm.Prepared(**{**vars(prepared),
                        "config": _with_steps(prepared.config, 2)})
  out = arm.train_transformers(two, a.checkpoint, 3, str(tmp_path), log=lambda line: None)
  first = out["first_loss"]
  assert abs(first["ours"] - np.log(2)) > 0.02  # wide weights: not the trivial log 2
  assert first["transformers"] == pytest.approx(first["ours"], abs=1e-4)
  assert len(out["losses"]) == len(out["step_seconds"]) == 2
  assert out["losses"][0] != out["losses"][1]
  steps = [json.loads(line) for line in open(tmp_path / "steps.jsonl")]
  assert [r["step"] for r in steps] == [1, 2]
  assert set(out["official"]) == {"accuracy"}
  predictions = [json.loads(line) for line in open(tmp_path / "dev_predictions.jsonl")]
  assert len(predictions) == 6
  assert {p["prediction"] for p in predictions} <= {"entailment", "not_entailment"}
  final = json.load(open(tmp_path / "final_metrics.json"))
  assert final["official"] == out["official"] and final["step"] == 2


def _with_steps(config, steps):
  config = config.copy_and_resolve_references()
  config.train.num_steps = steps
  config.optimizer.warmup_steps = 1
  return config


def test_median_step_seconds_leaves_out_warmup_and_compiles():
  seconds = [9, 9, 9, 9, 9, 1, 7, 2, 3, 8]
  lengths = [8, 8, 8, 8, 8, 8, 16, 8, 16, 32]  # 16 first at step 6, 32 at step 9
  assert study.median_step_seconds(seconds, lengths) == (2.0, 3)  # steps 5, 7, 8


def test_the_table_bars(tmp_path):
  rows = []
  for seed, (o, t, r) in enumerate([(80, 78, 50), (82, 79, 51), (81, 80, 52)]):
    for name, acc in (("ours", o), ("transformers", t), ("random", r)):
      row = dict(task="rte", arm=name, seed=seed, official={"accuracy": acc}, steps=10,
                 warmup=1, batch_size=16, max_length=128, lr=1e-4, steps_timed=4,
                 seconds_per_step=0.5 if name != "transformers" else 1.0,
                 cpu="AMD EPYC", cores=2, load_average=0.1 * seed, load_average_end=1.5)
      if name == "transformers":
        row["first_loss"] = {"ours": 0.7, "transformers": 0.7001}
        row["torch_threads"] = 2
      rows.append(row)
  text = study.markdown(rows)
  # ours 81.0, transformers 79.0: +2.0 within the seeds' range 2.0 (ours 80-82)
  assert "| rte | accuracy | 81.0 (80.0-82.0) | 79.0 (78.0-80.0) | 51.0 (50.0-52.0) |" \
         " +2.0 | 2.0 | yes |" in text
  assert "Steps (warmup), batch, tokens, peak rate: rte 10 (1), 16, 128, 0.0001." in text
  assert "| rte | 4 | 0.500 | 1.000 | 0.50 | 0.500 |" in text
  assert "torch threads 2. Load average at the runs' starts and ends: 0.00-1.50." in text
  assert "| rte | 0 | 0.700000 | 0.700100 | 1.0e-04 |" in text
  assert "s/step" not in study.markdown(rows, ["metrics"])
  no_random = [r for r in rows if r["arm"] != "random"]
  assert "| rte | 4 | 0.500 | 1.000 | 0.50 | - |" in study.markdown(no_random, ["speed"])
  assert "accuracy" not in study.markdown(rows, ["speed"])
  for k in (0, 3, 6):
    rows[k]["official"]["accuracy"] = 90  # ours 90 x 3, transformers 79 (78-80): -> no
  assert "| +11.0 | 2.0 | **no** |" in study.markdown(rows)
  page = tmp_path / "page.md"
  (mb, me), (sb, se) = study.markers("metrics"), study.markers("speed")
  page.write_text(f"# t\n\nprose\n{mb}\nold\n{me}\nbetween\n{sb}\nold\n{se}\nafter\n")
  study.write_between_markers(str(page), "new\n", "speed")
  assert page.read_text() == f"# t\n\nprose\n{mb}\nold\n{me}\nbetween\n{sb}\nnew\n{se}\nafter\n"


@pytest.mark.slow
def test_the_driver_runs_three_arms_end_to_end(tmp_path, capsys):
  """ours and random through `t5x-like finetune` children, transformers in the driver:
  results.jsonl, the table, and a rerun that runs nothing."""
  checkpoint, glue = _checkpoint(tmp_path / "bert"), _rte(tmp_path / "glue", 16)
  argv = ["--checkpoint", checkpoint, "--glue", glue, "--workdir", str(tmp_path / "w"),
          "--tasks", "rte", "--seeds", "0", "--num_steps", "2", "--batch_size", "8",
          "--max_length", "16", "--lr", "1e-2", "--configs", os.path.join(REPO, "configs")]
  assert study.main(argv) == 0
  rows = [json.loads(line) for line in open(tmp_path / "w" / "results.jsonl")]
  assert [(r["arm"], r["step"]) for r in rows] == [("ours", 2), ("transformers", 2),
                                                   ("random", 2)]
  ours, theirs = rows[0], rows[1]
  assert theirs["first_loss"]["transformers"] == pytest.approx(theirs["first_loss"]["ours"],
                                                               abs=1e-4)
  # dropout on: the logged first losses differ by the masks only
  assert ours["first_logged_loss"] == pytest.approx(theirs["first_logged_loss"], rel=0.5)
  assert "| rte | accuracy |" in capsys.readouterr().out
  mtime = os.path.getmtime(tmp_path / "w" / "results.jsonl")
  assert study.main(argv) == 0
  assert os.path.getmtime(tmp_path / "w" / "results.jsonl") == mtime
