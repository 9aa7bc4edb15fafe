"""Paged decode attention on GPU (one query per sequence): the ragged kernel's program, one
tile per sequence.

A decode step needs none of the ragged kernel's query tiling: sequence s's query heads of KV
head h are tile (s, h) as they stand (the GQA group zero-padded to >= 16 rows, so the two
products are `tl.dot`s), every row's position is the sequence's last. One program per
(sequence, KV head, KV split) walks its share of the sequence's pages through the block
table and keeps an online softmax in registers (`ragged_paged_gpu._attention_kernel`); the
splits are merged in jnp afterwards. Skipping the tiling's gathers made decode steps 6-33%
faster than the ragged wrapper on an H200, which is why the engine sends pure decode steps
here.

The oracle is `pallas_kernels.reference.paged_attention_reference` with one query per
sequence; tests/kernels/test_paged_decode_kernels.py holds the two to each other.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton  # noqa: F401 (tests read its target)

from pallas_kernels import quantized
from pallas_kernels.checks import check_decode_inputs
from pallas_kernels.ragged_paged_gpu import (
    DEFAULT_NUM_STAGES,
    DEFAULT_NUM_WARPS,
    MIN_DOT_ROWS,
    TRITON_DEPRECATION_MESSAGE,  # noqa: F401 (re-exported for the tests' warning filters)
    attend_tiles,
    next_power_of_2,
    pool_head_dim,
)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "pages_per_compute_block", "num_splits", "num_warps", "num_stages", "interpret",
        "sliding_window", "soft_cap",
    ),
)
def paged_decode_attention_gpu(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float | None = None,
    pages_per_compute_block: int | None = None,
    num_splits: int | None = None,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
    interpret: bool = False,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Decode attention (one query per sequence) over a paged KV pool, on GPU.

    Args:
      q: [S, num_heads, head_dim] float32 or bfloat16, one query per sequence. Query head h
        reads KV head h // (num_heads // num_kv_heads).
      k_pool, v_pool: [num_kv_heads, num_blocks, block_size, head_dim], q's dtype, or both
        `quantized.QuantizedPool`s of one format (read as their dequantization, each page
        dequantized in the kernel as it is loaded; q is then attended in float32). Slots
        that no sequence owns may hold anything, NaN included (a NaN scale too).
      block_tables: [S, max_blocks_per_seq] int32 block ids in [0, num_blocks); entries past
        a sequence's length are never read.
      seq_lens: [S] int32 tokens of each sequence, this step's token included; 0 marks a
        padding row, whose output is zeros.
      scale: softmax scale, default head_dim ** -0.5.
      pages_per_compute_block: pages per inner step (power of 2); default 128 tokens' worth.
      num_splits: KV splits per sequence (flash-decoding); default enough for ~4 waves of
        programs on a 132-SM GPU, capped by the compute blocks in the table width.
      num_warps, num_stages: Triton launch parameters.
      interpret: run the kernel in Pallas interpret mode (CPU).
      sliding_window, soft_cap: as `ragged_paged_attention_gpu`'s (a sequence reads no
        page before its query's window).

    Returns:
      [S, num_heads, head_dim] in q's dtype.

    block_size and head_dim must be powers of 2 (Triton tiles); a head_dim that is not is
    zero-padded here, which copies the pools.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[0]
    check_decode_inputs(q, k_pool, v_pool, block_tables, seq_lens)
    scale = head_dim**-0.5 if scale is None else scale
    group = num_heads // num_kv_heads
    group_rows = max(MIN_DOT_ROWS, next_power_of_2(group))
    padded_dim = pool_head_dim(head_dim)
    # [S, H, D] -> [S, K, G_pad, D_pad]; padded rows and lanes are zero
    # quantized pools are read in float32 (their dequantization), whatever q's dtype
    q_attend = q.astype(jnp.float32) if quantized.is_quantized(k_pool) else q
    q_grouped = q_attend.reshape(num_seqs, num_kv_heads, group, head_dim)
    q_grouped = jnp.pad(
        q_grouped, ((0, 0), (0, 0), (0, group_rows - group), (0, padded_dim - head_dim)))
    # every live row's query is its sequence's last token; padded rows (and sequences of
    # length 0) see no key
    row = jnp.arange(group_rows, dtype=jnp.int32)
    row_pos = jnp.where(row[None, :] < group, seq_lens[:, None] - 1, -1)  # [S, G_pad]
    out = attend_tiles(
        q_grouped, k_pool, v_pool, block_tables, seq_lens, row_pos, scale=scale,
        pages_per_compute_block=pages_per_compute_block, num_splits=num_splits,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        name="paged_decode_attention_gpu", sliding_window=sliding_window,
        soft_cap=soft_cap)  # [S, K, G_pad, D_pad]
    out = out[:, :, :group, :head_dim].reshape(num_seqs, num_heads, head_dim)
    return out.astype(q.dtype)
