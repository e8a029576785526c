"""A whole plan of a config on a topology, as one JSON-able dict.

  report = make_plan(config, topology, mfu=0.4, compile_step="auto")

Per config: the model, its parameters by group with their shardings, and the mesh.
Per phase (config.train.phases, else one): batch shapes, FLOPs per step
(train/flops.py), step time and wall-clock at the assumed MFU, the per-device memory
estimate (memory.py) and whether it fits; where the topology's devices are present
(or, with compile_step='yes', a TPU slice libtpu can describe), XLA's analyses of the
compiled train and eval steps beside them: memory, FLOPs, collectives, fused kernels,
the roofline step time (roofline.py) with its MFU ceiling, against which the assumed
MFU is judged ('assumed_mfu'), and on TPU libtpu's own estimated step time and MFU
(compiler_estimate.py, xla['compiler_estimate']).
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import jax
import ml_collections

from t5x_like import parallel
from t5x_like.data.mixture import describe_data
from t5x_like.models.attention_core import tracing_for
from t5x_like.plan import compiled as compiled_lib
from t5x_like.plan import compiler_estimate as estimate_lib
from t5x_like.plan import fit as fit_lib
from t5x_like.plan import remat as remat_lib
from t5x_like.plan.memory import estimate_memory, per_device_batch_shapes
from t5x_like.plan.params import param_table, spec_str
from t5x_like.plan.shapes import Phase, model_vocab_size, plan_phases
from t5x_like.plan import tpu as tpu_lib
from t5x_like.plan.topology import Topology, planned_mesh
from t5x_like.plan import roofline as roofline_lib
from t5x_like.train import flops as flops_lib
from t5x_like.train.config_check import validate
from t5x_like.experiment import (build_mesh, build_model_from_config, config_vocab,
                                 mesh_rules)
from t5x_like.train.optimizers import make_optimizer

COMPILE_CHOICES = ("auto", "yes", "no")


def _model_json(config, model) -> dict:
  cfg = model.config
  # The layers beyond num_layers: T5's decoder stack, 0 for the one-stack families.
  decoder_layers = sum(model.stack_layers(cfg).values()) - cfg.num_layers
  return {"preset": config.model.preset, "family": cfg.family, "layers": cfg.num_layers,
          "decoder_layers": decoder_layers,
          "d_model": cfg.d_model, "heads": cfg.num_heads, "kv_heads": cfg.kv_heads,
          "d_ff": cfg.d_ff, "vocab_size": cfg.vocab_size, "dtype": cfg.dtype,
          "remat_policy": cfg.remat_policy, "scan_layers": cfg.scan_layers}


def _topology_json(topology: Topology) -> dict:
  return {"name": topology.name, "platform": topology.platform,
          "device_kind": topology.device_kind, "num_devices": topology.num_devices,
          "num_slices": topology.num_slices,
          "num_hosts": topology.num_hosts, "peak_flops_per_device": topology.peak_flops,
          "memory_bytes_per_device": topology.memory_bytes}


def _params_json(table, model) -> dict:
  return {"total": table.total, "model_num_params": model.num_params(),
          "bytes_per_device": table.bytes_per_device,
          "groups": {name: {"params": g.params, "bytes_per_device": g.bytes_per_device,
                            "rows": [r.to_json() for r in g.rows]}
                     for name, g in table.groups.items()}}


def _notes(config, table, mesh_shape: dict, batch_size: int, topology: Topology,
           compiled: bool) -> list[str]:
  notes = []
  shards = mesh_shape["data"] * mesh_shape["fsdp"]
  if batch_size % shards:
    notes.append(f"train.batch_size={batch_size} does not divide over the {shards} batch"
                 f" shards (mesh data x fsdp): training will refuse to shard it")
  microbatches = int(config.train.microbatches or 1)
  if batch_size % microbatches:
    notes.append(f"train.batch_size={batch_size} is not a multiple of"
                 f" train.microbatches={microbatches}")
  uneven = [r.name for g in table.groups.values() for r in g.rows if r.uneven]
  if uneven:
    notes.append(f"unevenly split (XLA pads them): {', '.join(uneven)}")
  if topology.platform == "cpu" and config.model.remat_policy != "none" and \
     not config.model.scan_layers:
    notes.append("XLA:CPU merges remat's recomputation back into the forward unless"
                 " model.scan_layers is set; the estimate uses remat 'none' here")
  if compiled and config.model.scan_layers:
    notes.append("with model.scan_layers XLA's cost analysis counts the scanned layer body"
                 " once, not once per layer, so its FLOPs fall short of the analytic count; the"
                 " corrected count adds the other layers' matmuls from the HLO")
  return notes


def _phase_json(phase: Phase, model, optimizer, schedule, mesh, table, topology: Topology,
                mfu: float, rules, real_mesh, eval_step: bool = True, fit=None,
                refit=None) -> dict:
  """One phase: shapes, FLOPs, time, memory (and XLA's view when real_mesh is given;
  with `fit`, fit_lib.phase_fitter's, the largest batch that fits under 'fit_batch').

  A compile the compiler refuses for HBM is the plan's finding, not an error: 'xla' is
  None, 'xla_refused' what the compiler said (fit.OverMemory.to_json) and, with `refit`
  (a phase_fitter), 'fit_batch' the largest batch it accepts (fit.search_below); without
  `refit` the refusal propagates. The search halves the batch until it compiles, and
  with `fit` (--fit_batch) searches on between that size and twice it."""
  config = phase.config
  mesh_shape = dict(mesh.shape)
  microbatches = int(config.train.microbatches or 1)
  flops = flops_lib.train_flops_per_step(model, phase.batch_shapes)
  step_seconds = flops / (topology.num_devices * topology.peak_flops * mfu)
  memory = estimate_memory(model, optimizer, mesh, table.shardings, table.abstract_params,
                           phase.batch_shapes, platform=topology.platform,
                           microbatches=microbatches, rules=rules,
                           zero_stage=config.mesh.zero_stage)
  batch_shards = mesh_shape["data"] * mesh_shape["fsdp"]
  out = {
      "index": phase.index, "first_step": phase.first_step, "until_step": phase.until_step,
      "steps": phase.steps, "length": phase.length,
      "options": dict(config.data.options),
      "batch_shapes": {k: list(v) for k, v in phase.batch_shapes.items()},
      "per_device_batch_shapes": {k: list(v) for k, v in per_device_batch_shapes(
          phase.batch_shapes, batch_shards).items()},
      "tokens_per_step": _tokens(phase.batch_shapes),
      "flops_per_step": flops, "flops_per_device": flops / topology.num_devices,
      "flops_breakdown": flops_lib.forward_flops_breakdown(model, phase.batch_shapes),
      "step_seconds": step_seconds, "seconds": step_seconds * phase.steps,
      "step_seconds_at_mfu": step_seconds, "seconds_at_mfu": step_seconds * phase.steps,
      "roofline": None,  # compiled: the step-time bound (roofline.py), then the headline
      "assumed_mfu": None,  # compiled: the assumed MFU against the roofline's ceiling
      "memory": memory.to_json(),
      "fits": _fits(memory.total, topology),
      "xla": None,
  }
  if real_mesh is not None:
    began = time.monotonic()
    try:
      xla = compiled_lib.compile_train_step(model, optimizer, schedule, real_mesh, rules,
                                            phase.batch_shapes, microbatches,
                                            eval_step=eval_step,
                                            chip=roofline_lib.chip_for(topology),
                                            zero_stage=config.mesh.zero_stage)
    except Exception as e:
      refusal = fit_lib.over_memory(e)
      if refusal is None or refit is None:
        raise
      out["xla_refused"] = {**refusal.to_json(), "compile_seconds": time.monotonic() - began}
      out["fit_batch"] = refit(phase, None, refusal, refine=fit is not None)
      return out
    xla["compile_seconds"] = time.monotonic() - began
    xla["memory_ratio"] = memory.total / max(xla["memory"]["total_bytes"], 1)
    _judge(xla, flops, topology)
    if eval_step:
      _judge(xla["eval"], flops_lib.forward_flops(model, phase.batch_shapes),
             topology)
    out["xla"] = xla
    out["roofline"] = _roofline(xla, model, phase, flops, topology)
    if out["roofline"] is not None:
      out["step_seconds"] = out["roofline"]["seconds"]
      out["seconds"] = out["step_seconds"] * phase.steps
      xla["compiler_estimate"] = estimate_lib.with_model_flops(
          xla.get("compiler_estimate"), flops, topology.num_devices,
          out["roofline"]["extra_flops"], out["roofline"].get("extra_flops_source"))
    out["assumed_mfu"] = _assumed_mfu(mfu, out["roofline"], xla.get("compiler_estimate"),
                                      flops, topology, phase.steps)
    if fit is not None:
      out["fit_batch"] = fit(phase, xla["memory"]["total_bytes"])
  return out


def _no_search(phase, total0, refusal, refine) -> None:
  """A refused phase's batch search where the device's memory is unknown: none."""
  return None


def _roofline(xla: dict, model, phase: Phase, flops: float,
              topology: Topology) -> Optional[dict]:
  """The train step's roofline with its MFU ceiling; the FLOPs of attention kernels the
  HLO cannot see (Pallas without a cost estimate) added from the analytic count (3 x
  the forward's attention matmuls, train/flops.py), over the devices."""
  bound = xla.get("roofline")
  if bound is None:
    return None
  hidden = [k for k in bound["uncounted_kernels"] if "attention" in k or "flash" in k]
  extra = 0.0
  if hidden:
    attention = flops_lib.forward_flops_breakdown(model, phase.batch_shapes).get(
        "attention", 0.0)
    extra = 3.0 * attention / topology.num_devices
  return roofline_lib.with_model_flops(
      bound, flops, topology.num_devices, extra,
      f"analytic attention FLOPs for {', '.join(sorted(hidden))}" if hidden else None)


def _assumed_mfu(mfu: float, bound: Optional[dict], estimate: Optional[dict], flops: float,
                 topology: Topology, steps: int) -> Optional[dict]:
  """The assumed MFU against the roofline's MFU ceiling (the best this compiled step can
  reach): above it, the plan's time at that MFU is one the step cannot run in, and the
  time at the ceiling (the roofline's) is the truer one. With libtpu's estimate, its MFU
  (also an upper bound) beside. None without a roofline."""
  ceiling = bound.get("mfu_ceiling") if bound else None
  if not ceiling:
    return None
  at_ceiling = flops / (topology.num_devices * topology.peak_flops * ceiling)
  compiler = estimate.get("mfu") if estimate else None
  return {"mfu": mfu, "ceiling": ceiling, "above_ceiling": mfu > ceiling,
          "step_seconds_at_ceiling": at_ceiling, "seconds_at_ceiling": at_ceiling * steps,
          "compiler_mfu": compiler,
          "above_compiler_mfu": None if compiler is None else mfu > compiler}


def _judge(xla: dict, analytic_flops: float, topology: Topology) -> None:
  """Set the compiled program's fit to the device and its FLOPs over the analytic count."""
  total = xla["memory"]["total_bytes"]
  xla["fits"] = _fits(total, topology)
  xla["headroom_bytes"] = topology.memory_bytes - total if topology.memory_bytes else None
  xla["analytic_flops"] = analytic_flops
  xla["flops_ratio"] = xla["flops"] / analytic_flops if analytic_flops else None
  xla["flops_corrected_ratio"] = (xla["flops_corrected"] / analytic_flops
                                  if analytic_flops else None)


def _tokens(batch_shapes: dict) -> int:
  """Input tokens of one step: the encoder's, plus the decoder's for decoder stacks."""
  return sum(math.prod(batch_shapes[k]) for k in ("encoder_input_tokens", "decoder_input_tokens")
             if k in batch_shapes)


def _fits(total: int, topology: Topology) -> Optional[bool]:
  return total <= topology.memory_bytes if topology.memory_bytes else None


def _make_plan(config: ml_collections.ConfigDict, topology: Topology, *, mfu: float = 0.4,
              compile_step: str = "auto", eval_step: bool = True, fit_batch: bool = False,
              fit_budget_s: Optional[float] = None, fit_resume: Optional[dict] = None,
              search_refused: bool = True) -> dict[str, Any]:
  """The plan of `config` on `topology` (see the module docstring).

  compile_step: 'auto' compiles the real train and eval steps when the topology's devices
  are all present, 'yes' insists: on a TPU topology without its devices it compiles for
  libtpu's description of the slice (minutes for a big model; ValueError naming the
  `tpu` extra when libtpu is missing), elsewhere ValueError; 'no' never compiles.
  eval_step=False compiles the train step only. fit_batch: per phase, also search for the
  largest per-device batch whose train step fits (plan/fit.py; needs the compile and the
  device's memory); no compile of the search starts fit_budget_s after this call began;
  fit_resume: an earlier search's result (fit.search) that stopped, to go on from.
  A phase whose compile the compiler refuses for HBM does not fit: with search_refused
  the phase says so with the largest batch it accepts (_phase_json), else the refusal
  propagates (recipes.py handles it itself).
  """
  start = time.monotonic()
  if not 0.0 < mfu <= 1.0:
    raise ValueError(f"--mfu={mfu}: must be in (0, 1]")
  if compile_step not in COMPILE_CHOICES:
    raise ValueError(f"compile_step={compile_step!r}: expected one of {COMPILE_CHOICES}")
  try:
    mesh = planned_mesh(config.mesh, topology.num_devices)
  except ValueError as e:
    raise ValueError(f"topology {topology.name}: {e}") from None
  dcn = math.prod(int(config.mesh.get(f"dcn_{a}", 1)) for a in parallel.MESH_AXES)
  if topology.num_slices > 1 and dcn != topology.num_slices:
    raise ValueError(f"topology {topology.name} has {topology.num_slices} slices but"
                     f" mesh.dcn_data x mesh.dcn_fsdp x mesh.dcn_tensor = {dcn}: set them"
                     f" to split the mesh across the slices")
  rules = mesh_rules(config)
  vocab = config_vocab(config, shapes_only=True)
  validate(config, topology.num_devices, vocab_size=model_vocab_size(config, vocab),
           platform=topology.platform)
  model = build_model_from_config(config, model_vocab_size(config, vocab))
  optimizer, schedule = make_optimizer(config.optimizer, config.train.num_steps)
  phases = plan_phases(config, vocab)
  table = param_table(model, mesh, rules, phases[0].batch_shapes)

  present = compile_step != "no" and topology.devices_present()
  devices = None
  if present:
    devices = jax.devices(topology.platform)
  elif compile_step == "yes" and topology.platform == "tpu":
    devices = tpu_lib.slice_devices(topology)  # deviceless: libtpu's compile targets
  elif compile_step == "yes":
    raise ValueError(f"cannot compile for {topology.name}: its {topology.num_devices}"
                     f" {topology.device_kind} devices are not all present here")
  real_mesh = None if devices is None else build_mesh(config, devices)[0]
  remat = remat_lib.plan_remat(  # model.remat_policy="auto": the policy for this topology
      config, model, optimizer, schedule, rules, [p.batch_shapes for p in phases],
      memory_bytes=topology.memory_bytes or None, real_mesh=real_mesh,
      estimate_total=lambda m, shapes: estimate_memory(
          m, optimizer, mesh, table.shardings, table.abstract_params, shapes,
          platform=topology.platform, microbatches=int(config.train.microbatches or 1),
          rules=rules, zero_stage=config.mesh.zero_stage).total)
  model = model if remat is None else remat_lib.with_policy(model, remat.policy)
  fitter = None
  if real_mesh is not None and topology.memory_bytes:
    deadline = None if fit_budget_s is None else start + fit_budget_s
    fitter = fit_lib.phase_fitter(model, optimizer, schedule, real_mesh, rules, vocab,
                                  topology.memory_bytes, deadline, fit_resume)
  if fit_batch and fitter is None:
    raise ValueError(f"--fit_batch on {topology.name} needs the compiled train step"
                     f" (--compile=yes) and the device's memory")

  planned = [_phase_json(p, model, optimizer, schedule, mesh, table, topology, mfu, rules,
                         real_mesh, eval_step, fitter if fit_batch else None,
                         (fitter or _no_search) if search_refused else None)
             for p in phases]
  refused = any(p.get("xla_refused") for p in planned)
  mesh_shape = {k: int(v) for k, v in mesh.shape.items()}
  peak = max(p["memory"]["total_bytes"] for p in planned)
  total_flops = sum(p["flops_per_step"] * p["steps"] for p in planned)
  seconds = sum(p["seconds"] for p in planned)
  seconds_at_mfu = sum(p["seconds_at_mfu"] for p in planned)
  return {
      "model": _model_json(config, model),
      "optimizer": config.optimizer.name,
      "topology": _topology_json(topology),
      "mesh": mesh_shape,
      "batch_spec": spec_str(parallel.batch_spec(2, tuple(mesh_shape), rules)),
      "batch_size": int(config.train.batch_size),
      "per_host_batch": int(config.train.batch_size) // topology.num_hosts,
      "microbatches": int(config.train.microbatches or 1),
      "data": describe_data(config.data),
      "mfu": mfu,
      "params": _params_json(table, model),
      "phases": planned,
      "total": {"steps": sum(p["steps"] for p in planned), "flops": total_flops,
                "seconds": seconds, "days": seconds / 86400,
                "seconds_at_mfu": seconds_at_mfu,
                "roofline": all(p["roofline"] is not None for p in planned),
                "mfu_above_ceiling": [p["index"] for p in planned
                                      if (p.get("assumed_mfu") or {}).get("above_ceiling")],
                "peak_memory_bytes": peak,
                "fits": False if refused else _fits(peak, topology)},
      "compiled": real_mesh is not None,
      "remat_auto": None if remat is None else remat.to_json(),
      "notes": _notes(config, table, mesh_shape, int(config.train.batch_size), topology,
                      compiled=real_mesh is not None),
  }


def make_plan(config: ml_collections.ConfigDict, topology: Topology, **options) -> dict[str, Any]:
  """The plan of `config` on `topology` (_make_plan), with every trace of the model
  (parameter shapes, the estimate's residuals, the compiled steps) choosing its
  attention kernel for the topology's platform, not this host's."""
  with tracing_for(topology.platform, topology.device_kind):
    return _make_plan(config, topology, **options)
