"""A benchmark's splits from the distribution's own files: GLUE's TSV, SuperGLUE's JSONL,
SQuAD's JSON, read into the examples a TFDS build of them holds.

  data_dir/CoLA/train.tsv dev.tsv test.tsv       GLUE, as its download script lays it out
  data_dir/MNLI/dev_matched.tsv test_mismatched.tsv ...     (MNLI's dev and test pairs)
  data_dir/BoolQ/train.jsonl val.jsonl test.jsonl  SuperGLUE, as its zips unpack
  data_dir/train-v1.1.json dev-v2.0.json ...     SQuAD's official JSON

  if holds_files(bench, data_dir):
    part = read_split(bench, "validation", data_dir)   # SplitExamples
    part.examples[k]  -> {"sentence": "...", "label": 1, "idx": 7}   as TFDS gives it

Each example is what TFDS's builder makes of the same file (tensorflow_datasets/text/
glue.py and super_glue.py, datasets/squad/squad_dataset_builder.py: their
`_generate_examples`, feature names and label lists): the same texts, `idx` (the row's
number among the file's rows; SuperGLUE's own idx; SQuAD's id), label ids (a ClassLabel's
index, -1 on a test split; STS-B's score as a float32) and the same order: a TFDS build
stores a split sorted by the md5 of each example's key salted with the split's name
(tensorflow_datasets/core/writer.py, hashing.py), so a run reads the same examples, its
first `limit` ones included, from either source.

GLUE's quirks, as TFDS reads them: tab-separated with quoting off (a quote is text);
CoLA's train and dev files have no header (source, label, original label, sentence),
its test file has one (index, sentence); MRPC's header starts with a UTF-8 byte-order
mark; MNLI, QNLI and RTE write labels by name, the others by 0 / 1 (either form is
read). Where TFDS passes a broken row silently (a short row is dropped, an extra field
ignored), a row here with a column count other than its header's, a label the task
does not know or a malformed JSON line is a BadRow: `FILE:LINE: expected 4 columns,
got 3`, an error unless config.task.skip_bad_rows (then skipped and counted).
One difference remains: TFDS makes MRPC's train and dev splits from the MSR Paraphrase
corpus file they were both cut from, and numbers `idx` along it; GLUE's MRPC/train.tsv
and dev.tsv no longer say how their rows interleaved there, so `idx` here counts each
file's own rows (texts, labels and the test split are TFDS's).
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import os
from typing import Any, Optional, Sequence

import numpy as np

from t5x_like import fs
from t5x_like.benchmarks.registry import Benchmark, BenchmarkError
from t5x_like.finetune.task import BadRow


@dataclasses.dataclass(frozen=True)
class GlueColumns:
  """A GLUE task's TSV columns (TFDS's GlueConfig): feature -> column name; the label's
  column; the label names (a ClassLabel's, in its order; () for STS-B's score)."""

  texts: tuple[tuple[str, str], ...]
  label: str
  label_names: tuple[str, ...] = ()


_PAIR = (("sentence1", "sentence1"), ("sentence2", "sentence2"))
_ENTAIL = ("entailment", "not_entailment")
GLUE_COLUMNS = {
    "cola": GlueColumns((("sentence", "sentence"),), "is_acceptable",
                        ("unacceptable", "acceptable")),
    "sst2": GlueColumns((("sentence", "sentence"),), "label", ("negative", "positive")),
    "mrpc": GlueColumns((("sentence1", "#1 String"), ("sentence2", "#2 String")), "Quality",
                        ("not_equivalent", "equivalent")),
    "qqp": GlueColumns((("question1", "question1"), ("question2", "question2")),
                       "is_duplicate", ("not_duplicate", "duplicate")),
    "stsb": GlueColumns(_PAIR, "score"),
    "mnli": GlueColumns((("premise", "sentence1"), ("hypothesis", "sentence2")), "gold_label",
                        ("entailment", "neutral", "contradiction")),
    "qnli": GlueColumns((("question", "question"), ("sentence", "sentence")), "label", _ENTAIL),
    "rte": GlueColumns(_PAIR, "label", _ENTAIL),
    "wnli": GlueColumns(_PAIR, "label", ("not_entailment", "entailment")),
}
# CoLA's train / dev files: no header; these columns (TFDS's glue.py, _generate_examples).
_COLA_COLUMNS = 4
_COLA_LABEL, _COLA_SENTENCE = 1, 3

# SuperGLUE (TFDS's SuperGlueConfig): the features each row carries, the label names.
_TF = ("False", "True")
SUPERGLUE_FIELDS = {
    "boolq": (("question", "passage"), _TF),
    "cb": (("premise", "hypothesis"), ("entailment", "contradiction", "neutral")),
    "copa": (("premise", "choice1", "choice2", "question"), ("choice1", "choice2")),
    "rte": (("premise", "hypothesis"), _ENTAIL),
    "wic": (("word", "sentence1", "sentence2", "start1", "start2", "end1", "end2"), _TF),
}


@dataclasses.dataclass
class SplitExamples:
  """One split's examples as TFDS gives them (dicts of its features, in its order), the
  line each starts on in `where` (a TSV / JSONL file's line; a SQuAD file: the
  question's number in it; a TFDS split: the example's position), the rows that could
  not be read (line, BadRow), and the dataset's label names."""

  where: str
  examples: Sequence[dict]
  lines: Sequence[int]
  label_names: list[str]
  bad_rows: list[tuple[int, BadRow]] = dataclasses.field(default_factory=list)


# ====================================================================== where the files are
def split_file(bench: Benchmark, split: str, data_dir: str) -> str:
  """The file of a TFDS split (train / validation / test, MNLI's validation_matched ...)."""
  if bench.suite == "squad":  # SQuAD has no public test split
    return os.path.join(data_dir, f"{'dev' if split == 'validation' else split}-{bench.name}.json")
  if bench.suite == "glue":
    return os.path.join(data_dir, bench.folder, split.replace("validation", "dev") + ".tsv")
  return os.path.join(data_dir, bench.folder, {"validation": "val"}.get(split, split) + ".jsonl")


def task_splits(bench: Benchmark) -> list[str]:
  """The TFDS splits of the task: train, its dev splits, its test splits."""
  return ["train", *bench.dev_splits, *(split for split, _ in bench.submission
                                        if split not in bench.dev_splits)]


def holds_files(bench: Benchmark, data_dir: str) -> bool:
  """Whether data_dir holds any of the task's own split files."""
  return any(os.path.isfile(split_file(bench, split, data_dir)) for split in task_splits(bench))


def check_files(bench: Benchmark, data_dir: str, splits: Sequence[str]) -> None:
  """BenchmarkError naming the first of the splits' files that is not there (a test
  split's names the key that turns it off)."""
  for split in splits:
    path = split_file(bench, split, data_dir)
    if not os.path.isfile(path):
      check_case(bench, data_dir, os.path.relpath(path, data_dir))
      raise BenchmarkError(f"{bench.tfds_name}: {path} is missing (the {split} split; files"
                           f" there: {', '.join(_listing(os.path.dirname(path)))})"
                           + skip_test_hint(bench, split))


def skip_test_hint(bench: Benchmark, split: str) -> str:
  """How to run without a test split (predicted for the submission files only); ""
  for a split the run cannot do without."""
  if split in bench.dev_splits or split not in dict(bench.submission):
    return ""
  return "; to train without it: --config.benchmark.predict_test=false"


def check_case(bench: Benchmark, data_dir: str, relative: str) -> None:
  """BenchmarkError where data_dir/relative is not there but a name on the way to it is,
  in another case (`cb/` for `CB/`)."""
  found = wrong_case(data_dir, relative)
  if found:
    raise BenchmarkError(f"{bench.tfds_name}: {data_dir} holds {found[0]} where {found[1]}"
                         " is read (names are case-sensitive: rename it)")


def wrong_case(data_dir: str, relative: str) -> Optional[tuple[str, str]]:
  """(what data_dir holds, what is read), both relative to data_dir, where a folder or
  file on the way to data_dir/relative differs from its name only in case (`cb/` for
  `CB/`); else None."""
  here = ""
  for part in relative.split("/"):
    path = os.path.join(here, part)
    if os.path.exists(os.path.join(data_dir, path)):
      here = path
      continue
    parent = os.path.join(data_dir, here)
    names = sorted(os.listdir(parent)) if os.path.isdir(parent) else []
    same = [name for name in names if name.lower() == part.lower()]
    if not same:
      return None
    found = os.path.join(here, same[0])
    slash = "/" if os.path.isdir(os.path.join(data_dir, found)) else ""
    return found + slash, path + slash
  return None


def _listing(directory: str) -> list[str]:
  names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
  return names[:12] or ["none"]


# ====================================================================== reading
def read_split(bench: Benchmark, split: str, data_dir: str) -> SplitExamples:
  """The split's examples from its file (module docstring), in a TFDS build's order."""
  check_files(bench, data_dir, [split])
  path = split_file(bench, split, data_dir)
  try:
    text = fs.read_bytes(path).decode("utf-8-sig")  # MRPC's header starts with a BOM
  except UnicodeDecodeError as e:
    raise BenchmarkError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
  if bench.suite == "glue":
    keyed, bad, names = _glue_rows(bench, split, path, text)
  elif bench.suite == "super_glue":
    keyed, bad, names = _superglue_rows(bench, split, text)
  else:
    keyed, bad, names = _squad_rows(bench, path, text), [], []
  keyed.sort(key=lambda item: _tfds_hash(split, item[0]))
  return SplitExamples(path, [example for _, _, example in keyed],
                       [line for _, line, _ in keyed], list(names), bad)


def _tfds_hash(split: str, key: Any) -> int:
  """The position key of a TFDS build: md5 of the key salted with the split's name
  (tensorflow_datasets/core/hashing.py, Hasher(salt=split).hash_key(key))."""
  return int(hashlib.md5(split.encode() + str(key).encode()).hexdigest(), 16)


def _class_index(value: Any, names: Sequence[str]) -> int:
  """A label by name, or by its index as a number or a digit string (TFDS's rule:
  a value that is not a name is cast to int); BadRow when it is neither."""
  if isinstance(value, str) and value in names:
    return list(names).index(value)
  try:
    index = int(value)
  except (TypeError, ValueError):
    index = -1
  if isinstance(value, (bool, float)) or not 0 <= index < len(names):
    raise BadRow("bad_label", f"label {value!r} is not one of {', '.join(names)}"
                 f" (or 0 .. {len(names) - 1})")
  return index


def _glue_rows(bench: Benchmark, split: str, path: str, text: str):
  """([(idx, line, example)], [(line, BadRow)], label names) of a GLUE TSV file."""
  columns = GLUE_COLUMNS[bench.name]
  reader = csv.reader(io.StringIO(text), delimiter="\t", quoting=csv.QUOTE_NONE)
  headerless = bench.name == "cola" and split != "test"
  if headerless:
    width, text_at = _COLA_COLUMNS, {"sentence": _COLA_SENTENCE}
    label_at: Optional[int] = _COLA_LABEL
  else:
    header = next(reader, [])
    width = len(header)
    missing = [column for _, column in columns.texts if column not in header]
    if missing:
      raise BenchmarkError(f"{path}:1: no column {missing[0]!r} in its header (columns:"
                           f" {', '.join(header) or 'none'})")
    text_at = {feature: header.index(column) for feature, column in columns.texts}
    label_at = header.index(columns.label) if columns.label in header else None
    if label_at is None and not split.startswith("test"):
      raise BenchmarkError(f"{path}:1: no label column {columns.label!r} in the"
                           f" {split} split's header (columns: {', '.join(header)})")
  keyed, bad = [], []
  idx = 0
  for row in reader:
    if not row:  # a blank line is no row (csv.DictReader's rule, as TFDS reads)
      continue
    line = reader.line_num
    try:
      if len(row) != width:
        raise BadRow("bad_columns", f"expected {width} columns, got {len(row)}")
      example: dict[str, Any] = {f: row[k] for f, k in text_at.items()}
      example["label"] = (_glue_label(row[label_at], columns) if label_at is not None
                          else -1 if columns.label_names else np.float32(-1))
      example["idx"] = idx
      keyed.append((idx, line, example))
    except BadRow as e:
      bad.append((line, e))
    idx += 1
  return keyed, bad, columns.label_names


def _glue_label(value: str, columns: GlueColumns):
  if columns.label_names:
    return _class_index(value, columns.label_names)
  try:  # STS-B's score, stored as TFDS stores it
    return np.float32(value)
  except ValueError:
    raise BadRow("bad_label", f"score {value!r} is not a number") from None


def _superglue_rows(bench: Benchmark, split: str, text: str):
  """([(idx, line, example)], [(line, BadRow)], label names) of a SuperGLUE JSONL file."""
  fields, names = SUPERGLUE_FIELDS[bench.name]
  keyed, bad = [], []
  for line, source in enumerate(text.splitlines(), 1):
    if not source.strip():
      continue
    try:
      try:
        row = json.loads(source)
      except json.JSONDecodeError as e:
        raise BadRow("bad_json", f"not a JSON object ({e.msg}: column {e.colno})") from None
      absent = [f for f in (*fields, "idx") if not isinstance(row, dict) or f not in row]
      if absent:
        raise BadRow("missing_field", f"no field {absent[0]!r}")
      example = {f: row[f] for f in fields}
      example["idx"] = row["idx"]
      if "label" in row:
        label = row["label"]
        if bench.name == "copa":  # TFDS: "choice2" if row["label"] else "choice1"
          label = names[1] if label else names[0]
        elif isinstance(label, bool):
          label = _TF[label]
        example["label"] = _class_index(label, names)
      elif split == "test":
        example["label"] = -1
      else:
        raise BadRow("missing_field", "no field 'label'")
      keyed.append((row["idx"], line, example))
    except BadRow as e:
      bad.append((line, e))
  return keyed, bad, names


def _squad_rows(bench: Benchmark, path: str, text: str) -> list:
  """[(id, question number, example)] of a SQuAD JSON file, as TFDS's squad builder
  makes them (v1.1: a question id seen twice has its answers merged)."""
  try:
    articles = json.loads(text)["data"]
    questions = [(article.get("title", ""), paragraph["context"], qa)
                 for article in articles for paragraph in article["paragraphs"]
                 for qa in paragraph["qas"]]
  except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
    raise BenchmarkError(f"{path}: not SQuAD's JSON (data / paragraphs / context / qas:"
                         f" {type(e).__name__} {e})") from None
  examples: dict[str, tuple[int, dict]] = {}
  for number, (title, context, qa) in enumerate(questions, 1):
    try:
      answers = qa["answers"]
      example = {"title": title, "context": context, "question": qa["question"],
                 "id": qa["id"],
                 "answers": {"answer_start": [a["answer_start"] for a in answers],
                             "text": [a["text"] for a in answers]}}
      if bench.name == "v2.0":
        plausible = qa.get("plausible_answers", [])
        example["plausible_answers"] = {"answer_start": [a["answer_start"] for a in plausible],
                                        "text": [a["text"] for a in plausible]}
        example["is_impossible"] = qa["is_impossible"]
    except (KeyError, TypeError) as e:
      raise BenchmarkError(f"{path}: question {number} has no field {e}") from None
    if bench.name == "v2.0" and qa["id"] in examples:  # TFDS's build fails on it too
      raise BenchmarkError(f"{path}: question {number}'s id {qa['id']!r} is not unique")
    if qa["id"] in examples:
      merged = examples[qa["id"]][1]["answers"]
      for key in ("answer_start", "text"):
        merged[key] = merged[key] + example["answers"][key]
      continue
    examples[qa["id"]] = (number, example)
  return [(key, number, example) for key, (number, example) in examples.items()]
