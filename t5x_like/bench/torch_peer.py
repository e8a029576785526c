"""The peer: transformers' BertForPreTraining train step in PyTorch, on our batches.

  step = TorchBertStep(model_config, dtype="bfloat16", batches=host_batches)
  step()        # one AdamW step, blocking (CPU)

The model has our BERT ModelConfig's shape (layers, width, heads, MLP, vocabulary,
positions, token types, dropout rates); the step is the recipe's: MLM (loss at the masked
positions, labels -100 elsewhere) + NSP, backward, gradient clipping at 1.0,
torch.optim.AdamW (lr 1e-4, weight decay 0.01). "bfloat16" runs the forward under
torch.autocast(cpu, bfloat16) with float32 master weights, as a PyTorch user would;
"float32" runs without autocast.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np


def torch_inputs(batch: Mapping[str, np.ndarray]) -> dict:
  """Our BERT batch (models/model.py feature names) -> BertForPreTraining keyword arguments."""
  import torch
  tokens = np.asarray(batch["encoder_input_tokens"])
  labels = np.full(tokens.shape, -100, np.int64)
  positions, targets = batch["mlm_positions"], batch["mlm_targets"]
  weights = batch["mlm_weights"]
  for row in range(tokens.shape[0]):
    real = weights[row] > 0
    labels[row, positions[row][real]] = targets[row][real]
  out = {
      "input_ids": torch.as_tensor(tokens, dtype=torch.long),
      "token_type_ids": torch.as_tensor(np.asarray(batch["encoder_type_ids"]), dtype=torch.long),
      "attention_mask": torch.as_tensor(tokens > 0, dtype=torch.long),
      "labels": torch.as_tensor(labels),
  }
  if "nsp_labels" in batch:
    out["next_sentence_label"] = torch.as_tensor(np.asarray(batch["nsp_labels"]),
                                                 dtype=torch.long)
  return out


class TorchBertStep:
  """One callable AdamW step of BertForPreTraining; see the module docstring."""

  def __init__(self, model_config, *, dtype: str, batches, seed: int = 0):
    import torch
    import transformers
    if dtype not in ("bfloat16", "float32"):
      raise ValueError(f"dtype={dtype!r}: expected 'bfloat16' or 'float32'")
    torch.manual_seed(seed)
    cfg = model_config
    config = transformers.BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, intermediate_size=cfg.d_ff,
        max_position_embeddings=cfg.max_position_embeddings,
        type_vocab_size=max(cfg.type_vocab_size, 1), hidden_dropout_prob=cfg.dropout_rate,
        attention_probs_dropout_prob=cfg.attention_dropout_rate, layer_norm_eps=cfg.norm_eps)
    self.model = transformers.BertForPreTraining(config).train()
    self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01)
    self.inputs = [torch_inputs(b) for b in batches]
    self.dtype = dtype
    self.loss = None
    self._next = 0

  def __call__(self) -> None:
    import torch
    inputs = self.inputs[self._next % len(self.inputs)]
    self._next += 1
    self.optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.dtype == "bfloat16"):
      loss = self.model(**inputs).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
    self.optimizer.step()
    self.loss = float(loss.detach())  # synchronous on CPU: the step has finished
