"""Speculative decoding (`EngineConfig.speculative_config`, jaxpage.engine.speculative): the
engine must not be able to tell. Every request, greedy or seeded, gets the tokens and finish
reasons it gets without speculation, and its log-probabilities to float32 rounding (a
token's logits computed in a chunk with its drafts, not in a decode step of its own, round
differently); greedy ones are HF transformers' tokens. The drafts come from the n-gram
proposer, or from a scripted proposer that knows each sequence's continuation and gets it
wrong at random (so that every acceptance pattern happens: none, some, all, drafts cut
short, none proposed). The pool starts as NaN and released blocks are refilled with NaN
(`debug_nan_pool`): a read of the K/V of a rejected draft, or of a block given back, would
turn tokens to garbage."""

from __future__ import annotations

import dataclasses
import math
import random

import jax
import numpy as np
import pytest
from conftest import build_hf_model, hf_greedy, hf_logits
from test_fault_injection import Once, fault_at, make_llm, run
from test_fault_injection import workload as fault_workload
from test_lookahead import (
    GREEDY,
    PALLAS,
    llm_block_bytes,
    same_up_to_rounding,
    serve,
    stop_case,  # noqa: F401  (a fixture)
    tiny,  # noqa: F401  (a fixture)
    workload,
)

import jaxpage.engine.runner as runner_module
from jaxpage import LLM, SamplingParams
from jaxpage.config import EngineConfig
from jaxpage.engine.speculative import NgramProposer, SpeculativeConfig


class Scripted:
    """A proposer that knows `sequences` (each sample's prompt and output without
    speculation): for a sequence that is a prefix of one of them it proposes what follows,
    each draft wrong with probability `wrong`; for any other, random tokens. The number of
    drafts is drawn in [0, k]. Records, per proposal, how many of its drafts were right
    (the acceptance the engine must find)."""

    def __init__(self, sequences, vocab_size: int, wrong: float, seed: int = 0) -> None:
        self.sequences = [list(s) for s in sequences]
        self.vocab_size, self.wrong, self.rng = vocab_size, wrong, random.Random(seed)
        self.proposals: list[tuple[int, int]] = []  # (drafts, leading right ones)

    def propose(self, token_ids, k):
        n, rng = len(token_ids), self.rng
        k = rng.randint(0, k)
        known = next((s for s in self.sequences if len(s) > n and s[:n] == token_ids), None)
        truth = known[n : n + k] if known is not None else []
        drafts = [t if rng.random() >= self.wrong
                  else (t + rng.randrange(1, self.vocab_size)) % self.vocab_size
                  for t in truth]
        drafts += [rng.randrange(self.vocab_size) for _ in range(k - len(drafts))]
        right = 0
        while right < len(truth) and drafts[right] == truth[right]:
            right += 1
        if drafts:
            self.proposals.append((len(drafts), right))
        return drafts


def spec(k: int = 4, **kwargs) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, **kwargs}


def sequences(final) -> list[list[int]]:
    """Every sample's prompt + output of a run's final outputs."""
    return [list(out.prompt_token_ids) + list(c.token_ids)
            for out in final.values() for c in out.outputs]


def spec_workload(stop_case):  # noqa: F811
    """test_lookahead's workload (late arrivals, stop tokens inside min_tokens, penalties,
    n > 1, a beam, an abort), plus a prompt prefilled in chunks and a prefix hit."""
    return workload(stop_case) + [
        ("long", list(range(3, 70)), SamplingParams(max_tokens=20, **GREEDY), 3),
        ("hit", list(range(3, 10)), SamplingParams(max_tokens=26, **GREEDY), 10),
    ]


def assert_same(got, want) -> None:
    """Same outputs; the aborted request's are a prefix of the other run's (its abort
    lands after however many tokens the steps so far produced)."""
    assert set(got) == set(want)
    for request_id in want:
        if request_id == "abort":
            (a,), (b,) = got[request_id].outputs, want[request_id].outputs
            assert a.finish_reason == b.finish_reason == "abort"
            n = min(len(a.token_ids), len(b.token_ids))
            assert a.token_ids[:n] == b.token_ids[:n]
        else:
            same_up_to_rounding(got[request_id], want[request_id])


def committed_as_tokens(engine):
    """A `before_step` check: every running sequence's committed K/V is that of its own
    tokens (no rejected draft hashed, its computed count the scheduler's), and a sequence
    holds no block past the one its next token is written into (a rejected draft's blocks
    went back)."""
    allocator, bs = engine.allocator, engine.allocator.block_size

    def check(step):
        for request in engine.scheduler.running:
            seq = allocator._seqs[request.seq_id]
            computed = request.num_computed_tokens
            assert seq.num_computed_tokens == computed < request.num_tokens + 1
            assert seq.block_hashes == allocator.hash_blocks(
                request.token_ids[:computed], cache_salt=request.cache_salt)
            assert len(seq.block_table) <= computed // bs + 2, (step, request.seq_id)
    return check


@pytest.fixture(scope="module")
def plain(tiny, stop_case):  # noqa: F811
    """(block_size, num_blocks, swap, backend) -> the workload's final outputs without
    speculation, each run once."""
    runs = {}

    def get(block_size, num_blocks, swap, backend="cpp"):
        key = (block_size, num_blocks, swap, backend)
        if key not in runs:
            runs[key] = serve(make(tiny[0], block_size, num_blocks, swap, backend, None),
                              spec_workload(stop_case))[0]
        return runs[key]
    return get


def make(path, block_size, num_blocks, swap, backend, speculative, **overrides):
    kwargs = dict(block_size=block_size, num_blocks=num_blocks, max_num_batched_tokens=32,
                  max_num_seqs=8, debug_nan_pool=True, attention_backend=backend,
                  kernel_interpret=backend.startswith("pallas"),
                  swap_space=swap * llm_block_bytes(path, block_size),
                  preemption_mode="swap" if swap else "recompute",
                  speculative_config=speculative)
    return LLM(path, **{**kwargs, **overrides})


POOLS = {"blocks-of-4": (4, 64, 0), "preempting": (4, 24, 0), "swapping": (4, 24, 64),
         "blocks-of-16": (16, 24, 0)}


def backend_cases() -> list:
    """(backend, block_size, num_blocks, swap): the CPU's own kernel on every pool in the
    default suite; jnp on the preempting ones and each Pallas kernel, interpreted (~2
    minutes a case on two cores), on the preempting one in the slow suite."""
    cases = [pytest.param("cpp", *pool, id=f"cpp-{name}") for name, pool in POOLS.items()]
    cases += [pytest.param("jnp", *POOLS[name], id=f"jnp-{name}", marks=pytest.mark.slow)
              for name in ("preempting", "swapping")]
    cases += [pytest.param(p.values[0], *POOLS["preempting"], id=f"{p.values[0]}-preempting",
                           marks=p.marks) for p in PALLAS]
    return cases


@pytest.mark.parametrize("backend,block_size,num_blocks,swap", backend_cases())
def test_speculation_changes_no_request(tiny, stop_case, plain, backend, block_size,  # noqa: F811
                                        num_blocks, swap):
    """The workload with k = 6 drafts a step, a quarter of them wrong: every request as
    without speculation, HF's greedy tokens, the committed K/V checked every step."""
    path, model = tiny
    if backend == "pallas_tpu" and block_size < 8:  # Mosaic: blocks of whole sublanes
        num_blocks, swap, block_size = num_blocks // 2, swap // 2, 8
    want = plain(block_size, num_blocks, swap, backend)
    items = spec_workload(stop_case)
    llm = make(path, block_size, num_blocks, swap, backend, spec(6, adaptive=False))
    proposer = llm.engine.scheduler.proposer = Scripted(sequences(want), 97, wrong=0.25)
    got, stats, raised = serve(llm, items, before_step=committed_as_tokens(llm.engine))
    assert raised == 0
    assert_same(got, want)
    # every acceptance pattern happened: none, all, and long runs accepted
    spec_stats = stats["spec_decode"]
    right = [r for _, r in proposer.proposals]
    full = sum(1 for d, r in proposer.proposals if d == r)
    assert min(right) == 0 and full >= 5 and max(right) >= 4, proposer.proposals
    assert spec_stats["num_accepted_tokens"] > 20 and spec_stats["num_drafts"] > 30
    if num_blocks * block_size < 100:  # "preempting", "swapping"
        assert stats["num_preemptions"] > 0
    if swap:
        assert stats["num_swapped_preemptions"] > 0
    for request_id, prompt, params, _ in items:  # the independent oracle
        if request_id in ("g0", "late", "long"):
            assert got[request_id].outputs[0].token_ids == hf_greedy(model, prompt,
                                                                     params.max_tokens)


def test_acceptance_counts_are_the_proposals(tiny, stop_case, plain):  # noqa: F811
    """With one request at a time the engine's counts are the scripted proposer's own:
    each proposal's accepted drafts are its leading right ones (greedy requests, whose
    continuation the proposer knows)."""
    want = plain(4, 64, 0)
    items = [item for item in spec_workload(stop_case)
             if item[0] in ("g0", "late", "long", "hit")]
    for _, _, params, _ in items:
        assert params.temperature == 0
    llm = make(tiny[0], 4, 64, 0, "cpp", spec(5, adaptive=False), max_num_seqs=1)
    proposer = llm.engine.scheduler.proposer = Scripted(sequences(want), 97, wrong=0.3, seed=4)
    got, stats, _ = serve(llm, [(r, p, s, 0) for r, p, s, _ in items])
    for request_id, *_ in items:
        assert got[request_id].outputs[0].token_ids == want[request_id].outputs[0].token_ids
    s = stats["spec_decode"]
    assert s["num_drafts"] == len(proposer.proposals)
    assert s["num_draft_tokens"] == sum(d for d, _ in proposer.proposals)
    assert s["num_accepted_tokens"] == sum(r for _, r in proposer.proposals)
    per_pos = [sum(1 for _, r in proposer.proposals if r > pos) for pos in range(5)]
    assert s["accepted_per_pos"] == per_pos[:len(s["accepted_per_pos"])]
    assert s["mean_acceptance_length"] == pytest.approx(
        1 + s["num_accepted_tokens"] / s["num_drafts"])


@pytest.mark.parametrize("k", range(1, 9))
def test_ngram_speculation_is_greedy_decoding_for_every_k(tiny, k):  # noqa: F811
    """The n-gram proposer itself on prompts that repeat (the tiny model's greedy text
    repeats too), k from 1 to 8, preempting: HF transformers' tokens."""
    path, model = tiny
    prompts = [[5, 6, 7, 8] * 4, list(range(20, 30)) * 2, [40, 41, 40, 41, 42] * 3]
    llm = LLM(path, block_size=4, num_blocks=20, max_num_batched_tokens=32, max_num_seqs=4,
              debug_nan_pool=True, speculative_config=spec(k, adaptive=False))
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, **GREEDY), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 40)
    stats = llm.stats()
    assert stats["spec_decode"]["num_accepted_tokens"] > 0, stats["spec_decode"]


def naive_ngram(tokens, k, low, high):
    """The n-gram proposal by its definition, in loops: the longest n in [low, high] whose
    last n tokens occur earlier; of its occurrences, the latest; the k tokens after it."""
    n_tokens = len(tokens)
    for n in range(high, low - 1, -1):
        if n >= n_tokens:
            continue
        suffix = tokens[n_tokens - n:]
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_proposer_is_its_definition():
    rng = random.Random(0)
    proposer = NgramProposer(2, 5)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        k = rng.randint(1, 8)
        want = naive_ngram(tokens, k, 2, 5)
        assert proposer.propose(tokens, k) == want, (tokens, k)
        assert proposer.propose(np.asarray(tokens, np.int64), k) == want
    # hand-worked: the 3-gram [1, 2, 3] beats the later 2-gram [2, 3]
    assert proposer.propose([1, 2, 3, 9, 7, 2, 3, 5, 1, 2, 3], 3) == [9, 7, 2]
    assert NgramProposer(1, 1).propose([4, 8, 4], 2) == [8, 4]


@pytest.mark.parametrize("bad,field", [
    ({"method": "eagle"}, "speculative_config.method"),
    (spec(0), "speculative_config.num_speculative_tokens"),
    (spec(17), "speculative_config.num_speculative_tokens"),
    (spec(3, prompt_lookup_min=0), "speculative_config.prompt_lookup_min"),
    (spec(3, prompt_lookup_min=4, prompt_lookup_max=3), "speculative_config.prompt_lookup_max"),
    ({"method": "ngram", "k": 3}, "speculative_config"),
    ({"num_speculative_tokens": 3}, "speculative_config"),
    ("ngram", "speculative_config"),
])
def test_a_bad_speculative_config_is_refused_naming_its_field(bad, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        EngineConfig(speculative_config=bad)


def test_the_flag_takes_vllms_json():
    import argparse

    from jaxpage.engine_args import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 5}'])
    assert engine_config(args).speculative_config == SpeculativeConfig(num_speculative_tokens=5)


def test_eos_inside_an_accepted_run_ends_the_request_there(hf_model_dir, stop_case):  # noqa: F811
    """A model whose EOS is its 7th greedy token, drafts always right (the whole run is
    accepted): the request ends on that EOS, as without speculation."""
    prompt, greedy, _ = stop_case
    eos = greedy[6]
    path, _ = hf_model_dir("llama", eos_token_id=eos)
    outs = {}
    for speculative in (None, spec(8, adaptive=False)):
        llm = LLM(path, block_size=4, num_blocks=64, speculative_config=speculative)
        if speculative:
            llm.engine.scheduler.proposer = Scripted([prompt + greedy], 97, wrong=0.0)
        outs[speculative is None] = llm.generate(
            [prompt], SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0]
    with_spec, without = outs[False].outputs[0], outs[True].outputs[0]
    assert with_spec.token_ids == without.token_ids == greedy[:greedy.index(eos) + 1]
    assert with_spec.finish_reason == "stop"
    assert llm.stats()["spec_decode"]["num_accepted_tokens"] >= greedy.index(eos)


# ------------------------------------------------------------- the sampled distribution

VOCAB = 8  # a tiny vocabulary, so the first two tokens' joint distribution has 64 cells


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    model = build_hf_model("llama", 3, vocab_size=VOCAB, bos_token_id=0, eos_token_id=1)
    path = tmp_path_factory.mktemp("llama_vocab8")
    model.save_pretrained(path, safe_serialization=True)
    return str(path), model


def exact_joint(model, prompt, temperature, top_p) -> np.ndarray:
    """P(first two tokens) [VOCAB, VOCAB] in float64 from HF transformers' logits, with
    temperature and top-p applied as the sampler applies them."""
    def dist(tokens):
        logits = hf_logits(model, tokens)[-1].astype(np.float64) / temperature
        p = np.exp(logits - logits.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        keep = np.zeros(VOCAB, bool)
        keep[order[before < top_p]] = True
        p = np.where(keep, p, 0.0)
        return p / p.sum()

    first = dist(prompt)
    return np.stack([first[a] * dist(prompt + [a]) for a in range(VOCAB)])


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (1.0, 0.8)])
def test_sampled_tokens_follow_the_targets_distribution(small_vocab, temperature, top_p):
    """4,000 seeded requests of 3 tokens with a proposer whose drafts are a fixed guess, far
    from the model's distribution (most are rejected): the first two tokens' empirical joint
    distribution against the exact one, by a chi-square test (cells with expected count
    under 5 pooled) whose false alarm rate is 1e-4; and each request's tokens are those it
    draws without speculation."""
    from scipy import stats as scipy_stats

    path, model = small_vocab
    prompt = [3, 5, 2, 7, 4]
    draws = 4000
    params = [SamplingParams(max_tokens=3, temperature=temperature, top_p=top_p, seed=i,
                             ignore_eos=True) for i in range(draws)]

    class Guess:  # always proposes [6, 6]: q one-hot, far from p
        def propose(self, token_ids, k):
            return [6, 6][:k]

    runs = {}
    for speculative in (spec(2, adaptive=False), None):
        llm = LLM(path, block_size=4, num_blocks=2048, max_num_seqs=256,
                  max_num_batched_tokens=1024, speculative_config=speculative)
        if speculative:
            llm.engine.scheduler.proposer = Guess()
        runs[speculative is None] = [o.outputs[0].token_ids for o in llm.generate(
            [prompt] * draws, params, use_tqdm=False)]
        if speculative:
            s = llm.stats()["spec_decode"]
            assert s["num_drafts"] >= draws and 0.05 < s["acceptance_rate"] < 0.8, s
    assert runs[False] == runs[True]
    counts = np.zeros((VOCAB, VOCAB))
    for tokens in runs[False]:
        counts[tokens[0], tokens[1]] += 1
    expected = exact_joint(model, prompt, temperature, top_p).ravel() * draws
    observed = counts.ravel()
    assert observed[expected == 0].sum() == 0  # top-p's removed tokens never drawn
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:  # the pooled small cells: folded into the last big one
        obs, exp = np.append(obs[:-2], obs[-2:].sum()), np.append(exp[:-2], exp[-2:].sum())
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    p_value = scipy_stats.chi2.sf(chi2, len(obs) - 1)
    assert p_value > 1e-4, (chi2, len(obs), p_value)
    assert not math.isnan(chi2)


# ------------------------------------------------------------- faults

def spec_fault_llm(path, clean):
    llm = make_llm(path, speculative_config=spec(4, adaptive=False))
    llm.engine.scheduler.proposer = Scripted(sequences(clean), 97, wrong=0.3, seed=2)
    return llm


def verify_step(seqs) -> bool:
    return any(s.verify for s in seqs)


@pytest.fixture(scope="module")
def fault_clean(hf_model_dir):
    path, _ = hf_model_dir("llama")
    final, raised = run(make_llm(path))
    assert raised == 0
    return path, final


@pytest.mark.parametrize("stage", ["propose", "verify", "verify_sampler", "verify_pool_lost"])
def test_a_fault_in_a_speculative_step_leaves_the_others_untouched(fault_clean, stage,
                                                                   monkeypatch):
    """test_fault_injection's workload with speculation: the proposer failing for one
    request ends that request alone; the device call of a step with drafts failing (before
    it starts, in the sampler after the forward wrote the drafts' K/V, or losing the pool)
    raises once and every request then gets its clean tokens."""
    path, clean = fault_clean
    llm = spec_fault_llm(path, clean)
    engine = llm.engine

    def install(engine):
        if stage == "propose":
            proposer = engine.scheduler.proposer
            proposer.propose = Once(proposer.propose,
                                    lambda tokens, k: tokens[:3] == [62, 63, 64])  # g1
            return proposer.propose
        if stage == "verify":
            engine.runner.execute = Once(engine.runner.execute, verify_step)
            return engine.runner.execute
        if stage == "verify_sampler":
            once = Once(runner_module._SAMPLE, lambda logits, md: logits.shape[0] > 8)
            monkeypatch.setattr(runner_module, "_SAMPLE", once)
            return once

        def lose_pool(seqs):
            for leaf in jax.tree.leaves(engine.runner.kv_pool):
                leaf.delete()
            raise RuntimeError("injected failure: pool lost")
        engine.runner.execute = Once(engine.runner.execute, verify_step, lose_pool)
        return engine.runner.execute

    fault = fault_at(4, install)
    final, raised = run(llm, fault)
    assert fault.armed and fault.armed[0].fired, f"the {stage} fault never fired"
    ended = {"g1"} if stage == "propose" else set()
    assert raised == (0 if ended else 1)
    assert engine.stats()["spec_decode"]["num_accepted_tokens"] > 0
    assert set(final) == {item[0] for item in fault_workload()}
    for request_id, out in final.items():
        if request_id in ended:
            assert out.error is not None and "injected" in out.error
        else:
            assert out.error is None, (request_id, out.error)
            assert [c.token_ids for c in out.outputs] == [
                c.token_ids for c in clean[request_id].outputs], request_id


# ------------------------------------------------------------- sliding windows, stop strings

@pytest.mark.parametrize("name,proposer", [
    ("mistral", "scripted"), ("mistral", "draft"),
    pytest.param("gemma2", "scripted", marks=pytest.mark.slow)])
def test_sliding_window_models_speculate_past_the_window(hf_model_dir, name, proposer):
    """test_window_group's chunked, preempting case with drafts: the window group's blocks
    taken for rejected drafts go back too (no window block leaked), and the tokens are HF
    transformers' far past the 16-token window. The drafts are a scripted proposer's, or
    the model's own as a draft model of its own: its pool pages every layer in full (by the
    full group's table) and its windowed layers read their window from it, so each greedy
    draft is the target's next token, accepted, when that is right."""
    from jaxpage.engine.kv_groups import window_blocks_per_seq

    path, model = hf_model_dir(name, **({"sliding_window": 16} if name == "mistral" else {}))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 97, size=n).tolist() for n in (5, 16, 17, 40, 61, 90)]
    expected = [hf_greedy(model, p, 20) for p in prompts]
    llm = LLM(path, block_size=4, max_num_batched_tokens=12, max_num_seqs=6,
              num_window_blocks=2 * window_blocks_per_seq(16, 4, 12, 512) + 1,
              debug_nan_pool=True, speculative_config=spec(4, adaptive=False)
              if proposer == "scripted" else draft_model(path, 4, adaptive=False))
    if proposer == "scripted":
        llm.engine.scheduler.proposer = Scripted(
            [p + e for p, e in zip(prompts, expected, strict=True)], 97, wrong=0.3, seed=1)
    outs = llm.generate(prompts * 2, SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected * 2
    llm.engine.allocator.check_invariants()
    stats = llm.stats()
    assert stats["kv_window_blocks_used"] == stats["kv_blocks_used"] == 0
    s = stats["spec_decode"]
    if proposer == "scripted":
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
        assert s["num_accepted_tokens"] > 20
    else:
        assert s["num_accepted_tokens"] == s["num_draft_tokens"] > 100, s


def test_stop_strings_inside_an_accepted_run(tmp_path):
    """A byte-level BPE model, drafts always right (a step emits up to 7 tokens): each stop
    string, wherever it ends inside an accepted run, ends the request on the token it ends
    in, with the text cut before it, as without speculation; min_tokens defers it alike."""
    from conftest import byte_level_bpe_tokenizer

    tokenizer = byte_level_bpe_tokenizer()
    model = build_hf_model("llama", 0, vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path, safe_serialization=True)
    engine = dict(tokenizer=tokenizer, block_size=4, num_blocks=64)
    plain_llm = LLM(str(tmp_path), **engine)
    spec_llm = LLM(str(tmp_path), speculative_config=spec(6, adaptive=False), **engine)
    prompt = "Plain English text about the"
    base = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    first = plain_llm.generate([prompt], base, use_tqdm=False)[0]
    spec_llm.engine.scheduler.proposer = Scripted(
        [list(first.prompt_token_ids) + list(first.outputs[0].token_ids)], len(tokenizer),
        wrong=0.0)
    text = first.outputs[0].text
    stops = sorted({text[i : i + 3] for i in range(2, len(text) - 3, 2)} - {""})[:12]
    assert len(stops) >= 6, text
    cases = [dict(stop=[s]) for s in stops] + [dict(stop=[s], min_tokens=8) for s in stops]
    for case in cases:
        params = dataclasses.replace(base, **case)
        (want,) = plain_llm.generate([prompt], params, use_tqdm=False)
        (got,) = spec_llm.generate([prompt], params, use_tqdm=False)
        a, b = got.outputs[0], want.outputs[0]
        assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (
            b.text, b.token_ids, b.finish_reason, b.stop_reason), case
    assert spec_llm.stats()["spec_decode"]["mean_acceptance_length"] > 3


def test_metrics_under_vllms_names(tiny, stop_case, plain):  # noqa: F811
    """The server's /metrics collector over an engine that speculated: vLLM's spec_decode
    counters equal llm.stats(), per position too."""
    from prometheus_client.parser import text_string_to_metric_families

    from jaxpage.serve.metrics import ServerMetrics

    want = plain(4, 64, 0)
    llm = make(tiny[0], 4, 64, 0, "cpp", spec(4, adaptive=False))
    llm.engine.scheduler.proposer = Scripted(sequences(want), 97, wrong=0.3)
    serve(llm, spec_workload(stop_case))
    values = {}
    for family in text_string_to_metric_families(
            ServerMetrics("tiny", llm.stats).render().decode()):
        for sample in family.samples:
            values[sample.name, sample.labels.get("position")] = sample.value
    s = llm.stats()["spec_decode"]
    assert values["vllm:spec_decode_num_drafts_total", None] == s["num_drafts"] > 0
    assert values["vllm:spec_decode_num_draft_tokens_total", None] == s["num_draft_tokens"]
    assert (values["vllm:spec_decode_num_accepted_tokens_total", None]
            == s["num_accepted_tokens"])
    assert [values["vllm:spec_decode_num_accepted_tokens_per_pos_total", str(pos)]
            for pos in range(4)] == s["accepted_per_pos"]
    plain_metrics = ServerMetrics("tiny", make(tiny[0], 4, 64, 0, "cpp", None).stats)
    assert b"spec_decode" not in plain_metrics.render()


# ------------------------------------------------------------- the adaptive policy

def test_drafts_worth_and_their_expected_gain_hand_worked():
    from jaxpage.engine.speculative import drafts_worth, expected_gain

    # 0.5 and 0.25 beat 0.2; 0.125 does not
    assert drafts_worth(0.5, 0.2, 8) == 2
    assert drafts_worth(0.5, 0.2, 1) == 1
    assert drafts_worth(1.0, 0.9, 5) == 5
    assert drafts_worth(0.2, 0.2, 5) == 0
    # (0.5 * 10 - 1) + (0.25 * 10 - 1)
    assert expected_gain(0.5, 2, 10.0, 1.0) == pytest.approx(5.5)
    assert expected_gain(0.1, 1, 10.0, 1.0) == pytest.approx(0.0)


def test_step_cost_fits_what_steps_cost():
    """Steps of a + b * tokens + c (with drafts), with noise: the fit finds a, b, c, and
    the terms at a batch of 4 follow from them."""
    from jaxpage.engine.speculative import StepCost

    cost = StepCost()
    assert cost.coefficients == (1.0, 1 / 16, 1 / 8)  # the prior until it has seen enough
    rng = np.random.default_rng(0)
    a, b, c = 0.012, 0.0015, 0.003
    for _ in range(64):
        tokens = int(rng.integers(1, 40))
        drafts = bool(rng.integers(0, 2))
        cost.observe(tokens, drafts, a + b * tokens + c * drafts + rng.normal(0, 1e-5))
    fitted = cost.coefficients
    assert fitted == pytest.approx((a, b, c), rel=0.02, abs=2e-5)
    saving, draft_cost, switch = cost.terms(4)
    assert (saving, draft_cost, switch) == pytest.approx((fitted[0] / 4 + fitted[1],
                                                          fitted[1], fitted[2]))
    assert cost.threshold(4) == pytest.approx(fitted[1] / (fitted[0] / 4 + fitted[1]))


def test_a_request_rests_when_its_drafts_stop_paying():
    from jaxpage.engine.speculative import Acceptance

    rest = Acceptance.rest_steps
    acceptance = Acceptance()
    assert acceptance.rate(0.5) == 0.5
    acceptance.observe(4, 2, saving=10.0, switch=2.0, step=1)  # 2 of 3 trials:
    assert acceptance.rate(0.5) == pytest.approx(0.625)         # (2 + 0.5) / (3 + 1)
    # steps that find nothing: the yield 1.0 decays by 0.75 from its 2-draft step's
    # 0.75 + 0.5 = 1.25; rests once yield * 10 < 2, at step 8, until step 2 * 16
    yields, step = [], 1
    while not acceptance.waits(step + 1):
        step += 1
        acceptance.observe(0, 0, saving=10.0, switch=2.0, step=step)
        yields.append(acceptance.yield_)
    assert len(yields) == 7 and step == 8 and acceptance.resume == 2 * rest
    assert [acceptance.length(4, 0.1, 0.5, s) for s in range(9, 2 * rest + 1)] == (
        [0] * (2 * rest - 9) + [4])
    # a rate (here the prior 0.5) under the threshold: a rest from the first step, then
    # one draft to try again, then a rest to the step after next that is a multiple of 16;
    # a request that started resting a few steps later tries again at the same step
    fresh, other = Acceptance(), Acceptance()
    assert other.length(4, 0.6, 0.5, 14) == 0 and other.resume == 2 * rest
    lengths = [fresh.length(4, 0.6, 0.5, s) for s in range(3, 3 * rest + 1)]
    assert lengths == [0] * (2 * rest - 3) + [1] + [0] * rest
    assert fresh.resume == 4 * rest and fresh.waits(4 * rest - 1) and not fresh.waits(4 * rest)


@pytest.mark.parametrize("wrong", [0.0, 0.9])
def test_adaptive_speculation_changes_no_request(tiny, stop_case, plain, wrong):  # noqa: F811
    """The default, adaptive policy over the workload: drafts that are always right keep
    being proposed; drafts mostly wrong soon stop (requests rest); the tokens are the same."""
    want = plain(4, 64, 0)
    llm = make(tiny[0], 4, 64, 0, "cpp", spec(4))
    engine = llm.engine
    engine.scheduler.proposer = Scripted(sequences(want), 97, wrong=wrong, seed=5)
    rested = set()

    def watch(step):
        rested.update(r.seq_id for r in engine.scheduler.running
                      if r.acceptance is not None
                      and r.acceptance.waits(engine.scheduler.num_steps))

    got, stats, raised = serve(llm, spec_workload(stop_case), before_step=watch)
    assert raised == 0
    assert_same(got, want)
    s = stats["spec_decode"]
    if wrong:
        assert rested and s["acceptance_rate"] < 0.3, (rested, s)
    else:
        assert s["mean_acceptance_length"] > 2.5 and s["num_drafts"] > 20, s


# ------------------------------------------------------------- a draft model: the target cut

def self_draft(layers: int, k: int = 4, **kwargs) -> dict:
    return {"method": "draft_model", "model": "self", "draft_layers": layers,
            "num_speculative_tokens": k, **kwargs}


def test_a_draft_of_every_layer_is_the_target_so_every_draft_is_accepted(tiny):  # noqa: F811
    """The tiny Llama has 2 layers: a draft of both is the target itself, so its greedy
    drafts are the target's next tokens and every one is accepted (k + 1 tokens a step
    but where max_tokens cuts the drafts short), through preemption: HF's tokens."""
    path, model = tiny
    prompts = [list(range(3, 10)), list(range(20, 31)), list(range(40, 52))]
    llm = LLM(path, block_size=4, num_blocks=20, max_num_batched_tokens=32, max_num_seqs=4,
              debug_nan_pool=True, speculative_config=self_draft(2, 4, adaptive=False))
    outs = llm.generate(prompts, SamplingParams(max_tokens=31, **GREEDY), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 31)
    stats = llm.stats()
    s = stats["spec_decode"]
    assert s["num_accepted_tokens"] == s["num_draft_tokens"] >= 40, s
    assert s["mean_acceptance_length"] > 4, s
    assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_one_layer_draft_changes_no_request(tiny, stop_case, plain, adaptive):  # noqa: F811
    """Drafts by the first of the 2 layers, some accepted and some not, through the
    workload (seeded and greedy, n > 1 forks, stop tokens, preemption, NaN pool; requests
    with penalties do not draft: their rows need the drafts' tokens)."""
    want = plain(4, 24, 0)
    llm = make(tiny[0], 4, 24, 0, "cpp", self_draft(1, 3, adaptive=adaptive))
    got, stats, raised = serve(llm, spec_workload(stop_case),
                               before_step=committed_as_tokens(llm.engine))
    assert raised == 0
    assert_same(got, want)
    s = stats["spec_decode"]
    if not adaptive:
        assert 0 < s["num_accepted_tokens"] < s["num_draft_tokens"], s
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("bad,field", [
    ({"method": "draft_model", "model": "other/model", "draft_layers": 1},
     "speculative_config.draft_layers"),
    ({"method": "draft_model"}, "speculative_config.model"),
    ({"method": "draft_model", "model": ""}, "speculative_config.model"),
    ({"method": "draft_model", "model": "self", "draft_layers": 0},
     "speculative_config.draft_layers"),
    ({"method": "ngram", "draft_layers": 2}, "speculative_config.draft_layers"),
])
def test_a_bad_draft_model_config_is_refused_naming_its_field(bad, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        EngineConfig(speculative_config=bad)


def test_a_draft_of_more_layers_than_the_model_is_refused(tiny):  # noqa: F811
    with pytest.raises(ValueError, match="draft_layers must be <= the model's 2 layers, got 3"):
        LLM(tiny[0], num_blocks=16, speculative_config=self_draft(3))


@pytest.mark.parametrize("draft,stage,lose_pool", [
    ("self", "propose", False), ("self", "propose", True),
    ("first-layer", "propose", False), ("first-layer", "keep", True),
    pytest.param("first-layer", "propose", True, marks=pytest.mark.slow),
    pytest.param("first-layer", "keep", False, marks=pytest.mark.slow)])
def test_a_fault_in_a_draft_step_leaves_every_request_untouched(fault_clean, drafts, draft,
                                                                stage, lose_pool):
    """The draft model's device step fails (after freeing the donated pool, or not): one
    of its proposing steps, or (a draft of its own) the forward that keeps its pool in
    step. The step raises once with the engine as it was, and every request gets its clean
    tokens."""
    path, clean = fault_clean
    llm = make_llm(path, speculative_config=self_draft(1, 3, adaptive=False) if draft == "self"
                   else draft_model(drafts[draft], 3, adaptive=False))
    runner = llm.engine.runner
    name = "draft1" if draft == "self" else "draft"

    def install(engine):
        def fail(seqs, is_decode, token_ids=None):
            if lose_pool:
                for leaf in jax.tree.leaves(runner.kv_pool):
                    leaf.delete()
            raise RuntimeError("injected failure in a draft step")

        def when(seqs, is_decode, token_ids=None):  # a proposing step draws, the other not
            return runner._forward_name == name and bool(seqs[0].sampling) == (
                stage == "propose")
        runner._dispatch = Once(runner._dispatch, when, fail)
        return runner._dispatch

    fault = fault_at(4, install)
    final, raised = run(llm, fault)
    assert fault.armed and fault.armed[0].fired and raised == 1
    assert llm.stats()["spec_decode"]["num_drafts"] > 0
    for request_id, out in final.items():
        assert out.error is None, (request_id, out.error)
        assert [c.token_ids for c in out.outputs] == [
            c.token_ids for c in clean[request_id].outputs], request_id


# ------------------------------------------------------------- a draft model of its own

def draft_model(path: str, k: int = 4, **kwargs) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k, **kwargs}


@pytest.fixture(scope="module")
def drafts(tiny, hf_model_dir, tmp_path_factory):  # noqa: F811
    """Draft checkpoints for the tiny Llama (6 query heads over 2 KV heads, 2 layers),
    by name -> path:
    "twin": the target's function with each KV head repeated for its 3 query heads (6 KV
    heads: a pool of another shape), so each greedy draft is the target's next token when
    its own K/V is right; "first-layer": the target's first layer alone (some drafts
    right, some not); "qwen2": a random Qwen2 of the same vocabulary (head_dim 16)."""
    import transformers

    _, target = tiny
    state, config = target.state_dict(), target.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    paths = {}

    def save(name, config, weights):
        model = transformers.LlamaForCausalLM(config).eval()
        model.load_state_dict(weights)
        path = tmp_path_factory.mktemp(f"draft_{name}")
        model.save_pretrained(path, safe_serialization=True)
        paths[name] = str(path)

    wide = transformers.LlamaConfig(**{**config.to_dict(), "num_key_value_heads": heads})
    save("twin", wide, {
        name: (w.reshape(kv_heads, dim, -1).repeat_interleave(heads // kv_heads, dim=0)
               .reshape(heads * dim, -1) if name.endswith(("k_proj.weight", "v_proj.weight"))
               else w) for name, w in state.items()})
    short = transformers.LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})
    save("first-layer", short, {name: w for name, w in state.items()
                                if ".layers.1." not in name})
    paths["qwen2"] = hf_model_dir("qwen2", 5)[0]
    return paths


TWIN_POOLS = {"preempting": (4, 24, 0, {}), "swapping": (4, 24, 256, {}),
              "host-prefix-cache": (4, 24, 256, {"enable_host_prefix_cache": True}),
              "blocks-of-16": (16, 24, 0, {})}


@pytest.mark.parametrize("backend,pool", [
    *(("cpp", pool) for pool in ("preempting", "swapping", "host-prefix-cache")),
    pytest.param("cpp", "blocks-of-16", marks=pytest.mark.slow),
    # the GPU kernel interpreted (the TPU kernel's, 5 minutes interpreted, verifies drafts
    # in test_speculation_changes_no_request)
    *(pytest.param(p.values[0], "preempting", marks=p.marks) for p in PALLAS
      if p.values[0] == "pallas_gpu")])
def test_a_draft_computing_the_target_has_every_draft_accepted(tiny, stop_case, plain,  # noqa: F811
                                                              drafts, backend, pool):
    """The "twin" draft proposes the target's own greedy tokens if, and only if, its own
    pool holds its K/V of every token before the drafts (a NaN-filled pool: a block it
    missed is NaN): through chunked prefill, prefix hits, n = 2 forks, a beam's forks,
    preemption by recompute and by swap, and the host prefix cache, every draft of every
    greedy request is accepted, and every request gets the tokens it gets without
    speculation (HF's greedy ones)."""
    path, model = tiny
    block_size, num_blocks, swap, overrides = TWIN_POOLS[pool]
    # not "abort" (drafts all accepted, it reaches max_tokens before the step that aborts
    # it) nor "min" (min_tokens bans its stop token from the target's draws, not the draft's)
    greedy = ("g0", "stop", "late", "pen", "beam", "long", "hit")
    items = [item for item in spec_workload(stop_case) if item[0] in greedy] + [
        ("n2", list(range(60, 66)), SamplingParams(n=2, max_tokens=14, temperature=0.0), 40),
        ("hit2", list(range(3, 70)), SamplingParams(max_tokens=12, **GREEDY), 30)]
    llm = make(path, block_size, num_blocks, swap, backend,
               draft_model(drafts["twin"], 4, adaptive=False), **overrides)
    assert llm.engine.runner.draft_pool is not None
    got, stats, raised = serve(llm, items, before_step=committed_as_tokens(llm.engine))
    assert raised == 0
    want = plain(block_size, num_blocks, 0, backend)
    assert_same({r: got[r] for r in greedy}, {r: want[r] for r in greedy})
    for request_id, prompt, params, _ in items:
        if request_id in ("g0", "late", "long", "n2", "hit2"):
            for c in got[request_id].outputs:
                assert c.token_ids == hf_greedy(model, prompt, params.max_tokens), request_id
    s = stats["spec_decode"]
    assert s["num_accepted_tokens"] == s["num_draft_tokens"] >= 100, s
    if num_blocks * block_size < 100:
        assert stats["num_preemptions"] > 0
    if swap:
        assert stats["num_swapped_preemptions"] > 0
    if overrides:
        assert stats["prefix_cache_host_hits"] > 0, stats


@pytest.mark.parametrize("name,adaptive", [
    ("first-layer", False), pytest.param("first-layer", True, marks=pytest.mark.slow),
    pytest.param("qwen2", False, marks=pytest.mark.slow)])
def test_a_draft_model_changes_no_request(tiny, stop_case, plain, drafts, name,  # noqa: F811
                                          adaptive):
    """Drafts by a model of their own, some right and some not (the target's first layer)
    or seldom right (a random Qwen2 of other shapes), through the workload: every request
    as without speculation, the committed K/V checked every step."""
    want = plain(4, 24, 0)
    llm = make(tiny[0], 4, 24, 0, "cpp", draft_model(drafts[name], 3, adaptive=adaptive))
    got, stats, raised = serve(llm, spec_workload(stop_case),
                               before_step=committed_as_tokens(llm.engine))
    assert raised == 0
    assert_same(got, want)
    s = stats["spec_decode"]
    assert s["num_draft_tokens"] > 0
    if name == "first-layer" and not adaptive:
        assert 0 < s["num_accepted_tokens"] < s["num_draft_tokens"], s
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("k", [k if k in (1, 4, 8) else pytest.param(k, marks=pytest.mark.slow)
                               for k in range(1, 9)])
def test_a_draft_model_is_greedy_decoding_for_every_k(tiny, drafts, k):  # noqa: F811
    """The first-layer draft, k from 1 to 8, preempting, on a NaN pool: HF transformers'
    tokens, some drafts accepted and some not."""
    path, model = tiny
    prompts = [list(range(3, 10)), list(range(20, 41)), list(range(40, 46))]
    llm = LLM(path, block_size=4, num_blocks=20, max_num_batched_tokens=32, max_num_seqs=4,
              debug_nan_pool=True,
              speculative_config=draft_model(drafts["first-layer"], k, adaptive=False))
    outs = llm.generate(prompts, SamplingParams(max_tokens=30, **GREEDY), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 30)
    stats = llm.stats()
    s = stats["spec_decode"]
    assert 0 < s["num_accepted_tokens"] < s["num_draft_tokens"], s
    assert stats["num_preemptions"] > 0


def test_a_draft_model_must_share_the_vocabulary_and_fit(tiny, hf_model_dir, drafts):  # noqa: F811
    """Refused when the engine is built, naming speculative_config.model: another vocabulary
    size, a path that holds no model, and K/V that leaves the pool less than 2 blocks (the
    target alone has 3 in the same budget)."""
    path = tiny[0]
    cases = [(hf_model_dir("llama", 0, vocab_size=98)[0],
              "has a vocabulary of 98 tokens, the target 97"),
             (str(tiny[0]) + "-missing", "could not be loaded")]
    for draft, message in cases:
        with pytest.raises(ValueError, match=f"^speculative_config.model '.*' {message}"):
            LLM(path, num_blocks=16, speculative_config=draft_model(draft))
    block = llm_block_bytes(path, 4)
    assert LLM(path, block_size=4, kv_cache_memory=3 * block).engine.runner.num_blocks == 3
    with pytest.raises(ValueError, match=r"^speculative_config.model '.*': its K/V \(3072 "
                                         r"bytes a block beside the target's 1024\) does not "
                                         r"fit the KV budget"):
        LLM(path, block_size=4, kv_cache_memory=3 * block,
            speculative_config=draft_model(drafts["twin"]))


def test_a_draft_model_must_share_the_tokenizer(tmp_path):
    """Two byte-level BPEs of 400 tokens trained on different text: the same vocabulary
    size, another token -> id map; refused, naming the field."""
    from conftest import CORPUS, byte_level_bpe_tokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    ours = byte_level_bpe_tokenizer()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([text[::-1] for text in CORPUS], trainers.BpeTrainer(
        vocab_size=len(ours), special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    theirs = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    assert len(theirs) == len(ours) and theirs.get_vocab() != ours.get_vocab()
    for name, tokenizer in (("target", ours), ("draft", theirs)):
        build_hf_model("llama", 0, vocab_size=len(ours)).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    with pytest.raises(ValueError, match="^speculative_config.model '.*' has a tokenizer other "
                                         "than the target's"):
        LLM(str(tmp_path / "target"), num_blocks=16,
            speculative_config=draft_model(str(tmp_path / "draft")))
    # the same tokenizer: accepted
    LLM(str(tmp_path / "target"), num_blocks=16,
        speculative_config=draft_model(str(tmp_path / "target")))
