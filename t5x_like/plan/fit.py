"""The largest per-device batch whose train step fits the device, by the compiler's own
memory analysis.

  compile_rows = train_step_compiler(phase, model, optimizer, schedule, mesh, rules, vocab)
  found = search(compile_rows, rows0=16, total0=xla_total_at_16, memory_bytes=16 * GiB)
  found["rows"], found["total_bytes"], found["compiles"]

Rows are per device: the global batch is rows x (mesh data x fsdp), set through the
phase's config.train.batch_size, so the objective gives every feature its shape. The
search fits memory = a + b * rows through two compiles (the configured rows and twice
or half of them), predicts r* = floor((memory - a) / b) and compiles r* to confirm it,
stepping down 10% when it does not fit, or, when it fits with over 5% of the memory
left, predicting again from the line through the two largest fits (at most two
confirmations). A program over HBM may also be refused by libtpu's compiler
(RESOURCE_EXHAUSTED): that counts as does-not-fit, and when it refuses the configured
batch itself, search_below halves it until a size compiles and searches up from there
(plan --compile=yes on a slice too small for the recipe). Only the train step is
compiled: it holds the optimizer state and the backward pass, so it is the
larger of the two.
"""

from __future__ import annotations

import math
import re
import time
from typing import Callable, Optional

import ml_collections

from t5x_like.plan import compiled as compiled_lib
from t5x_like.plan.shapes import batch_shapes_for

CompileRows = Callable[[int], int]  # rows per device -> compiler's total bytes per device
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class OverMemory(Exception):
  """The TPU compiler refused the program: it does not fit HBM (RESOURCE_EXHAUSTED).

  required_bytes: what the message says the program needs (None when it does not say;
  a lower bound when it names the temporaries only); available_bytes: the HBM the
  compiler allows a program (a little under the chip's: it reserves some).
  """

  def __init__(self, message: str, required_bytes: Optional[int],
               available_bytes: Optional[int], required_for: str = "the program"):
    super().__init__(message)
    self.required_bytes, self.available_bytes = required_bytes, available_bytes
    self.required_for = required_for  # 'the program' or 'HLO temporaries' (a lower bound)

  def to_json(self) -> dict:
    return {"message": str(self), "required_bytes": self.required_bytes,
            "required_for": self.required_for, "available_bytes": self.available_bytes}


def _size(text: str) -> int:
  """'17.53G' -> bytes (XLA prints binary units)."""
  m = re.fullmatch(r"([\d.]+)\s*([KMGT]?)i?B?", text.strip())
  return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else 0


def over_memory(error: BaseException) -> Optional[OverMemory]:
  """OverMemory from a compile error that says the program does not fit HBM, else None.

  Reads 'Used 17.53G of 15.75G hbm' and '... required for HLO temporaries (48.00G)
  exceeds available HBM (15.75G)', the two forms libtpu's compiler writes.
  """
  text = str(error)
  if "RESOURCE_EXHAUSTED" not in text or not re.search(r"(?i)memory|hbm", text):
    return None
  used = re.search(r"Used ([\d.]+[KMGT]?B?) of ([\d.]+[KMGT]?B?) hbm", text)
  temps = re.search(r"\(([\d.]+[KMGT]?B?)\) exceeds available HBM \(([\d.]+[KMGT]?B?)\)",
                    text)
  found = used or temps
  return OverMemory(text.strip().splitlines()[0], _size(found.group(1)) if found else None,
                    _size(found.group(2)) if found else None,
                    "HLO temporaries" if temps and not used else "the program")


def row_step(batch_shards: int, microbatches: int) -> int:
  """The rows-per-device granularity that keeps rows x shards divisible by microbatches."""
  return microbatches // math.gcd(microbatches, batch_shards)


def compiled_total_bytes(model, optimizer, schedule, mesh, rules, batch_shapes,
                         microbatches: int = 1, zero_stage: int = 0) -> int:
  """The compiled train step's total bytes per device (memory_analysis); OverMemory when
  the compiler refuses it for HBM (libtpu does at compile time)."""
  try:
    xla = compiled_lib.compile_train_step(model, optimizer, schedule, mesh, rules,
                                          batch_shapes, microbatches, eval_step=False,
                                          zero_stage=zero_stage)
  except Exception as e:
    refused = over_memory(e)
    if refused is None:
      raise
    raise refused from e
  return int(xla["memory"]["total_bytes"])


def train_step_compiler(phase, model, optimizer, schedule, mesh, rules, vocab) -> CompileRows:
  """rows -> the compiled train step's total bytes per device (memory_analysis) for a
  global batch of rows x (data x fsdp) of phase's objective on `mesh`; OverMemory when
  the compiler refuses it for HBM."""
  shards = int(mesh.shape["data"]) * int(mesh.shape["fsdp"])
  microbatches = int(phase.config.train.microbatches or 1)

  def compile_rows(rows: int) -> int:
    config = ml_collections.ConfigDict(phase.config.to_dict())
    config.train.batch_size = rows * shards
    return compiled_total_bytes(model, optimizer, schedule, mesh, rules,
                                batch_shapes_for(config, vocab), microbatches,
                                config.mesh.zero_stage)

  return compile_rows


def _line(p: tuple[int, int], q: tuple[int, int]) -> tuple[float, float]:
  """(a, b) of total = a + b * rows through two (rows, total) points."""
  (r0, t0), (r1, t1) = p, q
  b = (t1 - t0) / (r1 - r0)
  return t0 - b * r0, b


def search(compile_rows: CompileRows, rows0: int, total0: int, memory_bytes: int, *,
           step: int = 1, max_confirm: int = 2, deadline: Optional[float] = None,
           resume: Optional[dict] = None) -> dict:
  """The largest rows (a multiple of `step`) whose compiled total <= memory_bytes.

  rows0, total0: the configured rows per device and the compiler's total there (already
  compiled). compile_rows raising OverMemory counts as does-not-fit (its required bytes,
  when given, serve the line; its available bytes lower memory_bytes). deadline:
  time.monotonic() by which compiles must end: none starts that the last one's duration
  would carry past it (the result then says 'stopped'). resume: an earlier result of this
  search (one that stopped): its compiled sizes and limit count as known, so the search
  goes on where it stopped without compiling them again. Returns {rows, total_bytes,
  compiles (beyond the first), predicted_rows, line: {a, b}, tried: [{rows, total_bytes,
  fits, refused}], next_over, limit_bytes, seconds, stopped}: rows is the largest tried
  rows that fit (0 when none), next_over the smallest tried rows above it that does not
  (None when none was tried).
  """
  start = time.monotonic()
  tried = {rows0: total0}  # rows -> total bytes (None: refused, its need unknown)
  refused = set()  # rows the compiler refused for HBM (then tried[rows] is a lower bound)
  order = [rows0]
  limit = [memory_bytes]  # lowered to what the compiler says it allows, once it says
  for t in (resume or {}).get("tried", []):
    if t["rows"] not in tried:
      tried[t["rows"]] = t["total_bytes"]
      order.append(t["rows"])
    if t["refused"]:
      refused.add(t["rows"])
  if resume and resume.get("limit_bytes"):  # rows written before limit_bytes lack it
    limit[0] = min(limit[0], resume["limit_bytes"])
  fits = lambda rows: rows not in refused and tried[rows] <= limit[0]
  stopped = None

  last = [0.0]  # the last compile's seconds: a compile that would end past deadline waits

  def measure(rows: int) -> bool:
    nonlocal stopped
    if rows in tried:
      return True
    if deadline is not None and time.monotonic() + last[0] > deadline:
      stopped = f"time budget spent before compiling {rows} rows"
      return False
    began = time.monotonic()
    try:
      tried[rows] = compile_rows(rows)
    except OverMemory as e:
      tried[rows] = e.required_bytes
      refused.add(rows)
      if e.available_bytes:
        limit[0] = min(limit[0], e.available_bytes)
    last[0] = time.monotonic() - began
    order.append(rows)
    return True

  second = 2 * rows0 if fits(rows0) else (rows0 // 2) // step * step
  predicted, line = None, None
  if second >= step and measure(second) and tried[second] is not None and total0 is not None:
    a, b = _line((rows0, total0), (second, tried[second]))
    line = {"a": a, "b": b}
    if b > 0:
      predicted = int(math.floor((limit[0] - a) / b)) // step * step
      rows, confirms = predicted, 0
      while rows >= step and confirms < max_confirm:
        best = max((r for r in tried if fits(r)), default=0)
        if rows <= best:
          break  # the step-down reached a size known to fit
        new = rows not in tried
        if not measure(rows):
          break
        confirms += new
        if fits(rows):
          # Memory grows slower than the line at large batches (XLA reuses buffers): with
          # room left, a second line through the two largest fits predicts further.
          if confirms >= max_confirm or limit[0] - tried[rows] <= 0.05 * limit[0]:
            break
          lower = max(r for r in tried if fits(r) and r < rows)
          a2, b2 = _line((lower, tried[lower]), (rows, tried[rows]))
          further = int(math.floor((limit[0] - a2) / b2)) // step * step if b2 > 0 else 0
          if further <= rows:
            break
          rows = further
          continue
        rows = min(int(rows * 0.9), rows - step) // step * step
  best = max((r for r in tried if fits(r)), default=0)
  over = min((r for r in tried if r > best and not fits(r)), default=None)
  return {"rows": best, "total_bytes": tried.get(best), "compiles": len(order) - 1,
          "predicted_rows": predicted, "line": line, "next_over": over,
          "tried": [{"rows": r, "total_bytes": tried[r], "fits": fits(r),
                     "refused": r in refused} for r in order],
          "limit_bytes": limit[0], "seconds": time.monotonic() - start, "stopped": stopped}


def search_below(compile_rows: CompileRows, rows0: int, refusal: OverMemory,
                 memory_bytes: int, *, step: int = 1, refine: bool = False,
                 deadline: Optional[float] = None) -> dict:
  """The largest rows that compile within memory_bytes after the compiler refused rows0.

  Halves rows0 (to a multiple of `step`) until a compile fits: a refusal is quick (10-20
  s for GPT-2 124M on 2 cores), a program that compiles takes minutes. With refine,
  then search() from that size with the larger ones as known (the line through the fit
  and the refusal above it, then at most two confirming compiles). Either way the rows
  found are ones the compiler accepted. Returns search()'s dict, 'tried' in compile
  order from rows0, 'halved' True without refine (rows 0 when even `step` rows are over
  or the deadline came first).
  """
  start = time.monotonic()
  tried = [{"rows": rows0, "total_bytes": refusal.required_bytes, "fits": False,
            "refused": True}]
  limit = min(memory_bytes, refusal.available_bytes or memory_bytes)
  rows, total, stopped = rows0, None, None
  while total is None:
    rows = (rows // 2) // step * step
    if rows < step:
      break
    if deadline is not None and time.monotonic() > deadline:
      stopped = f"time budget spent before compiling {rows} rows"
      break
    try:
      total = compile_rows(rows)
    except OverMemory as e:
      tried.append({"rows": rows, "total_bytes": e.required_bytes, "fits": False,
                    "refused": True})
      limit = min(limit, e.available_bytes or limit)
      continue
    if total > limit:
      tried.append({"rows": rows, "total_bytes": total, "fits": False, "refused": False})
      total = None
  if total is None or not refine:
    if total is not None:
      tried.append({"rows": rows, "total_bytes": total, "fits": True, "refused": False})
    return {"rows": 0 if total is None else rows, "total_bytes": total,
            "compiles": len(tried) - 1, "predicted_rows": None, "line": None,
            "next_over": min(t["rows"] for t in tried if not t["fits"]), "tried": tried,
            "limit_bytes": limit, "seconds": time.monotonic() - start, "stopped": stopped,
            "halved": True}
  found = search(compile_rows, rows, total, memory_bytes, step=step, deadline=deadline,
                 resume={"tried": tried, "limit_bytes": limit})
  # search() lists its first size (the halving's fit) before the resumed ones
  first, known = found["tried"][:1], found["tried"][1:len(tried) + 1]
  found["tried"] = known + first + found["tried"][len(tried) + 1:]
  found["seconds"], found["halved"] = time.monotonic() - start, False
  return found


def phase_fitter(model, optimizer, schedule, mesh, rules, vocab, memory_bytes: int,
                 deadline: Optional[float] = None,
                 resume: Optional[dict] = None) -> Callable[..., dict]:
  """(phase, total0) -> search()'s result for that phase, where total0 is the compiler's
  total of the train step at the phase's configured batch (make_plan's compile);
  resume: an earlier search's result to go on from (see search). (phase, None, refusal)
  when the compiler refused the configured batch (OverMemory): search_below()'s, refined
  by search() when refine."""
  shards = int(mesh.shape["data"]) * int(mesh.shape["fsdp"])

  def fit(phase, total0: Optional[int], refusal: Optional[OverMemory] = None,
          refine: bool = True) -> dict:
    batch = int(phase.config.train.batch_size)
    step = row_step(shards, int(phase.config.train.microbatches or 1))
    compile_rows = train_step_compiler(phase, model, optimizer, schedule, mesh, rules, vocab)
    if refusal is not None:
      out = search_below(compile_rows, batch // shards, refusal, memory_bytes, step=step,
                         refine=refine, deadline=deadline)
    else:
      out = search(compile_rows, batch // shards, total0, memory_bytes, step=step,
                   deadline=deadline, resume=resume)
    out["configured_rows"] = batch // shards
    out["global_batch"] = out["rows"] * shards
    return out

  return fit
