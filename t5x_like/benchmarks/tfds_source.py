"""A benchmark's splits from TFDS: `tfds.data_source` (array_record; no TensorFlow, no
download) -> Datasets of the fine-tuning task's Examples.

  data_dir = benchmark_data_dir(config.benchmark.data_dir)     # "" = TFDS's default
  train = read_benchmark_split(bench, "train", task, text_to_text=False, data_dir=data_dir)

The dataset must have been built under data_dir, on a machine with internet:
`tfds build glue/cola --data_dir DIR --file_format array_record` (GLUE's builder needs
TensorFlow there; reading it here does not). A dataset that is not built, a split or a
feature it lacks, are BenchmarkErrors naming the dataset and the directory.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Optional, Sequence

from t5x_like.benchmarks.registry import Benchmark, BenchmarkError, benchmark
from t5x_like.finetune.data import Dataset, dataset_from_rows
from t5x_like.finetune.task import BadRow, Task


def benchmark_data_dir(configured: str) -> str:
  """config.benchmark.data_dir, or TFDS's default ($TFDS_DATA_DIR, ~/tensorflow_datasets)."""
  path = configured or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
  return os.path.expanduser(path)


def build_command(bench: Benchmark, data_dir: str) -> str:
  return f"tfds build {bench.tfds_name} --data_dir {data_dir} --file_format array_record"


def _check_built(bench: Benchmark, data_dir: str) -> None:
  """BenchmarkError unless data_dir holds an array_record build of the dataset (a mocked
  TFDS, tfds.testing.mock_data, needs none)."""
  if _mocked():
    return
  infos = sorted(glob.glob(os.path.join(data_dir, bench.suite, bench.name, "*",
                                        "dataset_info.json")))
  if not infos:
    raise BenchmarkError(f"{bench.tfds_name} is not built under {data_dir}: on a machine with"
                         f" internet run `{build_command(bench, data_dir)}` (or set"
                         " config.benchmark.data_dir)")
  with open(infos[-1]) as f:
    file_format = json.load(f).get("fileFormat", "tfrecord")
  if file_format != "array_record":
    raise BenchmarkError(f"{os.path.dirname(infos[-1])} is a {file_format} build;"
                         f" rebuild it with `{build_command(bench, data_dir)}`")


def _mocked() -> bool:
  """True inside tfds.testing.mock_data (it patches the builder's data source)."""
  import tensorflow_datasets as tfds
  return getattr(tfds.core.DatasetBuilder.as_data_source, "__name__", "") != "as_data_source"


def _builder(bench: Benchmark, data_dir: str):
  """The dataset's builder, after the checks above and of its features."""
  import tensorflow_datasets as tfds
  from tensorflow_datasets.core import read_only_builder
  _check_built(bench, data_dir)
  if _mocked():
    builder = tfds.builder(bench.tfds_name, data_dir=data_dir)
  else:  # from the build's own files: GLUE's builder code needs TensorFlow
    builder = read_only_builder.builder_from_files(bench.tfds_name, data_dir=data_dir)
  features = builder.info.features
  needed = bench.features + (["answers"] if bench.kind == "span" else ["label"])
  absent = [f for f in needed if f not in features]
  if absent:
    raise BenchmarkError(f"{bench.tfds_name} under {data_dir} has no feature {absent[0]!r}"
                         f" (features: {', '.join(features.keys())})")
  return builder


def _check_split(builder, bench: Benchmark, split: str, data_dir: str) -> None:
  if split not in builder.info.splits and not _mocked():
    raise BenchmarkError(f"{bench.tfds_name} under {data_dir} has no split {split!r}"
                         f" (splits: {', '.join(builder.info.splits)})")


def check_benchmark(benchmark_config) -> None:
  """BenchmarkError for config.benchmark's first problem: an unknown name, a dataset not
  built under its data_dir, a feature or a split it lacks (reads metadata only)."""
  bench = benchmark(benchmark_config.name)
  data_dir = benchmark_data_dir(benchmark_config.data_dir)
  builder = _builder(bench, data_dir)
  tests = [split for split, _ in bench.submission] if benchmark_config.predict_test else []
  for split in ["train", *bench.dev_splits, *tests]:
    _check_split(builder, bench, split, data_dir)


def open_split(bench: Benchmark, split: str, data_dir: str):
  """(the split's data source, the dataset's label names), checked."""
  builder = _builder(bench, data_dir)
  _check_split(builder, bench, split, data_dir)
  label = builder.info.features["label"] if "label" in builder.info.features else None
  return builder.as_data_source(split=split), list(getattr(label, "names", None) or [])


def read_benchmark_split(bench: Benchmark, split: str, task: Task, *, text_to_text: bool,
                         data_dir: str, labels: Optional[Sequence[str]] = None,
                         limit: int = 0) -> Dataset:
  """One split as a Dataset (its first `limit` examples when limit > 0), with the
  examples' ids, gold values (SQuAD: every answer; STS-B: the score) and whether the
  split is labeled (a GLUE test split is not: it is predicted for submission only)."""
  source, dataset_labels = open_split(bench, split, data_dir)
  label_names = bench.label_names(dataset_labels, text_to_text)
  count = len(source) if limit <= 0 else min(limit, len(source))
  rows, ids, golds, labeled = [], [], [], []
  for k in range(count):
    record = bench.record(source[k], text_to_text, dataset_labels)
    rows.append((k, _checked_answer(record) if bench.kind == "span" else record))
    ids.append(record["idx"])
    golds.append(record["answers"] if bench.kind == "span" else
                 record["score"] if bench.kind == "regression" else record["label"])
    labeled.append(record["labeled"])
  dataset = dataset_from_rows(f"{bench.tfds_name}:{split}", rows, task,
                              labels if labels is not None else label_names)
  if len(dataset.examples) != len(rows):  # skip_bad_rows dropped some: keep ids aligned
    kept = {example.line for example in dataset.examples}
    ids = [i for (k, _), i in zip(rows, ids) if k in kept]
    golds = [g for (k, _), g in zip(rows, golds) if k in kept]
  dataset.ids, dataset.golds, dataset.labeled = ids, golds, all(labeled) if labeled else True
  return dataset


def _checked_answer(record: dict):
  """A SQuAD row whose first answer is not at its answer_start is a BadRow."""
  answer = record["answer_text"]
  if answer and record["text_pair" if "text_pair" in record else "text"].find(answer) < 0:
    return BadRow("bad_value", f"answer {answer!r} is not in the context")
  return record
