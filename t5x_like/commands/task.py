"""`t5x-like task KIND --out DIR`: build a fine-tuning task.

  authorship     which author wrote a passage           from any text (--source SPEC, the
  acceptability  a sentence as written or corrupted     `train` forms): train/dev/test.csv
  coherence      two sentences consecutive or not       and stats.json; --per_class N
                 (t5x_like/task_builders/text_tasks.py)

  books          which of the eight books a passage is from; writes the task and the
                 pretraining text without its held-out passages
                 (t5x_like/task_builders/books.py)
  books-unseen   3-way attribution among Carroll, Shelley and Wells
  books-within   who narrates a Frankenstein passage, Victor or the creature

books-unseen and books-within: pretrain/ holds the other five books, none of the task's
(t5x_like/task_builders/books_ood.py). Each prints the counts as JSON.
"""

from __future__ import annotations

import json

from absl import flags

from t5x_like.command_flags import choose_subcommand, parse_flags_and_args
from t5x_like.errors import UserError

_OOD = ("3-way attribution among Carroll, Shelley and Wells",
        "who narrates a Frankenstein passage, Victor or the creature")
SUBCOMMANDS = {
    "authorship": "which author wrote a passage of any text source (t5x_like/"
                  "task_builders/text_tasks.py)",
    "acceptability": "a sentence as written, or with two neighbouring words swapped or a"
                     " function word replaced (CoLA-style)",
    "coherence": "are two sentences consecutive, or is the second from elsewhere in the"
                 " same document",
    "books": "writes the book task (which book a passage is from) and the pretraining text"
             " without its held-out passages (t5x_like/task_builders/books.py)",
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


TEXT_TASKS = ("authorship", "acceptability", "coherence")  # task_builders/text_tasks.KINDS


def _text_task_flags(argv: list[str]) -> flags.FlagValues:
  del argv
  fv = flags.FlagValues()
  flags.DEFINE_string("source", None, "the text: embedded[:BOOK,...], text:GLOB,"
                      " jsonl:GLOB[:FIELD] or tfds:NAME[/CONFIG][:SPLIT][@DATA_DIR][#FIELD]",
                      flag_values=fv)
  flags.DEFINE_string("out", None, "directory to write (train/dev/test.csv, stats.json)",
                      flag_values=fv)
  flags.DEFINE_integer("per_class", 0, "training examples per label (acceptability:"
                       " sentences, each as written and corrupted); 0 = all", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "picks the --per_class subset (dev and test do not"
                       " depend on it)", flag_values=fv)
  flags.DEFINE_integer("regions", 10, "regions per document; region r goes to train (r %"
                       " 5 < 3), dev (3) or test (4)", flag_values=fv)
  flags.DEFINE_integer("min_words", 6, "shortest usable sentence, in words", flag_values=fv)
  flags.DEFINE_integer("max_words", 40, "longest usable sentence, in words", flag_values=fv)
  flags.DEFINE_integer("passage_words", 32, "authorship: words per passage", flag_values=fv)
  flags.DEFINE_integer("min_distance", 20, "coherence: sentences between a first sentence"
                       " and its 'elsewhere' second, at least", flag_values=fv)
  flags.DEFINE_list("corruptions", ["swap", "replace"], "acceptability: swap and/or"
                    " replace", flag_values=fv)
  return fv


def main(argv: list[str]) -> int:
  which, argv = choose_subcommand("task", argv, SUBCOMMANDS, doc=__doc__)
  if which in TEXT_TASKS:
    fv, _ = parse_flags_and_args(f"task {which}", argv, _text_task_flags,
                                 required=("source", "out"), doc=SUBCOMMANDS[which],
                                 positionals="")
    from t5x_like.task_builders.text_tasks import build_text_task
    summary = build_text_task(
        which, fv.source, fv.out, per_class=fv.per_class, seed=fv.seed, regions=fv.regions,
        min_words=fv.min_words, max_words=fv.max_words, passage_words=fv.passage_words,
        min_distance=fv.min_distance, corruptions=fv.corruptions)
  elif which == "books":
    fv, _ = parse_flags_and_args("task books", argv, _books_flags, required=("out",),
                                 doc=SUBCOMMANDS["books"], positionals="")
    from t5x_like.task_builders.books import make_book_task
    summary = make_book_task(fv.out, num_blocks=fv.num_blocks, block_words=fv.block_words,
                             passage_words=fv.passage_words)
  else:
    fv, _ = parse_flags_and_args(f"task {which}", argv, _ood_flags, required=("out",),
                                 doc=f"{SUBCOMMANDS[which]} (t5x_like/task_builders/"
                                     "books_ood.py)",
                                 positionals="")
    from t5x_like.task_builders import books_ood
    make = {"books-unseen": books_ood.make_unseen_task,
            "books-within": books_ood.make_within_task}[which]
    try:
      summary = make(fv.out, num_regions=fv.num_regions, passage_words=fv.passage_words)
    except ValueError as e:
      raise UserError(str(e)) from None
  print(json.dumps(summary, indent=1))
  return 0
