"""`t5x-like vocab train|encode|decode`: build and check sentencepiece vocabularies.

  t5x-like vocab train --source embedded --vocab-size 8192 --family bert --out DIR
  t5x-like vocab encode --family t5 "Some text."          (or --vocab DIR_OR_MODEL)
  t5x-like vocab decode --family t5 37 5 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from t5x_like.data.vocab import VOCAB_FAMILIES


def add_parser(subparsers) -> None:
  """Registers the `vocab` command on the main parser's subparsers."""
  vocab = subparsers.add_parser("vocab", help="train, inspect and use sentencepiece vocabularies")
  sub = vocab.add_subparsers(dest="vocab_command", required=True)

  train = sub.add_parser("train", help=_cmd_train.__doc__)
  train.add_argument("--source", required=True,
                     help="embedded | text:GLOB | jsonl:GLOB[:FIELD] |"
                          " tfds:NAME[/CONFIG][:SPLIT][@DATA_DIR][#FIELD]")
  train.add_argument("--vocab-size", required=True, type=_vocab_size,
                     help="ids in total (t5: including the 100 sentinels)")
  train.add_argument("--family", required=True, choices=VOCAB_FAMILIES)
  train.add_argument("--out", required=True, type=_out_dir, help="directory for spm.model")
  train.add_argument("--model-type", default="unigram", choices=("unigram", "bpe"))
  train.add_argument("--seed", type=int, default=0)
  train.add_argument("--threads", type=_positive_int, default=2,
                     help="trainer threads (the model depends on it; default 2)")
  train.add_argument("--max-sentences", type=_positive_int, default=2_000_000)
  train.set_defaults(fn=_cmd_train)

  for name, fn in (("encode", _cmd_encode), ("decode", _cmd_decode)):
    p = sub.add_parser(name, help=fn.__doc__)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--vocab", help="a .model file or a directory with spm.model")
    which.add_argument("--family", choices=VOCAB_FAMILIES, help="the shipped default vocabulary")
    if name == "encode":
      p.add_argument("text", nargs="+", help="texts to encode (one JSON line each)")
    else:
      p.add_argument("ids", nargs="+", type=int, help="token ids")
    p.set_defaults(fn=fn)


# ------------------------------------------------------------------ argument types
def _int_at_least(minimum: int, why: str):
  """An argparse type: an integer >= minimum, else an error saying `why`."""

  def parse(value: str) -> int:
    try:
      n = int(value)
    except ValueError:
      raise argparse.ArgumentTypeError(f"must be an integer, got {value!r}") from None
    if n < minimum:
      raise argparse.ArgumentTypeError(f"must be {why}, got {n}")
    return n

  return parse


_vocab_size = _int_at_least(300, "at least 300 (256 byte pieces + specials)")
_positive_int = _int_at_least(1, "positive")


def _out_dir(value: str) -> str:
  if os.path.exists(value) and not os.path.isdir(value):
    raise argparse.ArgumentTypeError(f"{value!r} exists and is not a directory")
  return value


# ------------------------------------------------------------------ commands
def _cmd_train(args) -> int:
  """Trains a vocabulary on a source and writes OUT/spm.model and OUT/vocab.json."""
  from t5x_like.data.sources import source_from_spec
  from t5x_like.data.vocab import train_vocab
  start = time.perf_counter()
  source = source_from_spec(args.source)  # a DataSourceError names the spec and path
  try:
    vocab = train_vocab(iter(source), vocab_size=args.vocab_size, family=args.family,
                        out_dir=args.out, model_type=args.model_type, seed=args.seed,
                        num_threads=args.threads, max_sentences=args.max_sentences)
  except RuntimeError as e:  # sentencepiece: e.g. "Vocabulary size too high"
    note = " (the t5 sentencepiece model holds vocab_size - 100 pieces)" if args.family == "t5" else ""
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


def _cmd_encode(args) -> int:
  """Prints the ids and pieces of each text, and whether it decodes back exactly."""
  vocab = _load(args, "encode")
  if vocab is None:
    return 2
  for text in args.text:
    ids = vocab.encode(text)
    print(json.dumps(dict(ids=ids.tolist(), pieces=[vocab.piece(i) for i in ids],
                          round_trip=vocab.decode(ids) == text), ensure_ascii=False))
  return 0


def _cmd_decode(args) -> int:
  """Prints the text of a list of ids."""
  vocab = _load(args, "decode")
  if vocab is None:
    return 2
  try:
    print(vocab.decode(args.ids))
  except ValueError as e:
    print(f"t5x-like vocab decode: error: argument ids: {e}", file=sys.stderr)
    return 2
  return 0
