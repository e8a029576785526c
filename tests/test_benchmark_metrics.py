"""The benchmarks' official metrics (t5x_like/finetune/metrics.py) against independent
references: scikit-learn's matthews_corrcoef and f1_score, scipy's pearsonr and
spearmanr, a SQuAD table written by hand the way the official evaluate-v2.0.py scores
(normalise: lower case, drop punctuation, articles and extra whitespace; exact match and
token F1, each the max over the gold answers; an empty prediction for an empty gold is a
match), and a GLUE score worked out by hand."""

import numpy as np
import pytest
import scipy.stats
from sklearn import metrics as sk

from t5x_like.benchmarks import metrics as benchmark_metrics
from t5x_like.finetune import metrics


def _random_pairs(seed: int, classes: int, n: int = 200):
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, classes, n)
  # Better than chance, so that the correlations are not all near 0.
  predictions = np.where(rng.random(n) < 0.6, labels, rng.integers(0, classes, n))
  return predictions, labels


@pytest.mark.parametrize("classes", [2, 3, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matthews_and_f1_equal_scikit_learn(classes, seed):
  predictions, labels = _random_pairs(seed, classes)
  assert metrics.matthews_corrcoef(predictions, labels) == pytest.approx(
      sk.matthews_corrcoef(labels, predictions), abs=1e-12)
  assert metrics.macro_f1(predictions, labels) == pytest.approx(
      sk.f1_score(labels, predictions, average="macro"), abs=1e-12)
  if classes == 2:
    assert metrics.binary_f1(predictions, labels) == pytest.approx(
        sk.f1_score(labels, predictions, average="binary"), abs=1e-12)


def test_matthews_and_f1_edge_cases_equal_scikit_learn():
  cases = [([1, 1, 1, 1], [1, 1, 1, 1]),  # one class only: the correlation is 0
           ([0, 0, 0, 0], [1, 0, 1, 0]),  # a constant prediction
           ([1, 0, 1, 0], [0, 1, 0, 1]),  # all wrong: -1
           ([0, 1, 0, 1], [0, 1, 0, 1])]  # all right: 1
  for predictions, labels in cases:
    assert metrics.matthews_corrcoef(predictions, labels) == pytest.approx(
        sk.matthews_corrcoef(labels, predictions), abs=1e-12), (predictions, labels)
    assert metrics.binary_f1(predictions, labels) == pytest.approx(
        sk.f1_score(labels, predictions, zero_division=0.0), abs=1e-12), (predictions, labels)


def test_labels_below_zero_are_left_out():
  predictions, labels = [1, 0, 1, 1, 0], [1, 0, -1, 0, -1]
  kept_p, kept_l = [1, 0, 1], [1, 0, 0]
  assert metrics.matthews_corrcoef(predictions, labels) == pytest.approx(
      sk.matthews_corrcoef(kept_l, kept_p))
  assert metrics.binary_f1(predictions, labels) == pytest.approx(sk.f1_score(kept_l, kept_p))


@pytest.mark.parametrize("seed", [0, 1])
def test_pearson_and_spearman_equal_scipy_with_ties(seed):
  rng = np.random.default_rng(seed)
  gold = rng.integers(0, 6, 80).astype(float)  # STS-B-like scores 0..5, many ties
  predicted = gold + rng.normal(0, 1.5, 80)
  predicted[:10] = 2.5  # ties in the predictions too
  assert metrics.pearson(predicted, gold) == pytest.approx(
      scipy.stats.pearsonr(predicted, gold)[0], abs=1e-12)
  assert metrics.spearman(predicted, gold) == pytest.approx(
      scipy.stats.spearmanr(predicted, gold)[0], abs=1e-12)


# (prediction, gold answers, exact match, F1 by evaluate-v1.1.py, F1 by evaluate-v2.0.py),
# each worked out by hand: v1.1's F1 is 0 when either side is empty, v2.0's is 1 when
# both are.
SQUAD_CASES = [
    ("the Eiffel Tower", ["Eiffel Tower"], 1.0, 1.0, 1.0),  # an article dropped
    ("Eiffel Tower!", ["The Eiffel tower"], 1.0, 1.0, 1.0),  # case and punctuation
    ("in Paris, France", ["Paris"], 0.0, 0.5, 0.5),  # P 1/3, R 1: 2 * (1/3) / (4/3)
    ("Paris", ["London", "paris"], 1.0, 1.0, 1.0),  # the max over the gold answers
    ("New York City", ["New York", "York City"], 0.0, 0.8, 0.8),  # P 2/3, R 1
    ("cats and dogs", ["dogs and cats"], 0.0, 1.0, 1.0),  # F1 counts tokens, not order
    ("three  point   five", ["three point five"], 1.0, 1.0, 1.0),  # whitespace
    ("", [""], 1.0, 0.0, 1.0),  # no answer predicted for no answer
    ("Paris", [""], 0.0, 0.0, 0.0),  # an answer where there is none
    ("", ["Paris"], 0.0, 0.0, 0.0),  # no answer where there is one
    ("an the a", [""], 1.0, 0.0, 1.0),  # articles alone normalise to nothing
    ("Denver Broncos", ["Denver Broncos", "The Denver Broncos", "Broncos"], 1.0, 1.0, 1.0),
    ("the Broncos of Denver", ["Denver Broncos"], 0.0, 0.8, 0.8),  # P 2/3 (of dropped), R 1
]


@pytest.mark.parametrize("prediction, answers, em, f1_v11, f1_v20", SQUAD_CASES)
def test_squad_exact_match_and_f1_follow_the_official_scripts(prediction, answers, em, f1_v11,
                                                               f1_v20):
  assert metrics.exact_match(prediction, answers) == em
  assert metrics.token_f1(prediction, answers, "v1.1") == pytest.approx(f1_v11)
  assert metrics.token_f1(prediction, answers, "v2.0") == pytest.approx(f1_v20)


def test_squad_scores_are_percent_means():
  predictions = [c[0] for c in SQUAD_CASES]
  answers = [c[1] for c in SQUAD_CASES]
  scores = metrics.squad_scores(predictions, answers, "v1.1")
  # 7 exact matches; F1 1 in 6 cases, 0.5, 0.8 and 0.8 in three more, 0 in four.
  assert scores == pytest.approx({"exact_match": 100 * 7 / 13,
                                  "f1": 100 * (6 + 0.5 + 0.8 + 0.8) / 13})
  scores = metrics.squad_scores(predictions, answers, "v2.0")
  # v2.0: the two empty-for-empty cases score F1 1; three questions have no answer
  # ("" golds), of which two predicted none.
  assert scores == pytest.approx({
      "exact_match": 100 * 7 / 13, "f1": 100 * (8 + 0.5 + 0.8 + 0.8) / 13,
      "HasAns_exact_match": 100 * 5 / 10, "HasAns_f1": 100 * (6 + 0.5 + 0.8 + 0.8) / 10,
      "NoAns_exact_match": 100 * 2 / 3, "NoAns_f1": 100 * 2 / 3})


def test_glue_score_averages_each_task_then_the_tasks():
  results = {"cola": {"matthews_corrcoef": 50.0},
             "mrpc": {"f1": 90.0, "accuracy": 80.0},
             "stsb": {"pearson": 80.0, "spearman": 60.0},
             "mnli": {"accuracy_matched": 84.0, "accuracy_mismatched": 83.0}}
  # Task scores 50, 85, 70, 83.5; their mean:
  assert benchmark_metrics.glue_score(results) == pytest.approx((50 + 85 + 70 + 83.5) / 4)
  with pytest.raises(ValueError, match="no task results"):
    benchmark_metrics.glue_score({})
  with pytest.raises(ValueError, match="'rte' has no metrics"):
    benchmark_metrics.glue_score({"rte": {}})
