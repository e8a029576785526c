"""`t5x-like finetune-suite --config configs/glue.py[:ARG] --workdir DIR [--tasks cola,rte]
[--init CHECKPOINT] [--lr_grid 3e-4,1e-4,5e-5,3e-5 [--lr_holdout 0.1]] [--config.KEY=VALUE ...]`.

Fine-tunes every task of the config's benchmark suite in turn (GLUE, SuperGLUE, SQuAD;
--tasks picks some), each as `t5x-like finetune --config FILE:ARG,task=TASK --workdir
DIR/TASK` with the same overrides, and --init as config.init.checkpoint.

Before training anything, every task still to run has its config built as its run
builds it and checked (finetune/config_check.py, the benchmark's data included): one
line per task that cannot run, exit 2, nothing written. The runner is
t5x_like/benchmarks/suite.py; this command parses its flags.

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

import sys

from absl import flags

from t5x_like.command_flags import parse_flags
from t5x_like.commands import finetune as finetune_command
from t5x_like.host_loss.distributed import initialize_distributed
from t5x_like.train.preemption import exit_at_once_on_interrupt


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


def finetune_config(argv: list[str]):
  """The config of a finetune argv, as `t5x-like finetune` parses it."""
  return parse_flags("finetune", argv, finetune_command._flags,
                     required=("config", "workdir")).config


def main(argv: list[str]) -> int:
  with exit_at_once_on_interrupt("finetune-suite"):
    fv = parse_flags("finetune-suite", argv, _flags, required=("config", "workdir"),
                     doc=__doc__)
    return _suite(fv, list(argv))


def _suite(fv: flags.FlagValues, argv: list[str]) -> int:
  from t5x_like.benchmarks.suite import Suite, SuiteFlags, run_suite, suite_tasks
  suite_flags = SuiteFlags(fv.config, fv.workdir, fv.tasks, fv.init, fv.lr_grid,
                           fv.lr_holdout, argv)
  suite_name, tasks = suite_tasks(suite_flags, fv["config"].config_filename)
  suite = Suite(suite_flags, finetune_config)
  initialize_distributed(fv, "finetune-suite")
  from t5x_like.plan.remat import resolve_remat  # model.remat_policy="auto", as finetune
  return run_suite(suite, suite_name, tasks, choose_remat=resolve_remat)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
