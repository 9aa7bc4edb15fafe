"""Ragged paged attention on TPU: Pallas Mosaic, manual double-buffered page DMAs.

A step's ragged, token-flat batch (decode tokens and prefill chunks together) is cut into
tiles by `pallas_kernels.ragged_tiles`: a tile is up to `rows` query rows of one sequence,
`tokens_per_tile` consecutive query tokens times the GQA group of query heads, for every KV
head (`[K, rows, Dp]`). A pure-decode step gets one-token tiles of a sublane multiple of
rows (8 f32, 16 bf16); a step with chunks gets tiles of ~128 rows (one MXU width).

One grid step per tile. Per tile, its sequence, the number of keys it reads (its last
query's position + 1), its first page (0, or with a sliding window the page of its earliest
query's first key: earlier pages are never copied) and the flattened block tables are
scalar-prefetched into SMEM. K and
V stay in HBM (`memory_space=ANY`) and are copied into VMEM `pages_per_compute_block` pages
at a time, one DMA per page and pool carrying all KV heads of that page (`[K, block_size,
Dp]`, strided in HBM). Copies are double-buffered: the copy of the next compute block is
started before the current one is waited for and computed, and the last compute block of a
tile starts the first one of the chunk's next tile (tiles of one sequence each copy their
pages; nothing is shared between tiles), so the pipeline only drains at the end of a chunk.
For every KV head, the tile is one [rows, Dp] x [Dp, tokens] product, causally masked by
each row's query position (a VMEM input, replicated over 128 lanes), with an online softmax
in VMEM scratch (max and sum replicated over 128 lanes, as in JAX's flash attention kernel).

The tiles are dealt round-robin to `batch_chunks` chunks on a "parallel" grid axis (one per
TensorCore on megacore chips, v4 and v5p): live tiles come first (empty ones, kept for a
static grid, last), so dealing them out balances the cores where contiguous halves would
not. Within a chunk, steps run in order ("arbitrary"), which the cross-tile prefetch relies
on.

The pool's head dim Dp may exceed q's D (pools allocated padded to 128 lanes, zeros past
D): only the queries are zero-padded to Dp, and the output is cut back to D.

Quantized pools (`quantized.QuantizedPool`, int8 / float8 values and a float32 scale per
head and token): the values are copied page by page as a float pool is, each page's scales
beside them by a second DMA (the scales are handed to the kernel block-major, [num_blocks,
K, B], a transposed copy of 4 bytes per head and token, so that a page's scales are one
whole array), and every page is dequantized, `float32(values) * scale`, right after its
copy is waited for; everything after is the float32 kernel's. 8-bit pages are whole
(32, 128) Mosaic tiles only when block_size is a multiple of 32, which the wrappers require.

The oracle is `pallas_kernels.reference.paged_attention_reference`;
tests/kernels/test_ragged_kernels.py holds the two (and a float64 NumPy one) to each other
in the TPU interpreter. Lowering to Mosaic is tested on CPU; Mosaic's layout passes (libtpu)
and the defaults have not met a TPU yet.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import quantized, ragged_tiles, score_mods
from pallas_kernels.checks import check_ragged_inputs

LANES = 128  # TPU vector lane count: head_dim and the compute block are padded to it
SUBLANES = 8  # f32 rows per vreg (bf16 packs 16): block sizes and query groups align to it
# Rows of Mosaic's native tile of an 8-bit array ((32, 128) for int8 and float8): a quantized
# pool's page is copied and read as whole tiles, so its block_size is a multiple of this.
QUANTIZED_SUBLANES = 32
MAX_UNROLLED_HEADS = 8  # KV heads past this loop instead of unrolling
# One compute block is 128 tokens (one lane-width of scores): 8 pages of 16 tokens.
DEFAULT_TOKENS_PER_COMPUTE_BLOCK = 128
# Two chunks feed both TensorCores of a megacore chip; on one-core chips they run back to
# back and cost one unhidden DMA.
DEFAULT_BATCH_CHUNKS = 2
# Query rows of a prefill tile: one pass of a 128-wide MXU.
PREFILL_ROWS = 128


def _ragged_kernel(
    # scalar prefetch
    tile_seq_ref,  # [N] int32 (SMEM): sequence of each tile
    tile_kv_len_ref,  # [N] int32 (SMEM): keys each tile reads, 0 for empty tiles
    tile_first_page_ref,  # [N] int32 (SMEM): each tile's first page (window start; else 0)
    tables_ref,  # [S * W] int32 (SMEM): flattened block tables
    # inputs
    row_pos_ref,  # [R, 128] int32: each row's query position (-1: no query), lane-replicated
    q_ref,  # [K, R, Dp] pool dtype: this tile's queries, grouped by KV head
    k_hbm,  # [K, num_blocks, block_size, Dp] (HBM): K pool (quantized: its values)
    v_hbm,  # [K, num_blocks, block_size, Dp] (HBM): V pool (quantized: its values)
    *refs,
    # quantized pools only: ks_hbm, vs_hbm [num_blocks, K, block_size] f32 (HBM): the K and
    # V scales, block-major (a page's scales are one whole [K, block_size] array); then
    # outputs
    # out_ref [K, R, Dp] f32
    # scratch
    # k_buf [2, P, K, block_size, Dp] (VMEM): double buffer of K pages
    # v_buf [2, P, K, block_size, Dp] (VMEM): double buffer of V pages
    # k_sems [2] DMA semaphores, one per K buffer slot
    # v_sems [2] DMA semaphores, one per V buffer slot
    # max_ref [K, R, 128] f32: running max of the scores, replicated over lanes
    # sum_ref [K, R, 128] f32: running sum of exp(score - max), replicated over lanes
    # acc_ref [K, R, Dp] f32: running unnormalized output
    # state_ref [2] int32 (SMEM): [slot of the next compute block, its copy already started]
    # quantized pools only: ks_buf, vs_buf [2, P, K, block_size] f32 (VMEM), double
    # buffers of the pages' scales, and ks_sems, vs_sems [2], their DMA semaphores
    scale: float,
    num_chunks: int,
    tiles_per_chunk: int,
    table_width: int,
    pages_per_compute_block: int,
    sliding_window: int | None,
    soft_cap: float | None,
    quantized_pools: bool = False,
):
    if quantized_pools:
        ks_hbm, vs_hbm, *refs = refs
        *refs, ks_buf, vs_buf, ks_sems, vs_sems = refs
    (out_ref, k_buf, v_buf, k_sems, v_sems, max_ref, sum_ref, acc_ref,
     state_ref) = refs
    num_kv_heads, _, head_dim = q_ref.shape
    block_size = k_hbm.shape[2]
    tokens = pages_per_compute_block * block_size
    precision = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
    chunk, step = pl.program_id(0), pl.program_id(1)
    tile = step * num_chunks + chunk  # tiles are dealt round-robin to the chunks
    kv_len = tile_kv_len_ref[tile]
    # a tile's compute blocks start at its first page: with a sliding window, pages before
    # it are neither copied nor read (their table entries may name any block)
    first_key = tile_first_page_ref[tile] * block_size
    num_compute_blocks = pl.cdiv(kv_len - first_key, tokens)  # 0 for empty tiles

    def page_copies(copy_tile, block, slot):
        """(valid, copies: K, V[, K scales, V scales]) for each page of compute block
        `block` of `copy_tile`."""
        copy_seq = tile_seq_ref[copy_tile]
        copies = []
        for p in range(pages_per_compute_block):
            page = tile_first_page_ref[copy_tile] + block * pages_per_compute_block + p
            page_id = tables_ref[copy_seq * table_width + page]
            valid = page * block_size < tile_kv_len_ref[copy_tile]  # pages past it: no copy
            k_copy = pltpu.make_async_copy(k_hbm.at[:, page_id], k_buf.at[slot, p], k_sems.at[slot])
            v_copy = pltpu.make_async_copy(v_hbm.at[:, page_id], v_buf.at[slot, p], v_sems.at[slot])
            this_page = [k_copy, v_copy]
            if quantized_pools:
                this_page += [
                    pltpu.make_async_copy(ks_hbm.at[page_id], ks_buf.at[slot, p],
                                          ks_sems.at[slot]),
                    pltpu.make_async_copy(vs_hbm.at[page_id], vs_buf.at[slot, p],
                                          vs_sems.at[slot])]
            copies.append((valid, this_page))
        return copies

    def start(copy_tile, block, slot):
        for valid, copies in page_copies(copy_tile, block, slot):
            pl.when(valid)(functools.partial(_start_all, copies))

    def wait(copy_tile, block, slot):
        for valid, copies in page_copies(copy_tile, block, slot):
            pl.when(valid)(functools.partial(_wait_all, copies))

    @pl.when(step == 0)
    def _reset_pipeline():
        state_ref[0] = 0
        state_ref[1] = 0

    def head_step(h, slot, mask, value_mask):
        q = q_ref[h]  # [R, Dp]
        if quantized_pools:  # dequantized as loaded; the float32 math below is unchanged
            k = _dequantized_rows(k_buf, ks_buf, slot, h)  # [T, Dp] f32
            v = _dequantized_rows(v_buf, vs_buf, slot, h)  # [T, Dp] f32
        else:
            k = _rows(k_buf[slot, :, h])  # [P, B, Dp] -> [T, Dp]
            v = _rows(v_buf[slot, :, h])  # [P, B, Dp] -> [T, Dp]
        # [R, Dp] x [T, Dp] -> [R, T]; bf16 products are exact in f32, f32 needs HIGHEST
        scores = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32) * scale
        scores = score_mods.soft_cap(scores, soft_cap)
        # unowned slots (and pages not copied) may hold anything, NaN included: select, not
        # add, and zero their values (0 * NaN = NaN)
        scores = jnp.where(mask, scores, -jnp.inf)
        v = jnp.where(value_mask, v, jnp.zeros_like(v))
        prev_max = max_ref[h]  # [R, 128]
        new_max = jnp.maximum(prev_max, scores.max(axis=1, keepdims=True))
        # a row with no visible key so far (an empty row: position -1) has max -inf:
        # subtract 0 instead, so that its exps are exp(-inf) = 0, not NaN
        safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        correction = jnp.exp(prev_max - safe_max)  # [R, 128]; 0 while prev_max is -inf
        probs = jnp.exp(scores - jnp.tile(safe_max, (1, tokens // LANES)))  # [R, T]
        sum_ref[h] = sum_ref[h] * correction + probs.sum(axis=1, keepdims=True)
        max_ref[h] = new_max
        # [R, T] x [T, Dp] -> [R, Dp]
        update = jax.lax.dot_general(
            probs.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32)
        acc_ref[h] = acc_ref[h] * jnp.tile(correction, (1, head_dim // LANES)) + update

    def block_step(block, carry):
        slot = state_ref[0]
        next_slot = 1 - slot

        @pl.when(block + 1 < num_compute_blocks)
        def _prefetch_next_block():
            start(tile, block + 1, next_slot)

        @pl.when(block + 1 == num_compute_blocks)
        def _prefetch_next_tile():
            # live tiles precede empty ones, so if the chunk's next tile is empty, so are
            # all after it
            next_tile = tile + num_chunks
            last = (tiles_per_chunk - 1) * num_chunks + chunk

            @pl.when((next_tile <= last)
                     & (tile_kv_len_ref[jnp.minimum(next_tile, last)] > 0))
            def _():
                start(next_tile, 0, next_slot)
                state_ref[1] = 1

        wait(tile, block, slot)

        # causal: a row sees keys up to its own position, which also keeps it inside the
        # sequence (position < seq_len) and inside the tile's copied pages (< kv_len); with
        # a window, none before it
        block_key = first_key + block * tokens
        row_pos = jnp.tile(row_pos_ref[...], (1, tokens // LANES))  # [R, T]
        key_pos = block_key + jax.lax.broadcasted_iota(jnp.int32, row_pos.shape, 1)
        mask = score_mods.visible(key_pos, row_pos, sliding_window)
        value_pos = block_key + jax.lax.broadcasted_iota(jnp.int32, (tokens, head_dim), 0)
        value_mask = value_pos < kv_len  # [T, Dp]
        if num_kv_heads <= MAX_UNROLLED_HEADS:
            for h in range(num_kv_heads):
                head_step(h, slot, mask, value_mask)
        else:
            def head_loop_body(h, head_carry):
                head_step(h, slot, mask, value_mask)
                return head_carry

            jax.lax.fori_loop(0, num_kv_heads, head_loop_body, 0)
        state_ref[0] = next_slot
        return carry

    @pl.when(num_compute_blocks > 0)
    def _attend():
        @pl.when(state_ref[1] == 0)
        def _first_copy():  # not prefetched by the previous tile
            start(tile, 0, state_ref[0])

        state_ref[1] = 0
        max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
        sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        jax.lax.fori_loop(0, num_compute_blocks, block_step, 0)
        total = jnp.tile(sum_ref[...], (1, 1, head_dim // LANES))  # [K, R, Dp]
        out_ref[...] = acc_ref[...] / jnp.where(total > 0, total, 1.0)  # empty rows: 0 / 1

    @pl.when(num_compute_blocks == 0)
    def _empty_tile():
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


def _dequantized_rows(values_buf, scales_buf, slot, h):
    """Head h's pages of buffer slot `slot`, dequantized: [P, B, Dp] 8-bit values times
    [P, B] scales -> [T, Dp] f32 rows, `float32(values) * scale` per element exactly as
    `quantized.dequantize`.

    A page's scales arrive as a row (tokens on lanes) and must multiply its rows (tokens on
    sublanes): the row is broadcast over B sublanes, its diagonal selected and summed over
    lanes into a [B, 1] column (a transpose from selects and a lane reduction, exact: the
    sum adds zeros to the one selected scale; a NaN scale of an unowned slot stays in its
    own row, which the kernel masks by position). B is a multiple of 32, so every page is
    whole 8-bit tiles and the pages join along sublanes without relayout.
    """
    _, num_pages, _, block_size, _ = values_buf.shape
    diagonal = (jax.lax.broadcasted_iota(jnp.int32, (block_size, block_size), 0)
                == jax.lax.broadcasted_iota(jnp.int32, (block_size, block_size), 1))
    pages = []
    for p in range(num_pages):
        scale_row = scales_buf[slot, p, pl.ds(h, 1), :]  # [1, B]
        scale_col = jnp.sum(jnp.where(diagonal, scale_row, 0.0), axis=1, keepdims=True)
        pages.append(values_buf[slot, p, h].astype(jnp.float32) * scale_col)  # [B, Dp]
    return jnp.concatenate(pages, axis=0) if num_pages > 1 else pages[0]


def _start_all(copies) -> None:
    for copy in copies:
        copy.start()


def _wait_all(copies) -> None:
    for copy in copies:
        copy.wait()


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


def attend_tiles(tile_seq, tile_kv_len, block_tables, row_pos, q_tiles, k_pool, v_pool, *,
                 scale, num_chunks, pages_per_compute_block, interpret, name,
                 sliding_window=None, soft_cap=None):
    """Run the kernel over prepared tiles: tile_seq [N] each tile's sequence (a row of
    block_tables [S, W]), tile_kv_len [N] the keys each tile reads, row_pos [N, R] each
    row's query position (-1: none), q_tiles [N, K, R, Dp] (Dp the pool's head dim rounded
    up to 128 lanes, lanes past the queries' zero), N a multiple of num_chunks ->
    [N, K, R, Dp] f32 attention outputs. A pool whose head dim is not Dp is padded here
    (a copy; pools allocated at 128 lanes avoid it). With a `sliding_window`, a tile copies
    pages from the one of its earliest query's first key on (`ragged_tiles.first_pages`).
    Quantized pools (`quantized.QuantizedPool`) are read as their dequantization, page by
    page inside the kernel; q_tiles must then be f32. Their scales are handed to the kernel
    block-major ([num_blocks, K, B], a transposed copy of 4 bytes per head and token) so
    that a page's scales are one whole array to copy."""
    num_tiles, num_kv_heads, rows, head_dim = q_tiles.shape
    block_size, pool_dim = k_pool.shape[2:]
    quantized_pools = quantized.is_quantized(k_pool)
    scales = ()
    if quantized_pools:
        scales = (jnp.swapaxes(k_pool.scales, 0, 1), jnp.swapaxes(v_pool.scales, 0, 1))
        k_pool, v_pool = k_pool.values, v_pool.values
    if pool_dim != head_dim:
        pad = ((0, 0), (0, 0), (0, 0), (0, head_dim - pool_dim))
        k_pool, v_pool = jnp.pad(k_pool, pad), jnp.pad(v_pool, pad)
    # whole compute blocks (one more where a window starts a tile's blocks mid-table), so
    # that a compute block's page lookups stay inside its sequence's row
    table_width = round_up(block_tables.shape[1], pages_per_compute_block) + (
        pages_per_compute_block if sliding_window is not None else 0)
    tables = jnp.pad(block_tables, ((0, 0), (0, table_width - block_tables.shape[1])))
    first_pages = ragged_tiles.first_pages(row_pos, block_size, sliding_window)
    row_pos = jnp.broadcast_to(row_pos[:, :, None], (num_tiles, rows, LANES))
    call = _build_call(
        scale=scale, num_chunks=num_chunks, tiles_per_chunk=num_tiles // num_chunks,
        num_kv_heads=num_kv_heads, rows=rows, head_dim=head_dim, block_size=block_size,
        pool_dtype=k_pool.dtype, table_width=table_width,
        pages_per_compute_block=pages_per_compute_block, sliding_window=sliding_window,
        soft_cap=soft_cap, interpret=interpret_params() if interpret is True else interpret,
        name=name, quantized_pools=quantized_pools)
    return call(tile_seq, tile_kv_len, first_pages, tables.reshape(-1), row_pos, q_tiles,
                k_pool, v_pool, *scales)


def check_tiling(block_size: int, pages_per_compute_block: int | None,
                 batch_chunks: int, pool=None) -> int:
    """The pages per compute block (default: 128 tokens' worth), after checking the
    wrapper arguments that shape the kernel's tiles (and, given the K pool, that a
    quantized pool's pages are whole 8-bit tiles)."""
    if block_size % SUBLANES:
        raise ValueError(f"block_size {block_size} must be a multiple of {SUBLANES}")
    if quantized.is_quantized(pool) and block_size % QUANTIZED_SUBLANES:
        raise ValueError(
            f"block_size {block_size} of a {pool.dtype} quantized pool must be a multiple of "
            f"{QUANTIZED_SUBLANES} on TPU: Mosaic tiles 8-bit arrays in ({QUANTIZED_SUBLANES},"
            f" {LANES}) tiles, and the kernel copies and reads each page as whole tiles")
    if pages_per_compute_block is None:
        pages_per_compute_block = max(1, -(-DEFAULT_TOKENS_PER_COMPUTE_BLOCK // block_size))
    if pages_per_compute_block < 1 or (pages_per_compute_block * block_size) % LANES:
        raise ValueError(
            f"pages_per_compute_block {pages_per_compute_block} * block_size {block_size}"
            f" must be a positive multiple of {LANES}")
    if batch_chunks < 1:
        raise ValueError(f"batch_chunks {batch_chunks} must be >= 1")
    return pages_per_compute_block


def pool_head_dim(head_dim: int) -> int:
    """The head dim a pool must have for these kernels to read it without a copy: whole
    128-lane vregs."""
    return round_up(head_dim, LANES)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _build_call(
    *,
    scale: float,
    num_chunks: int,
    tiles_per_chunk: int,
    num_kv_heads: int,
    rows: int,
    head_dim: int,
    block_size: int,
    pool_dtype,
    table_width: int,
    pages_per_compute_block: int,
    sliding_window: int | None,
    soft_cap: float | None,
    interpret,
    name: str,
    quantized_pools: bool = False,
):
    """The pallas_call over grid (chunk, tile within the chunk): (tile sequences [N], tile
    key counts [N], tile first pages [N], flattened block tables [S * W] (scalar prefetch),
    row positions
    [N, R, 128], q tiles [N, K, R, Dp], k_pool, v_pool) -> outputs [N, K, R, Dp] f32. Tile
    t runs in chunk t % num_chunks; live tiles must precede empty ones for the cross-tile
    prefetch to reach every live tile (an empty tile between live ones only costs the next
    tile its prefetch)."""
    kernel = functools.partial(
        _ragged_kernel, scale=scale, num_chunks=num_chunks, tiles_per_chunk=tiles_per_chunk,
        table_width=table_width, pages_per_compute_block=pages_per_compute_block,
        sliding_window=sliding_window, soft_cap=soft_cap, quantized_pools=quantized_pools)
    num_tiles = num_chunks * tiles_per_chunk
    itemsize = jnp.dtype(pool_dtype).itemsize
    q_itemsize = 4 if quantized_pools else itemsize  # quantized pools: f32 queries
    buffer_shape = (2, pages_per_compute_block, num_kv_heads, block_size, head_dim)
    tile_shape = (num_kv_heads, rows, head_dim)
    vmem_bytes = (
        2 * itemsize * math.prod(buffer_shape)  # K and V page buffers
        + 2 * (q_itemsize + 4) * math.prod(tile_shape)  # q and out tiles, double-buffered
        + 4 * math.prod(tile_shape)  # accumulator
        + 4 * 2 * num_kv_heads * rows * LANES  # running max and sum
        + 2 * 4 * rows * LANES)  # row positions, double-buffered
    scales_shape = (2, pages_per_compute_block, num_kv_heads, block_size)
    if quantized_pools:  # K and V scale buffers, (K, B) padded to (8, 128) tiles
        vmem_bytes += 2 * 4 * 2 * pages_per_compute_block * round_up(num_kv_heads, SUBLANES) * (
            round_up(block_size, LANES))
    # default scoped VMEM is 16 MiB (v5e) to 32 MiB: raise it only for very large tiles
    vmem_limit = None if vmem_bytes < 8 * 2**20 else vmem_bytes + 16 * 2**20

    def tile_block(chunk, step, *_):
        return (step * num_chunks + chunk, 0, 0, 0)

    def row_block(chunk, step, *_):
        return (step * num_chunks + chunk, 0, 0)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        # tile sequences, key counts and first pages, flattened block tables
        num_scalar_prefetch=4,
        grid=(num_chunks, tiles_per_chunk),
        in_specs=[
            # row_pos [N, R, 128] int32: one tile's query positions per step
            pl.BlockSpec((None, rows, LANES), row_block),
            # q [N, K, R, Dp] pool dtype: one tile's queries per step
            pl.BlockSpec((None, num_kv_heads, rows, head_dim), tile_block),
            # k_pool [K, num_blocks, B, Dp]: left in HBM, pages are copied by hand
            pl.BlockSpec(memory_space=pl.ANY),
            # v_pool [K, num_blocks, B, Dp]: likewise
            pl.BlockSpec(memory_space=pl.ANY),
            # quantized pools: K and V scales [num_blocks, K, B], copied page by page
            *[pl.BlockSpec(memory_space=pl.ANY)] * (2 if quantized_pools else 0),
        ],
        # out [N, K, R, Dp] f32: one tile's outputs per step
        out_specs=pl.BlockSpec((None, num_kv_heads, rows, head_dim), tile_block),
        scratch_shapes=[
            pltpu.VMEM(buffer_shape, pool_dtype),  # K pages, two slots
            pltpu.VMEM(buffer_shape, pool_dtype),  # V pages, two slots
            pltpu.SemaphoreType.DMA((2,)),  # K copies, per slot
            pltpu.SemaphoreType.DMA((2,)),  # V copies, per slot
            pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),  # running max
            pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),  # running sum
            pltpu.VMEM(tile_shape, jnp.float32),  # accumulator
            pltpu.SMEM((2,), jnp.int32),  # pipeline state
            *([pltpu.VMEM(scales_shape, jnp.float32),  # K scales of the pages, two slots
               pltpu.VMEM(scales_shape, jnp.float32),  # V scales
               pltpu.SemaphoreType.DMA((2,)),  # K scale copies, per slot
               pltpu.SemaphoreType.DMA((2,))]  # V scale copies, per slot
              if quantized_pools else []),
        ],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_tiles, *tile_shape), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=vmem_limit),
        interpret=interpret,
        name=name,
    )


@functools.partial(
    jax.jit, static_argnames=("max_query_len", "scale", "interpret", "pages_per_compute_block",
                              "batch_chunks", "sliding_window", "soft_cap"))
def ragged_paged_attention_tpu(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    max_query_len: int,
    scale: float | None = None,
    interpret: bool = False,
    pages_per_compute_block: int | None = None,
    batch_chunks: int = DEFAULT_BATCH_CHUNKS,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Attention of a ragged batch of queries over paged K/V, on TPU; the contract of
    `pallas_kernels.reference.paged_attention_reference`.

    Args:
      q: [T, num_heads, D] float32 or bfloat16 queries (already rotated). Query head h
        reads KV head h // (num_heads // num_kv_heads).
      k_pool, v_pool: [num_kv_heads, num_blocks, block_size, Dp], q's dtype, Dp >= D;
        lanes past D must be zero in owned slots. This step's K/V must already be written.
        Or both `quantized.QuantizedPool`s of one format: read as their dequantization,
        each page dequantized in the kernel as it is copied in, q attended in float32;
        block_size must then be a multiple of 32 (8-bit tiles). Slots that no sequence
        owns may hold anything, NaN included (a NaN scale too).
      block_tables: [S, max_blocks_per_seq] int32 block ids in [0, num_blocks); entries
        past a sequence's length are never read. The whole table is scalar-prefetched into
        SMEM, so S * max_blocks_per_seq must fit there.
      seq_lens: [S] int32 tokens of each sequence including this step's queries; 0 marks a
        padding sequence (no queries).
      query_start_loc: [S + 1] int32 offsets of each sequence's queries in `q` (its last
        tokens); tokens past `query_start_loc[S]` are padding, their rows zero.
      max_query_len: static upper bound on queries per sequence (1 for pure decode).
      scale: softmax scale, default D ** -0.5.
      interpret: run in interpret mode on CPU (`pltpu.InterpretParams` when available).
      pages_per_compute_block: pages per compute block; pages * block_size must be a
        multiple of 128. Default: 128 tokens' worth.
      batch_chunks: chunks of the tiles on the "parallel" grid axis (2 feeds both
        TensorCores of a megacore chip).
      sliding_window: a query at p sees only the keys (p - sliding_window, p]; a tile
        copies no page before its earliest query's window, and those pages' table entries
        may name any block.
      soft_cap: scores -> soft_cap * tanh(scores / soft_cap) (Gemma 2), before masking.

    Returns:
      [T, num_heads, D] in q's dtype.

    block_size must be a multiple of 8. A pool whose Dp is not a multiple of 128 is
    zero-padded here, which copies it: size pools to 128 lanes to avoid it.
    """
    check_ragged_inputs(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc,
                        max_query_len)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, pool_dim = k_pool.shape
    num_seqs = block_tables.shape[0]
    pages_per_compute_block = check_tiling(block_size, pages_per_compute_block, batch_chunks,
                                           k_pool)
    scale = head_dim**-0.5 if scale is None else scale
    group = num_heads // num_kv_heads
    # quantized pools are read in float32 (their dequantization), whatever q's dtype
    q_attend = q.astype(jnp.float32) if quantized.is_quantized(k_pool) else q
    sublanes = SUBLANES * (4 // q_attend.dtype.itemsize)  # 8 f32, 16 bf16
    layout = ragged_tiles.tile_layout(
        num_tokens, num_seqs, group, max_query_len, decode_rows=sublanes,
        prefill_rows=PREFILL_ROWS, round_rows=lambda n: round_up(n, sublanes))
    num_chunks = min(batch_chunks, layout.num_tiles)
    # extra tiles (to fill the last round of the chunks) are empty: make_tiles fills none
    layout = dataclasses.replace(layout, num_tiles=round_up(layout.num_tiles, num_chunks))
    tiles = ragged_tiles.make_tiles(layout, seq_lens, query_start_loc, num_tokens)

    q_tiles = ragged_tiles.gather_queries(q_attend, tiles, layout, pool_head_dim(pool_dim))
    out = attend_tiles(
        tiles.tile_seq, tiles.tile_kv_len, block_tables, tiles.row_pos, q_tiles, k_pool,
        v_pool, scale=scale, num_chunks=num_chunks,
        pages_per_compute_block=pages_per_compute_block, interpret=interpret,
        name="ragged_paged_attention_tpu", sliding_window=sliding_window,
        soft_cap=soft_cap)  # [N, K, R, Dp] f32
    return ragged_tiles.scatter_outputs(out, tiles, layout, num_tokens, head_dim, q.dtype)
