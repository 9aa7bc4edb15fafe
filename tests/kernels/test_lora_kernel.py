"""Multi-LoRA deltas: cpu_ops.lora_matmul (cpu/lora.h's JaxpageLoraMatmul) against a float64
NumPy oracle and against the jnp reference `pallas_kernels.lora.lora_matmul_reference`, and the
dispatcher `pallas_kernels.lora.lora_matmul` lowered for CPU, TPU and CUDA.

Tolerance, row by row (rows with an adapter; every other row must keep y bit for bit): the
shrink tmp = x @ a runs in float32 (bfloat16 widened exactly), so the kernel's tmp lies within
e = (K + 2) 2^-24 (|x| @ |a|) of the exact one; bfloat16 then rounds it, and rounding is
monotone, so the kernel's rounded tmp lies in [round(tmp - e), round(tmp + e)] (one value
unless an exact sum lies near a tie: a flip there moves the delta by a bfloat16 ulp of tmp times
b, far more than float32 rounding, which is why no plain relative tolerance holds for every
row). With mid and rad that interval's centre and half width (float32: tmp and e), the output
is within rad @ |b| + (R + 2) 2^-24 ((|mid| + rad) @ |b|) + 2^-23 (|y| + ...) of y + mid @ b.
Beside that bound, where no flip is possible the error is also held to 1e-5 of the delta's
norm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import cpu_library, cpu_ops, lora

pytestmark = pytest.mark.kernels
needs_kernel = pytest.mark.skipif(not cpu_ops.available(),
                                  reason="the CPU kernel library is not available")

DTYPES = [jnp.float32, jnp.bfloat16]
ROWS = [1, 3, 8, 64, 257]
NUM_SLOTS = [2, 5, 17]
RANKS = [1, 8, 16, 48, 64]
# (K, N): no full vector, vector tails of one and of two vectors (17, 50), many column blocks
# with a tail, SmolLM2-135M's qkv and down projections
SHAPES = [(7, 5), (33, 100), (17, 50), (576, 960), (1536, 576)]
EPS32 = 2.0**-24


def operands(rng, t, k, r, n, s, dtype, slot_range=None):
    y = jnp.asarray(rng.standard_normal((t, n)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((t, k)), dtype)
    a = jnp.asarray(rng.standard_normal((s, k, r)) / np.sqrt(k), dtype)
    b = jnp.asarray(rng.standard_normal((s, r, n)) / np.sqrt(r), dtype)
    lo, hi = slot_range or (0, s)
    slots = jnp.asarray(rng.integers(lo, hi, t), jnp.int32)
    return y, x, a, b, slots


def oracle(y, x, a, b, slots, live_rows=None):
    """(expected [T, N] float64, bound [T, N], active [T], unambiguous [T]): see the module's
    docstring. `unambiguous`: rows whose rounded intermediate is one value."""
    bf16 = jnp.dtype(x.dtype) == jnp.bfloat16
    y64, x64 = np.asarray(y, np.float64), np.asarray(x, np.float64)
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    slots = np.asarray(slots)
    t, k = x64.shape
    s, _, r = a64.shape
    live = t if live_rows is None else int(live_rows)
    active = (slots > 0) & (slots < s) & (np.arange(t) < live)
    expected, bound = y64.copy(), np.zeros_like(y64)
    unambiguous = np.ones(t, bool)
    for row in np.flatnonzero(active):
        ai, bi = a64[slots[row]], b64[slots[row]]
        tmp = x64[row] @ ai
        e = (k + 2) * EPS32 * (np.abs(x64[row]) @ np.abs(ai))
        if bf16:
            def rounded(v):
                return np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
            lo, hi = rounded(tmp - e), rounded(tmp + e)
            mid, rad = (lo + hi) / 2, (hi - lo) / 2
            unambiguous[row] = np.array_equal(lo, hi)
        else:
            mid, rad = tmp, e
        delta = mid @ bi
        expected[row] += delta
        magnitude = (np.abs(mid) + rad) @ np.abs(bi)
        bound[row] = (rad @ np.abs(bi) + (r + 2) * EPS32 * magnitude
                      + 2 * EPS32 * (np.abs(y64[row]) + magnitude))
    return expected, bound + 1e-30, active, unambiguous


def check(out, y, x, a, b, slots, live_rows=None):
    expected, bound, active, unambiguous = oracle(y, x, a, b, slots, live_rows)
    out = np.asarray(out)
    assert out.dtype == np.float32 and out.shape == expected.shape
    np.testing.assert_array_equal(out[~active], np.asarray(y)[~active])  # untouched rows
    err = np.abs(out - expected)
    assert np.all(err <= bound), (err - bound).max()
    sure = active & unambiguous
    if sure.any():
        delta = expected[sure] - np.asarray(y, np.float64)[sure]
        assert np.linalg.norm(err[sure]) <= 1e-5 * np.linalg.norm(delta) + 1e-30


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("r", RANKS)
@pytest.mark.parametrize("k,n", SHAPES)
def test_kernel_matches_float64(dtype, r, k, n):
    rng = np.random.default_rng(k * 10_000 + n * 100 + r)
    for t in ROWS:
        for s in NUM_SLOTS:
            if k * n > 100_000 and (t, s) not in ((1, 2), (8, 5), (64, 17), (257, 17)):
                continue  # keep the big shapes quick
            # slots from -1 to S + 1: none, every adapter, and out of range either way
            y, x, a, b, slots = operands(rng, t, k, r, n, s, dtype, (-1, s + 2))
            live = [None, int(rng.integers(0, t + 1))]
            for live_rows in live:
                out = cpu_ops.lora_matmul(y, x, a, b, slots, live_rows)
                check(out, y, x, a, b, slots, live_rows)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("r", [20, 256])  # two vectors with a partial one; 8 passes of R
def test_other_ranks(dtype, r):
    rng = np.random.default_rng(r)
    for t, (k, n) in [(1, (40, 70)), (9, (40, 70)), (64, (576, 960))]:
        y, x, a, b, slots = operands(rng, t, k, r, n, 3, dtype)
        check(cpu_ops.lora_matmul(y, x, a, b, slots), y, x, a, b, slots)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_kernel_equals_reference_under_jit_with_y_donated(dtype):
    rng = np.random.default_rng(3)
    y, x, a, b, slots = operands(rng, 64, 576, 16, 960, 17, dtype)
    live = jnp.int32(50)
    reference = jax.jit(lora.lora_matmul_reference)(y, x, a, b, slots, live)
    expected = np.asarray(reference)
    y_copy = np.asarray(y).copy()
    kernel = jax.jit(cpu_ops.lora_matmul, donate_argnums=0)
    out = np.asarray(kernel(y, x, a, b, slots, live))  # y's buffer, updated in place
    check(out, y_copy, x, a, b, slots, 50)
    check(expected, y_copy, x, a, b, slots, 50)
    _, bound, _, _ = oracle(y_copy, x, a, b, slots, 50)
    np.testing.assert_array_equal(out[50:], y_copy[50:])
    assert np.all(np.abs(out - expected) <= 2 * bound)  # each within its bound of the oracle
    if dtype == jnp.float32:
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_each_row_is_computed_alone(dtype):
    """A row's result is the same bit for bit whatever else the call holds: alone (one row,
    the calling thread), among many rows of many adapters (tiles shared by the threads), and
    among rows of one adapter (one tile whose columns the threads share): so it depends on no
    thread count, nor on the batch."""
    rng = np.random.default_rng(4)
    for t, s, r, (k, n), slot_range in [(257, 17, 16, (576, 960), None),
                                        (8, 2, 64, (576, 960), (1, 2)),
                                        (40, 5, 20, (33, 100), None)]:
        y, x, a, b, slots = operands(rng, t, k, r, n, s, dtype, slot_range)
        batch = np.asarray(jax.jit(cpu_ops.lora_matmul)(y, x, a, b, slots))
        again = np.asarray(jax.jit(cpu_ops.lora_matmul)(y, x, a, b, slots))
        np.testing.assert_array_equal(batch, again)
        one = jax.jit(cpu_ops.lora_matmul)
        for row in range(0, t, max(1, t // 9)):
            alone = one(y[row:row + 1], x[row:row + 1], a, b, slots[row:row + 1])
            np.testing.assert_array_equal(np.asarray(alone)[0], batch[row])


@needs_kernel
def test_no_live_rows_or_adapters_leave_y():
    rng = np.random.default_rng(5)
    y, x, a, b, slots = operands(rng, 6, 20, 8, 30, 4, jnp.float32)
    for args in [(slots, 0), (jnp.zeros(6, jnp.int32), None), (slots, -3)]:
        np.testing.assert_array_equal(cpu_ops.lora_matmul(y, x, a, b, *args), y)
    empty = cpu_ops.lora_matmul(y[:0], x[:0], a, b, slots[:0])
    assert empty.shape == (0, 30)


@pytest.mark.parametrize("t,k,r,n,s", [(5, 0, 4, 30, 3), (5, 20, 0, 30, 3), (5, 20, 4, 0, 3),
                                       (5, 20, 4, 30, 1), (5, 20, 4, 30, 0), (0, 20, 4, 30, 3)],
                         ids=["K0", "R0", "N0", "S1", "S0", "T0"])
def test_empty_dimensions(t, k, r, n, s):
    """Zero-sized K, R, N, T, and no adapter slots but 0 (S = 1) or none at all (S = 0): the
    kernel (where built), the dispatcher and the reference give y + 0 for the live rows with
    an adapter, y elsewhere."""
    rng = np.random.default_rng(9)
    y, x, a, b, _ = operands(rng, t, k, r, n, s, jnp.float32, (0, 1))
    slots = jnp.asarray(np.arange(t) % max(s, 1), jnp.int32)
    functions = [lora.lora_matmul_reference, lora.lora_matmul]
    if cpu_ops.available():
        functions.append(cpu_ops.lora_matmul)
    for fn in functions:
        out = fn(y, x, a, b, slots)
        assert out.shape == y.shape and out.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(out), np.asarray(y))


@needs_kernel
def test_the_dispatcher_takes_the_kernel_on_cpu():
    rng = np.random.default_rng(6)
    y, x, a, b, slots = operands(rng, 8, 64, 8, 96, 5, jnp.bfloat16)
    text = jax.jit(lora.lora_matmul).lower(y, x, a, b, slots).as_text()
    assert cpu_library.TARGET_LORA_MATMUL in text
    out = jax.jit(lora.lora_matmul)(y, x, a, b, slots, jnp.int32(6))
    check(out, y, x, a, b, slots, 6)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_the_dispatcher_lowers_the_reference_elsewhere(platform):
    rng = np.random.default_rng(7)
    y, x, a, b, slots = operands(rng, 8, 64, 8, 96, 5, jnp.bfloat16)
    exported = jax.export.export(jax.jit(lora.lora_matmul), platforms=[platform])(
        y, x, a, b, slots, jnp.int32(6))
    module = exported.mlir_module()
    assert cpu_library.TARGET_LORA_MATMUL not in module
    assert "stablehlo.dot_general" in module


def test_the_reference_matches_float64():
    rng = np.random.default_rng(8)
    for dtype in DTYPES:
        y, x, a, b, slots = operands(rng, 33, 40, 8, 70, 5, dtype, (-1, 7))
        check(lora.lora_matmul_reference(y, x, a, b, slots, 30), y, x, a, b, slots, 30)


BAD = [  # (what to change, the message's words)
    (dict(x=np.ones((4, 9), np.float32)), r"x \(4, 9\), a \(3, 8, 2\)"),
    (dict(a=np.ones((3, 8, 2, 1), np.float32)), r"a \(3, 8, 2, 1\)"),
    (dict(b=np.ones((3, 2, 7), np.float32)), r"b \(3, 2, 7\)"),
    (dict(b=np.ones((2, 2, 6), np.float32)), r"b \(2, 2, 6\)"),
    (dict(slots=np.ones(5, np.int32)), r"slots \(5,\)"),
    (dict(y=np.ones((4, 6), np.float16)), "float32 y, got float16"),
    (dict(x=np.ones((4, 8), ml_dtypes.bfloat16)), "one dtype, got bfloat16, float32 and float32"),
    (dict(slots=np.ones(4, np.float32)), "integer slots"),
]


def _good():
    return dict(y=np.ones((4, 6), np.float32), x=np.ones((4, 8), np.float32),
                a=np.ones((3, 8, 2), np.float32), b=np.ones((3, 2, 6), np.float32),
                slots=np.ones(4, np.int32))


@pytest.mark.parametrize("change,message", BAD)
def test_bad_operands_name_the_shapes(change, message):
    args = _good() | change
    functions = [lora.lora_matmul_reference, lora.lora_matmul]
    if cpu_ops.available():
        functions.append(cpu_ops.lora_matmul)
    for fn in functions:
        with pytest.raises(ValueError, match=message):
            fn(**{k: jnp.asarray(v) for k, v in args.items()})


@needs_kernel
def test_the_kernel_takes_float32_and_bfloat16_only():
    args = {k: jnp.asarray(v) for k, v in _good().items()}
    for name in ("x", "a", "b"):
        args[name] = args[name].astype(jnp.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16, got float16"):
        cpu_ops.lora_matmul(**args)
    out = lora.lora_matmul(**args)  # the dispatcher takes the reference for them
    np.testing.assert_allclose(np.asarray(out), 17 * np.ones((4, 6)))


def test_the_kernel_needs_the_library(monkeypatch):
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    args = {k: jnp.asarray(v) for k, v in _good().items()}
    with pytest.raises(RuntimeError, match="not available"):
        cpu_ops.lora_matmul(**args)
    np.testing.assert_allclose(np.asarray(lora.lora_matmul(**args)), 17 * np.ones((4, 6)))
