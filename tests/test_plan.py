"""`t5x-like plan`: parameter counts, shardings, FLOPs, memory and time of a config.

The big configs are planned on topologies that are not here (v3-32, v3-128); the
memory estimate is checked against XLA's own analysis of the compiled step on the 8
fake CPU devices with a CPU-sized BERT. Reference numbers are independent of the code
under test: Hugging Face's BertForPreTraining parameter counts, a first-principles
FLOP count, the Cloud TPU v3 figures (123 TFLOP/s and 32 GiB per chip, two cores).
"""

import contextlib
import io
import json
import math
import pathlib

import jax
import pytest

from t5x_like import cli, parallel
from t5x_like.plan import make_plan, parse_topology, planned_mesh
from t5x_like.experiment import build_model_from_config
from t5x_like.train.optimizers import make_optimizer
from t5x_like.train.state import train_state_shardings
from helpers import load_config

BERT_CONFIG = str(pathlib.Path(__file__).parents[1] / "configs" / "bert_pretrain.py")
# transformers' BertForPreTraining(BertConfig(vocab_size=30522, ...)).num_parameters()
HF_PARAMS = {"base": 110_106_428, "large": 336_226_108}
SIZES = {"base": dict(layers=12, d=768, ff=3072), "large": dict(layers=24, d=1024, ff=4096)}
TOPOLOGY = {"base": "v3-32", "large": "v3-128"}
V3_PEAK, V3_HBM = 61.5e12, 16 * 2**30  # one v3 TensorCore = one JAX device


def _plan_cli(capsys, *args) -> tuple[int, str, str]:
  rc = cli.main(["plan", *args])
  out = capsys.readouterr()
  return rc, out.out, out.err


@pytest.fixture(scope="module")
def json_plans():
  """{size: the --json plan of configs/bert_pretrain.py:<size> on its paper topology}."""
  plans = {}
  for size in ("base", "large"):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      assert cli.main(["plan", "--config", f"{BERT_CONFIG}:{size}", "--topology",
                       TOPOLOGY[size], "--json"]) == 0
    plans[size] = json.loads(out.getvalue())
  return plans


def bert_train_flops(layers, d, ff, vocab, batch, length, predictions) -> float:
  """Training FLOPs from first principles: 2 FLOPs per multiply-add, backward = 2x forward.

  6 N T for the N matmul weights of the layers over T = batch * length tokens, plus the
  attention scores and weighted sums (2 matmuls of L x L x d per layer and sequence),
  plus BERT's heads: the MLM transform and tied decoder only at the masked positions,
  the pooler and NSP classifier on [CLS].
  """
  per_layer = 4 * d * d + 2 * d * ff  # Q, K, V, output; MLP in and out
  flops = 6 * layers * per_layer * batch * length
  flops += 6 * layers * 2 * length * length * d * batch
  flops += 6 * (d * d + d * vocab) * batch * predictions
  flops += 6 * (d * d + d * 2) * batch
  return flops


# ------------------------------------------------------------------ big configs
def test_bert_base_on_v3_32_prints_every_number(capsys):
  rc, out, err = _plan_cli(capsys, "--config", f"{BERT_CONFIG}:base", "--topology", "v3-32")
  assert rc == 0, err
  for text in ["on v3-32: 32 x TPU v3 devices, 4 host(s)", "61.5 TFLOP/s peak",
               "16.00 GiB per device", "mesh data=32 fsdp=1 tensor=1",
               "110,106,428 (= model.num_params() 110,106,428)",
               "embeddings", "attention", "mlp", "norms", "heads",
               "token_embed/embedding  (30522, 768)  (vocab, embed) -> P('tensor', 'fsdp')",
               "(layers, embed, heads, kv) -> P(None, 'fsdp', 'tensor', None)",
               "phase 1: steps 0 to 900,000", "phase 2: steps 900,000 to 1,000,000",
               "length 128", "length 512", "mlm_positions [256, 20]", "mlm_positions [256, 80]",
               "FLOPs per step", "at 40% MFU", "per-device batch 8", "params (float32)",
               "optimizer state", "gradients (float32)", "activations saved for backward",
               "logits / loss buffers", "total: 1,000,000 steps", ": fits"]:
    assert text in out, (text, out)
  assert "XLA" not in out  # no v3 devices here: nothing is compiled


@pytest.mark.parametrize("size", ["base", "large"])
def test_json_plan_counts_params_and_shards_them(json_plans, size):
  plan = json_plans[size]
  config = _config(size)
  model = build_model_from_config(config, 30522)
  params = plan["params"]
  assert params["total"] == params["model_num_params"] == model.num_params() == HF_PARAMS[size]
  assert sum(g["params"] for g in params["groups"].values()) == HF_PARAMS[size]
  assert set(params["groups"]) == {"embeddings", "attention", "mlp", "norms", "heads"}
  for group in params["groups"].values():
    for row in group["rows"]:
      assert row["spec"].startswith("P(") and len(row["logical_axes"]) == len(row["shape"])
  # pure data parallel: every param whole on every device
  assert params["bytes_per_device"] == 4 * HF_PARAMS[size]
  devices = {"base": 32, "large": 128}[size]
  topo = plan["topology"]
  assert (topo["num_devices"], topo["num_hosts"]) == (devices, devices // 8)
  assert topo["peak_flops_per_device"] == V3_PEAK and topo["memory_bytes_per_device"] == V3_HBM
  assert plan["mesh"] == {"data": devices, "fsdp": 1, "tensor": 1}
  assert plan["compiled"] is False


@pytest.mark.parametrize("size", ["base", "large"])
def test_flops_and_time_agree_with_a_first_principles_count(json_plans, size):
  plan = json_plans[size]
  s = SIZES[size]
  assert [p["length"] for p in plan["phases"]] == [128, 512]
  assert [p["steps"] for p in plan["phases"]] == [900_000, 100_000]
  devices = plan["topology"]["num_devices"]
  for phase, predictions in zip(plan["phases"], (20, 80)):
    expected = bert_train_flops(s["layers"], s["d"], s["ff"], 30522, 256, phase["length"],
                                predictions)
    assert phase["flops_per_step"] == pytest.approx(expected, rel=0.05)
    step = expected / (devices * V3_PEAK * 0.4)
    assert phase["step_seconds"] == pytest.approx(step, rel=0.05)
    assert phase["seconds"] == pytest.approx(step * phase["steps"], rel=0.05)
    memory = phase["memory"]
    assert memory["per_device_batch"] == 256 // devices
    assert memory["params_bytes"] == 4 * HF_PARAMS[size]
    assert 2 * memory["params_bytes"] <= memory["opt_state_bytes"] < 2.01 * memory["params_bytes"]
    assert memory["activations_bytes"] > 0 and memory["logits_bytes"] > 0
    assert phase["fits"] is (memory["total_bytes"] <= V3_HBM)
  # length 512 costs more activation memory per sequence than 128
  assert plan["phases"][1]["memory"]["activations_bytes"] > \
      plan["phases"][0]["memory"]["activations_bytes"] * (plan["phases"][1]["memory"][
          "per_device_batch"] / plan["phases"][0]["memory"]["per_device_batch"])
  total = plan["total"]
  assert total["seconds"] == pytest.approx(sum(p["seconds"] for p in plan["phases"]))
  assert total["fits"] is True  # BERT fit on v3 in 2018


def _config(arg: str):
  """configs/bert_pretrain.py's get_config(arg)."""
  return load_config("bert_pretrain", arg)


# ----------------------------------------------------------------- CPU: compiled
def _local_config(remat: str):
  """A CPU-sized BERT with one phase at length 128 and 8 rows per device."""
  c = _config("base,local")
  c.train.phases = ()
  c.train.num_steps = 20
  c.train.batch_size = 64
  c.data.length = 128
  c.data.options = dict(max_predictions_per_seq=20, nsp=True)
  c.model.remat_policy = remat
  c.model.scan_layers = True  # XLA:CPU undoes remat of unrolled layers (see plan/memory.py)
  return c


@pytest.fixture(scope="module")
def cpu_plans():
  topology = parse_topology("cpu-8", "float32")
  return {remat: make_plan(_local_config(remat), topology) for remat in ("none", "full")}


@pytest.mark.long
@pytest.mark.parametrize("remat", ["none", "full"])
def test_memory_estimate_within_2x_of_xla_on_cpu(cpu_plans, remat):
  plan = cpu_plans[remat]
  assert plan["compiled"] is True  # cpu-8 devices are present: the real step was compiled
  phase, = plan["phases"]
  xla = phase["xla"]
  assert xla["memory"]["total_bytes"] == (xla["memory"]["argument_bytes"] +
                                          xla["memory"]["output_bytes"] +
                                          xla["memory"]["temp_bytes"] -
                                          xla["memory"]["alias_bytes"])
  ratio = phase["memory"]["total_bytes"] / xla["memory"]["total_bytes"]
  print(f"remat {remat}: estimate / XLA = {ratio:.3f}")
  assert 0.5 <= ratio <= 2.0
  assert xla["flops"] > 0


@pytest.mark.long
def test_remat_full_saves_memory_in_estimate_and_in_xla(cpu_plans):
  none, full = (cpu_plans[r]["phases"][0] for r in ("none", "full"))
  assert full["memory"]["total_bytes"] < none["memory"]["total_bytes"]
  assert full["xla"]["memory"]["temp_bytes"] < none["xla"]["memory"]["temp_bytes"]
  assert full["flops_per_step"] == none["flops_per_step"]  # recompute is not useful work


# ------------------------------------------------------------- TPU: the compiler's totals
# Per-device totals of libtpu 0.0.42.1 compiling the recipes' train steps for their slices
# (`python -m t5x_like.plan.recipes`, docs/tpu.md, "The recipes on TPU, compiled here"): the
# estimate, which compiles nothing, stays within 20% of them. Two peaks: BERT-large
# phase 1 on v3-128 (2 rows per device) peaks in the optimizer update, BERT-base phase 2
# on v5e-16 (16 rows, the fused kernel) in the backward pass.
# Compiled with model.loss_chunk_rows=1024, which chunks BERT-base's 1,280 masked rows per
# device (7,155,362,816 on full logits) and not BERT-large's 40 (chunked_loss.pays; it
# compiled 6,698,871,808 with chunks).
TPU_COMPILED_TOTALS = {
    ("large", 0, "v3-128"): 6_576_001_024,
    ("base", 1, "v5e-16"): 6_995_038_720,
}


@pytest.mark.parametrize("recipe", sorted(TPU_COMPILED_TOTALS), ids=lambda r: f"{r[0]}-{r[2]}")
def test_memory_estimate_within_20_percent_of_the_tpu_compiler(recipe):
  from t5x_like.plan.recipes import phase_config
  from t5x_like.command_flags import load_config_file
  size, phase, slice_name = recipe
  config = phase_config(load_config_file(f"{BERT_CONFIG}:{size}"), phase)
  plan = make_plan(config, parse_topology(slice_name, config.model.dtype),
                   compile_step="no", eval_step=False)
  ratio = plan["phases"][0]["memory"]["total_bytes"] / TPU_COMPILED_TOTALS[recipe]
  print(f"BERT-{size} phase {phase + 1} on {slice_name}: estimate / compiler = {ratio:.3f}")
  assert 0.8 <= ratio <= 1.2


# configs/bert_pretrain.py:base,local on data=2 x fsdp=2 x tensor=2, by hand from the
# default rules (embed -> fsdp; vocab, heads, mlp -> tensor; the rest replicated);
# scanned layers: a leading replicated 'layers' dim.
LOCAL_DIMS = dict(layers=2, d=64, heads=2, head_dim=32, ff=128, positions=128)
HAND_SPECS = {
    "token_embed/embedding": "P('tensor', 'fsdp')",
    "position_embed/embedding": "P(None, 'fsdp')",
    "embedding_norm/scale": "P('fsdp')",
    "encoder/layers/self_attention/query/kernel": "P(None, 'fsdp', 'tensor', None)",
    "encoder/layers/self_attention/query/bias": "P(None, 'tensor', None)",
    "encoder/layers/self_attention/out/kernel": "P(None, 'tensor', None, 'fsdp')",
    "encoder/layers/mlp/wi/kernel": "P(None, 'fsdp', 'tensor')",
    "encoder/layers/mlp/wo/kernel": "P(None, 'tensor', 'fsdp')",
    "encoder/layers/mlp_norm/scale": "P(None, 'fsdp')",
    "mlm_bias": "P('tensor')",
}


def bert_param_bytes_per_device(layers, d, heads, head_dim, ff, positions, vocab, fsdp,
                                tensor) -> int:
  """float32 bytes of one device's shards of BERT's params, each dim split as HAND_SPECS:
  d over fsdp, vocab / heads / d_ff over tensor (the pooler and MLM transform split
  their output dim over tensor too)."""
  inner = heads * head_dim
  embeddings = (vocab * d // (tensor * fsdp) + positions * d // fsdp  # token, position
                + 2 * d // fsdp + 2 * d // fsdp)  # type embedding, embedding norm
  attention = (4 * d * inner // (fsdp * tensor) + 3 * inner // tensor + d // fsdp
               + 2 * d // fsdp)  # Q, K, V, O kernels; Q, K, V biases; O bias; norm
  mlp = 2 * d * ff // (fsdp * tensor) + ff // tensor + d // fsdp + 2 * d // fsdp
  bert_heads = (vocab // tensor + 2 * d // fsdp  # MLM bias and norm
                + 2 * (d * d // (fsdp * tensor) + d // tensor)  # MLM transform, pooler
                + 2 * d // fsdp + 2)  # NSP classifier
  return 4 * (embeddings + layers * (attention + mlp) + bert_heads)


def _spec_text(spec, ndim) -> str:
  entries = list(spec) + [None] * (ndim - len(spec))
  return "P(" + ", ".join(map(repr, entries)) + ")"


def test_planned_shardings_are_the_ones_training_uses(capsys):
  """The plan and training's state shardings both match the hand-written specs and
  the hand count of bytes per device."""
  rc, out, err = _plan_cli(capsys, "--config", f"{BERT_CONFIG}:base,local", "--topology",
                           "cpu-8", "--compile", "no", "--json", "--config.mesh.fsdp=2",
                           "--config.mesh.tensor=2")
  assert rc == 0, err
  plan = json.loads(out)
  assert plan["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2} and plan["compiled"] is False
  config = _config("base,local")
  vocab = plan["model"]["vocab_size"]
  model = build_model_from_config(config, vocab)
  cfg = model.config
  assert dict(layers=cfg.num_layers, d=cfg.d_model, heads=cfg.num_heads,
              head_dim=cfg.dim_per_head, ff=cfg.d_ff,
              positions=cfg.max_position_embeddings) == LOCAL_DIMS
  optimizer, _ = make_optimizer(config.optimizer, config.train.num_steps)
  mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  shapes = {k: tuple(v) for k, v in plan["phases"][0]["batch_shapes"].items()}
  shardings = train_state_shardings(model, optimizer, mesh, parallel.DEFAULT_RULES, shapes)
  param_shapes = model.param_shapes(shapes)
  real = {}
  for path, sharding in jax.tree_util.tree_leaves_with_path(shardings.params):
    real["/".join(str(getattr(k, "key", k)) for k in path)] = sharding
  shape_of = {"/".join(str(getattr(k, "key", k)) for k in path): x.shape
              for path, x in jax.tree_util.tree_leaves_with_path(param_shapes)}
  rows = {r["name"]: r for g in plan["params"]["groups"].values() for r in g["rows"]}
  assert set(rows) == set(real)  # 2 layers, no 'layers_*' merging at scan_layers=True
  # Named params: the plan and training both shard them as written by hand.
  for name, spec in HAND_SPECS.items():
    assert rows[name]["spec"] == spec, name
    assert _spec_text(real[name].spec, len(shape_of[name])) == spec, name
  # Bytes per device: by hand from the dimensions and the axis sizes, in the plan and in
  # the shards training would hold.
  assert vocab % 4 == 0
  want = bert_param_bytes_per_device(**LOCAL_DIMS, vocab=vocab, fsdp=2, tensor=2)
  assert plan["params"]["bytes_per_device"] == want
  assert sum(4 * math.prod(s.shard_shape(shape_of[n])) for n, s in real.items()) == want


def test_without_topology_plans_the_devices_present(capsys):
  rc, out, err = _plan_cli(capsys, "--config", f"{BERT_CONFIG}:base,local", "--compile", "no",
                           "--json", "--mfu", "0.5")
  assert rc == 0, err
  plan = json.loads(out)
  topology = plan["topology"]
  assert (topology["platform"], topology["num_devices"]) == ("cpu", jax.device_count())
  assert plan["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1} and plan["mfu"] == 0.5
  for phase in plan["phases"]:
    assert phase["step_seconds"] == pytest.approx(
        phase["flops_per_step"] / (8 * topology["peak_flops_per_device"] * 0.5))


# ------------------------------------------------------------------- rejections
def test_rejects_a_mesh_that_does_not_fit_the_topology(capsys):
  rc, out, err = _plan_cli(capsys, "--config", f"{BERT_CONFIG}:base", "--topology", "v3-32",
                           "--config.mesh.data=64")
  assert rc == 2 and not out
  assert "topology v3-32" in err and "mesh.data=64" in err and "32 devices" in err
  mesh = _config("base").mesh
  mesh.tensor = 3
  with pytest.raises(ValueError, match=r"mesh.data=-1, mesh.fsdp=1, mesh.tensor=3"):
    planned_mesh(mesh, 32)


def test_rejects_an_unknown_topology_listing_the_known_ones(capsys):
  rc, out, err = _plan_cli(capsys, "--config", f"{BERT_CONFIG}:base", "--topology", "v9-32")
  assert rc == 2 and not out
  assert "unknown topology 'v9-32'" in err
  for known in ("v3-32", "v3-128", "v4-64", "v5p-128", "cpu-8"):
    assert known in err


def test_topologies_count_devices_hosts_and_peaks():
  cases = {"v3-32": (32, 4, 61.5e12, 16), "v3-128": (128, 16, 61.5e12, 16),
           "v4-64": (32, 8, 275e12, 32), "v5p-128": (64, 16, 459e12, 95)}
  for name, (devices, hosts, peak, gib) in cases.items():
    t = parse_topology(name)
    assert (t.num_devices, t.num_hosts, t.peak_flops, t.memory_bytes) == (
        devices, hosts, peak, gib * 2**30), name
    assert not t.devices_present()
  assert parse_topology("cpu-8").devices_present()  # conftest's 8 fake devices


# TPU7x (Ironwood), per chip (docs.cloud.google.com/tpu/docs/tpu7x): 2307 TFLOP/s bf16,
# 192 GiB HBM at 7380 GB/s, ICI 1200 GB/s both ways, 2 TensorCores, 4 chips a host. Each
# TensorCore is one JAX device, and tpu7x-N counts TensorCores: N devices, N/2 chips.
TPU7X_CHIP = dict(peak=2307e12, hbm=192 * 2**30, hbm_bw=7380e9, ici_both_ways=1200e9)


def test_tpu7x_slices_count_tensorcores_as_devices_with_half_a_chip_each():
  from t5x_like.plan import tpu
  from t5x_like.plan.topology import family_of, known_topologies
  cases = {"tpu7x-8": (8, 1), "tpu7x-16": (16, 2), "tpu7x-64": (64, 8),
           "tpu7x-512": (512, 64), "2xtpu7x-8": (16, 2)}  # 4 chips = 8 devices a host
  for name, (devices, hosts) in cases.items():
    t = parse_topology(name)
    assert (t.platform, t.device_kind, t.num_devices, t.num_hosts) == (
        "tpu", "TPU7x", devices, hosts), name
    assert t.peak_flops == 1153.5e12 == TPU7X_CHIP["peak"] / 2
    assert t.memory_bytes == 96 * 2**30 == TPU7X_CHIP["hbm"] // 2
    assert t.hbm_bandwidth == 3690e9 == TPU7X_CHIP["hbm_bw"] / 2
    assert t.ici_bandwidth == 300e9 == TPU7X_CHIP["ici_both_ways"] / 2 / 2  # one way
    assert not t.devices_present()
  assert parse_topology("2xtpu7x-8").num_slices == 2
  assert family_of("TPU7x") is family_of("tpu7x") is not None
  assert family_of("TPU7x").cores_per_device == 1
  assert tpu.libtpu_topology("tpu7x-8") == ("tpu7x:2x2x1", {}, 1)  # 2x2x1 chips
  assert tpu.libtpu_topology("2xtpu7x-64") == ("tpu7x:2x4x4", {}, 2)
  assert [s for s in tpu.supported_slices() if s.startswith("tpu7x")] == [
      f"tpu7x-{n}" for n in (8, 16, 32, 64, 128, 256, 512)]
  with pytest.raises(ValueError, match="tpu7x-8, tpu7x-16"):
    tpu.libtpu_topology("tpu7x-4")  # 2 chips: less than a host's 2x2x1
  assert "tpu7x" in known_topologies() and "tpu7x-64" in known_topologies()
