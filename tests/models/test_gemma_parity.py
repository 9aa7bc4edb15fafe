"""Gemma 2 and Gemma 3 compute what HF transformers computes, through the paged KV pool,
past the sliding window; and load the same from HF dirs, jaxpage checkpoints and GGUF."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import hf_greedy, hf_logits
from gemma_models import TINY_GEMMA_CONFIGS, WINDOW, build_gemma, write_gemma_gguf

from jaxpage.attention import build_metadata, init_kv_pool
from jaxpage.loading.checkpoint import load_checkpoint, save_checkpoint
from jaxpage.loading.gguf import gemma_config_from_gguf, load_gguf
from jaxpage.loading.hf import load_hf_dir
from jaxpage.models import build_model
from jaxpage.models.config import ModelConfig
from jaxpage.models.gemma import GemmaModel

ATOL = 1e-4
STEP = jax.jit(GemmaModel.forward, static_argnums=0)  # one compile per model and shape
NAMES = sorted(TINY_GEMMA_CONFIGS)


def load(path: str):
    config, params = load_hf_dir(path, "float32")
    return build_model(config), params


def make_pool(config, num_blocks, block_size):
    """A pool whose every slot holds NaN, so any read of an unowned slot shows."""
    pool = init_kv_pool(config.num_layers, num_blocks, block_size, config.num_kv_heads,
                        config.head_dim)
    return [(k + np.nan, v + np.nan) for k, v in pool]


def step(model, params, pool, items, block_size, **pad):
    """One ragged step over `items` = [(block table, tokens already cached, new tokens)];
    returns (logits of every new token, pool). The reference backend: the one that
    implements sliding windows and soft-capping on every platform."""
    tokens = [t for _, _, new in items for t in new]
    positions, metadata = build_metadata(
        [table for table, _, _ in items], [cached for _, cached, _ in items],
        [len(new) for _, _, new in items], block_size,
        logits_indices=list(range(len(tokens))), backend="reference", **pad)
    padded = np.zeros(len(positions), np.int32)
    padded[: len(tokens)] = tokens
    logits, pool = STEP(model, params, jnp.asarray(padded), positions, pool, metadata)
    return np.asarray(logits)[: len(tokens)], pool


def prompt(length: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(3, 97, size=length).tolist()


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logits_match_hf(name, hf_model_dir):
    """A 50-token prompt (three windows) in one step, over permuted blocks."""
    path, hf_model = hf_model_dir(name)
    model, params = load(path)
    tokens = prompt(50)
    pool = make_pool(model.config, 10, 16)
    logits, _ = step(model, params, pool, [([7, 2, 9, 4], 0, tokens)], 16)
    np.testing.assert_allclose(logits, hf_logits(hf_model, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_batched_and_decode_match_hf(name, hf_model_dir):
    """Sequence a prefills in chunks that straddle the window edge, sharing steps with
    sequence b, which decodes; then a decodes token by token to 60 tokens."""
    path, hf_model = hf_model_dir(name)
    model, params = load(path)
    block_size = 8
    seq_a, seq_b = prompt(60, seed=2), prompt(30, seed=3)
    exp_a, exp_b = hf_logits(hf_model, seq_a), hf_logits(hf_model, seq_b)
    table_a, table_b = [11, 3, 17, 6, 1, 14, 9, 20], [5, 12, 2, 19]
    pool = make_pool(model.config, 24, block_size)
    pad = dict(num_tokens=32, num_seqs=2, max_blocks_per_seq=8)  # one compiled shape

    logits, pool = step(model, params, pool, [(table_b, 0, seq_b[:25])], block_size, **pad)
    np.testing.assert_allclose(logits, exp_b[:25], atol=ATOL, rtol=0)
    cached_a, cached_b = 0, 25
    for chunk in (13, 10, 21):  # a: 0-13, 13-23, 23-44 while b decodes 25, 26, 27
        items = [(table_a, cached_a, seq_a[cached_a : cached_a + chunk]),
                 (table_b, cached_b, seq_b[cached_b : cached_b + 1])]
        logits, pool = step(model, params, pool, items, block_size, **pad)
        np.testing.assert_allclose(logits[:chunk], exp_a[cached_a : cached_a + chunk],
                                   atol=ATOL, rtol=0, err_msg=f"a's chunk at {cached_a}")
        np.testing.assert_allclose(logits[chunk], exp_b[cached_b], atol=ATOL, rtol=0,
                                   err_msg=f"b at {cached_b}")
        cached_a, cached_b = cached_a + chunk, cached_b + 1
    for pos in range(cached_a, len(seq_a)):
        logits, pool = step(model, params, pool, [(table_a, pos, seq_a[pos : pos + 1])],
                            block_size)
        np.testing.assert_allclose(logits[0], exp_a[pos], atol=ATOL, rtol=0,
                                   err_msg=f"a decoding at {pos}")


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_match_hf_generate(name, hf_model_dir):
    """24 greedy tokens after a 12-token prompt: generation runs 20 tokens past the window."""
    path, hf_model = hf_model_dir(name)
    model, params = load(path)
    tokens, new = prompt(12, seed=4), 24
    table, block_size = [4, 1, 6, 3, 2], 8
    pool = make_pool(model.config, 8, block_size)
    logits, pool = step(model, params, pool, [(table, 0, tokens)], block_size)
    generated = [int(logits[-1].argmax())]
    while len(generated) < new:
        pos = len(tokens) + len(generated) - 1
        logits, pool = step(model, params, pool, [(table, pos, generated[-1:])], block_size)
        generated.append(int(logits[0].argmax()))
    assert len(tokens) + new >= WINDOW + 20
    assert generated == hf_greedy(hf_model, tokens, new)


@pytest.mark.parametrize("name", NAMES)
def test_window_and_soft_caps_bind(name, hf_model_dir):
    """The parity tests would catch a model that ignores the window, the soft-caps or the
    local rope: each changes the tiny models' logits by far more than the tolerance."""
    path, hf_model = hf_model_dir(name)
    model, params = load(path)
    tokens = prompt(50)
    expected = hf_logits(hf_model, tokens)
    config = model.config
    variants = {"no window": dict(layer_types=("full_attention",) * config.num_layers)}
    if config.attn_logit_softcap:
        variants["no attention soft-cap"] = dict(attn_logit_softcap=None)
    if config.final_logit_softcap:
        variants["no final soft-cap"] = dict(final_logit_softcap=None)
    if config.rope_local:
        variants["global rope everywhere"] = dict(rope_local=None)
    for what, change in variants.items():
        changed = build_model(dataclasses.replace(config, **change))
        pool = make_pool(config, 5, 16)
        logits, _ = step(changed, params, pool, [([1, 2, 3, 4], 0, tokens)], 16)
        assert np.abs(logits - expected).max() > 100 * ATOL, what


def test_bfloat16_close_to_float32(hf_model_dir):
    """bfloat16 params and pool run the same forward (no float32 leaking into the pool)."""
    path, _ = hf_model_dir("gemma3")
    model, params32 = load(path)
    _, params16 = load_hf_dir(path, "bfloat16")
    tokens = prompt(40)
    pool32 = make_pool(model.config, 4, 16)
    pool16 = [(k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)) for k, v in pool32]
    l32, _ = step(model, params32, pool32, [([1, 2, 3], 0, tokens)], 16)
    l16, pool16 = step(model, params16, pool16, [([1, 2, 3], 0, tokens)], 16)
    assert l16.dtype == np.float32 and pool16[0][0].dtype == jnp.bfloat16
    assert np.abs(l16 - l32).max() < 0.05 * np.abs(l32).max()
    assert (l16.argmax(-1) == l32.argmax(-1)).mean() > 0.9


def test_config_from_hub_style_config_json(hf_model_dir):
    """Hub config.json files predate transformers 5: no layer_types, and Gemma 3's ropes
    as rope_theta / rope_scaling / rope_local_base_freq. Both forms give one config."""
    path, hf_model = hf_model_dir("gemma3")
    current = hf_model.config.to_dict()
    ropes = current.pop("rope_parameters")
    hub = {k: v for k, v in current.items() if k != "layer_types"}
    hub.update(rope_theta=ropes["full_attention"]["rope_theta"],
               rope_scaling={"type": "linear", "factor": ropes["full_attention"]["factor"]},
               rope_local_base_freq=ropes["sliding_attention"]["rope_theta"],
               sliding_window_pattern=6)
    assert ModelConfig.from_hf(hub) == ModelConfig.from_hf(hf_model.config)
    # transformers' defaults for what a config leaves out: Gemma 3's rope bases,
    # Gemma 2's soft-caps and scalar
    del hub["rope_theta"], hub["rope_local_base_freq"], hub["rope_scaling"]
    config = ModelConfig.from_hf(hub)
    assert (config.rope.theta, config.rope_local.theta) == (1e6, 1e4)
    gemma2 = {k: v for k, v in hf_model_dir("gemma2")[1].config.to_dict().items()
              if k not in ("attn_logit_softcapping", "final_logit_softcapping",
                           "query_pre_attn_scalar", "layer_types")}
    config = ModelConfig.from_hf(gemma2)
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert config.query_pre_attn_scalar == 256
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    with pytest.raises(ValueError, match="bidirectional"):
        ModelConfig.from_hf({**hub, "use_bidirectional_attention": True})


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_round_trip(name, hf_model_dir, tmp_path):
    path, _ = hf_model_dir(name)
    config, params = load_hf_dir(path, "float32")
    save_checkpoint(str(tmp_path / "ckpt"), config, params)
    loaded_config, loaded, _ = load_checkpoint(str(tmp_path / "ckpt"), "float32")
    assert loaded_config == config  # layer_types, rope_local and the soft-caps included
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_gguf_matches_hf(name, tmp_path):
    """A GGUF written as llama.cpp writes it loads to the HF twin's config and params (the
    norm shift undone) and logits. llama.cpp does not store query_pre_attn_scalar, and
    takes head_dim below 27B, so the twin has that."""
    hf_model = build_gemma(name, query_pre_attn_scalar=16)
    hf_model.save_pretrained(tmp_path / "hf")
    config, params = load_gguf(write_gemma_gguf(hf_model, tmp_path / f"{name}.gguf"), "float32")
    hf_config, hf_params = load_hf_dir(str(tmp_path / "hf"), "float32")
    assert config == hf_config
    assert jax.tree.structure(params) == jax.tree.structure(hf_params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(hf_params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    tokens = prompt(40)
    pool = make_pool(config, 4, 16)
    logits, _ = step(build_model(config), params, pool, [([3, 1, 2], 0, tokens)], 16)
    np.testing.assert_allclose(logits, hf_logits(hf_model, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch, layers_27b", [("gemma2", 46), ("gemma3", 62)])
def test_gguf_gemma_scalar_and_pattern_are_llama_cpps(arch, layers_27b):
    """What a Gemma GGUF leaves out is what llama.cpp hard-codes: query_pre_attn_scalar is
    head_dim, but hidden / heads at 27B (Gemma 2 27B: 4608 / 32 = 144, not head_dim 128);
    every 2nd (Gemma 2) or 6th (Gemma 3) layer is global."""
    meta = {"attention.sliding_window": 4096}.get
    common = dict(hidden_size=4608, num_attention_heads=32, head_dim=128, rope_theta=1e6,
                  rope_scaling=None)
    big = gemma_config_from_gguf(arch, meta, {**common, "num_hidden_layers": layers_27b})
    small = gemma_config_from_gguf(arch, meta, {**common, "num_hidden_layers": 12})
    assert (big["query_pre_attn_scalar"], small["query_pre_attn_scalar"]) == (144, 128)
    period = {"gemma2": 2, "gemma3": 6}[arch]
    assert [t == "full_attention" for t in small["layer_types"]] == [
        (n + 1) % period == 0 for n in range(12)]
    windowless = gemma_config_from_gguf(arch, {}.get, {**common, "num_hidden_layers": 12})
    assert set(windowless["layer_types"]) == {"full_attention"}


def test_gguf_of_an_unsupported_gemma_names_the_architectures(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "gemma1.gguf"), "gemma")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'.*gemma2"):
        load_gguf(str(tmp_path / "gemma1.gguf"), "float32")
