"""WordPiece (finetune/wordpiece.py, Hugging Face `tokenizers` underneath) against an
independent reference: transformers' BertTokenizerLegacy, the pure-Python port of
BERT's tokenization.py. Default tier: a few hundred tricky strings (accents, CJK,
punctuation, control characters, odd whitespace, long words). Slow tier: every sentence
of the GLUE dev files when ../shared/data/glue exists.
"""

import csv
import os
import pickle
import random
import string
import unicodedata

import pytest

from t5x_like.finetune.wordpiece import MAX_WORD_CHARS, WordPieceTokenizer

transformers = pytest.importorskip("transformers")

GLUE_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "glue")
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "un", "##aff", "##able", "cafe", "café", "naive", "zur", "##ich", "straße",
         "new", "york", "New", "York", "do", "##n", "istanbul", "москва", "Москва", "σοφια"]
# Characters whose Unicode categories are old (Unicode <= 8): the Rust tables and
# Python's unicodedata agree on them. Newer characters (e.g. U+2E44, U+12FF1) are
# classed differently by the two; capital sigma and NFC are the known differences below.
LETTERS = ("ÀÉÎÕÜàéîõüçñßøåæœÿŁłőŐſĳİı" "ΑΟΔσςάΩ" "МоскваЖж" "東京大学日本\u8c48\U00020000"
           "はカ한국" "مرحبا" "שלום" "नमस्ते" "ﬁＡａ²½")
PUNCT = string.punctuation + "¡¿«»§¶·—–‘’“”…•‹›‰！。、「」"
SYMBOLS = "$€£©®™°±×÷☃♥😀👍🏽"
SPACES = [" ", "\t", "\n", "\r", "\u00a0", "\u2009", "\u3000", "\u2028", "\u2029", "\u1680"]
DROPPED = ["\x00", "\x07", "\x1b", "\x7f", "\ufffd", "\u200b", "\u200d", "\ufeff", "\u00ad"]
COMBINING = ["\u0301", "\u0308", "\u0327"]  # NFC changes them: uncased only (see below)


def _vocab(cased: bool) -> list[str]:
  chars = set(string.ascii_letters + string.digits + PUNCT + SYMBOLS + LETTERS)
  lowered = {c for ch in chars for c in _normalize(ch, lowercase=True)}
  chars = sorted(chars | lowered) if cased else sorted(lowered)
  words = WORDS if cased else [w.lower() for w in WORDS]
  return list(dict.fromkeys(SPECIALS + words + chars + ["##" + c for c in chars]))


def _normalize(text: str, lowercase: bool) -> str:
  """BERT's per-character normalisation, written from its tokenization.py."""
  text = "".join(c for c in text if not (c in "\x00\ufffd" or (
      unicodedata.category(c).startswith("C") and c not in "\t\n\r")))
  if lowercase:
    text = "".join(c for c in unicodedata.normalize("NFD", text.lower())
                   if unicodedata.category(c) != "Mn")
  return text


def _tricky_texts(cased: bool, n: int = 300) -> list[str]:
  rng = random.Random(43 + cased)
  pool = [list(LETTERS), list(PUNCT), list(SYMBOLS), SPACES, DROPPED, list(string.ascii_letters),
          WORDS] + ([] if cased else [COMBINING])
  texts = ["", " ", "\x00", "a" * (MAX_WORD_CHARS - 1), "b" * MAX_WORD_CHARS,
           "c" * (MAX_WORD_CHARS + 1), "é" * (MAX_WORD_CHARS + 1) + " ok",
           "x" * 60 + "," + "y" * 60, "Zürich\x00ich 東京は unaffable!!", "ὈΔΌ ﬁne İstanbul"]
  while len(texts) < n:
    parts = [rng.choice(rng.choice(pool)) * rng.choice([1, 1, 1, 2, 30])
             for _ in range(rng.randint(1, 12))]
    texts.append("".join(parts))
  return texts


@pytest.fixture(scope="module", params=[False, True], ids=["uncased", "cased"])
def pair(request, tmp_path_factory):
  cased = request.param
  path = tmp_path_factory.mktemp("wp") / "vocab.txt"
  path.write_text("\n".join(_vocab(cased)) + "\n", encoding="utf-8")
  ours = WordPieceTokenizer.from_file(str(path), lowercase=not cased)
  legacy = transformers.BertTokenizerLegacy(str(path), do_lower_case=not cased)
  return cased, ours, legacy


def test_ids_equal_the_python_reference_on_tricky_strings(pair):
  cased, ours, legacy = pair
  texts = _tricky_texts(cased)
  pieces = unk = 0
  for text in texts:
    ids = ours.encode(text)
    assert ids == legacy.encode(text, add_special_tokens=False), ascii(text)
    pieces += sum(not t.startswith("[") for t in ours.pieces(ids))
    unk += ids.count(ours.unk_id)
  # The strings really exercise whole pieces, continuations and [UNK].
  assert pieces > 3000 and unk > 20, (pieces, unk)


def test_the_known_differences_from_the_python_reference(pair):
  """Python lower-cases a whole word (a final capital sigma becomes ς, as in BERT's
  tokenization.py); Rust lower-cases per character (σ). The legacy tokenizer
  NFC-normalises first (BERT's tokenization.py does not): in a cased vocabulary a
  decomposed accent or a CJK compatibility ideograph (U+F900 -> U+8C48) differs."""
  cased, ours, legacy = pair
  if not cased:
    assert ours.pieces(ours.encode("ΟΔΟΣ")) == ["ο", "##δ", "##ο", "##σ"]
    assert legacy.tokenize("ΟΔΟΣ") == ["ο", "##δ", "##ο", "##ς"]
  else:
    assert ours.encode("e\u0301") == [ours.unk_id]  # no piece "##\u0301"
    assert legacy.encode("e\u0301", add_special_tokens=False) == [ours.vocab["é"]]
    assert ours.encode("\uf900") == [ours.unk_id]
    assert legacy.encode("\uf900", add_special_tokens=False) == [ours.vocab["\u8c48"]]


def test_offsets_span_the_text_of_each_piece(pair):
  cased, ours, _ = pair
  checked = 0
  for text in _tricky_texts(cased):
    ids, offsets = ours.encode_with_offsets(text)
    assert ids == ours.encode(text)
    assert all(0 <= a < b <= len(text) for a, b in offsets), ascii(text)
    assert [a for a, _ in offsets] == sorted(a for a, _ in offsets)
    for piece, (a, b) in zip(ours.pieces(ids), offsets):
      if piece != "[UNK]":  # in: NFD splits a Hangul syllable into pieces of one char
        assert piece.removeprefix("##") in _normalize(text[a:b], not cased), ascii(text)
        checked += 1
  assert checked > 3000


def test_encode_words_is_each_word_alone(pair):
  cased, ours, legacy = pair
  for text in _tricky_texts(cased, n=80):
    words = text.split() + ["\x00\u200b"]  # a word of dropped characters only -> [UNK]
    expected = [legacy.encode(w, add_special_tokens=False) or [ours.unk_id] for w in words]
    assert ours.encode_words(words) == expected, ascii(text)
  assert ours.encode_words([]) == []


def test_pickles_and_reports_a_vocab_without_specials(pair, tmp_path):
  _, ours, _ = pair
  text = "Zürich is unaffable, 東京!"
  assert pickle.loads(pickle.dumps(ours)).encode_with_offsets(text) == ours.encode_with_offsets(text)
  with pytest.raises(ValueError, match=r"lacks \['\[CLS\]'\]"):
    WordPieceTokenizer(["[PAD]", "[UNK]", "[SEP]", "a"])


# ------------------------------------------------------------------ GLUE (slow)
GLUE_SENTENCES = {"CoLA": [3], "SST-2": [0], "MRPC": [3, 4], "STS-B": [7, 8], "RTE": [1, 2],
                  "WNLI": [1, 2], "QNLI": [1, 2]}


def _glue_dev_sentences() -> list[str]:
  out = []
  for task, columns in GLUE_SENTENCES.items():
    with open(os.path.join(GLUE_DIR, task, "dev.tsv"), encoding="utf-8-sig", newline="") as f:
      rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    out += [row[c] for row in rows[task != "CoLA":] for c in columns]  # CoLA: no header
  return out


@pytest.mark.long
@pytest.mark.skipif(not os.path.isdir(GLUE_DIR), reason="no ../shared/data/glue")
def test_ids_equal_the_python_reference_on_glue_dev(pair):
  cased, ours, legacy = pair
  sentences = _glue_dev_sentences()
  assert len(sentences) == 1043 + 872 + 2 * (408 + 1500 + 277 + 71 + 5463)
  differ = [s for s in sentences
            if ours.encode(s) != legacy.encode(s, add_special_tokens=False)]
  assert differ == []
