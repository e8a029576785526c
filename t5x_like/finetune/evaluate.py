"""Dev-set predictions and metrics of a fine-tuning run.

  predictions = predict_all(model, params, features, batch_size=..., mesh=..., ...)
  metrics = task_metrics(task, predictions, features, dataset)

Predictions per task: classification [N] class ids (text to text: {"generated": the
greedily generated label string's class, -1 when it is no label; "ranked": the label
of highest likelihood}), tagging [N, L] tag ids, spans {"start", "end"} [N] token
positions. Metrics: accuracy and macro F1 (classification, tagging: over the first
sub-token of each word; text to text: of the generated labels, and rank_accuracy,
rank_macro_f1 of the ranked ones), exact match and token F1 in percent (spans).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import numpy as np

from t5x_like import infer, parallel
from t5x_like.finetune import metrics as metrics_lib
from t5x_like.finetune.data import Dataset
from t5x_like.finetune.encoding import span_text

MODEL_INPUTS = ("encoder_input_tokens", "encoder_type_ids", "decoder_input_tokens",
                "decoder_segment_ids", "context_offsets")


def _batches(features: dict[str, np.ndarray], batch_size: int):
  """(rows, batch) of every `batch_size` rows; the last batch is filled with copies of
  its first row (real tokens, so nothing is all padding) and `rows` says how many count."""
  total = next(iter(features.values())).shape[0]
  for start in range(0, total, batch_size):
    stop = min(start + batch_size, total)
    index = np.concatenate([np.arange(start, stop), np.full(batch_size - (stop - start), start)])
    yield stop - start, {k: v[index] for k, v in features.items() if k in MODEL_INPUTS}


class Predictor:
  """Jitted prediction of a FinetuneModel on fixed-size batches, sharded like training.

  Text to text: tokenizer and label_names map generated text back to classes; labels
  are generated for at most target_length tokens.
  """

  def __init__(self, model, *, batch_size: int, mesh, rules, tokenizer=None,
               label_names: Sequence[str] = (), target_length: int = 8):
    self.model, self.batch_size, self.mesh, self.rules = model, batch_size, mesh, rules
    self.tokenizer, self.label_names = tokenizer, list(label_names)
    self.target_length = target_length

    def predict(params, batch):
      with parallel.traced_rules(mesh, rules):
        return model.predict(params, batch)
    self._predict = jax.jit(predict)

  def _generate_labels(self, params, batch) -> np.ndarray:
    decoded = infer.generate(self.model.seq2seq, params["backbone"],
                             {"encoder_input_tokens": batch["encoder_input_tokens"]},
                             max_new_tokens=self.target_length, mesh=self.mesh,
                             rules=self.rules, eos_id=self.tokenizer.eos_id, pad_id=0)
    lookup = {name: k for k, name in enumerate(self.label_names)}
    texts = [self.tokenizer.vocab.decode(_before_eos(row, self.tokenizer.eos_id)).strip()
             for row in np.asarray(jax.device_get(decoded.tokens))]
    return np.array([lookup.get(t, -1) for t in texts], np.int32)

  def __call__(self, params, features: dict[str, np.ndarray]):
    """Predictions for every row of `features` (module docstring)."""
    outputs = []
    for rows, batch in _batches(features, self.batch_size):
      batch = parallel.shard_batch(batch, self.mesh, self.rules)
      out = jax.device_get(self._predict(params, batch))
      if self.model.text_to_text:
        out = {"generated": self._generate_labels(params, batch), "ranked": out}
      outputs.append(jax.tree.map(lambda x: np.asarray(x)[:rows], out))
    if isinstance(outputs[0], dict):
      return {k: np.concatenate([o[k] for o in outputs]) for k in outputs[0]}
    return np.concatenate(outputs)


def _before_eos(ids: np.ndarray, eos_id: Optional[int]) -> list[int]:
  ids = [int(i) for i in ids]
  if eos_id is not None and eos_id in ids:
    ids = ids[:ids.index(eos_id)]
  return [i for i in ids if i > 0]


def task_metrics(task: str, predictions: Any, features: dict[str, np.ndarray],
                 dataset: Dataset) -> dict[str, float]:
  """Dev metrics of `predictions` against the encoded labels / the dataset's answers."""
  if task == "span_extraction":
    texts = [span_text(example.text_pair, offsets, int(s), int(e)) for example, offsets, s, e
             in zip(dataset.examples, features["context_offsets"], predictions["start"],
                    predictions["end"])]
    answers = [example.answer_text or "" for example in dataset.examples]
    return metrics_lib.squad_scores(texts, answers)
  labels = features["labels"]
  if isinstance(predictions, dict):  # text to text
    return {**task_metrics(task, predictions["generated"], features, dataset),
            **{f"rank_{k}": v for k, v in task_metrics(task, predictions["ranked"], features,
                                                       dataset).items()}}
  return {"accuracy": metrics_lib.accuracy(predictions, labels),
          "macro_f1": metrics_lib.macro_f1(predictions, labels)}


def prediction_rows(task: str, predictions: Any, dataset: Dataset,
                    features: dict[str, np.ndarray]) -> list[dict]:
  """One JSON-able row per dev example: its line, gold and predicted labels / answers
  (text to text: the generated label, None when it is no label, and the ranked one)."""
  rows, name = [], lambda k: dataset.labels[k] if k >= 0 else None
  for k, example in enumerate(dataset.examples):
    row = {"line": example.line}
    if task == "classification" and isinstance(predictions, dict):
      row.update(label=name(example.label), prediction=name(int(predictions["generated"][k])),
                 ranked=name(int(predictions["ranked"][k])))
    elif task == "classification":
      row.update(label=name(example.label), prediction=name(int(predictions[k])))
    elif task == "token_classification":
      keep = features["labels"][k] >= 0
      row.update(tags=[dataset.labels[t] for t in features["labels"][k][keep]],
                 prediction=[dataset.labels[t] for t in predictions[k][keep]])
    else:
      start, end = int(predictions["start"][k]), int(predictions["end"][k])
      row.update(answer=example.answer_text or "", prediction=span_text(
          example.text_pair, features["context_offsets"][k], start, end))
    rows.append(row)
  return rows
