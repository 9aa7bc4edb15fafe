"""The one attention entry point models call: `paged_attention(q, k, v, layer_kv, metadata)`.

A model's attention layer hands over this step's rotated queries and new keys/values plus
its layer's slice of the KV pool; this module writes the new K/V into the pool through the
slot mapping and computes attention over everything the sequences have cached, on the
backend named in the metadata. The metadata is an explicit pytree argument of the jitted
step, never a global.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.constants import ATTENTION_BACKENDS as BACKENDS  # each described there
from pallas_kernels import cpu_ops, quantized
from pallas_kernels.blockwise import paged_attention_blockwise, write_kv
from pallas_kernels.reference import paged_attention_reference

# Backends that cost each sequence only its own queries and keys (no padding to
# max_query_len): the runner packs a step's decode and prefill into one call for them.
RAGGED_BACKENDS = ("cpp", "pallas_gpu", "pallas_tpu")
# The Pallas kernels and the platform each one is compiled for.
_PALLAS_PLATFORM = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}

# One layer's pool: (k_pool, v_pool), each [num_kv_heads, num_blocks, block_size, head_dim]
# (head-major: a block of one head is a contiguous [block_size, head_dim] tile, the layout the
# Pallas kernels and the CPU kernel read and the jnp path gathers without transposes), or with
# an 8-bit kv_cache_dtype each a `quantized.QuantizedPool` of that shape (values + scales).
LayerKV = tuple[jax.Array | quantized.QuantizedPool, jax.Array | quantized.QuantizedPool]


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs to know about one ragged step (T tokens, S sequences).

    Array fields (traced):
      slot_mapping: [T] int32 pool slot each new token's K/V is written to
        (block_id * block_size + offset); padding tokens write into reserved block 0.
      block_tables: [S, max_blocks_per_seq] int32; padding entries are 0.
      seq_lens: [S] int32 tokens of each sequence after this step (0 for padding rows).
      query_start_loc: [S + 1] int32 offsets of each sequence's tokens in the flat batch.
      logits_indices: [R] int32 rows of the flat batch whose logits are wanted, or None
        for all T rows.
      num_logits: [] int32 how many of logits_indices are wanted (the others are a bucket's
        padding, whose logits nobody reads: a model may leave them uncomputed), or None: all.
      window_slot_mapping, window_block_tables: the same for the layers with a sliding
        window when their KV lives in a pool of its own (the engine's window group, which
        frees the blocks that left the window: `jaxpage.engine.kv_groups`), else None and
        every layer uses slot_mapping / block_tables.
    Static fields (part of the compiled shape):
      max_query_len: most tokens any sequence has in this step. 1 marks a pure decode
        step, whose sequence i has its one token at row i (as build_metadata lays it out).
      backend: one of BACKENDS. The ragged backends (RAGGED_BACKENDS: the C++ kernel and
        the Pallas kernels) run decode tokens and prefill chunks of one step in one call;
        the Pallas backends run a pure decode step in their decode kernel.
      interpret: run the Pallas kernel in interpret mode (any platform, slow).
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    query_start_loc: jax.Array
    logits_indices: jax.Array | None = None
    num_logits: jax.Array | None = None
    window_slot_mapping: jax.Array | None = None
    window_block_tables: jax.Array | None = None
    max_query_len: int = 1
    backend: str = "jnp"
    interpret: bool = False  # run Pallas kernels in interpret mode (CPU testing)


jax.tree_util.register_dataclass(
    AttentionMetadata,
    data_fields=["slot_mapping", "block_tables", "seq_lens", "query_start_loc", "logits_indices",
                 "num_logits", "window_slot_mapping", "window_block_tables"],
    meta_fields=["max_query_len", "backend", "interpret"],
)


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layer_kv: LayerKV,
    metadata: AttentionMetadata,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[jax.Array, LayerKV]:
    """Write this step's K/V into the layer's pool and attend over the cached sequences.

    Args:
      q: [T, num_heads, head_dim] rotated queries.
      k, v: [T, num_kv_heads, head_dim] this step's rotated keys and values.
      layer_kv: (k_pool, v_pool), each [num_kv_heads, num_blocks, block_size, head_dim].
      metadata: the step's AttentionMetadata.
      scale: softmax scale, default head_dim ** -0.5.
      sliding_window: this layer attends only to the last `sliding_window` positions (the
        query's own included, HF's convention). With the metadata's window tables set, the
        layer's pool is the window group's and is addressed through them.
      soft_cap: attention-logit soft-capping (Gemma 2): scores -> cap * tanh(scores / cap).

    Returns:
      ([T, num_heads, head_dim] attention output in q's dtype, updated layer_kv).
    """
    if metadata.backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {metadata.backend!r}; choose from {BACKENDS}")
    head_dim, pool_dim = q.shape[-1], layer_kv[0].shape[-1]
    scale = head_dim**-0.5 if scale is None else scale
    slot_mapping, block_tables = metadata.slot_mapping, metadata.block_tables
    if sliding_window is not None and metadata.window_block_tables is not None:
        slot_mapping, block_tables = metadata.window_slot_mapping, metadata.window_block_tables
    # the kernels' options, passed only when set (a kernel without them is then never asked)
    options = {k: v for k, v in (("sliding_window", sliding_window), ("soft_cap", soft_cap))
               if v is not None}
    if pool_dim > head_dim:  # a pool padded at allocation (pool_head_dim): zeros past head_dim
        pad = ((0, 0), (0, 0), (0, pool_dim - head_dim))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    k_pool, v_pool = write_kv(*layer_kv, k, v, slot_mapping)
    if metadata.backend in _PALLAS_PLATFORM and metadata.max_query_len == 1:
        # A decode step (the runner puts sequence i's one token at row i) goes to the decode
        # kernel: no tiling of queries, and 6-33% faster than the ragged kernel on an H200
        # (docs/bench/h200_kernels_run2.log).
        num_seqs = metadata.seq_lens.shape[0]
        q_pool = jnp.pad(q[:num_seqs], ((0, 0), (0, 0), (0, pool_dim - head_dim)))
        out = _pallas_kernel(metadata.backend, decode=True)(
            q_pool, k_pool, v_pool, block_tables, metadata.seq_lens, scale=scale,
            interpret=metadata.interpret, **options)
        out = jnp.zeros_like(q).at[:num_seqs].set(out[..., :head_dim].astype(q.dtype))
        return out, (k_pool, v_pool)
    if metadata.backend in _PALLAS_PLATFORM:  # ragged: decode tokens and chunks in one call
        out = _pallas_kernel(metadata.backend)(
            q, k_pool, v_pool, block_tables, metadata.seq_lens,
            metadata.query_start_loc, max_query_len=metadata.max_query_len, scale=scale,
            interpret=metadata.interpret, **options)
        return out, (k_pool, v_pool)
    if pool_dim > head_dim:  # zero lanes of q meet zero lanes of K: the scores are unchanged
        q = jnp.pad(q, ((0, 0), (0, 0), (0, pool_dim - head_dim)))
    if metadata.backend == "cpp":
        out = cpu_ops.paged_attention_cpu(q, k_pool, v_pool, block_tables,
                                                metadata.seq_lens, metadata.query_start_loc,
                                                scale=scale, **options)
    else:
        attend = paged_attention_reference if metadata.backend == "reference" else (
            paged_attention_blockwise)
        out = attend(q, k_pool, v_pool, block_tables, metadata.seq_lens,
                     metadata.query_start_loc, max_query_len=metadata.max_query_len,
                     scale=scale, **options)
    return out[..., :head_dim], (k_pool, v_pool)


def select_backend(requested: str, *, interpret: bool, head_dim: int, block_size: int,
                   dtype) -> str:
    """The backend that serves `requested` ("auto" or one of BACKENDS) on this platform.

    "auto" is the platform's Pallas kernels on TPU and GPU, and on CPU the C++ kernel
    where it serves the pool (float32 or bfloat16, built on this machine), else the blockwise
    jnp path.
    A backend that cannot run here raises ValueError saying why; a Pallas kernel forced onto
    another platform needs `interpret`.
    """
    platform = jax.default_backend()
    if requested == "auto":
        if platform == "cpu":
            usable = cpu_ops.unsupported_reason(head_dim, block_size, dtype) is None
            return "cpp" if usable else "jnp"
        return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(platform, "jnp")
    if requested not in BACKENDS:
        raise ValueError(f"attention_backend must be 'auto' or one of {BACKENDS}, "
                         f"got {requested!r}")
    if requested == "cpp":
        if platform != "cpu":
            raise ValueError(f"attention_backend 'cpp' runs on the CPU (this is {platform!r})")
        reason = cpu_ops.unsupported_reason(head_dim, block_size, dtype)
        if reason is not None:
            raise ValueError(f"attention_backend 'cpp' cannot serve this model: {reason}")
    native = _PALLAS_PLATFORM.get(requested)
    if native is not None and native != platform and not interpret:
        raise ValueError(f"attention_backend {requested!r} needs a {native.upper()} (this is "
                         f"{platform!r}); set kernel_interpret=True to run it interpreted")
    return requested


def _pallas_kernel(backend: str, decode: bool = False):
    """The platform's ragged kernel, or its decode kernel (one query per sequence)."""
    if backend == "pallas_gpu":
        from pallas_kernels.paged_decode_gpu import paged_decode_attention_gpu
        from pallas_kernels.ragged_paged_gpu import ragged_paged_attention_gpu

        return paged_decode_attention_gpu if decode else ragged_paged_attention_gpu
    from pallas_kernels.paged_decode_tpu import paged_decode_attention_tpu
    from pallas_kernels.ragged_paged_tpu import ragged_paged_attention_tpu

    return paged_decode_attention_tpu if decode else ragged_paged_attention_tpu


def pool_head_dim(backend: str, head_dim: int) -> int:
    """The head dim the KV pool is allocated with for `backend`: the lanes its kernel reads
    without a copy (TPU: whole 128-lane vregs; GPU Triton: a power of 2), padded once at
    allocation instead of on every call. The other backends read head_dim as is."""
    if backend == "pallas_tpu":
        from pallas_kernels.ragged_paged_tpu import pool_head_dim as kernel_pool_head_dim
    elif backend == "pallas_gpu":
        from pallas_kernels.ragged_paged_gpu import pool_head_dim as kernel_pool_head_dim
    else:
        return head_dim
    return kernel_pool_head_dim(head_dim)


def init_kv_pool(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: jnp.dtype = jnp.float32,
    fill_value: float = 0.0,
    sharding: jax.sharding.Sharding | None = None,
) -> list[LayerKV]:
    """Preallocate the paged KV pool: per layer a (k, v) pair of
    [num_kv_heads, num_blocks, block_size, head_dim] filled with `fill_value` (zeros; NaN to
    make reads of unwritten slots show). Block 0 is reserved for padding. With a `sharding`
    (tensor parallel: over KV heads) each device allocates only its own share.

    A quantized `dtype` (int8, float8_*: `quantized.FORMATS`) gives each of k and v as a
    `QuantizedPool`: zero values and scales of `fill_value`, or 1 for a zero fill (a NaN
    scale makes the slot read NaN whatever the format)."""
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    if quantized.is_format(dtype):
        def new():
            return quantized.empty_pool(shape, dtype, device=sharding,
                                        scale_fill=1.0 if fill_value == 0 else fill_value)
    else:
        def new():
            return jnp.full(shape, fill_value, dtype, device=sharding)
    return [(new(), new()) for _ in range(num_layers)]


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: jnp.dtype
) -> int:
    """Bytes one block occupies across all layers, K and V (with a quantized dtype's
    float32 scale per head and token)."""
    row = head_dim * jnp.dtype(dtype).itemsize
    if quantized.is_format(dtype):
        row += 4
    return 2 * num_layers * block_size * num_kv_heads * row


def build_metadata(
    block_tables: list[list[int]],
    num_computed: list[int],
    num_new: list[int],
    block_size: int,
    *,
    max_blocks_per_seq: int | None = None,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    max_query_len: int | None = None,
    logits_indices: list[int] | None = None,
    num_logits: int | None = None,
    backend: str = "jnp",
    interpret: bool = False,
    window_block_tables: list[list[int]] | None = None,
) -> tuple[np.ndarray, AttentionMetadata]:
    """Host-side packing of one step: `(positions [T], metadata)` as numpy int32 arrays.

    Sequence `s` has `num_computed[s]` tokens already in the pool and `num_new[s]` new
    tokens in this step, laid out one sequence after another. The optional sizes pad the
    arrays to a fixed shape bucket: padding tokens write into block 0 and padding sequences
    have length 0. `logits_indices` defaults to the last new token of every sequence.
    `window_block_tables` are the window group's tables (entries before a sequence's window
    may be the null block), packed the same way into the window fields.
    """
    # Whole-batch NumPy, not a loop over sequences: at 256 decoding sequences the loop's
    # per-sequence slices and conversions cost ~1.3 ms of a step's host work (a GPU's step
    # waits on it), these ~0.2 ms.
    count = len(block_tables)
    lens = np.fromiter(map(len, block_tables), np.int64, count=count)
    total_new = sum(num_new)
    num_tokens = total_new if num_tokens is None else num_tokens
    num_seqs = count if num_seqs is None else num_seqs
    width = max_blocks_per_seq or (int(lens.max()) if count else 1)
    if num_tokens < total_new or num_seqs < count:
        raise ValueError(f"bucket ({num_tokens} tokens, {num_seqs} seqs) smaller than the batch")
    new = np.asarray(num_new, np.int64).reshape(count)
    computed = np.asarray(num_computed, np.int64).reshape(count)
    ends = computed + new
    over = np.flatnonzero(ends > lens * block_size)
    if over.size:
        s = int(over[0])
        raise ValueError(f"sequence {s}: {ends[s]} tokens exceed its {lens[s]} blocks of "
                         f"{block_size}")
    starts = np.cumsum(new) - new  # each sequence's first new token
    seq_lens = np.zeros(num_seqs, np.int32)
    seq_lens[:count] = ends
    query_start_loc = np.full(num_seqs + 1, total_new, np.int32)
    query_start_loc[:count] = starts
    token_seq = np.repeat(np.arange(count), new)  # the sequence of each new token
    positions = np.zeros(num_tokens, np.int32)
    positions[:total_new] = np.arange(total_new) - starts[token_seq] + computed[token_seq]
    new_positions = positions[:total_new]

    def pack(group_tables: list[list[int]], sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot mapping [T], tables [S, width]) of one group's block tables (their lengths
        `sizes`)."""
        tables = np.zeros((num_seqs, width), np.int32)
        filled = int(sizes.sum())
        if filled:
            flat = np.fromiter(itertools.chain.from_iterable(group_tables), np.int32,
                               count=filled)
            rows = np.repeat(np.arange(len(group_tables)), sizes)
            tables[rows, np.arange(filled) - np.repeat(np.cumsum(sizes) - sizes, sizes)] = flat
        slot_mapping = np.zeros(num_tokens, np.int32)  # padding -> slots of block 0
        slot_mapping[:total_new] = (tables[token_seq, new_positions // block_size] * block_size
                                    + new_positions % block_size)
        return slot_mapping, tables

    slot_mapping, tables = pack(block_tables, lens)
    window_slots = window_tables = None
    if window_block_tables is not None:
        window_slots, window_tables = pack(window_block_tables, np.fromiter(
            map(len, window_block_tables), np.int64, count=len(window_block_tables)))
    if logits_indices is None:  # each sequence's last new token
        logits_indices = query_start_loc[1:count + 1] - 1
    indices = np.zeros(num_logits or len(logits_indices), np.int32)
    indices[: len(logits_indices)] = logits_indices
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        logits_indices=indices,
        num_logits=np.int32(len(logits_indices)),
        window_slot_mapping=window_slots,
        window_block_tables=window_tables,
        max_query_len=max_query_len or max(num_new, default=1),
        backend=backend,
        interpret=interpret,
    )
    return positions, metadata
