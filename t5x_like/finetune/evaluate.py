"""Dev-set predictions and metrics of a fine-tuning run.

  predictor = Predictor(model, batch_size=..., mesh=..., rules=..., tokenizer=...)
  predictions = predictor(params, features)        # every dev row, on every host
  metrics = dev_metrics(model, predictions, features, dataset)
  rows = prediction_rows(model, predictions, dataset, features)

Predictions are the task's (FinetuneModel.predict); a text-to-text model gives
{"generated": the greedily generated label string's class, -1 when it is no label;
"ranked": the label of highest likelihood}, and its metrics are the task's on the
generated labels plus rank_* on the ranked ones; a task that generates free text
(text_generation) gives the [N] generated strings.

Multi-host: every host passes all dev rows; each feeds its own slice of each batch
(as the training loader does) and every host gets all predictions back.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from t5x_like import infer, parallel
from t5x_like.finetune import padding
from t5x_like.finetune.data import Dataset


def _host_batches(features: dict[str, np.ndarray], batch_size: int,
                  padding_groups: Sequence = ()):
  """(rows, this host's part of the batch) for every `batch_size` rows; the last batch
  is filled with copies of its first row (real tokens, so nothing is all padding) and
  `rows` says how many count. padding_groups: each batch cut to its longest row."""
  total = next(iter(features.values())).shape[0]
  per_host = batch_size // jax.process_count()
  first = jax.process_index() * per_host
  for start in range(0, total, batch_size):
    stop = min(start + batch_size, total)
    index = np.concatenate([np.arange(start, stop), np.full(batch_size - (stop - start), start)])
    lengths = padding.cut_lengths({k: features[k][index] for k, _ in padding_groups
                                   if k in features}, padding_groups)
    index = index[first:first + per_host]
    yield stop - start, padding.cut({k: v[index] for k, v in features.items()}, lengths)


def _everywhere(tree) -> Any:
  """Global arrays -> numpy on every host (multi-host safe)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)


class Predictor:
  """Jitted prediction of a FinetuneModel on fixed-size batches, sharded like training.

  Text to text: tokenizer and label_names map generated text back to classes; labels
  are generated for at most the task's target_length tokens.
  """

  def __init__(self, model, *, batch_size: int, mesh, rules, tokenizer=None,
               label_names: Sequence[str] = ()):
    self.model, self.batch_size, self.mesh, self.rules = model, batch_size, mesh, rules
    self.tokenizer, self.label_names = tokenizer, list(label_names)

    def predict(params, batch):
      with parallel.traced_rules(mesh, rules):
        return model.predict(params, batch)
    self._predict = jax.jit(predict)

  def _generate_texts(self, params, batch, max_new_tokens: int) -> list[str]:
    decoded = infer.generate(self.model.seq2seq, params["backbone"],
                             {"encoder_input_tokens": batch["encoder_input_tokens"]},
                             max_new_tokens=max_new_tokens, mesh=self.mesh,
                             rules=self.rules, eos_id=self.tokenizer.eos_id, pad_id=0)
    return [self.tokenizer.vocab.decode(_before_eos(row, self.tokenizer.eos_id)).strip()
            for row in np.asarray(_everywhere(decoded.tokens))]

  def _generate_labels(self, params, batch) -> np.ndarray:
    lookup = {name: k for k, name in enumerate(self.label_names)}
    texts = self._generate_texts(params, batch, self.model.label_targets.shape[1])
    return np.array([lookup.get(t, -1) for t in texts], np.int32)

  def __call__(self, params, features: dict[str, np.ndarray]):
    """Predictions for every row of `features` (module docstring)."""
    task = self.model.task
    inputs = {k: v for k, v in features.items() if k not in task.label_features}
    outputs = []
    for rows, batch in _host_batches(inputs, self.batch_size, task.padding_groups()):
      batch = parallel.shard_batch(batch, self.mesh, self.rules)
      if self.model.generates_text:  # free text: [N] strings
        outputs.append(np.array(self._generate_texts(params, batch, task.target_length),
                                object)[:rows])
        continue
      out = _everywhere(self._predict(params, batch))
      if self.model.text_to_text:
        out = {"generated": self._generate_labels(params, batch), "ranked": out}
      outputs.append(jax.tree.map(lambda x: np.asarray(x)[:rows], out))
    return jax.tree.map(lambda *parts: np.concatenate(parts), *outputs)


def _before_eos(ids: np.ndarray, eos_id: Optional[int]) -> list[int]:
  ids = [int(i) for i in ids]
  if eos_id is not None and eos_id in ids:
    ids = ids[:ids.index(eos_id)]
  return [i for i in ids if i > 0]


def dev_metrics(model, predictions: Any, features: dict[str, np.ndarray],
                dataset: Dataset) -> dict[str, float]:
  """The task's dev metrics of `predictions` (text to text: generated, then rank_*)."""
  task = model.task
  if model.text_to_text and not model.generates_text:
    return {**task.metrics(predictions["generated"], features, dataset),
            **{f"rank_{k}": v for k, v in task.metrics(predictions["ranked"], features,
                                                       dataset).items()}}
  return task.metrics(predictions, features, dataset)


def prediction_rows(model, predictions: Any, dataset: Dataset,
                    features: dict[str, np.ndarray]) -> list[dict]:
  """One JSON-able row per dev example: its line (a benchmark's: its place in TFDS's
  storage order), a benchmark example's own `idx` (GLUE's / SuperGLUE's idx, SQuAD's id:
  what joins the row to the dataset's files), and the task's gold and predicted values
  (text to text: the generated label, None when it is no label, and `ranked`)."""
  task, rows = model.task, []
  ranked = None
  if model.text_to_text and not model.generates_text:
    predicted = task.prediction_rows(predictions["generated"], features, dataset)
    ranked = task.prediction_rows(predictions["ranked"], features, dataset)
  else:
    predicted = task.prediction_rows(predictions, features, dataset)
  for k, example in enumerate(dataset.examples):
    row = {"line": example.line}
    if dataset.ids is not None:
      row["idx"] = dataset.ids[k]
    row.update(predicted[k])
    if ranked is not None:
      row["ranked"] = ranked[k]["prediction"]
    rows.append(row)
  return rows
