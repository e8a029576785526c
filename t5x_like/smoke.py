"""`t5x-like smoke`: each family takes a few optimizer steps on the embedded corpus.

The real pipeline (shipped vocabulary, objective, loader) feeds small models of the
three families; the training issue replaces this with `t5x-like train`.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax

from t5x_like.data.loader import make_loader
from t5x_like.data.pipeline import make_objective
from t5x_like.data.sources import EmbeddedCorpus
from t5x_like.data.tokenize import build_store
from t5x_like.data.vocab import default_vocab
from t5x_like.models import bert, build_model, gpt2, t5

# name -> (vocabulary family, objective, objective options, model config for vocab size V)
SMOKE_RUNS = {
    "bert": ("bert", "bert_mlm", dict(max_predictions_per_seq=10),
             lambda v: bert(2, 128, vocab_size=v, dropout_rate=0.0,
                            attention_dropout_rate=0.0)),
    "gpt2": ("gpt", "causal_lm", {},
             lambda v: gpt2(2, 128, vocab_size=v, dropout_rate=0.0,
                            attention_dropout_rate=0.0)),
    "t5": ("t5", "span_corruption", {}, lambda v: t5("1.1", 128, 256, 2, 2, vocab_size=v)),
}


def run(steps: int = 40, batch: int = 16, length: int = 64, seed: int = 0) -> list[dict]:
  """Trains each smoke model for `steps` AdamW steps; returns first and last losses."""
  source = EmbeddedCorpus()
  results = []
  for name, (family, objective, options, make_config) in SMOKE_RUNS.items():
    vocab = default_vocab(family)
    store, _ = build_store(source, vocab)
    data = iter(make_loader(make_objective(objective, store, vocab, seed=seed, length=length,
                                           **options),
                            batch, seed=seed, process_index=0, process_count=1))
    first = next(data)
    model = build_model(make_config(vocab.vocab_size))
    params = model.init(jax.random.key(seed), {k: v.shape for k, v in first.items()
                                               if k in ("encoder_input_tokens",
                                                        "decoder_input_tokens")})
    optimizer = optax.adamw(3e-3)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, batch, key):
      (loss, _), grads = jax.value_and_grad(model.loss_fn, has_aux=True)(params, batch, key)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    start = time.perf_counter()
    losses = []
    batch_np = first
    for i in range(steps):
      params, opt_state, loss = step(params, opt_state, jax.tree.map(jnp.asarray, batch_np),
                                     jax.random.key(i))
      losses.append(float(loss))
      batch_np = next(data)
    results.append(dict(model=name, objective=objective, params=model.num_params(),
                        first_loss=losses[0], last_loss=losses[-1],
                        seconds=time.perf_counter() - start))
  return results
