"""The HLO walk (plan/hlo_cost.py, hlo_bytes.py, hlo.py's trip counts) on programs
compiled for a TPU7x slice on this CPU host (libtpu, deviceless AOT), each small enough
to compile in seconds: a scanned layer stack's backward writes each layer's gradient
into the stacked buffer in place; a data-parallel step all-reduces its gradient inside
an async call on the SparseCore; XLA:TPU's loops carry no known_trip_count, so their
counts come from their conditions. Expected values from the shapes, by hand.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

pytest.importorskip("libtpu")
pytestmark = pytest.mark.tpu

from t5x_like.plan import hlo, hlo_cost, roofline  # noqa: E402

CHIP = roofline.Chip("test", peak_flops=1e15, hbm_bandwidth=1e12, ici_bandwidth=1e11)


@pytest.fixture(scope="module")
def mesh():
  """The 8 TensorCores of a tpu7x:2x2x1 slice (4 chips, 2 cores each) on one axis."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies
  devices = topologies.get_topology_desc(topology_name="tpu7x:2x2x1", platform="tpu").devices
  return Mesh(np.array(devices), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _compile(mesh, fn, args, in_specs, out_specs):
  shard = lambda specs: jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                     is_leaf=lambda s: isinstance(s, P))
  return jax.jit(fn, in_shardings=shard(in_specs), out_shardings=shard(out_specs)).lower(
      *args).compile()


def _holds(module, name: str, opcode: str) -> bool:
  """Whether a fused computation (or one nested in it) holds an `opcode` instruction."""
  insts = module.computations[name].instructions.values()
  return any(i.opcode == opcode or (i.opcode == "fusion" and
                                    _holds(module, i.callees["calls"][0], opcode))
             for i in insts)


def test_scanned_stack_gradient_is_written_in_place_one_layer_a_step(mesh):
  """grad of a 4-layer scan of tanh(h @ w_l), w: f32[4, 2048, 2048] (64 MiB): the
  backward loop writes each f32[2048, 2048] layer gradient (16 MiB) into the stacked
  buffer; that fusion moves about the update, not 2 x 64 MiB."""
  layers, d = 4, 2048

  def loss(w, x):
    h, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl.astype(jnp.bfloat16)), None), x, w)
    return h.astype(jnp.float32).sum()

  args = (jax.ShapeDtypeStruct((layers, d, d), jnp.float32),
          jax.ShapeDtypeStruct((256, d), jnp.bfloat16))
  compiled = _compile(mesh, jax.grad(loss), args, (P(), P()), P())
  text = compiled.as_text()
  module = hlo.parse_module(text)
  stacked = [inst.name for comp in module.computations.values()
             for inst in comp.instructions.values()
             if inst.opcode == "fusion" and comp.name != module.entry
             and inst.leaves == [("f32", (layers, d, d))]
             and _holds(module, inst.callees["calls"][0], "dynamic-update-slice")]
  assert stacked, "no fusion writing the stacked gradient in a loop body"
  ops = {op.name: op for op in hlo_cost.hlo_ops(text)}
  update, buffer = d * d * 4, layers * d * d * 4
  for name in stacked:
    op = ops[name]
    assert op.times == layers
    assert update <= op.bytes <= 1.1 * update, (name, op.bytes, buffer)


def test_data_parallel_gradient_all_reduce_in_an_async_call_is_costed(mesh):
  """grad of sum(tanh(x @ w)) with w: f32[256, 256] replicated and x: [64, 256] split 8
  ways: one all-reduce of the 256 KiB gradient over 8 devices (on TPU7x inside a
  call-start on the SparseCore), 2 x 7/8 x 256 KiB / ICI; model FLOPs 2 matmuls of
  2 x 64 x 256 x 256 over the devices."""
  d = 256
  loss = lambda w, x: jnp.tanh(x @ w).sum()
  args = (jax.ShapeDtypeStruct((d, d), jnp.float32), jax.ShapeDtypeStruct((64, d), jnp.float32))
  compiled = _compile(mesh, jax.grad(loss), args, (P(), P("data")), P())
  grad = d * d * 4
  collectives = [op for op in hlo_cost.hlo_ops(compiled.as_text()) if op.collective]
  assert [(op.collective, op.bytes, op.group, op.times) for op in collectives] == [
      ("all-reduce", grad, 8, 1)]
  model_flops = 2 * (2 * 64 * d * d)
  bound = roofline.roofline(compiled, CHIP, model_flops=model_flops, num_devices=8)
  assert bound["collective_seconds"] == pytest.approx(2 * 7 / 8 * grad / 1e11, rel=1e-9)
  assert bound["collective_bytes"] == grad
  assert bound["flops_ratio"] == pytest.approx(1.0) and bound["flops_mismatch"] is False
  summary = hlo.summarize(hlo.parse_module(compiled.as_text()))
  assert summary["collectives"] == {"all-reduce": {"count": 1, "bytes": grad, "ops": 1}}


_BODY = lambda w: (lambda h: jnp.tanh(h @ w))
_LOOPS = {
    "fori_loop(3, 10)": (lambda w, x: jax.lax.fori_loop(3, 10, lambda i, h: _BODY(w)(h), x), 7),
    "i = 1; i < 11; i += 2": (lambda w, x: jax.lax.while_loop(
        lambda c: c[0] < 11, lambda c: (c[0] + 2, _BODY(w)(c[1])), (1, x))[1], 5),
    "i = 6; i > 0; i -= 1": (lambda w, x: jax.lax.while_loop(
        lambda c: c[0] > 0, lambda c: (c[0] - 1, _BODY(w)(c[1])), (6, x))[1], 6),
    "i = 2; 8 >= i; i += 1": (lambda w, x: jax.lax.while_loop(
        lambda c: 8 >= c[0], lambda c: (c[0] + 1, _BODY(w)(c[1])), (2, x))[1], 7),
}


@pytest.mark.parametrize("form", sorted(_LOOPS))
def test_loop_trip_counts_come_from_the_condition_without_known_trip_count(mesh, form):
  """Each loop runs an f32[64, 256] x [256, 256] matmul per iteration; the trip count
  is the loop's by hand. Any known_trip_count is stripped first (XLA:TPU writes none
  here), so the count can only come from the condition, the init and the step."""
  fn, trips = _LOOPS[form]
  args = (jax.ShapeDtypeStruct((256, 256), jnp.float32),
          jax.ShapeDtypeStruct((64, 256), jnp.float32))
  text = _compile(mesh, fn, args, (P(), P()), P()).as_text()
  text = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", text)
  _, loops = hlo.multiplicities(hlo.parse_module(text))
  assert [loop["trip_count"] for loop in loops] == [trips]
  flops = sum(op.times * op.flops for op in hlo_cost.hlo_ops(text))
  assert flops == trips * 2 * 64 * 256 * 256


def test_a_runtime_bound_loop_is_named_and_its_flops_flagged(mesh):
  """while i < n with n an argument: no count can be read; the body counts once, the
  loop is listed in unknown_trip_loops and, for n = 7, the FLOPs read 1/7 of the
  model's."""
  def fn(w, x, n):
    return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, _BODY(w)(c[1])),
                              (0, x))[1]

  args = (jax.ShapeDtypeStruct((256, 256), jnp.float32),
          jax.ShapeDtypeStruct((64, 256), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
  compiled = _compile(mesh, fn, args, (P(), P(), P()), P())
  per_iteration = 2 * 64 * 256 * 256  # every device runs the replicated loop
  bound = roofline.roofline(compiled, CHIP, model_flops=8 * 7 * per_iteration,
                            num_devices=8)
  assert len(bound["unknown_trip_loops"]) == 1
  assert bound["flops"] == per_iteration
  assert bound["flops_ratio"] == pytest.approx(1 / 7) and bound["flops_mismatch"] is True
