"""The OpenAI-compatible server, for real: `python -m jaxpage.serve` in a subprocess on
127.0.0.1, a tiny random-weight Llama with a byte-level BPE tokenizer and a chat template,
driven by the real `openai` client and by `httpx`.

The oracle is `LLM` in this process over the same model and engine config: greedy texts,
seeded samples and log-probabilities from the server must equal what `LLM.generate` and
`LLM.chat` return. `/metrics` is parsed with prometheus_client's own parser.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time

import httpx
import pytest
from conftest import build_hf_model, byte_level_bpe_tokenizer
from prometheus_client.parser import text_string_to_metric_families

from jaxpage import LLM, SamplingParams

API_KEY = "test-key"
MODEL = "tiny"
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")
ENGINE = dict(block_size=4, num_blocks=160, max_model_len=512, max_num_seqs=16,
              max_num_batched_tokens=64)
PROMPTS = ["The café on the corner", "Plain English text about", "日本語のテキスト"]


def save_chat_model(path) -> tuple[object, object]:
    """A tiny llama with a byte-level BPE tokenizer and CHAT_TEMPLATE, saved to `path`;
    returns (the HF model, the tokenizer)."""
    tokenizer = byte_level_bpe_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    model = build_hf_model("llama", 0, vocab_size=len(tokenizer))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model, tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve_model")
    save_chat_model(path)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(model_dir: str, *extra: str):
    """A live server's base URL (warm-up on, as users run it), ENGINE's flags and `extra`."""
    port = free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxpage.serve", "--model", model_dir, "--served-model-name",
         MODEL, "--port", str(port), "--api-key", API_KEY, "--compile-cache", "", *flags,
         *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        else:
            raise AssertionError("the server did not become healthy in 240 s")
        yield url
    finally:
        proc.terminate()
        try:
            log, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            log, _ = proc.communicate()
    assert "ready: serving tiny" in log and "warm-up:" in log, log[-3000:]
    assert "Traceback" not in log, log[-5000:]


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir) as url:
        yield url


@pytest.fixture(scope="module")
def oracle(model_dir):
    return LLM(model_dir, **ENGINE)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def metrics(url: str) -> dict[tuple, float]:
    """{(sample name, sorted labels without model_name): value} from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            values[sample.name, labels] = sample.value
    return values


def texts(outputs) -> list[list[str]]:
    return [[c.text for c in out.outputs] for out in outputs]


# ---------------------------------------------------------------- the openai client
def test_completions_greedy_equal_llm_generate(client, oracle):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = texts(oracle.generate(PROMPTS, params, use_tqdm=False))
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert response.object == "text_completion"
    assert [[c.text] for c in response.choices] == expected
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in response.choices)
    prompt_tokens = sum(len(oracle.engine.tokenize(p)) for p in PROMPTS)
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 36

    # streaming: the deltas of each choice add up to the same text, then [DONE]
    stream = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    streamed, usage = ["", "", ""], None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [[t] for t in streamed] == expected
    assert usage.completion_tokens == 36 and usage.prompt_tokens == prompt_tokens


def test_completions_token_id_prompts_and_echo(client, oracle):
    """Token-id prompts with echo: each choice is its own prompt's text, then LLM's
    continuation of that prompt."""
    ids = oracle.engine.tokenize(PROMPTS[0])
    expected = texts(oracle.generate([ids, ids[:3]], SamplingParams(max_tokens=6,
                                                                     temperature=0.0)))
    response = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=6,
                                         temperature=0, echo=True)
    decode = oracle.tokenizer.decode
    assert response.choices[0].text == decode(ids) + expected[0][0]
    assert response.choices[1].text == decode(ids[:3]) + expected[1][0]


def test_chat_greedy_equals_llm_chat(client, oracle):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Tell me about the café."}]
    expected = texts(oracle.chat(messages, SamplingParams(max_tokens=10, temperature=0.0,
                                                          ignore_eos=True), use_tqdm=False))
    response = client.chat.completions.create(model=MODEL, messages=messages,
                                              max_completion_tokens=10, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected[0][0]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected[0][0]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seeded_samples_repeat_and_equal_llm(client, oracle):
    """n=2 with a seed: the same seed gives the same two texts, and the texts LLM.generate
    gives for that seed (seeded draws do not depend on the batch)."""
    params = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    expected = texts(oracle.generate([PROMPTS[1]], params, use_tqdm=False))[0]
    runs = [client.completions.create(model=MODEL, prompt=PROMPTS[1], n=2, max_tokens=10,
                                      temperature=1.0, seed=1234,
                                      extra_body={"ignore_eos": True}) for _ in range(2)]
    for response in runs:
        assert [c.text for c in response.choices] == expected
    assert expected[0] != expected[1]
    other = client.completions.create(model=MODEL, prompt=PROMPTS[1], n=2, max_tokens=10,
                                      temperature=1.0, seed=99, extra_body={"ignore_eos": True})
    assert [c.text for c in other.choices] != expected


def test_stop_strings_end_where_llm_ends(client, oracle):
    full = texts(oracle.generate([PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0.0,
                                                              ignore_eos=True)))[0][0]
    stop = full[6:8]
    expected = oracle.generate([PROMPTS[0]], SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert expected.finish_reason == "stop" and stop not in expected.text
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20,
                                         temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert choice.text == expected.text and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop


def test_logprobs_equal_llm(client, oracle):
    """The completion's tokens, their log-probs and their top-3 (exactly 3: greedy draws the
    top token) are LLM's, each token as its own text; then chat's top-2."""
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    expected = oracle.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0]
    response = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6,
                                         temperature=0, logprobs=3,
                                         extra_body={"ignore_eos": True})
    lp = response.choices[0].logprobs
    assert response.choices[0].text == expected.text
    want = [entry[t] for t, entry in zip(expected.token_ids, expected.logprobs, strict=True)]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-5)
    decode = oracle.tokenizer.decode
    assert lp.tokens == [decode([t]) for t in expected.token_ids]
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    for top, entry in zip(lp.top_logprobs, expected.logprobs, strict=True):
        assert len(entry) == 3 and len({decode([t]) for t in entry}) == 3  # texts are keys
        assert top == pytest.approx({decode([t]): v for t, v in entry.items()}, abs=1e-5)

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob <= item.top_logprobs[0].logprob + 1e-6  # greedy: it is the top
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)


def test_models_tokenize_detokenize_version(server, oracle):
    models = httpx.get(f"{server}/v1/models", headers=auth()).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == ENGINE["max_model_len"]
    tokens = httpx.post(f"{server}/tokenize", headers=auth(), json={"prompt": PROMPTS[2]}).json()
    assert tokens["tokens"] == oracle.engine.tokenize(PROMPTS[2])
    assert tokens["count"] == len(tokens["tokens"])
    text = httpx.post(f"{server}/detokenize", headers=auth(),
                      json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == oracle.tokenizer.decode(tokens["tokens"])
    assert httpx.get(f"{server}/version").json()["version"]


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("body, status, param, words", [
    ('{"prompt": "x", "max_tokens": ', 400, None, "not valid JSON"),
    ({"prompt": "x", "max_tokens": -3}, 400, "max_tokens", "max_tokens must be"),
    ({"prompt": "x " * 600, "max_tokens": 4}, 400, "prompt", "max_model_len"),
    ({"prompt": "x", "model": "gpt-17"}, 404, "model", "does not exist"),
    ({"prompt": "x", "temperature": "warm"}, 400, "temperature", "temperature"),
    ({"prompt": [5, 6, 100000]}, 400, "prompt", "[0, 400)"),
    ({"prompt": "x", "n": 0}, 400, "n", "n must be"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p", "top_p"),
    ({"prompt": "x", "stop": [""]}, 400, "stop", "stop"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs", "logprobs"),
    ({"max_tokens": 3}, 400, "prompt", "required"),
])
def test_completion_errors_use_the_envelope(server, body, status, param, words):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server}/v1/completions", content=content, timeout=30,
                   headers={**auth(), "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"], error
    assert "Traceback" not in r.text


def test_wrong_or_missing_api_key_is_401(server):
    for headers in ({"Authorization": "Bearer nope"}, {}):
        r = httpx.post(f"{server}/v1/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/health").status_code == 200  # open without a key


def test_chat_errors(server):
    r = httpx.post(f"{server}/v1/chat/completions", headers=auth(), json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{server}/v1/chat/completions", headers=auth(), json={
        "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


# ---------------------------------------------------------------- load, aborts, metrics
def test_metrics_count_what_was_sent(server, oracle):
    before = metrics(server)
    shared = "Plain English text about the quick brown fox who jumps over the lazy dog"
    lengths = []
    for i, max_tokens in enumerate((3, 5, 7)):
        prompt = shared + f" again {i}"
        lengths.append(len(oracle.engine.tokenize(prompt)))
        r = httpx.post(f"{server}/v1/completions", headers=auth(), timeout=60, json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200
    after = metrics(server)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("vllm:prompt_tokens_total") == sum(lengths)
    assert delta("vllm:generation_tokens_total") == 15
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:time_per_output_token_seconds_count") == 3
    assert delta("vllm:prefix_cache_queries_total") == sum(lengths)
    # the 2nd and 3rd prompts find the blocks of the shared text the 1st one computed
    bs = ENGINE["block_size"]
    shared_blocks = len(oracle.engine.tokenize(shared)) // bs
    assert delta("vllm:prefix_cache_hits_total") >= 2 * shared_blocks * bs - 2 * bs
    assert after["vllm:num_requests_running", ()] == 0
    assert after["jaxpage:compiles", ()] >= 1


def test_concurrent_streams_with_disconnects(server):
    """200 streaming requests at once from one asyncio client, random lengths, 20% closing
    their stream after the first chunk: every finished stream is well-formed and ends with
    [DONE], every closed one is aborted, the pool empties, and the server still answers.
    A closing request asks for 480 tokens, so that it is usually still running when its
    client goes; the server does not wait for a slow client, so one may end first (by
    length): every closed request is aborted or ended so, and most are aborted."""
    rng = random.Random(0)
    plans = [(rng.choice(PROMPTS) + f" {i}", rng.randint(1, 24), i % 5 == 0)
             for i in range(200)]
    before = metrics(server)

    async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int, leave: bool):
        body = {"prompt": prompt, "max_tokens": 480 if leave else max_tokens,
                "temperature": 0.7, "stream": True, "ignore_eos": True}
        async with client.stream("POST", f"{server}/v1/completions", json=body,
                                 headers=auth()) as r:
            assert r.status_code == 200
            events = []
            async for line in r.aiter_lines():
                if not line:
                    continue
                assert line.startswith("data: ")
                events.append(line[len("data: "):])
                if leave:
                    return None  # closes the connection mid-stream
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["object"] == "text_completion" for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        return "".join(c["choices"][0]["text"] for c in chunks)

    async def main():
        limits = httpx.Limits(max_connections=250)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client, *p) for p in plans))

    results = asyncio.run(main())
    left = sum(leave for *_, leave in plans)
    assert sum(r is None for r in results) == left == 40
    # the closed streams' requests are aborted
    key = ("vllm:request_success_total", (("finished_reason", "abort"),))
    length = ("vllm:request_success_total", (("finished_reason", "length"),))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        after = metrics(server)
        aborted = after.get(key, 0) - before.get(key, 0)
        ended = after.get(length, 0) - before.get(length, 0)
        if aborted + ended >= len(plans) and after["vllm:num_requests_running", ()] == 0:
            break
        time.sleep(0.2)
    assert aborted + ended == len(plans) and aborted >= left * 3 // 4, (aborted, ended)
    assert after["vllm:kv_cache_usage_perc", ()] == 0.0, "blocks are still held"
    r = httpx.post(f"{server}/v1/completions", headers=auth(), timeout=60,
                   json={"prompt": "still there?", "max_tokens": 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


def test_a_client_that_gives_up_aborts_its_request(server):
    """A non-streaming request whose client goes away while it runs is aborted: its four
    samples count as aborted and its blocks are freed."""
    key = ("vllm:request_success_total", (("finished_reason", "abort"),))
    before = metrics(server).get(key, 0)

    async def give_up():
        async with httpx.AsyncClient(timeout=60) as client:
            request = asyncio.ensure_future(client.post(
                f"{server}/v1/completions", headers=auth(), json={
                    "prompt": PROMPTS[0], "max_tokens": 100, "n": 4, "ignore_eos": True}))
            for _ in range(500):  # until its samples run
                if (await asyncio.to_thread(metrics, server))[
                        "vllm:num_requests_running", ()] == 4:
                    break
                await asyncio.sleep(0.01)
            request.cancel()  # closes the connection
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(give_up())
    deadline = time.monotonic() + 30
    while metrics(server).get(key, 0) < before + 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    after = metrics(server)
    assert after.get(key, 0) == before + 4
    assert after["vllm:kv_cache_usage_perc", ()] == 0.0


def test_a_server_speculating_answers_as_llm_generate(model_dir, oracle):
    """`--speculative-config` as vLLM takes it: greedy completions through the openai
    client, streamed and not, are what LLM.generate gives without speculation, and
    /metrics has vLLM's spec_decode counters."""
    import openai

    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    prompts = [p * 3 for p in PROMPTS]  # repeated text: prompt lookup finds drafts
    want = [o.outputs[0].text for o in oracle.generate(
        prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        use_tqdm=False)]
    with running_server(model_dir, "--speculative-config", spec) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0,
                               timeout=120)
        for prompt, text in zip(prompts, want, strict=True):
            kwargs = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                          extra_body={"ignore_eos": True})
            assert client.completions.create(**kwargs).choices[0].text == text
            streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
                stream=True, **kwargs))
            assert streamed == text
        values = metrics(url)
    assert values["vllm:spec_decode_num_drafts_total", ()] > 0
    assert values["vllm:spec_decode_num_draft_tokens_total", ()] >= values[
        "vllm:spec_decode_num_accepted_tokens_total", ()] > 0
