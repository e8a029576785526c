"""The GLUE study (t5x_like/studies/glue_experiment.py, glue_tables.py) and the bag of
pieces it compares against (studies/bag_of_pieces.py fit_on_train)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT

from t5x_like.finetune.data import Dataset
from t5x_like.finetune.task import Example
from t5x_like.studies import bag_of_pieces, glue_tables


class _WordTokenizer:
  """Pieces = whitespace words over a fixed vocabulary."""

  def __init__(self, words):
    self.ids = {w: k for k, w in enumerate(words)}
    self.vocab_size = len(words)

  def encode(self, text):
    return [self.ids[w] for w in text.split()]


def _pairs(n, seed, words):
  """Pairs of 3-word texts; label 1 when they share a word (what no sum of two separate
  bags can tell), score = the number of shared words."""
  rng = np.random.default_rng(seed)
  examples = []
  for _ in range(n):
    a, b = rng.choice(words, 3, replace=False), rng.choice(words, 3, replace=False)
    shared = len(set(a) & set(b))
    examples.append(Example(" ".join(a), " ".join(b), label=shared))
  return examples


@pytest.mark.parametrize("regression", [False, True])
def test_bag_sees_what_two_texts_share(regression):
  words = [f"w{k}" for k in range(12)]
  tokenizer = _WordTokenizer(words)
  train, dev = _pairs(600, 0, words), _pairs(200, 1, words)
  if not regression:
    train = [Example(e.text, e.text_pair, int(e.label > 0)) for e in train]
    dev = [Example(e.text, e.text_pair, int(e.label > 0)) for e in dev]
  as_dataset = lambda ex: Dataset("mem", ex, ("no", "yes"), {})
  score = (lambda p, g: np.corrcoef(p, g)[0, 1]) if regression else (
      lambda p, g: np.mean(p == g))
  bag = bag_of_pieces.fit_on_train(as_dataset(train), tokenizer, regression, score)
  predicted = bag.predict(as_dataset(dev))
  gold = np.array([e.label for e in dev], float)
  if regression:
    assert np.corrcoef(predicted, gold)[0, 1] > 0.9
  else:
    assert np.mean(predicted == gold) > 0.9
  assert bag.w.shape[0] == 3 * 12 + 1  # two bags, their overlap, the bias
  if not regression:  # without the overlap block: no better than the majority (0.62)
    x = {n: bag_of_pieces.features(as_dataset(d), tokenizer, 12) for n, d in
         (("train", train), ("dev", dev))}
    w = bag_of_pieces.fit(x["train"], np.array([e.label for e in train]), 2, 1e-3)
    assert bag_of_pieces.accuracy(w, x["dev"], gold.astype(int)) < 0.75
  assert set(bag.holdout_scores) == set(bag_of_pieces.L2_GRID)


def test_five_task_average_of_the_published_rows():
  # Issue 43 quotes Turc et al.'s BERT-Tiny and BERT-Mini five-task averages.
  tiny, mini = glue_tables.PUBLISHED.values()
  assert round(glue_tables.five_task_average(tiny), 1) == 58.1
  assert round(glue_tables.five_task_average(mini), 1) == 58.9


def test_tables_average_per_seed_and_margin():
  official = lambda base: {"cola": {"mcc": base}, "sst2": {"accuracy": base + 10},
                           "mrpc": {"f1": base + 20, "accuracy": base},
                           "stsb": {"pearson": base, "spearman": base + 10},
                           "rte": {"accuracy": base}}
  rows = []
  for arm, bases in (("random", (10, 20)), ("pretrained", (30, 50))):
    for seed, base in enumerate(bases):
      rows += [dict(family="bert", arm=arm, task=t, seed=seed, official=m)
               for t, m in official(base).items()]
  text = glue_tables.glue_markdown(rows, list(glue_tables.FIVE))
  # per seed: base + (0 + 10 + 10 + 5 + 0) / 5 = base + 5
  assert "| 20.0 (15.0-25.0) | 45.0 (35.0-55.0) | **+25.0** |" in text
  assert "| stsb | spearman | 25.0 (20.0-30.0) | 50.0 (40.0-60.0) | +25.0 |" in text
  assert "58.1 |" in text and "58.9 |" in text
  # margins: five-task +25 and STS-B Pearson +25: both bars met
  assert ("five-task average +25.0 (bar +5): **met**; STS-B Pearson +25.0 (bar +20):"
          " **met**.") in text
  stsb_close = [dict(r, official={"pearson": 10.0, "spearman": 10.0})
                if r["task"] == "stsb" and r["arm"] == "pretrained" else r for r in rows]
  text = glue_tables.glue_markdown(stsb_close, list(glue_tables.FIVE))
  assert "STS-B Pearson -5.0 (bar +20): **not met**." in text


def test_mixture_shares_the_task_text_by_square_root():
  from t5x_like.studies.glue_experiment import pretraining_mixture
  mixture = pretraining_mixture("embedded", {"a.jsonl": 900, "b.jsonl": 100}, 0.8)
  assert mixture == {"embedded": 0.2, "jsonl:a.jsonl": 0.6, "jsonl:b.jsonl": 0.2}


def test_tables_replace_only_their_part_of_the_page(tmp_path):
  from t5x_like.studies.glue_experiment import BEGIN, END, write_between_markers
  page = tmp_path / "glue.md"
  write_between_markers(str(page), "first\n")
  assert page.read_text() == f"{BEGIN}\nfirst\n{END}"
  page.write_text(f"# GLUE\nprose\n{BEGIN}\nold\n{END}\nmore prose\n")
  write_between_markers(str(page), "new\n")
  assert page.read_text() == f"# GLUE\nprose\n{BEGIN}\nnew\n{END}\nmore prose\n"


def test_a_call_for_one_family_keeps_the_other_family_s_table(tmp_path):
  from t5x_like.studies.glue_experiment import BEGIN, END, write_between_markers
  rows = lambda family, value: [dict(family=family, arm="random", task="cola", seed=0,
                                     official={"mcc": value})]
  page = tmp_path / "glue.md"
  page.write_text("# GLUE\n")
  write_between_markers(str(page), glue_tables.glue_markdown(rows("bert", 11.0), ["cola"]))
  write_between_markers(str(page), glue_tables.glue_markdown(rows("t5", 22.0), ["cola"]))
  text = page.read_text()
  assert text.startswith(f"# GLUE\n{BEGIN}\n") and text.endswith(f"{END}")
  # BERT's table, then T5's, then the published rows once, in that order
  in_order = ("### BERT", "| cola | mcc | 11.0 |", "### T5", "| cola | mcc | 22.0 |",
              "For scale")
  positions = [text.index(part) for part in in_order]
  assert positions == sorted(positions)
  assert text.count("For scale") == 1 and text.count("BERT-Tiny (L2") == 1
  write_between_markers(str(page), glue_tables.glue_markdown(rows("bert", 33.0), ["cola"]))
  text = page.read_text()
  assert "| cola | mcc | 11.0 |" not in text and "| cola | mcc | 33.0 |" in text
  assert text.index("### BERT") < text.index("### T5") < text.index("For scale")
  assert "| cola | mcc | 22.0 |" in text


@pytest.mark.long
def test_study_smoke_end_to_end(tmp_path):
  """The driver on small GLUE files: pretraining, both arms at two seeds (the second at
  the first seed's picked rate), the bag; a second call runs nothing."""
  from test_benchmark_files import write_files
  data = write_files(tmp_path / "glue")
  with open(tmp_path / "glue" / "STS-B" / "train.tsv", "a") as f:  # 15 rows: 2 held out
    f.writelines(f"{k}\tg\tf\ty\t{k}\tn\tn\tA man {k}.\tA dog {k}.\t{k % 5}.0\n"
                 for k in range(5, 15))
  work = tmp_path / "study"
  command = [sys.executable, "-m", "t5x_like.studies.glue_experiment", "--workdir",
             str(work), "--data_dir", data, "--smoke", "--families", "bert", "--tasks",
             "rte,stsb", "--seeds", "0,1", "--lr_grid", "1e-3,1e-4"]
  run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1500)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  rows = [json.loads(line) for line in open(work / "results.jsonl")]
  assert {(r["arm"], r["task"], r["seed"]) for r in rows} == {
      *((a, t, s) for a in ("random", "pretrained") for t in ("rte", "stsb") for s in (0, 1)),
      ("bag", "rte", 0), ("bag", "stsb", 0)}
  picks = {(r["arm"], r["task"]): r["lr"] for r in rows if r["arm"] != "bag" and r["seed"] == 0}
  assert set(picks.values()) <= {"1e-3", "1e-4"}
  for r in rows:
    if r["arm"] != "bag" and r["seed"] == 1:  # at the rate picked at seed 0
      assert r["lr"] == picks[r["arm"], r["task"]]
      lr_logged = json.loads(open(work / "runs" / "bert" / r["arm"] / "s1" / r["task"]
                                  / "metrics.jsonl").readline())["learning_rate"]
      assert lr_logged <= float(r["lr"])
  # the corpus is train text only: no dev sentence of the files in it
  corpus = open(work / "corpus" / "rte.jsonl").read() + open(work / "corpus" / "stsb.jsonl").read()
  assert "Premise 3." in corpus and "He left." not in corpus and "A plane." not in corpus
  assert "| stsb | pearson |" in open(work / "tables.md").read()
  again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert again.returncode == 0 and "pretrain bert" not in again.stdout
  assert " in " not in "".join(l for l in again.stdout.splitlines() if "seed" in l)
  # --record: the results outside the workdir; a new workdir fine-tunes nothing again
  record = str(tmp_path / "runs.jsonl")
  assert subprocess.run(command + ["--record", record], cwd=ROOT, capture_output=True,
                        text=True, timeout=600).returncode == 0
  command[command.index(str(work))] = str(tmp_path / "elsewhere")
  moved = subprocess.run(command + ["--record", record], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
  assert moved.returncode == 0, moved.stdout[-3000:] + moved.stderr[-3000:]
  assert " in " not in "".join(l for l in moved.stdout.splitlines() if "seed" in l)
  assert open(tmp_path / "elsewhere" / "tables.md").read() == open(work / "tables.md").read()


def test_the_record_keeps_finished_results_outside_the_workdir(tmp_path):
  from t5x_like.studies.glue_experiment import restore_record, save_record
  work, record = tmp_path / "study", str(tmp_path / "docs" / "runs.jsonl")
  results = {"runs/t5/random/s0/cola/final_metrics.json": {"score": 1.0},
             "runs/t5/random/s0/lr_grid/cola/1e-3/final_metrics.json": {"score": 2.0},
             "baseline/t5/cola.json": {"official": {"mcc": 3.0}}}
  for path, result in results.items():
    (work / path).parent.mkdir(parents=True, exist_ok=True)
    (work / path).write_text(json.dumps(result))
  (work / "runs/t5/random/s0/cola/metrics.jsonl").write_text("{}\n")  # not a result
  assert save_record(record, str(work)) == 3
  assert [json.loads(line)["path"] for line in open(record)] == sorted(results)
  fresh = tmp_path / "fresh"  # another machine's empty workdir
  assert restore_record(record, str(fresh)) == 3
  for path, result in results.items():
    assert json.loads((fresh / path).read_text()) == result
  assert not (fresh / "runs/t5/random/s0/cola/metrics.jsonl").exists()
  # what a workdir holds is not overwritten; rows the workdir lacks stay in the record
  (fresh / "baseline/t5/cola.json").write_text(json.dumps({"official": {"mcc": 9.0}}))
  assert restore_record(record, str(fresh)) == 0
  assert json.loads((fresh / "baseline/t5/cola.json").read_text())["official"]["mcc"] == 9.0
  other = tmp_path / "other"
  (other / "runs/t5/pretrained/s0/rte").mkdir(parents=True)
  (other / "runs/t5/pretrained/s0/rte/final_metrics.json").write_text('{"score": 4.0}')
  assert save_record(record, str(other)) == 4
  assert restore_record(str(tmp_path / "absent.jsonl"), str(fresh)) == 0


def test_study_refuses_bad_flags_and_missing_data(tmp_path):
  from t5x_like.errors import UserError
  from t5x_like.studies.glue_experiment import main
  run = lambda *args: main(["--workdir", str(tmp_path / "w"), "--data_dir", str(tmp_path),
                            *args])
  with pytest.raises(UserError, match="mnli"):
    run("--tasks", "cola,mnli")
  with pytest.raises(UserError, match="RTE/train.tsv"):
    run("--tasks", "rte")
  assert not os.path.exists(tmp_path / "w")


def test_task_text_groups_examples_into_documents_of_paragraphs(tmp_path, monkeypatch):
  """Pretraining text from train only: runs of EXAMPLES_PER_DOCUMENT examples, every
  text (a pair's two, in order) a paragraph of its own, so a BERT instance holds whole
  pairs; the count returned is that of examples (the mixture's square-root shares)."""
  from test_benchmark_files import write_files
  from t5x_like.studies import glue_experiment
  data = write_files(tmp_path / "glue")
  with open(tmp_path / "glue" / "STS-B" / "train.tsv", "a") as f:
    f.writelines(f"{k}\tg\tf\ty\t{k}\tn\tn\tA man {k}.\tA dog {k}.\t{k % 5}.0\n"
                 for k in range(5, 15))
  monkeypatch.setattr(glue_experiment, "EXAMPLES_PER_DOCUMENT", 4)
  counts = glue_experiment.write_task_text(["stsb"], data, str(tmp_path / "study"))
  path = str(tmp_path / "study" / "corpus" / "stsb.jsonl")
  docs = [json.loads(line) for line in open(path)]
  train = open(tmp_path / "glue" / "STS-B" / "train.tsv").read().splitlines()[1:]
  assert counts == {path: len(train)} == {path: sum(d["examples"] for d in docs)}
  assert [d["examples"] for d in docs] == [4] * (len(train) // 4) + (
      [len(train) % 4] if len(train) % 4 else [])
  texts = [p for d in docs for p in d["text"].split("\n\n")]
  pairs = list(zip(texts[::2], texts[1::2]))  # in the reader's order
  assert sorted(pairs) == sorted(tuple(row.split("\t")[7:9]) for row in train)
  assert "A plane." not in texts  # dev's
