"""The GLUE study's tables (studies/glue_experiment.py): markdown from its result rows.

  text = glue_markdown(rows, tasks)   # a section per family, then the published rows

rows: {"family", "arm" (bag | random | pretrained), "task", "seed", "official": {metric:
value}} with GLUE's official dev metrics in percent. Cells are the mean (min-max) over
seeds; the five-task average is taken per seed, then averaged.
"""

from __future__ import annotations

import collections

import numpy as np

# The five tasks Turc et al. 2019 report for their miniatures, and how one number per
# task is made of their metrics (MRPC and STS-B: the mean of their two).
FIVE = {"cola": ("mcc",), "sst2": ("accuracy",), "mrpc": ("f1", "accuracy"),
        "stsb": ("pearson", "spearman"), "rte": ("accuracy",)}
METRICS = {"cola": ("mcc",), "sst2": ("accuracy",), "mrpc": ("f1", "accuracy"),
           "stsb": ("pearson", "spearman"), "rte": ("accuracy",), "wnli": ("accuracy",),
           "qnli": ("accuracy",)}
# GLUE test, Turc et al. 2019, table 7 (pretrained 1M steps on BooksCorpus + Wikipedia).
PUBLISHED = {
    "BERT-Tiny (L2 H128), Turc et al. 2019, GLUE test": {
        "cola": {"mcc": 0.0}, "sst2": {"accuracy": 83.2},
        "mrpc": {"f1": 81.1, "accuracy": 71.1}, "stsb": {"pearson": 74.3, "spearman": 73.6},
        "rte": {"accuracy": 57.2}},
    "BERT-Mini (L4 H256), Turc et al. 2019, GLUE test": {
        "cola": {"mcc": 0.0}, "sst2": {"accuracy": 85.9},
        "mrpc": {"f1": 81.1, "accuracy": 71.8}, "stsb": {"pearson": 75.4, "spearman": 73.3},
        "rte": {"accuracy": 57.9}},
}
ARM_NAMES = {"bag": "bag of pieces", "random": "random init", "pretrained": "pretrained here"}
# The bars the study is held to (docs/glue.md): pretrained above random initialisation
# by this many points, on the mean over seeds.
BARS = {"five-task average": 5.0, "STS-B Pearson": 20.0}


def section_marker(name: str) -> str:
  """The line that opens a family's part of the tables (or the published rows'): a call
  for one family replaces only its part of the page (glue_experiment.write_between_markers)."""
  return f"<!-- glue_experiment section: {name} -->"


def five_task_average(official: dict[str, dict[str, float]]) -> float:
  """The mean over FIVE of each task's mean of its metrics (NaN if a task is missing)."""
  if any(task not in official for task in FIVE):
    return float("nan")
  return float(np.mean([np.mean([official[t][m] for m in ms]) for t, ms in FIVE.items()]))


def mean_range(values: list[float]) -> str:
  """'mean (min-max)' of values to one decimal ('' for none, the value alone for one)."""
  if not values:
    return ""
  if len(values) == 1:
    return f"{values[0]:.1f}"
  return f"{np.mean(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def _bars(margins: dict[str, float]) -> str:
  """One line: each bar's measured pretrained - random margin, and whether it is met."""
  parts = [f"{name} {margins[name]:+.1f} (bar +{bar:.0f}): "
           + ("**met**" if margins[name] >= bar else "**not met**")
           for name, bar in BARS.items() if name in margins]
  return "Pretrained against random initialisation: " + "; ".join(parts) + "." if parts else ""


def glue_markdown(rows: list[dict], tasks: list[str]) -> str:
  """Per family: a row per task and metric, a column per arm, the pretrained - random
  margin; the five-task average and whether BARS are met; the published miniatures."""
  by = collections.defaultdict(list)  # (family, arm, task, metric) -> values over seeds
  per_seed = collections.defaultdict(dict)  # (family, arm, seed) -> {task: official}
  for r in rows:
    for metric, value in r["official"].items():
      by[r["family"], r["arm"], r["task"], metric].append(value)
    per_seed[r["family"], r["arm"], r["seed"]][r["task"]] = r["official"]
  out = []
  for family in sorted({r["family"] for r in rows}):
    arms = [a for a in ARM_NAMES if any(r["family"] == family and r["arm"] == a
                                        for r in rows)]
    margin = "pretrained" in arms and "random" in arms
    out.append(section_marker(family))
    out.append(f"\n### {family.upper()}: GLUE dev, official metrics, mean (range) over"
               " seeds\n")
    out.append("| task | metric | " + " | ".join(ARM_NAMES[a] for a in arms)
               + (" | pretrained - random" if margin else "") + " |")
    out.append("|---" * (2 + len(arms) + margin) + "|")
    for task in tasks:
      for metric in METRICS.get(task, ()):
        cells = [mean_range(by[family, a, task, metric]) for a in arms]
        if margin:
          p, q = by[family, "pretrained", task, metric], by[family, "random", task, metric]
          cells.append(f"{np.mean(p) - np.mean(q):+.1f}" if p and q else "")
        out.append(f"| {task} | {metric} | " + " | ".join(cells) + " |")
    averages = {a: [v for (f, arm, _), official in sorted(per_seed.items())
                    if f == family and arm == a
                    for v in [five_task_average(official)] if not np.isnan(v)]
                for a in arms}
    cells = [mean_range(averages[a]) for a in arms]
    if margin:
      p, q = averages["pretrained"], averages["random"]
      cells.append(f"**{np.mean(p) - np.mean(q):+.1f}**" if p and q else "")
    out.append("| **five-task average** | CoLA, SST-2, MRPC, STS-B, RTE | "
               + " | ".join(cells) + " |")
    if margin:
      margins = {"five-task average": (averages["pretrained"], averages["random"]),
                 "STS-B Pearson": (by[family, "pretrained", "stsb", "pearson"],
                                   by[family, "random", "stsb", "pearson"])}
      out.append("\n" + _bars({k: np.mean(p) - np.mean(q) for k, (p, q) in margins.items()
                               if p and q}))
  out.append("\n" + section_marker("published"))
  out.append("\nFor scale (GLUE test, not dev; pretrained for 1M steps of 256 x 128 tokens"
             " on BooksCorpus and English Wikipedia):\n")
  out.append("| model | " + " | ".join(FIVE) + " | five-task average |")
  out.append("|---" * (2 + len(FIVE)) + "|")
  for name, official in PUBLISHED.items():
    out.append(f"| {name} | " + " | ".join(" / ".join(f"{official[t][m]:.1f}" for m in ms)
                                           for t, ms in FIVE.items())
               + f" | {five_task_average(official):.1f} |")
  return "\n".join(out) + "\n"
