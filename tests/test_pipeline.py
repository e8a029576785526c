"""Source -> vocabulary -> objective -> loader -> model loss, on the embedded corpus."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.data.loader import make_loader
from t5x_like.data.pipeline import make_objective
from t5x_like.data.sources import source_from_spec
from t5x_like.data.tokenize import build_store
from t5x_like.data.vocab import default_vocab
from t5x_like.models import bert, build_model, gpt2, t5

CASES = {
    "bert_mlm": ("bert", dict(length=64, max_predictions_per_seq=10),
                 lambda v: bert(1, 64, vocab_size=v)),
    "span_corruption": ("t5", dict(length=64),
                        lambda v: t5("1.1", 64, 96, 1, 2, vocab_size=v, head_dim=32)),
    "causal_lm": ("gpt", dict(length=64), lambda v: gpt2(1, 64, vocab_size=v)),
    "prefix_lm": ("gpt", dict(length=64), lambda v: gpt2(1, 64, vocab_size=v)),
    "prefix_lm_encdec": ("t5", dict(length=48, targets_length=48),
                         lambda v: t5("1.1", 64, 96, 1, 2, vocab_size=v, head_dim=32)),
}


@pytest.fixture(scope="module")
def stores():
  source = source_from_spec("embedded:wells_the_time_machine")
  return {family: build_store(source, default_vocab(family))[0]
          for family in ("bert", "t5", "gpt")}


# The encoder-decoder and MLM cases compile the largest programs: the long tier.
@pytest.mark.parametrize("objective", [
    pytest.param(name, marks=pytest.mark.long)
    if name in ("bert_mlm", "span_corruption", "prefix_lm_encdec") else name
    for name in sorted(CASES)])
def test_objective_batches_feed_the_model(objective, stores):
  family, kwargs, make_config = CASES[objective]
  vocab = default_vocab(family)
  obj = make_objective(objective, stores[family], vocab, seed=0, **kwargs)
  batch = next(iter(make_loader(obj, 4, seed=0, process_index=0, process_count=1)))
  assert all(v.shape[0] == 4 for v in batch.values())
  model = build_model(make_config(vocab.vocab_size))
  params = model.init(jax.random.key(0), {k: v.shape for k, v in batch.items()
                                          if k.endswith("_tokens") and "target" not in k})
  loss, metrics = model.loss_fn(params, jax.tree.map(jnp.asarray, batch), jax.random.key(1))
  # An untrained model is near-uniform over the vocabulary: loss close to log(V).
  main = metrics.get("mlm_loss", metrics.get("token_loss"))
  assert abs(float(main) - np.log(vocab.vocab_size)) < 1.5
  assert np.isfinite(float(loss))


def test_objective_refuses_a_vocabulary_without_its_special_tokens(stores):
  with pytest.raises(ValueError, match="bert_mlm.*cls_id.*'bert' vocabulary"):
    make_objective("bert_mlm", stores["t5"], default_vocab("t5"), seed=0, length=64)
  with pytest.raises(ValueError, match="unknown objective 'mlm'"):
    make_objective("mlm", stores["t5"], default_vocab("t5"), seed=0, length=64)


def test_bad_input_is_counted_and_training_data_still_flows(tmp_path):
  """Empty documents, invalid UTF-8, malformed JSON and a document far longer than the
  sequence length: counted, never a crash; the long document fills many rows."""
  long_doc = " ".join(f"Sentence number {i} is here." for i in range(3000))  # ~40k tokens
  path = tmp_path / "docs.jsonl"
  with open(path, "wb") as f:
    f.write(b'{"text": "A short document. It has two sentences."}\n')
    f.write(b'{"text": ""}\n')
    f.write(b'{"text": "bad \xff\xfe bytes here. Still a document."}\n')
    f.write(b'{"text": unquoted}\n')
    f.write(('{"text": "%s"}\n' % long_doc).encode())
  source = source_from_spec(f"jsonl:{path}")
  vocab = default_vocab("bert")
  store, stats = build_store(source, vocab)
  counts = stats["source"]
  assert counts["empty_documents"] == 1 and counts["invalid_utf8"] == 1
  assert counts["malformed_json"] == 1
  assert store.num_docs == 3
  obj = make_objective("bert_mlm", store, vocab, seed=0, length=32, max_predictions_per_seq=5)
  assert obj.num_examples(0) > 100  # the long document is cut into many instances
  batch = next(iter(make_loader(obj, 8, seed=0, process_index=0, process_count=1)))
  assert batch["encoder_input_tokens"].shape == (8, 32)


def test_real_objective_hosts_and_resume(stores):
  """Two hosts split the global batch; a restored loader continues exactly."""
  obj = make_objective("bert_mlm", stores["bert"], default_vocab("bert"), seed=3, length=32,
                       max_predictions_per_seq=5)

  def batches(process_index, process_count, n, state=None):
    it = iter(make_loader(obj, 8, seed=3, process_index=process_index,
                          process_count=process_count))
    if state is not None:
      it.set_state(state)
    return [next(it) for _ in range(n)], it.get_state()

  whole, _ = batches(0, 1, 4)
  halves = [batches(h, 2, 4)[0] for h in range(2)]
  for step in range(4):
    for key in whole[step]:
      np.testing.assert_array_equal(
          np.concatenate([halves[0][step][key], halves[1][step][key]]), whole[step][key])
  _, state = batches(0, 1, 2)
  resumed, _ = batches(0, 1, 2, state)
  for key in whole[2]:
    np.testing.assert_array_equal(resumed[0][key], whole[2][key])
    np.testing.assert_array_equal(resumed[1][key], whole[3][key])


def test_held_out_split_is_disjoint_and_covers_everything(stores):
  from t5x_like.data.store import split_held_out
  store = stores["bert"]
  train, held = split_held_out(store, 0.05)
  assert train.num_tokens + held.num_tokens == store.num_tokens
  assert held.num_docs == store.num_docs  # few documents: each contributes its tail
  tail = store.doc_tokens(0)[-len(held.doc_tokens(0)):]
  np.testing.assert_array_equal(held.doc_tokens(0), tail)
  np.testing.assert_array_equal(np.concatenate([train.doc_tokens(0), held.doc_tokens(0)]),
                                store.doc_tokens(0))
