"""A roofline step time of a compiled program: the least time its ops can take on a chip.

  bound = roofline(compiled, chip_for(topology), model_flops=flops_per_step)
  bound = roofline(compiled, chip_of_device(jax.devices()[0]), model_flops=...)  # a GPU
  bound["seconds"], bound["compute_seconds"], bound["memory_seconds"],
  bound["collective_seconds"], bound["mfu_ceiling"]

Per device, from the optimized HLO's ops (hlo_cost.py: each top-level fusion, kernel or
custom call's FLOPs and the HBM bytes crossing its boundary, with loop trip counts).
Each op run costs

  max(flops / peak, bytes / hbm_bandwidth)

(Williams, Waterman & Patterson, "Roofline", CACM 2009). An op is compute-bound or
memory-bound by which term wins; `compute_seconds` sums the first kind, `memory_seconds`
the second.

Each collective moves its bytes over the interconnect at the chip's ICI bandwidth, with
the ring cost of n devices in its replica group:

  all-reduce                    2 (n - 1) / n x bytes / bw   (reduce-scatter + all-gather)
  all-gather                        (n - 1) / n x gathered bytes / bw
  reduce-scatter                    (n - 1) / n x operand bytes / bw
  all-to-all                        (n - 1) / n x bytes / bw
  collective-permute                            bytes / bw

(Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms", JPDC 2009; NCCL's
"bus bandwidth" convention). bw is the chip's whole ICI bandwidth in one direction, as if
a collective drove every link at once, so this too is a lower bound; collectives across
slices (data-center network) are costed at the same ICI bandwidth (optimistic).

`seconds` = compute + memory + collectives: nothing overlaps. `overlap_seconds` =
max(compute + memory, collectives): collectives hidden entirely behind the other work.
The MFU ceiling is model FLOPs / (seconds x devices x peak): the best MFU the program
could reach on this chip. `flops_ratio` is the HLO's FLOPs (all devices) over the model
FLOPs, `flops_mismatch` whether it is off 1 by more than 10%: a loop the walk counts once
(its trip count unread; roofline() lists it in `unknown_trip_loops`) reads low.

Kernels whose FLOPs the HLO cannot see (Pallas without a cost estimate) are listed in
`uncounted_kernels`; the caller may add their FLOPs (with_model_flops' extra_flops, e.g.
the analytic attention FLOPs). XLA's own cost_analysis()["bytes accessed"] is reported
beside (`xla_bytes_accessed`): it counts a while loop's body once, so compare it with
`bytes_once`, the sum here with every loop body once; it also counts XLA:TPU's VMEM
traffic, which is not HBM's.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

from t5x_like.plan.hlo_cost import Op, hlo_ops, hlo_ops_and_loops

_RING_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n,
                "all-gather": lambda n: (n - 1) / n,
                "reduce-scatter": lambda n: (n - 1) / n,
                "all-to-all": lambda n: (n - 1) / n,
                "collective-permute": lambda n: 1.0}


@dataclasses.dataclass(frozen=True)
class Chip:
  """What one JAX device can do: dense peak FLOP/s, HBM bytes/s, ICI bytes/s (one
  direction, all links together)."""

  name: str
  peak_flops: float
  hbm_bandwidth: float
  ici_bandwidth: float


def chip_for(topology) -> Optional[Chip]:
  """The Chip of a plan/topology.py Topology, None where its bandwidths are unknown
  (CPU; an unknown accelerator)."""
  if not (topology.hbm_bandwidth and topology.ici_bandwidth and topology.peak_flops):
    return None
  return Chip(topology.device_kind, topology.peak_flops, topology.hbm_bandwidth,
              topology.ici_bandwidth)


def chip_of_device(device, dtype: str = "bfloat16") -> Optional[Chip]:
  """The Chip of a present JAX device (e.g. jax.devices()[0] on a lent H100): its peak
  (train/flops.py) and its family's bandwidths (plan/topology.py); None for a CPU or an
  accelerator whose bandwidths are not in the table."""
  from t5x_like.plan.topology import family_of
  from t5x_like.train.flops import peak_flops_per_device
  family = family_of(device.device_kind) if device.platform != "cpu" else None
  if family is None or not family.hbm_bandwidth:
    return None
  return Chip(device.device_kind, peak_flops_per_device(device, dtype),
              family.hbm_bandwidth, family.ici_bandwidth)


def collective_seconds(op: Op, ici_bandwidth: float) -> float:
  """One run of a collective under the ring model (module docstring)."""
  n = max(op.group, 1)
  if n == 1 and op.collective != "collective-permute":
    return 0.0
  return _RING_FACTOR[op.collective](n) * op.bytes / ici_bandwidth


def op_seconds(op: Op, chip: Chip) -> float:
  """One op's roofline seconds per step, all its runs: max(flops / peak, bytes / HBM
  bandwidth) per run, or a collective's ring time."""
  if op.collective:
    return op.times * collective_seconds(op, chip.ici_bandwidth)
  return op.times * max(op.flops / chip.peak_flops, op.bytes / chip.hbm_bandwidth)


def bound_of_ops(ops: list[Op], chip: Chip, extra_flops: float = 0.0,
                 model_flops: Optional[float] = None,
                 num_devices: int = 1) -> dict[str, Any]:
  """The roofline of a list of ops (per device) on `chip`; extra_flops (per device) is
  compute-bound work the HLO cannot see, added at peak. With model_flops (all devices,
  one step): the MFU ceiling over num_devices."""
  compute = memory = comm = flops = hbm = comm_bytes = 0.0
  uncounted: dict[str, int] = {}
  slowest = []
  for op in ops:
    seconds = op_seconds(op, chip)
    if op.collective:
      comm += seconds
      comm_bytes += op.times * op.bytes
    else:
      if op.flops / chip.peak_flops >= op.bytes / chip.hbm_bandwidth:
        compute += seconds
      else:
        memory += seconds
      flops += op.times * op.flops
      hbm += op.times * op.bytes
      if not op.flops_known:
        uncounted[op.name] = uncounted.get(op.name, 0) + op.times
    slowest.append((seconds, op))
  compute += extra_flops / chip.peak_flops
  total = compute + memory + comm
  out = {
      "chip": dataclasses.asdict(chip),
      "seconds": total, "overlap_seconds": max(compute + memory, comm),
      "compute_seconds": compute, "memory_seconds": memory, "collective_seconds": comm,
      "flops": flops + extra_flops, "hlo_flops": flops, "extra_flops": extra_flops,
      "bytes": hbm, "collective_bytes": comm_bytes, "ops": len(ops),
      "uncounted_kernels": uncounted,
      "slowest": [{"name": op.name, "opcode": op.opcode, "times": op.times,
                   "seconds": s, "collective": op.collective}
                  for s, op in sorted(slowest, key=lambda p: -p[0])[:5]],
      "mfu_ceiling": None,
  }
  if model_flops is not None and total > 0:
    out["mfu_ceiling"] = model_flops / (total * num_devices * chip.peak_flops)
  return dict(out, **flops_check(out["flops"], model_flops, num_devices))


def flops_check(flops: float, model_flops: Optional[float],
                num_devices: int) -> dict[str, Any]:
  """{'flops_ratio': HLO FLOPs (per device, x num_devices) / model FLOPs,
  'flops_mismatch': whether it is off 1 by more than 10%} (None without model FLOPs): a
  program the walk is partly blind to (a loop counted once) reads low; rematerialized
  forwards read high (8/6 with full remat)."""
  if not model_flops:
    return {"flops_ratio": None, "flops_mismatch": None}
  ratio = flops * num_devices / model_flops
  return {"flops_ratio": ratio, "flops_mismatch": abs(ratio - 1) > 0.1}


def roofline(compiled, chip: Chip, model_flops: Optional[float] = None,
             extra_flops: float = 0.0, num_devices: Optional[int] = None) -> dict[str, Any]:
  """The roofline (bound_of_ops) of a compiled executable (jax's .lower().compile(),
  any backend) on `chip`, per device, with XLA's own bytes accessed beside it.

  model_flops: useful FLOPs of one step over all devices (train/flops.py), for the MFU
  ceiling; num_devices: devices the program runs on (default: the module's partitions).
  """
  text = compiled.as_text()
  ops, loops = hlo_ops_and_loops(text, num_devices)
  if num_devices is None:
    parts = re.search(r"num_partitions=(\d+)", text)
    num_devices = int(parts.group(1)) if parts else 1
  out = bound_of_ops(ops, chip, extra_flops, model_flops, num_devices)
  out["unknown_trip_loops"] = [loop["name"] for loop in loops if loop["trip_count"] is None]
  once = hlo_ops(text, num_devices, trips=False)
  out["bytes_once"] = sum(op.times * op.bytes for op in once if not op.collective)
  out["flops_once"] = sum(op.times * op.flops for op in once if not op.collective)
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  out["xla_bytes_accessed"] = float((cost or {}).get("bytes accessed", 0.0))
  out["xla_flops"] = float((cost or {}).get("flops", 0.0))
  return out


def with_model_flops(bound: dict[str, Any], model_flops: float, num_devices: int,
                     extra_flops: float = 0.0,
                     extra_source: Optional[str] = None) -> dict[str, Any]:
  """`bound` (roofline's) with extra_flops per device (work the HLO cannot see, e.g. a
  kernel's, at peak; extra_source says where they come from) added to its compute, and
  its MFU ceiling for model_flops (all devices, one step)."""
  peak = bound["chip"]["peak_flops"]
  out = dict(bound, extra_flops=bound["extra_flops"] + extra_flops,
             extra_flops_source=extra_source, flops=bound["flops"] + extra_flops)
  out["compute_seconds"] = bound["compute_seconds"] + extra_flops / peak
  out["seconds"] = out["compute_seconds"] + out["memory_seconds"] + out["collective_seconds"]
  out["overlap_seconds"] = max(out["compute_seconds"] + out["memory_seconds"],
                               out["collective_seconds"])
  out["mfu_ceiling"] = (model_flops / (out["seconds"] * num_devices * peak)
                        if out["seconds"] > 0 else None)
  return dict(out, **flops_check(out["flops"], model_flops, num_devices))



def with_hidden_attention_flops(bound: dict[str, Any], model, batch_shapes,
                                model_flops: float, num_devices: int) -> dict[str, Any]:
  """with_model_flops for a train step: the attention kernels the HLO cannot see
  (Pallas without a cost estimate, in `uncounted_kernels`) get the analytic count, 3x
  the forward's attention matmuls (train/flops.py), shared over the devices."""
  from t5x_like.train import flops as flops_lib
  hidden = sorted(k for k in bound["uncounted_kernels"] if "attention" in k or "flash" in k)
  extra = 0.0
  if hidden:
    attention = flops_lib.forward_flops_breakdown(model, batch_shapes).get("attention", 0.0)
    extra = 3.0 * attention / num_devices
  return with_model_flops(bound, model_flops, num_devices, extra,
                          f"analytic attention FLOPs for {', '.join(hidden)}" if hidden else None)
