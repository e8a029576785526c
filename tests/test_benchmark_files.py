"""A benchmark's own files (GLUE TSV, SuperGLUE JSONL, SQuAD JSON) read as TFDS builds them
(t5x_like/benchmarks/files_source.py, sources.py).

The reference is TFDS's own builder code (tensorflow_datasets/text/glue.py, super_glue.py,
datasets/squad/squad_dataset_builder.py): the same small files are built with it into
array_record under another data dir (its download step swapped for the local files),
and both data dirs must give the same Datasets: examples, order, idx, labels. The
quirks (CoLA without a header, MRPC's byte-order mark, a quote inside a sentence, test
splits without labels) are in the files. The slow tier reads the real GLUE files of
../shared/data/glue (skipped when absent): row counts and label histograms of its
README, and TFDS's `_generate_examples` on each of them, example for example.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import types

import numpy as np
import pytest
import tensorflow_datasets as tfds

from helpers import ROOT, cli_command, load_config, run_child
from t5x_like.benchmarks import files_source, sources
from t5x_like.benchmarks.registry import BenchmarkError, benchmark
from t5x_like.errors import UserError
from t5x_like.benchmarks.task_data import benchmark_task as run_task

GLUE_DIR = os.path.join(ROOT, "..", "shared", "data", "glue")
CONFIG_FILE = {"glue": "glue", "super_glue": "superglue", "squad": "squad"}
QUOTE = 'He said "no\' and left.'  # quoting is off: both quotes are text

# ------------------------------------------------------------------ small files
# Rows as GLUE's download script writes them; labels learnable by nobody, which is fine.
GLUE_FILES = {
    "CoLA/train.tsv": ["gj04\t1\t\tThe sailors rode the breeze.",
                       f"gj04\t0\t*\t{QUOTE}", "cj99\t1\t\tBill left.", "cj99\t0\t*\tLeft Bill."],
    "CoLA/dev.tsv": ["gj04\t0\t*\tHim go.", "gj04\t1\t\tHe went.", "gj04\t1\t\tShe ran."],
    "CoLA/test.tsv": ["index\tsentence", "0\tBill whistled.", f"1\t{QUOTE}"],
    "MRPC/train.tsv": ["\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String",
                       "1\t11\t12\tA cat sat .\tThe cat sat .", "0\t13\t14\tIt rained .\tSun .",
                       f"1\t15\t16\t{QUOTE}\tHe said no ."],
    "MRPC/dev.tsv": ["\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String",
                     "0\t21\t22\tUp .\tDown .", "1\t23\t24\tBig .\tLarge ."],
    "MRPC/test.tsv": ["index\t#1 ID\t#2 ID\t#1 String\t#2 String", "0\t31\t32\tA .\tB .",
                      "1\t33\t34\tC .\tD ."],
    "STS-B/train.tsv": ["index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1"
                        "\tsentence2\tscore"] + [
        f"{k}\tmain-news\tx\t2012\t{k:04d}\tnone\tnone\tA {k}.\tB {k}.\t{k * 0.8:.3f}"
        for k in range(5)],
    "STS-B/dev.tsv": ["index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1"
                      "\tsentence2\tscore", "0\tg\tf\ty\t0\tn\tn\tA plane.\tA jet.\t3.800"],
    "STS-B/test.tsv": ["index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1"
                       "\tsentence2", "0\tg\tf\ty\t0\tn\tn\tA girl.\tA woman."],
    "RTE/train.tsv": ["index\tsentence1\tsentence2\tlabel"] + [
        f"{k}\tPremise {k}.\tHypothesis {k}.\t{'not_entailment' if k % 3 else 'entailment'}"
        for k in range(7)],
    "RTE/dev.tsv": ["index\tsentence1\tsentence2\tlabel", f"0\t{QUOTE}\tHe left.\tentailment",
                    "1\tA.\tB.\tnot_entailment", "2\tC.\tD.\tentailment"],
    "RTE/test.tsv": ["index\tsentence1\tsentence2", "0\tE.\tF.", "1\tG.\tH.", "2\tI.\tJ."],
    "MNLI/train.tsv": ["index\tpromptID\tpairID\tgenre\tsentence1\tsentence2\tlabel1\tgold_label"]
    + [f"{k}\t1\t1e\tfiction\tP{k}.\tH{k}.\tx\t{['entailment', 'neutral', 'contradiction'][k % 3]}"
       for k in range(6)],
    "MNLI/dev_matched.tsv": ["index\tgenre\tsentence1\tsentence2\tlabel1\tlabel2\tgold_label",
                             "0\tslate\tP.\tH.\tneutral\tneutral\tneutral",
                             "1\tslate\tQ.\tI.\tentailment\tentailment\tentailment"],
    "MNLI/dev_mismatched.tsv": ["index\tgenre\tsentence1\tsentence2\tlabel1\tgold_label",
                                "0\tletters\tR.\tJ.\tcontradiction\tcontradiction"],
    "MNLI/test_matched.tsv": ["index\tgenre\tsentence1\tsentence2", "0\tslate\tS.\tK."],
    "MNLI/test_mismatched.tsv": ["index\tgenre\tsentence1\tsentence2", "0\tverbatim\tT.\tL."],
}
SUPERGLUE_FILES = {
    "BoolQ": ([{"question": "is it", "passage": f"P {k} {QUOTE}", "idx": k, "label": k % 2 == 0}
               for k in range(5)], {"question": "q", "passage": "p", "idx": 0}),
    "CB": ([{"premise": "P", "hypothesis": f"H{k}", "idx": k,
             "label": ["entailment", "contradiction", "neutral"][k % 3]} for k in range(4)],
           {"premise": "P", "hypothesis": "H", "idx": 0}),
    "COPA": ([{"premise": "P", "choice1": "a", "choice2": "b", "question": "cause", "idx": k,
               "label": k % 2} for k in range(4)],
             {"premise": "P", "choice1": "a", "choice2": "b", "question": "effect", "idx": 0}),
    "RTE": ([{"premise": "P", "hypothesis": f"H{k}", "idx": k,
              "label": "entailment" if k % 2 else "not_entailment"} for k in range(4)],
            {"premise": "P", "hypothesis": "H", "idx": 0}),
    "WiC": ([{"word": "bank", "sentence1": "a bank", "sentence2": f"the bank {k}", "idx": k,
              "label": k % 2 == 1, "start1": 2, "end1": 6, "start2": 4, "end2": 8}
             for k in range(4)],
            {"word": "w", "sentence1": "a w", "sentence2": "b w", "idx": 0, "start1": 2,
             "end1": 3, "start2": 2, "end2": 3}),
}


def _squad_json(version: str, offset: int) -> dict:
  qas = [{"id": f"q{offset + k}", "question": f"Where is {k}?",
          "answers": [{"text": "the river", "answer_start": 4}] * (1 + k % 2)} for k in range(4)]
  if version == "v2.0":
    for k, qa in enumerate(qas):
      qa["is_impossible"] = k == 3
      if k == 3:
        qa.update(answers=[], plausible_answers=[{"text": "the mill", "answer_start": 18}])
  else:  # TFDS merges a question id seen twice (XTREME-style flattened answers)
    qas.append({"id": f"q{offset}", "question": "Where is 0?",
                "answers": [{"text": "river", "answer_start": 8}]})
  return {"version": version, "data": [{"title": "T", "paragraphs": [
      {"context": "Off the river by the mill.", "qas": qas}]}]}


def write_files(directory) -> str:
  """Every format's small files under directory; returns it."""
  for name, lines in GLUE_FILES.items():
    path = os.path.join(directory, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      f.write("\n".join(lines) + "\n")
  sg = os.path.join(directory, "superglue")
  for folder, (rows, test_row) in SUPERGLUE_FILES.items():
    os.makedirs(os.path.join(sg, folder))
    for split, split_rows in (("train", rows), ("val", rows[:3]), ("test", [test_row])):
      with open(os.path.join(sg, folder, f"{split}.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in split_rows))
  for version in ("v1.1", "v2.0"):
    for split, offset in (("train", 0), ("dev", 100)):
      with open(os.path.join(directory, f"{split}-{version}.json"), "w") as f:
        json.dump(_squad_json(version, offset), f)
  return str(directory)


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory):
  return write_files(tmp_path_factory.mktemp("own_files"))


# ------------------------------------------------------------------ TFDS's builders
def _glue_gen_kwargs(bench, data_dir: str, out_dir: str) -> dict:
  """GLUE builder's gen_kwargs per split, its download swapped for our files. MRPC's
  builder cuts train and dev out of the MSR corpus file by a list of dev ids: here one
  file of our train rows, then our dev rows, and the dev rows' ids."""
  mrpc = None
  if bench.name == "mrpc":
    train, dev = GLUE_FILES["MRPC/train.tsv"], GLUE_FILES["MRPC/dev.tsv"]
    corpus, dev_ids = os.path.join(out_dir, "msr_train.txt"), os.path.join(out_dir, "ids.tsv")
    with open(corpus, "w", encoding="utf-8") as f:
      f.write("\n".join(train + dev[1:]) + "\n")
    with open(dev_ids, "w") as f:
      f.write("".join("\t".join(row.split("\t")[1:3]) + "\n" for row in dev[1:]))
    mrpc = {"train": corpus, "dev_ids": dev_ids,
            "test": files_source.split_file(bench, "test", data_dir)}
  out = {}
  for split in files_source.task_splits(bench):
    path = files_source.split_file(bench, split, data_dir)
    kind = split.split("_")[0].replace("validation", "dev")
    out[split] = {"data_file": path, "split": kind, "mrpc_files": mrpc}
  return out


def tfds_build(suite: str, name: str, files: str, out: str) -> None:
  """Builds suite/name under out with TFDS's own builder class from our files."""
  if suite == "glue":
    from tensorflow_datasets.text.glue import Glue as base
    bench = benchmark(f"glue/{name}")
    kwargs = _glue_gen_kwargs(bench, files, out)
  else:
    from tensorflow_datasets.datasets.squad.squad_dataset_builder import Builder as base
    bench = benchmark(f"squad/{name}")
    kwargs = {s: {"filepath": files_source.split_file(bench, s, files)}
              for s in ("train", "validation")}

  class Local(base, skip_registration=True):
    __module__ = base.__module__  # TFDS finds the builder's metadata files by its package

    def _split_generators(self, dl_manager):
      return [tfds.core.SplitGenerator(name=s, gen_kwargs=kw) for s, kw in kwargs.items()]

  Local.name = suite
  builder = Local(config=name, data_dir=out, file_format="array_record")
  builder.download_and_prepare(
      download_config=tfds.download.DownloadConfig(try_download_gcs=False))


def _plain(value):
  """A TFDS example's value as plain Python (bytes decoded, numpy scalars unwrapped)."""
  if isinstance(value, dict):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, bytes):
    return value.decode()
  if isinstance(value, np.ndarray):
    return [_plain(v) for v in value.tolist()]
  if isinstance(value, list):
    return [_plain(v) for v in value]
  return value.item() if isinstance(value, np.generic) else value


def _same_datasets(name: str, files: str, built: str, family_t5: bool = False):
  """Every split of name read from the files and from the TFDS build: equal Datasets."""
  bench = benchmark(name)
  suite, task_name = name.split("/")
  config = load_config(CONFIG_FILE[suite], task_name)
  task = run_task(config, family_t5)
  splits = files_source.task_splits(bench)
  for split in splits:
    ours = sources.open_examples(bench, split, files)
    theirs = sources.open_examples(bench, split, built)
    assert ours.where.startswith(files) and theirs.where == f"{name}:{split}"
    assert ours.label_names == theirs.label_names and not ours.bad_rows
    mine = [_plain(e) for e in ours.examples]
    tfds_examples = [_plain(theirs.examples[k]) for k in range(len(theirs.examples))]
    if name == "glue/mrpc" and split != "test":  # TFDS numbers idx along the MSR corpus
      strip = lambda rows: sorted(json.dumps({**r, "idx": 0}, sort_keys=True) for r in rows)
      assert strip(mine) == strip(tfds_examples), split
      continue
    assert mine == tfds_examples, split
    read = dict(task=task, text_to_text=family_t5, labels=None, limit=0)
    a = sources.read_benchmark_split(bench, split, data_dir=files, **read)
    b = sources.read_benchmark_split(bench, split, data_dir=built, **read)
    without_line = lambda ds: [dict(vars(e), line=0) for e in ds.examples]
    assert without_line(a) == without_line(b) and a.labels == b.labels
    assert (a.ids, a.golds, a.labeled) == (b.ids, b.golds, b.labeled)
  return splits


@pytest.fixture(scope="module")
def built_dir(files_dir, tmp_path_factory):
  """TFDS's builds of the small files: GLUE's tasks and SQuAD's (SuperGLUE's builder
  declares its features with TensorFlow's dtypes: below, its _generate_examples)."""
  out = str(tmp_path_factory.mktemp("tfds_built"))
  tfds.disable_progress_bar()
  for name in ("cola", "mrpc", "stsb", "rte", "mnli"):
    tfds_build("glue", name, files_dir, out)
  for name in ("v1.1", "v2.0"):
    tfds_build("squad", name, files_dir, out)
  return out


@pytest.mark.parametrize("name", ["glue/cola", "glue/mrpc", "glue/stsb", "glue/rte",
                                  "glue/mnli", "squad/v1.1", "squad/v2.0"])
def test_files_give_what_tfds_builds_from_them(name, files_dir, built_dir):
  _same_datasets(name, files_dir, built_dir)


@pytest.mark.parametrize("name", ["boolq", "cb", "copa", "rte", "wic"])
def test_superglue_files_equal_tfds_generate_examples(name, files_dir):
  """SuperGLUE's TFDS builder needs TensorFlow for its features, not for its
  _generate_examples: those, in a build's order (the md5 of the key salted with the
  split's name, TFDS's Hasher: the order the GLUE builds above check)."""
  from tensorflow_datasets.core import hashing
  from tensorflow_datasets.text.super_glue import SuperGlue
  directory = os.path.join(files_dir, "superglue")
  bench = benchmark(f"super_glue/{name}")
  config = {c.name: c for c in SuperGlue.BUILDER_CONFIGS}[name]
  names = list(config.label_classes)
  for split in ("train", "validation", "test"):
    path = files_source.split_file(bench, split, directory)
    made = SuperGlue._generate_examples(types.SimpleNamespace(builder_config=config), path,
                                        split)
    hasher = hashing.Hasher(split)
    ordered = [e for _, e in sorted(made, key=lambda ke: hasher.hash_key(ke[0]))]
    for example in ordered:  # the ClassLabel's encoding of a name
      example["label"] = names.index(example["label"]) if example["label"] != -1 else -1
    part = files_source.read_split(bench, split, directory)
    assert part.examples == ordered and part.label_names == names, split
    assert len(ordered) == {"train": len(SUPERGLUE_FILES[bench.folder][0]), "validation": 3,
                            "test": 1}[split]


def test_quirks_read_by_hand(files_dir):
  """What the files say, checked by eye: no TFDS involved."""
  by_idx = lambda part: {e["idx"]: e for e in part.examples}
  cola = by_idx(files_source.read_split(benchmark("glue/cola"), "train", files_dir))
  assert cola[1] == {"sentence": QUOTE, "label": 0, "idx": 1}  # header-less, quote kept
  assert [cola[k]["label"] for k in range(4)] == [1, 0, 1, 0]
  test = by_idx(files_source.read_split(benchmark("glue/cola"), "test", files_dir))
  assert test == {0: {"sentence": "Bill whistled.", "label": -1, "idx": 0},
                  1: {"sentence": QUOTE, "label": -1, "idx": 1}}
  mrpc = files_source.read_split(benchmark("glue/mrpc"), "train", files_dir)  # the BOM
  assert by_idx(mrpc)[2] == {"sentence1": QUOTE, "sentence2": "He said no .", "label": 1,
                             "idx": 2}
  assert mrpc.label_names == ["not_equivalent", "equivalent"]
  assert sorted(mrpc.lines) == [2, 3, 4]  # file lines, after the header
  rte = by_idx(files_source.read_split(benchmark("glue/rte"), "validation", files_dir))
  assert [rte[k]["label"] for k in range(3)] == [0, 1, 0]  # entailment = 0 (TFDS's list)
  stsb = files_source.read_split(benchmark("glue/stsb"), "validation", files_dir)
  assert stsb.examples[0]["label"] == np.float32(3.8) and stsb.label_names == []
  mnli = files_source.read_split(benchmark("glue/mnli"), "validation_mismatched", files_dir)
  assert mnli.examples == [{"premise": "R.", "hypothesis": "J.", "label": 2, "idx": 0}]
  copa = files_source.read_split(benchmark("super_glue/copa"), "train",
                                 os.path.join(files_dir, "superglue"))
  assert {e["idx"]: e["label"] for e in copa.examples} == {0: 0, 1: 1, 2: 0, 3: 1}
  squad = files_source.read_split(benchmark("squad/v1.1"), "validation", files_dir)
  merged = {e["id"]: e for e in squad.examples}["q100"]["answers"]
  assert merged == {"answer_start": [4, 8], "text": ["the river", "river"]}


# ------------------------------------------------------------------ errors
def _rte_dir(tmp_path, dev_lines) -> str:
  os.makedirs(tmp_path / "RTE")
  for split in ("train", "dev", "test"):
    lines = GLUE_FILES[f"RTE/{split}.tsv"] if split != "dev" else dev_lines
    (tmp_path / "RTE" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
  return str(tmp_path)


def _read_dev(data_dir: str, skip_bad_rows: bool = False):
  config = load_config("glue", "rte,smoke")
  config.task.skip_bad_rows = skip_bad_rows
  return sources.read_benchmark_split(benchmark("glue/rte"), "validation",
                                      run_task(config, False), text_to_text=False,
                                      data_dir=data_dir)


def test_bad_rows_name_file_and_line(tmp_path):
  header = "index\tsentence1\tsentence2\tlabel"
  short = _rte_dir(tmp_path / "short", [header, "0\tA.\tB.\tentailment", "1\tC.\tnot_entailment"])
  path = os.path.join(short, "RTE", "dev.tsv")
  with pytest.raises(UserError, match=f"^{path}:3: expected 4 columns, got 3$"):
    _read_dev(short)
  unknown = _rte_dir(tmp_path / "label", [header, "0\tA.\tB.\tneutral", "1\tC.\tD.\t1"])
  with pytest.raises(UserError) as info:
    _read_dev(unknown)
  assert str(info.value) == (f"{unknown}/RTE/dev.tsv:2: label 'neutral' is not one of"
                             " entailment, not_entailment (or 0 .. 1)")
  # skip_bad_rows: skipped and counted; the rest keeps its idx (a digit is an index)
  dataset = _read_dev(unknown, skip_bad_rows=True)
  assert dataset.ids == [1] and dataset.golds == ["not_entailment"]
  assert dataset.stats["bad_rows"] == 1 and dataset.stats["bad_row_reasons"] == {
      "bad_label": 1}


def test_missing_files_and_neither_source(tmp_path):
  config = load_config("glue", "rte,smoke")
  config.benchmark.data_dir = _rte_dir(tmp_path / "partial", GLUE_FILES["RTE/dev.tsv"])
  os.remove(tmp_path / "partial" / "RTE" / "test.tsv")
  with pytest.raises(BenchmarkError, match=r"^glue/rte: .*/partial/RTE/test.tsv is missing"
                                           r" \(the test split; files there: dev.tsv,"
                                           r" train.tsv\); to train without it:"
                                           r" --config.benchmark.predict_test=false$"):
    sources.check_benchmark(config.benchmark)
  config.benchmark.predict_test = False  # the test split is not needed then
  sources.check_benchmark(config.benchmark)
  config.benchmark.data_dir = str(tmp_path / "empty")
  os.makedirs(tmp_path / "empty")  # there, holding neither
  with pytest.raises(BenchmarkError) as info:
    sources.check_benchmark(config.benchmark)
  empty = tmp_path / "empty"
  assert str(info.value).endswith(f"looked for {empty}/glue/rte/*/dataset_info.json and"
                                  f" GLUE's {empty}/RTE/train.tsv")
  assert "(or set config.benchmark.data_dir)" not in str(info.value)  # it is set
  config = load_config("squad", "v2.0,smoke")
  config.benchmark.data_dir = str(empty)
  with pytest.raises(BenchmarkError, match=f"SQuAD's {empty}/train-v2.0.json$"):
    sources.check_benchmark(config.benchmark)


def test_malformed_jsonl_row_is_a_bad_row(tmp_path):
  os.makedirs(tmp_path / "CB")
  good = json.dumps({"premise": "P", "hypothesis": "H", "idx": 0, "label": "neutral"})
  (tmp_path / "CB" / "val.jsonl").write_text(good + "\n{not json\n" + json.dumps(
      {"premise": "P", "idx": 2, "label": "neutral"}) + '\n{"premise": "P, "idx": 3}\n')
  part = files_source.read_split(benchmark("super_glue/cb"), "validation", str(tmp_path))
  assert len(part.examples) == 1
  assert [(line, row.problem) for line, row in part.bad_rows] == [
      (2, "not a JSON object (Expecting property name enclosed in double quotes: column 2)"),
      (3, "no field 'hypothesis'"),
      (4, "not a JSON object (Expecting ',' delimiter: column 18)")]
  (tmp_path / "CB" / "val.jsonl").write_text(good + '\n{"premise": "P\n')
  config = load_config("superglue", "cb,smoke")
  with pytest.raises(UserError) as info:  # the line, as the run reports it
    sources.read_benchmark_split(benchmark("super_glue/cb"), "validation",
                                 run_task(config, False), text_to_text=False,
                                 data_dir=str(tmp_path))
  assert str(info.value) == (f"{tmp_path}/CB/val.jsonl:2: not a JSON object (Unterminated"
                             " string starting at: column 13)")


def test_a_data_dir_that_is_a_file_missing_or_in_another_case_is_said_so(tmp_path):
  """Each its own line, without `tfds build` or the advice to set the key just set."""
  config = load_config("superglue", "cb,smoke")

  def error(data_dir) -> str:
    config.benchmark.data_dir = str(data_dir)
    with pytest.raises(BenchmarkError) as info:
      sources.check_benchmark(config.benchmark)
    return str(info.value)

  (tmp_path / "a_file.txt").write_text("not a folder\n")
  assert error(tmp_path / "a_file.txt") == (
      f"config.benchmark.data_dir={tmp_path}/a_file.txt is a file; expected the folder"
      " that holds SuperGLUE's CB/train.jsonl or a TFDS build")
  assert error(tmp_path / "nowhere") == (
      f"config.benchmark.data_dir={tmp_path}/nowhere: no such directory")
  lower = tmp_path / "superglue"
  os.makedirs(lower / "cb")
  for split in ("train", "val", "test"):
    (lower / "cb" / f"{split}.jsonl").write_text("")
  assert error(lower) == (f"super_glue/cb: {lower} holds cb/ where CB/ is read (names are"
                          " case-sensitive: rename it)")
  (lower / "cb" / "train.jsonl").rename(lower / "cb" / "Train.jsonl")
  (lower / "cb").rename(lower / "CB")  # the folder right, a file in another case
  assert error(lower) == (f"super_glue/cb: {lower} holds CB/Train.jsonl where"
                          " CB/train.jsonl is read (names are case-sensitive: rename it)")
  os.makedirs(tmp_path / "tfds" / "Super_Glue" / "cb")  # a TFDS build's folder too
  assert error(tmp_path / "tfds") == (
      f"super_glue/cb: {tmp_path}/tfds holds Super_Glue/ where super_glue/ is read (names"
      " are case-sensitive: rename it)")


# ------------------------------------------------------------------ end to end
def test_load_splits_reads_the_files(files_dir):
  """The fine-tuning run's splits (benchmarks/task_data.py) through the files: MNLI's two dev
  and two test splits, limits, labels from train, unlabeled tests."""
  from t5x_like.benchmarks.task_data import benchmark_splits
  config = load_config("glue", "mnli,smoke")
  config.benchmark.data_dir = files_dir
  config.benchmark.max_eval_examples = 1
  sources.check_benchmark(config.benchmark)
  splits = benchmark_splits(config, run_task(config, False), False)
  assert len(splits.train.examples) == 6 and splits.train.labeled
  assert splits.train.labels == ("entailment", "neutral", "contradiction")
  assert {k: len(v.examples) for k, v in splits.dev.items()} == {
      "validation_matched": 1, "validation_mismatched": 1}
  assert {k: (v.ids, v.labeled) for k, v in splits.test.items()} == {
      "test_matched": ([0], False), "test_mismatched": ([0], False)}
  assert splits.dev["validation_mismatched"].golds == ["contradiction"]


@pytest.mark.slow  # a CLI process: start, compile, 4 steps (~30 s)
def test_finetune_cli_on_glue_files(files_dir, tmp_path):
  workdir = tmp_path / "run"
  out = run_child(cli_command("finetune", f"--config={ROOT}/configs/glue.py:rte,smoke",
                              f"--config.benchmark.data_dir={files_dir}",
                              f"--workdir={workdir}"), devices=1)
  assert out.returncode == 0, out.stderr[-2000:]
  metrics = json.loads((workdir / "final_metrics.json").read_text())
  assert metrics["train_examples"] == 7 and metrics["dev_examples"] == 3
  lines = (workdir / "submission" / "RTE.tsv").read_text().splitlines()
  assert lines[0] == "index\tprediction" and [l.split("\t")[0] for l in lines[1:]] == [
      "0", "1", "2"]
  assert {l.split("\t")[1] for l in lines[1:]} <= {"entailment", "not_entailment"}


# ------------------------------------------------------------------ the real GLUE files
REAL = [("cola", "CoLA"), ("sst2", "SST-2"), ("mrpc", "MRPC"), ("stsb", "STS-B"),
        ("rte", "RTE"), ("wnli", "WNLI"), ("qnli", "QNLI")]
# Rows per file and dev label counts (by TFDS's label index) from ../shared/data/glue's
# README (the published GLUE counts).
ROWS = {"CoLA": (8551, 1043, 1063), "SST-2": (67349, 872, 1821), "MRPC": (3668, 408, 1725),
        "STS-B": (5749, 1500, 1379), "RTE": (2490, 277, 3000), "WNLI": (635, 71, 146),
        "QNLI": (None, 5463, 5463)}
DEV_LABELS = {"CoLA": {1: 721, 0: 322},  # acceptable / unacceptable
              "SST-2": {1: 444, 0: 428},  # positive / negative
              "MRPC": {1: 279, 0: 129},  # equivalent / not
              "RTE": {0: 146, 1: 131},  # entailment / not_entailment
              "QNLI": {0: 2702, 1: 2761}}  # entailment / not_entailment


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(GLUE_DIR), reason="no ../shared/data/glue")
@pytest.mark.parametrize("name,folder", REAL)
def test_real_glue_files_as_tfds_reads_them(name, folder, tmp_path):
  from tensorflow_datasets.core import hashing
  from tensorflow_datasets.text.glue import Glue
  bench = benchmark(f"glue/{name}")
  config = {c.name: c for c in Glue.BUILDER_CONFIGS}[name]
  fake_self = types.SimpleNamespace(builder_config=config)
  fake_self._generate_example_mrpc_files = functools.partial(
      Glue._generate_example_mrpc_files, fake_self)
  mrpc_files = {"test": files_source.split_file(bench, "test", GLUE_DIR)}
  if name == "mrpc":  # TFDS cuts train and dev from one MSR file: ours, joined
    lines = {s: open(files_source.split_file(bench, s, GLUE_DIR), encoding="utf-8").read()
             .splitlines() for s in ("train", "validation")}
    mrpc_files["train"] = str(tmp_path / "msr_train.txt")
    mrpc_files["dev_ids"] = str(tmp_path / "dev_ids.tsv")
    with open(mrpc_files["train"], "w", encoding="utf-8") as f:
      f.write("\n".join(lines["train"] + lines["validation"][1:]) + "\n")
    with open(mrpc_files["dev_ids"], "w") as f:
      f.write("".join("\t".join(r.split("\t")[1:3]) + "\n" for r in lines["validation"][1:]))
  for split, rows in zip(("train", "validation", "test"), ROWS[folder]):
    if rows is None:  # QNLI's train file is not there
      continue
    part = files_source.read_split(bench, split, GLUE_DIR)
    assert len(part.examples) == rows and not part.bad_rows, split
    labels = collections.Counter(int(e["label"]) for e in part.examples)
    if split == "test":
      assert labels == {-1: rows}
    elif split == "validation" and folder in DEV_LABELS:
      assert labels == DEV_LABELS[folder]
    path = files_source.split_file(bench, split, GLUE_DIR)
    kind = {"validation": "dev"}.get(split, split)
    made = Glue._generate_examples(fake_self, path, kind, mrpc_files=mrpc_files)
    hasher = hashing.Hasher(split)
    expected = []
    for _, example in sorted(made, key=lambda ke: hasher.hash_key(ke[0])):
      label = example["label"]
      if config.label_classes and isinstance(label, str):  # the ClassLabel's encoding
        example["label"] = config.label_classes.index(label)
      expected.append(example)
    if name == "mrpc" and split != "test":  # idx: along the MSR file there, ours here
      strip = lambda rows: sorted(json.dumps({**r, "idx": 0}, sort_keys=True) for r in rows)
      assert strip(part.examples) == strip(expected), split
      continue
    assert part.examples == expected, split
