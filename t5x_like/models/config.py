"""Model configuration: one frozen dataclass describes every family.

A `ModelConfig` picks each building block (embeddings, attention, positions, MLP,
norm, head) so that BERT, GPT-2 and T5 (v1.0 / v1.1) are points in one space.
Presets for the published sizes live in `PRESETS`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

FAMILIES = ("encoder", "decoder", "encoder_decoder")
MLP_ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "reglu", "geglu", "geglu_tanh", "swiglu")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "relative", "rope", "none")
INIT_SCHEMES = ("normal", "t5")
DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
ATTENTION_IMPLS = ("auto", "explicit", "xla", "cudnn", "pallas", "pallas_gpu")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of one model. Sizes follow the usual names (d_model, d_ff, ...)."""

  family: str = "encoder"
  vocab_size: int = 30522
  d_model: int = 768
  num_heads: int = 12
  num_kv_heads: Optional[int] = None  # None: = num_heads (MHA); 1: MQA; else GQA
  head_dim: Optional[int] = None  # None: d_model // num_heads
  d_ff: int = 3072
  num_layers: int = 12  # encoder layers (encoder, encoder_decoder) or decoder layers
  num_decoder_layers: Optional[int] = None  # encoder_decoder only; None: = num_layers
  mlp_activation: str = "gelu"
  norm: str = "layernorm"
  norm_eps: float = 1e-12
  pre_norm: bool = False  # False: post-norm (BERT); True: pre-norm (GPT-2, T5)
  final_norm: bool = False  # a norm after the last layer (pre-norm stacks)
  embedding_norm: bool = False  # a norm right after the embeddings (BERT)
  use_bias: bool = True
  position_embedding: str = "learned"
  max_position_embeddings: int = 512
  type_vocab_size: int = 0  # BERT token type (segment A/B) embeddings; 0: none
  relative_buckets: int = 32
  relative_max_distance: int = 128
  rope_theta: float = 10000.0
  scale_attention: bool = True  # False: no 1/sqrt(head_dim) (T5 folds it into init)
  tie_embeddings: bool = True  # output layer = token embedding transposed
  scale_decoder_output: bool = False  # T5 v1.0: final hidden * d_model**-0.5 before the logits
  mlm_head: bool = False  # BERT MLM transform + tied decoder + output bias
  nsp_head: bool = False  # BERT pooler + next-sentence classifier
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  attention_impl: str = "auto"  # ATTENTION_IMPLS: auto, or a kernel of attention_core.py
  mlp_hidden_dropout: bool = False  # T5: dropout after the MLP activation
  init_scheme: str = "normal"
  init_std: float = 0.02
  scale_residual_init: bool = False  # GPT-2: residual projections std / sqrt(2 L)
  dtype: str = "float32"  # compute dtype; parameters are always float32
  scan_layers: bool = False
  remat_policy: str = "none"
  z_loss: float = 0.0
  label_smoothing: float = 0.0
  # The LM / MLM loss from the final hidden states in chunks of this many rows per
  # device, never holding [rows, vocab] float32 logits (models/chunked_loss.py), where
  # that pays (chunked_loss.pays); 0: the loss on the model's full logits. Per device,
  # so that a pod's chunks stay as large as one GPU's (each chunk reads the output
  # weights once). 1024: configs/gpt_cpu.py's train step on a 2-core Xeon takes 263 MiB
  # of temporaries instead of 545 and 15% less time than with 0 (2048: 360 MiB, 9% less).
  loss_chunk_rows: int = 1024

  def __post_init__(self):
    self.validate()

  # ---------------------------------------------------------------- derived
  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def dim_per_head(self) -> int:
    return self.head_dim or self.d_model // self.num_heads

  @property
  def decoder_layers(self) -> int:
    return self.num_decoder_layers or self.num_layers

  @property
  def gated_mlp(self) -> bool:
    return self.mlp_activation in ("reglu", "geglu", "geglu_tanh", "swiglu")

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  # ------------------------------------------------------------- validation
  def validate(self) -> None:
    """Raises ValueError naming the field and what would be valid."""

    def choice(name, options):
      value = getattr(self, name)
      if value not in options:
        raise ValueError(f"ModelConfig.{name}={value!r}: expected one of {options}")

    choice("family", FAMILIES)
    choice("mlp_activation", MLP_ACTIVATIONS)
    choice("norm", NORMS)
    choice("position_embedding", POSITIONS)
    choice("init_scheme", INIT_SCHEMES)
    choice("dtype", DTYPES)
    choice("remat_policy", REMAT_POLICIES)
    choice("attention_impl", ATTENTION_IMPLS)
    for name in ("vocab_size", "d_model", "num_heads", "d_ff", "num_layers"):
      if int(getattr(self, name)) <= 0:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}: must be positive")
    if self.head_dim is None and self.d_model % self.num_heads:
      raise ValueError(
          f"ModelConfig.num_heads={self.num_heads} does not divide d_model={self.d_model};"
          " set head_dim explicitly")
    if self.num_heads % self.kv_heads:
      raise ValueError(
          f"ModelConfig.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
    if self.position_embedding == "rope" and self.dim_per_head % 2:
      raise ValueError(f"ModelConfig.head_dim={self.dim_per_head}: RoPE needs an even head_dim")
    if (self.mlm_head or self.nsp_head) and self.family != "encoder":
      raise ValueError("ModelConfig.mlm_head / nsp_head: only the encoder family has them")
    if self.family == "encoder_decoder" and self.position_embedding == "learned":
      raise ValueError("ModelConfig.position_embedding='learned': not supported for"
                       " encoder_decoder; use 'relative' or 'rope'")
    if self.num_decoder_layers is not None and self.family != "encoder_decoder":
      raise ValueError("ModelConfig.num_decoder_layers: only for family='encoder_decoder'")
    if int(self.loss_chunk_rows) < 0:
      raise ValueError(f"ModelConfig.loss_chunk_rows={self.loss_chunk_rows!r}: must be >= 0"
                       " (0: no chunking)")
    for name in ("dropout_rate", "attention_dropout_rate", "label_smoothing"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}: must be in [0, 1)")


def bert(layers: int, d_model: int, *, vocab_size: int = 30522, **kw) -> ModelConfig:
  """BERT: post-LayerNorm encoder, exact gelu, MLM + NSP heads (Devlin et al. 2019;
  google-research/bert modeling.py)."""
  base = dict(
      family="encoder", vocab_size=vocab_size, d_model=d_model, num_heads=d_model // 64,
      d_ff=4 * d_model, num_layers=layers, mlp_activation="gelu", norm="layernorm",
      norm_eps=1e-12, pre_norm=False, embedding_norm=True, use_bias=True,
      position_embedding="learned", max_position_embeddings=512, type_vocab_size=2,
      tie_embeddings=True, mlm_head=True, nsp_head=True)
  return ModelConfig(**{**base, **kw})


def gpt2(layers: int, d_model: int, **kw) -> ModelConfig:
  """GPT-2: pre-LayerNorm decoder, tanh gelu, tied logits (Radford et al. 2019;
  openai/gpt-2 model.py)."""
  base = dict(
      family="decoder", vocab_size=50257, d_model=d_model, num_heads=d_model // 64,
      d_ff=4 * d_model, num_layers=layers, mlp_activation="gelu_tanh", norm="layernorm",
      norm_eps=1e-5, pre_norm=True, final_norm=True, use_bias=True,
      position_embedding="learned", max_position_embeddings=1024, tie_embeddings=True,
      scale_residual_init=True)
  return ModelConfig(**{**base, **kw})


def t5(version: str, d_model: int, d_ff: int, layers: int, heads: int, **kw) -> ModelConfig:
  """T5 v1.0 ('1.0': relu, tied + scaled logits) or v1.1 ('1.1': gated gelu, untied)."""
  if version not in ("1.0", "1.1"):
    raise ValueError(f"t5 version={version!r}: expected '1.0' or '1.1'")
  v11 = version == "1.1"
  base = dict(
      family="encoder_decoder", vocab_size=32128, d_model=d_model, num_heads=heads,
      head_dim=64, d_ff=d_ff, num_layers=layers, num_decoder_layers=layers,
      mlp_activation="geglu_tanh" if v11 else "relu", norm="rmsnorm", norm_eps=1e-6,
      pre_norm=True, final_norm=True, use_bias=False, position_embedding="relative",
      scale_attention=False, tie_embeddings=not v11, scale_decoder_output=not v11,
      dropout_rate=0.0 if v11 else 0.1, attention_dropout_rate=0.0 if v11 else 0.1,
      mlp_hidden_dropout=True, init_scheme="t5", init_std=1.0)
  return ModelConfig(**{**base, **kw})


PRESETS = {
    "bert-tiny": lambda **kw: bert(2, 128, **kw),
    "bert-mini": lambda **kw: bert(4, 256, **kw),
    "bert-small": lambda **kw: bert(4, 512, **kw),
    "bert-medium": lambda **kw: bert(8, 512, **kw),
    "bert-base": lambda **kw: bert(12, 768, **kw),
    "bert-large": lambda **kw: bert(24, 1024, **kw),
    "gpt2-124m": lambda **kw: gpt2(12, 768, **kw),
    "gpt2-355m": lambda **kw: gpt2(24, 1024, **kw),
    "gpt2-774m": lambda **kw: gpt2(36, 1280, **kw),
    "gpt2-1558m": lambda **kw: gpt2(48, 1600, num_heads=25, **kw),
    "t5-small": lambda **kw: t5("1.0", 512, 2048, 6, 8, **kw),
    "t5-base": lambda **kw: t5("1.0", 768, 3072, 12, 12, **kw),
    "t5-v1_1-small": lambda **kw: t5("1.1", 512, 1024, 8, 6, **kw),
    "t5-v1_1-base": lambda **kw: t5("1.1", 768, 2048, 12, 12, **kw),
    "t5-v1_1-large": lambda **kw: t5("1.1", 1024, 2816, 24, 16, **kw),
}


def preset(name: str, **overrides) -> ModelConfig:
  """A published size by name (see PRESETS) with fields replaced by `overrides`.

  Overrides replace fields as given: shrinking d_model does not re-derive num_heads or
  d_ff, so set those too.
  """
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)})
  if unknown:
    raise ValueError(f"model overrides {unknown} are not ModelConfig fields")
  return PRESETS[name]().replace(**overrides)
