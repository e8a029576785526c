"""`model.remat_policy="auto"`: the remat policy with the least recomputation whose
compiled train step fits the device, chosen by compiling it.

  model, choice = resolve_remat(model, optimizer, schedule, mesh, rules, batch_shapes)
  choice.policy, choice.summary(), choice.reasons()

Candidates in order of recomputation (models/transformer.py REMAT_POLICIES): 'none'
keeps every activation; 'dots' (jax.checkpoint_policies.checkpoint_dots) keeps every
matmul output and recomputes the elementwise ops between them; 'dots_no_batch' keeps
only the matmuls without batch dimensions (the projections, not attention's scores and
weighted values), so it also recomputes attention's matmuls; 'full' keeps only each
layer's input and recomputes the whole layer. Each is compiled in that order
(plan/compiled.py, XLA's own memory_analysis per device) until one fits, so a roomy
device pays one extra compile; when none fits the choice is 'full' and says so. This is
MaxText's way on TPU (compile, read the memory, pick), applied on every backend.

On XLA:CPU remat's recomputation is merged back into the forward unless the layers are
scanned (plan/memory.py effective_remat_policy), and the host's RAM is large: 'none'
normally fits there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

from t5x_like.models import build_model
from t5x_like.parallel.device_memory import local_device_memory
from t5x_like.plan.fit import OverMemory, compiled_total_bytes

AUTO = "auto"
# Least recomputation first: the order the candidates are compiled in.
REMAT_ORDER = ("none", "dots", "dots_no_batch", "full")
# The fraction of a device's memory a chosen step may take: the compiler's analysis
# leaves out the runtime's own buffers (allocator fragmentation, collectives' scratch,
# the input pipeline's prefetched batches), so 10% stays free for them.
MEMORY_HEADROOM = 0.9
_GIB = float(1 << 30)


def _size(n: float) -> str:
  """Bytes in GiB, or MiB under 1 GiB (a CPU smoke step takes a few MiB)."""
  return f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / (1 << 20):.2f} MiB"

TotalOf = Callable[[str], int]  # remat policy -> compiled total bytes per device


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One compiled policy: total_bytes per device, whether it fits the budget, and
  whether the compiler refused it for memory (then total_bytes is what the compiler
  said the program needs, None when it did not say)."""
  policy: str
  total_bytes: Optional[int]
  fits: bool
  refused: bool = False


@dataclasses.dataclass(frozen=True)
class RematChoice:
  """What auto picked and why. budget_bytes = headroom x memory_bytes; fits is False
  when no candidate fit (the policy is then 'full'); by: 'compiled' or 'estimate'."""
  policy: str
  fits: bool
  memory_bytes: Optional[int]
  budget_bytes: Optional[int]
  candidates: tuple[Candidate, ...]
  by: str = "compiled"

  def summary(self) -> str:
    """'remat auto: chose dots (compiled 11.20 GiB of 16.00 GiB; none needed 17.50 GiB)'."""
    if self.memory_bytes is None:
      return f"remat auto: chose {self.policy} (the device's memory is unknown)"
    needed = lambda c: ("more (refused by the compiler)" if c.total_bytes is None
                        else _size(c.total_bytes))
    chosen = self.candidates[-1]  # the first that fits, else 'full', the last compiled
    text = f"remat auto: chose {self.policy} ({self.by} {needed(chosen)} of" \
           f" {_size(self.memory_bytes)}"
    if self.policy != "none":
      text += f"; none needed {needed(self.candidates[0])}"
    text += ")"
    if not self.fits:
      text += (f"; nothing fits {MEMORY_HEADROOM:.0%} of the device: lower"
               " train.batch_size or raise train.microbatches")
    return text

  def reasons(self) -> list[str]:
    """One line per compiled candidate: its memory against the budget, or 'over'."""
    lines = []
    for c in self.candidates:
      if c.refused:
        needs = "" if c.total_bytes is None else f", needs {c.total_bytes / _GIB:.3f} GiB"
        lines.append(f"{c.policy}: over (refused by the compiler{needs})")
        continue
      sign, verdict = ("<=", "fits") if c.fits else (">", "over")
      lines.append(f"{c.policy}: {c.total_bytes / _GIB:.3f} GiB {sign}"
                   f" {self.budget_bytes / _GIB:.3f} GiB budget ({verdict})")
    return lines

  def to_json(self) -> dict:
    return {"policy": self.policy, "fits": self.fits, "by": self.by,
            "memory_bytes": self.memory_bytes, "budget_bytes": self.budget_bytes,
            "headroom": MEMORY_HEADROOM,
            "candidates": [dataclasses.asdict(c) for c in self.candidates]}


def choose_remat(total_of: TotalOf, memory_bytes: Optional[int], *,
                 headroom: float = MEMORY_HEADROOM, by: str = "compiled") -> RematChoice:
  """The first policy of REMAT_ORDER whose total_of(policy) <= headroom x memory_bytes.

  total_of may raise fit.OverMemory (the compiler refused the program for memory): that
  policy does not fit; any other error propagates. memory_bytes None (unknown): 'none'
  without compiling anything.
  """
  if memory_bytes is None:
    return RematChoice("none", True, None, None, (), by)
  budget = int(headroom * memory_bytes)
  candidates = []
  for policy in REMAT_ORDER:
    try:
      total, refused = int(total_of(policy)), False
    except OverMemory as e:
      total, refused = e.required_bytes, True
    fits = not refused and total <= budget
    candidates.append(Candidate(policy, total, fits, refused))
    if fits:
      return RematChoice(policy, True, memory_bytes, budget, tuple(candidates), by)
  return RematChoice("full", False, memory_bytes, budget, tuple(candidates), by)


def with_policy(model, policy: str):
  """`model` rebuilt with remat_policy=policy (the same architecture otherwise)."""
  if model.config.remat_policy == policy:
    return model
  return build_model(dataclasses.replace(model.config, remat_policy=policy))


def compiled_totals(model, optimizer, schedule, mesh, rules, batch_shapes,
                    microbatches: int = 1, rebuild=with_policy, zero_stage: int = 0) -> TotalOf:
  """policy -> the compiled train step's total bytes per device (memory_analysis) of
  rebuild(model, policy) on `mesh`; fit.OverMemory when the compiler refuses it."""

  def total_of(policy: str) -> int:
    return compiled_total_bytes(rebuild(model, policy), optimizer, schedule, mesh, rules,
                                batch_shapes, microbatches, zero_stage)

  return total_of


def resolve_remat(model, optimizer, schedule, mesh, rules, batch_shapes, *,
                  microbatches: int = 1, memory_bytes: Optional[int] = None,
                  headroom: float = MEMORY_HEADROOM, rebuild=with_policy,
                  zero_stage: int = 0):
  """(model with the chosen policy, RematChoice) for a train step of `batch_shapes`
  (feature -> global shape) on `mesh`, compiled per candidate (choose_remat).

  memory_bytes: one device's memory (default: local_device_memory() of the devices here).
  rebuild(model, policy): the model with that policy (default with_policy: a pretraining
  model; a fine-tuning model passes its own constructor).
  """
  if memory_bytes is None:
    memory_bytes = local_device_memory()
  choice = choose_remat(compiled_totals(model, optimizer, schedule, mesh, rules, batch_shapes,
                                        microbatches, rebuild, zero_stage), memory_bytes,
                        headroom=headroom)
  return rebuild(model, choice.policy), choice


def largest_shapes(shapes: list[dict]) -> dict:
  """Of several phases' batch shapes, the one with the most tokens (then the longest
  rows): the phase whose step needs the most memory, which the choice must fit."""
  def size(s: dict) -> tuple:
    return (sum(math.prod(v) for v in s.values()), max(max(v[1:], default=0) for v in s.values()))
  return max(shapes, key=size)


def resolve_config_remat(config, model, optimizer, schedule, mesh, rules, vocab=None, *,
                         batch_shapes=None, memory_bytes: Optional[int] = None):
  """(model, RematChoice) when config.model.remat_policy is 'auto', else (model, None).

  The step compiled is that of the phase with the largest batch (config.train.phases,
  shapes from plan/shapes.py with `vocab`), or of `batch_shapes` when given.
  """
  if config.model.remat_policy != AUTO:
    return model, None
  if batch_shapes is None:
    from t5x_like.experiment import phase_configs
    from t5x_like.plan.shapes import batch_shapes_for
    batch_shapes = largest_shapes([batch_shapes_for(phase, vocab)
                                   for _, phase in phase_configs(config)])
  return resolve_remat(model, optimizer, schedule, mesh, rules, batch_shapes,
                       microbatches=int(config.train.microbatches or 1),
                       memory_bytes=memory_bytes, zero_stage=config.mesh.zero_stage)


def plan_remat(config, model, optimizer, schedule, rules, phase_shapes: list[dict], *,
               memory_bytes: Optional[int], real_mesh=None, estimate_total=None):
  """`plan`'s choice for config.model.remat_policy='auto' (None otherwise): compiled on
  real_mesh (the devices present, or a deviceless TPU slice) when there is one, else
  from estimate_total(model with the policy, batch_shapes) -> bytes (plan/memory.py)."""
  if config.model.remat_policy != AUTO:
    return None
  shapes = largest_shapes(phase_shapes)
  microbatches = int(config.train.microbatches or 1)
  if real_mesh is not None:
    total_of = compiled_totals(model, optimizer, schedule, real_mesh, rules, shapes,
                               microbatches, zero_stage=config.mesh.zero_stage)
    return choose_remat(total_of, memory_bytes)
  return choose_remat(lambda policy: estimate_total(with_policy(model, policy), shapes),
                      memory_bytes, by="estimate")


def choice_lines(choice: Optional[dict]) -> list[str]:
  """The plan's text of RematChoice.to_json(): what auto picked, then each candidate."""
  if not choice:
    return []
  gib = lambda n: f"{n / _GIB:.3f} GiB"
  if choice["memory_bytes"] is None:
    return [f"remat auto: chose {choice['policy']} (the device's memory is unknown)"]
  how = ("by compiling each" if choice["by"] == "compiled" else
         "by the estimate (no compile: --compile=yes compiles each)")
  head = (f"remat auto: chose {choice['policy']} {how}, least recomputation first, against"
          f" {choice['headroom']:.0%} of {gib(choice['memory_bytes'])}"
          f" = {gib(choice['budget_bytes'])}")
  if not choice["fits"]:
    head += "; NOTHING FITS, took full"
  lines = [head]
  for c in choice["candidates"]:
    size = gib(c["total_bytes"]) if c["total_bytes"] is not None else "?"
    if c["refused"]:
      size = f"over (refused by the compiler; needs {size})"
    lines.append(f"  {c['policy']:<14} {size:>16}  {'fits' if c['fits'] else 'over'}")
  return lines
