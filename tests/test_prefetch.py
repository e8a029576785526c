"""DevicePrefetcher: batches in order, transfers ahead, and a state that resumes at the
first batch not yet handed out."""

import pytest

from t5x_like.train.prefetch import DevicePrefetcher


class _Counter:
  """A host iterator 0, 1, ..., n-1 with grain's get_state / set_state."""

  def __init__(self, n):
    self.n, self.next_value = n, 0

  def __next__(self):
    if self.next_value >= self.n:
      raise StopIteration
    self.next_value += 1
    return self.next_value - 1

  def get_state(self):
    return {"next": self.next_value}

  def set_state(self, state):
    self.next_value = state["next"]


def test_prefetch_order_lookahead_and_state():
  host = _Counter(6)
  put_calls = []
  prefetch = DevicePrefetcher(host, lambda b: put_calls.append(b) or ("device", b), size=2)
  assert next(prefetch) == ("device", 0)
  assert put_calls == [0, 1, 2]  # two more transferred before the step on batch 0 runs
  assert next(prefetch) == ("device", 1)
  state = prefetch.get_state()
  assert state == {"next": 2}  # not {"next": 4}: batches 2 and 3 are only queued
  resumed = _Counter(6)
  resumed.set_state(state)
  assert next(DevicePrefetcher(resumed, lambda b: b)) == 2
  assert [b for _, b in prefetch] == [2, 3, 4, 5]
  assert prefetch.get_state() == {"next": 6}


def test_prefetch_size_must_be_positive():
  with pytest.raises(ValueError, match="prefetch size=0"):
    DevicePrefetcher(_Counter(1), lambda b: b, size=0)
