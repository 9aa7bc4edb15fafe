"""Paged decode attention on TPU (one query per sequence): the ragged kernel's program, one
tile per sequence.

A decode step needs none of the ragged kernel's query tiling: sequence s's query heads,
grouped by KV head (`[K, G, D]`, the group padded to a sublane multiple), are tile s as they
stand, and every row's position is the sequence's last. The program is
`ragged_paged_tpu._ragged_kernel`: block tables and lengths scalar-prefetched into SMEM, K
and V left in HBM and copied page by page (one DMA per page carrying all KV heads),
double-buffered, the last compute block of a sequence starting the first copy of the
chunk's next sequence; for every KV head the group is one [G, D] x [D, T] product with an
online softmax in VMEM. Sequences are dealt round-robin to `batch_chunks` chunks on a
"parallel" grid axis (one per TensorCore on megacore chips).

The oracle is `pallas_kernels.reference.paged_attention_reference` with one query per
sequence; tests/kernels/test_paged_decode_kernels.py holds the two to each other in the TPU
interpreter. Lowering to Mosaic is tested on CPU; Mosaic's layout passes (libtpu) and the
defaults have not met a TPU yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import quantized
from pallas_kernels.checks import check_decode_inputs
from pallas_kernels.ragged_paged_tpu import (
    DEFAULT_BATCH_CHUNKS,
    SUBLANES,
    attend_tiles,
    check_tiling,
    pool_head_dim,
    round_up,
)


@functools.partial(
    jax.jit, static_argnames=("scale", "pages_per_compute_block", "batch_chunks", "interpret",
                              "sliding_window", "soft_cap")
)
def paged_decode_attention_tpu(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float | None = None,
    pages_per_compute_block: int | None = None,
    batch_chunks: int = DEFAULT_BATCH_CHUNKS,
    interpret: bool = False,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Decode attention (one query per sequence) over a paged KV pool, on TPU.

    Args:
      q: [S, num_heads, head_dim] float32 or bfloat16, one query per sequence. Query head h
        reads KV head h // (num_heads // num_kv_heads).
      k_pool, v_pool: [num_kv_heads, num_blocks, block_size, head_dim], q's dtype, or both
        `quantized.QuantizedPool`s of one format (read as their dequantization, each page
        dequantized in the kernel as it is copied in; q is then attended in float32; the
        block_size must be a multiple of 32). Slots that no sequence owns may hold
        anything, NaN included (a NaN scale too).
      block_tables: [S, max_blocks_per_seq] int32 block ids in [0, num_blocks); entries
        past a sequence's length are never read. The whole table is scalar-prefetched into
        SMEM, so S * max_blocks_per_seq must fit there.
      seq_lens: [S] int32 tokens of each sequence, this step's token included; 0 marks a
        padding row, whose output is zeros.
      scale: softmax scale, default head_dim ** -0.5.
      pages_per_compute_block: pages per compute block; pages * block_size must be a
        multiple of 128. Default: 128 tokens' worth.
      batch_chunks: chunks of the batch (sequences dealt round-robin) on the "parallel"
        grid axis (2 feeds both TensorCores of a megacore chip).
      interpret: run in interpret mode on CPU (`pltpu.InterpretParams` when available).
      sliding_window, soft_cap: as `ragged_paged_attention_tpu`'s (a sequence copies no
        page before its query's window).

    Returns:
      [S, num_heads, head_dim] in q's dtype.

    block_size must be a multiple of 8. A head_dim that is not a multiple of 128 is
    zero-padded here, which copies the pools: size pools to 128 lanes to avoid it.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pool.shape
    check_decode_inputs(q, k_pool, v_pool, block_tables, seq_lens)
    pages_per_compute_block = check_tiling(block_size, pages_per_compute_block, batch_chunks,
                                           k_pool)
    scale = head_dim**-0.5 if scale is None else scale
    group = num_heads // num_kv_heads
    # quantized pools are read in float32 (their dequantization), whatever q's dtype
    q_attend = q.astype(jnp.float32) if quantized.is_quantized(k_pool) else q
    group_rows = round_up(group, SUBLANES * (4 // q_attend.dtype.itemsize))  # 8 f32, 16 bf16
    padded_dim = pool_head_dim(head_dim)
    num_chunks = min(batch_chunks, max(1, num_seqs))
    padded_seqs = round_up(num_seqs, num_chunks)

    # [S, H, D] -> [S_pad, K, G_pad, D_pad]; padded rows, lanes and sequences are zero
    q_grouped = q_attend.reshape(num_seqs, num_kv_heads, group, head_dim)
    q_grouped = jnp.pad(q_grouped, ((0, padded_seqs - num_seqs), (0, 0),
                                    (0, group_rows - group), (0, padded_dim - head_dim)))
    lengths = jnp.pad(seq_lens, (0, padded_seqs - num_seqs))  # padding sequences: length 0
    tables = jnp.pad(block_tables, ((0, padded_seqs - num_seqs), (0, 0)))
    # every live row's query is its sequence's last token; padded rows see no key
    row = jnp.arange(group_rows, dtype=jnp.int32)
    row_pos = jnp.where(row[None, :] < group, lengths[:, None] - 1, -1)  # [S_pad, G_pad]
    out = attend_tiles(
        jnp.arange(padded_seqs, dtype=jnp.int32), lengths, tables, row_pos, q_grouped, k_pool,
        v_pool, scale=scale, num_chunks=num_chunks,
        pages_per_compute_block=pages_per_compute_block, interpret=interpret,
        name="paged_decode_attention_tpu", sliding_window=sliding_window,
        soft_cap=soft_cap)  # [S_pad, K, G_pad, D_pad] f32
    out = out[:num_seqs, :, :group, :head_dim].reshape(num_seqs, num_heads, head_dim)
    return out.astype(q.dtype)
