"""The benchmarks people report: GLUE, SuperGLUE and SQuAD, read from TFDS.

  bench = benchmark("glue/mrpc")
  bench.record(tfds_example, family, label_names)   -> a row for the task (columns below)
  bench.official_metrics({split: prediction rows})  -> {"f1": 88.1, "accuracy": 84.0}
  write_submission(bench, split, rows, ids, directory)  -> GLUE TSV / SuperGLUE JSONL / SQuAD JSON

One Benchmark per TFDS config says which features make the model's input, for BERT-style
heads (`text` / `text_pair` templates) and for T5 text to text (`t5_input`: the T5
paper's format, e.g. "mrpc sentence1: ... sentence2: ..." -> "equivalent"; Raffel et al.
2020, appendix D, as t5.data.preprocessors.glue writes it: the benchmark's name, then
each feature's name and value), which metrics the leaderboard reports, which splits
are dev and test, and the file a test split's predictions are submitted in.

Rows are what the fine-tuning tasks read (t5x_like/finetune/tasks/): "text", "text_pair",
"label" (a label name, or the score for regression), "answer_text" / "answer_start"
(span extraction, the first gold answer; "" when there is none). Labels come from the
dataset's own ClassLabel feature, in its order, so class k is the dataset's label k.
Metrics are in percent, as the leaderboards print them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional, Sequence

import numpy as np

from t5x_like.errors import UserError
from t5x_like.finetune import metrics as metrics_lib

# STS-B text to text: the score rounded to a multiple of 0.2, as a string (T5's stsb
# preprocessor), so the 26 strings "0.0" .. "5.0" are the labels T5 ranks and generates.
STSB_LABELS = tuple(f"{k / 5:.1f}" for k in range(26))


class BenchmarkError(UserError, ValueError):
  """An unknown benchmark, a dataset not built, or one without a needed feature."""


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """One task of a benchmark (a TFDS config). kind: classification | regression | span.
  text / text_pair / t5_input: str.format templates over the example's features.
  metrics: the official ones, keyed by dev split when there are several (MNLI).
  submission: {test split: file name}; submission_format: glue_tsv | superglue_jsonl |
  squad_json (the dev split's predictions: SQuAD has no public test split).
  label_format: how a GLUE / SuperGLUE file writes a class: index | name | bool.
  folder: the task's directory in the distribution's own download (GLUE's download
  script, SuperGLUE's zips: CoLA, SST-2, BoolQ ...; benchmarks/files_source.py)."""

  suite: str
  name: str
  kind: str
  text: str
  t5_input: str
  text_pair: str = ""
  metrics: tuple[str, ...] = ("accuracy",)
  dev_splits: tuple[str, ...] = ("validation",)
  submission: tuple[tuple[str, str], ...] = ()
  submission_format: str = "glue_tsv"
  label_format: str = "index"
  positive_label: int = 1  # F1's positive class (MRPC, QQP)
  folder: str = ""
  unanswerable: bool = False  # questions may have no answer (SQuAD 2.0)

  @property
  def tfds_name(self) -> str:
    return f"{self.suite}/{self.name}"

  @property
  def features(self) -> list[str]:
    """The TFDS features the input templates read."""
    import string
    names = set()
    for template in (self.text, self.text_pair, self.t5_input):
      names.update(f for _, f, _, _ in string.Formatter().parse(template) if f)
    return sorted(names)

  def task_name(self, text_to_text: bool) -> str:
    """The fine-tuning task type (t5x_like/finetune/tasks/) for a family."""
    if self.kind == "span":
      return "text_generation" if text_to_text else "span_extraction"
    if self.kind == "regression" and not text_to_text:
      return "regression"
    return "classification"  # T5's STS-B is text to text over STSB_LABELS

  def label_names(self, dataset_labels: Sequence[str], text_to_text: bool) -> tuple[str, ...]:
    """The label list of the task: the dataset's ClassLabel names (STS-B for T5: the
    26 score strings; regression and spans: none)."""
    if self.kind == "regression":
      return STSB_LABELS if text_to_text else ()
    return tuple(dataset_labels) if self.kind == "classification" else ()

  # ---------------------------------------------------------------- rows
  def record(self, example: dict, text_to_text: bool, label_names: Sequence[str]) -> dict:
    """A TFDS example (bytes decoded) -> the task's row; an unlabeled example (label
    -1, a test split) gets the first label as a placeholder ('labeled': False)."""
    values = {k: _text(v) for k, v in example.items()}
    row: dict[str, Any] = {"idx": _scalar(example.get("idx", example.get("id")))}
    if text_to_text:
      row["text"] = self.t5_input.format(**values)
    else:
      row["text"] = self.text.format(**values)
      if self.text_pair:
        row["text_pair"] = self.text_pair.format(**values)
    if self.kind == "span":
      answers = [_text(a) for a in example["answers"]["text"]]
      starts = [int(s) for s in example["answers"]["answer_start"]]
      row["answers"] = answers
      row["answer_text"] = answers[0] if answers else ""
      row["answer_start"] = starts[0] if answers else -1
      if text_to_text:
        row["label"] = row["answer_text"]
      row["labeled"] = True
      return row
    label = example["label"]
    if self.kind == "regression":  # a test split's score is -1
      score = float(label)
      row["labeled"] = score >= 0
      score = max(score, 0.0)
      row["label"] = f"{round(score * 5) / 5:.1f}" if text_to_text else score
      row["score"] = score
      return row
    row["labeled"] = int(label) >= 0
    row["label"] = label_names[int(label)] if int(label) >= 0 else label_names[0]
    return row

  # ---------------------------------------------------------------- metrics
  def official_metrics(self, rows_by_split: dict[str, list[dict]],
                       label_names: Sequence[str], golds_by_split: dict[str, list]
                       ) -> dict[str, float]:
    """The leaderboard's metrics (percent) of each dev split's prediction rows
    (finetune/evaluate.prediction_rows); MNLI's are suffixed _matched / _mismatched."""
    out = {}
    for split, rows in rows_by_split.items():
      suffix = "" if len(rows_by_split) == 1 else "_" + split.split("_")[-1]
      for key, value in self._split_metrics(rows, label_names, golds_by_split[split]).items():
        out[key + suffix] = value
    return out

  def _split_metrics(self, rows: list[dict], label_names: Sequence[str], golds: list
                     ) -> dict[str, float]:
    if self.kind == "span":
      predicted = [row["prediction"] or "" for row in rows]
      return metrics_lib.squad_scores(predicted, [g or [""] for g in golds],
                                      "v2.0" if self.unanswerable else "v1.1")
    if self.kind == "regression":
      predicted = np.array([_score(row["prediction"]) for row in rows], np.float64)
      gold = np.array(golds, np.float64)
      return {"pearson": 100 * metrics_lib.pearson(predicted, gold),
              "spearman": 100 * metrics_lib.spearman(predicted, gold)}
    lookup = {name: k for k, name in enumerate(label_names)}
    predicted = np.array([lookup.get(row["prediction"], -1) for row in rows])
    gold = np.array([lookup[row["label"]] for row in rows])
    scores = {"accuracy": metrics_lib.accuracy(predicted, gold),
              "f1": metrics_lib.binary_f1(predicted, gold, self.positive_label),
              "macro_f1": metrics_lib.macro_f1(predicted, gold),
              "mcc": metrics_lib.matthews_corrcoef(predicted, gold)}
    return {k: 100 * scores[k] for k in self.metrics}

  def scores(self, key: str) -> bool:
    """Whether an official_metrics key is one of the headline metrics a task's score
    averages (MNLI's with their _matched / _mismatched suffix; not SQuAD 2.0's
    HasAns_* / NoAns_*)."""
    return key in self.metrics or (len(self.dev_splits) > 1
                                   and key.rsplit("_", 1)[0] in self.metrics)

  # ---------------------------------------------------------------- submissions
  def submission_lines(self, rows: list[dict], ids: list, label_names: Sequence[str]) -> str:
    """The file's text for one split's prediction rows (ids: the examples' idx / id), in
    index order as GLUE's and SuperGLUE's own files are (TFDS stores them shuffled)."""
    order = sorted(range(len(rows)), key=lambda k: ids[k])
    rows, ids = [rows[k] for k in order], [ids[k] for k in order]
    if self.submission_format == "squad_json":
      return json.dumps({str(i): row["prediction"] or "" for i, row in zip(ids, rows)},
                        indent=1) + "\n"
    values = [self._submitted(row["prediction"], label_names) for row in rows]
    if self.submission_format == "superglue_jsonl":
      return "".join(json.dumps({"idx": int(i), "label": v}) + "\n" for i, v in zip(ids, values))
    return "index\tprediction\n" + "".join(f"{int(i)}\t{v}\n" for i, v in zip(ids, values))

  def _submitted(self, prediction, label_names: Sequence[str]):
    if self.kind == "regression":
      return f"{min(max(_score(prediction), 0.0), 5.0):.3f}"
    # A text-to-text model that generated no label: the first label, so every row has one.
    name = prediction if prediction in label_names else label_names[0]
    k = list(label_names).index(name)
    if self.label_format == "name":
      return name
    if self.label_format == "bool":
      return "true" if name == "True" else "false"
    return k if self.submission_format == "superglue_jsonl" else str(k)


def _text(value) -> Any:
  if isinstance(value, bytes):
    return value.decode("utf-8")
  if isinstance(value, np.ndarray) and value.dtype.kind in "SO":
    return [_text(v) for v in value.tolist()]
  if isinstance(value, dict):
    return {k: _text(v) for k, v in value.items()}
  return value


def _scalar(value):
  if value is None:
    return None
  value = _text(value)
  # TFDS's mock data gives a 0-d array where a build gives a numpy scalar
  return value.item() if isinstance(value, (np.generic, np.ndarray)) and np.ndim(value) == 0 \
      else value


def _score(value) -> float:
  """A regression prediction as a float; a generated non-number (T5) counts as 0."""
  try:
    return float(value)
  except (TypeError, ValueError):
    return 0.0


# ====================================================================== the registry
def _glue(name, kind, text, t5_input, text_pair="", metrics=("accuracy",), file="",
          label_format="index", dev_splits=("validation",), tests=("test",)):
  files = (file,) if len(tests) == 1 else (f"{file}-m.tsv", f"{file}-mm.tsv")
  files = tuple(f if f.endswith(".tsv") else f + ".tsv" for f in files)
  return Benchmark("glue", name, kind, text, t5_input, text_pair, metrics, dev_splits,
                   tuple(zip(tests, files)), "glue_tsv", label_format, folder=file)


def _superglue(name, text, t5_input, text_pair="", metrics=("accuracy",), file="",
               label_format="name"):
  return Benchmark("super_glue", name, "classification", text, t5_input, text_pair, metrics,
                   ("validation",), (("test", file),), "superglue_jsonl", label_format,
                   folder=file.removesuffix(".jsonl"))


BENCHMARKS: dict[str, Benchmark] = {b.tfds_name: b for b in [
    _glue("cola", "classification", "{sentence}", "cola sentence: {sentence}",
          metrics=("mcc",), file="CoLA"),
    _glue("sst2", "classification", "{sentence}", "sst2 sentence: {sentence}", file="SST-2"),
    _glue("mrpc", "classification", "{sentence1}", "mrpc sentence1: {sentence1} sentence2:"
          " {sentence2}", "{sentence2}", metrics=("f1", "accuracy"), file="MRPC"),
    _glue("qqp", "classification", "{question1}", "qqp question1: {question1} question2:"
          " {question2}", "{question2}", metrics=("f1", "accuracy"), file="QQP"),
    _glue("stsb", "regression", "{sentence1}", "stsb sentence1: {sentence1} sentence2:"
          " {sentence2}", "{sentence2}", metrics=("pearson", "spearman"), file="STS-B"),
    _glue("mnli", "classification", "{premise}", "mnli hypothesis: {hypothesis} premise:"
          " {premise}", "{hypothesis}", file="MNLI", label_format="name",
          dev_splits=("validation_matched", "validation_mismatched"),
          tests=("test_matched", "test_mismatched")),
    _glue("qnli", "classification", "{question}", "qnli question: {question} sentence:"
          " {sentence}", "{sentence}", file="QNLI", label_format="name"),
    _glue("rte", "classification", "{sentence1}", "rte sentence1: {sentence1} sentence2:"
          " {sentence2}", "{sentence2}", file="RTE", label_format="name"),
    _glue("wnli", "classification", "{sentence1}", "wnli sentence1: {sentence1} sentence2:"
          " {sentence2}", "{sentence2}", file="WNLI"),
    _superglue("boolq", "{question}", "boolq passage: {passage} question: {question}",
               "{passage}", file="BoolQ.jsonl", label_format="bool"),
    _superglue("cb", "{premise}", "cb hypothesis: {hypothesis} premise: {premise}",
               "{hypothesis}", metrics=("accuracy", "macro_f1"), file="CB.jsonl"),
    # COPA as a pair classification: which choice is the premise's cause / effect.
    _superglue("copa", "{premise} What was the {question}?", "copa choice1: {choice1}"
               " choice2: {choice2} premise: {premise} question: {question}",
               "{choice1} or {choice2}", file="COPA.jsonl", label_format="index"),
    _superglue("rte", "{premise}", "rte hypothesis: {hypothesis} premise: {premise}",
               "{hypothesis}", file="RTE.jsonl"),
    _superglue("wic", "{word}: {sentence1}", "wic sentence1: {sentence1} sentence2:"
               " {sentence2} word: {word}", "{sentence2}", file="WiC.jsonl",
               label_format="bool"),
    Benchmark("squad", "v1.1", "span", "{question}", "question: {question} context:"
              " {context}", "{context}", ("exact_match", "f1"),
              submission=(("validation", "predictions.json"),), submission_format="squad_json"),
    Benchmark("squad", "v2.0", "span", "{question}", "question: {question} context:"
              " {context}", "{context}", ("exact_match", "f1"),
              submission=(("validation", "predictions.json"),), submission_format="squad_json",
              unanswerable=True),
]}

SUITES = {suite: [b.name for b in BENCHMARKS.values() if b.suite == suite]
          for suite in ("glue", "super_glue", "squad")}


def benchmark(name: str) -> Benchmark:
  """The Benchmark of a TFDS name such as "glue/cola" (BenchmarkError if none)."""
  if name not in BENCHMARKS:
    raise BenchmarkError(f"config.benchmark.name={name!r}: expected one of"
                         f" {', '.join(BENCHMARKS)}")
  return BENCHMARKS[name]


def write_submission(bench: Benchmark, split: str, rows: list[dict], ids: list,
                     label_names: Sequence[str], directory: str) -> Optional[str]:
  """Writes the split's submission file under directory (via t5x_like.fs); its path,
  or None when the split is not submitted."""
  from t5x_like import fs
  files = dict(bench.submission)
  if split not in files:
    return None
  path = os.path.join(directory, files[split])
  fs.make_dirs(directory)
  fs.write_bytes(path, bench.submission_lines(rows, ids, label_names).encode())
  return path
