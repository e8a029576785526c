"""Fused attention kernels behind attention_core.attend: cuDNN (GPU) and Pallas (TPU).

  out_BxTxNxH = cudnn_attention(q, k, v, bias=, mask=, scale=, dropout_rate=)
  out_BxTxNxH = pallas_attention(q, k, v, bias=, mask=, scale=)
  with pallas_interpret(): ...   # the Pallas kernel on CPU, in interpret mode (tests)

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

Pallas: jax.experimental.pallas.ops.tpu.flash_attention (flash attention, Dao et al.
2022). Masks travel as segment ids (padding keys get a segment no query has) plus its
causal flag; a prefix-LM mask or a dense mask becomes a [B, N, T, S] additive bias.
Key/value heads are repeated for GQA. The kernel scales the sum of the logits and its
bias, so q is scaled before it instead. The kernel's blocks are 128 long: T and S must
be multiples of 128.
"""

from __future__ import annotations

import contextlib
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
def cudnn_unsupported(backend: str, dtype, head_dim: int) -> str:
  """Why cuDNN flash attention cannot run (bf16/fp16 on a GPU, head dim <= 128 and a
  multiple of 8), or ""."""
  if backend != "gpu":
    return f"needs a GPU (backend {backend!r})"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"needs bfloat16 or float16 compute (model.dtype is {jnp.dtype(dtype).name})"
  if head_dim > 128 or head_dim % 8:
    return f"head dim {head_dim}: needs <= 128 and a multiple of 8"
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
  it as on a TPU."""
  from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
  _INTERPRET.append(True)
  try:
    with pltpu.force_tpu_interpret_mode():
      yield
  finally:
    _INTERPRET.pop()


def pallas_interpreting() -> bool:
  return bool(_INTERPRET)


def pallas_unsupported(backend: str, q_len: int, kv_len: int, head_dim: int,
                       interpret: bool = False) -> str:
  """Why the Pallas TPU kernel cannot run, or ""."""
  if backend != "tpu" and not interpret:
    return f"needs a TPU (backend {backend!r}) or pallas_interpret()"
  if q_len % _PALLAS_BLOCK or kv_len % _PALLAS_BLOCK:
    return (f"lengths {q_len} x {kv_len}: the kernel's blocks need multiples of"
            f" {_PALLAS_BLOCK}")
  if head_dim > 128 and head_dim % 128:
    return f"head dim {head_dim}: needs <= 128 or a multiple of 128"
  return ""


def pallas_attention(q: Array, k: Array, v: Array, *, bias: Optional[Array],
                     mask: Union[Array, MaskSpec, None], scale: float) -> Array:
  """[B, T, N, H] through the Pallas TPU flash-attention kernel (module docstring)."""
  from jax.experimental.pallas.ops.tpu import flash_attention as fa  # noqa: PLC0415
  b, t, n, _ = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  if kv_heads != n:
    k, v = jnp.repeat(k, n // kv_heads, axis=2), jnp.repeat(v, n // kv_heads, axis=2)
  causal, segments, dense = False, None, None
  if isinstance(mask, MaskSpec) and mask.prefix is None:
    causal = mask.causal
    if mask.key_valid is not None or mask.q_segments is not None:
      q_seg = mask.q_segments if mask.q_segments is not None else jnp.ones((b, t), jnp.int32)
      kv_seg = (mask.kv_segments if mask.kv_segments is not None
                else jnp.ones((b, s), jnp.int32))
      kv_seg = jnp.where(mask.key_valid_or_ones(), kv_seg, -1)
      segments = fa.SegmentIds(q=q_seg.astype(jnp.int32), kv=kv_seg.astype(jnp.int32))
  elif mask is not None:
    dense = _dense(mask, (b, 1, t, s))
  ab = None
  if bias is not None or dense is not None:
    ab = jnp.zeros((b, n, t, s), jnp.float32)
    if bias is not None:
      ab = ab + bias.astype(jnp.float32)
    if dense is not None:
      ab = jnp.where(dense, ab, _PALLAS_MASKED)
  size = _PALLAS_BLOCK
  blocks = fa.BlockSizes(block_q=size, block_k_major=size, block_k=size, block_b=1,
                         block_q_major_dkv=size, block_k_major_dkv=size, block_k_dkv=size,
                         block_q_dkv=size, block_k_major_dq=size, block_k_dq=size,
                         block_q_dq=size)
  to_bnth = lambda x: jnp.swapaxes(x, 1, 2)
  # The kernel scales (q k^T + ab); scaling q first gives q k^T * scale + bias.
  q = q if scale == 1.0 else q * jnp.asarray(scale, q.dtype)
  out = fa.flash_attention(to_bnth(q), to_bnth(k), to_bnth(v), ab, segments, causal=causal,
                           sm_scale=1.0, block_sizes=blocks)
  return to_bnth(out).astype(q.dtype)
