"""Where the step goes: a jax.profiler trace of train steps -> device time per category.

  xplane = capture_steps(DIR, run_one_step, steps=3)  # jax.profiler trace (+ Perfetto)
  table = profile_table(xplane, hlo_text=compiled.as_text())
  print(format_table(table))

The numbers come from the trace file (DIR/plugins/profile/<run>/*.xplane.pb, read by
jaxlib's own XSpace reader `jax.profiler.ProfileData`; no TensorBoard needed), not from
timing in Python. The kernels are the events that carry an `hlo_op` stat: on the CPU the
XLA:CPU thunks on the host plane (stat `device_ordinal` names the device), on a GPU / TPU
the kernels on each `/device:*` plane (the `XLA Ops` line where the trace has one, else
every stream line). Each kernel belongs to the step annotation its start falls in.

Per device and step, the step is the span from the first kernel's start to the last
kernel's end; kernels that run at the same time (XLA:CPU runs independent thunks on
several threads, a GPU several streams) share the time they overlap equally, so the
categories plus the idle gaps add up to the span exactly. Rows are averaged over devices
and steps.

A kernel's category comes from its HLO instruction in the step's optimized HLO (the
trace names only the instruction): collectives by opcode; the optimizer update by the
`optimizer_update` name scope (train/step.py); attention kernels by a fused attention
custom call (cuDNN fMHA, flash / Pallas / Triton) or an op inside an attention module that
is not one of its projections (query / key / value / out); matmuls by dot / convolution
(or a cuBLAS / GEMM kernel); loss and logits by the loss function's ops (op_name outside
the model module, `jvp()`, or naming the loss); copies and dynamic slices by data
movement only (copy, transpose, (dynamic) slices, gather / scatter, broadcast); norms and
other elementwise fusions by any other fusion or elementwise op; the rest is "other"
(listed in the table's `other_ops`, so what could not be told is visible).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
from typing import Callable, Iterable, Optional

from t5x_like.plan import hlo as hlo_lib

MATMULS = "matmuls"
ATTENTION = "attention kernels"
LOSS = "loss and logits"
ELEMENTWISE = "norms and other elementwise fusions"
OPTIMIZER = "optimizer update"
COLLECTIVES = "collectives"
COPIES = "copies and dynamic slices"
OTHER = "other"
IDLE = "idle between kernels"
CATEGORIES = (MATMULS, ATTENTION, LOSS, ELEMENTWISE, OPTIMIZER, COLLECTIVES, COPIES, OTHER)

STEP_NAME = "t5x_like_profiled_step"  # the StepTraceAnnotation around each profiled step
OPTIMIZER_SCOPE = "optimizer_update"  # jax.named_scope in train/step.py

# Lines of a device plane that the profiler derives from the kernels (counting them
# would count each kernel twice).
_DERIVED_LINES = ("XLA Modules", "Steps", "XLA TraceMe", "Framework Name Scope",
                  "Framework Ops", "Source code", "Launch Stats", "SparseCore")
_CONTAINERS = ("while", "conditional", "call", "async-start", "async-done", "async-update")
_CONTAINER_NAME = re.compile(r"(while|conditional|call)(\.\d+)?$")
_MOVEMENT = {"copy", "copy-start", "copy-done", "transpose", "slice", "dynamic-slice",
             "dynamic-update-slice", "concatenate", "pad", "gather", "scatter", "broadcast",
             "reshape", "bitcast", "reverse", "iota", "parameter", "constant", "tuple",
             "get-tuple-element", "bitcast-convert", "convert"}
# Ops that are neither math nor data movement (unknown custom calls, sorts, host I/O).
_NOT_ELEMENTWISE = {"custom-call", "sort", "rng", "rng-bit-generator", "rng-get-and-update-state",
                    "infeed", "outfeed", "send", "recv", "send-done", "recv-done"}
_PROJECTIONS = {"query", "key", "value", "out", "qkv", "kv", "q", "k", "v", "o", "output",
                "wq", "wk", "wv", "wo", "kv_proj", "q_proj"}
_COLLECTIVE_NAME = re.compile(r"nccl|all-?reduce|all-?gather|reduce-?scatter|all-?to-?all|"
                              r"collective-?permute|rendezvous", re.I)
_ATTENTION_TARGET = re.compile(r"fmha|flash|attention|splash|mha", re.I)
_MATMUL_NAME = re.compile(r"gemm|cublas|cutlass|xmma|matmul|^dot[._]|^dot$|convolution|conv_",
                          re.I)
_LOSS_NAME = re.compile(r"loss|cross_entropy|logsumexp|log_softmax|take_along_axis|"
                        r"token_metrics|argmax|(^|/)(transpose\()?jvp\(\)", re.I)
_COPY_NAME = re.compile(r"memcpy|memset|^copy|dynamic[-_]update[-_]slice|dynamic[-_]slice|"
                        r"^transpose|^wrapped_broadcast", re.I)


# ------------------------------------------------------------------ the HLO side
@dataclasses.dataclass(frozen=True)
class OpInfo:
  """What the optimized HLO says about one instruction the trace names."""

  opcode: str
  op_name: str = ""  # the jax name stack (metadata op_name)
  target: str = ""  # custom_call_target
  inner: frozenset = frozenset()  # opcodes inside a fusion (and the op's own)


def hlo_ops(hlo_text: str) -> dict[str, OpInfo]:
  """{instruction name: OpInfo} of every instruction of an optimized HLO module
  (compiled.as_text()); a fusion's `inner` holds the opcodes of the computations it
  calls, and its op_name falls back to the first one found inside."""
  module = hlo_lib.parse_module(hlo_text)

  def inside(comp_name: str, seen: set) -> tuple[set, str]:
    if comp_name in seen or comp_name not in module.computations:
      return set(), ""
    seen.add(comp_name)
    ops, name = set(), ""
    for inst in module.computations[comp_name].instructions.values():
      if inst.opcode != "fusion":  # a nested fusion counts by what it holds
        ops.add(inst.opcode)
      name = name or _op_name(inst)
      for callee in inst.callees.get("calls", []) + inst.callees.get("to_apply", []):
        sub_ops, sub_name = inside(callee, seen)
        ops |= sub_ops
        name = name or sub_name
    return ops, name

  out = {}
  for comp in module.computations.values():
    for inst in comp.instructions.values():
      ops, name = ({inst.opcode} if inst.opcode != "fusion" else set()), _op_name(inst)
      if inst.opcode == "fusion":
        for callee in inst.callees.get("calls", []):
          sub_ops, sub_name = inside(callee, set())
          ops |= sub_ops
          name = name or sub_name
      target = re.search(r'custom_call_target="([^"]*)"', inst.attrs)
      out[inst.name] = OpInfo(inst.opcode, name, target.group(1) if target else "",
                              frozenset(ops))
  return out


def _op_name(inst: hlo_lib.Instruction) -> str:
  m = re.search(r'op_name="((?:[^"\\]|\\.)*)"', inst.attrs)
  return m.group(1) if m else ""


def hlo_module_name(hlo_text: str) -> Optional[str]:
  """'jit_train_step' from the text's first line `HloModule jit_train_step, ...`."""
  m = re.match(r"\s*HloModule\s+([\w.\-]+)", hlo_text)
  return m.group(1) if m else None


# ------------------------------------------------------------------ classification
def _attention_core(op_name: str) -> bool:
  """An op inside an attention module (self_attention, cross_attention, ...) that is
  not one of its projections nor a norm named after it (self_attention_norm)."""
  parts = [p for p in op_name.split("/") if p]
  for i, part in enumerate(parts):
    if "attention" in part.lower() and not re.search(r"norm|_ln$", part.lower()):
      rest = parts[i + 1:]
      return not (rest and rest[0].lower() in _PROJECTIONS)
  return False


def classify(kernel: str, info: Optional[OpInfo]) -> str:
  """The category (CATEGORIES) of one kernel: its trace name and, where the step's HLO
  knows the instruction, its OpInfo."""
  opcode = info.opcode if info else ""
  ops = info.inner if info else frozenset()
  op_name = info.op_name if info else ""
  target = info.target if info else ""
  if any(re.sub(r"-(start|done)$", "", o) in hlo_lib.COLLECTIVES for o in ops) or (
      not info and _COLLECTIVE_NAME.search(kernel)):
    return COLLECTIVES
  if OPTIMIZER_SCOPE in op_name:
    return OPTIMIZER
  if (_ATTENTION_TARGET.search(target) or _attention_core(op_name) or
      (opcode in ("", "custom-call") and _ATTENTION_TARGET.search(kernel))):
    return ATTENTION
  if ops & {"dot", "convolution"} or re.search(r"gemm|cublas|matmul", target, re.I) or (
      not info and _MATMUL_NAME.search(kernel)):
    return MATMULS
  if _LOSS_NAME.search(op_name):
    return LOSS
  if info:
    if opcode in _CONTAINERS:
      return OTHER
    if ops and ops <= _MOVEMENT:
      return COPIES
    return OTHER if opcode in _NOT_ELEMENTWISE else ELEMENTWISE
  if _COPY_NAME.search(kernel):
    return COPIES
  if re.search(r"fusion|^loop_|^input_|elementwise|reduce", kernel, re.I):
    return ELEMENTWISE
  return OTHER


# ------------------------------------------------------------------ the trace side
@dataclasses.dataclass(frozen=True)
class Kernel:
  """One kernel (XLA:CPU thunk, GPU kernel, TPU op) on one device's timeline."""

  device: str
  name: str  # the HLO instruction (hlo_op stat) or the event's own name
  start_ns: float
  end_ns: float
  module: str = ""  # hlo_module stat


def find_xplane(path: str) -> str:
  """The newest DIR/plugins/profile/<run>/*.xplane.pb under `path` (or `path` itself)."""
  if os.path.isfile(path):
    return path
  found = glob.glob(os.path.join(path, "plugins", "profile", "*", "*.xplane.pb"))
  if not found:
    raise FileNotFoundError(f"{path}: no plugins/profile/*/*.xplane.pb (a jax.profiler trace)")
  return max(found, key=os.path.getmtime)


def _stats(holder) -> dict:
  return {k: v for k, v in holder.stats if k is not None}


def trace_kernels(profile) -> tuple[list[Kernel], list[tuple[float, float]]]:
  """(kernels, step windows) of a jax.profiler.ProfileData.

  Kernels: events of the `/device:*` planes (GPU, TPU), else the host plane's events
  with an `hlo_op` stat (XLA:CPU, one timeline per `device_ordinal`). Step windows:
  (start_ns, end_ns) of the STEP_NAME annotations on the host plane, in time order.
  """
  kernels: list[Kernel] = []
  windows: list[tuple[float, float]] = []
  host_kernels: list[Kernel] = []
  for plane in profile.planes:
    if plane.name.startswith("/device:"):
      lines = list(plane.lines)
      ops_lines = [line for line in lines if line.name == "XLA Ops"]
      for line in ops_lines or lines:
        if not ops_lines and any(line.name.startswith(d) for d in _DERIVED_LINES):
          continue
        for event in line.events:
          stats = _stats(event)
          kernels.append(Kernel(plane.name, str(stats.get("hlo_op", event.name)),
                                event.start_ns, event.start_ns + event.duration_ns,
                                str(stats.get("hlo_module", ""))))
    elif plane.name.startswith("/host:"):
      for line in plane.lines:
        for event in line.events:
          if event.name == STEP_NAME:
            windows.append((event.start_ns, event.start_ns + event.duration_ns))
            continue
          stats = _stats(event)
          if "hlo_op" in stats:
            host_kernels.append(Kernel(f"cpu:{stats.get('device_ordinal', 0)}",
                                       str(stats["hlo_op"]), event.start_ns,
                                       event.start_ns + event.duration_ns,
                                       str(stats.get("hlo_module", ""))))
  return (kernels or host_kernels), sorted(windows)


def read_trace(path: str) -> tuple[list[Kernel], list[tuple[float, float]]]:
  """trace_kernels of the xplane.pb at (or under) `path`."""
  from jax.profiler import ProfileData  # jaxlib's XSpace reader
  return trace_kernels(ProfileData.from_file(find_xplane(path)))


# ------------------------------------------------------------------ the table
def share_time(spans: list[tuple[float, float, str]]) -> tuple[dict[str, float], float, float]:
  """({category: ns}, idle ns, span ns) of one device's step: `spans` are (start, end,
  category) of its kernels; overlapping kernels share their common time equally, and
  the time no kernel runs between the first start and the last end is idle."""
  if not spans:
    return {}, 0.0, 0.0
  edges = sorted([(s, 1, c) for s, e, c in spans] + [(e, -1, c) for s, e, c in spans],
                 key=lambda x: (x[0], x[1]))
  active: collections.Counter = collections.Counter()
  out: dict[str, float] = collections.defaultdict(float)
  idle, last = 0.0, edges[0][0]
  for t, delta, category in edges:
    dt = t - last
    running = sum(active.values())
    if dt > 0:
      if running:
        for c, n in active.items():
          if n:
            out[c] += dt * n / running
      else:
        idle += dt
    active[category] += delta
    last = t
  return dict(out), idle, edges[-1][0] - edges[0][0]


def step_groups(kernels: Iterable[Kernel], windows: list[tuple[float, float]]
                ) -> dict[tuple[int, str], list[Kernel]]:
  """{(step index, device): kernels} by the step window each kernel starts in (all one
  step when there are no windows); kernels outside every window are left out."""
  groups: dict[tuple[int, str], list[Kernel]] = collections.defaultdict(list)
  for k in kernels:
    if not windows:
      groups[(0, k.device)].append(k)
      continue
    for i, (start, end) in enumerate(windows):
      if start <= k.start_ns <= end:
        groups[(i, k.device)].append(k)
        break
  return groups


def profile_table(path: str, hlo_text: Optional[str] = None,
                  kernels_and_windows=None, module: Optional[str] = None) -> dict:
  """The table of the trace at `path` (or of `kernels_and_windows`, as trace_kernels
  returns them): {'steps', 'devices', 'step_ms', 'wall_step_ms', 'rows': [{category,
  ms_per_step, percent, kernels_per_step}], 'other_ops', 'top_ops', 'source'}.

  hlo_text: the step's optimized HLO (classification by op metadata; without it, by
  kernel names only); module: keep only kernels of this hlo_module (default: the one
  hlo_text names).
  """
  kernels, windows = kernels_and_windows or read_trace(path)
  infos = hlo_ops(hlo_text) if hlo_text else {}
  module = module or (hlo_module_name(hlo_text) if hlo_text else None)
  if module:  # a GPU trace may name it 'jit_train_step(17)'
    kernels = [k for k in kernels
               if not k.module or k.module == module or k.module.startswith(module + "(")]
  # While / conditional thunks contain their bodies' kernels: those are counted.
  kernels = [k for k in kernels if not (infos[k.name].opcode in _CONTAINERS
                                        if k.name in infos else _CONTAINER_NAME.match(k.name))]
  groups = step_groups(kernels, windows)
  if not groups:
    raise ValueError(f"{path}: the trace holds no kernels"
                     + (f" of module {module}" if module else "") + " in its steps")
  time_ns: dict[str, float] = collections.defaultdict(float)
  counts: collections.Counter = collections.Counter()
  by_op: dict[str, list] = {}
  idle_ns = span_ns = 0.0
  for group in groups.values():
    categories = {k.name: classify(k.name, infos.get(k.name)) for k in group}
    shares, idle, span = share_time([(k.start_ns, k.end_ns, categories[k.name])
                                     for k in group])
    for c, ns in shares.items():
      time_ns[c] += ns
    idle_ns += idle
    span_ns += span
    for k in group:
      counts[categories[k.name]] += 1
      entry = by_op.setdefault(k.name, [categories[k.name], 0.0, 0])
      entry[1] += k.end_ns - k.start_ns
      entry[2] += 1
  n = len(groups)
  step_ms = span_ns / n / 1e6
  rows = [{"category": c, "ms_per_step": round(time_ns.get(c, 0.0) / n / 1e6, 4),
           "percent": round(100 * time_ns.get(c, 0.0) / span_ns, 2) if span_ns else 0.0,
           "kernels_per_step": round(counts[c] / n, 1)} for c in CATEGORIES]
  rows.append({"category": IDLE, "ms_per_step": round(idle_ns / n / 1e6, 4),
               "percent": round(100 * idle_ns / span_ns, 2) if span_ns else 0.0,
               "kernels_per_step": None})
  ranked = sorted(by_op.items(), key=lambda kv: -kv[1][1])
  op_row = lambda name, v: {"op": name, "category": v[0],  # noqa: E731
                            "ms_per_step": round(v[1] / n / 1e6, 4),
                            "op_name": infos[name].op_name if name in infos else ""}
  return {
      "source": find_xplane(path) if path and not kernels_and_windows else path,
      "steps": len({s for s, _ in groups}), "devices": len({d for _, d in groups}),
      "classified_by": "hlo op metadata" if infos else "kernel names",
      "step_ms": round(step_ms, 4),
      "wall_step_ms": (round(sum(e - s for s, e in windows) / len(windows) / 1e6, 4)
                       if windows else None),
      "rows": rows,
      "top_ops": [op_row(k, v) for k, v in ranked[:10]],
      "other_ops": [op_row(k, v) for k, v in ranked if v[0] == OTHER][:10],
  }


def format_table(table: dict) -> str:
  """The table as aligned text lines (category, ms / step, % of step, kernels / step)."""
  lines = [f"device time per step ({table['devices']} device(s) x {table['steps']} steps,"
           f" from {table['source']}; classified by {table['classified_by']})",
           f"{'category':38s} {'ms/step':>10s} {'% step':>7s} {'kernels':>8s}"]
  for row in table["rows"]:
    kernels = "" if row["kernels_per_step"] is None else f"{row['kernels_per_step']:g}"
    lines.append(f"{row['category']:38s} {row['ms_per_step']:10.3f} {row['percent']:7.1f}"
                 f" {kernels:>8s}")
  lines.append(f"{'device step (first kernel to last)':38s} {table['step_ms']:10.3f} "
               f"{100.0:7.1f}")
  if table.get("wall_step_ms") is not None:
    lines.append(f"{'wall step (host annotation)':38s} {table['wall_step_ms']:10.3f}")
  return "\n".join(lines)


# ------------------------------------------------------------------ capture
def capture_steps(log_dir: str, run_step: Callable[[], None], steps: int) -> str:
  """Run `run_step` (one blocking step) `steps` times under a jax.profiler trace into
  log_dir, each inside a STEP_NAME annotation; the path of the new xplane.pb.

  log_dir gets TensorBoard's layout (plugins/profile/<run>/*.xplane.pb) and a Perfetto
  trace beside it (perfetto_trace.json.gz, for ui.perfetto.dev).
  """
  import jax
  before = set(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.xplane.pb")))
  with jax.profiler.trace(log_dir, create_perfetto_trace=True):
    for i in range(steps):
      with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=i):
        run_step()
  new = set(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.xplane.pb")))
  if not new - before:
    raise RuntimeError(f"{log_dir}: jax.profiler wrote no xplane.pb")
  return max(new - before, key=os.path.getmtime)
