"""Small TFDS datasets built here in array_record, with the real datasets' features.

  build_benchmark(data_dir, "glue/mrpc", {"train": 40, "validation": 12, "test": 8})

The features, versions and label names are those of TFDS's own builders (glue 2.0.0,
super_glue 1.0.2, squad 3.0.0; tensorflow_datasets/text/glue.py, super_glue.py,
datasets/squad), written out here because GLUE's builder code needs TensorFlow. Rows
are made up, learnable and deterministic: a label is readable from the text (the word
"good" / "bad", "same" / "other"), so a few steps of fine-tuning can move the metrics.
Test splits have label -1, as GLUE's and SuperGLUE's do.
"""

from __future__ import annotations

import numpy as np
import tensorflow_datasets as tfds

VERSIONS = {"glue": "2.0.0", "super_glue": "1.0.2", "squad": "3.0.0"}
LABELS = {
    "glue/cola": ["unacceptable", "acceptable"], "glue/sst2": ["negative", "positive"],
    "glue/mrpc": ["not_equivalent", "equivalent"], "glue/qqp": ["not_duplicate", "duplicate"],
    "glue/mnli": ["entailment", "neutral", "contradiction"],
    "glue/qnli": ["entailment", "not_entailment"], "glue/rte": ["entailment", "not_entailment"],
    "glue/wnli": ["not_entailment", "entailment"], "super_glue/boolq": ["False", "True"],
    "super_glue/cb": ["entailment", "contradiction", "neutral"],
    "super_glue/copa": ["choice1", "choice2"], "super_glue/rte": ["entailment", "not_entailment"],
    "super_glue/wic": ["False", "True"]}
TEXTS = {
    "glue/cola": ["sentence"], "glue/sst2": ["sentence"], "glue/mrpc": ["sentence1", "sentence2"],
    "glue/qqp": ["question1", "question2"], "glue/stsb": ["sentence1", "sentence2"],
    "glue/mnli": ["premise", "hypothesis"], "glue/qnli": ["question", "sentence"],
    "glue/rte": ["sentence1", "sentence2"], "glue/wnli": ["sentence1", "sentence2"],
    "super_glue/boolq": ["question", "passage"], "super_glue/cb": ["premise", "hypothesis"],
    "super_glue/copa": ["premise", "choice1", "choice2", "question"],
    "super_glue/rte": ["premise", "hypothesis"],
    "super_glue/wic": ["word", "sentence1", "sentence2"]}
_WORDS = ("the old man walked to the river and saw a boat near the mill while the children"
          " played in the garden under a grey sky").split()


def features(tfds_name: str, drop: str = "") -> dict:
  """The TFDS features of a dataset (without `drop`: a dataset lacking a column)."""
  if tfds_name.startswith("squad/"):
    answers = tfds.features.Sequence({"text": tfds.features.Text(), "answer_start": np.int32})
    out = {"id": tfds.features.Text(), "title": tfds.features.Text(),
           "context": tfds.features.Text(), "question": tfds.features.Text(), "answers": answers}
    if tfds_name == "squad/v2.0":
      out.update(is_impossible=np.bool_, plausible_answers=tfds.features.Sequence(
          {"text": tfds.features.Text(), "answer_start": np.int32}))
  else:
    out = {name: tfds.features.Text() for name in TEXTS[tfds_name]}
    out["label"] = (tfds.features.ClassLabel(names=LABELS[tfds_name])
                    if tfds_name in LABELS else np.float32)
    out["idx"] = np.int32
    if tfds_name == "super_glue/wic":
      out.update({k: np.int32 for k in ("start1", "start2", "end1", "end2")})
  out.pop(drop, None)
  return out


def _sentence(rng: np.random.Generator, n: int = 8) -> str:
  return " ".join(rng.choice(_WORDS, n))


def example(tfds_name: str, k: int, labeled: bool, rng: np.random.Generator) -> dict:
  """Row k of a split: the label (k's parity, or a score) is written into the text."""
  if tfds_name.startswith("squad/"):
    answer = ["the river", "a boat", "the garden"][k % 3]
    unanswerable = tfds_name == "squad/v2.0" and k % 4 == 3
    context = f"{_sentence(rng)} {answer} {_sentence(rng)}."
    start = context.index(answer)
    row = {"id": f"q{k:05d}", "title": "t", "context": context,
           "question": f"where did {k} go?",
           "answers": {"text": [] if unanswerable else [answer, answer.split()[-1]],
                       "answer_start": [] if unanswerable else [start,
                                                                start + len(answer) - len(
                                                                    answer.split()[-1])]}}
    if tfds_name == "squad/v2.0":
      row.update(is_impossible=unanswerable, plausible_answers={
          "text": [answer] if unanswerable else [], "answer_start": [start] if unanswerable
          else []})
    return row
  names = LABELS.get(tfds_name)
  label = k % len(names) if names else float(k % 6)
  cue = {0: "bad", 1: "good", 2: "so so"}.get(int(label) % 3 if names else 0)
  row = {name: f"{_sentence(rng)} {cue}" for name in TEXTS[tfds_name]}
  if not names:
    row = {name: f"{_sentence(rng)} {'very ' * int(label)}alike" for name in TEXTS[tfds_name]}
  row["label"] = (label if labeled else -1) if names else (label if labeled else -1.0)
  row["idx"] = k
  if tfds_name == "super_glue/wic":
    row.update(start1=0, start2=0, end1=3, end2=3)
  return row


def build_benchmark(data_dir: str, tfds_name: str, split_sizes: dict[str, int], *,
                    drop: str = "", seed: int = 0) -> str:
  """Builds tfds_name under data_dir in array_record; returns the version directory."""
  suite, config = tfds_name.split("/")
  rng = np.random.default_rng(seed)
  splits = {split: [example(tfds_name, k, not split.startswith("test"), rng)
                    for k in range(size)] for split, size in split_sizes.items()}
  feature_dict = features(tfds_name, drop)
  if drop:
    splits = {s: [{k: v for k, v in row.items() if k != drop} for row in rows]
              for s, rows in splits.items()}

  class Builder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    name = suite
    VERSION = tfds.core.Version(VERSIONS[suite])
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=config)]

    def _info(self):
      return tfds.core.DatasetInfo(builder=self,
                                   features=tfds.features.FeaturesDict(feature_dict))

    def _split_generators(self, dl_manager):
      return {split: self._generate_examples(rows) for split, rows in splits.items()}

    def _generate_examples(self, rows):
      for k, row in enumerate(rows):
        yield k, row

  builder = Builder(config=config, data_dir=data_dir, file_format="array_record")
  builder.download_and_prepare(
      download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return str(builder.data_dir)
