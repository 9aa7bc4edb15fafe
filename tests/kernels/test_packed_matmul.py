"""cpu_ops.packed_matmul (cpu/matmul_packed.h's JaxpagePackedMatmul) on weights packed by
`pack_weight`: against the float64 oracle and bit for bit against small_matmul's [K, N] tiles
(same products, same float32 sums in k's order; on AMX tiles, which sum in the hardware's
order, against the oracle only); llama's `pack_params` through a whole model
against HF transformers; and what a CPU runner does with a bfloat16 model's weights (packed,
backed by huge pages where Linux can)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import hf_logits
from test_small_matmul import check

from jaxpage.attention import build_metadata, init_kv_pool
from jaxpage.engine import huge_pages
from jaxpage.loading.hf import load_hf_dir
from jaxpage.models import llama
from pallas_kernels import cpu_library, cpu_ops

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(not cpu_ops.available(),
                                 reason="the CPU kernel library is not available")]

# (dtype, bf16_dot, tiles): bfloat16 on every path (the dot one is the portable one where the
# build has no AVX512-BF16; the tiles one runs only where `packed_tiles()`: AMX-BF16)
MODES = [(jnp.float32, None, False), (jnp.bfloat16, True, False), (jnp.bfloat16, False, False),
         (jnp.bfloat16, True, True)]
MODE_IDS = ["float32", "bfloat16-dot", "bfloat16-portable", "bfloat16-tiles"]


def _skip_unless_tiles(tiles):
    if tiles and not cpu_ops.packed_tiles():
        pytest.skip("no AMX tiles here (a CPU without AMX-BF16, or Linux refused them)")


# (K, N): an odd K (its last pair padded), one panel, several units of panels with the
# threads' share uneven, and SmolLM2-135M's projections qkv, o, gate_up, down
SLOW = pytest.mark.slow
SHAPES = [(1, 32), (7, 32), (33, 64), (64, 96), (99, 1120), (576, 960),
          pytest.param(576, 576, marks=SLOW), pytest.param(576, 3072, marks=SLOW), (1536, 576)]


def operands(rng, m, k, n, dtype=jnp.bfloat16):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)), dtype)
    return x, w


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("k,n", SHAPES)
def test_pack_weight_round_trips(dtype, k, n):
    w = operands(np.random.default_rng(k + n), 1, k, n, dtype)[1]
    packed = cpu_ops.pack_weight(w)
    g, panel = 2 if dtype == jnp.bfloat16 else 1, cpu_ops.panel_columns()
    assert panel == (32 if cpu_ops.wide_vectors() else 16)  # two of the build's vectors
    assert packed.shape == ((n // panel), -(-k // g), panel, g)
    np.testing.assert_array_equal(np.asarray(cpu_ops.unpack_weight(packed, k)),
                                  np.asarray(w))
    # panel p, group j, column c, member i: w[g * j + i, panel * p + c]
    p, j, c = n // panel - 1, (k - 1) // g, 5
    assert packed[p, j, c, 0] == w[g * j, panel * p + c]
    if g == 2 and k > 1:
        assert packed[p, 0, c, 1] == w[1, panel * p + c]


@pytest.mark.parametrize("dtype,bf16_dot,tiles", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("k,n", SHAPES)
def test_packed_matmul_matches_float64_and_small_matmul(dtype, bf16_dot, tiles, k, n):
    _skip_unless_tiles(tiles)
    rng = np.random.default_rng(k * 1000 + n)
    # one row; one pass over a panel and its edges (up to 6 rows on AVX2, 8 on AVX-512, 32 on
    # AMX tiles: two blocks of 16); several passes, their rows split evenly (the big shapes:
    # fewer, their float64 oracle is a [M, K, N] array)
    for m in (1, 8, 9, 17, 33) if k * n > 100_000 else (1, 2, 5, 6, 7, 8, 9, 12, 16, 17, 40):
        x, w = operands(rng, m, k, n, dtype)
        out = cpu_ops.packed_matmul(x, cpu_ops.pack_weight(w), bf16_dot=bf16_dot,
                                          tiles=tiles)
        check(out, x, w, False)
        # the [K, N] tiles' result, bit for bit (where N is whole tiles of small_matmul's, 64
        # columns up to 4 rows, else 32: the columns past them take its scalar tail, which
        # rounds in another order); not AMX's, which sums in an order of its own
        if not tiles and n % (64 if m <= 4 else 32) == 0:
            np.testing.assert_array_equal(
                np.asarray(out), np.asarray(cpu_ops.small_matmul(x, w, bf16_dot=bf16_dot)))


@pytest.mark.parametrize("dtype,bf16_dot,tiles", MODES, ids=MODE_IDS)
def test_nan_and_inf_propagate(dtype, bf16_dot, tiles):
    _skip_unless_tiles(tiles)
    rng = np.random.default_rng(2)
    m, k, n = 9, 69, 96
    x, w = operands(rng, m, k, n, dtype)
    x = x.at[2, 5].set(jnp.nan).at[4, 68].set(jnp.inf)  # the odd K's last, padded pair
    w = w.at[1, 3].set(jnp.inf).at[20, 69].set(-jnp.inf).at[33, 40].set(jnp.nan)
    out = cpu_ops.packed_matmul(x, cpu_ops.pack_weight(w), bf16_dot=bf16_dot,
                                      tiles=tiles)
    check(out, x, w, False)
    assert np.isnan(np.asarray(out)[2]).all()


def test_empty_rows_and_bad_operands():
    w = cpu_ops.pack_weight(jnp.ones((8, 64), jnp.bfloat16))
    assert cpu_ops.packed_matmul(jnp.zeros((0, 8), jnp.bfloat16), w).shape == (0, 64)
    with pytest.raises(ValueError, match="ceil"):
        cpu_ops.packed_matmul(jnp.ones((2, 10), jnp.bfloat16), w)
    with pytest.raises(ValueError, match="one dtype"):
        cpu_ops.packed_matmul(jnp.ones((2, 8), jnp.float32), w)
    with pytest.raises(ValueError, match="float32"):  # a bfloat16 packing read as float32
        cpu_ops.packed_matmul(jnp.ones((2, 8), jnp.float32), w.astype(jnp.float32))
    panel = cpu_ops.panel_columns()
    with pytest.raises(ValueError, match=f"multiple of {panel}"):
        cpu_ops.pack_weight(jnp.ones((8, 40), jnp.bfloat16))
    with pytest.raises(ValueError, match="float16"):
        cpu_ops.pack_weight(jnp.ones((8, 64), jnp.float16))
    with pytest.raises(ValueError, match=r"prefetch_bytes must be in \[0, 1048576\].*got -64"):
        cpu_ops.packed_matmul(jnp.ones((2, 8), jnp.bfloat16), w, prefetch_bytes=-64)
    # the handler checks for itself (an ffi_call past the wrapper)
    raw = jax.ffi.ffi_call(cpu_library.TARGET_PACKED_MATMUL,
                           jax.ShapeDtypeStruct((2, 96), jnp.float32))

    def call(*args, prefetch_bytes=0, layer=-1, **attrs):
        return raw(*args, prefetch_bytes=np.int64(prefetch_bytes), layer=np.int64(layer),
                   **attrs)

    two = np.int32(2)  # live rows
    with pytest.raises(Exception, match="output"):
        jax.block_until_ready(call(jnp.ones((2, 8), jnp.bfloat16), w, two, bf16_dot=np.int64(1)))
    with pytest.raises(Exception, match="K groups"):
        jax.block_until_ready(call(jnp.ones((2, 12), jnp.bfloat16), w, two, bf16_dot=np.int64(1)))
    with pytest.raises(Exception, match="one dtype"):
        jax.block_until_ready(call(jnp.ones((2, 8), jnp.float32), w, two, bf16_dot=np.int64(1)))
    with pytest.raises(Exception, match=rf"K / 1, {panel}, 1"):  # bfloat16's pairs read as float32
        jax.block_until_ready(call(jnp.ones((2, 8), jnp.float32), w.astype(jnp.float32), two,
                                   bf16_dot=np.int64(1)))
    good = jax.ffi.ffi_call(cpu_library.TARGET_PACKED_MATMUL,
                            jax.ShapeDtypeStruct((2, 64), jnp.float32))
    with pytest.raises(Exception, match="live rows must be one int32"):
        jax.block_until_ready(good(jnp.ones((2, 8), jnp.bfloat16), w, np.int32([2, 2]),
                                   bf16_dot=np.int64(1), prefetch_bytes=np.int64(0),
                                   layer=np.int64(-1)))
    for bad in (-1, (1 << 20) + 1):
        with pytest.raises(
                Exception, match=rf"prefetch_bytes must be in \[0, 1048576\], got {bad}"):
            jax.block_until_ready(good(jnp.ones((2, 8), jnp.bfloat16), w, two,
                                       bf16_dot=np.int64(1), prefetch_bytes=np.int64(bad),
                                       layer=np.int64(-1)))
    # a layer outside a stack (or of a weight that is no stack)
    stack = np.stack([np.asarray(w)] * 3)
    for bad in (3, 40):
        with pytest.raises(Exception, match=f"layer {bad} is outside w"):
            jax.block_until_ready(good(jnp.ones((2, 8), jnp.bfloat16), stack, two,
                                       bf16_dot=np.int64(1), prefetch_bytes=np.int64(0),
                                       layer=np.int64(bad)))
    with pytest.raises(ValueError, match="layer 3 is outside the stacked"):
        cpu_ops.packed_matmul(jnp.ones((2, 8), jnp.bfloat16), stack, layer=3)


@pytest.mark.parametrize("dtype,bf16_dot,tiles", MODES, ids=MODE_IDS)
def test_prefetch_distance_does_not_change_the_result(dtype, bf16_dot, tiles):
    # how far ahead a panel's walk prefetches (by its rows, or a call's prefetch_bytes) moves
    # only when memory is read: the products, bit for bit, at every distance, including ones
    # past the weight's end (where the walk must not prefetch) and none at all
    _skip_unless_tiles(tiles)
    rng = np.random.default_rng(7)
    for m in (1, 2, 3, 8, 9):
        x, w = operands(rng, m, 99, 1120, dtype)
        packed = cpu_ops.pack_weight(w)
        default = np.asarray(cpu_ops.packed_matmul(x, packed, bf16_dot=bf16_dot,
                                                         tiles=tiles))
        check(jnp.asarray(default), x, w, False)
        for ahead in (64, 2048, 4096, 6144, 1 << 20):
            np.testing.assert_array_equal(
                np.asarray(cpu_ops.packed_matmul(x, packed, bf16_dot=bf16_dot, tiles=tiles,
                                                       prefetch_bytes=ahead)), default)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_live_rows_computes_only_those_rows(dtype):
    # a bucket's padding rows: computed as if x had only the live rows, the others zeros (bit
    # for bit the product of the live rows alone: on AMX tiles, fewer than 3 live rows take the
    # vector panels, so not always the full product's rows); out-of-range counts are clamped
    rng = np.random.default_rng(5)
    x, w = operands(rng, 11, 69, 96, dtype)
    packed = cpu_ops.pack_weight(w)
    full = np.asarray(cpu_ops.packed_matmul(x, packed))
    check(jnp.asarray(full), x, w, False)  # the oracle: float64
    step = jax.jit(lambda x, live: cpu_ops.packed_matmul(x, packed, live_rows=live))
    for live in (0, 1, 3, 8, 9, 11, 40, -2):
        out = np.asarray(step(x, np.int32(live)))  # traced: one compilation for every count
        rows = min(max(live, 0), 11)
        if rows:
            alone = np.asarray(cpu_ops.packed_matmul(x[:rows], packed))
            np.testing.assert_array_equal(out[:rows], alone)
            check(jnp.asarray(out[:rows]), x[:rows], w, False)
        np.testing.assert_array_equal(out[rows:], 0.0)


def test_pack_params_leaves_what_it_cannot_pack():
    params = {"embed": jnp.ones((50, 64), jnp.bfloat16), "final_norm": jnp.ones(64, jnp.bfloat16),
              "layers": [{"qkv": jnp.ones((64, 96), jnp.bfloat16),      # packed
                          "o": jnp.ones((64, 40), jnp.bfloat16),        # N not a multiple of 16
                          "gate_up": jnp.ones((64, 128), jnp.float16),  # not a kernel dtype
                          "down": jnp.ones((63, 64), jnp.bfloat16),     # odd K: packed, padded
                          "attn_norm": jnp.ones(64, jnp.bfloat16)}]}
    packed = llama.pack_params(params)
    layer = packed["layers"][0]
    panel = cpu_ops.panel_columns()  # 32 (AVX-512) or 16
    assert layer["qkv"].shape == (96 // panel, 32, panel, 2)
    assert layer["down"].shape == (64 // panel, 32, panel, 2)
    for name in ("o", "gate_up", "attn_norm"):
        assert layer[name] is params["layers"][0][name]
    assert packed["embed"] is params["embed"]


# a tiny Llama whose every projection packs: head_dim 16, qkv (4 + 2 * 2) * 16 = 128
# columns, o 64, gate_up 192, down 64, and its head (vocabulary 128)
PACKABLE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=128)


STEP = jax.jit(llama.LlamaModel.forward, static_argnums=0)


def _step(model, params, pool, table, num_computed, tokens):
    positions, metadata = build_metadata([table], [num_computed], [len(tokens)], 16,
                                         logits_indices=list(range(len(tokens))))
    return STEP(model, params, jnp.asarray(tokens, jnp.int32), positions, pool, metadata)


@pytest.mark.parametrize("tiles", [False, True], ids=["vector", "tiles"])
@pytest.mark.parametrize("tied", [False, pytest.param(True, marks=SLOW)],
                         ids=["lm_head", "tied"])
def test_packed_model_errs_as_the_unpacked_one_and_decodes_alike(tied, tiles, hf_model_dir,
                                                                  monkeypatch):
    """bfloat16 with packed projections and head: a 37-token prefill (more rows than the
    [K, N] kernel takes, so the unpacked model runs XLA's dot there) against HF transformers'
    float32, within the bound test_llama_parity puts on the unpacked bfloat16 model (1.5x HF
    bfloat16's own error); then decode steps from one pool, where the unpacked model takes
    small_matmul's [K, N] tiles: the same logits bit for bit, but for a tied head, which the
    unpacked model reads as [N, K] (dot products summed across lanes): within twice the float32
    bound of the exact product (test_small_matmul) of each other. (Built without AVX-512, the
    unpacked model takes XLA's dot, and on AMX tiles the packed one sums in the hardware's
    order: there the decode steps are held to HF as the prefill is.)"""
    import copy

    import torch

    _skip_unless_tiles(tiles)
    monkeypatch.setenv("JAXPAGE_CPU_KERNEL_TILES", "1" if tiles else "0")
    jax.clear_caches()  # read when a step is traced: no step traced under another setting

    path, hf_model = hf_model_dir("llama", **PACKABLE, tie_word_embeddings=tied)
    config, params = load_hf_dir(path, "bfloat16")
    packed = llama.pack_params(params)
    assert all(packed["layers"][0][name].ndim == 4 for name in llama.PACKED_WEIGHTS)
    assert packed["embed" if tied else "lm_head"].ndim == 4
    model = llama.LlamaModel(config)
    tokens = list(range(3, 40))
    truth = hf_logits(hf_model, tokens)
    hf_err = np.abs(hf_logits(copy.deepcopy(hf_model).to(torch.bfloat16), tokens) - truth)
    pool = init_kv_pool(config.num_layers, 4, 16, config.num_kv_heads, config.head_dim,
                        dtype=jnp.bfloat16)
    logits, pool = _step(model, packed, pool, [1, 2, 3], 0, tokens)
    err = np.abs(np.asarray(logits) - truth)
    assert 0 < err.max() <= 1.5 * hf_err.max(), (err.max(), hf_err.max())
    assert err.mean() <= 1.5 * hf_err.mean(), (err.mean(), hf_err.mean())
    positions, metadata = build_metadata([[1, 2, 3]], [len(tokens)], [1], 16)
    hlo = STEP.lower(model, packed, jnp.asarray([7], jnp.int32), positions, pool,
                     metadata).as_text()
    assert hlo.count("jaxpage_packed_matmul") >= 4 * config.num_layers  # four per layer
    if not cpu_ops.wide_vectors() or tiles:
        # built without AVX-512 the unpacked model's few-row matmuls are XLA's dot, not
        # small_matmul's tiles (jaxpage.layers.matmul_f32), and AMX sums in its own order: then each
        # decode step against HF, as the prefill (bfloat16 activations round differently along
        # the two paths)
        steps = [7, 11, 13]
        truth = hf_logits(hf_model, tokens + steps)
        hf_err = np.abs(hf_logits(copy.deepcopy(hf_model).to(torch.bfloat16), tokens + steps)
                        - truth)
        for position, token in enumerate(steps, start=len(tokens)):
            ours, pool = _step(model, packed, pool, [1, 2, 3], position, [token])
            err = np.abs(np.asarray(ours)[0] - truth[position])
            assert err.max() <= 1.5 * hf_err.max(), (err.max(), hf_err.max())
        return
    for position, token in enumerate([7, 11, 13], start=len(tokens)):
        ours, _ = _step(model, packed, pool, [1, 2, 3], position, [token])
        theirs, pool = _step(model, params, pool, [1, 2, 3], position, [token])
        if not tied:
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
            continue
        # the same final hidden state h (every layer bit for bit): |ours - theirs| <= twice
        # the bound on each, (H + 2) 2^-24 sum_k |h_k| |e_vk|, <= (H + 2) 2^-24 |h|_1 max |e|
        embed = np.abs(np.asarray(params["embed"], np.float32)).max()
        h = _final_hidden(model, params, pool, position, token)
        limit = 2 * (config.hidden_size + 2) * 2.0**-24 * np.abs(h).sum() * embed
        assert np.abs(np.asarray(ours) - np.asarray(theirs)).max() <= limit


def _final_hidden(model, params, pool, position, token):
    """The final-normed hidden state the head reads at this step: the model's logits with an
    identity matrix for its head (each output h_k * 1, exact)."""
    eye = jnp.eye(model.config.hidden_size, dtype=jnp.bfloat16)
    probe = dict(params, lm_head=eye)
    h, _ = _step(model, probe, pool, [1, 2, 3], position, [token])
    return np.asarray(h, np.float32)[0]


def _greedy_tokens_and_logprobs(llm) -> list:
    """Each of three short prompts' 12 greedy tokens (ignore_eos) and their logprobs."""
    from jaxpage import SamplingParams

    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 30)]
    sampling = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
    return [(o.outputs[0].token_ids,
             [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)])
            for o in llm.generate(prompts, sampling)]


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=SLOW), "bfloat16"])
def test_a_cpu_runner_packs_the_weights_and_generates_as_unpacked(dtype, hf_model_dir,
                                                                   monkeypatch):
    """The runner packs (JAXPAGE_CPU_PACKED_WEIGHTS unset) or not (=0): greedy tokens and their
    logprobs are the same, the prompts short enough (<= 32 rows a step) that the unpacked model
    takes small_matmul's [K, N] tiles, which round as the packed kernel does on vectors (AMX
    tiles off: they sum in the hardware's order; the model test above holds them to HF)."""
    from jaxpage import LLM

    monkeypatch.setenv("JAXPAGE_CPU_KERNEL_TILES", "0")
    jax.clear_caches()  # read when a step is traced: no step traced under another setting

    path, _ = hf_model_dir("llama", **PACKABLE)
    small = dict(block_size=16, num_blocks=40, max_num_batched_tokens=32, max_num_seqs=4)
    results = {}
    for packs in ("1", "0"):
        monkeypatch.setenv("JAXPAGE_CPU_PACKED_WEIGHTS", packs)
        llm = LLM(path, dtype=dtype, **small)
        layer = llm.engine.runner.params["layers"][0]
        assert all((layer[name].ndim == 4) == (packs == "1") for name in llama.PACKED_WEIGHTS)
        results[packs] = _greedy_tokens_and_logprobs(llm)
    assert results["1"] == results["0"]


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unavailable"


def test_huge_pages_back_a_buffer_and_keep_its_contents(monkeypatch):
    if _thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {_thp_mode()} here")
    values = np.random.default_rng(5).standard_normal(3 << 20).astype(np.float32)  # 12 MiB
    array = jax.device_put(values)
    monkeypatch.setenv("JAXPAGE_CPU_HUGE_PAGES", "0")
    assert huge_pages.advise([array]) == 0
    monkeypatch.delenv("JAXPAGE_CPU_HUGE_PAGES")
    collapsed = huge_pages.advise([array, "not an array", np.ones(3)])
    if collapsed == 0:
        pytest.skip("Linux collapsed nothing (MADV_COLLAPSE needs Linux 6.1+ and free huge pages)")
    # best effort, a page at a time: a 2 MiB page that is not whole in the heap's mapping (at
    # its end) or finds no free huge page stays as it was; the others are huge pages now
    assert collapsed % huge_pages.HUGE_PAGE == 0
    assert huge_pages.anon_huge_bytes(array.unsafe_buffer_pointer(), array.nbytes) >= collapsed
    np.testing.assert_array_equal(np.asarray(array), values)
    assert float(jnp.sum(array)) == pytest.approx(float(values.astype(np.float64).sum()), rel=1e-4)


def test_the_whole_huge_pages_inside_a_buffer():
    """Hand-worked: only 2 MiB pages wholly inside [address, address + nbytes)."""
    page = huge_pages.HUGE_PAGE
    assert huge_pages.inner_pages(page + 10, 3 * page) == (2 * page, 4 * page)
    assert huge_pages.inner_pages(2 * page, 2 * page) == (2 * page, 4 * page)
    assert huge_pages.inner_pages(5, page) == (page, page)  # none whole
    assert huge_pages.inner_pages(page + 1, 10) == (2 * page, 2 * page)


def test_only_private_anonymous_memory_counts_as_zero_on_release():
    """/proc/self/maps as `advise_zeroed` reads it: a jax buffer (malloc's memory) is private
    anonymous, libc's code (a file's pages) is not."""
    import bisect
    import ctypes

    starts, _, anonymous = huge_pages._mappings()
    array = jax.block_until_ready(jnp.zeros(1 << 20, jnp.float32))
    code = ctypes.cast(ctypes.CDLL(None).printf, ctypes.c_void_p).value
    assert anonymous[bisect.bisect_right(starts, array.unsafe_buffer_pointer()) - 1]
    assert not anonymous[bisect.bisect_right(starts, code) - 1]


def test_a_zeroed_buffer_given_back_reads_zeros_and_refaults_as_huge_pages(monkeypatch):
    """A fresh pool's way to huge pages: the whole 2 MiB pages inside a zero-filled buffer are
    given back; it still reads zeros, a write through a donating call lands (the step's way),
    and the pages it faults in are huge ones."""
    if _thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {_thp_mode()} here")
    array = jnp.zeros(3 << 20, jnp.float32)  # 12 MiB, allocated and zero-filled by XLA
    monkeypatch.setenv("JAXPAGE_CPU_HUGE_PAGES", "0")
    assert huge_pages.advise_zeroed([array]) == 0
    monkeypatch.delenv("JAXPAGE_CPU_HUGE_PAGES")
    address = array.unsafe_buffer_pointer()
    first, last = huge_pages.inner_pages(address, array.nbytes)
    given = huge_pages.advise_zeroed([array, "not an array", np.ones(3)])
    assert given == last - first >= array.nbytes - 2 * huge_pages.HUGE_PAGE
    assert not np.asarray(array).any()
    values = np.random.default_rng(6).standard_normal(array.shape).astype(np.float32)
    written = jax.jit(lambda a, v: a + v, donate_argnums=0)(array, jnp.asarray(values))
    assert written.unsafe_buffer_pointer() == address  # donated: the same buffer, written
    np.testing.assert_array_equal(np.asarray(written), values)
    assert huge_pages.anon_huge_bytes(address, written.nbytes) >= huge_pages.HUGE_PAGE


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_cpu_runner_generates_the_same_on_a_pool_of_huge_pages(kv_dtype, hf_model_dir,
                                                                  monkeypatch):
    """The runner gives its fresh pool's pages back to come back huge (JAXPAGE_CPU_HUGE_PAGES
    unset) or keeps XLA's (=0): the pool reads as made either way (zeros; a quantized pool's
    scales 1, which it keeps), its written pages are huge ones where given back, and the greedy
    tokens and their logprobs are the same. A pool poisoned with NaN is left as it is."""
    from jaxpage import LLM
    from pallas_kernels import quantized

    path, _ = hf_model_dir("llama", **PACKABLE)
    # [2 heads, 8192 blocks, 16, 16]: 8 MiB a bfloat16 pool array, 4 MiB int8 values
    small = dict(block_size=16, num_blocks=8192, max_num_batched_tokens=32, max_num_seqs=4,
                 kv_cache_dtype=kv_dtype)
    results = {}
    for huge in ("1", "0"):
        monkeypatch.setenv("JAXPAGE_CPU_HUGE_PAGES", huge)
        llm = LLM(path, dtype="bfloat16", **small)
        layers = llm.engine.runner.kv_pool
        if kv_dtype == "auto":
            zeros, ones = jax.tree.leaves(layers), []
        else:
            pools = jax.tree.leaves(layers, is_leaf=quantized.is_quantized)
            zeros, ones = [p.values for p in pools], [p.scales for p in pools]
        assert not any(np.asarray(leaf, np.float32).any() for leaf in zeros)
        assert all((np.asarray(leaf) == 1).all() for leaf in ones)
        results[huge] = _greedy_tokens_and_logprobs(llm)
        if huge == "1" and _thp_mode() == "madvise":
            written = jax.tree.leaves(llm.engine.runner.kv_pool)[0]  # layer 0's K (values)
            assert huge_pages.anon_huge_bytes(written.unsafe_buffer_pointer(), written.nbytes) > 0
    assert results["1"] == results["0"]
    # a pool poisoned with NaN (debug_nan_pool) is not zeros: it keeps XLA's pages, and NaN
    monkeypatch.setenv("JAXPAGE_CPU_HUGE_PAGES", "1")
    poisoned = LLM(path, dtype="bfloat16", debug_nan_pool=True, **small).engine.runner.kv_pool
    leaves = (jax.tree.leaves(poisoned) if kv_dtype == "auto" else
              [p.scales for p in jax.tree.leaves(poisoned, is_leaf=quantized.is_quantized)])
    assert all(np.isnan(np.asarray(leaf, np.float32)).all() for leaf in leaves)
