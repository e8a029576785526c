"""The figures and the summary table of `t5x-like bench gpu` (gpu_suite.py).

  figures(step, bench_json) -> {tokens_per_second, mfu, ratio, ...}   (one step)
  compare_losses(fused_json, explicit_json) -> {passed, first_loss_difference, ...}
  summary_markdown(results) -> the table for docs/speed.md
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from typing import Any, Optional

# The fused kernel draws the explicit kernel's dropout mask: on the same data the first
# step's losses differ by rounding only. Over the later steps bf16 rounding of the
# attention outputs accumulates: 2^-7 relative, rounded up.
FIRST_LOSS_TOLERANCE = 1e-3
BF16_RELATIVE_TOLERANCE = 1e-2


def git_commit() -> Optional[str]:
  """The checkout's commit, or None (a copied tree has no .git)."""
  try:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, timeout=10)
  except (OSError, subprocess.TimeoutExpired):
    return None
  if out.returncode != 0:
    return None
  return out.stdout.strip() or None


def host_environment() -> dict[str, Any]:
  """What the driver sees without starting JAX's backend (a started GPU client would
  hold memory that the steps need): Python, XLA_FLAGS, the GPU as nvidia-smi names it.
  The steps' own environment (jax, jaxlib, backend, device kind) is added from their
  JSON by fill_environment."""
  gpu = None
  if shutil.which("nvidia-smi"):
    try:
      out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True,
                           timeout=20)
      gpu = out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
      gpu = None
  return {"python": platform.python_version(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "nvidia_smi": gpu, "jax": None, "jaxlib": None, "backend": None,
          "device_kind": None, "device_count": None, "torch": None}


def fill_environment(results: dict) -> None:
  """results['environment']'s jax, jaxlib, backend, device kind and torch from the first
  step JSON that records them (speed/environment.py)."""
  env = results["environment"]
  for step in results["steps"]:
    seen = (step.get("result") or {}).get("environment") or {}
    for key in ("jax", "jaxlib", "backend", "device_kind", "device_count", "torch"):
      if env.get(key) is None and seen.get(key) is not None:
        env[key] = seen[key]


def _kernels(bench: dict) -> list[str]:
  return sorted({g["kernel"] for g in (bench.get("attention_kernels") or {}).values()})


def _model_figures(result: dict) -> dict[str, Any]:
  train = result["train"]
  out = {"tokens_per_second": train["tokens_per_second"], "mfu": train["mfu"],
         "step_seconds": train["step_seconds_median"],
         "compile_seconds": train["compile_seconds"],
         "batch_shapes": result.get("batch_shapes"), "kernels": _kernels(result),
         "remat_policy": result.get("remat_policy"),
         "peak_memory_bytes": result.get("peak_memory_bytes"),
         "first_loss": train["losses"][0] if train.get("losses") else None,
         "roofline_seconds": None, "mfu_ceiling": None, "measured_over_bound": None,
         "costliest": None}
  bound = train.get("roofline")
  if bound:
    out.update(roofline_seconds=bound["seconds"], mfu_ceiling=bound.get("mfu_ceiling"),
               measured_over_bound=train.get("measured_over_bound"))
  table = result.get("profile")
  if table:
    rows = sorted(table["rows"], key=lambda r: -r["ms_per_step"])
    out["costliest"] = {"category": rows[0]["category"], "percent": rows[0]["percent"]}
    out["profile_rows"] = {r["category"]: r["percent"] for r in table["rows"]}
  return out


def _peer_figures(result: dict) -> dict[str, Any]:
  """Ours against the torch.compile'd peer (eager where only eager ran: the rehearsal)."""
  ours = result["ours"]
  mode = "compiled" if "torch_compiled" in result else "eager"
  torch = result[f"torch_{mode}"]
  return {"tokens_per_second": ours["tokens_per_second"], "mfu": ours.get("mfu"),
          "batch_shapes": result.get("batch_shapes"), "kernels": _kernels(result),
          "peak_memory_bytes": ours.get("peak_memory_bytes"), "torch_mode": mode,
          "torch": {k: torch.get(k) for k in ("tokens_per_second", "mfu",
                                              "peak_memory_bytes", "first_step_seconds")},
          "ratio": result["ratios"][f"ours_over_torch_{mode}"]}


def _attention_figures(result: dict) -> dict[str, Any]:
  """Per kernel: the largest error against float32 over the masks (outputs and
  gradients) and the range of its forward + backward time; the kernels skipped, why."""
  out = {}
  for impl, cases in (result.get("kernels") or {}).items():
    errors = [v for case in cases.values() for k, v in case.items() if k != "fwd_bwd_ms"]
    ms = [case["fwd_bwd_ms"] for case in cases.values() if "fwd_bwd_ms" in case]
    out[impl] = {"largest_error": max(errors, default=None),
                 "fwd_bwd_ms": [min(ms), max(ms)] if ms else None,
                 "dropout": (result.get("dropout") or {}).get(impl)}
  return {"attention": out, "skipped": result.get("skipped") or {}}


def figures(step, result: dict) -> dict[str, Any]:
  """The figures of one bench step's JSON (what summary_markdown shows)."""
  what = step.args[1] if len(step.args) > 1 else ""
  if what == "model":
    return _model_figures(result)
  if what == "peer":
    return _peer_figures(result)
  if what == "attention":
    return _attention_figures(result)
  return {}


def compare_losses(fused: dict, explicit: dict) -> dict[str, Any]:
  """Two `bench model` runs of one config (same data, same dropout key) with two
  attention kernels: the first losses within FIRST_LOSS_TOLERANCE, every loss within
  BF16_RELATIVE_TOLERANCE of the other's."""
  a, b = fused["train"]["losses"], explicit["train"]["losses"]
  n = min(len(a), len(b))
  first = abs(a[0] - b[0])
  worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a[:n], b[:n]))
  passed = first <= FIRST_LOSS_TOLERANCE and worst <= BF16_RELATIVE_TOLERANCE and n == len(a) == len(b)
  verdict = (f"first loss {a[0]:.5f} against {b[0]:.5f} (difference {first:.2e}, at most"
             f" {FIRST_LOSS_TOLERANCE:g}); largest relative difference over {n} steps"
             f" {worst:.2e} (at most {BF16_RELATIVE_TOLERANCE:g})")
  return {"passed": passed, "kernels": [_kernels(fused), _kernels(explicit)], "steps": n,
          "first_losses": [a[0], b[0]], "first_loss_difference": first,
          "largest_relative_difference": worst, "verdict": verdict}


def resume_figures(whole: dict[int, float], resumed: dict[int, float], *,
                   kill_at: int) -> dict[str, Any]:
  """{passed, verdict, ...}: a run killed after the save at step kill_at and resumed
  holds the uninterrupted run's loss at every step, bit for bit."""
  differ = sorted(s for s in whole if resumed.get(s) != whole[s])
  missing = sorted(set(resumed) ^ set(whole))
  passed = bool(whole) and not differ and not missing and max(whole) > kill_at
  verdict = (f"{len(whole)} steps, killed after the save at step {kill_at}: " +
             ("every loss equal bit for bit" if passed else
              f"{len(differ)} losses differ (first at step {differ[0]})" if differ else
              f"steps missing: {missing[:5]}" if missing else "no steps after the kill"))
  return {"passed": passed, "steps": len(whole), "kill_at": kill_at,
          "differing_steps": differ[:20], "verdict": verdict}


# ------------------------------------------------------------------ the summary
def _pct(x: Optional[float]) -> str:
  return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: Optional[float]) -> str:
  return "-" if x is None else f"{x:,.0f}"


def step_line(record: dict) -> str:
  """One line per finished step (stderr while the suite runs)."""
  f = record.get("figures") or {}
  extra = ""
  if "ratio" in f:
    extra = f" ours / torch {f['torch_mode']} {f['ratio']}"
  elif "mfu" in f:
    extra = f" {_num(f['tokens_per_second'])} tokens/s, MFU {_pct(f['mfu'])}"
  elif "verdict" in f:
    extra = " " + f["verdict"]
  reason = f" ({record['reason']})" if record.get("reason") else ""
  return f"bench gpu: {record['name']}: {record['status']}{reason}{extra}"


def _row(record: dict) -> str:
  f = record.get("figures") or {}
  note = record.get("reason", "") if record["status"] != "ok" else ""
  tokens = _num(f.get("tokens_per_second"))
  if "ratio" in f:
    tokens += f" (torch {f['torch_mode']} {_num(f['torch']['tokens_per_second'])})"
    note = "; ".join(filter(None, [f"ours / torch {f['torch_mode']} {f['ratio']:.3f}", note]))
  if record.get("fallback"):
    fb = record["fallback"]
    note = "; ".join(filter(None, [f"fallback {' '.join(fb['flags'])} after: {fb['because'][:80]}",
                                   note]))
  if "verdict" in f:
    note = "; ".join(filter(None, [f["verdict"], note if note != f["verdict"] else ""]))
  for impl, a in (f.get("attention") or {}).items():
    ms = a["fwd_bwd_ms"]
    note = "; ".join(filter(None, [note, f"{impl}: error {a['largest_error']:.3g}" +
                                   (f", {ms[0]:.2f}-{ms[1]:.2f} ms" if ms else "")]))
  bound = f.get("measured_over_bound")
  costliest = f.get("costliest")
  if costliest:
    note = "; ".join(filter(None, [f"costliest: {costliest['category']}"
                                   f" {costliest['percent']:.0f}%", note]))
  seconds = record.get("seconds")
  return (f"| {record['name']} | {record['title']} | {record['status']} |"
          f" {'-' if seconds is None else f'{seconds:.0f}'} | {tokens} | {_pct(f.get('mfu'))} |"
          f" {'-' if bound is None else f'{bound:.2f}'} | {note.replace('|', '/')} |")


def summary_markdown(results: dict) -> str:
  """The table of a suite run (results.json), with each recipe's profile table."""
  from t5x_like.speed.profile import format_table
  env = results["environment"]
  device = env.get("nvidia_smi") or env.get("device_kind") or "unknown device"
  lines = [f"### `t5x-like bench gpu`{' --rehearse' if results['mode'] == 'rehearsal' else ''},"
           f" {results['started'][:10]}, commit {results.get('commit') or 'unknown'}", "",
           f"Device: {device} ({env.get('backend')}, {env.get('device_count')} device(s));"
           f" jax {env.get('jax')}, jaxlib {env.get('jaxlib')}, torch {env.get('torch')},"
           f" Python {env.get('python')}; XLA_FLAGS"
           f" {'`' + env['xla_flags'] + '`' if env.get('xla_flags') else '(none)'}."
           f" Budget {results['budget_seconds']:.0f} s, used {results['elapsed_seconds']:.0f} s.",
           ""]
  if results["mode"] == "rehearsal":
    lines += ["A rehearsal on the CPU at smoke shapes: the figures check the commands,"
              " not a GPU's speed.", ""]
  lines += ["| step | what | status | s | tokens/s | MFU | measured / roofline | note |",
            "|---|---|---|---|---|---|---|---|"]
  lines += [_row(r) for r in results["steps"]]
  for record in results["steps"]:
    table = (record.get("result") or {}).get("profile")
    if table:
      lines += ["", f"Profile of `{record['name']}` ({record['title']}):", "", "```",
                format_table(table), "```"]
  traces = results.get("traces") or {}
  lines += ["", f"Traces: {traces.get('file') or traces.get('note')}."]
  return "\n".join(lines) + "\n"
