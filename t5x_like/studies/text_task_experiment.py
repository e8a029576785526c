"""The text-task experiment: pretrained against random initialisation against a bag of
pieces, on tasks from books that pretraining never saw, at several label counts.

  python -m t5x_like.studies.text_task_experiment --workdir workdir/text_tasks \\
      --pretrain large='text:more_books/*.txt' --pretrain small=embedded:austen_...

Run from the repository's root: its configs/ are the recipes (--configs DIR elsewhere).

Every stage skips what an earlier call finished, so a call resumes an interrupted one
and a second call with more arms, seeds or families adds only the missing runs:

  corpus    each --pretrain source, unwrapped (one line per paragraph, as the task texts
            have no line breaks), into WORKDIR/corpus/NAME/; a document that is also in
            --task_source is an error (the tasks must come from unseen text)
  pretrain  `t5x-like train --config configs/{bert,t5}_cpu.py:mini` on each corpus,
            with its --pretrain_set settings (WORKDIR/pretrain/FAMILY_NAME; about an
            hour each on 2 cores)
  tasks     `t5x-like task KIND --source TASK_SOURCE --per_class N --seed S` per kind,
            label count and seed (WORKDIR/tasks/KIND/N_sS; dev and test are the same
            for every N and S)
  lr        per family, arm (random, or pretrained on NAME) and kind: each learning
            rate of --lrs at --select_count labels per class, seed 0; the best dev
            accuracy picks the arm's rate
  finetune  every label count x seed at the picked rate (configs/text_tasks.py, with
            --set's settings; the step budget of steps_for), in
            WORKDIR/runs/FAMILY/ARM/KIND/N_sS_lrLR_stepsK[_VARIANT]
  baseline  the bag-of-pieces logistic regression (studies/bag_of_pieces.py) on
            every task folder
  tables    WORKDIR/results.jsonl (one row per run) and WORKDIR/tables.md: test
            accuracy, mean and range over the seeds, per family, kind and label count
"""

from __future__ import annotations

import collections
import concurrent.futures
import glob
import json
import math
import os
import sys
import time
from typing import Optional

import numpy as np
from absl import flags

from t5x_like.command_flags import FlagError, parse_flags_and_args
from t5x_like.errors import UserError
from t5x_like.studies.child_runs import configs_dir, configs_flag, exit_with, log, run_t5x_like

KINDS = ("authorship", "acceptability", "coherence")
UNSEEN = "embedded:carroll_alices_adventures_in_wonderland,shelley_frankenstein," \
         "wells_the_time_machine"


def count_name(count: int) -> str:
  return str(count) if count else "all"


def steps_for(train_examples: int, batch_size: int = 32) -> int:
  """The fine-tuning budget: 20 epochs within 100-300 steps; a training set whose 5
  epochs take more than 300 steps gets those 5 epochs, at most 1,000 steps.

  Every set of up to 256 labels per class (and 3 classes) ends in 100-300 steps; the
  larger "all" sets get enough passes to leave the chance-level loss a short budget
  leaves them at (acceptability's 6,454 sentences: 1,000 steps instead of 300).
  """
  epoch = train_examples / batch_size
  return int(min(1000, max(100, math.ceil(min(20 * epoch, max(300, 5 * epoch))))))


# --------------------------------------------------------------------------- stages
def write_corpus(name: str, specs: list[str], task_spec: str, workdir: str) -> str:
  """WORKDIR/corpus/NAME/*.txt: the documents of every spec, unwrapped, each file named
  after its document (its file or book name); returns the glob."""
  from t5x_like.data.sources import source_from_spec
  from t5x_like.corpus import unwrap
  folder = os.path.join(workdir, "corpus", name)
  pattern = os.path.join(folder, "*.txt")
  if os.path.exists(os.path.join(folder, "DONE")):
    return pattern
  task_docs = {" ".join(doc.split()) for doc in source_from_spec(task_spec)}
  os.makedirs(folder, exist_ok=True)
  for spec in specs:
    source = source_from_spec(spec)
    for d in range(len(source)):
      text = source[d]
      if " ".join(text.split()) in task_docs:
        raise UserError(f"--pretrain {name}={spec}: document {source.location(d)} is also"
                        f" in --task_source {task_spec}; the tasks must come from unseen"
                        " text")
      base = os.path.splitext(os.path.basename(source.location(d)))[0] or "document"
      path = os.path.join(folder, f"{base}.txt")
      if os.path.exists(path):
        path = os.path.join(folder, f"{base}_{d}.txt")
      with open(path, "w", encoding="utf-8") as f:
        f.write(unwrap(text))
  open(os.path.join(folder, "DONE"), "w").close()
  return pattern


def pretrain(family: str, name: str, corpus_glob: str, workdir: str, smoke: bool,
             settings: tuple[str, ...] = (), *, configs: str) -> str:
  """The pretraining run's workdir (trained when it has no DONE marker); settings:
  KEY=VALUE of configs/FAMILY_cpu.py:mini."""
  out = os.path.join(workdir, "pretrain", f"{family}_{name}")
  if not os.path.exists(out + ".done"):
    log(f"pretrain {family} on {name}" + (f" with {' '.join(settings)}" if settings else ""))
    variant = "smoke" if smoke else "mini"
    run_t5x_like("train", "--config", os.path.join(configs, f"{family}_cpu.py:{variant}"),
                 "--workdir", out, f"--config.data.source=text:{corpus_glob}",
                 *(f"--config.{s}" for s in settings), log_file=out + ".log")
    open(out + ".done", "w").close()
  return out


def build_task(kind: str, count: int, seed: int, task_spec: str, workdir: str) -> str:
  folder = os.path.join(workdir, "tasks", kind, f"{count_name(count)}_s{seed}")
  if not os.path.exists(os.path.join(folder, "stats.json")):
    from t5x_like.task_builders.text_tasks import build_text_task
    build_text_task(kind, task_spec, folder, per_class=count, seed=seed)
  return folder


def finetune(family: str, arm: str, kind: str, task_dir: str, lr: float, seed: int,
             checkpoint: str, workdir: str, smoke: bool,
             variant: tuple[str, list[str]] = ("", []), *, configs: str) -> dict:
  """final_metrics.json of one fine-tuning run (run when missing). The run's folder
  names its step budget and variant (NAME, its `KEY=VALUE` config settings), so a
  changed budget or variant is a new run."""
  with open(os.path.join(task_dir, "stats.json")) as f:
    train_examples = json.load(f)["splits"]["train"]["examples"]
  steps = 10 if smoke else steps_for(train_examples)
  name, settings = variant
  run = os.path.join(workdir, "runs", family, arm, kind,
                     f"{os.path.basename(task_dir)}_lr{lr:g}_steps{steps}"
                     + (f"_{name}" if name else ""))
  metrics_file = os.path.join(run, "final_metrics.json")
  if not os.path.exists(metrics_file):
    arg = f"{kind},family={family},dir={task_dir}" + (",smoke" if smoke else "")
    args = ["finetune", "--config", os.path.join(configs, f"text_tasks.py:{arg}"),
            "--workdir", run, f"--config.optimizer.learning_rate={lr}",
            f"--config.seed={seed}", f"--config.train.num_steps={steps}",
            *(f"--config.{s}" for s in settings)]
    if checkpoint:
      args.append(f"--config.init.checkpoint={checkpoint}")
    started = time.time()
    run_t5x_like(*args, log_file=run + ".log")
    log(f"{family} {arm} {kind} {os.path.basename(run)}: "
        f"{time.time() - started:.0f} s")
  with open(metrics_file) as f:
    return json.load(f)


def baseline(family: str, task_dir: str, workdir: str, *, configs: str) -> dict:
  out = os.path.join(workdir, "baseline", family, os.path.basename(os.path.dirname(task_dir)),
                     os.path.basename(task_dir) + ".json")
  if not os.path.exists(out):
    from t5x_like.command_flags import load_config_file
    from t5x_like.finetune.backbone import load_backbone
    from t5x_like.studies.bag_of_pieces import bag_of_pieces
    from t5x_like.finetune.splits import load_splits
    from t5x_like.finetune.tasks import task_from_config
    kind = os.path.basename(os.path.dirname(task_dir))
    config = load_config_file(os.path.join(configs, f"text_tasks.py:{kind},family={family},"
                                           f"dir={task_dir},smoke"))
    task = task_from_config(config.task)
    splits = load_splits(config, task, text_to_text=False)
    result = bag_of_pieces(splits.train, splits.main_dev, splits.test["test"],
                           load_backbone(config).tokenizer)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
      json.dump(result, f)
  with open(out) as f:
    return json.load(f)


# --------------------------------------------------------------------------- tables
def tables(rows: list[dict], arms: list[str]) -> str:
  """Markdown: per family (and fine-tuning variant), rows kind x label count, columns
  bag / each arm, test accuracy mean (min-max) over the seeds; the pretrained arms'
  margins over random."""
  cell = collections.defaultdict(list)
  for r in rows:
    cell[r["family"], r.get("variant", ""), r["kind"], r["count"], r["arm"]].append(
        r["test_accuracy"])
  out = []
  for family, variant in sorted({(k[0], k[1]) for k in cell if k[4] != "bag"}):
    def values(kind, count, arm):
      return cell.get((family, "" if arm == "bag" else variant, kind, count, arm), [])
    shown = [a for a in arms if any(k[:2] == (family, variant) and k[4] == a for k in cell)]
    pretrained = [a for a in shown if a != "random"]
    out.append(f"\n### {family.upper()}{f' ({variant})' if variant else ''}: test"
               " accuracy, mean (range) over seeds\n")
    out.append("| task | labels per class | bag of pieces | " + " | ".join(
        "random init" if a == "random" else f"pretrained on {a}" for a in shown)
        + "".join(f" | {a} - random" for a in pretrained) + " |")
    out.append("|---" * (3 + len(shown) + len(pretrained)) + "|")
    for kind in KINDS:
      counts = sorted({k[3] for k in cell if k[:3] == (family, variant, kind)},
                      key=lambda c: c or 10**9)
      for count in counts:
        v = {a: values(kind, count, a) for a in ["bag", *shown]}
        fmt = [f"{np.mean(x):.3f} ({min(x):.3f}-{max(x):.3f})" if len(x) > 1 else
               (f"{x[0]:.3f}" if x else "") for x in v.values()]
        margins = [f"{np.mean(v[a]) - np.mean(v['random']):+.3f}"
                   if v[a] and v.get("random") else "" for a in pretrained]
        out.append(f"| {kind} | {count_name(count)} | " + " | ".join(fmt + margins) + " |")
  return "\n".join(out) + "\n"


PROG = "python -m t5x_like.studies.text_task_experiment"


def _flags(argv: list[str]) -> flags.FlagValues:
  del argv
  fv = flags.FlagValues()
  flags.DEFINE_string("workdir", None, "where every stage writes", flag_values=fv)
  flags.DEFINE_multi_string("pretrain", [], "NAME=SPEC: a pretraining corpus (a source"
                            " spec); repeat for several corpora, or with the same NAME to"
                            " join several sources into one", flag_values=fv)
  flags.DEFINE_multi_string("pretrain_set", [], "NAME:KEY=VALUE: a setting of the"
                            " pretraining on corpus NAME, e.g. large_sd:data.options."
                            "nsp_negatives=same_document", flag_values=fv)
  flags.DEFINE_string("task_source", UNSEEN, "the text the tasks are built from",
                      flag_values=fv)
  flags.DEFINE_list("families", ["bert"], "bert and/or t5", flag_values=fv)
  flags.DEFINE_list("kinds", list(KINDS), "task kinds", flag_values=fv)
  flags.DEFINE_list("counts", ["16", "64", "256", "all"], "labels per class (all = every"
                    " one)", flag_values=fv)
  flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds", flag_values=fv)
  flags.DEFINE_list("lrs", ["1e-4", "3e-4", "1e-3"], "the learning-rate grid",
                    flag_values=fv)
  flags.DEFINE_string("select_count", "256", "labels per class of the lr selection",
                      flag_values=fv)
  flags.DEFINE_string("variant", "", "a name for the fine-tuning settings of --set (in"
                      " the run folders and the tables)", flag_values=fv)
  flags.DEFINE_multi_string("set", [], "KEY=VALUE: a setting of configs/text_tasks.py"
                            " for every fine-tuning run, e.g. task.pooling=cls (needs"
                            " --variant)", flag_values=fv)
  flags.DEFINE_bool("random", True, "also the random-initialisation arm", flag_values=fv)
  flags.DEFINE_integer("jobs", 1, "fine-tuning runs at once", flag_values=fv)
  flags.DEFINE_bool("smoke", False, "tiny configs, 10 steps (tests)", flag_values=fv)
  configs_flag(fv)
  return fv


def main(argv: Optional[list[str]] = None) -> int:
  a, _ = parse_flags_and_args("text-task experiment", sys.argv[1:] if argv is None else argv,
                              _flags, required=("workdir",), doc=__doc__, positionals="",
                              prog=PROG)
  try:
    counts = [parse_count(c) for c in a.counts]
    seeds = [int(s) for s in a.seeds]
    lrs = [float(x) for x in a.lrs]
    select = parse_count(a.select_count)
  except ValueError as e:
    raise FlagError(f"--counts, --seeds, --lrs or --select_count: {e}") from None
  if a.jobs < 1:
    raise FlagError(f"--jobs {a.jobs}: expected at least 1")
  unknown = set(a.kinds) - set(KINDS) or set(a.families) - {"bert", "t5"}
  if unknown:
    raise FlagError(f"--kinds or --families: unknown {sorted(unknown)}")
  kinds = list(a.kinds)
  bad = [x for x in a.set if not is_setting(x)]
  if bad or bool(a.set) != bool(a.variant):
    raise FlagError(f"--set {bad[0]!r}: expected KEY=VALUE" if bad else
                    "--set and --variant go together: the variant names the settings")
  variant = (a.variant, list(a.set))
  corpora: dict[str, list[str]] = {}
  for item in a.pretrain:
    name, sep, spec = item.partition("=")
    if not sep or not name or not spec:
      raise FlagError(f"--pretrain {item!r}: expected NAME=SPEC")
    corpora.setdefault(name, []).append(spec)
  pretrain_settings = collections.defaultdict(list)
  for item in a.pretrain_set:
    name, sep, setting = item.partition(":")
    if not sep or name not in corpora or not is_setting(setting):
      raise FlagError(f"--pretrain_set {item!r}: expected NAME:KEY=VALUE with NAME one of"
                      f" the --pretrain corpora {sorted(corpora)}")
    pretrain_settings[name].append(setting)
  configs = configs_dir(a.configs)
  workdir = os.path.abspath(a.workdir)
  results = os.path.join(workdir, "results.jsonl")
  rows = []
  arms = (["random"] if a.random else []) + list(corpora)
  for family in a.families:
    checkpoints = {"random": ""}
    for name, specs in corpora.items():
      corpus_glob = write_corpus(name, specs, a.task_source, workdir)
      checkpoints[name] = pretrain(family, name, corpus_glob, workdir, a.smoke,
                                   tuple(pretrain_settings[name]), configs=configs)
    tasks = {(kind, count, seed): build_task(kind, count, seed, a.task_source, workdir)
             for kind in kinds for count in {*counts, select} for seed in {*seeds, 0}}
    for kind in kinds:
      for count in counts:
        for seed in seeds:
          rows.append(dict(family=family, kind=kind, count=count, seed=seed, arm="bag",
                           **baseline(family, tasks[kind, count, seed], workdir,
                                             configs=configs)))
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
      def run(arm, kind, count, seed, lr):
        return pool.submit(finetune, family, arm, kind, tasks[kind, count, seed], lr, seed,
                           checkpoints[arm], workdir, a.smoke, variant, configs=configs)
      grid = {(arm, kind, lr): run(arm, kind, select, 0, lr)
              for kind in kinds for arm in arms for lr in lrs}
      best = {}
      for kind in kinds:
        for arm in arms:
          dev = {lr: grid[arm, kind, lr].result()["accuracy"] for lr in lrs}
          best[arm, kind] = max(lrs, key=lambda lr: (dev[lr], -lr))
          log(f"{family} {arm} {kind}{f' ({a.variant})' if a.variant else ''}: dev"
              f" accuracy by lr {dev}; picked {best[arm, kind]:g}")
      final = {(kind, arm, count, seed): run(arm, kind, count, seed, best[arm, kind])
               for kind in kinds for arm in arms for count in counts for seed in seeds}
      for (kind, arm, count, seed), future in final.items():
        m = future.result()  # fine-tuning's metrics are percent; the study's, fractions
        rows.append(dict(family=family, kind=kind, count=count, seed=seed, arm=arm,
                         variant=a.variant, lr=best[arm, kind], steps=m["step"],
                         dev_accuracy=m["accuracy"] / 100,
                         test_accuracy=m["test_accuracy"] / 100, seconds=m["seconds"]))
    with open(results, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(workdir, "tables.md"), "w") as f:
      f.write(tables(rows, arms))
  print(tables(rows, arms))
  return 0


def is_setting(text: str) -> bool:
  """Whether text is a config setting KEY=VALUE (a non-empty key)."""
  return "=" in text and not text.startswith("=")


def parse_count(count: str) -> int:
  """'all' -> 0 (every example), else the number."""
  return 0 if count == "all" else int(count)


if __name__ == "__main__":
  exit_with(main, PROG)
