"""t5x_like/gpu_flags.py: which XLA flags the command sets on a GPU host, and how it
tells it is on one (before jax starts)."""

from t5x_like import cli, gpu_flags

LHS = "--xla_gpu_enable_latency_hiding_scheduler=true"
TRITON_GEMM = "--xla_gpu_triton_gemm_any=true"


def test_no_gpu_leaves_the_environment_alone():
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  assert gpu_flags.with_gpu_flags(env, gpu_present=False) == env


def test_no_flag_is_kept_without_a_measurement():
  """KEPT is empty until a GPU profile shows a gain: a GPU run sets nothing unasked."""
  assert gpu_flags.KEPT == {}
  env = {"XLA_FLAGS": "--xla_dump_to=/tmp/d"}
  assert gpu_flags.with_gpu_flags(env, gpu_present=True) == env
  assert "XLA_FLAGS" not in gpu_flags.with_gpu_flags({}, gpu_present=True)


def test_chosen_flags_follow_the_users_and_leave_the_input_alone():
  env = {"XLA_FLAGS": "--xla_dump_to=/tmp/d", gpu_flags.ENV: "candidates"}
  out = gpu_flags.with_gpu_flags(env, gpu_present=True)
  assert out["XLA_FLAGS"] == f"--xla_dump_to=/tmp/d {LHS} {TRITON_GEMM}"
  assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"  # the input is not changed


def test_a_flag_the_user_set_keeps_the_users_value():
  env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false",
         gpu_flags.ENV: "candidates"}
  out = gpu_flags.with_gpu_flags(env, gpu_present=True)
  assert out["XLA_FLAGS"] == f"--xla_gpu_enable_latency_hiding_scheduler=false {TRITON_GEMM}"


def test_the_override_variable_chooses_none_candidates_or_a_list():
  none = gpu_flags.with_gpu_flags({gpu_flags.ENV: "none"}, gpu_present=True)
  assert "XLA_FLAGS" not in none
  cands = gpu_flags.with_gpu_flags({gpu_flags.ENV: "candidates"}, gpu_present=True)
  assert cands["XLA_FLAGS"].split() == [LHS, TRITON_GEMM]
  mine = gpu_flags.with_gpu_flags({gpu_flags.ENV: "--xla_gpu_a=1 --xla_gpu_b=2"},
                                   gpu_present=True)
  assert mine["XLA_FLAGS"] == "--xla_gpu_a=1 --xla_gpu_b=2"


def _pci(root, *vendors):
  for i, vendor in enumerate(vendors):
    (root / f"0000:0{i}:00.0").mkdir(parents=True)
    (root / f"0000:0{i}:00.0" / "vendor").write_text(vendor + "\n")
  return str(root)


def test_a_gpu_is_found_by_its_pci_vendor_or_its_device_files(tmp_path):
  dev, no_pci = tmp_path / "dev", str(tmp_path / "hidden_sys")
  dev.mkdir()
  (dev / "nvidiactl").touch()  # the driver's files, present without a GPU
  (dev / "nvidia-uvm").touch()
  other = _pci(tmp_path / "pci_intel", "0x8086")
  assert not gpu_flags.nvidia_gpu_present(other, str(dev))
  assert not cli.accelerator_present(other, str(dev))
  nvidia = _pci(tmp_path / "pci_nvidia", "0x8086", "0x10de")
  assert gpu_flags.nvidia_gpu_present(nvidia, str(dev))
  (dev / "nvidia0").touch()  # a container that hides /sys still has the GPU's file
  assert gpu_flags.nvidia_gpu_present(no_pci, str(dev))
  assert cli.accelerator_present(no_pci, str(dev))


def test_a_tpu_is_found_by_its_pci_vendor_or_its_device_files(tmp_path):
  empty, no_pci = tmp_path / "empty_dev", str(tmp_path / "hidden_sys")
  empty.mkdir()
  assert cli.accelerator_present(_pci(tmp_path / "pci", "0x1ae0"), str(empty))
  assert not gpu_flags.nvidia_gpu_present(_pci(tmp_path / "pci2", "0x1ae0"), str(empty))
  for name in ("accel0", "vfio"):
    dev = tmp_path / f"dev_{name}"
    dev.mkdir()
    (dev / name).touch()
    assert cli.accelerator_present(no_pci, str(dev))
