"""The roofline step time (t5x_like/plan/roofline.py): per op max(flops / peak, bytes /
HBM bandwidth), collectives at the ring cost over the ICI, summed with loop trip counts.

Expected values are worked out by hand here from the shapes in the HLO text and the
formulas (Williams et al., "Roofline", CACM 2009; ring all-reduce 2(n-1)/n), not from the
code under test. The TPU tier compiles a smoke config for a v5e-4 slice (libtpu,
deviceless) and checks the plan's roofline against its own collectives.
"""

import dataclasses
import json
import pathlib
import types

import jax
import jax.numpy as jnp
import pytest

from t5x_like import cli
from t5x_like.command_flags import load_config_file
from t5x_like.plan import hlo, hlo_bytes, hlo_cost, recipes, roofline
from t5x_like.plan.report import make_plan
from t5x_like.plan.text import format_plan, roofline_lines
from t5x_like.plan.topology import FAMILIES, Topology, parse_topology

CONFIGS = pathlib.Path(__file__).parents[1] / "configs"

# A 5-iteration loop holding a bf16 [512,1024] x [1024,512] matmul fusion, a fusion that
# slices one row of a stacked f32[6,1024] array, and an all-reduce of that row over 4
# devices; then, once: an all-gather of a f32[1,1024] row over 4, a collective-permute
# of it, a Mosaic kernel with a cost estimate and one without.
FIXTURE = """HloModule fixture, is_scheduled=true, num_partitions=4

%fused_dot (param_0: bf16[512,1024], param_1: bf16[1024,512]) -> bf16[512,512] {
  %param_0 = bf16[512,1024]{1,0} parameter(0)
  %param_1 = bf16[1024,512]{1,0} parameter(1)
  ROOT %dot.1 = bf16[512,512]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_row (param_0.1: f32[6,1024], param_1.1: s32[]) -> f32[1,1024] {
  %param_0.1 = f32[6,1024]{1,0} parameter(0)
  %param_1.1 = s32[] parameter(1)
  %zero.1 = s32[] constant(0)
  ROOT %row.1 = f32[1,1024]{1,0} dynamic-slice(%param_0.1, %param_1.1, %zero.1), dynamic_slice_sizes={1,1024}
}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (loop: (s32[], f32[6,1024], bf16[512,1024], bf16[1024,512])) -> (s32[], f32[6,1024], bf16[512,1024], bf16[1024,512]) {
  %loop = (s32[], f32[6,1024]{1,0}, bf16[512,1024]{1,0}, bf16[1024,512]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%loop), index=0
  %stack = f32[6,1024]{1,0} get-tuple-element(%loop), index=1
  %x = bf16[512,1024]{1,0} get-tuple-element(%loop), index=2
  %w = bf16[1024,512]{1,0} get-tuple-element(%loop), index=3
  %mm = bf16[512,512]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  %row = f32[1,1024]{1,0} fusion(%stack, %i), kind=kLoop, calls=%fused_row
  %ar = f32[1,1024]{1,0} all-reduce(%row), replica_groups={{0,1,2,3}}, to_apply=%sum
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[6,1024]{1,0}, bf16[512,1024]{1,0}, bf16[1024,512]{1,0}) tuple(%next, %stack, %x, %w)
}

%cond (loop.1: (s32[], f32[6,1024], bf16[512,1024], bf16[1024,512])) -> pred[] {
  %loop.1 = (s32[], f32[6,1024]{1,0}, bf16[512,1024]{1,0}, bf16[1024,512]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%loop.1), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (x.1: bf16[512,1024], w.1: bf16[1024,512], stack.1: f32[6,1024], r: f32[1,1024]) -> f32[4,1024] {
  %x.1 = bf16[512,1024]{1,0} parameter(0)
  %w.1 = bf16[1024,512]{1,0} parameter(1)
  %stack.1 = f32[6,1024]{1,0} parameter(2)
  %r = f32[1,1024]{1,0} parameter(3)
  %start = s32[] constant(0)
  %init = (s32[], f32[6,1024]{1,0}, bf16[512,1024]{1,0}, bf16[1024,512]{1,0}) tuple(%start, %stack.1, %x.1, %w.1)
  %while = (s32[], f32[6,1024]{1,0}, bf16[512,1024]{1,0}, bf16[1024,512]{1,0}) while(%init), condition=%cond, body=%body
  %custom-call.1 = bf16[512,512]{1,0} custom-call(%x.1, %w.1), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "TUxJUgA=", "cost_estimate": {"flops": 1000000, "transcendentals": 0, "bytes_accessed": 2000}}}, metadata={op_name="jit(f)/estimated_kernel/pallas_call"}
  %custom-call.2 = bf16[512,512]{1,0} custom-call(%x.1, %w.1), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "TUxJUgA="}}, metadata={op_name="jit(f)/blind_kernel/pallas_call"}
  %cp = f32[1,1024]{1,0} collective-permute(%r), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  ROOT %ag = f32[4,1024]{1,0} all-gather(%cp), replica_groups=[1,4]<=[4], dimensions={0}
}
"""

CHIP = roofline.Chip("fixture", peak_flops=1e11, hbm_bandwidth=1e9, ici_bandwidth=1e8)


def test_hand_written_hlo_bound_is_the_sum_of_its_ops_by_hand():
  peak, hbm, ici = 1e11, 1e9, 1e8
  # loop body, 5 times: the matmul fusion reads x, w and writes the product (bf16)
  mm_flops = 2 * 512 * 512 * 1024
  mm_bytes = 2 * (512 * 1024 + 1024 * 512 + 512 * 512)
  assert mm_flops / peak > mm_bytes / hbm  # compute-bound
  row_bytes = 1024 * 4 + 4 + 1024 * 4  # reads one row (not the stack) and the index
  add_bytes = 3 * 4  # i + 1: two s32 read, one written
  compare_bytes = 4 + 4 + 1  # the condition, run once per iteration too
  loop_memory = 5 * (row_bytes + add_bytes + compare_bytes) / hbm
  all_reduce = 5 * 2 * 3 / 4 * (1024 * 4) / ici
  # once: the kernel with a cost estimate (compute-bound), the one without (memory)
  k1 = 1e6 / peak
  k2_bytes = 2 * (512 * 1024 + 1024 * 512 + 512 * 512)
  permute = 1024 * 4 / ici
  all_gather = 3 / 4 * (4 * 1024 * 4) / ici

  bound = roofline.bound_of_ops(hlo_cost.hlo_ops(FIXTURE), CHIP, model_flops=1e10,
                                num_devices=4)
  assert bound["compute_seconds"] == pytest.approx(5 * mm_flops / peak + k1, rel=1e-12)
  assert bound["memory_seconds"] == pytest.approx(loop_memory + k2_bytes / hbm, rel=1e-12)
  assert bound["collective_seconds"] == pytest.approx(all_reduce + permute + all_gather,
                                                      rel=1e-12)
  total = 5 * mm_flops / peak + k1 + loop_memory + k2_bytes / hbm + all_reduce + permute + \
      all_gather
  assert bound["seconds"] == pytest.approx(total, rel=1e-12)
  comm = all_reduce + permute + all_gather
  assert bound["overlap_seconds"] == pytest.approx(max(total - comm, comm), rel=1e-12)
  assert bound["mfu_ceiling"] == pytest.approx(1e10 / (total * 4 * peak), rel=1e-12)
  assert bound["flops"] == 5 * mm_flops + 1e6  # the blind kernel's FLOPs: not counted
  assert bound["uncounted_kernels"] == {"blind_kernel": 1}
  assert bound["collective_bytes"] == 5 * 4096 + 4096 + 4 * 4096


def test_loop_bodies_count_once_without_trip_counts():
  once = hlo_cost.hlo_ops(FIXTURE, trips=False)
  with_trips = hlo_cost.hlo_ops(FIXTURE)
  mm = lambda ops: sum(o.times * o.flops for o in ops if o.opcode == "fusion")
  assert mm(with_trips) == 5 * mm(once) == 5 * 2 * 512 * 512 * 1024


def test_extra_kernel_flops_go_to_compute_and_lower_the_mfu_ceiling():
  bound = roofline.bound_of_ops(hlo_cost.hlo_ops(FIXTURE), CHIP)
  more = roofline.with_model_flops(bound, 1e10, 4, extra_flops=2e9, extra_source="test")
  assert more["compute_seconds"] == pytest.approx(bound["compute_seconds"] + 2e9 / 1e11)
  assert more["seconds"] == pytest.approx(bound["seconds"] + 2e9 / 1e11)
  assert more["mfu_ceiling"] == pytest.approx(1e10 / (more["seconds"] * 4 * 1e11))


def test_group_sizes_from_every_replica_group_form():
  reader = hlo_cost._Reader(hlo.parse_module(FIXTURE), FIXTURE, 8)
  inst = lambda attrs: hlo.Instruction("x", "all-reduce", [], [], attrs, {})
  assert reader.group_size(inst("replica_groups={{0,2},{1,3}}, to_apply=%sum")) == 2
  assert reader.group_size(inst("replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%s")) == 4
  assert reader.group_size(inst("replica_groups=mesh['axis_0'=4,'axis_1'=2,'axis_2'=1]"
                                " {'axis_0','axis_2'}, use_global_device_ids=true")) == 4
  assert reader.group_size(inst("replica_groups={}, to_apply=%sum")) == 8


def test_cublas_gemm_costs_its_dot_and_not_its_workspace():
  """XLA:GPU's GEMM custom call: (f32[64,32], s8[workspace]) = gemm(f32[64,128],
  f32[128,32]), contracting lhs dim 1."""
  text = """HloModule gpu, num_partitions=1

ENTRY %main (a: f32[64,128], b: f32[128,32]) -> f32[64,32] {
  %a = f32[64,128]{1,0} parameter(0)
  %b = f32[128,32]{1,0} parameter(1)
  %custom-call.3 = (f32[64,32]{1,0}, s8[4194304]{0}) custom-call(f32[64,128]{1,0} %a, f32[128,32]{1,0} %b), custom_call_target="__cublas$gemm", backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %out = f32[64,32]{1,0} get-tuple-element(%custom-call.3), index=0
}
"""
  op, = hlo_cost.hlo_ops(text)
  assert (op.flops, op.bytes) == (2 * 64 * 32 * 128, 4 * (64 * 128 + 128 * 32 + 64 * 32))


def test_a_stack_sliced_inside_a_nested_fusion_reads_one_row():
  """XLA:TPU slices a scanned layer's weights out of the [L, ...] stack in a fusion nested
  in the matmul's: the outer fusion reads one row, not the stack."""
  text = """HloModule nested, num_partitions=1

%slice_row (p.2: f32[6,1024], i.2: s32[]) -> f32[1,1024] {
  %p.2 = f32[6,1024]{1,0} parameter(0)
  %i.2 = s32[] parameter(1)
  %z.2 = s32[] constant(0)
  ROOT %ds.2 = f32[1,1024]{1,0} dynamic-slice(%p.2, %i.2, %z.2), dynamic_slice_sizes={1,1024}
}

%outer (p.1: f32[6,1024], i.1: s32[], x.1: f32[8,1]) -> f32[8,1024] {
  %p.1 = f32[6,1024]{1,0} parameter(0)
  %i.1 = s32[] parameter(1)
  %x.1 = f32[8,1]{1,0} parameter(2)
  %row.1 = f32[1,1024]{1,0} fusion(%p.1, %i.1), kind=kLoop, calls=%slice_row
  ROOT %d.1 = f32[8,1024]{1,0} dot(%x.1, %row.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (p: f32[6,1024], i: s32[], x: f32[8,1]) -> f32[8,1024] {
  %p = f32[6,1024]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = f32[8,1]{1,0} parameter(2)
  ROOT %f = f32[8,1024]{1,0} fusion(%p, %i, %x), kind=kOutput, calls=%outer
}
"""
  op, = hlo_cost.hlo_ops(text)
  assert op.flops == 2 * 8 * 1024 * 1
  assert op.bytes == 1024 * 4 + 4 + 8 * 4 + 8 * 1024 * 4


def test_tiled_layouts_count_their_padding():
  """XLA:TPU stores whole (8, 128) tiles: f32[256, 64] takes 256 x 128 floats, a scalar
  with T(128) 128 of them."""
  size = hlo_bytes._leaf_size
  assert size("f32", "256,64", "{1,0:T(8,128)}") == (256 * 128 * 4, True)
  assert size("bf16", "4,3,64", "{2,1,0:T(8,128)(2,1)S(1)}") == (4 * 8 * 128 * 2, False)
  assert size("f32", "256,64", "{0,1:T(8,128)}") == (256 * 64 * 4, True)  # 256 is minor
  assert size("s32", "", "{:T(128)}") == (128 * 4, True)
  assert size("f32", "3,5", "{1,0}") == (3 * 5 * 4, True)  # untiled (CPU, GPU)


def test_vmem_operands_and_results_are_not_hbm_traffic():
  """XLA:TPU layouts mark VMEM as memory space S(1): a fusion reading a VMEM copy of a
  weight and writing to VMEM moves only its HBM operand; copy-start and slice-start read
  from HBM what they bring into VMEM."""
  text = """HloModule vmem, num_partitions=1

%fused (p: f32[256,256], q: f32[256,256]) -> f32[256,256] {
  %p = f32[256,256]{1,0} parameter(0)
  %q = f32[256,256]{1,0} parameter(1)
  ROOT %m = f32[256,256]{1,0} multiply(%p, %q)
}

ENTRY %main (a: f32[256,256], b: f32[256,256]) -> f32[256,256] {
  %a = f32[256,256]{1,0:T(8,128)} parameter(0)
  %b = f32[256,256]{1,0:T(8,128)} parameter(1)
  %cs = (f32[256,256]{1,0:T(8,128)S(1)}, f32[256,256]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%b)
  %cd = f32[256,256]{1,0:T(8,128)S(1)} copy-done(%cs)
  %ss = ((f32[256,256]{1,0:T(8,128)}), f32[256,128]{1,0:T(8,128)S(1)}, s32[]{:S(2)}) slice-start(%a), slice={[0:256], [0:128]}
  %sd = f32[256,128]{1,0:T(8,128)S(1)} slice-done(%ss)
  ROOT %f = f32[256,256]{1,0:T(8,128)S(1)} fusion(%a, %cd), kind=kLoop, calls=%fused
}
"""
  ops = {o.name: o for o in hlo_cost.hlo_ops(text)}
  size = 256 * 256 * 4
  assert ops["cs"].bytes == size  # HBM read of b; its VMEM copy is free
  assert ops["ss"].bytes == size // 2  # reads half of a from HBM into VMEM
  assert ops["f"].bytes == size  # reads a from HBM; b and the result are in VMEM


# ------------------------------------------------------------------ in-place updates
# XLA:TPU's backward of a scan writes each layer's gradient into the stacked [L, ...]
# buffer in place: the buffer (operand 0 of the dynamic-update-slice, aliased to the
# result) is neither read nor written beyond the update, also where the update reaches
# the fused root through bitcasts, copies, tuples and nested fusions, and where the buffer
# reaches it through XLA:TPU's aliased re-tiling copy fusion.
IN_PLACE = """HloModule in_place, num_partitions=1

%retile (input: f32[24,256,512]) -> f32[24,256,512] {
  %input = f32[24,256,512]{2,1,0} parameter(0)
  ROOT %copy.1 = f32[24,256,512]{2,1,0} copy(%input)
}

%write_row (buf.4: f32[24,256,512], upd.4: f32[1,256,512], i.4: s32[]) -> f32[24,256,512] {
  %buf.4 = f32[24,256,512]{2,1,0} parameter(0)
  %upd.4 = f32[1,256,512]{2,1,0} parameter(1)
  %i.4 = s32[] parameter(2)
  %z.4 = s32[] constant(0)
  ROOT %dus.4 = f32[24,256,512]{2,1,0} dynamic-update-slice(%buf.4, %upd.4, %i.4, %z.4, %z.4)
}

%dus_bitcast (buf: f32[24,256,512], upd: f32[1,256,512], i: s32[]) -> f32[24,131072] {
  %buf = f32[24,256,512]{2,1,0} parameter(0)
  %upd = f32[1,256,512]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %aliased = f32[24,256,512]{2,1,0} fusion(%buf), kind=kLoop, output_to_operand_aliasing={{}: (0, {})}, calls=%retile
  %dus = f32[24,256,512]{2,1,0} fusion(%aliased, %upd, %i), kind=kLoop, calls=%write_row
  ROOT %bc = f32[24,131072]{1,0} bitcast(%dus)
}

%inner_dus (b.2: f32[8,1024], u.2: f32[1,1024], i.2: s32[]) -> f32[8,1024] {
  %b.2 = f32[8,1024]{1,0} parameter(0)
  %u.2 = f32[1,1024]{1,0} parameter(1)
  %i.2 = s32[] parameter(2)
  %z.2 = s32[] constant(0)
  ROOT %dus.2 = f32[8,1024]{1,0} dynamic-update-slice(%b.2, %u.2, %i.2, %z.2)
}

%dus_tuple (a.1: f32[16,2048], b.1: f32[8,1024], u.1: f32[1,2048], v.1: f32[1,1024], i.1: s32[]) -> (f32[16,2048], f32[8,1024], f32[1,2048]) {
  %a.1 = f32[16,2048]{1,0} parameter(0)
  %b.1 = f32[8,1024]{1,0} parameter(1)
  %u.1 = f32[1,2048]{1,0} parameter(2)
  %v.1 = f32[1,1024]{1,0} parameter(3)
  %i.1 = s32[] parameter(4)
  %z.1 = s32[] constant(0)
  %view = f32[16,2048]{1,0} bitcast(%a.1)
  %dus.1 = f32[16,2048]{1,0} dynamic-update-slice(%view, %u.1, %i.1, %z.1)
  %copied = f32[16,2048]{1,0} copy(%dus.1)
  %nested = f32[8,1024]{1,0} fusion(%b.1, %v.1, %i.1), kind=kLoop, calls=%inner_dus
  %twice = f32[1,2048]{1,0} add(%u.1, %u.1)
  ROOT %t = (f32[16,2048]{1,0}, f32[8,1024]{1,0}, f32[1,2048]{1,0}) tuple(%copied, %nested, %twice)
}

%dus_fresh (u.3: f32[1,1024], i.3: s32[]) -> f32[8,1024] {
  %u.3 = f32[1,1024]{1,0} parameter(0)
  %i.3 = s32[] parameter(1)
  %zero.3 = f32[] constant(0)
  %z.3 = s32[] constant(0)
  %fresh = f32[8,1024]{1,0} broadcast(%zero.3), dimensions={}
  ROOT %dus.3 = f32[8,1024]{1,0} dynamic-update-slice(%fresh, %u.3, %i.3, %z.3)
}

ENTRY %main (g: f32[24,256,512], dg: f32[1,256,512], i: s32[], a: f32[16,2048], b: f32[8,1024], u: f32[1,2048], v: f32[1,1024]) -> f32[24,131072] {
  %g = f32[24,256,512]{2,1,0} parameter(0)
  %dg = f32[1,256,512]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %a = f32[16,2048]{1,0} parameter(3)
  %b = f32[8,1024]{1,0} parameter(4)
  %u = f32[1,2048]{1,0} parameter(5)
  %v = f32[1,1024]{1,0} parameter(6)
  %tup = (f32[16,2048]{1,0}, f32[8,1024]{1,0}, f32[1,2048]{1,0}) fusion(%a, %b, %u, %v, %i), kind=kLoop, calls=%dus_tuple
  %fresh_row = f32[8,1024]{1,0} fusion(%v, %i), kind=kLoop, calls=%dus_fresh
  ROOT %grads = f32[24,131072]{1,0} fusion(%g, %dg, %i), kind=kLoop, calls=%dus_bitcast
}
"""


def test_in_place_update_behind_a_bitcast_root_moves_the_update():
  """bitcast(fusion(dynamic-update-slice(aliased copy(buffer), update))): the
  f32[1,256,512] update (512 KiB) is read and written; the f32[24,256,512] buffer
  (12 MiB) is neither read nor written."""
  ops = {o.name: o for o in hlo_cost.hlo_ops(IN_PLACE)}
  update = 256 * 512 * 4
  assert ops["grads"].bytes == update + 4 + update  # read update and index, write update


def test_in_place_updates_in_a_tuple_root_through_copies_and_nested_fusions():
  """tuple(copy(DUS(bitcast(a), u)), fusion(DUS(b, v)), u + u): reads u, v, the index;
  writes the two updates and the f32[1,2048] sum; a and b (the buffers) not at all."""
  ops = {o.name: o for o in hlo_cost.hlo_ops(IN_PLACE)}
  u, v = 2048 * 4, 1024 * 4
  assert ops["tup"].bytes == (u + v + 4) + (u + v + u)


def test_update_of_a_fresh_buffer_writes_all_of_it():
  """dynamic-update-slice(broadcast(0), row): no buffer comes in, so the whole f32[8,1024]
  result is written (not in place)."""
  ops = {o.name: o for o in hlo_cost.hlo_ops(IN_PLACE)}
  assert ops["fresh_row"].bytes == (1024 * 4 + 4) + 8 * 1024 * 4


# ------------------------------------------------------------------ async collectives
# XLA:TPU (tpu7x) runs the gradient all-reduce on the SparseCore inside an async call:
# call-start(operand) -> call-done, to_apply= a computation whose root is the
# all-reduce; that computation closes with `}, execution_thread="sparsecore"`.
ASYNC_CALL = """HloModule async_call, is_scheduled=true, num_partitions=8

%add.clone (x.4: f32[], y.2: f32[]) -> f32[] {
  %y.2 = f32[]{:T(128)S(7)} parameter(1)
  %x.4 = f32[]{:T(128)S(7)} parameter(0)
  ROOT %add.2 = f32[]{:T(128)S(7)} add(%x.4, %y.2)
}, execution_thread="sparsecore"

%called_computation (param_0.14: f32[256,256], param_1.14: token[]) -> f32[256,256] {
  %param_1.14 = token[] parameter(1)
  %param_0.14 = f32[256,256]{0,1:T(8,128)} parameter(0)
  ROOT %all-reduce.2 = f32[256,256]{0,1:T(8,128)} all-reduce(%param_0.14), channel_id=1, replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, use_global_device_ids=true, to_apply=%add.clone
}, execution_thread="sparsecore"

ENTRY %main.0_spmd (param.1: f32[256,256]) -> f32[256,256] {
  %param.1 = f32[256,256]{0,1:T(8,128)} parameter(0)
  %prepare_start = s32[]{:S(2)} custom-call(), custom_call_target="PrepareAsyncCallStart"
  %prepare_done = token[] custom-call(%prepare_start), custom_call_target="PrepareAsyncCallDone"
  %all-reduce.3.cloned.1.call-start = ((f32[256,256]{0,1:T(8,128)}, token[]), f32[256,256]{0,1:T(8,128)}) call-start(%param.1, %prepare_done), async_execution_thread="sparsecore", to_apply=%called_computation
  ROOT %all-reduce.3.cloned.1.call-done = f32[256,256]{0,1:T(8,128)} call-done(%all-reduce.3.cloned.1.call-start)
}
"""


def test_an_async_call_of_an_all_reduce_is_that_all_reduce_once():
  """f32[256,256] (256 KiB) all-reduced over 8 devices: 2 x 7/8 x bytes / ICI, counted
  at the call-start; the call-done and the prepare custom calls cost nothing."""
  ops = hlo_cost.hlo_ops(ASYNC_CALL)
  grad = 256 * 256 * 4
  assert [(o.name, o.collective, o.bytes, o.group, o.times) for o in ops] == [
      ("all-reduce.3.cloned.1.call-start", "all-reduce", grad, 8, 1)]
  bound = roofline.bound_of_ops(ops, CHIP)
  assert bound["collective_seconds"] == pytest.approx(2 * 7 / 8 * grad / 1e8, rel=1e-12)
  assert bound["seconds"] == bound["collective_seconds"]
  summary = hlo.summarize(hlo.parse_module(ASYNC_CALL))
  assert summary["collectives"] == {"all-reduce": {"count": 1, "bytes": grad, "ops": 1}}


# ------------------------------------------------------------------ loops' trip counts
def _loop(compare: str, start: str, step: str, bound: str = "s32[] constant(12)",
          cond_root: str = "") -> str:
  """A while over (i, bound, x) with no known_trip_count: i starts at `start` (a
  copied constant, as XLA:TPU writes it), the body adds `step` and runs an
  f32[8,128] x [128,128] dot; the condition is `compare` (%i, %n)."""
  return f"""HloModule loop, num_partitions=1

%cmp (ci: s32[], cn: s32[]) -> pred[] {{
  %ci = s32[] parameter(0)
  %cn = s32[] parameter(1)
  ROOT %fused_lt = pred[] compare(%ci, %cn), direction=LT
}}

%cond (p.1: (s32[], s32[], f32[8,128])) -> pred[] {{
  %p.1 = (s32[], s32[], f32[8,128]{{1,0}}) parameter(0)
  %i.1 = s32[]{{:T(128)}} get-tuple-element(%p.1), index=0
  %n = {bound}
  ROOT %c = pred[] {compare}{cond_root}
}}

%body (p.2: (s32[], s32[], f32[8,128])) -> (s32[], s32[], f32[8,128]) {{
  %p.2 = (s32[], s32[], f32[8,128]{{1,0}}) parameter(0)
  %i.2 = s32[] get-tuple-element(%p.2), index=0
  %m.2 = s32[] get-tuple-element(%p.2), index=1
  %x.2 = f32[8,128]{{1,0}} get-tuple-element(%p.2), index=2
  %step = s32[] constant({step})
  %next = s32[] add(%i.2, %step)
  %y.2 = f32[8,8]{{1,0}} dot(%x.2, %x.2), lhs_contracting_dims={{1}}, rhs_contracting_dims={{1}}
  ROOT %out = (s32[], s32[], f32[8,128]{{1,0}}) tuple(%next, %m.2, %x.2)
}}

ENTRY %main (x: f32[8,128], limit: s32[]) -> f32[8,128] {{
  %x = f32[8,128]{{1,0}} parameter(0)
  %limit = s32[] parameter(1)
  %k = s32[] constant({start})
  %start = s32[]{{:T(128)}} copy(%k)
  %eighteen = s32[] constant(18)
  %init = (s32[], s32[], f32[8,128]{{1,0}}) tuple(%start, %eighteen, %x)
  %w = (s32[], s32[], f32[8,128]{{1,0}}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[8,128]{{1,0}} get-tuple-element(%w), index=2
}}
"""


@pytest.mark.parametrize("compare, start, step, bound, trips", [
    ("compare(%i.1, %n), direction=LT", 2, 1, "s32[] constant(12)", 10),  # 2..11
    ("compare(%i.1, %n), direction=LT", 1, 2, "s32[] constant(11)", 5),  # 1, 3, .., 9
    ("compare(%i.1, %n), direction=GT", 6, -1, "s32[] constant(0)", 6),  # 6..1
    ("compare(%i.1, %n), direction=NE", 0, 3, "s32[] constant(9)", 3),  # 0, 3, 6
    ("compare(%n, %i.1), direction=GE", 2, 1, "s32[] constant(8)", 7),  # 8 >= i: 2..8
    ("compare(%n, %i.1), direction=GT", 0, 4, "s32[] constant(10)", 3),  # 0, 4, 8
    # the bound a loop-invariant element of the state: its init, 18
    ("compare(%i.1, %n), direction=LT", 0, 1, "s32[] get-tuple-element(%p.1), index=1", 18),
    ("compare(%n, %i.1), direction=GT", 9, 1, "s32[] get-tuple-element(%p.1), index=1", 9),
    # XLA:TPU's fused compare: fusion(i, n) calls compare(param 0, param 1)
    ("fusion(%i.1, %n), kind=kLoop, calls=%cmp", 3, 1, "s32[] constant(21)", 18),
])
def test_a_loop_without_known_trip_count_reads_it_off_its_condition(compare, start,
                                                                    step, bound, trips):
  text = _loop(compare, start, step, bound)
  module = hlo.parse_module(text)
  _, loops = hlo.multiplicities(module)
  assert [loop["trip_count"] for loop in loops] == [trips]
  dot, = [o for o in hlo_cost.hlo_ops(text) if o.opcode == "dot"]
  assert (dot.times, dot.flops) == (trips, 2 * 8 * 8 * 128)


def test_a_loop_bounded_by_a_runtime_value_runs_once_and_is_named():
  """i < limit, limit an argument: no count follows; the body counts once and roofline()
  lists the loop so that a report can say so."""
  text = _loop("compare(%i.1, %n), direction=LT", 0, 1, "s32[] get-tuple-element(%p.1),"
               " index=1").replace("tuple(%start, %eighteen, %x)", "tuple(%start, %limit, %x)")
  _, loops = hlo.multiplicities(hlo.parse_module(text))
  assert [loop["trip_count"] for loop in loops] == [None]
  compiled = types.SimpleNamespace(as_text=lambda: text, cost_analysis=lambda: {})
  bound = roofline.roofline(compiled, CHIP, model_flops=4 * 2 * 8 * 8 * 128)
  assert bound["unknown_trip_loops"] == ["w"]
  assert bound["flops_ratio"] == pytest.approx(1 / 4) and bound["flops_mismatch"] is True


def test_flops_ratio_flags_hlo_flops_off_the_model_flops_by_more_than_10_percent():
  """FIXTURE: 5 x 2 x 512 x 512 x 1024 + 1e6 FLOPs per device over 4 devices."""
  per_device = 5 * 2 * 512 * 512 * 1024 + 1e6
  ops = hlo_cost.hlo_ops(FIXTURE)
  for model, ratio, mismatch in ((4 * per_device, 1.0, False),
                                 (4 * per_device / 1.08, 1.08, False),
                                 (4 * per_device / 0.85, 0.85, True),
                                 (2 * per_device, 2.0, True)):
    bound = roofline.bound_of_ops(ops, CHIP, model_flops=model, num_devices=4)
    assert bound["flops_ratio"] == pytest.approx(ratio)
    assert bound["flops_mismatch"] is mismatch
  bound = roofline.bound_of_ops(ops, CHIP)
  assert (bound["flops_ratio"], bound["flops_mismatch"]) == (None, None)
  # with_model_flops: the kernel FLOPs the HLO cannot see count too (1e9 per device)
  more = roofline.with_model_flops(bound, 4 * (per_device + 1e9), 4, extra_flops=1e9)
  assert more["flops_ratio"] == pytest.approx(1.0) and more["flops_mismatch"] is False
  more = roofline.with_model_flops(bound, 4 * (per_device + 1e9), 4)
  assert more["flops_ratio"] == pytest.approx(per_device / (per_device + 1e9))
  assert more["flops_mismatch"] is True


def test_cpu_compiled_matmul_bound_is_its_flops_over_peak_or_bytes_over_bandwidth():
  a = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  b = jax.ShapeDtypeStruct((128, 32), jnp.float32)
  compiled = jax.jit(lambda x, y: x @ y).lower(a, b).compile()
  flops = 2 * 64 * 32 * 128
  moved = 4 * (64 * 128 + 128 * 32 + 64 * 32)
  fast_memory = roofline.Chip("cpu", 1e9, 1e30, 1e30)
  bound = roofline.roofline(compiled, fast_memory, model_flops=flops, num_devices=1)
  assert bound["seconds"] == pytest.approx(flops / 1e9, rel=1e-9)
  assert bound["mfu_ceiling"] == pytest.approx(1.0, rel=1e-9)
  fast_math = roofline.Chip("cpu", 1e30, 1e9, 1e30)
  bound = roofline.roofline(compiled, fast_math)
  assert bound["seconds"] == pytest.approx(moved / 1e9, rel=1e-9)
  assert bound["bytes"] == bound["bytes_once"] == bound["xla_bytes_accessed"] == moved


def test_chip_facts_per_generation():
  """HBM and ICI bandwidths per JAX device from the spec sheets (topology.py's sources):
  half a chip's on v2/v3 (two TensorCores per chip)."""
  want = {"v2": (350e9, 124e9), "v3": (450e9, 164e9), "v4": (1200e9, 300e9),
          "v5e": (819e9, 200e9), "v5p": (2765e9, 600e9), "v6e": (1640e9, 448e9),
          "h100": (3350e9, 450e9), "h200": (4800e9, 450e9)}
  for name, (hbm, ici) in want.items():
    family = FAMILIES[name]
    assert (family.hbm_bandwidth, family.ici_bandwidth) == pytest.approx((hbm, ici)), name
  chip = roofline.chip_for(parse_topology("v5e-16"))
  assert (chip.peak_flops, chip.hbm_bandwidth, chip.ici_bandwidth) == (197e12, 819e9, 200e9)
  assert roofline.chip_for(Topology("cpu-8", "cpu", "cpu", 8, 1, 1e9, 1 << 30)) is None
  h100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
  assert roofline.chip_of_device(h100) == roofline.Chip(
      "NVIDIA H100 80GB HBM3", 989e12, 3350e9, 450e9)
  h200 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")
  assert roofline.chip_of_device(h200).hbm_bandwidth == 4800e9
  assert roofline.chip_of_device(jax.devices("cpu")[0]) is None


def test_recipe_row_cells_show_the_bound_in_ms_and_the_mfu_ceiling():
  bound = roofline.with_model_flops(roofline.bound_of_ops(hlo_cost.hlo_ops(FIXTURE), CHIP),
                                    1e10, 4, 1e9, "analytic attention")
  row = recipes.roofline_json(bound)
  assert recipes._roofline_cells({"roofline": row}) == [
      f"{bound['seconds'] * 1e3:.1f} = {bound['compute_seconds'] * 1e3:.1f} +"
      f" {bound['memory_seconds'] * 1e3:.1f} + {bound['collective_seconds'] * 1e3:.1f}"
      " (attention kernels' FLOPs: analytic)",
      f"{1e10 / (bound['seconds'] * 4 * 1e11):.0%}"]
  json.dumps(row)


# ------------------------------------------------------------------ the plan
def _smoke_plan(compile_step: str = "auto", **topology_fields) -> dict:
  config = load_config_file(f"{CONFIGS / 'bert_cpu.py'}:smoke")
  topology = Topology("cpu-8", "cpu", "cpu", 8, 1, 1e12, 1 << 30, **topology_fields)
  return make_plan(config, topology, eval_step=False, compile_step=compile_step)


@pytest.mark.slow
def test_compiled_plan_times_its_phases_by_the_roofline():
  """cpu-8 with made-up bandwidths (CPU has none of its own): the plan compiles the real
  train step and its headline time is the roofline's, the assumed-MFU time beside it."""
  plan = _smoke_plan(hbm_bandwidth=1e11, ici_bandwidth=1e10)
  phase, = plan["phases"]
  r = phase["roofline"]
  assert r["seconds"] == pytest.approx(r["compute_seconds"] + r["memory_seconds"] +
                                       r["collective_seconds"])
  assert r["collective_seconds"] > 0  # data parallel over 8: gradients all-reduced
  assert r["mfu_ceiling"] == pytest.approx(
      phase["flops_per_step"] / (r["seconds"] * 8 * 1e12))
  assert phase["step_seconds"] == r["seconds"]
  assert phase["seconds"] == r["seconds"] * phase["steps"]
  assert phase["step_seconds_at_mfu"] == pytest.approx(
      phase["flops_per_step"] / (8 * 1e12 * plan["mfu"]))
  assert plan["total"]["roofline"] is True
  text = format_plan(plan)
  assert "roofline: step >= " in text and "MFU ceiling" in text
  assert "at 40% MFU" in text and "by the roofline bound" in text
  json.dumps(plan)  # the plan stays JSON


def test_roofline_lines_show_the_bound_its_split_and_mfu_ceiling():
  bound = roofline.bound_of_ops(hlo_cost.hlo_ops(FIXTURE), CHIP)
  r = roofline.with_model_flops(bound, 1e10, 4, 1e9, "analytic attention")
  text = "\n".join(roofline_lines(r, steps=1000))
  parts = " + ".join(f"{name} {r[key] * 1e3:.1f} ms" for name, key in (
      ("compute", "compute_seconds"), ("memory", "memory_seconds"),
      ("collectives", "collective_seconds")))
  assert f"roofline: step >= {r['seconds'] * 1e3:.1f} ms = {parts} (no overlap;" in text
  assert f"MFU ceiling {1e10 / (r['seconds'] * 4 * 1e11):.1%}" in text
  assert f"{r['seconds'] * 1000:.2f} s for the phase" in text
  assert "0.1 TFLOP/s, HBM 1 GB/s, ICI 0.1 GB/s" in text
  assert "+ 1e+09 FLOPs per device not in the HLO: analytic attention" in text


@pytest.mark.slow
def test_plan_text_puts_the_roofline_beside_the_assumed_mfu_time():
  """Uncompiled, the plan keeps the assumed-MFU time; given a roofline (the fixture's),
  its text shows the bound, its split and MFU ceiling, with the MFU time beside it."""
  plan = _smoke_plan(compile_step="no")
  phase, = plan["phases"]
  assert phase["roofline"] is None and phase["xla"] is None
  assert phase["step_seconds"] == phase["step_seconds_at_mfu"]
  assert "roofline" not in format_plan(plan)
  bound = roofline.bound_of_ops(hlo_cost.hlo_ops(FIXTURE), CHIP)
  phase["roofline"] = roofline.with_model_flops(bound, 1e10, 4, 1e9, "analytic attention")
  plan["total"]["roofline"] = True
  text = format_plan(plan)
  seconds = phase["roofline"]["seconds"]
  assert f"roofline: step >= {seconds * 1e3:.1f} ms = compute" in text
  assert f"MFU ceiling {1e10 / (seconds * 4 * 1e11):.1%}" in text
  assert "+ 1e+09 FLOPs per device not in the HLO: analytic attention" in text
  assert f"at {plan['mfu']:.0%} MFU" in text and "by the roofline bound" in text


# ------------------------------------------------------------------ TPU (libtpu)
@pytest.mark.tpu
def test_v5e_plan_roofline_costs_its_gradient_all_reduce_on_the_ring(capsys):
  pytest.importorskip("libtpu")
  rc = cli.main(["plan", "--config", f"{CONFIGS / 'bert_cpu.py'}:smoke", "--topology",
                 "v5e-4", "--compile=yes", "--json"])
  out = capsys.readouterr()
  assert rc == 0, out.err
  plan = json.loads(out.out)
  phase, = plan["phases"]
  r = phase["roofline"]
  ici = 1600e9 / 8  # v5e: 1600 Gbps per chip
  all_reduce = phase["xla"]["collectives"]["all-reduce"]["bytes"]
  assert set(phase["xla"]["collectives"]) == {"all-reduce"}
  assert r["collective_seconds"] == pytest.approx(2 * 3 / 4 * all_reduce / ici)
  assert r["chip"] == {"name": "TPU v5 lite", "peak_flops": 197e12,
                       "hbm_bandwidth": 819e9, "ici_bandwidth": ici}
  assert 0 < r["mfu_ceiling"] <= 1
  assert r["flops"] >= phase["xla"]["matmul_flops_per_device"]
  assert phase["step_seconds"] == r["seconds"]
