"""plan chooses the layout (t5x_like/plan/layouts.py): the candidates of a config on a
slice, each compiled, and the one with the smallest bound that fits.

Default tier: a tiny BERT on the 8 CPU devices, read with a chip whose figures are given
here (the CPU has no bandwidth table); the chosen row is checked against the minimum
taken here over the rows, and the rows against each other (a ZeRO-2 layout moves fewer
HBM bytes in the optimizer update than the replicated one). TPU tier: the search for
one recipe on one slice through `t5x-like plan --search_layouts`.
"""

import json

import jax
import pytest

from t5x_like import cli
from t5x_like.plan import layouts, roofline
from helpers import ROOT, load_config

CHIP = roofline.Chip("test chip", peak_flops=1e12, hbm_bandwidth=1e11, ici_bandwidth=1e10)


def test_candidates_split_the_devices_and_keep_the_batch_divisible():
  config = load_config("bert_cpu", "smoke")  # batch 8
  found = layouts.candidates(config, 8, fsdp=(1, 2), tensor=(1, 2), zero_stages=(0, 2))
  assert layouts.Candidate(8, 1, 1, 0) in found and layouts.Candidate(8, 1, 1, 2) in found
  assert layouts.Candidate(4, 2, 1, 2) in found and layouts.Candidate(4, 1, 2, 0) in found
  assert all(c.data * c.fsdp * c.tensor == 8 for c in found)
  assert all(8 % (c.data * c.fsdp * c.microbatches) == 0 for c in found)
  # ZeRO needs data-parallel devices to split over.
  assert layouts.Candidate(1, 8, 1, 2) not in layouts.candidates(config, 8, fsdp=(8,))
  assert layouts.Candidate(4, 2, 1, 0).overrides() == [
      "--config.mesh.data=4", "--config.mesh.fsdp=2", "--config.mesh.tensor=1",
      "--config.mesh.zero_stage=0", "--config.train.microbatches=1"]


def test_the_search_chooses_the_fitting_layout_with_the_smallest_roofline():
  config = load_config("bert_cpu", "smoke")
  config.train.batch_size = 16
  config.model.overrides.num_layers = 1
  cands = [layouts.Candidate(8, 1, 1, 0), layouts.Candidate(8, 1, 1, 2),
           layouts.Candidate(4, 1, 2, 0)]
  result = layouts.search_layouts(config, jax.devices(), CHIP, memory_bytes=1 << 40,
                                  layouts=cands)
  rows = result["rows"]
  assert [r["name"] for r in rows] == [c.name() for c in cands]
  assert all(r["fits"] and r["roofline_seconds"] > 0 and r["mfu_ceiling"] > 0 for r in rows)
  best = min(rows, key=lambda r: r["roofline_seconds"])
  assert result["chosen"] is best and best["rank_by"] == "roofline"
  # Distinct programs: ZeRO-2 updates 1/8 of the moments per device.
  replicated, zero = rows[0], rows[1]
  assert zero["memory_bytes"] < replicated["memory_bytes"]
  assert zero["hlo_bytes"] < replicated["hlo_bytes"]
  # A row over the HBM is never chosen, even when it is the fastest.
  over = dict(best, fits=False)
  others = [r for r in rows if r is not best]
  assert layouts.choose([over, *others]) is min(others, key=lambda r: r["roofline_seconds"])
  assert layouts.choose([over]) is None


@pytest.mark.tpu
def test_plan_searches_the_layouts_of_a_recipe_on_a_tpu_slice(capsys):
  pytest.importorskip("libtpu")
  code = cli.main(["plan", f"--config={ROOT}/configs/bert_cpu.py:smoke", "--topology=v5e-8",
                   "--compile=yes", "--search_layouts", "--json",
                   "--config.train.batch_size=16"])
  out = capsys.readouterr().out
  assert code == 0, out
  plan = json.loads(out.strip().splitlines()[-1])
  search = plan["layout_search"]
  assert len(search["rows"]) >= 4 and search["chosen_layout"] is not None
  assert 0 < search["mfu_ceiling"] <= 1
  chosen = search["chosen"]
  fitting = [r for r in search["rows"] if r["fits"]]
  assert chosen["rank_seconds"] == min(r["rank_seconds"] for r in fitting)
