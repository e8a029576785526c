"""Per-device memory of a train step, estimated without compiling it.

  estimate = estimate_memory(model, optimizer, mesh, param_shardings, ...)

State and inputs (arguments of the step; the new state reuses the donated buffers):
  params        float32, each param's block under its sharding
  opt_state     the optimizer's own state (jax.eval_shape of optimizer.init: AdamW mu and
                nu, Adafactor's factored rows + cols), sharded as train/state.py shards it
  batch         the int32 features of one step's per-device batch
Temporaries, at the higher of two peaks:
  grads         float32 like params (plus an accumulator of the same size with
                microbatches); live at both peaks
  backward peak, where the backward pass starts:
  activations   what the backward pass keeps from the forward, all layers: the residuals
                of jax.vjp of model.loss_fn (so the config's remat policy, dropout, compute
                dtype and activation functions count exactly as JAX saves them), traced
                at the per-device (micro)batch with 1 and 2 layers and extrapolated to the
                config's depth
  backward      the working set inside one layer's backward: two cotangents the size of
                its largest activation (attention scores and probabilities, unless the
                fused kernel keeps none) and, with remat, the layer's recomputed forward
  logits        the logits/loss buffers: the saved [rows, vocab] softmax terms, and two
                float32 [rows, vocab] buffers (the logits gradient and the float32
                logits or softmax it is computed from); with model.loss_chunk_rows
                (models/chunked_loss.py) nothing [rows, vocab] is saved: the forward
                keeps the float32 gradient of the output weights, counted here twice
                (it and its copy scaled in the backward), and of the hidden states,
                counted as an activation; the two buffers are one chunk's rows
                (loss_chunk_rows per device, split evenly: chunked_loss.chunk_size),
                where chunks pay (chunked_loss.pays: more rows per device than d_model
                and than one chunk)
  gathered      with FSDP: float32 weights all-gathered over 'fsdp' for the matmuls,
                every layer's when layers are unrolled (XLA may gather them all up
                front), two layers' worth with scan_layers (the loop gathers its layer)
  cast_weights  on TPU with scan_layers and bf16 compute: the bf16 copy of every
                layer's weights, cast once before the layer loops
  optimizer update peak:
  update        float32 temporaries the size of the params besides the gradients:
                two on CPU (the clipped gradient and the update), one on TPU, whose
                compiler fuses clipping and the AdamW update into loops that write the
                donated params and moments in place (the one left may be the
                all-reduced gradient beside the local one: not traced to a buffer).
                BERT-large on v3-128, where the update sets the peak: 6.12 GiB
                compiled against 7.52 estimated with two, 6.26 with one

The residuals are traced with the attention kernel the step will run on the plan's
platform (attention_core.tracing_for): on a TPU the fused kernel keeps row statistics,
not [B, N, T, S] probabilities. Dims sharded over 'tensor' (heads, mlp, vocab) divide
their activations by its size.
Calibrated against XLA's memory analysis on CPU meshes (tests/test_plan.py): within
~25% for BERT, GPT-2 and T5 shapes, remat none / full / dots, AdamW and Adafactor; and
against libtpu's for the shipped recipes on their TPU slices (docs/tpu.md, "The recipes on
TPU, compiled here"): within 20% (0.84-1.12).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from t5x_like import parallel
from t5x_like.models import build_model, chunked_loss
from t5x_like.models.attention_core import tracing_for
from t5x_like.plan.params import tree_bytes_per_device
from t5x_like.train.state import opt_state_shardings, update_shardings

STATE_FIELDS = ("params", "opt_state", "batch")
BACKWARD_FIELDS = ("activations", "backward", "logits", "gathered", "cast_weights")
FIELDS = STATE_FIELDS + ("grads",) + BACKWARD_FIELDS + ("update",)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Bytes per device, by component (see the module docstring)."""

  params: int
  opt_state: int
  batch: int
  grads: int
  activations: int
  backward: int
  logits: int
  gathered: int
  cast_weights: int
  update: int
  per_device_batch: int
  remat_policy: str  # the policy the estimate assumes (see effective_remat_policy)

  @property
  def state(self) -> int:
    """Arguments of the step: params, optimizer state, batch."""
    return sum(getattr(self, f) for f in STATE_FIELDS)

  @property
  def backward_peak(self) -> bool:
    """Whether the backward pass (not the optimizer update) sets the peak."""
    return sum(getattr(self, f) for f in BACKWARD_FIELDS) >= self.update

  @property
  def temporaries(self) -> int:
    return self.grads + max(sum(getattr(self, f) for f in BACKWARD_FIELDS), self.update)

  @property
  def total(self) -> int:
    return self.state + self.temporaries

  def to_json(self) -> dict:
    return {**{f"{f}_bytes": getattr(self, f) for f in FIELDS},
            "state_bytes": self.state, "temporaries_bytes": self.temporaries,
            "total_bytes": self.total,
            "peak": "backward" if self.backward_peak else "optimizer update",
            "per_device_batch": self.per_device_batch, "remat_policy": self.remat_policy}


def effective_remat_policy(config, platform: str) -> str:
  """The remat policy that will really shape memory on `platform`.

  XLA:CPU expands the optimization barriers jax puts around a remat'd layer and CSE then
  merges the recomputation back into the forward, so without scan_layers (whose loop
  keeps them apart) remat saves nothing there: the step keeps what 'none' keeps.
  """
  if platform == "cpu" and not config.scan_layers:
    return "none"
  return config.remat_policy


# ------------------------------------------------------------------ residuals
def _vjp_residuals(model, batch_shapes: Mapping[str, tuple]) -> list[jax.ShapeDtypeStruct]:
  """The arrays jax.vjp(loss_fn) keeps for the backward pass (dropout on), except the
  inputs themselves (params and batch, counted elsewhere)."""
  params = model.param_shapes(batch_shapes)
  batch = {k: jax.ShapeDtypeStruct(tuple(v), jnp.int32) for k, v in batch_shapes.items()}
  rng = jax.eval_shape(lambda: jax.random.key(0))
  loss = lambda p, b, r: model.loss_fn(p, b, r)[0]
  closed, shapes = jax.make_jaxpr(lambda p, b, r: jax.vjp(loss, p, b, r),
                                  return_shape=True)(params, batch, rng)
  jaxpr = closed.jaxpr
  num_residuals = len(jax.tree.leaves(shapes[1]))
  inputs = {id(v) for v in jaxpr.invars} | {id(v) for v in jaxpr.constvars}
  seen, out = set(), []
  for var in jaxpr.outvars[len(jaxpr.outvars) - num_residuals:]:
    if id(var) in inputs or id(var) in seen or not hasattr(var, "aval") or hasattr(var, "val"):
      continue
    seen.add(id(var))
    out.append(jax.ShapeDtypeStruct(var.aval.shape, var.aval.dtype))
  return out


def _output_weight_grad(residual, cfg) -> bool:
  """Whether a residual is the chunked loss's float32 output-weight gradient, [vocab,
  embed] (tied) or [embed, vocab], kept from the forward."""
  return (residual.dtype == jnp.float32 and
          tuple(residual.shape) in ((cfg.vocab_size, cfg.d_model), (cfg.d_model, cfg.vocab_size)))


def _tensor_split(shape: tuple[int, ...], cfg, tensor: int) -> int:
  """How many ways 'tensor' splits an activation of `shape` (heads, mlp, vocab dims)."""
  if tensor == 1 or len(shape) < 2:
    return 1
  if shape[-1] in (cfg.vocab_size, cfg.d_ff) or shape[0] == cfg.vocab_size:
    return tensor
  if len(shape) >= 4 and cfg.num_heads in shape[1:-1] and cfg.num_heads % tensor == 0:
    return tensor
  return 1


def _residual_bytes(cfg, batch_shapes, tensor: int) -> tuple[int, int, int]:
  """(bytes of activations, bytes of [.., vocab] logits terms, bytes of the largest
  activation) saved for the backward."""
  acts = logits = largest = 0
  for r in _vjp_residuals(build_model(cfg), batch_shapes):
    size = math.ceil(math.prod(r.shape) / _tensor_split(r.shape, cfg, tensor))
    size *= r.dtype.itemsize  # also for extended dtypes (PRNG keys)
    if _output_weight_grad(r, cfg):
      logits += 2 * size  # and its copy scaled by the loss's cotangent in the backward
    elif r.shape and r.shape[-1] == cfg.vocab_size:
      logits += size
    else:
      acts += size
      largest = max(largest, size)
  return acts, logits, largest


def logits_buffer_bytes(model, batch_shapes, tensor: int) -> int:
  """Two float32 [rows, vocab / tensor] buffers of a per-device (micro)batch of
  `batch_shapes`: all its logits rows, or one chunk's rows where the chunked loss runs
  (config.loss_chunk_rows rows per device; chunked_loss.pays)."""
  cfg = model.config
  rows = model.logits_rows(cfg, batch_shapes)
  if rows and chunked_loss.pays(cfg.loss_chunk_rows, rows, cfg.d_model):
    rows = chunked_loss.chunk_size(rows, cfg.loss_chunk_rows)
  return 2 * 4 * math.ceil(rows * cfg.vocab_size / tensor)


def _depths(model) -> list[dict]:
  """Layer counts to trace: 1 in every stack, then 2 in each stack in turn."""
  fields = model.stack_fields
  one = {field: 1 for field in fields.values()}
  return [one] + [{**one, field: 2} for field in fields.values()]


def layer_residual_bytes(model, batch_shapes, tensor: int,
                         remat_policy: str) -> dict[str, int]:
  """{'outside': bytes not in a layer, 'encoder'/'decoder': bytes per layer, 'logits',
  'largest': the largest single activation} of `model` under `remat_policy`."""
  cfg = model.config.replace(remat_policy=remat_policy)
  traced = [_residual_bytes(cfg.replace(**d), batch_shapes, tensor) for d in _depths(model)]
  one = traced[0][0]
  out = {"logits": traced[0][1], "largest": traced[0][2]}
  stacks = list(model.stack_fields)
  for stack, (two, _, _) in zip(stacks, traced[1:]):
    out[stack] = two - one
  out["outside"] = one - sum(out[stack] for stack in stacks)
  return out


def activation_bytes(model, batch_shapes, tensor: int, remat_policy: str) -> dict[str, int]:
  """{'activations', 'backward', 'logits'} bytes per device of `model` for a per-device
  batch."""
  layers = model.stack_layers(model.config)
  saved = layer_residual_bytes(model, batch_shapes, tensor, remat_policy)
  total = saved["outside"] + sum(n * saved[k] for k, n in layers.items())
  plain = saved
  if remat_policy != "none":
    plain = layer_residual_bytes(model, batch_shapes, tensor, "none")
  # Inside one layer's backward: two cotangents the size of its largest activation (the
  # attention scores' and probabilities'), plus, with remat, the recomputed forward.
  working = 2 * plain["largest"]
  if remat_policy != "none":
    working += max(plain[k] for k, n in layers.items() if n)
  return {"activations": total, "backward": working, "logits": saved["logits"]}


# ---------------------------------------------------------------------- total
def update_temporaries(platform: str) -> int:
  """Param-sized float32 temporaries of the optimizer update besides the gradients (see
  the module docstring): 1 on TPU, 2 elsewhere."""
  return 1 if platform == "tpu" else 2


def per_device_batch_shapes(batch_shapes: Mapping[str, tuple], batch_shards: int,
                            microbatches: int = 1) -> dict[str, tuple]:
  """Global {feature: (B, ...)} -> one device's microbatch (ceil(B / shards / M), ...)."""
  out = {}
  for name, shape in batch_shapes.items():
    rows = max(1, math.ceil(shape[0] / batch_shards / microbatches))
    out[name] = (rows, *shape[1:])
  return out


def gathered_weight_bytes(abstract_params: Any, param_shardings: Any, mesh_shape: dict,
                          fraction: float) -> int:
  """float32 bytes that all-gathering the params over 'fsdp' adds per device, times
  `fraction` (the share of the layers gathered at once)."""
  if mesh_shape.get("fsdp", 1) == 1:
    return 0
  unsharded = {**mesh_shape, "fsdp": 1}
  gathered = tree_bytes_per_device(abstract_params, param_shardings, unsharded)
  return int(fraction * (gathered - tree_bytes_per_device(abstract_params, param_shardings,
                                                           mesh_shape)))


def cast_weight_bytes(model, abstract_params: Any, param_shardings: Any, mesh_shape: dict,
                      platform: str) -> int:
  """On TPU with scan_layers and a 16-bit compute dtype: the compute-dtype copy of every
  layer's weights, which XLA casts once before the layer loops and keeps through the
  backward (13.5 MiB per BERT-base layer in bf16); 0 elsewhere."""
  itemsize = jnp.dtype(model.config.dtype).itemsize
  if platform != "tpu" or not model.config.scan_layers or itemsize >= 4:
    return 0
  stacks = set(model.stack_fields)
  layers = {k: v for k, v in abstract_params.items() if k in stacks}
  shardings = {k: v for k, v in param_shardings.items() if k in stacks}
  return tree_bytes_per_device(layers, shardings, mesh_shape) * itemsize // 4


def estimate_memory(model, optimizer, mesh, param_shardings: Any, abstract_params: Any,
                    batch_shapes: Mapping[str, tuple], *, platform: str,
                    microbatches: int = 1, rules=parallel.DEFAULT_RULES,
                    zero_stage: int = 0) -> MemoryEstimate:
  """The per-device MemoryEstimate of a train step of `model` on `mesh` (a Mesh or
  AbstractMesh) for a global batch of `batch_shapes` (feature -> shape); zero_stage
  (config.mesh.zero_stage) splits the optimizer state (1) and the gradients and update
  temporaries (2) over the batch's mesh axes."""
  cfg = model.config
  mesh_shape = dict(mesh.shape)
  batch_shards = mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1)
  tensor = mesh_shape.get("tensor", 1)
  params = tree_bytes_per_device(abstract_params, param_shardings, mesh_shape)
  abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
  updates = update_shardings(abstract_params, param_shardings, mesh, rules, zero_stage)
  opt_shardings = opt_state_shardings(abstract_opt, abstract_params, updates, mesh)
  opt_state = tree_bytes_per_device(abstract_opt, opt_shardings, mesh_shape)
  update_shards = tree_bytes_per_device(abstract_params, updates, mesh_shape)
  grads = update_shards if zero_stage >= 2 else params
  device_batch = per_device_batch_shapes(batch_shapes, batch_shards)
  micro = per_device_batch_shapes(batch_shapes, batch_shards, microbatches)
  remat = effective_remat_policy(cfg, platform)
  with tracing_for(platform):  # the attention kernel the step will run there
    acts = activation_bytes(model, micro, tensor, remat)
  layers = sum(model.stack_layers(cfg).values())
  fraction = min(1.0, 2 / layers) if cfg.scan_layers else 1.0
  return MemoryEstimate(
      params=params, opt_state=opt_state,
      batch=sum(4 * math.prod(s) for s in device_batch.values()),
      grads=grads * (2 if microbatches > 1 else 1),
      activations=acts["activations"], backward=acts["backward"],
      logits=acts["logits"] + logits_buffer_bytes(model, micro, tensor),
      gathered=gathered_weight_bytes(abstract_params, param_shardings, mesh_shape, fraction),
      cast_weights=cast_weight_bytes(model, abstract_params, param_shardings, mesh_shape,
                                     platform),
      update=update_shards * update_temporaries(platform),
      per_device_batch=next(iter(device_batch.values()))[0], remat_policy=remat)
