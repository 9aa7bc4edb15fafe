"""prompt_logprobs against HF transformers: each prompt token's log-probability and the top
ones at its position, from HF's float32 logits in a float64 log-softmax."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import hf_logits

from jaxpage import LLM, SamplingParams


@pytest.fixture(scope="module")
def model(hf_model_dir):
    return hf_model_dir("llama")


def reference(model, prompt: list[int]) -> np.ndarray:
    logits = hf_logits(model, prompt).astype(np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(
        -1, keepdims=True)) - logits.max(-1, keepdims=True)


def check(out, model, k: int) -> None:
    prompt = out.prompt_token_ids
    ref = reference(model, prompt)
    scored = out.prompt_logprobs
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None
    for i in range(1, len(prompt)):
        row = ref[i - 1]
        entry = scored[i]
        top = np.argsort(-row, kind="stable")[:k]
        assert set(entry) == set(top.tolist()) | {prompt[i]}, i
        for token, logprob in entry.items():
            assert abs(logprob - row[token]) < 2e-4, (i, token, logprob, row[token])


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_match_hf_across_chunks_and_requests(model, k):
    """Prompts split into several prefill chunks (max_num_batched_tokens 16), mixed with
    requests that ask for none, n=2, and the same prompt twice (the second is computed
    again, not served from the prefix cache, and scored the same)."""
    path, hf = model
    llm = LLM(path, max_model_len=256, num_blocks=64, block_size=8,
              max_num_batched_tokens=16, max_num_seqs=8)
    rng = np.random.default_rng(k)
    prompts = [rng.integers(3, 97, size=n).tolist() for n in (37, 5, 2, 37, 20)]
    prompts[3] = prompts[0]
    params = [SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=k),
              SamplingParams(max_tokens=4, temperature=0.0),
              SamplingParams(max_tokens=3, temperature=1.0, seed=1, n=2, prompt_logprobs=k),
              SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=k),
              SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=k)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[1].prompt_logprobs is None
    for i in (0, 2, 3, 4):
        check(outs[i], hf, k)
    for a, b in zip(outs[3].prompt_logprobs[1:], outs[0].prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys()  # scored alike (to rounding: other rows shared its steps)
        np.testing.assert_allclose(list(a.values()), [b[t] for t in a], atol=1e-5)
    assert outs[0].outputs[0].token_ids == outs[3].outputs[0].token_ids
    # with prompt_logprobs nothing of the prompt came from the cache
    assert outs[3].metrics.num_cached_tokens == 0
    # the draws are those of a request without prompt_logprobs
    plain = llm.generate(prompts[0], SamplingParams(max_tokens=4, temperature=0.0),
                         use_tqdm=False)[0]
    assert plain.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_prompt_logprobs_survive_preemption(model):
    """A pool too small for all the prompts at once preempts: the prompts' scores are still
    HF's, each token scored once."""
    path, hf = model
    llm = LLM(path, max_model_len=256, num_blocks=14, block_size=8,
              max_num_batched_tokens=16, max_num_seqs=4)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 97, size=30).tolist() for _ in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0,
                                                prompt_logprobs=2, ignore_eos=True),
                        use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for out in outs:
        check(out, hf, 2)
