"""Training: train state, optimizers and schedules, steps, loop, checkpoints, metrics."""
