"""FinetuneModel: a backbone (any family) plus a task's head, with the model contract.

  task = make_task("classification")
  model = FinetuneModel(pretrained.config, task, num_labels=2)
  params = model.init(rng, batch_shapes)            # {'backbone': ..., 'head': ...}
  params = model.load_backbone(params, pretrained_params)
  loss, metrics = model.loss_fn(params, batch, dropout_rng)   # train.step trains it
  model.logits(params, batch), model.predict(params, batch)

The family's model class (models/model.py) gives the backbone's final hidden states
and where a summary of a row is read ([CLS], or GPT's last real token); the task
(finetune/tasks/) gives the head, loss and predictions on them. A family that
fine-tunes text to text (T5) keeps the whole model and has no head params: the loss
is the encoder-decoder loss on the label string, and logits are each label string's
log-likelihood (rank classification, one forward pass; needs label_targets [C, T]).
A T5 classification task with text_to_text=False keeps the encoder alone (and the
shared embedding) under a head, as BERT's (EncT5, Liu et al. 2021).
The backbone drops the pretraining heads fine-tuning does not use (BERT's MLM / NSP,
GPT's output layer); BERT's pooler lives in the head ('head/pooler') and
load_backbone copies the pretrained one there.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.finetune.task import Task
from t5x_like.finetune.tasks import make_task
from t5x_like.models.config import ModelConfig
from t5x_like.models.model import Model, build_model, model_class

Array = jax.Array
Params = Any


class FinetuneModule(nn.Module):
  """Backbone ('backbone') + head ('head'). __call__(batch) -> the task's logits."""

  config: ModelConfig
  task: Task
  num_labels: int = 0
  deterministic: bool = True
  text_to_text: bool = False  # FinetuneModel.text_to_text

  def setup(self):
    family = model_class(self.config)
    self.backbone = family.hidden_states_module(self.config, deterministic=self.deterministic)
    self.head = None if self.text_to_text else self.task.head(
        self.config, self.num_labels, self.deterministic)

  def __call__(self, batch):
    family = model_class(self.config)
    if self.text_to_text:
      return self.backbone(batch)  # [B, T, V] decoder logits
    hidden_BxLxD, valid_BxL = family.hidden_states(self.backbone, batch)
    return self.task.forward(self.head, hidden_BxLxD, valid_BxL,
                             family.summary_index(valid_BxL), batch)

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
  pretraining heads are dropped). task: a Task (t5x_like.finetune.tasks), or a task
  name with its options as keywords (e.g. pooling="mean"). num_labels: classes (tags).
  label_targets: [C, T] label strings (text-to-text families).
  """

  module_class = FinetuneModule

  def __init__(self, config: ModelConfig, task, *, num_labels: int = 0,
               label_targets: Optional[np.ndarray] = None, **task_options):
    if isinstance(task, str):
      task = make_task(task, **task_options)
    elif task_options:
      raise TypeError(f"task options {sorted(task_options)} go with a task name, not a Task")
    family = model_class(config)
    if config.family not in task.families:
      raise ValueError(f"task={task.name!r} does not fine-tune the {config.family!r} family"
                       f" (it supports {', '.join(task.families)})")
    self.text_to_text = finetunes_text_to_text(config, task)
    # A task that generates free text (e.g. SQuAD's answers) has no label list to rank.
    self.generates_text = self.text_to_text and task.generates_text
    if self.text_to_text and not self.generates_text:
      if label_targets is None:
        raise ValueError("text-to-text fine-tuning needs label_targets [C, T] (the task's"
                         " label_targets)")
      label_targets = np.asarray(label_targets, np.int32)
      num_labels = label_targets.shape[0]
    elif task.uses_label_list and num_labels < 1:
      raise ValueError(f"task={task.name!r} needs num_labels >= 1, got {num_labels}")
    super().__init__(family.finetune_config(config))
    self.task = task
    self.num_labels = int(num_labels)
    self.label_targets = label_targets
    # Text to text: the backbone's own model and loss (the label string as its targets).
    self.seq2seq = build_model(self.config) if self.text_to_text else None

  def module(self, *, deterministic: bool = True, **kw) -> nn.Module:
    return FinetuneModule(self.config, self.task, num_labels=self.num_labels,
                          deterministic=deterministic, text_to_text=self.text_to_text, **kw)

  def example_batch_shapes(self, batch: int = 2, length: int = 8) -> dict[str, tuple]:
    return {name: (batch, length) for name in model_class(self.config).finetune_inputs}

  # ------------------------------------------------------------------ weights
  def load_backbone(self, params: Params, pretrained_params: Params) -> Params:
    """params with every backbone parameter replaced by the pretrained one.

    pretrained_params: a pretrained Model's params (or a FinetuneModel's: its
    'backbone' is used). Every backbone param must exist there with the same shape
    (ValueError naming the param otherwise); pretrained params the backbone does not
    use (MLM / NSP heads) are ignored, and BERT's pretrained pooler goes into the head.
    Replaced params are host (numpy) arrays, the others stay as given: device_put the
    result with the train state's shardings.
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
    """Denominators over the full batch (the task's; text to text: the seq2seq ones)."""
    if self.text_to_text:
      return self.seq2seq.loss_normalizers(batch)
    return self.task.normalizers(batch)

  def loss_fn(self, params, batch, dropout_rng, normalizers=None):
    """(loss, metrics): the task's loss on its head's output; text to text: the
    encoder-decoder token loss on decoder targets."""
    normalizers = normalizers or self.loss_normalizers(batch)
    if self.text_to_text:
      return self.seq2seq.loss_fn(params["backbone"], batch, dropout_rng, normalizers)
    out = self.apply(params, batch, dropout_rng=dropout_rng)
    metrics = self.task.loss(out, batch, normalizers, self.config)
    return metrics["loss"], metrics

  # ------------------------------------------------------------------ evaluation
  def logits(self, params, batch):
    """The task head's output (classification [B, C], tagging [B, L, C], spans
    {'start_logits', 'end_logits'} [B, L]); text to text: label log-likelihoods [B, C]."""
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
    """The task's predictions (classification [B] class ids, tagging [B, L], spans
    {'start', 'end'} [B]); text to text: the likeliest label [B]."""
    out = self.logits(params, batch)
    if self.text_to_text:
      return jnp.argmax(out, axis=-1).astype(jnp.int32)
    return self.task.predict(out, batch)


def finetunes_text_to_text(config: ModelConfig, task) -> bool:
  """Whether `task` fine-tunes a `config` backbone text to text: a family that does
  (T5), unless the task asks for a head (text_to_text=False)."""
  return model_class(config).finetunes_text_to_text and getattr(task, "text_to_text", True)


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
