"""FinetuneModel: a backbone (any family) plus a task head, with the model contract.

  model = FinetuneModel(pretrained.config, "classification", num_labels=2)
  params = model.init(rng, batch_shapes)            # {'backbone': ..., 'head': ...}
  params = model.load_backbone(params, pretrained_params)
  loss, metrics = model.loss_fn(params, batch, dropout_rng)   # train.step trains it
  model.logits(params, batch), model.predict(params, batch)

Task x family:
  classification        encoder: pooled [CLS] -> C; decoder: last real token
                        (decoder_segment_ids) -> C; encoder_decoder: text to text, the
                        EncoderDecoder loss on decoder targets, and logits = each label
                        string's log-likelihood (rank classification, one forward pass;
                        needs label_targets [C, T] from encoding.label_targets)
  token_classification  per position -> C (labels [B, L], -1 ignored)
  span_extraction       start / end logits over real positions (start_positions,
                        end_positions [B])
The backbone drops the pretraining heads fine-tuning does not use (BERT's MLM / NSP,
GPT's output layer); BERT's pooler lives in the head ('head/pooler') and
load_backbone copies the pretrained one there. Text-to-text keeps the whole T5 and has
no head params.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.finetune import heads
from t5x_like.models.config import ModelConfig
from t5x_like.models.families import DecoderModule, EncoderDecoderModule, EncoderModule
from t5x_like.models.layers import compute_dtype
from t5x_like.models.model import EncoderDecoderModel, Model

Array = jax.Array
Params = Any
TASKS = ("classification", "token_classification", "span_extraction")


def backbone_config(config: ModelConfig) -> ModelConfig:
  """The pretrained config without the pretraining heads fine-tuning does not use."""
  if config.family == "encoder":
    return config.replace(mlm_head=False, nsp_head=False)
  return config


class FinetuneModule(nn.Module):
  """Backbone ('backbone') + head ('head'). __call__(batch) -> the task's logits."""

  config: ModelConfig
  task: str
  num_labels: int = 0
  pooler: bool = True
  pooling: str = "cls"
  classifier_dropout: float = 0.1
  deterministic: bool = True

  def setup(self):
    cfg = self.config
    kw = dict(deterministic=self.deterministic)
    head_kw = dict(init_std=cfg.init_std, dtype=compute_dtype(cfg))
    drop_kw = dict(dropout_rate=self.classifier_dropout, deterministic=self.deterministic)
    if cfg.family == "encoder":
      self.backbone = EncoderModule(cfg, **kw)
    elif cfg.family == "decoder":
      self.backbone = DecoderModule(cfg, return_hidden=True, **kw)
    else:
      self.backbone = EncoderDecoderModule(cfg, **kw)
    if self.text_to_text:
      self.head = None
    elif self.task == "classification":
      self.head = heads.ClassificationHead(self.num_labels, pooler=self.pooler,
                                           pooling=self.pooling, **head_kw, **drop_kw)
    elif self.task == "token_classification":
      self.head = heads.TokenClassificationHead(self.num_labels, **head_kw, **drop_kw)
    else:
      self.head = heads.SpanExtractionHead(**head_kw)

  @property
  def text_to_text(self) -> bool:
    return self.config.family == "encoder_decoder"

  def _hidden_and_valid(self, batch) -> tuple[Array, Array]:
    """Final hidden [B, L, D] and real-token mask [B, L]."""
    if self.config.family == "encoder":
      tokens = batch["encoder_input_tokens"]
      segments = batch.get("encoder_segment_ids")
      return self.backbone(batch)["hidden"], (tokens > 0 if segments is None else segments > 0)
    tokens = batch["decoder_input_tokens"]
    segments = batch.get("decoder_segment_ids")
    valid = jnp.ones(tokens.shape, bool) if segments is None else segments > 0
    return self.backbone(batch), valid

  def __call__(self, batch):
    if self.text_to_text:
      return self.backbone(batch)  # [B, T, V] decoder logits
    hidden_BxLxD, valid_BxL = self._hidden_and_valid(batch)
    if self.task == "classification":
      index_B = None if self.config.family == "encoder" else heads.last_token_index(valid_BxL)
      return self.head(hidden_BxLxD, index_B, valid_BxL)
    if self.task == "token_classification":
      return self.head(hidden_BxLxD)
    start_BxL, end_BxL = self.head(hidden_BxLxD, valid_BxL)
    return {"start_logits": start_BxL, "end_logits": end_BxL}

  def rank_scores(self, batch, targets_CxT: Array) -> Array:
    """[B, C] log-likelihood of each label target (tokens + eos, 0-padded) given the
    encoder inputs: the encoder runs once, the decoder once per (row, label)."""
    encoded_BxLxD = self.backbone.encode(batch)
    batch_size, num_labels = encoded_BxLxD.shape[0], targets_CxT.shape[0]
    enc_tokens = jnp.repeat(batch["encoder_input_tokens"], num_labels, axis=0)
    targets_NxT = jnp.tile(targets_CxT, (batch_size, 1))  # N = B * C, row b*C + c
    inputs_NxT = jnp.concatenate([jnp.zeros_like(targets_NxT[:, :1]), targets_NxT[:, :-1]], 1)
    logits_NxTxV = self.backbone.decode_logits(
        jnp.repeat(encoded_BxLxD, num_labels, axis=0),
        {"encoder_input_tokens": enc_tokens, "decoder_input_tokens": inputs_NxT})
    logp = jax.nn.log_softmax(logits_NxTxV.astype(jnp.float32), axis=-1)
    token_logp_NxT = jnp.take_along_axis(logp, targets_NxT[..., None], -1)[..., 0]
    score_N = jnp.sum(token_logp_NxT * (targets_NxT > 0), axis=-1)
    return score_N.reshape(batch_size, num_labels)


class FinetuneModel(Model):
  """The model contract of t5x_like.models.model for a backbone + task head.

  config: the backbone's ModelConfig (a pretrained model's config works: its unused
  pretraining heads are dropped). num_labels: classes (tags). label_targets: [C, T]
  label strings (text-to-text classification). pooler: BERT classification through the
  pooler (default True, as BertForSequenceClassification). pooling: "cls" (the [CLS] /
  last token) or "mean" (the mean of the real tokens' final hidden states). classifier_dropout:
  default config.dropout_rate. max_answer_tokens: longest span predict() returns.
  """

  module_class = FinetuneModule

  def __init__(self, config: ModelConfig, task: str, *, num_labels: int = 0,
               label_targets: Optional[np.ndarray] = None, pooler: bool = True,
               pooling: str = "cls", classifier_dropout: Optional[float] = None,
               max_answer_tokens: int = 30):
    if task not in TASKS:
      raise ValueError(f"task={task!r}: expected one of {TASKS}")
    if config.family == "encoder_decoder" and task != "classification":
      raise ValueError(f"task={task!r}: the encoder_decoder family fine-tunes text to text;"
                       " only 'classification' (rank classification) is built in")
    if config.family == "encoder_decoder":
      if label_targets is None:
        raise ValueError("text-to-text classification needs label_targets [C, T]"
                         " (t5x_like.finetune.encoding.label_targets)")
      label_targets = np.asarray(label_targets, np.int32)
      num_labels = label_targets.shape[0]
    elif task != "span_extraction" and num_labels < 1:
      raise ValueError(f"task={task!r} needs num_labels >= 1, got {num_labels}")
    super().__init__(backbone_config(config))
    self.task = task
    self.num_labels = int(num_labels)
    self.label_targets = label_targets
    self.pooler = bool(pooler) and config.family == "encoder"
    if pooling not in heads.POOLINGS:
      raise ValueError(f"pooling={pooling!r}: expected one of {heads.POOLINGS}")
    self.pooling = pooling
    self.classifier_dropout = (config.dropout_rate if classifier_dropout is None
                               else float(classifier_dropout))
    self.max_answer_tokens = max_answer_tokens
    self.text_to_text = config.family == "encoder_decoder"
    self.seq2seq = EncoderDecoderModel(self.config) if self.text_to_text else None

  def module(self, *, deterministic: bool = True, **kw) -> nn.Module:
    return FinetuneModule(self.config, self.task, num_labels=self.num_labels,
                          pooler=self.pooler, pooling=self.pooling,
                          classifier_dropout=self.classifier_dropout,
                          deterministic=deterministic, **kw)

  def example_batch_shapes(self, batch: int = 2, length: int = 8) -> dict[str, tuple]:
    family = self.config.family
    if family == "encoder":
      return {"encoder_input_tokens": (batch, length), "encoder_type_ids": (batch, length)}
    if family == "decoder":
      return {"decoder_input_tokens": (batch, length), "decoder_segment_ids": (batch, length)}
    return {"encoder_input_tokens": (batch, length), "decoder_input_tokens": (batch, length)}

  # ------------------------------------------------------------------ weights
  def load_backbone(self, params: Params, pretrained_params: Params) -> Params:
    """params with every backbone parameter replaced by the pretrained one.

    pretrained_params: a pretrained Model's params (or a FinetuneModel's: its
    'backbone' is used). Every backbone param must exist there with the same shape
    (ValueError naming the param otherwise); pretrained params the backbone does not
    use (MLM / NSP heads) are ignored, and BERT's pretrained pooler goes into the head.
    Returns host (numpy) arrays: device_put them with the train state's shardings.
    """
    source = pretrained_params
    if isinstance(source, Mapping) and "backbone" in source:
      source = source["backbone"]
    flat_source = flax.traverse_util.flatten_dict(_as_dict(source))
    new = dict(_as_dict(params))
    new["backbone"] = _copy_params(params["backbone"], flat_source, (), "backbone")
    if "head" in params and "pooler" in params["head"] and any(
        k[0] == "pooler" for k in flat_source):
      head = dict(_as_dict(params["head"]))
      head["pooler"] = _copy_params(params["head"]["pooler"], flat_source, ("pooler",),
                                    "head/pooler")
      new["head"] = head
    return new

  # ------------------------------------------------------------------ losses
  def loss_normalizers(self, batch) -> dict[str, Array]:
    """Denominators over the full batch (labels given; start positions given)."""
    if self.text_to_text:
      return self.seq2seq.loss_normalizers(batch)
    if self.task == "span_extraction":
      return {"span": heads.label_normalizer(batch["start_positions"])}
    return {"labels": heads.label_normalizer(batch["labels"])}

  def loss_fn(self, params, batch, dropout_rng, normalizers=None):
    """(loss, metrics). Classification / tagging: weighted cross-entropy over labels
    >= 0 (metrics classification_* / tagging_*); spans: (start CE + end CE) / 2;
    text to text: the EncoderDecoder token loss on decoder targets."""
    normalizers = normalizers or self.loss_normalizers(batch)
    if self.text_to_text:
      return self.seq2seq.loss_fn(params["backbone"], batch, dropout_rng, normalizers)
    out = self.apply(params, batch, dropout_rng=dropout_rng)
    cfg = self.config
    if self.task == "span_extraction":
      metrics = heads.span_metrics(out["start_logits"], out["end_logits"],
                                   batch["start_positions"], batch["end_positions"],
                                   normalizers["span"])
      metrics["loss"] = metrics["span_loss"]
    else:
      prefix = "classification" if self.task == "classification" else "tagging"
      metrics = heads.label_metrics(prefix, out, batch["labels"], normalizers["labels"],
                                    z_loss=cfg.z_loss, label_smoothing=cfg.label_smoothing)
      metrics["loss"] = metrics[f"{prefix}_loss"]
    return metrics["loss"], metrics

  # ------------------------------------------------------------------ evaluation
  def logits(self, params, batch):
    """classification [B, C] (text to text: label log-likelihoods), tagging [B, L, C],
    spans {'start_logits', 'end_logits'} [B, L]."""
    if self.text_to_text:
      return self.apply(params, batch, method=FinetuneModule.rank_scores,
                        targets_CxT=jnp.asarray(self.label_targets))
    return self.apply(params, batch)

  def apply(self, params, batch, *, dropout_rng=None, method=None, **method_kw):
    module = self.module(deterministic=dropout_rng is None)
    rngs = {} if dropout_rng is None else {"dropout": dropout_rng}
    if method is None:
      return module.apply({"params": params}, dict(batch), rngs=rngs)
    return module.apply({"params": params}, dict(batch), rngs=rngs, method=method, **method_kw)

  def predict(self, params, batch, **unused_decode_kwargs):
    """classification [B] class ids, tagging [B, L], spans {'start', 'end'} [B].

    Spans: when the batch has context_offsets [B, L, 2] (encoding), only context
    tokens and [CLS] (position 0, "no answer") can start or end the answer.
    """
    out = self.logits(params, batch)
    if self.task == "span_extraction":
      start_BxL, end_BxL = out["start_logits"], out["end_logits"]
      if "context_offsets" in batch:
        allowed_BxL = (jnp.asarray(batch["context_offsets"])[..., 0] >= 0).at[:, 0].set(True)
        start_BxL = jnp.where(allowed_BxL, start_BxL, -1e9)
        end_BxL = jnp.where(allowed_BxL, end_BxL, -1e9)
      start, end = heads.best_spans(start_BxL, end_BxL, self.max_answer_tokens)
      return {"start": start, "end": end}
    return jnp.argmax(out, axis=-1).astype(jnp.int32)


def _as_dict(tree) -> dict:
  return flax.core.unfreeze(tree) if isinstance(tree, flax.core.FrozenDict) else dict(tree)


def _copy_params(target: Params, flat_source: dict, prefix: tuple, name: str) -> Params:
  """`target`'s tree filled from flat_source[prefix + path], shapes checked."""
  flat_target = flax.traverse_util.flatten_dict(_as_dict(target))
  missing = [k for k in flat_target if prefix + k not in flat_source]
  if missing:
    shown = ", ".join("/".join(prefix + k) for k in missing[:5])
    raise ValueError(f"pretrained params lack {len(missing)} {name} param(s): {shown}"
                     f"{' ...' if len(missing) > 5 else ''} (a different architecture, or"
                     " scan_layers differs?)")
  for key, value in flat_target.items():  # every shape first: fail before copying anything
    source = flat_source[prefix + key]
    if tuple(np.shape(source)) != tuple(np.shape(value)):
      raise ValueError(f"pretrained param {'/'.join(prefix + key)} has shape"
                       f" {tuple(np.shape(source))} but the fine-tuning model's {name} expects"
                       f" {tuple(np.shape(value))}")
  return flax.traverse_util.unflatten_dict(
      {key: np.asarray(jax.device_get(flat_source[prefix + key]), value.dtype)
       for key, value in flat_target.items()})
