"""Out-of-domain book tasks: attribution among books that pretraining never saw.

The book task (books.py) holds passages out of books whose other text is pretrained on,
so the pretrained model has met each book's names, places and topics. These tasks take
whole books out of pretraining instead:

  make_unseen_task("workdir/books_unseen")  ->  workdir/books_unseen/
      pretrain/<book>.txt   the PRETRAIN_BOOKS, whole and unwrapped (corpus.unwrap): pretrain
                            on these (`--config.data.source='text:.../pretrain/*.txt'`)
      train.csv, dev.csv    3-way attribution among the UNSEEN_BOOKS (label = the author's
                            surname); each book is cut into `num_regions` equal regions of
                            consecutive words, even regions give train passages, odd ones
                            dev passages, so no region gives passages to both
      README.md             books, regions and counts

  make_within_task("workdir/books_within")  ->  the same pretrain/, and two classes inside
      one unseen book: who narrates a passage of Frankenstein, Victor (chapters 1-10 and
      17-24) or the creature (chapters 11-16); each narrative cut into regions as above.

Which books are unseen: the three smallest (Carroll's Alice, Shelley's Frankenstein,
Wells' The Time Machine; 134k of the corpus' 820k words), so pretraining keeps 84% of
the text (Austen, Dickens, Doyle, Melville, Twain); Frankenstein has three narrators for
a within-book task, and both tasks share one pretrain/ (one pretraining serves both).
Classes are balanced: every region of every class gives the same number of passages.
"""

from __future__ import annotations

import os
import re
from typing import Optional, Sequence

from t5x_like import corpus
from t5x_like.corpus import unwrap
from t5x_like.task_builders.books import author, passages, region_rows, write_splits

UNSEEN_BOOKS = ("carroll_alices_adventures_in_wonderland", "shelley_frankenstein",
                "wells_the_time_machine")


_QUOTES = str.maketrans("", "", "“”‘\"")


def pretrain_books(unseen: Sequence[str] = UNSEEN_BOOKS) -> list[str]:
  """The embedded books not in `unseen`, sorted."""
  return [b for b in corpus.book_names() if b not in unseen]


def regions(parts: Sequence[Sequence[str]], num_regions: int) -> list[list[list[str]]]:
  """Words in `parts` (contiguous stretches of text) cut into `num_regions` regions of
  (nearly) equal word counts; each region is a list of segments, one per part it
  overlaps, so that no passage cut from a segment joins two parts."""
  bounds = [round(r * sum(map(len, parts)) / num_regions) for r in range(num_regions + 1)]
  out: list[list[list[str]]] = []
  for lo, hi in zip(bounds, bounds[1:]):
    segments, start = [], 0
    for part in parts:
      a, b = max(lo, start), min(hi, start + len(part))
      if a < b:
        segments.append(list(part[a - start:b - start]))
      start += len(part)
    out.append(segments)
  return out


def frankenstein_narrators(text: str) -> dict[str, list[list[str]]]:
  """{'walton': parts, 'victor': parts, 'creature': parts} of Frankenstein, each part the
  words of one contiguous stretch of the book.

  Walton's letters open the book (Letters 1-4) and close it ("Walton, in continuation");
  Victor narrates chapters 1-10 and 17-24; the creature chapters 11-16. Heading lines
  and quotation marks (but ’, also the apostrophe) are dropped; the headings are looked
  up after the table of contents.
  """
  lines = text.splitlines()

  def after_contents(heading: str) -> int:
    hits = [i for i, line in enumerate(lines) if line.strip() == heading]
    if not hits:
      raise ValueError(f"no line {heading!r} in the book")
    return hits[-1]  # the contents list each heading once, before the text

  letters, ch1, ch11, ch17 = (after_contents(h) for h in
                              ("Letter 1", "Chapter 1", "Chapter 11", "Chapter 17"))
  walton_end = after_contents("Walton, _in continuation._")
  heading = re.compile(r"^(Letter \d+|Chapter \d+|Walton, _in continuation._)$")

  def words(start: int, end: int) -> list[str]:
    # Without double quotes and opening single quotes: the creature's narrative is
    # quoted inside Victor's, so its paragraphs open with “ and never close with ” and its
    # dialogue is in ‘’; those marks alone would tell a third of the passages apart.
    kept = (line.translate(_QUOTES) for line in lines[start:end]
            if not heading.match(line.strip()))
    return [w for line in kept for w in line.split()]

  return dict(walton=[words(letters, ch1), words(walton_end, len(lines))],
              victor=[words(ch1, ch11), words(ch17, walton_end)],
              creature=[words(ch11, ch17)])


def _write_task(out_dir: str, classes: dict[str, list[list[str]]], unseen: Sequence[str],
                num_regions: int, passage_words: int, title: str) -> dict:
  """pretrain/ (the books not in `unseen`), train.csv, dev.csv and README.md."""
  if num_regions < 2:
    raise ValueError(f"num_regions={num_regions}: need at least one train and one dev region")
  os.makedirs(os.path.join(out_dir, "pretrain"), exist_ok=True)
  pretrain = {}
  for book in pretrain_books(unseen):
    text = unwrap(corpus.read_book(book))
    pretrain[book] = len(text.split())
    with open(os.path.join(out_dir, "pretrain", f"{book}.txt"), "w", encoding="utf-8") as f:
      f.write(text)
  cut = {label: [[p for segment in region for p in passages(segment, passage_words)]
                 for region in regions(parts, num_regions)]
         for label, parts in classes.items()}
  # The same number of passages from every region of every class: balanced classes.
  per_region = min(len(r) for rs in cut.values() for r in rs)
  if per_region == 0:
    raise ValueError(f"regions too short for {passage_words}-word passages;"
                     " use fewer regions or shorter passages")
  rows: dict[str, list] = {"train": [], "dev": []}
  per_class = {}
  for label, class_regions in cut.items():
    class_rows = region_rows(label, class_regions, per_region)
    for split in rows:
      rows[split] += class_rows[split]
    per_class[label] = dict(words=sum(map(len, classes[label])),
                            **{split: len(r) for split, r in class_rows.items()})
  write_splits(out_dir, rows)
  summary = dict(train=len(rows["train"]), dev=len(rows["dev"]), labels=len(classes),
                 num_regions=num_regions, passage_words=passage_words,
                 per_region=per_region, classes=per_class, pretrain=pretrain)
  with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
    f.write(f"# {title} (t5x_like.task_builders.books_ood)\n\nPretrain on pretrain/ ("
            f"{sum(pretrain.values())} words: {', '.join(pretrain)}); none of the task's"
            f" text is in it. Each class is cut into {num_regions} regions of consecutive"
            f" words; even regions give train passages, odd ones dev passages, {per_region}"
            f" passages of {passage_words} words from every region: {len(rows['train'])}"
            f" train, {len(rows['dev'])} dev.\n\n| label | words | train | dev |\n"
            "|---|---|---|---|\n")
    for label, row in per_class.items():
      f.write(f"| {label} | {row['words']} | {row['train']} | {row['dev']} |\n")
  return summary


def make_unseen_task(out_dir: str, *, num_regions: int = 12, passage_words: int = 32,
                     books: Optional[Sequence[str]] = None) -> dict:
  """Attribution among `books` (default UNSEEN_BOOKS), pretrain/ = every other book."""
  books = list(books or UNSEEN_BOOKS)
  unknown = sorted(set(books) - set(corpus.book_names()))
  if unknown or len(books) < 2:
    raise ValueError(f"books={books}: need two or more of {corpus.book_names()}")
  classes = {author(b): [corpus.read_book(b).split()] for b in books}
  return _write_task(out_dir, classes, books, num_regions, passage_words,
                     f"Attribution among {len(books)} books not pretrained on")


def make_within_task(out_dir: str, *, num_regions: int = 12, passage_words: int = 32,
                     narrators: Sequence[str] = ("victor", "creature")) -> dict:
  """Who narrates a passage of Frankenstein (unseen: pretrain/ holds the other books
  not in UNSEEN_BOOKS, the same as make_unseen_task's)."""
  all_narrators = frankenstein_narrators(corpus.read_book("shelley_frankenstein"))
  unknown = sorted(set(narrators) - set(all_narrators))
  if unknown or len(narrators) < 2:
    raise ValueError(f"narrators={list(narrators)}: need two or more of {list(all_narrators)}")
  return _write_task(out_dir, {n: all_narrators[n] for n in narrators}, UNSEEN_BOOKS,
                     num_regions, passage_words,
                     "Who narrates a passage of Frankenstein, a book not pretrained on")
