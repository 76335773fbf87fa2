"""Shape buckets: the fixed set of batch sizes and prompt lengths the engine compiles for."""

from __future__ import annotations

import bisect
from typing import Sequence


def powers_of_two_up_to(limit: int, start: int = 1) -> tuple[int, ...]:
  """``start, 2*start, 4*start, ...`` below ``limit``, then ``limit`` itself."""
  sizes, s = [], start
  while s < limit:
    sizes.append(s)
    s *= 2
  sizes.append(limit)
  return tuple(sizes)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
  """The smallest bucket that holds ``n`` items (``buckets`` sorted ascending)."""
  i = bisect.bisect_left(buckets, n)
  if i == len(buckets):
    raise ValueError(f"{n} does not fit the largest bucket {buckets[-1]}")
  return buckets[i]


def next_smaller(bucket: int, buckets: Sequence[int]) -> int:
  """The largest bucket below ``bucket`` (0 if none): live rows at or under it can be compacted."""
  i = bisect.bisect_left(buckets, bucket)
  return buckets[i - 1] if i > 0 else 0


def shard_ranges(n: int, shards: int) -> list[range]:
  """``n`` rows cut into ``shards`` contiguous ranges whose sizes differ by at most one (the
  first ones are the bigger; some are empty when ``n < shards``)."""
  base, extra = divmod(n, shards)
  out, start = [], 0
  for k in range(shards):
    size = base + (k < extra)
    out.append(range(start, start + size))
    start += size
  return out
