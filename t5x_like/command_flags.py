"""Parsing the absl / ml-collections flags of a `t5x-like` subcommand.

  fv = parse_flags("train", argv, make_flags, required=("config", "workdir"))
  if fv is None: return 2          # the reason was printed to stderr

make_flags(full_argv) -> FlagValues defines the command's flags; it receives the full
command line so that ml-collections reads --config.KEY=VALUE overrides from it (not
from sys.argv, which an in-process call does not set).
"""

from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

from absl import flags


def parse_flags(command: str, argv: Sequence[str],
                make_flags: Callable[[list[str]], flags.FlagValues],
                required: Sequence[str] = ("config",)) -> Optional[flags.FlagValues]:
  """The parsed flags of `t5x-like <command> argv...`, or None after printing why (a bad
  flag or config argument, or a `required` one missing)."""
  argv = [f"t5x-like {command}", *argv]
  fv = make_flags(argv)
  try:
    fv(argv)
  except (flags.Error, ValueError) as e:  # ValueError: the config file refused its argument
    print(f"t5x-like {command}: {e}", file=sys.stderr)
    return None
  missing = [f"--{name}" for name in required if fv[name].value in (None, "")]
  if missing:
    print(f"t5x-like {command}: {', '.join(missing)} required", file=sys.stderr)
    return None
  return fv
