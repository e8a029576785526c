"""`t5x-like vocab train|encode|decode`: build and check sentencepiece vocabularies.

  t5x-like vocab train --source embedded --vocab-size 8192 --family bert --out DIR
  t5x-like vocab encode --family t5 "Some text."          (or --vocab DIR_OR_MODEL)
  t5x-like vocab decode --family t5 37 5 1
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import flags

from t5x_like.command_flags import FlagError, choose_subcommand, parse_flags_and_args
from t5x_like.data.vocab import VOCAB_FAMILIES



# ------------------------------------------------------------------ flags
class _IntAtLeast(flags.ArgumentParser):
  """An integer >= minimum, else an error saying `why`."""

  def __init__(self, minimum: int, why: str):
    self.minimum, self.why = minimum, why

  def parse(self, argument) -> int:
    try:
      n = int(argument)
    except (TypeError, ValueError):
      raise ValueError(f"must be an integer, got {argument!r}") from None
    if n < self.minimum:
      raise ValueError(f"must be {self.why}, got {n}")
    return n

  def flag_type(self) -> str:
    return "int"


def _train_flags(argv: list[str]) -> flags.FlagValues:
  del argv
  fv = flags.FlagValues()
  flags.DEFINE_string("source", None, "embedded | text:GLOB | jsonl:GLOB[:FIELD] |"
                      " tfds:NAME[/CONFIG][:SPLIT][@DATA_DIR][#FIELD]", flag_values=fv)
  flags.DEFINE(_IntAtLeast(300, "at least 300 (256 byte pieces + specials)"), "vocab-size",
               None, "ids in total (t5: including the 100 sentinels)", flag_values=fv)
  flags.DEFINE_enum("family", None, list(VOCAB_FAMILIES), "the vocabulary's family",
                    flag_values=fv)
  flags.DEFINE_string("out", None, "directory for spm.model", flag_values=fv)
  flags.DEFINE_enum("model-type", "unigram", ["unigram", "bpe"], "sentencepiece model type",
                    flag_values=fv)
  flags.DEFINE_integer("seed", 0, "sampling seed", flag_values=fv)
  flags.DEFINE(_IntAtLeast(1, "positive"), "threads", 2,
               "trainer threads (the model depends on it; default 2)", flag_values=fv)
  flags.DEFINE(_IntAtLeast(1, "positive"), "max-sentences", 2_000_000,
               "sentences sampled for training", flag_values=fv)
  return fv


def _use_flags(argv: list[str]) -> flags.FlagValues:
  del argv
  fv = flags.FlagValues()
  flags.DEFINE_string("vocab", None, "a .model file or a directory with spm.model",
                      flag_values=fv)
  flags.DEFINE_enum("family", None, list(VOCAB_FAMILIES), "the shipped default vocabulary",
                    flag_values=fv)
  return fv


SUBCOMMANDS = {
    "train": "trains a vocabulary on a source and writes OUT/spm.model and OUT/vocab.json",
    "encode": "prints the ids and pieces of each text, and whether it decodes back exactly",
    "decode": "prints the text of a list of ids",
}


def main(argv: list[str]) -> int:
  which, argv = choose_subcommand("vocab", argv, SUBCOMMANDS, doc=__doc__)
  if which == "train":
    fv, _ = parse_flags_and_args(
        "vocab train", argv, _train_flags, required=("source", "vocab-size", "family", "out"),
        doc=SUBCOMMANDS["train"], positionals="")
    if os.path.exists(fv.out) and not os.path.isdir(fv.out):
      raise FlagError(f"--out={fv.out}: exists and is not a directory")
    return _cmd_train(fv)
  what = "TEXT" if which == "encode" else "ID"
  doc = (SUBCOMMANDS[which] + f"; {'texts' if which == 'encode' else 'ids'}: "
         f"{what} ... (one or more), with --vocab or --family (one of them)")
  fv, args = parse_flags_and_args(f"vocab {which}", argv, _use_flags, doc=doc,
                                  positionals=what, min_positionals=1)
  if (fv.vocab is None) == (fv.family is None):
    raise FlagError("one of --vocab, --family is required (not both)")
  if which == "encode":
    return _cmd_encode(fv, args)
  try:
    ids = [int(a) for a in args]
  except ValueError:
    raise FlagError(f"ids: expected integers, got {' '.join(args)!r}") from None
  return _cmd_decode(fv, ids)


# ------------------------------------------------------------------ commands
def _cmd_train(args) -> int:  # args: the flags
  """Trains a vocabulary on a source and writes OUT/spm.model and OUT/vocab.json."""
  from t5x_like.data.sources import source_from_spec
  from t5x_like.data.vocab import train_vocab
  start = time.perf_counter()
  source = source_from_spec(args.source)  # a DataSourceError names the spec and path
  try:
    vocab = train_vocab(iter(source), vocab_size=args['vocab-size'].value, family=args.family,
                        out_dir=args.out, model_type=args['model-type'].value, seed=args.seed,
                        num_threads=args.threads, max_sentences=args['max-sentences'].value)
  except RuntimeError as e:  # sentencepiece: e.g. "Vocabulary size too high"
    note = (" (the t5 sentencepiece model holds vocab_size - 100 pieces)"
            if args.family == "t5" else "")
    print(f"t5x-like vocab train: error: argument --vocab-size: {e}{note}", file=sys.stderr)
    return 2
  print(json.dumps(dict(path=vocab.path, family=vocab.family, vocab_size=vocab.vocab_size,
                        model_bytes=len(vocab.model_bytes),
                        seconds=round(time.perf_counter() - start, 2),
                        source=source.stats.as_dict())))
  return 0


def _load(args, command: str):
  """The vocabulary named by --vocab / --family, or None after printing the error."""
  from t5x_like.data.vocab import default_vocab, load_vocab
  try:
    return load_vocab(args.vocab) if args.vocab else default_vocab(args.family)
  except (OSError, ValueError, RuntimeError) as e:
    print(f"t5x-like vocab {command}: error: argument --vocab: {e}", file=sys.stderr)
    return None


def _cmd_encode(args, texts: list[str]) -> int:
  """Prints the ids and pieces of each text, and whether it decodes back exactly."""
  vocab = _load(args, "encode")
  if vocab is None:
    return 2
  for text in texts:
    ids = vocab.encode(text)
    print(json.dumps(dict(ids=ids.tolist(), pieces=[vocab.piece(i) for i in ids],
                          round_trip=vocab.decode(ids) == text), ensure_ascii=False))
  return 0


def _cmd_decode(args, ids: list[int]) -> int:
  """Prints the text of a list of ids."""
  vocab = _load(args, "decode")
  if vocab is None:
    return 2
  try:
    print(vocab.decode(ids))
  except ValueError as e:
    print(f"t5x-like vocab decode: error: argument ids: {e}", file=sys.stderr)
    return 2
  return 0
