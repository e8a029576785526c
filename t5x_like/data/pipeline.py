"""From a source spec and a vocabulary to an Objective: the one place that wires them.

  store, stats = build_store(source, vocab)
  objective = make_objective("span_corruption", store, vocab, seed=0, length=512)
  loader = make_loader(objective, global_batch_size=256, seed=0)
"""

from __future__ import annotations

from t5x_like.data.bert_pretraining import BertPretraining
from t5x_like.data.lm import CausalLM, PrefixLM
from t5x_like.data.objective import Objective
from t5x_like.data.span_corruption import SpanCorruption
from t5x_like.data.store import TokenStore
from t5x_like.data.vocab import Vocabulary

# objective -> the vocabulary family whose special tokens it needs
OBJECTIVE_FAMILIES = {
    "span_corruption": "t5",
    "bert_mlm": "bert",
    "causal_lm": "gpt",
    "prefix_lm": "gpt",
    "prefix_lm_encdec": "t5",
}


def _need(vocab: Vocabulary, objective: str, *names: str) -> None:
  missing = [n for n in names if getattr(vocab, n, None) is None]
  if missing:
    raise ValueError(f"objective {objective!r} needs a vocabulary with {', '.join(missing)};"
                     f" {vocab!r} (family {vocab.family!r}) has none. Use a"
                     f" {OBJECTIVE_FAMILIES[objective]!r} vocabulary.")


def make_objective(name: str, store: TokenStore, vocab: Vocabulary, *, seed: int,
                   length: int, targets_length: int | None = None, **options) -> Objective:
  """The objective `name` over `store`.

  length: the input length (span_corruption: encoder inputs; bert_mlm:
  max_seq_length; causal_lm / prefix_lm: decoder length; prefix_lm_encdec: encoder
  inputs, with targets_length). options go to the objective's constructor
  (e.g. noise_density, max_predictions_per_seq, nsp, whole_word_masking).
  """
  if name == "span_corruption":
    _need(vocab, name, "eos_id")
    return SpanCorruption(store, seed, inputs_length=length, vocab_size=vocab.vocab_size,
                          eos_id=vocab.eos_id, **options)
  if name == "bert_mlm":
    _need(vocab, name, "cls_id", "sep_id", "mask_id")
    word_start = vocab.word_start_mask() if options.get("whole_word_masking") else None
    return BertPretraining(store, seed, max_seq_length=length, cls_id=vocab.cls_id,
                           sep_id=vocab.sep_id, mask_id=vocab.mask_id, pad_id=vocab.pad_id,
                           vocab_size=vocab.vocab_size, word_start=word_start, **options)
  if name == "causal_lm":
    _need(vocab, name, "eos_id")
    return CausalLM(store, seed, length=length, eos_id=vocab.eos_id, **options)
  if name == "prefix_lm":
    _need(vocab, name, "eos_id")
    return PrefixLM(store, seed, eos_id=vocab.eos_id, length=length, **options)
  if name == "prefix_lm_encdec":
    _need(vocab, name, "eos_id")
    if targets_length is None:
      raise ValueError("objective 'prefix_lm_encdec' needs targets_length")
    return PrefixLM(store, seed, eos_id=vocab.eos_id, inputs_length=length,
                    targets_length=targets_length, **options)
  raise ValueError(f"unknown objective {name!r}; known: {sorted(OBJECTIVE_FAMILIES)}")
