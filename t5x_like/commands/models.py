"""`t5x-like models [NAME ...]`: every preset (or the names given) with its parameter
count, counted from shapes (nothing allocated), one JSON object per line.

names: presets to show (default: all).
"""

from __future__ import annotations

import json

from absl import flags

from t5x_like.command_flags import parse_flags_and_args



def _flags(argv: list[str]) -> flags.FlagValues:
  del argv  # no config overrides
  return flags.FlagValues()


def main(argv: list[str]) -> int:
  _, names = parse_flags_and_args("models", argv, _flags, doc=__doc__,
                                  positionals="[NAME ...]")
  from t5x_like.models import PRESETS, build_model, preset
  for name in names or sorted(PRESETS):
    cfg = preset(name)
    count = build_model(cfg).num_params()
    print(json.dumps(dict(preset=name, family=cfg.family, layers=cfg.num_layers,
                          d_model=cfg.d_model, heads=cfg.num_heads, params=count,
                          params_millions=round(count / 1e6, 1))))
  return 0
