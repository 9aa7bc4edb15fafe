"""The server's engine loop under failure and load, with the app served for real by uvicorn
on 127.0.0.1 in this process (so the test can break the runner): a transient step failure
is retried without losing a token, a device that keeps failing kills the loop and every
waiting request gets the error while /health turns 503, too many requests in flight get
503. Also the engine-side pieces the server relies on: warm-up covers the first requests'
shapes, and beam search reports real TTFT and TPOT."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import numpy as np
import pytest
import uvicorn
from test_server import free_port, metrics

from jaxpage import LLM, BeamSearchParams, SamplingParams
from jaxpage.serve import build_app

PROMPT = list(range(3, 20))


@pytest.fixture(scope="module")
def llama_dir(hf_model_dir):
    return hf_model_dir("llama")[0]


def make_llm(path) -> LLM:
    return LLM(path, block_size=4, num_blocks=96, max_model_len=160, max_num_seqs=8)


@contextlib.contextmanager
def serving(engine, **kwargs):
    """The app over `engine` on a free port, for the duration of the block."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, model_name="m", **kwargs),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(300):
            if server.started:
                break
            time.sleep(0.05)
        assert server.started
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive()


def fail_steps(engine, count: float, after: int = 0) -> list:
    """Make `count` runner executions raise (a device failure), after the next `after` run;
    returns [failures not yet raised]."""
    real = engine.runner.execute
    left, runs = [count], [after]

    def execute(seqs):
        if runs[0] > 0:
            runs[0] -= 1
        elif left[0] > 0:
            left[0] -= 1
            raise RuntimeError("injected device failure")
        return real(seqs)

    engine.runner.execute = execute
    return left


def running(url: str) -> float:
    return metrics(url)["vllm:num_requests_running", ()]


def test_a_transient_failure_is_retried_without_loss(llama_dir):
    """Two failed steps mid-generation (after the prefill and two decodes) are retried: both
    injected failures fired, and the reply's tokens and log-probs are the clean run's."""
    llm = make_llm(llama_dir)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    clean = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    with serving(llm.engine) as url:
        left = fail_steps(llm.engine, 2, after=3)  # fewer than max_consecutive_failures (3)
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": 0})
        assert r.status_code == 200, r.text
        assert httpx.get(f"{url}/health").status_code == 200
    assert left == [0]  # both failures were raised
    logprobs = r.json()["choices"][0]["logprobs"]
    # no tokenizer: a token's text is its id
    assert logprobs["tokens"] == [str(t) for t in clean.token_ids]
    np.testing.assert_allclose(logprobs["token_logprobs"],
                               [lp[t] for t, lp in zip(clean.token_ids, clean.logprobs,
                                                       strict=True)], rtol=0, atol=1e-5)
    assert r.json()["usage"]["completion_tokens"] == 12


def test_a_dead_engine_answers_every_request_and_health_is_503(llama_dir):
    llm = make_llm(llama_dir)
    with serving(llm.engine) as url:
        results = {}

        def stream():
            body = {"prompt": PROMPT, "max_tokens": 120, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                results["stream"] = (r.status_code, [line for line in r.iter_lines() if line])

        def plain():
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": 120, "ignore_eos": True})
            results["plain"] = (r.status_code, r.json())

        threads = [threading.Thread(target=f) for f in (stream, plain)]
        for t in threads:
            t.start()
        for _ in range(400):  # both running
            if running(url) == 2:
                break
            time.sleep(0.01)
        fail_steps(llm.engine, float("inf"))
        for t in threads:
            t.join(60)
        health = httpx.get(f"{url}/health")
        late = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})

    status, lines = results["stream"]
    assert status == 200 and lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert "injected device failure" in error["message"]
    status, body = results["plain"]
    assert status == 503 and "injected device failure" in body["error"]["message"]
    assert health.status_code == 503 and "injected" in health.json()["error"]["message"]
    assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"


def test_too_many_in_flight_is_503(llama_dir):
    llm = make_llm(llama_dir)
    with serving(llm.engine, max_in_flight=2) as url:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "prompt": [PROMPT, PROMPT[:5]], "max_tokens": 100, "stream": True,
                "ignore_eos": True}) as first:
            assert first.status_code == 200
            r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        # the first request's stream was closed: both its prompts are aborted, room again
        for _ in range(200):
            r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            if r.status_code == 200:
                break
            time.sleep(0.05)
        assert r.status_code == 200, r.text


def test_warmup_compiles_the_first_requests_shapes(llama_dir):
    llm = make_llm(llama_dir)
    compiles, seconds = llm.engine.warmup()
    assert compiles == llm.engine.runner.compiles > 0 and seconds > 0
    for params in (SamplingParams(max_tokens=20, temperature=0.0),
                   SamplingParams(max_tokens=20, temperature=1.0, seed=1)):
        for prompt in (PROMPT, list(range(3, 70))):
            llm.generate([prompt], params, use_tqdm=False)
    assert llm.engine.runner.compiles == compiles, "a first request compiled a new shape"


def test_beam_search_reports_ttft_and_tpot(llama_dir):
    llm = make_llm(llama_dir)
    outs = llm.beam_search([PROMPT, PROMPT[:9]], BeamSearchParams(beam_width=3, max_tokens=6,
                                                                  ignore_eos=True))
    for out in outs:
        m = out.metrics
        assert 0 < m.ttft < m.finished_time - m.arrival_time
        assert m.num_output_tokens == 6 and m.tpot > 0
    stats = llm.stats()
    assert stats["ttft"]["count"] == 2 and stats["ttft"]["mean"] > 0
    assert stats["tpot"]["count"] == 2 and stats["tpot"]["mean"] > 0


def test_sse_events_survive_line_readers_that_split_on_unicode_breaks():
    """Generated text may hold U+0085, U+2028, U+2029: valid inside SSE, but Python's
    splitlines (and httpx's aiter_lines) end lines there; each event must stay one line
    and decode to the same text."""
    import asyncio

    from jaxpage.serve.app import _sse

    text = "a\x85b\u2028c\u2029d\x1ce 日本"

    async def events():
        yield {"text": text}
        yield "[DONE]"

    async def body():
        return "".join([chunk async for chunk in _sse(events()).body_iterator])

    lines = [line for line in asyncio.run(body()).splitlines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) == 2
    assert json.loads(lines[0][len("data: "):]) == {"text": text}
