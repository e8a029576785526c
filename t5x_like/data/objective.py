"""The interface between objectives and the loader, and how an objective registers.

An objective turns a TokenStore into fixed-shape examples, each a pure function of
(seed, epoch, example index): the loader may ask for any example in any order, on
any host, after any restart, and gets the same arrays.

Each objective module describes itself with an ObjectiveSpec; data/pipeline.py's
OBJECTIVES lists them, and validation, training, plan and bench read only that list.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
from typing import Any, Callable, Optional

import numpy as np

Example = dict[str, np.ndarray]


def example_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
  """The random generator of one example: seeded from (seed, epoch, index) only."""
  return np.random.default_rng([seed, epoch, index])


def shift_right(targets_BxT: np.ndarray, real_BxT=None) -> np.ndarray:
  """Decoder inputs [B, T] int32: targets shifted right with 0 (BOS); 0 where real_BxT
  (if given) is False."""
  shifted = np.zeros_like(targets_BxT)
  shifted[:, 1:] = targets_BxT[:, :-1]
  if real_BxT is not None:
    shifted = np.where(real_BxT, shifted, 0)
  return shifted.astype(np.int32)


class Objective(abc.ABC):
  """Fixed-shape examples from a TokenStore, deterministic in (seed, epoch, index).

  A subclass implements num_examples and one of `examples` (vectorised, preferred) or
  `example`; the other is derived from it.
  """

  seed: int
  # True: each epoch's examples are already in a seeded random order (data/mixture.py);
  # the loader reads them in order instead of permuting them.
  reads_in_order: bool = False
  # True: the loader hands each host's rows to fit_batch with the whole global batch's
  # (epoch, indices) runs, the same on every host (finetune's EncodedRows cuts padding).
  fits_batches: bool = False

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if cls.example is Objective.example and cls.examples is Objective.examples:
      raise TypeError(f"{cls.__name__} must implement `examples` or `example`")

  @abc.abstractmethod
  def num_examples(self, epoch: int) -> int:
    """How many examples epoch `epoch` has (may differ between epochs)."""

  def example(self, index: int, epoch: int) -> Example:
    """Example `index` of `epoch`: {feature name: array} with shapes fixed by the config."""
    return {k: v[0] for k, v in self.examples(np.asarray([index], np.int64), epoch).items()}

  def examples(self, indices: np.ndarray, epoch: int) -> Example:
    """Examples [len(indices), ...] stacked along a new leading batch axis."""
    rows = [self.example(int(i), epoch) for i in indices]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

  def fit_batch(self, batch: Example, global_runs: list[tuple[int, np.ndarray]]) -> Example:
    """This host's rows of a global batch, reshaped by what the whole batch holds
    (fits_batches objectives only): e.g. cut to the batch's longest row."""
    return batch

  def feature_shapes(self) -> dict[str, tuple[int, ...]]:
    """Per-example shapes, read off example 0 of epoch 0."""
    return {k: v.shape for k, v in self.example(0, 0).items()}


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
  """An objective as configs name it (one entry of data/pipeline.py's OBJECTIVES).

  name: config.data.objective. cls: its Objective class; the constructor's keyword
  parameters that `build` does not fill are the options config.data.options may set.
  vocab_family: the vocabulary family whose special ids it needs (bert, t5, gpt).
  model_family: the model family it trains (encoder, decoder, encoder_decoder).
  default_length: its usual input length (`bench data`'s default).
  build: (store, vocab, seed=, length=, targets_length=, **options) -> Objective.
  filled: constructor parameters `build` sets from the store, vocabulary and lengths.
  needs_targets_length: config.data.targets_length must be set (> 0).
  decoder_length: (length, targets_length, options) -> the decoder's length, for an
  encoder-decoder objective (the attention kernel check needs it before any data).
  """

  name: str
  cls: type
  vocab_family: str
  model_family: str
  default_length: int
  build: Callable[..., Objective]
  filled: frozenset = frozenset()
  needs_targets_length: bool = False
  decoder_length: Optional[Callable[[int, int, dict], int]] = None

  def attention_lengths(self, length: int, targets_length: int,
                        options: dict) -> list[tuple[int, int]]:
    """(query, key) lengths of the attention calls of a model trained at `length`:
    self-attention, and with a decoder_length the decoder's self- and cross-attention."""
    calls = [(length, length)]
    if self.decoder_length is not None:
      decoder = self.decoder_length(length, targets_length, options)
      calls += [(decoder, decoder), (decoder, length)]
    return calls

  def options(self) -> set[str]:
    """Constructor options a config may set in data.options."""
    return set(self.option_defaults())

  def typed_option(self, name: str, value: Any) -> Any:
    """An option's value with text parsed by the type of its default: a command line
    gives text ("0.3" -> 0.3, "false" -> False, "80" -> 80); text for an option without
    a default is parsed as a number or a boolean where it is one. Other values are
    returned as they are. ValueError (naming the option) for text that does not parse."""
    if not isinstance(value, str):
      return value
    default = self.option_defaults().get(name)
    if isinstance(default, str):
      return value
    if default is None:
      for parse in (_parse_bool, int, float):
        try:
          return parse(value)
        except ValueError:
          pass
      return value
    kind = bool if isinstance(default, bool) else type(default)
    try:
      return _parse_bool(value) if kind is bool else kind(value)
    except (TypeError, ValueError):
      raise ValueError(f"{name}={value!r}: expected {kind.__name__} (like the default"
                       f" {default!r})") from None

  def option_defaults(self) -> dict[str, Any]:
    """{option: its default (None when it has none)} of data.options."""
    params = inspect.signature(self.cls.__init__).parameters
    return {name: (None if p.default is inspect.Parameter.empty else p.default)
            for name, p in params.items() if name not in self.filled | {"self", "store", "seed"}}


def _parse_bool(text: str) -> bool:
  """"true" / "false" (any case, as absl's boolean flags); ValueError otherwise."""
  if text.lower() in ("true", "false"):
    return text.lower() == "true"
  raise ValueError(f"not a boolean: {text!r}")


def require_special_ids(vocab, spec: ObjectiveSpec, *names: str) -> None:
  """ValueError unless `vocab` has every special id in `names` (e.g. "eos_id")."""
  missing = [n for n in names if getattr(vocab, n, None) is None]
  if missing:
    raise ValueError(f"objective {spec.name!r} needs a vocabulary with {', '.join(missing)};"
                     f" {vocab!r} (family {vocab.family!r}) has none. Use a"
                     f" {spec.vocab_family!r} vocabulary.")
