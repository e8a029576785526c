"""The bag-of-pieces baseline: logistic regression on a text's vocabulary pieces.

  result = bag_of_pieces(train, dev, test, tokenizer)  # {"dev_accuracy", "test_accuracy", "l2"}
  fitted = fit_on_train(train, tokenizer, kind, score)   # GLUE: penalty picked on train
  predictions = fitted.predict(dev)                      # class indices, or scores

What a classifier gets from the words alone, with no order and no pretraining: each
example is the counts of the tokenizer's pieces, log(1 + count), one block per text
column (a pair's two texts apart), plus a bias; a multinomial logistic regression with
an L2 penalty is fitted on train by L-BFGS (scipy), the penalty picked on dev from
`l2_grid`, and scored on dev and test. A fine-tuned model that cannot beat it has
learned nothing beyond word identity.

For benchmarks (fit_on_train): the penalty is picked on a held-out part of train (never
on dev), the model refitted on all of train; a pair gets a third block, the pieces its
two texts share (log(1 + the smaller count)), since a sum of two separate bags cannot
see overlap (what paraphrase and similarity tasks first measure); a regression (STS-B)
is a ridge regression on the same features.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import scipy.optimize
import scipy.sparse

from t5x_like.finetune.data import Dataset

L2_GRID = (1e-3, 1e-2, 1e-1, 1.0)  # the penalty per training example


def features(dataset: Dataset, tokenizer, vocab_size: int, overlap: bool = False
             ) -> scipy.sparse.csr_matrix:
  """[N, V * blocks] log(1 + piece count), a text pair's second text in its own block
  (and with overlap, a third: log(1 + min of the two counts) per shared piece)."""
  rows, cols, vals = [], [], []
  pairs = any(e.text_pair is not None for e in dataset.examples)
  for n, example in enumerate(dataset.examples):
    texts = [example.text] + ([example.text_pair] if example.text_pair is not None else [])
    bags = []
    for block, text in enumerate(texts):
      ids, counts = np.unique(tokenizer.encode(text), return_counts=True)
      bags.append(dict(zip(ids.tolist(), counts.tolist())))
      rows += [n] * len(ids)
      cols += list(block * vocab_size + ids)
      vals += list(np.log1p(counts))
    if overlap and len(bags) == 2:
      shared = sorted(set(bags[0]) & set(bags[1]))
      rows += [n] * len(shared)
      cols += [2 * vocab_size + i for i in shared]
      vals += [float(np.log1p(min(bags[0][i], bags[1][i]))) for i in shared]
  width = vocab_size * ((3 if overlap else 2) if pairs else 1)
  return scipy.sparse.csr_matrix((vals, (rows, cols)), shape=(len(dataset.examples), width))


def fit(x: scipy.sparse.csr_matrix, y: np.ndarray, num_labels: int, l2: float,
        max_iter: int = 500) -> np.ndarray:
  """[F + 1, C] weights (the last row the bias) minimising the mean cross-entropy +
  l2 / 2 * |W|^2 (the bias not penalised)."""
  n, f = x.shape
  onehot = np.eye(num_labels)[y]

  def loss_and_grad(flat):
    w = flat.reshape(f + 1, num_labels)
    logits = x @ w[:-1] + w[-1]
    logits -= logits.max(axis=1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    loss = -(onehot * log_p).sum() / n + 0.5 * l2 * (w[:-1] ** 2).sum()
    d = (np.exp(log_p) - onehot) / n
    grad = np.vstack([x.T @ d + l2 * w[:-1], d.sum(axis=0)])
    return loss, grad.ravel()

  result = scipy.optimize.minimize(loss_and_grad, np.zeros((f + 1) * num_labels), jac=True,
                                   method="L-BFGS-B", options=dict(maxiter=max_iter))
  return result.x.reshape(f + 1, num_labels)


def fit_ridge(x: scipy.sparse.csr_matrix, y: np.ndarray, l2: float,
              max_iter: int = 500) -> np.ndarray:
  """[F + 1, 1] weights (the last row the bias) minimising the mean squared error / 2 +
  l2 / 2 * |W|^2 (the bias not penalised)."""
  n, f = x.shape

  def loss_and_grad(w):
    residual = x @ w[:-1] + w[-1] - y
    loss = 0.5 * (residual ** 2).sum() / n + 0.5 * l2 * (w[:-1] ** 2).sum()
    grad = np.append(x.T @ residual / n + l2 * w[:-1], residual.sum() / n)
    return loss, grad

  start = np.append(np.zeros(f), y.mean())
  result = scipy.optimize.minimize(loss_and_grad, start, jac=True, method="L-BFGS-B",
                                   options=dict(maxiter=max_iter))
  return result.x.reshape(f + 1, 1)


class FittedBag:
  """A bag of pieces fitted on a benchmark's train split (fit_on_train)."""

  def __init__(self, w: np.ndarray, tokenizer, regression: bool, l2: float,
               holdout_scores: dict):
    self.w, self.tokenizer, self.regression = w, tokenizer, regression
    self.l2, self.holdout_scores = l2, holdout_scores

  def predict(self, dataset: Dataset) -> np.ndarray:
    """[N] class indices (classification) or scores (regression)."""
    x = _width(features(dataset, self.tokenizer, self.tokenizer.vocab_size, overlap=True),
               self.w.shape[0] - 1)
    out = x @ self.w[:-1] + self.w[-1]
    return out[:, 0] if self.regression else np.argmax(out, axis=1)


def fit_on_train(train: Dataset, tokenizer, regression: bool,
                 score: Callable[[np.ndarray, np.ndarray], float],
                 l2_grid: Sequence[float] = L2_GRID, holdout: float = 0.1,
                 seed: int = 0) -> FittedBag:
  """Fits on train - holdout at each penalty, keeps the one whose score(predicted, gold)
  on the held-out part is highest (the larger penalty on a tie), refits on all of train.
  The held-out part is benchmarks/task_data.hold_out's: the examples finetune-suite
  --lr_grid holds out at the same fraction and seed."""
  from t5x_like.benchmarks.task_data import hold_out
  rest, held = hold_out(train, holdout, seed)

  def data(dataset):
    return (features(dataset, tokenizer, tokenizer.vocab_size, overlap=True),
            np.array([e.label for e in dataset.examples],
                     np.float64 if regression else np.int64))

  def fitted(dataset, l2):
    x, y = data(dataset)
    return fit_ridge(x, y, l2) if regression else fit(x, y, len(train.labels), l2)

  scores = {}
  for l2 in sorted(l2_grid, reverse=True):
    bag = FittedBag(fitted(rest, l2), tokenizer, regression, l2, {})
    scores[l2] = float(score(bag.predict(held), data(held)[1]))
  # a score that cannot be computed (one held-out example, a constant prediction) loses
  best = max(sorted(l2_grid, reverse=True),
             key=lambda l2: scores[l2] if np.isfinite(scores[l2]) else -np.inf)
  return FittedBag(fitted(train, best), tokenizer, regression, best, scores)


def _width(x: scipy.sparse.csr_matrix, width: int) -> scipy.sparse.csr_matrix:
  """x with `width` columns (a single-text split padded with empty pair blocks)."""
  if x.shape[1] == width:
    return x
  return scipy.sparse.hstack([x, scipy.sparse.csr_matrix((x.shape[0], width - x.shape[1]))]
                             ).tocsr()


def accuracy(w: np.ndarray, x: scipy.sparse.csr_matrix, y: np.ndarray) -> float:
  return float(np.mean(np.argmax(x @ w[:-1] + w[-1], axis=1) == y))


def bag_of_pieces(train: Dataset, dev: Dataset, test: Dataset, tokenizer,
                  l2_grid: Sequence[float] = L2_GRID) -> dict:
  """{'dev_accuracy', 'test_accuracy', 'l2'}: fitted on train, the penalty with the best
  dev accuracy (the larger on a tie)."""
  v = tokenizer.vocab_size
  x = {name: features(d, tokenizer, v) for name, d in
       (("train", train), ("dev", dev), ("test", test))}
  width = max(m.shape[1] for m in x.values())
  x = {k: _width(m, width) for k, m in x.items()}
  y = {name: np.array([e.label for e in d.examples]) for name, d in
       (("train", train), ("dev", dev), ("test", test))}
  best = None
  for l2 in sorted(l2_grid, reverse=True):
    w = fit(x["train"], y["train"], len(train.labels), l2)
    dev_acc = accuracy(w, x["dev"], y["dev"])
    if best is None or dev_acc > best[0]:
      best = (dev_acc, l2, w)
  dev_acc, l2, w = best
  return {"dev_accuracy": round(dev_acc, 4),
          "test_accuracy": round(accuracy(w, x["test"], y["test"]), 4), "l2": l2}
