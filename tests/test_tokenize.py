"""Sentence splitting and the tokenized TokenStore (exact documents back, cache, stats)."""

import os
import statistics

import fsspec.implementations.memory
import numpy as np
import pytest
from etils.epath import backend as epath_backend
from etils.epath import gpath as epath_gpath

from t5x_like.corpus import book_names, read_book
from t5x_like.data.sentences import split_sentences
from t5x_like.data.sources import DataSourceError, EmbeddedCorpus, TextFiles
from t5x_like.data.store import TokenStore
from t5x_like.data.tokenize import build_store, tokenization_throughput
from t5x_like.data.vocab import default_vocab


# ------------------------------------------------------------------ sentences
@pytest.mark.parametrize("doc, expected", [
    ("Mr. Darcy came in. He sat down.", ["Mr. Darcy came in.", " He sat down."]),
    ("H. G. Wells wrote it. Then Dr. Moreau left!  Why? Nobody knows.",
     ["H. G. Wells wrote it.", " Then Dr. Moreau left!", "  Why?", " Nobody knows."]),
    ("“Stop!” he cried. “Why?” She turned.",
     ["“Stop!” he cried.", " “Why?”", " She turned."]),
    ('He said "Go." Then he went.', ['He said "Go."', " Then he went."]),
    ("It cost 3.50 dollars. 42 men paid it, e.g. the tailor.",
     ["It cost 3.50 dollars.", " 42 men paid it, e.g. the tailor."]),
    ("CHAPTER I\n\nIt was a dark night.\nThe wind blew.",
     ["CHAPTER I", "\n\nIt was a dark night.", "\nThe wind blew."]),
    ("Verse one\n   \n    indented verse\n", ["Verse one", "\n   \n    indented verse\n"]),
    ("no punctuation at all and no end", ["no punctuation at all and no end"]),
    ("The end.\n\n", ["The end.\n\n"]),
    ("\n\nLeading blank lines. Then text.", ["\n\nLeading blank lines.", " Then text."]),
    ("(He left.) [She stayed.] _Italic._ Done.",
     ["(He left.)", " [She stayed.]", " _Italic._", " Done."]),
    ("", []),
    ("   ", ["   "]),
])
def test_split_sentences_examples(doc, expected):
  assert split_sentences(doc) == expected


def test_overlong_sentences_are_cut_at_whitespace():
  doc = "Start. " + "word " * 1000 + "end"
  pieces = split_sentences(doc, max_chars=2000)
  assert "".join(pieces) == doc
  assert max(map(len, pieces)) <= 2000 and len(pieces) == 3  # 5010 chars
  assert all(p[0] == " " for p in pieces[1:])  # cut where whitespace begins
  assert all(p.rstrip() == p for p in pieces[:-1])  # so no piece ends with a cut word
  blob = "x" * 5000  # no whitespace at all: hard cuts
  assert [len(p) for p in split_sentences(blob, max_chars=2000)] == [2000, 2000, 1000]


def test_split_sentences_on_the_whole_corpus():
  lengths = []
  for name in book_names():
    book = read_book(name)
    sentences = split_sentences(book)
    assert "".join(sentences) == book
    assert all(sentences) and max(map(len, sentences)) <= 2000
    assert all(not s.isspace() for s in sentences)
    lengths += [len(s) for s in sentences]
  assert len(lengths) > 30_000
  assert 60 < statistics.mean(lengths) < 200
  assert 40 < statistics.median(lengths) < 150


# ------------------------------------------------------------------ store
@pytest.fixture(scope="module")
def corpus_store():
  vocab = default_vocab("bert")
  source = EmbeddedCorpus()
  store, stats = build_store(source, vocab, num_threads=2)
  return vocab, source, store, stats


def test_store_decodes_to_every_document_exactly(corpus_store):
  vocab, source, store, stats = corpus_store
  assert store.num_docs == 8 == stats["documents"]
  for d in range(store.num_docs):
    assert vocab.decode(store.doc_tokens(d)) == source[d]
  assert store.tokens.dtype == np.int32 and store.tokens.min() >= 5  # no specials
  assert stats["tokens"] == store.num_tokens > 1_000_000
  assert stats["characters"] == sum(len(source[d]) for d in range(8))
  assert stats["cache"] == "off" and stats["source"]["empty_documents"] == 0


def test_store_sentences_are_the_split_sentences(corpus_store):
  vocab, source, store, _ = corpus_store
  book = source[7]
  sentences = split_sentences(book)
  first = store.doc_sentences[7]
  assert store.doc_sentences[8] - first == len(sentences)
  for k in (0, 1, len(sentences) // 2, len(sentences) - 1):
    assert vocab.decode(store.sentence(first + k)) == sentences[k]
  # Every sentence starts with a word-start piece, except where it starts with no
  # whitespace (the first one of a document).
  starts = vocab.word_start_mask()[store.tokens[store.sentence_offsets[:-1]]]
  assert starts.mean() > 0.99


def test_build_store_drops_and_counts_empty_documents(tmp_path):
  (tmp_path / "1.txt").write_text("Call me Ishmael. Some years ago I went to sea.")
  (tmp_path / "2.txt").write_text("")
  (tmp_path / "3.txt").write_text("\n  \n")
  (tmp_path / "4.txt").write_bytes(b"Bad \xff byte.\n\nNew paragraph.")
  source = TextFiles(str(tmp_path / "*.txt"))
  vocab = default_vocab("gpt")
  store, stats = build_store(source, vocab)
  assert store.num_docs == 2 and stats["skipped_documents"] == 2
  assert stats["source"] == dict(empty_documents=2, invalid_utf8=1, malformed_json=0,
                                 missing_field=0)
  assert vocab.decode(store.doc_tokens(0)) == source[0]
  assert vocab.decode(store.doc_tokens(1)) == "Bad \ufffd byte.\n\nNew paragraph."
  assert store.num_sentences == 4


def test_build_store_batches_do_not_change_the_store(tmp_path):
  source = EmbeddedCorpus(["wells_the_time_machine", "carroll_alices_adventures_in_wonderland"])
  vocab = default_vocab("t5")
  one, _ = build_store(source, vocab, batch_sentences=1_000_000)
  many, _ = build_store(source, vocab, batch_sentences=37, num_threads=1)
  for name in ("tokens", "sentence_offsets", "doc_sentences"):
    assert np.array_equal(getattr(one, name), getattr(many, name))


def test_build_store_cache(tmp_path):
  cache = str(tmp_path / "cache")
  path = tmp_path / "doc.txt"
  path.write_text("One sentence. Another one.\n\nA paragraph.")
  vocab = default_vocab("t5")
  first, stats1 = build_store(TextFiles(str(path)), vocab, cache_dir=cache)
  second, stats2 = build_store(TextFiles(str(path)), vocab, cache_dir=cache)
  assert (stats1["cache"], stats2["cache"]) == ("miss", "hit")
  assert np.array_equal(first.tokens, second.tokens)
  assert np.array_equal(first.sentence_offsets, second.sentence_offsets)
  assert stats2["tokens"] == stats1["tokens"]
  # Another vocabulary or changed documents are another key.
  _, stats3 = build_store(TextFiles(str(path)), default_vocab("gpt"), cache_dir=cache)
  path.write_text("Changed text, longer than before.")
  changed, stats4 = build_store(TextFiles(str(path)), vocab, cache_dir=cache)
  assert (stats3["cache"], stats4["cache"]) == ("miss", "miss")
  assert vocab.decode(changed.doc_tokens(0)) == "Changed text, longer than before."
  assert len([f for f in os.listdir(cache) if f.endswith(".npz")]) == 3


def test_tokenization_throughput_reports_numbers():
  source = EmbeddedCorpus(["wells_the_time_machine"])
  result = tokenization_throughput(source=source, family="bert", repeats=1)
  assert result["tokens"] > 30_000 and result["documents"] == 1
  assert result["tokens_per_second"] > 0
  assert result["tokens_per_second_per_core"] * result["cores"] == pytest.approx(
      result["tokens_per_second"], rel=0.01)


def test_build_store_accepts_a_list_of_texts(tmp_path):
  vocab = default_vocab("t5")
  texts = ["One. Two.", "", " \n ", "Three"]
  store, stats = build_store(texts, vocab, cache_dir=str(tmp_path))
  assert (store.num_docs, store.num_sentences, stats["skipped_documents"]) == (2, 3, 2)
  assert [vocab.decode(store.doc_tokens(d)) for d in range(2)] == ["One. Two.", "Three"]
  assert build_store(texts, vocab, cache_dir=str(tmp_path))[1]["cache"] == "hit"
  assert build_store(texts[:1], vocab, cache_dir=str(tmp_path))[1]["cache"] == "miss"


def test_build_store_refuses_documents_without_text(tmp_path):
  with pytest.raises(DataSourceError, match="none of the 3 documents holds text") as info:
    build_store(["", "  \n", ""], default_vocab("t5"), cache_dir=str(tmp_path / "cache"))
  assert "\n" not in str(info.value)
  assert not (tmp_path / "cache").exists()


def test_relative_cache_dir_and_store_paths(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  vocab = default_vocab("t5")
  store, stats = build_store(["One. Two."], vocab, cache_dir="rel/cache")
  assert stats["cache"] == "miss"
  names = sorted(os.listdir(tmp_path / "rel" / "cache"))
  assert [n.rsplit(".", 1)[-1] for n in names] == ["json", "npz"], names  # no temporary left
  monkeypatch.chdir(tmp_path / "rel")  # an absolute cache_dir finds the same files
  assert build_store(["One. Two."], vocab, cache_dir=tmp_path / "rel/cache")[1]["cache"] == "hit"
  monkeypatch.chdir(tmp_path)
  store.save("x/store.npz")
  back = TokenStore.load(str(tmp_path / "x" / "store.npz"))
  assert np.array_equal(back.tokens, store.tokens)
  assert np.array_equal(back.doc_sentences, store.doc_sentences)


class _FakeBucket(fsspec.implementations.memory.MemoryFileSystem):
  """An in-memory stand-in for gcsfs: its own store, gs:// paths kept whole."""

  protocol = ("gs", "gcs")

  def __init__(self):
    super().__init__(skip_instance_cache=True)
    self.store, self.pseudo_dirs = {}, [""]


@pytest.fixture
def fake_gcs(monkeypatch):
  """gs:// paths of etils epath served by an in-memory fsspec filesystem."""
  bucket = _FakeBucket()
  monkeypatch.setattr(epath_gpath, "_is_tf_installed", lambda: False)  # the fsspec backend
  monkeypatch.setattr(epath_backend.fsspec_backend, "fs", lambda path: bucket)
  return bucket


def test_build_store_cache_on_a_url(tmp_path, monkeypatch, fake_gcs):
  """A gs:// cache_dir is written through epath: the files land in the bucket, atomically
  renamed, and no local folder named "gs:" appears."""
  monkeypatch.chdir(tmp_path)
  makedirs = os.makedirs
  monkeypatch.setattr(os, "makedirs", lambda path, *a, **k: (
      pytest.fail(f"os.makedirs({path!r})") if "gs:" in os.fspath(path)
      else makedirs(path, *a, **k)))
  vocab = default_vocab("t5")
  texts = ["Call me Ishmael. Some years ago I went to sea.", "", "Another one."]
  first, stats1 = build_store(texts, vocab, cache_dir="gs://bucket/run/data_cache")
  second, stats2 = build_store(texts, vocab, cache_dir="gs://bucket/run/data_cache")
  assert (stats1["cache"], stats2["cache"]) == ("miss", "hit")
  assert np.array_equal(first.tokens, second.tokens) and second.num_docs == 2
  names = sorted(k.rsplit("/", 1)[-1] for k in fake_gcs.store)
  assert [n.rsplit(".", 1)[-1] for n in names] == ["json", "npz"], names
  assert all(k.startswith("gs://bucket/run/data_cache/tokens-t5-") for k in fake_gcs.store)
  assert os.listdir(tmp_path) == []
  with pytest.raises(DataSourceError):  # refused before anything reaches the bucket
    build_store(["  "], vocab, cache_dir="gs://bucket/other")
  assert not any("other" in k for k in fake_gcs.store)


def test_failed_save_leaves_no_partial_file(tmp_path, monkeypatch):
  store = TokenStore.from_documents([[np.array([5, 6])]])

  def broken_savez(f, **arrays):
    f.write(b"PK partial")
    raise OSError("disk full")

  monkeypatch.setattr(np, "savez", broken_savez)
  with pytest.raises(OSError, match="disk full"):
    store.save(tmp_path / "s.npz")
  assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ vocabulary paths
def test_vocabulary_paths_relative_and_wrong(tmp_path, monkeypatch):
  """load_vocab: relative paths work; a wrong one is a UserError naming it as given."""
  from t5x_like.data.vocab import VocabularyFileError, VocabularyNotFoundError, load_vocab
  from t5x_like.errors import UserError
  monkeypatch.chdir(tmp_path)
  default_vocab("gpt").save("vocab_dir")
  assert load_vocab("vocab_dir").family == "gpt"
  assert load_vocab("vocab_dir/spm.model").path == str(tmp_path / "vocab_dir" / "spm.model")
  os.makedirs("empty_dir")
  open("notes.model", "w").write("not a model\n")
  for path, error, words in [
      ("no_such_vocab.model", VocabularyNotFoundError, ["'no_such_vocab.model'", "no such file"]),
      ("empty_dir", VocabularyNotFoundError, ["'empty_dir'", "a directory without spm.model"]),
      ("notes.model", VocabularyFileError, ["'notes.model' is not a sentencepiece model"])]:
    with pytest.raises(error) as info:
      load_vocab(path)
    message = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in message
    assert all(w in message for w in words), message
  assert isinstance(info.value, ValueError)
  with pytest.raises(FileNotFoundError):  # as callers caught it before
    load_vocab("no_such_vocab.model")
