"""Input checks shared by the paged attention kernels' public wrappers."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import quantized


def check_decode_inputs(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                        block_tables: jax.Array, seq_lens: jax.Array) -> None:
    """Raise ValueError naming the first bad argument of a decode-attention call.

    q: [S, num_heads, head_dim]; k_pool, v_pool: [num_kv_heads, num_blocks, block_size,
    head_dim] in q's dtype (float32 or bfloat16), or two `quantized.QuantizedPool`s of
    one format; block_tables: [S, W] int32;
    seq_lens: [S] int32.
    """
    if block_tables.ndim != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables shape {block_tables.shape} must be [{q.shape[0]}, W]")
    _check_pools_and_tables(q, k_pool, v_pool, block_tables, seq_lens)
    head_dim, pool_head_dim = q.shape[2], k_pool.shape[3]
    if pool_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != pool head_dim {pool_head_dim}")


def check_ragged_inputs(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                        block_tables: jax.Array, seq_lens: jax.Array,
                        query_start_loc: jax.Array, max_query_len: int) -> None:
    """Raise ValueError naming the first bad argument of a ragged-attention call.

    q: [T, num_heads, D]; k_pool, v_pool: [num_kv_heads, num_blocks, block_size, Dp] in
    q's dtype (float32 or bfloat16), or two `quantized.QuantizedPool`s of one format, with
    Dp >= D (a pool padded to the lane width holds zeros past D); block_tables: [S, W]
    int32; seq_lens: [S] int32; query_start_loc: [S + 1] int32; max_query_len >= 1.
    """
    if q.ndim != 3:
        raise ValueError(f"q shape {q.shape} must be [T, num_heads, head_dim]")
    _check_pools_and_tables(q, k_pool, v_pool, block_tables, seq_lens)
    num_seqs = block_tables.shape[0]
    head_dim, pool_head_dim = q.shape[2], k_pool.shape[3]
    if pool_head_dim < head_dim:
        raise ValueError(f"q head_dim {head_dim} > pool head_dim {pool_head_dim}"
                         " (the pool may only be wider, with zero lanes past q's)")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc shape {query_start_loc.shape} must be ({num_seqs + 1},)")
    if query_start_loc.dtype != jnp.int32:
        raise ValueError(f"query_start_loc dtype {query_start_loc.dtype} must be int32")
    if max_query_len < 1:
        raise ValueError(f"max_query_len {max_query_len} must be >= 1")


def _check_pools_and_tables(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                            block_tables: jax.Array, seq_lens: jax.Array) -> None:
    """The checks every paged kernel shares; the sequence count S is block_tables' rows."""
    num_heads = q.shape[1]
    if len(k_pool.shape) != 4:
        raise ValueError(
            f"k_pool shape {k_pool.shape} must be [num_kv_heads, num_blocks, block_size, D]")
    num_kv_heads = k_pool.shape[0]
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool {k_pool.shape} and v_pool {v_pool.shape} differ in shape")
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"q dtype {q.dtype} not supported (float32 or bfloat16)")
    if quantized.is_quantized(k_pool) or quantized.is_quantized(v_pool):
        _check_quantized_pools(k_pool, v_pool)
    elif k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise ValueError(f"pool dtypes {k_pool.dtype}/{v_pool.dtype} must equal q's {q.dtype}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables shape {block_tables.shape} must be [S, W]")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens shape {seq_lens.shape} must be ({num_seqs},)")
    if block_tables.dtype != jnp.int32 or seq_lens.dtype != jnp.int32:
        raise ValueError(
            f"block_tables/seq_lens dtypes {block_tables.dtype}/{seq_lens.dtype} must be int32")


def _check_quantized_pools(k_pool, v_pool) -> None:
    """Both pools `quantized.QuantizedPool`s of one storage format, scales [K, N, B] float32
    (q may then be float32 or bfloat16: the kernels attend in float32)."""
    if not (quantized.is_quantized(k_pool) and quantized.is_quantized(v_pool)):
        raise ValueError("k_pool and v_pool must both be QuantizedPools or both float pools")
    if k_pool.dtype != v_pool.dtype:
        raise ValueError(f"quantized pool dtypes {k_pool.dtype}/{v_pool.dtype} must be equal")
    quantized.format_max(k_pool.dtype)  # raises for a dtype that is not a quantized format
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.scales.shape != pool.shape[:-1] or pool.scales.dtype != jnp.float32:
            raise ValueError(f"{name} scales {pool.scales.shape} {pool.scales.dtype} must be "
                             f"float32 {pool.shape[:-1]}")
