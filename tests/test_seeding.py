"""data/seeding.py against numpy's own SeedSequence + PCG64, state for state."""

import numpy as np
import pytest

from t5x_like.data.seeding import keyed_generators, pcg64_states
from t5x_like.data.streams import STREAM_KEY, order_rng

KEYS = np.array([0, 1, 2, 3, 17, 1000, 123456, 2**31, 2**32 - 1])


def _numpy_state(entropy, prefix, key):
  state = np.random.PCG64(np.random.SeedSequence(entropy, spawn_key=(*prefix, key))).state
  return state["state"]["state"], state["state"]["inc"]


@pytest.mark.parametrize("entropy, prefix", [
    ([0, 0], (STREAM_KEY,)), ([11, 2], (STREAM_KEY,)), ([2**40 + 5, 3], (STREAM_KEY,)),
    ([2**32, 2**64 + 1], (STREAM_KEY,)), ([1, 2, 3, 4, 5], (STREAM_KEY,)),
    ([7], (STREAM_KEY, 9)), ([0, 0], ()), ([123456789, 99], (2**33,)), ([5], (0, 0, 0))])
def test_states_equal_numpys(entropy, prefix):
  got = pcg64_states(entropy, prefix, KEYS)
  assert got == [_numpy_state(entropy, prefix, k) for k in KEYS.tolist()]


def test_generators_draw_as_the_streams_order_rng():
  rng = np.random.default_rng(0)
  for seed, epoch in [(0, 0), (3, 7), (int(rng.integers(2**62)), 41)]:
    keys = rng.integers(0, 5000, 20)
    for key, gen in zip(keys.tolist(), keyed_generators([seed, epoch], [STREAM_KEY], keys)):
      want = order_rng(seed, epoch, key)
      np.testing.assert_array_equal(gen.permutation(1024), want.permutation(1024))
      np.testing.assert_array_equal(gen.permutation(7), want.permutation(7))


def test_keys_and_seeds_out_of_range_raise():
  with pytest.raises(ValueError):
    pcg64_states([0, 0], [STREAM_KEY], [2**32])
  with pytest.raises(ValueError):
    pcg64_states([-1, 0], [STREAM_KEY], [0])
  assert pcg64_states([0, 0], [STREAM_KEY], np.zeros(0, np.int64)) == []
