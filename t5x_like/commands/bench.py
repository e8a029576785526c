"""`t5x-like bench model | compile | peer | bert-vs-torch --config FILE[:ARG] [--config.KEY=VALUE]`.

  model          compile and time the train step (and decode step): bench/model.py
  compile        compile time of the train step at several depths (--layers 6,12,24)
  peer           our train step against transformers' PyTorch model of the config's family
                 (BERT, GPT-2), eager and torch.compile'd (--compile): bench/peers.py
  bert-vs-torch  our BERT step against transformers' BertForPreTraining in bfloat16 and
                 float32 (the CPU regression guard): bench/peers.py

Each prints one JSON object. absl / ml-collections flags, as `train`.
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags
from ml_collections import config_flags

from t5x_like.command_flags import parse_flags

COMMANDS = ("model", "compile", "peer", "bert-vs-torch")


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
  return fv


def main(argv: list[str]) -> int:
  if not argv or argv[0] not in COMMANDS:
    print(f"t5x-like bench: expected one of {', '.join(COMMANDS)} (or data); got"
          f" {argv[:1]}", file=sys.stderr)
    return 2
  what = argv[0]
  fv = parse_flags(f"bench {what}", argv[1:], _flags, doc=__doc__)
  if what in ("peer", "bert-vs-torch"):
    # PyTorch shares the GPU: JAX allocates as it needs instead of taking 75% up front
    # (read when JAX's GPU client starts, which is later).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  from t5x_like.bench import model as model_bench
  try:
    if what == "model":
      result = model_bench.bench_model(fv.config, steps=fv.steps, warmup=fv.warmup,
                                        decode=fv.decode)
    elif what == "compile":
      result = model_bench.bench_compile(fv.config, [int(n) for n in fv.layers])
    elif what == "peer":
      from t5x_like.bench.peers import bench_peer
      result = bench_peer(fv.config, steps=fv.steps, rounds=fv.rounds, warmup=fv.warmup,
                          compile=fv.compile)
    else:
      from t5x_like.bench.peers import bench_bert_vs_torch
      result = bench_bert_vs_torch(fv.config, steps=fv.steps, rounds=fv.rounds,
                                   warmup=fv.warmup)
  except ValueError as e:
    print(f"t5x-like bench {what}: {e}", file=sys.stderr)
    return 2
  print(json.dumps(result, indent=1))
  return 0
