"""Shape buckets (hand-worked lists)."""

from __future__ import annotations

import numpy as np
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


def test_build_metadata_by_hand():
    # two sequences in blocks of 4: one decoding its 7th token (6 computed), one prefilling 3
    # tokens after 2 computed; padded to 8 tokens and 3 sequences, tables 4 wide; the window
    # group's tables beside them (a null block 0 before the first's window)
    from jaxpage.attention import build_metadata

    positions, md = build_metadata([[7, 3], [5, 6]], [6, 2], [1, 3], 4, max_blocks_per_seq=4,
                                   num_tokens=8, num_seqs=3,
                                   window_block_tables=[[0, 9], [8, 2]])
    np.testing.assert_array_equal(positions, [6, 2, 3, 4, 0, 0, 0, 0])
    np.testing.assert_array_equal(md.seq_lens, [7, 5, 0])
    np.testing.assert_array_equal(md.query_start_loc, [0, 1, 4, 4])
    np.testing.assert_array_equal(md.block_tables, [[7, 3, 0, 0], [5, 6, 0, 0], [0, 0, 0, 0]])
    # position p of a sequence: its table's block p // 4, offset p % 4; padding: block 0
    np.testing.assert_array_equal(md.slot_mapping, [3 * 4 + 2, 5 * 4 + 2, 5 * 4 + 3, 6 * 4 + 0,
                                                    0, 0, 0, 0])
    np.testing.assert_array_equal(md.window_slot_mapping, [9 * 4 + 2, 8 * 4 + 2, 8 * 4 + 3,
                                                           2 * 4 + 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(md.logits_indices, [0, 3])
    assert md.num_logits == 2 and md.max_query_len == 3
    with pytest.raises(ValueError, match="sequence 1: 9 tokens exceed its 2 blocks of 4"):
        build_metadata([[1, 2], [3, 4]], [0, 6], [1, 3], 4)
    with pytest.raises(ValueError, match="bucket"):
        build_metadata([[1, 2]], [0], [5], 4, num_tokens=4)
