"""The table "The recipes on TPU, compiled here" (docs/tpu.md): every shipped
pretraining recipe at its documented slice and one current slice, compiled for it on
this host by libtpu.

  python -m t5x_like.plan.recipes [--only NAME ...] [--json OUT.jsonl] [--resume-from F
                                  [--continue-fits]]

Each row is one phase of one recipe on one slice: make_plan (report.py) compiles its
train step (not the eval step), reads its roofline step time and MFU ceiling
(roofline.py) and, with the row's time left, searches the largest per-device batch that
fits (fit.py). The markdown table goes to stdout (and --markdown
FILE after every row); --json appends one JSON line per row as it finishes, so a
stopped run keeps its rows, and --resume-from skips the rows a file already holds; with
--continue-fits it reruns those whose batch search stopped on its time budget, the search
going on from the sizes it compiled.
Minutes per row on a small host: this is a command to run once per release, not a test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
import traceback
import types
from typing import Optional

import ml_collections
from absl import flags

from t5x_like.plan.text import human_bytes

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Recipe:
  """One row: `phase` of `config` (its train.phases index; None: the only phase) on
  `slice` (documented: the slice the recipe's docstring names, else a current one)."""

  name: str
  config: str
  phase: Optional[int]
  slice: str
  documented: bool


def _both(name, config, lengths, documented, current):
  return [Recipe(f"{name}/{length}@{s}", config, i, s, s == documented)
          for i, length in enumerate(lengths) for s in (documented, current)]


# The run order: BERT-base first (the quickest to read a number from), then one row pair
# per family before BERT-large, whose 128-device compiles are the slowest.
RECIPES = (
    _both("bert-base", "configs/bert_pretrain.py:base", (128, 512), "v3-32", "v5e-16")
    + [Recipe("t5-base/512@v3-32", "configs/t5_pretrain.py:base", None, "v3-32", True),
       Recipe("t5-base/512@v5e-16", "configs/t5_pretrain.py:base", None, "v5e-16", False),
       Recipe("gpt2-124m/1024@v4-64", "configs/gpt2_pretrain.py:124m", None, "v4-64", True),
       Recipe("gpt2-124m/1024@v5e-32", "configs/gpt2_pretrain.py:124m", None, "v5e-32",
              False)]
    + _both("bert-large", "configs/bert_pretrain.py:large", (128, 512), "v3-128", "v5e-64"))

COLUMNS = ("recipe", "phase / length", "slice", "per-device batch",
           "compiler memory / HBM per device", "estimate / compiler", "collectives per step",
           "attention kernel", "roofline bound (ms/step): compute + memory + collectives",
           "MFU ceiling", "largest per-device batch that fits")


def phase_config(config: ml_collections.ConfigDict,
                 phase: Optional[int]) -> ml_collections.ConfigDict:
  """`config` narrowed to one of its train.phases (length and options applied), as a
  config of one phase, so make_plan compiles that phase only."""
  if phase is None:
    return config
  from t5x_like.experiment import phase_configs
  c = phase_configs(config)[phase][1]
  c.train.phases = ()
  return c


def attention_kernel(kernels: dict) -> str:
  """The Pallas attention kernels' names in a program's fused kernels, else 'XLA
  (explicit)': attention written out as XLA ops (einsum, softmax)."""
  names = sorted(k for k in kernels if "attention" in k or "flash" in k)
  return ", ".join(names) if names else "XLA (explicit)"


def row_json(recipe: Recipe, plan: dict, seconds: float) -> dict:
  """The table's row of one make_plan(..., fit_batch=...) of one phase."""
  phase, = plan["phases"]
  x = phase["xla"]
  shards = plan["mesh"]["data"] * plan["mesh"]["fsdp"]
  fit = phase.get("fit_batch")
  return {
      "name": recipe.name, "config": recipe.config, "phase": recipe.phase,
      "length": phase["length"], "slice": recipe.slice, "documented": recipe.documented,
      "mesh": plan["mesh"], "global_batch": plan["batch_size"],
      "per_device_batch": plan["batch_size"] // shards,
      "memory_bytes": plan["topology"]["memory_bytes_per_device"],
      "xla_total_bytes": x["memory"]["total_bytes"], "fits": x["fits"],
      "estimate_bytes": phase["memory"]["total_bytes"], "estimate_ratio": x["memory_ratio"],
      "collectives": {k: {"count": c["count"], "bytes": c["bytes"]}
                      for k, c in sorted(x["collectives"].items())},
      "kernels": x["kernels"], "attention_kernel": attention_kernel(x["kernels"]),
      "roofline": roofline_json(phase.get("roofline")),
      "fit_batch": fit and {k: fit[k] for k in ("rows", "total_bytes", "compiles",
                                                "predicted_rows", "next_over", "tried",
                                                "limit_bytes", "seconds", "stopped")},
      "seconds": {"plan_compile": x["compile_seconds"],
                  "fit": fit["seconds"] if fit else 0.0, "row": seconds},
      "error": None,
  }


def roofline_json(r: Optional[dict]) -> Optional[dict]:
  """The row's part of a phase's roofline (plan/roofline.py): seconds and the ceiling."""
  if not r:
    return None
  keys = ("seconds", "compute_seconds", "memory_seconds", "collective_seconds",
          "overlap_seconds", "mfu_ceiling", "flops", "bytes", "collective_bytes",
          "extra_flops", "extra_flops_source", "uncounted_kernels", "chip")
  return {k: r.get(k) for k in keys}


def _roofline_cells(row: dict) -> list[str]:
  r = row.get("roofline")
  if not r:
    return ["not computed", ""]
  ms = lambda key: f"{r[key] * 1e3:.1f}"
  bound = (f"{ms('seconds')} = {ms('compute_seconds')} + {ms('memory_seconds')} +"
           f" {ms('collective_seconds')}")
  if r.get("extra_flops_source"):
    bound += " (attention kernels' FLOPs: analytic)"
  ceiling = f"{r['mfu_ceiling']:.0%}" if r.get("mfu_ceiling") else "?"
  return [bound, ceiling]


def _collectives(collectives: dict) -> str:
  if not collectives:
    return "none"
  return "; ".join(f"{kind} x{c['count']} ({human_bytes(c['bytes'])})"
                   for kind, c in sorted(collectives.items()))


def _fit_cell(row: dict) -> str:
  fit = row["fit_batch"]
  if not fit or row.get("fit_skipped"):
    return row.get("fit_skipped") or "not searched"
  if not fit["rows"]:
    found = "none fits"
  elif fit.get("next_over") is None:  # no larger batch was compiled: a lower bound
    found = f"at least {fit['rows']} ({human_bytes(fit['total_bytes'])} there)"
  else:
    found = f"{fit['rows']} ({human_bytes(fit['total_bytes'])})"
  extra = f"; stopped: {fit['stopped']}" if fit["stopped"] else ""
  return f"{found}; {fit['compiles']} more compiles{extra}"


def format_row(row: dict) -> list[str]:
  """The markdown cells of one row (COLUMNS order)."""
  recipe, _, _ = row["name"].partition("/")
  phase = "-" if row["phase"] is None else str(row["phase"] + 1)
  slice_ = row["slice"] + (" (documented)" if row["documented"] else "")
  if row.get("error"):
    first = row["error"].strip().splitlines()[0]  # the rest: in the JSON line
    return [recipe, f"{phase} / {row.get('length', '?')}", slice_,
            f"error: {first}"] + [""] * (len(COLUMNS) - 4)
  fits = "fits" if row["fits"] else "**does not fit**"
  memory = (f"{row['xla_total_bytes'] / GiB:.2f} / {row['memory_bytes'] / GiB:.0f} GiB,"
            f" {fits}")
  batch = f"{row['per_device_batch']} (global {row['global_batch']})"
  refused = row.get("refused")
  if refused:  # the compiler refused the configured batch; the numbers are at half
    shards = row["global_batch"] // row["per_device_batch"]
    need = (f" (needs >= {refused['required_bytes'] / GiB:.2f} GiB)"
            if refused.get("required_bytes") else "")
    memory = (f"**does not fit** at {refused['global_batch'] // shards} rows: the compiler"
              f" refuses it{need}; at {row['per_device_batch']} rows"
              f" {row['xla_total_bytes'] / GiB:.2f} / {row['memory_bytes'] / GiB:.0f} GiB")
    batch = f"{refused['global_batch'] // shards} (global {refused['global_batch']})"
  return [recipe, f"{phase} / {row['length']}", slice_, batch, memory,
          f"{row['estimate_ratio']:.2f}", _collectives(row["collectives"]),
          row["attention_kernel"] + (f"; {row['note']}" if row.get("note") else ""),
          *_roofline_cells(row), _fit_cell(row)]


def format_table(rows: list[dict]) -> str:
  """A markdown table of rows (row_json's dicts), in the order given."""
  lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  cell = lambda c: " ".join(c.split()).replace("|", "/")  # one line per row
  lines += ["| " + " | ".join(cell(c) for c in format_row(r)) + " |" for r in rows]
  return "\n".join(lines)


def run_recipe(recipe: Recipe, fit: bool = True, fit_budget_s: float = 20 * 60,
               fit_resume: Optional[dict] = None) -> dict:
  """Compile one row (and search its batch within fit_budget_s of the row's start, going
  on from fit_resume, an earlier row's stopped search, when given).

  Two refusals are findings, kept in the row while its numbers come from a step that
  compiles: Mosaic refusing the Pallas kernel on the chip ('note'; then attention runs
  as XLA ops) and the compiler refusing the configured batch for HBM ('refused'; then
  the row is compiled at half the batch, and the search starts there).
  """
  from t5x_like.plan.fit import over_memory
  from t5x_like.plan.report import make_plan
  from t5x_like.plan.topology import parse_topology
  from t5x_like.command_flags import load_config_file
  start = time.monotonic()
  config = phase_config(load_config_file(recipe.config), recipe.phase)
  topology = parse_topology(recipe.slice, config.model.dtype)
  note, refused = None, None
  while True:
    try:
      plan = make_plan(config, topology, compile_step="yes", eval_step=False,
                       fit_batch=fit, fit_budget_s=fit_budget_s, fit_resume=fit_resume,
                       search_refused=False)  # a refusal: compiled again below
      break
    except Exception as e:  # a row's failure is a finding: keep the others going
      traceback.print_exc()
      error = f"{type(e).__name__}: {e}"
      code = re.search(r"E\d+: \w+", error)
      over = over_memory(e)
      if "Mosaic failed" in error and config.model.attention_impl == "auto":
        note = (f"the Pallas kernel does not compile for {recipe.slice}"
                f" ({code.group(0) if code else error.splitlines()[0]}); compiled with"
                f" model.attention_impl='explicit'")
        config.model.attention_impl = "explicit"
      elif over is not None and refused is None and config.train.batch_size > 1:
        refused = {"global_batch": int(config.train.batch_size), "message": str(over),
                   "required_bytes": over.required_bytes,
                   "available_bytes": over.available_bytes}
        config.train.batch_size = int(config.train.batch_size) // 2
      else:
        return {"name": recipe.name, "config": recipe.config, "phase": recipe.phase,
                "length": int(config.data.length), "slice": recipe.slice,
                "documented": recipe.documented, "error": error, "note": note,
                "refused": refused, "seconds": {"row": time.monotonic() - start}}
  row = row_json(recipe, plan, time.monotonic() - start)
  row["note"], row["refused"] = note, refused
  if refused:  # the configured batch does not fit: the row's numbers are at half of it
    row["fits"] = False
  if not fit:
    row["fit_skipped"] = "skipped (--no-fit)"
  elif row["fit_batch"]["stopped"] and not row["fit_batch"]["compiles"]:
    row["fit_skipped"] = f"skipped: the row's compile took over {fit_budget_s / 60:.0f} min"
  return row


def stopped_search(row: Optional[dict]) -> Optional[dict]:
  """A row's batch search when it stopped on the time budget (to go on from), else None."""
  fit = (row or {}).get("fit_batch")
  return fit if fit and fit.get("stopped") and not row.get("error") else None


def _read_rows(path: str) -> dict[str, dict]:
  rows = {}
  if path and os.path.exists(path):
    with open(path) as f:
      for line in f:
        if line.strip():
          row = json.loads(line)
          rows[row["name"]] = row
  return rows


_PROG = "python -m t5x_like.plan.recipes"


def _flags() -> flags.FlagValues:
  fv = flags.FlagValues()
  flags.DEFINE_multi_string("only", [], "rows whose name starts with NAME (e.g. bert-base,"
                            " bert-base/512@v5e-16; repeatable, or --only NAME NAME ...);"
                            " known: " + ", ".join(r.name for r in RECIPES), flag_values=fv)
  flags.DEFINE_string("json", None, "OUT.jsonl: append one JSON line per row", flag_values=fv)
  flags.DEFINE_string("resume-from", None, "IN.jsonl: skip the rows this file holds (errors"
                      " too: a compiler's refusal is a finding); they stay in the table",
                      flag_values=fv)
  flags.DEFINE_string("markdown", None, "OUT.md: also write the table here, rewritten after"
                      " every row", flag_values=fv)
  flags.DEFINE_bool("continue-fits", False, "with --resume-from: rerun its rows whose batch"
                    " search stopped on the time budget, going on from the sizes they"
                    " compiled", flag_values=fv)
  flags.DEFINE_bool("no-fit", False, "skip the batch search", flag_values=fv)
  flags.DEFINE_float("fit-budget-s", 20 * 60, "no search compile starts this long after the"
                     " row began", flag_values=fv)
  return fv


def _parse(argv: list[str]) -> Optional[types.SimpleNamespace]:
  """The flags (absl; `--only A B` as before: names after --only extend it), or None after
  printing the help."""
  fv = _flags()
  if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in argv):
    print(f"usage: {_PROG} [flags]\n\n{__doc__.strip()}\n\nflags:")
    for name in sorted(fv):
      default = "" if fv[name].default is None else f" (default: {fv[name].default_as_str})"
      print(f"  --{name}: {fv[name].help}{default}")
    return None
  try:
    extra = fv([_PROG, *argv])[1:]
  except flags.Error as e:
    raise ValueError(str(e)) from None
  if extra and not fv.only:
    raise ValueError(f"unexpected arguments {' '.join(extra)!r}")
  return types.SimpleNamespace(
      only=[*fv.only, *extra], json=fv.json, resume_from=fv["resume-from"].value,
      markdown=fv.markdown, continue_fits=fv["continue-fits"].value,
      no_fit=fv["no-fit"].value, fit_budget_s=fv["fit-budget-s"].value)


def main(argv: Optional[list[str]] = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    args = _parse(argv)
    if args is None:
      return 0
    recipes = [r for r in RECIPES if not args.only or any(r.name.startswith(p)
                                                          for p in args.only)]
    if not recipes:
      raise ValueError(f"--only {' '.join(args.only)}: no such rows")
    if args.continue_fits and not args.resume_from:
      raise ValueError("--continue-fits goes on from the rows of --resume-from FILE")
  except ValueError as e:
    print(f"{_PROG}: error: {e}", file=sys.stderr)
    return 2
  done = _read_rows(args.resume_from)

  from t5x_like.plan.tpu import quiet_backend_init
  quiet_backend_init()
  rows = []
  for recipe in recipes:
    prior = done.get(recipe.name)
    resume = stopped_search(prior) if args.continue_fits else None
    if prior is not None and resume is None:
      rows.append(prior)
      continue
    print(f"[recipes] {recipe.name} ...", file=sys.stderr, flush=True)
    row = run_recipe(recipe, fit=not args.no_fit, fit_budget_s=args.fit_budget_s,
                     fit_resume=resume)
    print(f"[recipes] {recipe.name}: {row['seconds']['row']:.0f} s", file=sys.stderr,
          flush=True)
    rows.append(row)
    if args.json:
      with open(args.json, "a") as f:
        f.write(json.dumps(row) + "\n")
    if args.markdown:
      with open(args.markdown, "w") as f:
        f.write(format_table(rows) + "\n")
  print(format_table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
