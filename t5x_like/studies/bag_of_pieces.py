"""The bag-of-pieces baseline: logistic regression on a text's vocabulary pieces.

  result = bag_of_pieces(splits, tokenizer)    # {"dev_accuracy", "test_accuracy", "l2"}

What a classifier gets from the words alone, with no order and no pretraining: each
example is the counts of the tokenizer's pieces, log(1 + count), one block per text
column (a pair's two texts apart), plus a bias; a multinomial logistic regression with
an L2 penalty is fitted on train by L-BFGS (scipy), the penalty picked on dev from
`l2_grid`, and scored on dev and test. A fine-tuned model that cannot beat it has
learned nothing beyond word identity.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import scipy.optimize
import scipy.sparse

from t5x_like.finetune.data import Dataset

L2_GRID = (1e-3, 1e-2, 1e-1, 1.0)  # the penalty per training example


def features(dataset: Dataset, tokenizer, vocab_size: int) -> scipy.sparse.csr_matrix:
  """[N, V * columns] log(1 + piece count), a text pair's second text in its own block."""
  rows, cols, vals = [], [], []
  for n, example in enumerate(dataset.examples):
    texts = [example.text] + ([example.text_pair] if example.text_pair is not None else [])
    for block, text in enumerate(texts):
      ids, counts = np.unique(tokenizer.encode(text), return_counts=True)
      rows += [n] * len(ids)
      cols += list(block * vocab_size + ids)
      vals += list(np.log1p(counts))
  width = vocab_size * (2 if any(e.text_pair is not None for e in dataset.examples) else 1)
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
  x = {k: m if m.shape[1] == width else scipy.sparse.hstack(
      [m, scipy.sparse.csr_matrix((m.shape[0], width - m.shape[1]))]).tocsr()
       for k, m in x.items()}
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
