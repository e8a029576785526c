"""Layer-wise lr decay's depths for each kind of stack (finetune/layer_decay.py), and its
bad values; tests/test_finetune_cli.py checks the decayed steps of a fine-tuning run."""

import jax
import numpy as np
import pytest

from t5x_like.finetune.layer_decay import layer_depths, scale_by_layer
from t5x_like.finetune.model import FinetuneModel
from t5x_like.models import model_class
from t5x_like.models.config import preset


def _depths(config, **model_kw):
  model = FinetuneModel(config, "classification", **model_kw)
  depths = layer_depths(model.param_shapes(), model_class(model.config).stack_layers(
      model.config))
  return {jax.tree_util.keystr(p, simple=True, separator="/"): d
          for p, d in jax.tree_util.tree_flatten_with_path(depths)[0]}


def test_t5_counts_the_encoder_then_the_decoder_and_its_output_layer_is_the_top():
  config = preset("t5-v1_1-small", d_model=32, d_ff=64, num_heads=2,
                                   head_dim=16, num_layers=2, num_decoder_layers=3,
                                   vocab_size=64)
  depths = _depths(config, label_targets=np.ones((2, 3), np.int32))
  want = {"backbone/token_embed/embedding": 0,
          "backbone/encoder/layers_0/mlp/wo/kernel": 1,
          "backbone/encoder/layers_1/self_attention/query/kernel": 2,
          "backbone/encoder/relpos/rel_embedding": 2, "backbone/encoder/final_norm/scale": 2,
          "backbone/decoder/layers_0/cross_attention/key/kernel": 3,
          "backbone/decoder/layers_2/mlp_norm/scale": 5,
          "backbone/decoder/final_norm/scale": 5, "backbone/logits_dense/kernel": 6}
  assert {k: depths[k] for k in want} == want
  assert max(depths.values()) == 6


def test_t5_encoder_under_a_head_counts_the_encoder_alone():
  """text_to_text=False: no decoder, so the head sits right above the encoder's top."""
  config = preset("t5-v1_1-small", d_model=32, d_ff=64, num_heads=2,
                                   head_dim=16, num_layers=2, num_decoder_layers=3,
                                   vocab_size=64)
  depths = _depths(config, num_labels=2, pooling="mean", text_to_text=False)
  want = {"backbone/token_embed/embedding": 0,
          "backbone/encoder/layers_0/mlp/wo/kernel": 1,
          "backbone/encoder/final_norm/scale": 2, "head/classifier/kernel": 3}
  assert {k: depths[k] for k in want} == want
  assert max(depths.values()) == 3 and not any("decoder" in k for k in depths)


def test_bert_scanned_layers_get_one_depth_per_layer():
  config = preset("bert-tiny", d_model=32, d_ff=64, num_heads=2,
                                   num_layers=3, vocab_size=64, scan_layers=True)
  depths = _depths(config, num_labels=2)
  kernel = depths["backbone/encoder/layers/mlp/wi/kernel"]
  assert kernel.shape == (3, 1, 1) and kernel.ravel().tolist() == [1, 2, 3]
  assert depths["backbone/token_embed/embedding"] == 0
  assert depths["head/classifier/kernel"] == 4
  factors = scale_by_layer({"a": kernel, "b": 0, "c": 4}, 0.5)
  updates, _ = factors.update({"a": np.ones((3, 2, 2)), "b": np.ones(()), "c": np.ones(())},
                              None)
  np.testing.assert_allclose(updates["a"][:, 0, 0], [0.125, 0.25, 0.5])
  assert (updates["b"], updates["c"]) == (0.0625, 1.0)


@pytest.mark.parametrize("decay", [0.0, 1.5, -0.5])
def test_layer_decay_outside_0_1_is_a_config_error(decay, tmp_path):
  from t5x_like.command_flags import load_config_file
  from t5x_like.errors import UserError
  from t5x_like.finetune.config_check import validate_finetune
  for split in ("train", "dev", "test"):
    (tmp_path / f"{split}.csv").write_text("text,label\na b c,acceptable\n")
  config = load_config_file(f"configs/text_tasks.py:acceptability,smoke,dir={tmp_path}")
  config.optimizer.layer_decay = decay
  with pytest.raises(UserError, match=r"optimizer.layer_decay=.*expected in \(0, 1\]"):
    validate_finetune(config, num_devices=1)
