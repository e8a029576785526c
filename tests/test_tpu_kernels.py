"""The TPU tier: the real train steps compiled for TPU slices on this CPU host (libtpu,
deviceless AOT), through the Pallas attention kernel in shard_map.

Before the kernel ran inside shard_map, every such compile on a sharded mesh stopped
with "Mosaic kernels cannot be automatically partitioned"; CPU tests could not see it
(interpret mode lowers to ordinary HLO, which XLA partitions). Here: each family's step
holds the Mosaic kernels (forward, dq, dk/dv; T5's bias gradient), under pure data
parallelism and with heads split over 'tensor'; the fused kernel's attention
temporaries are a fraction of the explicit kernel's; BERT-base at length 512 fits a
v5e-16 by the compiler's numbers.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

pytest.importorskip("libtpu")
pytestmark = pytest.mark.tpu

from t5x_like import parallel  # noqa: E402
from t5x_like.models.attention_core import attend, record_kernels  # noqa: E402
from t5x_like.models.masks import mask_spec  # noqa: E402
from t5x_like.plan import compiled as compiled_lib, tpu  # noqa: E402
from t5x_like.experiment import build_model_from_config, config_vocab  # noqa: E402
from t5x_like.plan.report import make_plan  # noqa: E402
from t5x_like.plan.shapes import model_vocab_size, plan_phases  # noqa: E402
from t5x_like.train.optimizers import make_optimizer  # noqa: E402
from t5x_like.plan.topology import parse_topology  # noqa: E402
from helpers import load_config  # noqa: E402

GiB = 1 << 30


_config = load_config


def _smoke_at_128(name: str, **model):
  """A family's smoke config in bfloat16 at length 128 (the kernel's block)."""
  c = _config(name, "smoke")
  c.data.length = 128
  c.model.dtype = "bfloat16"
  c.model.attention_impl = "pallas"
  c.model.overrides.update(model)
  return c


@pytest.mark.parametrize("family, mesh, want", [
    ("bert_cpu", dict(data=-1), {"fwd", "dq", "dkv"}),  # attention dropout 0.1, fused
    ("t5_cpu", dict(data=-1), {"fwd", "dq", "dkv", "dbias"}),  # relative position bias
    ("gpt_cpu", dict(data=2, tensor=2), {"fwd", "dq", "dkv"}),  # causal, heads split
])
def test_each_family_compiles_its_mosaic_kernels_on_a_sharded_v5e_mesh(family, mesh, want):
  overrides = dict(max_position_embeddings=128) if family != "t5_cpu" else {}
  if family == "bert_cpu":
    overrides["attention_dropout_rate"] = 0.1
  c = _smoke_at_128(family, **overrides)
  if family == "t5_cpu":
    c.model.attention_impl = "auto"  # the decoder's 32 targets are no 128-block
  for axis, size in mesh.items():
    setattr(c.mesh, axis, size)
  with record_kernels() as kernels:
    plan = make_plan(c, parse_topology("v5e-4"), compile_step="yes")
  assert "pallas" in {entry["kernel"] for entry in kernels.values()}, kernels
  xla = plan["phases"][0]["xla"]
  names = {name.removeprefix("flash_attention_") for name in xla["kernels"]}
  assert want <= names, xla["kernels"]
  assert xla["custom_calls"].get("tpu_custom_call", 0) >= len(want)
  assert xla["fits"]
  kinds = set(xla["collectives"])
  assert "all-reduce" in kinds, xla["collectives"]
  if "tensor" not in mesh:  # pure data parallel: gradients all-reduced, nothing gathered
    assert kinds == {"all-reduce"}, xla["collectives"]


def _attention_temporaries(impl: str, length: int, batch: int) -> int:
  """Temporaries (bytes per device) of BERT-base-shaped attention forward + backward over
  a v5e-4's 4 devices (batch / 4 rows each), 12 heads of 64, a T5-style [1, 12, T, T]
  bias, padding and dropout 0.1, compiled for the TPU. The gradients are reduced to
  scalars inside the program, so that no output buffer can hold a temporary."""
  mesh = parallel.make_mesh({"data": 4}, tpu.slice_devices("v5e-4"))
  heads, dim = 12, 64
  row = NamedSharding(mesh, P("data"))
  qkv = jax.ShapeDtypeStruct((batch, length, heads, dim), jnp.bfloat16, sharding=row)
  bias = jax.ShapeDtypeStruct((1, heads, length, length), jnp.float32,
                              sharding=NamedSharding(mesh, P()))
  valid = jax.ShapeDtypeStruct((batch, length), jnp.bool_, sharding=row)

  def loss(q, k, v, bias, valid):
    out = attend(q, k, v, bias=bias, mask=mask_spec(valid, q_len=length), scale=0.125,
                 dropout_rate=0.1, dropout_rng=jax.random.key(0), impl=impl)
    return jnp.sum(out.astype(jnp.float32))

  grads = jax.grad(loss, argnums=(0, 1, 2, 3))
  summed = lambda *args: [g.astype(jnp.float32).sum() for g in grads(*args)]
  with parallel.mesh_rules(mesh):
    compiled = jax.jit(summed).lower(qkv, qkv, qkv, bias, valid).compile()
  return compiled_lib.xla_memory(compiled)["temp_bytes"]


@pytest.mark.parametrize("length, batch", [(512, 32), (2048, 8)])
def test_fused_attention_keeps_no_probabilities_in_hbm(length, batch):
  """The explicit kernel keeps [B, N, T, S] probabilities (and the dropout mask) for the
  backward pass; the fused kernel keeps [B, N, T] row statistics (its temporaries are
  mostly the float32 gradient of the [1, N, T, S] bias, which any kernel must write)."""
  explicit = _attention_temporaries("explicit", length, batch)
  pallas = _attention_temporaries("pallas", length, batch)
  print(f"length {length}, {batch // 4} rows per device: attention temporaries per device:"
        f" explicit {explicit / 2**20:.1f} MiB, pallas {pallas / 2**20:.1f} MiB")
  rows = batch // 4
  assert explicit >= rows * 12 * length * length * 2  # bf16 probabilities, at least
  assert pallas * 2 < explicit, (pallas, explicit)


def test_bert_base_at_length_512_fits_a_v5e_16():
  """The whole recipe's phase 2 train step (BERT-base, length 512, batch 256, attention
  dropout 0.1 through the fused kernel) compiled for a v5e-16: it fits the 16 GiB of
  HBM by the compiler's numbers and is pure data parallel."""
  c = _config("bert_pretrain", "base")
  vocab = config_vocab(c, shapes_only=True)
  model = build_model_from_config(c, model_vocab_size(c, vocab))
  optimizer, schedule = make_optimizer(c.optimizer, c.train.num_steps)
  phase = plan_phases(c, vocab)[1]
  assert phase.length == 512
  mesh = parallel.mesh_from_config(c.mesh, tpu.slice_devices("v5e-16"))
  with record_kernels() as kernels:
    xla = compiled_lib.compile_train_step(model, optimizer, schedule, mesh,
                                          parallel.DEFAULT_RULES, phase.batch_shapes)
  assert {entry["kernel"] for entry in kernels.values()} == {"pallas"}, kernels
  total = xla["memory"]["total_bytes"]
  print(f"BERT-base, length 512, v5e-16: {total / GiB:.2f} GiB per device")
  assert total < 16 * GiB
  assert set(xla["collectives"]) == {"all-reduce"}, xla["collectives"]
  assert "fwd" in {name.removeprefix("flash_attention_") for name in xla["kernels"]}


def test_v3_mosaic_has_no_bf16_matmul_but_float32_compiles():
  """Why 'auto' keeps the explicit kernel on TPU v2/v3 in bf16 (attention_kernels.
  pallas_unsupported): libtpu's Mosaic rejects the kernel's bf16 matmuls there, and
  compiles the float32 kernel. A libtpu that lifts this fails here: then lift the rule."""
  from t5x_like.models import pallas_flash  # noqa: PLC0415
  mesh = jax.sharding.Mesh(tpu.slice_devices("v3-8")[:1], ("x",))
  replicated = NamedSharding(mesh, P())

  def compile_for(dtype):
    qkv = jax.ShapeDtypeStruct((1, 2, 256, 64), dtype, sharding=replicated)
    loss = lambda q, k, v: pallas_flash.flash_attention(q, k, v).astype(jnp.float32).sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(qkv, qkv, qkv).compile()

  compile_for(jnp.float32)
  with pytest.raises(Exception, match="E2001"):
    compile_for(jnp.bfloat16)
