"""The text-task builders (t5x_like/task_builders/text_tasks.py), the bag-of-pieces baseline
(studies/bag_of_pieces.py) and task.test_file.

The builders' properties are checked against the source text itself: every
"unacceptable" sentence is its "acceptable" twin with two neighbouring words swapped or
one function word put in place of a word of another part of speech, every "consecutive"
pair is found consecutive in the text and every "elsewhere" pair is not, no sentence is in
two splits, the classes are balanced and --per_class keeps that many."""

import collections
import contextlib
import csv
import io
import json
import os
import random
import re

import numpy as np
import pytest

from t5x_like import cli
from t5x_like.data.sentences import split_sentences
from t5x_like.task_builders import text_tasks
from helpers import ROOT

BOOKS = ("carroll_alices_adventures_in_wonderland", "shelley_frankenstein",
         "wells_the_time_machine")
UNSEEN = "embedded:" + ",".join(BOOKS)

# Parts of speech of some frequent words, written here apart from the module's table.
POS = {"the": "det", "a": "det", "his": "det", "their": "det", "of": "prep", "in": "prep",
       "with": "prep", "from": "prep", "he": "pron", "she": "pron", "they": "pron",
       "was": "aux", "had": "aux", "would": "aux", "and": "conj", "but": "conj"}


def _rows(folder, split):
  with open(os.path.join(folder, f"{split}.csv"), encoding="utf-8", newline="") as f:
    return list(csv.DictReader(f))


def _book_sentences():
  """Every sentence of the three books, whitespace squashed, per book."""
  from t5x_like import corpus
  return {b: [" ".join(s.split()) for s in split_sentences(corpus.read_book(b))]
          for b in BOOKS}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  out = {}
  for kind in text_tasks.KINDS:
    folder = str(tmp_path_factory.mktemp(kind))
    out[kind] = folder, text_tasks.build_text_task(kind, UNSEEN, folder)
  return out


def _balanced(folder, labels):
  for split in text_tasks.SPLITS:
    counts = collections.Counter(r["label"] for r in _rows(folder, split))
    assert sorted(counts) == sorted(labels), (split, counts)
    assert len(set(counts.values())) == 1, (split, counts)


def test_acceptability_pairs_are_local_corruptions(built):
  folder, stats = built["acceptability"]
  _balanced(folder, ["acceptable", "unacceptable"])
  kinds, seen = collections.Counter(), {}
  for split in text_tasks.SPLITS:
    rows = _rows(folder, split)
    good = {r["text"] for r in rows if r["label"] == "acceptable"}
    for s in good:
      assert s not in seen, f"{s!r} in {seen.get(s)} and {split}"
      seen[s] = split
    by_shape = collections.defaultdict(list)
    for s in good:
      by_shape[len(s.split()), s.split()[0]].append(s.split())
    for r in rows:
      if r["label"] != "unacceptable":
        continue
      bad = r["text"].split()
      twins = []
      for g in by_shape[len(bad), bad[0]]:
        diff = [i for i, (x, y) in enumerate(zip(g, bad)) if x != y]
        if len(diff) == 2 and diff[1] == diff[0] + 1 and g[diff[0]] == bad[diff[1]] \
            and g[diff[1]] == bad[diff[0]] and g[diff[0]].isalpha() and g[diff[0]].islower():
          twins.append("swap")
        elif len(diff) == 1 and diff[0] > 0:
          old, new = g[diff[0]], bad[diff[0]]
          if old in POS and new in POS:
            assert POS[old] != POS[new], (old, new, r["text"])
          twins.append("replace")
      assert twins, f"no acceptable twin in {split} for {r['text']!r}"
      kinds[twins[0]] += 1
  assert min(kinds.values()) > 0.3 * sum(kinds.values()), kinds
  assert stats["splits"]["train"]["examples"] > 5000
  # Every acceptable sentence is a whole sentence of one of the books.
  sentences = {s for book in _book_sentences().values() for s in book}
  assert all(s in sentences for s in seen)


def test_coherence_pairs_follow_the_text(built):
  folder, stats = built["coherence"]
  _balanced(folder, ["consecutive", "elsewhere"])
  position = {}
  for b, sentences in _book_sentences().items():
    for i, s in enumerate(sentences):
      position.setdefault(s, (b, i))
  firsts = {}
  for split in text_tasks.SPLITS:
    for r in _rows(folder, split):
      (b1, i), (b2, j) = position[r["text"]], position[r["text_pair"]]
      assert b1 == b2, "both sentences from one book"
      if r["label"] == "consecutive":
        assert j == i + 1
      else:
        assert abs(j - i) >= stats["min_distance"]
      firsts.setdefault(r["text"], set()).add(split)
      firsts.setdefault(r["text_pair"], set()).add(split)
  assert all(len(s) == 1 for s in firsts.values()), "a sentence in two splits"


def test_authorship_balanced_passages_of_the_books(built):
  folder, stats = built["authorship"]
  _balanced(folder, ["carroll", "shelley", "wells"])
  from t5x_like import corpus
  words = {b.split("_")[0]: " ".join(corpus.read_book(b).split()) for b in BOOKS}
  passages = collections.Counter()
  for split in text_tasks.SPLITS:
    for r in _rows(folder, split):
      assert len(r["text"].split()) == 32 and r["text"] in words[r["label"]]
      passages[r["text"]] += 1
  assert max(passages.values()) == 1


def test_per_class_keeps_that_many_and_the_same_dev(tmp_path):
  for kind, per_class in (("acceptability", 16), ("coherence", 64), ("authorship", 16)):
    a, b, c = (str(tmp_path / f"{kind}{n}") for n in range(3))
    stats = text_tasks.build_text_task(kind, UNSEEN, a, per_class=per_class, seed=1)
    text_tasks.build_text_task(kind, UNSEEN, b, per_class=per_class, seed=1)
    text_tasks.build_text_task(kind, UNSEEN, c, per_class=per_class, seed=2)
    train = _rows(a, "train")
    assert all(n == per_class for n in collections.Counter(r["label"] for r in train).values())
    assert stats["splits"]["train"]["examples"] == len(train)
    assert train == _rows(b, "train"), "a function of the seed"
    assert train != _rows(c, "train")
    for split in ("dev", "test"):  # the seed picks the training subset only
      assert _rows(a, split) == _rows(c, split)
    everything = str(tmp_path / f"{kind}_all")
    text_tasks.build_text_task(kind, UNSEEN, everything)
    assert _rows(everything, "test") == _rows(a, "test")
    whole = {tuple(r.values()) for r in _rows(everything, "train")}
    assert all(tuple(r.values()) in whole for r in train)


def _story(folder, authors=("smith", "jones"), sentences=300):
  """Text files the repository does not ship: `sentences` made-up sentences per author."""
  os.makedirs(folder, exist_ok=True)
  rng = random.Random(0)
  nouns = "house river garden letter window horse doctor city morning stranger".split()
  verbs = "watched opened followed remembered crossed answered found left".split()
  for author in authors:
    with open(os.path.join(folder, f"{author}_story.txt"), "w") as f:
      for n in range(sentences):
        f.write(f"The {rng.choice(nouns)} of the {rng.choice(nouns)} {rng.choice(verbs)} him"
                f" and the {rng.choice(nouns)} was quiet number {n}.\n\n")


def test_cli_builds_from_any_text(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  _story("mine")
  for kind in text_tasks.KINDS:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
      assert cli.main(["task", kind, "--source", "text:mine/*.txt", "--out", kind,
                       "--per_class", "8"]) == 0
    printed = json.loads(stdout.getvalue())
    with open(os.path.join(kind, "stats.json")) as f:
      assert json.load(f) == printed
    assert printed["splits"]["train"]["examples"] == 8 * len(printed["labels"])
    assert printed["source"] == "text:mine/*.txt" and printed["documents"] == 2


def test_bag_of_pieces_equals_sklearn(tmp_path):
  """The fitted weights are sklearn's multinomial logistic regression's on the same
  features (sklearn: C * sum of the losses + |W|^2 / 2, so C = 1 / (l2 * n))."""
  from sklearn.linear_model import LogisticRegression
  from t5x_like.studies import bag_of_pieces
  from t5x_like.finetune.data import read_examples
  from t5x_like.finetune.tasks import task_from_config
  from t5x_like.command_flags import load_config_file
  from t5x_like.finetune.backbone import load_backbone
  folder = str(tmp_path / "authorship")
  text_tasks.build_text_task("authorship", UNSEEN, folder, per_class=64)
  config = load_config_file(os.path.join(ROOT, "configs", "text_tasks.py")
                            + f":authorship,dir={folder},smoke")
  task = task_from_config(config.task)
  train = read_examples(config.task.train_file, task)
  tokenizer = load_backbone(config).tokenizer
  x = bag_of_pieces.features(train, tokenizer, tokenizer.vocab_size)
  y = np.array([e.label for e in train.examples])
  l2 = 0.01
  w = bag_of_pieces.fit(x, y, len(train.labels), l2)
  reference = LogisticRegression(C=1 / (l2 * len(y)), max_iter=5000, tol=1e-8).fit(x, y)
  ours = x @ w[:-1] + w[-1]
  theirs = reference.decision_function(x)
  # Softmax logits are defined up to a constant per row.
  np.testing.assert_allclose(ours - ours.mean(1, keepdims=True),
                             theirs - theirs.mean(1, keepdims=True), atol=2e-3)
  dev = read_examples(config.task.dev_file, task, labels=train.labels)
  test = read_examples(config.task.test_file, task, labels=train.labels)
  result = bag_of_pieces.bag_of_pieces(train, dev, test, tokenizer)
  assert result["l2"] in bag_of_pieces.L2_GRID and 0.5 < result["test_accuracy"] <= 1


@pytest.mark.long
def test_finetune_scores_the_test_file(tmp_path, monkeypatch):
  """configs/text_tasks.py reads train/dev/test.csv and scores test.csv, not dev.csv
  again: with test.csv = dev.csv, labels flipped, the test predictions are the dev
  predictions and the test accuracy is 1 - the dev accuracy."""
  monkeypatch.chdir(tmp_path)
  _story("mine")
  assert cli.main(["task", "coherence", "--source", "text:mine/*.txt", "--out",
                   "workdir/coherence", "--per_class", "8"]) == 0
  dev_rows = _rows("workdir/coherence", "dev")
  labels = sorted({r["label"] for r in dev_rows})
  assert len(labels) == 2
  flipped = [{**r, "label": labels[r["label"] == labels[0]]} for r in dev_rows]
  with open("workdir/coherence/test.csv", "w", encoding="utf-8", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(dev_rows[0]))
    writer.writeheader()
    writer.writerows(flipped)
  config = os.path.join(ROOT, "configs", "text_tasks.py") + ":coherence,smoke"
  assert cli.main(["finetune", "--config", config, "--workdir", "ft"]) == 0
  with open("ft/final_metrics.json") as f:
    final = json.load(f)
  predictions = {}
  for split in ("dev", "test"):
    with open(f"ft/{split}_predictions.jsonl") as f:
      predictions[split] = [json.loads(line) for line in f]
  assert [p["prediction"] for p in predictions["test"]] == [
      p["prediction"] for p in predictions["dev"]]
  assert [p["label"] for p in predictions["test"]] == [r["label"] for r in flipped]
  assert final["test_examples"] == len(flipped)
  assert abs(final["test_accuracy"] - (1 - final["accuracy"])) < 1e-9


@pytest.mark.long
def test_t5_encoder_head_end_to_end(tmp_path, monkeypatch, capsys):
  """--config.task.text_to_text=false: T5's encoder under a head (with layer decay) is
  trained and scored as a classifier, without rank_* metrics; a task without a head on
  T5's encoder is a config error naming the key, and writes nothing."""
  monkeypatch.chdir(tmp_path)
  _story("mine")
  assert cli.main(["task", "coherence", "--source", "text:mine/*.txt", "--out",
                   "workdir/coherence", "--per_class", "8"]) == 0
  config = os.path.join(ROOT, "configs", "text_tasks.py") + ":coherence,family=t5,smoke"
  assert cli.main(["finetune", "--config", config, "--workdir", "ft",
                   "--config.task.text_to_text=false",
                   "--config.optimizer.layer_decay=0.8"]) == 0
  with open("ft/final_metrics.json") as f:
    final = json.load(f)
  assert 0 <= final["accuracy"] <= 100 and 0 <= final["test_accuracy"] <= 100
  assert final["test_examples"] == len(_rows("workdir/coherence", "test"))
  assert not any(k.startswith("rank_") for k in final)
  capsys.readouterr()
  assert cli.main(["finetune", "--config", config, "--workdir", "ft_regression",
                   "--config.task.text_to_text=false", "--config.task.name=regression"]) == 2
  err = capsys.readouterr().err
  assert "config.task.text_to_text=False: task regression" in err and "Traceback" not in err
  assert not os.path.exists("ft_regression")


@pytest.mark.long
def test_experiment_driver_end_to_end_and_resumes(tmp_path, capsys):
  """The driver (smoke configs): pretraining, lr selection, every count x seed, the
  baseline and the tables for BERT and T5; a second call runs nothing again; a
  pretraining corpus holding a task book is refused."""
  from t5x_like.errors import UserError
  from t5x_like.studies import text_task_experiment as experiment
  workdir = str(tmp_path / "exp")
  tasks = "embedded:carroll_alices_adventures_in_wonderland,wells_the_time_machine"
  args = ["--workdir", workdir, "--smoke", "--pretrain",
          "tiny=embedded:austen_pride_and_prejudice", "--task_source", tasks,
          "--families", "bert,t5", "--kinds", "coherence", "--counts", "16,all",
          "--seeds", "0", "--lrs", "1e-3,3e-4", "--select_count", "16"]
  assert experiment.main(args) == 0
  with open(os.path.join(workdir, "results.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  arms = collections.Counter((r["family"], r["arm"]) for r in rows)
  assert arms == {(f, a): 2 for f in ("bert", "t5") for a in ("bag", "random", "tiny")}
  assert all(0 <= r["test_accuracy"] <= 1 for r in rows)
  tables = open(os.path.join(workdir, "tables.md")).read()
  assert "### BERT" in tables and "### T5" in tables and "| coherence | all |" in tables
  runs = sorted(os.listdir(os.path.join(workdir, "runs", "bert", "tiny", "coherence")))
  # lr selection at 16 per class, seed 0 (2 rates; the picked one is the 16 row), then all.
  assert len([r for r in runs if not r.endswith(".log")]) == 3
  capsys.readouterr()
  assert experiment.main(args) == 0
  assert " s\n" not in capsys.readouterr().out, "a second call reran something"
  # a fine-tuning variant: its own runs (and lr pick), its own table; bag rows shared
  # and a pretraining with its own settings, on the same text
  variant = ["--variant", "cls", "--set", "task.pooling=cls", "--set", "task.pooler=True",
             "--families", "bert", "--norandom", "--jobs", "2",
             "--pretrain", "sd=embedded:austen_pride_and_prejudice",
             "--pretrain_set", "sd:data.options.nsp_negatives=same_document"]
  capsys.readouterr()
  assert experiment.main(args + variant) == 0
  assert "pretrain bert on sd with data.options.nsp_negatives=same_document" in (
      capsys.readouterr().out)
  for arm in ("tiny", "sd"):
    runs = os.listdir(os.path.join(workdir, "runs", "bert", arm, "coherence"))
    assert len([r for r in runs if r.endswith("_steps10_cls")]) == 3
  tables = open(os.path.join(workdir, "tables.md")).read()
  assert "### BERT (cls)" in tables and "### T5" not in tables
  with pytest.raises(UserError, match="wells_the_time_machine"):
    experiment.main(["--workdir", str(tmp_path / "bad"), "--smoke", "--pretrain",
                     "x=embedded:wells_the_time_machine", "--task_source", tasks])


def test_experiment_step_budget():
  """20 epochs of 32 within 100-300 steps; 5 epochs (at most 1,000) once those pass 300."""
  from t5x_like.studies.text_task_experiment import steps_for
  budgets = {32: 100, 128: 100, 200: 125, 512: 300, 768: 300, 1476: 300, 1920: 300,
             3000: 469, 6454: 1000, 100_000: 1000}
  assert {n: steps_for(n) for n in budgets} == budgets


@pytest.mark.parametrize("flags, message", [
    (["--set", "task.pooling=cls"], "--set and --variant go together"),
    (["--variant", "v", "--set", "task.pooling"], "--set 'task.pooling': expected KEY=VALUE"),
    (["--counts", "16,many"], "--counts"),
    (["--kinds", "sentiment"], "unknown ['sentiment']"),
    (["--pretrain", "a=embedded:austen_pride_and_prejudice", "--pretrain_set",
      "b:data.length=64"], "--pretrain_set 'b:data.length=64': expected NAME:KEY=VALUE"),
    (["--jobs", "0"], "--jobs 0"),
])
def test_experiment_flag_errors(tmp_path, flags, message):
  from t5x_like.command_flags import FlagError
  from t5x_like.studies import text_task_experiment as experiment
  with pytest.raises(FlagError, match=re.escape(message)):
    experiment.main(["--workdir", str(tmp_path / "w"), *flags])
  assert not os.path.exists(tmp_path / "w")


def test_text_task_config_defaults_the_tables_chose():
  """configs/text_tasks.py's measured choices (docs/text-tasks.md): BERT's pair head for
  coherence, mean pooling for single texts, AdamW at 1e-3."""
  from t5x_like.command_flags import load_config_file
  heads = {}
  for kind in ("authorship", "acceptability", "coherence"):
    c = load_config_file(os.path.join(ROOT, "configs", f"text_tasks.py:{kind}"))
    heads[kind] = (c.task.pooling, c.task.pooler)
    assert (c.optimizer.name, c.optimizer.learning_rate) == ("adamw", 1e-3)
    assert c.optimizer.layer_decay == 1.0
  assert heads == {"authorship": ("mean", False), "acceptability": ("mean", False),
                   "coherence": ("cls", True)}
  t5 = load_config_file(os.path.join(ROOT, "configs", "text_tasks.py:coherence,family=t5"))
  assert (t5.task.text_to_text, t5.task.pooling) == (True, "mean")


def test_a_stopped_child_ends_the_study_in_one_line_with_its_status(monkeypatch, capsys):
  """A suite stopped by SIGTERM (exit 143, its checkpoint saved): the study driver says
  so in one line and exits 143, no traceback; another failure stays an error."""
  from t5x_like.studies import child_runs

  class Child:  # what subprocess.Popen gives; the child's status is the point
    def __init__(self, command, **unused):
      self.status = 143 if "finetune-suite" in command else 1

    def wait(self):
      return self.status

  monkeypatch.setattr(child_runs.subprocess, "Popen", Child)
  with pytest.raises(SystemExit) as exit_info:
    child_runs.exit_with(lambda: child_runs.run_t5x_like("finetune-suite", "--tasks=rte"),
                         "study")
  assert exit_info.value.code == 143
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "Traceback" not in err
  assert err.startswith("study: `t5x-like finetune-suite` was stopped (exit 143")
  with pytest.raises(RuntimeError, match="exit 1: "):
    child_runs.run_t5x_like("train")
