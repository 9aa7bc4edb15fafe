"""Shape buckets: every padded dimension of a step takes one of a few sizes (no JAX), so
XLA compiles a bounded number of shapes over any trace."""

from __future__ import annotations


def power_of_two_buckets(low: int, high: int, *, midpoints: bool = False) -> list[int]:
    """Powers of two from `low` up to the first one >= `high`, capped at `high`; with
    `midpoints`, also 1.5x each of them from 8 on (8, 12, 16, 24, 32, 48, ...)."""
    buckets, size = [], low
    while size < high:
        buckets.append(size)
        if midpoints and size >= 8 and size * 3 // 2 < high:
            buckets.append(size * 3 // 2)
        size *= 2
    buckets.append(high)
    return buckets


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket that holds `n`."""
    for size in buckets:
        if n <= size:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
