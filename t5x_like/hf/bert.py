"""BERT (BertForPreTraining) <-> our encoder family."""

from __future__ import annotations

from t5x_like.hf.io import require, unsupported
from t5x_like.hf.mapping import Path, TensorSpec, check_expressible, linear_spec, norm_spec
from t5x_like.models.config import ModelConfig, bert

ARCHITECTURE = "BertForPreTraining"
BASE_PREFIX = "bert."  # the bare BertModel's tensors inside the models with heads
# What the forms transformers saves hold besides the backbone (names without
# BASE_PREFIX), for fine-tuning's log of what it skips.
HEADS = {"cls.predictions.": "the MLM head", "cls.seq_relationship.": "the NSP head",
         "pooler.": "the pooler", "classifier.": "the checkpoint's task head",
         "qa_outputs.": "the checkpoint's question-answering head"}
BUFFERS = ("embeddings.position_ids",)  # not parameters: never reported
# Tied copies and buffers that the model does not need as parameters.
IGNORED = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias",
           "embeddings.position_ids")
_ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh",
                "gelu_pytorch_tanh": "gelu_tanh"}


def config_from_hf(hf: dict, path: str) -> ModelConfig:
  act = hf.get("hidden_act", "gelu")
  if act not in _ACTIVATIONS:
    raise unsupported(path, "hidden_act", act, sorted(_ACTIVATIONS))
  if hf.get("position_embedding_type", "absolute") != "absolute":
    raise unsupported(path, "position_embedding_type", hf["position_embedding_type"],
                      "'absolute'")
  d_model = require(hf, "hidden_size", path)
  return bert(
      require(hf, "num_hidden_layers", path), d_model,
      vocab_size=require(hf, "vocab_size", path),
      num_heads=require(hf, "num_attention_heads", path),
      d_ff=require(hf, "intermediate_size", path), mlp_activation=_ACTIVATIONS[act],
      max_position_embeddings=hf.get("max_position_embeddings", 512),
      type_vocab_size=hf.get("type_vocab_size", 2), norm_eps=hf.get("layer_norm_eps", 1e-12),
      dropout_rate=hf.get("hidden_dropout_prob", 0.1),
      attention_dropout_rate=hf.get("attention_probs_dropout_prob", 0.1),
      init_std=hf.get("initializer_range", 0.02))


def config_to_hf(cfg: ModelConfig) -> dict:
  act = {v: k for k, v in _ACTIVATIONS.items() if k != "gelu_pytorch_tanh"}[cfg.mlp_activation]
  return {
      "architectures": [ARCHITECTURE], "model_type": "bert", "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "intermediate_size": cfg.d_ff, "hidden_act": act,
      "max_position_embeddings": cfg.max_position_embeddings,
      "type_vocab_size": cfg.type_vocab_size, "layer_norm_eps": cfg.norm_eps,
      "hidden_dropout_prob": cfg.dropout_rate,
      "attention_probs_dropout_prob": cfg.attention_dropout_rate,
      "initializer_range": cfg.init_std, "pad_token_id": 0, "tie_word_embeddings": True,
      "position_embedding_type": "absolute",
  }


def check_config(cfg: ModelConfig) -> None:
  """Our config must be one that BertForPreTraining can express."""
  wanted = bert(cfg.num_layers, cfg.d_model, vocab_size=cfg.vocab_size,
                num_heads=cfg.num_heads, d_ff=cfg.d_ff, mlp_activation=cfg.mlp_activation,
                max_position_embeddings=cfg.max_position_embeddings,
                type_vocab_size=cfg.type_vocab_size, norm_eps=cfg.norm_eps)
  check_expressible(cfg, wanted, ARCHITECTURE)


def spec(path: Path) -> TensorSpec:
  top, leaf = path[0], path[-1]
  if top in ("token_embed", "position_embed", "type_embed"):
    name = {"token_embed": "word_embeddings", "position_embed": "position_embeddings",
            "type_embed": "token_type_embeddings"}[top]
    return TensorSpec(f"bert.embeddings.{name}.weight", "same")
  if top == "embedding_norm":
    return norm_spec("bert.embeddings.LayerNorm", leaf)
  if top == "mlm_bias":
    return TensorSpec("cls.predictions.bias", "vector")
  if top == "mlm_norm":
    return norm_spec("cls.predictions.transform.LayerNorm", leaf)
  heads = {"pooler": "bert.pooler.dense", "mlm_transform": "cls.predictions.transform.dense",
           "nsp": "cls.seq_relationship"}
  if top in heads:
    return linear_spec(heads[top], leaf)
  # encoder/layers_i/<sublayer>/...
  i = int(path[1].split("_")[1])
  layer = f"bert.encoder.layer.{i}"
  sub = path[2]
  if sub == "self_attention":
    proj = path[3]
    if proj == "out":
      return linear_spec(f"{layer}.attention.output.dense", leaf, in_dims=2)
    return linear_spec(f"{layer}.attention.self.{proj}", leaf)
  if sub == "self_attention_norm":
    return norm_spec(f"{layer}.attention.output.LayerNorm", leaf)
  if sub == "mlp":
    return linear_spec(f"{layer}.intermediate.dense" if path[3] == "wi" else f"{layer}.output.dense",
                  leaf)
  if sub == "mlp_norm":
    return norm_spec(f"{layer}.output.LayerNorm", leaf)
  raise KeyError(f"no BERT tensor for param {'/'.join(path)}")


def part_of(path: Path) -> str:
  """The part of the model a parameter belongs to (hf.load_backbone loads by parts)."""
  top = path[0]
  if top in ("token_embed", "position_embed", "type_embed", "embedding_norm"):
    return "embeddings"
  if top in ("mlm_transform", "mlm_norm", "mlm_bias"):
    return "mlm_head"
  return "nsp_head" if top == "nsp" else top  # encoder, pooler


def backbone_parts(pooler: bool, decoder: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(the parts fine-tuning loads, those of them a checkpoint may lack): the pooler
  where the task's head reads it; BertForTokenClassification / QuestionAnswering /
  MaskedLM save none."""
  del decoder
  return ("embeddings", "encoder") + (("pooler",) if pooler else ()), ("pooler",)


def resolve_factory(names: set[str]):
  """Old checkpoints: LayerNorm gamma/beta; BertModel-style names without 'bert.'."""

  def resolve(name: str) -> str:
    candidates = [name, name.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
        "LayerNorm.bias", "LayerNorm.beta")]
    if name.startswith("bert."):
      candidates += [c[len("bert."):] for c in candidates]
    return next((c for c in candidates if c in names), name)

  return resolve
