"""SQuAD as BERT's run_squad.py and the official evaluation scripts do it: windows with a
document stride, the n-best span over an example's windows mapped back to whole words,
v1.1 never empty, v2.0's null-score threshold, and evaluate-v1.1.py / evaluate-v2.0.py's
scores on hand-worked cases (Rajpurkar et al. 2016, 2018)."""

import collections
import json
import os
import re
import string

import numpy as np
import pytest

from t5x_like.finetune import metrics
from t5x_like.finetune.data import Dataset
from t5x_like.finetune.encoding import encode_examples
from t5x_like.finetune.task import BadRow, Example
from t5x_like.finetune.tasks import make_task
from t5x_like.finetune.tasks.span_extraction import (best_answers, doc_windows,
                                                     max_context_windows, span_text,
                                                     whole_words)
from t5x_like.finetune.wordpiece import WordPieceTokenizer

NEG = -1e9


# ------------------------------------------------------------------ the official scores
def test_v11_scores_equal_the_official_script_by_hand():
  # evaluate-v1.1.py: exact match compares normalised strings (so "" matches "."), and
  # F1 is 0 whenever the two share no token, an empty side included.
  got = metrics.squad_scores(["", "the", "Denver Broncos"],
                             [["."], [".", "x"], ["the Denver Broncos"]], "v1.1")
  assert got == pytest.approx({"exact_match": 100.0, "f1": 100 / 3})
  cases = [("the Eiffel Tower", ["Eiffel Tower"], 1, 1.0),
           ("in Paris, France", ["Paris"], 0, 0.5),  # P 1/3, R 1
           ("New York City", ["New York", "York City"], 0, 0.8),  # P 2/3, R 1
           ("", ["Paris"], 0, 0.0),
           ("the Broncos of Denver", ["Denver Broncos"], 0, 0.8)]  # P 2/3, R 1
  got = metrics.squad_scores([c[0] for c in cases], [c[1] for c in cases], "v1.1")
  assert got == pytest.approx({"exact_match": 100 * 1 / 5, "f1": 100 * 3.1 / 5})


def test_v20_scores_with_has_answer_and_no_answer_by_hand():
  # evaluate-v2.0.py: gold answers that normalise to "" are dropped; a question left
  # with none is unanswerable (gold ""), where only an empty prediction scores, 1 and 1.
  predictions = ["", "the", "Denver Broncos", "Paris", "", "in Paris, France"]
  golds = [["."], [".", "x"], ["the Denver Broncos"], [], [], ["Paris", "France"]]
  # per question (EM, F1): (1, 1) NoAns; (0, 0) HasAns ("x"); (1, 1) HasAns;
  # (0, 0) NoAns (an answer where there is none); (1, 1) NoAns; (0, 0.5) HasAns
  got = metrics.squad_scores(predictions, golds, "v2.0")
  assert got == pytest.approx({
      "exact_match": 100 * 3 / 6, "f1": 100 * 3.5 / 6,
      "HasAns_exact_match": 100 * 1 / 3, "HasAns_f1": 100 * 1.5 / 3,
      "NoAns_exact_match": 100 * 2 / 3, "NoAns_f1": 100 * 2 / 3})
  with pytest.raises(ValueError, match="version"):
    metrics.squad_scores(["a"], [["a"]], "v3")


# ------------------------------------------------------------------ windows
def test_windows_follow_run_squads_doc_spans_and_max_context():
  assert doc_windows(10, 4, 3) == [(0, 4), (3, 4), (6, 4)]
  assert doc_windows(10, 4, 8) == [(0, 4), (4, 4), (8, 2)]  # a stride over the room
  assert doc_windows(3, 4, 2) == [(0, 3)] and doc_windows(0, 4, 2) == [(0, 0)]
  # token 3: min(3, 0) + 0.04 in the first window and min(0, 3) + 0.04 in the second:
  # the first wins the tie; token 6 likewise goes to the second.
  best = max_context_windows(doc_windows(10, 4, 3), 10)
  assert best.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]


def _wordpiece():
  words = ["the", "city", "of", "light", "is", "paris", ",", "where", "he", "lives", ";",
           "nothing", "else", ".", "who", "?", "change", "(", "i", "##pcc", ")", "in", "20",
           "##15", "climate", "panel", "founded", "when", "what"]
  return WordPieceTokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words)


CONTEXT = ("The city of light is Paris, where he lives; nothing else. The climate panel"
           " Change (IPCC) was founded in 2015.")


def _example(question, answer, context=CONTEXT):
  return Example(question, context, answer_text=answer,
                 answer_start=context.index(answer) if answer else -1)


def test_every_answer_is_in_a_window_and_the_others_point_at_cls():
  tok = _wordpiece()
  task = make_task("span_extraction", text_pair_column="context", max_length=16,
                   max_question_length=4, doc_stride=4)
  examples = [_example("Who?", a) for a in ("Paris", "he lives", "nothing else", "2015",
                                           "Change (IPCC)")]
  features, stats = encode_examples(examples, tok, task)
  assert stats["answers_lost"] == 0 and stats["examples"] == 5 and stats["rows"] > 10
  for k, example in enumerate(examples):
    rows = np.flatnonzero(features["example_index"] == k)
    assert len(rows) > 1  # the context needs several windows of 16 positions
    holding = [r for r in rows if features["start_positions"][r] > 0]
    assert holding, example.answer_text
    for r in holding:
      assert span_text(CONTEXT, features["context_offsets"][r], features["start_positions"][r],
                       features["end_positions"][r]) == example.answer_text
    # Each context token has exactly one max-context window.
    counts = {}
    for r in rows:
      for (lo, hi), keep in zip(features["context_offsets"][r], features["max_context"][r]):
        if lo >= 0:
          counts[lo] = counts.get(lo, 0) + int(keep)
    assert set(counts.values()) == {1}
  # An answer longer than a window's room is lost, and counted.
  long_answer = _example("Who?", "The city of light is Paris, where he lives; nothing else.")
  _, stats = encode_examples([long_answer], tok, task, training=True)
  assert stats["answers_lost"] == 1


def test_windows_overlap_by_the_longest_answer_and_training_adds_one_for_longer_ones():
  tok = _wordpiece()
  # 16 positions, a 2-token question: room 11; max_answer_tokens 4 caps the stride at
  # 11 - 4 + 1 = 8 although doc_stride asks for 10. CONTEXT's 28 tokens: windows at
  # tokens 0 (The), 8 (he), 16 (panel), 24 (in).
  task = make_task("span_extraction", text_pair_column="context", max_length=16,
                   doc_stride=10, max_answer_tokens=4)
  example = _example("Who?", "is Paris, where he lives; nothing")  # tokens 4-11
  features, stats = encode_examples([example], tok, task)
  offsets = features["context_offsets"]
  firsts = [int(row[np.flatnonzero(row[:, 0] >= 0)[0], 0]) for row in offsets]
  assert firsts == [0, CONTEXT.index("he lives"), CONTEXT.index("panel"),
                    CONTEXT.index("in 2015")]
  # 8 tokens, longer than max_answer_tokens: no evaluation window holds it whole ...
  assert stats["answers_lost"] == 1 and not features["start_positions"].any()
  # ... and training adds one around it (tokens 3-13).
  train, train_stats = encode_examples([example], tok, task, training=True)
  assert train_stats["answers_lost"] == 0 and train_stats["rows"] == stats["rows"] + 1
  np.testing.assert_array_equal(train["context_offsets"][:-1], offsets)
  assert span_text(CONTEXT, train["context_offsets"][-1], train["start_positions"][-1],
                   train["end_positions"][-1]) == example.answer_text


def test_a_question_without_an_answer_needs_allow_no_answer():
  task = make_task("span_extraction", text_column="q", text_pair_column="c",
                   answer_text_column="a", answer_start_column="s")
  with pytest.raises(BadRow, match="allow_no_answer=true"):
    task.parse({"q": "Who?", "c": "Nobody.", "a": "", "s": -1}, 2, {}, ())
  allowed = make_task("span_extraction", text_column="q", text_pair_column="c",
                      answer_text_column="a", answer_start_column="s", allow_no_answer=True)
  assert allowed.parse({"q": "Who?", "c": "Nobody.", "a": "", "s": -1}, 2, {}, ()).answer_text == ""
  generation = make_task("text_generation")
  with pytest.raises(BadRow, match="allow_no_answer=true"):
    generation.parse({"text": "question: Who?", "label": " "}, 2, {}, ())


# ------------------------------------------------------------------ answers
def test_spans_widen_to_whole_words():
  text = "Change (IPCC) was founded in 2015."
  assert whole_words(text, 0, 9) == (0, 12)  # "Change (I" -> "Change (IPCC"
  assert text[slice(*whole_words(text, 29, 32))] == "2015"  # "201"
  assert text[slice(*whole_words(text, 8, 10))] == "IPCC"  # "PC"
  assert text[slice(*whole_words(text, 7, 8))] == "("  # punctuation is a word of its own
  assert whole_words(text, 14, 17) == (14, 17)  # already whole


def _two_windows():
  """One example in two windows of 8 positions: window 0 holds context characters
  0-29 at positions 3-6, window 1 characters 20-45 at positions 3-6."""
  context = "alpha beta gamma delta epsilon zeta eta theta"
  offsets = np.full((2, 8, 2), -1, np.int32)
  offsets[0, 3:7] = [[0, 5], [6, 10], [11, 16], [17, 22]]  # alpha beta gamma delta
  offsets[1, 3:7] = [[17, 22], [23, 30], [31, 35], [36, 39]]  # delta epsilon zeta eta
  return context, {"example_index": np.array([0, 0]), "context_offsets": offsets}


def _predictions(starts, ends, null):
  """predict's outputs from {row: {position: logit}} (K = 3; the rest masked)."""
  def top(table):
    index, logit = np.zeros((2, 3), np.int32), np.full((2, 3), NEG, np.float32)
    for row, chosen in table.items():
      for j, (position, value) in enumerate(sorted(chosen.items(), key=lambda x: -x[1])):
        index[row, j], logit[row, j] = position, value
    return index, logit
  (si, sv), (ei, ev) = top(starts), top(ends)
  return {"start_index": si, "start_logit": sv, "end_index": ei, "end_logit": ev,
          "null_score": np.asarray(null, np.float32)}


def test_the_best_span_over_all_windows_within_the_answer_length():
  context, features = _two_windows()
  # window 0: start "beta" (4) 2.0, end "gamma" (5) 1.0 -> 3.0; window 1: start
  # "epsilon" (4) 3.0, end "zeta" (5) 1.5 -> 4.5 wins; end before start never counts.
  predictions = _predictions({0: {4: 2.0}, 1: {4: 3.0, 6: 9.0}}, {0: {5: 1.0}, 1: {5: 1.5}},
                             [0.0, 0.0])
  assert best_answers(predictions, features, [context], 30, False) == ["epsilon zeta"]
  # max_answer_tokens=1: only start = end counts: window 0's "gamma" (5, 5), 1.5.
  predictions = _predictions({0: {4: 2.0, 5: 0.5}, 1: {4: 3.0}}, {0: {5: 1.0}, 1: {5: 1.5}},
                             [0.0, 0.0])
  assert best_answers(predictions, features, [context], 1, False) == ["gamma"]


def test_v11_never_predicts_empty_and_v20_follows_the_null_threshold():
  context, features = _two_windows()
  predictions = _predictions({0: {3: 1.0}, 1: {3: 0.5}}, {0: {4: 1.0}, 1: {3: 0.2}},
                             [5.0, 2.5])
  # best span: window 0 "alpha beta", 2.0; the null score is the least over windows, 2.5
  assert best_answers(predictions, features, [context], 30, False) == ["alpha beta"]
  assert best_answers(predictions, features, [context], 30, True) == [""]  # 2.5 - 2.0 > 0
  assert best_answers(predictions, features, [context], 30, True, 0.5) == ["alpha beta"]
  assert best_answers(predictions, features, [context], 30, True, 0.4) == [""]


def test_dev_metrics_and_rows_score_the_examples_not_the_windows():
  context, features = _two_windows()
  task = make_task("span_extraction", text_pair_column="context", allow_no_answer=True)
  predictions = _predictions({0: {3: 1.0}, 1: {4: 3.0}}, {0: {4: 1.0}, 1: {5: 1.5}},
                             [0.0, 0.0])
  dataset = Dataset("dev", [Example("q", context, answer_text="epsilon", answer_start=23)],
                    (), {}, golds=[["epsilon zeta", "zeta"]])
  assert task.metrics(predictions, features, dataset) == pytest.approx(
      {"exact_match": 100.0, "f1": 100.0, "HasAns_exact_match": 100.0, "HasAns_f1": 100.0})
  assert task.prediction_rows(predictions, features, dataset) == [
      {"answer": "epsilon", "prediction": "epsilon zeta"}]


# ------------------------------------------------------------------ end to end
def _v20_files(directory) -> list[list[str]]:
  """Hand-made SQuAD 2.0 train and dev files (the official JSON) in directory; the dev
  questions' gold answers ([] when unanswerable)."""
  context = "The mill stands by the river. Anna built it in 1890 with her brother Tom."
  questions = [("Who built the mill?", ["Anna", "her brother Tom"]),
               ("When was it built?", ["1890", "in 1890"]),
               ("Where is the mill?", ["by the river"]),
               ("What colour is the mill?", []),
               ("Who owns the river?", [])]
  golds = []
  for split in ("train", "dev"):
    qas = []
    for k, (question, answers) in enumerate(questions):
      qas.append({"id": f"{split}{k}", "question": question, "is_impossible": not answers,
                  "answers": [{"text": a, "answer_start": context.index(a)} for a in answers]})
    with open(os.path.join(directory, f"{split}-v2.0.json"), "w") as f:
      json.dump({"version": "v2.0", "data": [{"title": "Mill", "paragraphs": [
          {"context": context, "qas": qas}]}]}, f)
    golds = [answers for _, answers in questions]
  return golds


@pytest.mark.slow
def test_squad_v20_end_to_end_on_a_hand_made_file(tmp_path):
  """The null-score threshold on a fine-tuned model (configs/squad.py:v2.0,smoke): at
  -1e9 the null answer always wins, so every prediction is "" and the scores are the
  hand-worked ones of an all-empty prediction; at +1e9 it never does (no ""), and the
  scores equal evaluate-v2.0.py's definition recomputed here."""
  from helpers import load_config
  from t5x_like.benchmarks.task_data import task_data
  from t5x_like.finetune.loop import finetune
  golds = _v20_files(str(tmp_path))
  predicted = {}
  for threshold in (-1e9, 1e9):
    config = load_config("squad", "v2.0,smoke")
    config.benchmark.data_dir = str(tmp_path)
    config.task.null_score_threshold = threshold
    workdir = str(tmp_path / f"run{threshold:g}")
    result = finetune(config, workdir, data=task_data(config))
    with open(os.path.join(workdir, "submission", "predictions.json")) as f:
      predicted[threshold] = (json.load(f), result["official"])
  answers, official = predicted[-1e9]
  assert sorted(answers) == [f"dev{k}" for k in range(5)] and set(answers.values()) == {""}
  # 3 answerable questions, all wrong (EM 0, F1 0); 2 unanswerable, both right.
  assert official == pytest.approx({"exact_match": 40.0, "f1": 40.0, "HasAns_exact_match": 0.0,
                                    "HasAns_f1": 0.0, "NoAns_exact_match": 100.0,
                                    "NoAns_f1": 100.0}, abs=1e-3)
  answers, official = predicted[1e9]
  texts = [answers[f"dev{k}"] for k in range(5)]
  assert all(texts)

  def normalize(s):  # evaluate-v2.0.py's normalize_answer
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())

  def f1(gold, pred):  # evaluate-v2.0.py's compute_f1
    g, p = normalize(gold).split(), normalize(pred).split()
    if not g or not p:
      return float(g == p)
    same = sum((collections.Counter(g) & collections.Counter(p)).values())
    return 0.0 if same == 0 else 2 * same / (len(g) + len(p))

  gold_lists = [[a for a in g if normalize(a)] or [""] for g in golds]
  em = [max(float(normalize(a) == normalize(t)) for a in g) for g, t in zip(gold_lists, texts)]
  f = [max(f1(a, t) for a in g) for g, t in zip(gold_lists, texts)]
  assert official["exact_match"] == pytest.approx(100 * np.mean(em), abs=1e-3)
  assert official["f1"] == pytest.approx(100 * np.mean(f), abs=1e-3)
  assert official["NoAns_exact_match"] == 0.0  # never the empty answer
