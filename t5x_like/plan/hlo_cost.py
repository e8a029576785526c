"""What each op of an optimized HLO module costs one device: its FLOPs and the HBM bytes
it moves, or a collective's bytes and replica group; for plan/roofline.py.

  ops = hlo_ops(compiled.as_text())   # [Op(name, opcode, times, flops, bytes, ...)]

An op is one top-level instruction: of the entry computation or of a while body /
condition, a conditional's branch or an async wrapper, never one inside a fusion. Each
runs `times` per step (hlo.multiplicities: loop bodies times their trip count; a loop
whose count cannot be read runs once and is listed by hlo_ops_and_loops). Its flops are
its dots' and convolutions' (fused ones included; elementwise work is not counted; a
cuBLAS GEMM custom call's from its dot dimensions); its bytes what crosses its fusion
boundary (hlo_bytes.py: operands read, results written, slices and in-place updates at
their own size, VMEM free); TPU's async copies between HBM and VMEM count their HBM
side. An async wrapper of a collective (XLA:TPU's call-start of an all-reduce on the
SparseCore) is that collective, counted once at the wrapper.

Custom calls: a Mosaic / Triton / cuDNN kernel's FLOPs are invisible to the HLO; when
its backend config carries a cost estimate (pallas_call(cost_estimate=...)) its flops
and bytes are used, else its bytes are its operands and results and it is marked
flops_known=False. Compiler helper custom calls (AssumeGatherIndicesInBound, ...) cost
nothing. A collective's bytes are hlo.collective_bytes' (per device).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Optional

from t5x_like.plan import hlo
from t5x_like.plan.hlo_bytes import FusionBytes

# Ops that move no data of their own: tuples and views, control flow (their bodies are
# ops), the done / update halves of async pairs (costed at the start: XLA:TPU's
# copy-start / slice-start move between HBM and VMEM, and only the HBM side counts).
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while",
         "conditional", "call", "after-all", "partition-id", "replica-id", "opt-barrier",
         "add-dependency", "domain", "async-start", "async-update", "async-done",
         "call-start", "call-update", "call-done", "copy-done", "slice-done", "send",
         "send-done", "recv", "recv-done", "all-reduce-done", "all-gather-done",
         "collective-permute-done", "reduce-scatter-done", "all-to-all-done"}
# Edges to computations whose instructions are ops of their own (not fused ones).
_CONTROL_EDGES = ("body", "condition", "branch_computations", "true_computation",
                  "false_computation")
# Async wrappers of a computation (XLA:TPU's call-start runs an all-reduce on the
# SparseCore): a wrapped collective is costed at the wrapper, once.
_WRAPPERS = ("async-start", "call-start")

@dataclasses.dataclass
class Op:
  """One top-level op: per-run flops and HBM bytes, or a collective's bytes and group."""

  name: str
  opcode: str
  times: int
  flops: float = 0.0
  bytes: float = 0.0
  collective: Optional[str] = None  # its kind, for a collective
  group: int = 1  # devices in its replica group
  flops_known: bool = True


def _wrapped(module: hlo.Module, inst: hlo.Instruction) -> list[str]:
  """The computations an async wrapper (or a call) runs."""
  if inst.opcode not in _WRAPPERS + ("call",):
    return []
  return [c for c in inst.callees.get("calls", []) + inst.callees.get("to_apply", [])
          if c in module.computations]


def _kind(inst: hlo.Instruction) -> Optional[str]:
  return ("reduce-scatter" if hlo._is_reduce_scatter_fusion(inst)
          else hlo._collective_kind(inst.opcode))


def _wrapped_collectives(module: hlo.Module, inst: hlo.Instruction) -> list:
  """(computation, collective) pairs that an async wrapper runs."""
  if inst.opcode not in _WRAPPERS:
    return []
  return [(module.computations[c], i) for c in _wrapped(module, inst)
          for i in module.computations[c].instructions.values() if _kind(i)]


def _top_level(module: hlo.Module) -> list[str]:
  """Computations whose instructions are ops: the entry and what control flow and async
  wrappers reach from it (fusions, reductions' to_apply, a wrapped collective: not)."""
  seen, stack = {module.entry}, [module.entry]
  while stack:
    for inst in module.computations[stack.pop()].instructions.values():
      names = [c for kind in _CONTROL_EDGES for c in inst.callees.get(kind, [])]
      if not _wrapped_collectives(module, inst):
        names += _wrapped(module, inst)
      for name in names:
        if name in module.computations and name not in seen:
          seen.add(name)
          stack.append(name)
  return [name for name in module.computations if name in seen]


class _Reader(FusionBytes):
  """Costs of one module's ops (memoizes the fused computations' FLOPs)."""

  def __init__(self, module: hlo.Module, text: str, num_devices: int):
    super().__init__(module, text)
    self.num_devices = num_devices
    self._flops: dict[str, int] = {}

  def fused_flops(self, name: str) -> int:
    """Dot and convolution FLOPs of a fused computation, nested fusions included."""
    if name not in self._flops:
      comp = self.module.computations[name]
      total = 0
      for inst in comp.instructions.values():
        if inst.opcode == "dot":
          total += hlo.dot_flops(comp, inst)
        elif inst.opcode == "convolution":
          total += hlo.conv_flops(comp, inst)
        for callee in inst.callees.get("calls", []):
          if callee in self.module.computations:
            total += self.fused_flops(callee)
      self._flops[name] = total
    return self._flops[name]

  def group_size(self, inst: hlo.Instruction) -> int:
    """Devices in the first replica group of a collective (all of them when empty)."""
    attrs = inst.attrs
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if mesh:
      sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
      return math.prod(sizes.get(a, 1) for a in re.findall(r"'([^']+)'", mesh.group(2)))
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)
    if iota:
      return int(iota.group(1).split(",")[-1])
    listed = re.search(r"replica_groups=\{\{([^}]*)\}", attrs)
    if listed:
      return len([d for d in listed.group(1).split(",") if d.strip()])
    return self.num_devices

  def collective_op(self, comp, inst, kind: str, times: int,
                    wrapper: Optional[hlo.Instruction] = None) -> Op:
    """A collective's Op; wrapper: the async call that runs it, named for it."""
    group_of = inst
    if kind == "reduce-scatter" and inst.opcode == "fusion":  # XLA:TPU's fused form
      fused = self.module.computations.get(inst.callees["calls"][0])
      inner = [i for i in (fused.instructions.values() if fused else [])
               if i.opcode.startswith("all-reduce")]
      group_of = inner[0] if inner else inst
    named = wrapper or inst
    return Op(named.name, named.opcode, times, bytes=hlo.collective_bytes(comp, inst),
              collective=kind, group=self.group_size(group_of))

  def ops(self, comp: hlo.Computation, inst: hlo.Instruction, times: int) -> list[Op]:
    """The Ops of one top-level instruction: an async wrapper's are its collectives'."""
    wrapped = _wrapped_collectives(self.module, inst)
    if wrapped:
      return [self.collective_op(c, i, _kind(i), times, inst) for c, i in wrapped]
    op = self.op(comp, inst, times)
    return [] if op is None else [op]

  def op(self, comp: hlo.Computation, inst: hlo.Instruction, times: int) -> Optional[Op]:
    """The Op of one top-level instruction, None for one that costs nothing."""
    kind = _kind(inst)
    if kind:
      return self.collective_op(comp, inst, kind, times)
    if inst.opcode in ("copy-start", "slice-start"):  # HBM <-> VMEM: the HBM side counts
      return self.async_copy(comp, inst, times)
    if inst.opcode in _FREE:
      return None
    if inst.opcode == "fusion":
      flops = sum(self.fused_flops(c) for c in inst.callees.get("calls", [])
                  if c in self.module.computations)
      return Op(inst.name, "fusion", times, flops, self.fusion_bytes(comp, inst))
    if inst.opcode == "custom-call":
      return self.custom_call(comp, inst, times)
    if inst.opcode in ("dynamic-slice", "slice", "gather"):  # reads what it returns
      return Op(inst.name, inst.opcode, times, 0.0, 2 * self.hbm_bytes(inst))
    if inst.opcode == "dynamic-update-slice" and inst.operands[1] in comp.instructions:
      update = self.hbm_bytes(comp.instructions[inst.operands[1]])  # in place
      return Op(inst.name, inst.opcode, times, 0.0, 2 * update)
    flops = (hlo.dot_flops(comp, inst) if inst.opcode == "dot" else
             hlo.conv_flops(comp, inst) if inst.opcode == "convolution" else 0)
    return Op(inst.name, inst.opcode, times, flops,
              self.operand_bytes(comp, inst) + self.hbm_bytes(inst))

  def async_copy(self, comp, inst, times: int) -> Optional[Op]:
    """copy-start: (destination, source, context); slice-start: ((source), destination,
    context). The destination's bytes are read from the source's memory and written to
    its own; each side in HBM counts."""
    sizes = self._sizes(inst)
    if len(sizes) < 2 or not inst.operands or inst.operands[0] not in comp.instructions:
      return None
    dest_bytes, dest_in_hbm = sizes[0 if inst.opcode == "copy-start" else 1]
    source = self._sizes(comp.instructions[inst.operands[0]])
    moved = dest_bytes * (int(dest_in_hbm) + int(all(in_hbm for _, in_hbm in source)))
    return Op(inst.name, inst.opcode, times, 0.0, moved) if moved else None

  def custom_call(self, comp, inst, times: int) -> Optional[Op]:
    target = re.search(r'custom_call_target="([^"]*)"', inst.attrs)
    target = target.group(1) if target else ""
    if "cublas" in target:  # XLA:GPU's GEMMs: (result, workspace) = gemm(lhs, rhs[, bias])
      return Op(inst.name, "custom-call", times, self.gemm_flops(comp, inst),
                self.operand_bytes(comp, inst) + self.hbm_bytes(inst, slice(0, 1)))
    if not hlo.is_kernel_target(target):
      return None  # the compiler's helpers (index assumptions, buffer allocation)
    name = hlo.kernel_name(inst)
    estimate = _cost_estimate(inst.attrs)
    moved = self.operand_bytes(comp, inst) + self.hbm_bytes(inst)
    if estimate is not None:
      return Op(name, "custom-call", times, float(estimate.get("flops", 0)),
                float(estimate.get("bytes_accessed", moved)))
    return Op(name, "custom-call", times, 0.0, moved, flops_known=False)


  def gemm_flops(self, comp, inst) -> int:
    """2 x output elements x contracted size, the contraction from the GEMM's backend
    config (dot_dimension_numbers.lhs_contracting_dimensions)."""
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', inst.attrs)
    lhs = comp.instructions[inst.operands[0]].dims if inst.operands and \
        inst.operands[0] in comp.instructions else ()
    dims = [int(d) for d in re.findall(r"\d+", m.group(1))] if m else []
    if not lhs or not inst.leaves:
      return 0
    return 2 * math.prod(inst.leaves[0][1]) * math.prod(lhs[d] for d in dims)


def _cost_estimate(attrs: str) -> Optional[dict]:
  """A Mosaic kernel's "cost_estimate":{"flops":..,"bytes_accessed":..} from its
  backend config (jax's tpu_custom_call writes it when pallas_call has one)."""
  m = re.search(r'\\?"cost_estimate\\?":\s*(\{[^}]*\})', attrs)
  if not m:
    return None
  try:
    return json.loads(m.group(1).replace('\\"', '"'))
  except ValueError:
    return None


def hlo_ops(text: str, num_devices: Optional[int] = None,
            trips: bool = True) -> list[Op]:
  """Every costed top-level op of an HLO module's text with its runs per step.

  num_devices: the group of a collective with empty replica_groups (default: the
  module's num_partitions x replica_count). trips=False: each loop body once."""
  return hlo_ops_and_loops(text, num_devices, trips)[0]


def hlo_ops_and_loops(text: str, num_devices: Optional[int] = None,
                      trips: bool = True) -> tuple[list[Op], list[dict]]:
  """hlo_ops and the module's while loops (hlo.multiplicities': a trip_count of None is
  a loop whose count could not be read, its body counted once)."""
  module = hlo.parse_module(text)
  if num_devices is None:
    parts = re.search(r"num_partitions=(\d+)", text)
    replicas = re.search(r"replica_count=(\d+)", text)
    num_devices = int(parts.group(1) if parts else 1) * int(replicas.group(1) if replicas
                                                             else 1)
  reader = _Reader(module, text, num_devices)
  mult, loops = hlo.multiplicities(module, trips=trips)
  ops = []
  for name in _top_level(module):
    comp = module.computations[name]
    times = mult.get(name, 0)
    if not times:
      continue
    for inst in comp.instructions.values():
      ops.extend(reader.ops(comp, inst, times))
  return ops, loops
