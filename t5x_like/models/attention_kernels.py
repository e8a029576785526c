"""Fused attention kernels behind attention_core.attend: cuDNN (GPU), Pallas (TPU) and
Pallas GPU (Triton).

  out_BxTxNxH = cudnn_attention(q, k, v, bias=, mask=, scale=, dropout_rate=)
  out_BxTxNxH = pallas_attention(q, k, v, bias=, mask=, scale=, dropout_rate=, dropout_rng=)
  out_BxTxNxH = pallas_gpu_attention(q, k, v, bias=, mask=, scale=, dropout_rate=,
                                     dropout_rng=)
  with pallas_interpret(): ...   # the Pallas kernels on CPU, in interpret mode (tests)

q [B, T, N, H]; k, v [B, S, K, H] (K divides N); bias [1 or B, N, T, S]; mask a boolean
[B, 1, T, S] or its masks.MaskSpec. `*_unsupported` say why a kernel cannot run a call
("" when it can); attention_core.choose_kernel reads them.

cuDNN: jax's cuDNN fused attention (jax._src.cudnn.fused_attention_stablehlo: the public
jax.nn.dot_product_attention exposes no dropout). A mask that is only causal becomes its
causal mask type (blocks above the diagonal are skipped); any other mask is folded
into the bias as a large negative number (cuDNN reads a [B, 1 or N, T, S] bias). A
bias is broadcast and masked in float32 and cast to the compute dtype at the kernel's
input, so its gradient is summed back over the batch and the relative-position
buckets in float32.

Pallas: our flash-attention kernel (pallas_flash.py; flash attention, Dao et al. 2022)
inside jax.shard_map over the traced step's mesh, since XLA cannot partition a Mosaic
kernel: batch over the mesh axes of the 'batch' rule, heads over those of 'heads'
(tensor). Masks travel as segment ids (padding keys get a segment no query has), a
causal flag and prefix-LM flags; a bias [1 or B, N, T, S] is read block by block
(T5's batch-1 bias is never broadcast over the batch); a dense boolean mask is folded
into a bias. Dropout is drawn inside the kernel from dropout_hash.py with each shard's
global batch and head offsets: the explicit kernel's mask. The kernel computes
softmax(q k^T + bias), so q is scaled before it. Blocks are 128 long: T and S must be
multiples of 128. `pallas_interpret()` (or T5X_LIKE_PALLAS_INTERPRET=1 in the
environment, for a trainer in a subprocess) runs it in interpret mode on any backend.

Pallas GPU: our flash-attention kernel for GPUs (pallas_gpu_flash.py, Pallas' Triton
lowering: the `__gpu$xla.gpu.triton` custom call) in the same shard_map, with the same
mask encoding, scaled q and in-kernel hashed dropout (the explicit kernel's mask): the
fused kernel for GPU steps with attention dropout, where cuDNN's dropout would draw
its own mask. It reads q, k, v in [B, T, N, H] (no transposes); needs a power-of-two
head dim in [16, 256] and lengths that are multiples of 16; GQA repeats key/value heads
to N before the kernel. pallas_interpret() runs it in interpret mode too.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from typing import Iterator, Optional, Union

import jax
import jax.numpy as jnp

from t5x_like.models.masks import MaskSpec

Array = jax.Array

# cuDNN's large negative for masked logits in 16-bit (as jax's own cudnn wrapper: cuDNN
# mishandles the difference of two bf16 minimums).
_CUDNN_MASKED = float(-2 << 40)
_PALLAS_MASKED = float(jnp.finfo(jnp.float32).min * 0.7)
_PALLAS_BLOCK = 128
_INTERPRET: list[bool] = []


# ---------------------------------------------------------------------------- cuDNN
def cudnn_unsupported(backend: str, dtype, head_dim: int, q_len: int = 0, kv_len: int = 0,
                      biased: bool = False) -> str:
  """Why cuDNN flash attention cannot run (bf16/fp16 on a GPU, head dim <= 128 and a
  multiple of 8; with a bias, even lengths), or "". `biased`: the call carries a bias or
  a mask other than causal-only (cuDNN takes both as a bias; its gradient needs T and S
  even: jax's fused_attention_stablehlo.check_is_flash_attention raises on T5's
  29-token targets on an H100)."""
  if backend != "gpu":
    return f"needs a GPU (backend {backend!r})"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"needs bfloat16 or float16 compute (model.dtype is {jnp.dtype(dtype).name})"
  if head_dim > 128 or head_dim % 8:
    return f"head dim {head_dim}: needs <= 128 and a multiple of 8"
  if biased and (q_len % 2 or kv_len % 2):
    return (f"lengths {q_len} x {kv_len} with a bias or padding mask: its gradient needs"
            " even lengths")
  return ""


def _dense(mask: Union[Array, MaskSpec], shape: tuple[int, ...]) -> Array:
  dense = mask.dense() if isinstance(mask, MaskSpec) else mask
  return jnp.broadcast_to(dense.astype(bool), shape)


def cudnn_attention(q: Array, k: Array, v: Array, *, bias: Optional[Array],
                    mask: Union[Array, MaskSpec, None], scale: float,
                    dropout_rate: float = 0.0) -> Array:
  """[B, T, N, H] through cuDNN flash attention (see the module docstring)."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415
  b, t, n, _ = q.shape
  s = k.shape[1]
  mask_type = cudnn.MaskType.NO_MASK
  dense = None
  if isinstance(mask, MaskSpec) and mask.is_only_causal:
    mask_type = cudnn.MaskType.CAUSAL
  elif mask is not None:
    dense = _dense(mask, (b, 1, t, s))
  bias_in, mask_in = None, dense
  if bias is not None:
    full = jnp.broadcast_to(bias.astype(jnp.float32),
                            (b if dense is not None else bias.shape[0], n, t, s))
    if dense is not None:
      full = jnp.where(dense, full, _CUDNN_MASKED)
    bias_in, mask_in = full.astype(q.dtype), None
  return cudnn.dot_product_attention(
      q, k, v, bias=bias_in, mask=mask_in, scale=scale, mask_type=mask_type,
      dropout_rate=float(dropout_rate), qkv_layout="BTNH")


# --------------------------------------------------------------------------- Pallas
@contextlib.contextmanager
def pallas_interpret() -> Iterator[None]:
  """Runs the Pallas kernel in interpret mode (any backend) inside; 'auto' then picks
  it as on a TPU. This is Pallas' generic interpreter (ordinary HLO), not its TPU
  interpret mode, whose cross-device barriers deadlock a multi-device CPU mesh with
  fewer threads than devices."""
  _INTERPRET.append(True)
  try:
    yield
  finally:
    _INTERPRET.pop()


PALLAS_INTERPRET_ENV = "T5X_LIKE_PALLAS_INTERPRET"


def pallas_interpreting() -> bool:
  """Inside pallas_interpret(), or with T5X_LIKE_PALLAS_INTERPRET=1 set."""
  return bool(_INTERPRET) or os.environ.get(PALLAS_INTERPRET_ENV) == "1"


def pallas_unsupported(backend: str, q_len: int, kv_len: int, head_dim: int,
                       interpret: bool = False, dtype=None, device_kind: str = "") -> str:
  """Why the Pallas TPU kernel cannot run, or ""."""
  if backend != "tpu" and not interpret:
    return f"needs a TPU (backend {backend!r}) or pallas_interpret()"
  if (backend == "tpu" and not interpret and re.search(r"\bv[23]\b", device_kind.lower())
      and dtype is not None and jnp.dtype(dtype).itemsize == 2):
    # libtpu 0.0.42: "E2001: Unsupported matmul RHS type on target: vector<128x128xbf16>"
    # (jax's own flash attention fails alike); float32 compiles.
    return f"{device_kind}: Mosaic compiles no 16-bit matmul there (float32 does)"
  if q_len % _PALLAS_BLOCK or kv_len % _PALLAS_BLOCK:
    return (f"lengths {q_len} x {kv_len}: the kernel's blocks need multiples of"
            f" {_PALLAS_BLOCK}")
  if head_dim > 128 and head_dim % 128:
    return f"head dim {head_dim}: needs <= 128 or a multiple of 128"
  return ""


def _mesh_axes(spec_entry) -> tuple[str, ...]:
  if spec_entry is None:
    return ()
  return (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


def _shard_axes(mesh, rules_axes: tuple[str, ...], size: int) -> tuple[str, ...]:
  """The mesh axes of a logical dim that split `size` evenly (else none: replicated)."""
  axes = tuple(a for a in rules_axes if mesh.shape[a] > 1)
  return axes if axes and size % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def _sharding_plan(b: int, n: int, kv_heads: int):
  """(mesh, batch axes, head axes, kv-head axes) of the traced step's mesh and the
  active logical rules, or None without a mesh (or a mesh of one device)."""
  import flax.linen as nn  # noqa: PLC0415
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return None
  spec = nn.logical_to_mesh_axes(("batch", "length", "heads", "kv"))
  batch_axes = _shard_axes(mesh, _mesh_axes(spec[0]), b)
  head_axes = _shard_axes(mesh, _mesh_axes(spec[2]), n)
  kv_spec = nn.logical_to_mesh_axes(("batch", "length",
                                     "heads" if kv_heads == n else "kv_heads", "kv"))
  kv_axes = _shard_axes(mesh, _mesh_axes(kv_spec[2]), kv_heads)
  return mesh, batch_axes, head_axes, kv_axes


def _part(axes: tuple[str, ...]):
  return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _mask_operands(mask: Union[Array, MaskSpec, None], bias: Optional[Array], b: int, t: int,
                   s: int, n: int):
  """(causal, q_seg [B, T], kv_seg [B, S], prefix [B, T], bias) of a mask for the flash
  kernels: segment ids where padding keys get a segment no query has, a causal flag,
  prefix-LM flags; a dense mask is folded into a [B, N, T, S] bias."""
  causal = False
  q_seg = kv_seg = prefix = None
  if isinstance(mask, MaskSpec) or mask is None:
    if mask is not None:
      causal = mask.causal
      if mask.key_valid is not None or mask.q_segments is not None:
        q_seg = (mask.q_segments if mask.q_segments is not None
                 else jnp.ones((b, t), jnp.int32)).astype(jnp.int32)
        kv_seg = (mask.kv_segments if mask.kv_segments is not None
                  else jnp.ones((b, s), jnp.int32)).astype(jnp.int32)
        kv_seg = jnp.where(mask.key_valid_or_ones(), kv_seg, -1)
      if mask.prefix is not None:
        prefix = mask.prefix.astype(bool)
  else:  # a dense mask: folded into a [B, N, T, S] bias (no structure to exploit)
    dense = _dense(mask, (b, 1, t, s))
    base = jnp.zeros((1, n, t, s), jnp.float32) if bias is None else bias.astype(jnp.float32)
    bias = jnp.where(dense, base, _PALLAS_MASKED)
  return causal, q_seg, kv_seg, prefix, bias


def _flash_in_shard_map(run, q: Array, k: Array, v: Array, *, bias: Optional[Array],
                        mask: Union[Array, MaskSpec, None], scale: float, dropout_rate: float,
                        dropout_rng: Optional[Array]) -> Array:
  """[B, T, N, H] of a flash kernel `run(q, k, v, bias, q_seg, kv_seg, prefix, causal,
  rate, seeds, batch_offset, head_offset) -> [B, T, N, H]` (the shard's), inside
  shard_map over the traced step's mesh: batch over its batch axes, heads over its
  tensor axis (the logical rules of 'batch' and 'heads'), so a custom kernel, which
  XLA cannot partition, runs per shard. Each shard passes its global batch and head
  offsets so that dropout draws the global (b, h, q, k) mask."""
  from t5x_like.models import dropout_hash  # noqa: PLC0415
  b, t, n, _ = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  causal, q_seg, kv_seg, prefix, bias = _mask_operands(mask, bias, b, t, s, n)
  dropout = dropout_rate > 0.0 and dropout_rng is not None
  rate = dropout_rate if dropout else 0.0
  seeds = (dropout_hash.dropout_seeds(dropout_rng) if dropout
           else jnp.zeros((2,), jnp.int32))
  # The kernels compute softmax(q k^T + bias): scaling q first gives q k^T * scale + bias.
  q = q if scale == 1.0 else q * jnp.asarray(scale, q.dtype)

  plan = _sharding_plan(b, n, kv_heads)
  if plan is not None and kv_heads != n and plan[2] != plan[3]:
    # GQA with query heads split where key/value heads are not: give each shard the
    # key/value heads of its own query heads (no [T, S]-sized tensor is repeated).
    k, v = jnp.repeat(k, n // kv_heads, axis=2), jnp.repeat(v, n // kv_heads, axis=2)
    kv_heads = n
    plan = plan[:3] + (plan[2],)

  if plan is None:
    return run(q, k, v, bias, q_seg, kv_seg, prefix, causal, rate, seeds, 0, 0).astype(q.dtype)

  mesh, batch_axes, head_axes, kv_axes = plan
  P = jax.sharding.PartitionSpec
  bx, hx, kx = _part(batch_axes), _part(head_axes), _part(kv_axes)
  rows = lambda x: None if x is None else P(bx, None)
  bias_spec = None if bias is None else P(bx if bias.shape[0] == b else None, hx, None, None)
  local_b = b // math.prod(mesh.shape[a] for a in batch_axes)
  local_n = n // math.prod(mesh.shape[a] for a in head_axes)

  def shard(q, k, v, bias, q_seg, kv_seg, prefix, seeds):
    index = lambda axes: jax.lax.axis_index(axes) if axes else jnp.int32(0)
    return run(q, k, v, bias, q_seg, kv_seg, prefix, causal, rate, seeds,
               index(batch_axes) * local_b, index(head_axes) * local_n)

  out = jax.shard_map(
      shard, mesh=mesh,
      in_specs=(P(bx, None, hx, None), P(bx, None, kx, None), P(bx, None, kx, None),
                bias_spec, rows(q_seg), rows(kv_seg), rows(prefix), P()),
      out_specs=P(bx, None, hx, None), check_vma=False,
  )(q, k, v, bias, q_seg, kv_seg, prefix, seeds)
  return out.astype(q.dtype)


def pallas_attention(q: Array, k: Array, v: Array, *, bias: Optional[Array],
                     mask: Union[Array, MaskSpec, None], scale: float,
                     dropout_rate: float = 0.0, dropout_rng: Optional[Array] = None) -> Array:
  """[B, T, N, H] through our Pallas TPU flash-attention kernel (pallas_flash.py) inside
  shard_map (_flash_in_shard_map)."""
  from t5x_like.models import pallas_flash  # noqa: PLC0415
  to_bnth = lambda x: jnp.swapaxes(x, 1, 2)
  interpret = pallas_interpreting()

  def run(q, k, v, bias, q_seg, kv_seg, prefix, causal, rate, seeds, batch_offset,
          head_offset):
    out = pallas_flash.flash_attention(
        to_bnth(q), to_bnth(k), to_bnth(v), bias=bias, q_segments=q_seg,
        kv_segments=kv_seg, causal=causal, q_prefix=prefix, kv_prefix=prefix,
        dropout_rate=rate, dropout_seeds=seeds, batch_offset=batch_offset,
        head_offset=head_offset, interpret=interpret)
    return to_bnth(out)

  return _flash_in_shard_map(run, q, k, v, bias=bias, mask=mask, scale=scale,
                             dropout_rate=dropout_rate, dropout_rng=dropout_rng)


# ----------------------------------------------------------------------- Pallas GPU
def pallas_gpu_unsupported(backend: str, dtype, head_dim: int, q_len: int, kv_len: int,
                           interpret: bool = False) -> str:
  """Why the Pallas GPU (Triton) kernel cannot run, or "": a GPU (or pallas_interpret()),
  16-bit or float32 compute, a power-of-two head dim in [16, 256], lengths that are
  multiples of 16."""
  from t5x_like.models import pallas_gpu_flash  # noqa: PLC0415
  if backend != "gpu" and not interpret:
    return f"needs a GPU (backend {backend!r}) or pallas_interpret()"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                              jnp.dtype(jnp.float32)):
    return f"needs bfloat16, float16 or float32 compute, not {jnp.dtype(dtype).name}"
  return pallas_gpu_flash.unsupported(head_dim, q_len, kv_len)


def pallas_gpu_attention(q: Array, k: Array, v: Array, *, bias: Optional[Array],
                         mask: Union[Array, MaskSpec, None], scale: float,
                         dropout_rate: float = 0.0,
                         dropout_rng: Optional[Array] = None) -> Array:
  """[B, T, N, H] through our Pallas GPU flash-attention kernel (pallas_gpu_flash.py,
  Triton) inside shard_map (_flash_in_shard_map)."""
  from t5x_like.models import pallas_gpu_flash  # noqa: PLC0415
  interpret = pallas_interpreting()

  def run(q, k, v, bias, q_seg, kv_seg, prefix, causal, rate, seeds, batch_offset,
          head_offset):
    return pallas_gpu_flash.flash_attention(
        q, k, v, bias=bias, q_segments=q_seg, kv_segments=kv_seg, causal=causal,
        q_prefix=prefix, kv_prefix=prefix, dropout_rate=rate, dropout_seeds=seeds,
        batch_offset=batch_offset, head_offset=head_offset, interpret=interpret)

  return _flash_in_shard_map(run, q, k, v, bias=bias, mask=mask, scale=scale,
                             dropout_rate=dropout_rate, dropout_rng=dropout_rng)
