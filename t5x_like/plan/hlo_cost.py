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


def _leaf_size(dtype: str, dims_text: str, layout: str) -> tuple[int, bool]:
  """(bytes, in HBM) of one array leaf of a type. A tiled layout {1,0:T(8,128)} pads the
  most-minor dims up to the tile (XLA:TPU stores whole tiles: an f32[.., 64] array takes
  [.., 128]); S(n) with n > 0 names a memory space other than HBM (VMEM, SMEM, ...)."""
  dims = [int(d.strip().lstrip("<=")) for d in dims_text.split(",") if d.strip()]
  inside = (layout or "{}")[1:-1]
  order_text, _, rest = inside.partition(":")
  order = [int(d) for d in order_text.split(",") if d.strip()]
  tile = re.match(r"T\(([\d,]+)\)", rest)
  if tile and len(order) == len(dims):
    physical = [dims[i] for i in reversed(order)] or [1]  # major to minor
    sizes = [int(t) for t in tile.group(1).split(",")]
    physical = [1] * max(0, len(sizes) - len(physical)) + physical
    for k, t in enumerate(reversed(sizes)):
      physical[-1 - k] = -(-physical[-1 - k] // t) * t
    dims = physical
  return (hlo.shape_bytes([(dtype, tuple(dims))]),
          not re.search(r"S\([1-9]\d*\)", rest))


def _leaf_sizes(text: str) -> dict[str, list[tuple[int, bool]]]:
  """{instruction name: per leaf of its type, (bytes with tile padding, in HBM)}."""
  out = {}
  for m in re.finditer(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\([^=]*?\)|\S+)\s+[\w\-]+\(",
                       text, re.M):
    out[m.group(1)] = [_leaf_size(*leaf) for leaf in
                       _LEAF_LAYOUT.findall(re.sub(r"/\*.*?\*/", "", m.group(2)))]
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


def _written_bytes(comp: hlo.Computation, inst: hlo.Instruction, size,
                   in_hbm: Optional[list[bool]] = None) -> int:
  """Bytes a fused root writes to HBM (in_hbm: per result leaf, whether it lives there):
  an in-place dynamic-update-slice writes its update, not the whole buffer."""
  if inst.opcode == "tuple":
    parts = [comp.instructions[o] for o in inst.operands if o in comp.instructions]
    flags = in_hbm if in_hbm and len(in_hbm) == len(parts) else [True] * len(parts)
    return sum(_written_bytes(comp, p, size) for p, keep in zip(parts, flags) if keep)
  if in_hbm is not None and not all(in_hbm):
    return 0
  if inst.opcode == "bitcast" and inst.operands and inst.operands[0] in comp.instructions:
    return _written_bytes(comp, comp.instructions[inst.operands[0]], size)
  if inst.opcode == "dynamic-update-slice" and len(inst.operands) > 1 and \
     inst.operands[1] in comp.instructions:
    return size(comp.instructions[inst.operands[1]])
  return size(inst)


class _Reader:
  """Costs of one module's ops (memoizes the fused computations' FLOPs)."""

  def __init__(self, module: hlo.Module, text: str, num_devices: int):
    self.module = module
    self.params = _param_numbers(text)
    self.leaf_sizes = _leaf_sizes(text)
    self.num_devices = num_devices
    self._flops: dict[str, int] = {}
    self._users: dict[str, dict[str, list[hlo.Instruction]]] = {}

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

  def _sizes(self, inst: hlo.Instruction) -> list[tuple[int, bool]]:
    sizes = self.leaf_sizes.get(inst.name)
    if sizes is None or len(sizes) != len(inst.leaves):
      return [(hlo.shape_bytes([leaf]), True) for leaf in inst.leaves]
    return sizes

  def size(self, inst: hlo.Instruction) -> int:
    """Bytes of inst's result with tile padding, wherever it lives."""
    return sum(n for n, _ in self._sizes(inst))

  def hbm_bytes(self, inst: hlo.Instruction, leaves: Optional[slice] = None) -> int:
    """Bytes of inst's result (of its leaves[leaves]) that live in HBM."""
    return sum(n for n, in_hbm in self._sizes(inst)[leaves or slice(None)] if in_hbm)

  def operand_bytes(self, comp: hlo.Computation, inst: hlo.Instruction) -> int:
    return sum(self.hbm_bytes(comp.instructions[o]) for o in inst.operands
               if o in comp.instructions)

  def read_bytes(self, comp: hlo.Computation, name: str, full: int) -> int:
    """Bytes of the fusion parameter `name` that its fused computation `comp` reads: the
    slices' bytes when it is only sliced (or updated in place; through bitcasts and
    nested fusions), else all of it (`full`)."""
    total = 0
    for user in self.users(comp).get(name, []):
      if user.opcode in ("dynamic-slice", "slice", "gather") and user.operands[0] == name:
        total += self.size(user)
      elif user.opcode == "dynamic-update-slice" and user.operands[0] == name:
        continue  # written in place: the untouched rows are neither read nor written
      elif user.opcode == "bitcast":
        total += self.read_bytes(comp, user.name, full)
      elif user.opcode == "fusion" and user.callees.get("calls", [""])[0] in \
          self.module.computations:
        nested = self.module.computations[user.callees["calls"][0]]
        params = {self.params[n]: n for n in nested.instructions if n in self.params}
        total += sum(self.read_bytes(nested, params[i], full) if i in params else full
                     for i, operand in enumerate(user.operands) if operand == name)
      else:
        return full
    return min(total, full)

  def users(self, comp: hlo.Computation) -> dict[str, list[hlo.Instruction]]:
    if comp.name not in self._users:
      self._users[comp.name] = _users(comp)
    return self._users[comp.name]

  def fusion_bytes(self, comp: hlo.Computation, inst: hlo.Instruction) -> int:
    """Operands read and results written at the fusion's boundary."""
    fused = self.module.computations.get((inst.callees.get("calls") or [""])[0])
    if fused is None:
      return self.operand_bytes(comp, inst) + self.hbm_bytes(inst)
    by_number = {self.params[n]: n for n in fused.instructions if n in self.params}
    read = 0
    for i, operand in enumerate(inst.operands):
      full = self.hbm_bytes(comp.instructions[operand]) if operand in comp.instructions else 0
      read += self.read_bytes(fused, by_number[i], full) if i in by_number else full
    root = fused.instructions.get(fused.root) if fused.root else None
    if root is None:
      return read + self.hbm_bytes(inst)
    return read + _written_bytes(fused, root, self.size,
                                 [in_hbm for _, in_hbm in self._sizes(inst)])

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


