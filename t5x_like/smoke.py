"""`t5x-like smoke`: each family takes a few optimizer steps on the embedded corpus.

Byte-level tokens (id = byte + 4; 0 pad, 1 EOS, 2 [MASK]) keep this free of any
vocabulary; the real pipeline (sentencepiece, objectives, loader) replaces it.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from t5x_like import corpus
from t5x_like.models import bert, build_model, gpt2, t5

VOCAB = 256 + 4
MASK_ID = 2


def corpus_windows(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
  """[batch, length] byte-level token ids from random places in the embedded corpus."""
  text = "\n\n".join(corpus.read_book(b) for b in corpus.book_names())
  ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + 4
  starts = rng.integers(0, len(ids) - length, batch)
  return np.stack([ids[s:s + length] for s in starts])


def make_batch(family: str, rng: np.random.Generator, batch: int, length: int) -> dict:
  """A batch in DESIGN.md's feature names for a byte-level objective of each family."""
  x = corpus_windows(rng, batch, length)
  if family == "encoder":  # masked LM: 15% of positions replaced by [MASK]
    num = max(1, round(0.15 * length))
    positions = np.sort(np.stack([rng.choice(length, num, replace=False) for _ in x]), 1)
    targets = np.take_along_axis(x, positions, 1)
    masked = x.copy()
    np.put_along_axis(masked, positions, MASK_ID, 1)
    return dict(encoder_input_tokens=masked, mlm_positions=positions, mlm_targets=targets,
                mlm_weights=np.ones_like(targets, np.float32))
  if family == "decoder":  # causal LM
    return dict(decoder_input_tokens=x[:, :-1], decoder_target_tokens=x[:, 1:],
                decoder_loss_weights=np.ones_like(x[:, 1:], np.float32))
  half = length // 2  # encoder-decoder: continue the first half
  targets = x[:, half:]
  inputs = np.concatenate([np.zeros_like(targets[:, :1]), targets[:, :-1]], 1)
  return dict(encoder_input_tokens=x[:, :half], decoder_input_tokens=inputs,
              decoder_target_tokens=targets,
              decoder_loss_weights=np.ones_like(targets, np.float32))


SMOKE_CONFIGS = {
    "bert": lambda: bert(2, 128, vocab_size=VOCAB, nsp_head=False, dropout_rate=0.0,
                         attention_dropout_rate=0.0),
    "gpt2": lambda: gpt2(2, 128, vocab_size=VOCAB, dropout_rate=0.0,
                         attention_dropout_rate=0.0),
    "t5": lambda: t5("1.1", 128, 256, 2, 2, vocab_size=VOCAB),
}


def run(steps: int = 40, batch: int = 16, length: int = 64, seed: int = 0) -> list[dict]:
  """Trains each smoke model for `steps` AdamW steps; returns first and last losses."""
  results = []
  for name, make_config in SMOKE_CONFIGS.items():
    model = build_model(make_config())
    rng = np.random.default_rng(seed)
    params = model.init(jax.random.key(seed), model.example_batch_shapes(batch, length))
    optimizer = optax.adamw(3e-3)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, batch, key):
      (loss, _), grads = jax.value_and_grad(model.loss_fn, has_aux=True)(params, batch, key)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    start = time.perf_counter()
    losses = []
    for i in range(steps):
      data = {k: jnp.asarray(v) for k, v in make_batch(model.config.family, rng, batch,
                                                       length).items()}
      params, opt_state, loss = step(params, opt_state, data, jax.random.key(i))
      losses.append(float(loss))
    results.append(dict(model=name, params=model.num_params(), first_loss=losses[0],
                        last_loss=losses[-1], seconds=time.perf_counter() - start))
  return results
