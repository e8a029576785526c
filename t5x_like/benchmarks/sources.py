"""Where a benchmark's splits come from: the distribution's own files when
config.benchmark.data_dir holds them (files_source.py: GLUE's TSV, SuperGLUE's JSONL,
SQuAD's JSON), else a TFDS array_record build there (tfds_source.py). Both give the
same examples in the same order, so everything after (Benchmark.record, the task's rows,
the Dataset) is one path.

  check_benchmark(config.benchmark)             # BenchmarkError, before anything is read
  data_dir = benchmark_data_dir(config.benchmark.data_dir)
  train = read_benchmark_split(bench, "train", task, text_to_text=False, data_dir=data_dir)
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from t5x_like import fs
from t5x_like.benchmarks import files_source, tfds_source
from t5x_like.benchmarks.files_source import SplitExamples
from t5x_like.benchmarks.registry import Benchmark, BenchmarkError, benchmark
from t5x_like.benchmarks.tfds_source import benchmark_data_dir
from t5x_like.finetune.data import Dataset, dataset_from_rows
from t5x_like.finetune.task import BadRow, Task

__all__ = ["benchmark_data_dir", "check_benchmark", "read_benchmark_split"]

_OWN_FILES = {"glue": "GLUE's", "super_glue": "SuperGLUE's", "squad": "SQuAD's"}


def _files_hint(bench: Benchmark, data_dir: str) -> str:
  """What the files reader looked for, for the error of a data_dir with neither."""
  return f"{_OWN_FILES[bench.suite]} {files_source.split_file(bench, 'train', data_dir)}"


def check_benchmark(benchmark_config) -> None:
  """BenchmarkError for config.benchmark's first problem: an unknown name; a data_dir
  set to a file or to nothing there, or holding a folder in another case (`cb/` for
  `CB/`); a data_dir holding neither the task's files nor its TFDS build; a split file,
  a split or a feature missing (reads file listings or TFDS metadata only)."""
  bench = benchmark(benchmark_config.name)
  data_dir = benchmark_data_dir(benchmark_config.data_dir)
  if benchmark_config.data_dir:
    _check_data_dir(bench, data_dir)
  tests = [split for split, _ in bench.submission] if benchmark_config.predict_test else []
  splits = list(dict.fromkeys(["train", *bench.dev_splits, *tests]))
  if files_source.holds_files(bench, data_dir):
    files_source.check_files(bench, data_dir, splits)
  else:
    _check_case(bench, data_dir)
    tfds_source.check_splits(bench, splits, data_dir, _files_hint(bench, data_dir),
                             data_dir_set=bool(benchmark_config.data_dir))


def _check_data_dir(bench: Benchmark, data_dir: str) -> None:
  """BenchmarkError for a config.benchmark.data_dir that is a file or is not there."""
  if fs.is_url(data_dir) or tfds_source.is_built(bench, data_dir):
    return  # a TFDS build in a bucket: tfds_source reads it; or a mocked TFDS
  if os.path.isfile(data_dir):
    raise BenchmarkError(f"config.benchmark.data_dir={data_dir} is a file; expected the"
                         f" folder that holds {_files_hint(bench, '')} or a TFDS build")
  if not os.path.isdir(data_dir):
    raise BenchmarkError(f"config.benchmark.data_dir={data_dir}: no such directory")


def _check_case(bench: Benchmark, data_dir: str) -> None:
  """BenchmarkError where data_dir holds the task's files or build under a name in
  another case (`cb/` for `CB/`); called when neither was found as named."""
  if tfds_source.is_built(bench, data_dir):
    return
  train = os.path.relpath(files_source.split_file(bench, "train", data_dir), data_dir)
  for relative in (train, f"{bench.suite}/{bench.name}"):
    files_source.check_case(bench, data_dir, relative)


def open_examples(bench: Benchmark, split: str, data_dir: str) -> SplitExamples:
  """The split's examples, as TFDS gives them, from whichever source data_dir holds."""
  if files_source.holds_files(bench, data_dir):
    return files_source.read_split(bench, split, data_dir)
  source, label_names = tfds_source.open_split(bench, split, data_dir,
                                               _files_hint(bench, data_dir))
  return SplitExamples(f"{bench.tfds_name}:{split}", source, range(len(source)), label_names)


def read_benchmark_split(bench: Benchmark, split: str, task: Task, *, text_to_text: bool,
                         data_dir: str, labels: Optional[Sequence[str]] = None,
                         limit: int = 0) -> Dataset:
  """One split as a Dataset (its first `limit` examples when limit > 0), with the
  examples' ids, gold values (SQuAD: every answer; STS-B: the score) and whether the
  split is labeled (a GLUE test split is not: it is predicted for submission only).
  A file's unreadable rows are the task's bad rows (an error, or skipped and counted
  with config.task.skip_bad_rows), whatever the limit."""
  part = open_examples(bench, split, data_dir)
  label_names = bench.label_names(part.label_names, text_to_text)
  count = len(part.examples) if limit <= 0 else min(limit, len(part.examples))
  rows, ids, golds, labeled = list(part.bad_rows), [], [], []
  for k in range(count):
    record = bench.record(part.examples[k], text_to_text, part.label_names)
    rows.append((part.lines[k], _checked_answer(record) if bench.kind == "span" else record))
    ids.append(record["idx"])
    golds.append(record["answers"] if bench.kind == "span" else
                 record["score"] if bench.kind == "regression" else record["label"])
    labeled.append(record["labeled"])
  dataset = dataset_from_rows(part.where, rows, task,
                              labels if labels is not None else label_names)
  if len(dataset.examples) != count:  # skip_bad_rows dropped some: keep ids aligned
    kept = {example.line for example in dataset.examples}
    lines = [line for line, _ in rows[len(part.bad_rows):]]
    ids = [i for line, i in zip(lines, ids) if line in kept]
    golds = [g for line, g in zip(lines, golds) if line in kept]
  dataset.ids, dataset.golds, dataset.labeled = ids, golds, all(labeled) if labeled else True
  return dataset


def _checked_answer(record: dict):
  """A SQuAD row whose first answer is not in its context is a BadRow."""
  answer = record["answer_text"]
  if answer and record["text_pair" if "text_pair" in record else "text"].find(answer) < 0:
    return BadRow("bad_value", f"answer {answer!r} is not in the context")
  return record
