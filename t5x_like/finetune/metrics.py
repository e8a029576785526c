"""Evaluation metrics of fine-tuning tasks (host side, numpy / plain Python).

  accuracy(predictions, labels)              labels < 0 are ignored
  macro_f1(predictions, labels)              mean F1 over the classes that occur in
                                             labels or predictions
  binary_f1(predictions, labels)             F1 of the positive class (MRPC, QQP)
  matthews_corrcoef(predictions, labels)     Matthews correlation (CoLA), any classes
  pearson(a, b), spearman(a, b)              correlations (STS-B); ties share ranks
  normalize_answer(text)                     SQuAD: lower, drop punctuation, articles,
                                             extra whitespace
  exact_match(prediction, answers)           max over the gold answers, 0 / 1
  token_f1(prediction, answers, version)     max over the gold answers of the token F1
  squad_scores(predictions, answers, version)  evaluate-v1.1.py / evaluate-v2.0.py, in
                                             percent
  label_scores(predictions, labels)          {"accuracy", "macro_f1"} in percent

A task's metrics (Task.metrics: the progress lines, metrics.jsonl, final_metrics.json)
are in percent, as the benchmarks' official figures; the functions above that return
one figure give fractions.

The GLUE score, a benchmark suite's, is t5x_like/benchmarks/metrics.py.
"""

from __future__ import annotations

import collections
import math
import re
import string
from typing import Sequence, Union

import numpy as np

Answers = Union[str, Sequence[str]]


def _valid(predictions, labels) -> tuple[np.ndarray, np.ndarray]:
  predictions, labels = np.asarray(predictions).reshape(-1), np.asarray(labels).reshape(-1)
  if predictions.shape != labels.shape:
    raise ValueError(f"{predictions.shape[0]} predictions for {labels.shape[0]} labels")
  keep = labels >= 0
  return predictions[keep], labels[keep]


def accuracy(predictions, labels) -> float:
  """Fraction of predictions equal to their label, over labels >= 0 (any shape)."""
  predictions, labels = _valid(predictions, labels)
  return float(np.mean(predictions == labels)) if labels.size else 0.0


def macro_f1(predictions, labels) -> float:
  """Unweighted mean over classes c in labels or predictions of
  F1_c = 2 tp / (2 tp + fp + fn) (0 when a class has no true positive)."""
  predictions, labels = _valid(predictions, labels)
  classes = np.union1d(predictions, labels)
  if not classes.size:
    return 0.0
  scores = []
  for c in classes:
    tp = np.sum((predictions == c) & (labels == c))
    fp = np.sum((predictions == c) & (labels != c))
    fn = np.sum((predictions != c) & (labels == c))
    scores.append(2 * tp / (2 * tp + fp + fn))
  return float(np.mean(scores))


_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
  """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
  text = "".join(c for c in text.lower() if c not in _PUNCTUATION)
  return " ".join(_ARTICLES.sub(" ", text).split())


def _as_list(answers: Answers) -> list[str]:
  return [answers] if isinstance(answers, str) else list(answers)


def exact_match(prediction: str, answers: Answers) -> float:
  """1.0 if the normalised prediction equals any normalised gold answer."""
  return float(max(normalize_answer(prediction) == normalize_answer(a)
                   for a in _as_list(answers)))


def _token_f1(prediction: str, answer: str, empty_matches_empty: bool) -> float:
  pred, gold = normalize_answer(prediction).split(), normalize_answer(answer).split()
  if empty_matches_empty and (not pred or not gold):  # evaluate-v2.0.py's compute_f1
    return float(pred == gold)
  common = sum((collections.Counter(pred) & collections.Counter(gold)).values())
  if common == 0:  # evaluate-v1.1.py's f1_score: an empty side shares nothing
    return 0.0
  precision, recall = common / len(pred), common / len(gold)
  return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, answers: Answers, version: str = "v1.1") -> float:
  """Max over gold answers of the F1 of shared normalised tokens (bag of words); v1.1:
  an empty prediction or answer scores 0, v2.0: empty against empty scores 1."""
  return max(_token_f1(prediction, a, version == "v2.0") for a in _as_list(answers))


SQUAD_VERSIONS = ("v1.1", "v2.0")


def squad_scores(predictions: Sequence[str], answers: Sequence[Answers],
                 version: str = "v1.1") -> dict[str, float]:
  """SQuAD's official evaluation, in percent: means over questions of the best exact
  match and token F1 against any gold answer.

  v1.1 (evaluate-v1.1.py): {'exact_match', 'f1'}; an empty prediction scores 0.
  v2.0 (evaluate-v2.0.py): gold answers that normalise to "" are dropped, and a
  question left with none has the one gold answer "" (unanswerable: only the empty
  prediction scores); adds 'HasAns_exact_match', 'HasAns_f1' and 'NoAns_exact_match',
  'NoAns_f1' over the answerable / unanswerable questions, where there are any."""
  if version not in SQUAD_VERSIONS:
    raise ValueError(f"SQuAD version {version!r}: expected one of {SQUAD_VERSIONS}")
  if len(predictions) != len(answers):
    raise ValueError(f"{len(predictions)} predictions for {len(answers)} examples")
  if not predictions:
    return {"exact_match": 0.0, "f1": 0.0}
  golds = [_as_list(a) or [""] for a in answers]
  if version == "v2.0":
    golds = [[a for a in g if normalize_answer(a)] or [""] for g in golds]
  em = np.array([exact_match(p, g) for p, g in zip(predictions, golds)])
  f1 = np.array([token_f1(p, g, version) for p, g in zip(predictions, golds)])
  out = {"exact_match": 100.0 * float(em.mean()), "f1": 100.0 * float(f1.mean())}
  if version == "v2.0":
    has_answer = np.array([g != [""] for g in golds])
    for name, keep in (("HasAns", has_answer), ("NoAns", ~has_answer)):
      if keep.any():
        out[f"{name}_exact_match"] = 100.0 * float(em[keep].mean())
        out[f"{name}_f1"] = 100.0 * float(f1[keep].mean())
  return out


def label_scores(predictions, labels) -> dict[str, float]:
  """{'accuracy', 'macro_f1'} over labels >= 0, in percent (as the benchmarks report)."""
  return {"accuracy": 100.0 * accuracy(predictions, labels),
          "macro_f1": 100.0 * macro_f1(predictions, labels)}


def binary_f1(predictions, labels, positive: int = 1) -> float:
  """F1 = 2 tp / (2 tp + fp + fn) of the `positive` class, over labels >= 0 (0 when it
  has no true positive): GLUE's F1 for MRPC and QQP."""
  predictions, labels = _valid(predictions, labels)
  tp = np.sum((predictions == positive) & (labels == positive))
  fp = np.sum((predictions == positive) & (labels != positive))
  fn = np.sum((predictions != positive) & (labels == positive))
  return float(2 * tp / (2 * tp + fp + fn)) if tp else 0.0


def matthews_corrcoef(predictions, labels) -> float:
  """Matthews correlation over labels >= 0, for any number of classes (Gorodkin 2004):
  (c s - sum_k p_k t_k) / sqrt((s^2 - sum_k p_k^2) (s^2 - sum_k t_k^2)), with c the
  correct predictions, s the examples, p_k / t_k the predictions / labels of class k;
  0 when either factor of the denominator is 0 (one class only). CoLA's metric."""
  predictions, labels = _valid(predictions, labels)
  classes = np.union1d(predictions, labels)
  p = np.array([np.sum(predictions == c) for c in classes], np.float64)
  t = np.array([np.sum(labels == c) for c in classes], np.float64)
  s, c = float(labels.size), float(np.sum(predictions == labels))
  denominator = (s * s - p @ p) * (s * s - t @ t)
  return float((c * s - p @ t) / np.sqrt(denominator)) if denominator > 0 else 0.0


def pearson(a, b) -> float:
  """Pearson's correlation of two [N] arrays (0 when either is constant)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  a, b = a - a.mean(), b - b.mean()
  denominator = math.sqrt(float(np.sum(a * a) * np.sum(b * b)))
  return float(np.sum(a * b) / denominator) if denominator > 0 else 0.0


def ranks(x) -> np.ndarray:
  """Ranks 1..n of an [N] array, ties sharing their mean rank."""
  x = np.asarray(x)
  order = np.argsort(x, kind="stable")
  out = np.empty(len(x))
  out[order] = np.arange(1, len(x) + 1)
  for value in np.unique(x):
    tied = x == value
    out[tied] = out[tied].mean()
  return out


def spearman(a, b) -> float:
  """Spearman's rank correlation: Pearson's of the ranks, ties sharing their mean rank."""
  return pearson(ranks(a), ranks(b))
