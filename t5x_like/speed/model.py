"""`t5x-like bench model`: compile and time a config's train step (and decode step).

  result = bench_model(config, steps=10, warmup=2)

The train step is the trainer's own (make_train_step on create_train_state, the config's
mesh, optimizer and microbatches), fed real batches of the config's objective drawn
from the embedded corpus (the text does not change the step time; no download). The
batches are on the device before timing starts. Each timed step ends with
block_until_ready on the new state, and the median of `steps` after `warmup` is
reported, with tokens/s, model FLOP/s per device (train/flops.py conventions) and MFU.
On CPU the peaks are the bfloat16 and float32 matmul ceilings measured in the same run;
on accelerators the table's dense bf16 peak (train/flops.py).

The persistent compilation cache is switched off, so compile_seconds is a real compile.
"""

from __future__ import annotations

import os
import re
import resource
import statistics
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from t5x_like.data.loader import make_loader
from t5x_like.data.sources import EmbeddedCorpus
from t5x_like.data.tokenize import build_store
from t5x_like.speed import profile as profile_lib
from t5x_like.speed.environment import environment
from t5x_like.models.attention_core import record_kernels
from t5x_like.parallel import shard_batch
from t5x_like.plan import roofline as roofline_lib
from t5x_like.plan.compiled import compile_train_step, xla_memory
from t5x_like.train import flops as flops_lib
from t5x_like.train.config_check import validate
from t5x_like.experiment import (build_mesh, build_model_from_config, build_objective,
                                 config_vocab)
from t5x_like.train.optimizers import make_optimizer
from t5x_like.train.state import create_train_state
from t5x_like.train.step import make_train_step

# Distinct batches cycled through the timed steps.
_NUM_BATCHES = 4


def disable_compilation_cache() -> None:
  """Compile for real: a persistent-cache hit would make compile times meaningless."""
  jax.config.update("jax_enable_compilation_cache", False)


def median_seconds(run_once: Callable[[], Any], *, steps: int, warmup: int) -> tuple[float, list]:
  """(median, all) wall seconds of `steps` calls of run_once after `warmup` untimed ones;
  run_once must block until its work is done."""
  for _ in range(warmup):
    run_once()
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    run_once()
    times.append(time.perf_counter() - start)
  return statistics.median(times), times


def host_batches(config: ml_collections.ConfigDict, vocab, count: int = _NUM_BATCHES
                 ) -> list[dict[str, np.ndarray]]:
  """`count` global batches of config's objective over the embedded corpus (numpy)."""
  store, _ = build_store(EmbeddedCorpus(), vocab)
  objective = build_objective(config, store, vocab, seed=config.seed)
  batches = iter(make_loader(objective, config.train.batch_size, seed=config.seed,
                             num_workers=0))
  return [next(batches) for _ in range(count)]


def peak_flops(device: jax.Device, previous: Optional[dict[str, float]] = None,
               repeats: int = 20) -> dict[str, float]:
  """{'bfloat16': , 'float32': } peak FLOP/s of one device. CPU: measured now (the
  fastest of `repeats` matmuls; other load only slows a matmul down, so with
  `previous`, an earlier measurement, the higher of the two is the ceiling), shared by
  the local CPU devices; accelerators: the table (train/flops.py)."""
  if device.platform != "cpu":
    return {dtype: flops_lib.peak_flops_per_device(device, dtype)
            for dtype in ("bfloat16", "float32")}
  shares = len(jax.local_devices(backend="cpu"))
  out = {dtype: flops_lib.matmul_flops("cpu", dtype, repeats=repeats) / shares
         for dtype in ("bfloat16", "float32")}
  return {k: max(v, (previous or {}).get(k, 0.0)) for k, v in out.items()}


def memory_bandwidth(device: jax.Device, mib: int = 128, repeats: int = 5) -> float:
  """Bytes/s of a jitted elementwise pass over a `mib` MiB float32 array on `device`
  (read + write), the fastest of `repeats`: a CPU's measured stand-in for HBM bandwidth
  in the roofline, shared like the peak by the local CPU devices."""
  x = jax.device_put(jnp.zeros((mib * 2**18,), jnp.float32), device)
  add = jax.jit(lambda a: a + 1.0)
  jax.block_until_ready(add(x))
  _, times = median_seconds(lambda: jax.block_until_ready(add(x)), steps=repeats, warmup=0)
  return 2 * x.nbytes / min(times) / len(jax.local_devices(backend=device.platform))


def step_roofline(bench: "TrainBench", device: jax.Device, peaks: dict[str, float]
                  ) -> Optional[dict[str, Any]]:
  """The roofline bound of bench's compiled step on `device` (plan/roofline.py): a GPU's
  table figures; on a CPU the measured peak and memory_bandwidth (collectives at the
  same bandwidth). None for an accelerator that the table does not know."""
  dtype = bench.model.config.dtype
  chip = roofline_lib.chip_of_device(device, dtype)
  if chip is None and device.platform == "cpu":
    bandwidth = memory_bandwidth(device)
    chip = roofline_lib.Chip(f"{device.device_kind} (measured)", peaks[dtype], bandwidth,
                             bandwidth)
  if chip is None:
    return None
  n = jax.device_count()
  bound = roofline_lib.roofline(bench.compiled, chip, num_devices=n)
  bound = roofline_lib.with_hidden_attention_flops(bound, bench.model, bench.batch_shapes,
                                                   bench.flops_per_step, n)
  keep = ("chip", "seconds", "overlap_seconds", "compute_seconds", "memory_seconds",
          "collective_seconds", "mfu_ceiling", "uncounted_kernels", "extra_flops_source",
          "slowest")
  return {k: bound.get(k) for k in keep}


def peak_memory_bytes(device: jax.Device) -> Optional[int]:
  """The device allocator's peak (accelerators), or the process's max RSS (CPU)."""
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"])
  if device.platform == "cpu":
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB
  return None


def _rate_fields(seconds: float, tokens: int, flops: float, devices: int,
                 peaks: dict[str, float], dtype: str) -> dict[str, Any]:
  out = {
      "step_seconds_median": round(seconds, 5),
      "tokens_per_second": round(tokens / seconds, 1),
      "model_tflops_per_second_per_device": round(flops / seconds / devices / 1e12, 4),
      "mfu": round(flops_lib.mfu(flops, seconds, devices, peaks[dtype]), 4),
  }
  for name, peak in peaks.items():
    out[f"mfu_vs_{name}_peak"] = round(flops_lib.mfu(flops, seconds, devices, peak), 4)
  return out


def tokens_per_step(batch_shapes: dict[str, tuple]) -> int:
  """Positions a step processes: encoder inputs plus decoder inputs (B * L each)."""
  return sum(int(np.prod(batch_shapes[name][:2]))
             for name in ("encoder_input_tokens", "decoder_input_tokens")
             if name in batch_shapes)


def _layer_groups(kernels: dict) -> dict:
  """record_kernels' {module path: choice} with layer indices folded into 'layers_*':
  {path: {kernel, reason, modules}} (a scanned stack is one module)."""
  groups: dict = {}
  for path, entry in sorted(kernels.items()):
    key = re.sub(r"layers_\d+", "layers_*", path)
    group = groups.setdefault(key, {"kernel": entry["kernel"], "reason": entry["reason"],
                                    "modules": 0})
    if (group["kernel"], group["reason"]) != (entry["kernel"], entry["reason"]):
      group["kernel"], group["reason"] = "mixed", "layers differ"
    group["modules"] += 1
  return groups


class TrainBench:
  """The compiled train step of a config with its state and device batches.

  compile_seconds: trace + lower + compile. step() runs one step and blocks.
  attention_kernels: {attention: {kernel, reason, modules}} of the traced step.
  losses: the loss of every step run.
  """

  def __init__(self, config: ml_collections.ConfigDict, batches=None):
    vocab = config_vocab(config)
    validate(config, jax.device_count(), vocab_size=vocab.vocab_size)
    self.model = build_model_from_config(config, vocab.vocab_size)
    self.mesh, self.rules = build_mesh(config)
    batches = batches if batches is not None else host_batches(config, vocab)
    self.batch_shapes = {k: tuple(v.shape) for k, v in batches[0].items()}
    self.batches = [shard_batch(b, self.mesh, self.rules) for b in batches]
    optimizer, schedule = make_optimizer(config.optimizer, config.train.num_steps)
    from t5x_like.plan.remat import resolve_config_remat  # model.remat_policy="auto"
    self.model, self.remat = resolve_config_remat(config, self.model, optimizer, schedule,
                                                  self.mesh, self.rules,
                                                  batch_shapes=self.batch_shapes)
    self.rng = jax.random.key(config.seed)
    self.state, shardings = create_train_state(self.model, optimizer, self.mesh, self.rules,
                                               self.batch_shapes, jax.random.fold_in(self.rng, 1),
                                               config.mesh.zero_stage)
    step = make_train_step(self.model, optimizer, schedule,
                           microbatches=config.train.microbatches, mesh=self.mesh,
                           rules=self.rules, state_shardings=shardings,
                           batch_shapes=self.batch_shapes, zero_stage=config.mesh.zero_stage)
    start = time.perf_counter()
    with record_kernels() as kernels:
      lowered = step.lower(self.state, self.batches[0], self.rng)
    self.compiled = lowered.compile()
    self.compile_seconds = time.perf_counter() - start
    self.attention_kernels = _layer_groups(kernels)
    self.flops_per_step = flops_lib.train_flops_per_step(self.model, self.batch_shapes)
    self.tokens_per_step = tokens_per_step(self.batch_shapes)
    self._next = 0
    self.last_metrics = None
    self.losses: list[float] = []

  def step(self) -> None:
    batch = self.batches[self._next % len(self.batches)]
    self._next += 1
    self.state, self.last_metrics = self.compiled(self.state, batch, self.rng)
    jax.block_until_ready((self.state, self.last_metrics))
    self.losses.append(float(self.last_metrics["loss"]))


def _decode_step(model, params, batch_shapes: dict[str, tuple]):
  """(run_once, compile_seconds, cache length) of one cached decoding step for a batch
  of the training shapes (the model family's `decode_step`)."""
  cached = model.decode_step(params, batch_shapes)
  batch_size, cache_len = batch_shapes["decoder_input_tokens"][:2]
  cache = cached.make_cache(batch_size)
  token = jnp.ones((batch_size,), jnp.int32)
  position = jnp.zeros((batch_size,), jnp.int32)
  start = time.perf_counter()
  compiled = jax.jit(cached.step, donate_argnums=(1,)).lower(
      params, cache, token, position, *cached.context).compile()
  compile_seconds = time.perf_counter() - start
  state = {"cache": cache, "position": position}

  def run_once():
    logits, state["cache"] = compiled(params, state["cache"], token, state["position"],
                                      *cached.context)
    state["position"] = state["position"] + 1
    jax.block_until_ready(logits)
  return run_once, compile_seconds, cache_len


def bench_model(config: ml_collections.ConfigDict, *, steps: int = 10, warmup: int = 2,
                decode: bool = True, peaks: Optional[dict[str, float]] = None,
                profile_dir: Optional[str] = None, profile_steps: int = 3,
                peak_repeats: int = 20, compilation_cache: bool = False) -> dict:
  """The benchmark JSON of config's train step (and decode step where the family decodes).

  peaks: {'bfloat16', 'float32'} FLOP/s per device (default: peak_flops; on CPU measured
  before and after the timed steps, the fastest of `peak_repeats` matmuls each time).
  result['train']['roofline'] is the step's roofline bound (step_roofline) and
  'measured_over_bound' the median step over its seconds.
  compilation_cache: keep JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR)
  on, so that compile_seconds may be a cache hit (a rehearsal's repeated programs).
  profile_dir: after the timed steps, `profile_steps` more run under jax.profiler into
  this folder (TensorBoard / Perfetto; the step's HLO beside it as train_step.hlo.txt),
  and result['profile'] is their device time per category (speed/profile.py).
  """
  if steps < 1 or warmup < 0:
    raise ValueError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
  if profile_dir is not None and profile_steps < 1:
    raise ValueError(f"profile_steps={profile_steps} must be >= 1")
  if not compilation_cache:
    disable_compilation_cache()
  device = jax.devices()[0]
  measure = peaks is None
  peaks = peaks or peak_flops(device, repeats=peak_repeats)
  bench = TrainBench(config)
  seconds, times = median_seconds(bench.step, steps=steps, warmup=warmup)
  if measure:  # once before and once after the timed steps: the higher ceiling
    peaks = peak_flops(device, peaks, repeats=peak_repeats)
  bound = step_roofline(bench, device, peaks)
  timed_losses = list(bench.losses)
  profile = _profile(bench, profile_dir, profile_steps) if profile_dir is not None else None
  cfg = bench.model.config
  result = {
      "model": config.model.preset, "family": cfg.family, "dtype": cfg.dtype,
      "layers": cfg.num_layers, "d_model": cfg.d_model, "params": bench.model.num_params(),
      "scan_layers": cfg.scan_layers, "remat_policy": cfg.remat_policy,
      "loss_chunk_rows": cfg.loss_chunk_rows, "compilation_cache": compilation_cache,
      "remat_auto": bench.remat.to_json() if bench.remat else None,
      "attention_impl": cfg.attention_impl, "attention_kernels": bench.attention_kernels,
      "batch_shapes": {k: list(v) for k, v in bench.batch_shapes.items()},
      "optimizer": config.optimizer.name, "microbatches": config.train.microbatches,
      "device": device.device_kind, "platform": device.platform,
      "num_devices": jax.device_count(), "mesh": dict(bench.mesh.shape),
      "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
      "peak_flops_per_device": {k: round(v / 1e12, 4) for k, v in peaks.items()},
      "peak_flops_unit": "TFLOP/s",
      "train": {
          "compile_seconds": round(bench.compile_seconds, 2),
          **_rate_fields(seconds, bench.tokens_per_step, bench.flops_per_step,
                         jax.device_count(), peaks, cfg.dtype),
          "step_seconds": [round(t, 5) for t in times],
          "tokens_per_step": bench.tokens_per_step,
          "model_flops_per_step": bench.flops_per_step,
          "loss": float(bench.last_metrics["loss"]),
          "losses": [round(x, 5) for x in timed_losses],
          "xla_memory_per_device": xla_memory(bench.compiled),
          "roofline": bound,
          "measured_over_bound": round(seconds / bound["seconds"], 3)
                                 if bound and bound["seconds"] else None,
      },
  }
  if profile is not None:
    result["profile"] = profile
  if decode and bench.model.generates:
    batch_size = bench.batch_shapes["decoder_input_tokens"][0]
    run_once, compile_seconds, cache_len = _decode_step(bench.model, bench.state.params,
                                                        bench.batch_shapes)
    decode_steps = min(steps, cache_len - warmup)
    seconds, _ = median_seconds(run_once, steps=decode_steps, warmup=warmup)
    result["decode"] = {
        "compile_seconds": round(compile_seconds, 2), "batch_size": batch_size,
        "cache_length": cache_len, "step_seconds_median": round(seconds, 5),
        "tokens_per_second": round(batch_size / seconds, 1),
    }
  result["peak_memory_bytes"] = peak_memory_bytes(device)
  result["environment"] = environment()
  return result


def _profile(bench: TrainBench, log_dir: str, steps: int) -> dict:
  """Profile `steps` more train steps into log_dir; their table (speed/profile.py)."""
  os.makedirs(log_dir, exist_ok=True)
  hlo_text = bench.compiled.as_text()
  with open(os.path.join(log_dir, "train_step.hlo.txt"), "w") as f:
    f.write(hlo_text)  # so the trace can be read again: profile_table(xplane, hlo_text)
  xplane = profile_lib.capture_steps(log_dir, bench.step, steps)
  return profile_lib.profile_table(xplane, hlo_text=hlo_text)


def bench_compile(config: ml_collections.ConfigDict, depths: list[int]) -> dict:
  """Trace + lower + compile seconds of config's train step at each depth in `depths`
  (model.overrides.num_layers; T5: encoder and decoder), on abstract values (nothing is
  allocated or run)."""
  if not depths or min(depths) < 1:
    raise ValueError(f"layers={depths}: give depths >= 1")
  disable_compilation_cache()
  vocab = config_vocab(config)
  batch_shapes = {k: tuple(v.shape) for k, v in host_batches(config, vocab, count=1)[0].items()}
  rows = []
  for depth in depths:
    c = ml_collections.ConfigDict(config.to_dict())
    c.model.overrides.num_layers = depth
    model = build_model_from_config(c, vocab.vocab_size)
    if model.config.num_decoder_layers:
      c.model.overrides.num_decoder_layers = depth
      model = build_model_from_config(c, vocab.vocab_size)
    optimizer, schedule = make_optimizer(c.optimizer, c.train.num_steps)
    mesh, rules = build_mesh(c)
    start = time.perf_counter()
    compile_train_step(model, optimizer, schedule, mesh, rules, batch_shapes,
                       c.train.microbatches)
    rows.append({"layers": depth, "params": model.num_params(),
                 "compile_seconds": round(time.perf_counter() - start, 2)})
  cfg = build_model_from_config(config, vocab.vocab_size).config
  return {"model": config.model.preset, "scan_layers": cfg.scan_layers,
          "remat_policy": cfg.remat_policy, "dtype": cfg.dtype,
          "batch_shapes": {k: list(v) for k, v in batch_shapes.items()},
          "device": jax.devices()[0].device_kind, "compile": rows,
          "environment": environment()}
