"""`bench model --profile`: the device-time table read back from a jax.profiler trace
(speed/profile.py). Hand-written traces (XSpace text protos in the CPU and the GPU
layout) and a hand-written HLO module with times worked out by hand; then one real
trace of a tiny data-parallel step on the CPU, and (slow tier) of the smoke GPT
through `t5x-like bench model --profile`."""

import gzip
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.profiler import ProfileData
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from t5x_like import cli
from t5x_like.speed import profile as prof

# A module with one instruction of each kind the table tells apart. The fusions'
# op_names are the jax name stacks the train step gives them.
HLO = """HloModule jit_train_step, entry_computation_layout={()->f32[4,4]{1,0}}

%fused_dot (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/jvp(DecoderModule)/decoder/layers_0/mlp/wi/dot_general"}
}

%fused_scores (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  ROOT %dot.2 = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_copy (p0: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %transpose.1 = f32[4,4]{0,1} transpose(%p0), dimensions={1,0}
  ROOT %copy.1 = f32[4,4]{1,0} copy(%transpose.1)
}

%fused_exp (p0: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  ROOT %exponential.1 = f32[4,4]{1,0} exponential(%p0)
}

%fused_norm (p0: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  ROOT %multiply.1 = f32[4,4]{1,0} multiply(%p0, %p0)
}

%add_comp (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.9 = f32[] add(%a, %b)
}

ENTRY %main.1 () -> f32[4,4] {
  %x = f32[4,4]{1,0} constant({...})
  %dot_fusion = f32[4,4]{1,0} fusion(%x, %x), kind=kCustom, calls=%fused_dot
  %scores_fusion = f32[4,4]{1,0} fusion(%x, %x), kind=kCustom, calls=%fused_scores, metadata={op_name="jit(train_step)/transpose(jvp(DecoderModule))/decoder/layers_0/self_attention/bqhd,bkhd->bhqk/dot_general"}
  %copy_fusion = f32[4,4]{1,0} fusion(%x), kind=kLoop, calls=%fused_copy, metadata={op_name="jit(train_step)/jvp(DecoderModule)/decoder/layers_0/self_attention/query/transpose"}
  %loss_fusion = f32[4,4]{1,0} fusion(%x), kind=kLoop, calls=%fused_exp, metadata={op_name="jit(train_step)/jvp()/exp"}
  %norm_fusion = f32[4,4]{1,0} fusion(%x), kind=kLoop, calls=%fused_norm, metadata={op_name="jit(train_step)/jvp(DecoderModule)/decoder/layers_0/self_attention_norm/mul"}
  %adam_fusion = f32[4,4]{1,0} fusion(%x), kind=kLoop, calls=%fused_norm, metadata={op_name="jit(train_step)/optimizer_update/mul"}
  %all-reduce.1 = f32[4,4]{1,0} all-reduce(%x), replica_groups={}, to_apply=%add_comp
  %custom-call.1 = f32[4,4]{1,0} custom-call(%x), custom_call_target="__cudnn$fmhaSoftmaxDropout"
  %custom-call.2 = f32[4,4]{1,0} custom-call(%x), custom_call_target="AllocateBuffer"
  %sort.1 = f32[4,4]{1,0} sort(%x), dimensions={0}, to_apply=%add_comp
  ROOT %while.1 = f32[4,4]{1,0} while(%x), condition=%add_comp, body=%add_comp
}
"""


def test_classify_each_kind_of_instruction_by_its_hlo():
  infos = prof.hlo_ops(HLO)
  want = {"dot_fusion": prof.MATMULS,
          "scores_fusion": prof.ATTENTION,  # a dot, but inside the attention core
          "copy_fusion": prof.COPIES,  # transpose + copy only, under a projection
          "loss_fusion": prof.LOSS,  # the loss function, outside the model module
          "norm_fusion": prof.ELEMENTWISE,  # 'attention' in a norm's name is a norm
          "adam_fusion": prof.OPTIMIZER,
          "all-reduce.1": prof.COLLECTIVES,
          "custom-call.1": prof.ATTENTION,  # cuDNN's fused attention
          "custom-call.2": prof.OTHER, "sort.1": prof.OTHER, "while.1": prof.OTHER}
  assert {name: prof.classify(name, infos[name]) for name in want} == want
  assert prof.hlo_module_name(HLO) == "jit_train_step"
  # The fusion without op_name metadata of its own takes its root's.
  assert infos["dot_fusion"].op_name.endswith("mlp/wi/dot_general")


@pytest.mark.parametrize("kernel,category", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32", prof.MATMULS), ("cutlass_80_tensorop_s1688gemm",
                                                        prof.MATMULS),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", prof.COLLECTIVES),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", prof.ATTENTION),
    ("MemcpyD2D", prof.COPIES), ("dynamic_update_slice_fusion", prof.COPIES),
    ("loop_multiply_fusion", prof.ELEMENTWISE), ("input_reduce_fusion", prof.ELEMENTWISE),
    ("mystery_kernel", prof.OTHER)])
def test_classify_by_kernel_name_without_hlo(kernel, category):
  assert prof.classify(kernel, None) == category


def test_overlapping_kernels_share_their_time_and_gaps_are_idle():
  # a alone 0-5, a and b 5-10 (2.5 each), b alone 10-15, nothing 15-20, a 20-30.
  shares, idle, span = prof.share_time([(0, 10, "a"), (5, 15, "b"), (20, 30, "a")])
  assert shares == {"a": 17.5, "b": 7.5}
  assert (idle, span) == (5, 30)
  assert prof.share_time([]) == ({}, 0.0, 0.0)


# ------------------------------------------------------------------ hand-written traces
def _xspace(planes: dict) -> ProfileData:
  """An XSpace text proto: {plane: {line: [(name, start_ms, duration_ms, {stat: value})]}}
  (times from 0 on every line) read by jaxlib's reader."""
  text, ids = [], {}

  def meta(kind, name):
    return ids.setdefault((kind, name), len(ids) + 1)

  for plane_id, (plane, lines) in enumerate(planes.items(), 1):
    ids.clear()
    body = []
    for line_id, (line, events) in enumerate(lines.items(), 1):
      evs = []
      for name, start_ms, dur_ms, stats in events:
        st = " ".join(
            f"stats {{ metadata_id: {meta('stat', k)} "
            + (f'str_value: "{v}"' if isinstance(v, str) else f"int64_value: {v}") + " }"
            for k, v in stats.items())
        evs.append(f"events {{ metadata_id: {meta('event', name)} "
                   f"offset_ps: {int(start_ms * 1e9)} duration_ps: {int(dur_ms * 1e9)} {st} }}")
      body.append(f'lines {{ id: {line_id} name: "{line}" timestamp_ns: 0 {" ".join(evs)} }}')
    for (kind, name), i in ids.items():
      body.append(f'{kind}_metadata {{ key: {i} value {{ id: {i} name: "{name}" }} }}')
    text.append(f'planes {{ id: {plane_id} name: "{plane}" {" ".join(body)} }}')
  return ProfileData.from_text_proto("\n".join(text))


def _thunk(op, start, dur, device, module="jit_train_step"):
  return (op, start, dur, {"hlo_op": op, "hlo_module": module, "device_ordinal": device})


STEPS = [(prof.STEP_NAME, 0, 100, {"step_num": 0}), (prof.STEP_NAME, 200, 100, {"step_num": 1})]


@pytest.mark.parametrize("with_hlo", [True, False])
def test_cpu_layout_table_by_hand(with_hlo):
  """Two CPU devices (XLA:CPU thunks on the host plane) x two steps, times in ms.

  device 0, step 0: dot 10-30 and loss 20-35 overlap (5 ms each of 20-30), copy 40-50,
  idle 35-40: span 40 = matmuls 15 + loss 10 + copies 10 + idle 5. device 1: all-reduce
  10-60 (50). Step 1: dot 210-240 (30) on device 0, all-reduce 210-230 (20) on device 1.
  Left out: the while thunk (its body's kernels count), another module's kernel, and a
  kernel between the steps. Per (device, step), averaged over the 4: span 35 ms.
  Without the HLO, the kernel names alone tell the same, except the loss: its fusion
  is an elementwise fusion by name.
  """
  data = _xspace({"/host:CPU": {
      "python": STEPS,
      "thread0": [_thunk("while.1", 5, 90, 0), _thunk("dot_fusion", 10, 20, 0),
                  _thunk("copy_fusion", 40, 10, 0), _thunk("dot_fusion", 210, 30, 0),
                  _thunk("dot_fusion", 150, 10, 0)],
      "thread1": [_thunk("loss_fusion", 20, 15, 0), _thunk("all-reduce.1", 10, 50, 1),
                  _thunk("all-reduce.1", 210, 20, 1),
                  _thunk("dot_fusion", 60, 30, 1, module="jit_other")]}})
  kernels, windows = prof.trace_kernels(data)
  assert windows == [(0, 100e6), (200e6, 300e6)]
  table = prof.profile_table("fixture", hlo_text=HLO if with_hlo else None,
                             kernels_and_windows=(kernels, windows), module="jit_train_step")
  rows = {r["category"]: r for r in table["rows"]}
  loss = prof.LOSS if with_hlo else prof.ELEMENTWISE
  assert (table["steps"], table["devices"], table["step_ms"]) == (2, 2, 35.0)
  assert table["wall_step_ms"] == 100.0
  assert {c: r["ms_per_step"] for c, r in rows.items() if r["ms_per_step"]} == {
      prof.MATMULS: 11.25, loss: 2.5, prof.COPIES: 2.5, prof.COLLECTIVES: 17.5,
      prof.IDLE: 1.25}
  assert rows[prof.MATMULS]["percent"] == pytest.approx(100 * 45 / 140, abs=0.01)
  assert rows[prof.MATMULS]["kernels_per_step"] == 0.5  # 2 dots over 4 (device, step)
  assert sum(r["ms_per_step"] for r in rows.values()) == pytest.approx(table["step_ms"])
  assert table["top_ops"][0]["op"] == "all-reduce.1"
  text = prof.format_table(table)
  assert "idle between kernels" in text and "11.250" in text


def test_gpu_layout_reads_device_streams_not_host_thunks():
  """A GPU plane: kernels on two streams (named by the CUDA kernel, hlo_op names the
  instruction), a memcpy without hlo_op, and the derived 'XLA Modules' line, which is
  not a kernel; the host's thunk launches are not device time."""
  data = _xspace({
      "/host:CPU": {"python": STEPS, "launch": [_thunk("dot_fusion", 1, 1, 0)]},
      "/device:GPU:0": {
          "XLA Modules": [("jit_train_step(1)", 10, 80, {})],
          "Stream #7(compute)": [
              ("sm90_xmma_gemm_f32", 10, 30, {"hlo_op": "dot_fusion",
                                              "hlo_module": "jit_train_step"}),
              ("cudnn_fmha_kernel", 50, 10, {"hlo_op": "custom-call.1",
                                             "hlo_module": "jit_train_step"})],
          "Stream #13(memcpy)": [("MemcpyD2D", 60, 10, {})]}})
  kernels, windows = prof.trace_kernels(data)
  assert {k.device for k in kernels} == {"/device:GPU:0"}
  table = prof.profile_table("fixture", hlo_text=HLO, kernels_and_windows=(kernels, windows))
  rows = {r["category"]: r["ms_per_step"] for r in table["rows"]}
  # span 10-70: gemm 30, gap 40-50 idle 10, fMHA 10, memcpy 10.
  assert table["step_ms"] == 60.0
  assert {c: ms for c, ms in rows.items() if ms} == {
      prof.MATMULS: 30.0, prof.ATTENTION: 10.0, prof.COPIES: 10.0, prof.IDLE: 10.0}


# ------------------------------------------------------------------ real CPU traces
def test_real_cpu_trace_of_a_data_parallel_step(tmp_path):
  """A real jax.profiler trace of a tiny data-parallel SGD step on the 8 fake CPU
  devices (the cheap twin of the `bench model --profile` run below)."""
  mesh = Mesh(np.array(jax.devices()), ("data",))
  batch, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

  def step(w_DxD, x_BxD, y_BxD):
    grad = jax.grad(lambda w: jnp.mean((jnp.tanh(x_BxD @ w) - y_BxD) ** 2))(w_DxD)
    with jax.named_scope(prof.OPTIMIZER_SCOPE):
      return w_DxD - 0.1 * grad

  args = (jax.device_put(jnp.ones((128, 128)), replicated),
          jax.device_put(jnp.ones((512, 128)), batch), jax.device_put(jnp.ones((512, 128)), batch))
  compiled = jax.jit(step, in_shardings=(replicated, batch, batch),
                     out_shardings=replicated).lower(*args).compile()
  xplane = prof.capture_steps(str(tmp_path), lambda: jax.block_until_ready(compiled(*args)), 2)
  table = prof.profile_table(xplane, hlo_text=compiled.as_text())
  rows = {r["category"]: r for r in table["rows"]}
  assert (table["steps"], table["devices"]) == (2, 8)
  assert sum(r["ms_per_step"] for r in rows.values()) == pytest.approx(table["step_ms"],
                                                                       rel=1e-3)
  assert 0 < table["step_ms"] <= table["wall_step_ms"] * 1.001
  for category in (prof.MATMULS, prof.OPTIMIZER, prof.COLLECTIVES):  # x @ w, the update,
    assert rows[category]["kernels_per_step"] > 0, table  # the gradient's all-reduce
  assert rows[prof.OTHER]["ms_per_step"] == 0, table["other_ops"]
  assert os.path.isfile(os.path.join(os.path.dirname(xplane), "perfetto_trace.json.gz"))


@pytest.mark.slow  # compiles and runs a train step (~20 s of compiling on 2 cores)
def test_bench_model_profile_of_a_tiny_gpt_on_the_cpu(capsys, tmp_path, monkeypatch):
  """One real trace: 8 fake CPU devices, the smoke GPT, 2 profiled steps."""
  from t5x_like.speed import model as model_bench
  # MFU's CPU ceilings take ~30 s to measure and play no part here.
  monkeypatch.setattr(model_bench, "peak_flops",
                      lambda device, previous=None, repeats=20: {"bfloat16": 1e12,
                                                                 "float32": 1e12})
  out_dir = tmp_path / "trace"
  code = cli.main(["bench", "model", "--config", "configs/gpt_cpu.py:smoke", "--steps", "2",
                   "--warmup", "1", "--nodecode", "--config.train.batch_size=8",
                   "--profile", str(out_dir), "--profile_steps", "2"])
  captured = capsys.readouterr()
  assert code == 0, captured.err
  result = json.loads(captured.out)
  table = result["profile"]
  assert (table["steps"], table["devices"]) == (2, 8)
  assert table["classified_by"] == "hlo op metadata"
  rows = {r["category"]: r for r in table["rows"]}
  # Categories + idle are the device step; the device step lies inside the wall step
  # (the host annotation around it), which is a real step, not a sliver of one.
  assert sum(r["ms_per_step"] for r in rows.values()) == pytest.approx(table["step_ms"],
                                                                       rel=1e-3)
  assert 0 < table["step_ms"] <= table["wall_step_ms"] * 1.001
  assert table["step_ms"] > 0.2 * 1e3 * min(result["train"]["step_seconds"])
  assert rows[prof.MATMULS]["ms_per_step"] > 0 and rows[prof.MATMULS]["kernels_per_step"] > 0
  assert rows[prof.OPTIMIZER]["ms_per_step"] > 0  # the optimizer_update scope is seen
  assert rows[prof.COLLECTIVES]["kernels_per_step"] > 0  # 8 devices reduce gradients
  assert rows[prof.OTHER]["percent"] < 5, table["other_ops"]
  # The files TensorBoard and Perfetto open, and the HLO the table was read with.
  assert os.path.samefile(os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.dirname(table["source"])))), out_dir)
  run_dir = os.path.dirname(table["source"])
  assert table["source"].endswith(".xplane.pb")
  with gzip.open(os.path.join(run_dir, "perfetto_trace.json.gz")) as f:
    names = {e.get("name") for e in json.load(f)["traceEvents"]}
  assert {op["op"] for op in table["top_ops"]} & names  # the same kernels, in Perfetto's
  assert (out_dir / "train_step.hlo.txt").read_text().startswith("HloModule")
  assert "matmuls" in captured.err and "idle between kernels" in captured.err


def test_bench_model_profile_dir_that_is_a_file_exits_2(capsys, tmp_path):
  path = tmp_path / "file"
  path.write_text("x")
  code = cli.main(["bench", "model", "--config", "configs/gpt_cpu.py:smoke",
                   "--profile", str(path)])
  err = capsys.readouterr().err
  assert code == 2
  assert "--profile=" in err and str(path) in err and "Traceback" not in err
  assert len(err.strip().splitlines()) <= 2
