"""Run the C++ CPU kernel library (`pallas_kernels/cpu/`) under AddressSanitizer and
UndefinedBehaviorSanitizer.

Builds the library (`cpu/ffi.cc`, with -I that directory) as a shared library with
`-fsanitize=undefined,address` (plus `float-cast-overflow`, which `undefined` leaves out in GCC
and which is the check for a float such as NaN converted to an int), `-fno-sanitize-recover=all
-g -O1` and the library's own code generation flags (`cpu_library._FLAGS` less its -O level:
-march=native, -fopenmp-simd and the float flags, so that the `omp simd` loops are vectorized
as in the real build) into a temporary directory. A child Python then registers that library
through `JAXPAGE_CPU_KERNEL_LIB`, with the sanitizer runtimes preloaded (`LD_PRELOAD` of libasan and
libubsan, as `g++ -print-file-name` finds them), and runs the kernel on random ragged batches:
decode and prefill, GQA and not, the compiled (head_dim, block_size) pairs and run-time sized
ones, several query tiles, sliding windows (1 to wider than any sequence, the table entries of
the blocks before a sequence's window pointing outside the pool: reading one is an error) and
soft-capping, every pool slot no sequence owns holding NaN, +inf or -inf, with float32 pools
and with bfloat16 pools on both bfloat16 paths (the AVX512-BF16 "dot" path where the build has
it, and the "portable" one), and with quantized pools (`quantized.QuantizedPool`, the formats
int8, float8_e4m3fn and float8_e5m2 taking turns over the batches; the unowned slots' scales
NaN, +inf or -inf, which make their rows NaN or infinite). Each result is compared with naive
float64 NumPy attention (of the inputs rounded to bfloat16, for bfloat16 pools, within the
bound the kernel's roundings allow: see `bf16_ratio`; of the dequantized values, for quantized
pools, whose result must also equal the kernel's on the dequantized float32 pools bit for
bit). It also feeds the kernel inputs its
handler must reject (wrong output shape, overlapping or decreasing query ranges, too many
queries for a sequence, block ids outside the pool, a negative window or soft-cap; quantized K
and V of two types, scales of the wrong shape; a small matmul's wrong output shape or mixed
dtypes, a packed matmul's wrong output shape or weight, an int8 one's wrong output, weight or
scales) and checks each is an error. It also runs `small_matmul` (both weight layouts, float32
and bfloat16 on both bfloat16 paths, odd sizes), `packed_matmul` (weights packed by
`pack_weight`, the same dtypes and paths) and `packed_matmul_int8` (int8 weights packed by
`pack_weight_int8` with per-column scales, float32 and bfloat16 x, one pass and several; x's
rounding to int16 allowed for) against float64 NumPy, and `greedy_draw` (rows with ties, NaN
and infinities, vocabularies with and without a tail) against NumPy's argmax and float64
log-sum-exp, `lora_matmul` (slots out of range, rows past live_rows, vector tails) against
float64 NumPy, and the layer glue
(`add_rms_norm`, `silu_mul`, `qkv_rope`; float32 and bfloat16, a NaN row, rows shared among
the threads) against float64 NumPy, and `decoder_layer` (a decode step of three sequences and
a padding row, and a lone long sequence, float32 and bfloat16, float weights and int8 ones)
against the unfused calls it stands for, bit for bit; and the packed matmuls and the layer
reading their weights as the last layer of a stack (`layer`), bit for bit the unstacked call.

Prints a one-line summary. Exit status: 0 clean; 1 a sanitizer finding (its report is printed),
a wrong result, or a child that ran past --timeout (then the stages it reached, with their
times, and every Python thread's stack, dumped a minute before the deadline, are printed);
2 this machine cannot run the check (no C++ compiler or sanitizer runtime).

    python scripts/check_cpu_kernel_sanitizers.py [--seeds N] [--cxx g++] [--source DIR]
                                                  [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SANITIZE = ["-fsanitize=undefined,address", "-fsanitize=float-cast-overflow",
            "-fno-sanitize-recover=all", "-g", "-O1", "-fno-omit-frame-pointer"]
# what a report looks like in the child's output (with halt_on_error it also exits non-zero)
FINDING = re.compile(r"runtime error:|ERROR: AddressSanitizer|UndefinedBehaviorSanitizer|"
                     r"LeakSanitizer|SUMMARY: \w+Sanitizer")

# (num_heads, num_kv_heads, head_dim, block_size): the first four are compiled for their sizes
SHAPES = [(9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 64, 32), (8, 1, 128, 16),
          (4, 4, 8, 4), (6, 2, 16, 16), (9, 3, 8, 1), (8, 1, 32, 8), (2, 1, 24, 256)]
FILLS = [float("nan"), float("inf"), float("-inf")]
QUANTIZED_FORMATS = ["int8", "float8_e4m3fn", "float8_e5m2"]  # cycled through the batches
# (sliding_window, soft_cap) cycled through the batches: off, windows of one token, less than a
# block, odd sizes, longer than any sequence; soft-capping alone and with a window
ATTENTION_OPTIONS = [(None, None), (1, None), (5, 2.0), (13, None), (None, 3.0), (100, 30.0)]


def _runtime(compiler: str, name: str) -> str | None:
    """The path of a sanitizer runtime the compiler links against, or None."""
    try:
        path = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True,
                              text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


def build(compiler: str, out_dir: Path, source: Path | None = None) -> Path:
    import jax

    from pallas_kernels import cpu_library

    flags = [f for f in cpu_library._FLAGS if not re.fullmatch(r"-O\w*", f)]
    source = Path(source or cpu_library._SOURCE_DIR)
    library = out_dir / "cpu_kernels_sanitized.so"
    cmd = [compiler, *flags, *SANITIZE, "-isystem", jax.ffi.include_dir(), "-I", str(source),
           "-o", str(library), str(source / "ffi.cc")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")
    return library


# ----------------------------------------------------------------------------- the child


def random_batch(rng, *, num_heads, num_kv_heads, head_dim, block_size, decode, fill,
                 window=None):
    """A ragged batch over a permuted head-major pool whose unowned slots hold `fill`, plus
    each sequence's contiguous K/V for the oracle. With a `window`, the table entries of the
    blocks before each sequence's first needed one (the block of the first key its earliest
    query sees) point outside the pool, as if freed: the kernel must not read them."""
    import numpy as np

    num_seqs = int(rng.integers(1, 6))
    cached = rng.integers(0, 40, num_seqs)
    new = (np.ones(num_seqs, np.int64) if decode
           else np.where(rng.random(num_seqs) < 0.3, 1, rng.integers(1, 40, num_seqs)))
    if not decode and rng.random() < 0.5:
        new[int(rng.integers(num_seqs))] = 0  # a sequence without queries this step
    seq_lens = np.maximum(cached + new, 0)
    blocks_needed = -(-seq_lens // block_size)
    num_blocks = int(blocks_needed.sum()) + 3
    physical = rng.permutation(np.arange(1, num_blocks))  # block 0 is never owned
    k_pool = np.full((num_kv_heads, num_blocks, block_size, head_dim), fill, np.float32)
    v_pool = np.full_like(k_pool, fill)
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
        pos = np.arange(seq_lens[s])
        blocks, offsets = tables[s, pos // block_size], pos % block_size
        k_pool[:, blocks, offsets] = np.transpose(k, (1, 0, 2))
        v_pool[:, blocks, offsets] = np.transpose(v, (1, 0, 2))
    num_tokens = int(new.sum()) + int(rng.integers(0, 4))  # trailing padding tokens
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
    qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    for s in range(num_seqs):
        if window is not None and new[s]:
            freed = max(0, int(seq_lens[s] - new[s]) - window + 1) // block_size
            tables[s, :freed] = np.where(np.arange(freed) % 2, -7, num_blocks + 7)
    return (q, k_pool, v_pool, tables, seq_lens.astype(np.int32), qsl), keys, values


def naive_rows(args, keys, values, scale, window, soft_cap):
    """(token, head, float64 weights, the values they weigh) of every query row: attention
    over the keys (max(0, p - window + 1) .. p) of a query at position p, scores soft-capped
    as cap * tanh(scores / cap)."""
    import numpy as np

    q, qsl = args[0].astype(np.float64), args[5]
    group = q.shape[1] // keys[0].shape[1] if keys else 1
    for s, (k, v) in enumerate(zip(keys, values, strict=True)):
        k, v = k.astype(np.float64), v.astype(np.float64)
        first = k.shape[0] - (qsl[s + 1] - qsl[s])
        for i, tok in enumerate(range(qsl[s], qsl[s + 1])):
            pos = first + i
            seen = slice(0 if window is None else max(0, pos - window + 1), pos + 1)
            for h in range(q.shape[1]):
                scores = k[seen, h // group] @ q[tok, h] * scale
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                weights = np.exp(scores - scores.max())
                yield tok, h, weights / weights.sum(), v[seen, h // group]


def naive_error(out, args, keys, values, scale, window=None, soft_cap=None) -> float:
    """Largest |out - float64 attention| over all query rows (padding rows must be 0)."""
    import numpy as np

    worst = float(np.abs(out[args[5][-1]:]).max(initial=0.0))
    for tok, h, w, v in naive_rows(args, keys, values, scale, window, soft_cap):
        worst = max(worst, float(np.abs(out[tok, h] - w @ v).max()))
    return worst


def bf16_ratio(out, args, keys, values, scale, dot, window=None, soft_cap=None) -> float:
    """Largest |out - float64 attention| / the bound for bfloat16 pools (<= 1 is right):
    eps (|expected| + [dot] sum_t w_t |v_t|) (1 + eps) + 2e-5, eps = 2^-8: the output is
    rounded to bfloat16, and on the dot path each probability before P.V (see
    tests/kernels/test_cpu_attention.py::assert_bf16_matches_naive). keys/values/q are the
    bfloat16 values, upcast."""
    import numpy as np

    eps = 2.0**-8
    worst = float(np.abs(out[args[5][-1]:]).max(initial=0.0)) / 2e-5
    for tok, h, w, v in naive_rows(args, keys, values, scale, window, soft_cap):
        expected = w @ v
        spread = w @ np.abs(v) if dot else 0.0
        bound = eps * (np.abs(expected) + spread) * (1 + eps) + 2e-5
        worst = max(worst, float((np.abs(out[tok, h] - expected) / bound).max()))
    return worst


def quantize_batch(args, fmt, fill):
    """The batch's float32 pools quantized to `fmt` (each owned row as quantized.quantize_pool
    does), the scales of unowned slots (the rows holding `fill`) set to `fill`. Returns the
    args with QuantizedPools, the args with the float32 pools they dequantize to (by
    quantized.dequantize_pool, as the engine's jnp backends read them), and each sequence's
    dequantized keys and values for the oracle (NaN at positions whose table entry was freed:
    before the sequence's window, never seen)."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import quantized

    q, k_pool, v_pool, tables, seq_lens, qsl = args
    pools, dequantized = [], []
    for pool in (k_pool, v_pool):
        unowned = ~np.isfinite(pool).all(-1)
        qp = quantized.quantize_pool(jnp.asarray(np.where(np.isfinite(pool), pool, 0.0)),
                                     jnp.dtype(fmt))
        scales = np.array(qp.scales)
        scales[unowned] = fill
        pools.append(quantized.QuantizedPool(qp.values, jnp.asarray(scales)))
        dequantized.append(np.asarray(quantized.dequantize_pool(pools[-1])))
    block_size, num_blocks = k_pool.shape[2], k_pool.shape[1]
    keys, values = [], []
    for table, length in zip(tables, seq_lens, strict=True):
        pos = np.arange(length)
        blocks, offsets = table[pos // block_size], pos % block_size
        kept = (blocks >= 0) & (blocks < num_blocks)
        for deq, out in zip(dequantized, (keys, values), strict=True):
            x = np.full((length, deq.shape[0], deq.shape[3]), np.nan, np.float32)
            x[kept] = deq[:, blocks[kept], offsets[kept]].transpose(1, 0, 2)
            out.append(x)
    return ((q, *pools, tables, seq_lens, qsl), (q, *dequantized, tables, seq_lens, qsl), keys,
            values)


def bad_inputs():
    """(name, call, message the error must contain) for inputs the handler must reject."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import cpu_library, cpu_ops
    from pallas_kernels.cpu_ops import paged_attention_cpu

    k_pool = np.zeros((1, 6, 4, 8), np.float32)
    tables = np.array([[1, 2], [3, 4]], np.int32)
    lens = np.array([5, 6], np.int32)

    def attend(q_tokens, qsl, seq_lens=lens, table=tables):
        return lambda: paged_attention_cpu(np.ones((q_tokens, 2, 8), np.float32), k_pool,
                                           k_pool, table, seq_lens, np.array(qsl, np.int32))

    def wrong_out(shape, dtype=jnp.float32, window=0, soft_cap=0.0):
        """The FFI target called directly: any output shape, window and soft-cap."""
        target = cpu_library.TARGET if dtype == jnp.float32 else cpu_library.TARGET_BF16
        extra = {} if dtype == jnp.float32 else {"bf16_dot": np.int64(1)}
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(shape, dtype))
        return lambda: call(jnp.ones((4, 2, 8), dtype), k_pool.astype(dtype),
                            k_pool.astype(dtype), tables, lens, np.array([0, 2, 4], np.int32),
                            scale=np.float32(1.0), query_tile=np.int64(32),
                            sliding_window=np.int64(window), soft_cap=np.float32(soft_cap),
                            key_splits=np.int64(0), **extra)

    def attend_bf16(table, bf16_dot):
        pool = jnp.zeros((1, 6, 4, 64), jnp.bfloat16)  # head_dim 64: the dot path's sizes
        return lambda: paged_attention_cpu(jnp.ones((4, 2, 64), jnp.bfloat16), pool, pool, table,
                                           lens, np.array([0, 2, 4], np.int32),
                                           bf16_dot=bf16_dot)

    def attend_quantized(k_values, v_values, k_scales=None, table=tables):
        """The quantized FFI target called directly (no check by the wrapper first)."""
        k_scales = np.ones((1, 6, 4), np.float32) if k_scales is None else k_scales
        call = jax.ffi.ffi_call(cpu_library.TARGET_QUANTIZED,
                                jax.ShapeDtypeStruct((4, 2, 8), jnp.float32))
        return lambda: call(np.ones((4, 2, 8), np.float32), k_values, k_scales, v_values,
                            np.ones((1, 6, 4), np.float32), table, lens,
                            np.array([0, 2, 4], np.int32), scale=np.float32(1.0),
                            query_tile=np.int64(32), sliding_window=np.int64(0),
                            soft_cap=np.float32(0.0), key_splits=np.int64(0))

    def small_matmul(out_shape, w_dtype=jnp.float32):
        call = jax.ffi.ffi_call(cpu_library.TARGET_SMALL_MATMUL,
                                jax.ShapeDtypeStruct(out_shape, jnp.float32))
        return lambda: call(jnp.ones((2, 8), jnp.float32), jnp.ones((8, 3), w_dtype),
                            transpose_w=np.int64(0), bf16_dot=np.int64(1))

    panel = cpu_ops.panel_columns()  # 32 columns (AVX-512) or 16

    def packed_matmul(out_shape, k=8):
        call = jax.ffi.ffi_call(cpu_library.TARGET_PACKED_MATMUL,
                                jax.ShapeDtypeStruct(out_shape, jnp.float32))
        w = jnp.ones((1, 4, panel, 2), jnp.bfloat16)  # K = 8 packed, N = one panel
        return lambda: call(jnp.ones((2, k), jnp.bfloat16), w, np.int32(2), bf16_dot=np.int64(1),
                            prefetch_bytes=np.int64(0), layer=np.int64(-1))

    def packed_matmul_int8(out_shape, k=8, scale_n=panel):
        call = jax.ffi.ffi_call(cpu_library.TARGET_PACKED_MATMUL_INT8,
                                jax.ShapeDtypeStruct(out_shape, jnp.float32))
        w = jnp.ones((1, 4, panel, 2), jnp.int8)  # K = 8 packed in pairs, N = one panel
        return lambda: call(jnp.ones((2, k), jnp.float32), w, jnp.ones(scale_n, jnp.float32),
                            np.int32(2), prefetch_bytes=np.int64(0), layer=np.int64(-1))

    def set_rows(index, values_shape=(1, 1, 8)):
        return lambda: cpu_ops.set_rows(jnp.zeros((1, 6, 4, 8), jnp.bfloat16),
                                              jnp.array(index, jnp.int32),
                                              jnp.ones(values_shape, jnp.bfloat16))

    def decoder_layer(slots, table, down_k=None):
        """A bfloat16 layer of hidden size `panel` with one head (and one KV head) of that size
        and an MLP of that inner size, over a pool of 6 blocks of 4; `down_k`: the down
        projection's K if not the inner size (a weight that does not fit)."""
        h = panel
        down_k = h if down_k is None else down_k
        w = jnp.ones((1, h // 2, panel, 2), jnp.bfloat16)  # [h, panel] packed
        qkv = jnp.ones((3, h // 2, panel, 2), jnp.bfloat16)  # [h, 3 h]: q, k, v of one head
        pool = jnp.zeros((1, 6, 4, h), jnp.bfloat16)
        x = jnp.ones((2, h), jnp.bfloat16)
        gate_up = jnp.ones((2, h // 2, panel, 2), jnp.bfloat16)
        down = jnp.ones((1, down_k // 2, panel, 2), jnp.bfloat16)
        layer = {"qkv": qkv, "o": w, "gate_up": gate_up, "down": down,
                 "mlp_norm": jnp.ones(h, jnp.bfloat16)}
        return lambda: cpu_ops.decoder_layer(
            x, x, layer, x, x, pool, pool, np.array(slots, np.int32), np.array([table], np.int32),
            np.array([2], np.int32), np.array([0, 2], np.int32), layer["mlp_norm"],
            num_heads=1, eps=1e-6)

    int8 = np.zeros((1, 6, 4, 8), np.int8)
    e5m2 = jnp.zeros((1, 6, 4, 8), jnp.float8_e5m2)
    return [
        ("decoder_layer: slot past the pool", decoder_layer([4, 24], [1, 0]),
         "slot_mapping[1] = 24 is outside the pool's 24 slots"),
        ("decoder_layer: negative slot", decoder_layer([-1, 5], [1, 0]),
         "slot_mapping[0] = -1"),
        ("decoder_layer: block outside the pool", decoder_layer([4, 5], [6, 0]),
         "block table entry outside the pool"),
        ("decoder_layer: a down projection of another K", decoder_layer([4, 5], [1, 0], 12),
         "do not fit hidden size"),
        ("smaller output", wrong_out((1, 2, 8)), "output shape [1, 2, 8]"),
        ("larger output", wrong_out((64, 2, 8)), "output shape [64, 2, 8]"),
        ("overlapping query ranges", attend(4, [0, 3, 1]), "query_start_loc decreases"),
        ("decreasing query_start_loc", attend(4, [2, 1, 4]), "query_start_loc decreases"),
        ("negative query_start_loc", attend(4, [-1, 2, 4]), "query_start_loc[0] = -1"),
        ("queries past the batch", attend(4, [0, 2, 5]), "query_start_loc[2] = 5"),
        ("more queries than seq_len", attend(4, [0, 3, 4], np.array([2, 6], np.int32)),
         "sequence 0 has 3 queries but seq_len 2"),
        ("seq_len past the table", attend(4, [0, 2, 4], np.array([5, 9], np.int32)),
         "sequence 1 has seq_len 9"),
        ("block outside the pool", attend(4, [0, 2, 4], table=np.array([[1, 6], [3, 4]],
                                                                      np.int32)),
         "block table entry outside the pool"),
        ("bf16: smaller output", wrong_out((1, 2, 8), jnp.bfloat16), "output shape [1, 2, 8]"),
        ("negative window", wrong_out((4, 2, 8), window=-1), "sliding_window -1 is negative"),
        ("NaN soft-cap", wrong_out((4, 2, 8), soft_cap=float("nan")), "must be finite and >= 0"),
        ("negative soft-cap", wrong_out((4, 2, 8), soft_cap=-1.0), "soft_cap -1"),
        *((f"bf16 {mode}: block outside the pool",
           attend_bf16(np.array([[1, 2], [3, 6]], np.int32), mode == "dot"),
           "block table entry outside the pool") for mode in ("dot", "portable")),
        ("set_rows: index past the pool", set_rows([24]), "set_rows: index outside the pool"),
        ("set_rows: negative index", set_rows([-1]), "set_rows: index outside the pool"),
        ("set_rows: rows that do not tile the pool", set_rows([0], (1, 1, 5)),
         "set_rows: rows do not tile the pool"),
        ("greedy_draw: outputs of another length", lambda: jax.ffi.ffi_call(
            cpu_library.TARGET_GREEDY_DRAW, (jax.ShapeDtypeStruct((3,), jnp.int32),
                                                jax.ShapeDtypeStruct((2,), jnp.float32)))(
            np.zeros((2, 8), np.float32)), "greedy draw: logits must be [R, V >= 1]"),
        ("add_rms_norm: outputs of another shape", lambda: jax.ffi.ffi_call(
            cpu_library.TARGET_ADD_RMS_NORM, (jax.ShapeDtypeStruct((2, 8), jnp.float32),
                                                 jax.ShapeDtypeStruct((3, 8), jnp.float32)))(
            np.ones((2, 8), np.float32), np.ones((2, 8), np.float32), np.ones(8, np.float32),
            eps=np.float32(1e-6)), "add_rms_norm: x [T, H] [2, 8]"),
        ("silu_mul: output of another shape", lambda: jax.ffi.ffi_call(
            cpu_library.TARGET_SILU_MUL, jax.ShapeDtypeStruct((2, 5), jnp.bfloat16))(
            np.ones((2, 8), np.float32)), "silu_mul: gate_up [T, 2I] [2, 8]"),
        ("qkv_rope: outputs of another shape", lambda: jax.ffi.ffi_call(
            cpu_library.TARGET_QKV_ROPE, (jax.ShapeDtypeStruct((2, 2, 4), jnp.float32),
                                             jax.ShapeDtypeStruct((2, 1, 4), jnp.float32),
                                             jax.ShapeDtypeStruct((2, 2, 4), jnp.float32)))(
            np.ones((2, 16), np.float32), np.ones((2, 4), np.float32),
            np.ones((2, 4), np.float32)), "qkv_rope: qkv [T, (H + 2 KH) D] [2, 16]"),
        ("small_matmul: output of another shape", small_matmul((2, 4)), "small matmul: output"),
        ("small_matmul: x and w of two dtypes", small_matmul((2, 3), jnp.bfloat16),
         "small matmul: x is float32 but w bfloat16"),
        ("packed_matmul: output of another shape", packed_matmul((2, 2 * panel)),
         "packed matmul: output"),
        ("packed_matmul: K groups that do not match x", packed_matmul((2, panel), k=12),
         "does not contract"),
        ("packed_matmul_int8: output of another shape", packed_matmul_int8((2, 2 * panel)),
         "packed matmul: output"),
        ("packed_matmul_int8: K that does not match x", packed_matmul_int8((2, panel), k=12),
         "is not an int8 weight packed for x"),
        ("packed_matmul_int8: scales of another length",
         packed_matmul_int8((2, panel), scale_n=panel - 1), "one a column"),
        ("quantized: K and V of two types", attend_quantized(int8, e5m2),
         "K values are int8 but V values float8_e5m2"),
        ("quantized: scales of another shape",
         attend_quantized(e5m2, e5m2, k_scales=np.ones((1, 6, 2), np.float32)),
         "scales [1, 6, 2] are not the values' [1, 6, 4, 8] less head_dim"),
        ("quantized: block outside the pool",
         attend_quantized(e5m2, e5m2, table=np.array([[1, 2], [3, 6]], np.int32)),
         "block table entry outside the pool"),
    ]


def check_set_rows(rng) -> int:
    """The in-place pool write (`set_rows`, pallas_kernels/bits.py) on every pool dtype it
    serves, eagerly (the result does not alias the pool: the kernel copies it first) and
    donated under jit (in place), slots and whole blocks, against NumPy. Returns the calls."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from pallas_kernels import cpu_ops

    calls = 0
    donated = jax.jit(cpu_ops.set_rows, donate_argnums=0, static_argnames="token_major")
    for dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "float32"):
        np_dtype = np.int8 if dtype == "int8" else getattr(ml_dtypes, dtype, np.float32)
        for heads, blocks, block_size, dim in ((3, 9, 16, 64), (1, 5, 1, 8), (2, 7, 4, 3)):
            pool = rng.standard_normal((heads, blocks, block_size, dim)).astype(np_dtype)
            for row_shape, count in (((dim,), 5), ((block_size, dim), 2)):
                rows_per_head = blocks * block_size * dim // int(np.prod(row_shape))
                index = rng.choice(rows_per_head, count, replace=False).astype(np.int32)
                values = rng.standard_normal((heads, count, *row_shape)).astype(np_dtype)
                expected = pool.reshape(heads, rows_per_head, *row_shape).copy()
                expected[:, index] = values
                # head-major values [K, T, *row], and token-major [T, K, *row]
                for token_major, given in ((False, values), (True, values.swapaxes(0, 1))):
                    for fn in (cpu_ops.set_rows, donated):
                        out = fn(jnp.asarray(pool), jnp.asarray(index),
                                 jnp.asarray(np.ascontiguousarray(given)),
                                 token_major=token_major)
                        got = np.asarray(out).reshape(expected.shape)
                        if not np.array_equal(got.view(np.uint8), expected.view(np.uint8)):
                            raise AssertionError(f"set_rows {dtype} {pool.shape} rows "
                                                 f"{row_shape} token_major={token_major}")
                        calls += 1
    return calls


def within_float32_bound(out, x, w64) -> bool:
    """Whether out is x @ w64 ([K, N]) in float64 within a float32 dot product's bound,
    (K + 2) * 2^-24 * sum |x| |w| per output, and of its shape."""
    import numpy as np

    x64 = np.asarray(x, np.float64)
    bound = (x64.shape[1] + 2) * 2.0**-24 * (np.abs(x64) @ np.abs(w64)) + 1e-30
    return out.shape == bound.shape and bool(np.all(np.abs(out - x64 @ w64) <= bound))


def check_small_matmul(rng) -> int:
    """`small_matmul` (x [M, K] times w [K, N] or [N, K], float32 out) on both layouts and both
    dtypes (bfloat16 on the dot path, where built, and the portable one), odd sizes (vector
    tails in K and N, an odd K, more rows than a register tile, K in several chunks and N in
    several units of tiles plus a tail) and a SmolLM2-sized one,
    eagerly and under jit, against float64 NumPy within the float32 bound
    (K + 2) * 2^-24 * sum |x| |w|. Returns the calls."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import cpu_ops

    calls = 0
    jitted = jax.jit(cpu_ops.small_matmul, static_argnames=("transpose_w", "bf16_dot"))
    for dtype, bf16_dot in ((jnp.float32, False), (jnp.bfloat16, True), (jnp.bfloat16, False)):
        for m, k, n in ((1, 7, 7), (5, 33, 70), (9, 17, 33), (16, 41, 65), (3, 1, 1),
                        (8, 576, 200), (2, 64, 96), (12, 99, 1100)):
            for transpose_w in (False, True):
                x = jnp.asarray(rng.standard_normal((m, k)), dtype)
                w = jnp.asarray(rng.standard_normal((n, k) if transpose_w else (k, n)), dtype)
                w64 = np.asarray(w, np.float64)
                w64 = w64.T if transpose_w else w64
                for fn in (cpu_ops.small_matmul, jitted):
                    out = np.asarray(fn(x, w, transpose_w=transpose_w, bf16_dot=bf16_dot))
                    if not within_float32_bound(out, x, w64):
                        raise AssertionError(f"small_matmul {jnp.dtype(dtype).name} "
                                             f"{(m, k, n)} transpose_w={transpose_w} "
                                             f"bf16_dot={bf16_dot}")
                    calls += 1
    return calls


def check_lora_matmul(rng) -> int:
    """`lora_matmul` (y + round(x @ a[slot]) @ b[slot] per row) in float32, eagerly and under
    jit, slots out of range (-1, S) and rows past live_rows left as y, vector tails in K, R
    and N, against float64 NumPy within the float32 bound of both products. Returns the
    calls."""
    import jax
    import numpy as np

    from pallas_kernels import cpu_ops

    calls = 0
    jitted = jax.jit(cpu_ops.lora_matmul)
    for t, s, k, r, n in ((1, 2, 7, 1, 5), (9, 5, 33, 17, 70), (40, 17, 64, 16, 96),
                          (13, 3, 100, 48, 33)):
        y = rng.standard_normal((t, n)).astype(np.float32)
        x = rng.standard_normal((t, k)).astype(np.float32)
        a = rng.standard_normal((s, k, r)).astype(np.float32)
        b = rng.standard_normal((s, r, n)).astype(np.float32)
        slots = rng.integers(-1, s + 1, t).astype(np.int32)
        live = np.int32(max(1, t - 2))
        rows = (slots > 0) & (slots < s) & (np.arange(t) < live)
        clipped = np.clip(slots, 0, s - 1)
        a64, b64, x64 = (np.asarray(v, np.float64) for v in (a, b, x))
        mid = np.einsum("tk,tkr->tr", x64, a64[clipped])
        mid_bound = (k + 2) * 2.0**-24 * np.einsum("tk,tkr->tr", np.abs(x64),
                                                   np.abs(a64[clipped]))
        want = y + np.where(rows[:, None], np.einsum("tr,trn->tn", mid, b64[clipped]), 0)
        bound = ((r + 2) * 2.0**-24 * np.einsum("tr,trn->tn", np.abs(mid) + mid_bound,
                                                np.abs(b64[clipped]))
                 + np.einsum("tr,trn->tn", mid_bound, np.abs(b64[clipped])))
        bound = np.where(rows[:, None], bound, 0) + 2.0**-24 * np.abs(want) + 1e-30
        for fn in (cpu_ops.lora_matmul, jitted):
            out = np.asarray(fn(y, x, a, b, slots, live))
            if not np.all(np.abs(out - want) <= bound):
                raise AssertionError(f"lora_matmul {(t, s, k, r, n)}: max |error| "
                                     f"{np.max(np.abs(out - want))}")
            calls += 1
    return calls


def check_packed_matmul(rng) -> int:
    """`packed_matmul` on weights packed by `pack_weight` (float32, and bfloat16 on both paths
    and on AMX tiles where `packed_tiles()`), an odd K (bfloat16's last pair padded), one panel
    and several, 1 to 40 rows (passes of up to 8 rows, 6 on AVX2, 32 on tiles, the rows split
    evenly among them; tiles: partial 16-row blocks, a K that is not whole tiles), against
    float64 NumPy within the float32 bound, and each again with only its first half of the rows
    live (the rest zeros). Returns the calls."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import cpu_ops

    calls = 0
    paths = [(jnp.float32, False, False), (jnp.bfloat16, True, False),
             (jnp.bfloat16, False, False)]
    if cpu_ops.packed_tiles():
        paths.append((jnp.bfloat16, True, True))
    for dtype, bf16_dot, tiles in paths:
        for m, k, n in ((1, 7, 32), (9, 33, 64), (17, 64, 96), (8, 576, 960), (3, 1, 32),
                        (6, 40, 64), (13, 15, 32), (40, 99, 96)):
            x = jnp.asarray(rng.standard_normal((m, k)), dtype)
            w = jnp.asarray(rng.standard_normal((k, n)), dtype)
            out = np.asarray(cpu_ops.packed_matmul(x, cpu_ops.pack_weight(w),
                                                         bf16_dot=bf16_dot, tiles=tiles))
            if not within_float32_bound(out, x, np.asarray(w, np.float64)):
                raise AssertionError(f"packed_matmul {jnp.dtype(dtype).name} {(m, k, n)} "
                                     f"bf16_dot={bf16_dot} tiles={tiles}")
            # a bucket's padding: only the first rows computed, the rest zeros
            live = np.asarray(cpu_ops.packed_matmul(
                x, cpu_ops.pack_weight(w), live_rows=m // 2, bf16_dot=bf16_dot,
                tiles=tiles))
            if not (np.array_equal(live[: m // 2], out[: m // 2]) and not live[m // 2:].any()):
                raise AssertionError(f"packed_matmul live_rows {m // 2} of {m}")
            # the weight as the last layer of a stack of three, read in place: the same bits
            packed = cpu_ops.pack_weight(w)
            stack = jnp.stack([jnp.full_like(packed, np.nan), jnp.full_like(packed, np.nan),
                               packed])
            layered = np.asarray(cpu_ops.packed_matmul(x, stack, bf16_dot=bf16_dot,
                                                       tiles=tiles, layer=2))
            if layered.tobytes() != out.tobytes():
                raise AssertionError(f"packed_matmul layer 2 of a stack {(m, k, n)}")
            calls += 3
    return calls


def check_packed_matmul_int8(rng) -> int:
    """`packed_matmul_int8` on int8 weights packed by `pack_weight_int8` with per-column scales,
    float32 and bfloat16 x, K of one row, a step's tail only, whole steps and a tail; 1 to 40
    rows (1-3 rows in interleaved chains, one pass and several), one panel and several, against
    float64 NumPy within x's rounding to int16 (max|x[m]| / 65534 an element) plus the float32
    bound, and each again with only its first half of the rows live (those rows alone's
    product, the rest zeros). Returns the calls."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import cpu_ops

    calls = 0
    panel = cpu_ops.panel_columns()
    for dtype in (jnp.float32, jnp.bfloat16):
        for m, k, n in ((1, 7, panel), (2, 33, 2 * panel), (3, 1, panel), (8, 576, 30 * panel),
                        (9, 99, 3 * panel), (17, 64, 2 * panel), (40, 15, panel)):
            x = jnp.asarray(rng.standard_normal((m, k)), dtype)
            w = rng.integers(-128, 128, (k, n), dtype=np.int8)
            scale = rng.uniform(1e-3, 2e-2, n).astype(np.float32)
            packed = cpu_ops.pack_weight_int8(w)
            out = np.asarray(cpu_ops.packed_matmul_int8(x, packed, scale))
            w64 = w.astype(np.float64) * scale
            x64 = np.asarray(x, np.float64)
            rounding = np.abs(x64).max(axis=1)[:, None] / 65534 * 1.01 * np.abs(w64).sum(axis=0)
            if not np.all(np.abs(out - x64 @ w64) <= rounding + (k + 4) * 2.0**-24 * 1.01
                          * (np.abs(x64) @ np.abs(w64)) + 1e-30):
                raise AssertionError(f"packed_matmul_int8 {jnp.dtype(dtype).name} {(m, k, n)}")
            # the live rows are those rows alone's product
            live = np.asarray(cpu_ops.packed_matmul_int8(x, packed, scale, live_rows=m // 2))
            alone = np.asarray(cpu_ops.packed_matmul_int8(x[: m // 2], packed, scale))
            if not (np.array_equal(live[: m // 2], alone) and not live[m // 2:].any()):
                raise AssertionError(f"packed_matmul_int8 live_rows {m // 2} of {m}")
            # the weight and its scales as the last layer of a stack of three: the same bits
            stack = np.stack([np.full_like(packed, -128), np.full_like(packed, 127), packed])
            scales = np.stack([np.full_like(scale, np.nan), np.full_like(scale, np.inf), scale])
            layered = np.asarray(cpu_ops.packed_matmul_int8(x, stack, scales, layer=2))
            if layered.tobytes() != out.tobytes():
                raise AssertionError(f"packed_matmul_int8 layer 2 of a stack {(m, k, n)}")
            calls += 4
    return calls


def check_greedy_draw(rng) -> int:
    """`greedy_draw` on vocabularies below a vector, of whole vectors and with a tail, rows with
    tied maxima, NaN, -inf and +inf: the tokens np.argmax's, the log-probabilities within 1e-4
    of float64's (NaN where the maximum is not finite). Returns the calls."""
    import numpy as np

    from pallas_kernels import cpu_ops

    calls = 0
    for rows, vocab in ((1, 1), (3, 15), (2, 16), (5, 97), (9, 4099)):
        x = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
        if vocab > 2:
            x[0, 1] = x[0, vocab - 1] = x[0].max() + 1.0
        if rows > 2:
            x[1, rng.integers(vocab)] = np.nan
            x[2] = -np.inf
        if rows > 3:
            x[3, rng.integers(vocab)] = np.inf
        tokens, logprob = (np.asarray(a) for a in cpu_ops.greedy_draw(x))
        x64 = x.astype(np.float64)
        want = np.argmax(x64, axis=-1)
        top = x64.max(axis=-1)
        with np.errstate(invalid="ignore", over="ignore"):
            want_lp = x64[np.arange(rows), want] - (
                np.log(np.exp(x64 - top[:, None]).sum(axis=-1)) + top)
        if not (np.array_equal(tokens, want) and np.allclose(logprob, want_lp, rtol=0,
                                                             atol=1e-4, equal_nan=True)):
            raise AssertionError(f"greedy_draw {(rows, vocab)}: {tokens} {logprob}")
        calls += 1
    return calls


def check_layer_glue(rng) -> int:
    """`add_rms_norm`, `silu_mul` and `qkv_rope` (float32 and bfloat16, float32 and rounded
    inputs, a row with NaN, hidden sizes with a tail past the vectors, enough rows to share them
    among the threads) against float64 NumPy within 2^-6 relative (the tests hold them to the
    rounding bounds; here the point is the memory they touch), and qkv_rope's v exactly.
    Returns the calls."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import cpu_ops

    calls = 0
    for dtype in (jnp.float32, jnp.bfloat16):
        def f64(x):
            return np.asarray(jnp.asarray(x, jnp.float32), np.float64)

        for rows, hidden in ((1, 37), (8, 576), (200, 576)):
            x = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
            delta = rng.standard_normal((rows, hidden)).astype(np.float32)
            delta[0, 3] = np.nan  # row 0's sum and norm NaN; the others not
            weight = jnp.asarray(rng.standard_normal(hidden), dtype)
            s, normed = cpu_ops.add_rms_norm(x, jnp.asarray(delta), weight, 1e-6)
            s64 = f64(s)
            want = f64(weight) * s64 / np.sqrt(np.mean(s64 * s64, -1, keepdims=True) + 1e-6)
            ok = np.isnan(f64(normed)[0]).all() and np.allclose(
                f64(normed)[1:], want[1:], rtol=2.0**-6, atol=1e-6)
            gate_up = jnp.asarray(rng.standard_normal((rows, 2 * hidden)) * 3, jnp.float32)
            out = f64(cpu_ops.silu_mul(gate_up, dtype))
            g, u = f64(gate_up.astype(dtype)[:, :hidden]), f64(gate_up.astype(dtype)[:, hidden:])
            ok &= np.allclose(out, g / (1 + np.exp(-g)) * u, rtol=2.0**-6, atol=1e-6)
            heads, kv_heads, dim = 3, 1, 2 * (hidden // 8 // 2 + 1)
            qkv = jnp.asarray(rng.standard_normal((rows, (heads + 2 * kv_heads) * dim)),
                              jnp.float32)
            angles = rng.standard_normal((rows, dim))
            q, k, v = cpu_ops.qkv_rope(qkv, jnp.asarray(np.cos(angles), dtype),
                                             jnp.asarray(np.sin(angles), dtype), heads, kv_heads)
            ok &= np.array_equal(f64(v).reshape(rows, -1),
                                 f64(qkv.astype(dtype)[:, (heads + kv_heads) * dim:]))
            ok &= q.shape == (rows, heads, dim) and k.shape == (rows, kv_heads, dim)
            if not ok:
                raise AssertionError(f"layer glue {jnp.dtype(dtype).name} {(rows, hidden)}")
            calls += 3
    return calls


def check_decoder_layer(rng) -> int:
    """`decoder_layer` (float32 and bfloat16, its weights float or int8 with scales, a decode
    step of 3 sequences with a padding row, and a lone sequence whose keys the kernel cuts among
    the threads; every pool slot no step writes NaN) against the unfused calls it stands for,
    bit for bit: logits-free, the layer's two outputs and both pools. Returns the calls."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import cpu_ops

    hidden, heads, kv_heads, dim, inner, block = 64, 4, 2, 16, 96, 16
    calls = 0
    for dtype, int8 in ((jnp.float32, False), (jnp.bfloat16, False), (jnp.float32, True),
                        (jnp.bfloat16, True)):
        def weight(k, n, dtype=dtype):
            w = rng.standard_normal((k, n)) / np.sqrt(k)
            return cpu_ops.pack_weight(jnp.asarray(w, dtype))

        shapes = {"qkv": (hidden, (heads + 2 * kv_heads) * dim), "o": (heads * dim, hidden),
                  "gate_up": (hidden, 2 * inner), "down": (inner, hidden)}
        layer = {"mlp_norm": jnp.asarray(rng.standard_normal(hidden), dtype)}
        for name, (k, n) in shapes.items():
            if int8:  # int8 weights with per-column scales (packed_matmul_int8)
                layer[name] = cpu_ops.pack_weight_int8(rng.integers(-128, 128, (k, n), np.int8))
                layer[name + "_scale"] = (rng.uniform(0.5, 1.5, n) / (64 * np.sqrt(k))).astype(
                    np.float32)
            else:
                layer[name] = weight(k, n)

        def matmul(rows, name, live, layer=layer, int8=int8):
            if int8:
                return cpu_ops.packed_matmul_int8(rows, layer[name], layer[name + "_scale"],
                                                  live_rows=live)
            return cpu_ops.packed_matmul(rows, layer[name], live_rows=live)

        next_norm = jnp.asarray(rng.standard_normal(hidden), dtype)
        for lens, tables, rows in (([5, 17, 33], [[1, 0, 0], [2, 3, 0], [4, 5, 6]], 4),
                                   ([600], [list(range(7, 45))], 1)):
            pool_shape = (kv_heads, 48, block, dim)
            k_pool = jnp.full(pool_shape, np.nan, dtype).at[:, 1:].set(
                jnp.asarray(rng.standard_normal((kv_heads, 47, block, dim)), dtype))
            v_pool = jnp.full(pool_shape, np.nan, dtype).at[:, 1:].set(
                jnp.asarray(rng.standard_normal((kv_heads, 47, block, dim)), dtype))
            # NaN past each sequence's last token (the step writes its new one at lens - 1)
            for n, table in zip(lens, tables, strict=True):
                for p in range(n - 1, len(table) * block):
                    k_pool = k_pool.at[:, table[p // block], p % block].set(np.nan)
                    v_pool = v_pool.at[:, table[p // block], p % block].set(np.nan)
            live = len(lens)
            slots = np.zeros(rows, np.int32)
            slots[:live] = [t[(n - 1) // block] * block + (n - 1) % block
                            for n, t in zip(lens, tables, strict=True)]
            width = max(len(t) for t in tables)
            table_array = np.zeros((rows, width), np.int32)
            for s, t in enumerate(tables):
                table_array[s, : len(t)] = t
            seq_lens = np.zeros(rows, np.int32)
            seq_lens[:live] = lens
            qsl = np.minimum(np.arange(rows + 1), live).astype(np.int32)
            x = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
            h = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
            angles = rng.standard_normal((rows, dim))
            cos, sin = (jnp.asarray(f(angles), dtype) for f in (np.cos, np.sin))
            args = (slots, table_array, seq_lens, qsl)
            fused = cpu_ops.decoder_layer(x, h, layer, cos, sin, k_pool, v_pool, *args, next_norm,
                                     num_heads=heads, eps=1e-5, live_rows=live)
            qkv = matmul(h, "qkv", live)
            q, k, v = cpu_ops.qkv_rope(qkv, cos, sin, heads, kv_heads)
            kp = cpu_ops.set_rows(k_pool, slots, k, token_major=True)
            vp = cpu_ops.set_rows(v_pool, slots, v, token_major=True)
            a = cpu_ops.paged_attention_cpu(q, kp, vp, table_array, seq_lens, qsl)
            o = matmul(a.reshape(rows, -1), "o", live)
            x1, h1 = cpu_ops.add_rms_norm(x, o, layer["mlp_norm"], 1e-5)
            gate_up = matmul(h1, "gate_up", live)
            act = cpu_ops.silu_mul(gate_up, dtype)
            down = matmul(act, "down", live)
            x2, h2 = cpu_ops.add_rms_norm(x1, down, next_norm, 1e-5)
            for got, want in zip(fused, (x2, h2, kp, vp), strict=True):
                if np.asarray(got).tobytes() != np.asarray(want).tobytes():
                    raise AssertionError(f"decoder_layer {jnp.dtype(dtype).name} int8={int8} "
                                         f"{lens}: not the unfused calls' result bit for bit")
            if not np.isfinite(np.asarray(fused[1], np.float32)[:live]).all():
                raise AssertionError(f"decoder_layer {jnp.dtype(dtype).name} {lens}: read NaN")
            # the layer as the last of a stack of three (NaN the others), its next norm the
            # first of a stack of two: read in place, the same bits
            stacked = {name: jnp.stack([jnp.full_like(w, np.nan if jnp.issubdtype(
                w.dtype, jnp.floating) else 127)] * 2 + [w]) for name, w in layer.items()}
            norms = jnp.stack([next_norm, jnp.full_like(next_norm, np.nan)])
            layered = cpu_ops.decoder_layer(x, h, stacked, cos, sin, k_pool, v_pool, *args,
                                            norms, num_heads=heads, eps=1e-5, live_rows=live,
                                            layer=2, next_layer=0)
            for got, want in zip(layered, fused, strict=True):
                if np.asarray(got).tobytes() != np.asarray(want).tobytes():
                    raise AssertionError(f"decoder_layer {jnp.dtype(dtype).name} int8={int8} "
                                         f"{lens}: layer 2 of a stack not the layer's bits")
            calls += 2
    return calls


_STARTED = time.perf_counter()


def progress(stage: str) -> None:
    """One line on stderr as the child enters a stage: when it runs past its deadline, the
    parent prints these, so the report says where the time went."""
    print(f"[sanitizers +{time.perf_counter() - _STARTED:.1f} s] {stage}", file=sys.stderr,
          flush=True)


def child(seeds: int, deadline: float) -> int:
    import faulthandler
    import warnings

    # a minute before the parent gives up: every thread's Python stack, on stderr
    faulthandler.dump_traceback_later(max(deadline - 60.0, 1.0), exit=False)
    progress("importing JAX and registering the sanitized library")

    import jax
    import numpy as np

    from pallas_kernels import cpu_ops
    from pallas_kernels.cpu_ops import paged_attention_cpu

    assert os.environ.get("JAXPAGE_CPU_KERNEL_LIB"), "JAXPAGE_CPU_KERNEL_LIB is not set"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registered = cpu_ops.available()
    assert registered, f"the sanitized kernel did not register: {[str(w.message) for w in caught]}"
    import jax.numpy as jnp

    def to_bf16(x):
        return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))

    rng = np.random.default_rng(0)
    counts = {"decode": 0, "prefill": 0}
    worst = 0.0
    worst_bf16 = {"dot": 0.0, "portable": 0.0}
    worst_quantized = 0.0
    quantized_counts = dict.fromkeys(QUANTIZED_FORMATS, 0)
    for seed in range(seeds):
        for shape_index, (num_heads, num_kv_heads, head_dim, block_size) in enumerate(SHAPES):
            progress(f"attention: seed {seed}, shape {SHAPES[shape_index]}")
            for decode in (True, False):
                fill = FILLS[(seed + shape_index + decode) % len(FILLS)]
                query_tile = (1, 3, 32)[(seed + shape_index) % 3]
                window, soft_cap = ATTENTION_OPTIONS[
                    (2 * (seed + shape_index) + decode) % len(ATTENTION_OPTIONS)]
                # decode items cut among the threads (3 parts), as the kernel chooses, or not
                key_splits = (3, 0, 1)[(seed + shape_index) % 3] if decode else 0
                options = dict(sliding_window=window, soft_cap=soft_cap, key_splits=key_splits)
                args, keys, values = random_batch(
                    rng, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    block_size=block_size, decode=decode, fill=fill, window=window)
                out = np.asarray(paged_attention_cpu(*args, query_tile=query_tile, **options))
                error = naive_error(out, args, keys, values, head_dim**-0.5, window, soft_cap)
                if not error <= 2e-5:
                    raise AssertionError(
                        f"seed {seed} shape {SHAPES[shape_index]} decode={decode} fill={fill} "
                        f"query_tile={query_tile} window={window} soft_cap={soft_cap} "
                        f"key_splits={key_splits}: max |error| {error} vs float64")
                worst = max(worst, error)
                counts["decode" if decode else "prefill"] += 1
                float32_args = args
                # the same batch with bfloat16 pools (NaN/inf survive the rounding)
                args = (*(to_bf16(a) for a in args[:3]), *args[3:])
                keys, values = [to_bf16(k) for k in keys], [to_bf16(v) for v in values]
                bf16_args = (*(jnp.asarray(a, jnp.bfloat16) for a in args[:3]), *args[3:])
                for mode in ("dot", "portable"):
                    out = np.asarray(paged_attention_cpu(
                        *bf16_args, query_tile=query_tile, bf16_dot=mode == "dot", **options
                    ).astype(jnp.float32))
                    ratio = bf16_ratio(out, args, keys, values, head_dim**-0.5, mode == "dot",
                                       window, soft_cap)
                    if not ratio <= 1.0:
                        raise AssertionError(
                            f"bf16 {mode}: seed {seed} shape {SHAPES[shape_index]} "
                            f"decode={decode} fill={fill} query_tile={query_tile} "
                            f"window={window} soft_cap={soft_cap}: error "
                            f"{ratio:.2f} x the bound vs float64")
                    worst_bf16[mode] = max(worst_bf16[mode], ratio)
                # the same batch with quantized pools, one format per batch in turn
                fmt = QUANTIZED_FORMATS[(seed + shape_index + decode) % len(QUANTIZED_FORMATS)]
                args_q, args_f, keys, values = quantize_batch(float32_args, fmt, fill)
                out = np.asarray(paged_attention_cpu(*args_q, query_tile=query_tile, **options))
                out_f = np.asarray(paged_attention_cpu(*args_f, query_tile=query_tile,
                                                       **options))
                where = (f"{fmt}: seed {seed} shape {SHAPES[shape_index]} decode={decode} "
                         f"fill={fill} query_tile={query_tile} window={window} "
                         f"soft_cap={soft_cap}")
                if not np.array_equal(out, out_f):
                    raise AssertionError(f"{where}: not bit for bit the float32 kernel on the "
                                         f"dequantized pools")
                error = naive_error(out, args_q, keys, values, head_dim**-0.5, window, soft_cap)
                if not error <= 2e-5:
                    raise AssertionError(f"{where}: max |error| {error} vs float64")
                worst_quantized = max(worst_quantized, error)
                quantized_counts[fmt] += 1
    progress("set_rows")
    set_rows_calls = check_set_rows(rng)
    progress("small_matmul")
    small_matmul_calls = check_small_matmul(rng)
    progress("packed_matmul")
    packed_matmul_calls = check_packed_matmul(rng)
    progress("packed_matmul_int8")
    packed_matmul_int8_calls = check_packed_matmul_int8(rng)
    progress("greedy_draw")
    greedy_draw_calls = check_greedy_draw(rng)
    progress("lora_matmul")
    lora_matmul_calls = check_lora_matmul(rng)
    progress("layer glue")
    layer_glue_calls = check_layer_glue(rng)
    progress("decoder_layer")
    decoder_layer_calls = check_decoder_layer(rng)
    progress("bad inputs")
    rejected = 0
    for name, call, message in bad_inputs():
        try:
            jax.block_until_ready(call())
        except Exception as e:  # noqa: BLE001 - XLA raises its own runtime error type
            if message not in str(e):
                raise AssertionError(f"{name}: error without {message!r}: {e}") from e
            rejected += 1
        else:
            raise AssertionError(f"{name}: no error")
    print(json.dumps({**counts, "rejected": rejected, "max_error": worst,
                      "bf16_dot_compiled": cpu_ops.bf16_dot_compiled(),
                      "bf16_worst_ratio": worst_bf16, "quantized": quantized_counts,
                      "quantized_max_error": worst_quantized, "set_rows": set_rows_calls,
                      "small_matmul": small_matmul_calls,
                      "packed_matmul": packed_matmul_calls,
                      "packed_matmul_int8": packed_matmul_int8_calls,
                      "greedy_draw": greedy_draw_calls, "lora_matmul": lora_matmul_calls,
                      "layer_glue": layer_glue_calls,
                      "decoder_layer": decoder_layer_calls}),
          flush=True)
    return 0


# ----------------------------------------------------------------------------- the parent


def report(stderr: str, finding: bool, max_lines: int = 200, max_width: int = 300) -> str:
    """The sanitizer's report from its first line on (else the end of the child's stderr, e.g.
    a traceback), with the long template names of XLA's FFI frames cut short."""
    lines = stderr.splitlines()
    if finding:
        first = next(i for i, line in enumerate(lines) if FINDING.search(line))
        lines = lines[first:first + max_lines]
    else:
        lines = lines[-max_lines:]
    return "\n".join(line if len(line) <= max_width else line[:max_width] + " ..."
                     for line in lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3,
                        help=f"random batches per shape and mode ({len(SHAPES)} shapes x "
                             "decode/prefill each)")
    parser.add_argument("--cxx", default=os.environ.get("CXX") or shutil.which("g++"),
                        help="C++ compiler (default: $CXX, else g++)")
    parser.add_argument("--source", type=Path,
                        help="build the library from this directory (a copy of "
                             "pallas_kernels/cpu/: its ffi.cc and headers) instead, e.g. an "
                             "older version, to see what the check finds in it")
    parser.add_argument("--timeout", type=float, default=1500.0,
                        help="seconds the sanitized child may run before it is stopped and "
                             "reported (default 1500)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.seeds, args.timeout)

    if not args.cxx:
        print("cpu kernel sanitizers: cannot run (no C++ compiler)")
        return 2
    runtimes = [_runtime(args.cxx, name) for name in ("libasan.so", "libubsan.so")]
    if None in runtimes:
        print(f"cpu kernel sanitizers: cannot run ({args.cxx} has no libasan/libubsan)")
        return 2
    with tempfile.TemporaryDirectory(prefix="jaxpage-sanitizers-") as tmp:
        started = time.perf_counter()
        try:
            library = build(args.cxx, Path(tmp), args.source)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            print("cpu kernel sanitizers: FAILED (the sanitized build failed)")
            return 1
        built = time.perf_counter()
        env = dict(os.environ)
        env.update(
            JAXPAGE_CPU_KERNEL_LIB=str(library), LD_PRELOAD=":".join(runtimes),
            ASAN_OPTIONS="detect_leaks=0", UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
            JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
                [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
        env.pop("JAXPAGE_NO_CPU_KERNEL", None)
        try:
            result = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--child", "--seeds",
                 str(args.seeds), "--timeout", str(args.timeout)], env=env,
                capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired as e:  # run() has killed the child
            stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (
                e.stderr or "")
            print(report(stderr, False), file=sys.stderr)
            print(f"cpu kernel sanitizers: FAILED (the child ran past {args.timeout:.0f} s; "
                  f"its stages and stacks above; build {built - started:.1f} s)")
            return 1
        ran = time.perf_counter()
    timing = f"build {built - started:.1f} s, run {ran - built:.1f} s"
    finding = FINDING.search(result.stderr + result.stdout)
    if result.returncode or finding:
        sys.stdout.write(result.stdout)
        print(report(result.stderr, finding is not None), file=sys.stderr)
        what = ("a sanitizer finding" if finding else
                f"the child exited with status {result.returncode}")
        print(f"cpu kernel sanitizers: FAILED ({what}; {timing})")
        return 1
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"cpu kernel sanitizers: clean under ASan+UBSan: {summary['decode']} decode and "
          f"{summary['prefill']} prefill batches over {len(SHAPES)} shapes (NaN/+inf/-inf in "
          f"unowned slots) within {summary['max_error']:.1e} of float64, the same with "
          f"bfloat16 pools on the dot path (compiled: {summary['bf16_dot_compiled']}; worst "
          f"{summary['bf16_worst_ratio']['dot']:.2f} x its bound) and the portable one ("
          f"{summary['bf16_worst_ratio']['portable']:.2f} x), quantized pools ("
          + ", ".join(f"{n} {fmt}" for fmt, n in summary["quantized"].items())
          + f" batches) bit for bit the float32 kernel on their dequantization and within "
          f"{summary['quantized_max_error']:.1e} of float64, {summary['set_rows']} in-place "
          f"pool writes (set_rows) equal to NumPy's, {summary['small_matmul']} small matmuls "
          f"and {summary['packed_matmul']} packed matmuls (and {summary['packed_matmul_int8']} "
          f"of int8 weights) within float32's bound of float64, "
          f"{summary['greedy_draw']} greedy draws as NumPy's argmax and log-sum-exp, "
          f"{summary['lora_matmul']} LoRA deltas within float32's bound of float64, "
          f"{summary['layer_glue']} layer glue calls (add + RMSNorm, SiLU, rope) as float64's, "
          f"{summary['decoder_layer']} decoder layer calls as the unfused calls bit for bit, "
          f"{summary['rejected']} bad inputs "
          f"rejected; {timing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
