"""The pure-jnp paged attention reference against hand-worked cases and naive float64 NumPy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pallas_kernels.blockwise import _tiers, paged_attention_blockwise, write_kv
from pallas_kernels.reference import paged_attention_reference


def head_major(pool):
    """[num_blocks, block_size, K, D] (how these tests fill pools) -> the pool layout
    [K, num_blocks, block_size, D]."""
    return np.ascontiguousarray(np.transpose(pool, (2, 0, 1, 3)))


def naive_attention(q, k, v, scale):
    """Dense causal attention of the last len(q) positions over k/v, float64.

    q: [Q, H, D]; k, v: [L, K, D] contiguous; returns [Q, H, D].
    """
    num_q, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = np.zeros(q.shape, np.float64)
    first = k.shape[0] - num_q
    for i in range(num_q):
        for h in range(num_heads):
            keys, values = k[: first + i + 1, h // group], v[: first + i + 1, h // group]
            scores = keys @ q[i, h] * scale
            weights = np.exp(scores - scores.max())
            out[i, h] = (weights / weights.sum()) @ values
    return out


def test_hand_worked_one_head():
    """One head, head_dim 2, block size 2: a query equal to one key, values chosen by hand."""
    q = np.array([[[1.0, 0.0]]], np.float32)  # [T=1, H=1, D=2]
    k_pool = np.full((3, 2, 1, 2), np.nan, np.float32)
    v_pool = np.full((3, 2, 1, 2), np.nan, np.float32)
    # sequence of 3 tokens in blocks [2, 1]: keys (0,0), (2,0), (0,0) ; values 1, 2, 3
    k_pool[2, 0, 0], k_pool[2, 1, 0], k_pool[1, 0, 0] = [0, 0], [2, 0], [0, 0]
    v_pool[2, 0, 0], v_pool[2, 1, 0], v_pool[1, 0, 0] = [1, 0], [2, 0], [3, 0]
    out = paged_attention_reference(
        q, head_major(k_pool), head_major(v_pool), np.array([[2, 1]], np.int32),
        np.array([3], np.int32), np.array([0, 1], np.int32), max_query_len=1, scale=1.0,
    )
    # scores (0, 2, 0) -> weights (1, e^2, 1) / (2 + e^2)
    e2 = math.exp(2)
    expected = (1 + 2 * e2 + 3) / (2 + e2)
    np.testing.assert_allclose(np.asarray(out)[0, 0], [expected, 0.0], rtol=1e-6)


def test_hand_worked_causal_chunk():
    """Two queries of one sequence in one chunk: the first must not see the second's key."""
    q = np.zeros((2, 1, 1), np.float32)  # zero queries -> uniform weights over visible keys
    k_pool = np.zeros((2, 4, 1, 1), np.float32)
    v_pool = np.full((2, 4, 1, 1), np.nan, np.float32)
    v_pool[1, :3, 0, 0] = [10.0, 20.0, 60.0]
    out = paged_attention_reference(
        q, head_major(k_pool), head_major(v_pool), np.array([[1]], np.int32),
        np.array([3], np.int32), np.array([0, 2], np.int32), max_query_len=2,
    )
    # query 0 sits at position 1: mean(10, 20); query 1 at position 2: mean(10, 20, 60)
    np.testing.assert_allclose(np.asarray(out)[:, 0, 0], [15.0, 30.0], rtol=1e-6)


@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
def test_blockwise_chunking_does_not_change_results(blocks_per_chunk):
    """Chunk sizes that do not divide the table width give the dense reference's result."""
    rng = np.random.default_rng(5)
    k_pool = rng.standard_normal((2, 12, 4, 8)).astype(np.float32)
    v_pool = rng.standard_normal((2, 12, 4, 8)).astype(np.float32)
    tables = rng.permutation(np.arange(1, 12))[:10].reshape(2, 5).astype(np.int32)
    seq_lens = np.array([19, 7], np.int32)
    q = rng.standard_normal((9, 4, 8)).astype(np.float32)
    qsl = np.array([0, 6, 9], np.int32)  # a 6-token chunk and a 3-token chunk
    dense = paged_attention_reference(q, k_pool, v_pool, tables, seq_lens, qsl, max_query_len=6)
    blockwise = paged_attention_blockwise(q, k_pool, v_pool, tables, seq_lens, qsl,
                                          max_query_len=6, blocks_per_chunk=blocks_per_chunk)
    np.testing.assert_allclose(np.asarray(blockwise), np.asarray(dense), atol=1e-5)


@pytest.mark.parametrize("query_tile", [1, 2, 4, 8])
def test_blockwise_query_tiles_do_not_change_results(query_tile):
    """Prefill queries cut into tiles (some partial, a zero-query sequence in the middle,
    padding tiles at the end) give the dense reference's result."""
    rng = np.random.default_rng(6)
    k_pool = rng.standard_normal((2, 20, 4, 8)).astype(np.float32)
    v_pool = rng.standard_normal((2, 20, 4, 8)).astype(np.float32)
    tables = rng.permutation(np.arange(1, 20))[:16].reshape(4, 4).astype(np.int32)
    seq_lens = np.array([13, 5, 9, 0], np.int32)
    qsl = np.array([0, 7, 7, 10, 10], np.int32)  # 7 new tokens, none, 3 new, padding seq
    q = rng.standard_normal((12, 4, 8)).astype(np.float32)
    dense = paged_attention_reference(q, k_pool, v_pool, tables, seq_lens, qsl, max_query_len=7)
    tiled = paged_attention_blockwise(q, k_pool, v_pool, tables, seq_lens, qsl, max_query_len=7,
                                      blocks_per_chunk=2, query_tile=query_tile)
    np.testing.assert_allclose(np.asarray(tiled), np.asarray(dense), atol=1e-5)
    assert not np.asarray(tiled)[10:].any(), "padding rows must be zero"


def test_blockwise_decode_with_a_queryless_sequence_between():
    """Decode contract: sequence s's query sits at query_start_loc[s], whatever came before."""
    rng = np.random.default_rng(7)
    k_pool = rng.standard_normal((1, 6, 4, 8)).astype(np.float32)
    v_pool = rng.standard_normal((1, 6, 4, 8)).astype(np.float32)
    tables = np.array([[1, 2], [3, 0], [4, 5]], np.int32)
    seq_lens = np.array([6, 2, 7], np.int32)
    qsl = np.array([0, 1, 1, 2], np.int32)  # the middle sequence has no query this step
    q = rng.standard_normal((3, 2, 8)).astype(np.float32)
    dense = paged_attention_reference(q, k_pool, v_pool, tables, seq_lens, qsl, max_query_len=1)
    blockwise = paged_attention_blockwise(q, k_pool, v_pool, tables, seq_lens, qsl,
                                          max_query_len=1)
    np.testing.assert_allclose(np.asarray(blockwise), np.asarray(dense), atol=1e-5)
    assert not np.asarray(blockwise)[2].any()


def random_batch(rng, *, num_heads, num_kv_heads, head_dim, block_size, max_cached=40,
                 max_new=20, num_seqs=None):
    """A ragged batch over a permuted pool whose unowned slots are NaN, plus each sequence's
    contiguous K/V for the naive oracle."""
    num_seqs = num_seqs or int(rng.integers(1, 6))
    cached = rng.integers(0, max_cached, num_seqs)
    new = np.where(rng.random(num_seqs) < 0.5, 1, rng.integers(1, max_new, num_seqs))
    seq_lens = cached + new
    blocks_needed = -(-seq_lens // block_size)
    num_blocks = int(blocks_needed.sum()) + 3
    physical = rng.permutation(np.arange(1, num_blocks))
    k_pool = np.full((num_blocks, block_size, num_kv_heads, head_dim), np.nan, np.float32)
    v_pool = np.full_like(k_pool, np.nan)
    tables = np.zeros((num_seqs, int(blocks_needed.max()) + 2), np.int32)
    keys, values, used = [], [], 0
    for s in range(num_seqs):
        n = int(blocks_needed[s])
        tables[s, :n] = physical[used : used + n]
        used += n
        k = rng.standard_normal((seq_lens[s], num_kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((seq_lens[s], num_kv_heads, head_dim)).astype(np.float32)
        keys.append(k)
        values.append(v)
        for pos in range(seq_lens[s]):
            block, offset = tables[s, pos // block_size], pos % block_size
            k_pool[block, offset], v_pool[block, offset] = k[pos], v[pos]
    num_tokens = int(new.sum()) + int(rng.integers(0, 5))  # trailing padding tokens
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
    qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    args = (q, head_major(k_pool), head_major(v_pool), tables, seq_lens.astype(np.int32), qsl)
    return args, keys, values


def assert_matches_naive(out, args, keys, values, scale):
    q, qsl = args[0], args[5]
    assert np.isfinite(out).all(), "an unowned (NaN) slot leaked into the output"
    for s in range(len(keys)):
        rows = slice(qsl[s], qsl[s + 1])
        expected = naive_attention(q[rows].astype(np.float64), keys[s].astype(np.float64),
                                   values[s].astype(np.float64), scale)
        np.testing.assert_allclose(out[rows], expected, atol=2e-5, rtol=0, err_msg=f"seq {s}")
    assert not out[qsl[-1]:].any(), "padding rows must be zero"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(4, 4, 4), (6, 2, 16), (9, 3, 1),
                                                                (8, 1, 8)])
def test_random_ragged_batches_match_naive(seed, num_heads, num_kv_heads, block_size):
    rng = np.random.default_rng(seed)
    args, keys, values = random_batch(rng, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                      head_dim=8, block_size=block_size)
    max_query_len = int(np.diff(args[5]).max())
    for attend in (paged_attention_reference, paged_attention_blockwise):
        out = np.asarray(attend(*args, max_query_len=max_query_len))
        assert_matches_naive(out, args, keys, values, 8**-0.5)


def test_write_kv_scatters_through_slot_mapping():
    k_pool = np.zeros((2, 3, 2, 1), np.float32)  # 2 KV heads, 3 blocks of 2, head_dim 1
    k = np.array([[[5.0], [6.0]], [[7.0], [8.0]]], np.float32)  # [T=2, K=2, D=1]
    new_k, new_v = write_kv(k_pool, k_pool, k, -k, np.array([5, 2], np.int32))
    new_k = np.asarray(new_k)
    # slot 5 = block 2 offset 1; slot 2 = block 1 offset 0
    assert new_k[0, 2, 1, 0] == 5.0 and new_k[1, 2, 1, 0] == 6.0
    assert new_k[0, 1, 0, 0] == 7.0 and new_k[1, 1, 0, 0] == 8.0
    assert np.asarray(new_v)[1, 1, 0, 0] == -8.0
    assert np.count_nonzero(new_k) == 4


def test_tiers_hand_worked():
    """Rows sorted longest first are served in tiers: halving from the end while the rest is
    even and over `smallest`, at most 4 tiers."""
    assert _tiers(64, smallest=8) == [(0, 8), (8, 16), (16, 32), (32, 64)]
    assert _tiers(48, smallest=8) == [(0, 6), (6, 12), (12, 24), (24, 48)]
    assert _tiers(12, smallest=8) == [(0, 6), (6, 12)]
    assert _tiers(8, smallest=8) == [(0, 8)]
    assert _tiers(8, smallest=1) == [(0, 1), (1, 2), (2, 4), (4, 8)]
    assert _tiers(10, smallest=1) == [(0, 5), (5, 10)]  # 5 is odd: stop
    assert _tiers(1, smallest=1) == [(0, 1)]
