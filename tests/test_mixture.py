"""Mixtures of sources (data/mixture.py): rates, purity in (seed, i), each source read in
its own order, exhaustion, per-source eval, bad input; the trainer through the CLI.

Reference numbers come from counting what the examples say about themselves (a fake
objective whose rows carry their source, epoch and index) and from binomial sigmas,
never from the mixture's own tables."""

import math
import os

import numpy as np
import pytest

from t5x_like import cli
from t5x_like.data.loader import make_loader
from t5x_like.data.mixture import (BLOCK, Mixture, MixtureError, MixtureSource,
                                   exhaustion_step, parse_mixture, source_names)
from t5x_like.data.objective import Objective
from t5x_like.data.sources import source_from_spec
from t5x_like.data.tokenize import build_store
from t5x_like.data.vocab import default_vocab
from t5x_like.experiment import build_data
from helpers import (ROOT, committed_checkpoints, jsonl_rows, killed_and_resumed, load_config,
                     losses, run_child, train_command, train_two_processes)

AUSTEN = "embedded:austen_pride_and_prejudice"
WELLS = "embedded:wells_the_time_machine"


class Tagged(Objective):
  """Rows that say where they come from: source id, epoch, example index. Epoch sizes
  vary (size + epoch % 3) like real objectives'."""

  def __init__(self, tag: int, size: int, seed: int = 0):
    self.tag, self.size, self.seed = tag, size, seed

  def num_examples(self, epoch):
    return self.size + epoch % 3

  def examples(self, indices, epoch):
    indices = np.asarray(indices, np.int64)
    assert indices.min() >= 0 and indices.max() < self.num_examples(epoch)
    return {"source": np.full(len(indices), self.tag), "epoch": np.full(len(indices), epoch),
            "index": indices}


def tagged_mixture(rates=(0.8, 0.2), sizes=(5000, 700), seed=0):
  return Mixture([MixtureSource(f"s{i}", f"embedded:s{i}", Tagged(i, n), r)
                  for i, (r, n) in enumerate(zip(rates, sizes))], seed=seed)


def rows(objective, batch, steps, seed=0, **kw):
  """[steps * batch, 3] (source, epoch, index) of the loader's first `steps` batches."""
  it = iter(make_loader(objective, batch, seed=seed, process_index=kw.pop("process_index", 0),
                        process_count=kw.pop("process_count", 1)))
  if "state" in kw:
    it.set_state(kw["state"])
  out = [next(it) for _ in range(steps)]
  return np.stack([np.concatenate([b[k] for b in out]) for k in ("source", "epoch", "index")], 1)


# ------------------------------------------------------------------------ rates
def test_proportions_at_0_8_and_0_2_are_within_three_sigma_over_10000_examples():
  n, p = 10_000, 0.8
  sigma = math.sqrt(n * p * (1 - p))  # 40
  for seed in (0, 1, 2):
    got = rows(tagged_mixture(seed=seed), 100, 100, seed=seed)
    first = int((got[:, 0] == 0).sum())
    print(f"seed {seed}: source 0 in {first} of {n}; expected {n * p:.0f} +- 3 x {sigma:.0f}")
    assert abs(first - n * p) <= 3 * sigma
    assert 0 < first < n  # interleaved, not one source after the other


def test_rates_are_normalised_and_a_tiny_rate_still_gets_examples():
  got = rows(tagged_mixture(rates=(2500, 800)), 512, 128)  # 65,536 = one block: exact
  assert (got[:, 0] == 0).sum() == round(BLOCK * 2500 / 3300)
  got = rows(tagged_mixture(rates=(1.0, 1e-3)), 512, 128)
  assert (got[:, 0] == 1).sum() == round(BLOCK * 1e-3 / 1.001)


def test_rates_by_size_follow_each_source_s_training_tokens(tmp_path):
  config = load_config("bert_cpu", "smoke")
  config.data.mixture = f"{AUSTEN}=size,{WELLS}=size"
  _, train, _, stats = build_data(config, str(tmp_path))
  vocab = default_vocab("bert")
  # independent: every token of each book, less the held-out 2% tail of its document
  tokens = [build_store(source_from_spec(s), vocab)[0].num_tokens for s in (AUSTEN, WELLS)]
  want = np.array(tokens, float) / sum(tokens)
  rates = [s.rate for s in train.sources]
  np.testing.assert_allclose(rates, want, atol=0.002)
  assert [m["rate"] for m in stats["mixture"].values()] == pytest.approx(rates, abs=1e-6)
  config.data.mixture = f"{AUSTEN}=3,{WELLS}=1"  # given rates win over sizes
  _, train, _, _ = build_data(config, str(tmp_path))
  assert [s.rate for s in train.sources] == [0.75, 0.25]


def test_the_two_config_forms_and_commas_inside_a_spec():
  both = "embedded:a,b"
  assert parse_mixture(f"{both}=0.8,text:x/*.txt=0.2") == [(both, 0.8), ("text:x/*.txt", 0.2)]
  assert parse_mixture(f"{{'{both}': 0.8, 'text:x/*.txt': 0.2}}") == [
      (both, 0.8), ("text:x/*.txt", 0.2)]
  assert parse_mixture("prepared:gs://b/wiki=size,prepared:gs://b/books=size")[1] == (
      "prepared:gs://b/books", "size")
  assert source_names(["prepared:gs://b/wiki", "text:books/*.txt", "tfds:c4/en:train",
                       "jsonl:d/x.jsonl:body", "text:books/*.md"]) == [
      "wiki", "books", "c4", "x", "books_2"]
  with pytest.raises(MixtureError, match="all numbers or all 'size'"):
    parse_mixture("embedded=size,text:x=1")


# ------------------------------------------------------------------ purity, order
def test_example_i_depends_only_on_seed_and_i():
  """Whatever the batch size, host slicing, resume point or object that reads it."""
  whole = rows(tagged_mixture(), 40, 50)  # 2,000 examples
  np.testing.assert_array_equal(rows(tagged_mixture(), 100, 20), whole)
  hosts = [rows(tagged_mixture(), 40, 50, process_index=h, process_count=2) for h in (0, 1)]
  interleaved = np.concatenate([np.concatenate([h[s * 20:(s + 1) * 20] for h in hosts])
                                for s in range(50)])
  np.testing.assert_array_equal(interleaved, whole)
  it = iter(make_loader(tagged_mixture(), 40, seed=0, process_index=0, process_count=1))
  for _ in range(30):
    next(it)
  state = it.get_state()
  np.testing.assert_array_equal(rows(tagged_mixture(), 40, 20, state=state), whole[1200:])
  assert not np.array_equal(rows(tagged_mixture(seed=1), 40, 50, seed=1), whole)


def test_each_source_reads_its_epochs_in_order_each_a_fresh_permutation():
  """A 700-example source at 0.2 passes ~5 epochs in 18,000 examples: each epoch is a
  permutation of its examples, read whole before the next, and no two alike."""
  got = rows(tagged_mixture(), 500, 36)
  small = got[got[:, 0] == 1]
  epochs = small[:, 1]
  assert (np.diff(epochs) >= 0).all() and epochs.max() >= 4
  orders = []
  for e in range(epochs.max()):  # whole epochs
    index = small[epochs == e, 2]
    assert sorted(index) == list(range(700 + e % 3))
    orders.append(index[:50])
  assert len({tuple(o) for o in orders}) == len(orders)


def test_exhaustion_step_is_the_first_batch_past_a_source_s_first_epoch():
  for sizes, batch in [((5000, 700), 64), ((300, 4000), 100), ((20_000, 20_000), 256)]:
    mixture = tagged_mixture(sizes=sizes)
    step, name = exhaustion_step(mixture, batch)
    got = rows(tagged_mixture(sizes=sizes), batch, step + 1)
    past = got[:, 1] > 0  # an example of some source's second epoch
    assert not past[:step * batch].any() and past[step * batch:].any(), sizes
    assert name == f"s{got[step * batch:][past[step * batch:]][0, 0]}"


# ------------------------------------------------------------------------ the CLI
def _small_text(directory) -> str:
  """A text source of a few dozen BERT examples at length 64."""
  os.makedirs(directory, exist_ok=True)
  words = "the quick brown fox jumps over a lazy dog near the river bank".split()
  rng = np.random.default_rng(0)
  text = " ".join(" ".join(rng.choice(words, 12)) + "." for _ in range(300))
  with open(os.path.join(directory, "story.txt"), "w") as f:
    f.write(text)
  return f"text:{directory}/*.txt"


@pytest.mark.long
def test_stop_ends_the_run_cleanly_and_eval_is_reported_per_source(tmp_path):
  """A small text source at 0.5 runs out within a few steps: exit 0, a clear line, a
  checkpoint at the last step; eval rows hold each source's metrics and the overall
  ones, their rate-weighted mean."""
  small = _small_text(str(tmp_path / "small"))
  workdir = str(tmp_path / "run")
  mixture = f"{{'{WELLS}': 0.5, '{small}': 0.5}}"  # the dict form, through the flag
  done = run_child(train_command("bert_cpu.py:smoke", workdir, f"--config.data.mixture={mixture}",
                                 "--config.data.mixture_exhausted=stop",
                                 "--config.train.num_steps=200",
                                 "--config.train.eval_every=4", "--config.train.eval_batches=1"))
  assert done.returncode == 0, done.stderr[-3000:]
  line = [x for x in done.stdout.splitlines() if x.startswith("data exhausted at step")]
  assert line and "mixture source 'small'" in line[0], done.stdout[-2000:]
  step = int(line[0].split()[4].rstrip(":"))
  assert 2 <= step < 200
  assert max(losses(workdir)) == step and committed_checkpoints(workdir)[-1] == step
  evals = [r for r in jsonl_rows(workdir) if "eval_loss" in r]
  assert evals and evals[-1]["step"] == step
  for row in evals:
    for metric in ("loss", "mlm_accuracy"):
      per_source = [row[f"eval_{n}/{metric}"] for n in ("embedded_wells_the_time_machine",
                                                        "small")]
      assert row[f"eval_{metric}"] == pytest.approx(0.5 * sum(per_source), rel=1e-9)
    assert row["eval_small/loss"] != row["eval_embedded_wells_the_time_machine/loss"]


BAD = [
    ("zero", f"--config.data.mixture={AUSTEN}=0,{WELLS}=1", "data.mixture['embedded:austen"),
    ("negative", f"--config.data.mixture={AUSTEN}=-0.5,{WELLS}=1", "='-0.5'"),
    ("nan", f"--config.data.mixture={AUSTEN}=nan,{WELLS}=1", "'nan'"),
    ("not_a_number", f"--config.data.mixture={AUSTEN}=lots", "'lots'"),
    ("dict_non_number", f"--config.data.mixture={{'{AUSTEN}': None}}", "None"),
    ("unknown_scheme", "--config.data.mixture=books:x=1,embedded=1", "data.mixture['books:x']"),
    ("bad_spec", "--config.data.mixture=embedded=1,jsonl:=1", "'jsonl:'"),
    ("missing_files", "--config.data.mixture=embedded=1,text:no/such/*.txt=1", "no/such/*.txt"),
    ("missing_prepared", "--config.data.mixture=embedded=1,prepared:nowhere=1", "nowhere"),
    ("unknown_book", "--config.data.mixture=embedded:nosuchbook=1", "nosuchbook"),
    ("empty_dict", "--config.data.mixture={}", "data.mixture"),
    ("no_rate", f"--config.data.mixture={AUSTEN}", "no rate"),
    ("both", f"--config.data.mixture={AUSTEN}=1|--config.data.source={WELLS}", "data.source="),
    ("exhausted", f"--config.data.mixture={AUSTEN}=1|--config.data.mixture_exhausted=end",
     "data.mixture_exhausted"),
]


@pytest.mark.parametrize("name, flags, words", BAD, ids=[b[0] for b in BAD])
def test_bad_mixture_exits_2_with_one_line_and_writes_nothing(name, flags, words, tmp_path,
                                                              monkeypatch, capfd):
  monkeypatch.chdir(tmp_path)
  code = cli.main(["train", f"--config={ROOT}/configs/bert_cpu.py:smoke", "--workdir=wd",
                   *flags.split("|")])
  out, err = capfd.readouterr()
  lines = [x for x in err.splitlines() if x.strip()]
  assert code == 2, (name, err[-2000:])
  assert "Traceback" not in err + out and len(lines) == 1, err
  assert words in err, (words, err)
  assert os.listdir(tmp_path) == [], "something was written"


def test_plan_reads_the_recipe_s_mixture():
  from t5x_like.data.mixture import describe_data
  from t5x_like.plan.text import _data_line
  data = describe_data(load_config("bert_pretrain", "base,rates=paper").data)
  assert [m["rate"] for m in data["mixture"].values()] == [0.757576, 0.242424]
  assert _data_line(data).startswith("data mixture of wikipedia-en-bert (prepared:gs://")
  assert describe_data(load_config("bert_pretrain", "base").data)["exhausted"] == "restart"


# ---------------------------------------------------------------- slow: kill, hosts
MIX = (f"--config.data.mixture={AUSTEN}=0.8,{WELLS}=0.2",)


@pytest.mark.long
def test_sigkill_and_resume_equal_an_uninterrupted_mixture_run(tmp_path):
  full = str(tmp_path / "full")
  done = run_child(train_command("bert_cpu.py:smoke", full, *MIX))
  assert done.returncode == 0, done.stderr[-3000:]
  expected = losses(full)
  assert sorted(expected) == list(range(1, 21))
  killed = str(tmp_path / "killed")
  resumed = killed_and_resumed("bert_cpu.py:smoke", killed, *MIX)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from step" in resumed.stdout + resumed.stderr
  assert losses(killed) == expected  # float32 on CPU: identical
  last_eval = lambda w: {k: v for k, v in [r for r in jsonl_rows(w) if "eval_loss" in r][-1]
                         .items() if k.startswith("eval_")}
  assert last_eval(killed) == last_eval(full) and "eval_embedded_wells_the_time_machine/loss" in (
      last_eval(full))


@pytest.mark.long
def test_a_stopped_mixture_run_rerun_ends_at_the_same_step(tmp_path):
  small = _small_text(str(tmp_path / "small"))
  flags = (f"--config.data.mixture={WELLS}=0.5,{small}=0.5",
           "--config.data.mixture_exhausted=stop", "--config.train.num_steps=200")
  workdir = str(tmp_path / "run")
  first = run_child(train_command("bert_cpu.py:smoke", workdir, *flags))
  again = run_child(train_command("bert_cpu.py:smoke", workdir, *flags))
  assert first.returncode == again.returncode == 0, again.stderr[-3000:]
  line = lambda out: [x for x in out.splitlines() if x.startswith("data exhausted")][0]
  assert line(first.stdout).split(":")[0] == line(again.stdout).split(":")[0]
  restart = run_child(train_command("bert_cpu.py:smoke", str(tmp_path / "restart"),
                                    *flags[:1], "--config.train.num_steps=40"))
  assert restart.returncode == 0 and max(losses(str(tmp_path / "restart"))) == 40


@pytest.mark.long
def test_two_processes_of_a_mixture_match_one(tmp_path):
  flags = (*MIX, "--config.train.num_steps=6")
  single = str(tmp_path / "single")
  done = run_child(train_command("bert_cpu.py:smoke", single, *flags))
  assert done.returncode == 0, done.stderr[-3000:]
  multi = str(tmp_path / "multi")
  for code, out in train_two_processes("bert_cpu.py:smoke", multi, *flags):
    assert code == 0, out[-3000:]
  expected, got = losses(single), losses(multi)
  assert sorted(got) == sorted(expected) == list(range(1, 7))
  np.testing.assert_allclose([got[s] for s in range(1, 7)],
                             [expected[s] for s in range(1, 7)], rtol=1e-5)
  last = lambda w: [r for r in jsonl_rows(w) if "eval_loss" in r][-1]
  for key in ("eval_loss", "eval_embedded_wells_the_time_machine/mlm_accuracy"):
    assert last(multi)[key] == pytest.approx(last(single)[key], rel=1e-5)
