"""`t5x-like bench data | attention | model | compile | peer | bert-vs-torch | gpu [flags]`.

  data           tokens/s per core of an objective (plus packing) and of tokenization;
                 with --prepared, prepared corpora at --sizes: speed/data.py, speed/prepared.py
  attention      every attention kernel of this device against a float32 reference (values
                 and gradients, five masks, a bias; dropout statistics) and its time
  model          compile and time the train step (and decode step): speed/model.py;
                 with --profile DIR, a jax.profiler trace of a few more steps and their
                 device time per category (printed to stderr): speed/profile.py
  compile        compile time of the train step at several depths (--layers 6,12,24)
  peer           our train step against transformers' PyTorch model of the config's family
                 (BERT, GPT-2), eager and torch.compile'd (--compile): speed/peers.py
  bert-vs-torch  our BERT step against transformers' BertForPreTraining in bfloat16 and
                 float32 (the CPU regression guard): speed/peers.py
  gpu            every GPU figure of docs/speed.md in one budgeted call, most
                 important first, into --out (results.json, summary.md, log.txt,
                 traces.tar.gz); --rehearse runs the same steps on the CPU at smoke
                 shapes: speed/gpu_suite.py, speed/gpu_steps.py

Each prints one JSON object. model, compile, peer and bert-vs-torch take
--config FILE[:ARG] [--config.KEY=VALUE ...] (absl / ml-collections flags, as `train`).
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags
from ml_collections import config_flags

from t5x_like.command_flags import (FlagError, choose_subcommand, parse_flags,
                                    parse_flags_and_args)
from t5x_like.errors import UserError

COMMANDS = {
    "data": "tokens/s per core of an objective (plus packing) and of tokenization, as JSON;"
            " with --prepared, prepared corpora at --sizes (prepare, start-up, memory,"
            " tokens/s)",
    "attention": "every attention kernel of this device against a float32 reference (values"
                 " and gradients, five masks, a bias; dropout statistics) and its time, as"
                 " JSON",
    "model": "compile and time the train step (and a decode step) of a config",
    "compile": "compile time of the train step at several depths (--layers 6,12,24)",
    "peer": "our train step against transformers' PyTorch model (BERT, GPT-2), eager and"
            " compiled",
    "bert-vs-torch": "our BERT step against transformers' BertForPreTraining",
    "gpu": "every GPU figure in one budgeted call: the peers' ratios, the recipes' MFU and"
           " profiles, the fused kernel's checks, the variants (--out DIR [--rehearse])",
}


def _flags(argv: list[str]) -> flags.FlagValues:
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "experiment config file[:arg]",
                                  flag_values=fv, lock_config=True, sys_argv=argv)
  flags.DEFINE_integer("steps", 10, "timed steps (model) / per round (peer, bert-vs-torch)",
                       flag_values=fv)
  flags.DEFINE_integer("warmup", 2, "untimed steps first", flag_values=fv)
  flags.DEFINE_integer("rounds", 3, "peer, bert-vs-torch: interleaved rounds", flag_values=fv)
  flags.DEFINE_enum("compile", "both", ["both", "eager", "compiled"],
                    "peer: PyTorch eager, torch.compile'd, or both", flag_values=fv)
  flags.DEFINE_bool("decode", True, "model: also time one cached decoding step",
                    flag_values=fv)
  flags.DEFINE_list("layers", ["6", "12", "24"], "compile: depths to compile",
                    flag_values=fv)
  flags.DEFINE_string("profile", None, "model: after the timed steps, profile"
                      " --profile_steps more into this folder (jax.profiler: TensorBoard,"
                      " Perfetto) and print device time per category (speed/profile.py)",
                      flag_values=fv)
  flags.DEFINE_integer("profile_steps", 3, "model: steps to profile with --profile",
                       flag_values=fv)
  flags.DEFINE_integer("peak_repeats", 20, "model, peer on a CPU: matmuls timed for the"
                       " measured peak FLOP/s (the fastest counts)", flag_values=fv)
  flags.DEFINE_bool("compilation_cache", False, "model, peer: keep JAX's persistent"
                    " compilation cache (JAX_COMPILATION_CACHE_DIR) on; compile_seconds may"
                    " then be a cache hit", flag_values=fv)
  return fv


def _profile_dir(path: str) -> str:
  """--profile DIR, created if missing; a UserError when it cannot be written."""
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise UserError(f"--profile={path}: cannot create the folder ({e.strerror})") from None
  if not os.access(path, os.W_OK | os.X_OK):
    raise UserError(f"--profile={path}: the folder is not writable")
  return path


def main(argv: list[str]) -> int:
  what, argv = choose_subcommand("bench", argv, COMMANDS, doc=__doc__)
  if what == "data":
    return _bench_data(argv)
  if what == "attention":
    return _bench_attention(argv)
  if what == "gpu":
    return _bench_gpu(argv)
  fv = parse_flags(f"bench {what}", argv, _flags, doc=COMMANDS[what])
  if what in ("peer", "bert-vs-torch"):
    # PyTorch shares the GPU: JAX allocates as it needs instead of taking 75% up front
    # (read when JAX's GPU client starts, which is later).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  from t5x_like.speed import model as model_bench
  try:
    if what == "model":
      profile_dir = _profile_dir(fv.profile) if fv.profile else None
      result = model_bench.bench_model(fv.config, steps=fv.steps, warmup=fv.warmup,
                                        decode=fv.decode, profile_dir=profile_dir,
                                        profile_steps=fv.profile_steps,
                                        peak_repeats=fv.peak_repeats,
                                        compilation_cache=fv.compilation_cache)
    elif what == "compile":
      result = model_bench.bench_compile(fv.config, [int(n) for n in fv.layers])
    elif what == "peer":
      from t5x_like.speed.peers import bench_peer
      result = bench_peer(fv.config, steps=fv.steps, rounds=fv.rounds, warmup=fv.warmup,
                          compile=fv.compile, peak_repeats=fv.peak_repeats,
                          compilation_cache=fv.compilation_cache)
    else:
      from t5x_like.speed.peers import bench_bert_vs_torch
      result = bench_bert_vs_torch(fv.config, steps=fv.steps, rounds=fv.rounds,
                                   warmup=fv.warmup)
  except ValueError as e:
    print(f"t5x-like bench {what}: {e}", file=sys.stderr)
    return 2
  if "profile" in result:  # the table to stderr: stdout stays one JSON object
    from t5x_like.speed.profile import format_table
    print(format_table(result["profile"]), file=sys.stderr)
  print(json.dumps(result, indent=1))
  return 0


# ------------------------------------------------------------------ data, attention
def _data_flags(argv: list[str]) -> flags.FlagValues:
  del argv
  from t5x_like.data.pipeline import OBJECTIVES
  fv = flags.FlagValues()
  flags.DEFINE_enum("objective", None, sorted(OBJECTIVES), "the objective to bench",
                    flag_values=fv)
  flags.DEFINE_integer("length", None, "sequence length (default: the objective's usual"
                       " one)", flag_values=fv)
  flags.DEFINE_integer("batch", 64, "batch size", flag_values=fv)
  flags.DEFINE_integer("steps", 30, "batches per timed run", flag_values=fv)
  flags.DEFINE_integer("repeats", 5, "timed runs (median reported)", flag_values=fv)
  flags.DEFINE_string("mixture", "", "bench over a data.mixture ('SPEC=RATE,...', as"
                      " --config.data.mixture) instead of the embedded corpus", flag_values=fv)
  flags.DEFINE_bool("prepared", False, "bench prepared corpora (speed/prepared.py) instead",
                    flag_values=fv)
  flags.DEFINE_list("sizes", ["50", "2000"], "--prepared: synthetic corpus sizes in MB",
                    flag_values=fv)
  flags.DEFINE_list("workers", ["1", "2"], "--prepared: Beam worker counts to prepare with",
                    flag_values=fv)
  flags.DEFINE_string("scratch", None, "--prepared: folder for the scratch corpora"
                      " (default: the temp dir)", flag_values=fv)
  return fv


def _numbers(fv: flags.FlagValues, name: str, kind) -> list:
  try:
    return [kind(x) for x in fv[name].value]
  except ValueError:
    raise FlagError(f"--{name}={','.join(fv[name].value)}: expected {kind.__name__}s,"
                    " comma-separated") from None


def _bench_data(argv: list[str]) -> int:
  fv, _ = parse_flags_and_args("bench data", argv, _data_flags, required=("objective",),
                               doc=COMMANDS["data"], positionals="")
  if fv.prepared:
    from t5x_like.speed.prepared import bench_prepared
    print(json.dumps(bench_prepared(sizes_mb=_numbers(fv, "sizes", float),
                                    objective=fv.objective,
                                    workers=_numbers(fv, "workers", int),
                                    scratch=fv.scratch), indent=1))
    return 0
  from t5x_like.speed.data import bench_objective
  print(json.dumps(bench_objective(fv.objective, length=fv.length, batch_size=fv.batch,
                                   steps=fv.steps, repeats=fv.repeats,
                                   mixture=fv.mixture), indent=1))
  return 0


def _attention_flags(argv: list[str]) -> flags.FlagValues:
  del argv
  fv = flags.FlagValues()
  flags.DEFINE_integer("batch", 4, "batch size", flag_values=fv)
  flags.DEFINE_integer("length", 512, "sequence length", flag_values=fv)
  flags.DEFINE_integer("heads", 16, "query heads", flag_values=fv)
  flags.DEFINE_integer("kv_heads", 0, "key/value heads (default 0: --heads, MHA)",
                       flag_values=fv)
  flags.DEFINE_integer("head_dim", 64, "dimension per head", flag_values=fv)
  flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"],
                    "the kernels' dtype", flag_values=fv)
  flags.DEFINE_integer("steps", 10, "timed calls (median)", flag_values=fv)
  flags.DEFINE_bool("interpret_pallas", False, "also run the Pallas TPU kernel in"
                    " interpret mode (slow)", flag_values=fv)
  return fv


def _bench_attention(argv: list[str]) -> int:
  fv, _ = parse_flags_and_args("bench attention", argv, _attention_flags,
                               doc=COMMANDS["attention"], positionals="")
  from t5x_like.speed.attention import bench_attention
  try:
    result = bench_attention(batch=fv.batch, length=fv.length, heads=fv.heads,
                             kv_heads=fv.kv_heads, head_dim=fv.head_dim, dtype=fv.dtype,
                             steps=fv.steps, interpret_pallas=fv.interpret_pallas)
  except ValueError as e:
    raise UserError(str(e)) from None
  print(json.dumps(result, indent=1))
  return 0


# ------------------------------------------------------------------ gpu
def _gpu_flags(argv: list[str]) -> flags.FlagValues:
  del argv
  fv = flags.FlagValues()
  flags.DEFINE_string("out", None, "an empty (or new) folder for results.json, summary.md,"
                      " log.txt and traces.tar.gz", flag_values=fv)
  flags.DEFINE_bool("rehearse", False, "run every step on this machine's default backend"
                    " at smoke shapes (the CPU rehearsal of a GPU call)", flag_values=fv)
  flags.DEFINE_float("budget", 540.0, "seconds for the whole run; the steps left after it"
                     " are skipped (and recorded as skipped)", flag_values=fv)
  flags.DEFINE_list("only", [], "run only these steps (--list names them)", flag_values=fv)
  flags.DEFINE_string("configs", "configs", "the folder of the repository's configs",
                      flag_values=fv)
  flags.DEFINE_string("commit", "", "the commit to record (default: git's, where the"
                      " tree is a checkout)", flag_values=fv)
  flags.DEFINE_integer("jobs", 0, "steps run side by side (0: 1 on a GPU, 2 with"
                       " --rehearse)", flag_values=fv)
  flags.DEFINE_bool("list", False, "print the steps in order and exit", flag_values=fv)
  return fv


def _bench_gpu(argv: list[str]) -> int:
  fv, _ = parse_flags_and_args("bench gpu", argv, _gpu_flags, doc=COMMANDS["gpu"],
                               positionals="")
  from t5x_like.speed import gpu_steps, gpu_suite
  if fv.list:
    for step in gpu_steps.suite_steps(rehearse=fv.rehearse, configs=fv.configs):
      env = " ".join(f"{k}={v}" for k, v in step.env)
      print(f"{step.name:22s} {step.kind:8s} {step.timeout:4d} s  {step.title}")
      if step.args:
        print(f"{'':22s} {env + ' ' if env else ''}{' '.join(step.args)}")
    return 0
  if not fv.out:
    raise FlagError("--out is required (an empty folder for the results)")
  results = gpu_suite.run_suite(fv.out, rehearse=fv.rehearse, budget=fv.budget,
                                only=fv.only, configs=fv.configs, commit=fv.commit,
                                jobs=fv.jobs or None)
  with open(os.path.join(fv.out, "summary.md")) as f:
    print(f.read(), end="")
  bad = [s["name"] for s in results["steps"] if s["status"] in ("failed", "timeout")]
  if bad:
    print(f"t5x-like bench gpu: {len(bad)} step(s) did not pass: {', '.join(bad)}"
          f" (log: {os.path.join(fv.out, 'log.txt')})", file=sys.stderr)
  return 1 if bad else 0
