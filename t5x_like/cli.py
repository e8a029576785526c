"""The `t5x-like` command: one entry point for every subcommand.

Every command takes absl flags (t5x_like/command_flags.py); those with a config (train,
plan, infer, finetune, data prepare, bench model/compile/peer/bert-vs-torch) take
`--config FILE[:ARG]` and `--config.KEY=VALUE` overrides. All of them answer -h/--help
with their flags and report a user error (t5x_like/errors.py) in one line with exit
status 2; `--debug` anywhere shows its traceback.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import sys
import traceback

from t5x_like import command_flags, gpu_flags
from t5x_like.errors import EXIT_USER_ERROR, UserError

# glibc's malloc backs its large (mmap) allocations with transparent huge pages when
# this tunable is set at process start. XLA on CPU allocates each step's temporaries
# (gigabytes for BERT-base) afresh; with 4 KiB pages every step page-faults them in
# again (about 260,000 faults and 10% of a BERT-base step on CPU).
_HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


# Every command takes absl flags (ml-collections config flags where it has a config),
# parsed by command_flags.parse_flags: name -> (module with main(argv), one-line summary).
# `t5x-like COMMAND --help` lists a command's flags (or its subcommands).
COMMANDS = {
    "train": ("t5x_like.commands.train", "pretrain a config: --config FILE[:ARG] --workdir DIR"
              " [--config.KEY=VALUE ...]; reruns resume"),
    "supervise": ("t5x_like.commands.supervise", "run N processes of train (or finetune)"
                  " on this machine, restarting all when one is lost: --num_processes=N"
                  " [--max_restarts=R] -- train FLAGS..."),
    "plan": ("t5x_like.commands.plan", "params, shardings, FLOPs, memory and time of a config on"
             " a topology, without running it: --config FILE[:ARG] [--topology v3-32 ...]"),
    "infer": ("t5x_like.commands.infer", "generate with, score by or fill masks with a trained"
              " model, JSONL in and out: --config FILE --checkpoint DIR --input FILE.jsonl"),
    "finetune": ("t5x_like.commands.finetune", "fine-tune a pretrained (or random) backbone on a"
                 " CSV / JSONL task: --config FILE[:ARG] --workdir DIR"),
    "finetune-suite": ("t5x_like.commands.finetune_suite", "fine-tune every task of a"
                       " benchmark (GLUE, SuperGLUE, SQuAD) in turn, resumably; one table:"
                       " --config configs/glue.py --workdir DIR [--init CHECKPOINT]"),
    "models": ("t5x_like.commands.models", "print every preset with its parameter count (from"
               " shapes, nothing allocated): [NAME ...]"),
    "vocab": ("t5x_like.commands.vocab", "train, inspect and use sentencepiece vocabularies:"
              " train | encode | decode"),
    "task": ("t5x_like.commands.task", "build fine-tuning tasks: books | books-unseen |"
             " books-within --out DIR"),
    "data": ("t5x_like.commands.prepare", "prepare corpora: prepare --config FILE[:ARG] --out"
             " DIR [--runner ...] tokenizes a config's source once with Apache Beam"),
    "bench": ("t5x_like.commands.bench", "benchmarks: data, model, attention, compile, peer, gpu,"
              " bert-vs-torch"),
}
DATA_STEPS = {"prepare": "tokenize a config's source once with Apache Beam into a prepared"
                         " corpus: --config FILE[:ARG] --out DIR [--runner ...]"}


def usage() -> str:
  """The top-level help: this module's docstring and one line per command."""
  width = max(len(name) for name in COMMANDS)
  lines = ["usage: t5x-like COMMAND [flags]", "", __doc__.strip(), "", "commands:"]
  lines += [f"    {name.ljust(width)}  {summary}" for name, (_, summary) in COMMANDS.items()]
  lines += ["", "`t5x-like COMMAND --help` shows a command's flags. --debug (anywhere) shows"
            " the traceback of an error."]
  return "\n".join(lines)


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
  # The interpreter's own command line (sys.orig_argv), not sys.argv: a start as
  # `python -m t5x_like.cli` or `python -c` restarts the same way, options included.
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def _leave_out_absent_tpu() -> None:
  """Sets JAX_PLATFORMS=cpu where libtpu is installed (the tpu and test extras) but the
  host has no TPU chip and no NVIDIA GPU, and JAX_PLATFORMS is unset: jax would otherwise
  start libtpu's backend, which prints a page of errors before jax falls back to the CPU.
  The PCI check is the one jax's hardware_utils makes; device files (/dev/accel*,
  /dev/vfio for a TPU, /dev/nvidia0, ... for a GPU: a container that hides /sys) count
  too. Compiling for a TPU slice (`plan --compile`) needs no TPU backend."""
  if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
    return
  if not accelerator_present():
    os.environ["JAX_PLATFORMS"] = "cpu"


def _set_gpu_xla_flags() -> None:
  """Adds gpu_flags' XLA flags to XLA_FLAGS on a host with an NVIDIA GPU (before jax
  is imported, which reads XLA_FLAGS once)."""
  os.environ.update(gpu_flags.with_gpu_flags(os.environ,
                                             gpu_present=gpu_flags.nvidia_gpu_present()))


def accelerator_present(pci_root: str = gpu_flags.PCI_DEVICES, dev_root: str = "/dev") -> bool:
  """A TPU (Google's PCI vendor 0x1ae0, or dev_root/accel*, dev_root/vfio) or an NVIDIA
  GPU (gpu_flags.nvidia_gpu_present: PCI vendor 0x10de or dev_root/nvidia0, ...) on this
  host; pci_root lists the PCI devices (/sys/bus/pci/devices)."""
  return (gpu_flags.pci_vendor_present("0x1ae0", pci_root)
          or bool(glob.glob(os.path.join(glob.escape(dev_root), "accel*")))
          or os.path.exists(os.path.join(dev_root, "vfio"))
          or gpu_flags.nvidia_gpu_present(pci_root, dev_root))


def main(argv=None) -> int:
  """Runs `t5x-like argv...`; the exit status: 0 done, 2 a user error (one line on
  stderr, no traceback unless --debug), 1 a failure, 130 interrupted."""
  if argv is None:  # the console command, not an in-process call
    _reexec_with_huge_pages()
    _leave_out_absent_tpu()
    _set_gpu_xla_flags()
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
    return EXIT_USER_ERROR
  except KeyboardInterrupt as e:
    if debug:
      traceback.print_exception(e)
    print(f"{command}: interrupted", file=sys.stderr, flush=True)
    return 130


def _dispatch(argv: list[str]) -> int:
  if not argv or argv[0] in command_flags.HELP_FLAGS:
    if not argv:
      raise command_flags.FlagError("a command is required: one of " + ", ".join(COMMANDS)
                                    + " (t5x-like --help lists them)")
    print(usage())
    return 0
  if argv[0] not in COMMANDS:
    raise command_flags.FlagError(f"invalid choice: {argv[0]!r} (choose from"
                                  f" {', '.join(COMMANDS)}; t5x-like --help lists them)")
  if argv[0] == "data":
    step, rest = command_flags.choose_subcommand("data", argv[1:], DATA_STEPS)
    del step  # prepare, the only step
    argv = ["data", *rest]
  module = importlib.import_module(COMMANDS[argv[0]][0])
  return module.main(argv[1:])


if __name__ == "__main__":
  sys.exit(main())
