"""run_steps: how far the host runs ahead of the device (docs/known-issues.md: on fake
CPU devices an unbounded run-ahead deadlocked XLA's all-reduce); when it shows progress."""

import types

import numpy as np

from t5x_like.train import runner


class _Loss:
  """A step's loss that knows whether the loop has waited for it."""

  def __init__(self, step: int, unfinished: set):
    self.step, self.unfinished = step, unfinished
    unfinished.add(step)

  def block_until_ready(self):
    self.unfinished.discard(self.step)
    return self

  def __array__(self, dtype=None, copy=None):
    return np.asarray(1.0, dtype)


class _Batches:
  def __next__(self):
    return {}

  def get_state(self):
    return {}


def _fake_loop(unfinished: set, most_unfinished: list) -> runner.StepLoop:
  def train_step(state, batch, rng):
    step = state + 1
    loss = _Loss(step, unfinished)
    most_unfinished[0] = max(most_unfinished[0], len(unfinished))
    return step, {"loss": loss}

  nothing = lambda *args, **kwargs: None  # noqa: E731
  run = types.SimpleNamespace(
      checkpointer=types.SimpleNamespace(save=nothing, poll=nothing, latest_step=nothing),
      writer=types.SimpleNamespace(flush=nothing, progress=nothing, write_scalars=nothing,
                                   log=nothing),
      preemption=types.SimpleNamespace(requested=None))
  return runner.StepLoop(train_step=train_step, batches=_Batches(), rng=None, run=run,
                         every=runner.Every(log=1000), evaluate=lambda state, step: {},
                         scalars=lambda metrics, step, seconds: {})


def test_the_host_runs_at_most_two_steps_ahead_of_the_device():
  unfinished, most_unfinished = set(), [0]
  step, state, _, stopped = runner.run_steps(_fake_loop(unfinished, most_unfinished),
                                             state=0, step=0, until_step=40)
  assert (step, state, stopped) == (40, 40, False)
  # at step N's dispatch, steps N-2 .. N may be unfinished, never N-3
  assert most_unfinished[0] == runner.MAX_STEPS_IN_FLIGHT + 1 == 3


def test_progress_shows_the_first_step_and_rows_keep_log_every():
  """log_every=50: progress at the run's first step (a resumed run's too), then every 50
  and the end; the metric rows only every 50 and at the end."""
  for start, expected in ((0, [1, 50, 100, 110]), (60, [61, 100, 110])):
    loop = _fake_loop(set(), [0])
    progress, rows = [], []
    loop.run.writer.progress = lambda step, loss: progress.append((step, float(loss)))
    loop.run.writer.write_scalars = lambda step, row: rows.append(step)
    loop.every = runner.Every(log=50)
    loop.scalars = lambda metrics, step, seconds: {"loss": float(metrics["loss"])}
    runner.run_steps(loop, state=start, step=start, until_step=110)
    assert progress == [(s, 1.0) for s in expected]
    assert rows == [s for s in (50, 100, 110) if s > start]
