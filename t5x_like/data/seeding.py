"""Many seeded PCG64 generators at once, bit for bit numpy's.

  gens = keyed_generators([seed, epoch], (0x57E4,), keys)   # one Generator per key
  # gens[i] draws as default_rng(SeedSequence([seed, epoch], spawn_key=(0x57E4, keys[i])))

Building a SeedSequence and a PCG64 costs ~8 us each; an epoch stream seeds one per
chunk it loads (data/streams.py). Here the entropy words common to every key are mixed
once, the last spawn-key word (the key) is mixed and hashed into the PCG64 seed for all
keys at once with numpy's uint32 arithmetic, and one PCG64 is set to each resulting
state. The constants and steps are numpy's SeedSequence (bit_generator.pyx: mix_entropy,
generate_state) and PCG64 seeding (pcg64_set_seed: pcg_setseq_128_srandom_r);
tests/test_seeding.py checks the states against numpy's own for many inputs.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

_MASK32 = 0xFFFFFFFF
_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715
_POOL = 4  # SeedSequence's default pool size
_PCG_MULT = 0x2360ED051FC65DA44385DF649FCCF645  # PCG64's 128-bit multiplier
_MASK128 = (1 << 128) - 1


def _words(value: int) -> list[int]:
  """numpy's _int_to_uint32_array: the uint32 words of value >= 0, low first."""
  if value < 0:
    raise ValueError(f"seed words must be >= 0, got {value}")
  words = [value & _MASK32]
  while value > _MASK32:
    value >>= 32
    words.append(value & _MASK32)
  return words


def _common_pool(entropy: Sequence[int], spawn_prefix: Sequence[int]
                 ) -> tuple[list[int], int]:
  """(pool [4], hash constant) of SeedSequence.mix_entropy after every entropy word
  but the last spawn-key word (the key)."""
  run = [w for v in entropy for w in _words(int(v))]
  run += [0] * (_POOL - len(run))  # a spawn key follows: run entropy padded to the pool
  words = run + [w for v in spawn_prefix for w in _words(int(v))]
  const = _INIT_A

  def hashmix(value: int) -> int:
    nonlocal const
    value ^= const
    const = (const * _MULT_A) & _MASK32
    value = (value * const) & _MASK32
    return value ^ (value >> 16)

  def mix(x: int, y: int) -> int:
    r = (_MIX_L * x - _MIX_R * y) & _MASK32
    return r ^ (r >> 16)

  pool = [hashmix(w) for w in words[:_POOL]]
  for src in range(_POOL):
    for dst in range(_POOL):
      if src != dst:
        pool[dst] = mix(pool[dst], hashmix(pool[src]))
  for w in words[_POOL:]:
    for dst in range(_POOL):
      pool[dst] = mix(pool[dst], hashmix(w))
  return pool, const


def pcg64_states(entropy: Sequence[int], spawn_prefix: Sequence[int],
                 keys: np.ndarray) -> list[tuple[int, int]]:
  """[K] (state, inc) of PCG64(SeedSequence(entropy, spawn_key=(*spawn_prefix, key)))
  for each key in keys [K] (0 <= key < 2**32)."""
  keys = np.asarray(keys, np.int64)
  if len(keys) and (keys.min() < 0 or keys.max() > _MASK32):
    raise ValueError("keys must be in [0, 2**32)")
  pool0, const = _common_pool(entropy, spawn_prefix)
  u32 = np.uint32
  value = keys.astype(u32)
  pool = [np.full(len(keys), w, u32) for w in pool0]
  with np.errstate(over="ignore"):
    for dst in range(_POOL):  # mix_entropy's last word, every key at once
      h = value ^ u32(const)
      const = (const * _MULT_A) & _MASK32
      h *= u32(const)
      h ^= h >> u32(16)
      pool[dst] = pool[dst] * u32(_MIX_L) - h * u32(_MIX_R)
      pool[dst] ^= pool[dst] >> u32(16)
    const, state = _INIT_B, []
    for i in range(8):  # generate_state(4, uint64): 8 uint32 words
      word = pool[i % _POOL] ^ u32(const)
      const = (const * _MULT_B) & _MASK32
      word *= u32(const)
      word ^= word >> u32(16)
      state.append(word.astype(np.uint64))
  w64 = [(state[2 * i] | (state[2 * i + 1] << np.uint64(32))).tolist() for i in range(4)]
  out = []
  for s_hi, s_lo, i_hi, i_lo in zip(*w64):  # pcg_setseq_128_srandom_r
    inc = ((((i_hi << 64) | i_lo) << 1) | 1) & _MASK128
    start = (inc + ((s_hi << 64) | s_lo)) & _MASK128
    out.append(((start * _PCG_MULT + inc) & _MASK128, inc))
  return out


def keyed_generators(entropy: Sequence[int], spawn_prefix: Sequence[int],
                     keys: np.ndarray) -> Iterator[np.random.Generator]:
  """For each key of keys [K], a Generator drawing as default_rng(SeedSequence(entropy,
  spawn_key=(*spawn_prefix, key))). One Generator is re-seeded for each: use each one
  before taking the next."""
  bits = np.random.PCG64(0)
  gen = np.random.Generator(bits)
  words = {"state": 0, "inc": 0}
  full = {"bit_generator": "PCG64", "state": words, "has_uint32": 0, "uinteger": 0}
  for words["state"], words["inc"] in pcg64_states(entropy, spawn_prefix, keys):
    bits.state = full
    yield gen
