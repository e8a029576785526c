"""Greedy decoding and sampling: one token per row per step, in a lax.while_loop.

The loop is generic over the decoding state: `step_fn(state, token_B) -> (logits_BxV,
state)` feeds one token per row and returns the next-token logits (t5x_like.infer.steppers
builds it on the KV cache; a test can build it from full forwards). Rows stop at eos
and are padded after it; the loop ends when every row has stopped or after
max_new_tokens tokens.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from t5x_like.infer.sampling import choose_token

Array = jax.Array
StepFn = Callable[[Any, Array], tuple[Array, Any]]


class Decoded(NamedTuple):
  """tokens [B, N] (pad after eos) and scores [B]: the sum of the log-probabilities of
  the generated tokens up to and including eos (beam search: normalised by
  length ** length_penalty, as Hugging Face's sequences_scores)."""

  tokens: Array
  scores: Array


class _LoopState(NamedTuple):
  step: Array  # number of tokens generated so far
  logits_BxV: Array  # next-token logits
  tokens_BxN: Array
  scores_B: Array
  done_B: Array
  decode_state: Any


def temperature_sample(first_logits_BxV: Array, decode_state: Any, step_fn: StepFn, *,
                       max_new_tokens: int, eos_id: Optional[int] = None, pad_id: int = 0,
                       rng: Optional[Array] = None, temperature: float = 1.0, top_k: int = 0,
                       top_p: float = 1.0) -> Decoded:
  """Greedy (rng None or temperature 0) or sampled decoding of max_new_tokens tokens.

  first_logits_BxV: the logits after the prompt. The token of step t is drawn with
  jax.random.fold_in(rng, t), so the output is a function of rng alone.
  """
  batch = first_logits_BxV.shape[0]

  def choose(s: _LoopState) -> _LoopState:
    key = None if rng is None else jax.random.fold_in(rng, s.step)
    token_B = choose_token(s.logits_BxV, key, temperature=temperature, top_k=top_k,
                           top_p=top_p)
    token_B = jnp.where(s.done_B, pad_id, token_B)
    log_probs_BxV = jax.nn.log_softmax(s.logits_BxV.astype(jnp.float32), axis=-1)
    token_log_prob_B = jnp.take_along_axis(log_probs_BxV, token_B[:, None], axis=-1)[:, 0]
    scores_B = s.scores_B + jnp.where(s.done_B, 0.0, token_log_prob_B)
    tokens_BxN = jax.lax.dynamic_update_slice(s.tokens_BxN, token_B[:, None], (0, s.step))
    done_B = s.done_B if eos_id is None else s.done_B | (token_B == eos_id)
    return s._replace(step=s.step + 1, tokens_BxN=tokens_BxN, scores_B=scores_B,
                      done_B=done_B)

  def feed_and_choose(s: _LoopState) -> _LoopState:
    last_B = jax.lax.dynamic_slice_in_dim(s.tokens_BxN, s.step - 1, 1, axis=1)[:, 0]
    logits_BxV, decode_state = step_fn(s.decode_state, last_B)
    return choose(s._replace(logits_BxV=logits_BxV, decode_state=decode_state))

  def not_finished(s: _LoopState) -> Array:
    return (s.step < max_new_tokens) & ~jnp.all(s.done_B)

  state = _LoopState(step=jnp.zeros((), jnp.int32), logits_BxV=first_logits_BxV,
                     tokens_BxN=jnp.full((batch, max_new_tokens), pad_id, jnp.int32),
                     scores_B=jnp.zeros((batch,), jnp.float32),
                     done_B=jnp.zeros((batch,), jnp.bool_), decode_state=decode_state)
  # The first token comes from the prompt's logits; each loop step feeds the last token.
  state = jax.lax.while_loop(not_finished, feed_and_choose, choose(state))
  return Decoded(state.tokens_BxN, state.scores_B)
