"""The random-access index shuffle: a bijection of [0, n) for every n, keyed, close to
uniform, vectorised over any shape."""

import collections

import numpy as np
import pytest

from t5x_like.data.index_shuffle import shuffled


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 16, 17, 1000, 2 ** 20 + 3])
def test_a_bijection_of_0_to_n(n):
  image = shuffled(np.arange(n), n, (3, 1))
  assert image.dtype == np.int64
  np.testing.assert_array_equal(np.sort(image), np.arange(n))


def test_keys_name_different_orders_and_the_same_key_the_same_order():
  orders = [shuffled(np.arange(1000), 1000, key).tobytes()
            for key in [(0, 0), (0, 1), (1, 0), (0, 0, 1)]]
  assert len(set(orders)) == 4
  assert shuffled(np.arange(1000), 1000, (0, 1)).tobytes() == orders[1]
  assert orders[0] != np.arange(1000).tobytes()


def _chi_square(counts):
  counts = np.asarray(counts, float)
  expected = counts.sum() / len(counts)
  return float(((counts - expected) ** 2 / expected).sum())


def test_the_image_of_one_index_is_about_uniform():
  # 10 and 5 cycle-walk (domain 16), 16 is a whole domain. Thresholds: chi-square's
  # 99.99% quantile for n - 1 degrees of freedom (33.7 for 9, 18.5 for 4, 44.3 for 15).
  for n, bound in [(10, 33.7), (5, 18.5), (16, 44.3)]:
    images = [int(shuffled(np.array([0]), n, (key, 99))[0]) for key in range(400 * n)]
    assert _chi_square(np.bincount(images, minlength=n)) < bound, (n, np.bincount(images))


def test_whole_permutations_of_three_are_about_uniform():
  counts = collections.Counter(tuple(shuffled(np.arange(3), 3, (key,)).tolist())
                               for key in range(6000))
  assert len(counts) == 6
  assert _chi_square(list(counts.values())) < 25.7  # 99.99% quantile, 5 degrees of freedom


def test_images_of_neighbouring_indices_are_uncorrelated():
  images = np.stack([shuffled(np.array([0, 1]), 1000, (key, 5)) for key in range(3000)])
  assert abs(np.corrcoef(images.T)[0, 1]) < 0.1
  assert abs(images.mean() - 499.5) < 20


def test_vectorised_over_any_shape():
  n, key = 50, (4, 2)
  whole = shuffled(np.arange(n), n, key)
  grid = np.arange(n)[::-1].reshape(5, 2, 5)
  np.testing.assert_array_equal(shuffled(grid, n, key), whole[grid])
  assert shuffled(np.int64(7), n, key).shape == ()
  assert int(shuffled(np.int64(7), n, key)) == whole[7]
  assert shuffled(np.zeros((0, 3), np.int64), n, key).shape == (0, 3)
  np.testing.assert_array_equal(shuffled(np.array([3, 3, 9], np.int32), n, key), whole[[3, 3, 9]])


def test_large_n_and_bad_arguments():
  n = 300_000_000
  image = shuffled(np.arange(n - 1000, n), n, (0, 0))
  assert len(set(image.tolist())) == 1000 and image.min() >= 0 and image.max() < n
  with pytest.raises(ValueError, match="outside"):
    shuffled(np.array([5]), 5, (0,))
  with pytest.raises(ValueError, match="outside"):
    shuffled(np.array([-1]), 5, (0,))
  with pytest.raises(TypeError):
    shuffled(np.array([0.5]), 5, (0,))
