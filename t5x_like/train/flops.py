"""Analytic FLOP counts of a training step, peak FLOP/s per device, and MFU.

Conventions (those of the PaLM / MaxText MFU figures):
- A multiply-add is 2 FLOPs; only matmuls are counted. Embedding lookups, norms,
  activations, softmax, masks, the relative position bias, the loss and the
  optimizer update count 0.
- Every matmul the model runs is counted at the shapes it runs: attention scores
  (QK^T) and weighted values (PV) over the real lengths, causal self-attention at
  full square (it is executed full square; nothing skips the masked half),
  cross-attention at T x L, K/V projections with the config's kv heads (GQA/MQA).
- BERT's MLM transform and logits run only at `mlm_positions` (P of them) when the
  batch has them, else at every position; the pooler and NSP classifier run on [CLS].
- Training = forward + backward = 3x the forward FLOPs (the backward of a matmul is
  two matmuls of the same size). Rematerialisation recompute is NOT counted: MFU
  measures useful model FLOPs, so remat lowers MFU, as it should.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Mapping, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.models.config import ModelConfig
from t5x_like.models.model import Model, model_class

# What the counts are of: a Model (models.build_model), or the ModelConfig of one.
ModelOrConfig = Union[Model, ModelConfig]

# Dense bf16 peak FLOP/s of one JAX device, by substring of `device.device_kind`
# (first match wins, so longer names come first; Cloud TPU and NVIDIA datasheets). On
# TPU v2/v3 and TPU7x a JAX device is one TensorCore (half a chip); on v4 to v6e
# (megacore, or one TensorCore) one device is a chip.
_PEAK_BF16 = (
    ("TPU v2", 22.5e12),  # 45e12 per chip, 2 cores
    ("TPU v3", 61.5e12),  # 123e12 per chip, 2 cores
    ("TPU v4 lite", 137.5e12),  # v4i, one core
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),  # v5e
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),  # v5p reports 'TPU v5'
    ("TPU v6 lite", 918e12),  # v6e (Trillium)
    ("TPU v6e", 918e12),
    ("TPU7x", 1153.5e12),  # Ironwood: 2307e12 per chip of 2 cores (cloud TPU docs: tpu7x)
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM, dense (no sparsity)
    ("H200", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
)


def forward_flops_breakdown(model: ModelOrConfig,
                            batch_shapes: Mapping[str, Any]) -> dict[str, float]:
  """Forward matmul FLOPs by part (qo_proj, kv_proj, attention, mlp, head, logits) of a
  Model or a ModelConfig: the model's `forward_flops_breakdown` formula.

  batch_shapes: feature name -> shape (or array) of the global batch; uses
  encoder_input_tokens [B, L], decoder_input_tokens [B, T], mlm_positions [B, P].
  """
  if isinstance(model, ModelConfig):
    return model_class(model).forward_flops_breakdown(model, batch_shapes)
  return model.forward_flops_breakdown(model.config, batch_shapes)


def forward_flops(model: ModelOrConfig, batch_shapes: Mapping[str, Any]) -> float:
  """Matmul FLOPs of one deterministic forward over the batch (see module docstring)."""
  return float(sum(forward_flops_breakdown(model, batch_shapes).values()))


def train_flops_per_step(model: ModelOrConfig, batch_shapes: Mapping[str, Any]) -> float:
  """FLOPs of one training step over the global batch: 3x the forward (fwd + bwd).

  Microbatching does not change it (same tokens); remat recompute is not counted.
  """
  return 3.0 * forward_flops(model, batch_shapes)


# ------------------------------------------------------------------- peak FLOP/s
def _matmul_seconds(n: int, dtype, device, repeats: int) -> float:
  """Fastest wall time of an n x n x n matmul with float32 accumulation on `device`
  (the fastest: a ceiling is what the hardware can do, and noise only slows it)."""
  a = jax.device_put(jnp.ones((n, n), dtype), device)
  b = jax.device_put(jnp.full((n, n), 0.5, dtype), device)
  matmul = jax.jit(lambda x, y: jax.lax.dot(x, y, preferred_element_type=jnp.float32))
  for _ in range(2):  # compile and warm up
    matmul(a, b).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    times.append(time.perf_counter() - start)
  return float(np.min(times))


def matmul_flops(platform: str = "cpu", dtype: str = "bfloat16", n: int = 2048,
                 repeats: int = 10) -> float:
  """Measured FLOP/s of a jitted n x n matmul (`dtype` inputs, float32 accumulation)
  on the first device of `platform`: the fastest of `repeats` after warm-up."""
  device = jax.local_devices(backend=platform)[0]
  return 2.0 * n ** 3 / _matmul_seconds(n, jnp.dtype(dtype), device, repeats)


@functools.lru_cache(maxsize=None)
def measure_matmul_flops(platform: str = "cpu", dtype: str = "bfloat16", n: int = 2048,
                         repeats: int = 10) -> float:
  """matmul_flops, measured once per process."""
  return matmul_flops(platform, dtype, n, repeats)


def table_peak_flops(device_kind: str) -> Optional[float]:
  """Dense bf16 peak FLOP/s of one device of `device_kind` from the table, or None."""
  for name, peak in _PEAK_BF16:
    if name.lower() in device_kind.lower():
      return peak
  return None


def peak_flops_per_device(device: Optional[jax.Device] = None, dtype: str = "bfloat16") -> float:
  """Peak FLOP/s of one JAX device for matmuls in `dtype` ('bfloat16' or 'float32').

  Accelerators: the dense bf16 table above. For float32 the convention is the unit
  that JAX's default matmul precision uses: the MXU on TPU (the bf16 peak) and TF32
  tensor cores on NVIDIA (half the bf16 peak). CPU: measured at first use (`measure_matmul_flops`)
  and divided by the number of local CPU devices, since fake devices
  (--xla_force_host_platform_device_count) share the host's cores; then
  mfu = achieved host FLOP/s / measured host matmul FLOP/s. An unknown accelerator
  is measured too, with a warning.
  """
  if dtype not in ("bfloat16", "float32"):
    raise ValueError(f"peak_flops_per_device dtype={dtype!r}: expected 'bfloat16' or 'float32'")
  device = device or jax.local_devices()[0]
  if device.platform == "cpu":
    return measure_matmul_flops("cpu", dtype) / len(jax.local_devices(backend="cpu"))
  peak = table_peak_flops(device.device_kind)
  if peak is not None:
    return peak / 2 if dtype == "float32" and device.platform == "gpu" else peak
  logging.warning("peak_flops_per_device: unknown device kind %r; measuring a matmul",
                  device.device_kind)
  return measure_matmul_flops(device.platform, dtype, n=8192)


def mfu(flops_per_step: float, step_seconds: float, num_devices: int,
        peak_per_device: float) -> float:
  """Model FLOPs utilisation: achieved FLOP/s over the peak of all devices."""
  return flops_per_step / (step_seconds * num_devices * peak_per_device)
