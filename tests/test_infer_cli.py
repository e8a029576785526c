"""`t5x-like infer` end to end on tiny GPT, T5 and BERT workdirs trained by `t5x-like train`.

References are computed here from full forwards of `model.logits`, one example at a
time (no KV cache, no batching; right-padded to one width so that one compile serves
all): a greedy loop, teacher-forced log-softmax sums, the softmax at each [MASK]. The
params come from load_pretrained, the vocabulary from the config.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like import cli
from t5x_like.train.pretrained import load_pretrained
from helpers import CONFIGS as CONFIGS_DIR, load_config

CONFIG_DIR = CONFIGS_DIR
CONFIGS = {name: os.path.join(CONFIG_DIR, f"{name}_cpu.py:smoke") for name in ("gpt", "t5", "bert")}


def _load_config(name):
  return load_config(f"{name}_cpu", "smoke")


def _train(name, tmp_path_factory):
  """A train workdir of the smoke config: 2 steps, one checkpoint at step 2."""
  workdir = str(tmp_path_factory.mktemp(name))
  rc = cli.main(["train", "--config", CONFIGS[name], "--workdir", workdir,
                 "--config.train.num_steps=2", "--config.optimizer.warmup_steps=1",
                 "--config.train.checkpoint_every=2", "--config.train.eval_every=0",
                 "--config.train.eval_batches=1"])
  assert rc == 0
  return workdir


@pytest.fixture(scope="module")
def gpt_workdir(tmp_path_factory):
  return _train("gpt", tmp_path_factory)


@pytest.fixture(scope="module")
def t5_workdir(tmp_path_factory):
  return _train("t5", tmp_path_factory)


@pytest.fixture(scope="module")
def bert_workdir(tmp_path_factory):
  return _train("bert", tmp_path_factory)


def _loaded(name, workdir):
  """(model, params, vocab) through load_pretrained (params on config.mesh)."""
  loaded = load_pretrained(_load_config(name), workdir)
  return loaded.model, loaded.params, loaded.vocab


def _write_jsonl(path, lines):
  path.write_text("\n".join(lines) + "\n")
  return str(path)


def _infer(name, workdir, input_path, *extra):
  return cli.main(["infer", "--config", CONFIGS[name], "--checkpoint", workdir,
                   "--input", input_path, *extra])


def _read_rows(path):
  return [json.loads(line) for line in open(path)]


def _padded(ids, width=32):
  """[1, width] int32, ids then 0s (encoders mask 0s out; decoders are causal)."""
  out = np.zeros((1, width), np.int32)
  out[0, :len(ids)] = ids
  return out


# --------------------------------------------------------------------------- GPT
def _greedy_reference(logits_fn, params, prompt_ids, max_new_tokens, eos_id):
  """Greedy continuation by full forwards over [BOS, prompt, generated so far]: the
  sequence sits right-padded in a fixed buffer of 32 (causal: later slots do not matter;
  one shape, one compile)."""
  seq = [0] + list(prompt_ids)
  out = []
  for _ in range(max_new_tokens):
    buffer = np.zeros((1, 32), np.int32)
    buffer[0, :len(seq)] = seq
    token = int(jnp.argmax(logits_fn(params, buffer)[0, len(seq) - 1]))
    if token == eos_id:
      break
    out.append(token)
    seq.append(token)
  return out


@pytest.mark.long
def test_gpt_greedy_matches_full_forward_loop(gpt_workdir, tmp_path, capsys):
  """Five prompts of different lengths over two batches (mesh data 4 x tensor 2, batch 3
  rounded up to 4), a blank line in the input; rows in input order, to stdout."""
  texts = ["The old man", "It was a dark and stormy night, and the wind",
           "She said", "Once upon a time there lived a king who", "Why"]
  lines = [json.dumps({"text": t}) for t in texts]
  input_path = _write_jsonl(tmp_path / "in.jsonl", lines[:2] + [""] + lines[2:])
  rc = _infer("gpt", gpt_workdir, input_path, "--max_new_tokens", "6", "--batch_size",
              "3", "--config.mesh.data=4", "--config.mesh.tensor=2")
  captured = capsys.readouterr()
  assert rc == 0, captured.err
  rows = [json.loads(line) for line in captured.out.splitlines()]
  assert [r["line"] for r in rows] == [1, 2, 4, 5, 6]
  assert [r["text"] for r in rows] == texts
  model, params, vocab = _loaded("gpt", gpt_workdir)
  logits_fn = jax.jit(lambda p, t: model.logits(p, {"decoder_input_tokens": t}))
  for row, text in zip(rows, texts):
    want = _greedy_reference(logits_fn, params, vocab.encode(text), 6, vocab.eos_id)
    assert row["tokens"] == want, text
    assert row["output"] == vocab.decode(want)


@pytest.mark.slow
def test_gpt_score_counts_only_target_tokens(gpt_workdir, tmp_path):
  """log p(target | BOS, prompt) from one full forward over BOS, prompt, target."""
  pairs = [("The old man", " was tired"), ("", "Call me Ishmael.")]
  input_path = _write_jsonl(tmp_path / "in.jsonl", [
      json.dumps({"text": t, "target": a}) for t, a in pairs])
  output = str(tmp_path / "out.jsonl")
  assert _infer("gpt", gpt_workdir, input_path, "--mode", "score", "--output", output) == 0
  rows = _read_rows(output)
  model, params, vocab = _loaded("gpt", gpt_workdir)
  logits_fn = jax.jit(lambda p, t: model.logits(p, {"decoder_input_tokens": t}))
  for row, (text, target) in zip(rows, pairs):
    prompt, target_ids = [0, *vocab.encode(text)], list(vocab.encode(target))
    logits = logits_fn(params, _padded(prompt + target_ids))
    log_probs = np.asarray(jax.nn.log_softmax(np.asarray(logits[0], np.float64), axis=-1))
    positions = np.arange(len(prompt) - 1, len(prompt) + len(target_ids) - 1)
    assert row["num_tokens"] == len(target_ids)
    np.testing.assert_allclose(row["log_likelihood"], log_probs[positions, target_ids].sum(),
                               rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------- T5
def _teacher_forced_log_probs(logits_fn, params, encoder_ids, target_ids):
  """[len(target_ids)] log p(target_t | encoder input, targets before t)."""
  logits = logits_fn(params, {"encoder_input_tokens": _padded(encoder_ids),
                              "decoder_input_tokens": _padded([0] + list(target_ids[:-1]))})
  log_probs = jax.nn.log_softmax(np.asarray(logits[0], np.float64), axis=-1)
  return np.asarray(log_probs)[np.arange(len(target_ids)), target_ids]


T5_ROWS = [("The old man", " was tired"), ("It was a dark and stormy night", " and so"),
           ("A", " long long time ago, in a land far away")]


@pytest.mark.long
def test_t5_score_matches_teacher_forcing(t5_workdir, tmp_path):
  input_path = _write_jsonl(tmp_path / "in.jsonl", [
      json.dumps({"question": t, "answer": a}) for t, a in T5_ROWS])
  output = str(tmp_path / "out.jsonl")
  assert _infer("t5", t5_workdir, input_path, "--mode", "score", "--field", "question",
                "--target_field", "answer", "--output", output) == 0
  rows = _read_rows(output)
  model, params, vocab = _loaded("t5", t5_workdir)
  logits_fn = jax.jit(model.logits)
  assert [(r["line"], r["text"], r["target"]) for r in rows] == [
      (i + 1, t, a) for i, (t, a) in enumerate(T5_ROWS)]
  for row, (text, target) in zip(rows, T5_ROWS):
    target_ids = list(vocab.encode(target)) + [vocab.eos_id]
    encoder_ids = list(vocab.encode(text)) + [vocab.eos_id]
    want = _teacher_forced_log_probs(logits_fn, params, encoder_ids, target_ids).sum()
    assert row["num_tokens"] == len(target_ids)
    np.testing.assert_allclose(row["log_likelihood"], want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_t5_beam_search_scores_its_own_output(t5_workdir, tmp_path):
  """num_beams 2, length_penalty 0: each row's score is the log-likelihood of its tokens
  (plus the eos that ended it, when fewer than max_new_tokens came)."""
  input_path = _write_jsonl(tmp_path / "in.jsonl", [json.dumps({"text": t}) for t, _ in T5_ROWS])
  output = str(tmp_path / "out.jsonl")
  assert _infer("t5", t5_workdir, input_path, "--num_beams", "2", "--length_penalty", "0",
                "--max_new_tokens", "5", "--output", output) == 0
  rows = _read_rows(output)
  model, params, vocab = _loaded("t5", t5_workdir)
  logits_fn = jax.jit(model.logits)
  assert len(rows) == len(T5_ROWS)
  for row, (text, _) in zip(rows, T5_ROWS):
    assert 0 <= len(row["tokens"]) <= 5 and vocab.eos_id not in row["tokens"]
    scored = row["tokens"] + ([vocab.eos_id] if len(row["tokens"]) < 5 else [])
    encoder_ids = list(vocab.encode(text)) + [vocab.eos_id]
    want = _teacher_forced_log_probs(logits_fn, params, encoder_ids, scored).sum()
    np.testing.assert_allclose(row["score"], want, rtol=1e-4, atol=1e-4)


# -------------------------------------------------------------------------- BERT
@pytest.mark.long
def test_bert_fill_mask_matches_softmax(bert_workdir, tmp_path):
  texts = ["The [MASK] sat on the [MASK].", "He went [MASK] home", "no mask here"]
  input_path = _write_jsonl(tmp_path / "in.jsonl", [json.dumps({"text": t}) for t in texts])
  output = str(tmp_path / "out.jsonl")
  assert _infer("bert", bert_workdir, input_path, "--top_k", "3", "--output", output) == 0
  rows = _read_rows(output)
  model, params, vocab = _loaded("bert", bert_workdir)
  # The spec's layout: [CLS] text [SEP], a space before [MASK] belongs to the masked word.
  cls, sep, mask, enc = vocab.cls_id, vocab.sep_id, vocab.mask_id, vocab.encode
  expected_ids = [[cls, *enc("The"), mask, *enc(" sat on the"), mask, *enc("."), sep],
                  [cls, *enc("He went"), mask, *enc(" home"), sep],
                  [cls, *enc("no mask here"), sep]]
  assert [len(r["predictions"]) for r in rows] == [2, 1, 0]
  logits_fn = jax.jit(lambda p, ids: model.logits(p, {
      "encoder_input_tokens": ids, "encoder_type_ids": jnp.zeros_like(ids)})["mlm_logits"])
  for row, ids in zip(rows, expected_ids):
    logits = logits_fn(params, _padded(ids))  # [PAD]s (0) are masked out of attention
    probs = np.asarray(jax.nn.softmax(np.asarray(logits[0], np.float64), axis=-1))
    for predictions, position in zip(row["predictions"], np.flatnonzero(np.array(ids) == mask)):
      assert len(predictions) == 3
      best = predictions[0]
      assert best["id"] == int(np.argmax(probs[position]))
      assert best["token"] == vocab.piece(best["id"])
      np.testing.assert_allclose([p["prob"] for p in predictions],
                                 np.sort(probs[position])[::-1][:3], rtol=1e-4)


# ------------------------------------------------------------------------ errors
@pytest.mark.parametrize("lines,flags,where", [
    (['{"text": "a"}', '{"text": "b"}', '{"text": "c"', '{"text": "d"}'], [], "in.jsonl:3:"),
    (['{"text": "a"}', '{"prompt": "b"}'], [], "in.jsonl:2:"),
    (['{"text": "a"}', '', '{"text": 7}'], [], "in.jsonl:3:"),
    (['{"text": "a"}', '{"text": ""}'], [], "in.jsonl:2: empty prompt"),
    (['{"text": "a", "target": "b"}', '{"text": "a"}'], ["--mode", "score"], "in.jsonl:2:"),
])
def test_bad_input_lines(tmp_path, capsys, lines, flags, where):
  """Input problems are found before any checkpoint is read (this one does not exist)."""
  input_path = _write_jsonl(tmp_path / "in.jsonl", lines)
  assert _infer("gpt", str(tmp_path / "missing"), input_path, *flags) == 2
  assert where in capsys.readouterr().err


@pytest.mark.slow
def test_checkpoint_errors(gpt_workdir, tmp_path, capsys):
  input_path = _write_jsonl(tmp_path / "in.jsonl", ['{"text": "a"}'])
  assert _infer("gpt", str(tmp_path / "nowhere"), input_path) == 2
  assert "no checkpoint at" in capsys.readouterr().err
  # The full gpt_cpu config (d_model 128, 2 layers) against the smoke checkpoint.
  rc = cli.main(["infer", "--config", os.path.join(CONFIG_DIR, "gpt_cpu.py"),
                 "--checkpoint", gpt_workdir, "--input", input_path])
  err = capsys.readouterr().err
  assert rc == 2 and "does not hold the params" in err and "params.decoder." in err
  # BERT has no score mode; an unknown mode is a flag error.
  assert _infer("bert", str(tmp_path / "nowhere"), input_path, "--mode", "score") == 2
  assert "does not score" in capsys.readouterr().err
  assert _infer("gpt", gpt_workdir, input_path, "--mode", "translate") == 2
