"""`t5x-like finetune-suite --config configs/glue.py[:ARG] --workdir DIR [--tasks cola,rte]
[--init CHECKPOINT] [--lr_grid 3e-4,1e-4,5e-5,3e-5 [--lr_holdout 0.1]] [--config.KEY=VALUE ...]`.

Fine-tunes every task of the config's benchmark suite in turn (GLUE, SuperGLUE, SQuAD;
--tasks picks some), each as `t5x-like finetune --config FILE:ARG,task=TASK --workdir
DIR/TASK` with the same overrides, and --init as config.init.checkpoint.

Before training anything, every task still to run has its config built as its run
builds it and checked (finetune/config_check.py, the benchmark's data included): one
line per task that cannot run, exit 2, nothing written.

--lr_grid picks each task's learning rate on a split of train, never on dev (Turc et
al. 2019 tuned their small BERTs over 3e-4, 1e-4, 5e-5, 3e-5): a --lr_holdout fraction
of train, drawn by config.seed (config.benchmark.holdout_fraction / holdout_seed), is
held out; the task is fine-tuned at each rate on the rest (DIR/lr_grid/TASK/LR) and
scored on the held-out part with its official metrics; the best rate (the first of the
grid on a tie) is written to DIR/lr_grid/TASK/pick.json and the task then runs on all
of train at that rate, as without the grid.

Resumable: a task whose run finished (DIR/TASK/final_metrics.json) is not run again (nor
its grid), a finished grid point neither, an interrupted run resumes, so rerunning the
command finishes the suite. Prints one table (each task's official dev metrics and
score, the picked rate and each rate's held-out score, then the mean of the task
scores: "GLUE score" only when every task of GLUE is there, as the leaderboard
computes it, else "mean of 5 of GLUE's 9 tasks") and writes it as DIR/suite.json (with
the tasks covered). SIGTERM or Ctrl-C stops the running task with a checkpoint
(exit 143 / 130).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

from absl import flags

from t5x_like import fs
from t5x_like.command_flags import FlagError, parse_flags
from t5x_like.commands import finetune as finetune_command
from t5x_like.distributed import initialize_distributed
from t5x_like.errors import UserError
from t5x_like.train.preemption import (Preemption, exit_at_once_on_interrupt,
                                        stopped_exit_code)

SUITE_NAMES = {"glue": "GLUE", "super_glue": "SuperGLUE", "squad": "SQuAD"}
# Tasks of each leaderboard's score (Wang et al. 2019a, 2019b; diagnostics excluded):
# SuperGLUE's MultiRC, ReCoRD and WSC have no config here, so its score is never complete.
LEADERBOARD_TASKS = {"glue": 9, "super_glue": 8}


def _flags(argv: list[str]) -> flags.FlagValues:
  fv = finetune_command._flags(argv)
  flags.DEFINE_list("tasks", [], "the suite's tasks to run (default: all of them)",
                    flag_values=fv)
  flags.DEFINE_string("init", "", "pretrained checkpoint for every task"
                      " (config.init.checkpoint)", flag_values=fv)
  flags.DEFINE_list("lr_grid", [], "learning rates to pick each task's from, on a held-out"
                    " split of train (e.g. 3e-4,1e-4,5e-5,3e-5); empty: the config's",
                    flag_values=fv)
  flags.DEFINE_float("lr_holdout", 0.1, "with --lr_grid: the fraction of train held out"
                     " to score the rates", flag_values=fv)
  return fv


def task_argv(argv: list[str], config_spec: str, task: str, workdir: str,
              init: str, overrides: tuple[str, ...] = ()) -> list[str]:
  """argv of `t5x-like finetune` for one task: the config with task=TASK appended to its
  argument, the task's workdir, --init as config.init.checkpoint, then `overrides`
  (--config.KEY=VALUE: the suite's own, last so they win); the rest as given."""
  path, _, arg = config_spec.partition(":")
  spec = f"{path}:{arg + ',' if arg else ''}task={task}"
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
      continue
    name = a.split("=", 1)[0]
    if name in ("--config", "--workdir", "--tasks", "--init", "--lr_grid", "--lr_holdout"):
      skip = "=" not in a
      continue
    out.append(a)
  out = [f"--config={spec}", f"--workdir={workdir}", *out]  # the config before its overrides
  return out + ([f"--config.init.checkpoint={init}"] if init else []) + list(overrides)


def main(argv: list[str]) -> int:
  with exit_at_once_on_interrupt("finetune-suite"):
    fv = parse_flags("finetune-suite", argv, _flags, required=("config", "workdir"),
                     doc=__doc__)
    return _suite(fv, list(argv))


class _Suite:
  """Where each run of the suite lives and its argv (module docstring)."""

  def __init__(self, fv: flags.FlagValues, argv: list[str], config_spec: str):
    self.fv, self.argv, self.config_spec = fv, argv, config_spec
    self.grid = learning_rates(fv.lr_grid)
    self.holdout = dict(fraction=fv.lr_holdout, seed=fv.config.seed)

  def workdir(self, task: str, lr: Optional[str] = None) -> str:
    if lr is None:
      return os.path.join(self.fv.workdir, task)
    return os.path.join(self.fv.workdir, "lr_grid", task, lr)

  def pick_path(self, task: str) -> str:
    return os.path.join(self.fv.workdir, "lr_grid", task, "pick.json")

  def argv_of(self, task: str, lr: Optional[str] = None, grid_point: bool = False
              ) -> list[str]:
    """The finetune argv of the task's final run (lr: the picked rate) or grid point."""
    overrides = [f"--config.optimizer.learning_rate={lr}"] if lr else []
    if grid_point:
      overrides += [f"--config.benchmark.holdout_fraction={self.holdout['fraction']}",
                    f"--config.benchmark.holdout_seed={self.holdout['seed']}",
                    "--config.benchmark.predict_test=False"]
    return task_argv(self.argv, self.config_spec, task,
                     self.workdir(task, lr if grid_point else None), self.fv.init,
                     tuple(overrides))

  def config_of(self, argv: list[str]):
    return parse_flags("finetune", argv, finetune_command._flags,
                       required=("config", "workdir")).config


def learning_rates(values: list[str]) -> list[str]:
  """--lr_grid's rates as given (each a positive number), in order, without repeats."""
  out = []
  for value in values:
    try:
      ok = float(value) > 0
    except ValueError:
      ok = False
    if not ok:
      raise FlagError(f"--lr_grid: {value!r} is not a positive number")
    if value not in out:
      out.append(value)
  return out


def pick_learning_rate(scores: dict[str, float]) -> str:
  """The rate of the highest held-out score; on a tie the first in the grid's order."""
  best = None
  for lr, score in scores.items():
    if best is None or score > scores[best]:
      best = lr
  return best


def check_tasks(suite: _Suite, tasks: list[str]) -> None:
  """UserError with one line per task that cannot run (its config or its data), before
  any of them is trained."""
  from t5x_like.finetune.config_check import validate_finetune
  problems = []
  for task in tasks:
    argvs = [suite.argv_of(task)]
    if suite.grid:  # dev and test are not read there; the held-out part of train is
      argvs.append(suite.argv_of(task, suite.grid[0], grid_point=True))
    try:
      for argv in argvs:
        validate_finetune(suite.config_of(argv))
    except UserError as e:
      problems.append(f"  {task}: {e}")
  if problems:
    raise UserError(f"{len(problems)} of the {len(tasks)} tasks to run cannot run; nothing"
                    " was trained:\n" + "\n".join(problems))


def _suite(fv: flags.FlagValues, argv: list[str]) -> int:
  from t5x_like.benchmarks.registry import SUITES, benchmark
  if not fv.config.benchmark.name:
    raise FlagError(f"--config {fv['config'].config_filename}: config.benchmark.name is"
                    " empty: finetune-suite runs a benchmark's tasks (configs/glue.py, ...)")
  suite_name = benchmark(fv.config.benchmark.name).suite
  tasks = fv.tasks or SUITES[suite_name]
  unknown = [t for t in tasks if t not in SUITES[suite_name]]
  if unknown:
    raise FlagError(f"--tasks: unknown {suite_name} task {unknown[0]!r}; known:"
                    f" {', '.join(SUITES[suite_name])}")
  if fv.lr_grid and not 0 < fv.lr_holdout < 1:
    raise FlagError(f"--lr_holdout={fv.lr_holdout}: expected a fraction in (0, 1)")
  if fv.lr_grid and any(a.startswith("--config.optimizer.learning_rate") for a in argv):
    raise FlagError("--lr_grid and --config.optimizer.learning_rate: give one of them")
  config_spec = next(a.split("=", 1)[1] if "=" in a else argv[i + 1]
                     for i, a in enumerate(argv) if a.split("=", 1)[0] == "--config")
  suite = _Suite(fv, argv, config_spec)
  initialize_distributed(fv, "finetune-suite")
  done = lambda workdir: fs.exists(os.path.join(workdir, "final_metrics.json"))
  check_tasks(suite, [t for t in tasks if not done(suite.workdir(t))])
  import jax
  from t5x_like.finetune.loop import finetune

  def run(task: str, lr: Optional[str] = None, grid_point: bool = False) -> Optional[int]:
    """Runs one fine-tuning unless it finished; its exit code when it was stopped. A
    signal that came after a run's last step (it finished its outputs) or between two
    runs stops the suite before its next run."""
    workdir = suite.workdir(task, lr if grid_point else None)
    what = f"{task} lr {lr}" if grid_point else task
    if done(workdir):
      return None
    if between.requested:
      return _stopped(between.requested, f"before {what}", "nothing of it was started")
    print(f"=== {suite_name}/{what}: {workdir}", flush=True)
    final = finetune(suite.config_of(suite.argv_of(task, lr, grid_point)), workdir)  # takes the workdir's lock
    if final.status == "stopped":
      return _stopped(final.stopped_by, f"in {what} at step {final.step}", "checkpoint saved")
    if final.stopped_by:
      return _stopped(final.stopped_by, f"after {what} finished", "its outputs are written")
    return None

  # Signals between two runs (each run installs its own handlers while it runs).
  between = Preemption(then="stopping before the suite's next run")
  try:
    rows = {}
    for task in tasks:
      lr = None
      if suite.grid and not done(suite.workdir(task)):
        for rate in suite.grid:
          stopped = run(task, rate, grid_point=True)
          if stopped is not None:
            return stopped
        scores = {rate: _read(suite.workdir(task, rate))["score"] for rate in suite.grid}
        lr = pick_learning_rate(scores)
        if jax.process_index() == 0:
          fs.write_bytes(suite.pick_path(task), json.dumps(
              {"learning_rate": lr, "scores": scores, "holdout_fraction": fv.lr_holdout,
               "holdout_seed": fv.config.seed}, indent=1).encode())
      stopped = run(task, lr)
      if stopped is not None:
        return stopped
      result = _read(suite.workdir(task))
      rows[task] = {"official": result["official"], "score": result["score"]}
      if fs.exists(suite.pick_path(task)):
        rows[task]["lr_grid"] = json.loads(fs.read_bytes(suite.pick_path(task)))
    summary = summarize(suite_name, rows)
    print(table(summary), flush=True)
    if jax.process_index() == 0:
      fs.write_bytes(os.path.join(fv.workdir, "suite.json"),
                     json.dumps(summary, indent=1).encode())
    return 0
  finally:
    between.restore()


def _stopped(signal_name: str, where: str, state: str) -> int:
  """Says the suite stopped and how to go on; its exit status (128 + the signal)."""
  code = stopped_exit_code(signal_name)
  print(f"stopped by {signal_name} {where}: {state}; exit {code}: rerun the same command to"
        " resume", flush=True)
  return code


def _read(workdir: str) -> dict:
  return json.loads(fs.read_bytes(os.path.join(workdir, "final_metrics.json")))


def summarize(suite: str, rows: dict[str, dict]) -> dict:
  """suite.json: the tasks' rows, the mean of their scores (each task's official metrics
  averaged first, finetune/metrics.glue_score), and how much of the suite it covers."""
  from t5x_like.benchmarks.registry import SUITES
  from t5x_like.finetune.metrics import glue_score
  score = glue_score({task: r["official"] for task, r in rows.items()}) if rows else 0.0
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


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
