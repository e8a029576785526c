"""Document sources: boundaries kept, bad input counted (never a crash), spec parsing,
and a source with no usable document refused in one line naming its path."""

import json
import logging
import os
import pickle
import re

import pytest
import tensorflow_datasets as tfds

from t5x_like import cli
from t5x_like.corpus import book_names, read_book, unwrap
from t5x_like.data.sources import (DataSourceError, EmbeddedCorpus, JsonlFiles,
                                   SourceNotFoundError, TextFiles, TfdsSource,
                                   source_from_spec)
from t5x_like.data.tokenize import build_store
from t5x_like.data.vocab import default_vocab
from t5x_like.errors import UserError

NO_PROBLEMS = dict(empty_documents=0, invalid_utf8=0, malformed_json=0, missing_field=0)


def test_embedded_corpus_is_one_document_per_book():
  source = EmbeddedCorpus()
  assert len(source) == 8
  assert source[0] == unwrap(read_book(book_names()[0]))
  assert source[-1] == unwrap(read_book(book_names()[-1]))
  assert "\n\n" in source[3]  # paragraphs kept
  assert len(list(source)) == 8
  assert source.stats.as_dict() == NO_PROBLEMS
  with pytest.raises(IndexError):
    source[8]
  two = source_from_spec("embedded:wells_the_time_machine,shelley_frankenstein")
  assert [two[0], two[1]] == [unwrap(read_book("wells_the_time_machine")),
                              unwrap(read_book("shelley_frankenstein"))]
  assert two.identity() != source.identity()
  with pytest.raises(FileNotFoundError, match="no_such_book"):
    EmbeddedCorpus(["no_such_book"])


def test_embedded_books_come_unwrapped_with_every_word_and_paragraph():
  """The book files are hard-wrapped; the source joins a paragraph's lines, so the
  only line breaks left are the blank lines between paragraphs, and every word stays
  in its place. The files themselves are unchanged (read_book)."""
  for name in book_names():
    raw, doc = read_book(name), EmbeddedCorpus([name])[0]
    paragraphs = [p for p in raw.split("\n\n") if p.strip()]
    assert sum("\n" in p.strip() for p in paragraphs) > len(paragraphs) // 4  # wrapped
    assert doc.split() == raw.split()
    assert doc.endswith("\n") and not doc.endswith("\n\n")
    lines = doc[:-1].split("\n\n")
    assert all(line and "\n" not in line and line == " ".join(line.split())
               for line in lines)
    assert len(lines) == len(re.split(r"\n[ \t]*\n", raw.strip()))
    assert unwrap(doc) == doc
  assert unwrap("A wrapped\nline,  and\t more.\n \nNext\r\nparagraph.\n\n\n") == (
      "A wrapped line, and more.\n\nNext paragraph.\n")
  assert EmbeddedCorpus().identity().startswith("embedded-unwrapped:")  # a new cache key


def test_text_files_count_empty_and_invalid_utf8(tmp_path, caplog):
  (tmp_path / "a.txt").write_text("First document.\n\nSecond paragraph.\n", encoding="utf-8")
  (tmp_path / "b.txt").write_bytes(b"")
  (tmp_path / "c.txt").write_bytes(b"  \n\t\n")
  (tmp_path / "d.txt").write_bytes(b"caf\xc3\xa9 and a bad byte \xff here")
  (tmp_path / "e.md").write_text("not matched")
  source = TextFiles(str(tmp_path / "*.txt"))
  assert len(source) == 4
  with caplog.at_level(logging.WARNING):
    docs = [source[i] for i in range(len(source))]
  assert docs[0] == "First document.\n\nSecond paragraph.\n"
  assert docs[1] == docs[2] == ""
  assert docs[3] == "café and a bad byte \ufffd here"
  for _ in range(2):  # each document counted once however often it is read
    list(source)
  assert source.stats.as_dict() == dict(NO_PROBLEMS, empty_documents=2, invalid_utf8=1)
  assert str(tmp_path / "d.txt") in caplog.text
  assert len(list(source)) == 2


def test_missing_files_are_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="nothing_here"):
    TextFiles(str(tmp_path / "nothing_here" / "*.txt"))
  with pytest.raises(FileNotFoundError, match="missing.jsonl"):
    JsonlFiles(str(tmp_path / "missing.jsonl"))
  with pytest.raises(FileNotFoundError, match="missing.txt"):
    source_from_spec(f"text:{tmp_path}/missing.txt")


def test_relative_globs_read_from_anywhere_later(tmp_path, monkeypatch, caplog):
  """A relative glob is matched in the current directory once; reads and log lines
  keep working (and keep the relative names) after the directory changes."""
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs" / "a.jsonl").write_text('{"text": "one"}\nnot json\n{"text": "two"}\n')
  (tmp_path / "elsewhere").mkdir()
  monkeypatch.chdir(tmp_path)
  source = source_from_spec("jsonl:docs/*.jsonl")
  assert source.shown_files == ["docs/a.jsonl"]
  assert source.files == [str(tmp_path / "docs" / "a.jsonl")]
  monkeypatch.chdir(tmp_path / "elsewhere")
  with caplog.at_level(logging.WARNING):
    assert list(source) == ["one", "two"]
  assert "docs/a.jsonl:2" in caplog.text


def test_bad_leading_documents_are_still_logged_and_counted(tmp_path, caplog):
  """Making a source reads up to its first usable document without logging or counting
  the bad ones before it: the first full pass does, once."""
  (tmp_path / "a.jsonl").write_text('{"body": "x"}\n[1]\n{"text": "  "}\n{"text": "ok"}\n')
  with caplog.at_level(logging.WARNING):
    source = JsonlFiles(str(tmp_path / "a.jsonl"))
    assert caplog.text == "" and source.stats.as_dict() == NO_PROBLEMS
    assert list(source) == ["ok"]
  assert source.stats.as_dict() == dict(NO_PROBLEMS, empty_documents=1, malformed_json=1,
                                        missing_field=1)
  assert all(f"a.jsonl:{line}" in caplog.text for line in (1, 2, 3))


# ------------------------------------------------------------------ sources with no document
def _make_files():
  """Files for the error cases, in the current directory."""
  def write(path, data):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      f.write(data)
  write("empty_files/a.txt", "  \n\n")
  write("empty_files/b.txt", "")
  write("blank_rows/x.jsonl", "\n  \n")
  write("jsonl_no_field/x.jsonl", '{"body": "Some text here.", "n": 1}\n{"body": "More."}\n')
  write("plain_text/book.jsonl", "Once upon a time.\nThe end.\n")
  write("mixed/x.jsonl", '{"text": 7}\nnot json\n{"text": " "}\n')
  write("a_directory/doc.txt", "Some text. More text.\n")
  write("rows/x.jsonl", '{"body": "x"}\n')
  write("nested/sub/a.txt", "Text.\n")
  write("texts/a.txt", "Text.\n")


# (id, spec, exception type, words the message must contain)
NO_DOCUMENT_CASES = [
    ("glob matching nothing", "text:nothing/*.txt", SourceNotFoundError,
     ["no files match 'nothing/*.txt'", "(source 'text:nothing/*.txt'",
      "directory 'nothing' does not exist"]),
    ("jsonl glob matching nothing", "jsonl:texts/*.jsonl", SourceNotFoundError,
     ["no files match 'texts/*.jsonl'", "'texts' holds 1 entry, e.g. 'a.txt'"]),
    ("file that is not there", "text:missing.txt", SourceNotFoundError,
     ["no files match 'missing.txt'", "no such file"]),
    ("directory instead of a glob", "text:a_directory", SourceNotFoundError,
     ["'a_directory' is a directory", "did you mean 'text:a_directory/*.txt'?"]),
    ("jsonl directory with a field", "jsonl:rows:body", SourceNotFoundError,
     ["'rows' is a directory", "did you mean 'jsonl:rows/*.jsonl:body'?"]),
    ("glob matching only directories", "text:nested/*", SourceNotFoundError,
     ["'nested/*' matches only directories", "did you mean 'text:nested/*/*.txt'?"]),
    ("only empty files", "text:empty_files/*.txt", DataSourceError,
     ["no document in 'empty_files/*.txt'", "all its 2 files are empty or whitespace only"]),
    ("one empty file", "text:empty_files/a.txt", DataSourceError,
     ["its only file 'empty_files/a.txt' is empty"]),
    ("jsonl of blank lines", "jsonl:blank_rows/*.jsonl", DataSourceError,
     ["no document in 'blank_rows/*.jsonl'", "'blank_rows/x.jsonl' is empty"]),
    ("jsonl rows without the field", "jsonl:jsonl_no_field/*", DataSourceError,
     ["no document in 'jsonl_no_field/*'", "no row has a string field 'text'",
      "the first row has fields ['body', 'n']", "did you mean 'jsonl:jsonl_no_field/*:body'?"]),
    ("jsonl rows without a named field", "jsonl:jsonl_no_field/*:title", DataSourceError,
     ["(source 'jsonl:jsonl_no_field/*:title')", "no row has a string field 'title'"]),
    ("jsonl glob over text files", "jsonl:plain_text/*.jsonl", DataSourceError,
     ["no document in 'plain_text/*.jsonl'", "'plain_text/book.jsonl' is not JSON lines",
      "line 1 reads 'Once upon a time.'", "use 'text:plain_text/*.jsonl'"]),
    ("jsonl rows all bad in several ways", "jsonl:mixed/*.jsonl", DataSourceError,
     ["none of its 3 rows is usable", "1 is not a JSON object",
      "1 lacks a string field 'text'", "1 is empty"]),
    ("bad spec form", "webtext", DataSourceError,
     ["bad source spec 'webtext'", "text:GLOB", "jsonl:GLOB[:FIELD]"]),
    ("bare glob as a spec", "texts/*.txt", DataSourceError,
     ["bad source spec 'texts/*.txt'", "did you mean 'text:texts/*.txt'?"]),
    ("URL glob", "text:gs://bucket/docs/*.txt", DataSourceError,
     ["'gs://bucket/docs/*.txt'", "local files"]),
    ("unknown embedded book", "embedded:wells_time_machine", SourceNotFoundError,
     ["no book(s) ['wells_time_machine']", "did you mean 'wells_the_time_machine'?"]),
    ("TFDS data dir missing", "tfds:t5x_like_tiny_text@no_tfds_dir", SourceNotFoundError,
     ["TFDS data_dir 'no_tfds_dir' does not exist"]),
]


@pytest.mark.parametrize("name, spec, error, words", NO_DOCUMENT_CASES,
                         ids=[c[0] for c in NO_DOCUMENT_CASES])
def test_a_source_without_documents_is_one_line_naming_it(name, spec, error, words, tmp_path,
                                                          monkeypatch, caplog):
  monkeypatch.chdir(tmp_path)
  _make_files()
  before = sorted(os.walk("."))
  with caplog.at_level(logging.WARNING), pytest.raises(error) as info:
    build_store(source_from_spec(spec), default_vocab("t5"), cache_dir="cache")
  message = str(info.value)
  assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)
  assert "\n" not in message and len(message) < 400, message
  for word in words:
    assert word in message, (word, message)
  assert str(tmp_path) not in message.replace(f"relative to {str(tmp_path)!r}", "")
  assert not os.path.exists("cache") and sorted(os.walk(".")) == before
  assert caplog.text == ""  # the one line says it all: no warning per bad document


def test_cli_reports_a_source_without_documents(tmp_path, monkeypatch, capfd):
  """`t5x-like vocab train` with such a source: exit 2, the message, no traceback, no
  output directory."""
  monkeypatch.chdir(tmp_path)
  _make_files()
  code = cli.main(["vocab", "train", "--source", "jsonl:plain_text/*.jsonl",
                   "--vocab-size", "700", "--family", "t5", "--out", "vocab_out"])
  err = capfd.readouterr().err
  assert code == 2 and "Traceback" not in err
  assert "'plain_text/book.jsonl' is not JSON lines" in err.strip().splitlines()[-1]
  assert not os.path.exists("vocab_out")


def test_jsonl_counts_malformed_lines_with_file_and_line(tmp_path, caplog):
  lines = [
      json.dumps({"text": "Doc one.", "id": 1}),             # 1 ok
      "{not json",                                            # 2 malformed
      "",                                                     # 3 blank: not a document
      json.dumps({"body": "no text field"}),                  # 4 missing field
      json.dumps({"text": 17}),                               # 5 not a string
      json.dumps({"text": "   "}),                            # 6 empty
      json.dumps(["a", "list"]),                              # 7 not an object
      json.dumps({"text": "Doc two\nwith lines.", "body": "B"}),  # 8 ok
  ]
  path = tmp_path / "part-0.jsonl"
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  (tmp_path / "part-1.jsonl").write_bytes(b'{"text": "bad \xff byte"}\r\n\n{"text": "last"}')
  source = JsonlFiles(str(tmp_path / "*.jsonl"))
  assert len(source) == 7 + 2
  with caplog.at_level(logging.WARNING):
    docs = list(source)
  assert docs == ["Doc one.", "Doc two\nwith lines.", "bad \ufffd byte", "last"]
  assert source.stats.as_dict() == dict(empty_documents=1, invalid_utf8=1, malformed_json=2,
                                        missing_field=2)
  assert f"{path}:2" in caplog.text and f"{path}:4" in caplog.text
  assert f"{path}:7" in caplog.text
  # Random access, another field, and the spec form with a field.
  assert source[7] == "bad \ufffd byte"
  body = source_from_spec(f"jsonl:{tmp_path}/part-0.jsonl:body")
  assert isinstance(body, JsonlFiles) and body.field == "body"
  assert list(body) == ["no text field", "B"]


class T5xLikeTinyText(tfds.core.GeneratorBasedBuilder):
  """A tiny text dataset written as array_record (no TensorFlow needed)."""

  VERSION = tfds.core.Version("1.0.0")
  DOCS = ["First doc.\n\nTwo paragraphs.", "", b"invalid \xff utf-8", "caf\u00e9"]

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
        {"text": tfds.features.Text(), "title": tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples(self.DOCS),
            "validation": self._generate_examples(["held out"])}

  def _generate_examples(self, docs):
    for i, doc in enumerate(docs):
      yield i, {"text": doc, "title": f"title {i}"}


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  tfds.disable_progress_bar()
  T5xLikeTinyText(data_dir=data_dir, file_format="array_record").download_and_prepare()
  return data_dir


def test_tfds_source_reads_array_record(tfds_dir):
  source = TfdsSource("t5x_like_tiny_text", "train", tfds_dir)
  assert len(source) == 4
  docs = sorted(source[i] for i in range(4))  # TFDS shuffles records when writing
  assert docs == sorted(["First doc.\n\nTwo paragraphs.", "", "invalid \ufffd utf-8", "café"])
  assert source.stats.as_dict() == dict(NO_PROBLEMS, empty_documents=1, invalid_utf8=1)
  assert all(isinstance(d, str) for d in docs)
  # Pickles without the open files (loader workers reopen them).
  clone = pickle.loads(pickle.dumps(source))
  assert [clone[i] for i in range(4)] == [source[i] for i in range(4)]
  assert clone.identity() == source.identity() != TfdsSource(
      "t5x_like_tiny_text", "validation", tfds_dir).identity()

  spec = source_from_spec(f"tfds:t5x_like_tiny_text:validation@{tfds_dir}")
  assert isinstance(spec, TfdsSource) and list(spec) == ["held out"]
  titles = source_from_spec(f"tfds:t5x_like_tiny_text@{tfds_dir}#title")
  assert (titles.split, titles.field) == ("train", "title")
  assert sorted(titles) == [f"title {i}" for i in range(4)]


class T5xLikeEmptyText(T5xLikeTinyText):
  """Records whose text is all empty or whitespace."""

  DOCS = ["", "  \n", ""]


def test_tfds_source_errors(tfds_dir, tmp_path):
  with pytest.raises(FileNotFoundError, match="no_such_dataset"):
    TfdsSource("no_such_dataset", "train", tfds_dir)
  with pytest.raises(FileNotFoundError, match="split 'test'"):
    TfdsSource("t5x_like_tiny_text", "test", tfds_dir)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    TfdsSource("t5x_like_tiny_text", "train", str(tmp_path / "nowhere"))
  with pytest.raises(ValueError, match="no feature 'body'"):
    TfdsSource("t5x_like_tiny_text", "train", tfds_dir, field="body")
  T5xLikeEmptyText(data_dir=tfds_dir, file_format="array_record").download_and_prepare()
  cases = [
      (f"tfds:no_such_dataset@{tfds_dir}", SourceNotFoundError,
       ["TFDS dataset 'no_such_dataset' split 'train' not found", "Dataset no_such_dataset"]),
      (f"tfds:t5x_like_tiny_text@{tfds_dir}#body", DataSourceError,
       ["no feature 'body'", "['text', 'title']", "'#FIELD'"]),
      (f"tfds:t5x_like_empty_text@{tfds_dir}", DataSourceError,
       ["no document in TFDS dataset 't5x_like_empty_text' split 'train'",
        "the field 'text' of all 3 records is unusable", "'empty_documents': 3"]),
  ]
  for spec, error, words in cases:
    with pytest.raises(error) as info:
      source_from_spec(spec)
    message = str(info.value)
    assert "\n" not in message and f"{spec!r}" in message, message
    assert all(word in message for word in words), (words, message)


@pytest.mark.parametrize("spec, kind, attrs", [
    ("embedded", EmbeddedCorpus, dict(books=book_names())),
    ("text:{d}/*.txt", TextFiles, dict(pattern="{d}/*.txt")),
    ("jsonl:{d}/*.jsonl", JsonlFiles, dict(pattern="{d}/*.jsonl", field="text")),
    ("jsonl:{d}/*.jsonl:content", JsonlFiles, dict(pattern="{d}/*.jsonl", field="content")),
])
def test_source_from_spec_forms(spec, kind, attrs, tmp_path):
  (tmp_path / "x.txt").write_text("x")
  (tmp_path / "x.jsonl").write_text('{"text": "x", "content": "y"}\n')
  source = source_from_spec(spec.format(d=tmp_path))
  assert isinstance(source, kind)
  for name, value in attrs.items():
    if isinstance(value, str):
      value = value.format(d=tmp_path)
    assert getattr(source, name) == value


def test_tfds_spec_parsing(monkeypatch):
  seen = []
  monkeypatch.setattr(TfdsSource, "__init__",
                      lambda self, *a: seen.append(a))
  for spec in ("tfds:c4/en", "tfds:c4/en:validation[:1000]@/data/tfds",
               "tfds:wiki_text:train@/d#content"):
    source_from_spec(spec)
  assert seen == [("c4/en", "train", None, "text"),
                  ("c4/en", "validation[:1000]", "/data/tfds", "text"),
                  ("wiki_text", "train", "/d", "content")]


@pytest.mark.parametrize("spec", ["", "webtext", "text:", "jsonl:", "tfds:", "tfds:a b",
                                  "files:/x/*.txt"])
def test_bad_specs_list_the_valid_forms(spec):
  with pytest.raises(DataSourceError) as info:
    source_from_spec(spec)
  message = str(info.value)
  assert repr(spec) in message
  for form in ("embedded", "text:GLOB", "jsonl:GLOB[:FIELD]", "tfds:NAME"):
    assert form in message


def test_sources_pickle_for_worker_processes(tmp_path):
  (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
  for source in (EmbeddedCorpus(["wells_the_time_machine"]),
                 JsonlFiles(str(tmp_path / "*.jsonl"))):
    clone = pickle.loads(pickle.dumps(source))
    assert len(clone) == len(source) and clone[len(source) - 1] == source[len(source) - 1]
    assert clone.identity() == source.identity()


def test_text_identity_changes_with_content(tmp_path):
  path = tmp_path / "a.txt"
  path.write_text("one")
  before = TextFiles(str(path)).identity()
  path.write_text("one more")
  after = TextFiles(str(path)).identity()
  assert after != before and after == TextFiles(str(path)).identity()
