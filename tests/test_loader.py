"""The loader: determinism, host slices, epochs, and exact resumption from its state."""

import numpy as np
import pytest

from t5x_like.data.loader import BatchPlan, make_loader
from t5x_like.data.objective import Objective, example_rng


class CountingObjective(Objective):
  """Example i of epoch e: its identity plus seeded noise, so any mix-up shows."""

  def __init__(self, seed: int, sizes=(10, 13, 7)):
    self.seed = seed
    self.sizes = sizes

  def num_examples(self, epoch):
    return self.sizes[epoch % len(self.sizes)]

  def example(self, index, epoch):
    noise = example_rng(self.seed, epoch, index).integers(0, 1000, 3)
    return {"id": np.array([epoch, index]), "noise": noise}


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _ids(batch):
  return [tuple(row) for row in batch["id"]]


def test_same_seed_same_batches_other_seed_other_batches():
  a = _take(iter(make_loader(CountingObjective(0), 4, seed=0, process_index=0, process_count=1)), 6)
  b = _take(iter(make_loader(CountingObjective(0), 4, seed=0, process_index=0, process_count=1)), 6)
  c = _take(iter(make_loader(CountingObjective(0), 4, seed=1, process_index=0, process_count=1)), 6)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["id"], y["id"])
    np.testing.assert_array_equal(x["noise"], y["noise"])
  assert any(_ids(x) != _ids(z) for x, z in zip(a, c))


def test_each_epoch_is_a_permutation_and_epochs_differ():
  plan = BatchPlan(CountingObjective(0), 5, seed=3)  # epoch sizes 10, 13, 7 -> 30 examples
  rows = [r for step in range(6) for r in plan.host_examples(step)]
  assert sorted(rows[:10]) == [(0, i) for i in range(10)]
  assert sorted(rows[10:23]) == [(1, i) for i in range(13)]
  assert sorted(rows[23:30]) == [(2, i) for i in range(7)]
  assert [i for _, i in rows[:10]] != list(range(10))  # shuffled
  assert BatchPlan(CountingObjective(0), 5, seed=3, num_epochs=2).num_steps == 23 // 5


def test_hosts_read_disjoint_slices_whose_union_is_the_global_batch():
  global_batches = _take(iter(make_loader(CountingObjective(0), 6, seed=0, process_index=0,
                                          process_count=1)), 7)
  hosts = [_take(iter(make_loader(CountingObjective(0), 6, seed=0, process_index=h,
                                  process_count=2)), 7) for h in range(2)]
  for step, full in enumerate(global_batches):
    h0, h1 = hosts[0][step], hosts[1][step]
    assert not set(_ids(h0)) & set(_ids(h1))
    np.testing.assert_array_equal(np.concatenate([h0["id"], h1["id"]]), full["id"])
    np.testing.assert_array_equal(np.concatenate([h0["noise"], h1["noise"]]), full["noise"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_restored_iterator_continues_exactly(num_workers):
  def loader():
    return make_loader(CountingObjective(5), 4, seed=9, process_index=0, process_count=1,
                       num_workers=num_workers)

  uninterrupted = _take(iter(loader()), 12)
  first = iter(loader())
  _take(first, 5)
  state = first.get_state()
  del first
  resumed = iter(loader())
  resumed.set_state(state)
  for expected, got in zip(uninterrupted[5:], _take(resumed, 7)):
    np.testing.assert_array_equal(expected["id"], got["id"])
    np.testing.assert_array_equal(expected["noise"], got["noise"])


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="global_batch_size=6 does not divide over process_count=4"):
    BatchPlan(CountingObjective(0), 6, seed=0, process_count=4)
  with pytest.raises(ValueError, match="process_index=2"):
    BatchPlan(CountingObjective(0), 6, seed=0, process_index=2, process_count=2)
  with pytest.raises(ValueError, match="no examples in epoch 0"):
    BatchPlan(CountingObjective(0, sizes=(0,)), 2, seed=0).host_batch(0)


def test_a_batch_costs_its_rows_not_the_epoch():
  # 10^12 examples per epoch: a table of the epoch's order would not fit in memory.
  huge = CountingObjective(0, sizes=(10 ** 12,))
  plan = BatchPlan(huge, 64, seed=1, process_index=1, process_count=2)
  rows = plan.host_examples(10 ** 9)
  indices = [i for _, i in rows]
  assert len(set(indices)) == 32 and all(0 <= i < 10 ** 12 for i in indices)
  assert {e for e, _ in rows} == {0}
  assert sorted(indices) != indices  # shuffled


def test_rows_depend_on_the_step_only_and_unshuffled_is_in_order():
  walked = BatchPlan(CountingObjective(0), 4, seed=2)
  for step in range(9):
    walked.host_examples(step)
  assert walked.host_examples(9) == BatchPlan(CountingObjective(0), 4, seed=2).host_examples(9)
  plain = BatchPlan(CountingObjective(0), 4, seed=2, shuffle=False)
  rows = [r for step in range(4) for r in plain.host_examples(step)]
  assert rows == [(0, i) for i in range(10)] + [(1, i) for i in range(6)]
