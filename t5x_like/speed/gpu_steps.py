"""The steps of `t5x-like bench gpu`, in order of importance.

  for step in suite_steps(rehearse=False, configs="configs"): ...

First the two `bench peer` ratios against torch.compile (GPT-2 124M, BERT-large 512),
then each recipe's `bench model` with its profile table (BERT-large with the recipe's
attention dropout, GPT-2 124M, T5 v1.1 base), then the checks of the fused attention
kernel (its losses against the explicit kernel's; a SIGKILL and resume through it),
then `bench attention`, and last the variants that decide a setting (the full logits
against the chunked loss, remat `auto`, each candidate XLA flag of gpu_flags.py, the
unrolled stack).

With rehearse=True every step keeps its flags and runs the recipe's own CPU-sized copy
(the configs' `local` argument: same objective, optimizer and remat policy, a tiny
model) at a smoke batch, length and step count, so that the whole suite runs end to end
on a CPU in minutes, each flag parsed by the real command.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from t5x_like import gpu_flags
from t5x_like.models import attention_kernels

# XLA:GPU's deterministic scatter, reductions and GEMM choice (it implies
# --xla_gpu_exclude_nondeterministic_ops): a resumed run can then equal the whole one.
DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops=true"
# JAX's share of the GPU in a peer step, beside PyTorch (read when JAX's client starts).
PEER_MEMORY_FRACTION = "0.5"
# The rehearsal's figures are not timings: one matmul for a CPU's peak, and JAX's
# persistent compilation cache across its processes (gpu_suite.py sets the folder).
REHEARSAL_BENCH_FLAGS = ("--peak_repeats", "1", "--compilation_cache")
# The resume check kills the run right after this step's checkpoint is written.
RESUME_KILL_STEP = {False: 8, True: 4}


@dataclasses.dataclass(frozen=True)
class Recipe:
  """A config of the GPU table: its file:arg under configs/, the recipe's flags, and the
  smoke flags that the rehearsal adds (after every other flag)."""

  title: str
  config: str
  flags: tuple[str, ...]
  smoke_flags: tuple[str, ...]

  def config_flag(self, configs: str, rehearse: bool) -> tuple[str, ...]:
    spec = os.path.join(configs, self.config) + (",local" if rehearse else "")
    return ("--config", spec)


RECIPES = {
    "bert": Recipe("BERT-large 512, b32, attention dropout 0.1", "bert_pretrain.py:large",
                   ("--config.data.length=512",
                    "--config.data.options.max_predictions_per_seq=80",
                    "--config.train.batch_size=32"),
                   ("--config.data.length=64", "--config.data.options.max_predictions_per_seq=10",
                    "--config.train.batch_size=4")),
    "gpt2": Recipe("GPT-2 124M, b32 x 1024", "gpt2_pretrain.py:124m",
                   ("--config.train.batch_size=32",),
                   ("--config.data.length=64", "--config.train.batch_size=4")),
    "t5": Recipe("T5 v1.1 base, b128, 512 -> 114", "t5_pretrain.py:base",
                 ("--config.train.batch_size=128",),
                 ("--config.data.length=64", "--config.train.batch_size=4")),
}


@dataclasses.dataclass(frozen=True)
class Step:
  """One step of the suite.

  kind: 'bench' (`t5x-like ARGS` prints one JSON object), 'compare' (the losses of two
  bench steps), 'resume' (a SIGKILL after a save and a rerun against a whole run).
  args: after `t5x-like` ('bench'), or the `train` flags ('resume'); `--profile DIR` is
  added by the runner where profile is set. env: added to the environment (XLA_FLAGS is
  appended to, not replaced). fallback: flags of a second try after running out of
  memory (the peer's smaller batch). uses: the steps a 'compare' reads.
  """

  name: str
  title: str
  kind: str = "bench"
  args: tuple[str, ...] = ()
  env: tuple[tuple[str, str], ...] = ()
  timeout: int = 150
  profile: bool = False
  fallback: tuple[str, ...] = ()
  uses: tuple[str, ...] = ()


def _bench_model(name: str, recipe: str, title: str, extra: tuple[str, ...] = (), *,
                 configs: str, rehearse: bool, profile: bool = True,
                 env: tuple[tuple[str, str], ...] = (), timeout: int = 150) -> Step:
  r = RECIPES[recipe]
  counts = (("--steps", "3", "--warmup", "1", *REHEARSAL_BENCH_FLAGS) if rehearse
            else ("--steps", "20", "--warmup", "3"))
  args = ("bench", "model", *r.config_flag(configs, rehearse), *r.flags, *extra,
          *(r.smoke_flags if rehearse else ()), *counts, "--nodecode")
  return Step(name, title, args=args, env=env, timeout=timeout,
              profile=profile)


def _bench_peer(name: str, recipe: str, *, configs: str, rehearse: bool,
                fallback_batch: Optional[int] = None, timeout: int = 200) -> Step:
  r = RECIPES[recipe]
  # torch.compile takes minutes on a CPU: the rehearsal's small peer runs eager.
  counts = (("--steps", "2", "--warmup", "1", "--compile", "eager", *REHEARSAL_BENCH_FLAGS)
            if rehearse
            else ("--steps", "20", "--warmup", "3", "--compile", "compiled"))
  args = ("bench", "peer", *r.config_flag(configs, rehearse), *r.flags,
          *(r.smoke_flags if rehearse else ()), *counts, "--rounds", "1")
  fallback = ()
  if fallback_batch is not None:
    fallback = (f"--config.train.batch_size={fallback_batch // (8 if rehearse else 1)}",)
  return Step(name, f"bench peer: {r.title}, ours / torch.compile", args=args,
              env=(("XLA_PYTHON_CLIENT_MEM_FRACTION", PEER_MEMORY_FRACTION),),
              timeout=timeout, fallback=fallback)


def resume_args(configs: str, rehearse: bool) -> tuple[str, ...]:
  """`train` flags of the resume check: BERT-tiny (bf16 on a GPU, attention dropout 0.1)
  through the Pallas GPU kernel, a checkpoint every RESUME_KILL_STEP steps."""
  every = RESUME_KILL_STEP[rehearse]
  steps = 3 * every
  args = ("--config", os.path.join(configs, "bert_cpu.py"),
          "--config.model.attention_impl=pallas_gpu", f"--config.train.num_steps={steps}",
          "--config.train.log_every=1", f"--config.train.checkpoint_every={every}",
          f"--config.train.eval_every={2 * every}", "--config.train.eval_batches=2",
          "--config.train.async_checkpoints=False", "--config.optimizer.warmup_steps=4")
  if rehearse:
    args += ("--config.train.batch_size=8",)
  return args


def _flag_step_name(flag: str) -> str:
  """'--xla_gpu_triton_gemm_any=true' -> 'gpt2_flag_triton_gemm_any'."""
  return "gpt2_flag_" + gpu_flags.flag_name(flag).removeprefix("--xla_gpu_")


def suite_steps(*, rehearse: bool, configs: str = "configs") -> list[Step]:
  """Every step, in the order they run (module docstring)."""
  kw = dict(configs=configs, rehearse=rehearse)
  # On the CPU `auto` takes the explicit kernel; the rehearsal names the Pallas GPU
  # kernel, which `auto` takes on a GPU for attention dropout, in interpret mode.
  fused = ("--config.model.attention_impl=pallas_gpu",) if rehearse else ()
  interpret = ((attention_kernels.PALLAS_INTERPRET_ENV, "1"),) if rehearse else ()
  # The variants' profiles on a GPU; the rehearsal profiles the recipes only (the same
  # code path, in a third of the time).
  variant = dict(kw, profile=not rehearse)
  steps = [
      _bench_peer("peer_gpt2", "gpt2", **kw),
      _bench_peer("peer_bert", "bert", fallback_batch=16, **kw),
      _bench_model("bert", "bert", f"{RECIPES['bert'].title}, attention_impl=auto", fused,
                   env=interpret, **kw),
      _bench_model("gpt2", "gpt2", RECIPES["gpt2"].title, **kw),
      _bench_model("t5", "t5", RECIPES["t5"].title, **kw),
      _bench_model("bert_explicit", "bert", f"{RECIPES['bert'].title}, explicit kernel",
                   ("--config.model.attention_impl=explicit",), profile=False, **kw),
      Step("compare", "fused kernel against the explicit kernel: first loss within 1e-3,"
           " every loss within bf16 tolerance", kind="compare", timeout=5,
           uses=("bert", "bert_explicit")),
      Step("resume", "SIGKILL after a save and a rerun through the fused kernel equal the"
           " whole run (XLA:GPU deterministic)", kind="resume",
           args=resume_args(configs, rehearse),
           env=(("XLA_FLAGS", DETERMINISTIC_FLAG), *interpret),
           timeout=240 if rehearse else 150),
      Step("attention", "every attention kernel against float32; time", args=(
          "bench", "attention",
          *(("--batch", "1", "--length", "64", "--heads", "2", "--head_dim", "16",
             "--steps", "1") if rehearse else
            ("--length", "512", "--heads", "16", "--head_dim", "64", "--steps", "20")),
          "--dtype", "bfloat16"), timeout=90),
      _bench_model("gpt2_full_logits", "gpt2", "GPT-2 124M, full [B, T, V] logits",
                   ("--config.model.overrides.loss_chunk_rows=0",), **variant),
      _bench_model("t5_full_logits", "t5", "T5 v1.1 base, full [B, T, V] logits",
                   ("--config.model.overrides.loss_chunk_rows=0",), **variant),
      _bench_model("bert_remat_auto", "bert", "BERT-large, remat_policy=auto",
                   ("--config.model.remat_policy=auto", *fused), env=interpret, **variant),
      _bench_model("gpt2_remat_auto", "gpt2", "GPT-2 124M, remat_policy=auto",
                   ("--config.model.remat_policy=auto",), **variant),
      _bench_model("t5_remat_auto", "t5", "T5 v1.1 base, remat_policy=auto",
                   ("--config.model.remat_policy=auto",), **variant),
  ]
  for flag in gpu_flags.CANDIDATES:
    # Set in XLA_FLAGS itself (XLA parses GPU flags on any backend: the rehearsal checks
    # that this jaxlib knows the flag); none of gpu_flags' own list beside it.
    steps.append(_bench_model(_flag_step_name(flag), "gpt2", f"GPT-2 124M, {flag}",
                              env=(("XLA_FLAGS", flag), (gpu_flags.ENV, "none")), **variant))
  # An unrolled stack tests remat and scan, not the kernel: the rehearsal's explicit
  # kernel unrolls in half the time of the interpreted one.
  steps.append(_bench_model("bert_unrolled", "bert", "BERT-large, remat auto, unrolled",
                            ("--config.model.remat_policy=auto",
                             "--config.model.scan_layers=false"), **variant))
  return steps
