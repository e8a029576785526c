"""Reference behaviour written out from its definition, for several test modules:
independent of the code under test.

stream_order: the epoch streams' document order (data/streams.py's spec).
spec_truncate: BERT's truncate_seq_pair (create_pretraining_data.py), token by token.
"""

import numpy as np

import t5x_like.data.store as store_module

STREAM_KEY = 0x57E4  # spawn key of the streams' order generators


def stream_order(store, seed, epoch):
  """Store documents in the epoch's two-level order: chunks of K documents (K =
  store.STREAM_CHUNK_DOCS) in generator (seed, epoch)'s order, the documents of chunk c
  in generator (seed, epoch, c)'s order."""
  def rng(*key):
    return np.random.default_rng(np.random.SeedSequence([seed, epoch],
                                                        spawn_key=(STREAM_KEY, *key)))
  k = store_module.STREAM_CHUNK_DOCS
  order = []
  for c in rng().permutation(-(-store.num_docs // k)):
    order += (c * k + rng(int(c)).permutation(min(k, store.num_docs - c * k))).tolist()
  return order


def spec_truncate(la, lb, max_tokens):
  """truncate_seq_pair: while too long drop one token from the longer side (B on ties)."""
  da = db = 0
  while la + lb > max_tokens:
    if la > lb:
      la, da = la - 1, da + 1
    else:
      lb, db = lb - 1, db + 1
  return da, db
