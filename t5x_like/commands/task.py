"""`t5x-like task books|books-unseen|books-within --out DIR`: build a fine-tuning task.

  books          which of the eight books a passage is from; writes the task and the
                 pretraining text without its held-out passages (t5x_like/finetune/books.py)
  books-unseen   3-way attribution among Carroll, Shelley and Wells
  books-within   who narrates a Frankenstein passage, Victor or the creature

books-unseen and books-within: pretrain/ holds the other five books, none of the task's
(t5x_like/finetune/books_ood.py). Each prints the counts as JSON.
"""

from __future__ import annotations

import json

from absl import flags

from t5x_like.command_flags import choose_subcommand, parse_flags_and_args
from t5x_like.errors import UserError

_OOD = ("3-way attribution among Carroll, Shelley and Wells",
        "who narrates a Frankenstein passage, Victor or the creature")
SUBCOMMANDS = {
    "books": "writes the book task (which book a passage is from) and the pretraining text"
             " without its held-out passages (t5x_like/finetune/books.py)",
    "books-unseen": f"{_OOD[0]}; pretrain/ holds the other five books, none of the task's",
    "books-within": f"{_OOD[1]}; pretrain/ holds the other five books, none of the task's",
}


def _books_flags(argv: list[str]) -> flags.FlagValues:
  del argv
  fv = flags.FlagValues()
  flags.DEFINE_string("out", None, "directory to write", flag_values=fv)
  flags.DEFINE_integer("num_blocks", 12, "blocks held out of pretraining per book (even:"
                       " train, odd: dev)", flag_values=fv)
  flags.DEFINE_integer("block_words", 500, "words per held-out block", flag_values=fv)
  flags.DEFINE_integer("passage_words", 32, "words per passage", flag_values=fv)
  return fv


def _ood_flags(argv: list[str]) -> flags.FlagValues:
  del argv
  fv = flags.FlagValues()
  flags.DEFINE_string("out", None, "directory to write", flag_values=fv)
  flags.DEFINE_integer("num_regions", 12, "regions per class (even: train, odd: dev)",
                       flag_values=fv)
  flags.DEFINE_integer("passage_words", 32, "words per passage", flag_values=fv)
  return fv


def main(argv: list[str]) -> int:
  which, argv = choose_subcommand("task", argv, SUBCOMMANDS, doc=__doc__)
  if which == "books":
    fv, _ = parse_flags_and_args("task books", argv, _books_flags, required=("out",),
                                 doc=SUBCOMMANDS["books"], positionals="")
    from t5x_like.finetune.books import make_book_task
    summary = make_book_task(fv.out, num_blocks=fv.num_blocks, block_words=fv.block_words,
                             passage_words=fv.passage_words)
  else:
    fv, _ = parse_flags_and_args(f"task {which}", argv, _ood_flags, required=("out",),
                                 doc=SUBCOMMANDS[which] + " (t5x_like/finetune/books_ood.py)",
                                 positionals="")
    from t5x_like.finetune import books_ood
    make = {"books-unseen": books_ood.make_unseen_task,
            "books-within": books_ood.make_within_task}[which]
    try:
      summary = make(fv.out, num_regions=fv.num_regions, passage_words=fv.passage_words)
    except ValueError as e:
      raise UserError(str(e)) from None
  print(json.dumps(summary, indent=1))
  return 0
