"""XLA's own view of the train step: compile it (never run it) and read its analyses.

  xla = compile_train_step(model, optimizer, schedule, mesh, rules, batch_shapes)
  xla["memory"]["total_bytes"], xla["flops"]

Uses the trainer's own pieces (abstract_train_state, make_train_step), so what is
compiled is exactly the step `t5x-like train` runs; only abstract values
(ShapeDtypeStructs with shardings) go in, so nothing is allocated.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from t5x_like import parallel
from t5x_like.train.state import abstract_train_state
from t5x_like.train.step import make_train_step


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


def compile_train_step(model, optimizer, schedule, mesh: Mesh, rules,
                       batch_shapes: Mapping[str, tuple], microbatches: int = 1) -> dict[str, Any]:
  """{'memory': per-device bytes (see _memory), 'flops_per_device': XLA's count,
  'flops': that times the devices} of the jitted train step on `mesh` for a global
  batch of `batch_shapes` (feature -> shape)."""
  state = abstract_train_state(model, optimizer, mesh, rules, batch_shapes)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  step = make_train_step(model, optimizer, schedule, microbatches=microbatches, mesh=mesh,
                         rules=rules, state_shardings=shardings, batch_shapes=batch_shapes)
  rng = jax.eval_shape(lambda: jax.random.key(0))
  rng = jax.ShapeDtypeStruct(rng.shape, rng.dtype,
                             sharding=NamedSharding(mesh, PartitionSpec()))
  compiled = step.lower(state, _abstract_batch(batch_shapes, mesh, rules), rng).compile()
  per_device = _flops(compiled)
  return {"memory": xla_memory(compiled), "flops_per_device": per_device,
          "flops": per_device * mesh.size}
