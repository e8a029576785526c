"""The GLUE study: pretrained here against random initialisation against a bag of pieces,
on GLUE's dev sets with the official metrics, for BERT and T5 (docs/glue.md).

  python -m t5x_like.studies.glue_experiment --workdir workdir/glue_study \\
      --data_dir glue_data --out docs/glue.md

Run from the repository's root: its configs/ are the recipes (--configs DIR elsewhere).

data_dir holds GLUE's own files (CoLA/train.tsv ..., as GLUE's download script lays them
out) or a TFDS build. Every stage skips what an earlier call finished, so a call resumes
an interrupted one:

  corpus    the unlabeled text of the tasks' train splits (never dev or test), a
            document per 32 examples, WORKDIR/corpus/TASK.jsonl: task-adaptive pretraining
            (Gururangan et al. 2020), beside --books (the embedded corpus by default)
  pretrain  `t5x-like train --config configs/{bert,t5}_cpu.py:glue` on the mixture
            {books: 1 - task_text_rate, each task's text: task_text_rate shared by the
            square root of its size} (WORKDIR/pretrain/FAMILY, FAMILY_Nsteps with
            --pretrain_steps N)
  finetune  per family, arm (pretrained, random) and seed: `t5x-like finetune-suite
            --config configs/glue.py:family=FAMILY,cpu` on --data_dir; seed 0 picks each
            task's learning rate from --lr_grid on a held-out 10% of train (never dev),
            the other seeds run at that rate (WORKDIR/runs/FAMILY/ARM/sS)
  baseline  the bag of pieces (studies/bag_of_pieces.py fit_on_train: its penalty picked
            on train) with the family's vocabulary, per task
  tables    WORKDIR/results.jsonl (one row per run) and --out: each task's official dev
            metrics, mean (range) over the seeds, per family and arm, the five-task
            average (CoLA, SST-2, MRPC, STS-B, RTE; MRPC and STS-B as the mean of their
            two metrics, as Turc et al. 2019 report them) and their BERT-Tiny and
            BERT-Mini rows (GLUE test) for scale (--out replaces the sections of the
            families this call ran)

--record FILE keeps the finished results outside the workdir (restore_record,
save_record): a call in a new workdir runs only what the record lacks.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import time
from typing import Optional

import numpy as np
from absl import flags

from t5x_like import fs
from t5x_like.command_flags import FlagError, parse_flags_and_args
from t5x_like.studies.glue_tables import glue_markdown, section_marker
from t5x_like.studies.child_runs import configs_dir, configs_flag, exit_with, log, run_t5x_like

PROG = "python -m t5x_like.studies.glue_experiment"
TASKS = ("cola", "sst2", "mrpc", "stsb", "rte", "wnli")
ARMS = ("pretrained", "random")


# --------------------------------------------------------------------------- stages
EXAMPLES_PER_DOCUMENT = 32


def write_task_text(tasks: list[str], data_dir: str, workdir: str) -> dict[str, int]:
  """WORKDIR/corpus/TASK.jsonl: {"text": ..., "examples": k} per run of
  EXAMPLES_PER_DOCUMENT consecutive training examples of each task, every text a
  paragraph of its own (a pair's two texts one after the other). One short example per
  document would leave most of a 128-token BERT instance as padding; grouped, an
  instance holds whole pairs, and a masked word of one text can be read in its pair's
  other. Returns {path: the number of examples}."""
  from t5x_like.benchmarks.registry import benchmark
  from t5x_like.benchmarks.sources import open_examples
  out = {}
  for task in tasks:
    path = os.path.join(workdir, "corpus", f"{task}.jsonl")
    if not os.path.exists(path):
      os.makedirs(os.path.dirname(path), exist_ok=True)
      bench = benchmark(f"glue/{task}")
      part = open_examples(bench, "train", data_dir)
      texts = []
      for example in part.examples:
        row = bench.record(example, False, part.label_names or ["0"])
        texts.append([t.strip() for t in (row["text"], row.get("text_pair", ""))
                      if t.strip()])
      with open(path + ".tmp", "w", encoding="utf-8") as f:
        for start in range(0, len(texts), EXAMPLES_PER_DOCUMENT):
          group = texts[start:start + EXAMPLES_PER_DOCUMENT]
          text = "\n\n".join(t for example in group for t in example)
          f.write(json.dumps({"text": text, "examples": len(group)}) + "\n")
      os.replace(path + ".tmp", path)
    with open(path, encoding="utf-8") as f:
      out[path] = sum(json.loads(line)["examples"] for line in f)
  return out


def pretraining_mixture(books: str, task_text: dict[str, int], rate: float) -> dict:
  """{source spec: rate}: books at 1 - rate; the tasks' text at rate, shared in
  proportion to the square root of each task's examples (temperature-2 sampling, so
  SST-2's 67k phrases do not drown the sentence pairs of STS-B, MRPC and RTE)."""
  roots = {path: n ** 0.5 for path, n in task_text.items()}
  mixture = {books: round(1 - rate, 6)}
  mixture.update({f"jsonl:{path}": round(rate * r / sum(roots.values()), 6)
                  for path, r in roots.items()})
  return mixture


def pretrain(family: str, mixture: dict, steps: int, workdir: str, smoke: bool, *,
             configs: str) -> str:
  """The pretraining run's workdir (trained when it has no .done marker; a changed
  step count is another run, named by it)."""
  out = os.path.join(workdir, "pretrain", family + (f"_{steps}steps" if steps else ""))
  if not os.path.exists(out + ".done"):
    args = ["train", "--config", os.path.join(configs, f"{family}_cpu.py:"
                                              + ("smoke" if smoke else "glue")),
            "--workdir", out, f"--config.data.mixture={mixture!r}"]
    if steps:
      args.append(f"--config.train.num_steps={steps}")
    log(f"pretrain {family} on {mixture}")
    started = time.time()
    run_t5x_like(*args, log_file=out + ".log")
    log(f"pretrain {family}: {time.time() - started:.0f} s")
    open(out + ".done", "w").close()
  return out


def suite_runs(family: str, arm: str, seed: int, tasks: list[str], checkpoint: str,
               data_dir: str, lr_grid: list[str], picks: dict[str, str], workdir: str,
               smoke: bool, *, configs: str) -> dict[str, dict]:
  """{task: final_metrics.json} of the arm's suite at one seed (run where missing):
  with lr_grid, each task's rate picked on train; else each task at picks[task]."""
  suite = os.path.join(workdir, "runs", family, arm, f"s{seed}")
  arg = f"family={family}," + ("smoke" if smoke else "cpu")
  common = ["finetune-suite", "--config", os.path.join(configs, f"glue.py:{arg}"),
            f"--config.benchmark.data_dir={data_dir}", f"--config.seed={seed}"]
  if arm == "random":  # the same architecture as the pretrained arm, no checkpoint
    variant = "smoke" if smoke else "glue"
    common.append(f"--config.init.config={os.path.join(configs, f'{family}_cpu.py:{variant}')}")
  else:
    common.append(f"--init={checkpoint}")
  missing = [t for t in tasks if not os.path.exists(os.path.join(suite, t,
                                                                 "final_metrics.json"))]
  if missing:
    started = time.time()
    if lr_grid:
      run_t5x_like(*common, "--workdir", suite, f"--tasks={','.join(missing)}",
                   f"--lr_grid={','.join(lr_grid)}", log_file=f"{suite}.log")
    else:
      for task in missing:  # each at its rate picked at the first seed
        rate = [f"--config.optimizer.learning_rate={picks[task]}"] if picks.get(task) else []
        run_t5x_like(*common, "--workdir", suite, f"--tasks={task}", *rate,
                     log_file=f"{suite}_{task}.log")
    log(f"{family} {arm} seed {seed}: {', '.join(missing)} in {time.time() - started:.0f} s")
  out = {}
  for task in tasks:
    with open(os.path.join(suite, task, "final_metrics.json")) as f:
      out[task] = json.load(f)
    pick = os.path.join(suite, "lr_grid", task, "pick.json")
    if os.path.exists(pick):
      with open(pick) as f:
        out[task]["lr_grid"] = json.load(f)
  return out


# --------------------------------------------------------------------------- the record
RECORDED = ("runs/**/final_metrics.json", "baseline/**/*.json")


def restore_record(record: str, workdir: str) -> int:
  """Writes each result of the record (JSONL of {"path": under WORKDIR, "result"}) that
  the workdir lacks, so those runs count as finished; returns how many it wrote."""
  if not os.path.exists(record):
    return 0
  written = 0
  with open(record, encoding="utf-8") as f:
    for line in f:
      row = json.loads(line)
      path = os.path.join(workdir, row["path"])
      if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fs.write_bytes(path, json.dumps(row["result"], indent=1).encode())  # atomic
        written += 1
  return written


def save_record(record: str, workdir: str) -> int:
  """The record rewritten with every finished result under the workdir (fine-tunings'
  final_metrics.json, the bag of pieces'), beside the rows it held; returns the rows."""
  rows = {}
  if os.path.exists(record):
    with open(record, encoding="utf-8") as f:
      rows = {row["path"]: row for row in map(json.loads, f)}
  for pattern in RECORDED:
    for path in glob.glob(os.path.join(workdir, pattern), recursive=True):
      with open(path) as f:
        rel = os.path.relpath(path, workdir)
        rows[rel] = {"path": rel, "result": json.load(f)}
  os.makedirs(os.path.dirname(os.path.abspath(record)), exist_ok=True)
  # atomic, with a per-process temporary: the two study processes (one per arm) may save
  # at once
  fs.write_bytes(record, "".join(json.dumps(rows[k], sort_keys=True) + "\n"
                                 for k in sorted(rows)).encode())
  return len(rows)


def baseline(family: str, task: str, data_dir: str, workdir: str, smoke: bool, *,
             configs: str) -> dict:
  """The bag of pieces' official dev metrics on one task (cached as JSON)."""
  out = os.path.join(workdir, "baseline", family, f"{task}.json")
  if not os.path.exists(out):
    from t5x_like.command_flags import load_config_file
    from t5x_like.finetune import metrics as metrics_lib
    from t5x_like.finetune.backbone import load_backbone
    from t5x_like.benchmarks.registry import benchmark
    from t5x_like.benchmarks.task_data import benchmark_splits, benchmark_task
    from t5x_like.studies.bag_of_pieces import fit_on_train
    config = load_config_file(os.path.join(
        configs, f"glue.py:{task},family={family}," + ("smoke" if smoke else "cpu")))
    config.benchmark.data_dir = data_dir
    config.benchmark.predict_test = False
    config.init.config = config.init.default_config
    splits = benchmark_splits(config, benchmark_task(config, False), text_to_text=False)
    bench = benchmark(config.benchmark.name)
    regression = bench.kind == "regression"
    main = bench.metrics[0]
    score = {"pearson": metrics_lib.pearson, "mcc": metrics_lib.matthews_corrcoef,
             "f1": lambda p, g: metrics_lib.binary_f1(p, g, bench.positive_label)
             }.get(main, metrics_lib.accuracy)
    started = time.time()
    bag = fit_on_train(splits.train, load_backbone(config).tokenizer, regression, score)
    official = {}
    for name, dev in splits.dev.items():
      predicted = bag.predict(dev)
      labels = splits.train.labels
      rows = [{"prediction": float(p) if regression else labels[int(p)],
               "label": None if regression else labels[e.label]}
              for p, e in zip(predicted, dev.examples)]
      official.update(bench.official_metrics({name: rows}, labels, {name: dev.golds}))
    result = {"official": {k: round(v, 3) for k, v in official.items()}, "l2": bag.l2,
              "holdout_scores": {str(k): v for k, v in bag.holdout_scores.items()},
              "seconds": round(time.time() - started, 1)}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
      json.dump(result, f)
  with open(out) as f:
    return json.load(f)


# --------------------------------------------------------------------------- the study
def _flags(argv: list[str]) -> flags.FlagValues:
  del argv
  fv = flags.FlagValues()
  flags.DEFINE_string("workdir", None, "where every stage writes", flag_values=fv)
  flags.DEFINE_string("data_dir", None, "GLUE's files (CoLA/train.tsv ...) or a TFDS data"
                      " dir", flag_values=fv)
  flags.DEFINE_string("out", "", "also write the tables into this page, between its"
                      " markers (docs/glue.md)", flag_values=fv)
  flags.DEFINE_list("families", ["bert", "t5"], "bert and/or t5", flag_values=fv)
  flags.DEFINE_list("tasks", list(TASKS), "GLUE tasks", flag_values=fv)
  flags.DEFINE_list("arms", list(ARMS), "pretrained and/or random", flag_values=fv)
  flags.DEFINE_list("seeds", ["0", "1", "2"], "fine-tuning seeds", flag_values=fv)
  flags.DEFINE_list("lr_grid", ["3e-4", "1e-4", "5e-5", "3e-5"], "learning rates (Turc et"
                    " al. 2019's grid), picked per task and arm on train at the first seed",
                    flag_values=fv)
  flags.DEFINE_list("t5_lr_grid", ["3e-3", "1e-3", "3e-4", "1e-4"], "T5's grid",
                    flag_values=fv)
  flags.DEFINE_string("books", "embedded", "the general text beside the task text (a"
                      " source spec)", flag_values=fv)
  flags.DEFINE_float("task_text_rate", 0.7, "the task text's share of the pretraining"
                     " mixture", flag_values=fv)
  flags.DEFINE_integer("pretrain_steps", 0, "0 = the :glue config's", flag_values=fv)
  flags.DEFINE_string("record", "", "a JSONL file of finished results kept outside the"
                      " workdir (docs/glue_runs.jsonl): read first, so a run it holds is"
                      " not run again, and rewritten after every suite", flag_values=fv)
  flags.DEFINE_bool("smoke", False, "tiny configs and steps (tests)", flag_values=fv)
  configs_flag(fv)
  return fv


def main(argv: Optional[list[str]] = None) -> int:
  a, _ = parse_flags_and_args("GLUE study", sys.argv[1:] if argv is None else argv, _flags,
                              required=("workdir", "data_dir"), doc=__doc__,
                              positionals="", prog=PROG)
  unknown = (set(a.tasks) - set(TASKS) or set(a.families) - {"bert", "t5"}
             or set(a.arms) - set(ARMS))
  if unknown:
    raise FlagError(f"--tasks, --families or --arms: unknown {sorted(unknown)}"
                    f" (tasks: {', '.join(TASKS)})")
  try:
    seeds = [int(s) for s in a.seeds]
  except ValueError as e:
    raise FlagError(f"--seeds: {e}") from None
  if not 0 < a.task_text_rate < 1:
    raise FlagError(f"--task_text_rate {a.task_text_rate}: expected a number in (0, 1)")
  workdir, data_dir = os.path.abspath(a.workdir), os.path.abspath(a.data_dir)
  configs = configs_dir(a.configs)
  from t5x_like.benchmarks.registry import benchmark
  from t5x_like.benchmarks.sources import check_benchmark
  for task in a.tasks:  # every task's data before anything runs
    check_benchmark(_benchmark_config(benchmark(f"glue/{task}").tfds_name, data_dir))
  if a.record:
    log(f"{a.record}: {restore_record(a.record, workdir)} finished results restored")
  try:
    rows = _stages(a, seeds, workdir, data_dir, configs)
  finally:  # what finished is kept, also when a suite stopped or failed
    if a.record:
      log(f"{a.record}: {save_record(a.record, workdir)} results")
  with open(os.path.join(workdir, "results.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  text = glue_markdown(rows, list(a.tasks))
  with open(os.path.join(workdir, "tables.md"), "w") as f:
    f.write(text)
  if a.out:
    write_between_markers(a.out, text)
  print(text)
  return 0


def _stages(a, seeds: list[int], workdir: str, data_dir: str, configs: str) -> list[dict]:
  """Every stage (module docstring) of a parsed call; its result rows."""
  rows = []
  mixture = pretraining_mixture(a.books, write_task_text(list(a.tasks), data_dir, workdir),
                                a.task_text_rate)
  for family in a.families:
    checkpoint = (pretrain(family, mixture, a.pretrain_steps, workdir, a.smoke,
                           configs=configs)
                  if "pretrained" in a.arms else "")
    for task in a.tasks:
      rows.append(dict(family=family, arm="bag", task=task, seed=0,
                       **baseline(family, task, data_dir, workdir, a.smoke,
                                  configs=configs)))
    grid = a.t5_lr_grid if family == "t5" else a.lr_grid
    for arm in a.arms:
      picks: dict[str, str] = {}
      for seed in seeds:
        runs = suite_runs(family, arm, seed, list(a.tasks), checkpoint, data_dir,
                          grid if not picks else [], picks, workdir, a.smoke,
                          configs=configs)
        if a.record:
          save_record(a.record, workdir)
        for task, m in runs.items():
          picks.setdefault(task, m.get("lr_grid", {}).get("learning_rate", ""))
          rows.append(dict(family=family, arm=arm, task=task, seed=seed,
                           lr=picks[task], official=m["official"], step=m.get("step"),
                           seconds=m.get("seconds"),
                           submissions=m.get("submissions", [])))
  return rows


BEGIN, END = "<!-- glue_experiment tables: begin -->", "<!-- glue_experiment tables: end -->"


SECTION = re.compile(r"^<!-- glue_experiment section: (\S+) -->\n", re.M)  # section_marker


def write_between_markers(path: str, text: str) -> None:
  """Puts text between BEGIN and END in the file at path (the rest of the page is
  prose, kept), or writes the markers and text as a new file. Where text is made of
  sections (glue_tables.section_marker), only those replace the page's: a call for one
  family keeps the other family's table."""
  old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
  head, sep, rest = old.partition(BEGIN)
  inner, _, tail = rest.partition(END) if sep else ("", "", "")
  new_parts = SECTION.split(text)
  if len(new_parts) > 1:
    old_parts = SECTION.split(inner)
    sections = dict(zip(old_parts[1::2], old_parts[2::2]))
    sections.update(zip(new_parts[1::2], new_parts[2::2]))
    order = sorted(sections, key=lambda name: (name == "published", name))
    text = new_parts[0] + "".join(f"{section_marker(name)}\n{sections[name]}"
                                  for name in order)
  fs.write_bytes(path, f"{head}{BEGIN}\n{text}{END}{tail}".encode())


def _benchmark_config(name: str, data_dir: str):
  import ml_collections
  return ml_collections.ConfigDict(dict(name=name, data_dir=data_dir, predict_test=True))


if __name__ == "__main__":
  exit_with(main, PROG)
