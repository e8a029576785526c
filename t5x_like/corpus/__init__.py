"""The embedded default corpus: eight public-domain books, one document each (README.md)."""

from __future__ import annotations

from importlib import resources


def book_names() -> list[str]:
  """File stems of the books, sorted (e.g. 'austen_pride_and_prejudice')."""
  files = resources.files(__name__).iterdir()
  return sorted(f.name[:-4] for f in files if f.name.endswith(".txt"))


def read_book(name: str) -> str:
  """The full UTF-8 text of one book; paragraphs are separated by one blank line."""
  path = resources.files(__name__) / f"{name}.txt"
  if not path.is_file():
    raise FileNotFoundError(f"no book {name!r} in the embedded corpus; known: {book_names()}")
  return path.read_text(encoding="utf-8")
