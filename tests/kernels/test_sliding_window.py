"""Sliding-window attention and attention-logit soft-capping in every attention backend,
against a float64 NumPy oracle written out key by key and against the dense jnp reference.

Every batch is poisoned the way a sliding layer's pool is in the engine: NaN in every slot no
sequence owns, and every block-table entry before a sequence's first needed block (the block
holding the first key its earliest query sees) pointing at a block full of NaN, either the
freed block itself (reused by someone else: its contents are anything) or the null block 0.
A backend that reads such an entry into the output shows NaN.

The Pallas kernels run in interpret mode (the TPU one under the TPU interpreter); their
cases are kept small. The lowering tests export both kernels with a window and a soft-cap
for their real platforms.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_decode_kernels import TRITON_TARGETS, abstract_gpu_context
from test_ragged_kernels import make_batch

from jaxpage.attention import build_metadata, paged_attention
from pallas_kernels import cpu_ops, paged_decode_gpu, ragged_paged_gpu
from pallas_kernels.blockwise import paged_attention_blockwise
from pallas_kernels.cpu_ops import paged_attention_cpu
from pallas_kernels.paged_decode_gpu import paged_decode_attention_gpu
from pallas_kernels.paged_decode_tpu import paged_decode_attention_tpu
from pallas_kernels.ragged_paged_gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_tpu import ragged_paged_attention_tpu
from pallas_kernels.reference import paged_attention_reference

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.filterwarnings(
        f"ignore:{ragged_paged_gpu.TRITON_DEPRECATION_MESSAGE}:DeprecationWarning"),
]

BLOCK_SIZE = 16
TOLERANCE = {np.float32: 1e-5, jnp.bfloat16: 2e-2}  # times the largest |expected|
needs_cpp = pytest.mark.skipif(not cpu_ops.available(),
                               reason="the C++ kernel could not be built here")


def ragged(fn, **fixed):
    """A kernel under the one signature the tests call: (*inputs, max_query_len, **options)."""
    return functools.partial(fn, **fixed)


def without_max_query_len(fn, **fixed):
    """The C++ kernel walks each sequence's queries itself: it takes no max_query_len."""
    def call(*inputs, max_query_len, **options):
        del max_query_len
        return fn(*inputs, **fixed, **options)
    return call


# name -> (kernel, pool dtype)
BACKENDS = {
    "blockwise": (ragged(paged_attention_blockwise), np.float32),
    # one block per chunk and 4-token query tiles: many loop steps, tiles of one chunk
    # starting their windows in different blocks
    "blockwise_small_chunks": (ragged(paged_attention_blockwise, blocks_per_chunk=1,
                                      query_tile=4), np.float32),
    "cpp_f32": (without_max_query_len(paged_attention_cpu, query_tile=8), np.float32),
    "cpp_bf16_dot": (without_max_query_len(paged_attention_cpu, query_tile=8, bf16_dot=True),
                     jnp.bfloat16),
    "cpp_bf16_portable": (without_max_query_len(paged_attention_cpu, query_tile=8,
                                                bf16_dot=False), jnp.bfloat16),
    "pallas_gpu": (ragged(ragged_paged_attention_gpu, interpret=True), np.float32),
    "pallas_tpu": (ragged(ragged_paged_attention_tpu, interpret=True), np.float32),
}
CPP = [name for name in BACKENDS if name.startswith("cpp")]
PALLAS = ("pallas_gpu", "pallas_tpu")


def marks(backend, *, fast_in_interpreter=True):
    """The C++ kernel's cases skip where it could not be built; the interpreted Pallas
    kernels' cases that are not `fast_in_interpreter` are `slow` (each costs seconds)."""
    if backend in CPP:
        return [needs_cpp]
    if backend in PALLAS and not fast_in_interpreter:
        return [pytest.mark.slow]
    return []


def cases(values, fast_in_interpreter=lambda *value: True):
    """pytest params of every backend with every tuple of `values`."""
    return [pytest.param(backend, *value, id="-".join(map(str, (backend, *value))),
                         marks=marks(backend, fast_in_interpreter=fast_in_interpreter(*value)))
            for backend in BACKENDS for value in values]


def mixed_spec(b: int) -> list[tuple[int, int]]:
    """(seq_len, query_len) of a mixed step, small enough for the interpreters."""
    return [
        (5 * b + 3, 1),  # decode token, mid-block
        (0, 0),  # padding sequence
        (4 * b, 2 * b + 5),  # chunk starting mid-block: its queries' windows start in
        # different blocks
        (1, 1),  # one-token prompt
        (100, 40),  # a longer chunk over several blocks
        (2 * b, 2 * b),  # a whole prompt from position 0
        (b - 1, 1),  # decode token in the first block
    ]


def decode_spec(b: int) -> list[tuple[int, int]]:
    """A pure-decode step (the decode kernels' batch)."""
    return [(5 * b + 3, 1), (0, 0), (1, 1), (3 * b, 1), (b - 1, 1), (100, 1)]


def first_needed_block(seq_len, query_len, window, block_size):
    """The block holding the first key the sequence's earliest query sees."""
    return max(0, seq_len - query_len - window + 1) // block_size


def window_batch(spec, *, window, group=1, dtype=np.float32, seed=0, num_kv_heads=2):
    """`make_batch`'s ragged inputs (head_dim 64, NaN in unowned slots) with the blocks
    before each sequence's window freed: each such block filled with NaN, and its table entry
    left pointing at it (reused garbage), at the null block 0 (also NaN) or outside the pool
    in turn (reading that is an error in the C++ kernel and in the TPU interpreter)."""
    inputs, max_query_len = make_batch(spec, group=group, head_dims=(64, 64),
                                       block_size=BLOCK_SIZE, dtype=np.float32, seed=seed,
                                       num_kv_heads=num_kv_heads)
    q, k_pool, v_pool, tables, seq_lens, starts = (np.array(x) for x in inputs)
    freed = 0
    for seq, (length, count) in enumerate(spec):
        if not count or window is None:
            continue
        for page in range(first_needed_block(length, count, window, BLOCK_SIZE)):
            k_pool[:, tables[seq, page]] = v_pool[:, tables[seq, page]] = np.nan
            tables[seq, page] = (tables[seq, page], 0, k_pool.shape[1] + 5)[freed % 3]
            freed += 1
    assert window is None or window > 1000 or freed, "the batch frees no block"
    cast = functools.partial(jnp.asarray, dtype=dtype)
    return (cast(q), cast(k_pool), cast(v_pool), jnp.asarray(tables), jnp.asarray(seq_lens),
            jnp.asarray(starts)), max_query_len


def window_oracle(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, *, window=None,
                  soft_cap=None, scale=None):
    """Float64 attention one query and head at a time, reading only the keys in the query's
    window (positions max(0, p - window + 1) .. p), each through the block table."""
    q, k_pool, v_pool = (np.asarray(jnp.asarray(x, jnp.float32), np.float64)
                         for x in (q, k_pool, v_pool))
    tables, lens, starts = (np.asarray(x) for x in (block_tables, seq_lens, query_start_loc))
    _, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pool.shape
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    out = np.zeros(q.shape, np.float64)  # padding tokens stay zero
    for seq, length in enumerate(lens):
        count = starts[seq + 1] - starts[seq]
        for j in range(count):
            pos = length - count + j
            first = 0 if window is None else max(0, pos - window + 1)
            keys = np.arange(first, pos + 1)
            blocks, slots = tables[seq, keys // block_size], keys % block_size
            for head in range(num_heads):
                kv = head // group
                scores = k_pool[kv, blocks, slots] @ q[starts[seq] + j, head] * scale
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                weights = np.exp(scores - scores.max())
                out[starts[seq] + j, head] = weights @ v_pool[kv, blocks, slots] / weights.sum()
    return out


def assert_matches(out, inputs, max_query_len, dtype, **options):
    """Finite and within tolerance of both the float64 oracle and the dense reference."""
    assert out.shape == inputs[0].shape
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.isfinite(out).all()
    expected = window_oracle(*inputs, window=options.get("sliding_window"),
                             soft_cap=options.get("soft_cap"))
    reference = np.asarray(paged_attention_reference(
        *inputs, max_query_len=max_query_len, **options).astype(jnp.float32), np.float64)
    atol = TOLERANCE[dtype] * np.abs(expected).max()
    np.testing.assert_allclose(out, expected, rtol=0, atol=atol)
    np.testing.assert_allclose(out, reference, rtol=0, atol=atol)


def run(backend, spec, *, group=1, seed=0, **options):
    kernel, dtype = BACKENDS[backend]
    inputs, max_query_len = window_batch(spec(BLOCK_SIZE), window=options.get("sliding_window"),
                                         group=group, dtype=dtype, seed=seed)
    out = kernel(*inputs, max_query_len=max_query_len, **options)
    assert_matches(out, inputs, max_query_len, dtype, **options)


def test_oracle_is_the_reference():
    """The oracle against the dense reference on clean inputs first (no poison, whose NaN
    would be the reference's to ignore), so that a backend failure points at the backend."""
    inputs, max_query_len = window_batch(mixed_spec(BLOCK_SIZE), window=None, group=4)
    for options in ({}, {"sliding_window": 20}, {"soft_cap": 5.0},
                    {"sliding_window": 5, "soft_cap": 3.0}):
        expected = window_oracle(*inputs, window=options.get("sliding_window"),
                                 soft_cap=options.get("soft_cap"))
        reference = paged_attention_reference(*inputs, max_query_len=max_query_len, **options)
        np.testing.assert_allclose(np.asarray(reference), expected, rtol=0, atol=1e-5)


# windows: one token; smaller than a block; not a multiple of the block size; a multiple;
# longer than every sequence (no effect)
WINDOWS = (1, 5, 20, 2 * BLOCK_SIZE, 4096)


@pytest.mark.parametrize("backend,window", cases([(w,) for w in WINDOWS],
                                                 lambda window: window in (1, 4096)))
def test_window_mixed_batch(backend, window):
    run(backend, mixed_spec, group=4, seed=window, sliding_window=window)


OPTIONS = {
    "soft_cap": {"soft_cap": 2.0},  # small enough that it changes the scores a lot
    "window_soft_cap": {"sliding_window": 20, "soft_cap": 5.0},
    "window5": {"sliding_window": 5},
}


@pytest.mark.parametrize("backend,options,group", cases(
    [(name, group) for name in OPTIONS for group in (1, 4)],
    lambda name, group: (name, group) in {("soft_cap", 1), ("window_soft_cap", 4)}))
def test_groups_and_soft_cap(backend, options, group):
    run(backend, mixed_spec, group=group, seed=group, **OPTIONS[options])


@pytest.mark.parametrize("backend,window", cases([(5,), (20,)], lambda window: window == 5))
def test_pure_decode_batch(backend, window):
    run(backend, decode_spec, group=4, seed=3, sliding_window=window, soft_cap=4.0)


DECODE_KERNELS = {
    "gpu": functools.partial(paged_decode_attention_gpu, interpret=True),
    "tpu": functools.partial(paged_decode_attention_tpu, interpret=True),
}


@pytest.mark.parametrize("window", (20, pytest.param(5, marks=pytest.mark.slow),
                                    pytest.param(4096, marks=pytest.mark.slow)))
@pytest.mark.parametrize("kernel", sorted(DECODE_KERNELS))
def test_decode_kernels(kernel, window):
    """The decode kernels take one query per sequence, q [S, H, D] (row s: sequence s)."""
    inputs, max_query_len = window_batch(decode_spec(BLOCK_SIZE), window=window, group=4,
                                         seed=4)
    q, k_pool, v_pool, tables, lens, starts = inputs
    has_query = np.asarray(starts[1:] > starts[:-1])
    q_seq = jnp.zeros((len(lens), *q.shape[1:]), q.dtype).at[np.flatnonzero(has_query)].set(
        q[np.asarray(starts[:-1])[has_query]])
    out = DECODE_KERNELS[kernel](q_seq, k_pool, v_pool, tables, lens, sliding_window=window,
                                 soft_cap=4.0)
    flat = jnp.zeros_like(q).at[np.asarray(starts[:-1])[has_query]].set(out[has_query])
    assert_matches(flat, inputs, max_query_len, np.float32, sliding_window=window, soft_cap=4.0)


@needs_cpp
def test_cpp_rejects_windows_and_caps_out_of_range():
    """The wrapper passes 0 to the kernel for "off": a window of 0 or a cap <= 0 (or NaN)
    asked for explicitly is a mistake, not "off"."""
    inputs, _ = window_batch(decode_spec(BLOCK_SIZE), window=None)
    for options, message in (({"sliding_window": 0}, "sliding_window"),
                             ({"soft_cap": 0.0}, "soft_cap"),
                             ({"soft_cap": float("nan")}, "soft_cap")):
        with pytest.raises(ValueError, match=message):
            paged_attention_cpu(*inputs, **options)


# --- end to end through jaxpage.attention.paged_attention ----------------------------------

END_TO_END = {"cpp": {}, "jnp": {}, "reference": {}, "pallas_gpu": {"interpret": True},
              "pallas_tpu": {"interpret": True}}


@pytest.mark.parametrize("decode", [False, True], ids=["mixed", "decode"])
@pytest.mark.parametrize("backend", [pytest.param(name, marks=[needs_cpp] if name == "cpp"
                                                  else []) for name in END_TO_END])
def test_through_paged_attention(backend, decode):
    """The keywords reach every backend (Pallas: the ragged kernel for a mixed step, the
    decode kernel for a pure decode one): this step's K/V are written through the slot
    mapping, then attended with the window and the soft-cap."""
    window, soft_cap = 20, 4.0
    spec = decode_spec(BLOCK_SIZE) if decode else mixed_spec(BLOCK_SIZE)
    spec = [(length, count) for length, count in spec if count]  # build_metadata: no padding
    inputs, max_query_len = window_batch(spec, window=window, group=4, seed=9)
    q, k_pool, v_pool, tables, lens, starts = inputs
    rng = np.random.default_rng(9)
    k_new, v_new = (jnp.asarray(rng.standard_normal((q.shape[0], 2, 64)), jnp.float32)
                    for _ in "kv")
    widths = [-(-length // BLOCK_SIZE) for length, _ in spec]
    _, metadata = build_metadata([list(np.asarray(t)[:w]) for t, w in zip(tables, widths,
                                                                          strict=True)],
                                 [length - count for length, count in spec],
                                 [count for _, count in spec], BLOCK_SIZE,
                                 num_tokens=q.shape[0], backend=backend, **END_TO_END[backend])
    out, (k_written, v_written) = paged_attention(q, k_new, v_new, (k_pool, v_pool), metadata,
                                                  sliding_window=window, soft_cap=soft_cap)
    written = (q, k_written, v_written, metadata.block_tables, metadata.seq_lens,
               metadata.query_start_loc)
    assert_matches(out, tuple(map(jnp.asarray, written)), max_query_len, np.float32,
                   sliding_window=window, soft_cap=soft_cap)


# --- lowering for the real platforms, on this CPU machine ----------------------------------

WINDOW_OPTIONS = {"sliding_window": 1024, "soft_cap": 50.0}


def export_args(ragged: bool):
    """Abstract bf16 arguments at Llama-3-8B-like shapes (32 query heads, 8 KV heads,
    head_dim 128, blocks of 32): a ragged mixed step, or a decode step of 8 sequences."""
    bf16, i32 = jnp.bfloat16, jnp.int32
    num_seqs, num_tokens = (16, 256) if ragged else (8, 8)
    pool = jax.ShapeDtypeStruct((8, 1024, 32, 128), bf16)
    args = [jax.ShapeDtypeStruct((num_tokens, 32, 128), bf16), pool, pool,
            jax.ShapeDtypeStruct((num_seqs, 64), i32), jax.ShapeDtypeStruct((num_seqs,), i32)]
    if ragged:
        args.append(jax.ShapeDtypeStruct((num_seqs + 1,), i32))
    return args


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "decode"])
def test_tpu_kernels_lower_for_tpu_with_window_and_soft_cap(ragged):
    """Pallas -> Mosaic MLIR in one tpu_custom_call with the window's first pages among the
    scalar prefetches. Mosaic's layout passes (libtpu) are not exercised."""
    kernel = (functools.partial(ragged_paged_attention_tpu, max_query_len=256) if ragged
              else paged_decode_attention_tpu)
    exported = jax.export.export(jax.jit(functools.partial(kernel, **WINDOW_OPTIONS)),
                                 platforms=["tpu"])(*export_args(ragged))
    assert exported.platforms == ("tpu",)
    assert exported.mlir_module().count("custom_call @tpu_custom_call") == 1


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "decode"])
def test_gpu_kernels_lower_for_cuda_with_window_and_soft_cap(ragged):
    """Pallas -> Triton with tanh and the window mask in the body (as
    test_paged_decode_kernels.test_gpu_kernel_lowers_for_cuda, whose skip it shares)."""
    targets = set(TRITON_TARGETS) | {getattr(paged_decode_gpu.pltriton, "CUSTOM_CALL_TARGET_NAME",
                                             TRITON_TARGETS[0])}
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in sorted(targets)]
    kernel = (functools.partial(ragged_paged_attention_gpu, max_query_len=256) if ragged
              else paged_decode_attention_gpu)
    try:
        with abstract_gpu_context():
            exported = jax.export.export(
                jax.jit(functools.partial(kernel, **WINDOW_OPTIONS)), platforms=["cuda"],
                disabled_checks=checks)(*export_args(ragged))
    except RuntimeError as error:
        if "does not have a Triton compilation handler" in str(error):
            pytest.skip(f"Triton->PTX compilation handler is absent on this machine: {error}")
        raise
    assert exported.platforms == ("cuda",)
    assert set(re.findall(r"custom_call @([\w$.]+)", exported.mlir_module())) & targets
