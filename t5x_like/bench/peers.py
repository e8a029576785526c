"""`t5x-like bench bert-vs-torch`: our BERT train step against transformers' in PyTorch.

Both frameworks train the same shape on the same batches (our BERT objective on the
embedded corpus): ours in bfloat16 and float32 (the config's model, optimizer and
remat), PyTorch's BertForPreTraining with bf16 autocast and in float32
(bench/torch_bert.py). The four steps are timed in interleaved rounds in one process,
so that the machine's load drifts over all of them alike; each figure is the median
of every timed step of its kind.
"""

from __future__ import annotations

import statistics
import time

import jax
import ml_collections

from t5x_like.bench.model import TrainBench, disable_compilation_cache, host_batches
from t5x_like.bench.torch_bert import TorchBertStep
from t5x_like.experiment import build_model_from_config, config_vocab

DTYPES = ("bfloat16", "float32")


def _with_dtype(config: ml_collections.ConfigDict, dtype: str) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(config.to_dict())
  c.model.dtype = dtype
  return c


def bench_bert_vs_torch(config: ml_collections.ConfigDict, *, steps: int = 3, rounds: int = 3,
                        warmup: int = 2) -> dict:
  """{ours_<dtype>, torch_<dtype>: {step_seconds_median, tokens_per_second, ...},
  ratios} for config's BERT (family encoder) at its train.batch_size and data.length."""
  if steps < 1 or rounds < 1 or warmup < 0:
    raise ValueError(f"steps={steps}, rounds={rounds} must be >= 1, warmup={warmup} >= 0")
  disable_compilation_cache()
  vocab = config_vocab(config)
  model = build_model_from_config(config, vocab.vocab_size)
  if model.hf_model_type != "bert":  # the torch peer is transformers' BertForPreTraining
    raise ValueError(f"bench bert-vs-torch needs a BERT config; {config.model.preset} is"
                     f" family {model.config.family!r}")
  batches = host_batches(config, vocab)
  runners, info, last_loss = {}, {}, {}
  for dtype in DTYPES:
    bench = TrainBench(_with_dtype(config, dtype), batches=batches)
    runners[f"ours_{dtype}"] = bench.step
    info[f"ours_{dtype}"] = {"compile_seconds": round(bench.compile_seconds, 2)}
    last_loss[f"ours_{dtype}"] = lambda bench=bench: float(bench.last_metrics["loss"])
    model_config, tokens = bench.model.config, bench.tokens_per_step
  for dtype in DTYPES:
    peer = TorchBertStep(model_config, dtype=dtype, batches=batches)
    runners[f"torch_{dtype}"] = peer
    last_loss[f"torch_{dtype}"] = lambda peer=peer: peer.loss
  for run in runners.values():
    for _ in range(warmup):
      run()
  times = {name: [] for name in runners}
  for _ in range(rounds):
    for name, run in runners.items():
      for _ in range(steps):
        start = time.perf_counter()
        run()
        times[name].append(time.perf_counter() - start)
  result = {"layers": model_config.num_layers, "d_model": model_config.d_model,
            "vocab_size": model_config.vocab_size,
            "batch_shapes": {k: list(v.shape) for k, v in batches[0].items()},
            "tokens_per_step": tokens, "device": jax.devices()[0].device_kind,
            "timed_steps_each": steps * rounds}
  for name, seconds in times.items():
    median = statistics.median(seconds)
    result[name] = {**info.get(name, {}), "step_seconds_median": round(median, 4),
                    "tokens_per_second": round(tokens / median, 1),
                    "last_loss": round(last_loss[name](), 4),
                    "step_seconds": [round(t, 3) for t in seconds]}
  result["ratios"] = {
      f"ours_{d}_over_torch_{d}": round(result[f"ours_{d}"]["tokens_per_second"]
                                        / result[f"torch_{d}"]["tokens_per_second"], 3)
      for d in DTYPES}
  return result
