"""On-device sampling against independent NumPy computations and HF's logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import hf_logits

from jaxpage import LLM, SamplingParams
from jaxpage.sampling import SamplingMetadata, apply_penalties, argmax, sample


def metadata(rows, **overrides):
    base = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=0, step=0)
    base.update(overrides)
    md = {k: np.full(rows, v, np.float32 if isinstance(v, float) else np.int32)
          for k, v in base.items() if k not in ("seed",)}
    md["seeds"] = np.arange(rows, dtype=np.uint32) + np.uint32(base["seed"])
    md["steps"] = md.pop("step")
    return md


def expected_distribution(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Independent NumPy oracle of the documented order: temperature, min-p, top-k, top-p."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    if top_k > 0:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    q = np.where(keep, p, 0)
    q /= q.sum()
    order = np.argsort(-q, kind="stable")
    mass_before = np.cumsum(q[order]) - q[order]
    nucleus = np.zeros_like(keep)
    nucleus[order[mass_before < top_p]] = True
    q = np.where(keep & nucleus, q, 0)
    return q / q.sum()


FILTERS_OFF = {"top_p": 1.0, "top_k": 0, "min_p": 0.0}


@pytest.mark.parametrize("settings", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.8),
    dict(temperature=1.3, top_k=5),
    dict(temperature=1.0, min_p=0.3),
    dict(temperature=0.9, top_k=20, top_p=0.9),
    dict(temperature=0.9, top_p=0.9, min_p=0.4),
])
def test_empirical_distribution_matches_hf_logits(settings, hf_model_dir):
    """40,000 draws from HF's next-token logits follow the NumPy oracle's distribution, and
    never a token the row's filters drop. Every filter of a row bites: a sampler ignoring it
    would draw the tokens it drops over a thousand times."""
    _, model = hf_model_dir("llama")
    logits = hf_logits(model, [5, 17, 42, 8, 61])[-1]  # HF's next-token logits
    # scale up so the distribution is peaked enough for filters to bite
    logits = logits * 4.0
    draws = 40_000
    md = metadata(draws, **settings)
    filters = [name for name, off in FILTERS_OFF.items() if settings.get(name, off) != off]
    expected = expected_distribution(logits, **settings)
    for name in filters:
        without = expected_distribution(logits, **{**settings, name: FILTERS_OFF[name]})
        assert draws * without[expected == 0].sum() > 1000, name
    use_filters = bool(filters)
    out = jax.jit(sample)(jnp.tile(jnp.asarray(logits)[None], (draws, 1)),
                          SamplingMetadata(**md, use_filters=use_filters))
    counts = np.bincount(np.asarray(out["tokens"]), minlength=logits.shape[0])
    # tokens outside the kept set must never be drawn
    assert counts[expected == 0].sum() == 0
    # chi-square over the kept support: mean df, sd sqrt(2 df); allow 6 sd
    support = expected > 0
    df = support.sum() - 1
    if df > 0:
        chi2 = (((counts - draws * expected) ** 2)[support] / (draws * expected[support])).sum()
        assert chi2 < df + 6 * np.sqrt(2 * df) + 10, (chi2, df)
    # and total variation below a bound far under any filter's effect
    assert 0.5 * np.abs(counts / draws - expected).sum() < 0.5 * np.sqrt(support.sum() / draws)


def vllm_penalties_numpy(logits, prompt, output, presence, frequency, repetition):
    out = logits.astype(np.float64).copy()
    seen = set(prompt) | set(output)
    for t in seen:
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):
        out[t] -= frequency * output.count(t) + presence
    return out


def test_penalties_match_numpy_definition():
    rng = np.random.default_rng(0)
    vocab = 50
    logits = rng.standard_normal((3, vocab)).astype(np.float32) * 3
    prompts = [[1, 2, 3, 3], [], [7]]
    outputs = [[3, 4, 4, 4, 9], [5, 5], []]
    presence, frequency, repetition = [0.5, -0.3, 1.0], [0.2, 1.5, 0.0], [1.3, 1.0, 0.8]

    def pad(rows, width=8):
        arr = np.full((len(rows), width), -1, np.int32)
        for i, r in enumerate(rows):
            arr[i, : len(r)] = r
        return arr

    md = SamplingMetadata(**metadata(3), presence=np.array(presence, np.float32),
                          frequency=np.array(frequency, np.float32),
                          repetition=np.array(repetition, np.float32),
                          prompt_token_ids=pad(prompts), output_token_ids=pad(outputs),
                          use_penalties=True)
    got = np.asarray(apply_penalties(jnp.asarray(logits), md))
    for i in range(3):
        want = vllm_penalties_numpy(logits[i], prompts[i], outputs[i], presence[i],
                                    frequency[i], repetition[i])
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def llm(hf_model_dir):
    path, _ = hf_model_dir("llama")
    return LLM(path, block_size=8, num_blocks=200, max_num_batched_tokens=128, max_num_seqs=16)


def test_seeded_request_same_alone_and_in_batch(llm):
    rng = np.random.default_rng(3)
    target = rng.integers(3, 97, size=20).tolist()
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234,
                            ignore_eos=True)
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [rng.integers(3, 97, size=int(n)).tolist() for n in rng.integers(1, 60, 8)]
    other_params = [SamplingParams(max_tokens=int(m), temperature=0.8, ignore_eos=True)
                    for m in rng.integers(1, 30, 8)]
    batch = llm.generate(others[:4] + [target] + others[4:],
                         other_params[:4] + [params] + other_params[4:], use_tqdm=False)
    assert batch[4].outputs[0].token_ids == alone
    # a different seed gives a different continuation (16 tokens at temperature 1)
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99,
                                ignore_eos=True)
    assert llm.generate([target], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_one_equals_greedy(llm):
    prompt = list(range(10, 40))
    greedy = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0,
                                                   ignore_eos=True), use_tqdm=False)
    top1 = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=1.5, top_k=1,
                                                 ignore_eos=True), use_tqdm=False)
    assert top1[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_logprobs_are_raw_model_logprobs(llm, hf_model_dir):
    _, model = hf_model_dir("llama")
    prompt = [5, 17, 42, 8, 61]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=5,
                                                ignore_eos=True), use_tqdm=False)[0]
    logits = hf_logits(model, prompt)[-1].astype(np.float64)
    ref = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    entry = out.outputs[0].logprobs[0]
    top5 = np.argsort(-ref)[:5]
    assert set(top5) <= set(entry) and len(entry) == 5  # greedy token is the top-1
    for token, value in entry.items():
        assert abs(value - ref[token]) < 1e-4
    assert abs(out.outputs[0].cumulative_logprob - ref[top5[0]]) < 1e-4


def test_argmax_matches_numpy_on_ties_nan_and_inf():
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 3, (6, 37)).astype(np.float32)  # many tied maxima
    x[1, [4, 9]] = np.nan  # NaN wins, the first one (as np.argmax / jnp.argmax)
    x[2] = -np.inf
    x[3, :5] = np.inf
    x[4, -1] = 100.0
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(x))), np.argmax(x, axis=-1))


def test_greedy_logprob_without_top_logprobs(llm, hf_model_dir):
    """The sampled token's log-probability when no top logprobs are asked for (computed
    without the full log-softmax) is still the raw model's."""
    _, model = hf_model_dir("llama")
    prompt = [5, 17, 42, 8, 61]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    logits = hf_logits(model, prompt)[-1].astype(np.float64)
    ref = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    assert out.token_ids == [int(np.argmax(ref))]
    assert abs(out.cumulative_logprob - ref.max()) < 1e-4


def test_min_tokens_bans_eos_and_stop_tokens(llm, hf_model_dir):
    """Before min_tokens, neither EOS nor a stop token is drawn, even where it is the greedy
    choice: the runner-up is drawn instead."""
    # EOS (id 2) is the HF model's greedy next token after this prompt ...
    _, model = hf_model_dir("llama")
    eos_prompt = [62, 12, 50]
    logits = hf_logits(model, eos_prompt)[-1]
    assert llm.engine.eos_token_ids == {2} and int(np.argmax(logits)) == 2
    ends = llm.generate([eos_prompt], SamplingParams(max_tokens=6, temperature=0),
                        use_tqdm=False)[0].outputs[0]
    assert ends.token_ids == [2] and ends.finish_reason == "stop"
    # ... and min_tokens holds it back: the first token is the runner-up, no EOS in 3
    held = llm.generate([eos_prompt], SamplingParams(max_tokens=6, temperature=0,
                                                     min_tokens=3), use_tqdm=False)
    assert held[0].outputs[0].token_ids[0] == int(np.argsort(logits)[-2])
    assert 2 not in held[0].outputs[0].token_ids[:3]

    prompt = list(range(10, 40))
    greedy = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0,
                                                   ignore_eos=True), use_tqdm=False)
    first = greedy[0].outputs[0].token_ids[0]
    # the greedy first token as a stop token ends generation at once ...
    stopped = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0,
                                                    stop_token_ids=[first]), use_tqdm=False)
    assert stopped[0].outputs[0].token_ids == [first]
    assert stopped[0].outputs[0].finish_reason == "stop"
    assert stopped[0].outputs[0].stop_reason == first
    # ... unless min_tokens forbids it: then it is never drawn in the first 3 tokens
    held = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, min_tokens=3,
                                                 stop_token_ids=[first]), use_tqdm=False)
    assert first not in held[0].outputs[0].token_ids[:3]
