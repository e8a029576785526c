"""The book task: which embedded book a passage comes from, on text held out of pretraining.

  make_book_task("workdir/books")  ->  workdir/books/
      pretrain/<book>.txt   each book without its held-out blocks, one line per
                            paragraph (unwrap): pretrain on these
                            (`--config.data.source='text:workdir/books/pretrain/*.txt'`)
      train.csv, dev.csv    passages of `passage_words` words from the held-out blocks
                            (spread over the book), columns text,label (label = the
                            author's surname); even blocks train, odd blocks dev, so no
                            block gives passages to both
      README.md             what was held out and how many passages each split has

Every book gives the same number of passages (a balanced 8-way task: chance is 1/8),
and no passage text occurs in pretrain/ (tests check it). The shipped vocabularies
were trained on the whole corpus; pretrained and random-initialised models share them.
"""

from __future__ import annotations

import csv
import os
from typing import Optional, Sequence

from t5x_like import corpus
from t5x_like.corpus import unwrap


def author(book: str) -> str:
  """'austen_pride_and_prejudice' -> 'austen' (the label)."""
  return book.split("_", 1)[0]


def split_book(text: str, num_blocks: int, block_words: int) -> tuple[str, list[list[str]]]:
  """(the text without its held-out blocks, the words of each block).

  `num_blocks` blocks of about `block_words` words (whole lines), spread evenly over
  the book, are held out; the rest, in order, is the pretraining text.
  """
  lines = text.splitlines(keepends=True)
  counts = [len(line.split()) for line in lines]
  total = sum(counts)
  if num_blocks * block_words * 2 > total:
    raise ValueError(f"a book of {total} words cannot hold out {num_blocks} blocks of"
                     f" {block_words} words (at most half of it)")
  starts = [int((b + 0.5) * total / num_blocks - block_words / 2) for b in range(num_blocks)]
  held = [False] * len(lines)
  blocks: list[list[str]] = [[] for _ in range(num_blocks)]
  position, block = 0, 0
  for i, line in enumerate(lines):
    if block < num_blocks and position >= starts[block]:
      held[i] = True
      blocks[block] += line.split()
      if len(blocks[block]) >= block_words:
        block += 1
    position += counts[i]
  pretrain = "".join(line for line, h in zip(lines, held) if not h)
  return pretrain, blocks


def passages(words: Sequence[str], passage_words: int) -> list[str]:
  """Consecutive non-overlapping passages of exactly `passage_words` words."""
  return [" ".join(words[i:i + passage_words])
          for i in range(0, len(words) - passage_words + 1, passage_words)]


def region_rows(label: str, region_passages: Sequence[Sequence[str]],
                per_region: int) -> dict[str, list[tuple[str, str]]]:
  """{'train': [(passage, label)...], 'dev': [...]}: the first `per_region` passages of
  each region; even regions train, odd regions dev, so no region gives passages to both."""
  rows: dict[str, list] = {"train": [], "dev": []}
  for r, region in enumerate(region_passages):
    rows["train" if r % 2 == 0 else "dev"] += [(p, label) for p in region[:per_region]]
  return rows


def write_splits(out_dir: str, rows: dict[str, list[tuple[str, str]]]) -> None:
  """out_dir/train.csv and out_dir/dev.csv (columns text,label) from region_rows' form."""
  for split, split_rows in rows.items():
    with open(os.path.join(out_dir, f"{split}.csv"), "w", encoding="utf-8", newline="") as f:
      writer = csv.writer(f)
      writer.writerow(["text", "label"])
      writer.writerows(split_rows)


def make_book_task(out_dir: str, *, num_blocks: int = 12, block_words: int = 500,
                   passage_words: int = 32, books: Optional[Sequence[str]] = None) -> dict:
  """Writes the task (module docstring) under out_dir; returns its counts.

  Per book, `num_blocks` blocks of `block_words` words spread over the book are held
  out of pretraining and cut into passages of `passage_words` words; even blocks give
  training passages, odd blocks dev passages (so train and dev never share a block).
  """
  if num_blocks < 2:
    raise ValueError(f"num_blocks={num_blocks}: need at least one train and one dev block")
  books = list(books or corpus.book_names())
  os.makedirs(os.path.join(out_dir, "pretrain"), exist_ok=True)
  rows: dict[str, list] = {"train": [], "dev": []}
  per_book = {}
  for book in books:
    pretrain, blocks = split_book(corpus.read_book(book), num_blocks, block_words)
    with open(os.path.join(out_dir, "pretrain", f"{book}.txt"), "w", encoding="utf-8") as f:
      f.write(unwrap(pretrain))
    label = author(book)
    # The same number of passages from every block keeps the classes balanced.
    per_block = min(len(block) for block in blocks) // passage_words
    book_rows = region_rows(label, [passages(b, passage_words) for b in blocks], per_block)
    for split in rows:
      rows[split] += book_rows[split]
    per_book[book] = dict(label=label, pretrain_words=len(pretrain.split()),
                          **{split: len(r) for split, r in book_rows.items()})
  write_splits(out_dir, rows)
  summary = dict(train=len(rows["train"]), dev=len(rows["dev"]), labels=len(books),
                 num_blocks=num_blocks, block_words=block_words, passage_words=passage_words,
                 books=per_book)
  with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
    f.write("# The book task (t5x_like.task_builders.books)\n\nWhich book a passage comes from."
            f" {num_blocks} blocks of {block_words} words spread over each book are held"
            f" out of pretrain/; even blocks give train passages, odd ones dev passages, of"
            f" {passage_words} words: {len(rows['train'])} train, {len(rows['dev'])} dev."
            "\n\n| book | label | pretrain words | train | dev |\n|---|---|---|---|---|\n")
    for book, row in per_book.items():
      f.write(f"| {book} | {row['label']} | {row['pretrain_words']} | {row['train']} |"
              f" {row['dev']} |\n")
  return summary
