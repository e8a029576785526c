"""libtpu's own estimate of a compiled TPU program's step time, beside the roofline.

  est = estimate(compiled.as_text(), chip, num_devices)   # chip: roofline.Chip
  est = with_model_flops(est, model_flops, num_devices)    # + the MFU
  est["seconds"], est["combined_seconds"], est["mfu"], est["top"]

XLA:TPU's cost model writes `"estimated_cycles":"N"` into the backend config of the ops
it schedules (libtpu 0.0.42.1: inside "window_config", on top-level fusions of every
kind, copies, broadcasts and iotas, in v3 to v6e and TPU7x programs alike). What carries
none: Mosaic kernels (tpu_custom_call: Pallas attention), the gather / scatter custom
fusions (kind=kCustom), async copies (copy-start), collectives and XLA:TPU's scalar
leftovers (the RNG's unfused shifts and xors). Inside a fusion, and in the reduction
of TPU7x's SparseCore all-reduce, there are estimates too; they are part of their
caller's and are not read. libtpu writes INT64_MAX where it has no estimate (a copy on
TPU7x's SparseCore): taken for none; ops of the SparseCore's computations (call-start
with async_execution_thread="sparsecore") are not read either (not TensorCore cycles).

The estimate reads the same top-level ops as hlo_cost.hlo_ops (the entry, loop bodies,
branches, async wrappers; hlo.multiplicities' runs per step, loop bodies times their
trip count) and sums cycles x runs. Cycles become seconds at a clock per device kind,
calibrated from the cycles libtpu estimates for a bf16 [8192, 8192] x [8192, 8192]
matmul on one device against its FLOPs at the published dense peak (train/flops.py):

  clock_hz = peak_flops x cycles / flops

so in this unit the compiler's best matmul runs exactly at peak: the estimated time is
a lower bound (as the roofline's is; it knows the compiler's tiling, padding and
pipelining, which the roofline does not) and its MFU an upper bound. The cycles are
the compiler's, not measured ones; the calibration table (_MATMUL_CYCLES) holds
libtpu 0.0.42.1's and calibrate() recomputes an entry from a fresh compile.

Coverage: ops_with_estimate / ops_without count the program's top-level ops (each
instruction once); uncovered_roofline_seconds is the roofline (roofline.py's per-op
max(flops / peak, bytes / HBM bandwidth), with its trip counts) of the costed ops that
carry none, and collective_seconds the roofline's ring cost of the collectives (libtpu
estimates none). combined_seconds = seconds + uncovered_roofline_seconds +
collective_seconds (nothing overlaps; overlap_seconds: collectives hidden behind the
rest): the estimate where the compiler gives one, the roofline elsewhere. `top` lists
the slowest estimated ops with the roofline's seconds for the same op, flagged
`disagree` where the two differ by more than DISAGREE (2x) either way.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from t5x_like.plan import hlo
from t5x_like.plan import hlo_cost
from t5x_like.plan.roofline import Chip, op_seconds

LIBTPU_VERSION = "0.0.42.1"  # the libtpu that measured _MATMUL_CYCLES
CALIBRATION_N = 8192  # the calibration matmul: bf16 [N, N] x [N, N] on one device
DISAGREE = 2.0  # estimate / roofline of one op beyond this (or below 1 / this): flagged

# device_kind (as jax and plan/topology.py name it) -> (the libtpu topology the
# calibration matmul was compiled for, its estimated_cycles), libtpu 0.0.42.1. The
# clocks they give (peak x cycles / flops): v3 0.969 GHz, v4 1.131, v5e 1.712,
# v5p 1.942, v6e 2.486, TPU7x 2.732.
_MATMUL_CYCLES = {
    "TPU v3": ("v3:2x2", 17315966),  # one TensorCore a device
    "TPU v4": ("v4:2x2x1", 4523672),  # megacore
    "TPU v5 lite": ("v5e:2x2", 9557312),
    "TPU v5p": ("v5p:2x2x1", 4652072),  # megacore
    "TPU v5": ("v5p:2x2x1", 4652072),  # v5p devices report 'TPU v5'
    "TPU v6 lite": ("v6e:2x2", 2977840),
    "TPU7x": ("tpu7x:2x2x1", 2604600),  # one TensorCore a device
}
# Peaks per device where train/flops.py's table has none (Ironwood: 2307e12 per chip).
_PEAK_FALLBACK = {"TPU7x": 2307e12 / 2}

_CYCLES = re.compile(r'\\?"estimated_cycles\\?":\s*\\?"?(\d+)')
# libtpu writes INT64_MAX (9223372036854775807) where it has no estimate (seen on a
# SparseCore copy); anything this large is taken for none.
_NO_ESTIMATE = 1 << 62
_SPARSECORE = 'async_execution_thread="sparsecore"'


def estimated_cycles(inst: hlo.Instruction) -> Optional[int]:
  """The estimated_cycles of an instruction's backend config, None where it has none
  (or libtpu's INT64_MAX for none)."""
  m = _CYCLES.search(inst.attrs)
  return int(m.group(1)) if m and int(m.group(1)) < _NO_ESTIMATE else None


def _sparsecore_computations(module: hlo.Module) -> set[str]:
  """Computations an async wrapper runs on TPU7x's SparseCore (call-start with
  async_execution_thread="sparsecore"): not TensorCore work, so not on its clock."""
  return {c for comp in module.computations.values() for inst in comp.instructions.values()
          if _SPARSECORE in inst.attrs for names in inst.callees.values() for c in names}


def _key(device_kind: str) -> Optional[str]:
  for kind in _MATMUL_CYCLES:
    if kind.lower() == device_kind.strip().lower():
      return kind
  return None


def peak_flops(device_kind: str) -> Optional[float]:
  """Dense bf16 peak FLOP/s of one device (train/flops.py's table, else _PEAK_FALLBACK)."""
  from t5x_like.train.flops import table_peak_flops
  return table_peak_flops(device_kind) or _PEAK_FALLBACK.get(_key(device_kind) or "")


def clock_from(cycles: float, flops: float, peak: float) -> float:
  """Cycles per second at which a matmul of `flops` estimated at `cycles` runs at peak."""
  return peak * cycles / flops


def clock_hz(device_kind: str, peak: Optional[float] = None) -> Optional[float]:
  """The calibrated clock of a device kind (_MATMUL_CYCLES) for its peak (default:
  peak_flops(device_kind)), None where not in the table."""
  key, peak = _key(device_kind), peak or peak_flops(device_kind)
  if key is None or not peak:
    return None
  return clock_from(_MATMUL_CYCLES[key][1], 2.0 * CALIBRATION_N ** 3, peak)


def calibration_table() -> dict[str, dict[str, Any]]:
  """{device kind: {topology, cycles, clock_hz}} of the table, libtpu LIBTPU_VERSION."""
  return {kind: {"topology": topology, "cycles": cycles, "clock_hz": clock_hz(kind)}
          for kind, (topology, cycles) in _MATMUL_CYCLES.items()}


def installed_libtpu() -> Optional[str]:
  from importlib import metadata
  try:
    return metadata.version("libtpu")
  except metadata.PackageNotFoundError:
    return None


def calibrate(device, n: int = CALIBRATION_N) -> dict[str, Any]:
  """Recompute a calibration entry: compile a bf16 [n, n] x [n, n] matmul for one JAX
  TPU device (a present one, or libtpu's topology device: plan/tpu.py's slice_devices
  or jax.experimental.topologies) and read its estimated_cycles.

  {'device_kind', 'n', 'flops', 'cycles', 'peak_flops', 'clock_hz', 'libtpu'};
  ValueError where the compiled matmul carries no estimate."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  mesh = Mesh(np.array([device]), ("x",))
  a = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))
  module = hlo.parse_module(jax.jit(lambda x, y: x @ y).lower(a, a).compile().as_text())
  cycles = [c for comp in module.computations.values()
            for inst in comp.instructions.values()
            if inst.opcode == "fusion" and (c := estimated_cycles(inst)) is not None]
  if not cycles:
    raise ValueError(f"libtpu estimates no cycles for a matmul on {device.device_kind}")
  flops = 2.0 * n ** 3
  peak = peak_flops(device.device_kind)
  return {"device_kind": device.device_kind, "n": n, "flops": flops, "cycles": max(cycles),
          "peak_flops": peak, "libtpu": installed_libtpu(),
          "clock_hz": clock_from(max(cycles), flops, peak) if peak else None}


def _ratio(estimate: float, bound: float) -> Optional[float]:
  return estimate / bound if bound > 0 else None


def _disagree(ratio: Optional[float], estimate: float) -> bool:
  if ratio is None:
    return estimate > 0  # the roofline says it costs nothing
  return ratio > DISAGREE or ratio < 1 / DISAGREE


def _short_op_name(inst: hlo.Instruction) -> str:
  """The last parts of the op's jax op_name (metadata), e.g. 'decoder/while/body/dot_general'."""
  m = re.search(r'op_name="([^"]*)"', inst.attrs)
  return "/".join(m.group(1).split("/")[-3:]) if m else ""


def estimate(text: str, chip: Chip, num_devices: Optional[int] = None,
             device_kind: Optional[str] = None, top: int = 5) -> Optional[dict[str, Any]]:
  """libtpu's estimate of an optimized HLO module's (compiled.as_text()) step time on one
  device, beside the roofline of `chip` (module docstring). device_kind (default
  chip.name) picks the calibration, at chip.peak_flops; None for a program that is not
  a TPU one.

  {'device_kind', 'clock_hz', 'cycles', 'seconds', 'ops_with_estimate', 'ops_without',
   'uncovered_roofline_seconds', 'uncovered_kernels', 'collective_seconds',
   'collectives_estimated', 'combined_seconds', 'overlap_seconds', 'top', 'disagree',
   'mfu', 'libtpu', 'table_libtpu'}; seconds and what needs them are None where the
  clock is unknown, and with no op carrying an estimate cycles is 0 and seconds None.
  """
  device_kind = device_kind or chip.name
  if "tpu" not in device_kind.lower():
    return None
  module = hlo.parse_module(text)
  mult, _ = hlo.multiplicities(module)
  estimated: dict[str, tuple[hlo.Instruction, int, int]] = {}  # name: (inst, runs, cycles)
  sparsecore = _sparsecore_computations(module)
  for name in hlo_cost._top_level(module):
    times = mult.get(name, 0)
    if not times or name in sparsecore:
      continue
    for inst in module.computations[name].instructions.values():
      cycles = estimated_cycles(inst)
      if cycles is not None:
        estimated[inst.name] = (inst, times, cycles)

  ops = hlo_cost.hlo_ops(text, num_devices)
  bound_of: dict[str, float] = {}  # name: roofline seconds (a kernel's: all of that name)
  for op in ops:
    bound_of[op.name] = bound_of.get(op.name, 0.0) + op_seconds(op, chip)
  covered = set(estimated)
  for name, (inst, _, _) in estimated.items():  # hlo_ops names a custom call's op by
    if inst.opcode == "custom-call" and name not in bound_of:  # its kernel's name
      covered.add(hlo.kernel_name(inst))
      bound_of[name] = bound_of.get(hlo.kernel_name(inst), 0.0)
  uncovered = [op for op in ops if op.name not in covered and not op.collective]
  collectives = [op for op in ops if op.name not in covered and op.collective]
  clock = clock_hz(device_kind, chip.peak_flops)
  cycles = sum(times * c for _, times, c in estimated.values())
  seconds = cycles / clock if clock and estimated else None
  uncovered_s = sum(op_seconds(op, chip) for op in uncovered)
  comm_s = sum(op_seconds(op, chip) for op in collectives)

  rows = []
  for name, (inst, times, c) in estimated.items():
    est_s = times * c / clock if clock else None
    bound = bound_of.get(name, 0.0)
    ratio = _ratio(est_s, bound) if est_s is not None else None
    rows.append({"name": name, "opcode": inst.opcode, "op_name": _short_op_name(inst),
                 "times": times, "cycles": times * c, "seconds": est_s,
                 "roofline_seconds": bound, "ratio": ratio,
                 "disagree": est_s is not None and _disagree(ratio, est_s)})
  rows.sort(key=lambda r: -r["cycles"])
  combined = None if seconds is None else seconds + uncovered_s + comm_s
  return {
      "device_kind": device_kind, "clock_hz": clock, "libtpu": installed_libtpu(),
      "table_libtpu": LIBTPU_VERSION,
      "cycles": cycles, "seconds": seconds,
      "ops_with_estimate": len(estimated), "ops_without": len(uncovered),
      "uncovered_roofline_seconds": uncovered_s,
      "uncovered_kernels": sorted({op.name for op in uncovered if not op.flops_known}),
      "collective_seconds": comm_s,
      "collectives": len(collectives),
      "collectives_estimated": sum(1 for op in ops if op.collective and op.name in covered),
      "extra_flops": 0.0, "extra_flops_source": None,
      "combined_seconds": combined,
      "overlap_seconds": None if seconds is None else max(seconds + uncovered_s, comm_s),
      "top": rows[:top],
      "disagree": sum(1 for r in rows if r["disagree"]),
      "mfu": None,
      "peak_flops": chip.peak_flops,
  }


def with_model_flops(est: Optional[dict[str, Any]], model_flops: float, num_devices: int,
                     extra_flops: float = 0.0,
                     extra_source: Optional[str] = None) -> Optional[dict[str, Any]]:
  """`est` with its MFU for model_flops (all devices, one step) over num_devices at the
  chip's peak; extra_flops per device (work neither the compiler nor the HLO shows, e.g.
  the analytic attention FLOPs of Pallas kernels, as roofline.with_model_flops takes
  them) are added at peak to the uncovered part. An upper bound on the MFU (module
  docstring)."""
  if est is None:
    return None
  peak = est["peak_flops"]
  out = dict(est, extra_flops=est["extra_flops"] + extra_flops,
             extra_flops_source=extra_source or est["extra_flops_source"])
  if est["seconds"] is None:
    return out
  out["uncovered_roofline_seconds"] = est["uncovered_roofline_seconds"] + extra_flops / peak
  out["combined_seconds"] = (out["seconds"] + out["uncovered_roofline_seconds"]
                             + out["collective_seconds"])
  out["overlap_seconds"] = max(out["seconds"] + out["uncovered_roofline_seconds"],
                               out["collective_seconds"])
  out["mfu"] = (model_flops / (out["combined_seconds"] * num_devices * peak)
                if out["combined_seconds"] > 0 else None)
  return out
