"""The `t5x-like` command."""

from __future__ import annotations

import argparse
import json
import os
import sys

# glibc's malloc backs its large (mmap) allocations with transparent huge pages when
# this tunable is set at process start. XLA on CPU allocates each step's temporaries
# (gigabytes for BERT-base) afresh; with 4 KiB pages every step page-faults them in
# again (about 260,000 faults and 10% of a BERT-base step on CPU).
_HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def _cmd_models(args) -> int:
  """Prints every preset with its parameter count (from shapes, nothing allocated)."""
  from t5x_like.models import PRESETS, build_model, preset
  names = args.names or sorted(PRESETS)
  for name in names:
    cfg = preset(name)
    count = build_model(cfg).num_params()
    print(json.dumps(dict(preset=name, family=cfg.family, layers=cfg.num_layers,
                          d_model=cfg.d_model, heads=cfg.num_heads, params=count,
                          params_millions=round(count / 1e6, 1))))
  return 0


def _cmd_bench_data(args) -> int:
  """Tokens/s per core of an objective (plus packing) and of tokenization, as JSON."""
  from t5x_like.bench.data import bench_objective
  print(json.dumps(bench_objective(args.objective, length=args.length,
                                   batch_size=args.batch, steps=args.steps,
                                   repeats=args.repeats), indent=1))
  return 0


def _cmd_task_books(args) -> int:
  """Writes the book task (which book a passage is from) and the pretraining text without
  its held-out passages (t5x_like/finetune/books.py); prints the counts as JSON."""
  from t5x_like.finetune.books import make_book_task
  summary = make_book_task(args.out, num_blocks=args.num_blocks,
                           block_words=args.block_words, passage_words=args.passage_words)
  print(json.dumps(summary, indent=1))
  return 0


def build_parser() -> argparse.ArgumentParser:
  from t5x_like.bench.data import DEFAULT_LENGTHS
  from t5x_like.data import vocab_cli
  parser = argparse.ArgumentParser(prog="t5x-like", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  sub.add_parser("train", help="train a config: t5x-like train --config FILE[:ARG] --workdir"
                 " DIR [--config.KEY=VALUE ...] (see t5x_like/train/main.py)")
  sub.add_parser("plan", help="params, shardings, FLOPs, memory and time of a config on a"
                 " topology, without running it: t5x-like plan --config FILE[:ARG]"
                 " [--config.KEY=VALUE ...] [--topology v3-32 ...] [--json]"
                 " (see t5x_like/plan/cli.py)")
  sub.add_parser("infer", help="generate with, score by or fill masks with a trained model,"
                 " JSONL in and out: t5x-like infer --config FILE[:ARG] --checkpoint PATH"
                 " --input FILE.jsonl [--output FILE.jsonl] [--mode generate|score]"
                 " [--config.KEY=VALUE ...] (see t5x_like/infer/cli.py)")
  sub.add_parser("finetune", help="fine-tune a pretrained (or random) backbone on a CSV /"
                 " JSONL task: t5x-like finetune --config FILE[:ARG] --workdir DIR"
                 " [--config.KEY=VALUE ...] (see t5x_like/finetune/main.py)")
  models = sub.add_parser("models", help=_cmd_models.__doc__)
  models.add_argument("names", nargs="*", help="presets to show (default: all)")
  models.set_defaults(fn=_cmd_models)
  vocab_cli.add_parser(sub)
  task = sub.add_parser("task", help="build fine-tuning tasks").add_subparsers(
      dest="which", required=True)
  books = task.add_parser("books", help=_cmd_task_books.__doc__)
  books.add_argument("--out", required=True, help="directory to write")
  books.add_argument("--num_blocks", type=int, default=12,
                     help="blocks held out of pretraining per book (even: train, odd: dev)")
  books.add_argument("--block_words", type=int, default=500)
  books.add_argument("--passage_words", type=int, default=32)
  books.set_defaults(fn=_cmd_task_books)
  bench = sub.add_parser("bench", help="benchmarks: data (below); model, compile,"
                         " bert-vs-torch --config FILE[:ARG] [--config.KEY=VALUE ...]"
                         " (see t5x_like/bench/cli.py)").add_subparsers(dest="what",
                                                                        required=True)
  data = bench.add_parser("data", help=_cmd_bench_data.__doc__)
  data.add_argument("--objective", required=True, choices=sorted(DEFAULT_LENGTHS))
  data.add_argument("--length", type=int, default=None,
                    help="sequence length (default: the objective's usual one)")
  data.add_argument("--batch", type=int, default=64)
  data.add_argument("--steps", type=int, default=30, help="batches per timed run")
  data.add_argument("--repeats", type=int, default=5, help="timed runs (median reported)")
  data.set_defaults(fn=_cmd_bench_data)
  return parser


def _reexec_with_huge_pages() -> None:
  """Restarts this command (same PID, argv and environment) with _HUGE_PAGES_TUNABLE
  set, where glibc (2.35 or newer) supports it; T5X_LIKE_HUGE_PAGES=0 opts out."""
  tunables = os.environ.get("GLIBC_TUNABLES", "")
  if "glibc.malloc.hugetlb" in tunables or os.environ.get("T5X_LIKE_HUGE_PAGES") == "0":
    return
  try:
    name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
  except (ValueError, OSError, AttributeError):
    return
  if name != "glibc" or tuple(int(x) for x in version.split(".")[:2]) < (2, 35):
    return
  env = dict(os.environ, GLIBC_TUNABLES=":".join(filter(None, (tunables,
                                                                _HUGE_PAGES_TUNABLE))))
  os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main(argv=None) -> int:
  if argv is None:  # the console command, not an in-process call
    _reexec_with_huge_pages()
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] == ["train"]:  # absl / ml-collections flags: --config.key=value overrides
    from t5x_like.train import main as train_main
    return train_main.main(argv[1:])
  if argv[:1] == ["finetune"]:
    from t5x_like.finetune import main as finetune_main
    return finetune_main.main(argv[1:])
  if argv[:1] == ["plan"]:
    from t5x_like.plan import cli as plan_cli
    return plan_cli.main(argv[1:])
  if argv[:1] == ["infer"]:
    from t5x_like.infer import cli as infer_cli
    return infer_cli.main(argv[1:])
  if argv[:1] == ["bench"] and argv[1:2] != ["data"] and not {"-h", "--help"} & set(argv[1:2]):
    from t5x_like.bench import cli as bench_cli
    return bench_cli.main(argv[1:])
  args = build_parser().parse_args(argv)
  return args.fn(args)


if __name__ == "__main__":
  sys.exit(main())
