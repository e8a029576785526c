"""What each op of an optimized HLO module costs one device: its FLOPs and the HBM bytes
it moves, or a collective's bytes and replica group; for plan/roofline.py.

  ops = hlo_ops(compiled.as_text())   # [Op(name, opcode, times, flops, bytes, ...)]

An op is one top-level instruction: of the entry computation or of a while body /
condition, a conditional's branch or an async wrapper, never one inside a fusion. Each
runs `times` per step (hlo.multiplicities: loop bodies times their trip count). Its
flops are its dots' and convolutions' (fused ones included; elementwise work is not
counted; a cuBLAS GEMM custom call's from its dot dimensions); its bytes what crosses its
fusion boundary: every operand read and every result written, except that an operand
only sliced inside the fusion (a scanned layer's weights out of the stacked [L, ...]
array) counts the slices' bytes, an in-place dynamic-update-slice (a scan writing one
layer's row of a stacked output) counts the update's bytes, not the buffer's, and what
lives outside HBM (XLA:TPU's VMEM, a layout's S(1)) counts nothing; TPU's async copies
between HBM and VMEM count their HBM side.

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

# Ops that move no data of their own: tuples and views, control flow (their bodies are
# ops), the done / update halves of async pairs (costed at the start: XLA:TPU's
# copy-start / slice-start move between HBM and VMEM, and only the HBM side counts).
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while",
         "conditional", "call", "after-all", "partition-id", "replica-id", "opt-barrier",
         "add-dependency", "domain", "async-start", "async-update", "async-done",
         "copy-done", "slice-done", "send", "send-done",
         "recv", "recv-done", "all-reduce-done", "all-gather-done",
         "collective-permute-done", "reduce-scatter-done", "all-to-all-done"}
# Edges to computations whose instructions are ops of their own (not fused ones).
_CONTROL_EDGES = ("body", "condition", "branch_computations", "true_computation",
                  "false_computation")

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


def _top_level(module: hlo.Module) -> list[str]:
  """Computations whose instructions are ops: the entry and what control flow and async
  wrappers reach from it (fusions, reductions' to_apply: not)."""
  seen, stack = {module.entry}, [module.entry]
  while stack:
    for inst in module.computations[stack.pop()].instructions.values():
      names = [c for kind in _CONTROL_EDGES for c in inst.callees.get(kind, [])]
      if inst.opcode in ("call", "async-start"):
        names += inst.callees.get("calls", []) + inst.callees.get("to_apply", [])
      for name in names:
        if name in module.computations and name not in seen:
          seen.add(name)
          stack.append(name)
  return [name for name in module.computations if name in seen]


_LEAF_LAYOUT = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^{}]*\})?")


def _off_hbm(text: str) -> dict[str, list[bool]]:
  """{instruction name: per leaf of its type, whether it lives outside HBM}: a layout's
  S(n) with n > 0 names another memory space (XLA:TPU's VMEM, SMEM, ...), whose traffic
  is not HBM's. Instructions with every leaf in HBM are left out."""
  out = {}
  for m in re.finditer(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\([^=]*?\)|\S+)\s+[\w\-]+\(",
                       text, re.M):
    spaces = [bool(re.search(r"S\([1-9]\d*\)", layout or ""))
              for _, _, layout in _LEAF_LAYOUT.findall(re.sub(r"/\*.*?\*/", "", m.group(2)))]
    if any(spaces):
      out[m.group(1)] = spaces
  return out


def _param_numbers(text: str) -> dict[str, int]:
  """{parameter instruction name: its number} (names are unique in a module)."""
  return {m.group(1): int(m.group(2)) for m in
          re.finditer(r"%([\w.\-]+)\s*=\s*\S+\s+parameter\((\d+)\)", text)}


def _users(comp: hlo.Computation) -> dict[str, list[hlo.Instruction]]:
  users: dict[str, list[hlo.Instruction]] = {}
  for inst in comp.instructions.values():
    for operand in inst.operands:
      users.setdefault(operand, []).append(inst)
  return users


def _read_bytes(comp: hlo.Computation, users, name: str, full: int) -> int:
  """Bytes of the fusion parameter `name` that its fused computation reads: the slices'
  bytes when it is only sliced (or updated in place), else all of it."""
  total = 0
  for user in users.get(name, []):
    if user.opcode in ("dynamic-slice", "slice", "gather") and user.operands[0] == name:
      total += user.bytes
    elif user.opcode == "dynamic-update-slice" and user.operands[0] == name:
      continue  # written in place: the untouched rows are neither read nor written
    elif user.opcode == "bitcast":
      total += _read_bytes(comp, users, user.name, full)
    else:
      return full
  return min(total, full)


def _written_bytes(comp: hlo.Computation, inst: hlo.Instruction,
                   in_hbm: Optional[list[bool]] = None) -> int:
  """Bytes a fused root writes to HBM (in_hbm: per result leaf, whether it lives there):
  an in-place dynamic-update-slice writes its update, not the whole buffer."""
  if inst.opcode == "tuple":
    parts = [comp.instructions[o] for o in inst.operands if o in comp.instructions]
    flags = in_hbm if in_hbm and len(in_hbm) == len(parts) else [True] * len(parts)
    return sum(_written_bytes(comp, p) for p, keep in zip(parts, flags) if keep)
  if in_hbm is not None and not all(in_hbm):
    return 0
  if inst.opcode == "bitcast" and inst.operands and inst.operands[0] in comp.instructions:
    return _written_bytes(comp, comp.instructions[inst.operands[0]])
  if inst.opcode == "dynamic-update-slice" and len(inst.operands) > 1 and \
     inst.operands[1] in comp.instructions:
    return comp.instructions[inst.operands[1]].bytes
  return inst.bytes


class _Reader:
  """Costs of one module's ops (memoizes the fused computations' FLOPs)."""

  def __init__(self, module: hlo.Module, text: str, num_devices: int):
    self.module = module
    self.params = _param_numbers(text)
    self.off_hbm = _off_hbm(text)
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

  def hbm_bytes(self, inst: hlo.Instruction, leaves: Optional[slice] = None) -> int:
    """Bytes of inst's result (of its leaves[leaves]) that live in HBM."""
    off = self.off_hbm.get(inst.name)
    pairs = list(zip(inst.leaves, off or [False] * len(inst.leaves)))[leaves or slice(None)]
    return hlo.shape_bytes([leaf for leaf, away in pairs if not away])

  def operand_bytes(self, comp: hlo.Computation, inst: hlo.Instruction) -> int:
    return sum(self.hbm_bytes(comp.instructions[o]) for o in inst.operands
               if o in comp.instructions)

  def fusion_bytes(self, comp: hlo.Computation, inst: hlo.Instruction) -> int:
    """Operands read and results written at the fusion's boundary."""
    fused = self.module.computations.get((inst.callees.get("calls") or [""])[0])
    if fused is None:
      return self.operand_bytes(comp, inst) + self.hbm_bytes(inst)
    users = _users(fused)
    by_number = {self.params[n]: n for n in fused.instructions if n in self.params}
    read = 0
    for i, operand in enumerate(inst.operands):
      full = self.hbm_bytes(comp.instructions[operand]) if operand in comp.instructions else 0
      read += _read_bytes(fused, users, by_number[i], full) if i in by_number else full
    root = fused.instructions.get(fused.root) if fused.root else None
    if root is None:
      return read + self.hbm_bytes(inst)
    off = self.off_hbm.get(inst.name)
    return read + _written_bytes(fused, root, None if off is None else [not o for o in off])

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

  def collective_op(self, comp, inst, kind: str, times: int) -> Op:
    group_of = inst
    if kind == "reduce-scatter" and inst.opcode == "fusion":  # XLA:TPU's fused form
      fused = self.module.computations.get(inst.callees["calls"][0])
      inner = [i for i in (fused.instructions.values() if fused else [])
               if i.opcode.startswith("all-reduce")]
      group_of = inner[0] if inner else inst
    return Op(inst.name, inst.opcode, times, bytes=hlo.collective_bytes(comp, inst),
              collective=kind, group=self.group_size(group_of))

  def op(self, comp: hlo.Computation, inst: hlo.Instruction, times: int) -> Optional[Op]:
    """The Op of one top-level instruction, None for one that costs nothing."""
    kind = ("reduce-scatter" if hlo._is_reduce_scatter_fusion(inst)
            else hlo._collective_kind(inst.opcode))
    if kind:
      return self.collective_op(comp, inst, kind, times)
    if inst.opcode in ("copy-start", "slice-start"):  # HBM <-> VMEM: the HBM side counts
      moved = self.operand_bytes(comp, inst) + self.hbm_bytes(inst, slice(0, 1))
      return Op(inst.name, inst.opcode, times, 0.0, moved) if moved else None
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
  module = hlo.parse_module(text)
  if num_devices is None:
    parts = re.search(r"num_partitions=(\d+)", text)
    replicas = re.search(r"replica_count=(\d+)", text)
    num_devices = int(parts.group(1) if parts else 1) * int(replicas.group(1) if replicas
                                                             else 1)
  reader = _Reader(module, text, num_devices)
  mult, _ = hlo.multiplicities(module, trips=trips)
  ops = []
  for name in _top_level(module):
    comp = module.computations[name]
    times = mult.get(name, 0)
    if not times:
      continue
    for inst in comp.instructions.values():
      op = reader.op(comp, inst, times)
      if op is not None:
        ops.append(op)
  return ops


