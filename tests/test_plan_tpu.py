"""`t5x-like plan --compile=yes` on TPU topologies, compiled on this CPU host by libtpu
(deviceless AOT), and the HLO reader behind its collectives, kernels and FLOPs.

The HLO reader is checked on small programs compiled for the 8 fake CPU devices, with
FLOPs and bytes counted by hand; the TPU tier (marked `tpu`, skipped without libtpu)
compiles each family's smoke config for a v5e-4 slice (v5e:2x2).
"""

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from t5x_like import cli
from t5x_like.plan import fit, hlo, recipes, tpu

CONFIGS = pathlib.Path(__file__).parents[1] / "configs"


def _summary(fn, *args):
  """hlo.summarize of fn jitted and compiled for the abstract args, and XLA's FLOPs."""
  compiled = jax.jit(fn).lower(*args).compile()
  return hlo.summarize(hlo.parse_module(compiled.as_text())), compiled.cost_analysis()["flops"]


# ------------------------------------------------------------------ HLO reader (CPU)
def test_scanned_matmul_with_psum_counts_every_iteration():
  """6 iterations of h[8, 32] @ w[32, 32] per device, then a psum of f32[32] over 8."""
  mesh = jax.make_mesh((8,), ("x",))

  def step(w, x):
    h, _ = jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=6)
    return jax.lax.psum(h.sum(0), "x")

  fn = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("x")), out_specs=P())
  w = jax.ShapeDtypeStruct((32, 32), jnp.float32, sharding=NamedSharding(mesh, P()))
  x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  summary, xla_flops = _summary(fn, w, x)
  per_iteration = 2 * 8 * 32 * 32
  assert summary["matmul_flops"] == 6 * per_iteration
  assert summary["matmul_flops_once"] == per_iteration
  assert xla_flops < 2 * per_iteration  # XLA's cost analysis: the loop body once
  assert [loop["trip_count"] for loop in summary["loops"]] == [6]
  assert summary["collectives"] == {"all-reduce": {"count": 1, "bytes": 32 * 4, "ops": 1}}


def test_nested_loops_multiply_trip_counts_and_collectives_inside_count_per_iteration():
  """An all-gather of f32[4, 16] -> [32, 16] in an inner loop of 3 in an outer of 5."""
  mesh = jax.make_mesh((8,), ("x",))

  def step(w, x):
    def outer(h, _):
      def inner(h, _):
        full = jax.lax.all_gather(h, "x", tiled=True)  # [32, 16]
        return h + (full @ w)[:4], None  # [32, 16] @ [16, 16]
      return jax.lax.scan(inner, h, None, length=3)[0], None
    return jax.lax.scan(outer, x, None, length=5)[0]

  fn = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("x")), out_specs=P("x"))
  w = jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=NamedSharding(mesh, P()))
  x = jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  summary, _ = _summary(fn, w, x)
  dot = 2 * 32 * 16 * 16
  sliced = 2 * 4 * 16 * 16  # XLA may slice before the matmul: then only 4 rows
  assert summary["matmul_flops"] in (15 * dot, 15 * sliced)
  assert summary["matmul_flops"] // summary["matmul_flops_once"] == 15
  gather = summary["collectives"]["all-gather"]
  assert (gather["count"], gather["bytes"], gather["ops"]) == (15, 15 * 32 * 16 * 4, 1)


def test_convolution_flops_count_only_real_window_positions():
  """A 1-D convolution, length 10, kernel 3, padding 1 each side, 4 -> 6 channels,
  batch 2: the two edge outputs see 2 of the 3 taps, so 2*(10*3 - 2)*4*6*2 FLOPs."""
  lhs = jax.ShapeDtypeStruct((2, 4, 10), jnp.float32)
  rhs = jax.ShapeDtypeStruct((6, 4, 3), jnp.float32)
  conv = lambda a, b: jax.lax.conv_general_dilated(a, b, (1,), [(1, 1)])
  summary, xla_flops = _summary(conv, lhs, rhs)
  assert summary["matmul_flops"] == 2 * (10 * 3 - 2) * 4 * 6 * 2 == xla_flops


def test_parses_tuple_types_with_tiled_layouts_and_reads_a_while_condition():
  """TPU-style text: tiled layouts, /*index=N*/ comments, no known_trip_count."""
  text = """HloModule m, is_scheduled=true

%cond (p: (s32[], bf16[8,128])) -> pred[] {
  %c = s32[]{:T(128)} constant(12)
  %p = (s32[]{:T(128)}, bf16[8,128]{1,0:T(8,128)(2,1)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %c), direction=LT
}

%body (p: (s32[], bf16[8,128])) -> (s32[], bf16[8,128]) {
  %p = (s32[]{:T(128)}, bf16[8,128]{1,0:T(8,128)(2,1)}) parameter(0)
  %h = bf16[8,128]{1,0:T(8,128)(2,1)} get-tuple-element(%p), index=1
  %d = bf16[8,8]{1,0:T(8,128)(2,1)} dot(%h, %h), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %custom-call.3 = bf16[8,128]{1,0:T(8,128)(2,1)} custom-call(%d), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/while/body/flash_fwd/pallas_call"}
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %t = (s32[]{:T(128)}, /*index=1*/bf16[8,128]{1,0:T(8,128)(2,1)}) tuple(%i, %custom-call.3)
}

ENTRY %main (x: bf16[8,128]) -> bf16[8,128] {
  %x = bf16[8,128]{1,0:T(8,128)(2,1)} parameter(0)
  %zero = s32[]{:T(128)} constant(2)
  %init = (s32[]{:T(128)}, bf16[8,128]{1,0:T(8,128)(2,1)}) tuple(%zero, %x)
  %w = (s32[]{:T(128)}, bf16[8,128]{1,0:T(8,128)(2,1)}) while(%init), condition=%cond, body=%body
  ROOT %out = bf16[8,128]{1,0:T(8,128)(2,1)} get-tuple-element(%w), index=1
}

FileNames
1 "x.py"
"""
  module = hlo.parse_module(text)
  assert module.entry == "main" and set(module.computations) == {"cond", "body", "main"}
  assert module.computations["body"].instructions["t"].leaves == [("s32", ()),
                                                                   ("bf16", (8, 128))]
  summary = hlo.summarize(module)
  assert [loop["trip_count"] for loop in summary["loops"]] == [10]  # i from 2 to 12
  assert summary["kernels"] == {"flash_fwd": 10}
  assert summary["matmul_flops"] == 10 * 2 * 8 * 8 * 128


# ------------------------------------------------------------------ TPU topologies
@pytest.mark.tpu
def test_every_supported_slice_name_resolves_to_its_device_count():
  pytest.importorskip("libtpu")
  from t5x_like.plan.topology import parse_topology
  for name in tpu.supported_slices() + ["2xv5e-4"]:
    assert len(tpu.slice_devices(name)) == parse_topology(name).num_devices, name
  assert {d.slice_index for d in tpu.slice_devices("2xv5e-4")} == {0, 1}
  with pytest.raises(ValueError, match="v5e-16, v5e-32"):
    tpu.libtpu_topology("v5e-12")


def test_compile_without_libtpu_names_the_extra(capsys, monkeypatch):
  monkeypatch.setattr(tpu, "libtpu_available", lambda: False)
  rc = cli.main(["plan", "--config", f"{CONFIGS / 'bert_cpu.py'}:smoke", "--topology",
                 "v5e-4", "--compile=yes"])
  out = capsys.readouterr()
  assert rc == 2 and not out.out
  assert out.err == ("t5x-like plan: --compile for v5e-4 needs libtpu:"
                     " pip install 't5x_like[tpu]'\n")


def _tpu_plan(capsys, config: str, *overrides: str, topology: str = "v5e-4") -> dict:
  rc = cli.main(["plan", "--config", str(CONFIGS / config), "--topology", topology,
                 "--compile=yes", "--json", *overrides])
  out = capsys.readouterr()
  assert rc == 0, out.err
  return json.loads(out.out)


@pytest.mark.tpu
@pytest.mark.parametrize("config", ["bert_cpu.py:smoke", "t5_cpu.py:smoke", "gpt_cpu.py:smoke"])
def test_data_parallel_step_fits_a_v5e_slice_and_all_reduces_its_gradients(capsys, config):
  pytest.importorskip("libtpu")
  plan = _tpu_plan(capsys, config)
  assert plan["compiled"] and plan["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
  for phase in plan["phases"]:
    train, evaluate = phase["xla"], phase["xla"]["eval"]
    for x in (train, evaluate):
      assert x["fits"] and 0 < x["memory"]["total_bytes"] < x["headroom_bytes"]
    assert train["collectives"]["all-reduce"]["count"] >= 1
    assert "all-gather" not in train["collectives"]
    assert 0.5 < train["flops_corrected_ratio"] < 2.0
    assert evaluate["analytic_flops"] < phase["flops_per_step"]


@pytest.mark.tpu
def test_fsdp_gathers_weights_and_reduce_scatters_gradients(capsys):
  pytest.importorskip("libtpu")
  plan = _tpu_plan(capsys, "bert_cpu.py:smoke", "--config.mesh.data=1",
                   "--config.mesh.fsdp=4", "--config.model.scan_layers=True")
  assert plan["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
  phase, = plan["phases"]
  train = phase["xla"]
  assert train["collectives"]["all-gather"]["count"] > train["collectives"]["all-gather"]["ops"]
  assert train["collectives"]["reduce-scatter"]["count"] >= 1
  assert [loop["trip_count"] for loop in train["loops"]] == [2, 2]  # forward, backward
  # the scanned layers: XLA counts one layer, the corrected count both
  assert train["flops_corrected"] > train["flops"]
  assert abs(train["flops_corrected_ratio"] - 1) < abs(train["flops_ratio"] - 1)


@pytest.mark.tpu
def test_two_slices_split_the_data_axis_over_the_data_center_network(capsys):
  pytest.importorskip("libtpu")
  rc = cli.main(["plan", "--config", f"{CONFIGS / 'bert_cpu.py'}:smoke", "--topology",
                 "2xv5e-4", "--compile=yes"])
  err = capsys.readouterr().err
  assert rc == 2 and "2 slices" in err and "mesh.dcn_data" in err
  plan = _tpu_plan(capsys, "bert_cpu.py:smoke", "--config.mesh.dcn_data=2",
                   topology="2xv5e-4")
  assert plan["topology"]["num_slices"] == 2 and plan["mesh"]["data"] == 8
  phase, = plan["phases"]
  assert phase["xla"]["fits"] and "all-reduce" in phase["xla"]["collectives"]


# ------------------------------------------------------------------ batch search, recipes
def test_search_predicts_from_two_compiles_and_steps_down_when_the_line_misjudges():
  """memory = 100 + 10 * rows, with a bump of 25 from 40 rows on that the line through
  (8, 180) and (16, 260) does not see: r* = 43 is over, 10% down (38) fits."""
  calls = []

  def compile_rows(rows):
    calls.append(rows)
    return 100 + 10 * rows + (25 if rows >= 40 else 0)

  found = fit.search(compile_rows, 8, compile_rows(8), memory_bytes=530)
  assert calls == [8, 16, 43, 38]
  assert (found["rows"], found["total_bytes"], found["next_over"]) == (38, 480, 43)
  assert found["predicted_rows"] == 43 and found["compiles"] == 3
  assert found["line"] == {"a": 100.0, "b": 10.0}


def test_search_predicts_again_when_memory_grows_slower_than_its_line():
  """10 bytes a row up to 16 rows, 5 beyond: the first line's r* = 90 fits with 370 of
  1000 left, the line through (16, 260) and (90, 630) finds 164, which just fits."""
  total = lambda rows: 100 + 10 * rows if rows <= 16 else 260 + 5 * (rows - 16)
  found = fit.search(total, 8, total(8), memory_bytes=1000)
  assert [t["rows"] for t in found["tried"]] == [8, 16, 90, 164]
  assert (found["rows"], found["total_bytes"], found["next_over"]) == (164, 1000, None)


def test_a_stopped_search_resumed_ends_where_one_whole_search_ends(monkeypatch):
  """A search whose time budget ran out after its second compile (each compile takes
  100 s of a fake clock, the deadline is at 150 s), resumed from its result (recipes
  --continue-fits), compiles only the sizes it had not and finds what one uninterrupted
  search finds (the memory of the first search test above)."""
  total = lambda rows: 100 + 10 * rows + (25 if rows >= 40 else 0)
  whole = fit.search(total, 8, total(8), memory_bytes=530)
  clock, calls = [0.0], []
  monkeypatch.setattr(fit.time, "monotonic", lambda: clock[0])

  def compile_rows(rows):
    calls.append(rows)
    clock[0] += 100
    return total(rows)

  stopped = fit.search(compile_rows, 8, total(8), memory_bytes=530, deadline=150)
  assert calls == [16] and stopped["stopped"] == "time budget spent before compiling 43 rows"
  assert (stopped["rows"], stopped["next_over"]) == (16, None)
  calls.clear()
  resumed = fit.search(compile_rows, 8, total(8), memory_bytes=530, resume=stopped)
  assert calls == [43, 38] and resumed["stopped"] is None
  for key in ("rows", "total_bytes", "next_over", "predicted_rows", "compiles", "tried"):
    assert resumed[key] == whole[key], key
  calls.clear()
  older = {k: v for k, v in stopped.items() if k != "limit_bytes"}  # rows of an older run
  assert fit.search(compile_rows, 8, total(8), memory_bytes=530, resume=older)["rows"] == 38


def test_search_halves_an_over_batch_and_keeps_to_the_microbatch_step():
  found = fit.search(lambda rows: 10 * rows, 16, 160, memory_bytes=125, step=4)
  assert [t["rows"] for t in found["tried"]] == [16, 8, 12]
  assert (found["rows"], found["next_over"]) == (12, 16)
  none = fit.search(lambda rows: 1000, 1, 1000, memory_bytes=10)
  assert none["rows"] == 0 and none["compiles"] == 0 and none["total_bytes"] is None


def test_search_reads_the_compilers_refusals_for_hbm():
  """libtpu refuses a program over HBM (RESOURCE_EXHAUSTED) rather than compiling it: a
  refusal counts as over, its 'Used X of Y' serves the line and lowers the limit to Y."""
  def compile_rows(rows):
    if 100 + 10 * rows > 400:
      raise fit.over_memory(RuntimeError(
          f"RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used"
          f" {(100 + 10 * rows) / 1024:.2f}K of 0.39K hbm. Exceeded hbm capacity"))
    return 100 + 10 * rows

  found = fit.search(compile_rows, 16, 260, memory_bytes=1000)
  assert found["tried"][1] == {"rows": 32, "total_bytes": 419, "fits": False,
                               "refused": True}
  assert found["limit_bytes"] == 399 and (found["rows"], found["next_over"]) == (29, 32)
  temps = fit.over_memory(RuntimeError(
      "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO"
      " temporaries (48.00G) exceeds available HBM (15.75G)."))
  assert (temps.required_bytes, temps.available_bytes) == (48 << 30, int(15.75 * (1 << 30)))
  assert fit.over_memory(ValueError("shapes do not match")) is None


# libtpu's refusal of GPT-2 124M's train step at 128 rows of 1024 per device on a v6e-4
GPT2_V6E4_REFUSAL = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory"
                     " required for HLO temporaries (60.71G) exceeds available HBM (31.25G)")


def test_search_below_halves_a_refused_batch_until_the_compiler_accepts_one():
  """The compiler refuses over 40 rows (temporaries 10 bytes a row against 400 allowed)
  and compiles 100 + 10 x rows below: from a refused 128, halving compiles 64 (refused)
  and 32 (fits); refining goes on from the line through (32, 420) and (64, 640)."""
  calls = []

  def compile_rows(rows):
    calls.append(rows)
    if rows > 40:
      raise fit.over_memory(RuntimeError(
          f"RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for"
          f" HLO temporaries ({10 * rows / 1024:.4f}K) exceeds available HBM (0.4883K)"))
    return 100 + 10 * rows

  refusal = fit.over_memory(RuntimeError(GPT2_V6E4_REFUSAL))
  assert (refusal.required_bytes, refusal.available_bytes, refusal.required_for) == (
      int(60.71 * (1 << 30)), int(31.25 * (1 << 30)), "HLO temporaries")
  first = fit.over_memory(RuntimeError(GPT2_V6E4_REFUSAL.replace("60.71G", "1.25K")))
  halved = fit.search_below(compile_rows, 128, first, memory_bytes=1000)
  assert calls == [64, 32] and halved["halved"] and halved["limit_bytes"] == 500
  assert (halved["rows"], halved["total_bytes"], halved["next_over"]) == (32, 420, 64)
  assert [(t["rows"], t["fits"], t["refused"]) for t in halved["tried"]] == [
      (128, False, True), (64, False, True), (32, True, False)]
  assert halved["compiles"] == 2  # beyond the plan's own compile of 128
  calls.clear()
  refined = fit.search_below(compile_rows, 128, first, memory_bytes=1000, refine=True)
  assert calls[:2] == [64, 32] and not refined["halved"]
  assert refined["rows"] == max(r for r in calls if r <= 40) and refined["rows"] > 32
  assert [t["rows"] for t in refined["tried"]] == [128] + calls
  calls.clear()
  over = fit.search_below(lambda rows: compile_rows(rows + 100), 128, first, memory_bytes=1000)
  assert over["rows"] == 0 and [t["rows"] for t in over["tried"]] == [128, 64, 32, 16, 8,
                                                                        4, 2, 1]


def test_plan_reports_a_refused_compile_as_does_not_fit_with_a_batch_that_fits(
    capsys, monkeypatch):
  """The default tier's twin of the TPU test below: `plan --compile=yes` of GPT-2 124M on
  a v6e-4 whose compile (a fake here: libtpu's refusal over 40 rows per device, 2 GiB +
  0.5 GiB a row below) refuses the configured 128 rows: exit 0, the compiler's figures
  and the halved batch that compiled, in the text and the JSON."""
  monkeypatch.setattr(tpu, "slice_devices", lambda topology: jax.devices("cpu")[:4])
  from t5x_like.plan import compiled
  from t5x_like.plan.text import format_plan
  asked = []

  def compile_train_step(model, optimizer, schedule, mesh, rules, batch_shapes,
                         microbatches=1, eval_step=False, chip=None, zero_stage=0):
    rows = batch_shapes["decoder_input_tokens"][0] // mesh.size
    asked.append(rows)
    if rows > 40:
      raise jax.errors.JaxRuntimeError(GPT2_V6E4_REFUSAL.replace(
          "60.71G", f"{60.71 * rows / 128:.2f}G"))
    return {"memory": {"total_bytes": (4 + rows) << 29}}

  monkeypatch.setattr(compiled, "compile_train_step", compile_train_step)
  assert cli.main(["plan", "--config", f"{CONFIGS / 'gpt2_pretrain.py'}:124m", "--topology",
                   "v6e-4", "--compile=yes", "--json"]) == 0
  plan = json.loads(capsys.readouterr().out)
  assert asked == [128, 64, 32]
  phase, = plan["phases"]
  assert phase["xla"] is None and plan["total"]["fits"] is False
  refused = phase["xla_refused"]
  assert (refused["required_bytes"], refused["available_bytes"], refused["required_for"]) \
      == (int(60.71 * (1 << 30)), int(31.25 * (1 << 30)), "HLO temporaries")
  found = phase["fit_batch"]
  assert (found["rows"], found["global_batch"], found["total_bytes"]) == (32, 128, 18 << 30)
  assert (found["configured_rows"], found["next_over"], found["halved"]) == (128, 64, True)
  out = format_plan(plan)  # the text the command prints without --json
  assert ("  XLA: DOES NOT FIT: the compiler refuses the train step at 128 rows per device"
          " (it needs 60.71 GiB for HLO temporaries of the 31.25 GiB of HBM it allows;"
          " RESOURCE_EXHAUSTED)\n"
          "  batch that fits (halving the refused batch until the train step compiles;"
          " --fit_batch searches on below 64): 32 rows per device (global 128), train step"
          " 18.00 GiB of 32.00 GiB\n") in out
  assert "tried 128 -> 60.71 GiB (refused: over), 64 -> 30.36 GiB (refused: over), 32 ->" \
         " 18.00 GiB" in out
  total, = [line for line in out.splitlines() if line.startswith("total: ")]
  assert total.endswith("per device of 32.00 GiB: DOES NOT FIT")


@pytest.mark.tpu
def test_fit_batch_stops_below_an_over_batch_by_the_compilers_numbers(monkeypatch):
  """The device's memory set just under the configured batch's train step (32 rows per
  device): the search must find fewer rows that fit, and a larger one compiled over."""
  pytest.importorskip("libtpu")
  from t5x_like.plan.report import make_plan
  from t5x_like.plan.text import format_plan
  from t5x_like.plan.topology import parse_topology
  from t5x_like.command_flags import load_config_file
  search, limits = fit.search, []

  def under_the_first(compile_rows, rows0, total0, memory_bytes, **kwargs):
    limits.append(total0 - 1)  # a topology whose HBM is 1 byte short of rows0
    kwargs["max_confirm"] = 1  # 3 compiles in all (the step-downs: the test above)
    return search(compile_rows, rows0, total0, total0 - 1, **kwargs)

  monkeypatch.setattr(fit, "search", under_the_first)
  config = load_config_file(f"{CONFIGS / 'bert_cpu.py'}:smoke")
  config.train.batch_size = 128
  plan = make_plan(config, parse_topology("v5e-4"), compile_step="yes", eval_step=False,
                   fit_batch=True)
  phase, = plan["phases"]
  found, limit = phase["fit_batch"], limits[0]
  assert found["configured_rows"] == 32 and 0 < found["rows"] < 32
  assert found["total_bytes"] <= limit and found["global_batch"] == 4 * found["rows"]
  over = {t["rows"]: t["total_bytes"] for t in found["tried"]}[found["next_over"]]
  assert found["next_over"] > found["rows"] and over > limit
  assert found["compiles"] == 2 and found["predicted_rows"] is not None
  assert "largest batch that fits (by compiling the train step): " \
         f"{found['rows']} rows per device" in format_plan(plan)


@pytest.mark.tpu
def test_plan_of_gpt2_on_a_v6e_4_says_it_does_not_fit_and_which_batch_does(capsys):
  """`t5x-like plan --config configs/gpt2_pretrain.py:124m --topology v6e-4
  --compile=yes`: libtpu refuses 128 rows of 1024 per device for HBM (quickly), 64 too,
  and compiles 32 (minutes: about 5 in all on 2 cores). The plan says so, exit 0."""
  pytest.importorskip("libtpu")
  rc = cli.main(["plan", "--config", f"{CONFIGS / 'gpt2_pretrain.py'}:124m", "--topology",
                 "v6e-4", "--compile=yes"])
  out = capsys.readouterr().out
  assert rc == 0
  refused = re.search(r"XLA: DOES NOT FIT: the compiler refuses the train step at 128 rows"
                      r" per device \(it needs ([\d.]+) GiB for HLO temporaries of the"
                      r" ([\d.]+) GiB of HBM it allows; RESOURCE_EXHAUSTED\)", out)
  assert refused, out
  needs, allowed = map(float, refused.groups())
  assert allowed == 31.25 and needs > allowed
  found = re.search(r"batch that fits \(halving the refused batch until the train step"
                    r" compiles; --fit_batch searches on below 64\): 32 rows per device"
                    r" \(global 128\), train step ([\d.]+) GiB of 32.00 GiB", out)
  assert found and float(found.group(1)) < allowed, out
  assert f"tried 128 -> {needs:.2f} GiB (refused: over), 64 ->" in out
  total, = [line for line in out.splitlines() if line.startswith("total: ")]
  assert total.endswith("per device of 32.00 GiB: DOES NOT FIT")


def _recipe_row(**overrides) -> dict:
  row = {"name": "bert-base/128@v5e-16", "config": "configs/bert_pretrain.py:base",
         "phase": 0, "length": 128, "slice": "v5e-16", "documented": False,
         "mesh": {"data": 16, "fsdp": 1, "tensor": 1}, "global_batch": 256,
         "per_device_batch": 16, "memory_bytes": 16 << 30, "xla_total_bytes": 3 << 30,
         "fits": True, "estimate_bytes": 3 << 30, "estimate_ratio": 1.04,
         "collectives": {"all-reduce": {"count": 3, "bytes": 440 << 20}},
         "kernels": {"flash_attention_fwd": 12},
         "attention_kernel": recipes.attention_kernel({"flash_attention_fwd": 12,
                                                       "other": 1}),
         "fit_batch": {"rows": 112, "total_bytes": 15 << 30, "compiles": 2, "stopped": None,
                       "next_over": 120},
         "seconds": {"row": 300.0}, "error": None}
  row.update(overrides)
  return row


def test_recipe_rows_format_as_markdown_cells():
  assert recipes.format_row(_recipe_row()) == [
      "bert-base", "1 / 128", "v5e-16", "16 (global 256)", "3.00 / 16 GiB, fits", "1.04",
      "all-reduce x3 (440.00 MiB)", "flash_attention_fwd", "not computed", "",
      "112 (15.00 GiB); 2 more compiles"]
  over = recipes.format_row(_recipe_row(
      name="gpt2-124m/1024@v5e-32", slice="v5e-32", phase=None, documented=True,
      fits=False, collectives={}, attention_kernel=recipes.attention_kernel({}),
      fit_batch={"rows": 0, "total_bytes": None, "compiles": 1, "stopped": "time"}))
  assert over[:3] == ["gpt2-124m", "- / 128", "v5e-32 (documented)"]
  assert over[4].endswith("**does not fit**") and over[6:] == [
      "none", "XLA (explicit)", "not computed", "", "none fits; 1 more compiles; stopped: time"]
  open_ended = {"rows": 8, "total_bytes": 1 << 30, "compiles": 1, "stopped": None,
                "next_over": None}  # nothing larger compiled: a lower bound
  assert recipes.format_row(_recipe_row(fit_batch=open_ended))[-1] == \
      "at least 8 (1.00 GiB there); 1 more compiles"
  noted = recipes.format_row(_recipe_row(attention_kernel="XLA (explicit)", note="why"))
  assert noted[7] == "XLA (explicit); why"
  broken = _recipe_row(error="MosaicError: INTERNAL: E2001\n\nThe MLIR operation | ...")
  assert recipes.format_row(broken)[3] == "error: MosaicError: INTERNAL: E2001"
  assert len(recipes.format_row(broken)) == len(recipes.COLUMNS)
  table = recipes.format_table([_recipe_row(), broken]).splitlines()
  assert len(table) == 4 and {line.count("|") for line in table} == {len(recipes.COLUMNS) + 1}
  assert [r.name for r in recipes.RECIPES][:2] == ["bert-base/128@v3-32",
                                                   "bert-base/128@v5e-16"]


def test_continue_fits_reruns_only_the_rows_whose_search_stopped(tmp_path, monkeypatch,
                                                                  capsys):
  """`recipes --resume-from F --continue-fits`: a finished row stays as it was, a row
  whose search stopped on the time budget is run again, going on from its search."""
  stopped = {"rows": 32, "total_bytes": 9 << 30, "compiles": 1, "next_over": None,
             "tried": [{"rows": 16, "total_bytes": 6 << 30, "fits": True, "refused": False},
                       {"rows": 32, "total_bytes": 9 << 30, "fits": True, "refused": False}],
             "limit_bytes": 16 << 30, "stopped": "time budget spent before compiling 47 rows"}
  done = _recipe_row()
  halted = _recipe_row(name="bert-base/512@v5e-16", fit_batch=stopped)
  prior = tmp_path / "rows.jsonl"
  prior.write_text(json.dumps(done) + "\n" + json.dumps(halted) + "\n")
  runs = []

  def run_recipe(recipe, fit, fit_budget_s, fit_resume):
    runs.append((recipe.name, fit_resume))
    return _recipe_row(name=recipe.name, fit_batch={**stopped, "stopped": None,
                                                    "next_over": 48, "rows": 47})

  monkeypatch.setattr(recipes, "run_recipe", run_recipe)
  argv = ["--only", "bert-base/128@v5e-16", "bert-base/512@v5e-16", "--resume-from",
          str(prior)]
  assert recipes.main(argv) == 0 and runs == []  # without --continue-fits: both kept
  assert recipes.main(argv + ["--continue-fits", "--json", str(prior)]) == 0
  assert runs == [("bert-base/512@v5e-16", stopped)]
  assert recipes._read_rows(str(prior))["bert-base/512@v5e-16"]["fit_batch"]["rows"] == 47
  assert "112 (15.00 GiB)" in capsys.readouterr().out
  assert recipes.main(["--continue-fits"]) == 2  # a usage error: one line, exit 2
  assert "--resume-from" in capsys.readouterr().err


# ------------------------------------------------------------------ TPU7x (Ironwood)
@pytest.mark.tpu
def test_tpu7x_slices_are_two_devices_a_chip_and_eight_a_host():
  """tpu7x-N: N TensorCores, each its own JAX device (no megacore), N/2 chips, 4 chips
  (8 devices) a host, as libtpu lays them out."""
  pytest.importorskip("libtpu")
  from t5x_like.plan.topology import parse_topology
  names = [s for s in tpu.supported_slices() if s.startswith("tpu7x-")]
  assert names[0] == "tpu7x-8" and len(names) == 7
  for name in names + ["2xtpu7x-8"]:
    topology, devices = parse_topology(name), tpu.slice_devices(name)
    assert len(devices) == topology.num_devices, name
    assert {d.device_kind for d in devices} == {"TPU7x"}
    chips = {(getattr(d, "slice_index", 0), *d.coords) for d in devices}
    assert len(chips) == topology.num_devices // 2
    assert {d.core_on_chip for d in devices} == {0, 1}
    assert len({(getattr(d, "slice_index", 0), d.process_index) for d in devices}) == \
        topology.num_hosts
  assert {d.slice_index for d in tpu.slice_devices("2xtpu7x-8")} == {0, 1}


@pytest.mark.tpu
def test_plan_compiles_a_data_parallel_step_for_a_tpu7x_8_and_prints_its_roofline(capsys):
  """`t5x-like plan --config configs/bert_cpu.py:smoke --topology tpu7x-8 --compile=yes`:
  8 TPU7x devices on one host, the train and eval steps fit, the roofline at half a
  chip's figures (1153.5 TFLOP/s, 3690 GB/s HBM, 300 GB/s ICI one way)."""
  pytest.importorskip("libtpu")
  rc = cli.main(["plan", "--config", f"{CONFIGS / 'bert_cpu.py'}:smoke", "--topology",
                 "tpu7x-8", "--compile=yes"])
  out = capsys.readouterr().out
  assert rc == 0
  assert ("on tpu7x-8: 8 x TPU7x devices, 1 host(s); 1153.5 TFLOP/s peak and 96.00 GiB per"
          " device") in out, out
  assert re.search(r"train step: fits \([\d.]+ \w+ free\); eval step: fits", out), out
  roofline = [line for line in out.splitlines() if line.startswith("  roofline: step >= ")]
  assert roofline, out
  assert "    per device at 1153.5 TFLOP/s, HBM 3690 GB/s, ICI 300 GB/s: " in out
  print("\n".join(roofline))
  total, = [line for line in out.splitlines() if line.startswith("total: ")]
  assert total.endswith("per device of 96.00 GiB: fits")


# The shipped pretraining recipes (t5x_like/plan/recipes.py's configs and phases) on a
# tpu7x-64 (2x4x4: 32 chips, 8 hosts): global batches 256 and 512 split 4 and 8 rows a
# device.
TPU7X_RECIPES = [("configs/bert_pretrain.py:base", 0), ("configs/bert_pretrain.py:base", 1),
                 ("configs/t5_pretrain.py:base", None), ("configs/gpt2_pretrain.py:124m", None),
                 ("configs/bert_pretrain.py:large", 0), ("configs/bert_pretrain.py:large", 1)]


@pytest.mark.tpu
@pytest.mark.long  # minutes per recipe on 2 cores
@pytest.mark.parametrize("recipe", TPU7X_RECIPES, ids=lambda r: r[0].split("/")[-1]
                         + ("" if r[1] is None else f"-phase{r[1] + 1}"))
def test_pretraining_recipe_fits_a_tpu7x_64_by_the_compilers_numbers(recipe):
  pytest.importorskip("libtpu")
  import time
  from t5x_like.command_flags import load_config_file
  from t5x_like.plan.report import make_plan
  from t5x_like.plan.text import human_bytes, roofline_lines
  from t5x_like.plan.topology import parse_topology
  path, phase_index = recipe
  config = recipes.phase_config(load_config_file(str(CONFIGS.parent / path)), phase_index)
  topology = parse_topology("tpu7x-64", config.model.dtype)
  start = time.monotonic()
  plan = make_plan(config, topology, compile_step="yes", eval_step=False)
  seconds = time.monotonic() - start
  phase, = plan["phases"]
  x = phase["xla"]
  assert plan["compiled"] and plan["batch_size"] % 64 == 0
  assert x is not None, phase.get("xla_refused")
  total = x["memory"]["total_bytes"]
  print(f"{path} phase {phase_index} on tpu7x-64: {seconds:.0f} s; compiler"
        f" {human_bytes(total)} of {human_bytes(topology.memory_bytes)} per device;"
        f" estimate / compiler {x['memory_ratio']:.2f}")
  print("\n".join(roofline_lines(phase["roofline"], phase["steps"])))
  assert x["fits"] and 0 < total <= topology.memory_bytes
  assert phase["roofline"]["seconds"] > 0
