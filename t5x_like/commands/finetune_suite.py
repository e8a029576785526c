"""`t5x-like finetune-suite --config configs/glue.py[:ARG] --workdir DIR [--tasks cola,rte]
[--init CHECKPOINT] [--config.KEY=VALUE ...]`.

Fine-tunes every task of the config's benchmark suite in turn (GLUE, SuperGLUE, SQuAD;
--tasks picks some), each as `t5x-like finetune --config FILE:ARG,task=TASK --workdir
DIR/TASK` with the same overrides, and --init as config.init.checkpoint. Resumable:
a task whose run finished (DIR/TASK/final_metrics.json) is not run again, an
interrupted one resumes, so rerunning the command finishes the suite. Prints one table
(each task's official dev metrics and score, then the suite's score: the mean of the
task scores, as the GLUE leaderboard computes it) and writes it as DIR/suite.json.
SIGTERM or Ctrl-C stops the running task with a checkpoint (exit 143 / 130).
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags

from t5x_like import fs
from t5x_like.command_flags import FlagError, parse_flags
from t5x_like.commands import finetune as finetune_command
from t5x_like.distributed import initialize_distributed
from t5x_like.train.preemption import exit_at_once_on_interrupt


def _flags(argv: list[str]) -> flags.FlagValues:
  fv = finetune_command._flags(argv)
  flags.DEFINE_list("tasks", [], "the suite's tasks to run (default: all of them)",
                    flag_values=fv)
  flags.DEFINE_string("init", "", "pretrained checkpoint for every task"
                      " (config.init.checkpoint)", flag_values=fv)
  return fv


def task_argv(argv: list[str], config_spec: str, task: str, workdir: str,
              init: str) -> list[str]:
  """argv of `t5x-like finetune` for one task: the config with task=TASK appended to its
  argument, the task's workdir, --init as config.init.checkpoint; the rest as given."""
  path, _, arg = config_spec.partition(":")
  spec = f"{path}:{arg + ',' if arg else ''}task={task}"
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
      continue
    name = a.split("=", 1)[0]
    if name in ("--config", "--workdir", "--tasks", "--init"):
      skip = "=" not in a
      continue
    out.append(a)
  out = [f"--config={spec}", f"--workdir={workdir}", *out]  # the config before its overrides
  return out + ([f"--config.init.checkpoint={init}"] if init else [])


def main(argv: list[str]) -> int:
  with exit_at_once_on_interrupt("finetune-suite"):
    fv = parse_flags("finetune-suite", argv, _flags, required=("config", "workdir"),
                     doc=__doc__)
    return _suite(fv, list(argv))


def _suite(fv: flags.FlagValues, argv: list[str]) -> int:
  from t5x_like.benchmarks.registry import SUITES, benchmark
  from t5x_like.finetune.metrics import glue_score
  if not fv.config.benchmark.name:
    raise FlagError(f"--config {fv['config'].config_filename}: config.benchmark.name is"
                    " empty: finetune-suite runs a benchmark's tasks (configs/glue.py, ...)")
  suite = benchmark(fv.config.benchmark.name).suite
  tasks = fv.tasks or SUITES[suite]
  unknown = [t for t in tasks if t not in SUITES[suite]]
  if unknown:
    raise FlagError(f"--tasks: unknown {suite} task {unknown[0]!r}; known:"
                    f" {', '.join(SUITES[suite])}")
  config_spec = next(a.split("=", 1)[1] if "=" in a else argv[i + 1]
                     for i, a in enumerate(argv) if a.split("=", 1)[0] == "--config")
  initialize_distributed(fv, "finetune-suite")
  from t5x_like.finetune.loop import finetune
  results = {}
  for task in tasks:
    workdir = os.path.join(fv.workdir, task)
    done = os.path.join(workdir, "final_metrics.json")
    if not fs.exists(done):
      print(f"=== {suite}/{task}: {workdir}", flush=True)
      task_fv = parse_flags("finetune", task_argv(argv, config_spec, task, workdir, fv.init),
                            finetune_command._flags, required=("config", "workdir"))
      final = finetune(task_fv.config, workdir)  # takes the task workdir's lock
      if final.status == "stopped":
        print(f"stopped by {final.stopped_by} in {task} at step {final.step}: checkpoint"
              f" saved; exit {final.exit_code}: rerun the same command to resume", flush=True)
        return final.exit_code
    results[task] = json.loads(fs.read_bytes(done))
  table = {task: {"official": r["official"], "score": r["score"]} for task, r in
           results.items()}
  score = glue_score({task: r["official"] for task, r in table.items()}) if table else 0.0
  summary = {"suite": suite, "tasks": table, "score": round(score, 3)}
  print(_table(summary), flush=True)
  fs.write_bytes(os.path.join(fv.workdir, "suite.json"), json.dumps(summary, indent=1).encode())
  return 0


def _table(summary: dict) -> str:
  rows = [("task", "metrics", "score")]
  for task, r in summary["tasks"].items():
    rows.append((task, ", ".join(f"{k} {v:.1f}" for k, v in r["official"].items()
                                 if not k.startswith("test_")), f"{r['score']:.1f}"))
  rows.append((summary["suite"], "mean of the task scores", f"{summary['score']:.1f}"))
  widths = [max(len(r[i]) for r in rows) for i in range(3)]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
