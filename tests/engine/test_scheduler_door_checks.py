"""The checks the engine makes at a request's door, through its scheduler (no JAX): a
cache_salt the prefix cache can key blocks by, and the most KV blocks a request's samples
hold at once, in the device pool under each reservation policy and in a sliding-window
model's window pool."""

from __future__ import annotations

import pytest

from jaxpage.engine.kv_groups import window_blocks_per_seq
from jaxpage.engine.scheduler import Scheduler

LIMITS = dict(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=8)


@pytest.mark.parametrize("salt", [None, "", "tenant-a"])
def test_a_string_salt_or_none_passes(salt):
    Scheduler.check_cache_salt(salt)
    Scheduler(**LIMITS).check_cache_salt(salt)


@pytest.mark.parametrize("salt", [123, b"tenant", ["a"]])
def test_any_other_salt_is_refused(salt):
    with pytest.raises(ValueError, match="cache_salt must be str or None"):
        Scheduler(**LIMITS).check_cache_salt(salt)


@pytest.mark.parametrize(("policy", "first"), [("paged", 5), ("oracle", 5), ("max", 16)])
def test_device_blocks_by_policy_and_samples(policy, first):
    """A 7-token prompt growing to 18 tokens: 5 blocks of 4 (16 under "max": max_model_len
    64); each further sample its own 4 (5 blocks less the prompt's one full block shared)."""
    scheduler = Scheduler(**LIMITS, reservation_policy=policy)
    assert scheduler.blocks_needed(7, 18) == (first, 0)
    assert scheduler.blocks_needed(7, 18, n=3) == (first + 2 * 4, 0)
    # whole prompt blocks and no output: a further sample holds nothing of its own
    assert scheduler.blocks_needed(8, 8, n=2) == scheduler.blocks_needed(8, 8)


def test_window_blocks_are_capped_by_the_window():
    window = 6
    scheduler = Scheduler(**LIMITS, window=window, num_window_blocks=32)
    per_seq = window_blocks_per_seq(window, 4, 8, 64)  # (6 - 1 + 8) / 4 -> 4, + 1
    assert per_seq == 5
    # a short request holds all its blocks; a long one at most its window's, per sample
    assert scheduler.blocks_needed(3, 9, n=2) == (3 + 3, 2 * 3)
    assert scheduler.blocks_needed(3, 60, n=2)[1] == 2 * per_seq
