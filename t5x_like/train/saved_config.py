"""The config of a `t5x-like train` run, saved beside its checkpoints as a config file.

  write_run_config(workdir, config)    # train, at the start and on every resume:
                                       # WORKDIR/config.py (process 0)
  saved_config_path("workdir/bert")    # "workdir/bert/config.py", or None

WORKDIR/config.py is a config file like those in configs/: its get_config() returns the
run's config with every --config.KEY override applied. So a workdir is enough to rebuild
the model and vocabulary that wrote its checkpoints: fine-tuning reads it when
init.config is left "" (t5x_like/finetune/backbone.py), and any command takes it as
`--config WORKDIR/config.py` (e.g. `t5x-like infer --config workdir/bert/config.py
--checkpoint workdir/bert`). The values are written as a Python literal (pprint), so the
file reads as the config it is; a config whose values are not literals is not saved.
"""

from __future__ import annotations

import ast
import os
import pprint
from typing import Optional

from t5x_like import fs

CONFIG_FILE = "config.py"

_TEMPLATE = '''"""The config of the `t5x-like train` run in this directory, with its --config.KEY
overrides applied; written by train (t5x_like/train/saved_config.py) at the run's start
and on every resume. Fine-tuning reads it when config.init.checkpoint names this run and
config.init.config is left ""; any command takes it as --config DIR/config.py.
"""

import ml_collections

CONFIG = {config}


def get_config(arg: str = ""):
  if arg:
    raise ValueError(f"{{__file__}}: a saved run config takes no argument (got {{arg!r}})")
  return ml_collections.ConfigDict(CONFIG)
'''


def run_config_text(config) -> str:
  """The text of config.py for `config` (a ConfigDict); ValueError when a value is not a
  Python literal (it could not be read back as written)."""
  values = config.to_dict()
  literal = pprint.pformat(values, width=88, sort_dicts=True)
  try:
    same = ast.literal_eval(literal) == values
  except (ValueError, SyntaxError):
    same = False
  if not same:
    raise ValueError("the config holds values that are not Python literals")
  return _TEMPLATE.format(config=literal)


def write_run_config(workdir: str, config) -> Optional[str]:
  """Writes WORKDIR/config.py (atomically; a local path or a URL). Returns None, or why
  nothing was written (for the run's log: the run goes on without it)."""
  try:
    text = run_config_text(config)
  except ValueError as e:
    return f"{CONFIG_FILE} not written: {e}"
  fs.write_bytes(os.path.join(workdir, CONFIG_FILE), text.encode("utf-8"))
  return None


def train_workdir(checkpoint: str) -> Optional[str]:
  """The train workdir that a checkpoint path names, as the path is written: the
  workdir itself (it holds checkpoints/), its checkpoints/ directory, or one step
  directory checkpoints/<step>; None for anything else and for URLs."""
  if not checkpoint or fs.is_url(checkpoint):
    return None
  path = os.path.normpath(checkpoint)
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return path
  if os.path.basename(path) == "checkpoints":
    return os.path.dirname(path) or "."
  parent = os.path.dirname(path)
  if os.path.basename(parent) == "checkpoints":
    return os.path.dirname(parent) or "."
  return None


def saved_config_path(checkpoint: str) -> Optional[str]:
  """The config.py that `t5x-like train` saved in the workdir of `checkpoint` (see
  train_workdir), or None when there is none (a run of a version before it, a URL)."""
  workdir = train_workdir(checkpoint)
  if workdir is None:
    return None
  path = os.path.join(workdir, CONFIG_FILE)
  return path if os.path.isfile(path) else None
