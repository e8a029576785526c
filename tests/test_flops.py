"""Analytic FLOP counts against independent counts: hand formulas, the dot_general
equations of the model's own jaxpr, and XLA's cost analysis of the compiled step."""

import math
import types

import jax
import jax.extend
import jax.numpy as jnp
import pytest

from t5x_like.models import bert, build_model, gpt2, t5
from t5x_like.models.config import ModelConfig
from t5x_like.train import flops

B, L, T, P = 4, 64, 32, 10
NO_DROPOUT = dict(dropout_rate=0.0, attention_dropout_rate=0.0)


def _cases():
  """(config, training batch shapes) of tiny BERT / GPT-2 / T5 v1.1 (with GQA)."""
  return {
      "bert": (bert(2, 128, vocab_size=1000, **NO_DROPOUT),
               {"encoder_input_tokens": (B, L), "encoder_type_ids": (B, L),
                "mlm_positions": (B, P), "mlm_targets": (B, P), "mlm_weights": (B, P),
                "nsp_labels": (B,)}),
      "gpt2": (gpt2(2, 128, vocab_size=1000, **NO_DROPOUT),
               {"decoder_input_tokens": (B, T), "decoder_target_tokens": (B, T),
                "decoder_loss_weights": (B, T)}),
      "t5": (t5("1.1", 128, 256, 2, 4, vocab_size=1000, num_kv_heads=2, head_dim=32,
                num_decoder_layers=3),
             {"encoder_input_tokens": (B, L), "decoder_input_tokens": (B, T),
              "decoder_target_tokens": (B, T), "decoder_loss_weights": (B, T)}),
  }


def _forward_and_train_fns(cfg, shapes):
  """Abstract params and batch (tracing and compiling need only shapes), the
  deterministic forward and the training step (loss and grads)."""
  model = build_model(cfg)
  params = model.param_shapes(shapes)
  batch = {k: jax.ShapeDtypeStruct(s, jnp.int32) for k, s in shapes.items()}
  # EncoderModel.logits drops mlm_positions (logits at every position), so its forward
  # is counted without them.
  fwd_shapes = {k: v for k, v in shapes.items() if k != "mlm_positions"}
  forward = lambda p, b: model.logits(p, b)
  train = lambda p, b: jax.value_and_grad(lambda q: model.loss_fn(q, b, None)[0])(p)
  return params, batch, fwd_shapes, forward, train


def _ones(jaxpr) -> set:
  """Variables that are a broadcast of the literal 1 (jnp.ones)."""
  return {eqn.outvars[0] for eqn in jaxpr.eqns
          if eqn.primitive.name == "broadcast_in_dim"
          and isinstance(eqn.invars[0], jax.extend.core.Literal) and eqn.invars[0].val == 1}


def _jaxpr_dot_flops(jaxpr) -> float:
  """2 * output size * contracted size of every dot_general, through sub-jaxprs
  (pjit, custom_vjp, remat) and scans (times their length). A product of ones with g
  is a bias gradient (a sum over the batch, layers.dot), not a model matmul."""
  total = 0.0
  ones = _ones(jaxpr)
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general" and eqn.invars[0] not in ones:
      (lhs_contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in lhs_contract)
    times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if hasattr(sub, "eqns"):
          total += times * _jaxpr_dot_flops(sub)
        elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
          total += times * _jaxpr_dot_flops(sub.jaxpr)
  return total


def _xla_flops(fn, *args) -> float:
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return float(cost["flops"])


@pytest.mark.parametrize("name", ["bert", "gpt2", "t5"])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_matches_the_models_own_matmuls_exactly(name, scan_layers):
  """Every dot_general the traced forward and train step run, sized from their avals:
  the analytic count must match exactly (same matmuls, backward exactly 2x forward)."""
  cfg, shapes = _cases()[name]
  cfg = cfg.replace(scan_layers=scan_layers)
  params, batch, fwd_shapes, forward, train = _forward_and_train_fns(cfg, shapes)
  fwd = _jaxpr_dot_flops(jax.make_jaxpr(forward)(params, batch).jaxpr)
  step = _jaxpr_dot_flops(jax.make_jaxpr(train)(params, batch).jaxpr)
  assert flops.forward_flops(cfg, fwd_shapes) == pytest.approx(fwd, rel=1e-9)
  assert flops.train_flops_per_step(cfg, shapes) == pytest.approx(step, rel=1e-9)


@pytest.mark.parametrize("name", ["bert", "gpt2", "t5"])
def test_agrees_with_xla_cost_analysis(name):
  """XLA counts every op, matmuls and elementwise (norms, gelu, softmax, masks, the
  loss), so it must be >= the matmul-only count, and at most ~10% above it: for
  d_model=128 the elementwise work per token is O(d_ff + d_model + heads * length),
  a few % of the O(d_model^2 + d_model * d_ff) matmuls (measured: 2-8%)."""
  cfg, shapes = _cases()[name]
  params, batch, fwd_shapes, forward, train = _forward_and_train_fns(cfg, shapes)
  fwd_ratio = _xla_flops(forward, params, batch) / flops.forward_flops(cfg, fwd_shapes)
  train_ratio = _xla_flops(train, params, batch) / flops.train_flops_per_step(cfg, shapes)
  assert 0.999 <= fwd_ratio <= 1.10, fwd_ratio
  assert 0.999 <= train_ratio <= 1.10, train_ratio


def test_hand_count_decoder():
  # D=8, N=2 heads of H=4, F=16, 1 layer, V=10, B=1, T=3 (plain MLP, MHA).
  cfg = gpt2(1, 8, num_heads=2, d_ff=16, vocab_size=10)
  q = k = v = o = 2 * 3 * 8 * 8  # [3, 8] x [8, 8]
  scores = weighted = 2 * 2 * 3 * 3 * 4  # per head [3, 4] x [4, 3], then [3, 3] x [3, 4]
  mlp = 2 * 3 * 8 * 16 * 2  # wi and wo
  logits = 2 * 3 * 8 * 10
  forward = q + k + v + o + scores + weighted + mlp + logits
  assert forward == 3840
  shapes = {"decoder_input_tokens": (1, 3)}
  assert flops.forward_flops(cfg, shapes) == forward
  assert flops.train_flops_per_step(cfg, shapes) == 3 * forward


def test_hand_count_bert_heads_run_at_mlm_positions():
  # D=8, N=2, H=4, F=16, 1 layer, V=10, B=2, L=5, P=2; MLM transform [8, 8], NSP [8, 2].
  cfg = bert(1, 8, num_heads=2, d_ff=16, vocab_size=10)
  tokens = 2 * 5
  layer = 4 * 2 * tokens * 8 * 8 + 2 * 2 * 2 * 5 * 5 * 8 + 2 * 2 * tokens * 8 * 16
  mlm = 2 * 2 * 2 * 8 * 8 + 2 * 2 * 2 * 8 * 10  # transform + logits at B*P = 4 positions
  nsp = 2 * 2 * 8 * 8 + 2 * 2 * 8 * 2  # pooler + classifier on [CLS]
  shapes = {"encoder_input_tokens": (2, 5), "mlm_positions": (2, 2)}
  assert flops.forward_flops(cfg, shapes) == layer + mlm + nsp
  mlm_everywhere = 2 * tokens * 8 * 8 + 2 * tokens * 8 * 10
  assert flops.forward_flops(cfg, {"encoder_input_tokens": (2, 5)}) == layer + mlm_everywhere + nsp


def test_hand_count_t5_gqa_gated_cross_attention():
  # D=8, N=4 heads of H=2 with K=2 kv heads, gated MLP F=6, 1 enc + 2 dec layers, V=10,
  # B=1, L=5, T=3.
  cfg = t5("1.1", 8, 6, 1, 4, head_dim=2, num_kv_heads=2, num_decoder_layers=2,
           vocab_size=10)
  def attention(tq, tk):
    return 2 * 2 * tq * 8 * 8 + 2 * 2 * tk * 8 * 4 + 2 * 2 * 4 * tq * tk * 2
  enc = attention(5, 5) + 3 * 2 * 5 * 8 * 6
  dec = attention(3, 3) + attention(3, 5) + 3 * 2 * 3 * 8 * 6
  forward = enc + 2 * dec + 2 * 3 * 8 * 10
  shapes = {"encoder_input_tokens": (1, 5), "decoder_input_tokens": (1, 3)}
  assert flops.forward_flops(cfg, shapes) == forward


@pytest.mark.parametrize("make", [
    lambda n: gpt2(n, 64, vocab_size=100),
    lambda n: bert(n, 64, vocab_size=100),
    lambda n: t5("1.0", 64, 128, n, 2, vocab_size=100),
])
def test_linear_in_layers(make):
  shapes = {"encoder_input_tokens": (2, 16), "decoder_input_tokens": (2, 8),
            "mlm_positions": (2, 3)}
  counts = [flops.train_flops_per_step(make(n), shapes) for n in (1, 2, 3, 7)]
  per_layer = counts[1] - counts[0]
  assert per_layer > 0
  assert counts[2] - counts[1] == pytest.approx(per_layer, rel=1e-12)
  assert counts[3] - counts[0] == pytest.approx(6 * per_layer, rel=1e-12)


def test_forward_is_two_flops_per_parameter_per_token_when_attention_is_short():
  """Kaplan et al.: forward ~ 2 N tokens when d_model >> length. N = every parameter
  a matmul touches: the model's non-embedding params plus the tied token table (it is
  the logits matmul). Counted from the initialised params, not from the formula."""
  cfg = gpt2(2, 512, vocab_size=1000)
  tokens_shape = (2, 8)
  model = build_model(cfg)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                             {"decoder_input_tokens": tokens_shape}))
  total = sum(x.size for x in jax.tree.leaves(shapes))
  position_table = cfg.max_position_embeddings * cfg.d_model
  params = total - position_table  # the token table stays: it is the logits matrix
  expected = 2 * params * 2 * 8
  got = flops.forward_flops(cfg, {"decoder_input_tokens": tokens_shape})
  assert got == pytest.approx(expected, rel=0.01)


def test_mfu_arithmetic():
  assert flops.mfu(6e12, 2.0, 4, 1e12) == pytest.approx(0.75)


@pytest.mark.parametrize("kind,platform,dtype,peak", [
    ("TPU v2", "tpu", "bfloat16", 22.5e12),
    ("TPU v3", "tpu", "bfloat16", 61.5e12),
    ("TPU v4", "tpu", "bfloat16", 275e12),
    ("TPU v5 lite", "tpu", "bfloat16", 197e12),
    ("TPU v5", "tpu", "bfloat16", 459e12),
    ("TPU v5p", "tpu", "float32", 459e12),
    ("TPU v6 lite", "tpu", "bfloat16", 918e12),
    ("TPU7x", "tpu", "bfloat16", 1153.5e12),  # one TensorCore: half of 2307e12 a chip
    ("NVIDIA H100 80GB HBM3", "gpu", "bfloat16", 989e12),
    ("NVIDIA H100 80GB HBM3", "gpu", "float32", 494.5e12),
    ("NVIDIA H200", "gpu", "bfloat16", 989e12),
    ("NVIDIA A100-SXM4-40GB", "gpu", "bfloat16", 312e12),
])
def test_peak_table(kind, platform, dtype, peak):
  device = types.SimpleNamespace(platform=platform, device_kind=kind)
  assert flops.peak_flops_per_device(device, dtype) == peak


def test_cpu_peak_is_measured_and_cached():
  bf16 = flops.peak_flops_per_device(jax.devices("cpu")[0], "bfloat16")
  f32 = flops.peak_flops_per_device(jax.devices("cpu")[0], "float32")
  for value in (bf16, f32):
    assert math.isfinite(value) and value > 1e6  # any CPU does > 1 MFLOP/s per device
  # Per device: the host rate shared by the (fake) CPU devices; measured once.
  host = flops.measure_matmul_flops("cpu", "bfloat16")
  assert bf16 == pytest.approx(host / len(jax.local_devices(backend="cpu")))
  assert flops.peak_flops_per_device(jax.devices("cpu")[0], "bfloat16") == bf16
  with pytest.raises(ValueError, match="dtype"):
    flops.peak_flops_per_device(jax.devices("cpu")[0], "float16")


def test_rejects_config_without_needed_shapes():
  with pytest.raises(KeyError):
    flops.forward_flops(ModelConfig(family="decoder"), {"encoder_input_tokens": (1, 4)})
