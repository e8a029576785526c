"""Rules as a static jit argument (decoding and scoring trace under
parallel.traced_rules, as training does)."""

from __future__ import annotations


def hashable_rules(rules) -> tuple:
  """Rules as nested tuples (a static jit argument must hash)."""
  if isinstance(rules, (list, tuple)):
    return tuple(hashable_rules(r) for r in rules)
  return rules
