"""The generating families as incremental decoders on the KV cache (`module(decode=True)`).

Each stepper builder runs the prompt (but its last token) once and returns a Stepper:
the token to feed first [B] (the prompt's last token; T5's decoder start token), the
decoding state (the cache, and for the decoder-only family the position of each row's
next token), `step_fn(state, token) -> (logits, state)` for B * rows_per_example rows
(beam search folds beams into the batch), and the batch axis of every state leaf (how
beams are expanded and reordered). Feeding the first token inside the search loop
keeps one trace of the step.

Under each stepper is a CachedStep: one step as a pure function of params, cache, token
and the batch's other inputs (what `t5x-like bench model` compiles and times).

Decoder-only prompts come right-padded ([B, P] with per-row lengths, the layout of the
training data) and are left-aligned here, so that every row generates into the same
cache slot: padding is kept out of attention (decoder_segment_ids = 0) and positions
count from each row's first real token, as Hugging Face's generate does for
left-padded prompts.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class Stepper(NamedTuple):
  first_token_B: Array
  state: Any
  step_fn: Callable[[Any, Array], tuple[Array, Any]]
  batch_axes: Any  # per state leaf: its batch axis, or None


class CachedStep(NamedTuple):
  """One decoding step on the KV cache, pure in all of its inputs.

  step(params, cache, token_B, position_B, *context) -> (logits [B, V], cache);
  make_cache(rows) -> the empty cache of `rows` rows; context: the step's other inputs
  for the batch (T5: the encoder output [B, L, D] and the encoder tokens [B, L]).
  """

  step: Callable[..., tuple[Array, Any]]
  make_cache: Callable[[int], Any]
  context: tuple = ()


def _batch_axes(make_cache: Callable[[int], Any]) -> Any:
  """Per cache leaf the axis that grows with the batch (None for the scalar index)."""
  one, two = jax.eval_shape(lambda: make_cache(1)), jax.eval_shape(lambda: make_cache(2))

  def axis(a, b):
    differing = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
    return differing[0] if differing else None
  return jax.tree.map(axis, one, two)


def zero_cache(init_fn: Callable[[], Any]) -> Any:
  """The cache `init_fn` would create (all zeros), without running the init forward."""
  shapes = jax.eval_shape(init_fn)
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def prompt_lengths(batch: Mapping[str, Array]) -> Array:
  """[B] real-token counts of right-padded decoder prompts: decoder_segment_ids > 0 when
  given, else every row is P long (GPT-2's id 0 is a real token)."""
  tokens = batch["decoder_input_tokens"]
  segments = batch.get("decoder_segment_ids")
  if segments is None:
    return jnp.full(tokens.shape[:1], tokens.shape[1], jnp.int32)
  return jnp.sum(jnp.asarray(segments) > 0, axis=1).astype(jnp.int32)


def left_align(prompt_BxP: Array, lengths_B: Array, pad_id: int = 0):
  """Right-padded prompts -> (left-padded tokens, valid mask, positions), all [B, P].

  Row b's real tokens move to the last lengths_B[b] slots; positions count 0, 1, ...
  from the first real token (0 on padding).
  """
  prompt_len = prompt_BxP.shape[1]
  source_BxP = jnp.arange(prompt_len)[None, :] - (prompt_len - lengths_B)[:, None]
  valid_BxP = source_BxP >= 0
  positions_BxP = jnp.maximum(source_BxP, 0)
  tokens_BxP = jnp.where(valid_BxP, jnp.take_along_axis(prompt_BxP, positions_BxP, axis=1),
                         pad_id)
  return tokens_BxP, valid_BxP, positions_BxP


# ------------------------------------------------------------------ decoder-only
def _run_decoder(module, params, cache, features):
  """(logits [B, T, V], cache) of decoder features fed on the cache."""
  logits, mutated = module.apply({"params": params, "cache": cache}, features,
                                 mutable=["cache"])
  return logits, mutated["cache"]


def decoder_only_step(model, cache_len: int) -> CachedStep:
  """GPT-2 family: one token per row at its position, on a cache of cache_len slots."""
  module = model.module(decode=True)

  def step(params, cache, token_B, position_B):
    logits_Bx1xV, cache = _run_decoder(module, params, cache,
                                       {"decoder_input_tokens": token_B[:, None],
                                        "decoder_positions": position_B[:, None]})
    return logits_Bx1xV[:, 0], cache

  def make_cache(rows):
    tokens = {"decoder_input_tokens": jnp.zeros((rows, cache_len), jnp.int32)}
    return zero_cache(lambda: module.init(jax.random.key(0), tokens)["cache"])
  return CachedStep(step, make_cache)


def decoder_only(model, params, prompt_BxP: Array, lengths_B: Array, *, max_new_tokens: int,
                 rows_per_example: int = 1, pad_id: int = 0) -> Stepper:
  """GPT-2 family: prefill the left-aligned prompt but its last token, then one token
  per step. The cache holds P + max_new_tokens - 1 slots (the last generated token is
  never fed back).
  """
  del rows_per_example  # every per-row input lives in the state
  batch, prompt_len = prompt_BxP.shape
  cache_len = prompt_len + max_new_tokens - 1
  cfg = model.config
  if cfg.position_embedding == "learned" and cache_len > cfg.max_position_embeddings:
    raise ValueError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} - 1 ="
                     f" {cache_len} positions > max_position_embeddings"
                     f" {cfg.max_position_embeddings}")
  cached = decoder_only_step(model, cache_len)
  tokens_BxP, valid_BxP, positions_BxP = left_align(prompt_BxP, lengths_B, pad_id)
  cache = cached.make_cache(batch)
  if prompt_len > 1:
    _, cache = _run_decoder(model.module(decode=True), params, cache,
                            {"decoder_input_tokens": tokens_BxP[:, :-1],
                             "decoder_segment_ids": valid_BxP[:, :-1].astype(jnp.int32),
                             "decoder_positions": positions_BxP[:, :-1]})

  def step_fn(state, token_B):
    cache, position_B = state
    logits_BxV, cache = cached.step(params, cache, token_B, position_B)
    return logits_BxV, (cache, position_B + 1)

  state = (cache, positions_BxP[:, -1].astype(jnp.int32))
  return Stepper(tokens_BxP[:, -1], state, step_fn, (_batch_axes(cached.make_cache), 0))


# ------------------------------------------------------------------ encoder-decoder
def encoder_decoder_step(model, params, encoder_tokens_BxL: Array, cache_len: int
                         ) -> CachedStep:
  """T5 family: encodes the batch once (the context), then one decoder token per row
  on a cache of cache_len slots (relative positions come from the cache index)."""
  module = model.module(decode=True)
  encoded_BxLxD = model.module().apply({"params": params},
                                       {"encoder_input_tokens": encoder_tokens_BxL},
                                       method="encode")

  def step(params, cache, token_B, position_B, encoded_BxLxD, encoder_tokens_BxL):
    del position_B
    logits_Bx1xV, mutated = module.apply(
        {"params": params, "cache": cache}, encoded_BxLxD,
        {"encoder_input_tokens": encoder_tokens_BxL, "decoder_input_tokens": token_B[:, None]},
        method="decode_logits", mutable=["cache"])
    return logits_Bx1xV[:, 0], mutated["cache"]

  def make_cache(rows):
    encoded = jnp.zeros((rows,) + encoded_BxLxD.shape[1:], encoded_BxLxD.dtype)
    features = {"encoder_input_tokens": jnp.zeros((rows, encoder_tokens_BxL.shape[1]),
                                                  jnp.int32),
                "decoder_input_tokens": jnp.zeros((rows, cache_len), jnp.int32)}
    return zero_cache(lambda: module.init(jax.random.key(0), encoded, features,
                                          method="decode_logits")["cache"])
  return CachedStep(step, make_cache, (encoded_BxLxD, encoder_tokens_BxL))


def encoder_decoder(model, params, encoder_tokens_BxL: Array, *, max_new_tokens: int,
                    rows_per_example: int = 1, decoder_start_id: int = 0) -> Stepper:
  """T5 family: encode once, then decode from decoder_start_id (T5: the pad id 0), fed
  as the first token.

  The encoder output is shared by the rows_per_example rows of each example and is
  not part of the state (it never needs reordering).
  """
  batch = encoder_tokens_BxL.shape[0]
  cached = encoder_decoder_step(model, params, encoder_tokens_BxL, max_new_tokens)
  context_rows = tuple(jnp.repeat(x, rows_per_example, axis=0) for x in cached.context)

  def step_fn(cache, token_B):
    return cached.step(params, cache, token_B, None, *context_rows)

  start_B = jnp.full((batch,), decoder_start_id, jnp.int32)
  return Stepper(start_B, cached.make_cache(batch), step_fn, _batch_axes(cached.make_cache))
