"""How many times a while loop of XLA's optimized HLO runs: its known_trip_count, or
read off its condition, init and body (XLA:TPU's loops often carry no count); for
plan/hlo.py's multiplicities.

  trip_count(module, caller, loop)   # 18, or None when no count follows
"""

from __future__ import annotations

import re
from typing import Optional

# Module, Computation and Instruction in the annotations are plan/hlo.py's parsed HLO
# (not imported: hlo.py imports this file).

_FLIP = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "NE": "NE"}


def trip_count(module: Module, caller: Computation, loop: Instruction) -> Optional[int]:
  """The iterations of a while instruction: XLA's known_trip_count when the backend
  config carries it, else read off the loop (XLA:TPU's loops often carry none, cf.
  XLA's ComputeWhileLoopTripCount): the condition compares a loop-state element i with a
  bound N (a constant, or an element the body leaves alone whose init is one; LT, LE,
  GT, GE or NE, either side), i starts at its init tuple's constant and steps by the
  body's constant (1 where the body's step cannot be read). None when no count follows:
  the caller runs such a body once."""
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
  if m:
    return int(m.group(1))
  cond = module.computations.get(loop.callees.get("condition", [""])[0])
  body = module.computations.get(loop.callees.get("body", [""])[0])
  init = caller.instructions.get(loop.operands[0]) if loop.operands else None
  if cond is None or cond.root is None or body is None or init is None or \
     init.opcode != "tuple":
    return None
  compare, where, outer = cond.instructions[cond.root], cond, None
  if compare.opcode == "fusion":  # XLA:TPU may fuse the compare
    where = module.computations.get((compare.callees.get("calls") or [""])[0])
    outer, compare = (cond, compare, None), where and where.instructions.get(where.root)
  if compare is None or compare.opcode != "compare" or len(compare.operands) != 2:
    return None
  direction = re.search(r"direction=(\w+)", compare.attrs)
  direction = direction.group(1) if direction else ""
  sides = [_affine(module, where, o, outer) for o in compare.operands]
  if None in sides:
    return None
  invariant = lambda side: side[0] is None or \
      _affine(module, body, _element(body, side[0])) == (side[0], 0)
  if sides[0][0] is None or (invariant(sides[0]) and not invariant(sides[1])):
    sides, direction = sides[::-1], _FLIP.get(direction, "")  # N < i: i > N
  (index, offset), (other, bound) = sides
  if index is None or not invariant(sides[1]):
    return None
  values = [_affine(module, caller, _element(caller, k, init)) if k is not None
            else (None, 0) for k in (index, other)]  # their init constants
  if any(v is None or v[0] is not None for v in values):
    return None
  step = _affine(module, body, _element(body, index))
  step = step[1] if step and step[0] == index and step[1] else 1
  return _iterations(values[0][1] + offset, step, bound + values[1][1], direction)


def _element(comp: Computation, k: int, tuple_inst: Optional[Instruction] = None):
  """The name of element k of a tuple (default: comp's root tuple), None if none."""
  tup = tuple_inst or (comp.instructions.get(comp.root) if comp and comp.root else None)
  if tup is None or tup.opcode != "tuple" or k >= len(tup.operands):
    return None
  return tup.operands[k]


def _affine(module: Module, comp: Computation, name: Optional[str],
            outer=None) -> Optional[tuple[Optional[int], int]]:
  """A scalar of a loop's condition or body as (k, c): element k of the loop state
  plus c; (None, c) for a constant; None for anything else. Reads through copies,
  bitcasts, converts and fusions (outer: (caller, fusion, its outer) inside one)."""
  inst = comp.instructions.get(name) if comp and name else None
  while inst is not None and inst.opcode in ("copy", "bitcast", "convert") and inst.operands:
    inst = comp.instructions.get(inst.operands[0])
  if inst is None:
    return None
  if inst.opcode == "constant":
    n = _int(inst.literal)
    return None if n is None else (None, n)
  if inst.opcode == "parameter" and outer is not None:
    caller, fusion, above = outer
    number = _int(inst.literal)
    if number is None or number >= len(fusion.operands):
      return None
    return _affine(module, caller, fusion.operands[number], above)
  if inst.opcode == "get-tuple-element" and outer is None and inst.operands:
    source = comp.instructions.get(inst.operands[0])
    index = re.search(r"index=(\d+)", inst.attrs)
    if source is not None and source.opcode == "parameter" and index:
      return int(index.group(1)), 0
    return None
  if inst.opcode == "fusion":
    fused = module.computations.get((inst.callees.get("calls") or [""])[0])
    return _affine(module, fused, fused.root, (comp, inst, outer)) if fused else None
  if inst.opcode in ("add", "subtract") and len(inst.operands) == 2:
    a, b = (_affine(module, comp, o, outer) for o in inst.operands)
    if a is None or b is None:
      return None
    sign = 1 if inst.opcode == "add" else -1
    if b[0] is not None and (a[0] is not None or sign < 0):
      return None  # i + j, c - i: not an affine step of one element
    return (a[0] if a[0] is not None else b[0]), a[1] + sign * b[1]
  return None


def _iterations(start: int, step: int, bound: int, direction: str) -> Optional[int]:
  """How many of i = start, start + step, ... pass `i <direction> bound` before the
  first that fails; None for a loop that never ends (or an unknown direction)."""
  if direction in ("LE", "GE"):  # i <= N: i < N + 1
    bound, direction = bound + (1 if direction == "LE" else -1), direction[0] + "T"
  if direction == "LT":
    return 0 if start >= bound else (-(-(bound - start) // step) if step > 0 else None)
  if direction == "GT":
    return 0 if start <= bound else (-(-(start - bound) // -step) if step < 0 else None)
  if direction == "NE":
    if start == bound:
      return 0
    return (bound - start) // step if (bound - start) % step == 0 and \
        (bound - start) // step > 0 else None
  return None


def _int(literal: Optional[str]) -> Optional[int]:
  try:
    return int(literal)
  except (TypeError, ValueError):
    return None
