"""Input prefetch to the devices, checkpoint-exact.

  batches = DevicePrefetcher(host_iterator, put=lambda b: shard_batch(b, mesh, rules))
  batch = next(batches)          # already on the devices; `size` more are on their way
  state = batches.get_state()    # the host iterator's state after `batch`

The next `size` batches are generated and transferred while the step that consumes the
current one runs (jit dispatch is asynchronous). get_state() is the state the host
iterator had right after producing the last batch handed out, not after the ones
still queued, so a checkpoint resumes at exactly the next unconsumed batch.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterator


class DevicePrefetcher:
  """Iterator of device batches `size` ahead of the consumer (see the module doc)."""

  def __init__(self, host_iterator: Iterator, put: Callable[[Any], Any], size: int = 2):
    if size < 1:
      raise ValueError(f"prefetch size={size}: must be >= 1")
    self._host = host_iterator
    self._put = put
    self._size = size
    self._queue: collections.deque = collections.deque()
    self._state = host_iterator.get_state()

  def _fill(self) -> None:
    while len(self._queue) < self._size:
      try:
        host_batch = next(self._host)
      except StopIteration:
        return
      self._queue.append((self._put(host_batch), self._host.get_state()))

  def __iter__(self) -> "DevicePrefetcher":
    return self

  def __next__(self):
    self._fill()
    if not self._queue:
      raise StopIteration
    batch, self._state = self._queue.popleft()
    self._fill()  # start the next transfers before the caller runs its step
    return batch

  def get_state(self) -> Any:
    return self._state
