"""The `t5x-like` command: one entry point for every subcommand.

train, plan, infer, finetune and bench model/compile/peer/bert-vs-torch take absl flags with
`--config FILE[:ARG]` and `--config.KEY=VALUE` overrides (t5x_like/command_flags.py);
models, vocab, task and bench data take argparse options. All of them answer -h/--help
with their flags and report a user error (t5x_like/errors.py) in one line with exit
status 2; `--debug` anywhere shows its traceback.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import json
import os
import sys
import traceback

from t5x_like import command_flags
from t5x_like.errors import USER_ERROR_EXIT, UserError

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
  """Tokens/s per core of an objective (plus packing) and of tokenization, as JSON;
  with --prepared, prepared corpora at --sizes (prepare, start-up, memory, tokens/s)."""
  if args.prepared:
    from t5x_like.bench.prepared import bench_prepared
    print(json.dumps(bench_prepared(sizes_mb=args.sizes, objective=args.objective,
                                    workers=args.workers, scratch=args.scratch), indent=1))
    return 0
  from t5x_like.bench.data import bench_objective
  print(json.dumps(bench_objective(args.objective, length=args.length,
                                   batch_size=args.batch, steps=args.steps,
                                   repeats=args.repeats), indent=1))
  return 0


def _cmd_bench_attention(args) -> int:
  """Every attention kernel of this device against a float32 reference (values and
  gradients, five masks, a bias; dropout statistics) and its time, as JSON."""
  from t5x_like.bench.attention import bench_attention
  try:
    result = bench_attention(batch=args.batch, length=args.length, heads=args.heads,
                             kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                             steps=args.steps, interpret_pallas=args.interpret_pallas)
  except ValueError as e:
    raise UserError(str(e)) from None
  print(json.dumps(result, indent=1))
  return 0


def _cmd_task_books(args) -> int:
  """Writes the book task (which book a passage is from) and the pretraining text without
  its held-out passages (t5x_like/finetune/books.py); prints the counts as JSON."""
  from t5x_like.finetune.books import make_book_task
  summary = make_book_task(args.out, num_blocks=args.num_blocks,
                           block_words=args.block_words, passage_words=args.passage_words)
  print(json.dumps(summary, indent=1))
  return 0


def _cmd_task_books_ood(args) -> int:
  """Writes an out-of-domain book task (t5x_like/finetune/books_ood.py): pretrain/ holds
  the books not in the task; prints the counts as JSON."""
  from t5x_like.finetune import books_ood
  make = {"books-unseen": books_ood.make_unseen_task,
          "books-within": books_ood.make_within_task}[args.which]
  try:
    summary = make(args.out, num_regions=args.num_regions, passage_words=args.passage_words)
  except ValueError as e:
    raise UserError(str(e)) from None
  print(json.dumps(summary, indent=1))
  return 0


# The absl / ml-collections commands (any config key overridable on the command line):
# name -> (module with main(argv), one-line summary). Their --help lists their flags.
FLAG_COMMANDS = {
    "train": ("t5x_like.commands.train", "pretrain a config: --config FILE[:ARG] --workdir DIR"
              " [--config.KEY=VALUE ...]; reruns resume"),
    "plan": ("t5x_like.commands.plan", "params, shardings, FLOPs, memory and time of a config on"
             " a topology, without running it: --config FILE[:ARG] [--topology v3-32 ...]"),
    "infer": ("t5x_like.commands.infer", "generate with, score by or fill masks with a trained"
              " model, JSONL in and out: --config FILE --checkpoint DIR --input FILE.jsonl"),
    "finetune": ("t5x_like.commands.finetune", "fine-tune a pretrained (or random) backbone on a"
                 " CSV / JSONL task: --config FILE[:ARG] --workdir DIR"),
}
BENCH_FLAG_COMMANDS = {
    "model": "compile and time the train step (and a decode step) of a config",
    "compile": "compile time of the train step at several depths (--layers 6,12,24)",
    "peer": "our train step against transformers' PyTorch model (BERT, GPT-2), eager and"
            " compiled",
    "bert-vs-torch": "our BERT step against transformers' BertForPreTraining",
}


class _OneLineErrors(argparse.ArgumentParser):
  """Usage errors in one line (not the usage block), exit status 2; subparsers inherit."""

  def error(self, message: str):
    self.exit(USER_ERROR_EXIT, f"{self.prog}: error: {message} (--help lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
  from t5x_like.data.pipeline import OBJECTIVES
  from t5x_like.commands import vocab as vocab_command
  parser = _OneLineErrors(
      prog="t5x-like", description=__doc__,
      epilog="`t5x-like COMMAND --help` shows a command's flags. --debug (anywhere) shows"
             " the traceback of an error.")
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  for name, (_, summary) in FLAG_COMMANDS.items():
    sub.add_parser(name, help=summary, add_help=False)
  models = sub.add_parser("models", help=_cmd_models.__doc__)
  models.add_argument("names", nargs="*", help="presets to show (default: all)")
  models.set_defaults(fn=_cmd_models)
  vocab_command.add_parser(sub)
  task = sub.add_parser("task", help="build fine-tuning tasks").add_subparsers(
      dest="which", required=True, metavar="TASK")
  books = task.add_parser("books", help=_cmd_task_books.__doc__)
  books.add_argument("--out", required=True, help="directory to write")
  books.add_argument("--num_blocks", type=int, default=12,
                     help="blocks held out of pretraining per book (even: train, odd: dev)")
  books.add_argument("--block_words", type=int, default=500)
  books.add_argument("--passage_words", type=int, default=32)
  books.set_defaults(fn=_cmd_task_books)
  for name, what in (("books-unseen", "3-way attribution among Carroll, Shelley and Wells"),
                     ("books-within", "who narrates a Frankenstein passage, Victor or the"
                      " creature")):
    ood = task.add_parser(name, help=f"{what}; pretrain/ holds the other five books,"
                          " none of the task's (t5x_like/finetune/books_ood.py)")
    ood.add_argument("--out", required=True, help="directory to write")
    ood.add_argument("--num_regions", type=int, default=12,
                     help="regions per class (even: train, odd: dev)")
    ood.add_argument("--passage_words", type=int, default=32)
    ood.set_defaults(fn=_cmd_task_books_ood)
  data_cmd = sub.add_parser("data", help="prepare corpora").add_subparsers(
      dest="which", required=True, metavar="STEP")
  data_cmd.add_parser("prepare", add_help=False,
                      help="tokenize a config's source once with Apache Beam into a prepared"
                      " corpus: --config FILE[:ARG] --out DIR [--runner ...]")
  bench = sub.add_parser("bench", help="benchmarks: data, model, attention, compile, peer,"
                         " bert-vs-torch"
                         ).add_subparsers(dest="what", required=True, metavar="BENCHMARK")
  data = bench.add_parser("data", help=_cmd_bench_data.__doc__)
  data.add_argument("--objective", required=True, choices=sorted(OBJECTIVES))
  data.add_argument("--length", type=int, default=None,
                    help="sequence length (default: the objective's usual one)")
  data.add_argument("--batch", type=int, default=64)
  data.add_argument("--steps", type=int, default=30, help="batches per timed run")
  data.add_argument("--repeats", type=int, default=5, help="timed runs (median reported)")
  numbers = lambda kind: lambda text: [kind(x) for x in text.split(",")]
  data.add_argument("--prepared", action="store_true",
                    help="bench prepared corpora (bench/prepared.py) instead")
  data.add_argument("--sizes", type=numbers(float), default=[50, 2000],
                    help="--prepared: synthetic corpus sizes in MB (default 50,2000)")
  data.add_argument("--workers", type=numbers(int), default=[1, 2],
                    help="--prepared: Beam worker counts to prepare with (default 1,2)")
  data.add_argument("--scratch", default=None,
                    help="--prepared: folder for the scratch corpora (default: the temp dir)")
  data.set_defaults(fn=_cmd_bench_data)
  attention = bench.add_parser("attention", help=_cmd_bench_attention.__doc__)
  attention.add_argument("--batch", type=int, default=4)
  attention.add_argument("--length", type=int, default=512)
  attention.add_argument("--heads", type=int, default=16)
  attention.add_argument("--kv_heads", type=int, default=0, help="default: --heads (MHA)")
  attention.add_argument("--head_dim", type=int, default=64)
  attention.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16",
                                                                 "float32"))
  attention.add_argument("--steps", type=int, default=10, help="timed calls (median)")
  attention.add_argument("--interpret_pallas", action="store_true",
                         help="also run the Pallas TPU kernel in interpret mode (slow)")
  attention.set_defaults(fn=_cmd_bench_attention)
  for name, summary in BENCH_FLAG_COMMANDS.items():
    bench.add_parser(name, help=summary + ": --config FILE[:ARG] [--config.KEY=VALUE ...]",
                     add_help=False)
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


def _pci_vendor_present(vendor: str) -> bool:
  """Whether a PCI device of `vendor` ('0x1ae0': Google's TPUs) is on this host."""
  root = "/sys/bus/pci/devices"
  try:
    names = os.listdir(root)
  except OSError:
    return False
  for name in names:
    try:
      with open(os.path.join(root, name, "vendor")) as f:
        if f.read().strip() == vendor:
          return True
    except OSError:
      continue
  return False


def _leave_out_absent_tpu() -> None:
  """Sets JAX_PLATFORMS=cpu where libtpu is installed (the tpu and test extras) but the
  host has no TPU chip and no NVIDIA GPU, and JAX_PLATFORMS is unset: jax would otherwise
  start libtpu's backend, which prints a page of errors before jax falls back to the CPU.
  The PCI check is the one jax's hardware_utils makes; TPU device files (/dev/accel*,
  /dev/vfio: a container that hides /sys) also count as a TPU. Compiling for a TPU
  slice (`plan --compile`) needs no TPU backend."""
  if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
    return
  if not accelerator_present():
    os.environ["JAX_PLATFORMS"] = "cpu"


def accelerator_present() -> bool:
  """A TPU (Google's PCI vendor 0x1ae0, or /dev/accel*, /dev/vfio) or an NVIDIA GPU (PCI
  vendor 0x10de) on this host."""
  return (_pci_vendor_present("0x1ae0") or _pci_vendor_present("0x10de")
          or bool(glob.glob("/dev/accel*")) or os.path.exists("/dev/vfio"))


def main(argv=None) -> int:
  """Runs `t5x-like argv...`; the exit status: 0 done, 2 a user error (one line on
  stderr, no traceback unless --debug), 1 a failure, 130 interrupted."""
  if argv is None:  # the console command, not an in-process call
    _reexec_with_huge_pages()
    _leave_out_absent_tpu()
  argv = sys.argv[1:] if argv is None else list(argv)
  debug = command_flags.debug_requested(argv)
  argv = [a for a in argv if a != "--debug"]
  command = " ".join(["t5x-like", *argv[:1]])
  try:
    return _dispatch(argv)
  except command_flags.HelpShown:
    return 0
  except UserError as e:
    command_flags.print_error(command, e, debug)
    return USER_ERROR_EXIT
  except KeyboardInterrupt as e:
    if debug:
      traceback.print_exception(e)
    print(f"{command}: interrupted", file=sys.stderr, flush=True)
    return 130


def _dispatch(argv: list[str]) -> int:
  if argv[:2] == ["data", "prepare"]:
    from t5x_like.commands import prepare as prepare_command
    return prepare_command.main(argv[2:])
  if argv[:1] and argv[0] in FLAG_COMMANDS:
    module = importlib.import_module(FLAG_COMMANDS[argv[0]][0])
    return module.main(argv[1:])
  if argv[:1] == ["bench"] and argv[1:2] and argv[1] in BENCH_FLAG_COMMANDS:
    from t5x_like.commands import bench as bench_command
    return bench_command.main(argv[1:])
  try:
    args = build_parser().parse_args(argv)
  except SystemExit as e:  # argparse: --help (0) or a usage error (2, printed)
    return int(e.code or 0)
  return args.fn(args)


if __name__ == "__main__":
  sys.exit(main())
