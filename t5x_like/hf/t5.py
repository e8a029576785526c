"""T5 v1.0 / v1.1 (T5ForConditionalGeneration) <-> our encoder-decoder family."""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from t5x_like.hf.io import Weights, require, unsupported
from t5x_like.hf.mapping import Path, TensorSpec, check_expressible, linear_spec, norm_spec
from t5x_like.models.config import ModelConfig, t5

log = logging.getLogger(__name__)

ARCHITECTURE = "T5ForConditionalGeneration"
IGNORED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight")
# The model inside T5ForSequenceClassification / T5ForTokenClassification (the others
# have no prefix).
BASE_PREFIX = "transformer."
HEADS = {"decoder.": "the decoder", "lm_head.": "the output layer (lm_head)",
         "classification_head.": "the checkpoint's classification head",
         "classifier.": "the checkpoint's task head",
         "qa_outputs.": "the checkpoint's question-answering head"}
BUFFERS = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")  # copies of shared
_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu"}
_GATED = {"relu": "reglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh", "silu": "swiglu"}


def config_from_hf(hf: dict, path: str, weights: Optional[Weights] = None) -> ModelConfig:
  proj = hf.get("feed_forward_proj", "relu")
  gated = proj.startswith("gated-")
  act = "gelu_new" if proj == "gated-gelu" else hf.get("dense_act_fn", proj.split("-")[-1])
  if act not in _ACTIVATIONS or (not gated and _ACTIVATIONS[act] == "silu"):
    raise unsupported(path, "feed_forward_proj", proj, "relu, gelu or gated-{relu,gelu,silu}")
  mlp = _GATED[_ACTIVATIONS[act]] if gated else _ACTIVATIONS[act]
  d_model = require(hf, "d_model", path)
  vocab = require(hf, "vocab_size", path)
  # transformers 5 always ties T5's lm_head to `shared`; older exports of v1.1 carry
  # a separate lm_head, which we keep. Without weights (an architecture alone, to
  # initialise at random): as config.json says.
  if weights is None:
    untied = not hf.get("tie_word_embeddings", True)
  else:
    untied = ("lm_head.weight" in weights and "shared.weight" in weights
              and not np.array_equal(weights.read("lm_head.weight"),
                                     weights.read("shared.weight")))
  scale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True))
  layers = require(hf, "num_layers", path)
  return t5(
      "1.0", d_model, require(hf, "d_ff", path), layers, require(hf, "num_heads", path),
      vocab_size=vocab, head_dim=require(hf, "d_kv", path),
      num_decoder_layers=hf.get("num_decoder_layers") or layers, mlp_activation=mlp,
      norm_eps=hf.get("layer_norm_epsilon", 1e-6),
      relative_buckets=hf.get("relative_attention_num_buckets", 32),
      relative_max_distance=hf.get("relative_attention_max_distance", 128),
      tie_embeddings=not untied, scale_decoder_output=bool(scale),
      dropout_rate=hf.get("dropout_rate", 0.1),
      attention_dropout_rate=hf.get("dropout_rate", 0.1),
      init_std=hf.get("initializer_factor", 1.0))


def config_to_hf(cfg: ModelConfig) -> dict:
  gated = cfg.gated_mlp
  base = {v: k for k, v in _GATED.items()}[cfg.mlp_activation] if gated else cfg.mlp_activation
  hf_act = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "silu": "silu"}[base]
  proj = "gated-gelu" if hf_act == "gelu_new" and gated else (
      f"gated-{hf_act}" if gated else hf_act)
  if not cfg.tie_embeddings:
    log.warning("exporting a T5 with an untied output layer: model.safetensors holds"
                " lm_head.weight, but transformers 5.x ties T5's lm_head to shared.weight"
                " when loading")
  return {
      "architectures": [ARCHITECTURE], "model_type": "t5", "vocab_size": cfg.vocab_size,
      "d_model": cfg.d_model, "d_kv": cfg.dim_per_head, "d_ff": cfg.d_ff,
      "num_layers": cfg.num_layers, "num_decoder_layers": cfg.decoder_layers,
      "num_heads": cfg.num_heads, "feed_forward_proj": proj, "dense_act_fn": hf_act,
      "is_gated_act": gated, "layer_norm_epsilon": cfg.norm_eps,
      "relative_attention_num_buckets": cfg.relative_buckets,
      "relative_attention_max_distance": cfg.relative_max_distance,
      "dropout_rate": cfg.dropout_rate, "initializer_factor": cfg.init_std,
      "tie_word_embeddings": cfg.tie_embeddings,
      "scale_decoder_outputs": cfg.scale_decoder_output, "is_encoder_decoder": True,
      "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0,
  }


def check_config(cfg: ModelConfig) -> None:
  wanted = t5("1.0", cfg.d_model, cfg.d_ff, cfg.num_layers, cfg.num_heads,
              vocab_size=cfg.vocab_size, head_dim=cfg.dim_per_head,
              num_decoder_layers=cfg.decoder_layers, mlp_activation=cfg.mlp_activation,
              norm_eps=cfg.norm_eps, relative_buckets=cfg.relative_buckets,
              relative_max_distance=cfg.relative_max_distance,
              tie_embeddings=cfg.tie_embeddings, scale_decoder_output=cfg.scale_decoder_output)
  check_expressible(cfg, wanted, ARCHITECTURE)


_ATTENTION = {"query": "q", "key": "k", "value": "v", "out": "o"}


def spec(path: Path) -> TensorSpec:
  top, leaf = path[0], path[-1]
  if top == "token_embed":
    return TensorSpec("shared.weight", "same")
  if top == "logits_dense":
    return linear_spec("lm_head", leaf)
  stack = top  # encoder | decoder
  if path[1] == "relpos":
    return TensorSpec(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                      "transpose")
  if path[1] == "final_norm":
    return norm_spec(f"{stack}.final_layer_norm", leaf)
  i = int(path[1].split("_")[1])
  sub = path[2]
  index = {"self_attention": 0, "cross_attention": 1, "mlp": 1 if stack == "encoder" else 2}
  module = {"self_attention": "SelfAttention", "cross_attention": "EncDecAttention",
            "mlp": "DenseReluDense"}
  base = sub[:-len("_norm")] if sub.endswith("_norm") else sub
  layer = f"{stack}.block.{i}.layer.{index[base]}"
  if sub.endswith("_norm"):
    return norm_spec(f"{layer}.layer_norm", leaf)
  if sub == "mlp":
    return linear_spec(f"{layer}.DenseReluDense.{path[3]}", leaf)
  return linear_spec(f"{layer}.{module[sub]}.{_ATTENTION[path[3]]}", leaf,
                     in_dims=2 if path[3] == "out" else 1)


def part_of(path: Path) -> str:
  return {"token_embed": "embeddings", "logits_dense": "lm_head"}.get(path[0], path[0])


def backbone_parts(pooler: bool, decoder: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(the parts fine-tuning loads: the encoder, and the decoder where it is trained
  (text to text), those a checkpoint may lack): T5EncoderModel saves no decoder."""
  del pooler
  return ("embeddings", "encoder") + (("decoder", "lm_head") if decoder else ()), ("decoder",)


def resolve_factory(names: set[str]):
  """T5ForSequenceClassification and T5ForTokenClassification keep the model under
  'transformer.'."""

  def resolve(name: str) -> str:
    if name not in names and "transformer." + name in names:
      return "transformer." + name
    return name

  return resolve
