"""One table drives both directions: our parameter path <-> a Hugging Face tensor.

Each family gives `spec(path) -> TensorSpec` for every parameter path of the
unscanned model. Import reads, checks the shape and reshapes; export does the
inverse, concatenating the parts of fused tensors (GPT-2's c_attn).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Optional

import flax
import jax
import numpy as np

from t5x_like.hf.io import CheckpointError, Weights
from t5x_like.models.config import ModelConfig
from t5x_like.models.model import build_model

Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """How our parameter of shape S maps to the HF tensor `name`.

  kind: 'same' (HF shape = S, embeddings), 'vector' (HF is S flattened), 'linear'
  (torch Linear [out, in] = kernel.reshape(in, out).T), 'conv1d' (HF [in, out] =
  kernel.reshape(in, out)), 'transpose' (HF = S.T, 2-D).
  in_dims: leading kernel dims that are inputs. part=(i, n): our tensor is part i
  of n equal slices along the HF tensor's last axis.
  """

  name: str
  kind: str
  in_dims: int = 1
  part: tuple[int, int] = (0, 1)


def _flat_hf_shape(spec: TensorSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
  i, n = spec.part
  if spec.kind == "same":
    return shape
  if spec.kind == "vector":
    return (math.prod(shape) * n,)
  if spec.kind == "transpose":
    return shape[::-1]
  rows, cols = math.prod(shape[:spec.in_dims]), math.prod(shape[spec.in_dims:])
  if spec.kind == "linear":
    return (cols, rows)
  if spec.kind == "conv1d":
    return (rows, cols * n)
  raise ValueError(f"unknown TensorSpec kind {spec.kind!r}")


def to_ours(spec: TensorSpec, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  """HF tensor (its full, unsliced value) -> our parameter of `shape`."""
  i, n = spec.part
  if n > 1:
    hf = np.split(hf, n, axis=-1)[i]
  if spec.kind == "linear":
    hf = hf.T
  elif spec.kind == "transpose":
    hf = hf.T
  return np.ascontiguousarray(hf.reshape(shape))


def to_hf(spec: TensorSpec, ours: np.ndarray) -> np.ndarray:
  """Our parameter -> its HF tensor (or this part of it)."""
  ours = np.asarray(ours, np.float32)
  if spec.kind == "same":
    return ours
  if spec.kind == "vector":
    return ours.reshape(-1)
  if spec.kind == "transpose":
    return ours.T
  rows = math.prod(ours.shape[:spec.in_dims])
  matrix = ours.reshape(rows, -1)
  return matrix.T if spec.kind == "linear" else matrix


def _unscanned_shapes(config: ModelConfig) -> dict[Path, tuple[int, ...]]:
  model = build_model(config.replace(scan_layers=False))
  shapes = model.param_shapes()
  return {tuple(k): tuple(v.shape)
          for k, v in flax.traverse_util.flatten_dict(shapes).items()}


def stack_layers(flat: dict[Path, np.ndarray]) -> dict[Path, np.ndarray]:
  """{(..., 'layers_i', ...): x} -> {(..., 'layers', ...): stack over i} (scan layout)."""
  groups: dict[Path, dict[int, np.ndarray]] = {}
  out = {}
  for path, value in flat.items():
    idx = next((j for j, p in enumerate(path) if p.startswith("layers_")), None)
    if idx is None:
      out[path] = value
      continue
    key = path[:idx] + ("layers",) + path[idx + 1:]
    groups.setdefault(key, {})[int(path[idx].split("_")[1])] = value
  for key, by_layer in groups.items():
    out[key] = np.stack([by_layer[i] for i in sorted(by_layer)])
  return out


def unstack_layers(flat: dict[Path, np.ndarray]) -> dict[Path, np.ndarray]:
  """Inverse of stack_layers."""
  out = {}
  for path, value in flat.items():
    if "layers" in path:
      idx = path.index("layers")
      for i in range(value.shape[0]):
        out[path[:idx] + (f"layers_{i}",) + path[idx + 1:]] = value[i]
    else:
      out[path] = value
  return out


SpecFn = Callable[[Path], TensorSpec]


def import_params(config: ModelConfig, weights: Weights, spec_fn: SpecFn,
                  resolve: Callable[[str], str] = lambda n: n) -> dict:
  """Reads every parameter of `config`'s model from `weights` -> nested params dict."""
  flat = {}
  cache: dict[str, np.ndarray] = {}
  for path, shape in _unscanned_shapes(config).items():
    spec = spec_fn(path)
    name = resolve(spec.name)
    if name not in cache:
      cache[name] = weights.take(name, _flat_hf_shape(spec, shape))
    flat[path] = to_ours(spec, cache[name], shape)
  if config.scan_layers:
    flat = stack_layers(flat)
  return flax.traverse_util.unflatten_dict(flat)


def import_parts(config: ModelConfig, weights: Weights, spec_fn: SpecFn,
                 resolve: Callable[[str], str], part_of: Callable[[Path], str],
                 wanted: tuple[str, ...], optional: tuple[str, ...] = (), read: bool = True
                 ) -> tuple[Optional[dict], dict[str, int], tuple[str, ...]]:
  """The parameters of `config`'s model in the parts `wanted` (part_of(path) names a
  parameter's part) -> (nested params, or None with read=False: names and shapes are
  checked from the files' headers, no data read; {part: tensors taken}, in `wanted`'s
  order; the parts of `optional` the checkpoint has no tensor of, left out).
  A part is taken whole or, when optional and absent, not at all; a missing tensor
  of a part otherwise present is a CheckpointError naming it."""
  entries: dict[str, list] = {part: [] for part in wanted}
  for path, shape in _unscanned_shapes(config).items():
    part = part_of(path)
    if part in entries:
      spec = spec_fn(path)
      entries[part].append((path, shape, spec, resolve(spec.name)))
  absent = tuple(part for part in wanted if part in optional and entries[part]
                 and not any(name in weights for *_, name in entries[part]))
  flat, cache, counts = {}, {}, {}
  for part in wanted:
    if part in absent or not entries[part]:
      continue
    for path, shape, spec, name in entries[part]:
      if name not in cache:
        hf_shape = _flat_hf_shape(spec, shape)
        cache[name] = weights.take(name, hf_shape) if read else weights.check(name, hf_shape)
        counts[part] = counts.get(part, 0) + 1
      if read:
        flat[path] = to_ours(spec, cache[name], shape)
  if not read:
    return None, counts, absent
  if config.scan_layers:
    flat = stack_layers(flat)
  return flax.traverse_util.unflatten_dict(flat), counts, absent


def export_params(config: ModelConfig, params: Mapping, spec_fn: SpecFn) -> dict[str, np.ndarray]:
  """Our params -> {hf_name: tensor}; fused tensors are concatenated from their parts."""
  flat = {tuple(k): np.asarray(jax.device_get(v))
          for k, v in flax.traverse_util.flatten_dict(dict(params)).items()}
  if config.scan_layers:
    flat = unstack_layers(flat)
  expected = _unscanned_shapes(config)
  if set(flat) != set(expected):
    missing = sorted("/".join(p) for p in set(expected) - set(flat))
    extra = sorted("/".join(p) for p in set(flat) - set(expected))
    raise CheckpointError(f"params do not match the model config: missing {missing[:5]},"
                          f" unexpected {extra[:5]}")
  parts: dict[str, dict[int, np.ndarray]] = {}
  for path, value in flat.items():
    if tuple(value.shape) != expected[path]:
      raise CheckpointError(f"param {'/'.join(path)} has shape {value.shape}, expected"
                            f" {expected[path]}")
    spec = spec_fn(path)
    parts.setdefault(spec.name, {})[spec.part[0]] = to_hf(spec, value)
  return {name: (by_part[0] if len(by_part) == 1 else
                 np.concatenate([by_part[i] for i in sorted(by_part)], axis=-1))
          for name, by_part in parts.items()}


# Fields that do not change the function a checkpoint computes.
_NON_ARCHITECTURE = {"dropout_rate", "attention_dropout_rate", "init_std", "dtype", "scan_layers",
                     "remat_policy", "z_loss", "label_smoothing", "mlp_hidden_dropout",
                     "scale_residual_init", "init_scheme", "loss_chunk_rows"}


def check_expressible(cfg: ModelConfig, wanted: ModelConfig, architecture: str) -> None:
  """Raises ValueError naming the first field where cfg differs from what HF can express."""
  for field, value in wanted.to_dict().items():
    if field not in _NON_ARCHITECTURE and getattr(cfg, field) != value:
      raise ValueError(f"ModelConfig.{field}={getattr(cfg, field)!r} cannot be exported as"
                       f" {architecture} (needs {value!r})")


def norm_spec(prefix: str, leaf: str) -> TensorSpec:
  """LayerNorm / RMSNorm: our scale -> prefix.weight, bias -> prefix.bias."""
  return TensorSpec(f"{prefix}.{'weight' if leaf == 'scale' else 'bias'}", "vector")


def linear_spec(prefix: str, leaf: str, in_dims: int = 1) -> TensorSpec:
  """torch.nn.Linear: our kernel -> prefix.weight [out, in], bias -> prefix.bias."""
  if leaf == "kernel":
    return TensorSpec(f"{prefix}.weight", "linear", in_dims)
  return TensorSpec(f"{prefix}.bias", "vector")
