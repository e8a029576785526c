"""A benchmark suite's score (host side, numpy). The per-task metrics are the fine-tuning
tasks' (t5x_like/finetune/metrics.py: accuracy, binary_f1, matthews_corrcoef, pearson,
spearman, squad_scores ...), picked per benchmark by registry.py.

  glue_score(results)      GLUE's mean over tasks of each task's mean metric
"""

from __future__ import annotations

import numpy as np


def glue_score(results: dict[str, dict[str, float]]) -> float:
  """The GLUE score as the leaderboard computes it: each task's metrics averaged into
  one task score (MRPC's F1 and accuracy, STS-B's Pearson and Spearman, MNLI's matched
  and mismatched accuracy), then the unweighted mean over tasks (Wang et al. 2019)."""
  if not results:
    raise ValueError("glue_score: no task results")
  scores = []
  for task, metrics in results.items():
    if not metrics:
      raise ValueError(f"glue_score: task {task!r} has no metrics")
    scores.append(float(np.mean(list(metrics.values()))))
  return float(np.mean(scores))
