"""A suite's result: suite.json's summary of the tasks' official metrics and the
suite's score, and the table finetune-suite prints.

  summary = summarize("glue", {task: {"official": {...}, "score": 81.2}})
  print(table(summary))
"""

from __future__ import annotations

from t5x_like.benchmarks.metrics import glue_score
from t5x_like.benchmarks.registry import SUITES, benchmark

SUITE_NAMES = {"glue": "GLUE", "super_glue": "SuperGLUE", "squad": "SQuAD"}
# Tasks of each leaderboard's score (Wang et al. 2019a, 2019b; diagnostics excluded):
# SuperGLUE's MultiRC, ReCoRD and WSC have no config here, so its score is never complete.
LEADERBOARD_TASKS = {"glue": 9, "super_glue": 8}


def summarize(suite: str, rows: dict[str, dict]) -> dict:
  """suite.json: the tasks' rows, the mean of their scores (each task's headline
  official metrics averaged first, benchmarks/metrics.glue_score), and how much of the
  suite it covers."""
  score = glue_score({task: {k: v for k, v in r["official"].items()
                             if benchmark(f"{suite}/{task}").scores(k)}
                      for task, r in rows.items()}) if rows else 0.0
  total = LEADERBOARD_TASKS.get(suite, len(SUITES[suite]))
  name = SUITE_NAMES.get(suite, suite)
  complete = suite in LEADERBOARD_TASKS and len(rows) == total
  return {"suite": suite, "tasks": rows, "score": round(score, 3),
          "score_name": f"{name} score" if complete else
          f"mean of {len(rows)} of {name}'s {total} tasks",
          "complete": complete, "tasks_covered": list(rows), "num_tasks_covered": len(rows),
          "num_suite_tasks": total}


def table(summary: dict) -> str:
  """The printed table: a row per task, then the suite's score and what it covers."""
  grid = any("lr_grid" in r for r in summary["tasks"].values())
  rows = [("task", "metrics", "score") + (("lr picked (held-out score per lr)",) if grid
                                           else ())]
  for task, r in summary["tasks"].items():
    row = (task, ", ".join(f"{k} {v:.1f}" for k, v in r["official"].items()
                           if not k.startswith("test_")), f"{r['score']:.1f}")
    if grid:
      picked = r.get("lr_grid")
      row += (f"{picked['learning_rate']} (" + ", ".join(
          f"{lr} {s:.1f}" for lr, s in picked["scores"].items()) + ")" if picked else "-",)
    rows.append(row)
  rows.append((summary["suite"], summary["score_name"], f"{summary['score']:.1f}")
              + (("",) if grid else ()))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
