"""`t5x-like bench attention`: every attention kernel this device runs, checked and timed.

  result = bench_attention(batch=4, length=512, heads=16, head_dim=64, dtype="bfloat16")

For each kernel (explicit and xla everywhere, cudnn and pallas_gpu on a GPU, pallas on
a TPU or in interpret mode) and each mask (padding, packing, causal, causal with packing, prefix
LM), with a [1, N, T, S] bias: the output and the gradients of q, k, v and the bias
against a float32 reference computed from the definition (largest error relative to
the largest reference entry, over query rows that see a key), and the median time of a
jitted forward + backward. Kernels that apply attention dropout (explicit, cudnn, pallas,
pallas_gpu) are checked by statistics: with v the one-hot key index, out = probs * keep,
so the dropped fraction of visible entries must be the rate and the mean unchanged; and
whether two calls drop the same entries (Pallas kernels: and the explicit kernel's
entries); the hashed-dropout kernels (explicit, pallas, pallas_gpu) are also timed
forward + backward with dropout 0.1 at the full shape (padding mask, the bias), except
with interpret_pallas. pallas_gpu runs on a GPU only (its interpret mode is tested in
tests/test_pallas_gpu_flash.py).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.speed.environment import environment
from t5x_like.models.attention_core import choose_kernel, attend
from t5x_like.models.attention_kernels import pallas_gpu_unsupported, pallas_interpret
from t5x_like.models.masks import MaskSpec, mask_spec

KERNELS = ("explicit", "xla", "cudnn", "pallas", "pallas_gpu")
HASHED_DROPOUT = ("explicit", "pallas", "pallas_gpu")  # never cudnn: it crashes XLA (docs)


def _reference(q, k, v, bias, dense, scale):
  rep = q.shape[2] // k.shape[2]
  kr, vr = jnp.repeat(k, rep, 2), jnp.repeat(v, rep, 2)
  logits = jnp.einsum("btnh,bsnh->bnts", q, kr, precision="highest") * scale + bias
  probs = jax.nn.softmax(jnp.where(dense, logits, -1e30), axis=-1)
  return jnp.einsum("bnts,bsnh->btnh", probs, vr, precision="highest")


def mask_cases(batch: int, length: int) -> dict[str, MaskSpec]:
  """Padding (row b keeps a different length), packing (3 segments), causal, causal
  with packing, prefix LM."""
  pos = np.arange(length)[None, :]
  lengths = length - (np.arange(batch) * length) // (2 * batch)
  valid = pos < lengths[:, None]
  segments = np.where(valid, 1 + (pos >= length // 3) + (pos >= length // 2), 0)
  segments = jnp.asarray(segments, jnp.int32)
  prefix = jnp.asarray(pos < (lengths[:, None] // 3), jnp.int32)
  causal = dict(q_len=length, kv_len=length, batch=batch, causal=True)
  return {
      "padding": mask_spec(jnp.asarray(valid), q_len=length),
      "packing": mask_spec(segments > 0, query_segment_BxQ=segments, key_segment_BxK=segments),
      "causal": mask_spec(None, **causal),
      "causal_packing": mask_spec(segments > 0, query_segment_BxQ=segments,
                                  key_segment_BxK=segments, causal=True),
      "prefix": mask_spec(None, prefix_BxQ=prefix, **causal),
  }


def _median_ms(fn, *args, steps: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return round(statistics.median(times) * 1e3, 3)


def _check(impl, spec, inputs, dtype, steps):
  q, k, v, bias, cot = inputs
  dense = spec.dense()
  weights = cot * jnp.any(dense, -1)[:, 0, :, None, None]
  scale = q.shape[-1] ** -0.5

  def grads(fn):
    def loss(q, k, v, bias):
      return jnp.sum(fn(q, k, v, bias).astype(jnp.float32) * weights)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))

  cast = lambda x: x.astype(dtype)
  ours = grads(lambda q, k, v, b: attend(cast(q), cast(k), cast(v), bias=b, mask=spec,
                                         scale=scale, impl=impl))
  ref = grads(lambda q, k, v, b: _reference(q, k, v, b, dense, scale))
  got, want = ours(q, k, v, bias), ref(q, k, v, bias)
  out = jax.jit(lambda *a: attend(*[cast(x) for x in a[:3]], bias=a[3], mask=spec,
                                  scale=scale, impl=impl).astype(jnp.float32) * weights)
  out_ref = _reference(q, k, v, bias, dense, scale) * weights
  errors = {"out": np.abs(np.asarray(out(q, k, v, bias)) - np.asarray(out_ref)).max()
            / np.abs(np.asarray(out_ref)).max()}
  for name, g, w in zip(("dq", "dk", "dv", "dbias"), got[1], want[1]):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    errors[name] = np.abs(g - w).max() / np.abs(w).max()
  return {**{k: float(f"{v:.3g}") for k, v in errors.items()},
          "fwd_bwd_ms": _median_ms(ours, q, k, v, bias, steps=steps)}


def _dropout_stats(impl, spec, dtype, rate=0.1):
  """Dropped fraction (want `rate`), mean ratio (want 1) and whether two calls with
  the same key drop different entries, with v = one-hot key index."""
  b, _, t, s = spec.shape
  rng = np.random.RandomState(1)
  q = jnp.asarray(rng.randn(b, t, 2, s), dtype)
  k = jnp.asarray(rng.randn(b, s, 2, s), dtype)
  eye = jnp.broadcast_to(jnp.eye(s, dtype=dtype)[None, :, None, :], (b, s, 2, s))
  run = jax.jit(lambda key, rate: attend(q, k, eye, mask=spec, scale=0.05, dropout_rate=rate,
                                         dropout_rng=key, impl=impl), static_argnums=1)
  dropped = np.asarray(run(jax.random.key(0), rate), np.float32)
  again = np.asarray(run(jax.random.key(0), rate), np.float32)
  other = np.asarray(run(jax.random.key(1), rate), np.float32)
  clean = np.asarray(attend(q, k, eye, mask=spec, scale=0.05, impl=impl), np.float32)
  visible = np.broadcast_to(np.asarray(spec.dense())[:, 0, :, None, :], dropped.shape)
  stats = {"rate": rate, "dropped_fraction": round(float((dropped == 0)[visible].mean()), 5),
          "sigma": round(float(np.sqrt(rate * (1 - rate) / visible.sum())), 6),
          "mean_ratio": round(float(dropped.sum() / clean.sum()), 5),
          "same_key_same_mask": bool(np.array_equal(dropped == 0, again == 0)),
          "other_key_other_mask": not np.array_equal(dropped == 0, other == 0)}
  if impl in ("pallas", "pallas_gpu"):  # the explicit kernel's hashed mask, entry for entry
    run_explicit = jax.jit(lambda key: attend(
        q, k, eye, mask=spec, scale=0.05, dropout_rate=rate, dropout_rng=key,
        impl="explicit"))
    stats["mask_equals_explicit"] = bool(np.array_equal(
        dropped == 0, np.asarray(run_explicit(jax.random.key(0)), np.float32) == 0))
  return stats


def _dropout_ms(impl, spec, inputs, dtype, steps, rate=0.1):
  """Median ms of a jitted forward + backward with attention dropout."""
  q, k, v, bias, cot = (x.astype(dtype) if i < 3 else x for i, x in enumerate(inputs))

  def loss(q, k, v, bias, key):
    out = attend(q, k, v, bias=bias, mask=spec, scale=q.shape[-1] ** -0.5, dropout_rate=rate,
                 dropout_rng=key, impl=impl)
    return jnp.sum(out.astype(jnp.float32) * cot)

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
  return _median_ms(fn, q, k, v, bias, jax.random.key(0), steps=steps)


def bench_attention(*, batch: int = 4, length: int = 512, heads: int = 16, kv_heads: int = 0,
                    head_dim: int = 64, dtype: str = "bfloat16", steps: int = 10,
                    interpret_pallas: bool = False) -> dict:
  """The JSON of `t5x-like bench attention` (module docstring)."""
  if min(batch, length, heads, head_dim, steps) < 1 or kv_heads < 0:
    raise ValueError("batch, length, heads, head_dim and steps must be >= 1")
  kv_heads = kv_heads or heads
  if heads % kv_heads:
    raise ValueError(f"kv_heads={kv_heads} must divide heads={heads}")
  dt = jnp.dtype(dtype)
  rng = np.random.RandomState(0)
  shape = lambda n: (batch, length, n, head_dim)
  inputs = (jnp.asarray(rng.randn(*shape(heads)), jnp.float32),
            jnp.asarray(rng.randn(*shape(kv_heads)), jnp.float32),
            jnp.asarray(rng.randn(*shape(kv_heads)), jnp.float32),
            jnp.asarray(rng.randn(1, heads, length, length), jnp.float32),
            jnp.asarray(rng.randn(*shape(heads)), jnp.float32))
  cases = mask_cases(batch, length)
  backend = jax.default_backend()
  result = {"device": jax.devices()[0].device_kind, "backend": backend, "dtype": dt.name,
            "shape": {"batch": batch, "length": length, "heads": heads, "kv_heads": kv_heads,
                      "head_dim": head_dim},
            "errors_are": "max |kernel - float32 reference| / max |reference|",
            "kernels": {}, "skipped": {}, "dropout": {}}
  with pallas_interpret() if interpret_pallas else contextlib.nullcontext():
    for impl in KERNELS:
      if impl == "pallas_gpu" and backend != "gpu":  # interpret mode: its own tests
        result["skipped"][impl] = (pallas_gpu_unsupported(backend, dt, head_dim, length, length)
                                   + "; interpret mode: tests/test_pallas_gpu_flash.py")
        continue
      try:
        choose_kernel(impl, backend=backend, dtype=dt, head_dim=head_dim, q_len=length,
                      kv_len=length, dropout=False)
      except ValueError as e:
        result["skipped"][impl] = str(e)
        continue
      result["kernels"][impl] = {name: _check(impl, spec, inputs, dt, steps)
                                 for name, spec in cases.items()}
    small = mask_cases(batch, 128)["padding"]
    for impl in ("explicit", "cudnn", "pallas", "pallas_gpu"):
      if impl in result["kernels"]:
        result["dropout"][impl] = _dropout_stats(impl, small, dt)
        if impl in HASHED_DROPOUT and not interpret_pallas:  # interpret mode: no timing
          result["dropout"][impl]["fwd_bwd_ms"] = _dropout_ms(impl, cases["padding"], inputs,
                                                              dt, steps)
  result["environment"] = environment()
  return result

