"""Parity with Hugging Face transformers (PyTorch, float32, eval) and checkpoint round trips.

Reference logits come from transformers' own modules on random small configs; our
side only reads the saved directory.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import t5x_like.hf as hf
from t5x_like.hf import CheckpointError
from t5x_like.models import bert

TOL = 1e-4


@pytest.fixture(autouse=True)
def _seed():
  torch.manual_seed(0)


def _max_diff(ours, ref) -> float:
  return float(np.max(np.abs(np.asarray(ours, np.float64) - np.asarray(ref, np.float64))))


def _save(model, tmp_path, name="hf") -> str:
  path = str(tmp_path / name)
  model.save_pretrained(path)
  return path


# --------------------------------------------------------------------------- BERT
BERT_CONFIGS = [
    dict(vocab_size=99, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
         intermediate_size=37),
    dict(vocab_size=1001, hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
         intermediate_size=50, hidden_act="gelu_new", max_position_embeddings=40,
         type_vocab_size=3),
]


def _bert_batch(rng, vocab, types=2):
  tokens = rng.integers(1, vocab, (3, 11))
  tokens[1, 7:] = 0  # padding
  tokens[2, 4:] = 0
  type_ids = np.zeros_like(tokens)
  type_ids[:, 5:] = types - 1
  type_ids[tokens == 0] = 0
  return tokens, type_ids


def _bert_reference(model, tokens, type_ids):
  with torch.no_grad():
    out = model(input_ids=torch.tensor(tokens), token_type_ids=torch.tensor(type_ids),
                attention_mask=torch.tensor(tokens != 0))
  return out.prediction_logits.numpy(), out.seq_relationship_logits.numpy()


@pytest.mark.parametrize("cfg", BERT_CONFIGS)
@pytest.mark.parametrize("scan", [False, True])
def test_bert_parity_and_round_trip(cfg, scan, tmp_path):
  reference = transformers.BertForPreTraining(transformers.BertConfig(**cfg)).eval()
  tokens, type_ids = _bert_batch(np.random.default_rng(1), cfg["vocab_size"],
                                 cfg.get("type_vocab_size", 2))
  ref_mlm, ref_nsp = _bert_reference(reference, tokens, type_ids)

  model, params = hf.load(_save(reference, tmp_path), scan_layers=scan)
  assert model.config.scan_layers == scan
  out = model.logits(params, {"encoder_input_tokens": jnp.asarray(tokens),
                              "encoder_type_ids": jnp.asarray(type_ids)})
  assert out["mlm_logits"].shape == ref_mlm.shape
  assert _max_diff(out["mlm_logits"], ref_mlm) < TOL
  assert _max_diff(out["nsp_logits"], ref_nsp) < TOL

  # The MLM head on gathered positions gives the same logits as at every position.
  positions = np.array([[1, 3, 0], [2, 5, 6], [1, 2, 3]])
  gathered = model.apply(params, {"encoder_input_tokens": jnp.asarray(tokens),
                                  "encoder_type_ids": jnp.asarray(type_ids),
                                  "mlm_positions": jnp.asarray(positions)})["mlm_logits"]
  assert _max_diff(gathered, np.take_along_axis(ref_mlm, positions[..., None], 1)) < TOL

  out_dir = str(tmp_path / "ours")
  hf.save(model, params, out_dir)
  reloaded = transformers.BertForPreTraining.from_pretrained(out_dir).eval()
  rt_mlm, rt_nsp = _bert_reference(reloaded, tokens, type_ids)
  assert _max_diff(rt_mlm, ref_mlm) < 1e-6 and _max_diff(rt_nsp, ref_nsp) < 1e-6


# -------------------------------------------------------------------------- GPT-2
GPT2_CONFIGS = [
    dict(vocab_size=99, n_embd=24, n_layer=2, n_head=3),
    dict(vocab_size=251, n_embd=48, n_layer=3, n_head=6, n_inner=70, n_positions=64,
         activation_function="gelu"),
]


def _gpt2_reference(model, tokens, attention_mask):
  with torch.no_grad():
    return model(input_ids=torch.tensor(tokens),
                 attention_mask=torch.tensor(attention_mask)).logits.numpy()


@pytest.mark.parametrize("cfg", GPT2_CONFIGS)
def test_gpt2_parity_and_round_trip(cfg, tmp_path):
  reference = transformers.GPT2LMHeadModel(
      transformers.GPT2Config(bos_token_id=0, eos_token_id=0, **cfg)).eval()
  rng = np.random.default_rng(2)
  tokens = rng.integers(0, cfg["vocab_size"], (3, 13))
  valid = np.ones_like(tokens)
  valid[1, 9:] = 0  # right padding: real positions must not see it
  ref = _gpt2_reference(reference, tokens, valid)

  model, params = hf.load(_save(reference, tmp_path))
  segments = jnp.asarray(valid)
  ours = model.logits(params, {"decoder_input_tokens": jnp.asarray(tokens),
                               "decoder_segment_ids": segments})
  real = valid.astype(bool)
  assert _max_diff(np.asarray(ours)[real], ref[real]) < TOL
  # Without segment ids (no padding information) the causal mask alone still gives
  # the same logits at every real position of a right-padded row.
  plain = model.logits(params, {"decoder_input_tokens": jnp.asarray(tokens)})
  assert _max_diff(np.asarray(plain)[real], ref[real]) < TOL

  out_dir = str(tmp_path / "ours")
  hf.save(model, params, out_dir)
  reloaded = transformers.GPT2LMHeadModel.from_pretrained(out_dir).eval()
  assert _max_diff(_gpt2_reference(reloaded, tokens, valid)[real], ref[real]) < 1e-6


# ----------------------------------------------------------------------------- T5
T5_CONFIGS = {
    "v1.0": dict(vocab_size=99, d_model=24, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=3,
                 num_heads=3, feed_forward_proj="relu", tie_word_embeddings=True),
    "v1.1": dict(vocab_size=123, d_model=30, d_kv=5, d_ff=41, num_layers=3, num_decoder_layers=1,
                 num_heads=6, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                 relative_attention_num_buckets=8, relative_attention_max_distance=20),
}


def _t5_batch(rng, vocab):
  enc = rng.integers(2, vocab, (3, 25))  # long enough to reach log-spaced buckets
  enc[0, 12:] = 0
  enc[2, 5:] = 0
  dec = rng.integers(2, vocab, (3, 21))
  dec[:, 0] = 0  # decoder start token
  return enc, dec


def _t5_reference(model, enc, dec):
  with torch.no_grad():
    return model(input_ids=torch.tensor(enc), attention_mask=torch.tensor(enc != 0),
                 decoder_input_ids=torch.tensor(dec)).logits.numpy()


@pytest.mark.parametrize("version", sorted(T5_CONFIGS))
def test_t5_parity_and_round_trip(version, tmp_path):
  cfg = T5_CONFIGS[version]
  reference = transformers.T5ForConditionalGeneration(transformers.T5Config(**cfg)).eval()
  enc, dec = _t5_batch(np.random.default_rng(3), cfg["vocab_size"])
  ref = _t5_reference(reference, enc, dec)

  model, params = hf.load(_save(reference, tmp_path))
  ours_cfg = model.config
  assert ours_cfg.num_layers == cfg["num_layers"]
  assert ours_cfg.decoder_layers == cfg["num_decoder_layers"]
  assert ours_cfg.mlp_activation == ("relu" if version == "v1.0" else "geglu_tanh")
  assert ours_cfg.scale_decoder_output == (version == "v1.0")
  ours = model.logits(params, {"encoder_input_tokens": jnp.asarray(enc),
                               "decoder_input_tokens": jnp.asarray(dec)})
  assert _max_diff(ours, ref) < TOL

  out_dir = str(tmp_path / "ours")
  hf.save(model, params, out_dir)
  reloaded = transformers.T5ForConditionalGeneration.from_pretrained(out_dir).eval()
  assert _max_diff(_t5_reference(reloaded, enc, dec), ref) < 1e-6


def test_t5_untied_output_layer_survives_our_round_trip(tmp_path):
  """A v1.1 with its own lm_head (as older exports have) is read untied and kept so."""
  reference = transformers.T5ForConditionalGeneration(
      transformers.T5Config(**T5_CONFIGS["v1.1"])).eval()
  path = _save(reference, tmp_path)
  tensors = load_file(os.path.join(path, "model.safetensors"))
  rng = np.random.default_rng(4)
  tensors["lm_head.weight"] = rng.normal(size=tensors["shared.weight"].shape).astype(np.float32)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})

  model, params = hf.load(path)
  assert not model.config.tie_embeddings
  np.testing.assert_array_equal(params["logits_dense"]["kernel"], tensors["lm_head.weight"].T)
  hf.save(model, params, str(tmp_path / "ours"))
  model2, params2 = hf.load(str(tmp_path / "ours"))
  assert model2.config == model.config
  jax.tree.map(np.testing.assert_array_equal, params, params2)


# ---------------------------------------------------------------------- bad input
@pytest.fixture
def bert_dir(tmp_path):
  reference = transformers.BertForPreTraining(transformers.BertConfig(**BERT_CONFIGS[0]))
  return _save(reference, tmp_path)


def test_not_a_directory(tmp_path):
  with pytest.raises(CheckpointError, match="nowhere.*not a directory"):
    hf.load(str(tmp_path / "nowhere"))


def test_directory_without_config(tmp_path):
  with pytest.raises(CheckpointError, match="config.json.*missing"):
    hf.load(str(tmp_path))


def test_unsupported_model_type(bert_dir):
  config_path = os.path.join(bert_dir, "config.json")
  config = json.load(open(config_path))
  config["model_type"] = "llama"
  json.dump(config, open(config_path, "w"))
  with pytest.raises(CheckpointError, match="config.json.*model_type='llama'"):
    hf.load(bert_dir)


def test_missing_weight_names_file_and_tensor(bert_dir):
  weights_path = os.path.join(bert_dir, "model.safetensors")
  tensors = load_file(weights_path)
  del tensors["bert.encoder.layer.1.intermediate.dense.weight"]
  save_file(tensors, weights_path)
  with pytest.raises(CheckpointError) as err:
    hf.load(bert_dir)
  assert "model.safetensors" in str(err.value)
  assert "bert.encoder.layer.1.intermediate.dense.weight" in str(err.value)


def test_shape_mismatch_names_file_tensor_and_shapes(bert_dir):
  config_path = os.path.join(bert_dir, "config.json")
  config = json.load(open(config_path))
  config["intermediate_size"] = 40  # the weights have 37
  json.dump(config, open(config_path, "w"))
  with pytest.raises(CheckpointError) as err:
    hf.load(bert_dir)
  message = str(err.value)
  assert "model.safetensors" in message and "bert.encoder.layer.0.intermediate.dense" in message
  assert "(37" in message and "(40" in message  # what the file has, what the config needs


def test_pytorch_bin_only_is_a_clear_error(bert_dir):
  os.rename(os.path.join(bert_dir, "model.safetensors"),
            os.path.join(bert_dir, "pytorch_model.bin"))
  with pytest.raises(CheckpointError, match="model.safetensors: missing.*pytorch_model.bin"):
    hf.load(bert_dir)


def test_corrupt_safetensors_names_the_file(bert_dir):
  with open(os.path.join(bert_dir, "model.safetensors"), "wb") as f:
    f.write(b"\x00garbage")
  with pytest.raises(CheckpointError, match="model.safetensors: not a readable"):
    hf.load(bert_dir)


def test_export_refuses_what_the_architecture_cannot_express(tmp_path):
  from t5x_like.models import build_model
  model = build_model(bert(2, 64, vocab_size=50, pre_norm=True))
  with pytest.raises(ValueError, match="pre_norm"):
    hf.save(model, model.init(jax.random.key(0)), str(tmp_path / "x"))
