"""The model contract: pure functions around a Flax module.

  init(rng, batch_shapes) -> params
  loss_fn(params, batch, dropout_rng) -> (loss, metrics)
  logits(params, batch) -> logits

Batches are dicts of int arrays named as in T5X/seqio (encoder_input_tokens,
decoder_input_tokens, decoder_target_tokens, decoder_loss_weights, *_segment_ids,
*_positions) plus BERT's encoder_type_ids, mlm_positions, mlm_targets, mlm_weights and
nsp_labels. Generation and scoring of the decoder and encoder-decoder families are
t5x_like.infer.predict / score (infer builds on the models, not the other way); each
family says here what infer, bench and hf may ask of it (`generates`, `stepper`,
`hf_model_type`, ...).

The trainer never touches the module; `param_axes` gives the logical axis names of
every parameter for sharding.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.models import chunked_loss, cost, losses, steppers
from t5x_like.models.config import FAMILIES, ModelConfig
from t5x_like.models.families import (DecoderModule, EncoderDecoderModule, EncoderModule,
                                      output_layer)

Array = jax.Array
Params = Any


def _zeros_batch(batch_shapes: Mapping[str, Any]) -> dict[str, Array]:
  """Shapes (tuples) or arrays -> int32 zero arrays, so init sees only shapes."""
  out = {}
  for name, value in batch_shapes.items():
    shape = tuple(value) if isinstance(value, (tuple, list)) else np.shape(value)
    out[name] = jnp.zeros(shape, jnp.int32)
  return out


class Model:
  """Base class; subclasses set the module and the loss."""

  module_class: type[nn.Module]

  # What infer, bench and hf may ask of the family.
  generates = False  # infer.generate / predict decode it on the KV cache (`stepper`)
  scores = False  # infer.score: log-likelihood of decoder_target_tokens
  fills_masks = False  # infer's fill-mask mode: the likeliest tokens at mlm_positions
  continues_prompt = False  # generation continues the prompt (shared positions and cache)
  hf_model_type: Optional[str] = None  # Hugging Face config.json model_type (t5x_like.hf)

  # What fine-tuning (t5x_like.finetune) asks of the family.
  finetune_inputs: tuple[str, ...] = ()  # the input features of a fine-tuning batch
  finetunes_text_to_text = False  # trains the whole model on label strings (no head)
  pretrained_pooler = False  # pretraining has a [CLS] pooler a head may start from

  @classmethod
  def finetune_config(cls, config: ModelConfig) -> ModelConfig:
    """The config of the fine-tuning backbone (without unused pretraining heads)."""
    return config

  @classmethod
  def hidden_states_module(cls, config: ModelConfig, *, deterministic: bool) -> nn.Module:
    """The backbone module of fine-tuning (hidden_states reads it)."""
    return cls.module_class(config, deterministic=deterministic)

  @classmethod
  def hidden_states(cls, module: nn.Module, batch) -> tuple[Array, Array]:
    """(final hidden states [B, L, D], real-token mask [B, L]) for a task's head."""
    raise TypeError(f"{cls.__name__} has no hidden states for a task head (it fine-tunes"
                    " text to text)")

  @staticmethod
  def summary_index(valid_BxL: Array) -> Optional[Array]:
    """[B] the position a head reads one row's summary from; None: position 0 ([CLS])."""
    return None

  def __init__(self, config: ModelConfig):
    self.config = config

  def module(self, *, deterministic: bool = True, **kw) -> nn.Module:
    return self.module_class(self.config, deterministic=deterministic, **kw)

  # ------------------------------------------------------------------ init
  def _init_boxed(self, rng: Array, batch_shapes: Mapping[str, Any]) -> Params:
    return self.module().init({"params": rng}, _zeros_batch(batch_shapes))["params"]

  def init(self, rng: Array, batch_shapes: Optional[Mapping[str, Any]] = None) -> Params:
    """Float32 params (plain arrays) for a batch of the given shapes."""
    shapes = batch_shapes or self.example_batch_shapes()
    return nn.meta.unbox(self._init_boxed(rng, shapes))

  def param_axes(self, batch_shapes: Optional[Mapping[str, Any]] = None) -> Params:
    """Tree of PartitionSpecs of logical axis names, one per parameter."""
    shapes = batch_shapes or self.example_batch_shapes()
    boxed = jax.eval_shape(lambda: self._init_boxed(jax.random.key(0), shapes))
    return nn.get_partition_spec(boxed)

  def param_shapes(self, batch_shapes: Optional[Mapping[str, Any]] = None) -> Params:
    """ShapeDtypeStructs of the params, without allocating them."""
    shapes = batch_shapes or self.example_batch_shapes()
    return jax.eval_shape(lambda: self.init(jax.random.key(0), shapes))

  def num_params(self) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.param_shapes()))

  # ---------------------------------------------------------------- forward
  def apply(self, params: Params, batch: Mapping[str, Array], *,
            dropout_rng: Optional[Array] = None, **module_kw):
    module = self.module(deterministic=dropout_rng is None, **module_kw)
    rngs = {} if dropout_rng is None else {"dropout": dropout_rng}
    return module.apply({"params": params}, dict(batch), rngs=rngs)

  # Layer stacks -> the ModelConfig field that counts their layers.
  stack_fields: dict[str, str] = {}

  @classmethod
  def stack_layers(cls, config: ModelConfig) -> dict[str, int]:
    """{stack ('encoder' / 'decoder'): number of layers} of this family."""
    return {stack: getattr(config, field) or config.num_layers
            for stack, field in cls.stack_fields.items()}

  @classmethod
  def logits_rows(cls, config: ModelConfig, batch_shapes: Mapping[str, Any]) -> int:
    """Rows of the [rows, vocab] logits of a batch (decoder tokens unless overridden)."""
    return math.prod(batch_shapes["decoder_input_tokens"])

  @classmethod
  def forward_flops_breakdown(cls, config: ModelConfig,
                              batch_shapes: Mapping[str, Any]) -> dict[str, float]:
    """Matmul FLOPs of one forward over a batch of `batch_shapes`, by part (qo_proj,
    kv_proj, attention, mlp, head, logits); conventions in t5x_like/train/flops.py."""
    raise TypeError(f"{cls.__name__}: only the pretraining families (encoder, decoder,"
                    " encoder_decoder) have a FLOP formula")

  def logits(self, params: Params, batch: Mapping[str, Array]):
    """Deterministic forward; see each family for the output."""
    return self.apply(params, batch)

  def _chunked_token_metrics(self, prefix: str, params: Params, hidden: Array,
                             targets: Array, weights: Optional[Array], denominator: Array,
                             bias: Optional[Array] = None) -> dict[str, Array]:
    """chunked_loss.model_token_metrics of this model's output layer on `hidden`."""
    return chunked_loss.model_token_metrics(
        self.config, prefix, *output_layer(self.config, params), hidden, targets, weights,
        denominator, bias)


class EncoderModel(Model):
  """BERT. logits() -> {'mlm_logits': [B, L, V], 'nsp_logits': [B, 2]} at every position."""

  module_class = EncoderModule
  stack_fields = {"encoder": "num_layers"}
  fills_masks = True
  hf_model_type = "bert"
  finetune_inputs = ("encoder_input_tokens", "encoder_type_ids")
  pretrained_pooler = True

  @classmethod
  def finetune_config(cls, config):
    return config.replace(mlm_head=False, nsp_head=False)

  @staticmethod
  def hidden_states(module, batch):
    tokens, segments = batch["encoder_input_tokens"], batch.get("encoder_segment_ids")
    return module(batch)["hidden"], (tokens > 0 if segments is None else segments > 0)

  @classmethod
  def logits_rows(cls, config, batch_shapes):
    """Masked positions (every position without mlm_positions); 0 without an MLM head."""
    if not config.mlm_head:
      return 0
    return math.prod(batch_shapes.get("mlm_positions") or batch_shapes["encoder_input_tokens"])

  def example_batch_shapes(self, batch: int = 2, length: int = 8) -> dict[str, tuple]:
    return {"encoder_input_tokens": (batch, length), "encoder_type_ids": (batch, length)}

  @classmethod
  def forward_flops_breakdown(cls, config, batch_shapes):
    """The stack, then the MLM transform and logits at mlm_positions (every position
    without them) and the pooler and NSP classifier on [CLS]."""
    b, length = cost.batch_length(batch_shapes, "encoder_input_tokens")
    d, out, head = config.d_model, cost.encoder_stack(config, b, length), 0.0
    if config.mlm_head:
      p = (cost.batch_length(batch_shapes, "mlm_positions")[1]
           if batch_shapes.get("mlm_positions") is not None else length)
      head += 2.0 * b * p * d * d  # MLM transform
      out["logits"] = 2.0 * b * p * d * config.vocab_size
    if config.nsp_head:
      head += 2.0 * b * d * d + 2.0 * b * d * 2  # pooler + NSP classifier on [CLS]
    out["head"] = head
    return out

  def logits(self, params, batch):
    batch = {k: v for k, v in batch.items() if k != "mlm_positions"}
    out = self.apply(params, batch)
    return {k: v for k, v in out.items() if k != "hidden"}

  def loss_normalizers(self, batch) -> dict[str, Array]:
    """Denominators of the loss terms over `batch` (BERT's run_pretraining.py): MLM
    sum(w) + 1e-5, NSP B."""
    out = {}
    if "mlm_targets" in batch:
      weights = batch.get("mlm_weights")
      count = (jnp.sum(jnp.asarray(weights, jnp.float32)) if weights is not None
               else jnp.asarray(np.prod(batch["mlm_targets"].shape), jnp.float32))
      out["mlm"] = count + 1e-5
    if "nsp_labels" in batch:
      out["nsp"] = jnp.asarray(batch["nsp_labels"].shape[0], jnp.float32)
    return out

  def loss_fn(self, params, batch, dropout_rng, normalizers=None):
    """MLM loss at mlm_positions (run_pretraining.py: sum(w nll) / (sum(w) + 1e-5)) + NSP mean CE.

    normalizers: the denominators of a larger batch this one is a microbatch of
    (`loss_normalizers`), so that microbatch losses and gradients add up exactly.
    config.loss_chunk_rows > 0, where it pays (chunked_loss.pays): the MLM loss from
    the head's hidden states by row chunks, without [P, V] logits (chunked_loss.py).
    """
    cfg = self.config
    normalizers = normalizers or self.loss_normalizers(batch)
    chunked = (cfg.mlm_head and "mlm_targets" in batch
               and chunked_loss.runs(cfg, int(np.prod(batch["mlm_targets"].shape))))
    out = self.apply(params, batch, dropout_rng=dropout_rng, loss_hidden=chunked)
    loss = jnp.zeros((), jnp.float32)
    metrics = {}
    if chunked:
      metrics.update(self._chunked_token_metrics(
          "mlm", params, out["mlm_hidden"], batch["mlm_targets"], batch.get("mlm_weights"),
          normalizers["mlm"], params["mlm_bias"]))
      loss = loss + metrics["mlm_loss"]
    elif cfg.mlm_head and "mlm_targets" in batch:
      per_token, z_term = losses.cross_entropy(out["mlm_logits"], batch["mlm_targets"],
                                               z_loss=cfg.z_loss,
                                               label_smoothing=cfg.label_smoothing)
      metrics.update(losses.token_metrics("mlm", out["mlm_logits"], batch["mlm_targets"],
                                          batch.get("mlm_weights"), per_token,
                                          z_term if cfg.z_loss else None,
                                          normalizers["mlm"]))
      loss = loss + metrics["mlm_loss"]
    if cfg.nsp_head and "nsp_labels" in batch:
      per_pair, _ = losses.cross_entropy(out["nsp_logits"], batch["nsp_labels"])
      metrics.update(losses.token_metrics("nsp", out["nsp_logits"], batch["nsp_labels"], None,
                                          per_pair, None, normalizers["nsp"]))
      loss = loss + metrics["nsp_loss"]
    metrics["loss"] = loss
    return loss, metrics


class _SequenceModel(Model):
  """Shared loss, decoding and scoring for models whose output is [B, T, V] decoder logits."""

  generates = scores = True

  def loss_normalizers(self, batch) -> dict[str, Array]:
    """Denominator of the loss over `batch`: sum(decoder_loss_weights)."""
    weights = batch.get("decoder_loss_weights")
    if weights is None:
      return {"token": jnp.asarray(np.prod(batch["decoder_target_tokens"].shape), jnp.float32)}
    return {"token": jnp.maximum(jnp.sum(jnp.asarray(weights, jnp.float32)), 1.0)}

  def loss_fn(self, params, batch, dropout_rng, normalizers=None):
    """sum(w * nll) / sum(w) over decoder_target_tokens, w = decoder_loss_weights.

    normalizers: denominators of the full batch when this is a microbatch of it.
    config.loss_chunk_rows > 0, where it pays (chunked_loss.pays): from the decoder's
    hidden states by row chunks, without [B, T, V] logits (models/chunked_loss.py).
    """
    cfg = self.config
    normalizers = normalizers or self.loss_normalizers(batch)
    targets = batch["decoder_target_tokens"]
    if chunked_loss.runs(cfg, int(np.prod(targets.shape))):
      hidden = self.apply(params, batch, dropout_rng=dropout_rng, loss_hidden=True)
      metrics = self._chunked_token_metrics("token", params, hidden, targets,
                                            batch.get("decoder_loss_weights"),
                                            normalizers["token"])
      metrics["loss"] = metrics["token_loss"]
      return metrics["loss"], metrics
    logits = self.apply(params, batch, dropout_rng=dropout_rng)
    per_token, z_term = losses.cross_entropy(logits, targets, z_loss=cfg.z_loss,
                                             label_smoothing=cfg.label_smoothing)
    metrics = losses.token_metrics("token", logits, targets, batch.get("decoder_loss_weights"),
                                   per_token, z_term if cfg.z_loss else None,
                                   normalizers["token"])
    metrics["loss"] = metrics["token_loss"]
    return metrics["loss"], metrics

  # ------------------------------------------------------------- inference
  default_eos_id: Optional[int] = None  # eos of infer.predict() unless given

  def stepper(self, params: Params, batch: Mapping[str, Array], *, max_new_tokens: int,
              rows_per_example: int = 1, pad_id: int = 0,
              decoder_start_id: int = 0) -> steppers.Stepper:
    """The incremental decoder of `batch` on the KV cache (infer.generate's layout)."""
    raise TypeError(f"{type(self).__name__} has no incremental decoder")

  def decode_step(self, params: Params, batch_shapes: Mapping[str, Any]) -> steppers.CachedStep:
    """One cached decoding step for a batch of the training `batch_shapes`: the cache
    has the decoder length's slots (T5: over encoder outputs of the encoder length)."""
    raise TypeError(f"{type(self).__name__} has no incremental decoder")


class DecoderModel(_SequenceModel):
  """GPT-2. logits() -> [B, T, V] next-token logits of decoder_input_tokens.

  infer.predict() continues right-padded prompts (decoder_input_tokens, with
  decoder_segment_ids marking the real tokens); eos_id defaults to None (no stop).
  """

  module_class = DecoderModule
  stack_fields = {"decoder": "num_layers"}
  continues_prompt = True
  hf_model_type = "gpt2"
  finetune_inputs = ("decoder_input_tokens", "decoder_segment_ids")

  @classmethod
  def hidden_states_module(cls, config, *, deterministic):
    return DecoderModule(config, return_hidden=True, deterministic=deterministic)

  @staticmethod
  def hidden_states(module, batch):
    tokens, segments = batch["decoder_input_tokens"], batch.get("decoder_segment_ids")
    valid = jnp.ones(tokens.shape, bool) if segments is None else segments > 0
    return module(batch), valid

  @staticmethod
  def summary_index(valid_BxL):
    """Each row's last real token (0 for an empty row)."""
    return jnp.maximum(jnp.sum(valid_BxL, axis=1) - 1, 0).astype(jnp.int32)

  def example_batch_shapes(self, batch: int = 2, length: int = 8) -> dict[str, tuple]:
    return {"decoder_input_tokens": (batch, length)}

  @classmethod
  def forward_flops_breakdown(cls, config, batch_shapes):
    b, t = cost.batch_length(batch_shapes, "decoder_input_tokens")
    return cost.decoder_stack(config, b, t, config.num_layers)

  def stepper(self, params, batch, *, max_new_tokens, rows_per_example=1, pad_id=0,
              decoder_start_id=0):
    """Continues right-padded decoder_input_tokens [B, P] (steppers.prompt_lengths)."""
    del decoder_start_id  # the prompt's last token is fed first
    return steppers.decoder_only(self, params, batch["decoder_input_tokens"],
                                 steppers.prompt_lengths(batch), max_new_tokens=max_new_tokens,
                                 rows_per_example=rows_per_example, pad_id=pad_id)

  def decode_step(self, params, batch_shapes):
    del params  # the step takes them
    return steppers.decoder_only_step(self, batch_shapes["decoder_input_tokens"][1])


class EncoderDecoderModel(_SequenceModel):
  """T5. logits() -> [B, T, V] decoder logits given encoder and decoder inputs."""

  module_class = EncoderDecoderModule
  stack_fields = {"encoder": "num_layers", "decoder": "num_decoder_layers"}
  default_eos_id = 1  # T5's </s>; decoding starts from the pad id 0
  hf_model_type = "t5"
  finetune_inputs = ("encoder_input_tokens", "decoder_input_tokens")
  finetunes_text_to_text = True  # or the encoder alone under a head (hidden_states)

  @staticmethod
  def hidden_states(module, batch):
    """The encoder's output [B, L, D] and its real tokens (EncT5: the decoder unused)."""
    tokens, segments = batch["encoder_input_tokens"], batch.get("encoder_segment_ids")
    return module.encode(batch), (tokens > 0 if segments is None else segments > 0)

  def example_batch_shapes(self, batch: int = 2, length: int = 8) -> dict[str, tuple]:
    return {"encoder_input_tokens": (batch, length), "decoder_input_tokens": (batch, length)}

  @classmethod
  def forward_flops_breakdown(cls, config, batch_shapes):
    b, length = cost.batch_length(batch_shapes, "encoder_input_tokens")
    _, t = cost.batch_length(batch_shapes, "decoder_input_tokens")
    return cost.add(cost.encoder_stack(config, b, length),
                    cost.decoder_stack(config, b, t, config.decoder_layers, length))

  def stepper(self, params, batch, *, max_new_tokens, rows_per_example=1, pad_id=0,
              decoder_start_id=0):
    """Decodes from decoder_start_id over encoder_input_tokens [B, L] (0 = padding)."""
    del pad_id  # the outputs' padding is the search's
    return steppers.encoder_decoder(self, params, batch["encoder_input_tokens"],
                                    max_new_tokens=max_new_tokens,
                                    rows_per_example=rows_per_example,
                                    decoder_start_id=decoder_start_id)

  def decode_step(self, params, batch_shapes):
    """Over encoder inputs of ones (the tokens do not change the step time)."""
    encoder_tokens_BxL = jnp.ones(batch_shapes["encoder_input_tokens"][:2], jnp.int32)
    return steppers.encoder_decoder_step(self, params, encoder_tokens_BxL,
                                         batch_shapes["decoder_input_tokens"][1])


# config.FAMILIES (the values ModelConfig.family takes), each with its model class.
MODEL_CLASSES: dict[str, type[Model]] = dict(
    zip(FAMILIES, (EncoderModel, DecoderModel, EncoderDecoderModel), strict=True))


def model_class(config: ModelConfig) -> type[Model]:
  """The model class of config.family: what the family is and can do (stack_fields,
  finetunes_text_to_text, ...) without building a model."""
  return MODEL_CLASSES[config.family]


def build_model(config: ModelConfig) -> Model:
  """The model of config (its family's model class)."""
  return model_class(config)(config)
