"""Softmax cross-entropy from the final hidden states and the output layer, by row chunks.

  loss_sum, z_sum, correct_sum = chunked_cross_entropy(
      hidden_NxD, kernel, targets_N, weights_N, vocab_axis=0, chunk_rows=2048, ...)

The plain loss path (losses.cross_entropy on the model's logits) holds [N, V] logits, their
float32 copy and its gradient: GPT-2 at b32 x 1024 x 50,257 is 6.6 GB per float32 array.
Here the logits of `chunk_rows` rows at a time are computed, reduced to each row's loss,
z-term and correctness, and dropped; no [N, V] array exists in the forward or backward.

Why row chunks (not vocabulary chunks): a row's softmax, label-smoothing sum and argmax
stay inside one chunk, so each is exact there (no online logsumexp across chunks), and
the rows are the dim the batch is sharded over, so each device works on its own rows
while the vocabulary dim of the chunk follows the weight's 'tensor' sharding through
the ("batch", "vocab") constraint (XLA reduces the logsumexp, the target logit and the
argmax across it). A chunk takes every n-th row (rows i, i + n, i + 2n, ... for chunk
i of n), so that a batch sharded in contiguous blocks over devices is sharded the same
way inside every chunk.

The gradient is computed in the forward pass, chunk by chunk, as Liger Kernel's fused
linear cross-entropy does (Hsu et al. 2024, arXiv:2410.10989; linkedin/Liger-Kernel
ops/fused_linear_cross_entropy.py): the loss is a weighted sum, so its gradient with
respect to the hidden states and the output weights is known up to the one scalar
cotangent of that sum. That costs the logits matmul plus the two gradient matmuls,
where recomputing the chunk's logits in the backward (jax.checkpoint per chunk) would
cost a fourth. Without differentiation (eval) the primal runs and no gradient is formed.

Numerics follow the model's own head (layers.dot and families._output_logits): the
matmul runs in the compute dtype with float32 accumulation, the logits are rounded to
the compute dtype (plus BERT's output bias in that dtype) and then taken in float32 as
losses.cross_entropy does; the gradient matmuls take the logits' gradient in the
compute dtype with float32 accumulation, as layers.dot's backward does.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from t5x_like.models.layers import compute_dtype, constrain

Array = jax.Array


def pays(chunk_rows: int, device_rows: int, d_model: int) -> bool:
  """Whether the chunked loss, `chunk_rows` rows per device and chunk, saves memory for
  `device_rows` rows on one device.

  It drops the float32 [rows, V] logits and their gradient (about 8 bytes per row and
  word) but keeps the output weights' float32 gradient [V, D] from the forward, and
  the backward scales it into a second one (8 bytes per d_model and word). Below
  D rows per device the chunks cost more than they save (BERT-large's 40 masked rows
  per device on v3-128 compiled 1.9% larger with chunks), and one chunk holds the
  whole [rows, V] anyway (configs/gpt_cpu.py in one chunk: 673 MiB of temporaries
  against 545 on full logits)."""
  return chunk_rows > 0 and device_rows > max(d_model, chunk_rows)


def batch_shards() -> int:
  """Devices the traced step splits the 'batch' dim over: the product of the mesh axes
  the active logical rules give it (1 outside a mesh)."""
  import flax.linen as nn  # noqa: PLC0415
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  axes = nn.logical_to_mesh_axes(("batch",))[0]
  axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
  return math.prod(mesh.shape[a] for a in axes)


def runs(cfg, rows: int) -> bool:
  """Whether a model of ModelConfig `cfg` takes the chunked loss for `rows` rows of the
  traced (global) batch: pays() on one device's share."""
  return pays(cfg.loss_chunk_rows, rows // batch_shards(), cfg.d_model)


def model_token_metrics(cfg, prefix: str, kernel: Array, vocab_axis: int, hidden: Array,
                        targets: Array, weights: Optional[Array], denominator: Array,
                        bias: Optional[Array] = None) -> dict[str, Array]:
  """losses.token_metrics of a model's output layer (kernel, vocab_axis:
  families.output_layer) on `hidden` [..., D] (the modules' loss_hidden output) with
  targets and weights [...], by cfg.loss_chunk_rows rows per device."""
  flat = lambda x: None if x is None else jnp.reshape(x, (-1,))
  return chunked_token_metrics(
      prefix, hidden.reshape(-1, hidden.shape[-1]), kernel, flat(targets), flat(weights),
      denominator, bias, vocab_axis=vocab_axis,
      chunk_rows=cfg.loss_chunk_rows * batch_shards(), z_loss=cfg.z_loss,
      label_smoothing=cfg.label_smoothing, dtype=compute_dtype(cfg))


def num_chunks(rows: int, chunk_rows: int) -> int:
  """How many chunks `rows` rows take at up to `chunk_rows` rows each (1 when off: 0)."""
  return max(1, math.ceil(rows / chunk_rows)) if chunk_rows > 0 else 1


def chunk_size(rows: int, chunk_rows: int) -> int:
  """Rows of one chunk: `rows` split evenly over num_chunks (the last rows padded)."""
  return math.ceil(rows / num_chunks(rows, chunk_rows))


def chunked_cross_entropy(hidden_NxD: Array, kernel: Array, targets_N: Array,
                          weights_N: Optional[Array] = None, bias_V: Optional[Array] = None, *,
                          vocab_axis: int, chunk_rows: int, z_loss: float = 0.0,
                          label_smoothing: float = 0.0, dtype=jnp.float32
                          ) -> tuple[Array, Array, Array]:
  """(sum(w * loss), sum(w * z_term), sum(w * correct)), float32 scalars.

  hidden_NxD: the output layer's input (compute dtype); kernel: the output weights,
  [V, D] with vocab_axis=0 (a tied embedding) or [D, V] with vocab_axis=1 (an untied
  layer); bias_V: an output bias (BERT's MLM head) or None; integer targets_N; weights_N
  (default ones). loss and z_term are losses.cross_entropy's (z-loss, label smoothing and
  its entropy shift included; loss contains z_term); correct is argmax(logits) == target
  with jnp.argmax's tie rule (the first maximum). Only the first sum is differentiable
  (hidden, kernel and bias); the z and accuracy sums are metrics (stop_gradient).
  """
  weights_N = (jnp.ones(targets_N.shape, jnp.float32) if weights_N is None
               else weights_N.astype(jnp.float32))
  loss, z_sum, correct = _sums(hidden_NxD, kernel, bias_V, targets_N.astype(jnp.int32),
                               weights_N, vocab_axis, int(chunk_rows), float(z_loss),
                               float(label_smoothing), jnp.dtype(dtype))
  return loss, lax.stop_gradient(z_sum), lax.stop_gradient(correct)


def chunked_token_metrics(prefix: str, hidden_NxD: Array, kernel: Array, targets_N: Array,
                          weights_N: Optional[Array], denominator: Array,
                          bias_V: Optional[Array] = None, *, vocab_axis: int,
                          chunk_rows: int, z_loss: float = 0.0, label_smoothing: float = 0.0,
                          dtype=jnp.float32) -> dict[str, Array]:
  """losses.token_metrics of the chunked loss: <prefix>_loss, _z_loss (with z_loss),
  _accuracy (sums over rows / denominator) and <prefix>_tokens (sum of weights)."""
  weights_N = (jnp.ones(targets_N.shape, jnp.float32) if weights_N is None
               else weights_N.astype(jnp.float32))
  loss, z_sum, correct = chunked_cross_entropy(
      hidden_NxD, kernel, targets_N, weights_N, bias_V, vocab_axis=vocab_axis,
      chunk_rows=chunk_rows, z_loss=z_loss, label_smoothing=label_smoothing, dtype=dtype)
  metrics = {f"{prefix}_loss": loss / denominator}
  if z_loss:
    metrics[f"{prefix}_z_loss"] = z_sum / denominator
  metrics[f"{prefix}_accuracy"] = correct / denominator
  metrics[f"{prefix}_tokens"] = jnp.sum(weights_N)
  return metrics


# ------------------------------------------------------------------ one chunk
def _dot(a: Array, b: Array, a_contract: int, b_contract: int) -> Array:
  return lax.dot_general(a, b, (((a_contract,), (b_contract,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _chunk_logits(h_CxD, kernel_lp, bias_lp, vocab_axis, dtype) -> Array:
  """[C, V] float32 logits, rounded through the compute dtype as the model's head does."""
  logits = _dot(h_CxD, kernel_lp, 1, 1 - vocab_axis).astype(dtype)
  if bias_lp is not None:
    logits = logits + bias_lp
  return constrain(logits.astype(jnp.float32), ("batch", "vocab"))


def _smoothing(vocab: int, label_smoothing: float) -> tuple[float, float, float]:
  """(weight on the target, on every other id, entropy of that distribution)."""
  if label_smoothing <= 0.0:
    return 1.0, 0.0, 0.0
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab - 1)
  entropy = -(confidence * math.log(confidence) + (vocab - 1) * low * math.log(low + 1e-20))
  return confidence, low, entropy


def _chunk_terms(logits_CxV, t_C, z_loss, label_smoothing):
  """Per row: (loss incl. z, z_term, correct, log Z, target one-hot [C, V] bool)."""
  vocab = logits_CxV.shape[-1]
  # The target logit by a masked sum, not a gather: it stays a fused elementwise +
  # reduce when the vocabulary dim is sharded.
  is_target = lax.broadcasted_iota(jnp.int32, logits_CxV.shape, 1) == t_C[:, None]
  row_max = jnp.max(logits_CxV, axis=-1)
  log_z = row_max + jnp.log(jnp.sum(jnp.exp(logits_CxV - row_max[:, None]), axis=-1))
  target_logp = jnp.sum(jnp.where(is_target, logits_CxV, 0.0), axis=-1) - log_z
  confidence, low, entropy = _smoothing(vocab, label_smoothing)
  if label_smoothing > 0.0:
    off_target = jnp.sum(logits_CxV, axis=-1) - vocab * log_z - target_logp
    loss = -(confidence * target_logp + low * off_target) - entropy
  else:
    loss = -target_logp
  z_term = z_loss * jnp.square(log_z)
  # jnp.argmax's answer (the first maximum) as a min-reduce of the max's ids: it fuses
  # like the other reductions, where XLA:CPU's variadic argmax reduce costs ~15% of
  # the chunk (tests/test_chunked_loss.py checks the tie rule).
  ids = lax.broadcasted_iota(jnp.int32, logits_CxV.shape, 1)
  first_max = jnp.min(jnp.where(logits_CxV == row_max[:, None], ids, vocab), axis=-1)
  correct = (first_max == t_C).astype(jnp.float32)
  return loss + z_term, z_term, correct, log_z, is_target


def _chunk_logits_grad(logits_CxV, log_z_C, is_target, w_C, z_loss, label_smoothing):
  """d sum(w * loss) / d logits, [C, V] float32: w * ((1 + 2 z log Z) p - q), q the
  (smoothed) target distribution; d(z log Z^2) = 2 z log Z p."""
  confidence, low, _ = _smoothing(logits_CxV.shape[-1], label_smoothing)
  probs = jnp.exp(logits_CxV - log_z_C[:, None])
  scale = 1.0 + 2.0 * z_loss * log_z_C
  target = jnp.where(is_target, confidence, low)
  return w_C[:, None] * (scale[:, None] * probs - target)


# ------------------------------------------------------------------ all chunks
def _to_chunks(x: Array, n: int, size: int) -> Array:
  """[N, ...] -> [n, size, ...]: chunk i holds rows i, i + n, ... (zero padded)."""
  pad = n * size - x.shape[0]
  if pad:
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
  x = x.reshape(size, n, *x.shape[1:])
  return jnp.swapaxes(x, 0, 1)


def _from_chunks(x: Array, rows: int) -> Array:
  """[n, size, ...] -> [rows, ...], the inverse of _to_chunks."""
  x = jnp.swapaxes(x, 0, 1)
  return x.reshape(-1, *x.shape[2:])[:rows]


def _kernel_axes(vocab_axis: int) -> tuple[str, str]:
  return ("vocab", "embed") if vocab_axis == 0 else ("embed", "vocab")


def _run(hidden, kernel, bias, targets, weights, vocab_axis, chunk_rows, z_loss,
         label_smoothing, dtype, with_grads):
  """The scan over chunks: (sums, grads or None); grads = (d hidden, d kernel, d bias) of
  the first sum."""
  rows = hidden.shape[0]
  n, size = num_chunks(rows, chunk_rows), chunk_size(rows, chunk_rows)
  kernel_lp = kernel.astype(dtype)
  bias_lp = None if bias is None else bias.astype(dtype)
  xs = (_to_chunks(hidden, n, size), _to_chunks(targets, n, size),
        _to_chunks(weights, n, size))

  def body(carry, chunk):
    h_CxD, t_C, w_C = chunk
    h_CxD = constrain(h_CxD, ("batch", "embed"))
    logits = _chunk_logits(h_CxD.astype(dtype), kernel_lp, bias_lp, vocab_axis, dtype)
    loss, z_term, correct, log_z, is_target = _chunk_terms(logits, t_C, z_loss,
                                                           label_smoothing)
    sums = tuple(s + jnp.sum(w_C * v) for s, v in zip(carry[0], (loss, z_term, correct)))
    if not with_grads:
      return (sums, None), None
    d_logits = _chunk_logits_grad(logits, log_z, is_target, w_C, z_loss, label_smoothing)
    d_lp = d_logits.astype(dtype)
    d_h = _dot(d_lp, kernel_lp, 1, vocab_axis).astype(hidden.dtype)
    # kernel [V, D]: d_logits^T h; [D, V]: h^T d_logits (rows contracted either way)
    d_k = (_dot(d_lp, h_CxD.astype(dtype), 0, 0) if vocab_axis == 0
           else _dot(h_CxD.astype(dtype), d_lp, 0, 0))
    d_kernel, d_bias = carry[1]
    d_kernel = constrain(d_kernel + d_k, _kernel_axes(vocab_axis))
    if d_bias is not None:
      d_bias = d_bias + jnp.sum(d_logits, axis=0)
    return (sums, (d_kernel, d_bias)), constrain(d_h, ("batch", "embed"))

  zero = jnp.zeros((), jnp.float32)
  grads0 = None
  if with_grads:
    grads0 = (jnp.zeros(kernel.shape, jnp.float32),
              None if bias is None else jnp.zeros(bias.shape, jnp.float32))
  carry = ((zero, zero, zero), grads0)
  if n == 1:  # no loop for a single chunk
    (sums, grads), d_h = body(carry, jax.tree.map(lambda x: x[0], xs))
    d_h = None if d_h is None else d_h[None]
  else:
    (sums, grads), d_h = lax.scan(body, carry, xs)
  if not with_grads:
    return sums, None
  d_kernel, d_bias = grads  # float32; cast to the params' dtype (float32 in the models)
  d_bias = None if d_bias is None else d_bias.astype(bias.dtype)
  return sums, (_from_chunks(d_h, rows), d_kernel.astype(kernel.dtype), d_bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _sums(hidden, kernel, bias, targets, weights, vocab_axis, chunk_rows, z_loss,
          label_smoothing, dtype):
  return _run(hidden, kernel, bias, targets, weights, vocab_axis, chunk_rows, z_loss,
              label_smoothing, dtype, with_grads=False)[0]


def _sums_fwd(hidden, kernel, bias, targets, weights, vocab_axis, chunk_rows, z_loss,
              label_smoothing, dtype):
  return _run(hidden, kernel, bias, targets, weights, vocab_axis, chunk_rows, z_loss,
              label_smoothing, dtype, with_grads=True)


def _sums_bwd(vocab_axis, chunk_rows, z_loss, label_smoothing, dtype, grads, cotangents):
  # Only the loss sum is differentiable: chunked_cross_entropy stops the gradient of the
  # z and accuracy sums, so their cotangents are zero here.
  g = cotangents[0]
  d_hidden, d_kernel, d_bias = grads
  scale = lambda x: None if x is None else (g * x.astype(jnp.float32)).astype(x.dtype)
  return scale(d_hidden), scale(d_kernel), scale(d_bias), None, None


_sums.defvjp(_sums_fwd, _sums_bwd)
