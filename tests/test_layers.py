"""Building blocks against independent references: masks, GQA/MQA, a Llama decoder in
PyTorch, losses against optax, the decode cache, scanned / rematerialised stacks, dropout."""

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from t5x_like import models
from t5x_like.models.layers import dot
from t5x_like.models.attention import MultiHeadAttention
from t5x_like.models.masks import attention_mask
from t5x_like.models.attention_core import attend
from t5x_like.models.losses import cross_entropy

_NO_DROPOUT = dict(dropout_rate=0.0, attention_dropout_rate=0.0)


def _gpt2_tiny(**kw):
  base = dict(num_heads=4, d_ff=40, vocab_size=37, max_position_embeddings=16, **_NO_DROPOUT)
  return models.gpt2(2, 24, **{**base, **kw})


def _t5_tiny(**kw):
  return models.t5("1.1", 24, 40, 2, 4, head_dim=6, vocab_size=37, **kw)


def _tokens(shape, vocab=37, seed=0):
  return np.random.RandomState(seed).randint(1, vocab, size=shape).astype(np.int32)


def _random_params(model, batch_shapes=None, seed=0, std=0.2):
  """Params of the model's shapes drawn with numpy (norm scales around 1).

  On CPU, compiling jax's threefry initialisers costs seconds per shape; the values of
  the params are inputs here, not what is tested.
  """
  rng = np.random.RandomState(seed)

  def draw(path, shape):
    base = 1.0 if path[-1].key == "scale" else 0.0
    return (base + std * rng.randn(*shape.shape)).astype(np.float32)

  return jax.tree_util.tree_map_with_path(draw, model.param_shapes(batch_shapes))


def _key(seed):
  """A dropout key; 'rbg' compiles much faster than threefry on CPU."""
  return jax.random.key(seed, impl="rbg")


def _logits(model, params, batch):
  return np.asarray(jax.jit(model.logits)(params, batch))


# ------------------------------------------------------------------------- (a) masks
def test_causal_mask():
  mask = attention_mask(jnp.ones((1, 4)), causal=True)
  assert mask.shape == (1, 1, 4, 4) and mask.dtype == jnp.bool_
  want = np.array([[1, 0, 0, 0],
                   [1, 1, 0, 0],
                   [1, 1, 1, 0],
                   [1, 1, 1, 1]], bool)
  np.testing.assert_array_equal(np.asarray(mask[0, 0]), want)


def test_prefix_lm_mask():
  prefix = jnp.array([[1, 1, 0, 0], [1, 1, 1, 0]])  # decoder_causal_attention
  mask = attention_mask(jnp.ones((2, 4)), causal=True, prefix_BxQ=prefix)
  want0 = np.array([[1, 1, 0, 0],
                    [1, 1, 0, 0],
                    [1, 1, 1, 0],
                    [1, 1, 1, 1]], bool)
  want1 = np.array([[1, 1, 1, 0],
                    [1, 1, 1, 0],
                    [1, 1, 1, 0],
                    [1, 1, 1, 1]], bool)
  np.testing.assert_array_equal(np.asarray(mask[0, 0]), want0)
  np.testing.assert_array_equal(np.asarray(mask[1, 0]), want1)


def test_packed_segments_mask():
  seg = jnp.array([[1, 1, 2, 2, 2, 0]])  # two packed examples and one padding slot
  causal = attention_mask(seg > 0, query_segment_BxQ=seg, key_segment_BxK=seg, causal=True)
  want = np.array([[1, 0, 0, 0, 0, 0],
                   [1, 1, 0, 0, 0, 0],
                   [0, 0, 1, 0, 0, 0],
                   [0, 0, 1, 1, 0, 0],
                   [0, 0, 1, 1, 1, 0],
                   [0, 0, 0, 0, 0, 0]], bool)
  np.testing.assert_array_equal(np.asarray(causal[0, 0]), want)
  bidir = attention_mask(seg > 0, query_segment_BxQ=seg, key_segment_BxK=seg)
  want = np.array([[1, 1, 0, 0, 0, 0],
                   [1, 1, 0, 0, 0, 0],
                   [0, 0, 1, 1, 1, 0],
                   [0, 0, 1, 1, 1, 0],
                   [0, 0, 1, 1, 1, 0],
                   [0, 0, 0, 0, 0, 0]], bool)
  np.testing.assert_array_equal(np.asarray(bidir[0, 0]), want)
  padded = attention_mask(jnp.array([[5, 3, 0]]) > 0)  # no segments: padding keys only
  padded = np.broadcast_to(np.asarray(padded), (1, 1, 3, 3))  # [B, 1, 1, K] broadcasts
  np.testing.assert_array_equal(padded[0, 0], np.array([[1, 1, 0]] * 3, bool))


def test_packed_decoder_equals_separate_examples():
  """A packed row gives each example the logits it gets alone (positions restart)."""
  model = models.build_model(_gpt2_tiny())
  params = _random_params(model)
  a, b = _tokens((1, 2), seed=1), _tokens((1, 3), seed=2)
  packed = {"decoder_input_tokens": np.concatenate([a, b, [[0]]], 1),
            "decoder_segment_ids": np.array([[1, 1, 2, 2, 2, 0]], np.int32),
            "decoder_positions": np.array([[0, 1, 0, 1, 2, 0]], np.int32)}
  got = _logits(model, params, packed)
  alone_a = _logits(model, params, {"decoder_input_tokens": a})
  alone_b = _logits(model, params, {"decoder_input_tokens": b})
  np.testing.assert_allclose(got[:, :2], alone_a, atol=1e-5)
  np.testing.assert_allclose(got[:, 2:5], alone_b, atol=1e-5)


# ------------------------------------------------------------------- (b) GQA / MQA
def _np_softmax(x):
  x = x - x.max(-1, keepdims=True)
  e = np.exp(x)
  return e / e.sum(-1, keepdims=True)


def _reference_attention(x, p, num_heads, num_kv_heads, mask, scale, bias=None):
  """Plain numpy attention; each group of num_heads // num_kv_heads query heads shares
  one kv head (kv heads repeated, as Hugging Face's repeat_kv)."""
  x = np.asarray(x, np.float64)
  proj = lambda name: (np.einsum("btd,dnh->btnh", x, np.asarray(p[name]["kernel"])) +
                       np.asarray(p[name]["bias"]))
  q, k, v = proj("query"), proj("key"), proj("value")
  rep = num_heads // num_kv_heads
  k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
  logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
  if bias is not None:
    logits = logits + np.asarray(bias)
  logits = np.where(np.asarray(mask), logits, -1e30)
  out = np.einsum("bnts,bsnh->btnh", _np_softmax(logits), v)
  return np.einsum("btnh,nhd->btd", out, np.asarray(p["out"]["kernel"])) + p["out"]["bias"]


@pytest.mark.parametrize("num_kv_heads", [6, 2, 1])
def test_attention_gqa_mqa_matches_reference(num_kv_heads):
  cfg = models.gpt2(1, 36, num_heads=6, num_kv_heads=num_kv_heads, d_ff=8, vocab_size=11,
                    **_NO_DROPOUT)
  rng = np.random.RandomState(num_kv_heads)
  x = rng.randn(2, 5, 36).astype(np.float32)
  mask = attention_mask(jnp.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]), causal=True)
  attn = MultiHeadAttention(cfg)
  shapes = jax.eval_shape(lambda: nn.meta.unbox(attn.init(_key(0), x, x, mask)["params"]))
  # Random kernels and biases (non-zero, so that they are checked).
  params = jax.tree.map(lambda s: (0.2 * rng.randn(*s.shape)).astype(np.float32), shapes)
  assert params["key"]["kernel"].shape == (36, num_kv_heads, 6)
  got = jax.jit(attn.apply)({"params": params}, x, x, mask)
  want = _reference_attention(x, params, 6, num_kv_heads, mask, 6 ** -0.5)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def _plain_attention(q, k, v, bias, mask, keep, scale):
  """Plain float32 attention with kv heads repeated (GQA), autodiffed by JAX."""
  rep = q.shape[2] // k.shape[2]
  kr, vr = jnp.repeat(k, rep, 2), jnp.repeat(v, rep, 2)
  logits = jnp.einsum("btnh,bsnh->bnts", q, kr) * scale + bias
  probs = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1) * keep
  return jnp.einsum("bnts,bsnh->btnh", probs, vr)


def _attention_inputs(num_kv_heads, seed=0):
  rng = np.random.RandomState(seed + num_kv_heads)
  q = rng.randn(2, 5, 4, 8).astype(np.float32)
  k = rng.randn(2, 7, num_kv_heads, 8).astype(np.float32)
  v = rng.randn(2, 7, num_kv_heads, 8).astype(np.float32)
  bias = rng.randn(1, 4, 5, 7).astype(np.float32)
  mask = np.broadcast_to(np.arange(7)[None, None, None, :] < np.array([7, 4])[:, None,
                                                                               None, None],
                         (2, 1, 5, 7))
  keep = (rng.rand(2, 4, 5, 7) > 0.3).astype(np.float32) / 0.7
  return q, k, v, bias, mask, keep


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_explicit_attention_values_and_grads_match_reference(num_kv_heads):
  """attention_core's explicit kernel (custom VJP) == autodiff of a plain float32
  attention, values and gradients of q, k, v and the bias, with and without dropout;
  without dropout also == jax.nn.dot_product_attention."""
  q, k, v, bias, mask, keep = _attention_inputs(num_kv_heads)
  cot = np.random.RandomState(9).randn(2, 5, 4, 8).astype(np.float32)
  for keep_or_none in (None, keep):
    ref_keep = np.ones_like(keep) if keep_or_none is None else keep_or_none

    def ours(q, k, v, bias):
      return jnp.sum(attend(q, k, v, bias=bias, mask=mask, keep=keep_or_none, scale=0.3,
                            impl="explicit") * cot)

    def ref(q, k, v, bias):
      return jnp.sum(_plain_attention(q, k, v, bias, mask, ref_keep, 0.3) * cot)

    got = jax.value_and_grad(ours, argnums=(0, 1, 2, 3))(q, k, v, bias)
    want = jax.value_and_grad(ref, argnums=(0, 1, 2, 3))(q, k, v, bias)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=1e-4)
  out = attend(q, k, v, bias=bias, mask=mask, scale=0.3, impl="explicit")
  fused = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=0.3)
  np.testing.assert_allclose(np.asarray(out), np.asarray(fused), atol=1e-5)


def test_explicit_attention_bfloat16_close_to_float32():
  """In bfloat16 every product is bf16 x bf16 -> f32: values and grads stay within bf16
  rounding of the float32 reference."""
  q, k, v, bias, mask, keep = _attention_inputs(2, seed=3)
  cot = np.random.RandomState(4).randn(2, 5, 4, 8).astype(np.float32)

  def ours(q, k, v, bias):
    out = attend(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                 bias=bias, mask=mask, keep=keep, scale=0.3, impl="explicit")
    assert out.dtype == jnp.bfloat16
    return jnp.sum(out.astype(jnp.float32) * cot)

  def ref(q, k, v, bias):
    return jnp.sum(_plain_attention(q, k, v, bias, mask, keep, 0.3) * cot)

  got = jax.grad(ours, argnums=(0, 1, 2, 3))(q, k, v, bias)
  want = jax.grad(ref, argnums=(0, 1, 2, 3))(q, k, v, bias)
  for g, w in zip(got, want):
    scale = np.abs(np.asarray(w)).max()
    np.testing.assert_allclose(np.asarray(g, np.float32) / scale, np.asarray(w) / scale,
                               atol=3e-2)


def test_attention_impl_choices():
  q, k, v, bias, mask, keep = _attention_inputs(4)
  with pytest.raises(ValueError, match="cannot apply attention dropout"):
    attend(q, k, v, mask=mask, dropout_rate=0.1, dropout_rng=jax.random.key(0), impl="xla")
  with pytest.raises(ValueError, match="attention impl 'flash'"):
    attend(q, k, v, impl="flash")
  with pytest.raises(ValueError, match="attention_impl"):
    models.preset("bert-tiny", attention_impl="flash")


# ------------------------------------------------- (c) Llama (RoPE, RMSNorm, SwiGLU, GQA)
def test_llama_decoder_matches_transformers():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  vocab, d, n, kvh, ff, layers = 101, 48, 6, 2, 80, 2
  h = d // n
  hf_config = transformers.LlamaConfig(
      vocab_size=vocab, hidden_size=d, intermediate_size=ff, num_hidden_layers=layers,
      num_attention_heads=n, num_key_value_heads=kvh, rms_norm_eps=1e-6,
      tie_word_embeddings=False, max_position_embeddings=64, attn_implementation="eager")
  torch.manual_seed(0)
  hf = transformers.LlamaForCausalLM(hf_config).float().eval()
  assert hf.config._attn_implementation == "eager"
  assert hf.config.rope_parameters["rope_theta"] == 10000.0
  with torch.no_grad():  # larger than the 0.02 init so that every weight matters
    for name, p in hf.named_parameters():
      base = 1.0 if name.endswith("norm.weight") else 0.0
      p.copy_(base + 0.15 * torch.randn_like(p))
  w = {k: v.detach().numpy() for k, v in hf.state_dict().items()}

  cfg = models.ModelConfig(
      family="decoder", vocab_size=vocab, d_model=d, num_heads=n, num_kv_heads=kvh, d_ff=ff,
      num_layers=layers, mlp_activation="swiglu", norm="rmsnorm", norm_eps=1e-6,
      pre_norm=True, final_norm=True, use_bias=False, position_embedding="rope",
      rope_theta=10000.0, tie_embeddings=False, **_NO_DROPOUT)
  model = models.build_model(cfg)

  def layer(i):
    pre = f"model.layers.{i}."
    heads = lambda name, k: w[pre + f"self_attn.{name}.weight"].T.reshape(d, k, h)
    return {
        "self_attention_norm": {"scale": w[pre + "input_layernorm.weight"]},
        "self_attention": {
            "query": {"kernel": heads("q_proj", n)},
            "key": {"kernel": heads("k_proj", kvh)},
            "value": {"kernel": heads("v_proj", kvh)},
            "out": {"kernel": w[pre + "self_attn.o_proj.weight"].T.reshape(n, h, d)},
        },
        "mlp_norm": {"scale": w[pre + "post_attention_layernorm.weight"]},
        "mlp": {
            "wi_0": {"kernel": w[pre + "mlp.gate_proj.weight"].T},
            "wi_1": {"kernel": w[pre + "mlp.up_proj.weight"].T},
            "wo": {"kernel": w[pre + "mlp.down_proj.weight"].T},
        },
    }

  params = {
      "token_embed": {"embedding": w["model.embed_tokens.weight"]},
      "decoder": {**{f"layers_{i}": layer(i) for i in range(layers)},
                  "final_norm": {"scale": w["model.norm.weight"]}},
      "logits_dense": {"kernel": w["lm_head.weight"].T},
  }
  shapes = model.param_shapes()
  assert jax.tree.structure(params) == jax.tree.structure(shapes)
  jax.tree.map(lambda a, s: np.testing.assert_equal(a.shape, s.shape), params, shapes)

  tokens = _tokens((2, 9), vocab=vocab, seed=4)
  with torch.no_grad():
    want = hf(torch.from_numpy(tokens).long()).logits.numpy()
  got = _logits(model, params, {"decoder_input_tokens": tokens})
  assert np.abs(want).max() > 1.0  # not a trivially small comparison
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------- (d) losses
@pytest.mark.parametrize("smoothing, z_loss", [(0.0, 0.0), (0.1, 0.0), (0.2, 1e-2)])
def test_cross_entropy_matches_optax_and_t5x(smoothing, z_loss):
  rng = np.random.RandomState(0)
  vocab = 11
  logits = (3 * rng.randn(3, 5, vocab)).astype(np.float32)
  targets = rng.randint(0, vocab, size=(3, 5))
  loss, z_term = cross_entropy(jnp.asarray(logits), jnp.asarray(targets), z_loss=z_loss,
                               label_smoothing=smoothing)
  confidence, low = 1.0 - smoothing, smoothing / (vocab - 1)
  soft = np.full((3, 5, vocab), low, np.float64)
  np.put_along_axis(soft, targets[..., None], confidence, axis=-1)
  ce = np.asarray(optax.softmax_cross_entropy(jnp.asarray(logits), jnp.asarray(soft)))
  # T5X: subtract the entropy of the smoothed targets so that a perfect model scores 0.
  normalizer = -(confidence * np.log(confidence) + (vocab - 1) * low * np.log(low + 1e-20))
  log_z = np.log(np.exp(logits.astype(np.float64)).sum(-1))
  want_z = z_loss * log_z ** 2
  np.testing.assert_allclose(np.asarray(z_term), want_z, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(loss), ce - normalizer + want_z, rtol=1e-5, atol=1e-5)
  # equivalently: KL(smoothed targets || softmax) + z term
  log_p = logits - log_z[..., None]
  kl = np.sum(np.where(soft > 0, soft * (np.log(np.where(soft > 0, soft, 1)) - log_p), 0), -1)
  np.testing.assert_allclose(np.asarray(loss), kl + want_z, rtol=1e-5, atol=1e-5)


def test_decoder_loss_is_weighted_mean_of_nll():
  model = models.build_model(_gpt2_tiny())
  params = _random_params(model)
  batch = {"decoder_input_tokens": _tokens((2, 6), seed=5),
           "decoder_target_tokens": _tokens((2, 6), seed=6),
           "decoder_loss_weights": np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]],
                                            np.float32)}
  loss, metrics = jax.jit(model.loss_fn)(params, batch, None)
  logits = _logits(model, params, batch).astype(np.float64)
  log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  nll = -np.take_along_axis(log_p, batch["decoder_target_tokens"][..., None], -1)[..., 0]
  w = batch["decoder_loss_weights"]
  np.testing.assert_allclose(float(loss), (nll * w).sum() / w.sum(), rtol=1e-5)
  assert float(metrics["token_tokens"]) == 10.0


# ----------------------------------------------------------------- (e) decode cache
def _llama_tiny():
  return models.ModelConfig(
      family="decoder", vocab_size=37, d_model=24, num_heads=4, num_kv_heads=2, d_ff=40,
      num_layers=2, mlp_activation="swiglu", norm="rmsnorm", norm_eps=1e-6, pre_norm=True,
      final_norm=True, use_bias=False, position_embedding="rope", tie_embeddings=False,
      **_NO_DROPOUT)


@pytest.mark.parametrize("make_config", [_gpt2_tiny, _llama_tiny], ids=["gpt2", "rope_gqa"])
def test_decoder_incremental_decoding_matches_full_forward(make_config):
  model = models.build_model(make_config())
  batch_size, length = 2, 6
  params = _random_params(model)
  tokens = _tokens((batch_size, length), seed=7)
  full = _logits(model, params, {"decoder_input_tokens": tokens})

  module = model.module(decode=True)
  # The cache, sized by the full-length batch (the params init also makes are dead code).
  cache = jax.jit(lambda: module.init(
      _key(1), {"decoder_input_tokens": jnp.zeros((batch_size, length), jnp.int32)})["cache"])()

  @jax.jit
  def step(cache, token_Bx1):
    logits, state = module.apply({"params": params, "cache": cache},
                                 {"decoder_input_tokens": token_Bx1}, mutable=["cache"])
    return logits, state["cache"]

  fresh = cache
  steps = []
  for t in range(length):
    logits, cache = step(cache, tokens[:, t:t + 1])
    steps.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=1e-5, rtol=1e-5)
  # The cache matters: the last token alone (empty cache) gives other logits.
  alone, _ = step(fresh, tokens[:, -1:])
  assert np.abs(np.asarray(alone)[:, 0] - full[:, -1]).max() > 1e-3


def test_encoder_decoder_incremental_decoding_matches_full_forward():
  model = models.build_model(_t5_tiny())
  batch_size, length = 2, 5
  params = _random_params(model, {"encoder_input_tokens": (batch_size, 7),
                                  "decoder_input_tokens": (batch_size, length)})
  enc = _tokens((batch_size, 7), seed=8)
  enc[1, 4:] = 0  # padding in the encoder input
  batch = {"encoder_input_tokens": enc, "decoder_input_tokens": _tokens((batch_size, length),
                                                                        seed=9)}
  full = _logits(model, params, batch)
  encoded = jax.jit(lambda p, b: model.module().apply({"params": p}, b, method="encode"))(
      params, batch)

  module = model.module(decode=True)
  cache = jax.jit(lambda: module.init(_key(1), encoded, batch, method="decode_logits")["cache"])()

  @jax.jit
  def step(cache, token_Bx1):
    logits, state = module.apply(
        {"params": params, "cache": cache}, encoded,
        {"encoder_input_tokens": enc, "decoder_input_tokens": token_Bx1},
        method="decode_logits", mutable=["cache"])
    return logits, state["cache"]

  fresh = cache
  steps = []
  for t in range(length):
    logits, cache = step(cache, batch["decoder_input_tokens"][:, t:t + 1])
    steps.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=1e-5, rtol=1e-5)
  alone, _ = step(fresh, batch["decoder_input_tokens"][:, -1:])
  assert np.abs(np.asarray(alone)[:, 0] - full[:, -1]).max() > 1e-3


# ------------------------------------------------------------ (f) scan and remat
def _stack_layers(params, num_layers):
  """Unscanned {'layers_i': tree} -> scanned {'layers': tree stacked on axis 0}."""
  out = {k: v for k, v in params.items() if not k.startswith("layers_")}
  out["layers"] = jax.tree.map(lambda *xs: np.stack(xs), *[params[f"layers_{i}"]
                                                            for i in range(num_layers)])
  return out


def test_scanned_layers_equal_unscanned():
  cfg = _t5_tiny(num_decoder_layers=3)
  plain, scanned = models.build_model(cfg), models.build_model(cfg.replace(scan_layers=True))
  batch = {"encoder_input_tokens": _tokens((2, 6), seed=10),
           "decoder_input_tokens": _tokens((2, 5), seed=11)}
  shapes = {k: v.shape for k, v in batch.items()}
  params = _random_params(plain, shapes)
  converted = dict(params, encoder=_stack_layers(params["encoder"], 2),
                   decoder=_stack_layers(params["decoder"], 3))
  want_shapes = scanned.param_shapes(shapes)
  assert jax.tree.structure(converted) == jax.tree.structure(want_shapes)
  assert converted["decoder"]["layers"]["mlp"]["wo"]["kernel"].shape == (3, 40, 24)
  np.testing.assert_allclose(_logits(scanned, converted, batch), _logits(plain, params, batch),
                             atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scan", [False, True])
def test_remat_full_gives_same_loss_and_grads(scan):
  cfg = _gpt2_tiny(dropout_rate=0.1, attention_dropout_rate=0.1, scan_layers=scan)
  batch = {"decoder_input_tokens": _tokens((2, 6), seed=12),
           "decoder_target_tokens": _tokens((2, 6), seed=13)}
  base = models.build_model(cfg)
  remat = models.build_model(cfg.replace(remat_policy="full"))
  params = _random_params(base)
  rng = _key(5)
  grad = lambda m: jax.jit(jax.value_and_grad(m.loss_fn, has_aux=True))(params, batch, rng)
  (loss_a, _), grads_a = grad(base)
  (loss_b, _), grads_b = grad(remat)
  np.testing.assert_allclose(float(loss_b), float(loss_a), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(b), np.asarray(a),
                                                       atol=1e-6, rtol=1e-5), grads_a, grads_b)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads_a)) > 1e-3


# ------------------------------------------------------------------- (g) dropout
def test_dropout_depends_on_rng_only():
  cfg = _gpt2_tiny(dropout_rate=0.2, attention_dropout_rate=0.0)
  model = models.build_model(cfg)
  params = _random_params(model)
  batch = {"decoder_input_tokens": _tokens((2, 6), seed=14)}
  apply = jax.jit(lambda p, b, rng: model.apply(p, b, dropout_rng=rng))
  out = lambda rng: np.asarray(apply(params, batch, rng))
  a, a_again, b = out(_key(1)), out(_key(1)), out(_key(2))
  np.testing.assert_array_equal(a, a_again)
  assert np.abs(a - b).max() > 1e-3
  deterministic = _logits(model, params, batch)
  no_dropout = models.build_model(cfg.replace(dropout_rate=0.0))
  np.testing.assert_array_equal(deterministic, _logits(no_dropout, params, batch))
  assert np.abs(a - deterministic).max() > 1e-3


def test_attention_dropout_is_applied():
  cfg = _gpt2_tiny(dropout_rate=0.0, attention_dropout_rate=0.3)
  model = models.build_model(cfg)
  params = _random_params(model)
  batch = {"decoder_input_tokens": _tokens((2, 6), seed=15)}
  apply = jax.jit(lambda p, b, rng: model.apply(p, b, dropout_rng=rng))
  out = lambda rng: np.asarray(apply(params, batch, rng))
  a, b = out(_key(1)), out(_key(2))
  np.testing.assert_array_equal(a, out(_key(1)))
  assert np.abs(a - b).max() > 1e-3
  # without a dropout rng the model is deterministic and equals the rate-0 model
  no_dropout = models.build_model(cfg.replace(attention_dropout_rate=0.0))
  np.testing.assert_array_equal(_logits(model, params, batch),
                                _logits(no_dropout, params, batch))


# ------------------------------------------------------------- bf16 matmul gradients
@pytest.mark.parametrize("x_shape, k_shape, contract", [
    ((3, 5, 16), (16, 24), 1),        # dense
    ((3, 5, 16), (16, 2, 8), 1),      # into heads
    ((3, 5, 2, 8), (2, 8, 16), 2),    # out of heads
    ((3, 5, 24), (24, 16), 1),        # wider in than out: dkernel as (g . x) transposed
    ((3, 5, 2, 8), (2, 8, 4), 2)])
def test_bf16_dot_gradients_are_bf16_products_with_f32_accumulation(x_shape, k_shape,
                                                                     contract):
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randn(*x_shape), jnp.float32)
  kernel = jnp.asarray(rng.randn(*k_shape), jnp.float32)
  weights = jnp.asarray(rng.randn(*x_shape[:-contract], *k_shape[contract:]), jnp.float32)

  def loss(x, kernel, dtype):
    return jnp.sum(dot(x, kernel, contract, dtype).astype(jnp.float32) * weights)

  # Reference: float32 math on the bf16-rounded operands.
  rounded = [a.astype(jnp.bfloat16).astype(jnp.float32) for a in (x, kernel)]
  want = jax.grad(loss, (0, 1))(*rounded, jnp.float32)
  got = jax.grad(loss, (0, 1))(x, kernel, jnp.bfloat16)
  for g, w, primal in zip(got, want, (x, kernel)):
    assert g.dtype == primal.dtype == jnp.float32
    np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * float(jnp.abs(w).max()))

  # Every matmul of forward and backward multiplies bf16 by bf16 into float32.
  jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)), static_argnums=2)(x, kernel, jnp.bfloat16)
  dots = [eq for eq in _all_eqns(jaxpr.jaxpr) if eq.primitive.name == "dot_general"]
  assert len(dots) == 3
  for eq in dots:
    assert [v.aval.dtype for v in eq.invars] == [jnp.bfloat16] * 2, eq
    assert eq.outvars[0].aval.dtype == jnp.float32, eq


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("out", [16, 4])  # 4: wider in (2 x 8) than out, dkernel swapped
def test_dot_with_bias_matches_plain_autodiff(dtype, tol, out):
  """dot(..., bias): values and the gradients of x, kernel and bias (the bias one is a
  product with ones) == JAX autodiff of a plain float32 tensordot + bias."""
  rng = np.random.RandomState(1)
  x = jnp.asarray(rng.randn(3, 5, 2, 8), jnp.float32)
  kernel = jnp.asarray(rng.randn(2, 8, out), jnp.float32)
  bias = jnp.asarray(rng.randn(out), jnp.float32)
  weights = jnp.asarray(rng.randn(3, 5, out), jnp.float32)

  def ours(x, kernel, bias):
    return jnp.sum(dot(x, kernel, 2, dtype, bias).astype(jnp.float32) * weights)

  def plain(x, kernel, bias):
    return jnp.sum((jnp.tensordot(x, kernel, 2) + bias) * weights)

  got = jax.value_and_grad(ours, (0, 1, 2))(x, kernel, bias)
  want = jax.value_and_grad(plain, (0, 1, 2))(x, kernel, bias)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol * float(jnp.abs(w).max()))


def _all_eqns(jaxpr):
  for eq in jaxpr.eqns:
    yield eq
    for sub in jax.extend.core.jaxprs_in_params(eq.params):
      yield from _all_eqns(sub)
