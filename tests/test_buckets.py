"""Shape buckets (hand-worked lists)."""

from __future__ import annotations

import pytest

from jaxpage.buckets import bucket_for, power_of_two_buckets


@pytest.mark.parametrize("low, high, midpoints, expected", [
    (16, 512, False, [16, 32, 64, 128, 256, 512]),
    (16, 500, False, [16, 32, 64, 128, 256, 500]),
    (8, 64, True, [8, 12, 16, 24, 32, 48, 64]),
    (8, 50, True, [8, 12, 16, 24, 32, 48, 50]),
    (8, 12, True, [8, 12]),
    (4, 6, True, [4, 6]),  # no midpoints below 8
    (4, 32, True, [4, 8, 12, 16, 24, 32]),
])
def test_bucket_lists(low, high, midpoints, expected):
    assert power_of_two_buckets(low, high, midpoints=midpoints) == expected


def test_bucket_for_picks_the_smallest_that_fits():
    buckets = [8, 12, 16, 24]
    assert [bucket_for(n, buckets) for n in (1, 8, 9, 12, 13, 24)] == [8, 8, 12, 12, 16, 24]
    with pytest.raises(ValueError, match="25 exceeds the largest bucket 24"):
        bucket_for(25, buckets)
