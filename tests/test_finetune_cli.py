"""`t5x-like task books` and `t5x-like finetune` end to end: the held-out task, starting
from our checkpoint / at random / from a Hugging Face checkpoint, exact resume after a
signal or a SIGKILL, two processes equal to one, text to text evaluated by generation,
and bad input reported with its line."""

import csv
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from t5x_like import cli, corpus
from t5x_like.task_builders import books
from t5x_like.data.loader import make_loader
from t5x_like.finetune.encoding import EncodedRows
from t5x_like.train.metrics import read_jsonl
from t5x_like.train.pretrained import find_checkpoint
from helpers import ROOT, xla_flags

CONFIG = os.path.join(ROOT, "configs", "finetune_books.py")
BERT_CPU = os.path.join(ROOT, "configs", "bert_cpu.py")


def _read_csv(path):
  with open(path, encoding="utf-8", newline="") as f:
    return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("books"))
  assert cli.main(["task", "books", "--out", out, "--num_blocks", "4", "--block_words", "100",
                   "--passage_words", "16"]) == 0
  return out


@pytest.fixture(scope="module")
def bert_workdir(tmp_path_factory, task_dir):
  """A 6-step bert_cpu:smoke pretraining on the task's pretraining text."""
  workdir = str(tmp_path_factory.mktemp("bert_pre"))
  assert cli.main(["train", f"--config={BERT_CPU}:smoke", f"--workdir={workdir}",
                   f"--config.data.source=text:{task_dir}/pretrain/*.txt",
                   "--config.train.num_steps=6", "--config.train.checkpoint_every=6",
                   "--config.train.eval_every=0"]) == 0
  return workdir


# BERT's own classifier, [CLS] through the pooler (the book config mean-pools instead):
# the tests of what initialises the pooler ask for it.
BERT_HEAD = ("--config.task.pooling=cls", "--config.task.pooler=True")
# Every batch at the full length: one train and one predict program to compile, where
# the test is not about cutting padding (tests/test_batch_padding.py is).
ONE_LENGTH = ("--config.task.batch_padding=max_length",)


def _finetune(workdir, task_dir, *overrides, variant="bert,smoke"):
  return cli.main(["finetune", f"--config={CONFIG}:{variant},dir={task_dir}",
                   f"--workdir={workdir}", f"--config.init.config={BERT_CPU}:smoke"
                   if variant.startswith("bert") else
                   f"--config.init.config={os.path.join(ROOT, 'configs', 't5_cpu.py')}:smoke",
                   *overrides])


def _start_finetune(workdir, task_dir, *overrides, variant="bert,smoke", devices=8):
  """`t5x-like finetune` in a child process (stdout and stderr piped)."""
  init = BERT_CPU if variant.startswith("bert") else os.path.join(ROOT, "configs", "t5_cpu.py")
  command = [sys.executable, "-m", "t5x_like.cli", "finetune",
             f"--config={CONFIG}:{variant},dir={task_dir}", f"--workdir={workdir}",
             f"--config.init.config={init}:smoke", *overrides]
  env = dict(os.environ, T5X_LIKE_HUGE_PAGES="0", JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags(devices))
  return subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _wait_for_losses(proc, workdir, count):
  """Polls metrics.jsonl until it has `count` train rows."""
  metrics, deadline = os.path.join(workdir, "metrics.jsonl"), time.time() + 300
  while not (os.path.exists(metrics)
             and sum("loss" in r for r in read_jsonl(metrics)) >= count):
    assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
    time.sleep(0.02)


def _saved_params(path):
  """{dotted name: array} of a checkpoint's params, read with orbax directly."""
  import orbax.checkpoint as ocp
  handler = ocp.PyTreeCheckpointHandler()
  tree = handler.restore(find_checkpoint(path) / "state")
  handler.close()
  from flax.traverse_util import flatten_dict
  return {"/".join(k): np.asarray(v) for k, v in flatten_dict(tree["params"]).items()}


# ------------------------------------------------------------------ the book task
def test_book_task_is_balanced_and_held_out_of_pretraining(task_dir):
  train, dev = _read_csv(f"{task_dir}/train.csv"), _read_csv(f"{task_dir}/dev.csv")
  labels = sorted({books.author(b) for b in corpus.book_names()})
  for rows in (train, dev):
    counts = {label: sum(r["label"] == label for r in rows) for label in labels}
    assert len(set(counts.values())) == 1 and min(counts.values()) > 0, counts
  squash = lambda text: " ".join(text.split())
  for book in corpus.book_names():
    whole = squash(corpus.read_book(book))
    with open(f"{task_dir}/pretrain/{book}.txt", encoding="utf-8") as f:
      raw = f.read()
    pretrain = squash(raw)
    paragraphs = raw.strip().split("\n\n")
    assert len(paragraphs) > 20 and all("\n" not in p for p in paragraphs)  # unwrapped
    assert 400 <= len(whole.split()) - len(pretrain.split()) < 500  # 4 blocks of ~100 words
    for row in train + dev:
      if row["label"] == books.author(book):
        assert len(row["text"].split()) == 16
        assert row["text"] in whole and row["text"] not in pretrain
  assert not {r["text"] for r in train} & {r["text"] for r in dev}


def _rows(seed, steps, batch_size, process_index=0, process_count=1, state=None):
  rows = EncodedRows({"row": np.arange(10)}, seed)
  loader = iter(make_loader(rows, batch_size, seed=seed, shuffle=False,
                            process_index=process_index, process_count=process_count))
  if state is not None:
    loader.set_state(state)
  return [next(loader)["row"] for _ in range(steps)]


def test_finetune_rows_are_the_concatenated_epoch_permutations():
  # The reference: batch s is rows s*B .. (s+1)*B of permutation(seed, epoch 0),
  # permutation(seed, epoch 1), ... written out by hand.
  order = np.concatenate([np.random.default_rng([3, e]).permutation(10) for e in range(2)])
  batches = _rows(3, 5, 4)
  np.testing.assert_array_equal(np.concatenate(batches), order[:20])
  assert sorted(order[:10]) == list(range(10)) and not np.array_equal(order[:10], order[10:])
  # Two hosts read the halves of each global batch; a restored loader goes on exactly.
  halves = [_rows(3, 5, 4, process_index=h, process_count=2) for h in range(2)]
  for step in range(5):
    np.testing.assert_array_equal(np.concatenate([halves[0][step], halves[1][step]]),
                                  batches[step])
  np.testing.assert_array_equal(_rows(3, 2, 4, state={"next_index": 3})[0], batches[3])


# ------------------------------------------------------------------ initialisation
def test_finetune_starts_from_the_pretrained_checkpoint(tmp_path, task_dir,
                                                                     bert_workdir, capsys):
  # Learning rate 0: the saved backbone is the one the run started from.
  frozen = ("--config.train.num_steps=2", "--config.optimizer.learning_rate=0.0",
            "--config.optimizer.warmup_steps=0", *ONE_LENGTH)
  assert _finetune(str(tmp_path / "pre"), task_dir, *frozen, *BERT_HEAD,
                   f"--config.init.checkpoint={bert_workdir}") == 0
  assert "checkpoint step 6" in capsys.readouterr().out
  pretrained = _saved_params(bert_workdir)
  tuned = _saved_params(str(tmp_path / "pre"))
  backbone = [k for k in tuned if k.startswith("backbone/")]
  assert len(backbone) > 10
  for key in backbone:
    np.testing.assert_array_equal(tuned[key], pretrained[key[len("backbone/"):]], err_msg=key)
  np.testing.assert_array_equal(tuned["head/pooler/kernel"], pretrained["pooler/kernel"])
  final = json.load(open(tmp_path / "pre" / "final_metrics.json"))
  predictions = [json.loads(line) for line in open(tmp_path / "pre" / "dev_predictions.jsonl")]
  dev = _read_csv(f"{task_dir}/dev.csv")
  assert [p["line"] for p in predictions] == list(range(2, len(dev) + 2))
  assert [p["label"] for p in predictions] == [r["label"] for r in dev]
  assert final["accuracy"] == pytest.approx(  # percent, as the benchmarks report
      100 * np.mean([p["prediction"] == p["label"] for p in predictions]))


@pytest.mark.long
def test_layer_decay_scales_each_layer_s_first_step(tmp_path, task_dir, bert_workdir):
  """optimizer.layer_decay=0.5 from the pretrained backbone: Adam's first step moves
  each parameter's largest-gradient element by the same lr x c (|g| >> eps), times
  0.5^(3 - depth): bert_cpu:smoke's embeddings are depth 0, its layers_0 and layers_1
  depths 1 and 2, the head (here the loaded pooler) 3."""
  assert _finetune(str(tmp_path / "decay"), task_dir, *BERT_HEAD,
                   "--config.train.num_steps=1", "--config.optimizer.warmup_steps=0",
                   "--config.optimizer.weight_decay=0.0", "--config.optimizer.layer_decay=0.5",
                   "--config.optimizer.eps=1e-12",  # |g| >> eps for every kernel
                   f"--config.init.checkpoint={bert_workdir}") == 0
  pretrained, tuned = _saved_params(bert_workdir), _saved_params(str(tmp_path / "decay"))
  moved = {k: np.abs(tuned[k] - pretrained[k.split("/", 1)[1]]).max()
           for k in tuned if k.startswith("backbone/") and k.endswith("kernel")
           or k.endswith("embedding")}
  unit = np.abs(tuned["head/pooler/kernel"] - pretrained["pooler/kernel"]).max()
  depths = {}
  for key in moved:
    layer = re.search(r"/layers_(\d+)/", key)
    depths[key] = 1 + int(layer.group(1)) if layer else 0
  assert sorted(set(depths.values())) == [0, 1, 2] and len(moved) > 10
  for key, depth in depths.items():
    assert moved[key] / unit == pytest.approx(0.5 ** (3 - depth), rel=0.02), key


def test_finetune_from_random_init_resumes_to_the_same_numbers(tmp_path, task_dir, capsys):
  args = ("--config.train.num_steps=6", "--config.train.log_every=1",
          "--config.train.checkpoint_every=3", *ONE_LENGTH)
  assert _finetune(str(tmp_path / "whole"), task_dir, *args) == 0
  assert "backbone: random initialisation of" in capsys.readouterr().out
  import shutil
  shutil.copytree(tmp_path / "whole", tmp_path / "cut")
  shutil.rmtree(tmp_path / "cut" / "checkpoints" / "6")  # "killed" after step 3's save
  assert _finetune(str(tmp_path / "cut"), task_dir, *args) == 0
  whole = [r for r in read_jsonl(str(tmp_path / "whole" / "metrics.jsonl")) if "loss" in r]
  cut = [r for r in read_jsonl(str(tmp_path / "cut" / "metrics.jsonl")) if "loss" in r]
  assert [r["step"] for r in cut] == list(range(1, 7))
  assert [r["loss"] for r in cut] == [r["loss"] for r in whole]
  a, b = _saved_params(str(tmp_path / "whole")), _saved_params(str(tmp_path / "cut"))
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.long
def test_finetune_sigterm_saves_exits_143_and_resumes(tmp_path, task_dir):
  """SIGTERM: a checkpoint at the current step, exit 143, no traceback; the rerun
  finishes with every loss equal to an uninterrupted run's. (Ctrl-C takes the same path
  through the shared run context: tests/test_train.py sends both to the trainer.)"""
  signum = signal.SIGTERM
  args = ("--config.train.num_steps=300", "--config.train.log_every=1",
          "--config.train.checkpoint_every=0", "--config.train.eval_every=0")
  assert _finetune(str(tmp_path / "whole"), task_dir, *args) == 0
  cut = str(tmp_path / "cut")
  proc = _start_finetune(cut, task_dir, *args)
  _wait_for_losses(proc, cut, 1)
  proc.send_signal(signum)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 128 + signum, err[-3000:]
  name = signal.Signals(signum).name
  assert "Traceback" not in err and f"stopped by {name} at step" in out, (out, err[-3000:])
  stopped_at = int(re.search(r"stopped by \w+ at step (\d+)", out).group(1))
  assert f"exit {128 + signum}: rerun the same command" in out, out
  assert 1 <= stopped_at < 300 and not os.path.exists(os.path.join(cut, "final_metrics.json"))
  assert _finetune(cut, task_dir, *args) == 0
  losses = lambda d: [(r["step"], r["loss"]) for r in read_jsonl(
      str(tmp_path / d / "metrics.jsonl")) if "loss" in r]
  assert losses("cut") == losses("whole")


@pytest.mark.long
def test_finetune_killed_at_a_random_step_resumes_to_the_same_losses(tmp_path, task_dir):
  """SIGKILL (no chance to save) at a random step; the rerun resumes from the last
  checkpoint and gives every loss, dev metric and parameter of an uninterrupted run,
  with one metrics row per step."""
  args = ("--config.train.num_steps=40", "--config.train.log_every=1",
          "--config.train.checkpoint_every=4", "--config.train.eval_every=10")
  assert _finetune(str(tmp_path / "whole"), task_dir, *args) == 0
  cut = str(tmp_path / "cut")
  kill_after = int(np.random.default_rng(int(time.time())).integers(5, 36))
  proc = _start_finetune(cut, task_dir, *args)
  _wait_for_losses(proc, cut, kill_after)
  proc.kill()
  proc.communicate(timeout=60)
  assert not os.path.exists(os.path.join(cut, "final_metrics.json"))
  assert _finetune(cut, task_dir, *args) == 0
  rows = lambda d: read_jsonl(str(tmp_path / d / "metrics.jsonl"))
  assert [r["step"] for r in rows("cut") if "loss" in r] == list(range(1, 41)), kill_after
  for key in ("loss", "dev_accuracy"):
    assert ([(r["step"], r[key]) for r in rows("cut") if key in r]
            == [(r["step"], r[key]) for r in rows("whole") if key in r]), (key, kill_after)
  a, b = _saved_params(str(tmp_path / "whole")), _saved_params(cut)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.long
@pytest.mark.parametrize("variant", ["bert,smoke"])
def test_two_processes_fine_tune_like_one(variant, tmp_path, task_dir, bert_workdir):
  """2 processes x 4 devices (jax.distributed) against 1 process x 8 devices: the same
  losses, dev metrics and dev predictions. BERT starts from a pretrained checkpoint,
  T5 fine-tunes text to text (predictions by generation, gathered from both hosts)."""
  args = ["--config.train.num_steps=4", "--config.train.log_every=1",
          "--config.train.eval_every=2", "--config.train.batch_size=8"]
  if variant.startswith("bert"):
    args.append(f"--config.init.checkpoint={bert_workdir}")
  single = _start_finetune(str(tmp_path / "single"), task_dir, *args, variant=variant)
  out, err = single.communicate(timeout=600)
  assert single.returncode == 0, err[-3000:]
  port = _free_port()
  procs = [_start_finetune(str(tmp_path / "multi"), task_dir, *args,
                           f"--coordinator_address=localhost:{port}", "--num_processes=2",
                           f"--process_id={i}", variant=variant, devices=4) for i in range(2)]
  outputs = [proc.communicate(timeout=600) for proc in procs]
  for proc, (out, err) in zip(procs, outputs):
    assert proc.returncode == 0, err[-3000:]
  assert "2 process(es)" in outputs[0][0]
  rows = lambda d: read_jsonl(str(tmp_path / d / "metrics.jsonl"))
  losses = lambda d: [(r["step"], r["loss"]) for r in rows(d) if "loss" in r]
  assert [s for s, _ in losses("multi")] == [1, 2, 3, 4]
  np.testing.assert_allclose([v for _, v in losses("multi")], [v for _, v in losses("single")],
                             rtol=1e-5)
  dev = lambda d: [(r["step"], {k: v for k, v in r.items() if k.startswith("dev_")})
                   for r in rows(d) if "dev_accuracy" in r]
  assert dev("multi") == dev("single") and len(dev("single")) == 2
  read = lambda d: open(tmp_path / d / "dev_predictions.jsonl").read()
  assert read("multi") == read("single")


@pytest.mark.long
def test_regression_task_end_to_end(tmp_path, task_dir):
  """The README's worked example of a new task type runs as any other: a score per
  passage (its share of words starting with a capital), Pearson / Spearman / MSE."""
  for split in ("train", "dev"):
    with open(tmp_path / f"{split}.csv", "w", encoding="utf-8", newline="") as f:
      writer = csv.writer(f)
      writer.writerow(["text", "score"])
      for row in _read_csv(f"{task_dir}/{split}.csv"):
        words = row["text"].split()
        writer.writerow([row["text"], sum(w[:1].isupper() for w in words) / len(words)])
  workdir = tmp_path / "ft"
  assert _finetune(str(workdir), task_dir, "--config.task.name=regression",
                   "--config.task.label_column=score", "--config.train.num_steps=4",
                   f"--config.task.train_file={tmp_path / 'train.csv'}",
                   f"--config.task.dev_file={tmp_path / 'dev.csv'}") == 0
  final = json.load(open(workdir / "final_metrics.json"))
  assert {"pearson", "spearman", "mse"} <= set(final) and final["step"] == 4
  predictions = [json.loads(line) for line in open(workdir / "dev_predictions.jsonl")]
  assert len(predictions) == final["dev_examples"] == len(_read_csv(f"{task_dir}/dev.csv"))
  assert all(isinstance(p["prediction"], float) for p in predictions)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.long
def test_finetune_from_a_hugging_face_bert_with_its_vocab_txt(tmp_path, task_dir, capsys):
  import torch
  import transformers
  words = sorted({w.lower() for r in _read_csv(f"{task_dir}/train.csv")
                  for w in re.findall(r"\w+", r["text"])})
  vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words
  hf_dir = tmp_path / "hf_bert"
  torch.manual_seed(0)
  model = transformers.BertForPreTraining(transformers.BertConfig(
      vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
      intermediate_size=64, max_position_embeddings=64))
  model.save_pretrained(str(hf_dir))
  (hf_dir / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
  assert cli.main(["finetune", f"--config={CONFIG}:bert,smoke,dir={task_dir}",
                   f"--workdir={tmp_path / 'ft'}", "--config.init.config=",
                   f"--config.init.hf={hf_dir}", "--config.train.num_steps=2",
                   "--config.optimizer.learning_rate=0.0",
                   "--config.optimizer.warmup_steps=0", *BERT_HEAD]) == 0
  assert f"Hugging Face checkpoint {hf_dir}" in capsys.readouterr().out
  tuned = _saved_params(str(tmp_path / "ft"))
  torch_weights = dict(model.state_dict())
  np.testing.assert_array_equal(tuned["backbone/token_embed/embedding"],
                                torch_weights["bert.embeddings.word_embeddings.weight"].numpy())
  np.testing.assert_array_equal(tuned["head/pooler/kernel"],
                                torch_weights["bert.pooler.dense.weight"].numpy().T)


# ------------------------------------------------------------------ text to text
@pytest.mark.long
def test_t5_text_to_text_by_generation_and_by_rank(tmp_path, task_dir):
  assert _finetune(str(tmp_path), task_dir, "--config.train.num_steps=3",
                   variant="t5,smoke") == 0
  final = json.load(open(tmp_path / "final_metrics.json"))
  predictions = [json.loads(line) for line in open(tmp_path / "dev_predictions.jsonl")]
  labels = {r["label"] for r in _read_csv(f"{task_dir}/train.csv")}
  assert all(p["prediction"] is None or p["prediction"] in labels for p in predictions)
  assert all(p["ranked"] in labels for p in predictions)  # ranking always names a label
  for prefix, key in (("", "prediction"), ("rank_", "ranked")):
    assert final[f"{prefix}accuracy"] == pytest.approx(
        100 * np.mean([p[key] == p["label"] for p in predictions]))


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("file_name, content, expected", [
    ("train.csv", 'text,label\n"a passage",austen\n"another",\n', "train.csv:3:"),
    ("train.csv", 'text,label\n"a passage",austen\n"x","twain"\n"no label column"\n',
     "train.csv:4:"),
    ("dev.jsonl", '{"text": "a", "label": "austen"}\n\n{"text": "b", "label": "tolstoy"}\n',
     "dev.jsonl:3:"),
    ("dev.jsonl", '{"text": "a", "label": "austen"}\n{"label": "twain"}\n', "dev.jsonl:2:"),
])
def test_bad_rows_are_reported_with_their_line(tmp_path, task_dir, capsys, file_name,
                                               content, expected):
  bad = tmp_path / file_name
  bad.write_text(content, encoding="utf-8")
  which = "train_file" if file_name.startswith("train") else "dev_file"
  assert _finetune(str(tmp_path / "ft"), task_dir, f"--config.task.{which}={bad}") == 2
  err = capsys.readouterr().err
  assert f"{bad}:{expected.split(':')[1]}:" in err, err
  assert not (tmp_path / "ft" / "checkpoints").exists()  # stopped before any training
