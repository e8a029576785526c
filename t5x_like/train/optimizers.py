"""Optimizers and learning-rate schedules from the `c.optimizer` config.

  make_optimizer(opt_cfg, num_steps) -> (optax.GradientTransformation, schedule)

AdamW follows BERT's reference AdamWeightDecayOptimizer (google-research/bert
optimization.py): decoupled weight decay on kernels and embeddings only, optionally
no bias correction. Adafactor follows T5 (Shazeer & Stern 2018; the T5 paper, section
3.1.2): factored second moments, decay rate 0.8, no momentum. Every schedule is a pure
jnp function of the update count `step` (0 for the first update), the same count the
train step reports. OPTIMIZERS and SCHEDULES below are the registries configs name.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

Schedule = Callable[[Any], jax.Array]


# ----------------------------------------------------------------- schedules
def _warmup(lr: float, warmup_steps: int, step):
  """lr * step / warmup_steps (BERT's warmup: 0 at step 0)."""
  return lr * step / max(warmup_steps, 1)


def linear_schedule(lr: float, warmup_steps: int, decay_steps: int,
                    end_fraction: float = 0.0) -> Schedule:
  """BERT's reference schedule, exactly (run_pretraining.py / optimization.py).

  step < warmup_steps: lr * step / warmup_steps
  else:                end + (lr - end) * (1 - min(step, decay_steps) / decay_steps),
                       end = lr * end_fraction.
  The decay is measured from step 0, not from the end of warmup (as the reference
  polynomial_decay does), so the lr drops from lr to lr * (1 - warmup/decay) at the
  end of warmup.
  """
  end = lr * end_fraction
  decay_steps = max(int(decay_steps), 1)

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    decayed = end + (lr - end) * (1.0 - jnp.minimum(step, decay_steps) / decay_steps)
    return jnp.where(step < warmup_steps, _warmup(lr, warmup_steps, step), decayed)
  return schedule


def rsqrt_schedule(lr: float, warmup_steps: int) -> Schedule:
  """T5: lr constant for warmup_steps, then lr * sqrt(warmup_steps / step).

  = lr * sqrt(w) / sqrt(max(step, w)), continuous at w. T5's lr 0.01 for 10k steps
  then 1/sqrt(step) is lr=0.01, warmup_steps=10_000. With warmup_steps 0 it is
  lr / sqrt(max(step, 1)).
  """
  w = float(max(warmup_steps, 1))

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    return lr * math.sqrt(w) * jax.lax.rsqrt(jnp.maximum(step, w))
  return schedule


def cosine_schedule(lr: float, warmup_steps: int, decay_steps: int,
                    end_fraction: float = 0.0) -> Schedule:
  """GPT: linear warmup (lr * step / warmup), then cosine from lr to lr * end_fraction.

  The cosine runs from warmup_steps to decay_steps (a total step count, warmup
  included) and stays at the floor after it:
  lr * (f + (1 - f) * (1 + cos(pi * p)) / 2), p = (step - w) / (decay_steps - w) in [0, 1].
  """
  span = max(int(decay_steps) - int(warmup_steps), 1)

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    progress = jnp.clip((step - warmup_steps) / span, 0.0, 1.0)
    cosine = lr * (end_fraction + (1.0 - end_fraction) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress)))
    return jnp.where(step < warmup_steps, _warmup(lr, warmup_steps, step), cosine)
  return schedule


def constant_schedule(lr: float, warmup_steps: int = 0) -> Schedule:
  """lr, after an optional linear warmup lr * step / warmup_steps."""
  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    return jnp.where(step < warmup_steps, _warmup(lr, warmup_steps, step),
                     jnp.asarray(lr, jnp.float32))
  return schedule


# name -> (lr, warmup_steps, decay_steps, end_fraction) -> Schedule; a new schedule is
# a function above and one line here (validation reads the names from this table).
SCHEDULES: dict[str, Callable[[float, int, int, float], Schedule]] = {
    "linear": linear_schedule,
    "rsqrt": lambda lr, warmup, decay, end: rsqrt_schedule(lr, warmup),
    "cosine": cosine_schedule,
    "constant": lambda lr, warmup, decay, end: constant_schedule(lr, warmup),
}


def make_schedule(opt_cfg, num_steps: int) -> Schedule:
  """The schedule named by opt_cfg.schedule (a key of SCHEDULES)."""
  if opt_cfg.schedule not in SCHEDULES:
    raise ValueError(f"optimizer.schedule={opt_cfg.schedule!r}: expected one of"
                     f" {sorted(SCHEDULES)}")
  decay = int(opt_cfg.get("decay_steps", 0)) or int(num_steps)
  return SCHEDULES[opt_cfg.schedule](float(opt_cfg.learning_rate), int(opt_cfg.warmup_steps),
                                     decay, float(opt_cfg.get("end_learning_rate_fraction",
                                                              0.0)))


# --------------------------------------------------------- weight-decay mask
def is_decayed(path: tuple[str, ...]) -> bool:
  """Whether weight decay applies to the param at `path` (module names..., leaf name).

  As BERT's reference (exclude_from_weight_decay=["LayerNorm", "layer_norm", "bias"]):
  no decay on any name containing 'bias' (dense biases, mlm_bias) nor on any param of
  a norm module (a name ending in 'norm': embedding_norm, mlp_norm, final_norm, ...).
  Kernels, embeddings and T5's relative-position tables are decayed.
  """
  names = [p.lower() for p in path]
  if any("bias" in n for n in names):
    return False
  return not any(n.endswith("norm") for n in names[:-1])


def decay_mask(params: Any) -> Any:
  """Tree of bools like `params`: True where weight decay applies (see is_decayed)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: is_decayed(tuple(
          jax.tree_util.keystr(path, simple=True, separator="/").split("/"))), params)


# --------------------------------------------------------------------- adam
def scale_by_adam(b1: float, b2: float, eps: float,
                  bias_correction: bool = True) -> optax.GradientTransformation:
  """Adam's direction m / (sqrt(v) + eps), with or without bias correction.

  bias_correction=False is BERT's AdamWeightDecayOptimizer: m and v are the plain
  EMAs, without the 1 / (1 - b^t) factors. The state is optax's ScaleByAdamState
  (count, mu, nu) either way, so checkpoints and shardings look the same.
  """
  if bias_correction:
    return optax.scale_by_adam(b1=b1, b2=b2, eps=eps)

  def init_fn(params):
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros,
                                  nu=jax.tree.map(jnp.copy, zeros))

  def update_fn(updates, state, params=None):
    del params
    mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, updates)
    nu = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * jnp.square(g), state.nu, updates)
    out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
    return out, optax.ScaleByAdamState(count=state.count + 1, mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)


def adamw(schedule: Schedule, *, b1: float, b2: float, eps: float, weight_decay: float,
          bias_correction: bool, clip_norm: float) -> optax.GradientTransformation:
  """clip (global norm) -> adam -> + weight_decay * param (masked) -> * -lr.

  The decay is decoupled and scaled by the lr like BERT's: p -= lr * (adam + wd * p).
  """
  parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm > 0 else []
  parts.append(scale_by_adam(b1, b2, eps, bias_correction))
  if weight_decay > 0:
    parts.append(optax.add_decayed_weights(weight_decay, mask=decay_mask))
  parts.append(optax.scale_by_learning_rate(schedule))
  return optax.chain(*parts)


def adafactor(schedule: Schedule, *, decay_rate: float, clip_norm: float,
              weight_decay: float = 0.0) -> optax.GradientTransformation:
  """T5's Adafactor: factored second moments (dims >= 128), decay rate 0.8, no momentum,
  parameter-scaled updates clipped at RMS 1; optional global-norm clipping first.

  weight_decay > 0 adds decoupled decay (lr-scaled, masked as AdamW); T5 uses none,
  so T5 configs set optimizer.weight_decay = 0.
  """
  parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm > 0 else []
  parts.append(optax.adafactor(
      learning_rate=schedule, decay_rate=decay_rate, factored=True, momentum=None,
      multiply_by_parameter_scale=True, clipping_threshold=1.0,
      weight_decay_rate=weight_decay if weight_decay > 0 else None,
      weight_decay_mask=decay_mask if weight_decay > 0 else None))
  return optax.chain(*parts)


def _adamw(opt_cfg, schedule: Schedule, clip_norm: float, weight_decay: float):
  return adamw(schedule, b1=float(opt_cfg.b1), b2=float(opt_cfg.b2), eps=float(opt_cfg.eps),
               weight_decay=weight_decay, bias_correction=bool(opt_cfg.bias_correction),
               clip_norm=clip_norm)


def _adafactor(opt_cfg, schedule: Schedule, clip_norm: float, weight_decay: float):
  return adafactor(schedule, decay_rate=float(opt_cfg.adafactor_decay_rate),
                   clip_norm=clip_norm, weight_decay=weight_decay)


# name -> (opt_cfg, schedule, clip_norm, weight_decay) -> optax transformation; a new
# optimizer is a builder and one line here (validation reads the names from this table).
OPTIMIZERS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "adamw": _adamw,
    "adafactor": _adafactor,
}


def make_optimizer(opt_cfg, num_steps: int) -> tuple[optax.GradientTransformation, Schedule]:
  """(optax transformation, schedule) from a `c.optimizer` ConfigDict (train/defaults.py).

  schedule(step) is the lr applied by the update that takes params from step to
  step + 1 (step 0 = the first update).
  """
  if opt_cfg.name not in OPTIMIZERS:
    raise ValueError(f"optimizer.name={opt_cfg.name!r}: expected one of {sorted(OPTIMIZERS)}")
  schedule = make_schedule(opt_cfg, num_steps)
  clip_norm = float(opt_cfg.get("clip_norm", 0.0) or 0.0)
  weight_decay = float(opt_cfg.get("weight_decay", 0.0) or 0.0)
  return OPTIMIZERS[opt_cfg.name](opt_cfg, schedule, clip_norm, weight_decay), schedule
