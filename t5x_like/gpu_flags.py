"""XLA flags for NVIDIA GPUs, set by the `t5x-like` command before jax starts.

  env = with_gpu_flags(os.environ, gpu_present=True)   # XLA_FLAGS gains the kept flags

JAX's GPU performance guide (docs.jax.dev, "GPU performance tips") and NVIDIA's JAX
images recommend flags that XLA does not set by default. A flag is in KEPT only where
a measurement says it helps (docs/benchmarks.md); CANDIDATES are the others of the
guide, measured by `launch/gpu_bench.sh` (each variant with its profile table) before
they may move to KEPT.

A flag the user already names in XLA_FLAGS is left as the user set it.
T5X_LIKE_GPU_XLA_FLAGS overrides the list: "none" sets nothing, "candidates" sets KEPT
and CANDIDATES, anything else is taken as the flags to set (space separated).
"""

from __future__ import annotations

from typing import Mapping

# flag -> why it is kept.
KEPT: dict[str, str] = {
    # NVIDIA's JAX images set it by default (JAX-Toolbox, "Environment Variables"): it
    # lets XLA schedule collectives to overlap compute. It only moves collectives, so a
    # one-GPU step has nothing to reorder.
    "--xla_gpu_enable_latency_hiding_scheduler=true":
        "overlaps collectives with compute (NVIDIA's JAX images set it)",
}

# flag -> what it is expected to change; not set until a GPU profile shows a gain.
CANDIDATES: dict[str, str] = {
    "--xla_gpu_triton_gemm_any=true":
        "Triton GEMMs for every matmul it supports (fusing the epilogue), not only cuBLAS",
}

ENV = "T5X_LIKE_GPU_XLA_FLAGS"


def flag_name(flag: str) -> str:
  """'--xla_gpu_x=true' -> '--xla_gpu_x'."""
  return flag.split("=", 1)[0]


def chosen_flags(env: Mapping[str, str]) -> list[str]:
  """The flags to set on a GPU: KEPT, or what T5X_LIKE_GPU_XLA_FLAGS says."""
  choice = env.get(ENV, "").strip()
  if not choice:
    return list(KEPT)
  if choice == "none":
    return []
  if choice == "candidates":
    return [*KEPT, *CANDIDATES]
  return choice.split()


def with_gpu_flags(env: Mapping[str, str], *, gpu_present: bool) -> dict[str, str]:
  """A copy of env whose XLA_FLAGS carries the chosen GPU flags (where a GPU is
  present), each unless XLA_FLAGS already names it."""
  out = dict(env)
  if not gpu_present:
    return out
  current = out.get("XLA_FLAGS", "").split()
  named = {flag_name(f) for f in current}
  added = [f for f in chosen_flags(env) if flag_name(f) not in named]
  if added:
    out["XLA_FLAGS"] = " ".join([*current, *added])
  return out
