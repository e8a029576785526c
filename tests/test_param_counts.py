"""Parameter counts of the full-size presets equal Hugging Face transformers' counts.

Nothing is allocated on either side: our counts come from `jax.eval_shape`
(`param_shapes` / `num_params`), the reference models are built on torch's meta device.
"""

import jax
import numpy as np
import pytest

from t5x_like import models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_count(model_class, config) -> int:
  with torch.device("meta"):
    model = model_class(config)
  return sum(p.numel() for p in model.parameters())  # tied weights are counted once


def _ours(name: str) -> int:
  model = models.build_model(models.preset(name))
  shapes = model.param_shapes()
  leaves = jax.tree.leaves(shapes)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing allocated
  assert all(x.dtype == np.float32 for x in leaves)
  count = model.num_params()
  assert count == sum(int(np.prod(x.shape)) for x in leaves)
  return count


@pytest.mark.parametrize("name, hidden, layers, heads, approx", [
    ("bert-base", 768, 12, 12, 110e6),
    ("bert-large", 1024, 24, 16, 340e6),
])
def test_bert(name, hidden, layers, heads, approx):
  config = transformers.BertConfig(vocab_size=30522, hidden_size=hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   intermediate_size=4 * hidden, max_position_embeddings=512,
                                   type_vocab_size=2)
  want = _hf_count(transformers.BertForPreTraining, config)
  assert abs(want - approx) / approx < 0.03  # the published size, as a sanity check
  assert _ours(name) == want


def test_gpt2_124m():
  config = transformers.GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12,
                                   n_head=12)
  want = _hf_count(transformers.GPT2LMHeadModel, config)
  assert want == 124_439_808
  assert _ours("gpt2-124m") == want


def _t5_config(d_model, d_ff, layers, heads, ffn, tie):
  return transformers.T5Config(vocab_size=32128, d_model=d_model, d_kv=64, d_ff=d_ff,
                               num_layers=layers, num_decoder_layers=layers, num_heads=heads,
                               feed_forward_proj=ffn, tie_word_embeddings=tie)


@pytest.mark.parametrize("name, d_model, d_ff, layers, heads", [
    ("t5-v1_1-small", 512, 1024, 8, 6),
    ("t5-v1_1-base", 768, 2048, 12, 12),
])
def test_t5_v1_1(name, d_model, d_ff, layers, heads):
  # T5 v1.1 has a separate (untied) output layer. transformers 5.23 ties T5's lm_head to
  # the shared embedding even when asked not to, so its count lacks that layer: when the
  # tie is there, we add the [vocab, d_model] output kernel to the Hugging Face count.
  config = _t5_config(d_model, d_ff, layers, heads, "gated-gelu", tie=False)
  with torch.device("meta"):
    hf_model = transformers.T5ForConditionalGeneration(config)
  hf = sum(p.numel() for p in hf_model.parameters())
  if hf_model.lm_head.weight is hf_model.shared.weight:  # forced tie: add the lm_head back
    hf += 32128 * d_model
  assert _ours(name) == hf


def test_t5_v1_0_small_tied():
  config = _t5_config(512, 2048, 6, 8, "relu", tie=True)
  want = _hf_count(transformers.T5ForConditionalGeneration, config)
  assert abs(want - 60.5e6) / 60.5e6 < 0.01
  assert _ours("t5-small") == want
