"""Paged decode attention on TPU: Pallas Mosaic, manual double-buffered page DMAs.

One grid step per sequence. The block table and the lengths are scalar-prefetched into
SMEM; K and V stay in HBM (`memory_space=ANY`) and are copied into VMEM
`pages_per_compute_block` pages at a time, one DMA per page and pool carrying all KV heads
of that page (`[K, block_size, D]`, strided in HBM). Copies are double-buffered: the copy of
the next compute block is started before the current one is waited for and computed, and
the last compute block of a sequence starts the first one of the next non-empty sequence,
so the pipeline only drains at the end of a chunk of the batch. For every KV head, the
whole GQA group of query heads is one [G, D] x [D, T] product, with an online softmax in
VMEM scratch (max and sum replicated over 128 lanes, as in JAX's flash attention kernel).

The batch is cut into `batch_chunks` contiguous chunks on a "parallel" grid axis (one per
TensorCore on megacore chips, v4 and v5p); within a chunk, steps run in order ("arbitrary"),
which the cross-sequence prefetch relies on.

The oracle is `pallas_kernels.reference.paged_attention_reference` with one query per
sequence; tests/kernels/test_paged_decode_kernels.py holds the two to each other in the TPU
interpreter. Lowering to Mosaic is tested on CPU; Mosaic's layout passes (libtpu) and the
defaults have not met a TPU yet.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.checks import check_decode_inputs

LANES = 128  # TPU vector lane count: head_dim and the compute block are padded to it
SUBLANES = 8  # f32 rows per vreg (bf16 packs 16): block sizes and query groups align to it
MAX_UNROLLED_HEADS = 8  # KV heads past this loop instead of unrolling
# One compute block is 128 tokens (one lane-width of scores): 8 pages of 16 tokens.
DEFAULT_TOKENS_PER_COMPUTE_BLOCK = 128
# Two chunks feed both TensorCores of a megacore chip; on one-core chips they run back to
# back and cost one unhidden DMA.
DEFAULT_BATCH_CHUNKS = 2


def _decode_kernel(
    # scalar prefetch
    lengths_ref,  # [S_pad] int32 (SMEM): tokens per sequence, 0 for padding
    tables_ref,  # [S_pad * W] int32 (SMEM): flattened block tables
    # inputs
    q_ref,  # [K, G, D] pool dtype: this sequence's queries, grouped by KV head
    k_hbm,  # [K, num_blocks, block_size, D] (HBM): K pool
    v_hbm,  # [K, num_blocks, block_size, D] (HBM): V pool
    # outputs
    out_ref,  # [K, G, D] f32
    # scratch
    k_buf,  # [2, P, K, block_size, D] (VMEM): double buffer of K pages
    v_buf,  # [2, P, K, block_size, D] (VMEM): double buffer of V pages
    k_sems,  # [2] DMA semaphores, one per K buffer slot
    v_sems,  # [2] DMA semaphores, one per V buffer slot
    max_ref,  # [K, G, 128] f32: running max of the scores, replicated over lanes
    sum_ref,  # [K, G, 128] f32: running sum of exp(score - max), replicated over lanes
    acc_ref,  # [K, G, D] f32: running unnormalized output
    state_ref,  # [2] int32 (SMEM): [slot of the next compute block, its copy already started]
    *,
    scale: float,
    seqs_per_chunk: int,
    table_width: int,
    pages_per_compute_block: int,
):
    num_kv_heads, _, head_dim = q_ref.shape
    block_size = k_hbm.shape[2]
    tokens = pages_per_compute_block * block_size
    precision = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
    chunk, step = pl.program_id(0), pl.program_id(1)
    seq = chunk * seqs_per_chunk + step
    chunk_end = (chunk + 1) * seqs_per_chunk
    length = lengths_ref[seq]
    num_compute_blocks = pl.cdiv(length, tokens)

    def page_copies(copy_seq, block, slot):
        """(valid, K copy, V copy) for each page of compute block `block` of `copy_seq`."""
        copies = []
        for p in range(pages_per_compute_block):
            page = block * pages_per_compute_block + p
            page_id = tables_ref[copy_seq * table_width + page]
            valid = page * block_size < lengths_ref[copy_seq]  # pages past the end: no copy
            k_copy = pltpu.make_async_copy(k_hbm.at[:, page_id], k_buf.at[slot, p], k_sems.at[slot])
            v_copy = pltpu.make_async_copy(v_hbm.at[:, page_id], v_buf.at[slot, p], v_sems.at[slot])
            copies.append((valid, k_copy, v_copy))
        return copies

    def start(copy_seq, block, slot):
        for valid, k_copy, v_copy in page_copies(copy_seq, block, slot):
            pl.when(valid)(functools.partial(_start_both, k_copy, v_copy))

    def wait(copy_seq, block, slot):
        for valid, k_copy, v_copy in page_copies(copy_seq, block, slot):
            pl.when(valid)(functools.partial(_wait_both, k_copy, v_copy))

    def next_nonempty_seq():
        """The first sequence after `seq` in this chunk with tokens (chunk_end if none)."""
        def empty(s):
            return (s < chunk_end) & (lengths_ref[jnp.minimum(s, chunk_end - 1)] == 0)
        return jax.lax.while_loop(empty, lambda s: s + 1, seq + 1)

    @pl.when(step == 0)
    def _reset_pipeline():
        state_ref[0] = 0
        state_ref[1] = 0

    def head_step(h, block, slot):
        q = q_ref[h]  # [G, D]
        k = _rows(k_buf[slot, :, h])  # [P, B, D] -> [T, D]
        v = _rows(v_buf[slot, :, h])  # [P, B, D] -> [T, D]
        # [G, D] x [T, D] -> [G, T]; bf16 products are exact in f32, f32 needs HIGHEST
        scores = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32) * scale
        # unowned slots (and pages not copied) may hold anything: mask scores and values
        key_pos = block * tokens + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        scores = jnp.where(key_pos < length, scores, -jnp.inf)
        prev_max = max_ref[h]  # [G, 128]
        new_max = jnp.maximum(prev_max, scores.max(axis=1, keepdims=True))  # finite
        correction = jnp.exp(prev_max - new_max)  # [G, 128]; 0 on the first block
        probs = jnp.exp(scores - jnp.tile(new_max, (1, tokens // LANES)))  # [G, T]
        sum_ref[h] = sum_ref[h] * correction + probs.sum(axis=1, keepdims=True)
        max_ref[h] = new_max
        value_pos = block * tokens + jax.lax.broadcasted_iota(jnp.int32, v.shape, 0)
        v = jnp.where(value_pos < length, v, jnp.zeros_like(v))
        # [G, T] x [T, D] -> [G, D]
        update = jax.lax.dot_general(
            probs.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32)
        acc_ref[h] = acc_ref[h] * jnp.tile(correction, (1, head_dim // LANES)) + update

    def block_step(block, carry):
        slot = state_ref[0]
        next_slot = 1 - slot

        @pl.when(block + 1 < num_compute_blocks)
        def _prefetch_next_block():
            start(seq, block + 1, next_slot)

        @pl.when(block + 1 == num_compute_blocks)
        def _prefetch_next_sequence():
            next_seq = next_nonempty_seq()

            @pl.when(next_seq < chunk_end)
            def _():
                start(next_seq, 0, next_slot)
                state_ref[1] = 1

        wait(seq, block, slot)

        if num_kv_heads <= MAX_UNROLLED_HEADS:
            for h in range(num_kv_heads):
                head_step(h, block, slot)
        else:
            def head_loop_body(h, head_carry):
                head_step(h, block, slot)
                return head_carry

            jax.lax.fori_loop(0, num_kv_heads, head_loop_body, 0)
        state_ref[0] = next_slot
        return carry

    @pl.when(num_compute_blocks > 0)
    def _attend():
        @pl.when(state_ref[1] == 0)
        def _first_copy():  # not prefetched by the previous sequence
            start(seq, 0, state_ref[0])

        state_ref[1] = 0
        max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
        sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        jax.lax.fori_loop(0, num_compute_blocks, block_step, 0)
        total = jnp.tile(sum_ref[...], (1, 1, head_dim // LANES))  # [K, G, D]
        out_ref[...] = acc_ref[...] / jnp.where(total > 0, total, 1.0)

    @pl.when(num_compute_blocks == 0)
    def _padding_row():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)


def _rows(pages):
    """[P, B, D] pages -> [P * B, D] token rows, in the pages' dtype.

    Merging pages into rows is free when B is a whole number of sublane tiles (8 rows of
    f32, 16 of bf16); a bf16 block of 8 rows goes through f32, whose tiles are 8 rows.
    """
    num_pages, block_size, head_dim = pages.shape
    if pages.dtype == jnp.float32 or block_size % (2 * SUBLANES) == 0:
        return pages.reshape(num_pages * block_size, head_dim)
    rows = pages.astype(jnp.float32).reshape(num_pages * block_size, head_dim)
    return rows.astype(pages.dtype)


def _start_both(k_copy, v_copy) -> None:
    k_copy.start()
    v_copy.start()


def _wait_both(k_copy, v_copy) -> None:
    k_copy.wait()
    v_copy.wait()


def _build_decode_call(
    *,
    scale: float,
    num_chunks: int,
    seqs_per_chunk: int,
    num_kv_heads: int,
    group_rows: int,
    head_dim: int,
    block_size: int,
    pool_dtype,
    table_width: int,
    pages_per_compute_block: int,
    interpret,
):
    """The pallas_call over grid (batch chunk, sequence within the chunk)."""
    kernel = functools.partial(
        _decode_kernel, scale=scale, seqs_per_chunk=seqs_per_chunk, table_width=table_width,
        pages_per_compute_block=pages_per_compute_block)
    num_seqs = num_chunks * seqs_per_chunk
    buffer_shape = (2, pages_per_compute_block, num_kv_heads, block_size, head_dim)
    buffer_bytes = 2 * jnp.dtype(pool_dtype).itemsize * math.prod(buffer_shape)
    # default scoped VMEM is 16 MiB (v5e) to 32 MiB: raise it only for very large head counts
    vmem_limit = None if buffer_bytes < 8 * 2**20 else buffer_bytes + 16 * 2**20

    def seq_block(chunk, step, *_):
        return (chunk * seqs_per_chunk + step, 0, 0, 0)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,  # lengths, flattened block tables
        grid=(num_chunks, seqs_per_chunk),
        in_specs=[
            # q [S_pad, K, G, D] pool dtype: one sequence's queries per step
            pl.BlockSpec((None, num_kv_heads, group_rows, head_dim), seq_block),
            # k_pool [K, N, B, D]: left in HBM, pages are copied by hand
            pl.BlockSpec(memory_space=pl.ANY),
            # v_pool [K, N, B, D]: likewise
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        # out [S_pad, K, G, D] f32: one sequence's outputs per step
        out_specs=pl.BlockSpec((None, num_kv_heads, group_rows, head_dim), seq_block),
        scratch_shapes=[
            pltpu.VMEM(buffer_shape, pool_dtype),  # K pages, two slots
            pltpu.VMEM(buffer_shape, pool_dtype),  # V pages, two slots
            pltpu.SemaphoreType.DMA((2,)),  # K copies, per slot
            pltpu.SemaphoreType.DMA((2,)),  # V copies, per slot
            pltpu.VMEM((num_kv_heads, group_rows, LANES), jnp.float32),  # running max
            pltpu.VMEM((num_kv_heads, group_rows, LANES), jnp.float32),  # running sum
            pltpu.VMEM((num_kv_heads, group_rows, head_dim), jnp.float32),  # accumulator
            pltpu.SMEM((2,), jnp.int32),  # pipeline state
        ],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_seqs, num_kv_heads, group_rows, head_dim),
                                       jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=vmem_limit),
        interpret=interpret,
        name="paged_decode_attention_tpu",
    )


def interpret_params():
    """The most faithful interpret mode this jax offers: the TPU interpreter (simulated
    DMAs and semaphores, uninitialized memory filled with NaN) with out-of-bounds reads
    raising where it can, else the generic interpreter."""
    params_cls = getattr(pltpu, "InterpretParams", None)
    if params_cls is None:
        return True
    fields = {f.name for f in dataclasses.fields(params_cls)}
    kwargs = {}
    if "out_of_bounds_reads" in fields:
        kwargs["out_of_bounds_reads"] = "raise"
    if "uninitialized_memory" in fields:
        kwargs["uninitialized_memory"] = "nan"
    return params_cls(**kwargs)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.partial(
    jax.jit, static_argnames=("scale", "pages_per_compute_block", "batch_chunks", "interpret")
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
) -> jax.Array:
    """Decode attention (one query per sequence) over a paged KV pool, on TPU.

    Args:
      q: [S, num_heads, head_dim] float32 or bfloat16, one query per sequence. Query head h
        reads KV head h // (num_heads // num_kv_heads).
      k_pool, v_pool: [num_kv_heads, num_blocks, block_size, head_dim], q's dtype. Slots
        that no sequence owns may hold anything, NaN included.
      block_tables: [S, max_blocks_per_seq] int32 block ids in [0, num_blocks); entries
        past a sequence's length are never read. The whole table is scalar-prefetched into
        SMEM, so S * max_blocks_per_seq must fit there.
      seq_lens: [S] int32 tokens of each sequence, this step's token included; 0 marks a
        padding row, whose output is zeros.
      scale: softmax scale, default head_dim ** -0.5.
      pages_per_compute_block: pages per compute block; pages * block_size must be a
        multiple of 128. Default: 128 tokens' worth.
      batch_chunks: contiguous chunks of the batch on the "parallel" grid axis (2 feeds both
        TensorCores of a megacore chip).
      interpret: run in interpret mode on CPU (`pltpu.InterpretParams` when available).

    Returns:
      [S, num_heads, head_dim] in q's dtype.

    block_size must be a multiple of 8. A head_dim that is not a multiple of 128 is
    zero-padded here, which copies the pools: size pools to 128 lanes to avoid it.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pool.shape
    check_decode_inputs(q, k_pool, v_pool, block_tables, seq_lens)
    if block_size % SUBLANES:
        raise ValueError(f"block_size {block_size} must be a multiple of {SUBLANES}")
    if pages_per_compute_block is None:
        pages_per_compute_block = max(1, -(-DEFAULT_TOKENS_PER_COMPUTE_BLOCK // block_size))
    if pages_per_compute_block < 1 or (pages_per_compute_block * block_size) % LANES:
        raise ValueError(
            f"pages_per_compute_block {pages_per_compute_block} * block_size {block_size}"
            f" must be a positive multiple of {LANES}")
    if batch_chunks < 1:
        raise ValueError(f"batch_chunks {batch_chunks} must be >= 1")
    scale = head_dim**-0.5 if scale is None else scale
    if interpret is True:
        interpret = interpret_params()

    group = num_heads // num_kv_heads
    group_rows = _round_up(group, SUBLANES * (4 // q.dtype.itemsize))  # 8 f32, 16 bf16
    padded_dim = _round_up(head_dim, LANES)
    batch_chunks = min(batch_chunks, max(1, num_seqs))
    seqs_per_chunk = -(-num_seqs // batch_chunks)
    padded_seqs = batch_chunks * seqs_per_chunk
    table_width = _round_up(block_tables.shape[1], pages_per_compute_block)

    # [S, H, D] -> [S_pad, K, G_pad, D_pad]; padded rows, lanes and sequences are zero
    q_grouped = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    q_grouped = jnp.pad(q_grouped, ((0, padded_seqs - num_seqs), (0, 0),
                                    (0, group_rows - group), (0, padded_dim - head_dim)))
    if padded_dim != head_dim:  # copies the pools
        pad = ((0, 0), (0, 0), (0, 0), (0, padded_dim - head_dim))
        k_pool, v_pool = jnp.pad(k_pool, pad), jnp.pad(v_pool, pad)
    lengths = jnp.pad(seq_lens, (0, padded_seqs - num_seqs))
    tables = jnp.pad(block_tables, ((0, padded_seqs - num_seqs),
                                    (0, table_width - block_tables.shape[1]))).reshape(-1)

    call = _build_decode_call(
        scale=scale, num_chunks=batch_chunks, seqs_per_chunk=seqs_per_chunk,
        num_kv_heads=num_kv_heads, group_rows=group_rows, head_dim=padded_dim,
        block_size=block_size, pool_dtype=k_pool.dtype, table_width=table_width,
        pages_per_compute_block=pages_per_compute_block, interpret=interpret)
    out = call(lengths, tables, q_grouped, k_pool, v_pool)  # [S_pad, K, G_pad, D_pad]
    out = out[:num_seqs, :, :group, :head_dim].reshape(num_seqs, num_heads, head_dim)
    return out.astype(q.dtype)
