"""`t5x-like infer`: generate with, score by, or fill masks with a model trained by
`t5x-like train`, JSONL in and out.

  t5x-like infer --config configs/gpt_cpu.py --checkpoint /tmp/gpt --input prompts.jsonl
  t5x-like infer --config configs/t5_cpu.py --checkpoint /tmp/t5 --input in.jsonl \\
      --output out.jsonl --num_beams 4 --max_new_tokens 64
  t5x-like infer --config configs/gpt_cpu.py --checkpoint /tmp/gpt --input in.jsonl \\
      --mode score --target_field target
  t5x-like infer --config configs/bert_cpu.py --checkpoint /tmp/bert --input masked.jsonl

--config is the train config (with the same --config.KEY=VALUE overrides as the
training run); --checkpoint a train workdir, its checkpoints/ directory or one step
directory (--step picks a step). Each input line is a JSON object whose --field
("text") is the prompt (GPT), the encoder input (T5) or a text with "[MASK]"s (BERT);
blank lines are skipped. Output lines (stdout unless --output), in input order:
  generate  {"line", "text", "output", "tokens", "score"}: --max_new_tokens tokens, or
            fewer when the vocabulary's eos comes; greedy (--temperature 0), sampled
            (--temperature > 0, --top_k, --top_p, --seed) or beam search (--num_beams).
  score     {"line", "text", "target", "log_likelihood", "num_tokens"}: log p(target |
            text) of the --target_field (T5: target + eos; GPT: the tokens after text).
  BERT      {"line", "text", "predictions"}: per [MASK], the --top_k (5) likeliest
            tokens [{"token", "id", "prob"}].
GPT prompts start with the BOS id 0 as causal_lm training rows do; T5 inputs end with
eos and are cut to config.data.length (a warning counts them). Exit status 2 for a bad
input line ("FILE:LINE: problem", found before the checkpoint is read), a missing or
incompatible checkpoint, or flags that do not fit the model family. Single process.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time

import jax
from absl import flags
from ml_collections import config_flags

from t5x_like import infer, parallel
from t5x_like.command_flags import parse_flags
from t5x_like.infer import requests
from t5x_like.infer.sharding import hashable_rules
from t5x_like.checkpoint import IncompatibleCheckpointError
from t5x_like.experiment import build_mesh, build_model_from_config, config_vocab
from t5x_like.train.pretrained import load_pretrained

MODES = ("generate", "score")


def _flags(argv: list[str]) -> flags.FlagValues:
  """The flags; ml-collections reads --config.KEY=VALUE overrides from `argv`."""
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "the train config file[:arg]",
                                  flag_values=fv, lock_config=True, sys_argv=argv)
  flags.DEFINE_string("checkpoint", None, "train workdir, its checkpoints/ directory, or a"
                      " step directory", flag_values=fv)
  flags.DEFINE_integer("step", None, "checkpoint step (default: the newest)", flag_values=fv)
  flags.DEFINE_string("input", None, "JSONL file of requests ('-': stdin)", flag_values=fv)
  flags.DEFINE_string("output", "-", "JSONL file to write ('-': stdout)", flag_values=fv)
  flags.DEFINE_string("field", "text", "the text field of each input line", flag_values=fv)
  flags.DEFINE_string("target_field", "target", "the target field (score mode)",
                      flag_values=fv)
  flags.DEFINE_enum("mode", "generate", list(MODES), "generate (BERT: fill-mask) or score",
                    flag_values=fv)
  flags.DEFINE_integer("max_new_tokens", 32, "tokens to generate per row", flag_values=fv)
  flags.DEFINE_integer("num_beams", 1, "beam search when > 1", flag_values=fv)
  flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sampling", flag_values=fv)
  flags.DEFINE_integer("top_k", None, "sampling: keep the k likeliest tokens (default 0:"
                       " all); BERT: predictions per mask (default 5)", flag_values=fv)
  flags.DEFINE_float("top_p", 1.0, "sampling: nucleus probability mass", flag_values=fv)
  flags.DEFINE_float("length_penalty", 1.0, "beam search: score / length ** length_penalty",
                     flag_values=fv)
  flags.DEFINE_integer("seed", 0, "sampling rng seed", flag_values=fv)
  flags.DEFINE_integer("batch_size", 8, "rows per forward (rounded up to a multiple of the"
                       " mesh's batch shards)", flag_values=fv)
  return fv


def _info(message: str) -> None:
  """Progress and warnings go to stderr (stdout may carry the output rows)."""
  print(f"t5x-like infer: {message}", file=sys.stderr, flush=True)


def _fail(message: str) -> int:
  """Says why and returns exit status 2."""
  _info(message)
  return 2


def sequence_limit(config, model) -> int:
  """The longest input the model takes: max_position_embeddings for a decoder with
  learned positions, else config.data.length (encoder inputs; trained length)."""
  if model.continues_prompt and model.config.position_embedding == "learned":
    return int(model.config.max_position_embeddings)
  return int(config.data.length)


def batch_shards(mesh, rules) -> int:
  """How many ways the mesh splits the batch dim (the batch must divide by it)."""
  spec = parallel.batch_spec(1, mesh.axis_names, rules)[0]
  axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
  return math.prod(mesh.shape[a] for a in axes)


# ------------------------------------------------------------------ running modes
def _run_generate(loaded, items, fv, *, mesh, rules, cap, batch_size):
  """Yields one output row per item: continuations (decoder) or outputs (enc-dec)."""
  model, vocab = loaded.model, loaded.vocab
  if model.continues_prompt:  # the cache holds the padded prompt + max_new_tokens - 1
    cap = cap - fv.max_new_tokens + 1
  sampling = fv.temperature > 0
  for index, (chunk, num_real) in enumerate(requests.chunks(items, batch_size)):
    rng = jax.random.fold_in(jax.random.key(fv.seed), index) if sampling else None
    decoded = infer.generate(
        model, loaded.params, requests.generate_features(chunk, model, cap),
        max_new_tokens=fv.max_new_tokens, rng=rng, mesh=mesh, rules=rules,
        num_beams=fv.num_beams, eos_id=vocab.eos_id, pad_id=vocab.pad_id,
        temperature=fv.temperature, top_k=fv.top_k or 0, top_p=fv.top_p,
        length_penalty=fv.length_penalty)
    tokens, scores = jax.device_get((decoded.tokens, decoded.scores))
    for item, row_tokens, score in list(zip(chunk, tokens, scores))[:num_real]:
      yield requests.generation_row(item.row, row_tokens, score, vocab)


def _run_score(loaded, items, fv, *, mesh, rules, cap, batch_size):
  """Yields one {"log_likelihood", "num_tokens"} row per item."""
  del fv
  model = loaded.model
  for chunk, num_real in requests.chunks(items, batch_size):
    scores = infer.score(model, loaded.params, requests.score_features(chunk, model, cap),
                         mesh=mesh, rules=rules)
    log_likelihood = jax.device_get(scores["log_likelihood"])
    for item, value in list(zip(chunk, log_likelihood))[:num_real]:
      yield requests.score_row(item.row, value, len(item.target_ids))


@functools.partial(jax.jit, static_argnames=("model", "top_k", "mesh", "rules"))
def _fill_mask_top_k(model, params, batch, *, top_k, mesh, rules):
  """(probs [B, P, K], ids [B, P, K]): the top_k of softmax(MLM logits) at mlm_positions."""
  with parallel.traced_rules(mesh, rules):
    logits_BxPxV = model.apply(params, batch)["mlm_logits"].astype("float32")
    return jax.lax.top_k(jax.nn.softmax(logits_BxPxV, axis=-1), top_k)


def _run_fill_mask(loaded, items, fv, *, mesh, rules, cap, batch_size):
  """Yields one {"predictions"} row per item (BERT)."""
  vocab = loaded.vocab
  top_k = min(5 if fv.top_k is None else fv.top_k, vocab.vocab_size)
  for chunk, num_real in requests.chunks(items, batch_size):
    features = requests.fill_mask_features(chunk, vocab.mask_id, cap)
    probs, ids = jax.device_get(_fill_mask_top_k(loaded.model, loaded.params, features,
                                                 top_k=top_k, mesh=mesh,
                                                 rules=hashable_rules(rules)))
    for b in range(num_real):
      yield requests.fill_mask_row(chunk[b], probs[b], ids[b], vocab)


# ------------------------------------------------------------------ main
def _check_settings(fv, model, cap: int) -> str | None:
  """What is wrong with the flags for this model's family (longest input: cap), or None."""
  if fv.batch_size < 1:
    return "--batch_size must be >= 1"
  if model.fills_masks and fv.mode == "score":
    return ("--mode score: the encoder family (BERT) does not score sequences; its"
            " generate mode fills [MASK]s")
  if model.fills_masks:
    too_few = fv.top_k is not None and fv.top_k < 1
    return "--top_k must be >= 1 for fill-mask" if too_few else None
  if fv.max_new_tokens < 1 or fv.num_beams < 1:
    return "--max_new_tokens and --num_beams must be >= 1"
  if model.continues_prompt and fv.mode == "generate" and fv.max_new_tokens > cap - 1:
    return (f"--max_new_tokens={fv.max_new_tokens} leaves no room for a prompt: the model"
            f" takes {cap} positions")
  if fv.num_beams > 1 and fv.temperature > 0:
    return "beam search does not sample: use --temperature 0 with --num_beams > 1"
  if fv.temperature < 0 or not 0 < fv.top_p <= 1 or (fv.top_k or 0) < 0:
    return "--temperature must be >= 0, --top_p in (0, 1], --top_k >= 0"
  return None


def _parse(argv: list[str]):
  """(flag values, None) or (None, exit status) after printing why."""
  fv = parse_flags("infer", argv, _flags, required=("config", "checkpoint", "input"),
                   doc=__doc__)
  if fv.output != "-" and not os.path.isdir(os.path.dirname(os.path.abspath(fv.output))):
    return None, _fail(f"--output {fv.output}: its directory does not exist")
  return fv, None


def _write(rows, path: str) -> int:
  """Writes JSON rows as they come (stdout for '-'); returns how many."""
  out = sys.stdout if path == "-" else open(path, "w", encoding="utf-8")
  count = 0
  try:
    for row in rows:
      out.write(json.dumps(row, ensure_ascii=False) + "\n")
      out.flush()
      count += 1
  finally:
    if out is not sys.stdout:
      out.close()
  return count


def main(argv: list[str]) -> int:
  fv, status = _parse(argv)
  if fv is None:
    return status
  config = fv.config
  try:
    vocab = config_vocab(config)
    model = build_model_from_config(config, vocab.vocab_size)
    cap = sequence_limit(config, model)
    problem = _check_settings(fv, model, cap)
    if problem:
      return _fail(problem)
    rows = requests.read_rows(fv.input, fv.field,
                              fv.target_field if fv.mode == "score" else None)
    items, truncated = requests.encode_rows(
        rows, vocab, model, fv.mode, limit=cap,
        max_new_tokens=fv.max_new_tokens, source="<stdin>" if fv.input == "-" else fv.input)
  except (requests.InputError, ValueError) as e:
    return _fail(str(e))
  if truncated:
    _info(f"warning: {len(truncated)} input(s) truncated to fit {cap} positions (lines"
          f" {', '.join(map(str, truncated[:10]))}{' ...' if len(truncated) > 10 else ''})")
  return _infer(fv, config, items, cap)


def _infer(fv, config, items, cap: int) -> int:
  """Loads the checkpoint and writes the rows of `items`."""
  mesh, rules = build_mesh(config)
  start = time.time()
  try:
    loaded = load_pretrained(config, fv.checkpoint, mesh=mesh, rules=rules, step=fv.step)
  except (FileNotFoundError, IncompatibleCheckpointError, ValueError) as e:
    return _fail(str(e))
  family = loaded.model.config.family
  shards = batch_shards(mesh, rules)
  batch_size = shards * math.ceil(fv.batch_size / shards)
  _info(f"{family} model, checkpoint step {loaded.step} ({time.time() - start:.1f} s);"
        f" {len(items)} row(s), batch {batch_size}")
  if loaded.model.fills_masks:
    run = _run_fill_mask
  else:
    run = _run_score if fv.mode == "score" else _run_generate
  written = _write(run(loaded, items, fv, mesh=mesh, rules=rules, cap=cap,
                       batch_size=batch_size), fv.output)
  _info(f"wrote {written} row(s) to {fv.output if fv.output != '-' else 'stdout'}"
        f" in {time.time() - start:.1f} s")
  return 0
