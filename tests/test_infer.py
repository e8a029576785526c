"""Decoding and scoring (t5x_like.infer) against full forwards and Hugging Face generate.

References: decoding loops written here that run a full forward over the whole prefix
at every step (no cache), transformers' `generate` / loss on the same random weights,
and log_softmax of model.logits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import t5x_like.hf as hf
from t5x_like import infer, parallel

N_NEW = 7  # max_new_tokens everywhere
PAD = 0
GPT2_PROMPT_LEN = 6
GPT2_LENGTHS = (6, 4, 2, 1)  # the padded batch: right-padded here, left-padded for HF
VOCAB = 98  # even: the vocabulary shards over 'tensor' = 2


def _key(seed):
  return jax.random.key(seed, impl="rbg")  # compiles much faster than threefry on CPU


# ---------------------------------------------------------------- models and batches
def _redraw(reference, embedding_std, embedding_names):
  """Redraws the weights (norms at 1): HF's initialisation makes tiny random models
  repeat one token forever, which would test little. Seeded by the caller."""
  with torch.no_grad():
    for name, weight in reference.named_parameters():
      if "ln_" in name or "layer_norm" in name:
        weight.fill_(1.0 if name.endswith("weight") else 0.0)
      elif any(part in name for part in embedding_names):
        weight.normal_(0.0, embedding_std)
      else:
        weight.normal_(0.0, 0.5)
  return reference


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
  """(HF GPT2LMHeadModel, our model, params): 2 layers, d 32, vocab 98, seeded."""
  torch.manual_seed(0)
  config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                   n_positions=32, bos_token_id=None, eos_token_id=None)
  reference = _redraw(transformers.GPT2LMHeadModel(config).eval(), 0.3, ("wte", "wpe"))
  path = str(tmp_path_factory.mktemp("gpt2"))
  reference.save_pretrained(path)
  return (reference, *hf.load(path))


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
  """(HF T5ForConditionalGeneration, its checkpoint directory): a small v1.1, seeded."""
  torch.manual_seed(1)
  config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                                 num_decoder_layers=2, num_heads=4,
                                 feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                 relative_attention_num_buckets=8,
                                 relative_attention_max_distance=16,
                                 decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
  reference = _redraw(transformers.T5ForConditionalGeneration(config).eval(), 0.3,
                      ("shared", "relative_attention_bias"))
  path = str(tmp_path_factory.mktemp("t5"))
  reference.save_pretrained(path)
  return reference, path


@pytest.fixture(scope="module")
def t5(t5_dir):
  """(HF T5ForConditionalGeneration, our model, params)."""
  reference, path = t5_dir
  return (reference, *hf.load(path))


def _gpt2_prompts(padded: bool):
  """Right-padded prompts [B, P] and their valid mask (our layout)."""
  tokens = np.random.default_rng(5).integers(1, VOCAB, (4, GPT2_PROMPT_LEN)).astype(np.int32)
  lengths = GPT2_LENGTHS if padded else (GPT2_PROMPT_LEN,) * 4
  valid = (np.arange(GPT2_PROMPT_LEN)[None] < np.array(lengths)[:, None]).astype(np.int32)
  return np.where(valid > 0, tokens, PAD), valid


def _left_pad(tokens, valid):
  """Right-padded rows -> left-padded rows (HF's layout for decoder-only generation)."""
  out, mask = np.full_like(tokens, PAD), np.zeros_like(valid)
  for row, (t, v) in enumerate(zip(tokens, valid)):
    n = int(v.sum())
    out[row, len(t) - n:], mask[row, len(t) - n:] = t[:n], 1
  return out, mask


def _t5_inputs(padded: bool):
  tokens = np.random.default_rng(6).integers(2, VOCAB, (4, 8)).astype(np.int32)
  if padded:
    tokens[1, 5:] = 0
    tokens[2, 3:] = 0
    tokens[3, 1:] = 0
  return tokens


def _gpt2_batch(padded):
  prompts, valid = _gpt2_prompts(padded)
  return {"decoder_input_tokens": prompts, "decoder_segment_ids": valid}


# --------------------------------------------------------- uncached reference decoders
def _uncached_gpt2(model, params, prompts, valid):
  """A Stepper that runs model.logits over the whole left-aligned buffer at each step.

  Column P - 1 + t holds the token fed at step t (the prompt's last token first)."""
  left, mask = _left_pad(prompts, valid)
  last_prompt_column = left.shape[1] - 1
  buffer = np.concatenate([left, np.full((len(left), N_NEW), PAD, np.int32)], 1)
  segments = np.concatenate([mask, np.ones((len(left), N_NEW), np.int32)], 1)
  positions = np.maximum(np.cumsum(segments, 1) - 1, 0).astype(np.int32)

  def step_fn(state, token_B):
    column = last_prompt_column + state["t"]
    tokens = jax.lax.dynamic_update_slice(state["tokens"], token_B[:, None], (0, column))
    logits = model.logits(params, {"decoder_input_tokens": tokens,
                                   "decoder_segment_ids": state["segments"],
                                   "decoder_positions": state["positions"]})
    state = dict(state, tokens=tokens, t=state["t"] + 1)
    return jax.lax.dynamic_index_in_dim(logits, column, 1, keepdims=False), state

  state = {"tokens": jnp.asarray(buffer), "segments": jnp.asarray(segments),
           "positions": jnp.asarray(positions), "t": jnp.zeros((), jnp.int32)}
  axes = {"tokens": 0, "segments": 0, "positions": 0, "t": None}
  return jnp.asarray(left[:, -1]), state, step_fn, axes


def _uncached_t5(model, params, encoder_tokens):
  """A Stepper that runs the whole encoder-decoder over the decoded prefix at each step.

  Column t of the decoder input holds the token fed at step t (the start token 0 first)."""
  def step_fn(state, token_B):
    column = state["t"]
    tokens = jax.lax.dynamic_update_slice(state["tokens"], token_B[:, None], (0, column))
    logits = model.logits(params, {"encoder_input_tokens": state["encoder"],
                                   "decoder_input_tokens": tokens})
    state = dict(state, tokens=tokens, t=state["t"] + 1)
    return jax.lax.dynamic_index_in_dim(logits, column, 1, keepdims=False), state

  state = {"encoder": jnp.asarray(encoder_tokens),
           "tokens": jnp.zeros((len(encoder_tokens), N_NEW), jnp.int32),
           "t": jnp.zeros((), jnp.int32)}
  start = jnp.zeros((len(encoder_tokens),), jnp.int32)
  return start, state, step_fn, {"encoder": 0, "tokens": 0, "t": None}


def _uncached_decoder(stepper, num_beams):
  """eos_id (-1: none) -> tokens, through the same search loops on full forwards."""
  first, state, step_fn, axes = stepper
  if num_beams == 1:
    run = lambda f, s, eos: infer.temperature_sample(f, s, step_fn, max_new_tokens=N_NEW,
                                                     eos_id=eos, pad_id=PAD)
  else:
    run = lambda f, s, eos: infer.beam_search(f, s, step_fn, axes, num_beams=num_beams,
                                              max_new_tokens=N_NEW, eos_id=eos, pad_id=PAD)
  run = jax.jit(run)
  return lambda eos: np.asarray(run(first, state, jnp.asarray(-1 if eos is None else eos))
                                .tokens)


def _pick_eos(free_tokens, generate_with_eos):
  """An eos id that stops some row after >= 1 token, and the generation with it.

  Candidates are the tokens at steps 1-3 of a run without eos; generate_with_eos(eos)
  -> [B, <= N] tokens. Beam search may not end on a given token, hence the search."""
  candidates = [t for t in dict.fromkeys(np.asarray(free_tokens)[:, 1:4].T.ravel().tolist())
                if t != PAD]
  for eos in candidates:
    tokens = np.asarray(generate_with_eos(eos))
    if (tokens[:, 1:] == eos).any():
      return eos, tokens
  raise AssertionError(f"no eos among {candidates} stops a row")


@pytest.mark.parametrize("num_beams", [1, 3])
def test_cached_decoding_equals_full_forward_decoding_gpt2(gpt2, num_beams):
  _, model, params = gpt2
  batch = _gpt2_batch(padded=True)
  predict = lambda eos: infer.predict(model, params, batch, max_new_tokens=N_NEW,
                                      num_beams=num_beams, eos_id=eos)
  free = predict(None)
  eos, cached = _pick_eos(free, predict)
  uncached = _uncached_decoder(_uncached_gpt2(model, params, batch["decoder_input_tokens"],
                                              batch["decoder_segment_ids"]), num_beams)
  np.testing.assert_array_equal(free, uncached(None))
  np.testing.assert_array_equal(cached, uncached(eos))


@pytest.mark.parametrize("num_beams", [1, 3])
def test_cached_decoding_equals_full_forward_decoding_t5(t5, num_beams):
  _, model, params = t5
  encoder_tokens = _t5_inputs(padded=True)
  batch = {"encoder_input_tokens": encoder_tokens}
  predict = lambda eos: infer.predict(model, params, batch, max_new_tokens=N_NEW,
                                      num_beams=num_beams, eos_id=eos)
  free = predict(None)
  eos, cached = _pick_eos(free, predict)
  uncached = _uncached_decoder(_uncached_t5(model, params, encoder_tokens), num_beams)
  np.testing.assert_array_equal(free, uncached(None))
  np.testing.assert_array_equal(cached, uncached(eos))


def test_beam_search_reorders_a_scanned_cache(t5, t5_dir):
  """With scan_layers the cache is [layers, B * K, ...]: beams live on axis 1 there."""
  _, model, params = t5
  scanned_model, scanned_params = hf.load(t5_dir[1], scan_layers=True)
  assert scanned_model.config.scan_layers
  batch = {"encoder_input_tokens": _t5_inputs(padded=True)}
  kw = dict(max_new_tokens=N_NEW, num_beams=3, eos_id=None)
  np.testing.assert_array_equal(infer.predict(scanned_model, scanned_params, batch, **kw),
                                infer.predict(model, params, batch, **kw))


# ---------------------------------------------------------------- Hugging Face generate
def _hf_generate(reference, input_ids, attention_mask, **settings):
  with torch.no_grad():
    return reference.generate(input_ids=torch.tensor(input_ids, dtype=torch.long),
                              attention_mask=torch.tensor(attention_mask, dtype=torch.long),
                              do_sample=False, max_new_tokens=N_NEW, pad_token_id=PAD,
                              **settings).numpy()


def _greedy_margin(reference, input_ids, attention_mask):
  """The smallest top-1 - top-2 logit gap of HF's greedy run (all rows, all steps)."""
  with torch.no_grad():
    out = reference.generate(input_ids=torch.tensor(input_ids, dtype=torch.long),
                             attention_mask=torch.tensor(attention_mask, dtype=torch.long),
                             do_sample=False, max_new_tokens=N_NEW, pad_token_id=PAD,
                             eos_token_id=NO_EOS, output_scores=True,
                             return_dict_in_generate=True)
  top2 = torch.stack([scores.topk(2).values for scores in out.scores])
  return float((top2[..., 0] - top2[..., 1]).min())


def _assert_same_generation(ours, reference_new, eos_id):
  """Equal up to and including each row's eos; ours is pad after it (HF may crop or
  fill beam outputs with eos instead)."""
  ours = np.asarray(ours)
  assert ours.shape == (len(reference_new), N_NEW)
  for row, (mine, theirs) in enumerate(zip(ours, reference_new)):
    theirs = list(theirs)
    end = theirs.index(eos_id) + 1 if eos_id in theirs else N_NEW
    assert len(theirs) >= end, (row, theirs)
    np.testing.assert_array_equal(mine[:end], theirs[:end], err_msg=f"row {row}")
    assert (mine[end:] == PAD).all(), (row, mine)


GENERATE_SETTINGS = [
    dict(num_beams=1),
    dict(num_beams=3, length_penalty=0.7),
    dict(num_beams=3, length_penalty=2.0, early_stopping=True),
    dict(num_beams=3, length_penalty=1.5, early_stopping="never"),
]
NO_EOS = 98_765  # an id outside the vocabulary: HF never stops on it


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("settings", GENERATE_SETTINGS)
def test_gpt2_generation_equals_transformers(gpt2, padded, settings):
  reference, model, params = gpt2
  batch = _gpt2_batch(padded)
  left, mask = _left_pad(batch["decoder_input_tokens"], batch["decoder_segment_ids"])

  hf = lambda eos: _hf_generate(reference, left, mask, eos_token_id=eos,
                                **settings)[:, left.shape[1]:]
  if settings["num_beams"] == 1:  # the seeds leave no near-ties for float error to flip
    assert _greedy_margin(reference, left, mask) > 1e-3
  _assert_equals_hf_with_and_without_eos(model, params, batch, hf, settings)


def _assert_equals_hf_with_and_without_eos(model, params, batch, hf, settings):
  """Ours == hf(eos) without an eos, then with an eos id that HF's free run produces."""
  hf_free = hf(NO_EOS)
  ours_free = infer.predict(model, params, batch, max_new_tokens=N_NEW, eos_id=None, **settings)
  _assert_same_generation(ours_free, hf_free, None)

  eos, hf_eos = _pick_eos(hf_free, hf)
  ours_eos = infer.predict(model, params, batch, max_new_tokens=N_NEW, eos_id=eos, **settings)
  _assert_same_generation(ours_eos, hf_eos, eos)


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("settings", GENERATE_SETTINGS)
def test_t5_generation_equals_transformers(t5, padded, settings):
  reference, model, params = t5
  encoder_tokens = _t5_inputs(padded)
  batch = {"encoder_input_tokens": encoder_tokens}
  mask = (encoder_tokens != 0).astype(np.int32)

  # HF's output starts with the decoder start token (0); ours holds generated tokens only.
  hf = lambda eos: _hf_generate(reference, encoder_tokens, mask, eos_token_id=eos,
                                **settings)[:, 1:]
  if settings["num_beams"] == 1:
    assert _greedy_margin(reference, encoder_tokens, mask) > 1e-3
  _assert_equals_hf_with_and_without_eos(model, params, batch, hf, settings)


# ------------------------------------------------------------------------- sampling
def test_sampling_is_a_function_of_the_key_and_filters_reduce_to_greedy(gpt2):
  _, model, params = gpt2
  batch = _gpt2_batch(padded=True)
  predict = lambda **kw: np.asarray(infer.predict(model, params, batch, max_new_tokens=N_NEW,
                                                  **kw))
  greedy = predict()
  first = predict(rng=_key(1))
  np.testing.assert_array_equal(first, predict(rng=_key(1)))
  assert (first != predict(rng=_key(2))).any()
  assert (first != greedy).any()  # it does sample
  np.testing.assert_array_equal(predict(rng=_key(3), top_k=1), greedy)
  np.testing.assert_array_equal(predict(rng=_key(3), top_p=1e-6), greedy)
  np.testing.assert_array_equal(predict(rng=_key(3), temperature=1e-5), greedy)


def test_top_k_samples_only_the_top_k_tokens_in_proportion(gpt2):
  _, model, params = gpt2
  k, samples = 3, 2000
  prompt = np.random.default_rng(7).integers(1, VOCAB, (1, 4)).astype(np.int32)
  logits = np.asarray(jax.jit(model.logits)(params, {"decoder_input_tokens": prompt}))[0, -1]
  top = np.argsort(logits)[::-1][:k]
  probs = np.exp(logits[top] - logits[top].max())
  probs /= probs.sum()
  batch = {"decoder_input_tokens": np.repeat(prompt, samples, 0)}
  drawn = np.asarray(infer.predict(model, params, batch, max_new_tokens=1, rng=_key(4),
                                   top_k=k))[:, 0]
  assert set(drawn.tolist()) == set(top.tolist())
  freq = np.array([(drawn == t).mean() for t in top])
  np.testing.assert_allclose(freq, probs, atol=0.04)  # ~4 standard deviations


# -------------------------------------------------------------------------- scoring
def _reference_log_likelihood(model, params, batch, weights):
  forward = {k: v for k, v in batch.items() if k not in ("decoder_target_tokens",
                                                          "decoder_loss_weights")}
  logits = np.asarray(jax.jit(model.logits)(params, forward), np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  per_token = np.take_along_axis(log_probs, batch["decoder_target_tokens"][..., None], -1)[..., 0]
  return (per_token * weights).sum(-1)


def test_scoring_gpt2_equals_full_forward_and_transformers_loss(gpt2):
  reference, model, params = gpt2
  ids = np.random.default_rng(8).integers(0, VOCAB, (3, 9)).astype(np.int32)
  valid = np.ones_like(ids)
  valid[1, 6:] = 0  # right padding
  batch = {"decoder_input_tokens": ids[:, :-1], "decoder_target_tokens": ids[:, 1:],
           "decoder_loss_weights": valid[:, 1:]}
  scores = infer.score(model, params, batch)
  assert scores["token_log_likelihood"].shape == (3, 8)
  np.testing.assert_allclose(scores["log_likelihood"],
                             _reference_log_likelihood(model, params, batch, valid[:, 1:]),
                             rtol=1e-5)
  for row in range(3):  # HF: mean NLL over the row's predicted tokens
    labels = torch.tensor(np.where(valid[row:row + 1] > 0, ids[row:row + 1], -100),
                          dtype=torch.long)
    with torch.no_grad():
      loss = reference(input_ids=torch.tensor(ids[row:row + 1], dtype=torch.long),
                       labels=labels,
                       attention_mask=torch.tensor(valid[row:row + 1])).loss.item()
    np.testing.assert_allclose(-scores["log_likelihood"][row], loss * (valid[row].sum() - 1),
                               rtol=1e-5)


def test_scoring_t5_equals_full_forward_and_transformers_loss(t5):
  reference, model, params = t5
  encoder_tokens = _t5_inputs(padded=True)
  targets = np.random.default_rng(9).integers(2, VOCAB, (4, 5)).astype(np.int32)
  targets[2, 3:] = 0
  weights = (targets > 0).astype(np.int32)
  inputs = np.concatenate([np.zeros((4, 1), np.int32), targets[:, :-1]], 1)
  batch = {"encoder_input_tokens": encoder_tokens, "decoder_input_tokens": inputs,
           "decoder_target_tokens": targets, "decoder_loss_weights": weights}
  scores = infer.score(model, params, batch)
  np.testing.assert_allclose(scores["log_likelihood"],
                             _reference_log_likelihood(model, params, batch, weights),
                             rtol=1e-5)
  with torch.no_grad():
    loss = reference(input_ids=torch.tensor(encoder_tokens, dtype=torch.long),
                     attention_mask=torch.tensor(encoder_tokens != 0, dtype=torch.long),
                     labels=torch.tensor(np.where(weights > 0, targets, -100),
                                         dtype=torch.long)).loss.item()
  np.testing.assert_allclose(-np.sum(scores["log_likelihood"]), loss * weights.sum(), rtol=1e-5)


# ------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("family,num_beams", [("gpt2", 3), ("t5", 1)])
def test_sharded_decoding_equals_unsharded(gpt2, t5, family, num_beams):
  """Params sharded over a ('data' 4, 'tensor' 2) mesh, activations by the logical rules."""
  _, model, params = gpt2 if family == "gpt2" else t5
  batch = _gpt2_batch(padded=True) if family == "gpt2" else {
      "encoder_input_tokens": _t5_inputs(padded=True)}
  mesh = parallel.make_mesh({"data": 4, "tensor": 2})
  sharded = jax.device_put(params, parallel.param_shardings(model, mesh))
  embedding = sharded["token_embed"]["embedding"]
  assert embedding.sharding.spec == jax.sharding.PartitionSpec("tensor", None)
  assert embedding.addressable_shards[0].data.shape[0] == VOCAB // 2

  kw = dict(max_new_tokens=N_NEW, num_beams=num_beams, eos_id=None)
  want = np.asarray(infer.predict(model, params, batch, **kw))
  got = infer.predict(model, sharded, batch, mesh=mesh, rules=parallel.DEFAULT_RULES, **kw)
  np.testing.assert_array_equal(np.asarray(got), want)
