"""The human-readable form of a plan (report.make_plan's dict)."""

from __future__ import annotations

from t5x_like.plan.hlo import is_kernel_target
from t5x_like.plan.remat import choice_lines

_STATE_LABELS = (("params", "params (float32)"), ("opt_state", "optimizer state"),
                 ("batch", "batch (int32)"))
_BACKWARD_LABELS = (("activations", "activations saved for backward"),
                    ("backward", "one layer's backward working set"),
                    ("logits", "logits / loss buffers"),
                    ("gathered", "FSDP-gathered weights"),
                    ("cast_weights", "layers' weights, compute dtype"))


def human_bytes(n: float) -> str:
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{int(n)} B"


def human_seconds(s: float) -> str:
  if s >= 2 * 86400:
    return f"{s / 86400:.2f} days"
  if s >= 2 * 3600:
    return f"{s / 3600:.2f} h"
  if s >= 120:
    return f"{s / 60:.1f} min"
  return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def _fits(value) -> str:
  return {True: "fits", False: "DOES NOT FIT", None: "device memory unknown"}[value]


def _header(plan: dict, source: str) -> list[str]:
  t, m = plan["topology"], plan["model"]
  mesh = " ".join(f"{k}={v}" for k, v in plan["mesh"].items())
  layers = (f"{m['layers']}+{m['decoder_layers']} layers" if m["decoder_layers"]
            else f"{m['layers']} layers")
  shards = plan["mesh"]["data"] * plan["mesh"]["fsdp"]
  memory = human_bytes(t["memory_bytes_per_device"]) if t["memory_bytes_per_device"] else "?"
  return [
      f"plan of {source} on {t['name']}: {t['num_devices']} x {t['device_kind']} devices,"
      f" {t['num_hosts']} host(s); {t['peak_flops_per_device'] / 1e12:.1f} TFLOP/s peak"
      f" and {memory} per device",
      f"model {m['preset']}: {m['family']}, {layers}, d_model {m['d_model']}, {m['heads']}"
      f" heads, d_ff {m['d_ff']}, vocab {m['vocab_size']}; compute {m['dtype']}, remat"
      f" {m['remat_policy']}, scan_layers {m['scan_layers']}; optimizer {plan['optimizer']}",
      f"mesh {mesh}; batch {plan['batch_size']} global ({plan['per_host_batch']} per host),"
      f" sharded {plan['batch_spec']} over {shards} shards, microbatches"
      f" {plan['microbatches']}",
      _data_line(plan.get("data", {})),
  ] + choice_lines(plan.get("remat_auto"))


def _data_line(data: dict) -> str:
  """'data SPEC' or 'data mixture of NAME (SPEC) RATE, ...; exhausted: restart'."""
  if "mixture" not in data:
    return f"data {data.get('source', '?')}"
  parts = [f"{name} ({m['spec']}) {m['rate']}" for name, m in data["mixture"].items()]
  return f"data mixture of {', '.join(parts)}; a source exhausted: {data['exhausted']}"


def _params(plan: dict) -> list[str]:
  p = plan["params"]
  same = "=" if p["total"] == p["model_num_params"] else "!="
  lines = ["", f"parameters: {p['total']:,} ({same} model.num_params() {p['model_num_params']:,});"
           f" {human_bytes(4 * p['total'])} float32, {human_bytes(p['bytes_per_device'])}"
           f" per device"]
  for name, group in p["groups"].items():
    if not group["params"]:
      continue
    lines.append(f"  {name:<11} {group['params']:>13,} params"
                 f"  {human_bytes(group['bytes_per_device']):>11} per device")
    for r in group["rows"]:
      times = f" x{r['count']}" if r["count"] > 1 else ""
      axes = "(" + ", ".join(str(a) for a in r["logical_axes"]) + ")"
      lines.append(f"      {r['name']}{times}  {tuple(r['shape'])}  {axes} -> {r['spec']}")
  return lines


def _memory(phase: dict, plan: dict) -> list[str]:
  est, xla = phase["memory"], phase["xla"]
  limit = plan["topology"]["memory_bytes_per_device"]
  row = lambda label, n, indent=4: f"{' ' * indent}{label:<{38 - indent}} {human_bytes(n):>11}"
  lines = [f"  memory per device (estimate, remat {est['remat_policy']}, per-device batch"
           f" {est['per_device_batch']}):"]
  lines += [row(label, est[f + "_bytes"]) for f, label in _STATE_LABELS]
  lines.append(row("gradients (float32)", est["grads_bytes"]))
  backward = sum(est[f + "_bytes"] for f, _ in _BACKWARD_LABELS)
  mark = lambda peak: "  <- peak" if est["peak"] == peak else ""
  lines.append(row("backward pass:", backward) + mark("backward"))
  lines += [row(label, est[f + "_bytes"], 6) for f, label in _BACKWARD_LABELS]
  lines.append(row("optimizer update temporaries", est["update_bytes"]) +
               mark("optimizer update"))
  of = f" of {human_bytes(limit)}" if limit else ""
  lines.append(row("total", est["total_bytes"]) + f"{of}: {_fits(phase['fits'])}")
  if xla:
    lines += _xla_memory(xla, est)
  if phase.get("xla_refused"):
    lines.append(_refused(phase["xla_refused"], est["per_device_batch"]))
  return lines


def _refused(refused: dict, rows: int) -> str:
  """The compiler's refusal of the step for HBM, in its own figures."""
  need, allowed = refused["required_bytes"], refused["available_bytes"]
  needs = (f"it needs {human_bytes(need)}"
           + (" for HLO temporaries" if refused["required_for"] == "HLO temporaries" else "")
           if need is not None else "it does not say how much it needs")
  of = f" of the {human_bytes(allowed)} of HBM it allows" if allowed else ""
  return (f"  XLA: DOES NOT FIT: the compiler refuses the train step at {rows} rows per"
          f" device ({needs}{of}; RESOURCE_EXHAUSTED)")


def _over(xla: dict) -> str:
  if xla["headroom_bytes"] is None:
    return "device memory unknown"
  if xla["headroom_bytes"] >= 0:
    return f"fits ({human_bytes(xla['headroom_bytes'])} free)"
  return f"OVER by {human_bytes(-xla['headroom_bytes'])}"


def _xla_memory(xla: dict, est: dict) -> list[str]:
  """The compiler's memory analysis of the train and eval steps beside the estimate."""
  ev = xla.get("eval")
  col = lambda key, n: f"  {human_bytes(n):>11}" if n is not None else f"  {'':>11}"
  rows = [("arguments (state + batch)", "argument_bytes", est["state_bytes"]),
          ("outputs", "output_bytes", None), ("aliased (donated state)", "alias_bytes", None),
          ("temporaries", "temp_bytes", est["temporaries_bytes"]),
          ("generated code", "generated_code_bytes", None),
          ("total (args + out + temp - aliased)", "total_bytes", est["total_bytes"])]
  lines = [f"  XLA memory analysis, per device:{'':<5} {'train step':>11}"
           + (f"  {'eval step':>11}" if ev else "") + f"  {'estimate':>11}"]
  for label, key, estimate in rows:
    lines.append(f"    {label:<34} {human_bytes(xla['memory'][key]):>11}"
                 + (col(key, ev["memory"][key]) if ev else "") + col(key, estimate))
  lines.append(f"    estimate / XLA train = {xla['memory_ratio']:.2f}; train step:"
               f" {_over(xla)}" + (f"; eval step: {_over(ev)}" if ev else ""))
  return lines


def _xla_flops(name: str, x: dict) -> str:
  loops = [loop["trip_count"] for loop in x.get("loops", [])]
  corrected = (f"; + the loops' other iterations' matmuls = {x['flops_corrected']:.4g}"
               f" = {x['flops_corrected_ratio']:.3f} x" if loops else "")
  return (f"    {name}: XLA {x['flops']:.4g} = {x['flops_ratio']:.3f} x the analytic"
          f" {x['analytic_flops']:.4g}{corrected}")


def _collectives(xla: dict) -> list[str]:
  steps = [("train", xla)] + ([("eval", xla["eval"])] if xla.get("eval") else [])
  kinds = sorted({k for _, x in steps for k in x["collectives"]})
  if not kinds:
    return ["  collectives per step: none"]
  lines = ["  collectives per step, per device (count, bytes; loop bodies x trip count):"]
  for kind in kinds:
    cells = []
    for name, x in steps:
      c = x["collectives"].get(kind)
      cells.append(f"{name} {c['count']:>4} {human_bytes(c['bytes']):>11}" if c
                   else f"{name} {0:>4} {'':>11}")
    lines.append(f"    {kind:<20}" + "   ".join(cells))
  return lines


def _kernels(xla: dict) -> list[str]:
  lines = []
  for name, x in [("train", xla)] + ([("eval", xla["eval"])] if xla.get("eval") else []):
    kernels = ", ".join(f"{k} x{n}" for k, n in sorted(x["kernels"].items())) or "none"
    others = ", ".join(f"{k} x{n}" for k, n in sorted(x["custom_calls"].items())
                       if not is_kernel_target(k))
    loops = ", ".join(str(loop["trip_count"]) for loop in x["loops"]) or "none"
    lines.append(f"  {name} step: fused kernels per step: {kernels}; while-loop trip"
                 f" counts: {loops}" + (f"; other custom calls: {others}" if others else ""))
  return lines


def _phase(phase: dict, plan: dict) -> list[str]:
  shapes = ", ".join(f"{k} {v}" for k, v in phase["batch_shapes"].items())
  lines = ["", f"phase {phase['index'] + 1}: steps {phase['first_step']:,} to"
           f" {phase['until_step']:,} ({phase['steps']:,} steps), length {phase['length']}",
           f"  batch: {shapes}",
           f"  FLOPs per step: {phase['flops_per_step']:.4g} ({phase['flops_per_device']:.4g}"
           f" per device; {phase['tokens_per_step']:,} tokens)"]
  x = phase["xla"]
  if x:
    lines.append("  compiled FLOPs per step (all devices; XLA also counts elementwise ops"
                 " and remat recompute, a while loop's body once; fused kernels' FLOPs are not seen):")
    lines.append(_xla_flops("train step", x))
    if x.get("eval"):
      lines.append(_xla_flops("eval step ", x["eval"]))
  at_mfu = phase.get("step_seconds_at_mfu", phase["step_seconds"])
  lines.append(f"  at {plan['mfu']:.0%} MFU: {human_seconds(at_mfu)} per step,"
               f" {human_seconds(at_mfu * phase['steps'])} for the phase"
               + above_ceiling(phase.get("assumed_mfu")))
  if phase.get("roofline"):
    lines += roofline_lines(phase["roofline"], phase["steps"])
    if x and x.get("compiler_estimate") is not None:
      lines += compiler_estimate_lines(x["compiler_estimate"], phase["steps"])
  lines += _memory(phase, plan)
  if x:
    lines += _collectives(x) + _kernels(x)
  if phase.get("fit_batch"):
    lines += _fit_batch(phase["fit_batch"], plan)
  return lines


def roofline_lines(r: dict, steps: int) -> list[str]:
  """The train step's roofline (plan/roofline.py): the bound, its split, the MFU ceiling."""
  chip = r["chip"]
  ceiling = f"; MFU ceiling {r['mfu_ceiling']:.1%}" if r.get("mfu_ceiling") else ""
  lines = [f"  roofline: step >= {human_seconds(r['seconds'])} = compute"
           f" {human_seconds(r['compute_seconds'])} + memory {human_seconds(r['memory_seconds'])}"
           f" + collectives {human_seconds(r['collective_seconds'])} (no overlap;"
           f" {human_seconds(r['overlap_seconds'])} if collectives overlap fully){ceiling};"
           f" {human_seconds(r['seconds'] * steps)} for the phase",
           f"    per device at {chip['peak_flops'] / 1e12:.1f} TFLOP/s, HBM"
           f" {chip['hbm_bandwidth'] / 1e9:.4g} GB/s, ICI {chip['ici_bandwidth'] / 1e9:.4g}"
           f" GB/s: {r['flops']:.4g} FLOPs, {human_bytes(r['bytes'])} HBM traffic,"
           f" {human_bytes(r['collective_bytes'])} collectives"]
  if r.get("extra_flops_source"):
    lines.append(f"    + {r['extra_flops']:.4g} FLOPs per device not in the HLO:"
                 f" {r['extra_flops_source']}")
  elif r.get("uncounted_kernels"):
    lines.append("    FLOPs not counted (kernels without a cost estimate): "
                 + ", ".join(f"{k} x{n}" for k, n in sorted(r["uncounted_kernels"].items())))
  return lines


def above_ceiling(assumed) -> str:
  """' -- ABOVE the roofline's MFU ceiling ...' where the assumed MFU (report's
  'assumed_mfu') is more than the compiled step can reach, with the time at the ceiling;
  '' otherwise."""
  if not assumed or not assumed["above_ceiling"]:
    return ""
  compiler = (f"; libtpu's estimate allows at most {assumed['compiler_mfu']:.1%}"
              if assumed.get("compiler_mfu") else "")
  return (f" -- ABOVE the roofline's MFU ceiling {assumed['ceiling']:.1%}{compiler}: at the"
          f" ceiling {human_seconds(assumed['step_seconds_at_ceiling'])} per step,"
          f" {human_seconds(assumed['seconds_at_ceiling'])} for the phase")


def fine_seconds(s: float) -> str:
  """Three significant figures in s, ms, us or ns (one op's time)."""
  for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
    if s >= size:
      return f"{s / size:.3g} {unit}"
  return f"{s / 1e-9:.3g} ns"


def _estimated_op(row: dict) -> str:
  where = f" ({row['op_name']})" if row.get("op_name") else ""
  bound = (fine_seconds(row["roofline_seconds"]) if row["roofline_seconds"] > 0
           else "nothing (no HBM traffic or FLOPs it can see)")
  apart = ""
  if row["disagree"]:
    apart = (f": {row['ratio']:.1f}x apart" if row["ratio"] and row["ratio"] >= 1 else
             f": {1 / row['ratio']:.1f}x apart" if row["ratio"] else "") + " <- DISAGREE"
  return (f"      {row['name']} x{row['times']}{where}: {fine_seconds(row['seconds'])},"
          f" roofline {bound}{apart}")


def compiler_estimate_lines(e: dict, steps: int) -> list[str]:
  """libtpu's estimated step time (plan/compiler_estimate.py) beside the roofline: the
  total, its parts (estimated ops, the roofline of the ops and collectives without an
  estimate), the MFU it allows, its slowest ops against the roofline's, and the ops
  where the two disagree by more than 2x."""
  kind = e["device_kind"]
  if not e["ops_with_estimate"]:
    return [f"  no compiler estimate in this program (libtpu gives none for {kind})"]
  if e["seconds"] is None:
    return [f"  compiler estimate: {e['cycles']:,} cycles over {e['ops_with_estimate']}"
            f" ops, but no calibrated clock for {kind} (compiler_estimate.calibrate on one"
            f" of its devices gives one)"]
  from t5x_like.plan.compiler_estimate import CALIBRATION_N
  mfu = f"; MFU <= {e['mfu']:.1%}" if e.get("mfu") else ""
  comm = ("libtpu estimates none" if not e["collectives_estimated"] else
          f"libtpu estimates {e['collectives_estimated']} of them")
  extra = (f" + {e['extra_flops']:.4g} FLOPs at peak ({e['extra_flops_source']})"
           if e.get("extra_flops") else "")
  lines = [f"  compiler estimate (libtpu {e.get('libtpu') or e['table_libtpu']}"
           f" estimated_cycles at {e['clock_hz'] / 1e9:.3f} GHz, the clock at which its"
           f" {CALIBRATION_N}^3 bf16 matmul runs at peak): step >="
           f" {human_seconds(e['combined_seconds'])} = estimated"
           f" {human_seconds(e['seconds'])} ({e['ops_with_estimate']} ops) + roofline"
           f" {human_seconds(e['uncovered_roofline_seconds'])} ({e['ops_without']} ops"
           f" without an estimate{extra}) + collectives"
           f" {human_seconds(e['collective_seconds'])} (roofline; {comm}){mfu};"
           f" {human_seconds(e['combined_seconds'] * steps)} for the phase"]
  if e["top"]:
    lines.append("    slowest estimated ops (estimate, and the roofline of the same op):")
    lines += [_estimated_op(row) for row in e["top"]]
  apart = [row["name"] for row in e["top"] if row["disagree"]]
  if apart:
    lines.append(f"    estimate and roofline disagree by more than 2x on: {', '.join(apart)}"
                 f" ({e['disagree']} of the {e['ops_with_estimate']} estimated ops in all)")
  return lines


def _fit_batch(fit: dict, plan: dict) -> list[str]:
  """plan/fit.py's search: the largest per-device batch whose train step fits."""
  limit = human_bytes(plan["topology"]["memory_bytes_per_device"])
  tried = ", ".join(f"{t['rows']} -> " + (
      "refused by the compiler" if t["total_bytes"] is None else
      human_bytes(t["total_bytes"]) + ("" if t["fits"] else
                                       " (refused: over)" if t.get("refused") else " (over)"))
      for t in fit["tried"])
  if fit["rows"]:
    bound = "" if fit["next_over"] is not None else "at least "  # nothing larger tried
    found = (f"{bound}{fit['rows']} rows per device (global {fit['global_batch']}), train"
             f" step {human_bytes(fit['total_bytes'])} of {limit}")
  else:
    found = f"none: even the smallest batch tried is over {limit}"
  line = fit["line"]
  fitted = (f"; fit {human_bytes(line['a'])} + {human_bytes(line['b'])} x rows predicted"
            f" {fit['predicted_rows']}" if line and fit["predicted_rows"] is not None else "")
  stopped = f"; stopped: {fit['stopped']}" if fit["stopped"] else ""
  lead = "largest batch that fits (by compiling the train step)"
  if fit.get("halved"):  # fit.search_below without refine: the configured batch halved
    lead = "batch that fits (halving the refused batch until the train step compiles" + (
        f"; --fit_batch searches on below {fit['next_over']})" if fit["rows"] else ")")
  return [f"  {lead}: {found}",
          f"    {fit['compiles']} compiles beyond the plan's, {human_seconds(fit['seconds'])}"
          f"{fitted}; tried {tried}{stopped}"]


def format_plan(plan: dict, source: str = "config") -> str:
  """The plan as text: header, parameters, each phase, the total and any notes."""
  lines = _header(plan, source) + _params(plan)
  for phase in plan["phases"]:
    lines += _phase(phase, plan)
  total = plan["total"]
  limit = plan["topology"]["memory_bytes_per_device"]
  of = f" of {human_bytes(limit)}" if limit else ""
  at_mfu = total.get("seconds_at_mfu", total["seconds"])
  time = (f"{human_seconds(total['seconds'])} by the roofline bound"
          f" ({human_seconds(at_mfu)} at {plan['mfu']:.0%} MFU)" if total.get("roofline")
          else f"{human_seconds(at_mfu)} at {plan['mfu']:.0%} MFU")
  above = total.get("mfu_above_ceiling")
  if above:
    time += (f"; the assumed {plan['mfu']:.0%} MFU is above the roofline's MFU ceiling in"
             f" phase{'s' if len(above) > 1 else ''} {', '.join(str(i + 1) for i in above)}")
  lines += ["", f"total: {total['steps']:,} steps, {total['flops']:.4g} FLOPs,"
            f" {time}; peak memory"
            f" {human_bytes(total['peak_memory_bytes'])} per device{of}:"
            f" {_fits(total['fits'])}"]
  lines += [f"note: {n}" for n in plan["notes"]]
  return "\n".join(lines)
