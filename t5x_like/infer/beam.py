"""Beam search with Hugging Face's conventions (transformers' vectorised `_beam_search`).

Beams are folded into the batch dimension of the decoding state ([B * K, ...], beam
fastest), which is expanded from the prompt's [B, ...] once and reordered by beam index
after every step. Per row and step:

  1. the 2K best continuations of the K running beams by summed log-probability;
  2. those ending in eos (or reaching max_new_tokens) among the top K become finished
     hypotheses scored sum_log_probs / generated_length ** length_penalty (the length
     counts eos); the K best finished hypotheses are kept;
  3. the K best continuations that did not finish run on.

Stopping (HF `early_stopping`): True stops a row once K hypotheses are finished; False
(HF's default) once the best running beam, normalised at the current length, cannot
beat the worst finished one; "never" normalises it at max_new_tokens when
length_penalty > 0. The result is the best finished hypothesis of each row.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

from t5x_like.infer.search import Decoded, StepFn

Array = jax.Array
EarlyStopping = Union[bool, str, Array]
_BLOCKED = -1.0e9  # HF's score for impossible candidates (added, so blocks accumulate)
EARLY_STOPPING_CODES = {False: 0, True: 1, "never": 2}


def early_stopping_code(early_stopping: EarlyStopping) -> Array:
  """HF's early_stopping (False, True or "never") as an int32 code, traceable."""
  if isinstance(early_stopping, jax.Array):
    return early_stopping.astype(jnp.int32)
  for value, code in EARLY_STOPPING_CODES.items():
    if early_stopping is value or (isinstance(value, str) and early_stopping == value):
      return jnp.asarray(code, jnp.int32)
  raise ValueError(f"early_stopping={early_stopping!r}: expected True, False or 'never'")


# ------------------------------------------------------- beams in the batch dimension
def _map_with_axes(fn, batch_axes: Any, tree: Any) -> Any:
  """fn(axis, leaf) over the leaves of `tree`; batch_axes: same structure, int or None."""
  return jax.tree.map(lambda axis, x: x if axis is None else fn(axis, x), batch_axes, tree,
                      is_leaf=lambda a: a is None)


def expand_beams(tree: Any, batch_axes: Any, num_beams: int) -> Any:
  """[B, ...] -> [B * K, ...] along each leaf's batch axis; row b * K + k is beam k of b."""
  return _map_with_axes(lambda axis, x: jnp.repeat(x, num_beams, axis=axis), batch_axes, tree)


def gather_beams(tree: Any, batch_axes: Any, rows_BK: Array) -> Any:
  """Reorders the [B * K] rows of each leaf: new row i = old row rows_BK[i]."""
  return _map_with_axes(lambda axis, x: jnp.take(x, rows_BK, axis=axis), batch_axes, tree)


# ----------------------------------------------------------------------- the search
class _BeamState(NamedTuple):
  step: Array  # tokens generated so far
  last_BK: Array  # the tokens to feed next
  running_BxKxN: Array
  running_scores_BxK: Array  # summed log-probs, sorted best first
  finished_BxKxN: Array
  finished_scores_BxK: Array  # length-normalised, sorted best first
  finished_BxK: Array  # which finished slots hold a hypothesis
  improvable_B: Array  # HF's is_early_stop_heuristic_unsatisfied
  all_hit_limit: Array  # every candidate ended (max length): nothing can go on
  decode_state: Any


def _take(x_BxM, index_BxJ):
  """x [B, M, ...] gathered along dim 1 -> [B, J, ...]."""
  index = index_BxJ.reshape(index_BxJ.shape + (1,) * (x_BxM.ndim - 2))
  return jnp.take_along_axis(x_BxM, index, axis=1)


def beam_search(first_token_B: Array, decode_state: Any, step_fn: StepFn, batch_axes: Any, *,
                num_beams: int, max_new_tokens: int, eos_id: Optional[Union[int, Array]] = None, pad_id: int = 0,
                length_penalty: Union[float, Array] = 1.0,
                early_stopping: EarlyStopping = False) -> Decoded:
  """Beam search of max_new_tokens tokens -> Decoded(best tokens [B, N], their scores [B]).

  first_token_B (fed first: a prompt's last token, T5's decoder start) and decode_state
  ([B, ...], the batch axis of each leaf in batch_axes) come from the prompt; step_fn
  runs on [B * K] rows. eos_id, length_penalty and early_stopping (as
  early_stopping_code) may be traced scalars (eos_id < 0: no eos).
  """
  code = early_stopping_code(early_stopping)
  stop_when_full = code == EARLY_STOPPING_CODES[True]
  never = code == EARLY_STOPPING_CODES["never"]
  batch, k, n = first_token_B.shape[0], num_beams, max_new_tokens
  top_k_mask_2K = jnp.arange(2 * k) < k
  length_penalty = jnp.asarray(length_penalty, jnp.float32)

  def feed_and_select(s: _BeamState) -> _BeamState:
    t = s.step
    logits_BKxV, decode_state = step_fn(s.decode_state, s.last_BK)
    vocab = logits_BKxV.shape[-1]
    if vocab < 2 * k:
      raise ValueError(f"num_beams={k} needs a vocabulary of at least {2 * k} tokens")
    log_probs_BKxV = jax.nn.log_softmax(logits_BKxV.astype(jnp.float32), axis=-1)
    totals_BxKV = (log_probs_BKxV.reshape(batch, k, vocab)
                   + s.running_scores_BxK[:, :, None]).reshape(batch, k * vocab)
    # 1. the 2K best continuations
    cand_scores_Bx2K, cand_index_Bx2K = jax.lax.top_k(totals_BxKV, 2 * k)
    cand_beam_Bx2K = cand_index_Bx2K // vocab
    cand_token_Bx2K = (cand_index_Bx2K % vocab).astype(jnp.int32)
    at_t_N = jnp.arange(n) == t
    cand_Bx2KxN = jnp.where(at_t_N, cand_token_Bx2K[:, :, None],
                            _take(s.running_BxKxN, cand_beam_Bx2K))
    ends_Bx2K = jnp.full(cand_token_Bx2K.shape, t + 1 >= n)
    if eos_id is not None:
      ends_Bx2K = ends_Bx2K | (cand_token_Bx2K == eos_id)

    # 3. the K best that go on
    going_Bx2K = cand_scores_Bx2K + ends_Bx2K * _BLOCKED
    running_scores_BxK, keep_BxK = jax.lax.top_k(going_Bx2K, k)
    running_BxKxN = _take(cand_Bx2KxN, keep_BxK)
    source_beam_BxK = _take(cand_beam_Bx2K, keep_BxK)

    # 2. finished hypotheses among the top K, merged with the finished ones so far
    just_finished_Bx2K = ends_Bx2K & top_k_mask_2K[None]
    normalised_Bx2K = cand_scores_Bx2K / (t + 1).astype(jnp.float32) ** length_penalty
    full_B = jnp.all(s.finished_BxK, axis=-1) & stop_when_full
    normalised_Bx2K = (normalised_Bx2K + full_B[:, None] * _BLOCKED
                       + (~s.improvable_B)[:, None] * _BLOCKED
                       + (~just_finished_Bx2K) * _BLOCKED)
    merged_scores_Bx3K = jnp.concatenate([s.finished_scores_BxK, normalised_Bx2K], axis=1)
    finished_scores_BxK, best_BxK = jax.lax.top_k(merged_scores_Bx3K, k)
    finished_BxKxN = _take(jnp.concatenate([s.finished_BxKxN, cand_Bx2KxN], axis=1), best_BxK)
    finished_BxK = _take(jnp.concatenate([s.finished_BxK, just_finished_Bx2K], axis=1),
                         best_BxK)

    rows_BK = (jnp.arange(batch)[:, None] * k + source_beam_BxK).reshape(-1)
    decode_state = gather_beams(decode_state, batch_axes, rows_BK)

    # Can a running beam still beat the worst finished hypothesis?
    length = jnp.where(never & (length_penalty > 0.0), n, t + 1)
    best_running_B = running_scores_BxK[:, 0] / length.astype(jnp.float32) ** length_penalty
    worst_finished_BxK = jnp.where(
        finished_BxK, jnp.min(finished_scores_BxK, axis=-1, keepdims=True), _BLOCKED)
    improvable_B = s.improvable_B & jnp.any(best_running_B[:, None] > worst_finished_BxK, -1)
    return _BeamState(step=t + 1, last_BK=_take(cand_token_Bx2K, keep_BxK).reshape(-1),
                      running_BxKxN=running_BxKxN,
                      running_scores_BxK=running_scores_BxK, finished_BxKxN=finished_BxKxN,
                      finished_scores_BxK=finished_scores_BxK, finished_BxK=finished_BxK,
                      improvable_B=improvable_B, all_hit_limit=jnp.all(ends_Bx2K),
                      decode_state=decode_state)

  def not_finished(s: _BeamState) -> Array:
    all_full = jnp.all(s.finished_BxK) & stop_when_full
    return (s.step < n) & jnp.any(s.improvable_B) & ~all_full & ~s.all_hit_limit

  pads_BxKxN = jnp.full((batch, k, n), pad_id, jnp.int32)
  state = _BeamState(
      step=jnp.zeros((), jnp.int32),
      last_BK=jnp.repeat(first_token_B.astype(jnp.int32), k, axis=0),
      running_BxKxN=pads_BxKxN,
      # Only beam 0 is live at first: the K copies of the prompt must not all expand.
      running_scores_BxK=jnp.where(jnp.arange(k) == 0, 0.0, _BLOCKED)[None].repeat(batch, 0),
      finished_BxKxN=pads_BxKxN,
      finished_scores_BxK=jnp.full((batch, k), _BLOCKED, jnp.float32),
      finished_BxK=jnp.zeros((batch, k), jnp.bool_),
      improvable_B=jnp.ones((batch,), jnp.bool_),
      all_hit_limit=jnp.zeros((), jnp.bool_),
      decode_state=expand_beams(decode_state, batch_axes, k))
  state = jax.lax.while_loop(not_finished, feed_and_select, state)
  return Decoded(state.finished_BxKxN[:, 0], state.finished_scores_BxK[:, 0])
