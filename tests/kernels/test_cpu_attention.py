"""The C++ CPU attention kernel (`pallas_kernels/cpu/attention.h`, the "cpp" backend) against
naive float64 NumPy, hand-worked cases and the dense jnp reference.

Both code paths of the kernel are covered: the (head_dim, block_size) pairs compiled for their
sizes (64 or 128 by 16 or 32) and the run-time sized one (any other pair), each with few query
rows per item (decode, dot products off the K tile) and many (prefill tiles, transposed K).
Every pool slot no sequence owns holds NaN (or +-inf, where that is what a test is about).
Malformed calls (output shape, query ranges, lengths, block ids) must be errors. The last test
runs scripts/check_cpu_kernel_sanitizers.py: the kernel built with ASan and UBSan.

bfloat16 pools are tested on both of their paths, "dot" (AVX512-BF16, where this machine's build
has it; else those tests skip) and "portable" (forced per call with `bf16_dot=False`), against
float64 attention of the bfloat16 inputs upcast (dequantize, then the oracle).
"""

from __future__ import annotations

import ctypes
import functools
import math
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_quantized_kv import assert_exact_and_near_oracle, one_format_each, quantized_batch
from test_reference import assert_matches_naive, random_batch

from pallas_kernels import cpu_library, cpu_ops, quantized
from pallas_kernels.cpu_ops import paged_attention_cpu
from pallas_kernels.reference import paged_attention_reference

pytestmark = pytest.mark.skipif(not cpu_ops.available(),
                                reason="the C++ kernel could not be built here")


def fill_unowned(pool, tables, seq_lens, value):
    """Set every slot of a head-major pool [K, NB, B, D] that no sequence owns to `value`."""
    block_size = pool.shape[2]
    owned = np.zeros(pool.shape[1:3], bool)
    for table, length in zip(tables, seq_lens, strict=True):
        pos = np.arange(length)
        owned[table[pos // block_size], pos % block_size] = True
    pool[:, ~owned] = value


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


@pytest.mark.parametrize("query_tile", [1, 3, 32, 2**40])
def test_query_tiles_do_not_change_results(query_tile):
    """Long chunks cut into work items of 1, 3 or 32 tokens (3 leaves partial tiles), or of
    whole chunks (a tile past int32's range must neither wrap nor loop forever)."""
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


@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf])
def test_non_finite_unowned_slots_give_exact_results(fill):
    """Unowned slots holding NaN, +inf or -inf change nothing: masked key slots get scores
    NaN (0 * inf), +inf or -inf, which the softmax's exp must take without undefined
    behaviour and weigh 0. One decode query (dot products off the K tile) and a 9-token chunk
    (transposed K tiles), hand-worked."""
    # the one-head case: keys (0,0), (2,0), (0,0) in blocks [2, 1]; q . (fill, fill) = +-inf
    q = np.array([[[1.0, 0.5]]], np.float32)
    k_pool = np.full((1, 3, 2, 2), fill, np.float32)
    v_pool = np.full((1, 3, 2, 2), fill, np.float32)
    k_pool[0, 2, 0], k_pool[0, 2, 1], k_pool[0, 1, 0] = [0, 0], [2, 0], [0, 0]
    v_pool[0, 2, 0], v_pool[0, 2, 1], v_pool[0, 1, 0] = [1, 0], [2, 0], [3, 0]
    out = paged_attention_cpu(q, k_pool, v_pool, np.array([[2, 1]], np.int32),
                              np.array([3], np.int32), np.array([0, 1], np.int32), scale=1.0)
    e2 = math.exp(2)
    np.testing.assert_allclose(np.asarray(out)[0, 0], [(1 + 2 * e2 + 3) / (2 + e2), 0.0],
                               rtol=1e-6)

    # a chunk of 9 zero queries at positions 1..9 over keys 0..9 (values 1..10) in blocks
    # [3, 1, 2] of 4: query i weighs keys 0..i+1 uniformly, mean (i + 3) / 2; block 0, block 4
    # and the last two slots of block 2 are unowned
    q = np.zeros((9, 1, 1), np.float32)
    k_pool = np.full((1, 5, 4, 1), fill, np.float32)
    v_pool = np.full((1, 5, 4, 1), fill, np.float32)
    tables = np.array([[3, 1, 2]], np.int32)
    for pos in range(10):
        k_pool[0, tables[0, pos // 4], pos % 4, 0] = 0.0
        v_pool[0, tables[0, pos // 4], pos % 4, 0] = pos + 1.0
    out = paged_attention_cpu(q, k_pool, v_pool, tables, np.array([10], np.int32),
                              np.array([0, 9], np.int32))
    np.testing.assert_allclose(np.asarray(out)[:, 0, 0], (np.arange(9) + 3) / 2, rtol=1e-6)


@pytest.mark.parametrize("fill", [np.inf, -np.inf])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),  # compiled sizes
    (4, 4, 8, 4),    # run-time sizes
    (8, 1, 32, 8),   # run-time sizes, decode items of 8 rows (transposed K)
])
def test_infinite_unowned_slots_match_naive(fill, num_heads, num_kv_heads, head_dim,
                                            block_size):
    """Random ragged batches whose unowned slots hold +inf or -inf instead of NaN."""
    rng = np.random.default_rng(5)
    args, keys, values = random_batch(rng, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                      head_dim=head_dim, block_size=block_size, num_seqs=4)
    k_pool, v_pool = (np.where(np.isnan(pool), np.float32(fill), pool) for pool in args[1:3])
    assert np.isinf(k_pool).any()
    args = (args[0], k_pool, v_pool, *args[3:])
    out = np.asarray(paged_attention_cpu(*args))
    assert_matches_naive(out, args, keys, values, head_dim**-0.5)


def test_queryless_and_padding_sequences_match_reference():
    """A sequence without queries between two with queries, then padding sequences."""
    rng = np.random.default_rng(7)
    k_pool = rng.standard_normal((1, 6, 16, 64)).astype(np.float32)
    v_pool = rng.standard_normal((1, 6, 16, 64)).astype(np.float32)
    tables = np.array([[1, 2], [3, 0], [4, 5], [0, 0]], np.int32)
    seq_lens = np.array([20, 2, 31, 0], np.int32)
    qsl = np.array([0, 1, 1, 9, 9], np.int32)  # decode, none, an 8-token chunk, padding
    q = rng.standard_normal((12, 3, 64)).astype(np.float32)
    fill_unowned(k_pool, tables, seq_lens, np.nan)  # block 0 and the tails of blocks 2, 3, 5
    fill_unowned(v_pool, tables, seq_lens, np.nan)
    dense = paged_attention_reference(q, k_pool, v_pool, tables, seq_lens, qsl, max_query_len=8)
    out = np.asarray(paged_attention_cpu(q, k_pool, v_pool, tables, seq_lens, qsl))
    np.testing.assert_allclose(out, np.asarray(dense), atol=1e-5)
    assert not out[9:].any()
    assert np.isfinite(out).all(), "an unowned (NaN) slot leaked into the output"


def test_under_jit_equals_eager():
    """Inside jit, as the model calls it once per layer, results equal eager calls and naive
    float64 attention."""
    rng = np.random.default_rng(3)
    args, keys, values = random_batch(rng, num_heads=9, num_kv_heads=3, head_dim=64,
                                      block_size=16, num_seqs=4)
    jitted = jax.jit(lambda *a: paged_attention_cpu(*a) * 2.0)(*args)
    np.testing.assert_allclose(np.asarray(jitted), 2.0 * np.asarray(paged_attention_cpu(*args)),
                               rtol=1e-6)
    # and right, not only self-consistent: halving is exact
    assert_matches_naive(np.asarray(jitted) / 2.0, args, keys, values, 64**-0.5)


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


def _call_target(args, out_shape):
    """The FFI target called as `paged_attention_cpu` calls it (scale 1, no window or
    soft-cap), any result shape."""
    call = jax.ffi.ffi_call(cpu_library.TARGET, jax.ShapeDtypeStruct(out_shape, jnp.float32))
    return jax.block_until_ready(call(*args, scale=np.float32(1.0),
                                      query_tile=np.int64(cpu_ops.QUERY_TILE),
                                      sliding_window=np.int64(0), soft_cap=np.float32(0.0),
                                      key_splits=np.int64(0)))


@pytest.mark.parametrize("out_shape", [(1, 2, 8), (2, 2, 8), (64, 2, 8), (2, 4, 8), (4, 2, 1, 8)])
def test_output_shape_other_than_qs_is_an_error(out_shape):
    """The wrapper always asks for q's shape; a call asking for another (smaller: the kernel
    would write past its end; same size, other shape; another rank) is an error naming both
    shapes, not a write out of bounds."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((4, 2, 8)).astype(np.float32)
    k_pool = rng.standard_normal((1, 6, 4, 8)).astype(np.float32)
    args = (q, k_pool, k_pool, np.array([[1, 2], [3, 4]], np.int32), np.array([5, 6], np.int32),
            np.array([0, 2, 4], np.int32))
    shape_text = "[" + ", ".join(map(str, out_shape)) + "]"
    with pytest.raises(Exception,
                       match=re.escape(f"output shape {shape_text} is not q's shape [4, 2, 8]")):
        _call_target(args, out_shape)
    np.testing.assert_array_equal(np.asarray(_call_target(args, q.shape)),
                                  np.asarray(paged_attention_cpu(*args, scale=1.0)))


def _attend_tiny(qsl, seq_lens=(5, 6, 3)):
    """Three sequences over a zero pool of 6 blocks of 4; q has 6 tokens."""
    k_pool = np.zeros((1, 6, 4, 8), np.float32)
    return jax.block_until_ready(paged_attention_cpu(
        np.ones((6, 2, 8), np.float32), k_pool, k_pool,
        np.array([[1, 2], [3, 4], [5, 0]], np.int32), np.array(seq_lens, np.int32),
        np.array(qsl, np.int32)))


def test_overlapping_query_ranges_are_an_error():
    """query_start_loc [0, 3, 1, 4]: sequence 2's tokens [1, 4) overlap sequence 0's [0, 3)
    (and sequence 1's count is negative); both would write tokens 1 and 2."""
    with pytest.raises(Exception, match=r"query_start_loc decreases at sequence 1: "
                                        r"query_start_loc\[1\] = 3 > query_start_loc\[2\] = 1"):
        _attend_tiny([0, 3, 1, 4])


@pytest.mark.parametrize("qsl,message", [
    ([2, 1, 3, 4], r"query_start_loc decreases at sequence 0: query_start_loc\[0\] = 2 > "
                   r"query_start_loc\[1\] = 1"),
    ([0, 2, 4, 3], r"query_start_loc decreases at sequence 2"),
    ([0, 1, 2, 0], r"query_start_loc decreases at sequence 2"),
])
def test_decreasing_query_start_loc_is_an_error(qsl, message):
    with pytest.raises(Exception, match=message):
        _attend_tiny(qsl)


@pytest.mark.parametrize("qsl,seq_lens,message", [
    ([-1, 1, 2, 3], (5, 6, 3), r"query_start_loc\[0\] = -1 is negative"),
    ([0, 1, 2, 7], (5, 6, 3), r"query_start_loc\[3\] = 7 exceeds the 6 query tokens"),
    ([0, 1, 5, 6], (5, 3, 3), r"sequence 1 has 4 queries but seq_len 3"),
    ([0, 0, 0, 0], (5, -1, 3), r"sequence 1 has 0 queries but seq_len -1"),
])
def test_query_ranges_outside_the_batch_or_the_sequence_are_an_error(qsl, seq_lens, message):
    """query_start_loc must lie in [0, num_tokens] and a sequence have at most seq_len
    queries (the new tokens are its last ones)."""
    with pytest.raises(Exception, match=message):
        _attend_tiny(qsl, seq_lens)


def test_valid_tiny_batch_runs():
    """The batch the error tests above spoil is valid as it stands (a queryless sequence and
    padding tokens included)."""
    out = np.asarray(_attend_tiny([0, 1, 4, 4], (5, 6, 3)))
    np.testing.assert_allclose(out[:4], 0.0)  # zero keys and values
    assert np.isfinite(out).all()


def test_unsupported_pools_are_named():
    assert cpu_ops.unsupported_reason(64, 16, np.float32) is None
    assert cpu_ops.unsupported_reason(64, 16, jnp.bfloat16) is None
    for fmt in quantized.FORMATS:  # a QuantizedPool's dtype is its storage dtype
        assert cpu_ops.unsupported_reason(64, 16, jnp.dtype(fmt)) is None
        assert cpu_ops.unsupported_reason(8, 1, jnp.dtype(fmt)) is None
    assert "float8_e4m3fnuz" in cpu_ops.unsupported_reason(64, 16, jnp.float8_e4m3fnuz)
    assert "uint8" in cpu_ops.unsupported_reason(64, 16, np.uint8)
    assert "float16" in cpu_ops.unsupported_reason(64, 16, jnp.float16)
    assert "512" in cpu_ops.unsupported_reason(512, 16, np.float32)


# ----------------------------------------------------------------------------- bfloat16 pools

BF16_EPS = 2.0**-8  # bfloat16's unit roundoff: 8 significand bits, round to nearest even
BF16_MODES = [pytest.param(True, id="dot"), pytest.param(False, id="portable")]


def _skip_unless_mode_built(bf16_dot):
    if bf16_dot and not cpu_ops.bf16_dot_compiled():
        pytest.skip("this build has no AVX512-BF16 path (the CPU or compiler lacks it)")


def to_bf16(x):
    """x rounded to bfloat16 (nearest even), as a float32 array (NaN stays NaN)."""
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


def bf16_batch(rng, **shape):
    """`random_batch` with q, K and V rounded to bfloat16 (NaN in every unowned pool slot): the
    kernel's arguments as bfloat16 arrays, plus float32 copies of the same values for the
    oracle."""
    args, keys, values = random_batch(rng, **shape)
    q, k_pool, v_pool = (to_bf16(a) for a in args[:3])
    keys, values = [to_bf16(k) for k in keys], [to_bf16(v) for v in values]
    bf16_args = (*(jnp.asarray(a, jnp.bfloat16) for a in (q, k_pool, v_pool)), *args[3:])
    return bf16_args, (q, k_pool, v_pool, *args[3:]), keys, values


def assert_bf16_matches_naive(out, args, keys, values, scale, bf16_dot):
    """`out` (bfloat16) against float64 attention of the (already bfloat16) inputs.

    What the kernel rounds, beyond its inputs: the output, to bfloat16 (|error| <= eps |out|);
    on the dot path also each probability p_t before P.V (the denominator sums them unrounded),
    which moves out[d] = sum_t p_t v_t[d] / sum_t p_t by at most eps sum_t w_t |v_t[d]| (w the
    softmax weights). q.K is exact products summed in float32 on both paths, as in the float32
    kernel, whose 2e-5 against float64 covers that. So per element:
    |out - expected| <= eps (|expected| + [dot] sum_t w_t |v_t[d]|) (1 + eps) + 2e-5.
    """
    q, qsl = args[0], args[5]
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    assert np.isfinite(out).all(), "an unowned (NaN) slot leaked into the output"
    group = q.shape[1] // keys[0].shape[1]
    for s, (k, v) in enumerate(zip(keys, values, strict=True)):
        k, v = k.astype(np.float64), v.astype(np.float64)
        first = k.shape[0] - (qsl[s + 1] - qsl[s])
        for i, tok in enumerate(range(qsl[s], qsl[s + 1])):
            for h in range(q.shape[1]):
                seen = slice(0, first + i + 1)
                scores = k[seen, h // group] @ q[tok, h].astype(np.float64) * scale
                w = np.exp(scores - scores.max())
                w /= w.sum()
                expected = w @ v[seen, h // group]
                spread = w @ np.abs(v[seen, h // group]) if bf16_dot else 0.0
                bound = BF16_EPS * (np.abs(expected) + spread) * (1 + BF16_EPS) + 2e-5
                error = np.abs(out[tok, h] - expected)
                assert (error <= bound).all(), (
                    f"seq {s} token {tok} head {h}: error {error.max()} > bound "
                    f"{bound[np.argmax(error - bound)]}")
    assert not out[qsl[-1]:].any(), "padding rows must be zero"


@pytest.mark.parametrize("bf16_dot", BF16_MODES)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),   # SmolLM2's shape: compiled sizes (the dot path where built)
    (8, 2, 128, 32),  # compiled sizes
    (4, 4, 64, 32),   # compiled sizes, no GQA
    (8, 1, 128, 16),  # compiled sizes, decode items of 8 rows (transposed K)
    (4, 4, 8, 4),     # run-time sizes: portable on both settings
    (8, 1, 32, 8),    # run-time sizes, decode items of 8 rows
])
def test_bf16_random_ragged_batches_match_naive(bf16_dot, seed, num_heads, num_kv_heads,
                                                head_dim, block_size):
    """Decode tokens and chunks starting mid-block, GQA groups, NaN in every unowned slot."""
    _skip_unless_mode_built(bf16_dot)
    rng = np.random.default_rng(seed)
    bf16_args, args, keys, values = bf16_batch(
        rng, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size)
    out = paged_attention_cpu(*bf16_args, bf16_dot=bf16_dot)
    assert out.dtype == jnp.bfloat16
    assert_bf16_matches_naive(out, args, keys, values, head_dim**-0.5, bf16_dot)


@pytest.mark.parametrize("bf16_dot", BF16_MODES)
@pytest.mark.parametrize("query_tile", [1, 3, 32])
def test_bf16_long_chunks_match_naive(bf16_dot, query_tile):
    """Chunks of up to 70 tokens over up to 80 cached ones, cut into items of 1, 3 (partial
    8-row tiles) or 32 tokens; head_dim 64 by blocks of 16 and 128 by 32."""
    _skip_unless_mode_built(bf16_dot)
    rng = np.random.default_rng(11)
    for num_heads, num_kv_heads, head_dim, block_size in [(9, 3, 64, 16), (4, 2, 128, 32)]:
        bf16_args, args, keys, values = bf16_batch(
            rng, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            block_size=block_size, max_cached=80, max_new=70, num_seqs=5)
        out = paged_attention_cpu(*bf16_args, query_tile=query_tile, bf16_dot=bf16_dot)
        assert_bf16_matches_naive(out, args, keys, values, head_dim**-0.5, bf16_dot)


@pytest.mark.parametrize("bf16_dot", BF16_MODES)
@pytest.mark.parametrize("fill", [np.inf, -np.inf])
def test_bf16_infinite_unowned_slots_match_naive(bf16_dot, fill):
    """Unowned slots holding +-inf (0 * inf is NaN: the dot path must zero the V pairs and K
    slots past a tile's valid keys, not only weigh them 0)."""
    _skip_unless_mode_built(bf16_dot)
    rng = np.random.default_rng(5)
    for num_heads, num_kv_heads, head_dim, block_size in [(9, 3, 64, 16), (8, 1, 128, 32)]:
        bf16_args, args, keys, values = bf16_batch(
            rng, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            block_size=block_size, num_seqs=4)
        k_pool, v_pool = (jnp.where(jnp.isnan(pool), jnp.bfloat16(fill), pool)
                          for pool in bf16_args[1:3])
        assert bool(jnp.isinf(k_pool).any())
        out = paged_attention_cpu(bf16_args[0], k_pool, v_pool, *bf16_args[3:],
                                  bf16_dot=bf16_dot)
        assert_bf16_matches_naive(out, args, keys, values, head_dim**-0.5, bf16_dot)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 8, 4)])
def test_bf16_portable_path_is_the_float32_kernel_rounded(num_heads, num_kv_heads, head_dim,
                                                          block_size):
    """The portable path widens each tile exactly and runs the float32 code on it: bit for bit
    the float32 kernel on the upcast inputs, rounded to bfloat16 once."""
    rng = np.random.default_rng(1)
    bf16_args, args, _, _ = bf16_batch(rng, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                       head_dim=head_dim, block_size=block_size, num_seqs=5)
    portable = paged_attention_cpu(*bf16_args, bf16_dot=False)
    float32 = paged_attention_cpu(*args).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(portable.astype(jnp.float32)),
                                  np.asarray(float32.astype(jnp.float32)))


def test_bf16_dot_path_is_taken_and_matches_the_dense_reference():
    """Where the build has AVX512-BF16, bf16_dot=True takes another path than the portable one
    (results differ in the last bits: P is rounded), both within bfloat16 rounding of the dense
    reference run on the upcast inputs; the environment variable picks the default."""
    rng = np.random.default_rng(7)
    bf16_args, args, _, _ = bf16_batch(rng, num_heads=9, num_kv_heads=3, head_dim=64,
                                       block_size=16, max_cached=60, max_new=40, num_seqs=5)
    dense = np.asarray(paged_attention_reference(*args, max_query_len=int(np.diff(args[5]).max())))
    outs = {dot: np.asarray(paged_attention_cpu(*bf16_args, bf16_dot=dot).astype(jnp.float32))
            for dot in (True, False)}
    for out in outs.values():
        # output rounding (eps |out|) plus P's rounding (eps max|v| bounds sum_t w_t |v_t|)
        np.testing.assert_array_less(
            np.abs(out - dense), BF16_EPS * (np.abs(dense) + np.nanmax(np.abs(args[2]))) + 2e-5)
    if cpu_ops.bf16_dot_compiled():
        assert not np.array_equal(outs[True], outs[False]), "bf16_dot=True ran the portable path"
    else:
        np.testing.assert_array_equal(outs[True], outs[False])


def test_bf16_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv("JAXPAGE_CPU_KERNEL_BF16", "portable")
    assert cpu_ops._default_bf16_dot() is False
    monkeypatch.setenv("JAXPAGE_CPU_KERNEL_BF16", "dot")
    assert cpu_ops._default_bf16_dot() is True
    monkeypatch.setenv("JAXPAGE_CPU_KERNEL_BF16", "avx")
    with pytest.raises(ValueError, match="portable"):
        cpu_ops._default_bf16_dot()


def test_mixed_pool_dtypes_are_refused():
    k_pool = np.zeros((1, 6, 4, 8), np.float32)
    with pytest.raises(ValueError, match="one dtype"):
        paged_attention_cpu(np.ones((1, 1, 8), np.float32), k_pool, k_pool.astype(jnp.bfloat16),
                            np.array([[1]], np.int32), np.array([1], np.int32),
                            np.array([0, 1], np.int32))


# Key splits: a single-token item's blocks cut into parts that the threads read at once, each
# part's softmax sums merged after (`key_splits`: 0 the kernel chooses, 1 never, k up to k
# parts). Decode batches over long contexts, against the float64 oracle; a cut result is not
# bit for bit the uncut one (sums in another order), which shows the cut was taken.
KEY_SPLITS = [pytest.param(0, id="kernel-chooses"), pytest.param(3, id="3-parts"),
              pytest.param(100, id="a-block-a-part")]


def decode_batch(rng, num_seqs, make=random_batch, **shape):
    """`make`'s batch (`random_batch`, `bf16_batch` or `quantized_batch` with its format bound)
    of long contexts (up to 200 cached keys) where every sequence decodes one token: the items
    a key split cuts."""
    for _ in range(100):  # a draw with a context past two blocks: nearly every one
        batch = make(rng, max_cached=200, max_new=2, num_seqs=num_seqs, **shape)
        seq_lens, qsl = (np.asarray(a) for a in batch[0][4:6])
        if (np.diff(qsl) == 1).all() and (seq_lens > 2 * shape["block_size"]).any():
            return batch
    raise AssertionError("no decode batch over more than two blocks in 100 draws")


@pytest.mark.parametrize("key_splits", KEY_SPLITS)
@pytest.mark.parametrize("num_seqs", [1, 3])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),   # SmolLM2's shape, compiled sizes
    (4, 4, 8, 4),     # run-time sizes, no GQA
    (9, 3, 8, 1),     # one-token blocks
    (8, 1, 32, 8),    # eight query heads per KV head: decode items of 8 rows (transposed K)
])
def test_key_splits_match_naive(key_splits, num_seqs, num_heads, num_kv_heads, head_dim,
                                block_size):
    rng = np.random.default_rng(num_seqs * 100 + head_dim)
    args, keys, values = decode_batch(rng, num_seqs, num_heads=num_heads,
                                      num_kv_heads=num_kv_heads, head_dim=head_dim,
                                      block_size=block_size)
    out = np.asarray(paged_attention_cpu(*args, key_splits=key_splits))
    assert_matches_naive(out, args, keys, values, head_dim**-0.5)
    if key_splits > 1:
        assert not np.array_equal(out, np.asarray(paged_attention_cpu(*args, key_splits=1)))


@pytest.mark.parametrize("bf16_dot", BF16_MODES)
@pytest.mark.parametrize("key_splits", KEY_SPLITS)
def test_bf16_key_splits_match_naive(bf16_dot, key_splits):
    """Both bfloat16 paths cut: the merged sums rounded to bfloat16 once, within the uncut
    result's bound of float64 attention; the portable path still the float32 kernel (cut the
    same way) rounded."""
    _skip_unless_mode_built(bf16_dot)
    rng = np.random.default_rng(3)
    for num_heads, num_kv_heads, head_dim, block_size in [(9, 3, 64, 16), (8, 1, 128, 16)]:
        bf16_args, args, keys, values = decode_batch(
            rng, 2, make=bf16_batch, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, block_size=block_size)
        out = paged_attention_cpu(*bf16_args, bf16_dot=bf16_dot, key_splits=key_splits)
        assert_bf16_matches_naive(out, args, keys, values, head_dim**-0.5, bf16_dot)
        if not bf16_dot:
            float32 = paged_attention_cpu(*args, key_splits=key_splits)
            np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)),
                                          to_bf16(np.asarray(float32)))


@pytest.mark.parametrize("key_splits", KEY_SPLITS)
def test_key_splits_with_sliding_window_and_soft_cap(key_splits):
    """A window of 40 keys and a soft-cap of 2, the table entries before each window naming
    block 0 (NaN: never read): the parts cut only the blocks the window sees."""
    window, soft_cap = 40, 2.0
    rng = np.random.default_rng(8)
    args, keys, values = decode_batch(rng, 2, num_heads=9, num_kv_heads=3, head_dim=64,
                                      block_size=16)
    tables, seq_lens = np.array(args[3]), args[4]
    for s, length in enumerate(seq_lens):
        tables[s, : max(0, length - window) // 16] = 0
    args[1][:, 0], args[2][:, 0] = np.nan, np.nan
    args = (*args[:3], tables, *args[4:])
    out = np.asarray(paged_attention_cpu(*args, sliding_window=window, soft_cap=soft_cap,
                                         key_splits=key_splits))
    assert np.isfinite(out).all(), "an unowned (NaN) slot leaked into the output"
    for s in range(len(keys)):
        np.testing.assert_allclose(
            out[s : s + 1], windowed_naive(args[0][s : s + 1], keys[s], values[s], 64**-0.5,
                                           window, soft_cap), atol=2e-5, rtol=0)


@pytest.mark.parametrize("fmt", list(quantized.FORMATS))
def test_quantized_key_splits_read_as_their_dequantization(fmt):
    """Cut quantized pools: bit for bit the float32 kernel, cut the same way, on the pools they
    dequantize to."""
    rng = np.random.default_rng(6)
    args_q, args_f, keys, values = decode_batch(
        rng, 2, make=functools.partial(quantized_batch, fmt=fmt), num_heads=9, num_kv_heads=3,
        head_dim=64, block_size=16)
    for key_splits in (0, 3):
        assert_exact_and_near_oracle(paged_attention_cpu(*args_q, key_splits=key_splits),
                                     paged_attention_cpu(*args_f, key_splits=key_splits),
                                     args_q, keys, values, 64**-0.5)


def test_negative_key_splits_are_refused():
    args = (np.ones((1, 1, 8), np.float32), np.zeros((1, 6, 4, 8), np.float32),
            np.zeros((1, 6, 4, 8), np.float32), np.array([[1]], np.int32),
            np.array([1], np.int32), np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="key_splits must be >= 0"):
        paged_attention_cpu(*args, key_splits=-1)
    call = jax.ffi.ffi_call(cpu_library.TARGET, jax.ShapeDtypeStruct((1, 1, 8), jnp.float32))
    with pytest.raises(Exception, match="key_splits -2 is negative"):
        jax.block_until_ready(call(*args, scale=np.float32(1.0), query_tile=np.int64(32),
                                   sliding_window=np.int64(0), soft_cap=np.float32(0.0),
                                   key_splits=np.int64(-2)))


SANITIZER_SCRIPT = (Path(__file__).resolve().parents[2] / "scripts"
                    / "check_cpu_kernel_sanitizers.py")


# slow: a sanitized build (~35-125 s) and the checks under ASan (~95-240 s) on 2 cores, more than
# the rest of this file together; .ci/run runs it with the slow tests. Alone it takes ~4 min on
# a 2-core Xeon, 6 min beside two busy processes; in CI it once ran past 1,700 s, so the script
# stops its child at 1,300 s and reports the stage it had reached and its Python stacks.
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_kernel_is_clean_under_address_and_undefined_behaviour_sanitizers():
    """scripts/check_cpu_kernel_sanitizers.py: the kernel built with ASan and UBSan runs random
    ragged batches (NaN/+inf/-inf in unowned slots; float32 pools, bfloat16 pools on both
    bfloat16 paths, and quantized pools of the three formats, whose scales are NaN/+inf/-inf in
    unowned slots) without a finding and matches float64, and rejects malformed calls. About
    60 s on a machine with more cores, 3 min on two (the sanitized build, the float64 oracle)."""
    result = subprocess.run([sys.executable, str(SANITIZER_SCRIPT), "--timeout", "1300"],
                            capture_output=True, text=True, timeout=1700)
    if result.returncode == 2:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout + result.stderr[-8000:]
    assert "clean under ASan+UBSan" in result.stdout


# ----------------------------------------------------------------------------- quantized pools

QUANTIZED_FORMATS = list(quantized.FORMATS)  # int8, float8_e4m3fn, float8_e5m2


def windowed_naive(q, keys, values, scale, window, soft_cap):
    """float64 attention of one sequence's queries (its last tokens) over keys
    (max(0, p - window + 1) .. p] of a query at position p, scores soft-capped."""
    q, keys, values = (a.astype(np.float64) for a in (q, keys, values))
    group = q.shape[1] // keys.shape[1]
    out = np.zeros(q.shape)
    first = keys.shape[0] - q.shape[0]
    for i in range(q.shape[0]):
        pos = first + i
        seen = slice(max(0, pos - window + 1), pos + 1)
        for h in range(q.shape[1]):
            scores = keys[seen, h // group] @ q[i, h] * scale
            scores = soft_cap * np.tanh(scores / soft_cap)
            w = np.exp(scores - scores.max())
            out[i, h] = w / w.sum() @ values[seen, h // group]
    return out


@pytest.mark.parametrize("seed,num_heads,num_kv_heads,head_dim,block_size,fmt", one_format_each(
    [(seed, *shape) for seed in range(2) for shape in [
        (9, 3, 64, 16),   # compiled sizes
        (8, 2, 128, 32),  # compiled sizes
        (4, 4, 8, 4),     # run-time sizes, no GQA
        (9, 3, 8, 1),     # one-token blocks
        (8, 1, 32, 8),    # eight query heads per KV head: decode items of 8 rows (transposed K)
    ]]))
def test_quantized_pools_read_as_their_dequantization(seed, num_heads, num_kv_heads, head_dim,
                                                      block_size, fmt):
    """Ragged batches (decode tokens and chunks) over QuantizedPools with NaN scales in every
    unowned slot: bit for bit the kernel's output on the float32 pools they dequantize to, and
    within 2e-5 of float64 attention of those dequantized values."""
    rng = np.random.default_rng(seed)
    args_q, args_f, keys, values = quantized_batch(
        rng, fmt, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size)
    out_q = paged_attention_cpu(*args_q)
    assert out_q.dtype == jnp.float32
    assert_exact_and_near_oracle(out_q, paged_attention_cpu(*args_f), args_q, keys, values,
                                 head_dim**-0.5)
    assert not np.asarray(out_q)[args_q[5][-1]:].any(), "padding rows must be zero"


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
def test_quantized_long_chunks_and_query_tiles(fmt):
    """Chunks of up to 70 tokens over up to 80 cached ones cut into items of 3 tokens (partial
    8-row tiles) and of 32, under jit as the model calls the kernel (QuantizedPools are
    pytrees)."""
    rng = np.random.default_rng(11)
    args_q, args_f, keys, values = quantized_batch(
        rng, fmt, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, max_cached=80,
        max_new=70, num_seqs=5)
    for query_tile in (3, 32):
        attend = jax.jit(lambda *a, t=query_tile: paged_attention_cpu(*a, query_tile=t))
        assert_exact_and_near_oracle(attend(*args_q), attend(*args_f), args_q, keys, values,
                                     64**-0.5)


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (8, 1, 8, 4)])
def test_quantized_sliding_window_and_soft_cap(fmt, num_heads, num_kv_heads, head_dim,
                                               block_size):
    """A sliding window of 7 keys and a soft-cap of 2 (small enough to bend the scores), the
    table entries of the blocks before each sequence's window pointing at block 0, which no
    sequence owns (all its scales NaN): never read. Bit for bit the float32 kernel on the
    dequantized pools, and near float64 windowed, soft-capped attention."""
    window, soft_cap = 7, 2.0
    rng = np.random.default_rng(4)
    args_q, args_f, keys, values = quantized_batch(
        rng, fmt, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, num_seqs=5)
    tables, seq_lens, qsl = (np.array(a) for a in args_q[3:])
    freed = 0
    for s in range(len(seq_lens)):
        first_query = seq_lens[s] - (qsl[s + 1] - qsl[s])
        freed += max(0, first_query - window + 1) // block_size
        tables[s, : max(0, first_query - window + 1) // block_size] = 0
    assert freed > 0, "no block before a window: the case tests nothing"
    assert np.isnan(np.asarray(args_q[1].scales)[:, 0]).all()
    args_q, args_f = ((*args[:3], tables, *args[4:]) for args in (args_q, args_f))
    options = dict(sliding_window=window, soft_cap=soft_cap, query_tile=8)
    out_q = np.asarray(paged_attention_cpu(*args_q, **options))
    out_f = np.asarray(paged_attention_cpu(*args_f, **options))
    assert np.isfinite(out_q).all(), "an unowned slot (NaN scale) leaked into the output"
    np.testing.assert_array_equal(out_q, out_f)
    q = args_q[0]
    for s in range(len(keys)):
        rows = slice(qsl[s], qsl[s + 1])
        np.testing.assert_allclose(
            out_q[rows], windowed_naive(q[rows], keys[s], values[s], head_dim**-0.5, window,
                                        soft_cap), atol=2e-5, rtol=0, err_msg=f"seq {s}")


def test_quantized_q_dtype_round_trip():
    """q is cast to float32 for the kernel and the float32 result back to q's dtype."""
    rng = np.random.default_rng(2)
    args_q, _, _, _ = quantized_batch(rng, "int8", num_heads=4, num_kv_heads=2, head_dim=8,
                                      block_size=4)
    q16 = jnp.asarray(args_q[0], jnp.bfloat16)
    out = paged_attention_cpu(q16, *args_q[1:])
    assert out.dtype == jnp.bfloat16
    expected = paged_attention_cpu(q16.astype(jnp.float32), *args_q[1:]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)),
                                  np.asarray(expected.astype(jnp.float32)))


@pytest.mark.parametrize("k_fmt,v_fmt", [("int8", "float8_e4m3fn"),
                                         ("float8_e5m2", "float8_e4m3fn"),
                                         ("int8", None), (None, "float8_e5m2")])
def test_quantized_mixed_pool_dtypes_are_refused(k_fmt, v_fmt):
    """K and V must both be QuantizedPools of one storage dtype: the error names both."""
    pool = np.zeros((1, 6, 4, 8), np.float32)
    k_pool, v_pool = (pool if fmt is None else quantized.quantize_pool(jnp.asarray(pool),
                                                                       jnp.dtype(fmt))
                      for fmt in (k_fmt, v_fmt))
    with pytest.raises(ValueError, match="one storage dtype") as error:
        paged_attention_cpu(np.ones((1, 1, 8), np.float32), k_pool, v_pool,
                            np.array([[1]], np.int32), np.array([1], np.int32),
                            np.array([0, 1], np.int32))
    for fmt in (k_fmt, v_fmt):
        assert (fmt or "float32") in str(error.value)


def _call_quantized_target(q, k_values, k_scales, v_values, v_scales):
    """The quantized FFI target called directly (one sequence of 5 tokens in blocks 1, 2)."""
    call = jax.ffi.ffi_call(cpu_library.TARGET_QUANTIZED,
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return jax.block_until_ready(call(
        q, k_values, k_scales, v_values, v_scales, np.array([[1, 2]], np.int32),
        np.array([5], np.int32), np.array([0, 1], np.int32), scale=np.float32(1.0),
        query_tile=np.int64(32), sliding_window=np.int64(0), soft_cap=np.float32(0.0),
        key_splits=np.int64(0)))


def test_quantized_handler_checks_types_and_scale_shapes():
    """The handler itself refuses K and V values of two types, a storage type it does not
    read, and scales whose shape is not the values' less head_dim (it would read past them)."""
    q = np.ones((1, 2, 8), np.float32)
    scales = np.ones((1, 6, 4), np.float32)
    int8 = np.zeros((1, 6, 4, 8), np.int8)
    e4m3 = jnp.zeros((1, 6, 4, 8), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(
        np.asarray(_call_quantized_target(q, int8, scales, int8, scales)), 0.0)
    with pytest.raises(Exception, match="K values are int8 but V values float8_e4m3fn"):
        _call_quantized_target(q, int8, scales, e4m3, scales)
    with pytest.raises(Exception, match="not uint8"):
        _call_quantized_target(q, int8.view(np.uint8), scales, int8.view(np.uint8), scales)
    with pytest.raises(Exception, match=re.escape("scales [1, 6, 3] are not the values' "
                                                  "[1, 6, 4, 8] less head_dim")):
        _call_quantized_target(q, int8, scales[:, :, :3], int8, scales)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_tables_match_ml_dtypes(fmt):
    """The kernel's float32 value of each of the 256 bit patterns is ml_dtypes' conversion:
    equal where finite or infinite (signed zeros included), NaN exactly where it is NaN
    (e4m3fn: 0x7f and 0xff, no inf; e5m2: inf at 0x7c and 0xfc, NaN above)."""
    table = np.zeros(256, np.float32)
    cpu_library.loaded().JaxpageFloat8Table(
        ctypes.c_int(0 if fmt == "float8_e4m3fn" else 1),
        table.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
    expected = np.arange(256, dtype=np.uint8).view(getattr(ml_dtypes, fmt)).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(table), np.isnan(expected))
    finite = ~np.isnan(expected)
    np.testing.assert_array_equal(table[finite].view(np.uint32),
                                  expected[finite].view(np.uint32))
    assert np.isnan(table).sum() == (2 if fmt == "float8_e4m3fn" else 6)
