"""Default vocabularies shipped as package data: {bert,t5,gpt}.model, 8192 ids each.

Trained on the embedded corpus. To regenerate one (byte for byte on the same
sentencepiece version):
  t5x-like vocab train --source embedded --vocab-size 8192 --family bert --out DIR
  cp DIR/spm.model t5x_like/data/vocabs/bert.model
Load them with t5x_like.data.vocab.default_vocab(family).
"""
