"""Meshes, logical-axis rules and sharded params / forwards of every family (8 fake CPUs).

Expected shardings are written by hand (the tensor-parallel layout of each param);
per-device parameter counts are checked against Hugging Face transformers' counts."""

import math

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from t5x_like import models, parallel

VOCAB = 98  # even (sharded over 'model' = 2) but not a multiple of 4 or 8
BATCH, LENGTH = 4, 7  # batch over 'data' = 4; odd length (replicated)

_NO_DROPOUT = dict(dropout_rate=0.0, attention_dropout_rate=0.0)
CONFIGS = {
    "bert": lambda: models.bert(2, 36, num_heads=6, d_ff=74, vocab_size=VOCAB,
                                max_position_embeddings=16, **_NO_DROPOUT),
    "gpt2": lambda: models.gpt2(2, 36, num_heads=6, d_ff=74, vocab_size=VOCAB,
                                max_position_embeddings=16, **_NO_DROPOUT),
    # GQA (3 kv heads: not divisible by 'model' = 2) and scanned layers
    "gpt2_gqa_scan": lambda: models.gpt2(2, 36, num_heads=6, num_kv_heads=3, d_ff=74,
                                         vocab_size=VOCAB, max_position_embeddings=16,
                                         scan_layers=True, **_NO_DROPOUT),
    "t5_v1_1_scan": lambda: models.t5("1.1", 36, 74, 2, 6, head_dim=8, vocab_size=VOCAB,
                                      num_decoder_layers=3, scan_layers=True),
    "t5_v1_0": lambda: models.t5("1.0", 36, 74, 1, 6, head_dim=8, vocab_size=VOCAB,
                                 **_NO_DROPOUT),
}

# Hand-written expectations on the ('data', 'model') mesh: path -> spec (without 'layers').
_M = "model"
EXPECTED = {
    "bert": {
        ("token_embed", "embedding"): (_M, None),
        ("position_embed", "embedding"): (None, None),
        ("type_embed", "embedding"): (None, None),
        ("embedding_norm", "scale"): (None,),
        ("embedding_norm", "bias"): (None,),
        ("encoder", "layers_0", "self_attention", "query", "kernel"): (None, _M, None),
        ("encoder", "layers_0", "self_attention", "query", "bias"): (_M, None),
        ("encoder", "layers_1", "self_attention", "key", "kernel"): (None, _M, None),
        ("encoder", "layers_0", "self_attention", "out", "kernel"): (_M, None, None),
        ("encoder", "layers_0", "self_attention", "out", "bias"): (None,),
        ("encoder", "layers_0", "mlp", "wi", "kernel"): (None, _M),
        ("encoder", "layers_0", "mlp", "wi", "bias"): (_M,),
        ("encoder", "layers_1", "mlp", "wo", "kernel"): (_M, None),
        ("encoder", "layers_1", "mlp_norm", "scale"): (None,),
        ("mlm_bias",): (_M,),
        ("nsp", "kernel"): (None, None),
    },
    "gpt2": {
        ("token_embed", "embedding"): (_M, None),
        ("position_embed", "embedding"): (None, None),
        ("decoder", "layers_0", "self_attention", "value", "kernel"): (None, _M, None),
        ("decoder", "layers_0", "mlp", "wi", "kernel"): (None, _M),
        ("decoder", "final_norm", "scale"): (None,),
    },
    "gpt2_gqa_scan": {  # leading None: the scanned 'layers' axis
        ("decoder", "layers", "self_attention", "query", "kernel"): (None, None, _M, None),
        ("decoder", "layers", "self_attention", "key", "kernel"): (None, None, None, None),
        ("decoder", "layers", "self_attention", "value", "bias"): (None, None, None),
        ("decoder", "layers", "self_attention", "out", "kernel"): (None, _M, None, None),
        ("decoder", "layers", "mlp", "wo", "kernel"): (None, _M, None),
        ("decoder", "layers", "mlp_norm", "scale"): (None, None),
    },
    "t5_v1_1_scan": {
        ("token_embed", "embedding"): (_M, None),
        ("logits_dense", "kernel"): (None, _M),
        ("encoder", "relpos", "rel_embedding"): (_M, None),
        ("decoder", "relpos", "rel_embedding"): (_M, None),
        ("encoder", "layers", "self_attention", "query", "kernel"): (None, None, _M, None),
        ("decoder", "layers", "cross_attention", "key", "kernel"): (None, None, _M, None),
        ("decoder", "layers", "mlp", "wi_0", "kernel"): (None, None, _M),
        ("decoder", "layers", "mlp", "wi_1", "kernel"): (None, None, _M),
        ("decoder", "layers", "mlp", "wo", "kernel"): (None, _M, None),
        ("decoder", "final_norm", "scale"): (None,),
    },
    "t5_v1_0": {
        ("token_embed", "embedding"): (_M, None),
        ("encoder", "layers_0", "self_attention", "query", "kernel"): (None, _M, None),
        ("decoder", "layers_0", "cross_attention", "out", "kernel"): (_M, None, None),
        ("decoder", "layers_0", "mlp", "wi", "kernel"): (None, _M),
        ("decoder", "layers_0", "cross_attention_norm", "scale"): (None,),
    },
}
# Independent of the models' logical names and of the rules: the dim of each param that
# tensor parallelism splits (Megatron-LM, Shoeybi et al. 2019), keyed by the end of its
# path: the vocab of the embedding, logits and MLM bias; the heads of Q, K, V, O and of
# the relative position bias; d_ff of the MLP; the output dim of BERT's pooler and MLM
# transform. K and V of grouped-query attention stay whole (their few heads are shared).
# Every other param is replicated; scanned layers add a leading (replicated) dim.
TENSOR_PARALLEL_DIM = {
    ("token_embed", "embedding"): 0, ("logits_dense", "kernel"): 1, ("mlm_bias",): 0,
    ("relpos", "rel_embedding"): 0,
    ("query", "kernel"): 1, ("key", "kernel"): 1, ("value", "kernel"): 1,
    ("query", "bias"): 0, ("key", "bias"): 0, ("value", "bias"): 0, ("out", "kernel"): 0,
    ("wi", "kernel"): 1, ("wi_0", "kernel"): 1, ("wi_1", "kernel"): 1, ("wi", "bias"): 0,
    ("wo", "kernel"): 0,
    ("pooler", "kernel"): 1, ("pooler", "bias"): 0,
    ("mlm_transform", "kernel"): 1, ("mlm_transform", "bias"): 0,
}
D, HEADS, FF, RELPOS_BUCKETS = 36, 6, 74, 32  # the CONFIGS' dimensions (T5's default buckets)


def _tensor_parallel_spec(path, shape, config):
  """Expected spec of a param on ('data', 'model') from its path (TENSOR_PARALLEL_DIM)."""
  dim = TENSOR_PARALLEL_DIM.get(path[-2:], TENSOR_PARALLEL_DIM.get(path[-1:]))
  if path[-2:-1] in (("key",), ("value",)) and config.kv_heads != config.num_heads:
    dim = None
  spec = [None] * len(shape)
  if dim is not None:
    spec[dim + (1 if "layers" in path else 0)] = _M
  return tuple(spec)


def hf_num_params(name: str) -> int:
  """Parameter count of the Hugging Face transformers model equivalent to CONFIGS[name],
  built on torch's meta device (nothing allocated, nothing downloaded)."""
  torch = pytest.importorskip("torch")
  hf = pytest.importorskip("transformers")
  if name == "bert":
    model_class, config = hf.BertForPreTraining, hf.BertConfig(
        vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=HEADS,
        intermediate_size=FF, max_position_embeddings=16, type_vocab_size=2)
  elif name.startswith("gpt2"):
    model_class, config = hf.GPT2LMHeadModel, hf.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=D, n_layer=2, n_head=HEADS, n_inner=FF,
        bos_token_id=1, eos_token_id=1)
  else:
    v1_1 = name == "t5_v1_1_scan"
    model_class, config = hf.T5ForConditionalGeneration, hf.T5Config(
        vocab_size=VOCAB, d_model=D, d_kv=8, d_ff=FF, num_layers=2 if v1_1 else 1,
        num_decoder_layers=3 if v1_1 else 1, num_heads=HEADS,
        feed_forward_proj="gated-gelu" if v1_1 else "relu", tie_word_embeddings=not v1_1)
  with torch.device("meta"):
    model = model_class(config)
  count = sum(p.numel() for p in model.parameters())  # tied weights once
  if name == "t5_v1_1_scan" and model.lm_head.weight is model.shared.weight:
    count += VOCAB * D  # transformers ties T5's lm_head even when asked not to
  if name == "gpt2_gqa_scan":  # K and V kernels and biases with 3 of the 6 heads
    count -= 2 * 2 * (D + 1) * 3 * (D // HEADS)
  return count


def tensor_parallel_params(name: str) -> int:
  """How many of CONFIGS[name]'s params TENSOR_PARALLEL_DIM splits, from its dimensions."""
  if name in ("bert", "gpt2", "gpt2_gqa_scan"):
    inner = D  # 6 heads of 6
    qkv = (1 if name == "gpt2_gqa_scan" else 3) * (D + 1) * inner  # kernels and biases
    layer = qkv + inner * D + 2 * D * FF + FF  # + O kernel, MLP kernels, wi bias
    heads = VOCAB + 2 * (D * D + D) if name == "bert" else 0  # MLM bias, transform, pooler
    return VOCAB * D + 2 * layer + heads
  inner = HEADS * 8
  mlp = (3 if name == "t5_v1_1_scan" else 2) * D * FF
  encoder, decoder = (2, 3) if name == "t5_v1_1_scan" else (1, 1)
  logits = VOCAB * D if name == "t5_v1_1_scan" else 0  # untied in v1.1
  return (VOCAB * D + logits + 2 * HEADS * RELPOS_BUCKETS + encoder * (4 * D * inner + mlp)
          + decoder * (8 * D * inner + mlp))


def _norm(spec, ndim):
  """PartitionSpec -> tuple of length ndim, 1-tuples of axes as plain names."""
  out = [a[0] if isinstance(a, tuple) and len(a) == 1 else a for a in tuple(spec)]
  return tuple(out) + (None,) * (ndim - len(out))


def _flat(tree, is_leaf=None):
  return {tuple(k.key for k in path): v
          for path, v in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)}


def _batch(model, seed=0):
  rng = np.random.RandomState(seed)
  batch = {}
  for name in model.example_batch_shapes():
    batch[name] = rng.randint(1, VOCAB, size=(BATCH, LENGTH)).astype(np.int32)
  if "encoder_type_ids" in batch:
    batch["encoder_type_ids"] %= 2
  if "encoder_input_tokens" in batch:
    batch["encoder_input_tokens"][1, 5:] = 0  # some padding
  return batch


def _sharded_forward(model, mesh, rules, batch, rng=None):
  # 'rbg' keys compile much faster than threefry on CPU; one test keeps the default.
  rng = jax.random.key(1, impl="rbg") if rng is None else rng
  shapes = {k: v.shape for k, v in batch.items()}
  param_sh = parallel.param_shardings(model, mesh, rules, shapes)
  params = jax.jit(lambda r: model.init(r, shapes), out_shardings=param_sh)(rng)
  with parallel.mesh_rules(mesh, rules):
    fwd = jax.jit(model.logits, in_shardings=(param_sh, parallel.batch_shardings(batch, mesh,
                                                                                 rules)))
    out = fwd(params, batch)
  return params, out


def _single_device_forward(model, params, batch):
  one = jax.devices()[0]
  params = jax.device_put(jax.device_get(params), one)
  return jax.jit(model.logits)(params, jax.device_put(batch, one))


@pytest.fixture(scope="module")
def mesh_4x2():
  return parallel.make_mesh({"data": 4, "model": 2})


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_params_sharded_by_rules_and_forward_matches(name, mesh_4x2):
  model = models.build_model(CONFIGS[name]())
  batch = _batch(model)
  params, out = _sharded_forward(model, mesh_4x2, parallel.DEFAULT_RULES, batch)

  flat = _flat(params)
  for path, spec in EXPECTED[name].items():
    assert path in flat, (path, sorted(flat))
    assert _norm(flat[path].sharding.spec, flat[path].ndim) == spec, path
  # Every param: sharded as the tensor-parallel layout says (by its path, by hand).
  logical = _flat(model.param_axes({k: v.shape for k, v in batch.items()}),
                  is_leaf=lambda x: isinstance(x, P))
  assert logical.keys() == flat.keys()
  scanned = model.config.scan_layers
  for path, x in flat.items():
    names = tuple(logical[path])
    assert len(names) == x.ndim, path
    assert ("layers" in names) == (scanned and "layers" in path), path
    want = _tensor_parallel_spec(path, x.shape, model.config)
    assert _norm(x.sharding.spec, x.ndim) == want, (path, names)
    # The shards really are split that way.
    shard_shape = x.addressable_shards[0].data.shape
    assert shard_shape == tuple(s // 2 if w == _M else s for s, w in zip(x.shape, want)), path
  # One device holds all of Hugging Face's count of the same model but half of the
  # params the tensor-parallel layout splits (counted from the dimensions).
  per_device = sum(math.prod(x.addressable_shards[0].data.shape) for x in flat.values())
  assert per_device == hf_num_params(name) - tensor_parallel_params(name) // 2

  ref = _single_device_forward(model, params, batch)
  for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
  # Logits come out sharded by the activation constraints: batch over data, vocab over model.
  logits = out["mlm_logits"] if isinstance(out, dict) else out
  assert _norm(logits.sharding.spec, 3) == ("data", None, _M)


def test_three_axis_mesh_shards_embed_over_fsdp():
  mesh = parallel.make_mesh([("data", 2), ("fsdp", 2), ("tensor", 2)])
  model = models.build_model(CONFIGS["gpt2"]())
  batch = _batch(model, seed=3)
  params, out = _sharded_forward(model, mesh, parallel.DEFAULT_RULES, batch,
                                 rng=jax.random.key(2))
  flat = _flat(params)
  layer = ("decoder", "layers_1")
  expected = {
      ("token_embed", "embedding"): ("tensor", "fsdp"),
      ("position_embed", "embedding"): (None, "fsdp"),
      layer + ("self_attention", "query", "kernel"): ("fsdp", "tensor", None),
      layer + ("self_attention", "out", "kernel"): ("tensor", None, "fsdp"),
      layer + ("mlp", "wi", "kernel"): ("fsdp", "tensor"),
      layer + ("mlp", "wi", "bias"): ("tensor",),
      layer + ("mlp", "wo", "kernel"): ("tensor", "fsdp"),
      layer + ("mlp", "wo", "bias"): ("fsdp",),
      ("decoder", "final_norm", "scale"): ("fsdp",),
  }
  for path, spec in expected.items():
    assert _norm(flat[path].sharding.spec, flat[path].ndim) == spec, path
  emb = flat[("token_embed", "embedding")]
  assert emb.addressable_shards[0].data.shape == (VOCAB // 2, 36 // 2)
  ref = _single_device_forward(model, params, batch)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
  # Activations: batch takes data and fsdp, so embed is not sharded again.
  assert _norm(out.sharding.spec, 3) == (("data", "fsdp"), None, "tensor")


# ------------------------------------------------------------------------- mesh
def test_make_mesh_fills_minus_one():
  mesh = parallel.make_mesh({"data": -1, "model": 2})
  assert dict(mesh.shape) == {"data": 4, "model": 2}
  assert mesh.axis_names == ("data", "model")
  assert all(t == AxisType.Auto for t in mesh.axis_types)
  mesh = parallel.make_mesh([("data", 2), ("fsdp", -1), ("tensor", 1)])
  assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
  mesh = parallel.make_mesh({"data": -1}, devices=jax.devices()[:2])
  assert dict(mesh.shape) == {"data": 2}
  assert set(mesh.devices.flat) == set(jax.devices()[:2])


@pytest.mark.parametrize("sizes, pattern", [
    ({"data": 3, "model": 2}, r"'data': 3, 'model': 2.*multiply to 6.*8 devices"),
    ({"data": -1, "model": 3}, r"'model': 3.*8 devices"),
    ({"data": -1, "model": -1}, r"at most one"),
    ({"data": 0, "model": 8}, r"positive"),
])
def test_make_mesh_rejects_bad_shapes(sizes, pattern):
  with pytest.raises(ValueError, match=pattern):
    parallel.make_mesh(sizes)


# ------------------------------------------------------------------------ rules
def test_rules_for_mesh_drops_missing_axes():
  rules = parallel.rules_for_mesh(parallel.DEFAULT_RULES, ("data", "model"))
  as_dict = {}
  for logical, axes in rules:
    as_dict.setdefault(logical, []).append(axes)
  assert as_dict["batch"] == ["data"]
  assert as_dict["heads"] == as_dict["mlp"] == as_dict["vocab"] == ["model"]
  assert "embed" not in as_dict  # its only axis (fsdp) is gone: the rule goes
  assert as_dict["kv"] == [None]  # explicit replication is kept
  full = parallel.rules_for_mesh(parallel.DEFAULT_RULES, ("data", "fsdp", "tensor"))
  assert dict(full)["batch"] == ("data", "fsdp") and dict(full)["embed"] == "fsdp"
  assert ("heads", "model") not in full


def test_rules_for_mesh_keeps_later_fallback():
  rules = (("embed", ("fsdp",)), ("embed", "model"), ("mlp", ("data", "model")))
  kept = parallel.rules_for_mesh(rules, ("data", "model"))
  assert kept == (("embed", "model"), ("mlp", ("data", "model")))
  assert nn.logical_to_mesh_axes(("embed",), kept) == P("model")
  # The first rule, had it become "replicated", would have hidden the fallback.
  assert nn.logical_to_mesh_axes(("embed",), (("embed", None), ("embed", "model"))) == P(None)


def test_default_rules_cover_every_logical_name(monkeypatch):
  """The rules (and LOGICAL_AXES) name exactly the logical axes the models use: those of
  their params and of the activations they constrain, recorded while tracing each
  family's forward."""
  used = set()

  def record(x, axes, *args, **kwargs):
    used.update(n for n in axes if n is not None)
    return x

  monkeypatch.setattr(nn, "with_logical_constraint", record)
  for make in CONFIGS.values():
    model = models.build_model(make())
    specs = jax.tree.leaves(model.param_axes(), is_leaf=lambda x: isinstance(x, P))
    used.update(n for spec in specs for n in spec if n is not None)
    batch = {k: jax.ShapeDtypeStruct(v, np.int32)
             for k, v in model.example_batch_shapes().items()}
    jax.eval_shape(model.logits, model.param_shapes(), batch)
  assert {"batch", "length"} <= used  # activations only: the recording worked
  assert {r[0] for r in parallel.DEFAULT_RULES} == used
  assert set(parallel.LOGICAL_AXES) == used


def test_batch_sharding_and_shard_batch(mesh_4x2):
  batch = {"decoder_input_tokens": np.arange(4 * 6, dtype=np.int32).reshape(4, 6),
           "nsp_labels": np.array([0, 1, 1, 0], np.int32)}
  sh = parallel.batch_shardings(batch, mesh_4x2)
  assert _norm(sh["decoder_input_tokens"].spec, 2) == ("data", None)
  assert _norm(sh["nsp_labels"].spec, 1) == ("data",)
  arrays = parallel.shard_batch(batch, mesh_4x2)
  np.testing.assert_array_equal(np.asarray(arrays["decoder_input_tokens"]),
                                batch["decoder_input_tokens"])
  shard = arrays["decoder_input_tokens"].addressable_shards[0]
  assert shard.data.shape == (1, 6)
  mesh3 = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  assert _norm(parallel.batch_spec(2, mesh3.axis_names), 2) == (("data", "fsdp"), None)
