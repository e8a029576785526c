"""`t5x-like bench peer`: our train step and transformers' PyTorch model side by side.

The peer is checked against references that are not the bench: its parameter count
against the count by hand from the shape (and transformers' published GPT-2 124M and
BERT-base sizes), its loss against our model's loss on the same weights and batch
(packed documents included), and, through the CLI, the losses of the runs themselves:
started from the same weights on the same batches with the same optimizer, ours, eager
PyTorch and torch.compile'd PyTorch give the same first loss and the same loss after
a few AdamW steps. torch.compile runs on this CPU (gcc; the GPT smoke model compiles
in 4-40 s, the first time in a fresh cache dir the slowest). The CUDA path (fused
AdamW, autocast on 'cuda', synchronize) has no GPU here; its configs are checked to
build.
"""

import json

import jax
import numpy as np
import pytest
import torch

from t5x_like import cli
from t5x_like.commands import bench as bench_cli
from t5x_like.speed.torch_peer import (bert_inputs, build_peer_model, gpt2_inputs,
                                       peer_config, peer_for)
from t5x_like.command_flags import parse_flags
from t5x_like.data.lm import packed_features
from t5x_like.experiment import build_model_from_config, config_vocab
from t5x_like.models.config import gpt2
from t5x_like.models.model import build_model


def hand_params(config) -> int:
  """Parameters of BertForPreTraining / GPT2LMHeadModel (tied output layer) by hand:
  embeddings, per layer Q/K/V/O and the MLP with biases and two LayerNorms, then BERT's
  pooler, MLM transform (+ LayerNorm, + output bias) and NSP classifier, GPT-2's final
  LayerNorm."""
  v, d, f, n = config.vocab_size, config.d_model, config.d_ff, config.num_layers
  layer = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
  embeddings = (v + config.max_position_embeddings) * d
  if config.family == "decoder":
    return embeddings + n * layer + 2 * d
  embeddings += config.type_vocab_size * d + 2 * d
  return embeddings + n * layer + (d * d + d) + (d * d + d + 2 * d + v) + (2 * d + 2)


def _run(capsys, argv):
  code = cli.main(argv)
  captured = capsys.readouterr()
  return code, (json.loads(captured.out) if code == 0 else None), captured.err


@pytest.mark.long
@pytest.mark.parametrize("argv,torch_runners", [
    (["--config", "configs/gpt_cpu.py:smoke"], ("eager", "compiled")),
    (["--config", "configs/bert_cpu.py:smoke", "--compile", "eager"], ("eager",)),
])
def test_bench_peer_runs_ours_and_torch_from_the_same_start(capsys, argv, torch_runners):
  code, out, err = _run(capsys, ["bench", "peer", *argv, "--steps", "2", "--rounds", "2",
                                 "--warmup", "1"])
  assert code == 0, err
  names = ["ours"] + [f"torch_{m}" for m in torch_runners]
  assert set(names) <= set(out)
  assert ("torch_compiled" in out) == ("compiled" in torch_runners)
  assert set(out["ratios"]) == {f"ours_over_torch_{m}" for m in torch_runners}
  assert out["attn_implementation"] == "sdpa" and out["torch_device"] == "cpu"
  assert out["versions"]["torch"] == torch.__version__
  # The peer's shape: transformers' parameter count is the count by hand and ours.
  config = _config(argv)
  cfg = build_model_from_config(config, config_vocab(config).vocab_size).config
  assert out["params"]["torch"] == out["params"]["ours"] == hand_params(cfg)
  for name in names:
    run = out[name]
    assert len(run["step_seconds"]) == 4
    assert run["tokens_per_second"] == pytest.approx(
        out["tokens_per_step"] / run["step_seconds_median"], rel=5e-3)
    peak = out["peak_flops_per_device"][out["dtype"]] * 1e12 * out["jax_device_count"]
    assert run["mfu"] == pytest.approx(
        out["model_flops_per_step"] / run["step_seconds_median"] / peak, rel=0.01, abs=1e-4)
    # Same weights, batches, loss and updates: float32 agrees to rounding, at the first
    # step and after 1 + 1 + 4 AdamW steps of our schedule.
    assert run["first_loss"] == pytest.approx(out["ours"]["first_loss"], rel=1e-5)
    assert run["last_loss"] == pytest.approx(out["ours"]["last_loss"], rel=1e-4)
    assert run["last_loss"] < run["first_loss"] - 0.05  # and the updates did something
  for mode in torch_runners:
    assert out["ratios"][f"ours_over_torch_{mode}"] == pytest.approx(
        out["ours"]["tokens_per_second"] / out[f"torch_{mode}"]["tokens_per_second"], rel=1e-2)
  if "compiled" in torch_runners:
    compiled = out["torch_compiled"]
    assert compiled["compile_seconds"] == compiled["first_step_seconds"] > 0
  assert out["ours"]["compile_seconds"] > 0


def _config(argv):
  return parse_flags("bench peer", argv, bench_cli._flags).config


def test_gpt2_peer_loss_is_ours_on_packed_documents():
  """Our causal-LM loss over two packed documents (positions restart, attention stays
  inside each, the first document's last target is its EOS while the next input is 0)
  is transformers' loss of gpt2_inputs, on the same weights; the labels = input ids
  recipe (shifted inside transformers, no positions) is not."""
  model = build_model(gpt2(2, 32, vocab_size=97, num_heads=2, d_ff=48,
                           max_position_embeddings=16))
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 97, (2, 12))
  starts = np.zeros_like(tokens, bool)
  starts[0, 5] = True  # row 0: a document of 5 tokens, then another
  batch = packed_features(tokens, starts)
  assert batch["decoder_positions"][0, 5] == 0 and batch["decoder_input_tokens"][0, 5] == 0
  params = model.init(jax.random.key(1), {k: v.shape for k, v in batch.items()})
  ours = float(model.loss_fn(params, batch, None)[0])
  peer = build_peer_model(model, params).eval()
  with torch.no_grad():
    theirs = peer(**{k: torch.from_numpy(v) for k, v in gpt2_inputs(batch).items()}).loss
    ids = torch.from_numpy(batch["decoder_input_tokens"].astype(np.int64))
    naive = peer(input_ids=ids, labels=ids).loss
  assert float(theirs) == pytest.approx(ours, rel=1e-5)
  assert abs(float(naive) - ours) > 1e-3


def test_bert_inputs_put_mlm_targets_at_their_positions():
  """BertForPreTraining labels: our targets at mlm_positions where the weight is 1,
  -100 (ignored) everywhere else, padded prediction slots included; packed rows
  (segment ids > 1) are refused."""
  batch = {"encoder_input_tokens": np.array([[2, 7, 5, 9, 3, 0], [2, 8, 8, 3, 0, 0]]),
           "encoder_type_ids": np.zeros((2, 6), np.int32),
           "mlm_positions": np.array([[1, 3, 0], [2, 0, 0]]),
           "mlm_targets": np.array([[11, 12, 0], [13, 0, 0]]),
           "mlm_weights": np.array([[1, 1, 0], [1, 0, 0]]),
           "nsp_labels": np.array([1, 0])}
  inputs = bert_inputs(batch)
  np.testing.assert_array_equal(inputs["labels"], [[-100, 11, -100, 12, -100, -100],
                                                   [-100, -100, 13, -100, -100, -100]])
  np.testing.assert_array_equal(inputs["attention_mask"], [[1, 1, 1, 1, 1, 0],
                                                           [1, 1, 1, 1, 0, 0]])
  np.testing.assert_array_equal(inputs["next_sentence_label"], [1, 0])
  packed = dict(batch, encoder_segment_ids=np.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]]))
  with pytest.raises(ValueError, match="packed"):
    bert_inputs(packed)


@pytest.mark.parametrize("argv,published", [
    (["--config", "configs/bert_pretrain.py:large", "--config.model.dtype=bfloat16",
      "--config.train.batch_size=32", "--config.data.length=512", "--steps", "20"], None),
    (["--config", "configs/bert_pretrain.py:large", "--config.data.length=512",
      "--config.data.options.max_predictions_per_seq=80", "--config.train.batch_size=32",
      "--steps", "20"], None),
    (["--config", "configs/bert_pretrain.py:base"], 110_106_428),
    (["--config", "configs/gpt2_pretrain.py:124m", "--config.model.dtype=bfloat16",
      "--config.train.batch_size=32", "--config.data.length=512", "--steps", "20"],
     124_439_808),
])
def test_gpu_configs_build_their_peer(argv, published):
  """The command lines of the GPU runs parse, and their peers (built on the meta device:
  no memory) have our parameter count: by hand and, where transformers publishes one,
  its count (bert-base-uncased, gpt2)."""
  config = _config(argv)
  model = build_model_from_config(config, config_vocab(config).vocab_size)
  spec = peer_for(model)
  import transformers
  with torch.device("meta"):
    peer = getattr(transformers, spec.architecture)(peer_config(model))
  count = sum(p.numel() for p in peer.parameters())
  assert count == model.num_params() == hand_params(model.config)
  assert published is None or count == published
  assert peer.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("argv,message", [
    (["--config", "configs/t5_cpu.py:smoke"], "no PyTorch peer for family 'encoder_decoder'"),
    (["--config", "configs/gpt_cpu.py:smoke", "--config.data.objective=prefix_lm"],
     "no prefix-LM attention"),
    (["--config", "configs/gpt_cpu.py:smoke", "--compile", "sometimes"], "--compile"),
])
def test_bench_peer_bad_input_exits_2_in_one_line(capsys, argv, message):
  code, _, err = _run(capsys, ["bench", "peer", *argv])
  assert code == 2
  assert message in err and len(err.strip().splitlines()) == 1, err
