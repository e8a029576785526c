"""The embedded default corpus: eight public-domain books, one document each (README.md).

The book files are hard-wrapped at ~70 characters, as Project Gutenberg ships them:
`read_book` gives a file's text as it is, `unwrap` joins a paragraph's lines (the
`embedded` data source delivers the books unwrapped).
"""

from __future__ import annotations

import re
from importlib import resources

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


def book_names() -> list[str]:
  """File stems of the books, sorted (e.g. 'austen_pride_and_prejudice')."""
  files = resources.files(__name__).iterdir()
  return sorted(f.name[:-4] for f in files if f.name.endswith(".txt"))


def read_book(name: str) -> str:
  """The full UTF-8 text of one book, hard-wrapped; paragraphs are separated by one blank line."""
  path = resources.files(__name__) / f"{name}.txt"
  if not path.is_file():
    raise FileNotFoundError(f"no book {name!r} in the embedded corpus; known: {book_names()}")
  return path.read_text(encoding="utf-8")


def unwrap(text: str) -> str:
  """Hard-wrapped lines joined: one line per paragraph, paragraphs split by a blank line.

  The books' line breaks are layout, and the shipped vocabularies keep "\\n" as a
  token, so wrapped text would teach line breaks inside sentences (one token in
  thirteen) that task passages (words joined by spaces) never contain. Whitespace
  inside a paragraph becomes one space; the words and their order are kept.
  Idempotent: unwrap(unwrap(t)) == unwrap(t).
  """
  paragraphs = _PARAGRAPH_BREAK.split(text)
  return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip()) + "\n"
