"""Silence for the leftovers of an orbax read that failed half-way.

Orbax reads a checkpoint's arrays in many coroutines and tensorstore futures on an event
loop it closes when the read raises. The reads still in flight then die one by one,
during the read or when collected later, each printing a traceback: 70-105 KB on stderr
for one damaged or mismatched checkpoint, on top of the one line the caller reports.
They arrive by three routes: sys.unraisablehook (a coroutine collected with its
exception), sys.excepthook (a tensorstore callback meeting the closed loop) and the
asyncio logger ("Future exception was never retrieved").
"""

from __future__ import annotations

import logging
import sys

_CLOSED_LOOP = "Event loop is closed"
_NEVER_RETRIEVED = "exception was never retrieved"  # asyncio: "Future ..." / "Task ..."


def quiet_read_leftovers() -> None:
  """Call before orbax reads a checkpoint: from then on, the three routes above drop
  what a failed read leaves behind (the caller reports the failure itself). Anything
  else still reaches the previous hooks. Idempotent."""
  if getattr(sys.unraisablehook, "drops_read_leftovers", False):
    return
  unraisable_hook, except_hook = sys.unraisablehook, sys.excepthook

  def on_unraisable(unraisable):
    if not (_from_orbax(unraisable.object) or _CLOSED_LOOP in str(unraisable.exc_value)):
      unraisable_hook(unraisable)

  def on_exception(kind, error, traceback):
    if _CLOSED_LOOP not in str(error):
      except_hook(kind, error, traceback)

  on_unraisable.drops_read_leftovers = True
  sys.unraisablehook, sys.excepthook = on_unraisable, on_exception
  logging.getLogger("asyncio").addFilter(_DropNeverRetrieved())


class _DropNeverRetrieved(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return _NEVER_RETRIEVED not in str(record.msg)


def _from_orbax(obj) -> bool:
  """Whether `obj` is a coroutine of orbax's (or tensorstore's) code."""
  code = getattr(obj, "cr_code", None)
  filename = getattr(code, "co_filename", "")
  return "/orbax/" in filename or "/tensorstore/" in filename
