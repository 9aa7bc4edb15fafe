"""The JAX models compute what HF transformers computes, through the paged KV pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS, hf_logits, slow_unless

from jaxpage.attention import build_metadata, init_kv_pool
from jaxpage.loading.hf import load_hf_dir
from jaxpage.models.llama import LlamaModel

ATOL = 1e-4
STEP = jax.jit(LlamaModel.forward, static_argnums=0)  # one compile per model and shape


def paged_forward(model, params, kv_pool, table, num_computed, new_tokens, block_size,
                  all_logits=False):
    """One step for one sequence through the pool; returns (logits, kv_pool)."""
    positions, metadata = build_metadata(
        [table], [num_computed], [len(new_tokens)], block_size,
        logits_indices=list(range(len(new_tokens))) if all_logits else None,
    )
    logits, kv_pool = STEP(model, params, jnp.asarray(new_tokens, jnp.int32), positions, kv_pool,
                           metadata)
    return np.asarray(logits), kv_pool


def make_pool(config, num_blocks, block_size, fill=np.nan):
    """A pool whose every slot holds `fill` (NaN shows any read of an unowned slot)."""
    pool = init_kv_pool(config.num_layers, num_blocks, block_size, config.num_kv_heads,
                        config.head_dim)
    return [(k + fill, v + fill) for k, v in pool]


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_full_prompt_logits_match_hf(name, hf_model_dir):
    path, hf_model = hf_model_dir(name)
    config, params = load_hf_dir(path, "float32")
    model = LlamaModel(config)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, config.vocab_size, size=45).tolist()
    block_size = 16
    table = (rng.permutation(9)[:3] + 1).tolist()  # 3 blocks out of 9, permuted, never 0
    pool = make_pool(config, 10, block_size)
    logits, _ = paged_forward(model, params, pool, table, 0, tokens, block_size, all_logits=True)
    expected = hf_logits(hf_model, tokens)
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name,block_size", [  # ~5 s each
    slow_unless(block_size == 16 or name == "llama", name, block_size)
    for name in ("llama", "qwen3", "smollm2") for block_size in (1, 16, 32)])
def test_token_by_token_decode_matches_hf(name, block_size, hf_model_dir):
    """Prefill a prompt, then decode one token per step; lengths cross block boundaries
    and land exactly on block multiples."""
    path, hf_model = hf_model_dir(name)
    config, params = load_hf_dir(path, "float32")
    model = LlamaModel(config)
    rng = np.random.default_rng(block_size)
    total = 2 * block_size + 3 if block_size > 1 else 12
    prompt_len = block_size if block_size > 1 else 4  # prompt ends exactly on a block
    tokens = rng.integers(0, config.vocab_size, size=total).tolist()
    num_table_blocks = -(-total // block_size)
    num_blocks = num_table_blocks + 5
    table = (rng.permutation(num_blocks - 1)[:num_table_blocks] + 1).tolist()
    pool = make_pool(config, num_blocks, block_size)
    expected = hf_logits(hf_model, tokens)

    assert_prefill_then_decode_match(model, params, pool, table, tokens, prompt_len,
                                     block_size, expected)


def assert_prefill_then_decode_match(model, params, pool, table, tokens, prompt_len,
                                     block_size, expected):
    """Prefill `tokens[:prompt_len]` in one step, then decode the rest one token per step,
    through `table`; every position's logits within ATOL of `expected` [len, vocab]."""
    logits, pool = paged_forward(model, params, pool, table, 0, tokens[:prompt_len], block_size,
                                 all_logits=True)
    np.testing.assert_allclose(logits, expected[:prompt_len], atol=ATOL, rtol=0)
    for pos in range(prompt_len, len(tokens)):
        logits, pool = paged_forward(model, params, pool, table, pos, tokens[pos : pos + 1],
                                     block_size)
        np.testing.assert_allclose(logits[0], expected[pos], atol=ATOL, rtol=0,
                                   err_msg=f"position {pos}")


def test_chunked_prefill_and_batched_sequences_match_hf(hf_model_dir):
    """Two sequences in one ragged step, one mid-prefill (chunk after a cached prefix),
    one decoding; then a mixed step with padding up to a bucket."""
    path, hf_model = hf_model_dir("llama")
    config, params = load_hf_dir(path, "float32")
    model = LlamaModel(config)
    rng = np.random.default_rng(7)
    block_size = 4
    seq_a = rng.integers(0, config.vocab_size, size=23).tolist()
    seq_b = rng.integers(0, config.vocab_size, size=9).tolist()
    pool = make_pool(config, 20, block_size)
    table_a = [5, 3, 9, 1, 12, 7]
    table_b = [2, 18, 4]

    def run(items, **pad):
        tables = [table for table, _, _, _ in items]
        computed = [c for _, c, _, _ in items]
        new = [n for _, _, n, _ in items]
        tokens = [tok for _, c, n, seq in items for tok in seq[c : c + n]]
        positions, md = build_metadata(tables, computed, new, block_size,
                                       logits_indices=list(range(len(tokens))), **pad)
        padded = np.zeros(len(positions), np.int32)
        padded[: len(tokens)] = tokens
        nonlocal pool
        logits, pool = STEP(model, params, jnp.asarray(padded), positions, pool, md)
        return np.asarray(logits)

    exp_a, exp_b = hf_logits(hf_model, seq_a), hf_logits(hf_model, seq_b)
    # step 1: a prefills its first 10 tokens, b its first 8
    out = run([(table_a, 0, 10, seq_a), (table_b, 0, 8, seq_b)])
    np.testing.assert_allclose(out[:10], exp_a[:10], atol=ATOL, rtol=0)
    np.testing.assert_allclose(out[10:18], exp_b[:8], atol=ATOL, rtol=0)
    # step 2: a's next chunk of 13 (attends to its 10 cached tokens), b decodes one token;
    # padded to 32 tokens, 4 sequences, 8 blocks per table
    out = run([(table_a, 10, 13, seq_a), (table_b, 8, 1, seq_b)], num_tokens=32, num_seqs=4,
              max_blocks_per_seq=8)
    np.testing.assert_allclose(out[:13], exp_a[10:23], atol=ATOL, rtol=0)
    np.testing.assert_allclose(out[13], exp_b[8], atol=ATOL, rtol=0)


def test_bfloat16_close_to_float32(hf_model_dir):
    path, _ = hf_model_dir("qwen2")
    config, params32 = load_hf_dir(path, "float32")
    _, params16 = load_hf_dir(path, "bfloat16")
    assert params16["embed"].dtype == jnp.bfloat16
    model = LlamaModel(config)
    tokens = list(range(3, 40))
    pool32 = make_pool(config, 4, 16, fill=0.0)
    pool16 = [(k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)) for k, v in pool32]
    l32, _ = paged_forward(model, params32, pool32, [1, 2, 3], 0, tokens, 16, all_logits=True)
    l16, _ = paged_forward(model, params16, pool16, [1, 2, 3], 0, tokens, 16, all_logits=True)
    assert l16.dtype == np.float32
    scale = np.abs(l32).max()
    assert np.abs(l16 - l32).max() < 0.05 * scale
    # the argmax agrees almost everywhere
    assert (l16.argmax(-1) == l32.argmax(-1)).mean() > 0.9


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_bfloat16_errs_from_float32_as_hf_bfloat16_does(name, hf_model_dir):
    """bfloat16 against HF transformers' bfloat16, both measured against HF's float32 logits
    (the truth both round away from): bfloat16 keeps 8 significant bits, so each op of
    either implementation rounds by up to 2^-9 relative, and two implementations that round
    at different places (jaxpage accumulates projections in float32 and rounds once, as
    PyTorch's CPU matmul does; the attention kernel's softmax is float32) differ from the
    truth by errors of the same size but not the same values. The bound: jaxpage's bfloat16
    error at most 1.5x HF's own, in the largest and in the mean absolute logit error."""
    import copy

    import torch

    path, hf_model = hf_model_dir(name)
    hf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
    tokens = list(range(3, 40))
    truth = hf_logits(hf_model, tokens)
    hf_err = np.abs(hf_logits(hf16, tokens) - truth)
    config, params16 = load_hf_dir(path, "bfloat16")
    pool16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_pool(config, 4, 16, fill=0.0))
    l16, _ = paged_forward(LlamaModel(config), params16, pool16, [1, 2, 3], 0, tokens, 16,
                           all_logits=True)
    our_err = np.abs(l16 - truth)
    assert hf_err.max() > 0  # bfloat16 rounds: the bound below is not vacuous
    assert our_err.max() <= 1.5 * hf_err.max(), (our_err.max(), hf_err.max())
    assert our_err.mean() <= 1.5 * hf_err.mean(), (our_err.mean(), hf_err.mean())
