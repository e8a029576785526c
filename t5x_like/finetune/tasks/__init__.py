"""The fine-tuning task registry: every module of this package that defines `TASK`.

  TASKS["classification"]               the Task class config.task.name selects
  make_task("span_extraction", text_pair_column="context")
  task_from_config(config.task)         the task with config.task's options
  task_options()                        {option: default} of every task (the schema)

A new task type is one file here (see t5x_like/finetune/task.py for the interface);
nothing else names it.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from t5x_like.errors import UserError
from t5x_like.finetune.task import Task

TASKS: dict[str, type[Task]] = {}


class TaskConfigError(UserError, ValueError):
  """config.task names no task, or an option the task refuses; the message names the key."""


def register(cls: type[Task]) -> type[Task]:
  """Adds a Task class under its name (ValueError on a clash or an unnamed task)."""
  if not cls.name:
    raise ValueError(f"{cls.__name__}: a task needs a `name`")
  if TASKS.get(cls.name, cls) is not cls:
    raise ValueError(f"two tasks are named {cls.name!r}: {TASKS[cls.name]} and {cls}")
  TASKS[cls.name] = cls
  return cls


for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
  _module = importlib.import_module(f"{__name__}.{_info.name}")
  if hasattr(_module, "TASK"):
    register(_module.TASK)


def task_class(name: str) -> type[Task]:
  """The registered Task class `name` (TaskConfigError naming config.task.name if none)."""
  if name not in TASKS:
    raise TaskConfigError(f"config.task.name={name!r}: expected one of {sorted(TASKS)}")
  return TASKS[name]


def make_task(name: str, **options) -> Task:
  """The task `name` with `options` (its dataclass fields)."""
  return task_class(name)(**options)


def task_options() -> dict:
  """{option: default} over every registered task; one default per option name."""
  defaults: dict = {}
  for cls in TASKS.values():
    for f in dataclasses.fields(cls):
      if f.name in defaults and defaults[f.name] != f.default:
        raise ValueError(f"task option {f.name!r} has two defaults: {defaults[f.name]!r} and"
                         f" {f.default!r} ({cls.__name__})")
      defaults[f.name] = f.default
  return defaults


def task_from_config(task_config) -> Task:
  """config.task -> its Task, given the options the task has; a refused option raises
  TaskConfigError naming config.task.<key>."""
  name = task_config.name
  cls = task_class(name)
  fields = {f.name for f in dataclasses.fields(cls)}
  options = {k: v for k, v in task_config.items() if k in fields}
  try:
    task = cls(**options)
    task.check_files_options()
    return task
  except (TypeError, ValueError) as e:
    raise TaskConfigError(f"config.task ({name}): {e}") from None
