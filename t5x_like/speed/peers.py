"""`t5x-like bench peer` and `bench bert-vs-torch`: our train step against transformers'
PyTorch model of the same shape (speed/torch_peer.py), in one process, on the same batches.

  result = bench_peer(config, steps=10, rounds=3, warmup=2, compile="both")
  result = bench_bert_vs_torch(config, steps=3, rounds=3, warmup=2)

peer: the config's model (BERT -> BertForPreTraining, GPT-2 -> GPT2LMHeadModel) in the
config's dtype; ours on JAX's default backend, PyTorch eager and / or torch.compile'd on
CUDA when PyTorch sees a GPU, else on the CPU. bert-vs-torch, the CPU regression guard:
BERT in bfloat16 and in float32, ours against eager PyTorch.

Every runner starts from our initial weights and follows our learning-rate schedule, so
the first losses agree up to rounding (`first_loss`) and the last ones stay close.
Each runner first runs one step (`first_step_seconds`; torch.compile compiles there,
`compile_seconds`) and `warmup` untimed steps; then the steps are timed in interleaved
rounds (each round runs `steps` steps of every runner in turn, so that the machine's
load drifts over all of them alike) and each figure is the median of a runner's timed
steps. FLOPs: our model's formula for both (train/flops.py; transformers' BERT computes
its MLM head at every position, only the predicted ones are counted: useful FLOPs). MFU
is against `bench model`'s peak (peak_flops: the table on accelerators, measured on the
CPU after the rounds) of the devices the runner uses. On one GPU both frameworks share its
memory: the CLI stops JAX from taking most of it up front
(XLA_PYTHON_CLIENT_PREALLOCATE=false; from Python, set it before JAX starts).
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

import jax
import ml_collections
import numpy as np

from t5x_like.speed.environment import environment
from t5x_like.speed.model import TrainBench, disable_compilation_cache, host_batches, peak_flops
from t5x_like.speed.torch_peer import TorchStep, device_name, peer_for, torch_adamw
from t5x_like.experiment import build_model_from_config, config_vocab
from t5x_like.train.optimizers import make_optimizer

DTYPES = ("bfloat16", "float32")
# --compile -> the PyTorch runners
COMPILE_MODES = {"both": ("eager", "compiled"), "eager": ("eager",), "compiled": ("compiled",)}
H100_PEAK = 989e12  # dense bf16 FLOP/s of an H100 SXM (train/flops.py's table)


class OursStep:
  """Our compiled train step (TrainBench) with TorchStep's runner interface."""

  def __init__(self, bench: TrainBench):
    self.bench = bench

  def __call__(self) -> None:
    self.bench.step()

  @property
  def loss(self) -> float:
    return float(self.bench.last_metrics["loss"])

  def reset_peak_memory(self) -> None:
    """JAX's allocator peak cannot be reset: peak_memory_bytes is the process's."""

  def peak_memory_bytes(self) -> Optional[int]:
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats["peak_bytes_in_use"]) if "peak_bytes_in_use" in stats else None


def _check_counts(steps: int, rounds: int, warmup: int) -> None:
  if steps < 1 or rounds < 1 or warmup < 0:
    raise ValueError(f"steps={steps}, rounds={rounds} must be >= 1, warmup={warmup} >= 0")


def _torch_peer(ours: TrainBench, config: ml_collections.ConfigDict, batches, *, dtype: str,
                steps: int, compiled: bool = False) -> TorchStep:
  """The PyTorch peer of `ours` (before its first step: its initial weights), with our
  optimizer's AdamW settings and the lr of our schedule for each of `steps` updates."""
  _, schedule = make_optimizer(config.optimizer, config.train.num_steps)
  return TorchStep(ours.model, dtype=dtype, batches=batches, params=ours.state.params,
                   optimizer=torch_adamw(config.optimizer),
                   learning_rates=np.asarray(schedule(np.arange(steps))), compiled=compiled)


def time_runners(runners: dict, *, steps: int, rounds: int, warmup: int) -> dict[str, dict]:
  """{name: {first_step_seconds, first_loss, peak_memory_bytes, step_seconds [rounds *
  steps], last_loss}}: each runner's first step and warmup in turn, then interleaved rounds."""
  out = {}
  for name, run in runners.items():
    run.reset_peak_memory()
    start = time.perf_counter()
    run()
    out[name] = {"first_step_seconds": time.perf_counter() - start, "first_loss": run.loss}
    for _ in range(warmup):
      run()
    out[name]["peak_memory_bytes"] = run.peak_memory_bytes()
    out[name]["step_seconds"] = []
  for _ in range(rounds):
    for name, run in runners.items():
      for _ in range(steps):
        start = time.perf_counter()
        run()
        out[name]["step_seconds"].append(time.perf_counter() - start)
  for name, run in runners.items():
    out[name]["last_loss"] = run.loss
  return out


def _figures(timed: dict, tokens: int, flops: Optional[float] = None,
             peak: Optional[float] = None, cuda: bool = False) -> dict:
  """One runner's JSON: medians, tokens/s and, with flops, TFLOP/s and MFU (vs `peak`,
  the FLOP/s of every device it uses; on CUDA also vs an H100's 989 TFLOP/s)."""
  median = statistics.median(timed["step_seconds"])
  out = {"step_seconds_median": round(median, 5), "tokens_per_second": round(tokens / median, 1)}
  if flops is not None:
    out["model_tflops_per_second"] = round(flops / median / 1e12, 4)
    out["mfu"] = round(flops / median / peak, 4) if peak else None
    if cuda:
      out["mfu_vs_989"] = round(flops / median / H100_PEAK, 4)
  out.update(first_step_seconds=round(timed["first_step_seconds"], 3),
             first_loss=round(timed["first_loss"], 5), last_loss=round(timed["last_loss"], 5),
             peak_memory_bytes=timed["peak_memory_bytes"],
             step_seconds=[round(t, 4) for t in timed["step_seconds"]])
  return out


def bench_peer(config: ml_collections.ConfigDict, *, steps: int = 10, rounds: int = 3,
               warmup: int = 2, compile: str = "both",
               peaks: Optional[dict[str, float]] = None, peak_repeats: int = 20,
               compilation_cache: bool = False) -> dict:
  """{ours, torch_eager, torch_compiled: {step_seconds_median, tokens_per_second,
  model_tflops_per_second, mfu, ...}, ratios, ...} for config's model (see the module
  docstring). peaks: {'bfloat16', 'float32'} FLOP/s per JAX device (default peak_flops,
  of `peak_repeats` matmuls on a CPU); compilation_cache: as bench_model's."""
  if compile not in COMPILE_MODES:
    raise ValueError(f"compile={compile!r}: expected one of {sorted(COMPILE_MODES)}")
  _check_counts(steps, rounds, warmup)
  if not compilation_cache:
    disable_compilation_cache()
  vocab = config_vocab(config)
  peer = peer_for(build_model_from_config(config, vocab.vocab_size))
  batches = host_batches(config, vocab)
  peer.inputs(batches[0])  # a batch the peer cannot take fails here, before compiling
  ours = TrainBench(config, batches=batches)
  cfg = ours.model.config
  runners = {"ours": OursStep(ours)}
  for mode in COMPILE_MODES[compile]:
    runners[f"torch_{mode}"] = _torch_peer(ours, config, batches, dtype=cfg.dtype,
                                           steps=1 + warmup + rounds * steps,
                                           compiled=mode == "compiled")
  timed = time_runners(runners, steps=steps, rounds=rounds, warmup=warmup)
  device = jax.devices()[0]
  peaks = peaks or peak_flops(device, repeats=peak_repeats)
  some_torch = runners[f"torch_{COMPILE_MODES[compile][0]}"]
  cuda = some_torch.device == "cuda"
  # Torch's devices: the whole CPU (all of JAX's CPU devices' shares) or one GPU.
  same_kind = (device.platform == "cpu") == (not cuda)
  torch_peak = (peaks[cfg.dtype] * (jax.device_count() if not cuda else 1)
                if same_kind else None)
  flops, tokens = ours.flops_per_step, ours.tokens_per_step
  import torch
  import transformers
  result = {
      "model": config.model.preset, "family": cfg.family, "peer": peer.architecture,
      "dtype": cfg.dtype, "layers": cfg.num_layers, "d_model": cfg.d_model,
      "vocab_size": cfg.vocab_size,
      "params": {"ours": ours.model.num_params(), "torch": some_torch.num_params},
      "batch_shapes": {k: list(v) for k, v in ours.batch_shapes.items()},
      "tokens_per_step": tokens, "model_flops_per_step": flops,
      "jax_device": device.device_kind, "jax_platform": device.platform,
      "jax_device_count": jax.device_count(), "torch_device": device_name(some_torch.device),
      "attn_implementation": some_torch.attn_implementation,
      "attention_kernels": ours.attention_kernels,
      "versions": {"jax": jax.__version__, "torch": torch.__version__,
                   "transformers": transformers.__version__},
      "torch_optimizer": torch_adamw(config.optimizer),
      "peak_flops_per_device": {k: round(v / 1e12, 4) for k, v in peaks.items()},
      "peak_flops_unit": "TFLOP/s", "timed_steps_each": steps * rounds,
      "ours": {"compile_seconds": round(ours.compile_seconds, 2),
               **_figures(timed["ours"], tokens, flops,
                          peaks[cfg.dtype] * jax.device_count(), cuda)},
  }
  for mode in COMPILE_MODES[compile]:
    name = f"torch_{mode}"
    result[name] = _figures(timed[name], tokens, flops, torch_peak, cuda)
    if mode == "compiled":
      result[name]["compile_seconds"] = result[name]["first_step_seconds"]
  result["ratios"] = {
      f"ours_over_torch_{mode}": round(result["ours"]["tokens_per_second"]
                                       / result[f"torch_{mode}"]["tokens_per_second"], 3)
      for mode in COMPILE_MODES[compile]}
  result["environment"] = environment()
  return result


def _with_dtype(config: ml_collections.ConfigDict, dtype: str) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(config.to_dict())
  c.model.dtype = dtype
  return c


def bench_bert_vs_torch(config: ml_collections.ConfigDict, *, steps: int = 3, rounds: int = 3,
                        warmup: int = 2) -> dict:
  """{ours_<dtype>, torch_<dtype>: {step_seconds_median, tokens_per_second, ...},
  ratios} for config's BERT (family encoder) at its train.batch_size and data.length,
  in bfloat16 and float32, PyTorch eager."""
  _check_counts(steps, rounds, warmup)
  disable_compilation_cache()
  vocab = config_vocab(config)
  model = build_model_from_config(config, vocab.vocab_size)
  if model.hf_model_type != "bert":  # the torch peer is transformers' BertForPreTraining
    raise ValueError(f"bench bert-vs-torch needs a BERT config; {config.model.preset} is"
                     f" family {model.config.family!r}")
  batches = host_batches(config, vocab)
  runners, compile_seconds = {}, {}
  for dtype in DTYPES:
    ours = TrainBench(_with_dtype(config, dtype), batches=batches)
    runners[f"ours_{dtype}"] = OursStep(ours)
    compile_seconds[f"ours_{dtype}"] = round(ours.compile_seconds, 2)
  for dtype in DTYPES:
    runners[f"torch_{dtype}"] = _torch_peer(ours, config, batches, dtype=dtype,
                                            steps=1 + warmup + rounds * steps)
  timed = time_runners(runners, steps=steps, rounds=rounds, warmup=warmup)
  cfg, tokens = ours.model.config, ours.tokens_per_step
  result = {"layers": cfg.num_layers, "d_model": cfg.d_model, "vocab_size": cfg.vocab_size,
            "batch_shapes": {k: list(v) for k, v in ours.batch_shapes.items()},
            "tokens_per_step": tokens, "device": jax.devices()[0].device_kind,
            "torch_device": device_name(runners["torch_float32"].device),
            "timed_steps_each": steps * rounds}
  for name in runners:
    result[name] = {**({"compile_seconds": compile_seconds[name]} if name in compile_seconds
                       else {}), **_figures(timed[name], tokens)}
  result["ratios"] = {
      f"ours_{d}_over_torch_{d}": round(result[f"ours_{d}"]["tokens_per_second"]
                                        / result[f"torch_{d}"]["tokens_per_second"], 3)
      for d in DTYPES}
  result["environment"] = environment()
  return result
