"""The small tokenizer interface fine-tuning needs, for sentencepiece and WordPiece.

  tok = as_tokenizer(vocab)   # a data.vocab.Vocabulary, a WordPieceTokenizer, or a path
  tok.encode(text) -> [ids]
  tok.encode_with_offsets(text) -> ([ids], [(char_start, char_end)])   span extraction
  tok.encode_words(words) -> [[ids] per word]                          token tagging
  tok.vocab_size, pad_id, unk_id, cls_id, sep_id, eos_id (None where the family has none)

Offsets are character spans in the original text with leading whitespace trimmed: a
sentencepiece piece "▁word" spans "word", a piece of only whitespace spans nothing
(start == end), and the bytes of one byte-fallback character all span that character.
"""

from __future__ import annotations

import os
from typing import Optional, Protocol, Sequence, Union

import numpy as np

from t5x_like.data.vocab import Vocabulary, load_vocab
from t5x_like.finetune.wordpiece import WordPieceTokenizer

Offsets = list[tuple[int, int]]


class Tokenizer(Protocol):
  vocab_size: int
  pad_id: int
  unk_id: int
  cls_id: Optional[int]
  sep_id: Optional[int]
  eos_id: Optional[int]

  def encode(self, text: str) -> list[int]: ...

  def encode_with_offsets(self, text: str) -> tuple[list[int], Offsets]: ...

  def encode_words(self, words: Sequence[str]) -> list[list[int]]: ...


class SentencePieceTokenizer:
  """Our sentencepiece Vocabulary (any family) behind the fine-tuning interface."""

  def __init__(self, vocab: Vocabulary):
    self.vocab = vocab
    self.family = vocab.family
    self.vocab_size = vocab.vocab_size
    self.pad_id, self.unk_id, self.eos_id = vocab.pad_id, vocab.unk_id, vocab.eos_id
    self.cls_id, self.sep_id, self.mask_id = vocab.cls_id, vocab.sep_id, vocab.mask_id

  def __repr__(self):
    return f"SentencePieceTokenizer({self.vocab!r})"

  def encode(self, text: str) -> list[int]:
    return [int(i) for i in self.vocab.encode(text)]

  def encode_words(self, words: Sequence[str]) -> list[list[int]]:
    """Each word as it encodes inside " ".join(words) (the vocabularies split on
    whitespace, so the pieces of the joined text are these lists concatenated)."""
    texts = [w if k == 0 else " " + w for k, w in enumerate(words)]
    return [list(ids) or [self.unk_id] for ids in self.vocab.encode_lists(texts, 1)]

  def encode_with_offsets(self, text: str) -> tuple[list[int], Offsets]:
    proto = self.vocab.sp.encode(text, return_type="proto")
    # sentencepiece reports byte offsets into the UTF-8 text: map them to characters.
    byte_to_char = np.zeros(len(text.encode("utf-8")) + 1, np.int64)
    position = 0
    for k, char in enumerate(text):
      width = len(char.encode("utf-8"))
      byte_to_char[position:position + width] = k
      position += width
    byte_to_char[position] = len(text)
    pieces = list(proto.pieces)
    ids = [int(p.id) for p in pieces]
    spans = [[int(byte_to_char[p.begin]), int(byte_to_char[p.end])] for p in pieces]
    # Leading bytes of a byte-fallback character have empty spans: give them the
    # character's span (the span of the next byte piece that is not empty).
    for k in range(len(pieces) - 2, -1, -1):
      if self.vocab.sp.is_byte(ids[k]) and spans[k][0] == spans[k][1]:
        spans[k] = list(spans[k + 1])
    return ids, [_trim_leading_space(text, *span) for span in spans]


def _trim_leading_space(text: str, start: int, end: int) -> tuple[int, int]:
  while start < end and text[start].isspace():
    start += 1
  return start, end


def as_tokenizer(vocab: Union[Vocabulary, WordPieceTokenizer, SentencePieceTokenizer, str],
                 **wordpiece_kw) -> Tokenizer:
  """A Tokenizer from a Vocabulary, a tokenizer, a vocab.txt path (WordPiece; kw:
  lowercase, strip_accents) or a sentencepiece model path / directory."""
  if isinstance(vocab, (WordPieceTokenizer, SentencePieceTokenizer)):
    return vocab
  if isinstance(vocab, Vocabulary):
    return SentencePieceTokenizer(vocab)
  path = os.fspath(vocab)
  if path.endswith(".txt"):
    return WordPieceTokenizer.from_file(path, **wordpiece_kw)
  return SentencePieceTokenizer(load_vocab(path))
