"""Vocabularies: special ids per family, exact round trip, whole-word starts, training."""

import json
import os
import pickle

import numpy as np
import pytest

from t5x_like import cli
from t5x_like.corpus import book_names, read_book
from t5x_like.data.vocab import (Vocabulary, default_vocab, load_vocab, train_vocab,
                                 WORD_MARK)

FAMILIES = ("bert", "t5", "gpt")
TRICKY = [
    "", " ", "   leading", "trailing   ", "a  b   c", "\n", "\n\n\n", " \n \n ",
    "line one\nline two\n\n  indented verse\n", "tab\tseparated\t\ttext", "crlf\r\nline",
    "“Curly” ‘quotes’ — dashes… £5", "naïve café Œuvre", "emoji 🙂 and 漢字 and עברית",
    "nbsp\xa0here", "combining e\u0301", "[CLS] [MASK] <extra_id_0> </s> <|endoftext|>",
    "\x00\x01 control", "Mr. Darcy.  Two spaces.",
]


@pytest.fixture(scope="module")
def tiny_vocabs(tmp_path_factory):
  """One small vocabulary per family, trained on one short book (a second each)."""
  text = [read_book("wells_the_time_machine")]
  return {f: train_vocab(text, vocab_size=700, family=f,
                         out_dir=str(tmp_path_factory.mktemp(f"vocab_{f}")))
          for f in FAMILIES}


# ------------------------------------------------------------------ the shipped vocabularies
@pytest.mark.parametrize("family", FAMILIES)
def test_default_vocab_round_trips_the_whole_corpus(family):
  vocab = default_vocab(family)
  assert vocab.vocab_size == 8192
  books = [read_book(b) for b in book_names()]
  assert len(books) == 8
  for book, ids in zip(books, vocab.encode_batch(books)):
    assert ids.dtype == np.int32
    assert ids.max() < vocab.vocab_size - vocab.num_sentinels
    assert vocab.decode(ids) == book
  # A sensible vocabulary: around 4 characters per token on English prose.
  tokens = sum(len(vocab.encode(b)) for b in books)
  assert 3.0 < sum(map(len, books)) / tokens < 6.0, tokens


def test_default_vocab_special_ids():
  bert, t5, gpt = (default_vocab(f) for f in FAMILIES)
  assert (bert.pad_id, bert.unk_id, bert.cls_id, bert.sep_id, bert.mask_id) == (0, 1, 2, 3, 4)
  assert [bert.piece(i) for i in range(5)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
  assert bert.eos_id is None

  assert (t5.pad_id, t5.eos_id, t5.unk_id) == (0, 1, 2)
  assert [t5.piece(i) for i in range(3)] == ["<pad>", "</s>", "<unk>"]
  assert t5.base_vocab_size == 8092 and t5.vocab_size == 8192
  assert t5.sentinel_id(0) == 8191 and t5.sentinel_id(1) == 8190 and t5.sentinel_id(99) == 8092
  assert t5.piece(8191) == "<extra_id_0>" and t5.piece(8092) == "<extra_id_99>"
  assert t5.cls_id is None and t5.mask_id is None

  assert (gpt.pad_id, gpt.unk_id, gpt.eos_id) == (0, 1, 2)
  assert gpt.piece(gpt.eos_id) == "<|endoftext|>"

  for v in (bert, gpt):
    with pytest.raises(ValueError, match="no sentinels"):
      v.sentinel_id(0)
  with pytest.raises(ValueError):
    t5.sentinel_id(100)


@pytest.mark.parametrize("family", FAMILIES)
def test_special_tokens_never_come_from_text(family):
  vocab = default_vocab(family)
  text = "[PAD] [UNK] [CLS] [SEP] [MASK] <pad> </s> <unk> <|endoftext|> <extra_id_0>"
  ids = vocab.encode(text)
  specials = {vocab.pad_id, vocab.unk_id, vocab.eos_id, vocab.cls_id, vocab.sep_id,
              vocab.mask_id} - {None}
  assert not specials & set(ids.tolist())
  assert ids.max() < vocab.vocab_size - vocab.num_sentinels
  assert vocab.decode(ids) == text


def test_decode_drops_control_tokens_and_names_sentinels():
  t5 = default_vocab("t5")
  a, b = t5.encode("The whale"), t5.encode(" sank.")
  ids = np.concatenate([a, [t5.sentinel_id(0)], b, [t5.sentinel_id(1), t5.eos_id, 0, 0]])
  assert t5.decode(ids) == "The whale<extra_id_0> sank.<extra_id_1>"
  bert = default_vocab("bert")
  ids = np.concatenate([[bert.cls_id], bert.encode("Call me"), [bert.sep_id, bert.pad_id]])
  assert bert.decode(ids) == "Call me"
  with pytest.raises(ValueError, match="out of range"):
    bert.decode([8192])
  with pytest.raises(ValueError, match="out of range"):
    bert.decode([-1])


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_on_tricky_text(family):
  vocab = default_vocab(family)
  for text in TRICKY:
    assert vocab.decode(vocab.encode(text)) == text, repr(text)
  # Concatenating the ids of consecutive pieces decodes to the concatenated text (the
  # TokenStore relies on it: it encodes sentences one by one).
  parts = ["He said.", "\n\nThen", " he  left.", "\n  ", "Œ🙂"]
  ids = np.concatenate([vocab.encode(p) for p in parts])
  assert vocab.decode(ids) == "".join(parts)
  batch = vocab.encode_batch(TRICKY, num_threads=2)
  assert all(np.array_equal(b, vocab.encode(t)) for b, t in zip(batch, TRICKY))


def test_known_limitation_the_word_mark_character():
  """U+2581 itself is sentencepiece's space marker: it decodes as a space (documented)."""
  vocab = default_vocab("t5")
  assert vocab.decode(vocab.encode(f"a{WORD_MARK}b")) == "a b"


def test_newline_is_followed_by_a_word_start():
  vocab = default_vocab("bert")
  pieces = [vocab.piece(i) for i in vocab.encode("of a\nsingle man")]
  assert pieces[pieces.index("\n") + 1].startswith(WORD_MARK)


@pytest.mark.parametrize("family", FAMILIES)
def test_word_start_mask_groups_tokens_into_whitespace_words(family):
  vocab = default_vocab(family)
  mask = vocab.word_start_mask()
  assert mask.shape == (vocab.vocab_size,) and mask.dtype == bool
  specials = [i for i in (vocab.pad_id, vocab.unk_id, vocab.eos_id, vocab.cls_id,
                          vocab.sep_id, vocab.mask_id) if i is not None]
  assert mask[specials].all()
  if family == "t5":
    assert mask[vocab.base_vocab_size:].all()
  byte_ids = [i for i in range(vocab.base_vocab_size) if vocab.sp.is_byte(i)]
  assert len(byte_ids) == 256 and not mask[byte_ids].any()
  assert 0.3 < mask.mean() < 0.95
  # Splitting a whole book before every word-start token gives its whitespace words.
  text = read_book("carroll_alices_adventures_in_wonderland") + " naïve 🙂x"
  ids = vocab.encode(text)
  groups = np.split(ids, np.flatnonzero(mask[ids]))
  words = [w for w in (vocab.decode(g).strip() for g in groups) if w]
  assert words == text.split()


def test_vocabulary_pickles_as_model_bytes():
  vocab = default_vocab("t5")
  blob = pickle.dumps(vocab)
  assert len(blob) < len(vocab.model_bytes) + 1000
  clone = pickle.loads(blob)
  text = "It was the best of times."
  assert clone.family == "t5" and clone.vocab_size == vocab.vocab_size
  assert np.array_equal(clone.encode(text), vocab.encode(text))
  assert clone.fingerprint == vocab.fingerprint != default_vocab("gpt").fingerprint


# ------------------------------------------------------------------ training
def test_train_vocab_layout_files_and_round_trip(tiny_vocabs, tmp_path):
  held_out = read_book("doyle_adventures_of_sherlock_holmes")[:20000] + " Zoë 🙂 ünïcödé"
  for family, vocab in tiny_vocabs.items():
    assert vocab.vocab_size == 700
    assert vocab.base_vocab_size == (600 if family == "t5" else 700)
    assert vocab.decode(vocab.encode(held_out)) == held_out
    out_dir = os.path.dirname(vocab.path)
    with open(os.path.join(out_dir, "vocab.json")) as f:
      assert json.load(f)["family"] == family
    loaded = load_vocab(out_dir)
    assert loaded.family == family and loaded.model_bytes == vocab.model_bytes
    # Without vocab.json the family is read off the special pieces.
    bare = tmp_path / f"{family}.model"
    bare.write_bytes(vocab.model_bytes)
    assert load_vocab(str(bare)).family == family
  # The same model under another family's layout is refused.
  with pytest.raises(ValueError, match="special ids"):
    Vocabulary(tiny_vocabs["t5"].model_bytes, "bert")


def test_train_vocab_is_deterministic(tiny_vocabs):
  again = train_vocab([read_book("wells_the_time_machine")], vocab_size=700, family="gpt",
                      out_dir=None)
  assert again.model_bytes == tiny_vocabs["gpt"].model_bytes


def test_train_vocab_rejects_bad_arguments(tmp_path):
  text = [read_book("wells_the_time_machine")[:30000]]
  with pytest.raises(ValueError, match="family"):
    train_vocab(text, vocab_size=700, family="roberta", out_dir=None)
  with pytest.raises(ValueError, match="vocab_size"):
    train_vocab(text, vocab_size=100, family="bert", out_dir=None)
  with pytest.raises(RuntimeError, match="Vocabulary size too high"):
    train_vocab(text, vocab_size=50_000, family="bert", out_dir=None)
  with pytest.raises(FileNotFoundError, match="nothing-here"):
    load_vocab(str(tmp_path / "nothing-here"))
  with pytest.raises(ValueError, match="family"):
    default_vocab("roberta")


# ------------------------------------------------------------------ the command
def test_cli_vocab_train_and_encode(tmp_path, capsys):
  out = tmp_path / "vocab"
  rc = cli.main(["vocab", "train", "--source", "embedded:wells_the_time_machine",
                 "--vocab-size", "700", "--family", "t5", "--out", str(out)])
  assert rc == 0
  report = json.loads(capsys.readouterr().out)
  assert report["vocab_size"] == 700 and report["family"] == "t5"
  assert load_vocab(str(out)).vocab_size == 700
  assert cli.main(["vocab", "encode", "--vocab", str(out), "The Time  Traveller\n"]) == 0
  line = json.loads(capsys.readouterr().out)
  assert line["round_trip"] is True and len(line["ids"]) == len(line["pieces"]) > 2
  assert cli.main(["vocab", "decode", "--family", "t5", "8191"]) == 0
  assert capsys.readouterr().out == "<extra_id_0>\n"


@pytest.mark.parametrize("args, named", [
    (["--source", "text:/no/such/dir/*.txt", "--vocab-size", "700", "--family", "t5"],
     "no files match '/no/such/dir/*.txt'"),
    (["--source", "webtext", "--vocab-size", "700", "--family", "t5"],
     "bad source spec 'webtext'; valid forms: embedded"),
    (["--source", "embedded", "--vocab-size", "12", "--family", "t5"], "--vocab-size=12"),
    (["--source", "embedded", "--vocab-size", "many", "--family", "t5"], "--vocab-size=many"),
    (["--source", "embedded", "--vocab-size", "700", "--family", "xlnet"], "--family=xlnet"),
])
def test_cli_vocab_train_names_the_bad_argument(args, named, tmp_path, capsys):
  assert cli.main(["vocab", "train", "--out", str(tmp_path)] + args) == 2
  err = capsys.readouterr().err
  assert named in err and err.count("\n") == 1, err


def test_cli_vocab_train_too_large_a_vocabulary(tmp_path, capsys):
  rc = cli.main(["vocab", "train", "--source", "embedded:wells_the_time_machine",
                 "--vocab-size", "60000", "--family", "t5", "--out", str(tmp_path)])
  assert rc == 2
  assert "argument --vocab-size" in capsys.readouterr().err


def test_protobuf_wire_drops_a_sub_field_and_keeps_the_rest():
  """A message written by hand from the protobuf encoding spec: field 1 = 1, field 3 =
  {field 1 = 150 (a two-byte varint), field 6 = "x"}; dropping 3.6 keeps the rest."""
  from t5x_like.data.protobuf_wire import drop_subfields
  message = bytes([0x08, 0x01, 0x1A, 0x06, 0x08, 0x96, 0x01, 0x32, 0x01, ord("x")])
  assert drop_subfields(message, {3: 6}) == bytes([0x08, 0x01, 0x1A, 0x03, 0x08, 0x96, 0x01])
  assert drop_subfields(message, {3: 2}) == message  # no such sub-field: unchanged
