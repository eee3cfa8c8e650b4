"""mtrl_jax.buckets: the one place sizes are rounded to compiled shapes."""

import pytest

from mtrl_jax import buckets


def test_next_pow2():
  assert [buckets.next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 17)] == [1, 1, 2, 4, 4, 8, 32]
  assert buckets.next_pow2(3, minimum=16) == 16 and buckets.next_pow2(17, minimum=16) == 32


def test_round_up():
  assert [buckets.round_up(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 4, 4, 8, 8]
  with pytest.raises(ValueError, match="multiple=0"):
    buckets.round_up(3, 0)


def test_bucket_picks_smallest_holding_bucket_and_names_the_size():
  assert buckets.bucket(5, (8, 4, 16), "row length") == 8
  assert buckets.bucket(8, (8, 4, 16), "row length") == 8
  with pytest.raises(
      ValueError, match=r"row length 17 exceeds the largest bucket 16 \(buckets \[4, 8, 16\]\)"
  ):
    buckets.bucket(17, (8, 4, 16), "row length")


def test_bucket_or_pow2():
  assert buckets.bucket_or_pow2(5, None, "x", minimum=16) == 16
  assert buckets.bucket_or_pow2(40, None, "x", minimum=16) == 64
  assert buckets.bucket_or_pow2(40, (48, 96), "x") == 48


def test_row_count():
  # The next power of two, then a multiple of the data axis (3 shards: 8 -> 9).
  assert [buckets.row_count(n) for n in (0, 1, 3, 8, 9)] == [1, 1, 4, 8, 16]
  assert buckets.row_count(5, multiple=3) == 9 and buckets.row_count(1, multiple=4) == 4
