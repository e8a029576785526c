"""A random-access seeded permutation of [0, n): any entries, without an O(n) table.

`shuffled(indices, n, key)` is where the permutation of [0, n) keyed by `key` sends each
of `indices`, computed for those indices only (O(len(indices)) work and memory). The
construction is the one of Grain's index_shuffle (grain/_src/python/experimental/
index_shuffle, after TensorFlow's random_index_shuffle), here in vectorised numpy:

* a balanced Feistel network on the smallest power-of-four domain 4^h >= n: an index is
  split into two h-bit halves (L, R), and each of ROUNDS rounds maps
  (L, R) -> (R, L xor F(R xor k_r)) with F a 64-bit mixing hash (splitmix64's
  finaliser) cut to h bits and k_r a round key drawn from `key`. Every round is
  invertible, so the network is a bijection of the domain whatever F is;
* "cycle walking" (Black and Rogaway, "Ciphers with Arbitrary Finite Domains", 2002; the
  format-preserving encryption construction): apply the network again until the value
  falls in [0, n). Following a permutation's cycle from a point of [0, n) reaches a
  point of [0, n) again, so this is a bijection of [0, n). The domain is < 4n, so an
  index walks fewer than 4 times on average.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

ROUNDS = 8
MAX_N = 2 ** 62  # halves of at most 31 bits
_KEY_DOMAIN = 0x1D5F  # spawn key keeping the round keys apart from other uses of `key`
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def round_keys(key: Sequence[int]) -> np.ndarray:
  """[ROUNDS] uint64 round keys of the permutation named by `key` (non-negative ints)."""
  sequence = np.random.SeedSequence([int(k) for k in key], spawn_key=(_KEY_DOMAIN,))
  return sequence.generate_state(ROUNDS, np.uint64)


def half_bits(n: int) -> int:
  """h of the domain 4^h: the smallest h >= 1 with 4^h >= n."""
  return max(1, -(-(n - 1).bit_length() // 2))


def _mix(x: np.ndarray) -> np.ndarray:
  """splitmix64's finaliser on uint64 [M] (wrapping arithmetic)."""
  x = (x ^ (x >> np.uint64(30))) * _MIX_1
  x = (x ^ (x >> np.uint64(27))) * _MIX_2
  return x ^ (x >> np.uint64(31))


def feistel(x: np.ndarray, keys: np.ndarray, h: int) -> np.ndarray:
  """The Feistel network on values x [M] uint64 < 4^h: a bijection of [0, 4^h)."""
  bits, mask = np.uint64(h), np.uint64((1 << h) - 1)
  left, right = x >> bits, x & mask
  for k in keys:
    left, right = right, left ^ (_mix(right ^ k) & mask)
  return (left << bits) | right


def shuffled(indices: np.ndarray, n: int, key: Sequence[int]) -> np.ndarray:
  """Position of each of `indices` (any shape, integers in [0, n)) under the seeded
  permutation of [0, n) named by `key`: int64, the shape of `indices`."""
  indices = np.asarray(indices)
  if indices.size == 0:
    return np.zeros(indices.shape, np.int64)
  if not np.issubdtype(indices.dtype, np.integer):
    raise TypeError(f"indices must be integers, not {indices.dtype}")
  if not 0 < n <= MAX_N:
    raise ValueError(f"n={n}: must be in [1, {MAX_N}]")
  if indices.min() < 0 or indices.max() >= n:
    raise ValueError(f"indices outside [0, {n}): {indices.min()} .. {indices.max()}")
  keys, h = round_keys(key), half_bits(n)
  x = indices.astype(np.uint64).reshape(-1)
  walking = np.arange(x.size)
  while walking.size:
    x[walking] = feistel(x[walking], keys, h)
    walking = walking[x[walking] >= np.uint64(n)]
  return x.astype(np.int64).reshape(indices.shape)
