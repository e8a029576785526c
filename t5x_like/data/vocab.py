"""Sentencepiece vocabularies for the three families, with an exact round trip.

Special ids per family (the first pieces of the sentencepiece model):
  bert: [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4
  t5:   <pad>=0 </s>=1 (eos) <unk>=2, plus 100 sentinels on top of the model, as seqio:
        <extra_id_0> = vocab_size-1, <extra_id_1> = vocab_size-2, ...
  gpt:  <pad>=0 <unk>=1 <|endoftext|>=2 (eos)
Specials are control symbols: text never encodes to them, decoding drops them
(sentinels decode to "<extra_id_k>").

Exact round trip (decode(encode(text)) == text for any text without U+2581 "▁"):
no dummy prefix, no whitespace folding, byte fallback for characters outside the
vocabulary, and one normalization rule "\\n" -> "\\n " undone by a denormalization
rule at decode time. The rule makes the word after a line break start with "▁" like
any other word, so `word_start_mask` is right for whole-word masking and the hard
wrapped lines of the corpus do not need a second, prefix-less copy of every word.
Both rules live inside the .model file: a plain SentencePieceProcessor round-trips too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import json
import os
import tempfile
from importlib import resources
from typing import Iterable, Sequence

import numpy as np
import sentencepiece as spm

from t5x_like.data.protobuf_wire import drop_subfields
from t5x_like.errors import UserError
from t5x_like.fs import PathLike, is_url, resolve_path

NUM_SENTINELS = 100  # T5 only
WORD_MARK = "\u2581"  # sentencepiece's "▁": a space before the piece

# Reserved pieces, in id order, for each family.
SPECIAL_PIECES = {
    "bert": ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"),
    "t5": ("<pad>", "</s>", "<unk>"),
    "gpt": ("<pad>", "<unk>", "<|endoftext|>"),
}
# Vocabulary families (layouts of special ids), not model families (models.config.FAMILIES).
VOCAB_FAMILIES = tuple(SPECIAL_PIECES)


@dataclasses.dataclass(frozen=True)
class _Specials:
  pad_id: int
  unk_id: int
  eos_id: int | None = None
  cls_id: int | None = None
  sep_id: int | None = None
  mask_id: int | None = None


_SPECIAL_IDS = {
    "bert": _Specials(pad_id=0, unk_id=1, cls_id=2, sep_id=3, mask_id=4),
    "t5": _Specials(pad_id=0, eos_id=1, unk_id=2),
    "gpt": _Specials(pad_id=0, unk_id=1, eos_id=2),
}


class Vocabulary:
  """A sentencepiece model plus the special-token conventions of one family.

  Keeps the serialized model bytes (not the processor), so it pickles cheaply into
  loader worker processes; the processor is rebuilt from them when unpickled.
  """

  def __init__(self, model_bytes: bytes, family: str, *, path: str | None = None):
    if family not in VOCAB_FAMILIES:
      raise ValueError(f"family must be one of {VOCAB_FAMILIES}, got {family!r}")
    self.model_bytes = bytes(model_bytes)
    self.family = family
    self.path = path
    self._sp = None
    self._word_starts = None
    sp = self.sp
    _check_specials(sp, family, path)
    self.base_vocab_size = sp.get_piece_size()
    self.num_sentinels = NUM_SENTINELS if family == "t5" else 0
    self.vocab_size = self.base_vocab_size + self.num_sentinels
    specials = _SPECIAL_IDS[family]
    self.pad_id = specials.pad_id
    self.unk_id = specials.unk_id
    self.eos_id = specials.eos_id
    self.cls_id = specials.cls_id
    self.sep_id = specials.sep_id
    self.mask_id = specials.mask_id

  # -------------------------------------------------------------- plumbing
  @property
  def sp(self) -> spm.SentencePieceProcessor:
    if self._sp is None:
      self._sp = spm.SentencePieceProcessor(model_proto=self.model_bytes)
    return self._sp

  def __getstate__(self):
    return dict(model_bytes=self.model_bytes, family=self.family, path=self.path)

  def __setstate__(self, state):
    self.__init__(state["model_bytes"], state["family"], path=state["path"])

  def __repr__(self):
    return (f"Vocabulary(family={self.family!r}, vocab_size={self.vocab_size},"
            f" path={self.path!r})")

  @property
  def fingerprint(self) -> str:
    """sha256 of (family, model bytes): a cache key for anything tokenized with it."""
    h = hashlib.sha256(self.family.encode())
    h.update(self.model_bytes)
    return h.hexdigest()

  # -------------------------------------------------------------- ids
  def sentinel_id(self, k: int) -> int:
    """Id of <extra_id_k> (T5): vocab_size - 1 - k."""
    if not self.num_sentinels:
      raise ValueError(f"the {self.family} vocabulary has no sentinels")
    if not 0 <= k < self.num_sentinels:
      raise ValueError(f"sentinel index must be in [0, {self.num_sentinels}), got {k}")
    return self.vocab_size - 1 - k

  def piece(self, i: int) -> str:
    """The piece string of id i (sentinels as "<extra_id_k>")."""
    if self.base_vocab_size <= i < self.vocab_size:
      return f"<extra_id_{self.vocab_size - 1 - i}>"
    return self.sp.id_to_piece(int(i))

  def word_start_mask(self) -> np.ndarray:
    """[vocab_size] bool: True for pieces that begin a word.

    Those are pieces starting with "▁" (a space before them) or a newline, and every
    special id (control symbols, unknown, sentinels). Byte-fallback pieces and other
    pieces continue the word before them. Whole-word masking groups a word start with
    the continuation pieces that follow it.
    """
    if self._word_starts is None:
      sp = self.sp
      mask = np.ones(self.vocab_size, bool)
      for i in range(self.base_vocab_size):
        if sp.is_control(i) or sp.is_unknown(i):
          continue
        p = sp.id_to_piece(i)
        mask[i] = not sp.is_byte(i) and p[:1] in (WORD_MARK, "\n")
      mask.setflags(write=False)
      self._word_starts = mask
    return self._word_starts

  # -------------------------------------------------------------- text
  def encode(self, text: str) -> np.ndarray:
    """[n] int32 ids of `text`, no EOS / CLS added."""
    return np.asarray(self.sp.encode(text), np.int32)

  def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[np.ndarray]:
    """Ids of each text ([n_i] int32 arrays), encoded on `num_threads` threads."""
    return [np.asarray(ids, np.int32) for ids in self.encode_lists(texts, num_threads)]

  def encode_lists(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
    """Like encode_batch but plain lists (skips the per-text array conversion)."""
    if not texts:
      return []
    threads = num_threads or os.cpu_count() or 1
    return self.sp.encode(list(texts), num_threads=threads)

  def decode(self, ids) -> str:
    """Text of `ids` ([n] ints); specials are dropped, sentinels become "<extra_id_k>"."""
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"ids out of range [0, {self.vocab_size}): {bad[:5]}")
    if not self.num_sentinels:
      return self.sp.decode(ids)
    parts, run = [], []
    for i in ids:
      if i >= self.base_vocab_size:
        parts.append(self.sp.decode(run))
        parts.append(self.piece(i))
        run = []
      else:
        run.append(i)
    parts.append(self.sp.decode(run))
    return "".join(parts)

  # -------------------------------------------------------------- files
  def save(self, out_dir: str) -> str:
    """Writes out_dir/spm.model and out_dir/vocab.json; returns the model path."""
    os.makedirs(out_dir, exist_ok=True)
    model_path = os.path.join(out_dir, "spm.model")
    with open(model_path, "wb") as f:
      f.write(self.model_bytes)
    meta = dict(family=self.family, vocab_size=self.vocab_size,
                base_vocab_size=self.base_vocab_size, num_sentinels=self.num_sentinels)
    with open(os.path.join(out_dir, "vocab.json"), "w") as f:
      json.dump(meta, f, indent=2)
    self.path = model_path
    return model_path


def _check_specials(sp: spm.SentencePieceProcessor, family: str, path) -> None:
  """Fails loudly when a model's first pieces do not follow the family's layout."""
  want = SPECIAL_PIECES[family]
  got = tuple(sp.id_to_piece(i) for i in range(min(len(want), sp.get_piece_size())))
  ids = _SPECIAL_IDS[family]
  if (sp.pad_id() != ids.pad_id or sp.unk_id() != ids.unk_id
      or (ids.eos_id is not None and sp.eos_id() != ids.eos_id)
      or (family == "bert" and got != want)):
    raise ValueError(f"sentencepiece model {path or '(in memory)'} does not have the {family}"
                     f" special ids {want}; its first pieces are {got}")


def infer_family(sp: spm.SentencePieceProcessor) -> str:
  """The family whose special-id layout a model follows."""
  first = tuple(sp.id_to_piece(i) for i in range(min(5, sp.get_piece_size())))
  if first[:5] == SPECIAL_PIECES["bert"]:
    return "bert"
  if sp.pad_id() == 0 and sp.eos_id() == 1 and sp.unk_id() == 2:
    return "t5"
  if sp.pad_id() == 0 and sp.unk_id() == 1 and sp.eos_id() == 2:
    return "gpt"
  raise ValueError(f"cannot tell the family of a model whose first pieces are {first};"
                   " pass family=")


class VocabularyFileError(UserError, ValueError):
  """A vocabulary path without a usable sentencepiece model; the message names the path."""


class VocabularyNotFoundError(VocabularyFileError, FileNotFoundError):
  """No sentencepiece model at a vocabulary path."""


def load_vocab(path: PathLike, family: str | None = None) -> Vocabulary:
  """Loads a vocabulary from a .model file or a directory holding spm.model.

  `path` is local (relative or absolute) or a URL (gs://...). The family comes from
  `family`, else vocab.json next to the model, else the special-id layout of the model
  itself. VocabularyNotFoundError / VocabularyFileError name `path` as given.
  """
  shown = os.fspath(path)
  root = resolve_path(shown, "vocabulary")
  model_path = root / "spm.model" if root.is_dir() else root
  if not model_path.is_file():
    absolute = is_url(shown) or os.path.isabs(os.path.expanduser(shown))
    where = "" if absolute else f" (relative to {os.getcwd()!r})"
    why = "a directory without spm.model" if root.is_dir() else "no such file"
    raise VocabularyNotFoundError(f"no sentencepiece model at {shown!r}{where}: {why}")
  model_bytes = model_path.read_bytes()
  try:
    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
  except RuntimeError:  # sentencepiece: "INTERNAL: ... ParseFromArray ..."
    what = repr(shown) if model_path == root else f"spm.model in {shown!r}"
    raise VocabularyFileError(f"{what} is not a sentencepiece model") from None
  meta_path = model_path.parent / "vocab.json"
  if family is None and meta_path.is_file():
    family = json.loads(meta_path.read_text()).get("family")
  if family is None:
    family = infer_family(sp)
  return Vocabulary(model_bytes, family, path=os.fspath(model_path))


def default_vocab(family: str) -> Vocabulary:
  """The shipped vocabulary of `family` (8192 ids, trained on the embedded corpus)."""
  if family not in VOCAB_FAMILIES:
    raise ValueError(f"family must be one of {VOCAB_FAMILIES}, got {family!r}")
  res = resources.files("t5x_like.data.vocabs") / f"{family}.model"
  return Vocabulary(res.read_bytes(), family, path=str(res))


# ------------------------------------------------------------------ training
_RULE_TSV = 6  # normalization_rule_tsv, inside NormalizerSpec


def _without_tmp_paths(model_bytes: bytes) -> bytes:
  """The model with the (temporary) rule file paths cleared: reproducible bytes.

  Edits the serialized ModelProto directly (sentencepiece_model.proto: normalizer_spec
  = 3, denormalizer_spec = 5, their normalization_rule_tsv = 6), so that no protobuf
  runtime of a particular version is needed (sentencepiece's generated module pins one).
  """
  return drop_subfields(model_bytes, {3: _RULE_TSV, 5: _RULE_TSV})


def trainer_options(family: str, vocab_size: int, *, model_type: str = "unigram",
                    seed_sentencepiece_size: int = 1_000_000, num_threads: int = 2,
                    max_sentences: int = 2_000_000) -> dict:
  """Sentencepiece trainer arguments for `family` (everything but the data)."""
  if family not in VOCAB_FAMILIES:
    raise ValueError(f"family must be one of {VOCAB_FAMILIES}, got {family!r}")
  base = vocab_size - (NUM_SENTINELS if family == "t5" else 0)
  specials = _SPECIAL_IDS[family]
  pieces = SPECIAL_PIECES[family]
  opts = dict(
      vocab_size=base, model_type=model_type, character_coverage=0.9999,
      remove_extra_whitespaces=False, add_dummy_prefix=False, byte_fallback=True,
      allow_whitespace_only_pieces=True, split_by_whitespace=True, split_digits=False,
      max_sentence_length=1 << 16, input_sentence_size=max_sentences,
      shuffle_input_sentence=False, seed_sentencepiece_size=seed_sentencepiece_size,
      num_threads=num_threads, minloglevel=2, bos_id=-1,
      pad_id=specials.pad_id, pad_piece=pieces[specials.pad_id],
      unk_id=specials.unk_id, unk_piece=pieces[specials.unk_id],
      eos_id=-1 if specials.eos_id is None else specials.eos_id,
      eos_piece=pieces[specials.eos_id] if specials.eos_id is not None else "</s>")
  if family == "bert":
    opts["control_symbols"] = ",".join(pieces[2:])
  return opts


def train_vocab(texts: Iterable[str], *, vocab_size: int, family: str, out_dir: str | None,
                model_type: str = "unigram", seed: int = 0, num_threads: int = 2,
                max_sentences: int = 2_000_000) -> Vocabulary:
  """Trains a vocabulary of `vocab_size` ids (T5: including the 100 sentinels).

  `texts` are documents (split into sentences here) or sentences. Writes
  out_dir/spm.model and out_dir/vocab.json when out_dir is given.

  Unigram by default: it is what T5/seqio use, it trains in seconds here, and it
  encodes several times faster than sentencepiece's BPE. Training is deterministic:
  sentences are read in order (no shuffling, at most `max_sentences`), the random
  seed is fixed, and the thread count is an argument (keep it fixed to reproduce a
  model byte for byte).
  """
  from t5x_like.data.sentences import split_sentences
  if vocab_size < 300:
    raise ValueError(f"vocab_size must be at least 300 (256 byte pieces + specials),"
                     f" got {vocab_size}")
  opts = trainer_options(family, vocab_size, model_type=model_type,
                         num_threads=num_threads, max_sentences=max_sentences)
  sentences = (s for text in texts for s in split_sentences(text) if s.strip())
  sentences = itertools.islice(sentences, max_sentences)
  model = io.BytesIO()
  spm.set_random_generator_seed(seed)
  with tempfile.TemporaryDirectory() as tmp:
    norm, denorm = os.path.join(tmp, "norm.tsv"), os.path.join(tmp, "denorm.tsv")
    with open(norm, "w") as f:
      f.write("A\tA 20\n")  # "\n" -> "\n " (code points in hex)
    with open(denorm, "w") as f:
      f.write("A 20\tA\n")  # and back when decoding
    spm.SentencePieceTrainer.train(sentence_iterator=sentences, model_writer=model,
                                   normalization_rule_tsv=norm,
                                   denormalization_rule_tsv=denorm, **opts)
  vocab = Vocabulary(_without_tmp_paths(model.getvalue()), family)
  if out_dir is not None:
    vocab.save(out_dir)
  return vocab
