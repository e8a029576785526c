"""Parsing the absl / ml-collections flags of a `t5x-like` subcommand.

  fv = parse_flags("train", argv, make_flags, required=("config", "workdir"), doc=__doc__)

make_flags(full_argv) -> FlagValues defines the command's flags; it receives the full
command line so that ml-collections reads --config.KEY=VALUE overrides from it (not
from sys.argv, which an in-process call does not set).

-h / --help / --helpshort / --helpfull print the command's usage and flags and raise
HelpShown (the command exits 0). Every mistake raises FlagError (a UserError: one line,
exit 2): an unknown flag, a bad value, a missing required flag, a config file that does
not exist or fails to load, and a --config.KEY override naming a key the config does
not have (with the closest known keys). Config files are read before absl parses the
flags, so that ml-collections never meets a key it cannot set.

The sections of OPEN_SECTIONS (model.overrides: ModelConfig fields) take any field of
their dataclass, which the config file sets only some of: `--config.model.overrides.
FIELD=VALUE` is parsed here, by the field's type as ml-collections parses a key's, and
set after absl's parse; a name that is no field is refused with the closest fields.
The sections of FREE_SECTIONS (data.options: the objective's options) take any name:
a key the config file has is parsed by its type, a new one is kept as text, which
validation types and checks against the objective (train/config_check.py), as the
objective is known only then.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import os
import re
import sys
import traceback
import types
import typing
from typing import Any, Callable, NamedTuple, Optional, Sequence

import ml_collections
from absl import flags

from t5x_like.errors import UserError

HELP_FLAGS = ("-h", "--help", "--helpshort", "--helpfull")

# Config sections whose keys are the fields of a dataclass: dotted section -> (module,
# class), imported only when a flag names the section (t5x_like.models imports jax).
OPEN_SECTIONS = {
    "model.overrides": ("t5x_like.models.config", "ModelConfig"),
    "init.model_overrides": ("t5x_like.models.config", "ModelConfig"),  # finetune
}
# Config sections whose keys depend on another key (data.options on data.objective).
FREE_SECTIONS = ("data.options",)
# The absl parsers ml-collections gives a key of each type (config_flags).
_FIELD_PARSERS = {int: flags.IntegerParser(), float: flags.FloatParser(),
                  bool: flags.BooleanParser(), str: flags.ArgumentParser()}


class FlagError(UserError):
  """A bad command line; the message names the flag or the config key."""


class HelpShown(Exception):
  """--help was answered; the command exits 0."""


def parse_flags(command: str, argv: Sequence[str],
                make_flags: Callable[[list[str]], flags.FlagValues],
                required: Sequence[str] = ("config",),
                doc: Optional[str] = None) -> flags.FlagValues:
  """The parsed flags of `t5x-like <command> argv...` (no positional arguments).

  Raises HelpShown after printing `doc` and the flags for a help flag, FlagError for
  a bad command line.
  """
  fv, _ = parse_flags_and_args(command, argv, make_flags, required=required, doc=doc,
                               positionals=None)
  return fv


def parse_flags_and_args(command: str, argv: Sequence[str],
                         make_flags: Callable[[list[str]], flags.FlagValues],
                         required: Sequence[str] = (), doc: Optional[str] = None,
                         positionals: Optional[str] = "ARGS", min_positionals: int = 0,
                         prog: Optional[str] = None) -> tuple[flags.FlagValues, list[str]]:
  """parse_flags, and the positional arguments (flags and positionals may mix; `--`
  ends the flags). positionals=None: positional arguments are ignored, as absl does;
  "": none are allowed; else their name in the usage line and the errors, at least
  `min_positionals` of them.
  `prog` replaces "t5x-like <command>" in the usage line (a `python -m` tool)."""
  argv = list(argv)
  prog = prog or f"t5x-like {command}"
  if any(a in HELP_FLAGS for a in argv):
    fv = make_flags([prog, *argv])
    print(usage_text(command, fv, doc, positionals=positionals, prog=prog))
    raise HelpShown()
  argv, field_overrides = split_field_overrides(argv)  # ml-collections never sees them
  full_argv = [prog, *argv]
  fv = make_flags(full_argv)
  if field_overrides and "config" not in fv:
    raise FlagError(f"Unknown command line flag {field_overrides[0].flag.lstrip('-')!r}"
                    f" ({prog} takes no config)")
  config_spec = flag_value(argv, "config")
  if config_spec and "config" in fv:
    config = load_config(config_spec)
    for key, flag in _config_overrides(argv):
      check_config_key(config, key, flag)
    for override in field_overrides:
      if not _has_key(config, override.section):  # names the first missing part
        check_config_key(config, f"{override.section}.{override.field}", override.flag)
  try:
    args = fv(full_argv)[1:]
  except flags.Error as e:
    raise FlagError(str(e)) from None
  except Exception as e:  # noqa: BLE001  (ml-collections raises many types for a bad override)
    raise FlagError(f"{' '.join(argv)}: {type(e).__name__}: {e}") from None
  if field_overrides and fv["config"].value is not None:
    set_field_overrides(fv.config, field_overrides)
  missing = [f"--{name}" for name in required if fv[name].value in (None, "")]
  if missing:
    raise FlagError(f"{', '.join(missing)} required ({prog} --help lists the flags)")
  if positionals == "" and args:
    raise FlagError(f"unexpected arguments {' '.join(args)!r} ({prog} takes flags only)")
  if positionals and len(args) < min_positionals:
    raise FlagError(f"{positionals} required ({prog} --help lists the arguments)")
  return fv, args


def usage_text(command: str, fv: flags.FlagValues, doc: Optional[str],
               positionals: Optional[str] = None, prog: Optional[str] = None) -> str:
  """The command's docstring and one entry per flag (name, default, help)."""
  tail = f" {positionals}" + ("" if "..." in positionals else " ...") if positionals else ""
  lines = [f"usage: {prog or f't5x-like {command}'} [flags]{tail}", ""]
  if doc:
    lines += [doc.strip(), ""]
  lines.append("flags:")
  for name in sorted(fv):
    flag = fv[name]
    if flag.name != name:  # a short alias is listed with its flag
      continue
    default = "" if flag.default is None else f" (default: {flag.default_as_str})"
    lines.append(f"  --{name}: {flag.help}{default}")
    if name == "config":
      lines.append("  --config.KEY=VALUE: override any key of the config (repeatable)")
      lines.append("  --config.model.overrides.FIELD=VALUE (finetune: init.model_overrides):"
                   " any ModelConfig field (t5x_like/models/config.py), in the file or not")
      lines.append("  --config.data.options.NAME=VALUE: any option of data.objective, in the"
                   " file or not (docs/models-and-data.md lists them)")
  lines.append("  --debug: show the traceback of an error (a t5x-like flag)")
  return "\n".join(lines)


# ------------------------------------------------------------------ config files
def load_config(spec: str) -> ml_collections.ConfigDict:
  """`get_config([arg])` of "path.py[:arg]"; FlagError naming the file on any failure."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    where = "a directory" if os.path.isdir(path) else "no such file"
    raise FlagError(f"--config={spec}: {path!r}: {where} (expected a Python config file"
                    " with get_config(), e.g. configs/bert_cpu.py)")
  if not path.endswith(".py"):
    raise FlagError(f"--config={spec}: {path!r} is not a Python file; a config is a .py"
                    " file defining get_config()")
  try:
    config = load_config_file(spec)
  except Exception as e:  # noqa: BLE001  (the user's file: any error is theirs to see)
    frame = _innermost_frame_in(e, path)
    raise FlagError(f"--config={spec}: {type(e).__name__}: {e}{frame}") from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise FlagError(f"--config={spec}: get_config() returned {type(config).__name__},"
                    " expected an ml_collections.ConfigDict")
  return config


def _innermost_frame_in(error: Exception, path: str) -> str:
  """' (path:line)' of the deepest traceback frame in the config file, or ''."""
  lineno = getattr(error, "lineno", None) if isinstance(error, SyntaxError) else None
  for frame in traceback.extract_tb(error.__traceback__):
    if os.path.abspath(frame.filename) == os.path.abspath(path):
      lineno = frame.lineno
  return f" ({path}:{lineno})" if lineno else ""


def lock_flags(argv: Sequence[str]) -> Optional[types.SimpleNamespace]:
  """The flags the workdir lock needs (workdir, distributed, num_processes, process_id),
  read from the raw command line before the config file is loaded (a config may import
  jax through the libraries it names). None for a help request, no --workdir, or a
  value the full parse will refuse."""
  argv = list(argv)
  workdir = flag_value(argv, "workdir")
  if not workdir or any(a in HELP_FLAGS for a in argv):
    return None
  try:
    return types.SimpleNamespace(
        workdir=workdir, distributed=flag_value(argv, "distributed") or "flags",
        num_processes=int(flag_value(argv, "num_processes") or 1),
        process_id=int(flag_value(argv, "process_id") or 0))
  except ValueError:
    return None


def flag_value(argv: list[str], name: str) -> Optional[str]:
  """The last value of --name=V / --name V in argv, or None."""
  value = None
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      value = arg.split("=", 1)[1]
    elif arg == f"--{name}" and i + 1 < len(argv):
      value = argv[i + 1]
  return value


def _config_overrides(argv: list[str]) -> list[tuple[str, str]]:
  """[(dotted key, the flag as given)] of every --config.KEY[=VALUE] in argv."""
  out = []
  for arg in argv:
    if arg.startswith("--config."):
      flag = arg.split("=", 1)[0]
      out.append((flag[len("--config."):], flag))
  return out


def config_keys(config, prefix: str = "") -> list[str]:
  """Every dotted key path of `config` (sections and leaves)."""
  keys = []
  for key in config.keys():
    name = f"{prefix}{key}"
    keys.append(name)
    value = config[key]
    if isinstance(value, ml_collections.ConfigDict):
      keys += config_keys(value, name + ".")
  return keys


def _has_key(config, key: str) -> bool:
  """Whether `config` has the dotted `key`."""
  for part in key.split("."):
    if not (isinstance(config, ml_collections.ConfigDict) and part in config):
      return False
    config = config[part]
  return True


def check_config_key(config, key: str, flag: str) -> None:
  """FlagError naming the full key and the closest known keys when `config` has no `key`."""
  node = config
  for i, part in enumerate(key.split(".")):
    if isinstance(node, ml_collections.ConfigDict) and part in node:
      node = node[part]
      continue
    known = [k for k in config_keys(config) if not key.startswith(k + ".")]
    close = _closest(key, known, cutoff=0.6)
    parent = ".".join(key.split(".")[:i])
    if not close and parent:
      close = _closest(key, [k for k in known if k.startswith(parent + ".")], cutoff=0.4)
    hint = (f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else
            f"; the config has no key {'.'.join(key.split('.')[:i + 1])!r}")
    schema = "finetune" if {"init", "task"} <= set(config.keys()) else "train"  # its defaults
    raise FlagError(f"{flag}: unknown config key {key!r}{hint} (t5x_like/{schema}/defaults.py"
                    " lists every key)")


# ------------------------------------------------------- open sections (model.overrides)
class FieldOverride(NamedTuple):
  """--config.SECTION.FIELD=VALUE of an OPEN_SECTIONS section, its value parsed."""
  section: str  # "model.overrides"
  field: str
  value: Any
  flag: str  # as given, for messages


_OPEN_FLAG = re.compile(r"^--?(no)?config\.(%s)\.([^.=]+)(?:=(.*))?$"
                        % "|".join(re.escape(s) for s in (*OPEN_SECTIONS, *FREE_SECTIONS)),
                        re.S)


def field_types(section: str) -> dict[str, tuple[type, bool]]:
  """{field: (type, whether None is allowed)} of the dataclass of an OPEN_SECTIONS
  section (Optional[int] -> (int, True))."""
  module, name = OPEN_SECTIONS[section]
  cls = getattr(importlib.import_module(module), name)
  hints = typing.get_type_hints(cls)
  out = {}
  for field in dataclasses.fields(cls):
    args = typing.get_args(hints[field.name])
    optional = type(None) in args
    kind = next(a for a in args if a is not type(None)) if optional else hints[field.name]
    out[field.name] = (kind, optional)
  return out


def split_field_overrides(argv: list[str]) -> tuple[list[str], list[FieldOverride]]:
  """(argv without them, the OPEN_SECTIONS overrides in argv, in order). Forms as absl's:
  --config.S.F=V, --config.S.F V, and for a bool field --config.S.F / --noconfig.S.F.
  FlagError for a name that is no field (with the closest fields) or a bad value."""
  rest, out, i = [], [], 0
  while i < len(argv):
    arg = argv[i]
    i += 1
    if arg == "--":  # positional arguments follow
      rest += argv[i - 1:]
      break
    match = _OPEN_FLAG.match(arg)
    if not match:
      rest.append(arg)
      continue
    negated, section, field, value = match.groups()
    flag = arg.split("=", 1)[0]
    if section in FREE_SECTIONS:
      if value is None and (negated or i >= len(argv) or argv[i].startswith("-")):
        value = "false" if negated else "true"  # --config.S.NAME / --noconfig.S.NAME
      elif value is None:
        value, i = argv[i], i + 1
      out.append(FieldOverride(section, field, value, flag))
      continue
    types_ = field_types(section)
    if field not in types_:
      close = _closest(field, list(types_), cutoff=0.0)  # some field is always closest
      hint = f"; did you mean {' or '.join(repr(f'{section}.{c}') for c in close)}?"
      module, name = OPEN_SECTIONS[section]
      raise FlagError(f"{flag}: unknown config key {f'{section}.{field}'!r}: not a field of"
                      f" {name} ({module.replace('.', '/')}.py){hint}")
    kind, optional = types_[field]
    if kind is bool and value is None:
      value = "false" if negated else "true"
    elif negated:
      raise FlagError(f"{flag}: --no... is for boolean fields; {section}.{field} is a"
                      f" {kind.__name__}")
    elif value is None:
      if i >= len(argv):
        raise FlagError(f"{flag}: a value is required ({flag}=VALUE)")
      value, i = argv[i], i + 1
    out.append(FieldOverride(section, field, _parse_field(flag, value, kind, optional),
                             flag))
  return rest, out


def _parse_field(flag: str, value: str, kind: type, optional: bool) -> Any:
  """value parsed as ml-collections parses a key of type `kind`; 'None' / 'none' is
  None where the field allows it."""
  if optional and value in ("None", "none"):
    return None
  try:
    return _FIELD_PARSERS[kind].parse(value)
  except (ValueError, flags.Error) as e:
    allowed = " (or None)" if optional else ""
    raise FlagError(f"{flag}={value}: expected {kind.__name__}{allowed}: {e}") from None


def set_field_overrides(config: ml_collections.ConfigDict,
                        overrides: Sequence[FieldOverride]) -> None:
  """Sets each override in `config` (locked or not; its type replaces the file's). A
  FREE_SECTIONS value is text: parsed by the type of the key the file has, if any."""
  for override in overrides:
    section = config
    for part in override.section.split("."):
      section = section[part]
    value = override.value
    if override.section in FREE_SECTIONS and override.field in section:
      kind = type(section[override.field])
      if kind in _FIELD_PARSERS:
        value = _parse_field(override.flag, value, kind, optional=False)
    with section.unlocked(), section.ignore_type():
      section[override.field] = value


def _closest(key: str, candidates: list[str], cutoff: float) -> list[str]:
  """The candidates most like `key` (at most 3, within 0.1 of the best ratio)."""
  scored = sorted(((difflib.SequenceMatcher(None, key, c).ratio(), c) for c in candidates),
                  reverse=True)
  best = scored[0][0] if scored else 0.0
  return [c for r, c in scored[:3] if r >= max(cutoff, best - 0.1)]


def choose_subcommand(command: str, argv: Sequence[str], subcommands: dict[str, str],
                      doc: Optional[str] = None) -> tuple[str, list[str]]:
  """(subcommand, its argv) of `t5x-like <command> SUBCOMMAND ...`; `subcommands` maps
  each name to its one-line summary. A help flag first prints them (HelpShown); no
  subcommand or an unknown one is a FlagError."""
  argv = list(argv)
  names = ", ".join(subcommands)
  if argv[:1] and argv[0] in HELP_FLAGS:
    width = max(len(name) for name in subcommands)
    lines = [f"usage: t5x-like {command} SUBCOMMAND [flags]", ""]
    if doc:
      lines += [doc.strip(), ""]
    lines.append("subcommands:")
    lines += [f"    {name.ljust(width)}  {summary}" for name, summary in subcommands.items()]
    lines += ["", f"`t5x-like {command} SUBCOMMAND --help` shows a subcommand's flags."]
    print("\n".join(lines))
    raise HelpShown()
  if not argv:
    raise FlagError(f"a subcommand is required: one of {names}")
  if argv[0] not in subcommands:
    raise FlagError(f"invalid choice: {argv[0]!r} (choose from {names})")
  return argv[0], argv[1:]


def debug_requested(argv: Sequence[str]) -> bool:
  return "--debug" in argv


def print_error(prefix: str, error: BaseException, debug: bool) -> None:
  """One line `prefix: message` on stderr (the traceback first when debugging)."""
  if debug:
    traceback.print_exception(error)
  print(f"{prefix}: {error}", file=sys.stderr, flush=True)


def load_config_file(spec: str) -> ml_collections.ConfigDict:
  """`get_config(arg)` of a config file named as on the command line: "path.py[:arg]"."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"config file {path!r} (from {spec!r}) does not exist")
  module_spec = importlib.util.spec_from_file_location(
      f"_t5x_like_config_{os.path.basename(path)[:-3]}", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()
