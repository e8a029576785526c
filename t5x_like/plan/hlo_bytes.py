"""The HBM bytes an op of XLA's optimized HLO moves at its fusion boundary; for
plan/hlo_cost.py.

Every operand read and every result written, tile padding included, except:
  - what lives outside HBM (XLA:TPU's VMEM and other memory spaces, a layout's S(n)) is
    free;
  - an operand only sliced inside the fusion (a scanned layer's weights out of the
    stacked [L, ...] array) reads the slices, also through views (bitcast, copy,
    convert) and nested fusions;
  - an in-place dynamic-update-slice of an operand (a scan writing one layer's row of a
    stacked output, or its gradient's) reads nothing of the buffer and writes the
    update, also where it reaches the fused root through bitcasts, copies, tuples,
    get-tuple-elements and nested fusions (XLA's in-place fusion emitter, cf.
    CanEmitFusedDynamicUpdateSliceInPlace).
"""

from __future__ import annotations

import functools
import re
from typing import Optional

from t5x_like.plan import hlo

# Fused ops whose result is their operand's values (a slice of it reads a slice).
_VIEWS = ("bitcast", "copy", "convert")


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


class FusionBytes:
  """HBM bytes of one module's fusions (tile-padded sizes from the text's layouts)."""

  def __init__(self, module: hlo.Module, text: str):
    self.module = module
    self.params = _param_numbers(text)
    self.leaf_sizes = _leaf_sizes(text)
    self._users: dict[str, dict[str, list[hlo.Instruction]]] = {}

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

  def read_bytes(self, comp: hlo.Computation, name: str, full: int, escape=None) -> int:
    """Bytes of the fusion parameter `name` (`full` bytes in HBM) that its fused
    computation `comp` reads: the slices' share when it is only sliced or updated in
    place (through views and nested fusions; escape: what the caller reads of a nested
    fusion's result), else all of it."""
    total = 0
    if name == comp.root:
      if escape is None:
        return full
      total += escape()
    size = max(self.size(comp.instructions[name]), 1)
    for user in self.users(comp).get(name, []):
      first = user.operands[0] == name
      if user.opcode in ("dynamic-slice", "slice", "gather") and first:
        total += full * self.size(user) // size
      elif user.opcode == "dynamic-update-slice" and first and user.operands[1] != name:
        continue  # written in place: the untouched rows are neither read nor written
      elif user.opcode in _VIEWS:
        total += self.read_bytes(comp, user.name, full, escape)
      elif user.opcode == "fusion" and user.callees.get("calls", [""])[0] in \
          self.module.computations:
        nested = self.module.computations[user.callees["calls"][0]]
        params = {self.params[n]: n for n in nested.instructions if n in self.params}
        outer = functools.partial(self.read_bytes, comp, user.name, full, escape)
        total += sum(self.read_bytes(nested, params[i], full, outer) if i in params else full
                     for i, operand in enumerate(user.operands) if operand == name)
      else:
        return full
    return min(total, full)

  def written_bytes(self, comp: hlo.Computation, inst: hlo.Instruction,
                    in_hbm: Optional[list[bool]] = None) -> int:
    """Bytes a fused root writes to HBM (in_hbm: per result leaf, whether it lives there):
    an in-place dynamic-update-slice writes its update, not the whole buffer."""
    if inst.opcode == "tuple":
      parts = [comp.instructions[o] for o in inst.operands if o in comp.instructions]
      flags = in_hbm if in_hbm and len(in_hbm) == len(parts) else [True] * len(parts)
      return sum(self.written_bytes(comp, p) for p, keep in zip(parts, flags) if keep)
    if in_hbm is not None and not all(in_hbm):
      return 0
    update = self.in_place_update(comp, inst)
    return self.size(update if update is not None else inst)

  def in_place_update(self, comp: hlo.Computation, inst: hlo.Instruction,
                      index: Optional[int] = None) -> Optional[hlo.Instruction]:
    """The update of the dynamic-update-slice that `inst` (its tuple element `index`)
    is, through bitcasts, copies, get-tuple-elements and nested fusions; None if none."""
    for _ in range(64):  # a chain of views, never a cycle
      if index is not None and inst.opcode == "tuple":
        inst, index = comp.instructions.get(inst.operands[index]) if index < len(
            inst.operands) else None, None
      elif inst.opcode == "get-tuple-element" and index is None:
        k = re.search(r"index=(\d+)", inst.attrs)
        inst, index = comp.instructions.get(inst.operands[0]), int(k.group(1)) if k else 0
      elif inst.opcode == "fusion" and inst.callees.get("calls", [""])[0] in \
          self.module.computations:
        comp = self.module.computations[inst.callees["calls"][0]]
        inst = comp.instructions.get(comp.root) if comp.root else None
      elif inst.opcode in ("bitcast", "copy") and index is None:
        inst = comp.instructions.get(inst.operands[0])
      elif inst.opcode == "dynamic-update-slice" and index is None:
        return comp.instructions.get(inst.operands[1]) if self._is_parameter(
            comp, inst.operands[0]) else None  # DUS(broadcast, ..): all written
      else:
        return None
      if inst is None:
        return None
    return None

  def _is_parameter(self, comp: hlo.Computation, name: str) -> bool:
    """Whether `name` is a fused parameter (a buffer from outside), through views."""
    for _ in range(64):
      inst = comp.instructions.get(name)
      if inst is None or inst.opcode == "parameter":
        return inst is not None
      if inst.opcode == "fusion" and inst.callees.get("calls", [""])[0] in \
          self.module.computations:
        comp = self.module.computations[inst.callees["calls"][0]]
        name = comp.root
      elif inst.opcode in ("bitcast", "copy") and inst.operands:
        name = inst.operands[0]
      else:
        return False
    return False

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
    return read + self.written_bytes(fused, root, [in_hbm for _, in_hbm in self._sizes(inst)])
