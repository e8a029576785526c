"""The transformers arm of the real-checkpoint study (studies/hf_checkpoint_glue.py): a
Hugging Face checkpoint fine-tuned on a GLUE task as a plain transformers script does,
on exactly the rows, batches, steps and recipe of our `t5x-like finetune` run.

  prepared = prepare(config)                     # our reader, tokenizer, encoding, steps
  batch = batch_at(prepared, seed, step)         # the rows our loader gives at `step`
  ours = our_first_loss(prepared, seed)          # our step-1 loss, dropout off
  result = train_transformers(prepared, checkpoint, seed, workdir)

transformers side, from its documented API: BertForSequenceClassification.from_pretrained
(num_labels=1 for STS-B: its MSE loss), torch.optim.AdamW with no decay on biases and
LayerNorm weights (Trainer's grouping), clip_grad_norm_ 1.0, and a LambdaLR of our
linear schedule (BERT's reference: warmup to the peak, then decay measured from step 0,
which transformers' get_linear_schedule_with_warmup measures from the warmup's end).
Both arms start from the same classifier: ours, drawn by our init at the run's seed and
copied into torch, so the first-step losses (dropout off) must agree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import numpy as np

from t5x_like.benchmarks.registry import Benchmark, benchmark
from t5x_like.benchmarks.task_data import BenchmarkTaskData
from t5x_like.finetune import padding
from t5x_like.finetune.backbone import Backbone, load_backbone, resolve_init
from t5x_like.finetune.data import Dataset
from t5x_like.finetune.encoding import encode_examples
from t5x_like.finetune.evaluate import dev_metrics, prediction_rows
from t5x_like.finetune.model import FinetuneModel
from t5x_like.finetune.steps import resolve_steps
from t5x_like.finetune.task import Task

Features = dict[str, np.ndarray]


@dataclasses.dataclass
class Prepared:
  """One task's data and model as our finetune run builds them (config: resolved steps)."""
  config: Any
  task: Task
  bench: Benchmark
  backbone: Backbone
  model: FinetuneModel
  train: Features  # [N, L] training rows (labels too), the features our loader reads
  dev: Features  # [M, L] dev rows
  dev_set: Dataset
  labels: list[str]

  @property
  def num_rows(self) -> int:
    return len(next(iter(self.train.values())))

  @property
  def batch_size(self) -> int:
    return int(self.config.train.batch_size)

  @property
  def num_steps(self) -> int:
    return int(self.config.train.num_steps)


def prepare(config) -> Prepared:
  """The benchmark task of `config` (init.hf set) read, tokenized and encoded by our
  product's own pieces, as t5x_like/finetune/loop.py does; train.num_steps and
  optimizer.warmup_steps resolved from train.epochs."""
  resolved = resolve_init(config)
  config = resolved.config
  backbone = load_backbone(config, resolved.origin, resolved.pretrain)
  data = BenchmarkTaskData()
  task = data.task(config, text_to_text=False)
  splits = data.splits(config, task, text_to_text=False)
  kw = dict(family=backbone.model_config.family, label_names=splits.train.labels)
  train, _ = encode_examples(splits.train.examples, backbone.tokenizer, task, training=True,
                             **kw)
  train = {k: v for k, v in train.items() if k not in task.host_features}
  dev, _ = encode_examples(splits.main_dev.examples, backbone.tokenizer, task, **kw)
  model = FinetuneModel(backbone.model_config, task, num_labels=len(splits.train.labels))
  config, _ = resolve_steps(config, len(next(iter(train.values()))))
  return Prepared(config, task, benchmark(config.benchmark.name), backbone, model, train,
                  dev, splits.main_dev, list(splits.train.labels))


# ------------------------------------------------------------------ the same batches
def batch_rows(num_rows: int, batch_size: int, seed: int, step: int) -> np.ndarray:
  """[B] row indices of batch `step` (0-based): positions step*B .. (step+1)*B - 1 of
  the epochs' permutations concatenated, epoch e in default_rng([seed, e]) order (our
  EncodedRows: a batch runs on into the next epoch)."""
  positions = np.arange(step * batch_size, (step + 1) * batch_size)
  epochs, offsets = np.divmod(positions, num_rows)
  rows = np.empty(batch_size, np.int64)
  for epoch in np.unique(epochs):
    order = np.random.default_rng([seed, int(epoch)]).permutation(num_rows)
    rows[epochs == epoch] = order[offsets[epochs == epoch]]
  return rows


def cut_to_longest(features: Features, groups) -> Features:
  """Each sequence feature cut to the batch's longest row (finetune/padding.py)."""
  return padding.cut(features, padding.cut_lengths(features, groups))


def batch_at(prepared: Prepared, seed: int, step: int) -> Features:
  """{feature: [B, ...]}: training batch `step` (0-based) as our loader gives it."""
  rows = batch_rows(prepared.num_rows, prepared.batch_size, seed, step)
  return cut_to_longest({k: v[rows] for k, v in prepared.train.items()},
                        prepared.task.padding_groups())


def batch_lengths(prepared: Prepared, seed: int) -> list[int]:
  """The sequence length of every training batch of the run, in step order."""
  return [batch_at(prepared, seed, s)["encoder_input_tokens"].shape[1]
          for s in range(prepared.num_steps)]


# ------------------------------------------------------------------ our side
def our_initial_params(prepared: Prepared, seed: int):
  """The params our run starts from: model.init at key(seed) (create_train_state's),
  the checkpoint's backbone and pooler loaded over it."""
  shapes = {k: (prepared.batch_size, *v.shape[1:]) for k, v in prepared.train.items()}
  params = jax.jit(lambda r: prepared.model.init(r, shapes))(jax.random.key(seed))
  return prepared.model.load_backbone(params, prepared.backbone.params)


def our_first_loss(prepared: Prepared, seed: int, params=None) -> float:
  """Our loss on the first training batch at the initial params, dropout off."""
  params = our_initial_params(prepared, seed) if params is None else params
  loss, _ = prepared.model.loss_fn(params, batch_at(prepared, seed, 0), None)
  return float(loss)


# ------------------------------------------------------------------ transformers
def linear_rate(step: int, num_steps: int, warmup: int) -> float:
  """Our linear schedule's factor (train/optimizers.py linear_schedule) at update `step`."""
  if step < warmup:
    return step / max(warmup, 1)
  return 1.0 - min(step, num_steps) / max(num_steps, 1)


def torch_inputs(batch: Features) -> dict:
  import torch
  tokens = torch.from_numpy(np.asarray(batch["encoder_input_tokens"], np.int64))
  inputs = {"input_ids": tokens, "attention_mask": (tokens != 0).long(),
            "token_type_ids": torch.from_numpy(np.asarray(batch["encoder_type_ids"], np.int64))}
  if "labels" in batch:
    labels = np.asarray(batch["labels"])
    inputs["labels"] = torch.from_numpy(labels.astype(np.float32 if labels.dtype.kind == "f"
                                                      else np.int64))
  return inputs


def torch_model(prepared: Prepared, checkpoint: str, params):
  """BertForSequenceClassification of `checkpoint` with our classifier (params'
  head/classifier) copied in; the pooler is the checkpoint's, as ours."""
  import torch
  import transformers
  num_labels = 1 if prepared.task.name == "regression" else len(prepared.labels)
  transformers.logging.set_verbosity_error()  # its load report: the head is ours, below
  model = transformers.BertForSequenceClassification.from_pretrained(checkpoint,
                                                                     num_labels=num_labels)
  head = params["head"]["classifier"]
  with torch.no_grad():
    model.classifier.weight.copy_(torch.from_numpy(np.array(head["kernel"]).T.copy()))
    model.classifier.bias.copy_(torch.from_numpy(np.array(head["bias"])))
  return model


def torch_first_loss(model, batch: Features) -> float:
  import torch
  model.eval()
  with torch.no_grad():
    return float(model(**torch_inputs(batch)).loss)


def torch_predictions(model, features: Features, batch_size: int, groups, regression: bool
                      ) -> np.ndarray:
  """[M] dev predictions (classes, or scores), in batches cut as our Predictor's."""
  import torch
  model.eval()
  inputs = {k: v for k, v in features.items() if k != "labels"}
  total, out = len(features["encoder_input_tokens"]), []
  with torch.no_grad():
    for start in range(0, total, batch_size):
      part = cut_to_longest({k: v[start:start + batch_size] for k, v in inputs.items()}, groups)
      logits = model(**torch_inputs(part)).logits
      out.append(logits[:, 0].numpy() if regression else logits.argmax(-1).numpy())
  return np.concatenate(out)


def train_transformers(prepared: Prepared, checkpoint: str, seed: int, workdir: str,
                       log=print) -> dict:
  """Fine-tunes `checkpoint` with transformers on our batches (module docstring); writes
  workdir/steps.jsonl (loss, seconds per step), dev_predictions.jsonl and
  final_metrics.json; returns {official, metrics, first_loss: {ours, transformers},
  step_seconds, losses, seconds}."""
  import torch
  torch.manual_seed(seed)
  params = our_initial_params(prepared, seed)
  ours_first = our_first_loss(prepared, seed, params)
  model = torch_model(prepared, checkpoint, params)
  theirs_first = torch_first_loss(model, batch_at(prepared, seed, 0))
  log(f"first-step loss, dropout off, the same classifier: ours {ours_first:.6f},"
      f" transformers {theirs_first:.6f}")
  opt = prepared.config.optimizer
  no_decay = lambda name: "bias" in name or "LayerNorm" in name
  named = list(model.named_parameters())
  groups = [{"params": [p for n, p in named if not no_decay(n)],
             "weight_decay": float(opt.weight_decay)},
            {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}]
  optimizer = torch.optim.AdamW(groups, lr=float(opt.learning_rate),
                                betas=(float(opt.b1), float(opt.b2)), eps=float(opt.eps))
  steps, warmup = prepared.num_steps, int(opt.warmup_steps)
  scheduler = torch.optim.lr_scheduler.LambdaLR(
      optimizer, lambda s: linear_rate(s, steps, warmup))
  os.makedirs(workdir, exist_ok=True)
  started, losses, seconds = time.perf_counter(), [], []
  model.train()
  with open(os.path.join(workdir, "steps.jsonl"), "w") as f:
    for step in range(steps):
      inputs = torch_inputs(batch_at(prepared, seed, step))
      tick = time.perf_counter()
      loss = model(**inputs).loss
      loss.backward()
      if float(opt.clip_norm) > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), float(opt.clip_norm))
      optimizer.step()
      scheduler.step()
      optimizer.zero_grad(set_to_none=True)
      seconds.append(time.perf_counter() - tick)
      losses.append(loss.item())
      f.write(json.dumps({"step": step + 1, "loss": losses[-1],
                          "seconds_per_step": seconds[-1]}) + "\n")
      if step == 0 or (step + 1) % 50 == 0 or step + 1 == steps:
        log(f"transformers step {step + 1}/{steps}: loss {losses[-1]:.4f},"
            f" {seconds[-1]:.2f} s/step")
  predictions = torch_predictions(model, prepared.dev, prepared.batch_size,
                                  prepared.task.padding_groups(),
                                  prepared.task.name == "regression")
  rows = prediction_rows(prepared.model, predictions, prepared.dev_set, prepared.dev)
  split = prepared.bench.dev_splits[0]
  official = prepared.bench.official_metrics({split: rows}, prepared.labels,
                                             {split: prepared.dev_set.golds})
  final = {"official": {k: round(float(v), 3) for k, v in official.items()},
           "metrics": dev_metrics(prepared.model, predictions, prepared.dev, prepared.dev_set),
           "first_loss": {"ours": ours_first, "transformers": theirs_first},
           "step": steps, "seconds": round(time.perf_counter() - started, 1),
           "torch_threads": torch.get_num_threads()}
  with open(os.path.join(workdir, "dev_predictions.jsonl"), "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
  with open(os.path.join(workdir, "final_metrics.json"), "w") as f:
    json.dump(final, f, indent=1)
  return {**final, "step_seconds": seconds, "losses": losses}
