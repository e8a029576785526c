"""The attention core softmax(q k^T * scale + bias) v, with masks and dropout.

  out_BxTxNxH = attend(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, bias=, mask=, scale=,
                       dropout_rate=, dropout_rng=, impl="auto", name=)

Kernels (config.attention_impl; attention_kernels.py holds the fused ones):
- "explicit": every matmul, forward and backward, is a 16-bit x 16-bit -> float32 product
  (a custom VJP, like layers.dot): plain autodiff of a float32-accumulating einsum
  upcasts the backward matmuls to float32, and XLA's generic attention lowering is slow
  on CPU. Softmax and its gradient run in float32; the probabilities are kept for the
  backward pass in the compute dtype ([B, N, T, S]). Dropout multiplies the
  probabilities by a mask hashed from the step's dropout key and each probability's
  global (batch, head, query, key) index (dropout_hash.py), the mask the Pallas kernel
  draws block by block. Any mask, bias, dropout; the reference the others are tested
  against.
- "xla": jax.nn.dot_product_attention's XLA lowering. No dropout.
- "cudnn": cuDNN flash attention (GPU, bf16/fp16): a causal flag instead of a mask where
  the mask is only causal, a [B, 1, T, S] mask otherwise, a bias with its gradient, and
  dropout inside the kernel (its mask comes from cuDNN's generator, not from the dropout
  key: a resumed run does not redraw the same masks). With a bias or a mask other than
  causal it needs even lengths ("auto" takes "xla" for T5's 29-token targets).
- "pallas": our Pallas flash-attention kernel for TPU (pallas_flash.py) inside
  shard_map over the mesh: segment ids, causal and prefix-LM flags for the mask, a bias
  [1 or B, N, T, S] with its gradient read block by block, and dropout drawn inside
  the kernel from the same hash as the explicit kernel's; on CPU it runs in Pallas
  interpret mode inside `pallas_interpret()` (tests).
- "pallas_gpu": our Pallas flash-attention kernel for GPUs (pallas_gpu_flash.py, Triton
  lowering) in the same shard_map with the same masks, bias gradient and hashed
  dropout mask as "pallas": "auto" takes it on a GPU when attention dropout is on (BERT
  recipes), so a dropout step neither writes [B, N, T, S] probabilities to HBM nor
  draws cuDNN's own mask; power-of-two head dims in [16, 256], lengths multiples of 16.
  Interpret mode inside `pallas_interpret()` as "pallas" (configured explicitly).
"auto" picks per platform and call (choose_kernel). The platform is the one the step is
compiled for: the devices of the mesh being traced under (a TPU slice compiled from a
CPU host picks TPU kernels), else jax.default_backend(); and their generation (Mosaic
compiles no bf16 matmul for TPU v2/v3, so 'auto' takes the explicit kernel there).
`record_kernels()` collects each attention's choice and the reason for it while a model
is traced (bench model prints it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Iterator, Optional, Union

import jax
import jax.numpy as jnp

Array = jax.Array

from t5x_like.models import attention_kernels, dropout_hash
from t5x_like.models.config import ATTENTION_IMPLS as IMPLS
from t5x_like.models.masks import MaskSpec

_MASKED = jnp.finfo(jnp.float32).min * 0.7  # masked logits (finite: no inf - inf)


def _grouped(q_BxTxNxH: Array, kv_heads: int) -> Array:
  b, t, n, h = q_BxTxNxH.shape
  return q_BxTxNxH.reshape(b, t, kv_heads, n // kv_heads, h)


def _einsum(spec: str, a: Array, b: Array) -> Array:
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _probs(q, k, bias, mask, scale):
  """float32 softmax probabilities [B, K, G, T, S]."""
  b, t, n, _ = q.shape
  kv = k.shape[2]
  logits = _einsum("btkgh,bskh->bkgts", _grouped(q, kv), k) * scale
  s = logits.shape[-1]
  logits = logits.reshape(b, n, t, s)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  if mask is not None:
    logits = jnp.where(mask, logits, _MASKED)
  return jax.nn.softmax(logits, axis=-1).reshape(b, kv, n // kv, t, s)


def _dropped(p, keep, keep_scale, dtype):
  """Probabilities [B, K, G, T, S] times the dropout multiplier keep [B, N, T, S] times
  keep_scale (float32: 1 / (1 - rate) is not rounded to 16 bits), in dtype."""
  if keep is None:
    return p.astype(dtype)
  return (p * (keep.reshape(p.shape).astype(jnp.float32) * keep_scale)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _explicit(q, k, v, bias, mask, keep, scale, keep_scale):
  return _explicit_fwd(q, k, v, bias, mask, keep, scale, keep_scale)[0]


def _explicit_fwd(q, k, v, bias, mask, keep, scale, keep_scale):
  dtype = q.dtype
  p = _probs(q, k, bias, mask, scale)
  out = _einsum("bkgts,bskh->btkgh", _dropped(p, keep, keep_scale, dtype), v)
  out = out.reshape(q.shape).astype(dtype)
  return out, (q, k, v, p.astype(dtype), bias, mask, keep)


def _explicit_bwd(scale, keep_scale, residuals, g_BxTxNxH):
  q, k, v, p, bias, mask, keep = residuals
  dtype = q.dtype
  kv = k.shape[2]
  g = _grouped(g_BxTxNxH.astype(dtype), kv)
  dv = _einsum("bkgts,btkgh->bskh", _dropped(p, keep, keep_scale, dtype), g)
  dp = _einsum("btkgh,bskh->bkgts", g, v)  # float32
  if keep is not None:
    dp = dp * (keep.reshape(dp.shape).astype(jnp.float32) * keep_scale)
  p32 = p.astype(jnp.float32)
  ds = p32 * (dp - jnp.sum(dp * p32, axis=-1, keepdims=True))  # d logits, float32
  ds_lp = ds.astype(dtype)
  dq = (_einsum("bkgts,bskh->btkgh", ds_lp, k) * scale).reshape(q.shape).astype(q.dtype)
  dk = (_einsum("bkgts,btkgh->bskh", ds_lp, _grouped(q, kv)) * scale).astype(k.dtype)
  dbias = None
  if bias is not None:
    b, n, t, s = ds.shape[0], ds.shape[1] * ds.shape[2], ds.shape[3], ds.shape[4]
    ds_n = ds.reshape(b, n, t, s)
    summed = tuple(i for i, size in enumerate(bias.shape) if size == 1 and ds_n.shape[i] != 1)
    dbias = jnp.sum(ds_n, axis=summed, keepdims=True).astype(bias.dtype)
  return (dq, dk, dv.astype(v.dtype), dbias, None, None)


_explicit.defvjp(_explicit_fwd, _explicit_bwd)


# ------------------------------------------------------------------- choice of kernel
@dataclasses.dataclass(frozen=True)
class KernelChoice:
  kernel: str  # explicit | xla | cudnn | pallas | pallas_gpu
  reason: str


def choose_kernel(impl: str, *, backend: str, dtype, head_dim: int, q_len: int, kv_len: int,
                  dropout: bool, device_kind: str = "", biased: bool = False) -> KernelChoice:
  """The kernel `impl` runs as on `backend` (a `device_kind` such as 'TPU v3') for one
  attention call (module docstring); `biased`: it carries a bias or a mask other than
  causal-only.

  Raises ValueError when an explicitly configured kernel cannot run this call.
  """
  if impl not in IMPLS:
    raise ValueError(f"attention impl {impl!r}: expected one of {IMPLS}")
  interpret = attention_kernels.pallas_interpreting()
  cudnn_why = attention_kernels.cudnn_unsupported(backend, dtype, head_dim, q_len, kv_len,
                                                 biased)
  pallas_why = attention_kernels.pallas_unsupported(backend, q_len, kv_len, head_dim, interpret,
                                                    dtype=dtype, device_kind=device_kind)
  gpu_why = attention_kernels.pallas_gpu_unsupported(backend, dtype, head_dim, q_len, kv_len,
                                                     interpret)
  if impl == "explicit":
    return KernelChoice("explicit", "configured")
  if impl == "xla":
    if dropout:
      raise ValueError("attention_impl='xla' cannot apply attention dropout; use"
                       " 'explicit', 'cudnn' (GPU) or 'auto'")
    return KernelChoice("xla", "configured")
  if impl == "cudnn":
    if cudnn_why:
      raise ValueError(f"attention_impl='cudnn': {cudnn_why}")
    return KernelChoice("cudnn", "configured")
  if impl == "pallas":
    if pallas_why:
      raise ValueError(f"attention_impl='pallas': {pallas_why}")
    return KernelChoice("pallas", "configured")
  if impl == "pallas_gpu":
    if gpu_why:
      raise ValueError(f"attention_impl='pallas_gpu': {gpu_why}")
    return KernelChoice("pallas_gpu", "configured")
  # auto
  if backend == "gpu":
    if dropout and not gpu_why:
      return KernelChoice("pallas_gpu", "GPU with attention dropout: Pallas (Triton) flash"
                          " attention, its mask hashed from the step's dropout key")
    if dropout:
      return KernelChoice("explicit", f"attention dropout without the Pallas GPU kernel"
                          f" ({gpu_why}): the explicit kernel draws its mask from the step's"
                          " dropout key (exact resume); set attention_impl='cudnn' for"
                          " cuDNN's fused dropout")
    if not cudnn_why:
      return KernelChoice("cudnn", "GPU: cuDNN flash attention")
    return KernelChoice("xla", f"GPU without cuDNN flash attention ({cudnn_why})")
  if backend == "tpu" or interpret:
    if not pallas_why:
      return KernelChoice("pallas", "TPU: Pallas flash attention" +
                          (" with its fused dropout" if dropout else ""))
    return KernelChoice("explicit", f"TPU without the Pallas kernel ({pallas_why})")
  return KernelChoice("explicit", f"{backend}: the explicit kernel (16-bit products)")


_RECORDS: list[dict] = []


@contextlib.contextmanager
def record_kernels() -> Iterator[dict]:
  """Collects {attention name: {kernel, reason, calls}} of the attentions traced inside."""
  found: dict = {}
  _RECORDS.append(found)
  try:
    yield found
  finally:
    _RECORDS.remove(found)


def _record(name: str, choice: KernelChoice) -> None:
  for found in _RECORDS:
    entry = found.setdefault(name, {"kernel": choice.kernel, "reason": choice.reason,
                                    "traced_calls": 0})
    entry["traced_calls"] += 1


_TARGETS: list[tuple[str, str]] = []  # (platform, device kind) set by tracing_for


@contextlib.contextmanager
def tracing_for(platform: str, device_kind: Optional[str] = None) -> Iterator[None]:
  """Kernels are chosen for `platform` (and `device_kind`, e.g. 'TPU v3'; None: the
  enclosing tracing_for's for the same platform) inside: plan traces a TPU step on a CPU
  host, and its estimate traces the model without a mesh."""
  if device_kind is None:
    device_kind = next((kind for p, kind in reversed(_TARGETS) if p == platform), "")
  _TARGETS.append((platform, device_kind))
  try:
    yield
  finally:
    _TARGETS.pop()


def kernel_target() -> tuple[str, str]:
  """(platform, device kind) the traced step will run on: tracing_for's, else the mesh's
  devices' (jax.set_mesh or the abstract mesh the step builders trace under), else
  jax.default_backend() with this host's first device."""
  if _TARGETS:
    return _TARGETS[-1]
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else getattr(mesh, "abstract_device", None)
  if getattr(device, "platform", None):
    return device.platform, device.device_kind or ""
  return jax.default_backend(), jax.devices()[0].device_kind


# ------------------------------------------------------------------------- attend
def attend(q_BxTxNxH: Array, k_BxSxKxH: Array, v_BxSxKxH: Array, *,
           bias: Optional[Array] = None, mask: Union[Array, MaskSpec, None] = None,
           scale: float = 1.0, dropout_rate: float = 0.0, dropout_rng: Optional[Array] = None,
           keep: Optional[Array] = None, impl: str = "auto",
           name: Optional[str] = "attention") -> Array:
  """Attention over S keys for T queries -> [B, T, N, H] in q's dtype.

  bias: [1 or B, N, T, S] added to the logits; mask: boolean [B, 1, T, S] (True = may
  attend) or its MaskSpec. Dropout: `dropout_rate` with `dropout_rng` (None: no
  dropout), or an explicit multiplier `keep` [B, N, T, S] (0 or 1 / (1 - rate); explicit
  kernel only, for tests). Heads: N query heads over K = N / G key/value heads (GQA).
  Query rows that may attend to no key give an unspecified finite value.
  """
  dtype = q_BxTxNxH.dtype
  k_BxSxKxH, v_BxSxKxH = k_BxSxKxH.astype(dtype), v_BxSxKxH.astype(dtype)
  b, t, n, h = q_BxTxNxH.shape
  s = k_BxSxKxH.shape[1]
  dropout = keep is not None or (dropout_rate > 0.0 and dropout_rng is not None)
  platform, device_kind = kernel_target()
  biased = bias is not None or not (mask is None or (isinstance(mask, MaskSpec)
                                                     and mask.is_only_causal))
  choice = choose_kernel(impl, backend=platform, dtype=dtype, head_dim=h, q_len=t, kv_len=s,
                         dropout=dropout, device_kind=device_kind, biased=biased)
  if keep is not None and choice.kernel != "explicit":
    raise ValueError("attend: an explicit dropout multiplier `keep` needs impl='explicit'")
  if name is not None:  # None: not recorded (parameter creation)
    _record(name, choice)
  if choice.kernel == "cudnn":
    return attention_kernels.cudnn_attention(
        q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, bias=bias, mask=mask, scale=scale,
        dropout_rate=dropout_rate if dropout else 0.0)
  if choice.kernel in ("pallas", "pallas_gpu"):
    fused = (attention_kernels.pallas_attention if choice.kernel == "pallas"
             else attention_kernels.pallas_gpu_attention)
    return fused(
        q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, bias=bias, mask=mask, scale=scale,
        dropout_rate=dropout_rate if dropout else 0.0, dropout_rng=dropout_rng)
  dense = mask.dense() if isinstance(mask, MaskSpec) else mask
  if choice.kernel == "xla":
    return jax.nn.dot_product_attention(
        q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask=dense, scale=scale, implementation="xla",
        bias=None if bias is None else bias.astype(dtype))
  if dense is not None:
    dense = dense.astype(bool)
  keep_scale = 1.0
  if keep is None and dropout:  # 0 / 1 in the compute dtype (exact), scaled in float32
    keep = dropout_hash.keep_mask(dropout_hash.dropout_seeds(dropout_rng), dropout_rate,
                                  batch=b, heads=n, q_len=t, kv_len=s).astype(dtype)
    keep_scale = 1.0 / (1.0 - dropout_rate)
  return _explicit(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, bias, dense, keep, scale, keep_scale)
