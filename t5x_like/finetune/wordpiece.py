"""BERT's WordPiece tokenizer from a `vocab.txt`, with character offsets.

  tok = WordPieceTokenizer.from_file("vocab.txt", lowercase=True)
  tok.encode("Héllo, world!")              -> [ids]
  tok.encode_with_offsets(text)            -> ([ids], [(char_start, char_end)])
  tok.encode_words(["John", "lives"])      -> [[ids of John], [ids of lives]]

A thin wrapper over Hugging Face `tokenizers` (Rust): BertNormalizer (drop control
characters, whitespace to spaces, spaces around CJK ideographs, lower-case and strip
accents when uncased), BertPreTokenizer (split on whitespace and on every punctuation
character), WordPiece (greedy longest-match-first, "##" continuations, a word over 100
characters or with a part no piece matches becomes one [UNK]). The pipeline of BERT's
tokenization.py (github.com/google-research/bert), and transformers' `BertTokenizer`
itself. Rare inputs differ from the Python ports: a word-final capital sigma (Python
lower-cases whole words: ς; here σ), NFC in transformers' `BertTokenizerLegacy` (cased:
a decomposed accent), characters newer than Rust's Unicode tables. docs/models-and-
data.md ("WordPiece for BERT checkpoints") has the measurement on GLUE (no difference in
118,337 sentences), the speed, and the hand-written tokenizer this replaced.

No [CLS] / [SEP] are added here: finetune/encoding.py lays pairs out and truncates
them the same way for every tokenizer family.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

MAX_WORD_CHARS = 100  # BERT's max_input_chars_per_word in transformers and tokenizers

Offsets = list[tuple[int, int]]


class WordPieceTokenizer:
  """BERT basic tokenization + WordPiece over a vocab.txt, run by `tokenizers`.

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
    self.lowercase = lowercase
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
    # strip_accents=None: strip exactly when lower-casing, as BERT.
    self.rust = Tokenizer(models.WordPiece(self.vocab, unk_token=unk_token,
                                           max_input_chars_per_word=MAX_WORD_CHARS))
    self.rust.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=split_cjk, strip_accents=strip_accents,
        lowercase=lowercase)
    self.rust.pre_tokenizer = pre_tokenizers.BertPreTokenizer()

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
            f" lowercase={self.lowercase}, path={self.path!r})")

  def encode_with_offsets(self, text: str) -> tuple[list[int], Offsets]:
    """Ids of `text` and each piece's [start, end) character span in `text`."""
    encoding = self.rust.encode(text, add_special_tokens=False)
    return list(encoding.ids), [tuple(span) for span in encoding.offsets]

  def encode(self, text: str) -> list[int]:
    """Ids of `text`, no [CLS] / [SEP] added."""
    return list(self.rust.encode(text, add_special_tokens=False).ids)

  def encode_words(self, words: Sequence[str]) -> list[list[int]]:
    """Ids of each whitespace word (at least one each: [UNK] for a word with no pieces)."""
    per_word: list[list[int]] = [[] for _ in words]
    if words:  # one call: word_ids say which input word each piece came from
      encoding = self.rust.encode(list(words), is_pretokenized=True, add_special_tokens=False)
      for i, word in zip(encoding.ids, encoding.word_ids):
        per_word[word].append(i)
    return [ids or [self.unk_id] for ids in per_word]

  def pieces(self, ids: Iterable[int]) -> list[str]:
    return [self.tokens[int(i)] for i in ids]

  def decode_pieces(self, ids: Iterable[int]) -> str:
    """Pieces joined back into words ("##" continuations glued on), as BERT does."""
    return " ".join(self.pieces(ids)).replace(" ##", "").strip()
