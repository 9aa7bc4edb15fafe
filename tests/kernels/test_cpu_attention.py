"""The C++ CPU attention kernel (`pallas_kernels/cpu_attention.cc`, the "cpp" backend) against
naive float64 NumPy, hand-worked cases and the dense jnp reference.

Both code paths of the kernel are covered: the (head_dim, block_size) pairs compiled for their
sizes (64 or 128 by 16 or 32) and the run-time sized one (any other pair), each with few query
rows per item (decode, dot products off the K tile) and many (prefill tiles, transposed K).
Every pool slot no sequence owns holds NaN.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from test_reference import assert_matches_naive, random_batch

from pallas_kernels import cpu_attention
from pallas_kernels.cpu_attention import paged_attention_cpu
from pallas_kernels.reference import paged_attention_reference

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason="the C++ kernel could not be built here")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),   # SmolLM2's shape, compiled sizes
    (8, 2, 128, 32),  # compiled sizes
    (4, 4, 8, 4),     # run-time sizes, no GQA
    (6, 2, 16, 16),   # run-time head_dim
    (9, 3, 8, 1),     # one-token blocks
    (8, 1, 32, 8),    # eight query heads per KV head: decode items of 8 rows (transposed K)
])
def test_random_ragged_batches_match_naive(seed, num_heads, num_kv_heads, head_dim, block_size):
    rng = np.random.default_rng(seed)
    args, keys, values = random_batch(rng, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                      head_dim=head_dim, block_size=block_size)
    out = np.asarray(paged_attention_cpu(*args))
    assert_matches_naive(out, args, keys, values, head_dim**-0.5)


@pytest.mark.parametrize("query_tile", [1, 3, 32])
def test_query_tiles_do_not_change_results(query_tile):
    """Long chunks cut into work items of 1, 3 or 32 tokens (3 leaves partial tiles)."""
    rng = np.random.default_rng(11)
    args, keys, values = random_batch(rng, num_heads=9, num_kv_heads=3, head_dim=64,
                                      block_size=16, max_cached=80, max_new=70, num_seqs=5)
    out = np.asarray(paged_attention_cpu(*args, query_tile=query_tile))
    assert_matches_naive(out, args, keys, values, 64**-0.5)


def test_hand_worked_one_head():
    """One head, head_dim 2, block size 2: a query equal to one key, values chosen by hand;
    the unused slot of the last block is NaN."""
    q = np.array([[[1.0, 0.0]]], np.float32)
    k_pool = np.full((1, 3, 2, 2), np.nan, np.float32)  # [K, NB, B, D]
    v_pool = np.full((1, 3, 2, 2), np.nan, np.float32)
    # sequence of 3 tokens in blocks [2, 1]: keys (0,0), (2,0), (0,0); values 1, 2, 3
    k_pool[0, 2, 0], k_pool[0, 2, 1], k_pool[0, 1, 0] = [0, 0], [2, 0], [0, 0]
    v_pool[0, 2, 0], v_pool[0, 2, 1], v_pool[0, 1, 0] = [1, 0], [2, 0], [3, 0]
    out = paged_attention_cpu(q, k_pool, v_pool, np.array([[2, 1]], np.int32),
                              np.array([3], np.int32), np.array([0, 1], np.int32), scale=1.0)
    e2 = math.exp(2)  # scores (0, 2, 0) -> weights (1, e^2, 1) / (2 + e^2)
    np.testing.assert_allclose(np.asarray(out)[0, 0], [(1 + 2 * e2 + 3) / (2 + e2), 0.0],
                               rtol=1e-6)


def test_hand_worked_causal_chunk():
    """Two queries of one chunk: zero queries weigh the keys each one sees uniformly, and
    the first must not see the second's key."""
    q = np.zeros((2, 1, 1), np.float32)
    k_pool = np.zeros((1, 2, 4, 1), np.float32)
    v_pool = np.full((1, 2, 4, 1), np.nan, np.float32)
    v_pool[0, 1, :3, 0] = [10.0, 20.0, 60.0]
    out = paged_attention_cpu(q, k_pool, v_pool, np.array([[1]], np.int32),
                              np.array([3], np.int32), np.array([0, 2], np.int32))
    np.testing.assert_allclose(np.asarray(out)[:, 0, 0], [15.0, 30.0], rtol=1e-6)


def test_queryless_and_padding_sequences_match_reference():
    """A sequence without queries between two with queries, then padding sequences."""
    rng = np.random.default_rng(7)
    k_pool = rng.standard_normal((1, 6, 16, 64)).astype(np.float32)
    v_pool = rng.standard_normal((1, 6, 16, 64)).astype(np.float32)
    tables = np.array([[1, 2], [3, 0], [4, 5], [0, 0]], np.int32)
    seq_lens = np.array([20, 2, 31, 0], np.int32)
    qsl = np.array([0, 1, 1, 9, 9], np.int32)  # decode, none, an 8-token chunk, padding
    q = rng.standard_normal((12, 3, 64)).astype(np.float32)
    dense = paged_attention_reference(q, k_pool, v_pool, tables, seq_lens, qsl, max_query_len=8)
    out = np.asarray(paged_attention_cpu(q, k_pool, v_pool, tables, seq_lens, qsl))
    np.testing.assert_allclose(out, np.asarray(dense), atol=1e-5)
    assert not out[9:].any()


def test_under_jit_equals_eager():
    """Inside jit, as the model calls it once per layer, results equal eager calls."""
    rng = np.random.default_rng(3)
    args, _, _ = random_batch(rng, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                              num_seqs=4)
    jitted = jax.jit(lambda *a: paged_attention_cpu(*a) * 2.0)(*args)
    np.testing.assert_allclose(np.asarray(jitted), 2.0 * np.asarray(paged_attention_cpu(*args)),
                               rtol=1e-6)


@pytest.mark.parametrize("bad_block", [-1, 6])
def test_block_table_entry_outside_the_pool_is_an_error(bad_block):
    """A block id outside [0, num_blocks) raises instead of reading foreign memory."""
    k_pool = np.zeros((1, 6, 4, 8), np.float32)
    tables = np.array([[1, bad_block]], np.int32)
    with pytest.raises(Exception, match="block table entry outside the pool"):
        jax.block_until_ready(paged_attention_cpu(
            np.ones((1, 1, 8), np.float32), k_pool, k_pool, tables, np.array([7], np.int32),
            np.array([0, 1], np.int32)))


def test_inconsistent_lengths_are_an_error():
    """seq_lens longer than the block table can hold raises, naming the sequence."""
    k_pool = np.zeros((1, 6, 4, 8), np.float32)
    with pytest.raises(Exception, match="sequence 0"):
        jax.block_until_ready(paged_attention_cpu(
            np.ones((1, 1, 8), np.float32), k_pool, k_pool, np.array([[1, 2]], np.int32),
            np.array([9], np.int32), np.array([0, 1], np.int32)))


def test_unsupported_pools_are_named():
    assert cpu_attention.unsupported_reason(64, 16, np.float32) is None
    assert "bfloat16" in cpu_attention.unsupported_reason(64, 16, jax.numpy.bfloat16)
    assert "512" in cpu_attention.unsupported_reason(512, 16, np.float32)
