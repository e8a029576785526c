"""A real pretrained checkpoint fine-tuned on GLUE through our path, beside transformers
and beside random initialisation of the same architecture (docs/glue.md).

  python -m t5x_like.studies.hf_checkpoint_glue --checkpoint DIR --glue glue_data \\
      --workdir /tmp/hf_glue [--tasks stsb,mrpc,rte] [--seeds 0,1,2] \\
      [--arms ours,transformers,random] [--out docs/glue.md]

Run from the repository's root: its configs/ are the recipes (--configs DIR elsewhere).
DIR is a Hugging Face BERT checkpoint folder (config.json, model.safetensors, vocab.txt).
Per task and seed, three arms on one recipe (configs/glue.py:TASK with --lr, --epochs,
--batch_size, --max_length, 10% warmup, weight decay 0.01, clip 1.0, the checkpoint's
dropout):

  ours          `t5x-like finetune --config configs/glue.py:TASK --config.init.hf=DIR`
  transformers  BertForSequenceClassification in PyTorch on the same rows, batches, steps
                and schedule, from our classifier's initial weights
                (studies/transformers_arm.py)
  random        ours with --config.init.hf_random=true

Each run writes WORKDIR/runs/TASK/ARM/sSEED/ and one row of WORKDIR/results.jsonl (the
official dev metrics, seconds per step: the median over steps after the first five,
without the steps that compile a new batch length; for transformers the first-step loss
of both sides, dropout off, the same classifier). A rerun skips the rows it has.
WORKDIR/tables.md (and --out's sections between their markers) holds the tables:
metrics (official dev metrics per arm, the first-step losses) and speed (seconds per
step, ours / transformers, the load average). --tables picks them: a speed table from
a quiet machine's short runs (--num_steps) beside metrics from longer runs that shared
the machine.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from typing import Optional

import numpy as np
from absl import flags

from t5x_like import fs
from t5x_like.command_flags import FlagError, parse_flags_and_args
from t5x_like.studies.child_runs import configs_dir, configs_flag, exit_with, log, run_t5x_like
from t5x_like.studies.glue_tables import mean_range

PROG = "python -m t5x_like.studies.hf_checkpoint_glue"
TASKS = ("stsb", "mrpc", "rte", "cola")
ARMS = ("ours", "transformers", "random")
SKIP_FIRST = 5  # steps left out of seconds per step besides each new length's compile
TABLES = ("metrics", "speed")


def markers(table: str) -> tuple[str, str]:
  """The page markers around `table` (one of TABLES)."""
  return (f"<!-- hf_checkpoint_glue {table}: begin -->",
          f"<!-- hf_checkpoint_glue {table}: end -->")


# --------------------------------------------------------------------------- recipe
def recipe_overrides(a, task: str, arm: str, seed: int) -> dict:
  """{config key: value}: what every arm's configs/glue.py:TASK config gets."""
  out = {"init.hf": os.path.abspath(a.checkpoint), "benchmark.data_dir": os.path.abspath(a.glue),
         "benchmark.predict_test": False, "seed": seed, "train.batch_size": a.batch_size,
         "train.epochs": a.epochs, "train.num_steps": a.num_steps, "train.log_every": 1,
         "train.eval_every": 0, "train.checkpoint_every": 0,
         "task.max_length": a.max_length, "optimizer.learning_rate": a.lr,
         "optimizer.warmup_steps": 0, "optimizer.warmup_fraction": 0.1,
         "optimizer.weight_decay": 0.01, "optimizer.clip_norm": 1.0}
  if arm == "random":
    out["init.hf_random"] = True
  return out


def task_config(configs: str, task: str, overrides: dict):
  """configs/glue.py:TASK with the overrides applied (the config a child run reads)."""
  from t5x_like.benchmarks.configs import benchmark_config
  config = benchmark_config("glue", task, configs)
  for key, value in overrides.items():
    *path, leaf = key.split(".")
    node = config
    for part in path:
      node = node[part]
    node[leaf] = value
  return config


def flag_args(overrides: dict) -> list[str]:
  as_text = lambda v: str(v).lower() if isinstance(v, bool) else str(v)
  return [f"--config.{key}={as_text(value)}" for key, value in overrides.items()]


def median_step_seconds(seconds: list[float], lengths: list[int]) -> tuple[float, int]:
  """(median of seconds [T] over steps after SKIP_FIRST that do not start a new batch
  length, how many steps that is)."""
  seen, kept = set(lengths[:SKIP_FIRST]), []
  for k in range(SKIP_FIRST, min(len(seconds), len(lengths))):
    if lengths[k] in seen:
      kept.append(seconds[k])
    seen.add(lengths[k])
  return (float(np.median(kept)) if kept else float("nan")), len(kept)


def machine() -> dict:
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return {"cpu": cpu, "cores": os.cpu_count(), "load_average": round(os.getloadavg()[0], 2)}


# --------------------------------------------------------------------------- arms
def run_ours(a, configs: str, task: str, arm: str, seed: int, run_dir: str,
             lengths: list[int]) -> dict:
  """Our finetune in a child process; its official metrics and step times."""
  final_path = os.path.join(run_dir, "final_metrics.json")
  if not os.path.exists(final_path):
    run_t5x_like("finetune", f"--config={configs}/glue.py:{task}", f"--workdir={run_dir}",
                 *flag_args(recipe_overrides(a, task, arm, seed)),
                 log_file=run_dir + ".log")
  final = json.load(open(final_path))
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  steps = {r["step"]: r for r in rows if "seconds_per_step" in r}
  seconds = [steps[s]["seconds_per_step"] for s in sorted(steps)]
  median, counted = median_step_seconds(seconds, lengths)
  return {"official": final["official"], "step": final["step"], "seconds": final["seconds"],
          "seconds_per_step": median, "steps_timed": counted,
          "first_logged_loss": steps[min(steps)]["loss"]}


def run_transformers(prepared, a, seed: int, run_dir: str, lengths: list[int]) -> dict:
  from t5x_like.studies.transformers_arm import train_transformers
  out = train_transformers(prepared, os.path.abspath(a.checkpoint), seed, run_dir, log=log)
  median, counted = median_step_seconds(out["step_seconds"], lengths)
  return {"official": out["official"], "step": out["step"], "seconds": out["seconds"],
          "seconds_per_step": median, "steps_timed": counted,
          "first_logged_loss": out["losses"][0], "first_loss": out["first_loss"],
          "torch_threads": out["torch_threads"]}


def run_grid(a, seeds: list[int], configs: str, workdir: str) -> list[dict]:
  """Every (seed, task, arm) not yet in results.jsonl, seeds first; all rows."""
  from t5x_like.studies.transformers_arm import batch_lengths, prepare
  path = os.path.join(workdir, "results.jsonl")
  rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
  done = {(r["task"], r["arm"], r["seed"]) for r in rows}
  for seed in seeds:
    for task in a.tasks:
      todo = [arm for arm in a.arms if (task, arm, seed) not in done]
      if not todo:
        continue
      prepared = prepare(task_config(configs, task, recipe_overrides(a, task, "ours", seed)))
      lengths = batch_lengths(prepared, seed)
      recipe = {"lr": a.lr, "batch_size": prepared.batch_size, "steps": prepared.num_steps,
                "warmup": int(prepared.config.optimizer.warmup_steps),
                "epochs": prepared.num_steps * prepared.batch_size / prepared.num_rows,
                "max_length": a.max_length}
      for arm in todo:
        run_dir = os.path.join(workdir, "runs", task, arm, f"s{seed}")
        log(f"{task} {arm} seed {seed}: {recipe['steps']} steps of {recipe['batch_size']}"
            f" ({run_dir})")
        start = machine()
        result = (run_transformers(prepared, a, seed, run_dir, lengths)
                  if arm == "transformers" else
                  run_ours(a, configs, task, arm, seed, run_dir, lengths))
        row = dict(task=task, arm=arm, seed=seed, **recipe, **result, **start,
                   load_average_end=round(os.getloadavg()[0], 2),
                   date=time.strftime("%Y-%m-%d %H:%M"))
        log(f"{task} {arm} seed {seed}: {json.dumps(result['official'])},"
            f" {row['seconds_per_step']:.3f} s/step")
        rows.append(row)
        with open(path, "a") as f:
          f.write(json.dumps(row) + "\n")
  return rows


# --------------------------------------------------------------------------- table
def metrics_table(rows: list[dict]) -> str:
  """The metric table (mean (range) over seeds per arm; ours - transformers against the
  larger of 1.5 and the seeds' range) and the first-step losses."""
  tasks = _tasks(rows)
  out = ["| task | metric | ours | transformers | random | ours - transformers | bar |"
         " within |", "|---|---|---|---|---|---|---|---|"]
  for task in tasks:
    metrics = next(iter(r["official"] for r in rows if r["task"] == task))
    for metric in metrics:
      vals = {arm: [r["official"][metric] for r in _by(rows, task, arm)] for arm in ARMS}
      cells = [mean_range(vals[arm]) or "-" for arm in ARMS]
      if vals["ours"] and vals["transformers"]:
        diff = np.mean(vals["ours"]) - np.mean(vals["transformers"])
        bar = max([1.5] + [max(v) - min(v) for v in (vals["ours"], vals["transformers"])])
        tail = [f"{diff:+.1f}", f"{bar:.1f}", "yes" if abs(diff) <= bar else "**no**"]
      else:
        tail = ["-", "-", "-"]
      out.append(f"| {task} | {metric} | " + " | ".join(cells + tail) + " |")
  seeds = sorted({r["seed"] for r in rows})
  recipe = sorted({(r["task"], r["steps"], r["warmup"], r["batch_size"], r["max_length"],
                    r["lr"]) for r in rows}, key=lambda t: TASKS.index(t[0]))
  out += ["", f"Seeds: {', '.join(map(str, seeds))}. Steps (warmup), batch, tokens, peak"
          " rate: " + "; ".join(f"{t} {n} ({w}), {b}, {L}, {lr:g}"
                                for t, n, w, b, L, lr in recipe) + ".", "",
          "| task | seed | first-step loss, ours | transformers | difference |",
          "|---|---|---|---|---|"]
  for r in rows:
    if r["arm"] == "transformers":
      ours, theirs = r["first_loss"]["ours"], r["first_loss"]["transformers"]
      out.append(f"| {r['task']} | {r['seed']} | {ours:.6f} | {theirs:.6f} |"
                 f" {abs(ours - theirs):.1e} |")
  return "\n".join(out + ["", _machine_line(rows)]) + "\n"


def speed_table(rows: list[dict]) -> str:
  """Median seconds per training step per task and arm (medians over seeds), the ratio,
  and the machine's 1-minute load average at the runs' starts and ends."""
  out = ["| task | steps timed | ours s/step | transformers s/step | ours / transformers |"
         " random s/step |", "|---|---|---|---|---|---|"]
  for task in _tasks(rows):
    sps = {arm: [r["seconds_per_step"] for r in _by(rows, task, arm)] for arm in ARMS}
    med = {arm: float(np.median(v)) if v else float("nan") for arm, v in sps.items()}
    timed = min(r["steps_timed"] for r in rows if r["task"] == task)
    out.append(f"| {task} | {timed} | {_show(med['ours'])} | {_show(med['transformers'])} |"
               f" {_show(med['ours'] / med['transformers'], 2)} | {_show(med['random'])} |")
  loads = [r[k] for r in rows for k in ("load_average", "load_average_end") if k in r]
  load = f"{min(loads):.2f}-{max(loads):.2f}" if loads else "-"
  return "\n".join(out + ["", f"{_machine_line(rows)} Load average at the runs' starts"
                                f" and ends: {load}."]) + "\n"


def _show(x: float, digits: int = 3) -> str:
  return "-" if np.isnan(x) else f"{x:.{digits}f}"


def markdown(rows: list[dict], tables=TABLES) -> str:
  """The named tables, one after the other."""
  makers = {"metrics": metrics_table, "speed": speed_table}
  return "\n".join(makers[t](rows) for t in tables)


def _tasks(rows: list[dict]) -> list[str]:
  return [t for t in TASKS if any(r["task"] == t for r in rows)]


def _by(rows: list[dict], task: str, arm: str) -> list[dict]:
  return [r for r in rows if r["task"] == task and r["arm"] == arm]


def _machine_line(rows: list[dict]) -> str:
  cpus = sorted({f"{r['cpu']} ({r['cores']} cores)" for r in rows})
  threads = sorted({r["torch_threads"] for r in rows if "torch_threads" in r})
  return (f"CPU: {'; '.join(cpus)}; float32 on both sides"
          f"{'; torch threads ' + ', '.join(map(str, threads)) if threads else ''}.")


def write_between_markers(path: str, text: str, table: str) -> None:
  """text between `table`'s markers in the page at path (appended there if absent)."""
  begin, end = markers(table)
  old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
  head, sep, rest = old.partition(begin)
  tail = rest.partition(end)[2] if sep else "\n"
  fs.write_bytes(path, f"{head}{begin}\n{text}{end}{tail}".encode())


# --------------------------------------------------------------------------- main
def _flags(argv: list[str]) -> flags.FlagValues:
  del argv
  fv = flags.FlagValues()
  flags.DEFINE_string("checkpoint", None, "a Hugging Face BERT checkpoint folder",
                      flag_values=fv)
  flags.DEFINE_string("glue", None, "GLUE's files (STS-B/train.tsv ...)", flag_values=fv)
  flags.DEFINE_string("workdir", None, "where the runs and results.jsonl go", flag_values=fv)
  flags.DEFINE_list("tasks", ["stsb", "mrpc", "rte"], f"of {', '.join(TASKS)}",
                    flag_values=fv)
  flags.DEFINE_list("seeds", ["0", "1", "2"], "fine-tuning seeds", flag_values=fv)
  flags.DEFINE_list("arms", list(ARMS), "ours, transformers and / or random", flag_values=fv)
  flags.DEFINE_float("lr", 5e-5, "peak learning rate", flag_values=fv)
  flags.DEFINE_float("epochs", 3.0, "passes over train", flag_values=fv)
  flags.DEFINE_integer("num_steps", 0, "> 0: this many steps instead of --epochs",
                       flag_values=fv)
  flags.DEFINE_integer("batch_size", 32, "batch size", flag_values=fv)
  flags.DEFINE_integer("max_length", 128, "tokens per pair", flag_values=fv)
  flags.DEFINE_list("tables", list(TABLES), "the tables printed and written: metrics"
                    " (and first-step losses), speed (seconds per step)", flag_values=fv)
  flags.DEFINE_string("out", "", "also write the tables into this page, each between its"
                      " markers (docs/glue.md)", flag_values=fv)
  configs_flag(fv)
  return fv


def main(argv: Optional[list[str]] = None) -> int:
  a, _ = parse_flags_and_args("HF checkpoint study", sys.argv[1:] if argv is None else argv,
                              _flags, required=("checkpoint", "glue", "workdir"), doc=__doc__,
                              positionals="", prog=PROG)
  unknown = (set(a.tasks) - set(TASKS) or set(a.arms) - set(ARMS)
             or set(a.tables) - set(TABLES))
  if unknown:
    raise FlagError(f"--tasks, --arms or --tables: unknown {sorted(unknown)}")
  try:
    seeds = [int(s) for s in a.seeds]
  except ValueError as e:
    raise FlagError(f"--seeds: {e}") from None
  if not os.path.isfile(os.path.join(a.checkpoint, "config.json")):
    raise FlagError(f"--checkpoint {a.checkpoint}: no config.json there")
  workdir = os.path.abspath(a.workdir)
  os.makedirs(workdir, exist_ok=True)
  rows = run_grid(a, seeds, configs_dir(a.configs), workdir)
  text = markdown(rows, a.tables)
  with open(os.path.join(workdir, "tables.md"), "w") as f:
    f.write(text)
  if a.out:
    for table in a.tables:
      write_between_markers(a.out, markdown(rows, [table]), table)
  print(text)
  return 0


if __name__ == "__main__":
  exit_with(main, PROG)
