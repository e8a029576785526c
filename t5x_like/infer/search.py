"""Greedy decoding and sampling: one token per row per step, in a lax.while_loop.

The loop is generic over the decoding state: `step_fn(state, token_B) -> (logits_BxV,
state)` feeds one token per row and returns the next-token logits (t5x_like.models.steppers
builds it on the KV cache; a test can build it from full forwards). Rows stop at eos
and are padded after it; the loop ends when every row has stopped or after
max_new_tokens tokens.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

from t5x_like.infer.sampling import choose_token

Array = jax.Array
StepFn = Callable[[Any, Array], tuple[Array, Any]]


class Decoded(NamedTuple):
  """tokens [B, N] (pad after eos) and scores [B]: the sum of the model's
  log-probabilities (before temperature and filters) of the generated tokens up to and
  including eos; beam search divides it by length ** length_penalty (Hugging Face's
  sequences_scores)."""

  tokens: Array
  scores: Array


class _LoopState(NamedTuple):
  step: Array  # number of tokens generated so far
  last_B: Array  # the token to feed next
  tokens_BxN: Array
  scores_B: Array
  done_B: Array
  decode_state: Any


def temperature_sample(first_token_B: Array, decode_state: Any, step_fn: StepFn, *,
                       max_new_tokens: int, eos_id: Optional[Union[int, Array]] = None,
                       pad_id: int = 0, rng: Optional[Array] = None,
                       temperature: Union[float, Array] = 1.0, top_k: int = 0,
                       top_p: float = 1.0) -> Decoded:
  """Greedy (rng None or temperature 0) or sampled decoding of max_new_tokens tokens.

  first_token_B: the token fed first (a prompt's last token, T5's decoder start); each
  loop step feeds one token and chooses the next. The token of step t is drawn with
  jax.random.fold_in(rng, t), so the output is a function of rng alone. eos_id and
  temperature may be traced scalars (eos_id < 0: no eos).
  """
  batch = first_token_B.shape[0]

  def feed_and_choose(s: _LoopState) -> _LoopState:
    logits_BxV, decode_state = step_fn(s.decode_state, s.last_B)
    key = None if rng is None else jax.random.fold_in(rng, s.step)
    token_B = choose_token(logits_BxV, key, temperature=temperature, top_k=top_k, top_p=top_p)
    token_B = jnp.where(s.done_B, pad_id, token_B)
    log_probs_BxV = jax.nn.log_softmax(logits_BxV.astype(jnp.float32), axis=-1)
    token_log_prob_B = jnp.take_along_axis(log_probs_BxV, token_B[:, None], axis=-1)[:, 0]
    scores_B = s.scores_B + jnp.where(s.done_B, 0.0, token_log_prob_B)
    tokens_BxN = jax.lax.dynamic_update_slice(s.tokens_BxN, token_B[:, None], (0, s.step))
    done_B = s.done_B if eos_id is None else s.done_B | (token_B == eos_id)
    return _LoopState(step=s.step + 1, last_B=token_B, tokens_BxN=tokens_BxN,
                      scores_B=scores_B, done_B=done_B, decode_state=decode_state)

  def not_finished(s: _LoopState) -> Array:
    return (s.step < max_new_tokens) & ~jnp.all(s.done_B)

  state = _LoopState(step=jnp.zeros((), jnp.int32), last_B=first_token_B.astype(jnp.int32),
                     tokens_BxN=jnp.full((batch, max_new_tokens), pad_id, jnp.int32),
                     scores_B=jnp.zeros((batch,), jnp.float32),
                     done_B=jnp.zeros((batch,), jnp.bool_), decode_state=decode_state)
  state = jax.lax.while_loop(not_finished, feed_and_choose, state)
  return Decoded(state.tokens_BxN, state.scores_B)
