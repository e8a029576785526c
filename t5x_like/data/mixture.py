"""Weighted mixtures of sources (seqio's Mixture), as one Objective.

  data.mixture = "prepared:gs://b/wiki=0.8,text:books/*.txt=0.2"          # SPEC=RATE,...
  data.mixture = "{'prepared:gs://b/wiki': 0.8, 'text:books/*.txt': 0.2}"  # or a dict
  data.mixture = "prepared:gs://b/wiki=size,prepared:gs://b/books=size"  # by tokens

A rate is a positive number (rates are normalised to sum to 1) or, for every entry at
once, the word `size`: rates proportional to each source's training tokens (seqio's
mixing by size; BERT's pretraining text is Wikipedia and BooksCorpus concatenated,
i.e. mixed by size).

The mixture is an Objective whose epoch is a block of BLOCK examples. Block b holds
exactly n_s examples of source s (n_s: the rates times BLOCK, rounded by largest
remainder), namely positions [b * n_s, (b + 1) * n_s) of that source's own endless
sequence of epochs, in order (loader.EpochSequence: each epoch a seeded permutation of
the source's examples, each epoch's examples drawn anew by the source's objective).
Example j of the block is from the source whose slot range [cum_s, cum_s + n_s) holds
perm_b(j), perm_b the seeded permutation of [0, BLOCK) keyed by (seed, b, MIX_STREAM):
the sources are interleaved at random, without replacement, each read in its own
order. The loader reads a mixture's blocks in order (Objective.reads_in_order), so
example i of the mixture is a pure function of (seed, i) (block i // BLOCK, a table of
O(BLOCK) built once per block); exact resume, host slicing and packing are the loader's
and the sources' objectives', unchanged.

Exhaustion: with "restart" (default) a source runs on into its next epoch, reshuffled
and redrawn. With "stop" the trainer ends the run cleanly after the last whole global
batch before the first example past some source's first epoch (`exhaustion_step`, the
same step on every host).
"""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import re
from typing import Optional, Sequence

import numpy as np

from t5x_like.data.index_shuffle import shuffled
from t5x_like.data.loader import EpochSequence
from t5x_like.data.objective import Example, Objective
from t5x_like.errors import UserError

BLOCK = 1 << 16  # examples per mixture epoch; rates resolve to 1 / BLOCK
MIX_STREAM = 0x313C  # key word of the block permutations
SOURCE_STREAM = 0x50C5  # key word of each source's epoch permutations
EXHAUSTED = ("restart", "stop")
SIZE = "size"


class MixtureError(UserError, ValueError):
  """A data.mixture that cannot be mixed; the message names the key and the entry."""


# ------------------------------------------------------------------------ config
def parse_mixture(text: str) -> list[tuple[str, float | str]]:
  """[(spec, rate)] of data.mixture: "SPEC=RATE,..." or a dict literal "{SPEC: RATE}".

  A rate is a positive finite number or "size" (then every rate must be). A comma inside
  a spec (embedded:a,b) is kept: an item without "=RATE" joins the next one.
  """
  text = text.strip()
  if not text:
    raise MixtureError("data.mixture='': name at least one source, as SPEC=RATE,..."
                       " (or leave data.mixture unset for data.source)")
  if text.startswith("{"):
    try:
      entries = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      raise MixtureError(f"data.mixture={text!r}: not a dict literal {{SPEC: RATE, ...}}"
                         ) from None
    if not isinstance(entries, dict):
      raise MixtureError(f"data.mixture={text!r}: expected {{SPEC: RATE, ...}}")
    pairs = list(entries.items())
  else:
    pairs, pending = [], []
    for item in text.split(","):
      spec, sep, rate = item.rpartition("=")
      if not sep:
        pending.append(item)
        continue
      pairs.append((",".join(pending + [spec]).strip(), rate.strip()))
      pending = []
    if pending:
      raise MixtureError(f"data.mixture entry {','.join(pending)!r}: no rate; write"
                         " SPEC=RATE (a number or 'size')")
  if not pairs:
    raise MixtureError("data.mixture={}: name at least one source")
  out = [(str(spec), _rate(str(spec), rate)) for spec, rate in pairs]
  specs = [s for s, _ in out]
  for spec in specs:
    if not spec or specs.count(spec) > 1:
      raise MixtureError(f"data.mixture entry {spec!r}: each source once, with a spec")
  if len({r == SIZE for _, r in out}) > 1:
    raise MixtureError(f"data.mixture={text!r}: rates are either all numbers or all"
                       f" {SIZE!r}")
  return out


def _rate(spec: str, rate) -> float | str:
  if isinstance(rate, str) and rate.strip() == SIZE:
    return SIZE
  try:
    value = float(rate) if not isinstance(rate, bool) else math.nan
  except (TypeError, ValueError):
    value = math.nan
  if not (math.isfinite(value) and value > 0):
    raise MixtureError(f"data.mixture[{spec!r}]={rate!r}: a rate must be a positive"
                       f" number or {SIZE!r}")
  return value


def describe_data(data) -> dict:
  """config.data's sources as plan and bench report them, read from the config only:
  {"source": SPEC} or {"mixture": {name: {"spec", "rate"}}, "exhausted": ...}, each rate
  normalised, or "size" (resolved when the data is read)."""
  if not data.get("mixture", ""):
    return {"source": data.source}
  entries = parse_mixture(data.mixture)
  total = sum(r for _, r in entries if r != SIZE)
  return {"mixture": {name: {"spec": spec, "rate": r if r == SIZE else round(r / total, 6)}
                      for name, (spec, r) in zip(source_names([s for s, _ in entries]),
                                                 entries)},
          "exhausted": data.get("mixture_exhausted", "restart")}


def source_names(specs: Sequence[str]) -> list[str]:
  """Short unique names of specs for metric keys: a path's last folder or file stem,
  a TFDS dataset's name ('prepared:gs://b/wiki' -> 'wiki', 'text:books/*.txt' ->
  'books', 'embedded:a,b' -> 'embedded_a_b'); a repeat gets a suffix."""
  names = []
  for spec in specs:
    kind, _, rest = spec.partition(":")
    if kind == "embedded":
      base = "embedded" + ("_" + rest.replace(",", "_") if rest else "")
    elif kind == "tfds":
      base = re.split(r"[/:@#]", rest)[0]
    else:
      path = re.split(r"[#]", rest)[0] if kind == "prepared" else rest
      if kind == "jsonl":
        path = re.sub(r":[A-Za-z_][A-Za-z0-9_]*$", "", path)
      parts = [p for p in re.split(r"[/\\]", path) if p and not re.search(r"[*?\[]", p)]
      base = os.path.splitext(parts[-1])[0] if parts else kind
    base = re.sub(r"[^A-Za-z0-9_.\-]", "_", base) or kind
    name, n = base, 2
    while name in names:
      name, n = f"{base}_{n}", n + 1
    names.append(name)
  return names


def largest_remainder(rates: Sequence[float], total: int) -> np.ndarray:
  """[S] int64 counts: rates / sum(rates) * total rounded by largest remainder (ties to
  the earlier entry), so they sum to total."""
  rates = np.asarray(rates, np.float64)
  exact = rates / rates.sum() * total
  counts = np.floor(exact).astype(np.int64)
  counts[np.argsort(-(exact - counts), kind="stable")[:total - counts.sum()]] += 1
  return counts


def allocate(rates: Sequence[float], block: int = BLOCK) -> np.ndarray:
  """[S] int64 slots of each source per block: rates / sum(rates) * block, rounded by
  largest remainder (they sum to block). MixtureError if a rate gets no slot."""
  rates = np.asarray(rates, np.float64)
  slots = largest_remainder(rates, block)
  if (slots == 0).any():
    raise MixtureError(f"data.mixture: rate {rates[slots == 0][0]:g} is under 1/{block} of"
                       " the total; raise it or drop the source")
  return slots


# ------------------------------------------------------------------------ objective
def source_seed(seed: int, index: int) -> int:
  """The seed of source `index`'s objective and epoch order in a mixture seeded `seed`."""
  return int(np.random.SeedSequence([seed, MIX_STREAM, index]).generate_state(1)[0])


@dataclasses.dataclass(frozen=True)
class MixtureSource:
  """One source of a mixture: its metric name, spec, objective and normalised rate."""

  name: str
  spec: str
  objective: Objective
  rate: float


class Mixture(Objective):
  """Examples of several objectives (one per source) at fixed rates; see the module
  docstring. The sources' objectives give the same features and shapes."""

  reads_in_order = True  # each block is interleaved at random already (the loader reads it in order)

  def __init__(self, sources: Sequence[MixtureSource], *, seed: int):
    self.sources, self.seed = list(sources), seed
    self.slots = allocate([s.rate for s in self.sources])  # [S]
    self.slot_starts = np.concatenate([[0], np.cumsum(self.slots)])  # [S + 1]
    self.sequences = [
        EpochSequence(self._sizes_of(s), seed=source_seed(seed, i), stream=SOURCE_STREAM)
        for i, s in enumerate(self.sources)]
    self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # the last 2 used

  @staticmethod
  def _sizes_of(source: MixtureSource):
    def size(epoch: int) -> int:
      n = source.objective.num_examples(epoch)
      if n <= 0:
        raise MixtureError(f"data.mixture[{source.spec!r}]: no examples in epoch {epoch}")
      return n
    return size

  def num_examples(self, epoch: int) -> int:
    return BLOCK

  def block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(source [BLOCK], position in that source's sequence [BLOCK]) of each example of
    block `block`: slot perm_b(j) picks the source; the source's examples in the block
    are its positions [b * n_s, (b + 1) * n_s), in order. O(BLOCK), cached."""
    if block not in self._blocks:
      slot = shuffled(np.arange(BLOCK), BLOCK, (self.seed, block, MIX_STREAM))
      source = np.searchsorted(self.slot_starts, slot, side="right") - 1
      position = np.empty(BLOCK, np.int64)
      for s, n in enumerate(self.slots.tolist()):
        position[source == s] = np.arange(block * n, (block + 1) * n)
      self._blocks[block] = (source, position)
      while len(self._blocks) > 2:
        del self._blocks[next(iter(self._blocks))]
    return self._blocks[block]

  def examples(self, indices: np.ndarray, epoch: int) -> Example:
    indices = np.asarray(indices, np.int64)
    source, position = (a[indices] for a in self.block(epoch))
    out: Example = {}
    for s in np.unique(source).tolist():
      rows = np.flatnonzero(source == s)
      epochs, examples = self.sequences[s].locate(position[rows])
      for e in np.unique(epochs).tolist():
        at = epochs == e
        for k, v in self.sources[s].objective.examples(examples[at], e).items():
          if k not in out:
            out[k] = np.zeros((len(indices),) + v.shape[1:], v.dtype)
          out[k][rows[at]] = v
    return out

  def feature_shapes(self) -> dict[str, tuple[int, ...]]:
    return self.sources[0].objective.feature_shapes()


def eval_sets(objective: Objective) -> list[tuple[str, Objective, float]]:
  """[(name, objective, weight)] to evaluate: a mixture's sources at their rates, or
  ("", objective, 1.0)."""
  if isinstance(objective, Mixture):
    return [(s.name, s.objective, s.rate) for s in objective.sources]
  return [("", objective, 1.0)]


def exhaustion_step(mixture: Mixture, global_batch_size: int) -> tuple[int, str]:
  """(G, name): global batch G of the mixture's loader is the first to read past source
  `name`'s first epoch (the G batches before it are whole). The loader reads a mixture in
  order, so G depends on neither the host nor the loader's seed."""
  best = None
  for s, source in enumerate(mixture.sources):
    size, n = source.objective.num_examples(0), int(mixture.slots[s])
    block = size // n  # the block holding the source's position `size`
    got, position = mixture.block(block)
    first = int(np.flatnonzero((got == s) & (position == size))[0])
    step = (block * BLOCK + first) // global_batch_size
    if best is None or step < best[0]:
      best = (step, source.name)
  return best
