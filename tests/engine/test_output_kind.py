"""`SamplingParams.output_kind` (vLLM's RequestOutputKind) through the engine's step.

DELTA streams each step's new tokens and text, CUMULATIVE the state so far, FINAL_ONLY one
output at the end, before which the engine builds no outputs and (without stop strings)
detokenizes nothing. The same requests (greedy with log-probs, seeded n = 3 samples, a stop
string) run once per kind on one engine: each kind's last word must equal the DELTA stream
merged, and the text of a request that ran to its length must equal the tokenizer's own
decode of prompt + output less the prompt's (a byte-level BPE whose tokens split multi-byte
characters, a tiny random model of its vocabulary).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from conftest import CORPUS, byte_bpe_llm

from jaxpage import RequestOutputKind, SamplingParams
from jaxpage.llm import merge_delta

_WORDS = sorted({word for line in CORPUS for word in line.split()})
PROMPTS = [" ".join(random.Random(seed).sample(_WORDS, 3)) for seed in range(3)]
KINDS = tuple(RequestOutputKind)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return byte_bpe_llm(tmp_path_factory.mktemp("llama_output_kind"), block_size=4, num_blocks=256,
                        max_num_batched_tokens=64, max_num_seqs=8)


def run(llm, requests: dict[str, tuple[str, SamplingParams]], kind: RequestOutputKind,
        abort: dict[str, int] | None = None) -> dict[str, list]:
    """Every output step() returned for each request, run with `kind`; `abort`: a request
    aborted after that many steps."""
    engine = llm.engine
    for request_id, (prompt, params) in requests.items():
        engine.add_request(f"{kind.name}-{request_id}", prompt,
                           dataclasses.replace(params, output_kind=kind))
    outputs: dict[str, list] = {request_id: [] for request_id in requests}
    steps = 0
    while engine.has_unfinished_requests():
        for request_id, after in (abort or {}).items():
            if steps == after:
                engine.abort_request(f"{kind.name}-{request_id}")
        for out in engine.step():
            outputs[out.request_id.split("-", 1)[1]].append(out)
        steps += 1
    return outputs


def merged(outs: list) -> list:
    completions: dict = {}
    for out in outs:
        final = merge_delta(completions, out)
    return final


def fields(completion) -> tuple:
    return (completion.index, completion.text, list(completion.token_ids),
            completion.cumulative_logprob, completion.logprobs, completion.finish_reason,
            completion.stop_reason)


def decoded(tokenizer, prompt_ids: list[int], output_ids: list[int]) -> str:
    prompt = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    whole = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=True)
    assert whole.startswith(prompt)
    return whole[len(prompt):]


@pytest.fixture(scope="module")
def requests(llm):
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    # a stop string out of the middle of the greedy run's text, which must end it there
    first = llm.generate([PROMPTS[2]], greedy, use_tqdm=False)[0].outputs[0].text
    stop = first[6:9]
    assert len(stop) == 3 and "\ufffd" not in stop, first
    samples = SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    # a stop token one sample draws early and another never: the samples end apart, the
    # first one's text (FINAL_ONLY: not made yet) wanted only at the request's end
    drawn = [list(c.token_ids)
             for c in llm.generate([PROMPTS[1]], samples, use_tqdm=False)[0].outputs]
    token = next(ids[k] for k in range(2, 10) for ids in drawn
                 if any(ids[k] not in other for other in drawn))
    return {
        "greedy": (PROMPTS[0], greedy),
        "samples": (PROMPTS[1], samples),
        "stop": (PROMPTS[2], dataclasses.replace(greedy, stop=(stop,))),
        "uneven": (PROMPTS[1], dataclasses.replace(samples, stop_token_ids=(token,))),
    }


@pytest.fixture(scope="module")
def runs(llm, requests):
    return {kind: run(llm, requests, kind) for kind in KINDS}


def test_every_kind_ends_with_the_delta_stream_merged(runs, requests):
    delta = runs[RequestOutputKind.DELTA]
    assert merged(delta["stop"])[0].finish_reason == "stop"
    uneven = merged(delta["uneven"])
    assert len({len(c.token_ids) for c in uneven}) > 1
    assert "stop" in {c.finish_reason for c in uneven}
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        for request_id in requests:
            want = [fields(c) for c in merged(delta[request_id])]
            last = runs[kind][request_id][-1]
            assert last.finished
            assert [fields(c) for c in last.outputs] == want, (kind, request_id)
            assert len(last.outputs) == requests[request_id][1].n


def test_final_only_returns_one_output_and_nothing_before(runs, requests):
    for request_id in requests:
        outs = runs[RequestOutputKind.FINAL_ONLY][request_id]
        assert len(outs) == 1 and outs[0].finished
        # the delta stream had several steps to show
        assert len(runs[RequestOutputKind.DELTA][request_id]) > 5


def test_cumulative_outputs_grow_from_the_start(runs, requests):
    for request_id in requests:
        outs = runs[RequestOutputKind.CUMULATIVE][request_id]
        assert len(outs) > 5 and not any(o.finished for o in outs[:-1])
        final = {c.index: c for c in outs[-1].outputs}
        for out in outs:
            for c in out.outputs:
                whole = final[c.index]
                assert whole.token_ids[: len(c.token_ids)] == c.token_ids
                assert whole.text.startswith(c.text)
        lengths = [sum(len(c.token_ids) for c in out.outputs) for out in outs]
        assert lengths == sorted(lengths) and lengths[0] < lengths[-1]


def test_text_is_the_tokenizers_decode(llm, runs):
    for kind in KINDS:
        for request_id in ("greedy", "samples"):  # ran to max_tokens: every token's text
            out = runs[kind][request_id][-1] if kind is not RequestOutputKind.DELTA else None
            completions = merged(runs[kind][request_id]) if out is None else out.outputs
            prompt_ids = list(runs[kind][request_id][-1].prompt_token_ids)
            for c in completions:
                assert c.finish_reason == "length"
                assert c.text == decoded(llm.tokenizer, prompt_ids, list(c.token_ids)), kind


def test_an_aborted_final_only_request_ends_with_all_it_made(llm, requests):
    prompt, params = requests["samples"]
    outs = run(llm, {"aborted": (prompt, dataclasses.replace(params, max_tokens=60))},
               RequestOutputKind.FINAL_ONLY, abort={"aborted": 8})["aborted"]
    assert len(outs) == 1 and outs[0].finished
    made = [list(c.token_ids) for c in outs[0].outputs]
    assert len(made) == 3 and all(0 < len(ids) < 60 for ids in made)
    for c in outs[0].outputs:
        assert c.finish_reason == "abort"
        assert c.text == decoded(llm.tokenizer, list(outs[0].prompt_token_ids),
                                 list(c.token_ids))


def test_generate_keeps_the_callers_params_and_returns_the_whole_output(llm, runs, requests):
    prompt, params = requests["samples"]
    [out] = llm.generate([prompt], params, use_tqdm=False)
    assert params.output_kind is RequestOutputKind.DELTA  # the caller's object, unchanged
    want = merged(runs[RequestOutputKind.DELTA]["samples"])
    # alone in its batch: the same tokens, log-probs to float32's rounding
    assert [fields(c)[:3] + fields(c)[4:] for c in out.outputs] == [
        fields(c)[:3] + fields(c)[4:] for c in want]
    assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(
        [c.cumulative_logprob for c in want], rel=1e-6)


@pytest.mark.parametrize("value", [3, -1, "delta", 1.0, None])
def test_a_bad_output_kind_is_refused_by_name(value):
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=value)


def test_output_kind_takes_vllms_values():
    assert [SamplingParams(output_kind=v).output_kind for v in (0, 1, 2)] == [
        RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY]
    assert SamplingParams().output_kind is RequestOutputKind.DELTA
