"""GPT-2 (GPT2LMHeadModel) <-> our decoder family."""

from __future__ import annotations

from t5x_like.hf.io import require, unsupported
from t5x_like.hf.mapping import Path, TensorSpec, check_expressible, norm_spec
from t5x_like.models.config import ModelConfig, gpt2

ARCHITECTURE = "GPT2LMHeadModel"
IGNORED = ("lm_head.weight", "attn.bias", "attn.masked_bias")
BASE_PREFIX = "transformer."  # the bare GPT2Model's tensors inside the models with heads
HEADS = {"lm_head.": "the LM head (tied to the embeddings)",
         "score.": "the checkpoint's classification head",
         "classifier.": "the checkpoint's task head",
         "qa_outputs.": "the checkpoint's question-answering head",
         "multiple_choice_head.": "the checkpoint's multiple-choice head"}
BUFFERS = ("attn.bias", "attn.masked_bias")
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                "relu": "relu"}


def config_from_hf(hf: dict, path: str) -> ModelConfig:
  act = hf.get("activation_function", "gelu_new")
  if act not in _ACTIVATIONS:
    raise unsupported(path, "activation_function", act, sorted(_ACTIVATIONS))
  for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                  ("add_cross_attention", False)):
    if hf.get(key, ok) != ok:
      raise unsupported(path, key, hf[key], ok)
  d_model = require(hf, "n_embd", path)
  return gpt2(
      require(hf, "n_layer", path), d_model, vocab_size=require(hf, "vocab_size", path),
      num_heads=require(hf, "n_head", path), d_ff=hf.get("n_inner") or 4 * d_model,
      mlp_activation=_ACTIVATIONS[act], norm_eps=hf.get("layer_norm_epsilon", 1e-5),
      max_position_embeddings=hf.get("n_positions", 1024),
      dropout_rate=hf.get("resid_pdrop", 0.1), attention_dropout_rate=hf.get("attn_pdrop", 0.1),
      init_std=hf.get("initializer_range", 0.02))


def config_to_hf(cfg: ModelConfig) -> dict:
  act = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}[cfg.mlp_activation]
  return {
      "architectures": [ARCHITECTURE], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
      "n_embd": cfg.d_model, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
      "n_inner": cfg.d_ff, "activation_function": act, "layer_norm_epsilon": cfg.norm_eps,
      "n_positions": cfg.max_position_embeddings, "resid_pdrop": cfg.dropout_rate,
      "embd_pdrop": cfg.dropout_rate, "attn_pdrop": cfg.attention_dropout_rate,
      "initializer_range": cfg.init_std, "scale_attn_weights": True,
      "tie_word_embeddings": True,
  }


def check_config(cfg: ModelConfig) -> None:
  wanted = gpt2(cfg.num_layers, cfg.d_model, vocab_size=cfg.vocab_size, num_heads=cfg.num_heads,
                d_ff=cfg.d_ff, mlp_activation=cfg.mlp_activation, norm_eps=cfg.norm_eps,
                max_position_embeddings=cfg.max_position_embeddings)
  check_expressible(cfg, wanted, ARCHITECTURE)


def spec(path: Path) -> TensorSpec:
  top, leaf = path[0], path[-1]
  if top == "token_embed":
    return TensorSpec("transformer.wte.weight", "same")
  if top == "position_embed":
    return TensorSpec("transformer.wpe.weight", "same")
  if path[1] == "final_norm":
    return norm_spec("transformer.ln_f", leaf)
  i = int(path[1].split("_")[1])
  block = f"transformer.h.{i}"
  sub = path[2]
  if sub == "self_attention_norm":
    return norm_spec(f"{block}.ln_1", leaf)
  if sub == "mlp_norm":
    return norm_spec(f"{block}.ln_2", leaf)
  if sub == "self_attention":
    proj = path[3]
    if proj == "out":
      return _conv1d(f"{block}.attn.c_proj", leaf, in_dims=2)
    part = ({"query": 0, "key": 1, "value": 2}[proj], 3)
    return _conv1d(f"{block}.attn.c_attn", leaf, part=part)
  if sub == "mlp":
    return _conv1d(f"{block}.mlp.{'c_fc' if path[3] == 'wi' else 'c_proj'}", leaf)
  raise KeyError(f"no GPT-2 tensor for param {'/'.join(path)}")


def part_of(path: Path) -> str:
  return "embeddings" if path[0] in ("token_embed", "position_embed") else "decoder"


def backbone_parts(pooler: bool, decoder: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(the parts fine-tuning loads: all of GPT-2 but its tied LM head, none optional)."""
  del pooler, decoder
  return ("embeddings", "decoder"), ()


def _conv1d(prefix: str, leaf: str, in_dims: int = 1, part=(0, 1)) -> TensorSpec:
  if leaf == "kernel":
    return TensorSpec(f"{prefix}.weight", "conv1d", in_dims, part)
  return TensorSpec(f"{prefix}.bias", "vector", part=part)


def resolve_factory(names: set[str]):
  """The original OpenAI export has no 'transformer.' prefix."""

  def resolve(name: str) -> str:
    if name not in names and name.startswith("transformer."):
      return name[len("transformer."):]
    return name

  return resolve
