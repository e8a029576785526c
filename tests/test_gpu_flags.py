"""t5x_like/gpu_flags.py: which XLA flags the command sets on a GPU host."""

from t5x_like import gpu_flags

LHS = "--xla_gpu_enable_latency_hiding_scheduler=true"


def test_no_gpu_leaves_the_environment_alone():
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  assert gpu_flags.with_gpu_flags(env, gpu_present=False) == env


def test_a_gpu_adds_the_kept_flags_after_the_users():
  env = {"XLA_FLAGS": "--xla_dump_to=/tmp/d"}
  out = gpu_flags.with_gpu_flags(env, gpu_present=True)
  assert out["XLA_FLAGS"] == f"--xla_dump_to=/tmp/d {LHS}"
  assert env == {"XLA_FLAGS": "--xla_dump_to=/tmp/d"}  # the input is not changed


def test_a_flag_the_user_set_keeps_the_users_value():
  env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
  assert gpu_flags.with_gpu_flags(env, gpu_present=True) == env


def test_the_override_variable_chooses_none_candidates_or_a_list():
  none = gpu_flags.with_gpu_flags({gpu_flags.ENV: "none"}, gpu_present=True)
  assert "XLA_FLAGS" not in none
  cands = gpu_flags.with_gpu_flags({gpu_flags.ENV: "candidates"}, gpu_present=True)
  assert cands["XLA_FLAGS"].split() == [LHS, "--xla_gpu_triton_gemm_any=true"]
  mine = gpu_flags.with_gpu_flags({gpu_flags.ENV: "--xla_gpu_a=1 --xla_gpu_b=2"},
                                   gpu_present=True)
  assert mine["XLA_FLAGS"] == "--xla_gpu_a=1 --xla_gpu_b=2"
