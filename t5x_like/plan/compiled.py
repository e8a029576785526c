"""XLA's own view of the train and eval steps: compile them (never run them) and read
their analyses.

  xla = compile_train_step(model, optimizer, schedule, mesh, rules, batch_shapes)
  xla["memory"]["total_bytes"], xla["flops"], xla["collectives"], xla["eval"]["memory"]

Uses the trainer's own pieces (abstract_train_state, make_train_step, make_eval_step),
so what is compiled is exactly what `t5x-like train` runs; only abstract values
(ShapeDtypeStructs with shardings) go in, so nothing is allocated. The mesh's devices
may be libtpu's topology devices (plan/tpu.py): then this compiles for a TPU slice on
a CPU host.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from t5x_like import parallel
from t5x_like.plan import compiler_estimate as estimate_lib
from t5x_like.plan import hlo
from t5x_like.plan import roofline as roofline_lib
from t5x_like.train.state import abstract_train_state
from t5x_like.train.step import make_eval_step, make_train_step


def _abstract_batch(batch_shapes: Mapping[str, tuple], mesh: Mesh, rules) -> dict:
  shardings = parallel.batch_shardings(batch_shapes, mesh, rules)
  return {name: jax.ShapeDtypeStruct(tuple(shape), jnp.int32, sharding=shardings[name])
          for name, shape in batch_shapes.items()}


def xla_memory(compiled) -> dict[str, int]:
  """compiled.memory_analysis() per device; total = arguments + outputs + temps - aliased
  (donated state buffers are reused for the new state, so they count once)."""
  stats = compiled.memory_analysis()
  out = {
      "argument_bytes": int(stats.argument_size_in_bytes),
      "output_bytes": int(stats.output_size_in_bytes),
      "alias_bytes": int(stats.alias_size_in_bytes),
      "temp_bytes": int(stats.temp_size_in_bytes),
      "generated_code_bytes": int(stats.generated_code_size_in_bytes),
  }
  out["total_bytes"] = (out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"]
                        - out["alias_bytes"])
  return out


def _flops(compiled) -> float:
  """XLA's cost_analysis FLOPs of the compiled (per-device) program."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return float((cost or {}).get("flops", 0.0))


def analyze(compiled, num_devices: int,
            chip: Optional[roofline_lib.Chip] = None) -> dict[str, Any]:
  """Memory, FLOPs, collectives and kernels of one compiled program (per device).

  flops_per_device is XLA's cost analysis, which counts a while loop's body once (a
  scanned layer stack: one layer); flops_corrected_per_device adds the matmul FLOPs of
  the loops' other iterations, from the optimized HLO (hlo.summarize). With `chip`, the
  program's roofline on it under 'roofline' (roofline.py; no MFU ceiling: the caller
  knows the model FLOPs), else None; with a TPU `chip`, libtpu's own estimated step time
  beside it under 'compiler_estimate' (compiler_estimate.py; no MFU either), else None.
  """
  text = compiled.as_text()
  summary = hlo.summarize(hlo.parse_module(text))
  per_device = _flops(compiled)
  corrected = per_device + summary["matmul_flops"] - summary["matmul_flops_once"]
  return {"memory": xla_memory(compiled), "flops_per_device": per_device,
          "flops": per_device * num_devices,
          "matmul_flops_per_device": summary["matmul_flops"],
          "flops_corrected_per_device": corrected, "flops_corrected": corrected * num_devices,
          "collectives": summary["collectives"], "kernels": summary["kernels"],
          "custom_calls": summary["custom_calls"],
          "loops": [{k: loop[k] for k in ("trip_count", "op_name")}
                    for loop in summary["loops"]],
          "roofline": None if chip is None else roofline_lib.roofline(compiled, chip,
                                                                      num_devices=num_devices),
          "compiler_estimate": None if chip is None else estimate_lib.estimate(
              text, chip, num_devices)}


def _replicated_key(mesh: Mesh):
  rng = jax.eval_shape(lambda: jax.random.key(0))
  return jax.ShapeDtypeStruct(rng.shape, rng.dtype,
                              sharding=NamedSharding(mesh, PartitionSpec()))


def compile_train_step(model, optimizer, schedule, mesh: Mesh, rules,
                       batch_shapes: Mapping[str, tuple], microbatches: int = 1,
                       eval_step: bool = False,
                       chip: Optional[roofline_lib.Chip] = None,
                       zero_stage: int = 0) -> dict[str, Any]:
  """analyze() of the jitted train step on `mesh` for a global batch of `batch_shapes`
  (feature -> shape); with eval_step, the eval step's under 'eval'; with chip, each
  step's roofline on it."""
  state = abstract_train_state(model, optimizer, mesh, rules, batch_shapes, zero_stage)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  batch = _abstract_batch(batch_shapes, mesh, rules)
  step = make_train_step(model, optimizer, schedule, microbatches=microbatches, mesh=mesh,
                         rules=rules, state_shardings=shardings, batch_shapes=batch_shapes,
                         zero_stage=zero_stage)
  out = analyze(step.lower(state, batch, _replicated_key(mesh)).compile(), mesh.size, chip)
  if eval_step:
    evaluate = make_eval_step(model, mesh=mesh, rules=rules, state_shardings=shardings,
                              batch_shapes=batch_shapes)
    out["eval"] = analyze(evaluate.lower(state.params, batch).compile(), mesh.size, chip)
  return out
