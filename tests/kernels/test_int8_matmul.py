"""cpu_ops.packed_matmul_int8 (cpu/matmul_int8.h's panels, JaxpagePackedMatmulInt8) on int8
weights packed by `pack_weight_int8`, with a float32 scale per column: bit for bit against a
NumPy model of its arithmetic (each row of x scaled to int16, integer products summed exactly in
chunks of 256 k, the chunks added in float32, times scale * s), and within a stated bound of the
float64 product of x and w; the pack round trip, live rows, rows of zeros, NaN and inf, the
refusals; and (slow) this file again under the library built for AVX2 and for no vector
extension past SSE2.

Tolerance against float64: x's rounding to int16, |x - s x_q| <= s / 2 an element (s = max|x[m]|
/ 32767) plus the few float32 roundings of s and x * 32767 / max|x[m]|, and float32's
roundings of the chunks' sums and of the two final multiplies: `bound`."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_library, cpu_ops

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(not cpu_ops.available(),
                                 reason="the CPU kernel library is not available")]

DTYPES = [jnp.float32, jnp.bfloat16]
DTYPE_IDS = ["float32", "bfloat16"]
ROWS = (1, 3, 8, 17, 64, 200)  # chains of 4 and 2, one pass, and 3, 8, 25 passes
# K: one row, a step's tail only (7), an odd K over whole steps and a tail (33, 99), SmolLM2's
# hidden size, and a K of several int32 chunks (1536: SmolLM2's intermediate size)
KS = (1, 7, 33, 99, 576, 1536)
CHUNK = 256  # k rows an int32 sum runs over (the kernel's kInt8ChunkPairs pairs)


def operands(rng, m, k, n, dtype):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = rng.integers(-128, 128, (k, n), dtype=np.int8)  # -128 included
    scale = rng.uniform(1e-3, 3e-2, n).astype(np.float32)
    return x, w, scale


def integer_model(x, w, scale):
    """The kernel's arithmetic in NumPy: each row's scale s = a / 32767 (a = max|x[m]|, float32)
    and x_q = rint(x * (32767 / a)) in float32; x_q @ w exact in int64 over chunks of CHUNK k,
    each chunk converted to float32 and added in k's order; times (scale * s) rounded first. A
    row holding a NaN or an inf: NaN; a row of zeros or whose a < 2^-100: zeros (times scale)."""
    x = np.asarray(x, np.float32)
    a = np.abs(x).max(axis=1)
    finite = np.isfinite(x).all(axis=1)
    live = finite & (a >= np.float32(2.0**-100))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.float32(32767.0) / a
        q = np.where(live[:, None], np.rint(x * inv[:, None]), 0).astype(np.int64)
        s = np.where(live, a / np.float32(32767.0), np.where(finite, 0, np.nan)).astype(np.float32)
    total = np.zeros((x.shape[0], w.shape[1]), np.float32)
    for k0 in range(0, x.shape[1], CHUNK):
        total += (q[:, k0:k0 + CHUNK] @ w[k0:k0 + CHUNK].astype(np.int64)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        return total * (scale[None, :] * s[:, None]).astype(np.float32)


def oracle(x, w, scale):
    """((x @ w) * scale, (|x| @ |w|) * |scale|, (max|x[m]| * sum_k |w[k, n]|) * |scale|) in
    float64 (finite operands: BLAS's float64 rounding is far below the bound)."""
    x64, w64 = np.asarray(x, np.float64), w.astype(np.float64)
    s64 = np.abs(scale.astype(np.float64))
    return ((x64 @ w64) * scale.astype(np.float64), (np.abs(x64) @ np.abs(w64)) * s64,
            np.abs(x64).max(axis=1)[:, None] * np.abs(w64).sum(axis=0)[None, :] * s64)


def bound(k, magnitude, spread):
    # x's rounding: s / 2 = max|x| / 65534 an element (with 1% for the roundings of s and of
    # x * 32767 / a); float32's: the chunks' conversions and sums and the two multiplies
    chunks = -(-k // CHUNK)
    return spread / 65534 * 1.01 + (chunks + 4) * 2.0**-24 * magnitude * 1.01 + 1e-30


def check(out, x, w, scale):
    out = np.asarray(out)
    expected, magnitude, spread = oracle(x, w, scale)
    assert out.dtype == np.float32 and out.shape == expected.shape
    np.testing.assert_array_equal(out, integer_model(x, w, scale))
    err = np.abs(out - expected)
    assert np.all(err <= bound(x.shape[1], magnitude, spread)), (err.max(), x.shape, w.shape)


def test_build_target():
    # the child runs of test_other_builds: the library they load is the one they asked for
    march = os.environ.get("JAXPAGE_CPU_KERNEL_MARCH")
    if march not in ("x86-64-v3", "x86-64"):
        pytest.skip("the machine's own build (JAXPAGE_CPU_KERNEL_MARCH unset)")
    assert cpu_ops.panel_columns() == 16 and not cpu_ops.wide_vectors()
    assert not cpu_ops.bf16_dot_compiled()


@pytest.mark.parametrize("host", [True, False], ids=["numpy", "jax"])
def test_pack_weight_int8_round_trips(host):
    rng = np.random.default_rng(3)
    panel = cpu_ops.panel_columns()
    for k, n in ((1, panel), (33, 3 * panel), (98, 2 * panel)):
        w = rng.integers(-128, 128, (k, n), dtype=np.int8)
        packed = cpu_ops.pack_weight_int8(w if host else jnp.asarray(w))
        assert isinstance(packed, np.ndarray) == host
        assert packed.dtype == np.int8 and packed.shape == (n // panel, (k + 1) // 2, panel, 2)
        # panel p, pair row j // 2, column c, half j % 2: w[j, panel * p + c]
        for p, j, c in ((0, 0, 0), (n // panel - 1, k - 1, panel - 1), (n // panel - 1, k // 2, 5)):
            assert packed[p, j // 2, c, j % 2] == w[j, panel * p + c]
        if k % 2:  # an odd K's last pair: a zero second row
            np.testing.assert_array_equal(np.asarray(packed)[:, -1, :, 1], 0)
        np.testing.assert_array_equal(np.asarray(cpu_ops.unpack_weight_int8(packed, k)), w)
        np.testing.assert_array_equal(np.asarray(cpu_ops.unpack_weight_int8(packed, k - 1)),
                                      w[: k - 1])
    assert cpu_ops.packable_int8(np.zeros((8, panel), np.int8))
    assert not cpu_ops.packable_int8(np.zeros((8, panel + 8), np.int8))
    assert not cpu_ops.packable_int8(np.zeros((8, panel), np.uint8))
    assert not cpu_ops.packable_int8(np.zeros((8, panel), np.float32))
    with pytest.raises(ValueError, match=f"multiple of {panel}"):
        cpu_ops.pack_weight_int8(np.zeros((8, panel + 8), np.int8))
    with pytest.raises(ValueError, match="int8"):
        cpu_ops.pack_weight_int8(np.zeros((8, panel), np.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_packed_matmul_int8_matches_its_integer_model_and_float64(dtype):
    # under jit (the packed weight and scale as operands, not constants), every (M, K) of the
    # grid; N: one panel, and several panels over units of uneven shares between the threads
    # (both for two of the Ks, to keep the compilations few)
    panel = cpu_ops.panel_columns()
    rng = np.random.default_rng(11)
    step = jax.jit(cpu_ops.packed_matmul_int8)
    for k in KS:
        for n in (panel, 7 * panel) if k in (33, 576) else (3 * panel,):
            for m in ROWS:
                x, w, scale = operands(rng, m, k, n, dtype)
                check(step(x, cpu_ops.pack_weight_int8(w), scale), x, w, scale)


def test_decode_sized_weight():
    # a [576, 1536] projection (SmolLM2-135M's gate_up), the shape a decode step streams
    rng = np.random.default_rng(12)
    for dtype in DTYPES:
        for m in (1, 2, 4, 8):
            x, w, scale = operands(rng, m, 576, 1536, dtype)
            check(cpu_ops.packed_matmul_int8(x, cpu_ops.pack_weight_int8(w), scale), x, w, scale)


def test_extreme_weights_do_not_overflow_the_int32_sums():
    # every product at its largest (x_q = +-32767 against w = -128) over K = 1536 (three int32
    # chunks of 256 k, and a sum of 2^32.6 in all): exact, as the integer model says
    panel = cpu_ops.panel_columns()
    k = 1536
    w = np.full((k, panel), -128, np.int8)
    w[:, 1] = 127
    scale = np.ones(panel, np.float32)
    for x in (np.ones((2, k), np.float32), -np.ones((2, k), np.float32)):
        out = np.asarray(cpu_ops.packed_matmul_int8(jnp.asarray(x), cpu_ops.pack_weight_int8(w),
                                                    scale))
        np.testing.assert_array_equal(out, integer_model(x, w, scale))
        np.testing.assert_allclose(out[:, 0], x[:, 0] * -128.0 * k, rtol=2e-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_a_row_is_the_same_alone_and_among_others(dtype):
    # integer sums: a row's result does not depend on the pass, the chains or the other rows
    rng = np.random.default_rng(13)
    panel = cpu_ops.panel_columns()
    for k in (33, 600):
        x, w, scale = operands(rng, 19, k, 3 * panel, dtype)
        packed = cpu_ops.pack_weight_int8(w)
        together = np.asarray(cpu_ops.packed_matmul_int8(x, packed, scale))
        for m in (0, 7, 18):
            alone = np.asarray(cpu_ops.packed_matmul_int8(x[m:m + 1], packed, scale))
            np.testing.assert_array_equal(alone[0], together[m])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_live_rows_computes_only_those_rows(dtype):
    # a bucket's padding rows: zeros, the live rows bit for bit the product of those rows alone
    # (one compilation for every count: traced); out-of-range counts are clamped
    rng = np.random.default_rng(5)
    x, w, scale = operands(rng, 11, 69, 3 * cpu_ops.panel_columns(), dtype)
    packed = cpu_ops.pack_weight_int8(w)
    step = jax.jit(lambda x, live: cpu_ops.packed_matmul_int8(x, packed, scale, live_rows=live))
    for live in (0, 1, 3, 8, 9, 11, 40, -2):
        out = np.asarray(step(x, np.int32(live)))
        rows = min(max(live, 0), 11)
        if rows:
            alone = np.asarray(cpu_ops.packed_matmul_int8(x[:rows], packed, scale))
            np.testing.assert_array_equal(out[:rows], alone)
            check(out[:rows], x[:rows], w, scale)
        np.testing.assert_array_equal(out[rows:], 0.0)
    # live rows as a plain int, and none at all
    np.testing.assert_array_equal(
        np.asarray(cpu_ops.packed_matmul_int8(x, packed, scale, live_rows=2))[2:], 0.0)
    assert cpu_ops.packed_matmul_int8(x[:0], packed, scale).shape == (0, w.shape[1])


def test_prefetch_distance_does_not_change_the_result():
    rng = np.random.default_rng(7)
    for m in (1, 2, 3, 8, 9):
        x, w, scale = operands(rng, m, 99, 5 * cpu_ops.panel_columns(), jnp.bfloat16)
        packed = cpu_ops.pack_weight_int8(w)
        default = np.asarray(cpu_ops.packed_matmul_int8(x, packed, scale))
        check(default, x, w, scale)
        for ahead in (64, 4096, 1 << 20):
            np.testing.assert_array_equal(
                np.asarray(cpu_ops.packed_matmul_int8(x, packed, scale, prefetch_bytes=ahead)),
                default)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_zeros_nan_inf_and_tiny_rows(dtype):
    # a row holding a NaN or an inf has no int16 scale: all NaN; a row of zeros, or one whose
    # largest magnitude is below 2^-100 (float32 only: bfloat16 has such values too), is zeros;
    # the scales by IEEE's rules: an infinite scale makes its column +-inf (NaN where the sum is
    # 0), a NaN scale its column NaN
    rng = np.random.default_rng(2)
    panel = cpu_ops.panel_columns()
    for m in (5, 12):
        x, w, scale = operands(rng, m, 37, 2 * panel, dtype)
        w[:, 1] = 0
        x = (x.at[0, 5].set(jnp.nan).at[1, 36].set(jnp.inf).at[2].set(0.0)
             .at[3].set(jnp.asarray(2.0**-110, dtype)))
        scale[3], scale[4], scale[1] = np.inf, np.nan, -np.inf
        out = np.asarray(cpu_ops.packed_matmul_int8(x, cpu_ops.pack_weight_int8(w), scale))
        np.testing.assert_array_equal(out, integer_model(x, w, scale))
        assert np.isnan(out[:2]).all()
        np.testing.assert_array_equal(np.nan_to_num(out[2:4], nan=0.0), 0.0)
        assert np.isnan(out[4:, 4]).all() and np.isnan(out[4:, 1]).all()  # NaN scale; 0 * -inf
        assert np.isinf(out[4:, 3]).all()
        cols = np.isfinite(scale)  # the finite rows' finite columns, within the bound
        check(out[4:, cols], x[4:], w[:, cols], scale[cols])


def test_bad_operands():
    panel = cpu_ops.panel_columns()
    w = cpu_ops.pack_weight_int8(np.ones((8, 2 * panel), np.int8))
    scale = np.ones(2 * panel, np.float32)
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_ops.packed_matmul_int8(x.astype(jnp.float16), w, scale)
    with pytest.raises(ValueError, match="int8 packed weight"):
        cpu_ops.packed_matmul_int8(x, w.astype(np.float32), scale)
    with pytest.raises(ValueError, match=r"\[N / \d+, ceil\(K / 2\)"):
        cpu_ops.packed_matmul_int8(jnp.ones((2, 9)), w, scale)
    with pytest.raises(ValueError, match="one a column"):
        cpu_ops.packed_matmul_int8(x, w, scale[:panel])
    with pytest.raises(ValueError, match=r"prefetch_bytes must be in \[0, 1048576\]"):
        cpu_ops.packed_matmul_int8(x, w, scale, prefetch_bytes=-64)
    # the handler checks for itself (an ffi_call past the wrapper)
    def raw(out_columns):
        call = jax.ffi.ffi_call(cpu_library.TARGET_PACKED_MATMUL_INT8,
                                jax.ShapeDtypeStruct((2, out_columns), jnp.float32))
        return lambda *args, layer=-1, **attrs: call(*args, layer=np.int64(layer), **attrs)

    two = np.int32(2)
    zero = np.int64(0)
    with pytest.raises(Exception, match="output"):
        jax.block_until_ready(raw(panel)(x, w, scale, two, prefetch_bytes=zero))
    with pytest.raises(Exception, match="not an int8 weight packed for x"):
        jax.block_until_ready(raw(2 * panel)(jnp.ones((2, 9)), w, scale, two,
                                             prefetch_bytes=zero))
    with pytest.raises(Exception, match="not an int8 weight"):
        jax.block_until_ready(raw(2 * panel)(x, w.view(np.uint8), scale, two,
                                             prefetch_bytes=zero))
    with pytest.raises(Exception, match="is not float32 or bfloat16|not float32 or bfloat16"):
        jax.block_until_ready(raw(2 * panel)(x.astype(jnp.float16), w, scale, two,
                                             prefetch_bytes=zero))
    with pytest.raises(Exception, match="one a column"):
        jax.block_until_ready(raw(2 * panel)(x, w, scale[:panel], two, prefetch_bytes=zero))
    with pytest.raises(Exception, match="live rows must be one int32"):
        jax.block_until_ready(raw(2 * panel)(x, w, scale, np.int32([2, 2]),
                                             prefetch_bytes=zero))
    with pytest.raises(Exception, match="prefetch_bytes must be in"):
        jax.block_until_ready(raw(2 * panel)(x, w, scale, two,
                                             prefetch_bytes=np.int64((1 << 20) + 1)))
    # a layer outside a stack (or of a weight that is no stack)
    stack_w, stack_scale = np.stack([w, w]), np.stack([scale, scale])
    for layer in (2, 7):
        with pytest.raises(Exception, match=f"layer {layer} is outside w"):
            jax.block_until_ready(raw(2 * panel)(x, stack_w, stack_scale, two,
                                                 prefetch_bytes=zero, layer=layer))
    with pytest.raises(ValueError, match="layer 2 is outside the stacked"):
        cpu_ops.packed_matmul_int8(x, stack_w, stack_scale, layer=2)


@pytest.mark.slow
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "portable"])
def test_other_builds(march):
    # this file's default tests again in a child process whose library is built for AVX2 (16-
    # column panels, 6 rows a pass, vpmaddwd on 8 lanes) or for plain x86-64 (GCC's vectors):
    # a build of its own, ~1 minute on a 2-core CPU (cached after)
    if platform.machine() != "x86_64":
        pytest.skip("x86-64 targets")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, JAXPAGE_CPU_KERNEL_MARCH=march)
    env.pop("JAXPAGE_CPU_KERNEL_LIB", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider", "-m",
         "not slow", str(Path(__file__).resolve())],
        cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = [line for line in result.stdout.splitlines() if " passed" in line][-1]
    assert "skipped" not in summary, result.stdout[-2000:]  # test_build_target ran


def _unfused_layer(x, h, layer, cos, sin, k_pool, v_pool, slots, tables, seq_lens, qsl,
                   next_norm, num_heads, eps, matmul):
    """The calls `cpu_ops.decoder_layer` stands for, in its order (cpu/decoder_layer.h)."""
    dtype = x.dtype
    kv_heads = k_pool.shape[0]
    q, k, v = cpu_ops.qkv_rope(matmul("qkv", h), cos, sin, num_heads, kv_heads)
    k_pool = cpu_ops.set_rows(k_pool, slots, k, token_major=True)
    v_pool = cpu_ops.set_rows(v_pool, slots, v, token_major=True)
    a = cpu_ops.paged_attention_cpu(q, k_pool, v_pool, tables, seq_lens, qsl)
    x1, h1 = cpu_ops.add_rms_norm(x, matmul("o", a.reshape(x.shape[0], -1)), layer["mlp_norm"],
                                  eps)
    act = cpu_ops.silu_mul(matmul("gate_up", h1), dtype)
    x2, h2 = cpu_ops.add_rms_norm(x1, matmul("down", act), next_norm, eps)
    return x2, h2, k_pool, v_pool


# (hidden, heads, kv heads, head_dim, intermediate) in panels of 32 (AVX-512) or 16 columns:
# head_dim 64, whole panels a head (the qkv stage's rotary epilogue) and an intermediate size
# of whole panels (gate_up's SiLU epilogue); head_dim 16 and an intermediate size of 1.5
# panels on AVX-512 (a rotary stage and a SiLU stage of their own)
LAYER_SHAPES = [(128, 2, 1, 64, 96), (64, 4, 2, 16, 48)]


@pytest.mark.parametrize("shape", LAYER_SHAPES, ids=["epilogues", "stages"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_decoder_layer_with_int8_weights_is_the_unfused_calls_bit_for_bit(dtype, shape):
    # a decode step of three sequences (1, 20 and 37 keys) in the fused layer, its projections
    # int8 with their scales (the down projection kept float: each weight on its own), against
    # the unfused calls: outputs and pools byte for byte
    hidden, heads, kv_heads, dim, inter = shape
    rng = np.random.default_rng(21)
    block, blocks = 16, 12

    def normal(*shape_, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape_) * scale, dtype)

    def int8(k, n):
        return (rng.integers(-128, 128, (k, n), dtype=np.int8),
                rng.uniform(1e-3, 2e-2, n).astype(np.float32))

    weights = {"qkv": int8(hidden, (heads + 2 * kv_heads) * dim), "o": int8(heads * dim, hidden),
               "gate_up": int8(hidden, 2 * inter)}
    layer = {name: cpu_ops.pack_weight_int8(w) for name, (w, _) in weights.items()}
    layer |= {f"{name}_scale": s for name, (_, s) in weights.items()}
    down = normal(inter, hidden, scale=0.05)
    layer["down"] = cpu_ops.pack_weight(down)
    layer["mlp_norm"] = normal(hidden)
    next_norm = normal(hidden)
    x, h = normal(3, hidden), normal(3, hidden)
    angles = rng.uniform(0, 2 * np.pi, (3, dim))
    cos, sin = jnp.asarray(np.cos(angles), dtype), jnp.asarray(np.sin(angles), dtype)
    k_pool, v_pool = normal(kv_heads, blocks, block, dim), normal(kv_heads, blocks, block, dim)
    tables = jnp.asarray([[3, 0, 0], [5, 1, 0], [7, 2, 9]], jnp.int32)
    seq_lens = np.asarray([1, 20, 37], np.int32)
    pos = seq_lens - 1
    slots = jnp.asarray(np.asarray(tables)[np.arange(3), pos // block] * block + pos % block,
                        jnp.int32)
    qsl = jnp.asarray([0, 1, 2, 3], jnp.int32)
    args = (x, h, layer, cos, sin, k_pool, v_pool, slots, tables, jnp.asarray(seq_lens), qsl,
            next_norm)

    def matmul(name, rows):
        if name == "down":
            return cpu_ops.packed_matmul(rows, layer["down"])
        return cpu_ops.packed_matmul_int8(rows, layer[name], layer[f"{name}_scale"])

    fused = jax.jit(lambda *a: cpu_ops.decoder_layer(*a, num_heads=heads, eps=1e-5))(*args)
    unfused = _unfused_layer(*args, heads, 1e-5, matmul)
    for ours, theirs in zip(fused, unfused, strict=True):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        np.testing.assert_array_equal(np.asarray(ours).view(np.uint8),
                                      np.asarray(theirs).view(np.uint8))
    assert np.isfinite(np.asarray(fused[0], np.float32)).all()
    # an int8 weight without its scale, or a scale beside a float weight: refused
    with pytest.raises(ValueError, match="'o_scale'"):
        cpu_ops.decoder_layer(x, h, {k: v for k, v in layer.items() if k != "o_scale"},
                              *args[3:], num_heads=heads, eps=1e-5)
    with pytest.raises(ValueError, match="'down_scale'"):
        cpu_ops.decoder_layer(x, h, layer | {"down_scale": np.ones(hidden, np.float32)},
                              *args[3:], num_heads=heads, eps=1e-5)
    # the handler checks a scale's length itself
    short = layer | {"gate_up_scale": layer["gate_up_scale"][:-1]}
    with pytest.raises(Exception, match="do not fit"):
        jax.block_until_ready(cpu_ops.decoder_layer(x, h, short, *args[3:], num_heads=heads,
                                                    eps=1e-5))
