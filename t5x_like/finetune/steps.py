"""How long a fine-tuning run trains: train.num_steps, or with train.num_steps = 0 the
steps of train.epochs passes over the training rows the run read (at most
train.max_steps), so `epochs=3` is three epochs of the file given, whatever its size;
and the warmup, optimizer.warmup_fraction of those steps where it is set.

  config, line = resolve_steps(config, num_rows)   # after the train split is encoded
  run.writer.log(line)      # "steps: 24 of batch 32 (train.epochs=3) = 3.07 epochs ..."
"""

from __future__ import annotations

import copy
import math

import ml_collections


def resolve_steps(config: ml_collections.ConfigDict,
                  num_rows: int) -> tuple[ml_collections.ConfigDict, str]:
  """(a copy of config with train.num_steps and optimizer.warmup_steps as the run takes
  them, the log line that says so); num_rows: the training rows one epoch passes over
  (a row per example; SQuAD: per window)."""
  t, o = config.train, config.optimizer
  if t.num_steps > 0:
    steps, how = int(t.num_steps), "train.num_steps"
  else:
    steps = max(1, math.ceil(t.epochs * num_rows / t.batch_size))
    how = f"train.epochs={t.epochs:g}"
    if 0 < t.max_steps < steps:
      steps, how = int(t.max_steps), how + f", at most train.max_steps={t.max_steps}"
  warmup = int(o.warmup_steps)
  if o.warmup_fraction > 0:  # BERT's int(steps * 0.1), at least one step
    warmup = max(1, int(round(o.warmup_fraction * steps, 6)))
    how += f"; warmup {o.warmup_fraction:g} of them"
  resolved = copy.deepcopy(config)
  resolved.train.num_steps = steps
  resolved.optimizer.warmup_steps = warmup
  epochs = steps * t.batch_size / max(num_rows, 1)
  line = (f"steps: {steps:,} of batch {t.batch_size} ({how}) = {epochs:.2f} epochs of the"
          f" {num_rows:,} training rows; warmup {warmup:,} step{'' if warmup == 1 else 's'}")
  return resolved, line
