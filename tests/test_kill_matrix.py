"""The kill matrix (tests/kill_matrix.py): the plan it draws from a seed and the
failpoints it arms (default tier, no process started), and a short matrix of real
supervised 2-process BERT runs (slow tier)."""

from __future__ import annotations

import pytest

import kill_matrix
from t5x_like import failpoints


def test_the_plan_covers_every_point_config_and_process_count_and_is_seeded():
  runs = kill_matrix.plan(0, 20, ["bert", "t5", "gpt"], [2, 4])
  kills = [(cell, k) for cell, ks in runs.items() for k in ks]
  assert len(kills) == 20 and len(runs) == 6
  assert {k.point for _, k in kills} == {"in_step", "during_save", "during_eval",
                                         "first_compile"}
  for (config, n), ks in runs.items():
    assert all(0 <= k.victim < n for k in ks)
    assert len({(k.point, k.step) for k in ks}) == len(ks)  # one item fires once
    assert sum(k.point == "first_compile" for k in ks) <= 1
  for _, k in kills:
    assert k.step in kill_matrix.POINTS[k.point][1]
  assert {k.item.split("@")[0] for _, k in kills} == {"in_step", "after_save",
                                                      "during_eval", "first_compile"}
  again = kill_matrix.plan(0, 20, ["bert", "t5", "gpt"], [2, 4])
  assert [k.item for ks in again.values() for k in ks] == [k.item for _, k in kills]
  other = kill_matrix.plan(1, 20, ["bert", "t5", "gpt"], [2, 4])
  assert [k.item for ks in other.values() for k in ks] != [k.item for _, k in kills]


def test_a_failpoint_item_fires_in_its_process_only_and_once(tmp_path, monkeypatch):
  monkeypatch.setenv(failpoints.FAILPOINT_ENV, "in_step@3:1,during_eval@6")
  monkeypatch.setenv(failpoints.ONCE_ENV, str(tmp_path))
  monkeypatch.setattr(failpoints, "_process_index", lambda: 0)
  assert not failpoints.armed("in_step", 3)  # process 1's
  assert not failpoints.armed("in_step", 4)
  monkeypatch.setattr(failpoints, "_process_index", lambda: 1)
  assert failpoints.armed("in_step", 3)
  assert not failpoints.armed("in_step", 3)  # a restart: already fired
  assert failpoints.armed("during_eval", 6) and not failpoints.armed("during_eval", 6)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["during_eval@6", "in_step@3:1"]
  assert (tmp_path / "in_step@3:1").read_text().startswith("pid ")


def test_without_the_once_directory_a_failpoint_fires_every_time(monkeypatch):
  monkeypatch.setenv(failpoints.FAILPOINT_ENV, "after_row@2")
  monkeypatch.delenv(failpoints.ONCE_ENV, raising=False)
  assert failpoints.armed("after_row", 2) and failpoints.armed("after_row", 2)
  assert not failpoints.armed("after_row", 3) and not failpoints.armed("before_row", 2)


@pytest.mark.slow
def test_a_short_kill_matrix_recovers_bit_for_bit(tmp_path, capsys):
  """Three kills of one supervised 2-process BERT smoke run (seed 0: during the final
  eval, inside step 5, during step 8's async save), against its uninterrupted run."""
  code = kill_matrix.main(["--processes=2", "--kills=3", "--configs=bert", "--seed=0",
                           f"--workdir={tmp_path}"])
  out = capsys.readouterr().out
  assert code == 0, out
  rows = [line for line in out.splitlines() if line.startswith("bert ")]
  assert len(rows) == 3 and all(line.endswith("yes") for line in rows), out
  assert "summary: 3/3 kills recovered" in out and "3 fired" in out, out
