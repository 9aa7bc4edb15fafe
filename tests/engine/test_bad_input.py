"""Every request is validated at the door: what `add_request` accepts is served, whatever it
refuses is a ValueError naming the field, and nothing accepted can break a later step."""

from __future__ import annotations

import collections.abc

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jaxpage import LLM, SamplingParams

VOCAB = 97  # the tiny models' vocabulary


@pytest.fixture(scope="module")
def llm(hf_model_dir):
    path, _ = hf_model_dir("llama")
    return LLM(path, block_size=4, num_blocks=64, max_num_batched_tokens=32, max_num_seqs=8,
               max_model_len=128)


def drain(engine):
    final = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.allocator.check_invariants()
    raise AssertionError("the engine did not drain")


CANARY = ([5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))


def canary_tokens(llm):
    return llm.generate([CANARY[0]], CANARY[1], use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def expected_canary(hf_model_dir):
    """The canary's tokens from a fresh engine that nothing else has touched."""
    path, _ = hf_model_dir("llama")
    return canary_tokens(LLM(path, block_size=4, num_blocks=64, max_num_batched_tokens=32,
                             max_num_seqs=8, max_model_len=128))


def test_inputs_that_used_to_break_every_later_step_are_refused(llm, expected_canary):
    engine = llm.engine
    expected = expected_canary
    refused = [
        (lambda: engine.add_request("a", [1, 2], SamplingParams(), cache_salt=123),
         "cache_salt"),
        (lambda: SamplingParams(top_k=2**31), "top_k"),
        (lambda: engine.add_request("b", [1, 2], SamplingParams(
            stop_token_ids=[2**31], min_tokens=1, max_tokens=4)), "stop_token_ids"),
        (lambda: engine.add_request("c", [1, 2], SamplingParams(
            stop_token_ids=list(range(200)), min_tokens=1, max_tokens=4)), "stop_token_ids"),
        (lambda: SamplingParams(stop=5), "stop"),
        (lambda: SamplingParams(stop_token_ids=7), "stop_token_ids"),
        (lambda: SamplingParams(stop={"x": 1}), "stop"),
        (lambda: llm.generate(None), "prompts"),
        (lambda: engine.add_request("d", None), "prompt"),
        (lambda: engine.add_request("e", [1, 2.5]), "token ids"),
        (lambda: engine.add_request("f", {"prompt": "x"}), "prompt"),
    ]
    for call, field in refused:
        with pytest.raises(ValueError, match=field):
            call()
    assert not engine.requests and not engine.has_unfinished_requests()
    assert canary_tokens(llm) == expected  # still serving, as before


def test_numpy_integers_are_integers(llm):
    expected = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.0),
                            use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.0),
                            top_k=np.int32(-1), stop_token_ids=np.array([], np.int64))
    for prompts in (np.array([1, 2, 3]), [np.int64(1), np.int32(2), np.uint8(3)],
                    [np.array([1, 2, 3])]):
        out = llm.generate(prompts, params, use_tqdm=False)
        assert len(out) == 1 and out[0].outputs[0].token_ids == expected
    assert isinstance(params.max_tokens, int) and type(params.top_k) is int


def test_top_k_at_the_int32_limit_is_served(llm):
    big = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.8, seed=1,
                                                   top_k=2**31 - 1), use_tqdm=False)[0]
    off = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.8, seed=1),
                       use_tqdm=False)[0]
    assert big.outputs[0].token_ids == off.outputs[0].token_ids  # k >= vocab keeps all


def test_a_failed_batch_leaves_nothing_behind(llm):
    """Any error while a generate() call adds its requests (a ValueError, or any other
    exception) aborts those it already added; the next call sees none of them."""
    engine = llm.engine
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2, 3], [4, 5, "x"]], use_tqdm=False)
    assert not engine.requests

    class Boom(Exception):
        pass

    class Exploding(collections.abc.Sequence):  # a prompt whose token ids cannot be read
        def __len__(self):
            return 3

        def __getitem__(self, index):
            raise Boom()

    good = SamplingParams(max_tokens=3)
    with pytest.raises(Boom):
        llm.generate([[1, 2, 3], Exploding()], good, use_tqdm=False)
    assert not engine.requests and engine.scheduler.num_unfinished == 0  # none will run
    out = llm.generate([[7, 8, 9]], good, use_tqdm=False)
    assert [o.request_id for o in out] == [out[0].request_id] and out[0].finished


@pytest.mark.parametrize("policy", ["paged", "oracle", "max"])
def test_no_request_waits_forever(hf_model_dir, policy):
    """A request that could never be admitted under the policy is refused at the door; one
    that fits is admitted and finishes (the pool holds 15 blocks of 4 tokens)."""
    path, _ = hf_model_dir("llama")
    llm = LLM(path, block_size=4, num_blocks=16, max_num_batched_tokens=32, max_num_seqs=4,
              max_model_len=128, reservation_policy=policy)
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    if policy == "max":  # max_model_len 128 needs 32 blocks per sequence: never admitted
        with pytest.raises(ValueError, match="reservation_policy 'max'"):
            engine.add_request("r", [1, 2, 3], params)
        assert not engine.requests
        return
    engine.add_request("r", [1, 2, 3], params)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("n", [1, 2, 3], SamplingParams(n=4, max_tokens=60))
    final = drain(engine)
    assert final["r"].outputs[0].finish_reason == "length"


def test_prompt_dicts_and_cache_salts(llm):
    """vLLM's prompt dicts: a salt isolates a tenant's prefix cache from the facade."""
    prompt = list(range(10, 30))  # 5 full blocks
    params = SamplingParams(max_tokens=4, temperature=0.0)
    assert llm.reset_prefix_cache()
    first = llm.generate({"prompt_token_ids": prompt, "cache_salt": "a"}, params,
                         use_tqdm=False)[0]
    same = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "a"}], params,
                        use_tqdm=False)[0]
    other = llm.generate({"prompt_token_ids": prompt, "cache_salt": "b"}, params,
                         use_tqdm=False)[0]
    assert first.metrics.num_cached_tokens == 0
    assert same.metrics.num_cached_tokens == 16  # the salt's own cache: 4 blocks hit
    assert other.metrics.num_cached_tokens == 0  # another tenant: no hit
    assert first.outputs[0].token_ids == same.outputs[0].token_ids == other.outputs[0].token_ids
    for bad in ({"prompt": "x", "prompt_token_ids": [1]}, {"prompt_token_ids": [1], "salt": 1},
                {"prompt_token_ids": [1], "cache_salt": 5}):
        with pytest.raises(ValueError):
            llm.generate(bad, params, use_tqdm=False)
    assert not llm.engine.requests


extreme_ints = st.one_of(st.integers(-2**70, 2**70),
                         st.sampled_from([-1, 0, 2**31 - 1, 2**31, -2**31 - 1, 2**63]))
extreme_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                           st.sampled_from([0.0, 1e-45, 1e-30, 1e30, -1.0]))


FIELDS = {  # name: (valid values, extreme values)
    "n": (st.integers(1, 3), extreme_ints),
    "temperature": (st.floats(0, 2), extreme_floats),
    "top_p": (st.floats(0.01, 1), extreme_floats),
    "top_k": (st.integers(-1, 200), extreme_ints),
    "min_p": (st.floats(0, 1), extreme_floats),
    "seed": (st.integers(-2**40, 2**40), extreme_ints),
    "max_tokens": (st.integers(1, 12), extreme_ints),
    "min_tokens": (st.integers(0, 3), extreme_ints),
    "logprobs": (st.one_of(st.none(), st.integers(0, 20)), extreme_ints),
    "presence_penalty": (st.floats(-2, 2), extreme_floats),
    "frequency_penalty": (st.floats(-2, 2), extreme_floats),
    "repetition_penalty": (st.floats(0.1, 2), extreme_floats),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=4),
                       st.lists(extreme_ints, max_size=3)),
    "ignore_eos": (st.booleans(), st.booleans()),
    "prompt": (st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
               st.lists(extreme_ints, max_size=5)),
    "cache_salt": (st.one_of(st.none(), st.text(max_size=3)), extreme_ints),
}


@st.composite
def requests(draw):
    """(SamplingParams fields, prompt, salt, valid): half the requests take only valid values
    (`valid`: they must be served); the others take extreme values in a few fields."""
    all_valid = draw(st.booleans())
    extremes = set() if all_valid else draw(st.sets(st.sampled_from(sorted(FIELDS)), min_size=1,
                                                 max_size=3))
    values = {}
    for name, (valid, extreme) in FIELDS.items():
        if name in extremes or name in ("prompt", "cache_salt") or draw(st.booleans()):
            values[name] = draw(extreme if name in extremes else valid)
    if not extremes.intersection(("min_tokens", "max_tokens")):  # valid together too
        values["min_tokens"] = min(values.get("min_tokens", 0), values.get("max_tokens", 16))
    return values, values.pop("prompt"), values.pop("cache_salt"), all_valid


# every field at the low, then the high end of its valid range
EDGES = [({"n": 1, "temperature": 0.0, "top_p": 0.01, "top_k": -1, "min_p": 0.0, "seed": -2**40,
           "max_tokens": 1, "min_tokens": 0, "logprobs": 0, "presence_penalty": -2.0,
           "frequency_penalty": -2.0, "repetition_penalty": 0.1, "stop_token_ids": [],
           "ignore_eos": False}, [0], "", True),
         ({"n": 3, "temperature": 2.0, "top_p": 1.0, "top_k": 200, "min_p": 1.0, "seed": 2**40,
           "max_tokens": 12, "min_tokens": 3, "logprobs": 20, "presence_penalty": 2.0,
           "frequency_penalty": 2.0, "repetition_penalty": 2.0,
           "stop_token_ids": [VOCAB - 1] * 4, "ignore_eos": True}, [VOCAB - 1] * 40, "abc",
          True)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(requests(), min_size=1, max_size=4))
@example(batch=EDGES)
def test_any_request_is_refused_at_the_door_or_finishes(llm, expected_canary, batch):
    """Whatever the door accepts finishes and leaves the engine as it was; a request built
    only from valid values is accepted (a door refusing one fails here)."""
    engine = llm.engine
    accepted = []
    for i, (fields, prompt, salt, valid) in enumerate(batch):
        try:
            params = SamplingParams(**fields)
            engine.add_request(f"h{i}", prompt, params, cache_salt=salt)
        except ValueError as exc:
            assert not valid, f"a valid request was refused: {fields} {prompt} {salt!r}: {exc}"
            continue
        accepted.append(f"h{i}")
    final = drain(engine)
    assert set(final) == set(accepted)
    for out in final.values():
        assert out.error is None
        assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
    assert engine.allocator.usage()["used"] == 0
    assert canary_tokens(llm) == expected_canary  # and the engine serves as before
