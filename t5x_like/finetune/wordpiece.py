"""BERT's WordPiece tokenizer from a `vocab.txt`, with character offsets.

  tok = WordPieceTokenizer.from_file("vocab.txt", lowercase=True)
  tok.encode("Héllo, world!")              -> [ids]
  tok.encode_with_offsets(text)            -> ([ids], [(char_start, char_end)])
  tok.encode_words(["John", "lives"])      -> [[ids of John], [ids of lives]]

Two stages, as BERT's tokenization.py (and transformers' BertTokenizer):
1. basic tokenization: drop NUL / U+FFFD / control characters, map whitespace to
   spaces, put spaces around CJK ideographs, NFC-normalise (as transformers), split on
   whitespace; then per word lower-case and strip accents (NFD, drop Mn marks) when
   uncased, and split off every punctuation character (Unicode P* and all non-alphanumeric
   ASCII) as a word of its own;
2. WordPiece: greedy longest-match-first over each word, continuation pieces prefixed
   "##"; a word longer than 100 characters, or one with a part no piece matches,
   becomes a single [UNK].

Offsets are into the original text. They are exact whenever per-character lower-casing
and accent stripping give the same string as the whole word's (all but exotic cases such
as a Greek final sigma); otherwise every piece of that word spans the whole word.
"""

from __future__ import annotations

import unicodedata
from typing import Iterable, Optional, Sequence

MAX_WORD_CHARS = 100

Offsets = list[tuple[int, int]]


# ------------------------------------------------------------ character classes
def is_whitespace(char: str) -> bool:
  """Space, tab, newline, carriage return, or Unicode Zs."""
  if char in (" ", "\t", "\n", "\r"):
    return True
  return unicodedata.category(char) == "Zs"


def is_control(char: str) -> bool:
  """Unicode C* except tab / newline / carriage return (those count as whitespace)."""
  if char in ("\t", "\n", "\r"):
    return False
  return unicodedata.category(char).startswith("C")


def is_punctuation(char: str) -> bool:
  """Unicode P*, and every ASCII character that is not a letter, digit or space."""
  cp = ord(char)
  if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
    return True
  return unicodedata.category(char).startswith("P")


def is_cjk(char: str) -> bool:
  """CJK Unified Ideographs (and extensions, compatibility ideographs): one word each."""
  cp = ord(char)
  return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
          or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
          or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def _dropped(char: str) -> bool:
  return char in ("\x00", "\ufffd") or is_control(char)


def _strip_accents(text: str) -> str:
  return "".join(c for c in unicodedata.normalize("NFD", text)
                 if unicodedata.category(c) != "Mn")


# ------------------------------------------------------------ basic tokenizer
class BasicTokenizer:
  """BERT's BasicTokenizer; also tracks where each character of each word came from."""

  def __init__(self, lowercase: bool = True, strip_accents: Optional[bool] = None,
               split_cjk: bool = True):
    self.lowercase = lowercase
    # BERT strips accents exactly when it lower-cases, unless told otherwise.
    self.strip_accents = lowercase if strip_accents is None else strip_accents
    self.split_cjk = split_cjk

  def _normalize(self, text: str) -> str:
    text = unicodedata.normalize("NFC", text)
    if self.lowercase:
      text = text.lower()
    if self.strip_accents:
      text = _strip_accents(text)
    return text

  def _raw_words(self, text: str) -> Iterable[tuple[list[int], str]]:
    """Whitespace / CJK delimited words: (original char indices kept, their text)."""
    indices: list[int] = []
    for i, char in enumerate(text):
      if _dropped(char):
        continue
      if is_whitespace(char) or char.isspace():
        if indices:
          yield indices, "".join(text[j] for j in indices)
        indices = []
      elif self.split_cjk and is_cjk(char):
        if indices:
          yield indices, "".join(text[j] for j in indices)
        yield [i], char
        indices = []
      else:
        indices.append(i)
    if indices:
      yield indices, "".join(text[j] for j in indices)

  def tokenize_with_offsets(self, text: str) -> list[tuple[str, list[int], list[int]]]:
    """[(word, starts, ends)]: normalised words, and for each of their characters the
    [start, end) span in `text` it comes from."""
    out = []
    for indices, raw in self._raw_words(text):
      word = self._normalize(raw)
      # Map each normalised character back to an original one where that is exact.
      pieces = [self._normalize(text[j]) for j in indices]
      if "".join(pieces) == word:
        starts = [j for j, p in zip(indices, pieces) for _ in p]
        ends = [j + 1 for j in starts]
      else:  # not alignable: every character spans the whole word
        starts, ends = [indices[0]] * len(word), [indices[-1] + 1] * len(word)
      begin = 0
      for k, char in enumerate(word + " "):
        if k == len(word) or is_punctuation(char):
          if k > begin:
            out.append((word[begin:k], starts[begin:k], ends[begin:k]))
          if k < len(word):
            out.append((char, starts[k:k + 1], ends[k:k + 1]))
          begin = k + 1
    return out

  def tokenize(self, text: str) -> list[str]:
    return [w for w, _, _ in self.tokenize_with_offsets(text)]


# ------------------------------------------------------------ wordpiece
class WordPieceTokenizer:
  """Basic tokenization + greedy longest-match-first WordPiece over a BERT vocab.txt.

  The small interface fine-tuning needs (as t5x_like.finetune.tokenizer.Tokenizer):
  vocab_size, pad_id, unk_id, cls_id, sep_id, mask_id, eos_id (None), encode,
  encode_with_offsets, encode_words, decode_pieces.
  """

  def __init__(self, tokens: Sequence[str], *, lowercase: bool = True,
               strip_accents: Optional[bool] = None, split_cjk: bool = True,
               unk_token: str = "[UNK]", cls_token: str = "[CLS]", sep_token: str = "[SEP]",
               pad_token: str = "[PAD]", mask_token: str = "[MASK]", path: str | None = None):
    self.tokens = list(tokens)
    self.vocab = {}
    for i, token in enumerate(self.tokens):  # a repeated token keeps its last id, as BERT
      self.vocab[token] = i
    self.path = path
    self.basic = BasicTokenizer(lowercase, strip_accents, split_cjk)
    missing = [t for t in (unk_token, cls_token, sep_token, pad_token) if t not in self.vocab]
    if missing:
      raise ValueError(f"WordPiece vocabulary {path or '(in memory)'} lacks {missing}")
    self.vocab_size = len(self.tokens)
    self.unk_id = self.vocab[unk_token]
    self.cls_id = self.vocab[cls_token]
    self.sep_id = self.vocab[sep_token]
    self.pad_id = self.vocab[pad_token]
    self.mask_id = self.vocab.get(mask_token)
    self.eos_id = None
    self.family = "bert"

  @classmethod
  def from_file(cls, path: str, **kw) -> "WordPieceTokenizer":
    """Reads a vocab.txt: one token per line, the line number (from 0) is its id."""
    with open(path, encoding="utf-8") as f:
      tokens = [line.rstrip("\n") for line in f]
    if tokens and tokens[-1] == "":  # a trailing empty line is not a token
      tokens.pop()
    return cls(tokens, path=path, **kw)

  def __repr__(self):
    return (f"WordPieceTokenizer(vocab_size={self.vocab_size},"
            f" lowercase={self.basic.lowercase}, path={self.path!r})")

  # ---------------------------------------------------------------- pieces
  def _word_pieces(self, word: str) -> list[tuple[int, int, int]]:
    """[(id, start, end)] of one basic word; [UNK] for the whole word when it fails."""
    if len(word) > MAX_WORD_CHARS:
      return [(self.unk_id, 0, len(word))]
    out, start = [], 0
    while start < len(word):
      end = len(word)
      found = None
      while start < end:
        piece = word[start:end] if start == 0 else "##" + word[start:end]
        if piece in self.vocab:
          found = self.vocab[piece]
          break
        end -= 1
      if found is None:
        return [(self.unk_id, 0, len(word))]
      out.append((found, start, end))
      start = end
    return out

  def encode_with_offsets(self, text: str) -> tuple[list[int], Offsets]:
    """Ids of `text` and each piece's [start, end) character span in `text`."""
    ids, offsets = [], []
    for word, starts, ends in self.basic.tokenize_with_offsets(text):
      for i, lo, hi in self._word_pieces(word):
        ids.append(i)
        offsets.append((starts[lo], ends[hi - 1]))
    return ids, offsets

  def encode(self, text: str) -> list[int]:
    """Ids of `text`, no [CLS] / [SEP] added."""
    ids = []
    for word in self.basic.tokenize(text):
      ids.extend(i for i, _, _ in self._word_pieces(word))
    return ids

  def encode_words(self, words: Sequence[str]) -> list[list[int]]:
    """Ids of each whitespace word (at least one each: [UNK] for a word with no pieces)."""
    return [self.encode(word) or [self.unk_id] for word in words]

  def pieces(self, ids: Iterable[int]) -> list[str]:
    return [self.tokens[int(i)] for i in ids]

  def decode_pieces(self, ids: Iterable[int]) -> str:
    """Pieces joined back into words ("##" continuations glued on), as BERT does."""
    return " ".join(self.pieces(ids)).replace(" ##", "").strip()
