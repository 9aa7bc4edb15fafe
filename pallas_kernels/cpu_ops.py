"""JAX functions over jaxpage's CPU kernel library (`cpu_library`), called through XLA FFI.

`paged_attention_cpu` has the same contract as `reference.paged_attention_reference`. XLA:CPU
fuses no gather into a contraction (and Pallas has no CPU backend), so the jnp path copies
every block it reads before contracting it; this kernel reads each [block_size, head_dim]
tile of K and V where it lies in the pool.

bfloat16 pools are read as they lie, in one of two ways: "dot", on the AVX512-BF16 dot product
`vdpbf16ps` (q.K and P.V; the probabilities P are rounded to bfloat16 before P.V, everything
else of the softmax is float32), compiled in where the build targets a CPU with AVX512-BF16
(`bf16_dot_compiled()`); or "portable", each tile widened to float32 (exact) and run through
the float32 code (only the output is rounded). It can be forced to "portable" per call
(`bf16_dot=False`) or per process (`JAXPAGE_CPU_KERNEL_BF16=portable`), for tests of the
fallback on machines that have the instruction.

Quantized pools (`quantized.QuantizedPool`: int8, float8_e4m3fn or float8_e5m2 values with a
float32 scale per KV head and slot) are read the portable way: each K/V tile is dequantized
into float32 scratch (`float32(value) * scale`, exactly `quantized.dequantize`), so the output
is bit for bit the float32 kernel's on `quantized.dequantize_pool` of the pools.

The other ops: `small_matmul`, x [M, K] times weights [K, N] (or [N, K]) with few rows,
streaming the weights once; `packed_matmul`, weights packed once (`pack_weight`) into column
panels, each one sequential stream, for any number of rows (a model's projections on CPU; on
a CPU with AMX-BF16 it runs bfloat16 on the AMX tiles from 3 live rows on, `packed_tiles()`,
held to the float64 bound rather than bit for bit; `JAXPAGE_CPU_KERNEL_TILES=0` keeps the
vector path); `packed_matmul_int8`, the same for int8 weights (`pack_weight_int8`) with a
float32 scale per column, a quarter of float32's bytes read (x scaled to int16 a row, integer
multiply-adds); `lora_matmul`, each row's LoRA
adapter delta added to a projection's output, the rows grouped by adapter
(`pallas_kernels.lora` chooses it on CPU); `greedy_draw`, each row's argmax and its
log-probability in one pass; `set_rows`, narrow-float rows written into a pool in place; the
elementwise glue between a layer's matmuls (`add_rms_norm`, `silu_mul`, `qkv_rope`); and
`decoder_layer`, a whole Llama layer in one call on a team of threads.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_library, quantized

# what the library was built with, asked by callers choosing an op (re-exported)
from pallas_kernels.cpu_library import (  # noqa: F401
    available,
    bf16_dot_compiled,
    packed_tiles,
    wide_vectors,
)

# Query tokens per work item in prefill (x the GQA group = rows contracted against each
# K/V tile while it is in cache). Decode items have one token.
QUERY_TILE = 32


def _default_tiles() -> bool:
    value = os.environ.get("JAXPAGE_CPU_KERNEL_TILES", "1")
    if value not in ("0", "1"):
        raise ValueError(f"JAXPAGE_CPU_KERNEL_TILES must be '0' or '1', got {value!r}")
    return value == "1"


def _default_bf16_dot() -> bool:
    value = os.environ.get("JAXPAGE_CPU_KERNEL_BF16", "dot")
    if value not in ("dot", "portable"):
        raise ValueError(f"JAXPAGE_CPU_KERNEL_BF16 must be 'dot' or 'portable', got {value!r}")
    return value == "dot"


MAX_TILE = 256  # largest head_dim and block_size the kernel serves (cpu/attention.h)
POOL_DTYPES = (jnp.float32, jnp.bfloat16)  # the float pools it reads (q and the output alike)
# the storage dtypes of the QuantizedPools it reads (q cast to float32, the output float32)
QUANTIZED_DTYPES = tuple(jnp.dtype(name) for name in quantized.FORMATS)


def unsupported_reason(head_dim: int, block_size: int, dtype) -> str | None:
    """Why the kernel cannot serve this pool, or None if it can (building it if needed).

    `dtype` is a float pool's dtype, or a `QuantizedPool`'s storage dtype (its `.dtype`: int8,
    float8_e4m3fn or float8_e5m2)."""
    if jnp.dtype(dtype) not in (*POOL_DTYPES, *QUANTIZED_DTYPES):
        names = ", ".join(jnp.dtype(d).name for d in (*POOL_DTYPES, *QUANTIZED_DTYPES))
        return (f"the kernel reads float32 or bfloat16 pools or quantized ones ({names} in "
                f"all), not {jnp.dtype(dtype).name}")
    if head_dim > MAX_TILE or block_size > MAX_TILE:
        return f"head_dim {head_dim} and block_size {block_size} must be <= {MAX_TILE}"
    if not available():
        return ("the kernel is not available (JAXPAGE_NO_CPU_KERNEL is set, or its build "
                "failed: see the warning)")
    return None


def paged_attention_cpu(
    q: jax.Array,
    k_pool: jax.Array | quantized.QuantizedPool,
    v_pool: jax.Array | quantized.QuantizedPool,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    scale: float | None = None,
    query_tile: int = QUERY_TILE,
    bf16_dot: bool | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    key_splits: int = 0,
) -> jax.Array:
    """`paged_attention_reference`'s contract (no `max_query_len` needed: the kernel walks
    each sequence's queries), float32 or bfloat16 pools (both the same dtype; q is cast to
    it, the result back to q's dtype), or two `QuantizedPool`s of one storage dtype (int8,
    float8_e4m3fn, float8_e5m2: q is cast to float32 and the float32 result back to q's dtype;
    the result equals, bit for bit, this function's on `quantized.dequantize_pool` of each
    pool); the kernel must be `available()`.

    `bf16_dot` (bfloat16 pools only): True takes the AVX512-BF16 path where the build has it,
    False the portable one; None reads `JAXPAGE_CPU_KERNEL_BF16` ("dot", the default, or
    "portable"). `sliding_window` and `soft_cap` as the reference's: the kernel reads no
    block before the first key a work item's earliest query sees.

    `key_splits`: a decode query's keys (a single-token work item: one sequence's KV head) may
    be cut into parts of consecutive blocks that the threads read at once, their softmax sums
    merged after (split-K, as flash decoding); 0 (default) lets the kernel choose (where a step
    has fewer than two items a thread: few sequences), 1 never cuts, k > 1 cuts every such
    item into up to k parts (for tests and benchmarks). Within float32 rounding of the uncut
    result, not bit for bit."""
    if not available():
        raise RuntimeError("the CPU attention kernel is not available; use the jnp path")
    pool_dtype = jnp.dtype(k_pool.dtype)
    k_quantized, v_quantized = quantized.is_quantized(k_pool), quantized.is_quantized(v_pool)
    if k_quantized or v_quantized:
        if not (k_quantized and v_quantized and jnp.dtype(v_pool.dtype) == pool_dtype
                and pool_dtype in QUANTIZED_DTYPES):
            kinds = ["quantized " if k_quantized else "", "quantized " if v_quantized else ""]
            raise ValueError(
                f"the kernel reads quantized K and V pools of one storage dtype (int8, "
                f"float8_e4m3fn or float8_e5m2), got K {kinds[0]}{pool_dtype.name} and V "
                f"{kinds[1]}{jnp.dtype(v_pool.dtype).name}")
    elif jnp.dtype(v_pool.dtype) != pool_dtype or pool_dtype not in POOL_DTYPES:
        raise ValueError(f"the kernel reads float32 or bfloat16 pools of one dtype, got K "
                         f"{pool_dtype.name} and V {jnp.dtype(v_pool.dtype).name}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    if key_splits < 0:
        raise ValueError(f"key_splits must be >= 0 (0: the kernel chooses), got {key_splits}")
    attrs = dict(scale=np.float32(scale), query_tile=np.int64(query_tile),
                 sliding_window=np.int64(sliding_window or 0),  # 0 and 0.0: off
                 soft_cap=np.float32(soft_cap or 0.0), key_splits=np.int64(key_splits))
    tables_etc = (block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32),
                  query_start_loc.astype(jnp.int32))
    if k_quantized:
        out = jax.ffi.ffi_call(cpu_library.TARGET_QUANTIZED,
                               jax.ShapeDtypeStruct(q.shape, jnp.float32))(
            q.astype(jnp.float32), k_pool.values, k_pool.scales.astype(jnp.float32),
            v_pool.values, v_pool.scales.astype(jnp.float32), *tables_etc, **attrs)
        return out.astype(q.dtype)
    if pool_dtype == jnp.bfloat16:
        target = cpu_library.TARGET_BF16
        attrs["bf16_dot"] = np.int64(_default_bf16_dot() if bf16_dot is None else bf16_dot)
    else:
        target = cpu_library.TARGET
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, pool_dtype))(
        q.astype(pool_dtype), k_pool, v_pool, *tables_etc, **attrs)
    return out.astype(q.dtype)


def set_rows(pool: jax.Array, index: jax.Array, values: jax.Array, *,
             token_major: bool = False) -> jax.Array:
    """`pool.reshape(K, N, *row).at[:, index].set(values)` in pool's shape, written in place
    by the kernel library (the result aliases the pool; XLA copies it first only where the
    pool is still needed): values [K, T, *row] of the pool's dtype ([T, K, *row] with
    `token_major`: a step's new K/V as the projection leaves them, read where they lie
    instead of transposed by XLA first), index [T] int32 within [0, N), the pool any shape
    [K, ...] whose rows are `row` (pass a [K, blocks, block_size, D] pool as it is, not
    reshaped: XLA copies an aliased operand that is a reshape). The kernel must be
    `available()`."""
    if not available():
        raise RuntimeError("the CPU kernel library is not available")
    return jax.ffi.ffi_call(cpu_library.TARGET_SET_ROWS,
                            jax.ShapeDtypeStruct(pool.shape, pool.dtype),
                            input_output_aliases={0: 0})(
        pool, index.astype(jnp.int32), values.astype(pool.dtype),
        token_major=np.int64(bool(token_major)))


def greedy_draw(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(tokens [R] int32, log-probabilities [R] float32) of logits [R, V] float32: each row's
    first maximum (its first NaN where it has one), as `jnp.argmax`, and that token's
    log-probability `logit - jax.nn.logsumexp(row)` (NaN where the row's maximum is not finite,
    as that formula gives). The sum of exponentials runs in the kernel's order, so the
    log-probability is that formula's to float32 rounding, not bit for bit. The kernel must be
    `available()`."""
    if not available():
        raise RuntimeError("the CPU kernel library is not available")
    if logits.ndim != 2 or logits.shape[1] < 1:
        raise ValueError(f"greedy_draw takes logits [R, V >= 1], got {logits.shape}")
    rows = logits.shape[0]
    return jax.ffi.ffi_call(cpu_library.TARGET_GREEDY_DRAW,
                            (jax.ShapeDtypeStruct((rows,), jnp.int32),
                             jax.ShapeDtypeStruct((rows,), jnp.float32)))(
        logits.astype(jnp.float32))


SMALL_MATMUL_DTYPES = (jnp.float32, jnp.bfloat16)


def small_matmul(x: jax.Array, w: jax.Array, *, transpose_w: bool = False,
                 bf16_dot: bool | None = None) -> jax.Array:
    """x [M, K] @ w [K, N] (or @ w.T for w [N, K] with `transpose_w`, a tied LM head) as
    float32 [M, N]: x and w of one dtype, float32 or bfloat16, products and sums in float32
    (bfloat16 widened exactly), as `jnp.dot(x, w, preferred_element_type=jnp.float32)`. Made
    for few rows (a decode step's; `jaxpage.layers.SMALL_MATMUL_ROWS` says up to where it
    beats XLA's dot): each weight is read once and used for all rows while in registers; any
    M is correct. The kernel must be `available()`.

    `bf16_dot` (bfloat16 only), as `paged_attention_cpu`'s: True takes the AVX512-BF16
    `vdpbf16ps` path where the build has it (products exact, float32 sums, subnormal inputs
    and results flushed to zero), False widens to float32 (exact, then float32 FMAs); None
    reads `JAXPAGE_CPU_KERNEL_BF16`."""
    if not available():
        raise RuntimeError("the CPU kernel library is not available")
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"small_matmul takes matrices, got x {x.shape} and w {w.shape}")
    if jnp.dtype(x.dtype) != jnp.dtype(w.dtype) or jnp.dtype(x.dtype) not in SMALL_MATMUL_DTYPES:
        raise ValueError(f"small_matmul takes x and w of one dtype, float32 or bfloat16, got "
                         f"{jnp.dtype(x.dtype).name} and {jnp.dtype(w.dtype).name}")
    k = w.shape[1] if transpose_w else w.shape[0]
    if x.shape[1] != k:
        layout = "[N, K]" if transpose_w else "[K, N]"
        raise ValueError(f"x {x.shape} does not contract with w {w.shape} ({layout})")
    n = w.shape[0] if transpose_w else w.shape[1]
    return jax.ffi.ffi_call(cpu_library.TARGET_SMALL_MATMUL,
                            jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(
        x, w, transpose_w=np.int64(bool(transpose_w)),
        bf16_dot=np.int64(_default_bf16_dot() if bf16_dot is None else bool(bf16_dot)))


def panel_columns() -> int:
    """Columns in a packed weight's panel: two of the kernel's vectors (cpu/packed_panels.h
    kPanel), 32 where the library was built for AVX-512, else 16. It is the build's, so a
    packing is for the machine that made it, as the runner's is. The kernel must be
    `available()`."""
    library = cpu_library.loaded()
    if library is None:
        raise RuntimeError("the CPU kernel library is not available")
    return int(library.JaxpagePanelColumns())


def _group(dtype) -> int:
    """Rows a packed weight interleaves: 2 for bfloat16 (vdpbf16ps's pairs), 1 for float32."""
    return 2 if jnp.dtype(dtype) == jnp.bfloat16 else 1


def packable(w: jax.Array) -> bool:
    """Whether `pack_weight` takes w: a float32 or bfloat16 [K, N] matrix, N a multiple of
    `panel_columns()`, and the kernel available."""
    return (w.ndim == 2 and jnp.dtype(w.dtype) in (jnp.float32, jnp.bfloat16)
            and available() and w.shape[1] % panel_columns() == 0)


def pack_weight(w: jax.Array) -> jax.Array:
    """w [K, N] (float32 or bfloat16, N a multiple of PANEL = `panel_columns()`) -> [N / PANEL,
    ceil(K / G), PANEL, G], the layout `packed_matmul` streams: panel p holds columns p *
    PANEL.., row after row in groups of G rows interleaved column by column (G = 2 for
    bfloat16, the pairs the dot product instruction takes, an odd K's last row paired with
    zeros; 1 for float32). The same bytes as w (plus one zero row for a bfloat16 w of odd K); a
    NumPy array in, a NumPy array out."""
    if not packable(w):
        panel = panel_columns()  # raises where the kernel is not available
        raise ValueError(f"pack_weight takes a float32 or bfloat16 [K, N] matrix with N a "
                         f"multiple of {panel}, got {jnp.dtype(w.dtype).name} {tuple(w.shape)}")
    return _pack_panels(w, _group(w.dtype))


def _pack_panels(w: jax.Array, g: int) -> jax.Array:
    """w [K, N] -> [N / PANEL, ceil(K / g), PANEL, g] (an odd K's last group padded with zero
    rows); a NumPy array packs on the host."""
    k, n = w.shape
    panel = panel_columns()
    xp = np if isinstance(w, np.ndarray) else jnp
    if k % g:
        w = xp.concatenate([w, xp.zeros((g - k % g, n), w.dtype)])
    packed = w.reshape(-1, g, n // panel, panel).transpose(2, 0, 3, 1)
    return np.ascontiguousarray(packed) if xp is np else packed


def unpack_weight(packed: jax.Array, k: int | None = None) -> jax.Array:
    """`pack_weight`'s inverse: [P, KG, PANEL, G] -> [k, P * PANEL] (k defaults to KG * G)."""
    p, kg, panel, g = packed.shape
    w = packed.transpose(1, 3, 0, 2).reshape(kg * g, p * panel)
    return w if k is None else w[:k]


MAX_PREFETCH_BYTES = 1 << 20  # the handler's kMaxPrefetchBytes


def packed_matmul(x: jax.Array, packed: jax.Array, *, live_rows: jax.Array | int | None = None,
                  bf16_dot: bool | None = None, tiles: bool | None = None,
                  prefetch_bytes: int = 0, layer: int | None = None) -> jax.Array:
    """x [M, K] @ w, given `pack_weight(w)` (x of w's dtype), as float32 [M, N]: products and
    sums as `small_matmul(x, w, bf16_dot=...)`'s [K, N] tiles', bit for bit (float32 sums in k's
    order; `bf16_dot` as there). Any M: up to 8 rows (6 on a CPU without AVX-512) are computed
    in one pass over each panel, more re-read it from cache (the rows split evenly among the
    passes). `tiles` (default: `JAXPAGE_CPU_KERNEL_TILES`, "1" unless set to "0"): bfloat16 on
    the dot path runs on AMX tiles where `packed_tiles()` and at least 3 rows are live, 32
    rows a pass (two blocks of 16), products exact and sums in float32 in the hardware's order
    (within the float32 bound of the exact product, not bit for bit the vector path's);
    elsewhere it has no effect. `live_rows`
    (an int32 scalar, traced or not; default M): only x's first `live_rows` rows are
    multiplied, the output's other rows are zeros (a shape bucket's padding rows, whose
    products no one reads). `prefetch_bytes`: how far ahead in a panel's stream the walk
    prefetches; 0 (default) lets the kernel choose by the rows of a pass (a tuning knob for
    `scripts/lab/matmul_prefetch_ab.py --bytes`; the result does not depend on it). `layer`:
    `packed` is a stack of packed weights [L, ...] (`np.stack` of them) and the matmul reads its
    layer `layer` in place (nothing copied: a slice of it in XLA would be). The kernel must be
    `available()`."""
    if not available():
        raise RuntimeError("the CPU kernel library is not available")
    packed_shape = _layer_shape("packed_matmul", packed, layer)
    dtype = jnp.dtype(x.dtype)
    if dtype not in (jnp.float32, jnp.bfloat16) or jnp.dtype(packed.dtype) != dtype:
        raise ValueError(f"packed_matmul takes x and a packed weight of one dtype, float32 or "
                         f"bfloat16, got {dtype.name} and {jnp.dtype(packed.dtype).name}")
    g, panel = _group(dtype), panel_columns()
    if (x.ndim != 2 or len(packed_shape) != 4 or packed_shape[2:] != (panel, g)
            or -(-x.shape[1] // g) != packed_shape[1]):
        raise ValueError(f"packed_matmul takes x [M, K] and a packed {dtype.name} weight "
                         f"[N / {panel}, ceil(K / {g}), {panel}, {g}], got x {tuple(x.shape)} "
                         f"and {packed_shape}")
    if not 0 <= prefetch_bytes <= MAX_PREFETCH_BYTES:
        raise ValueError(f"prefetch_bytes must be in [0, {MAX_PREFETCH_BYTES}] (0: by the rows), "
                         f"got {prefetch_bytes}")
    n = packed_shape[0] * panel
    live = jnp.asarray(x.shape[0] if live_rows is None else live_rows, jnp.int32).reshape(())
    return jax.ffi.ffi_call(cpu_library.TARGET_PACKED_MATMUL,
                            jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(
        x, packed, live,
        bf16_dot=np.int64(_bf16_dot_mode(bf16_dot, tiles)), prefetch_bytes=np.int64(prefetch_bytes),
        layer=np.int64(-1 if layer is None else layer))


def _layer_shape(op: str, array, layer: int | None) -> tuple[int, ...]:
    """The shape `op` reads of `array`: its own, or with `layer` one layer's of a stack [L, ...]
    (`layer` in [0, L), checked)."""
    shape = tuple(array.shape)
    if layer is None:
        return shape
    if not shape or not 0 <= layer < shape[0]:
        raise ValueError(f"{op}: layer {layer} is outside the stacked {shape} (a leading axis "
                         "of layers)")
    return shape[1:]



def packable_int8(w: jax.Array) -> bool:
    """Whether `pack_weight_int8` takes w: an int8 [K, N] matrix, N a multiple of
    `panel_columns()`, and the kernel available."""
    return (w.ndim == 2 and jnp.dtype(w.dtype) == jnp.int8 and available()
            and w.shape[1] % panel_columns() == 0)


def pack_weight_int8(w: jax.Array) -> jax.Array:
    """w [K, N] int8 (N a multiple of PANEL = `panel_columns()`) -> [N / PANEL, ceil(K / 2),
    PANEL, 2], the layout `packed_matmul_int8` streams: bfloat16's (`pack_weight`), panel p
    holding columns p * PANEL.. in pairs of rows interleaved column by column (the pairs the
    int16 multiply-add takes; an odd K's last row paired with zeros), half of its bytes (the
    same bytes as w, plus one zero row for an odd K). A NumPy array in, a NumPy array out."""
    if not packable_int8(w):
        panel = panel_columns()  # raises where the kernel is not available
        raise ValueError(f"pack_weight_int8 takes an int8 [K, N] matrix with N a multiple of "
                         f"{panel}, got {jnp.dtype(w.dtype).name} {tuple(w.shape)}")
    return _pack_panels(w, 2)


def unpack_weight_int8(packed: jax.Array, k: int | None = None) -> jax.Array:
    """`pack_weight_int8`'s inverse: [P, KG, PANEL, 2] -> [k, P * PANEL] (k defaults to
    2 KG)."""
    return unpack_weight(packed, k)


def packed_matmul_int8(x: jax.Array, packed: jax.Array, scale: jax.Array, *,
                       live_rows: jax.Array | int | None = None,
                       prefetch_bytes: int = 0, layer: int | None = None) -> jax.Array:
    """(x [M, K] @ w) * scale[None, :] as float32 [M, N], given `pack_weight_int8(w)` of an int8
    w [K, N] and its columns' scales `scale` [N] (cast to float32), x float32 or bfloat16.
    Each row of x is scaled to int16, x_q = rint(x / s) with s = max|x[m]| / 32767 (float64
    arithmetic, s then rounded to float32), and multiplied by w's integers exactly in int32
    sums of 256 rows of k at a time (the pairs of an int16 multiply-add, vpdpwssd or vpmaddwd),
    each chunk converted to float32 and added in k's order; each sum is then times
    (scale[n] * s) (that product rounded first). So the result is bit for bit that integer
    arithmetic whatever the rows, threads and prefetch distance, and within s / 2 *
    sum_k |w[k, n]| * |scale[n]| (x's rounding: 2^-16 of max|x| relative) plus float32's
    roundings of the exact product. A row of zeros gives zeros; a row holding a NaN or an inf
    gives NaNs (it has no scale). Any M: up to 8 rows (6 on a CPU without AVX-512) in one pass
    over each panel, more in more passes that widen it again from cache (cpu/matmul_int8.h).
    `live_rows`, `prefetch_bytes` and `layer` as `packed_matmul`'s (rows past `live_rows` are
    zeros; with `layer`, `packed` [L, ...] and `scale` [L, N] are stacks). The kernel must be
    `available()`."""
    if not available():
        raise RuntimeError("the CPU kernel library is not available")
    packed_shape = _layer_shape("packed_matmul_int8", packed, layer)
    scale_shape = _layer_shape("packed_matmul_int8", scale, layer)
    dtype = jnp.dtype(x.dtype)
    if dtype not in (jnp.float32, jnp.bfloat16) or jnp.dtype(packed.dtype) != jnp.int8:
        raise ValueError(f"packed_matmul_int8 takes x float32 or bfloat16 and an int8 packed "
                         f"weight, got {dtype.name} and {jnp.dtype(packed.dtype).name}")
    panel = panel_columns()
    if (x.ndim != 2 or len(packed_shape) != 4 or packed_shape[2:] != (panel, 2)
            or (x.shape[1] + 1) // 2 != packed_shape[1]):
        raise ValueError(f"packed_matmul_int8 takes x [M, K] and a packed int8 weight "
                         f"[N / {panel}, ceil(K / 2), {panel}, 2], got x {tuple(x.shape)} and "
                         f"{packed_shape}")
    n = packed_shape[0] * panel
    if scale_shape != (n,):
        raise ValueError(f"packed_matmul_int8 takes a scale [N] = [{n}], one a column, got "
                         f"{scale_shape}")
    if not 0 <= prefetch_bytes <= MAX_PREFETCH_BYTES:
        raise ValueError(f"prefetch_bytes must be in [0, {MAX_PREFETCH_BYTES}] (0: by the rows), "
                         f"got {prefetch_bytes}")
    live = jnp.asarray(x.shape[0] if live_rows is None else live_rows, jnp.int32).reshape(())
    return jax.ffi.ffi_call(cpu_library.TARGET_PACKED_MATMUL_INT8,
                            jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(
        x, packed, jnp.asarray(scale, jnp.float32), live, prefetch_bytes=np.int64(prefetch_bytes),
        layer=np.int64(-1 if layer is None else layer))


def _bf16_dot_mode(bf16_dot: bool | None, tiles: bool | None) -> int:
    """The packed handler's `bf16_dot`: 0 portable, 1 vdpbf16ps, 2 AMX tiles (each falling back
    to the one before where the build or the process lacks it)."""
    if not (_default_bf16_dot() if bf16_dot is None else bool(bf16_dot)):
        return 0
    return 2 if (_default_tiles() if tiles is None else bool(tiles)) else 1


def _check_model_dtype(name: str, dtype) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"{name} runs float32 or bfloat16 models, got {dtype.name}")
    return dtype


def add_rms_norm(x: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float
                 ) -> tuple[jax.Array, jax.Array]:
    """(s, RMSNorm(s) * weight) with s = x + delta.astype(x.dtype) (s = x without delta): the
    residual add and the next layer's (or the final) norm, for x [T, H] float32 or bfloat16,
    delta [T, H] of x's dtype or float32 (a matmul's output, rounded to x's dtype first, as
    `.astype` does), weight [H] of x's dtype. The sum is exactly XLA's `x + delta.astype(...)`;
    the norm computes `jaxpage.layers.rms_norm`'s formula with its roundings, summing the
    squares in the kernel's order (within float32 rounding of it, not bit for bit). The
    kernel must be `available()`."""
    if not available():
        raise RuntimeError("the CPU kernel library is not available")
    dtype = _check_model_dtype("add_rms_norm", x.dtype)
    if delta is None:
        delta = jnp.zeros((0,), dtype)
    return jax.ffi.ffi_call(cpu_library.TARGET_ADD_RMS_NORM, (jax.ShapeDtypeStruct(x.shape, dtype),
                                                   jax.ShapeDtypeStruct(x.shape, dtype)))(
        x, delta, weight.astype(dtype), eps=np.float32(eps))


def silu_mul(gate_up: jax.Array, dtype) -> jax.Array:
    """silu(gate) * up in `dtype` (float32 or bfloat16) for gate_up [T, 2I] = [gate | up] of
    `dtype` or float32 (rounded to `dtype` first): silu in float32 and rounded to `dtype` once
    (HF's bfloat16 silu), then the product rounded. The kernel must be `available()`."""
    if not available():
        raise RuntimeError("the CPU kernel library is not available")
    dtype = _check_model_dtype("silu_mul", dtype)
    rows, width = gate_up.shape
    return jax.ffi.ffi_call(cpu_library.TARGET_SILU_MUL,
                            jax.ShapeDtypeStruct((rows, width // 2), dtype))(gate_up)


def qkv_rope(qkv: jax.Array, cos: jax.Array, sin: jax.Array, num_heads: int,
             num_kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [T, H, D], k and v [T, KH, D] in cos's dtype (float32 or bfloat16) from qkv [T, (H +
    2 KH) D] (of that dtype or float32, rounded to it first), q and k rotated by the rotary
    tables cos, sin [T, D] in the rotate-half convention (`jaxpage.layers.rotate`), each
    product and their sum rounded to the dtype as XLA rounds them: bit for bit the jnp path's.
    The kernel must be `available()`."""
    if not available():
        raise RuntimeError("the CPU kernel library is not available")
    dtype = _check_model_dtype("qkv_rope", cos.dtype)
    rows, dim = qkv.shape[0], cos.shape[1]
    return jax.ffi.ffi_call(cpu_library.TARGET_QKV_ROPE, (
        jax.ShapeDtypeStruct((rows, num_heads, dim), dtype),
        jax.ShapeDtypeStruct((rows, num_kv_heads, dim), dtype),
        jax.ShapeDtypeStruct((rows, num_kv_heads, dim), dtype)))(qkv, cos, sin.astype(dtype))


def decoder_layer(x: jax.Array, h: jax.Array, weights: dict, cos: jax.Array, sin: jax.Array,
                  k_pool: jax.Array, v_pool: jax.Array, slot_mapping: jax.Array,
                  block_tables: jax.Array, seq_lens: jax.Array, query_start_loc: jax.Array,
                  next_norm: jax.Array, *, num_heads: int, eps: float,
                  scale: float | None = None, live_rows: jax.Array | int | None = None,
                  query_tile: int = QUERY_TILE, key_splits: int = 0,
                  bf16_dot: bool | None = None, tiles: bool | None = None,
                  layer: int | None = None, next_layer: int | None = None
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A Llama-family decoder layer without biases or q/k norms in one kernel call: given the
    residual stream x [T, H] and its attention norm h, (x2, h2, k_pool, v_pool) with x2 the
    layer's output, h2 = RMSNorm(x2) * next_norm (the next layer's input norm, or the final
    one), and the pools [KH, blocks, block_size, D] with this step's K/V written at
    `slot_mapping` (in place: the results alias them). `weights` holds "qkv", "o", "gate_up",
    "down" packed (`pack_weight`) and "mlp_norm"; x, h, cos, sin [T, D], the pools and the
    norms are one dtype, float32 or bfloat16. Any of the four weights may instead be int8,
    packed by `pack_weight_int8`, with its columns' float32 scales [N] in `weights` under its
    name + "_scale" ("qkv_scale", "o_scale", "gate_up_scale", "down_scale"), run as
    `packed_matmul_int8` runs it. Bit for bit what the unfused calls give: `packed_matmul` (or
    `packed_matmul_int8`), `qkv_rope`, `set_rows`, `paged_attention_cpu`, `add_rms_norm`,
    `silu_mul` in `jaxpage.models.llama.LlamaModel.forward`'s order, with the same
    `live_rows`, `query_tile`, `key_splits` and `bf16_dot` / `tiles`. With `layer`, the four
    weights, their scales and "mlp_norm" are stacks over the model's layers ([L, ...],
    `np.stack` of each) read at `layer` in place; with `next_layer`, `next_norm` is a stack [L, H]
    read at `next_layer`. The kernel must be `available()`."""
    if not available():
        raise RuntimeError("the CPU kernel library is not available")
    for name in ("qkv", "o", "gate_up", "down", "mlp_norm"):
        _layer_shape("decoder_layer", weights[name], layer)
    if next_layer is not None:
        _layer_shape("decoder_layer", next_norm, next_layer)
    dtype = _check_model_dtype("decoder_layer", x.dtype)
    if key_splits < 0:
        raise ValueError(f"key_splits must be >= 0 (0: the kernel chooses), got {key_splits}")
    dim = k_pool.shape[-1]
    scale = dim ** -0.5 if scale is None else scale
    live = jnp.asarray(x.shape[0] if live_rows is None else live_rows, jnp.int32).reshape(())
    ints = [a.astype(jnp.int32) for a in (slot_mapping, block_tables, seq_lens, query_start_loc)]
    scales = []  # an int8 weight's columns' scales; none for a float weight
    for name in ("qkv", "o", "gate_up", "down"):
        int8, scaled = jnp.dtype(weights[name].dtype) == jnp.int8, f"{name}_scale" in weights
        if int8 != scaled:
            raise ValueError(f"decoder_layer takes {name!r} int8 with {name + '_scale'!r}, or a "
                             f"float weight without one, got {jnp.dtype(weights[name].dtype).name}"
                             f" and {'a' if scaled else 'no'} scale")
        scales.append(jnp.asarray(weights[f"{name}_scale"], jnp.float32) if int8
                      else jnp.zeros((0,), jnp.float32))
    out = (jax.ShapeDtypeStruct(x.shape, dtype), jax.ShapeDtypeStruct(x.shape, dtype),
           jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype),
           jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype))
    return jax.ffi.ffi_call(cpu_library.TARGET_DECODER_LAYER, out,
                            input_output_aliases={5: 2, 6: 3})(
        x, h, weights["qkv"], cos, sin, k_pool, v_pool, *ints, weights["o"],
        weights["mlp_norm"], weights["gate_up"], weights["down"], next_norm, live, *scales,
        num_heads=np.int64(num_heads),
        eps=np.float32(eps), scale=np.float32(scale), query_tile=np.int64(query_tile),
        key_splits=np.int64(key_splits), bf16_dot=np.int64(_bf16_dot_mode(bf16_dot, tiles)),
        layer=np.int64(-1 if layer is None else layer),
        next_layer=np.int64(-1 if next_layer is None else next_layer))


LORA_DTYPES = (jnp.float32, jnp.bfloat16)  # x, a and b: the kernel's element types


def check_lora_operands(y, x, a, b, slots, dtypes=None) -> None:
    """Raises ValueError unless y [T, N] float32, x [T, K], a [S, K, R], b [S, R, N] (x, a and b
    of one dtype, one of `dtypes` where given) and slots [T] of an integer dtype agree
    (`lora_matmul` and `pallas_kernels.lora.lora_matmul_reference`)."""
    shapes = (f"y {tuple(y.shape)}, x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, "
              f"slots {tuple(slots.shape)}")
    if (y.ndim != 2 or x.ndim != 2 or a.ndim != 3 or b.ndim != 3 or slots.ndim != 1
            or x.shape[0] != y.shape[0] or slots.shape[0] != y.shape[0]
            or a.shape[1] != x.shape[1] or b.shape[:2] != (a.shape[0], a.shape[2])
            or b.shape[2] != y.shape[1]):
        raise ValueError(f"lora_matmul takes y [T, N], x [T, K], a [S, K, R], b [S, R, N] and "
                         f"slots [T], got {shapes}")
    names = [jnp.dtype(v.dtype).name for v in (y, x, a, b, slots)]
    if names[0] != "float32":
        raise ValueError(f"lora_matmul adds to a float32 y, got {names[0]} ({shapes})")
    if not names[1] == names[2] == names[3]:
        raise ValueError(f"lora_matmul takes x, a and b of one dtype, got {names[1]}, {names[2]} "
                         f"and {names[3]} ({shapes})")
    if dtypes is not None and jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in dtypes]:
        allowed = " or ".join(jnp.dtype(d).name for d in dtypes)
        raise ValueError(f"lora_matmul takes x, a and b of {allowed}, got {names[1]}")
    if not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"lora_matmul takes integer slots, got {names[4]}")


def lora_matmul(y: jax.Array, x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array,
                live_rows: jax.Array | int | None = None) -> jax.Array:
    """y + delta as float32 [T, N], each row's LoRA delta added to a projection's output y
    [T, N] float32: for each row t < `live_rows` (every row where None) with 0 < slots[t] < S,
    delta[t] = X(x[t] @ a[slots[t]]) @ b[slots[t]] with x [T, K], a [S, K, R], b [S, R, N] of
    one dtype X (float32 or bfloat16), products and sums in float32 and the intermediate [R]
    vector rounded once to X (as PyTorch's bfloat16 `lora_B(lora_A(x))`). Every other row keeps
    y: slot 0 (or below) is "no adapter"; a slot >= S is out of contract (the caller keeps
    slots in [0, S)), and the kernel leaves such rows alone rather than read past a or b.
    `live_rows`: an int32 scalar, traced or not (a bucket's padding rows past it keep y). The
    kernel groups the rows by slot (cpu/lora.h), reading each adapter once a call; the result
    is y's buffer, updated in place where XLA can alias it. Within float32 rounding of
    `pallas_kernels.lora.lora_matmul_reference` (sums in another order; for bfloat16 the
    intermediate's rounding may then differ by an ulp where a sum lies near a tie), and the
    same whatever the threads. The kernel must be `available()`."""
    if not available():
        raise RuntimeError("the CPU kernel library is not available")
    check_lora_operands(y, x, a, b, slots, LORA_DTYPES)
    live = jnp.asarray(x.shape[0] if live_rows is None else live_rows, jnp.int32).reshape(())
    return jax.ffi.ffi_call(cpu_library.TARGET_LORA_MATMUL,
                            jax.ShapeDtypeStruct(y.shape, jnp.float32),
                            input_output_aliases={0: 0})(
        y, x, a, b, slots.astype(jnp.int32), live)
