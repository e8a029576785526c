"""Shared building blocks: dense layers, embeddings, norms, MLP.

Parameters are float32 and carry logical axis names; computation runs in the
config's dtype with float32 accumulation in every matmul.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5x_like.models.config import ModelConfig

Array = jax.Array


def compute_dtype(config: ModelConfig):
  return jnp.bfloat16 if config.dtype == "bfloat16" else jnp.float32


def param_with_axes(module: nn.Module, name: str, init: Callable, shape: Sequence[int],
                    axes: Sequence[str | None]) -> Array:
  """A float32 parameter annotated with logical axis names."""
  return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape),
                      jnp.float32)


def constrain(x: Array, axes: Sequence[str | None]) -> Array:
  """Logical sharding constraint on an activation (no-op without rules and mesh)."""
  return nn.with_logical_constraint(x, tuple(axes))


def normal_init(std: float) -> Callable:
  return nn.initializers.normal(stddev=std)


def dot(x: Array, kernel: Array, contract: int, dtype, bias: Optional[Array] = None) -> Array:
  """Contracts the last `contract` dims of x with the first of kernel, plus `bias`.

  x [*batch, *C] . kernel [*C, *out] (+ bias [*out]) -> [*batch, *out] in `dtype`. Both
  operands are cast to `dtype` and every product accumulates in float32 (bf16 x bf16 ->
  f32 on matrix units), in the backward pass too; the bias is added in float32 before
  the result is rounded. See _dot_with_vjp.
  """
  return _dot_with_vjp(x, kernel, bias, contract, jnp.dtype(dtype), x.dtype, kernel.dtype)


def _dot_f32(a: Array, b: Array, a_dims, b_dims) -> Array:
  return jax.lax.dot_general(a, b, ((tuple(a_dims), tuple(b_dims)), ((), ())),
                             preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _dot_with_vjp(x: Array, kernel: Array, bias: Optional[Array], contract: int, dtype,
                  x_dtype, k_dtype) -> Array:
  """dot() whose gradients are `dtype` x `dtype` -> float32 products too.

  Plain autodiff would transpose a bf16 float32-accumulating product into float32 x
  bf16 matmuls (XLA upcasts both operands), several times slower than the forward on
  bf16 matrix units; here dx and dkernel are bf16 x bf16 -> f32, cast to x's and
  kernel's own dtypes (kernel grads stay float32 for float32 params). The bias
  gradient (the sum of g over the batch dims) is a product with ones: on CPU a matmul
  is much faster than XLA's reduction of a large array.
  """
  y, _ = _dot_with_vjp_fwd(x, kernel, bias, contract, dtype, x_dtype, k_dtype)
  return y


def _dot_with_vjp_fwd(x, kernel, bias, contract, dtype, x_dtype, k_dtype):
  x_lp, k_lp = x.astype(dtype), kernel.astype(dtype)
  y = _dot_f32(x_lp, k_lp, range(x.ndim - contract, x.ndim), range(contract))
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(dtype), (x_lp, k_lp, bias)


def _dot_with_vjp_bwd(contract, dtype, x_dtype, k_dtype, residuals, g):
  x_lp, k_lp, bias = residuals
  g = g.astype(dtype)
  batch = x_lp.ndim - contract          # leading dims of x (and of g)
  out = k_lp.ndim - contract            # trailing dims of kernel (and of g)
  # dx[*batch, *C] = g[*batch, *out] . kernel[*C, *out] over out
  dx = _dot_f32(g, k_lp, range(batch, batch + out), range(contract, contract + out))
  # dkernel[*C, *out] = x[*batch, *C] . g[*batch, *out] over batch. A product over the
  # leading dims makes XLA:CPU copy its left operand transposed (a strided loop fused
  # with the producer's elementwise ops), so the smaller of x and g goes on the left:
  # for the MLP's output layer g, not the 4x wider activation (MiniLM-L6's fine-tuning
  # step on 2 EPYC cores: 9% faster; docs/glue.md). The barrier keeps XLA from undoing it.
  if math.prod(x_lp.shape[batch:]) > math.prod(g.shape[batch:]):
    dk_t = jax.lax.optimization_barrier(_dot_f32(g, x_lp, range(batch), range(batch)))
    dk = jnp.transpose(dk_t, (*range(out, out + contract), *range(out)))
  else:
    dk = _dot_f32(x_lp, g, range(batch), range(batch))
  # The barrier keeps XLA from folding a caller's transpose of dk (Embed.attend passes
  # embedding.T) into this dot: that fold yields a bf16 x bf16 -> f32 dot the CPU
  # backend cannot run ("Unsupported element type for DotThunk").
  dk = jax.lax.optimization_barrier(dk)
  dbias = None
  if bias is not None:  # dbias[*out] = ones[*batch] . g[*batch, *out]
    dbias = _dot_f32(jnp.ones(g.shape[:batch], dtype), g, range(batch),
                     range(batch)).astype(bias.dtype)
  return dx.astype(x_dtype), dk.astype(k_dtype), dbias


_dot_with_vjp.defvjp(_dot_with_vjp_fwd, _dot_with_vjp_bwd)


class DenseGeneral(nn.Module):
  """y = x . W (+ b): contracts the last `len(in_axes)` dims of x into `features`.

  in_shape / features are the kernel's input and output shapes; `axes` names every
  kernel dim (input dims first).
  """

  features: tuple[int, ...]
  axes: tuple[str | None, ...]
  in_dims: int = 1
  use_bias: bool = True
  kernel_init: Callable = normal_init(0.02)
  dtype: object = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    in_shape = x.shape[x.ndim - self.in_dims:]
    kernel = param_with_axes(self, "kernel", self.kernel_init, (*in_shape, *self.features),
                             self.axes)
    bias = None
    if self.use_bias:
      bias = param_with_axes(self, "bias", nn.initializers.zeros, self.features,
                             self.axes[self.in_dims:])
    return dot(x, kernel, self.in_dims, self.dtype, bias)


class Embed(nn.Module):
  """Embedding table [num, features] with logical axes; `attend` gives tied logits."""

  num_embeddings: int
  features: int
  axes: tuple[str | None, str | None] = ("vocab", "embed")
  embedding_init: Callable = normal_init(0.02)
  dtype: object = jnp.float32

  def setup(self):
    self.embedding = param_with_axes(self, "embedding", self.embedding_init,
                                     (self.num_embeddings, self.features), self.axes)

  def __call__(self, ids_BxL: Array) -> Array:
    """[B, L] int ids -> [B, L, features] in dtype."""
    return jnp.take(self.embedding, ids_BxL, axis=0).astype(self.dtype)

  def attend(self, x_BxLxD: Array) -> Array:
    """[B, L, D] -> [B, L, num_embeddings] logits against the table."""
    return dot(x_BxLxD, self.embedding.T, 1, self.dtype)


class LayerNorm(nn.Module):
  """LayerNorm (mean and variance, scale + bias) or RMSNorm (scale only), in float32."""

  kind: str = "layernorm"
  eps: float = 1e-6
  dtype: object = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    features = x.shape[-1]
    x32 = x.astype(jnp.float32)
    if self.kind == "layernorm":
      mean = jnp.mean(x32, axis=-1, keepdims=True)
      var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
      y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    else:
      y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    y = y * param_with_axes(self, "scale", nn.initializers.ones, (features,), ("embed",))
    if self.kind == "layernorm":
      y = y + param_with_axes(self, "bias", nn.initializers.zeros, (features,), ("embed",))
    return y.astype(self.dtype)


def make_norm(config: ModelConfig, name: str) -> LayerNorm:
  return LayerNorm(kind=config.norm, eps=config.norm_eps, dtype=compute_dtype(config), name=name)


def activation(name: str) -> Callable[[Array], Array]:
  return {
      "relu": jax.nn.relu,
      "gelu": lambda x: jax.nn.gelu(x, approximate=False),
      "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
      "silu": jax.nn.silu,
  }[name]


# gated name -> activation of the gate branch
_GATED = {"reglu": "relu", "geglu": "gelu", "geglu_tanh": "gelu_tanh", "swiglu": "silu"}


def init_std(config: ModelConfig, fan_in: int, *, residual: bool = False) -> float:
  """Initialisation std of a kernel: T5 scales by fan-in, BERT/GPT use a fixed std."""
  if config.init_scheme == "t5":
    return config.init_std * fan_in ** -0.5
  std = config.init_std
  if residual and config.scale_residual_init:
    std /= math.sqrt(2 * (config.num_layers + (config.num_decoder_layers or 0)))
  return std


class Mlp(nn.Module):
  """Position-wise MLP: [B, L, D] -> [B, L, D], plain (wi) or gated (wi_0 * wi_1)."""

  config: ModelConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    dtype = compute_dtype(cfg)
    dense = lambda features, axes, std, name: DenseGeneral(
        features=(features,), axes=axes, use_bias=cfg.use_bias, kernel_init=normal_init(std),
        dtype=dtype, name=name)
    wi_std = init_std(cfg, cfg.d_model)
    if cfg.gated_mlp:
      gate = activation(_GATED[cfg.mlp_activation])
      h = gate(dense(cfg.d_ff, ("embed", "mlp"), wi_std, "wi_0")(x))
      h = h * dense(cfg.d_ff, ("embed", "mlp"), wi_std, "wi_1")(x)
    else:
      h = activation(cfg.mlp_activation)(dense(cfg.d_ff, ("embed", "mlp"), wi_std, "wi")(x))
    h = constrain(h, ("batch", "length", "mlp"))
    if cfg.mlp_hidden_dropout:
      h = nn.Dropout(cfg.dropout_rate)(h, deterministic=self.deterministic)
    return dense(cfg.d_model, ("mlp", "embed"), init_std(cfg, cfg.d_ff, residual=True), "wo")(h)
