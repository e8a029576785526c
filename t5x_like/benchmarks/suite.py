"""The suite runner behind `t5x-like finetune-suite` (commands/finetune_suite.py parses
its flags and says what it does): every task of a benchmark suite fine-tuned in turn,
each checked before any is trained, with an optional learning-rate grid picked on a
held-out split of train, resumable, then one table (suite_table.py).

  suite = Suite(SuiteFlags(...), parse_config=fn)     # fn(finetune argv) -> its config
  exit_code = run_suite(suite, tasks, choose_remat=resolve_remat)

Each task runs as `t5x-like finetune --config FILE:ARG,task=TASK --workdir DIR/TASK`
would, with the suite's overrides; a grid point in DIR/lr_grid/TASK/LR on the held-out
split (config.benchmark.holdout_fraction / holdout_seed), the pick in
DIR/lr_grid/TASK/pick.json.
"""

from __future__ import annotations

import json
import os
from typing import Callable, NamedTuple, Optional

from t5x_like import fs
from t5x_like.benchmarks.registry import SUITES, benchmark
from t5x_like.benchmarks.suite_table import summarize, table
from t5x_like.benchmarks.task_data import task_data
from t5x_like.command_flags import FlagError
from t5x_like.errors import UserError
from t5x_like.train.preemption import Preemption, stopped_exit_code

# The suite's own flags, not passed on to each task's finetune argv.
SUITE_FLAGS = ("--config", "--workdir", "--tasks", "--init", "--lr_grid", "--lr_holdout")


class SuiteFlags(NamedTuple):
  """What the command parsed: the suite's config (its first task's), the flags and the
  full argv (each task's finetune argv is made from it)."""
  config: object
  workdir: str
  tasks: list[str]
  init: str
  lr_grid: list[str]
  lr_holdout: float
  argv: list[str]


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
    if a.split("=", 1)[0] in SUITE_FLAGS:
      skip = "=" not in a
      continue
    out.append(a)
  out = [f"--config={spec}", f"--workdir={workdir}", *out]  # the config before its overrides
  return out + ([f"--config.init.checkpoint={init}"] if init else []) + list(overrides)


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


class Suite:
  """Where each run of the suite lives and its config. parse_config(argv): the config of
  a finetune argv, as `t5x-like finetune` parses it (the command's flags)."""

  def __init__(self, flags: SuiteFlags, parse_config: Callable[[list[str]], object]):
    self.flags, self.parse_config = flags, parse_config
    self.config_spec = next(a.split("=", 1)[1] if "=" in a else flags.argv[i + 1]
                            for i, a in enumerate(flags.argv)
                            if a.split("=", 1)[0] == "--config")
    self.grid = learning_rates(flags.lr_grid)
    self.holdout = dict(fraction=flags.lr_holdout, seed=flags.config.seed)

  def workdir(self, task: str, lr: Optional[str] = None) -> str:
    if lr is None:
      return os.path.join(self.flags.workdir, task)
    return os.path.join(self.flags.workdir, "lr_grid", task, lr)

  def pick_path(self, task: str) -> str:
    return os.path.join(self.flags.workdir, "lr_grid", task, "pick.json")

  def argv_of(self, task: str, lr: Optional[str] = None, grid_point: bool = False
              ) -> list[str]:
    """The finetune argv of the task's final run (lr: the picked rate) or grid point."""
    overrides = [f"--config.optimizer.learning_rate={lr}"] if lr else []
    if grid_point:
      overrides += [f"--config.benchmark.holdout_fraction={self.holdout['fraction']}",
                    f"--config.benchmark.holdout_seed={self.holdout['seed']}",
                    "--config.benchmark.predict_test=False"]
    return task_argv(self.flags.argv, self.config_spec, task,
                     self.workdir(task, lr if grid_point else None), self.flags.init,
                     tuple(overrides))

  def config_of(self, argv: list[str]):
    return self.parse_config(argv)

  def done(self, workdir: str) -> bool:
    return fs.exists(os.path.join(workdir, "final_metrics.json"))


def suite_tasks(flags: SuiteFlags, config_filename: str) -> tuple[str, list[str]]:
  """(the suite's name, the tasks to run); FlagError for flags that cannot run."""
  if not flags.config.benchmark.name:
    raise FlagError(f"--config {config_filename}: config.benchmark.name is"
                    " empty: finetune-suite runs a benchmark's tasks (configs/glue.py, ...)")
  suite_name = benchmark(flags.config.benchmark.name).suite
  tasks = flags.tasks or SUITES[suite_name]
  unknown = [t for t in tasks if t not in SUITES[suite_name]]
  if unknown:
    raise FlagError(f"--tasks: unknown {suite_name} task {unknown[0]!r}; known:"
                    f" {', '.join(SUITES[suite_name])}")
  if flags.lr_grid and not 0 < flags.lr_holdout < 1:
    raise FlagError(f"--lr_holdout={flags.lr_holdout}: expected a fraction in (0, 1)")
  if flags.lr_grid and any(a.startswith("--config.optimizer.learning_rate")
                           for a in flags.argv):
    raise FlagError("--lr_grid and --config.optimizer.learning_rate: give one of them")
  return suite_name, list(tasks)


def check_tasks(suite: Suite, tasks: list[str]) -> None:
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
        config = suite.config_of(argv)
        validate_finetune(config, data=task_data(config))
    except UserError as e:
      problems.append(f"  {task}: {e}")
  if problems:
    raise UserError(f"{len(problems)} of the {len(tasks)} tasks to run cannot run; nothing"
                    " was trained:\n" + "\n".join(problems))


def run_suite(suite: Suite, suite_name: str, tasks: list[str], *,
              choose_remat: Optional[Callable] = None) -> int:
  """Checks the tasks still to run, runs each (its grid first), prints the table and
  writes DIR/suite.json; the exit status (128 + a signal's number when one stopped it).
  choose_remat: handed to each finetune (finetune/loop.py)."""
  check_tasks(suite, [t for t in tasks if not suite.done(suite.workdir(t))])
  import jax
  from t5x_like.finetune.loop import finetune

  def run(task: str, lr: Optional[str] = None, grid_point: bool = False) -> Optional[int]:
    """Runs one fine-tuning unless it finished; its exit code when it was stopped. A
    signal that came after a run's last step (it finished its outputs) or between two
    runs stops the suite before its next run."""
    workdir = suite.workdir(task, lr if grid_point else None)
    what = f"{task} lr {lr}" if grid_point else task
    if suite.done(workdir):
      return None
    if between.requested:
      return _stopped(between.requested, f"before {what}", "nothing of it was started")
    print(f"=== {suite_name}/{what}: {workdir}", flush=True)
    config = suite.config_of(suite.argv_of(task, lr, grid_point))
    final = finetune(config, workdir, data=task_data(config),  # takes the workdir's lock
                     choose_remat=choose_remat)
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
      if suite.grid and not suite.done(suite.workdir(task)):
        for rate in suite.grid:
          stopped = run(task, rate, grid_point=True)
          if stopped is not None:
            return stopped
        scores = {rate: _read(suite.workdir(task, rate))["score"] for rate in suite.grid}
        lr = pick_learning_rate(scores)
        if jax.process_index() == 0:
          fs.write_bytes(suite.pick_path(task), json.dumps(
              {"learning_rate": lr, "scores": scores,
               "holdout_fraction": suite.flags.lr_holdout,
               "holdout_seed": suite.flags.config.seed}, indent=1).encode())
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
      fs.write_bytes(os.path.join(suite.flags.workdir, "suite.json"),
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
