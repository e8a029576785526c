"""Reading and writing Hugging Face checkpoint directories (config.json + safetensors).

Weights are read through safetensors' numpy API; torch is never imported.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from t5x_like.errors import UserError

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(UserError, ValueError):
  """A Hugging Face directory that cannot be read; the message names file and tensor."""


def read_config(path: str) -> dict:
  """config.json of a checkpoint directory as a dict."""
  if not os.path.isdir(path):
    raise CheckpointError(f"{path}: not a directory (expected a Hugging Face checkpoint"
                          f" directory with {CONFIG_FILE} and {WEIGHTS_FILE})")
  config_path = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise CheckpointError(f"{config_path}: missing; not a Hugging Face checkpoint directory")
  try:
    with open(config_path, encoding="utf-8") as f:
      config = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{config_path}: not valid JSON ({e})") from e
  if not isinstance(config, dict):
    raise CheckpointError(f"{config_path}: expected a JSON object")
  return config


def _weight_files(path: str) -> list[str]:
  single = os.path.join(path, WEIGHTS_FILE)
  index = os.path.join(path, WEIGHTS_INDEX_FILE)
  if os.path.isfile(single):
    return [single]
  if os.path.isfile(index):
    with open(index, encoding="utf-8") as f:
      shards = sorted(set(json.load(f)["weight_map"].values()))
    return [os.path.join(path, s) for s in shards]
  others = [n for n in ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack")
            if os.path.isfile(os.path.join(path, n))]
  hint = (f" (found {', '.join(others)}: re-save it with safe_serialization=True)"
          if others else "")
  raise CheckpointError(f"{single}: missing; only safetensors checkpoints are read{hint}")


class Weights:
  """The tensors of a checkpoint, taken by name with shape checks.

  `take` records what was used so that leftovers can be reported.
  """

  def __init__(self, path: str):
    self.files = _weight_files(path)
    self._where: dict[str, str] = {}
    for file in self.files:
      if not os.path.isfile(file):
        raise CheckpointError(f"{file}: missing shard listed in {WEIGHTS_INDEX_FILE}")
      try:
        with safe_open(file, framework="numpy") as f:
          for name in f.keys():
            self._where[name] = file
      except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e
    self.used: set[str] = set()

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def names(self) -> list[str]:
    return sorted(self._where)

  def file_of(self, name: Optional[str] = None) -> str:
    return self._where.get(name, self.files[0]) if name else self.files[0]

  def take(self, name: str, shape: Sequence[int]) -> np.ndarray:
    """The tensor `name` as float32, checked against `shape`."""
    self.check(name, shape)
    return np.asarray(self.read(name), dtype=np.float32)

  def check(self, name: str, shape: Sequence[int]) -> None:
    """Marks `name` used after checking its shape (from the file's header: no data read)."""
    if name not in self._where:
      raise CheckpointError(f"{self.file_of()}: missing tensor {name!r} (expected shape"
                            f" {tuple(shape)})")
    with safe_open(self._where[name], framework="numpy") as f:
      found = tuple(f.get_slice(name).get_shape())
    if found != tuple(shape):
      raise CheckpointError(f"{self._where[name]}: tensor {name!r} has shape"
                            f" {found}, expected {tuple(shape)}")
    self.used.add(name)

  def read(self, name: str) -> np.ndarray:
    """The tensor `name` as stored, unchecked and not marked used."""
    with safe_open(self._where[name], framework="numpy") as f:
      return f.get_tensor(name)

  def report_unused(self, ignore: Iterable[str] = ()) -> list[str]:
    """Names never taken (minus known buffers); logged as a warning."""
    ignore = tuple(ignore)
    unused = [n for n in self.names() if n not in self.used and not n.endswith(ignore)]
    if unused:
      log.warning("%s: %d tensors not used by the model: %s", self.file_of(), len(unused),
                  ", ".join(unused[:20]) + (" ..." if len(unused) > 20 else ""))
    return unused


def write_checkpoint(path: str, config: Mapping, tensors: Mapping[str, np.ndarray]) -> None:
  """Writes config.json and model.safetensors (float32, contiguous) into `path`."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
    json.dump(dict(config), f, indent=2, sort_keys=True)
  arrays = {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32)) for k, v in tensors.items()}
  save_file(arrays, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})


def require(config: Mapping, key: str, path: str):
  """config[key] or an error naming config.json and the key."""
  if key not in config or config[key] is None:
    raise CheckpointError(f"{os.path.join(path, CONFIG_FILE)}: missing key {key!r}")
  return config[key]


def unsupported(path: str, key: str, value, expected) -> CheckpointError:
  return CheckpointError(f"{os.path.join(path, CONFIG_FILE)}: {key}={value!r} is not"
                         f" supported (expected {expected})")
