"""Greedy generation through the whole engine equals HF transformers `generate`, token for
token, under every scheduling regime: one big batch, chunked prefill, preemption, and
prefix caching on and off."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import hf_greedy

from jaxpage import LLM, SamplingParams

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(hf_model_dir):
    return hf_model_dir("llama")


@pytest.fixture(scope="module")
def mixed_prompts():
    """16 prompts of lengths 1..300, and their HF greedy continuations."""
    rng = np.random.default_rng(0)
    lengths = [1, 2, 15, 16, 17, 31, 33, 64, 100, 127, 150, 199, 230, 256, 280, 300]
    return [rng.integers(3, 97, size=n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def expected(tiny, mixed_prompts):
    _, model = tiny
    return [hf_greedy(model, p, MAX_TOKENS) for p in mixed_prompts]


def run_and_check(llm, prompts, expected):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, (out, exp) in enumerate(zip(outs, expected, strict=True)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} (len {len(prompts[i])})"
        assert out.outputs[0].finish_reason == "length"
        assert out.prompt_token_ids == prompts[i]
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0, "blocks leaked after all requests finished"
    llm.engine.allocator.check_invariants()
    return stats


def test_one_big_batch(tiny, mixed_prompts, expected):
    llm = LLM(tiny[0], block_size=16, num_blocks=128, max_num_batched_tokens=1024,
              max_num_seqs=16)
    run_and_check(llm, mixed_prompts, expected)


def test_chunked_prefill_small_budget(tiny, mixed_prompts, expected):
    llm = LLM(tiny[0], block_size=16, num_blocks=128, max_num_batched_tokens=48,
              max_num_seqs=8)
    stats = run_and_check(llm, mixed_prompts, expected)
    assert stats["num_steps"] > 20


def test_preemption(tiny, mixed_prompts, expected):
    # 40 blocks of 8 tokens = 312 usable slots: the longest prompt alone nearly fills it
    llm = LLM(tiny[0], block_size=8, num_blocks=40, max_num_batched_tokens=128,
              max_num_seqs=16, enable_prefix_caching=False)
    stats = run_and_check(llm, mixed_prompts, expected)
    assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_shared_prefix(tiny, prefix_caching):
    _, model = tiny
    rng = np.random.default_rng(1)
    prefix = rng.integers(3, 97, size=100).tolist()
    prompts = [prefix + rng.integers(3, 97, size=n).tolist() for n in (1, 7, 20, 33)]
    exp = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    llm = LLM(tiny[0], block_size=16, num_blocks=128, max_num_batched_tokens=256,
              max_num_seqs=8, enable_prefix_caching=prefix_caching)
    run_and_check(llm, prompts[:1], exp[:1])  # the first request fills the cache
    stats = run_and_check(llm, prompts[1:], exp[1:])
    if prefix_caching:
        # each later prompt reuses the 6 full blocks (96 tokens) of the shared prefix
        assert stats["prefix_cache_hits"] == 3 * 96
    else:
        assert stats["prefix_cache_hits"] == 0


def test_reset_prefix_cache(tiny):
    """After reset_prefix_cache() a repeated prompt gets no hits (and the same tokens); the
    reset is refused while a request holds blocks."""
    _, model = tiny
    prompt = np.random.default_rng(2).integers(3, 97, size=70).tolist()
    exp = [hf_greedy(model, prompt, MAX_TOKENS)]
    llm = LLM(tiny[0], block_size=16, num_blocks=64, max_num_batched_tokens=256)
    run_and_check(llm, [prompt], exp)
    run_and_check(llm, [prompt], exp)
    assert llm.stats()["prefix_cache_hits"] == 64  # the second run hit 4 full blocks
    assert llm.reset_prefix_cache()
    run_and_check(llm, [prompt], exp)
    assert llm.stats()["prefix_cache_hits"] == 64  # no new hits after the reset
    llm.engine.add_request("busy", prompt, GREEDY)
    llm.engine.step()
    assert not llm.reset_prefix_cache()
    llm.engine.abort_request("busy")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.reset_prefix_cache()
