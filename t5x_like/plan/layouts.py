"""`plan` chooses the layout: compile each candidate's train step and keep the fastest
that fits, by the compiled program's own numbers (bounds, not measured times).

  result = search_layouts(config, topology, devices, chip)   # compiles len(candidates)
  result["rows"], result["chosen"]["overrides"], result["chosen"]["mfu_ceiling"]

A candidate is a split of the devices into data x fsdp x tensor, a ZeRO stage
(mesh.zero_stage), the microbatches per step (rows per device within the recipe's global
batch: gradient accumulation where the rows do not fit) and a remat policy; the attention
kernel is the config's. Each is compiled for the largest phase (the most tokens per
step) and read as plan --compile reads a step: the compiler's memory per device against
the HBM, the roofline (roofline.py: compute + memory + collectives) with the attention
kernels' hidden FLOPs added, the MFU ceiling, and XLA's own cost_analysis() FLOPs and
bytes beside ours. The ranking key is the compiler's estimated step time where the
program carries libtpu's estimate (compiler_estimate.py), else the roofline; a
candidate over the HBM, or refused by the compiler, is never chosen.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Any, Callable, Iterable, Optional

import ml_collections

from t5x_like.plan import compiled as compiled_lib
from t5x_like.plan import fit as fit_lib
from t5x_like.plan import roofline as roofline_lib
from t5x_like.plan.shapes import model_vocab_size, plan_phases
from t5x_like.train import flops as flops_lib
from t5x_like.experiment import build_mesh, build_model_from_config, config_vocab
from t5x_like.train.optimizers import make_optimizer


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One layout: mesh axis sizes, ZeRO stage, microbatches, remat policy (None: the
  config's)."""

  data: int
  fsdp: int = 1
  tensor: int = 1
  zero_stage: int = 0
  microbatches: int = 1
  remat: Optional[str] = None

  def overrides(self) -> list[str]:
    """The `--config.` flags that give a config this layout."""
    out = [f"--config.mesh.data={self.data}", f"--config.mesh.fsdp={self.fsdp}",
           f"--config.mesh.tensor={self.tensor}", f"--config.mesh.zero_stage={self.zero_stage}",
           f"--config.train.microbatches={self.microbatches}"]
    if self.remat is not None:
      out.append(f"--config.model.remat_policy={self.remat}")
    return out

  def apply(self, config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of `config` with this layout (dcn axes left as they are)."""
    out = ml_collections.ConfigDict(config.to_dict())
    out.mesh.data, out.mesh.fsdp, out.mesh.tensor = self.data, self.fsdp, self.tensor
    out.mesh.zero_stage = self.zero_stage
    out.train.microbatches = self.microbatches
    if self.remat is not None:
      out.model.remat_policy = self.remat
    return out

  def name(self) -> str:
    text = f"data {self.data} x fsdp {self.fsdp} x tensor {self.tensor}, zero {self.zero_stage}"
    if self.microbatches > 1:
      text += f", {self.microbatches} microbatches"
    return text + (f", remat {self.remat}" if self.remat else "")


def candidates(config: ml_collections.ConfigDict, num_devices: int, *,
               fsdp: Iterable[int] = (1, 2, 4, 8), tensor: Iterable[int] = (1, 2),
               zero_stages: Iterable[int] = (0, 1, 2), microbatches: Iterable[int] = (1,),
               remat: Iterable[Optional[str]] = (None,)) -> list[Candidate]:
  """The layouts of `config` on `num_devices` (one slice): every (fsdp, tensor) that
  divides the devices, data the rest, where each microbatch still splits over the batch
  shards; ZeRO stages above 0 only where data > 1 (they split over it)."""
  batch = int(config.train.batch_size)
  out = []
  for f, t, z, m, r in itertools.product(fsdp, tensor, zero_stages, microbatches, remat):
    if num_devices % (f * t):
      continue
    d = num_devices // (f * t)
    if batch % (d * f * m) or (z and d == 1):
      continue
    out.append(Candidate(d, f, t, z, m, r))
  return out


def _largest_phase(config, vocab):
  phases = plan_phases(config, vocab)
  return max(phases, key=lambda p: sum(math.prod(s) for s in p.batch_shapes.values()))


def evaluate(config: ml_collections.ConfigDict, candidate: Candidate, devices,
             chip: Optional[roofline_lib.Chip], memory_bytes: int) -> dict[str, Any]:
  """One candidate compiled on `devices`: its row of the table (see the module doc)."""
  cfg = candidate.apply(config)
  vocab = config_vocab(cfg, shapes_only=True)
  model = build_model_from_config(cfg, model_vocab_size(cfg, vocab))
  optimizer, schedule = make_optimizer(cfg.optimizer, cfg.train.num_steps)
  phase = _largest_phase(cfg, vocab)
  row: dict[str, Any] = {"layout": dataclasses.asdict(candidate), "name": candidate.name(),
                         "overrides": candidate.overrides(), "phase": phase.index,
                         "fits": False, "refused": None}
  began = time.monotonic()
  try:
    mesh, rules = build_mesh(cfg, devices)
    xla = compiled_lib.compile_train_step(model, optimizer, schedule, mesh, rules,
                                          phase.batch_shapes, candidate.microbatches,
                                          chip=chip, zero_stage=candidate.zero_stage)
  except Exception as e:  # the compiler's refusal for HBM is a row, not an error
    refusal = fit_lib.over_memory(e)
    if refusal is None:
      raise
    row["refused"] = refusal.to_json()
    row["compile_seconds"] = time.monotonic() - began
    return row
  row["compile_seconds"] = time.monotonic() - began
  total = xla["memory"]["total_bytes"]
  row["memory_bytes"] = total
  row["fits"] = not memory_bytes or total <= memory_bytes
  flops = flops_lib.train_flops_per_step(model, phase.batch_shapes)
  bound = xla.get("roofline")
  if bound is not None:
    bound = roofline_lib.with_hidden_attention_flops(bound, model, phase.batch_shapes, flops,
                                                     mesh.size)
    row.update(roofline_seconds=bound["seconds"], compute_seconds=bound["compute_seconds"],
               memory_seconds=bound["memory_seconds"],
               collective_seconds=bound["collective_seconds"],
               mfu_ceiling=bound["mfu_ceiling"], hlo_flops=bound["flops"],
               hlo_bytes=bound["bytes"], xla_flops=bound.get("xla_flops"),
               xla_bytes_accessed=bound.get("xla_bytes_accessed"))
  estimate = xla.get("compiler_estimate")  # the whole step: estimated + the rest
  if estimate and estimate.get("ops_with_estimate") and estimate.get("combined_seconds"):
    row["estimated_seconds"] = estimate["combined_seconds"]
    row["estimated_mfu"] = flops / (estimate["combined_seconds"] * mesh.size *
                                    chip.peak_flops) if chip else None
  return row


def rank_key(row: dict) -> tuple:
  """Fitting rows first, then by the compiler's estimate where every fitting row has one,
  else by the roofline."""
  return (not row["fits"], row.get("rank_seconds", math.inf))


def choose(rows: list[dict]) -> Optional[dict]:
  """The fastest fitting row (rank_key), None when none fits. Sets each row's
  rank_seconds and rank_by ('compiler estimate' where all fitting rows carry one)."""
  fitting = [r for r in rows if r["fits"]]
  by_estimate = bool(fitting) and all(r.get("estimated_seconds") for r in fitting)
  for row in rows:
    key = row.get("estimated_seconds") if by_estimate else row.get("roofline_seconds")
    row["rank_seconds"] = math.inf if key is None else key
    row["rank_by"] = "compiler estimate" if by_estimate else "roofline"
  ranked = sorted(rows, key=rank_key)
  return ranked[0] if ranked and ranked[0]["fits"] else None


def search_layouts(config: ml_collections.ConfigDict, devices,
                   chip: Optional[roofline_lib.Chip], memory_bytes: int,
                   layouts: Optional[list[Candidate]] = None,
                   progress: Optional[Callable[[dict], None]] = None) -> dict[str, Any]:
  """Compiles every candidate (default: candidates(config, len(devices))) on `devices`
  and chooses one: {'rows': [...], 'chosen': the row or None}."""
  layouts = candidates(config, len(devices)) if layouts is None else layouts
  if not layouts:
    raise ValueError(f"no layout of train.batch_size={config.train.batch_size} splits over"
                     f" {len(devices)} devices")
  rows = []
  for candidate in layouts:
    rows.append(evaluate(config, candidate, devices, chip, memory_bytes))
    if progress is not None:
      progress(rows[-1])
  return {"rows": rows, "chosen": choose(rows)}


def _ms(seconds: Optional[float]) -> str:
  return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _pct(x: Optional[float]) -> str:
  return "-" if x is None else f"{100 * x:.0f}%"


def search_lines(result: dict[str, Any]) -> list[str]:
  """The search as text: one line per candidate, then the chosen layout's flags."""
  from t5x_like.plan.text import human_bytes
  lines = ["layout search (compiled train step of the largest phase, per device; bounds read"
           " from the compiled program, not measured times):",
           "  layout | memory | roofline ms = compute + memory + collectives | MFU ceiling |"
           " compiler ms (MFU) | FLOPs ours / XLA | bytes ours / XLA"]
  for r in result["rows"]:
    if r["refused"] is not None:
      lines.append(f"  {r['name']} | refused by the compiler: {r['refused'].get('message', '')[:80]}")
      continue
    memory = human_bytes(r["memory_bytes"]) + ("" if r["fits"] else " (over HBM)")
    terms = (f"{_ms(r.get('roofline_seconds'))} = {_ms(r.get('compute_seconds'))} +"
             f" {_ms(r.get('memory_seconds'))} + {_ms(r.get('collective_seconds'))}")
    estimate = (f"{_ms(r['estimated_seconds'])} ({_pct(r.get('estimated_mfu'))})"
                if r.get("estimated_seconds") else "none")
    flops = f"{r.get('hlo_flops') or 0:.3g} / {r.get('xla_flops') or 0:.3g}"
    moved = (f"{human_bytes(r.get('hlo_bytes') or 0)} /"
             f" {human_bytes(r.get('xla_bytes_accessed') or 0)}")
    lines.append(f"  {r['name']} | {memory} | {terms} | {_pct(r.get('mfu_ceiling'))} |"
                 f" {estimate} | {flops} | {moved}")
  chosen = result["chosen"]
  if chosen is None:
    lines.append("chosen: none fits")
  else:
    lines.append(f"chosen by the {chosen['rank_by']} ({chosen['name']}; MFU ceiling"
                 f" {_pct(chosen.get('mfu_ceiling'))}): {' '.join(chosen['overrides'])}")
  return lines
