"""UL2's mixture of denoisers (data/ul2.py), checked against the definitions of the UL2
paper (Tay et al. 2022) and T5's span corruption and prefix LM, with the arithmetic
written out here: every example gives back its piece of the stream, the pieces tile the
stream, each denoiser's counts and lengths are the largest that fit, the rates hold."""

import os

import numpy as np
import pytest

from helpers import random_token_store
from references import stream_order
from t5x_like.command_flags import load_config_file
from t5x_like.data.pipeline import OBJECTIVES, make_objective
from t5x_like.data.ul2 import UL2, DEFAULT_DENOISERS
from t5x_like.data.vocab import default_vocab
from t5x_like.train.config_check import ConfigError, validate

V, EOS, SENTINELS = 1000, 1, 100
MODES = {"R": [5, 6], "X": [7], "S": [8, 9, 10]}
L, T = 64, 48


def _store(num_docs=1200, seed=0):
  return random_token_store(num_docs, seed, tokens=(2, 900), sentence_lengths=(5, 30),
                            sentences=(2, 8))


def _ul2(store, seed=0, *, length=L, targets_length=T, **options):
  return UL2(store, seed, inputs_length=length, targets_length=targets_length,
             vocab_size=V, eos_id=EOS, max_spans=SENTINELS, mode_ids=MODES, **options)


def _stream(store, seed, epoch):
  return np.concatenate([store.doc_tokens(d) for d in stream_order(store, seed, epoch)])


def _counts(n, density, mean, max_spans=SENTINELS):
  """T5's random_spans_noise_mask counts, spans capped at the sentinels."""
  noise = min(max(round(n * density), 1), n - 1)
  spans = min(max(1, round(noise / mean)), max_spans, noise, n - noise)
  return noise, spans


def _fits(kind, mean, density, n, mode, length=L, targets_length=T):
  if kind == "S":
    return mode + n <= length and n <= targets_length
  noise, spans = _counts(n, density, mean)
  return mode + n - noise + spans + 1 <= length and noise + spans + 1 <= targets_length


def _piece(inputs, targets, mode):
  """The raw piece an example was made from: a span example's sentinels in the inputs
  filled with what follows the same sentinel in the targets; an S example's prefix then
  its continuation. Also (noise tokens, spans) for a span example."""
  x = inputs[:np.flatnonzero(inputs == EOS)[-1]]
  y = targets[:np.flatnonzero(targets == EOS)[-1]]
  assert list(x[:len(MODES[mode])]) == MODES[mode]
  x = x[len(MODES[mode]):]
  if mode == "S":
    return np.concatenate([x, y]), None
  is_sentinel = y >= V - SENTINELS
  spans = {}
  for start in np.flatnonzero(is_sentinel):
    end = start + 1
    while end < len(y) and not is_sentinel[end]:
      end += 1
    spans[int(y[start])] = y[start + 1:end]
  out = []
  for token in x:
    out.extend(spans.pop(int(token)) if token >= V - SENTINELS else [token])
  assert not spans  # every target span was used
  used = int(is_sentinel.sum())
  assert list(y[is_sentinel]) == list(range(V - 1, V - 1 - used, -1))  # in order
  return np.array(out), (len(y) - used, used)


def test_examples_give_back_the_stream_and_each_denoiser_its_counts():
  store = _store()
  objective = _ul2(store, seed=3, denoisers="R:3:0.15,X:8:0.5,X:32:0.15,S", rates="1,1,1,2")
  kinds = ["R", "X", "X", "S"]
  params = [(3, 0.15), (8, 0.5), (32, 0.15), (0, 0)]
  # Each denoiser's raw length is the largest that fits (T5's random_spans_helper).
  for k, ((mean, density), kind) in enumerate(zip(params, kinds)):
    n = int(objective.raw_lengths[k])
    mode = len(MODES[kind])
    assert _fits(kind, mean, density, n, mode) and not _fits(kind, mean, density, n + 1, mode)
  stream = _stream(store, 3, 1)
  count = objective.num_examples(1)
  assert count > 1000  # more than one period
  batch = objective.examples(np.arange(count), 1)
  pieces, seen = [], {k: 0 for k in range(4)}
  for i in range(count):
    x, y = batch["encoder_input_tokens"][i], batch["decoder_target_tokens"][i]
    real_x = int(batch["encoder_segment_ids"][i].sum())
    real_y = int(batch["decoder_loss_weights"][i].sum())
    assert (x[real_x:] == 0).all() and (y[real_y:] == 0).all()
    assert x[real_x - 1] == EOS and y[real_y - 1] == EOS
    kind = "S" if x[0] == 8 else ("R" if x[0] == 5 else "X")
    piece, counts = _piece(x[:real_x], y[:real_y], kind)
    n = len(piece)
    k = [j for j in range(4) if kinds[j] == kind and objective.raw_lengths[j] == n][0]
    seen[k] += 1
    if counts is not None:
      assert counts == _counts(n, *params[k][::-1])
    pieces.append(piece)
  # The pieces, in index order, are the stream's tokens back to back.
  flat = np.concatenate(pieces)
  np.testing.assert_array_equal(flat, stream[:len(flat)])
  assert len(stream) - len(flat) < max(objective.raw_lengths)
  # Rates 1:1:1:2 hold exactly in the first period of 1000.
  first = objective.plan(np.arange(1000), 1)[0]
  assert np.bincount(first).tolist() == [200, 200, 200, 400]
  assert sum(seen.values()) == count and seen[3] > 1.5 * seen[0]
  # Decoder inputs are the targets shifted right; positions count real tokens.
  np.testing.assert_array_equal(batch["decoder_input_tokens"][:, 1:],
                                batch["decoder_target_tokens"][:, :-1]
                                * batch["decoder_segment_ids"][:, 1:])
  np.testing.assert_array_equal(batch["encoder_positions"],
                                np.arange(L) * batch["encoder_segment_ids"])


def test_the_decoder_layout_is_a_prefix_lm_row_of_the_same_pairs():
  """ul2_decoder: one row of `length` = mode tokens and inputs (the prefix: seen both
  ways, no loss), then the targets (loss); each denoiser's piece is the largest whose
  prefix and targets fit the row together; the rows give the stream back."""
  store = _store(400)
  length = 96
  objective = UL2(store, 5, inputs_length=length, targets_length=None, vocab_size=V,
                  eos_id=EOS, max_spans=SENTINELS, mode_ids=MODES,
                  denoisers="R:3:0.15,X:8:0.5,S")
  kinds, params = ["R", "X", "S"], [(3, 0.15), (8, 0.5), (0, 0)]
  for k, ((mean, density), kind) in enumerate(zip(params, kinds)):
    n, mode = int(objective.raw_lengths[k]), len(MODES[kind])
    def fits(n):
      if kind == "S":
        return mode + n + 2 <= length
      noise, spans = _counts(n, density, mean)
      return mode + (n - noise + spans + 1) + (noise + spans + 1) <= length
    assert fits(n) and not fits(n + 1)
  count = objective.num_examples(0)
  batch = objective.examples(np.arange(count), 0)
  assert set(batch) == {"decoder_target_tokens", "decoder_input_tokens",
                        "decoder_loss_weights", "decoder_causal_attention",
                        "decoder_segment_ids", "decoder_positions"}
  pieces = []
  for i in range(count):
    row = batch["decoder_target_tokens"][i]
    loss = batch["decoder_loss_weights"][i].astype(bool)
    real = int(batch["decoder_segment_ids"][i].sum())
    split = int(np.flatnonzero(loss)[0])
    assert loss[split:real].all() and not loss[:split].any() and not loss[real:].any()
    assert (batch["decoder_causal_attention"][i] == (np.arange(length) <= split)).all()
    assert (row[real:] == 0).all()
    np.testing.assert_array_equal(batch["decoder_input_tokens"][i][1:real], row[:real - 1])
    assert batch["decoder_input_tokens"][i][0] == 0
    kind = "S" if row[0] == 8 else ("R" if row[0] == 5 else "X")
    pieces.append(_piece(row[:split], row[split:real], kind)[0])
  flat = np.concatenate(pieces)
  np.testing.assert_array_equal(flat, _stream(store, 5, 0)[:len(flat)])
  spec = OBJECTIVES["ul2_decoder"]
  assert (spec.vocab_family, spec.model_family, spec.needs_targets_length) == (
      "t5", "decoder", False)
  built = make_objective("ul2_decoder", store, default_vocab("t5"), seed=0, length=128)
  assert built.feature_shapes()["decoder_causal_attention"] == (128,)


def test_the_paper_mixture_caps_spans_at_the_sentinels():
  """At 512 / 512 the X (3, 0.5) denoiser would need 135 spans; it gets the vocabulary's
  100 sentinels, so its spans are longer than 3 on average."""
  objective = _ul2(_store(200), length=512, targets_length=512)
  assert [str(d) for d in objective.denoisers] == DEFAULT_DENOISERS.split(",")
  k = [str(d) for d in objective.denoisers].index("X:3:0.5")
  n = int(objective.raw_lengths[k])
  noise, spans = objective.spans(k)
  assert round(round(n * 0.5) / 3) > 100 and spans == 100 and noise == round(n * 0.5)
  assert np.allclose(objective.rates, 1 / 7)
  assert sorted(objective.counts) == [142] + [143] * 6  # largest remainders of 1000 / 7
  batch = objective.examples(np.arange(objective.num_examples(0)), 0)
  x = batch["encoder_input_tokens"]
  assert x.max() < V and (x[x >= V - SENTINELS] >= V - SENTINELS).all()


def test_examples_are_a_function_of_seed_epoch_and_index():
  store = _store(300)
  a, b = _ul2(store), _ul2(store)
  one = a.example(7, 2)
  row = b.examples(np.array([3, 7, 1]), 2)
  for name, value in one.items():
    np.testing.assert_array_equal(value, row[name][1])
  assert not np.array_equal(a.examples(np.arange(50), 2)["encoder_input_tokens"],
                            a.examples(np.arange(50), 3)["encoder_input_tokens"])
  assert not np.array_equal(a.plan(np.arange(1000), 0)[0], a.plan(np.arange(1000, 2000), 0)[0])


def test_mode_tokens_can_be_left_out():
  store = _store(300)
  with_modes = _ul2(store, denoisers="S", targets_length=L)
  without = _ul2(store, denoisers="S", targets_length=L, mode_tokens=False)
  assert (with_modes.raw_lengths[0], without.raw_lengths[0]) == (L - 3, L)
  x = without.examples(np.arange(20), 0)["encoder_input_tokens"]
  assert not (x[:, :3] == [8, 9, 10]).all(1).any()


@pytest.mark.parametrize("options, message", [
    (dict(denoisers="R:3"), "bad entry 'R:3'"),
    (dict(denoisers="Q:3:0.5"), "bad entry 'Q:3:0.5'"),
    (dict(denoisers="R:3:1.5"), "0 < DENSITY < 1"),
    (dict(denoisers="R:3:0.15,S", rates="1"), "expected 2 non-negative numbers"),
    (dict(denoisers="R:3:0.15,S", rates="1,x"), "expected numbers"),
    (dict(denoisers="R:3:0.15,S", rates="1,0.0001"), "would get no example"),
    (dict(length=8, targets_length=2), "too short"),
])
def test_bad_options_are_refused_with_the_option_named(options, message):
  with pytest.raises(ValueError, match=message):
    _ul2(_store(20), **options)


def test_registered_and_validated_from_the_registry():
  spec = OBJECTIVES["ul2"]
  assert (spec.vocab_family, spec.model_family) == ("t5", "encoder_decoder")
  assert spec.options() == {"denoisers", "rates", "mode_tokens"}
  vocab = default_vocab("t5")
  objective = make_objective("ul2", _store(300), vocab, seed=0, length=128,
                             targets_length=64, denoisers="X:8:0.5,S")
  assert [list(m) for m in objective.modes] == [list(vocab.encode("[NLG]")),
                                                list(vocab.encode("[S2S]"))]
  assert objective.feature_shapes()["decoder_target_tokens"] == (64,)
  with pytest.raises(ValueError, match="needs targets_length"):
    make_objective("ul2", _store(20), vocab, seed=0, length=128)
  with pytest.raises(ValueError, match="sentinels"):
    make_objective("ul2", _store(20), default_vocab("gpt"), seed=0, length=128,
                   targets_length=64)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  config = load_config_file(os.path.join(root, "configs", "t5_cpu.py"))
  config.data.objective = "ul2"
  config.data.targets_length = 64
  config.data.options = {"denoisers": "R:3:0.15,S", "rates": "3,1"}
  validate(config, 8)
  config.data.options = {"denoisers": 3}
  with pytest.raises(ConfigError, match="data.options.denoisers=3: expected str"):
    validate(config, 8)
  config.data.options = {}
  config.data.targets_length = 0
  with pytest.raises(ConfigError, match="data.targets_length"):
    validate(config, 8)


@pytest.mark.slow
@pytest.mark.parametrize("config, objective, extra", [
    ("configs/t5_cpu.py:smoke", "ul2", ["--config.data.targets_length=64"]),
    ("configs/gpt_cpu.py:smoke", "ul2_decoder", []),
])
def test_a_model_trains_on_it_end_to_end(tmp_path, config, objective, extra):
  """`t5x-like train` on the embedded books: the loss of the last 10 of 60 steps is below
  the first step's, every logged loss is finite, and the final eval runs."""
  import json
  import math
  from t5x_like import cli
  workdir = tmp_path / "run"
  assert cli.main(["train", f"--config={config}", f"--workdir={workdir}",
                   f"--config.data.objective={objective}", "--config.train.num_steps=60",
                   "--config.train.log_every=1", *extra]) == 0
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  losses = [r["loss"] for r in rows if "loss" in r and "step" in r]
  assert len(losses) >= 60 and all(math.isfinite(x) for x in losses)
  assert np.mean(losses[-10:]) < losses[0] - 0.5


@pytest.mark.slow
def test_a_resumed_run_gives_the_uninterrupted_runs_losses(tmp_path):
  """T5 smoke (float32) on ul2: 10 steps, then a rerun to 20, against 20 at once: every
  loss of steps 11-20 is bit-equal (the loader resumes inside the denoisers' plan)."""
  import json
  from t5x_like import cli
  def run(workdir, steps):
    assert cli.main(["train", "--config=configs/t5_cpu.py:smoke", f"--workdir={workdir}",
                     "--config.data.objective=ul2", "--config.data.targets_length=64",
                     "--config.train.log_every=1", "--config.train.checkpoint_every=10",
                     f"--config.train.num_steps={steps}"]) == 0
    return {r["step"]: r["loss"] for r in map(json.loads, open(workdir / "metrics.jsonl"))
            if "loss" in r}
  once = run(tmp_path / "once", 20)
  run(tmp_path / "twice", 10)
  twice = run(tmp_path / "twice", 20)
  assert [twice[s] for s in range(11, 21)] == [once[s] for s in range(11, 21)]
