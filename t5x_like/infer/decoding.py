"""generate(): greedy, sampled or beam-searched continuations of a batch, in one jit.

  generate(model, params, batch, max_new_tokens=..., ...) -> Decoded(tokens [B, N], scores [B])

batch (models/model.py feature names; each family's `stepper` reads its part):
  decoder-only:     decoder_input_tokens [B, P], prompts padded on the RIGHT; their
                    lengths from decoder_segment_ids [B, P] (> 0 on real tokens) when
                    given, else every row is P long (GPT-2's id 0 is a real token).
                    Every prompt needs at least one token.
  encoder-decoder:  encoder_input_tokens [B, L] (0 = padding); decoding starts from
                    decoder_start_id (the pad id 0, as T5).
tokens holds the N = max_new_tokens generated tokens only (not the prompt), pad_id
after a row's eos.

With a mesh, the step runs under it and the logical-axis rules (as the train step):
params may come sharded (as load_pretrained places them) and activations and the cache are
sharded by the models' logical constraints.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Optional, Union

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from t5x_like import parallel
from t5x_like.infer.beam import beam_search, early_stopping_code
from t5x_like.infer.sharding import hashable_rules
from t5x_like.infer.search import Decoded, temperature_sample

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Decoding settings. eos_id, length_penalty, temperature and early_stopping reach the
  jitted loop as traced scalars (changing them does not recompile); the others are
  static.

  num_beams > 1: beam search (length_penalty, early_stopping as Hugging Face);
  otherwise greedy, or sampling when generate() gets an rng (temperature 0: greedy;
  top_k 0 and top_p 1.0: no filter). eos_id None (the default): every row runs
  max_new_tokens (T5's eos is 1, GPT-2's 50256).
  """

  max_new_tokens: int
  num_beams: int = 1
  eos_id: Optional[int] = None
  pad_id: int = 0
  decoder_start_id: int = 0
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  length_penalty: float = 1.0
  early_stopping: Union[bool, str] = False

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
    if self.num_beams < 1:
      raise ValueError(f"num_beams={self.num_beams}: must be >= 1")
    if self.temperature < 0.0:
      raise ValueError(f"temperature={self.temperature}: must be >= 0")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
    early_stopping_code(self.early_stopping)  # raises on anything but False, True, "never"


@functools.partial(jax.jit, static_argnames=("model", "cfg", "mesh", "rules"))
def _generate(model, params, batch, rng, scalars, *, cfg: DecodeConfig, mesh, rules) -> Decoded:
  with parallel.traced_rules(mesh, rules):
    stepper = model.stepper(params, batch, max_new_tokens=cfg.max_new_tokens,
                            rows_per_example=cfg.num_beams, pad_id=cfg.pad_id,
                            decoder_start_id=cfg.decoder_start_id)
    if cfg.num_beams > 1:
      return beam_search(stepper.first_token_B, stepper.state, stepper.step_fn,
                         stepper.batch_axes, num_beams=cfg.num_beams,
                         max_new_tokens=cfg.max_new_tokens, eos_id=scalars["eos_id"],
                         pad_id=cfg.pad_id, length_penalty=scalars["length_penalty"],
                         early_stopping=scalars["early_stopping"])
    return temperature_sample(stepper.first_token_B, stepper.state, stepper.step_fn,
                              max_new_tokens=cfg.max_new_tokens, eos_id=scalars["eos_id"],
                              pad_id=cfg.pad_id, rng=rng, temperature=scalars["temperature"],
                              top_k=cfg.top_k, top_p=cfg.top_p)


_FEATURES = ("decoder_input_tokens", "decoder_segment_ids", "encoder_input_tokens")


def generate(model, params: Any, batch: Mapping[str, Array], *, max_new_tokens: int,
             rng: Optional[Array] = None, mesh: Optional[Mesh] = None,
             rules=parallel.DEFAULT_RULES, **settings) -> Decoded:
  """Decodes `batch` on the KV cache -> Decoded(tokens [B, N], scores [B]).

  settings: the fields of DecodeConfig (num_beams, eos_id, pad_id, temperature, top_k,
  top_p, length_penalty, early_stopping, decoder_start_id). rng: sampling key (None:
  greedy); the same key gives the same tokens. mesh / rules: run sharded (see above).
  """
  cfg = DecodeConfig(max_new_tokens=max_new_tokens, **settings)
  if cfg.num_beams > 1 and rng is not None:
    raise ValueError("beam search does not sample: pass rng=None with num_beams > 1")
  if not model.generates:
    raise ValueError(f"model family {model.config.family!r} does not generate")
  features = {k: jnp.asarray(v) for k, v in batch.items() if k in _FEATURES}
  # Traced, so that changing them does not recompile.
  scalars = {"eos_id": jnp.asarray(-1 if cfg.eos_id is None else cfg.eos_id, jnp.int32),
             "length_penalty": jnp.asarray(cfg.length_penalty, jnp.float32),
             "temperature": jnp.asarray(cfg.temperature, jnp.float32),
             "early_stopping": early_stopping_code(cfg.early_stopping)}
  static = dataclasses.replace(cfg, eos_id=None, length_penalty=1.0, temperature=1.0,
                               early_stopping=False)
  return _generate(model, params, features, rng, scalars, cfg=static, mesh=mesh,
                   rules=hashable_rules(rules))


def predict(model, params: Any, batch: Mapping[str, Array], **decode_kwargs) -> Array:
  """Generated tokens [B, max_new_tokens], pad after eos: `generate` with eos_id
  defaulting to the model's (T5's </s>; None for decoders: every row runs to the end)."""
  decode_kwargs.setdefault("eos_id", getattr(model, "default_eos_id", None))
  return generate(model, params, batch, **decode_kwargs).tokens
