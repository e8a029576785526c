"""libtpu's estimated step time (t5x_like/plan/compiler_estimate.py) beside the roofline.

The default tier reads a hand-written HLO module whose backend configs carry
estimated_cycles inside and outside a while loop with a known trip count (sums worked out
by hand here), and formats the plan's lines from dicts. The TPU tier (marked `tpu`,
skipped without libtpu) compiles matmuls and a scanned layer stack for libtpu's TPU7x
(deviceless) and checks the clock and the loop's multiplication against the compiler's
own figures.
"""

import os
import pathlib
import re

import pytest

from t5x_like.command_flags import load_config_file
from t5x_like.plan import compiler_estimate as ce
from t5x_like.plan import hlo_cost, report, roofline
from t5x_like.plan.text import above_ceiling, compiler_estimate_lines, format_plan
from t5x_like.plan.topology import Topology

CONFIGS = pathlib.Path(__file__).parents[1] / "configs"

# A 6-iteration loop (known_trip_count) holding a bf16 [256,512] x [512,256] matmul
# fusion estimated at 5000 cycles a run; once: an f32[1024] add fusion at 100 cycles
# (its fused add's own 77 is the fusion's, never read), a multiply fusion at 50000 (far
# above its roofline), a Mosaic kernel and an all-reduce over 4 with no estimate.
FIXTURE = """HloModule estimate_fixture, is_scheduled=true, num_partitions=4

%fused_dot (p.0: bf16[256,512], p.1: bf16[512,256]) -> bf16[256,256] {
  %p.0 = bf16[256,512]{1,0} parameter(0)
  %p.1 = bf16[512,256]{1,0} parameter(1)
  ROOT %dot.1 = bf16[256,256]{1,0} dot(%p.0, %p.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (a.0: f32[1024], b.0: f32[1024]) -> f32[1024] {
  %a.0 = f32[1024]{0} parameter(0)
  %b.0 = f32[1024]{0} parameter(1)
  ROOT %add.0 = f32[1024]{0} add(%a.0, %b.0), backend_config={"window_config":{"estimated_cycles":"77"}}
}

%fused_mul (a.1: f32[1024], b.1: f32[1024]) -> f32[1024] {
  %a.1 = f32[1024]{0} parameter(0)
  %b.1 = f32[1024]{0} parameter(1)
  ROOT %mul.1 = f32[1024]{0} multiply(%a.1, %b.1)
}

%sum (x.2: f32[], y.2: f32[]) -> f32[] {
  %x.2 = f32[] parameter(0)
  %y.2 = f32[] parameter(1)
  ROOT %s = f32[] add(%x.2, %y.2)
}

%body (loop: (s32[], bf16[256,512], bf16[512,256])) -> (s32[], bf16[256,512], bf16[512,256]) {
  %loop = (s32[], bf16[256,512]{1,0}, bf16[512,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%loop), index=0
  %x = bf16[256,512]{1,0} get-tuple-element(%loop), index=1
  %w = bf16[512,256]{1,0} get-tuple-element(%loop), index=2
  %mm = bf16[256,256]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(f)/while/body/dot_general"}, backend_config={"flag_configs":[],"window_config":{"kernel_window_bounds":["128","8"],"estimated_cycles":"5000","cost_model_type":"COST_MODEL_TYPE_CLASSIC"}}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[256,512]{1,0}, bf16[512,256]{1,0}) tuple(%next, %x, %w)
}

%cond (loop.1: (s32[], bf16[256,512], bf16[512,256])) -> pred[] {
  %loop.1 = (s32[], bf16[256,512]{1,0}, bf16[512,256]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%loop.1), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (x.1: bf16[256,512], w.1: bf16[512,256], a: f32[1024], b: f32[1024]) -> f32[1024] {
  %x.1 = bf16[256,512]{1,0} parameter(0)
  %w.1 = bf16[512,256]{1,0} parameter(1)
  %a = f32[1024]{0} parameter(2)
  %b = f32[1024]{0} parameter(3)
  %start = s32[] constant(0)
  %init = (s32[], bf16[256,512]{1,0}, bf16[512,256]{1,0}) tuple(%start, %x.1, %w.1)
  %while = (s32[], bf16[256,512]{1,0}, bf16[512,256]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  %sum.1 = f32[1024]{0} fusion(%a, %b), kind=kLoop, calls=%fused_add, backend_config={"window_config":{"estimated_cycles":"100"}}
  %slow = f32[1024]{0} fusion(%sum.1, %b), kind=kLoop, calls=%fused_mul, metadata={op_name="jit(f)/mul"}, backend_config={"window_config":{"estimated_cycles":"50000"}}
  %custom-call.1 = f32[1024]{0} custom-call(%slow), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "TUxJUgA="}}, metadata={op_name="jit(f)/blind_kernel/pallas_call"}
  ROOT %ar = f32[1024]{0} all-reduce(%custom-call.1), replica_groups={{0,1,2,3}}, to_apply=%sum
}
"""

PEAK, HBM, ICI = 1e12, 1e9, 1e8
CHIP = roofline.Chip("TPU v5 lite", peak_flops=PEAK, hbm_bandwidth=HBM, ici_bandwidth=ICI)
# the table's v5e matmul: 9557312 cycles for 2 x 8192^3 FLOPs, at this chip's peak
CLOCK = PEAK * 9557312 / (2 * 8192 ** 3)
# the roofline of the estimated ops, per run: the matmul reads x, w and writes the
# product (memory-bound at these bandwidths); each f32[1024] fusion reads 2, writes 1
MM = 2 * (256 * 512 + 512 * 256 + 256 * 256) / HBM
assert 2 * 256 * 256 * 512 / PEAK < MM
VEC = 3 * 1024 * 4 / HBM


def test_cycles_are_summed_with_trip_counts_and_turned_into_seconds_by_hand():
  est = ce.estimate(FIXTURE, CHIP)
  assert est["clock_hz"] == pytest.approx(CLOCK, rel=1e-12)
  assert est["cycles"] == 6 * 5000 + 100 + 50000  # not the fused add's 77
  assert est["seconds"] == pytest.approx((6 * 5000 + 100 + 50000) / CLOCK, rel=1e-12)
  assert est["ops_with_estimate"] == 3
  ops = hlo_cost.hlo_ops(FIXTURE)
  rest = [o for o in ops if o.name not in ("mm", "sum.1", "slow") and not o.collective]
  assert est["ops_without"] == len(rest) and {"next", "blind_kernel"} <= {o.name for o in rest}
  # the ops without an estimate: the roofline's non-collective time less the three's
  bound = roofline.bound_of_ops(ops, CHIP)
  uncovered = bound["compute_seconds"] + bound["memory_seconds"] - (6 * MM + 2 * VEC)
  assert est["uncovered_roofline_seconds"] == pytest.approx(uncovered, rel=1e-9)
  assert est["uncovered_roofline_seconds"] >= 2 * 1024 * 4 / HBM  # the kernel's in + out
  assert est["uncovered_kernels"] == ["blind_kernel"]
  # libtpu estimates no collective: the all-reduce of f32[1024] over 4 at the ring cost
  assert est["collectives_estimated"] == 0
  assert est["collective_seconds"] == pytest.approx(2 * 3 / 4 * 4096 / ICI, rel=1e-12)
  assert est["combined_seconds"] == pytest.approx(
      est["seconds"] + uncovered + 2 * 3 / 4 * 4096 / ICI, rel=1e-9)


def test_slowest_ops_carry_the_roofline_beside_and_the_disagreement_flag():
  est = ce.estimate(FIXTURE, CHIP)
  slow, mm, add = est["top"]
  assert [r["name"] for r in est["top"]] == ["slow", "mm", "sum.1"]
  assert (mm["times"], mm["cycles"]) == (6, 30000)
  assert mm["seconds"] == pytest.approx(30000 / CLOCK, rel=1e-12)
  assert mm["roofline_seconds"] == pytest.approx(6 * MM, rel=1e-12)
  assert mm["ratio"] == pytest.approx(30000 / CLOCK / (6 * MM), rel=1e-12)
  assert 0.5 < mm["ratio"] < 2 and not mm["disagree"]
  assert 0.5 < add["ratio"] < 2 and not add["disagree"]
  assert slow["ratio"] == pytest.approx(50000 / CLOCK / VEC, rel=1e-12)
  assert slow["ratio"] > 2 and slow["disagree"]
  assert slow["op_name"] == "jit(f)/mul" and est["disagree"] == 1


def test_model_flops_give_an_mfu_over_the_combined_time():
  est = ce.with_model_flops(ce.estimate(FIXTURE, CHIP), 1e10, 4, extra_flops=2e8,
                            extra_source="analytic attention")
  base = ce.estimate(FIXTURE, CHIP)
  assert est["uncovered_roofline_seconds"] == pytest.approx(
      base["uncovered_roofline_seconds"] + 2e8 / PEAK)
  assert est["combined_seconds"] == pytest.approx(base["combined_seconds"] + 2e8 / PEAK)
  assert est["mfu"] == pytest.approx(1e10 / (est["combined_seconds"] * 4 * PEAK))


def test_no_estimate_without_cycles_no_clock_for_unknown_kinds_none_off_tpu():
  bare = re.sub(r'"estimated_cycles":"\d+"', '"x":"0"', FIXTURE)
  est = ce.estimate(bare, CHIP)
  assert (est["ops_with_estimate"], est["cycles"], est["seconds"], est["top"]) == (0, 0, None, [])
  assert compiler_estimate_lines(est, steps=10) == [
      "  no compiler estimate in this program (libtpu gives none for TPU v5 lite)"]
  unknown = ce.estimate(FIXTURE, roofline.Chip("TPU v9", PEAK, HBM, ICI))
  assert unknown["cycles"] == 80100 and unknown["seconds"] is None
  assert "no calibrated clock for TPU v9" in compiler_estimate_lines(unknown, 10)[0]
  assert ce.estimate(FIXTURE, roofline.Chip("H100", PEAK, HBM, ICI)) is None


def test_int64_max_cycles_mean_no_estimate():
  """libtpu writes 9223372036854775807 where it has none (a SparseCore copy on TPU7x)."""
  est = ce.estimate(FIXTURE.replace('"50000"', '"9223372036854775807"'), CHIP)
  assert est["cycles"] == 6 * 5000 + 100 and est["ops_with_estimate"] == 2


def test_calibration_table_clocks():
  table = ce.calibration_table()
  assert table["TPU7x"]["clock_hz"] == pytest.approx(1153.5e12 * 2604600 / (2 * 8192 ** 3))
  assert table["TPU v5"] == table["TPU v5p"]  # v5p devices report 'TPU v5'
  assert ce.clock_hz("tpu v6 lite") == pytest.approx(918e12 * 2977840 / (2 * 8192 ** 3))
  assert ce.clock_hz("TPU v4 lite") is None  # not measured: no look-alike's clock
  assert 0.9e9 < min(t["clock_hz"] for t in table.values())
  assert max(t["clock_hz"] for t in table.values()) < 3e9


def test_estimate_lines_give_the_total_its_parts_and_name_the_op_that_disagrees():
  est = ce.with_model_flops(ce.estimate(FIXTURE, CHIP), 1e10, 4)
  lines = compiler_estimate_lines(est, steps=1000)
  head = lines[0]
  assert head.startswith(f"  compiler estimate (libtpu {ce.installed_libtpu() or '0.0.42.1'}"
                         f" estimated_cycles at {CLOCK / 1e9:.3f} GHz")
  combined = est["combined_seconds"]
  assert f"step >= {combined * 1e3:.1f} ms = estimated {est['seconds'] * 1e3:.1f} ms (3 ops)" \
      in head
  assert f"({est['ops_without']} ops without an estimate)" in head
  assert "(roofline; libtpu estimates none)" in head
  assert f"MFU <= {1e10 / (combined * 4 * PEAK):.1%}" in head
  assert head.endswith(f"{combined * 1000:.2f} s for the phase")
  slow, = [line for line in lines if line.startswith("      slow x1")]
  assert slow == (f"      slow x1 (jit(f)/mul): {50000 / CLOCK * 1e3:.3g} ms, roofline"
                  f" {VEC * 1e6:.3g} us: {50000 / CLOCK / VEC:.1f}x apart <- DISAGREE")
  mm, = [line for line in lines if line.startswith("      mm x6")]
  assert "DISAGREE" not in mm
  assert lines[-1] == ("    estimate and roofline disagree by more than 2x on: slow"
                       " (1 of the 3 estimated ops in all)")


# ------------------------------------------------------------------ the assumed MFU
def test_assumed_mfu_above_the_ceiling_quotes_the_time_at_the_ceiling():
  topology = Topology("cpu-8", "cpu", "cpu", 8, 1, 1e12, 1 << 30)
  flops, steps = 8e12, 1000
  above = report._assumed_mfu(0.4, {"mfu_ceiling": 0.25}, {"mfu": 0.2}, flops, topology, steps)
  assert above["above_ceiling"] and above["above_compiler_mfu"]
  assert above["step_seconds_at_ceiling"] == pytest.approx(flops / (8 * 1e12 * 0.25))
  assert above["seconds_at_ceiling"] == pytest.approx(steps * 4.0)
  assert above_ceiling(above) == (" -- ABOVE the roofline's MFU ceiling 25.0%; libtpu's"
                                  " estimate allows at most 20.0%: at the ceiling 4.00 s per"
                                  " step, 66.7 min for the phase")
  below = report._assumed_mfu(0.4, {"mfu_ceiling": 0.5}, None, flops, topology, steps)
  assert not below["above_ceiling"] and below["compiler_mfu"] is None
  assert above_ceiling(below) == "" and above_ceiling(None) == ""
  assert report._assumed_mfu(0.4, None, None, flops, topology, steps) is None


def test_plan_text_says_the_assumed_mfu_is_above_the_ceiling_beside_the_hours():
  """An uncompiled plan given a roofline whose MFU ceiling is under the assumed 40%: the
  phase's 'at 40% MFU' line says so with the time at the ceiling, and so does the total."""
  config = load_config_file(f"{CONFIGS / 'bert_cpu.py'}:smoke")
  topology = Topology("cpu-8", "cpu", "cpu", 8, 1, 1e12, 1 << 30)
  plan = report.make_plan(config, topology, eval_step=False, compile_step="no")
  phase, = plan["phases"]
  assert phase["assumed_mfu"] is None and plan["total"]["mfu_above_ceiling"] == []
  bound = roofline.bound_of_ops(hlo_cost.hlo_ops(FIXTURE), CHIP)
  phase["roofline"] = roofline.with_model_flops(bound, phase["flops_per_step"], 8)
  ceiling = phase["roofline"]["mfu_ceiling"]
  assert ceiling < plan["mfu"]
  phase["assumed_mfu"] = report._assumed_mfu(plan["mfu"], phase["roofline"], None,
                                             phase["flops_per_step"], topology, phase["steps"])
  plan["total"]["roofline"] = True
  plan["total"]["mfu_above_ceiling"] = [0]
  text = format_plan(plan)
  line, = [l for l in text.splitlines() if l.startswith("  at 40% MFU: ")]
  assert f" -- ABOVE the roofline's MFU ceiling {ceiling:.1%}: at the ceiling" in line
  total, = [l for l in text.splitlines() if l.startswith("total: ")]
  assert "the assumed 40% MFU is above the roofline's MFU ceiling in phase 1" in total


# ------------------------------------------------------------------ TPU (libtpu)
def _device(libtpu_topology: str = "tpu7x:2x2x1"):
  """The first device of libtpu's description of a topology (megacore on v4 / v5p)."""
  pytest.importorskip("libtpu")
  from jax.experimental import topologies
  from t5x_like.plan import tpu
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  kwargs = ({"chip_config_name": "megacore"} if libtpu_topology.startswith(("v4", "v5p"))
            else {})
  with tpu._quiet_stderr():
    return topologies.get_topology_desc(topology_name=libtpu_topology, platform="tpu",
                                        **kwargs).devices[0]



def _compile(fn, *shapes, device):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  sharding = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in shapes]
  return jax.jit(fn).lower(*args).compile().as_text()


TPU7X = roofline.Chip("TPU7x", 1153.5e12, 7380e9 / 2, 300e9)


@pytest.mark.tpu
def test_a_4096_matmul_on_tpu7x_runs_near_peak_at_the_calibrated_clock():
  """Calibrated on 8192^3, the 4096^3 bf16 matmul's estimate is within 15% of its FLOPs
  at peak (libtpu 0.0.42.1: 3% under)."""
  device = _device()
  est = ce.estimate(_compile(lambda x, y: x @ y, (4096, 4096), (4096, 4096), device=device),
                    TPU7X)
  assert est["ops_with_estimate"] >= 1
  at_peak = 2 * 4096 ** 3 / TPU7X.peak_flops
  assert est["seconds"] == pytest.approx(at_peak, rel=0.15)


@pytest.mark.tpu
@pytest.mark.parametrize("kind", ["TPU7x", "TPU v6 lite", "TPU v5", "TPU v5 lite", "TPU v4",
                                  "TPU v3"])
def test_the_tables_calibration_equals_a_fresh_one(kind):
  entry = ce.calibration_table()[kind]
  fresh = ce.calibrate(_device(entry["topology"]))
  assert fresh["device_kind"] == kind
  assert fresh["clock_hz"] == pytest.approx(entry["clock_hz"], rel=0.01)
  assert fresh["cycles"] == pytest.approx(entry["cycles"], rel=0.01)


@pytest.mark.tpu
def test_a_scanned_layers_estimate_multiplies_by_the_loops_trip_count():
  """tanh(h @ w) over 2 and 8 stacked bf16 [1024, 1024] layers, h [8192, 1024]: the loop
  body's ops run 2 and 8 times with the same cycles a run, and they dominate, so the
  whole estimate grows between 3x and 4x (libtpu 0.0.42.1: 3.5x; a fixed part outside)."""
  import jax
  import jax.numpy as jnp
  device = _device()
  layers = lambda ws, x: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
  est = {n: ce.estimate(_compile(layers, (n, 1024, 1024), (8192, 1024), device=device), TPU7X)
         for n in (2, 8)}
  body = {n: {r["name"]: r["cycles"] / n for r in est[n]["top"] if r["times"] == n}
          for n in (2, 8)}
  assert body[2] and body[2].keys() == body[8].keys()
  for name, per_run in body[2].items():
    assert body[8][name] == pytest.approx(per_run, rel=0.01)
  assert 3.0 < est[8]["cycles"] / est[2]["cycles"] <= 4.0


@pytest.mark.tpu
def test_compiled_v5e_plan_reports_libtpus_estimate_beside_the_roofline(capsys):
  """`t5x-like plan --config configs/gpt_cpu.py:smoke --topology v5e-4 --compile=yes`:
  the train step's fusions carry estimated_cycles (libtpu 0.0.42.1), the JSON holds the
  estimate and its MFU under xla['compiler_estimate'], the text prints it under the
  roofline line; the tiny model sits far below 40% MFU, so the plan says so."""
  pytest.importorskip("libtpu")
  import json
  from t5x_like import cli
  args = ["plan", "--config", f"{CONFIGS / 'gpt_cpu.py'}:smoke", "--topology", "v5e-4",
          "--compile=yes"]
  assert cli.main(args + ["--json"]) == 0
  plan = json.loads(capsys.readouterr().out)
  phase, = plan["phases"]
  est, bound = phase["xla"]["compiler_estimate"], phase["roofline"]
  assert est["device_kind"] == "TPU v5 lite" and est["ops_with_estimate"] > 10
  assert est["collectives_estimated"] == 0
  assert est["collective_seconds"] == pytest.approx(bound["collective_seconds"])
  assert est["combined_seconds"] == pytest.approx(
      est["seconds"] + est["uncovered_roofline_seconds"] + est["collective_seconds"])
  assert est["mfu"] == pytest.approx(phase["flops_per_step"] / (
      est["combined_seconds"] * 4 * plan["topology"]["peak_flops_per_device"]))
  assumed = phase["assumed_mfu"]
  assert assumed["above_ceiling"] and assumed["ceiling"] == bound["mfu_ceiling"]
  assert assumed["seconds_at_ceiling"] == pytest.approx(phase["seconds"])
  assert plan["total"]["mfu_above_ceiling"] == [0]
  assert cli.main(args) == 0
  text = capsys.readouterr().out.splitlines()
  at = [i for i, line in enumerate(text) if line.startswith("  roofline: step >= ")][0]
  line, = [line for line in text[at + 1:at + 4] if line.startswith("  compiler estimate")]
  assert line.startswith("  compiler estimate (libtpu ") and f"MFU <= {est['mfu']:.1%}" in line
  assert "-- ABOVE the roofline's MFU ceiling" in text[at - 1]
