"""The objective registry, and the one place that wires a store and a vocabulary to one.

  store, stats = build_store(source, vocab)
  objective = make_objective("span_corruption", store, vocab, seed=0, length=512)
  loader = make_loader(objective, global_batch_size=256, seed=0)

A new objective is a module with an Objective subclass and its ObjectiveSpec
(data/objective.py), plus one line in OBJECTIVES below; validation, training, plan
and bench read everything else (vocabulary, model family, options, default length)
from the spec.
"""

from __future__ import annotations

from t5x_like.data import bert_pretraining, iid_denoising, lm, span_corruption, ul2
from t5x_like.data.objective import Objective, ObjectiveSpec
from t5x_like.data.store import TokenStore
from t5x_like.data.vocab import Vocabulary

OBJECTIVES: dict[str, ObjectiveSpec] = {spec.name: spec for spec in (
    span_corruption.SPEC,
    bert_pretraining.SPEC,
    lm.CAUSAL_LM,
    lm.PREFIX_LM,
    lm.PREFIX_LM_ENCDEC,
    iid_denoising.SPEC,
    ul2.SPEC,
    ul2.DECODER_SPEC,
)}


def objective_spec(name: str) -> ObjectiveSpec:
  """The registered objective `name`; ValueError naming the known ones otherwise."""
  if name not in OBJECTIVES:
    raise ValueError(f"unknown objective {name!r}; known: {sorted(OBJECTIVES)}")
  return OBJECTIVES[name]


def make_objective(name: str, store: TokenStore, vocab: Vocabulary, *, seed: int,
                   length: int, targets_length: int | None = None, **options) -> Objective:
  """The objective `name` over `store`.

  length: the input length (span_corruption: encoder inputs; bert_mlm:
  max_seq_length; causal_lm / prefix_lm: decoder length; prefix_lm_encdec: encoder
  inputs, with targets_length). options go to the objective's constructor
  (e.g. noise_density, max_predictions_per_seq, nsp, whole_word_masking).
  """
  return objective_spec(name).build(store, vocab, seed=seed, length=length,
                                    targets_length=targets_length, **options)
