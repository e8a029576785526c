"""Decoding (greedy, sampling, beam search) on the KV cache, and scoring.

  generate(model, params, batch, max_new_tokens=..., **settings) -> Decoded(tokens, scores)
  predict(model, params, batch, max_new_tokens=..., ...) -> tokens (eos: the model's)
  score(model, params, batch) -> {'token_log_likelihood': [B, T], 'log_likelihood': [B]}

The search loops (temperature_sample, beam_search) are generic over a step function,
so that they run on the cache (each generating model's `stepper`,
t5x_like/models/steppers.py) or on anything else that gives logits.
"""

from t5x_like.infer.beam import beam_search, expand_beams, gather_beams
from t5x_like.infer.decoding import DecodeConfig, generate, predict
from t5x_like.infer.sampling import choose_token, process_logits, top_k_filter, top_p_filter
from t5x_like.infer.scoring import score, target_weights, token_log_likelihood
from t5x_like.infer.search import Decoded, temperature_sample
from t5x_like.models.steppers import (Stepper, decoder_only, encoder_decoder, left_align,
                                      prompt_lengths)

__all__ = [
    "DecodeConfig", "Decoded", "Stepper", "beam_search", "choose_token", "decoder_only",
    "encoder_decoder", "expand_beams", "gather_beams", "generate", "left_align", "predict",
    "process_logits", "prompt_lengths", "score", "target_weights", "temperature_sample",
    "token_log_likelihood", "top_k_filter", "top_p_filter",
]
