"""A whole decoder layer in one CPU kernel call (cpu/decoder_layer.h's JaxpageDecoderLayer; the
model takes it for steps of at most `layers.FUSED_LAYER_ROWS` tokens, 64) against the unfused
calls the model makes otherwise (packed matmuls, qkv_rope, set_rows, paged attention, add_rms_norm,
silu_mul: each tested against float64 and HF in its own file): logits and every pool byte bit
for bit, NaN in the pool's unwritten slots, over decode steps with several sequences, padding
rows and a context long enough that the kernel cuts a lone sequence's keys among the threads;
and the decode steps against HF transformers' float32 within the bound the packed model is held
to. Bad slots and block ids are refused with an error naming them."""

from __future__ import annotations

import copy
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import hf_logits
from test_layer_glue import same_bits
from test_packed_matmul import PACKABLE

from jaxpage import layers
from jaxpage.attention import build_metadata, init_kv_pool
from jaxpage.loading.hf import load_hf_dir
from jaxpage.models import llama
from pallas_kernels import cpu_library, cpu_ops

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(not cpu_ops.available(),
                                 reason="the CPU kernel library is not available")]

STEP = jax.jit(llama.LlamaModel.forward, static_argnums=0)
BLOCK = 16


def _same_pools(ours, theirs) -> bool:
    """Every K and V array of two pools the same, byte for byte (NaN slots included)."""
    return all(same_bits(a, b) for pair in zip(ours, theirs, strict=True)
               for a, b in zip(*pair, strict=True))


# SmolLM2's head_dim (64: two 32-column panels a head with AVX-512, so the qkv stage rotates
# each head and writes k and v to the pools in its epilogue; PACKABLE's is 16, two heads a
# panel, a rotary stage of its own) and a gate_up of an odd number of panels (3 with AVX-512:
# the gate/up boundary inside a panel)
HEADS_64 = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=48, vocab_size=128)


def _setup(hf_model_dir, dtype, shapes=None):
    path, hf_model = hf_model_dir("llama", **(shapes or PACKABLE))
    config, params = load_hf_dir(path, dtype)
    return config, llama.pack_params(params), hf_model


def _pool(config, dtype, blocks=48):
    # NaN in every slot no step writes: a read of one shows in the logits
    return init_kv_pool(config.num_layers, blocks, BLOCK, config.num_kv_heads, config.head_dim,
                        dtype=jnp.dtype(dtype), fill_value=float("nan"))


def _inputs(tables, computed, new_tokens, **bucket):
    positions, metadata = build_metadata(tables, computed, [len(t) for t in new_tokens], BLOCK,
                                         backend="cpp", **bucket)
    tokens = np.zeros(len(positions), np.int32)
    flat = [t for seq in new_tokens for t in seq]
    tokens[: len(flat)] = flat
    return jnp.asarray(tokens), positions, metadata


def _run(model, params, pool, tables, computed, new_tokens, **bucket):
    tokens, positions, metadata = _inputs(tables, computed, new_tokens, **bucket)
    return STEP(model, params, tokens, positions, pool, metadata)


def _layer_calls(model, params, pool, tables, computed, new_tokens, **bucket) -> int:
    """The layer kernel's calls in the step `_run` compiles for the same arguments."""
    tokens, positions, metadata = _inputs(tables, computed, new_tokens, **bucket)
    hlo = STEP.lower(model, params, tokens, positions, pool, metadata).as_text()
    return hlo.count(cpu_library.TARGET_DECODER_LAYER)


@pytest.mark.parametrize("shapes", [PACKABLE, HEADS_64], ids=["head_dim16", "head_dim64"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_steps_are_the_unfused_ones_bit_for_bit(dtype, shapes, hf_model_dir):
    """Three sequences prefilled (unfused: more rows than FUSED_LAYER_ROWS), then decode steps
    in a bucket of 4 tokens / 4 sequences (one padding row) and in the exact shape: fused and
    unfused from the same pool give the same logits and pools, byte for byte."""
    import torch

    config, params, hf_model = _setup(hf_model_dir, dtype, shapes)
    fused, unfused = llama.LlamaModel(config), llama.LlamaModel(config, fuse_layers=False)
    prompts = [list(range(3, 40)), list(range(50, 59)), list(range(60, 80))]
    tables = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    _, pool = _run(unfused, params, _pool(config, dtype), tables, [0, 0, 0], prompts)
    lens = [len(p) for p in prompts]
    texts = [list(p) for p in prompts]
    hf_bf16 = copy.deepcopy(hf_model).to(torch.bfloat16)  # HF's own bfloat16 error: the bound
    for step, bucket in enumerate([dict(num_tokens=4, num_seqs=4), {}, dict(num_tokens=8)]):
        new = [[(7 * step + 11 * s) % 120 + 3] for s in range(3)]
        step_dims = dict(bucket, num_logits=None)
        ours, ours_pool = _run(fused, params, pool, tables, lens, new, **step_dims)
        theirs, pool = _run(unfused, params, pool, tables, lens, new, **step_dims)
        assert same_bits(ours, theirs), step
        assert _same_pools(ours_pool, pool), step
        # against HF float32: within the bound the packed model's decode is held to
        for s in range(3):
            texts[s] += new[s]
            truth = hf_logits(hf_model, texts[s])[-1]
            hf_err = np.abs(hf_logits(hf_bf16, texts[s])[-1] - truth).max()
            err = np.abs(np.asarray(ours)[s] - truth).max()
            limit = 1.5 * hf_err if dtype == "bfloat16" else 1e-4 * np.abs(truth).max()
            assert err <= limit, (step, s, err, limit)
        lens = [n + 1 for n in lens]
    # the fused step calls the layer kernel once a layer and no other matmul but the head's
    positions, metadata = build_metadata(tables, lens, [1, 1, 1], BLOCK, backend="cpp")
    hlo = STEP.lower(fused, params, jnp.zeros(3, jnp.int32), positions, pool,
                     metadata).as_text()
    assert hlo.count("jaxpage_decoder_layer") == config.num_layers
    assert hlo.count("jaxpage_packed_matmul") == 1


@pytest.mark.parametrize("shapes", [PACKABLE, HEADS_64], ids=["head_dim16", "head_dim64"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_short_prompt_chunk_beside_decodes_fuses_alike(dtype, shapes, hf_model_dir):
    """A ragged step of at most FUSED_LAYER_ROWS tokens that is not a pure decode: a 5-token
    prompt (its queries attending to each other causally) beside two decoding sequences, in a
    bucket of 8 tokens, fused and unfused alike (7 live rows: bfloat16 on AMX tiles where the
    CPU has them, the qkv and gate_up epilogues included with head_dim64)."""
    config, params, _ = _setup(hf_model_dir, dtype, shapes)
    fused, unfused = llama.LlamaModel(config), llama.LlamaModel(config, fuse_layers=False)
    tables = [[1, 2], [3, 4], [5]]
    _, pool = _run(unfused, params, _pool(config, dtype), tables[:2], [0, 0],
                   [list(range(3, 23)), list(range(30, 47))])
    new = [[7], [9], [11, 12, 13, 14, 15]]
    assert sum(map(len, new)) <= layers.FUSED_LAYER_ROWS
    dims = dict(num_tokens=8, max_query_len=8, num_logits=None)
    # the fused step is one kernel call a layer, the unfused one none
    assert _layer_calls(fused, params, pool, tables, [20, 17, 0], new, **dims) == \
        config.num_layers
    assert _layer_calls(unfused, params, pool, tables, [20, 17, 0], new, **dims) == 0
    ours, ours_pool = _run(fused, params, pool, tables, [20, 17, 0], new, **dims)
    theirs, pool = _run(unfused, params, pool, tables, [20, 17, 0], new, **dims)
    assert same_bits(ours, theirs)
    assert _same_pools(ours_pool, pool)


@pytest.mark.parametrize("shapes", [PACKABLE, HEADS_64], ids=["head_dim16", "head_dim64"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_of_fused_layer_rows_tokens_fuses_alike(dtype, shapes, hf_model_dir):
    """The widest step the model fuses: FUSED_LAYER_ROWS tokens, a 25-token prompt chunk
    beside decoding sequences with the bucket's last rows padding (several row tiles and every
    thread's share of the glue's rows), fused and unfused alike, byte for byte."""
    config, params, _ = _setup(hf_model_dir, dtype, shapes)
    fused, unfused = llama.LlamaModel(config), llama.LlamaModel(config, fuse_layers=False)
    rows = layers.FUSED_LAYER_ROWS
    decoding = rows - 25 - 3  # three padding rows
    tables = [[1 + s] for s in range(decoding)] + [[decoding + 1, decoding + 2]]
    prompts = [[(5 * s + k) % 120 + 3 for k in range(6 + s % 5)] for s in range(decoding)]
    _, pool = _run(unfused, params, _pool(config, dtype, blocks=decoding + 3), tables[:-1],
                   [0] * decoding, prompts)
    computed = [len(p) for p in prompts] + [0]
    new = [[(11 * s) % 120 + 3] for s in range(decoding)] + [list(range(40, 65))]
    dims = dict(num_tokens=rows, num_seqs=decoding + 1, max_query_len=rows, num_logits=None)
    assert _layer_calls(fused, params, pool, tables, computed, new, **dims) == \
        config.num_layers
    ours, ours_pool = _run(fused, params, pool, tables, computed, new, **dims)
    theirs, pool = _run(unfused, params, pool, tables, computed, new, **dims)
    assert same_bits(ours, theirs)
    assert _same_pools(ours_pool, pool)
    # one more token and the step is the unfused one
    wider = dict(dims, num_tokens=rows + 1)
    assert _layer_calls(fused, params, pool, tables, computed, new, **wider) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_long_lone_sequence_cut_among_threads_fuses_alike(dtype, hf_model_dir):
    """One sequence of 600 tokens (38 blocks: its keys cut into parts for the threads where the
    kernel chooses) decodes alike fused (one kernel call a layer) and unfused. The cut runs:
    the layer kernel with the keys cut in 4 parts equals the uncut one within rounding, and in
    float32 not bit for bit (the parts' sums are merged in another order)."""
    config, params, _ = _setup(hf_model_dir, dtype)
    fused, unfused = llama.LlamaModel(config), llama.LlamaModel(config, fuse_layers=False)
    table = [list(range(1, 40))]
    prompt = [[(5 * i) % 120 + 3 for i in range(600)]]
    _, pool = _run(unfused, params, _pool(config, dtype), table, [0], prompt)
    assert _layer_calls(fused, params, pool, table, [600], [[9]]) == config.num_layers
    assert _layer_calls(unfused, params, pool, table, [600], [[9]]) == 0
    for step, token in enumerate([9, 17]):
        ours, ours_pool = _run(fused, params, pool, table, [600 + step], [[token]])
        theirs, pool = _run(unfused, params, pool, table, [600 + step], [[token]])
        assert same_bits(ours, theirs)
        assert _same_pools(ours_pool, pool)

    # layer 0 decoding position 602, its keys uncut and cut in 4
    rng = np.random.default_rng(0)
    x, h = (jnp.asarray(rng.normal(size=(1, config.hidden_size)), dtype) for _ in range(2))
    angles = rng.uniform(0, 2 * np.pi, (1, config.head_dim))
    cos, sin = jnp.asarray(np.cos(angles), dtype), jnp.asarray(np.sin(angles), dtype)
    layer, slot = params["layers"][0], table[0][602 // BLOCK] * BLOCK + 602 % BLOCK

    def layer_out(key_splits):
        out = cpu_ops.decoder_layer(
            x, h, layer, cos, sin, *pool[0], jnp.asarray([slot], jnp.int32),
            jnp.asarray(table, jnp.int32), jnp.asarray([603], jnp.int32),
            jnp.asarray([0, 1], jnp.int32), params["layers"][1]["attn_norm"],
            num_heads=config.num_heads, eps=config.rms_norm_eps, key_splits=key_splits)
        return np.asarray(out[0], np.float32)  # the layer's output x2

    uncut, cut = layer_out(1), layer_out(4)
    if dtype == "float32":  # (bfloat16 rounds the attention's output: it may hide the cut)
        assert not same_bits(cut, uncut)
    np.testing.assert_allclose(cut, uncut, rtol=0,
                               atol=(1e-5 if dtype == "float32" else 2**-6) * np.abs(uncut).max())


@pytest.mark.parametrize("weights", ["bfloat16", "float32", "int8"])
def test_stacked_layers_read_in_place_are_the_per_layer_ones_bit_for_bit(weights,
                                                                         hf_model_dir):
    """The layers stacked (`layers.StackedLayers`: one array a param name, the kernels reading
    a layer at an index) against a dict of arrays a layer, same weights: a prefill (unfused,
    the packed matmuls reading each layer of the stack) and decode steps (the layer kernel,
    mlp_norm and the next layer's norm read from the stack) give the same logits and pools
    byte for byte, fused and unfused, over 3 layers (the index matters); the stacked step
    hands its call 6 layer arrays (10 with int8 scales) where the other hands it 18 (30), and
    its compiled step copies no layer out of a stack (no array of one layer's packed shape)."""
    dtype = "float32" if weights == "float32" else "bfloat16"
    # (a vocabulary of 160: the tied head's packed shape not one of a layer's)
    path, _ = hf_model_dir("llama", **dict(HEADS_64, vocab_size=160), num_hidden_layers=3)
    config, params = load_hf_dir(path, dtype)
    if weights == "int8":
        params = dict(params, layers=[
            {name: layers.quantize(np.asarray(w, np.float32), "int8")
             if name in llama.PACKED_WEIGHTS else w for name, w in layer.items()}
            for layer in params["layers"]])
    per_layer, stacked = llama.pack_params(params), llama.pack_params(params, stack=True)
    assert isinstance(stacked["layers"], layers.StackedLayers)
    assert isinstance(per_layer["layers"], list)
    arrays = {name: len(jax.tree.leaves(p["layers"])) for name, p in
              (("stacked", stacked), ("per layer", per_layer))}
    assert arrays == ({"stacked": 10, "per layer": 30} if weights == "int8"
                      else {"stacked": 6, "per layer": 18})
    # indexing a stack gives a layer's own arrays (int8 ones still packed)
    for i in range(3):
        for name, w in per_layer["layers"][i].items():
            ours = stacked["layers"][i][name]
            if layers.is_quantized(w):
                assert ours.packed and same_bits(ours.values, w.values)
                ours, w = ours.scale, w.scale
            assert same_bits(ours, w), (i, name)
    fused, unfused = llama.LlamaModel(config), llama.LlamaModel(config, fuse_layers=False)
    prompts = [list(range(3, 80)), list(range(50, 59))]  # 86 rows: unfused
    tables = [[1, 2, 3, 4, 5, 8], [6, 7]]
    _, pool = _run(fused, per_layer, _pool(config, dtype), tables, [0, 0], prompts)
    _, stacked_pool = _run(fused, stacked, _pool(config, dtype), tables, [0, 0], prompts)
    assert _same_pools(stacked_pool, pool)
    lens = [len(p) for p in prompts]
    for step in range(3):
        new = [[(7 * step + 11 * s) % 120 + 3] for s in range(2)]
        for model in (fused, unfused):
            theirs, their_pool = _run(model, per_layer, pool, tables, lens, new)
            ours, our_pool = _run(model, stacked, stacked_pool, tables, lens, new)
            assert same_bits(ours, theirs), (step, model.fuse_layers)
            assert _same_pools(our_pool, their_pool), (step, model.fuse_layers)
        pool, stacked_pool, lens = their_pool, our_pool, [n + 1 for n in lens]
    # no layer sliced out of a stack: no value in the compiled step has a layer's packed shape
    tokens, positions, metadata = _inputs(tables, lens, [[5], [6]])
    hlo = STEP.lower(fused, stacked, tokens, positions, stacked_pool,
                     metadata).compile().as_text()
    assert _layer_calls(fused, stacked, stacked_pool, tables, lens, [[5], [6]]) == 3
    for name in llama.PACKED_WEIGHTS:
        w = per_layer["layers"][0][name]
        w = w.values if layers.is_quantized(w) else w
        layer_shape = f"[{','.join(map(str, w.shape))}]"
        assert layer_shape not in hlo.replace(" ", ""), name


def test_bad_slots_and_blocks_are_refused_by_name(hf_model_dir):
    """A slot outside the pool or a block table entry past it: an error naming it, not a
    write or read out of bounds."""
    config, params, _ = _setup(hf_model_dir, "float32")
    layer, (k_pool, v_pool) = params["layers"][0], _pool(config, "float32", blocks=4)[0]
    x = jnp.ones((2, config.hidden_size), jnp.float32)
    cos = jnp.ones((2, config.head_dim), jnp.float32)

    def call(slots, table):
        return cpu_ops.decoder_layer(
            x, x, layer, cos, cos * 0, k_pool, v_pool, jnp.asarray(slots, jnp.int32),
            jnp.asarray([table], jnp.int32), jnp.asarray([2], jnp.int32),
            jnp.asarray([0, 2], jnp.int32), layer["attn_norm"], num_heads=config.num_heads,
            eps=1e-5)

    out = call([16, 17], [1, 0])  # well formed (positions 0 and 1 of block 1): runs
    assert np.isfinite(np.asarray(out[0])).all()
    with pytest.raises(Exception, match=r"slot_mapping\[1\] = 64 is outside the pool's 64"):
        jax.block_until_ready(call([16, 64], [1, 0]))
    with pytest.raises(Exception, match="block table entry outside the pool"):
        jax.block_until_ready(call([16, 17], [9, 0]))
    with pytest.raises(ValueError, match="key_splits"):
        cpu_ops.decoder_layer(x, x, layer, cos, cos, k_pool, v_pool,
                                    jnp.zeros(2, jnp.int32), jnp.zeros((1, 2), jnp.int32),
                                    jnp.ones(1, jnp.int32), jnp.asarray([0, 2], jnp.int32),
                                    layer["attn_norm"], num_heads=config.num_heads, eps=1e-5,
                                    key_splits=-1)


_CLOCKED_STEPS = """
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from jaxpage import layers
from jaxpage.attention import build_metadata, init_kv_pool
from jaxpage.loading.hf import load_hf_dir
from jaxpage.models import llama
from pallas_kernels import cpu_library, cpu_ops

config, params = load_hf_dir(sys.argv[1], "bfloat16")
params = llama.pack_params(params)
model = llama.LlamaModel(config)
step = jax.jit(llama.LlamaModel.forward, static_argnums=0)
pool = init_kv_pool(config.num_layers, 16, 16, config.num_kv_heads, config.head_dim,
                    dtype=jnp.bfloat16)

def run(lens):
    positions, md = build_metadata([[1, 2], [3, 4], [5, 6]], lens, [1, 1, 1], 16,
                                   backend="cpp")
    return step(model, params, jnp.array([5, 6, 7], jnp.int32), positions, pool, md)

jax.block_until_ready(run([3, 4, 5]))  # compiles
assert cpu_library.stage_clock(reset=True) is not None
start = time.perf_counter()
for i in range(int(sys.argv[2])):
    logits, pool = run([4 + i, 5 + i, 6 + i])
    jax.block_until_ready(logits)
wall = time.perf_counter() - start
print(json.dumps(dict(cpu_library.stage_clock(), wall=wall, layers=config.num_layers)))
"""


@pytest.mark.slow
def test_the_stage_clock_counts_every_layer_call_within_the_steps_wall_time(hf_model_dir):
    """scripts/lab/profile_layer_stages.py's clock (a library built with JAXPAGE_STAGE_CLOCK, in a
    process of its own): one count per layer call of each decode step, every stage's time
    counted, their sum within the steps' wall time, and at most one join per helper and call;
    the default library has no clock."""
    import json
    import os
    import subprocess
    import sys

    assert cpu_library.stage_clock() is None  # this process's library: built without it
    path, _ = hf_model_dir("llama", **PACKABLE)
    steps = 5
    env = dict(os.environ, JAXPAGE_CPU_KERNEL_STAGE_CLOCK="1")
    env.pop("JAXPAGE_CPU_KERNEL_LIB", None)  # a prebuilt library would have no clock
    done = subprocess.run([sys.executable, "-c", _CLOCKED_STEPS, path, str(steps)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    clock = json.loads(done.stdout.strip().splitlines()[-1])
    calls = clock["calls"]
    assert calls == clock["layers"] * steps
    assert list(clock["seconds"]) == list(cpu_library.LAYER_STAGES)
    assert all(seconds > 0 for seconds in clock["seconds"].values()), clock["seconds"]
    assert sum(clock["seconds"].values()) < clock["wall"]
    # a helper joins its call at most once (one scheduled for a call the caller finished alone
    # may start after the clock is read: CI saw 9 joins of 10 calls)
    assert 0 <= clock["late_joins"] <= clock["joins"] <= calls * (os.cpu_count() or 1)
    assert clock["join_seconds"] >= 0
    # every join in one bucket of lateness; those past 50 us in the buckets from 2^15 ns on
    # (bucket 15 holds 32.8-65.5 us: the late ones are at most it and those after it)
    buckets = clock["join_buckets"]
    assert len(buckets) == 32 and min(buckets) >= 0 and sum(buckets) == clock["joins"]
    assert sum(buckets[16:]) <= clock["late_joins"] <= sum(buckets[15:])


def test_join_quantile_is_the_upper_edge_of_the_bucket_a_quantile_falls_in():
    """Hand-worked: 5 joins 7-14 ns late (bucket 3), 4 joins 1023-2046 ns (bucket 10), one
    past the last bucket's lower edge."""
    buckets = [0] * 32
    buckets[3], buckets[10], buckets[31] = 5, 4, 1
    assert cpu_library.join_quantile(buckets, 0.5) == pytest.approx(15e-9)
    assert cpu_library.join_quantile(buckets, 0.51) == pytest.approx(2047e-9)
    assert cpu_library.join_quantile(buckets, 0.9) == pytest.approx(2047e-9)
    assert cpu_library.join_quantile(buckets, 0.99) == float("inf")
    assert math.isnan(cpu_library.join_quantile([0] * 32, 0.5))
