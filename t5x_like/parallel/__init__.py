"""Parallelism: device meshes, logical-axis rules, shardings of params and batches."""

from t5x_like.parallel.mesh import (MESH_AXES, config_axis_sizes, make_mesh,
                                    mesh_from_config, mesh_rules, resolve_axis_sizes,
                                    traced_rules)
from t5x_like.parallel.rules import DEFAULT_RULES, LOGICAL_AXES, TENSOR_AXES, rules_for_mesh
from t5x_like.parallel.shardings import (ZERO_STAGES, batch_mesh_axes, batch_shardings,
                                         batch_spec, logical_to_mesh_specs,
                                         logical_to_shardings, param_shardings, shard_batch,
                                         zero_shardings)

__all__ = [
    "DEFAULT_RULES", "LOGICAL_AXES", "TENSOR_AXES", "batch_shardings", "batch_spec",
    "MESH_AXES", "config_axis_sizes", "logical_to_mesh_specs", "logical_to_shardings",
    "make_mesh", "mesh_from_config", "mesh_rules", "param_shardings", "resolve_axis_sizes",
    "rules_for_mesh", "shard_batch", "traced_rules", "ZERO_STAGES", "batch_mesh_axes",
    "zero_shardings",
]
