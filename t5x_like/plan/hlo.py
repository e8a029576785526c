"""A small reader of XLA's optimized HLO text (compiled.as_text()), for what
cost_analysis does not tell: collectives, fused kernels, and matmul FLOPs with loop
trip counts.

  module = parse_module(compiled.as_text())
  summary = summarize(module)   # {'collectives', 'custom_calls', 'loops', 'matmul_flops', ...}

The text is a list of computations (`%name (params) -> type {` ... `}`, one ENTRY)
of instructions (`[ROOT] %name = TYPE opcode(%operand, ...), attr=..., ...`); a
computation reaches others through calls= (fusions, async wrappers), body= /
condition= (while loops), to_apply= (reductions) and branch_computations= (conditionals).
Each computation runs `multiplicity` times per step: the sum over its call sites of
the caller's multiplicity, times the trip count for a while body (hlo_loops.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

from t5x_like.plan.hlo_loops import trip_count

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
                "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
                "f64": 8, "c64": 8, "c128": 16, "token": 0}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")
_EDGE = re.compile(r"\b(calls|body|condition|to_apply|branch_computations|true_computation|"
                   r"false_computation)=(\{[^}]*\}|%[\w.\-]+)")
_LEAF = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")


@dataclasses.dataclass
class Instruction:
  """One HLO instruction; leaves: the (dtype, dims) arrays of its (maybe tuple) type."""

  name: str
  opcode: str
  leaves: list[tuple[str, tuple[int, ...]]]
  operands: list[str]
  attrs: str  # everything after the operand list
  callees: dict[str, list[str]]  # edge kind (calls, body, ...) -> computation names
  literal: Optional[str] = None  # constant(5), parameter(5) -> '5'

  @property
  def bytes(self) -> int:
    return shape_bytes(self.leaves)

  @property
  def dims(self) -> tuple[int, ...]:
    """The dims of an array-typed instruction (the first leaf of a tuple)."""
    return self.leaves[0][1] if self.leaves else ()


@dataclasses.dataclass
class Computation:
  name: str
  instructions: dict[str, Instruction]
  root: Optional[str] = None


@dataclasses.dataclass
class Module:
  computations: dict[str, Computation]
  entry: str


def shape_bytes(leaves) -> int:
  return int(sum(_DTYPE_BYTES.get(dt, 4) * math.prod(dims) for dt, dims in leaves))


def parse_type(text: str) -> list[tuple[str, tuple[int, ...]]]:
  """'(s32[], bf16[8,128]{1,0:T(8,128)(2,1)})' -> [('s32', ()), ('bf16', (8, 128))]."""
  text = re.sub(r"/\*.*?\*/", "", text)
  while True:  # layouts {1,0:T(8,128)S(1)}: drop them, innermost first
    stripped = re.sub(r"\{[^{}]*\}", "", text)
    if stripped == text:
      break
    text = stripped
  return [(dt, tuple(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip()))
          for dt, dims in _LEAF.findall(text)]


def _balanced(text: str, start: int, open_: str, close: str) -> int:
  """Index just past the bracket closing text[start] (== open_), skipping {...}."""
  depth, braces = 0, 0
  for i in range(start, len(text)):
    c = text[i]
    if c == "{":
      braces += 1
    elif c == "}":
      braces -= 1
    elif braces == 0 and c == open_:
      depth += 1
    elif braces == 0 and c == close:
      depth -= 1
      if depth == 0:
        return i + 1
  return len(text)


def _split_top(text: str) -> list[str]:
  """Split on commas outside any brackets."""
  parts, depth, last = [], 0, 0
  for i, c in enumerate(text):
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    elif c == "," and depth == 0:
      parts.append(text[last:i])
      last = i + 1
  parts.append(text[last:])
  return [p.strip() for p in parts if p.strip()]


def parse_instruction(line: str) -> Optional[tuple[Instruction, bool]]:
  """(instruction, is_root) of one instruction line, None for anything else."""
  m = re.match(r"\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*", line)
  if not m:
    return None
  pos = m.end()
  if line.startswith("(", pos):
    end = _balanced(line, pos, "(", ")")
  else:  # an array type has no spaces: bf16[8,128]{1,0:T(8,128)(2,1)}
    end = line.find(" ", pos)
  type_text = line[pos:end]
  rest = line[end:].lstrip()
  op = re.match(r"([\w\-]+)\(", rest)
  if not op:
    return None
  close = _balanced(rest, op.end() - 1, "(", ")")
  operand_text = re.sub(r"/\*.*?\*/", "", rest[op.end():close - 1])
  operands = [re.findall(r"%([\w.\-]+)", o)[-1] for o in _split_top(operand_text)
              if "%" in o]
  attrs = rest[close:]
  callees: dict[str, list[str]] = {}
  for kind, target in _EDGE.findall(attrs):
    callees.setdefault(kind, []).extend(re.findall(r"%([\w.\-]+)", target))
  literal = operand_text.strip() if op.group(1) in ("constant", "parameter") else None
  return Instruction(m.group(2), op.group(1), parse_type(type_text), operands, attrs,
                     callees, literal), bool(m.group(1))


def parse_module(text: str) -> Module:
  """All computations of an HLO module's text (the stack-frame tables are skipped)."""
  computations, entry, current = {}, None, None
  for line in text.splitlines():
    if current is None:
      header = _HEADER.match(line)
      if header:
        current = Computation(header.group(2), {})
        if header.group(1):
          entry = current.name
      continue
    if line.lstrip().startswith("}"):  # also `}, execution_thread="sparsecore"`
      computations[current.name] = current
      current = None
      continue
    parsed = parse_instruction(line)
    if parsed:
      inst, is_root = parsed
      current.instructions[inst.name] = inst
      if is_root:
        current.root = inst.name
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return Module(computations, entry)


# ------------------------------------------------------------------ multiplicity
def multiplicities(module: Module, trips: bool = True) -> tuple[dict[str, int], list[dict]]:
  """({computation: times it runs per step}, the while loops with their trip counts).

  trips=False counts each loop body once, as XLA's cost analysis does. A loop whose
  count cannot be read (trip_count None) runs its body once: the caller can say so.
  """
  order, seen = [], set()

  def visit(name):  # post-order DFS; reversed, callers come before their callees
    seen.add(name)
    for inst in module.computations[name].instructions.values():
      for callee in _callees(inst):
        if callee not in seen and callee in module.computations:
          visit(callee)
    order.append(name)

  visit(module.entry)
  mult = {name: 0 for name in order}
  mult[module.entry] = 1
  loops = []
  for name in reversed(order):
    comp = module.computations[name]
    for inst in comp.instructions.values():
      n = None
      if inst.opcode == "while":
        n = trip_count(module, comp, inst)
        loops.append({"name": inst.name, "computation": name, "trip_count": n,
                      "op_name": _op_name(inst)})
      for kind, names in inst.callees.items():
        if inst.opcode in ("async-update", "async-done", "call-update", "call-done"):
          continue  # the async-start's edge already counts the wrapped computation
        factor = (n or 1) if trips and kind in ("body", "condition") else 1
        for callee in names:
          if callee in mult:
            mult[callee] += mult[name] * factor
  return mult, loops


def _callees(inst: Instruction) -> list[str]:
  return [c for names in inst.callees.values() for c in names]


def _op_name(inst: Instruction) -> str:
  m = re.search(r'op_name="([^"]*)"', inst.attrs)
  return m.group(1) if m else ""


# ------------------------------------------------------------------ FLOPs
def _dims_attr(attrs: str, key: str) -> list[int]:
  m = re.search(key + r"=\{([\d,\s]*)\}", attrs)
  return [int(d) for d in m.group(1).split(",") if d.strip()] if m else []


def dot_flops(comp: Computation, inst: Instruction) -> int:
  """2 x output elements x contracted size (XLA's count for a dot)."""
  lhs = comp.instructions[inst.operands[0]].dims
  contracted = math.prod(lhs[d] for d in _dims_attr(inst.attrs, "lhs_contracting_dims"))
  return 2 * math.prod(inst.dims) * contracted


def _window(attrs: str) -> list[dict[str, int]]:
  """window={size=1x2 pad=0_0x1_1 stride=..} -> one dict per spatial dim."""
  m = re.search(r"window=\{([^}]*)\}", attrs)
  fields = dict(f.split("=", 1) for f in m.group(1).split()) if m else {}
  size = [int(s) for s in fields.get("size", "").split("x") if s]
  dims = []
  for i in range(len(size)):
    get = lambda key, default: int(fields[key].split("x")[i]) if key in fields else default
    pad = fields["pad"].split("x")[i].split("_") if "pad" in fields else ("0", "0")
    dims.append({"size": size[i], "stride": get("stride", 1), "pad_low": int(pad[0]),
                 "lhs_dilate": get("lhs_dilate", 1), "rhs_dilate": get("rhs_dilate", 1)})
  return dims


def _valid_positions(w: dict, input_size: int, output_size: int) -> int:
  """(output, kernel) position pairs that land on a real (not padded, not dilation-hole)
  input element of one spatial dimension."""
  count = 0
  for k in range(w["size"]):
    for o in range(output_size):
      pos = o * w["stride"] - w["pad_low"] + k * w["rhs_dilate"]
      if pos % w["lhs_dilate"] == 0 and 0 <= pos // w["lhs_dilate"] < input_size:
        count += 1
  return count


def conv_flops(comp: Computation, inst: Instruction) -> int:
  """2 x batch x in-features per group x out-features x valid window positions (XLA's
  count; TPU lowers many batched matmuls to convolutions with padded or dilated windows,
  so the naive output x window product over-counts)."""
  lhs = comp.instructions[inst.operands[0]].dims
  rhs = comp.instructions[inst.operands[1]].dims
  out = inst.dims
  m = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", inst.attrs)
  lhs_l, rhs_l, out_l = m.groups()
  groups = re.search(r"feature_group_count=(\d+)", inst.attrs)
  batch_groups = re.search(r"batch_group_count=(\d+)", inst.attrs)
  in_feature = lhs[lhs_l.index("f")] // (int(groups.group(1)) if groups else 1)
  batch = lhs[lhs_l.index("b")] // (int(batch_groups.group(1)) if batch_groups else 1)
  positions = 1
  for i, w in enumerate(_window(inst.attrs)):
    w = dict(w, size=rhs[rhs_l.index(str(i))])
    positions *= _valid_positions(w, lhs[lhs_l.index(str(i))], out[out_l.index(str(i))])
  return 2 * batch * in_feature * out[out_l.index("f")] * positions


def matmul_flops(module: Module, mult: dict[str, int]) -> int:
  """Dot and convolution FLOPs, fusions included, each times its computation's count."""
  total = 0
  for name, times in mult.items():
    comp = module.computations[name]
    for inst in comp.instructions.values():
      if inst.opcode == "dot":
        total += times * dot_flops(comp, inst)
      elif inst.opcode == "convolution":
        total += times * conv_flops(comp, inst)
  return total


# ------------------------------------------------------------------ collectives, kernels
def _collective_kind(opcode: str) -> Optional[str]:
  base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
  return base if base in COLLECTIVES else None


def collective_bytes(comp: Computation, inst: Instruction) -> int:
  """Per-device bytes of one collective: its operands (all-gather: the gathered result;
  a -start form's result tuple holds the operands too, so they are taken off)."""
  operands = sum(comp.instructions[o].bytes for o in inst.operands if o in comp.instructions)
  if _collective_kind(inst.opcode) == "all-gather":
    return inst.bytes - operands if inst.opcode.endswith("-start") else inst.bytes
  return operands


_GENERIC = ("custom-call", "shard_map", "pallas_call", "closed_call", "body", "while",
            "cond", "remat", "checkpoint", "rematted_computation")


def kernel_name(inst: Instruction) -> str:
  """A Mosaic / Triton kernel's name: pallas_call(name=...) names the instruction, else
  the nearest telling part of its op_name (.../flash_fwd/pallas_call)."""
  parts = [re.sub(r"\.\d+$", "", inst.name)] + _op_name(inst).split("/")[::-1]
  for part in parts:
    if part and part not in _GENERIC and "(" not in part:
      return part
  return parts[0]


def is_kernel_target(target: str) -> bool:
  """Custom calls that are fused kernels (Mosaic TPU / GPU, Triton, cuDNN), not the
  compiler's own helpers (AllocateBuffer, AsyncCollectiveStart, ...)."""
  return target in ("tpu_custom_call", "mosaic_gpu") or "triton" in target or \
      "cudnn" in target


def _is_reduce_scatter_fusion(inst: Instruction) -> bool:
  """XLA:TPU emits reduce-scatter as a fusion of an all-reduce and dynamic slices."""
  return inst.opcode == "fusion" and (
      '"emitter":"AllReduceScatterFusion"' in inst.attrs or
      any(c.startswith("all-reduce-scatter") for c in inst.callees.get("calls", [])))


def summarize(module: Module) -> dict:
  """{'collectives': {kind: {count, bytes, ops}}, 'kernels': {name: count},
  'custom_calls': {target: count}, 'loops': [...], 'matmul_flops', 'matmul_flops_once'}.

  count and bytes are per step (ops in loop bodies times the trip count); ops: how
  many instructions of that kind the program holds.
  """
  mult, loops = multiplicities(module)
  once, _ = multiplicities(module, trips=False)
  collectives: dict[str, dict] = {}
  kernels: dict[str, int] = {}
  custom: dict[str, int] = {}
  fused_collectives = {c for comp in module.computations.values()
                       for inst in comp.instructions.values()
                       if _is_reduce_scatter_fusion(inst) for c in inst.callees["calls"]}
  for name, times in mult.items():
    if name in fused_collectives:
      continue  # counted as the reduce-scatter fusion that calls it
    comp = module.computations[name]
    for inst in comp.instructions.values():
      kind = ("reduce-scatter" if _is_reduce_scatter_fusion(inst)
              else _collective_kind(inst.opcode))
      if kind:
        c = collectives.setdefault(kind, {"count": 0, "bytes": 0, "ops": 0})
        c["count"] += times
        c["bytes"] += times * collective_bytes(comp, inst)
        c["ops"] += 1
      elif inst.opcode == "custom-call":
        m = re.search(r'custom_call_target="([^"]*)"', inst.attrs)
        target = m.group(1) if m else "?"
        custom[target] = custom.get(target, 0) + times
        if is_kernel_target(target):
          kernels[kernel_name(inst)] = kernels.get(kernel_name(inst), 0) + times
  return {"collectives": dict(sorted(collectives.items())), "kernels": kernels,
          "custom_calls": dict(sorted(custom.items())), "loops": loops,
          "matmul_flops": matmul_flops(module, mult),
          "matmul_flops_once": matmul_flops(module, once)}
