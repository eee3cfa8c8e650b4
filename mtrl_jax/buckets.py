"""Shape buckets: the few sizes a jitted function is compiled for.

A jitted function compiles once per input shape (docs/design.md invariant 5), so
every variable size (rows, prompt length, decode length, stop ids) is rounded
up to a bucket: the smallest configured bucket that holds it, or else the
next power of two, then to a multiple of the mesh axis the rows are split on.
Every caller that rounds a size for compilation uses these functions.
"""

from __future__ import annotations

from typing import Optional, Sequence


def next_pow2(n: int, minimum: int = 1) -> int:
  """The smallest power of two >= n and >= minimum (n <= 1 gives 1, then `minimum`)."""
  return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def round_up(n: int, multiple: int) -> int:
  """The smallest multiple of `multiple` >= n."""
  if multiple < 1:
    raise ValueError(f"round_up: multiple={multiple}; must be >= 1")
  return -(-int(n) // multiple) * multiple


def bucket(n: int, buckets: Sequence[int], what: str) -> int:
  """The smallest of `buckets` >= n.

  Args:
    n: the size to hold.
    buckets: the configured sizes.
    what: what `n` is, for the error ('row length', 'Sampler.prompt_buckets', ...).
  Raises:
    ValueError naming `what`, `n` and the buckets when none is large enough.
  """
  fits = [b for b in sorted(buckets) if b >= n]
  if not fits:
    raise ValueError(
        f"{what} {n} exceeds the largest bucket {max(buckets)} "
        f"(buckets {sorted(buckets)}); raise the bucket or shorten the rollout"
    )
  return int(fits[0])


def bucket_or_pow2(n: int, buckets: Optional[Sequence[int]], what: str, minimum: int = 1) -> int:
  """`bucket(n, buckets, what)`, or `next_pow2(n, minimum)` when `buckets` is None."""
  if buckets is None:
    return next_pow2(n, minimum)
  return bucket(n, buckets, what)


def row_count(n: int, multiple: int = 1) -> int:
  """Rows of a batch of n sequences: the next power of two >= n (at least 1), rounded up
  to a multiple of `multiple` (the number of shards of the data axis)."""
  return round_up(next_pow2(max(int(n), 1)), multiple)
