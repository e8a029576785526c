"""The peer: transformers' PyTorch model of our model's family, one training step a call.

  step = TorchStep(model, dtype="bfloat16", batches=host_batches, params=ours,
                   optimizer=torch_adamw(config.optimizer), learning_rates=lrs)
  step()       # one AdamW step; returns when it is done (torch.cuda.synchronize on CUDA)
  step.loss    # that step's loss (of the weights before its update)

The peer is chosen by our model's `hf_model_type` (PEERS) and built from our Hugging Face
export's config.json (t5x_like/hf), so it has exactly our shape, with SDPA attention:
- bert: BertForPreTraining. MLM labels are our mlm_targets at mlm_positions (weight 1),
  -100 elsewhere, so transformers' mean over labelled tokens is our
  sum(w nll) / sum(w); + NSP on nsp_labels; attention_mask = tokens > 0.
- gpt2: GPT2LMHeadModel. input_ids = decoder_input_tokens (targets shifted right, 0 at
  each document start), position_ids = decoder_positions: transformers reads the resets
  as packed documents and confines attention to each, as our segment mask does. Our
  targets are not the inputs shifted left (the last target has no next input, a
  document's EOS target sits where the next input is 0), so they are passed as
  `shift_labels` (transformers then does not shift), -100 where decoder_loss_weights is
  0: the loss is our sum(w nll) / sum(w) over decoder_target_tokens.
With `params` (ours, e.g. the initial ones) the weights are ours, so both frameworks
start from the same point and their first losses agree up to rounding.

The step: zero_grad, forward under torch.autocast(device, bfloat16) when dtype is
bfloat16 (float32 master weights, as a PyTorch user trains) and without autocast in
float32, backward, clip_grad_norm_, torch.optim.AdamW (fused on CUDA) with weight decay
on matrices and embeddings only (as ours: not on norms and biases), lr per update from
`learning_rates` (our schedule). compiled=True wraps the model in torch.compile (the
first call compiles forward and backward). Runs on CUDA when torch.cuda.is_available(),
else on the CPU.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Optional, Sequence

import numpy as np

import t5x_like.hf as hf

Batch = Mapping[str, np.ndarray]


def bert_inputs(batch: Batch) -> dict[str, np.ndarray]:
  """Our BERT batch -> BertForPreTraining keyword arguments (int64 numpy)."""
  tokens = np.asarray(batch["encoder_input_tokens"])
  segments = batch.get("encoder_segment_ids")
  if segments is not None and np.max(segments) > 1:
    raise ValueError("the BERT peer cannot attend within packed examples"
                     " (encoder_segment_ids > 1)")
  labels = np.full(tokens.shape, -100, np.int64)
  positions, targets = batch["mlm_positions"], batch["mlm_targets"]
  weights = batch["mlm_weights"]
  for row in range(tokens.shape[0]):
    real = weights[row] > 0
    labels[row, positions[row][real]] = targets[row][real]
  out = {"input_ids": tokens, "token_type_ids": np.asarray(batch["encoder_type_ids"]),
         "attention_mask": tokens > 0, "labels": labels}
  if "nsp_labels" in batch:
    out["next_sentence_label"] = np.asarray(batch["nsp_labels"])
  return {k: v.astype(np.int64) for k, v in out.items()}


def gpt2_inputs(batch: Batch) -> dict[str, np.ndarray]:
  """Our causal-LM batch -> GPT2LMHeadModel keyword arguments (int64 numpy); see the
  module docstring for why the targets go in as shift_labels."""
  if "decoder_causal_attention" in batch:
    raise ValueError("the GPT-2 peer has no prefix-LM attention (decoder_causal_attention);"
                     " use data.objective='causal_lm'")
  targets = np.asarray(batch["decoder_target_tokens"])
  weights = batch.get("decoder_loss_weights")
  labels = targets if weights is None else np.where(np.asarray(weights) > 0, targets, -100)
  out = {"input_ids": np.asarray(batch["decoder_input_tokens"]), "labels": labels,
         "shift_labels": labels}
  if "decoder_positions" in batch:
    out["position_ids"] = np.asarray(batch["decoder_positions"])
  return {k: v.astype(np.int64) for k, v in out.items()}


class Peer(NamedTuple):
  architecture: str  # the transformers class
  inputs: Callable[[Batch], dict[str, np.ndarray]]
  # Config fields beyond our export's. GPT-2: no KV cache (with one, transformers ignores
  # the packing in position_ids), no bos / eos (its 50256 may be out of our vocabulary).
  config: dict
  loss_type: Optional[str] = None  # transformers' loss function (the one shift_labels means)


# Our hf_model_type -> its PyTorch peer; a new one is a converter and one line here.
PEERS = {"bert": Peer("BertForPreTraining", bert_inputs, {}),
         "gpt2": Peer("GPT2LMHeadModel", gpt2_inputs,
                      {"use_cache": False, "bos_token_id": None, "eos_token_id": None},
                      loss_type="ForCausalLM")}


def peer_for(model) -> Peer:
  """The peer of our model, or a ValueError naming its family."""
  if model.hf_model_type not in PEERS:
    raise ValueError(f"no PyTorch peer for family {model.config.family!r} (model type"
                     f" {model.hf_model_type!r}); peers: {sorted(PEERS)}")
  return PEERS[model.hf_model_type]


def torch_adamw(opt_cfg) -> dict:
  """torch.optim.AdamW settings {lr, betas, eps, weight_decay, clip_norm} of our
  optimizer config when it is adamw (lr: the peak; torch always bias-corrects); for
  another optimizer, BERT's AdamW with its lr, weight decay and clipping."""
  adamw = opt_cfg.name == "adamw"
  return {"lr": float(opt_cfg.learning_rate),
          "betas": (float(opt_cfg.b1), float(opt_cfg.b2)) if adamw else (0.9, 0.999),
          "eps": float(opt_cfg.eps) if adamw else 1e-6,
          "weight_decay": float(opt_cfg.get("weight_decay", 0.0) or 0.0),
          "clip_norm": float(opt_cfg.get("clip_norm", 0.0) or 0.0)}


def torch_device() -> str:
  """'cuda' when PyTorch sees a GPU, else 'cpu'."""
  import torch
  return "cuda" if torch.cuda.is_available() else "cpu"


def device_name(device: str) -> str:
  import torch
  return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def peer_config(model):
  """The transformers config of our model's peer: our export's, SDPA attention."""
  import transformers
  hf_config = hf.config_json(model)
  kwargs = {k: v for k, v in hf_config.items() if k != "model_type"}
  kwargs.update(peer_for(model).config)
  return transformers.AutoConfig.for_model(hf_config["model_type"], attn_implementation="sdpa",
                                           **kwargs)


def build_peer_model(model, params=None, *, seed: int = 0):
  """The transformers model of our model (peer_config), on the CPU, in train mode; with
  `params` our weights (every parameter of it), else its own init."""
  import torch
  import transformers
  spec = peer_for(model)
  torch.manual_seed(seed)
  peer = getattr(transformers, spec.architecture)(peer_config(model))
  if spec.loss_type:
    peer.loss_type = spec.loss_type
  if params is not None:
    state = {name: torch.tensor(t) for name, t in hf.export(model, params)[1].items()}
    _, unexpected = peer.load_state_dict(state, strict=False)
    untouched = {name for name, _ in peer.named_parameters()} - set(state)
    if unexpected or untouched:
      raise ValueError(f"{type(peer).__name__}: our export does not cover it (not set:"
                       f" {sorted(untouched)[:5]}; unknown: {sorted(unexpected)[:5]})")
  return peer.train()


class TorchStep:
  """One callable training step of the peer on our batches; see the module docstring."""

  def __init__(self, model, *, dtype: str, batches: Sequence[Batch], params=None,
               optimizer: Optional[dict] = None, learning_rates: Optional[Sequence] = None,
               compiled: bool = False, device: Optional[str] = None, seed: int = 0):
    import torch
    if dtype not in ("bfloat16", "float32"):
      raise ValueError(f"dtype={dtype!r}: expected 'bfloat16' or 'float32'")
    self.device = device or torch_device()
    if self.device == "cuda":  # float32 matmuls in TF32, as XLA's default precision on GPU
      torch.set_float32_matmul_precision("high")
    self.model = build_peer_model(model, params, seed=seed).to(self.device)
    self.forward = torch.compile(self.model) if compiled else self.model
    settings = dict(optimizer or {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-6,
                                  "weight_decay": 0.01, "clip_norm": 1.0})
    self.clip_norm = settings.pop("clip_norm")
    decay = settings.pop("weight_decay")
    weights = list(self.model.parameters())
    groups = [{"params": [p for p in weights if p.ndim >= 2], "weight_decay": decay},
              {"params": [p for p in weights if p.ndim < 2], "weight_decay": 0.0}]
    self.optimizer = torch.optim.AdamW(groups, fused=self.device == "cuda", **settings)
    self.learning_rates = learning_rates
    self.inputs = [{k: torch.from_numpy(v).to(self.device)
                    for k, v in peer_for(model).inputs(b).items()} for b in batches]
    self.autocast = dtype == "bfloat16"
    self.num_params = sum(p.numel() for p in weights)
    self.attn_implementation = self.model.config._attn_implementation
    self._loss = None
    self._next = 0

  @property
  def loss(self) -> float:
    return float(self._loss)

  def __call__(self) -> None:
    import torch
    step = self._next
    self._next += 1
    if self.learning_rates is not None:
      lr = float(self.learning_rates[min(step, len(self.learning_rates) - 1)])
      for group in self.optimizer.param_groups:
        group["lr"] = lr
    self.optimizer.zero_grad(set_to_none=True)
    with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.autocast):
      loss = self.forward(**self.inputs[step % len(self.inputs)]).loss
    loss.backward()
    if self.clip_norm > 0:
      torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
    self.optimizer.step()
    self._loss = loss.detach()
    if self.device == "cuda":
      torch.cuda.synchronize()

  def reset_peak_memory(self) -> None:
    import torch
    if self.device == "cuda":
      torch.cuda.reset_peak_memory_stats()

  def peak_memory_bytes(self) -> Optional[int]:
    """torch.cuda.max_memory_allocated since reset_peak_memory; None on the CPU."""
    import torch
    return int(torch.cuda.max_memory_allocated()) if self.device == "cuda" else None
