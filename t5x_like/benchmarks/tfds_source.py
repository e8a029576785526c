"""A benchmark's splits from TFDS: `tfds.data_source` (array_record; no TensorFlow, no
download), read through benchmarks/sources.py (which reads the distribution's own files
instead where data_dir holds them: files_source.py).

  data_dir = benchmark_data_dir(config.benchmark.data_dir)     # "" = TFDS's default
  source, label_names = open_split(bench, "train", data_dir)   # source[k]: an example

The dataset must have been built under data_dir, on a machine with internet:
`tfds build glue/cola --data_dir DIR --file_format array_record` (GLUE's builder needs
TensorFlow there; reading it here does not). A dataset that is not built, a split or a
feature it lacks, are BenchmarkErrors naming the dataset and the directory.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Sequence

from t5x_like.benchmarks.files_source import skip_test_hint
from t5x_like.benchmarks.registry import Benchmark, BenchmarkError


def benchmark_data_dir(configured: str) -> str:
  """config.benchmark.data_dir, or TFDS's default ($TFDS_DATA_DIR, ~/tensorflow_datasets)."""
  path = configured or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
  return os.path.expanduser(path)


def build_command(bench: Benchmark, data_dir: str) -> str:
  return f"tfds build {bench.tfds_name} --data_dir {data_dir} --file_format array_record"


def is_built(bench: Benchmark, data_dir: str) -> bool:
  """Whether data_dir holds a build of the dataset (in any file format), or TFDS is mocked."""
  return _mocked() or bool(glob.glob(_info_pattern(bench, data_dir)))


def _info_pattern(bench: Benchmark, data_dir: str) -> str:
  return os.path.join(data_dir, bench.suite, bench.name, "*", "dataset_info.json")


def _check_built(bench: Benchmark, data_dir: str, files_hint: str = "",
                 data_dir_set: bool = False) -> None:
  """BenchmarkError unless data_dir holds an array_record build of the dataset (a mocked
  TFDS, tfds.testing.mock_data, needs none); files_hint: the files also looked for;
  data_dir_set: config.benchmark.data_dir named it (no advice to set it then)."""
  if _mocked():
    return
  pattern = _info_pattern(bench, data_dir)
  infos = sorted(glob.glob(pattern))
  if not infos:
    looked = f"; looked for {pattern}" + (f" and {files_hint}" if files_hint else "")
    advice = "" if data_dir_set else " (or set config.benchmark.data_dir)"
    raise BenchmarkError(f"{bench.tfds_name} is not built under {data_dir}: on a machine with"
                         f" internet run `{build_command(bench, data_dir)}`{advice}{looked}")
  with open(infos[-1]) as f:
    file_format = json.load(f).get("fileFormat", "tfrecord")
  if file_format != "array_record":
    raise BenchmarkError(f"{os.path.dirname(infos[-1])} is a {file_format} build;"
                         f" rebuild it with `{build_command(bench, data_dir)}`")


def _mocked() -> bool:
  """True inside tfds.testing.mock_data (it patches the builder's data source)."""
  import tensorflow_datasets as tfds
  return getattr(tfds.core.DatasetBuilder.as_data_source, "__name__", "") != "as_data_source"


def _builder(bench: Benchmark, data_dir: str, files_hint: str = "",
             data_dir_set: bool = False):
  """The dataset's builder, after the checks above and of its features."""
  import tensorflow_datasets as tfds
  from tensorflow_datasets.core import read_only_builder
  _check_built(bench, data_dir, files_hint, data_dir_set)
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
                         f" (splits: {', '.join(builder.info.splits)})"
                         + skip_test_hint(bench, split))


def check_splits(bench: Benchmark, splits: Sequence[str], data_dir: str,
                 files_hint: str = "", data_dir_set: bool = False) -> None:
  """BenchmarkError unless data_dir holds a build of the dataset with these splits and
  the features the benchmark reads (metadata only); files_hint: what else was looked for;
  data_dir_set: config.benchmark.data_dir named data_dir."""
  builder = _builder(bench, data_dir, files_hint, data_dir_set)
  for split in splits:
    _check_split(builder, bench, split, data_dir)


def open_split(bench: Benchmark, split: str, data_dir: str, files_hint: str = ""):
  """(the split's data source, the dataset's label names), checked."""
  builder = _builder(bench, data_dir, files_hint)
  _check_split(builder, bench, split, data_dir)
  label = builder.info.features["label"] if "label" in builder.info.features else None
  return builder.as_data_source(split=split), list(getattr(label, "names", None) or [])
