"""The server under hostile HTTP: bodies over the size limit, a list of prompts that can never
be in flight, max_tokens and n beyond what the engine can do, a prompt of megabytes being
tokenized while others are served, a client that stalls mid-body, and the whole OpenAPI
surface fuzzed with schemathesis. One real server (`python -m jaxpage.serve` on 127.0.0.1,
the tiny chat model of test_server.py) with an 8 MB body limit; raw sockets where a client
must misbehave in ways httpx will not.

The oracles: the status and OpenAI's error envelope naming the field and the limit, the order
in which concurrent requests finish, and for the fuzzing, that no generated request (valid or
not, by the schema) gets a 5xx and every 4xx is the envelope.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from test_server import API_KEY, ENGINE, MODEL, auth, running_server, save_chat_model

LIMIT = 8_000_000  # bytes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("limits_model")
    save_chat_model(path)
    with running_server(str(path), "--max-request-body-bytes", str(LIMIT),
                        "--max-in-flight", "64") as url:
        yield url


def post(url: str, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=auth(), timeout=timeout)


def assert_error(r: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


def raw_request(url: str, head: str, body: bytes = b"", *, read: bool = True,
                timeout: float = 30) -> tuple[int, bytes]:
    """Send a hand-made request on a raw socket; the response's status and body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        data = b""
        while read:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
            if b"\r\n\r\n" in data:
                header, _, rest = data.partition(b"\r\n\r\n")
                length = [int(line.split(b":")[1]) for line in header.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")]
                if length and len(rest) >= length[0]:
                    break
    status = int(data.split(b" ", 2)[1]) if data else 0
    return status, data.partition(b"\r\n\r\n")[2]


def headers(path: str, extra: str) -> str:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\n{extra}")


# ---------------------------------------------------------------- body size
def test_a_body_over_the_limit_is_refused_unread(server):
    """Content-Length over the limit: a 413 naming the limit with no byte of the body sent."""
    status, body = raw_request(server, headers("/v1/completions",
                                               f"Content-Length: {LIMIT + 1}\r\n"))
    assert status == 413
    error = json.loads(body)["error"]
    assert str(LIMIT) in error["message"] and "--max-request-body-bytes" in error["message"]
    assert error["code"] == "request_too_large"


def test_a_chunked_body_over_the_limit_is_refused_as_it_arrives(server):
    """No Content-Length (chunked): the body is counted as it comes and refused once past
    the limit; the server answers before the client has sent it all."""
    chunk = b"x" * 1_000_000
    one = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(headers("/v1/completions", "Transfer-Encoding: chunked\r\n").encode()
                     + b"\r\n")
        sent = 0
        for _ in range(LIMIT // len(chunk) + 1):  # one byte over the limit's worth
            sock.sendall(one)
            sent += len(chunk)
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            more = sock.recv(65536)
            if not more:
                break
            data += more
    assert sent > LIMIT
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_too_large"


def test_a_body_under_the_limit_is_served(server):
    r = post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 2,
                                         "user": "u" * (LIMIT // 2)})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- counts and lengths
def test_more_prompts_than_can_ever_be_in_flight_is_a_400(server):
    """65 prompts with --max-in-flight 64 can never fit: a 400 naming the limit, not 503."""
    assert_error(post(server, "/v1/completions", {"prompt": ["x"] * 65, "max_tokens": 1}),
                 400, "prompt", "65 prompts", "at most 64")
    r = post(server, "/v1/completions", {"prompt": ["x"] * 64, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 64


def test_max_tokens_and_n_beyond_the_engine_are_400s(server):
    max_len = ENGINE["max_model_len"]
    for body in ({"prompt": "hi", "max_tokens": 10**30},
                 {"prompt": "hi", "max_tokens": max_len}):
        assert_error(post(server, "/v1/completions", body), 400, "max_tokens",
                     "max_model_len", str(max_len))
    assert_error(post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**9}),
        400, "max_tokens", "max_model_len")
    n = ENGINE["max_num_seqs"] + 1
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": n}),
                 400, "n", f"max_num_seqs ({ENGINE['max_num_seqs']})")


def test_prompt_longer_than_the_context_is_a_400(server):
    assert_error(post(server, "/v1/completions", {"prompt": list(range(3, 3 + 400)) * 2}),
                 400, "prompt", "800 tokens", "max_model_len")
    assert_error(post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "word " * 600}]}),
        400, "messages", "max_model_len")


def test_auto_tool_choice_needs_the_parser(server):
    """Tools without tool_choice mean "auto" (vLLM's default), which this server (no
    --tool-call-parser) cannot parse: a 400 saying which flags turn it on."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for extra in ({}, {"tool_choice": "auto"}):
        assert_error(post(server, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "tools": tools, **extra}),
            400, "tool_choice", "--enable-auto-tool-choice", "--tool-call-parser")


# ---------------------------------------------------------------- the event loop stays free
def test_a_large_prompt_being_tokenized_holds_up_nobody(server):
    """A prompt of a few MB (seconds of tokenizing, on a worker thread) is still being
    tokenized when a small request, sent after it, has its answer; then it gets its 400 (it
    is far longer than the context)."""
    big = {"prompt": "Plain English text about the café. " * 150_000, "max_tokens": 1}
    assert len(json.dumps(big)) < LIMIT

    async def main():
        async with httpx.AsyncClient(timeout=120, headers=auth()) as client:
            started = time.monotonic()
            slow = asyncio.ensure_future(client.post(f"{server}/v1/completions", json=big))
            await asyncio.sleep(0.5)  # the big body is in, its tokenizing under way
            small = await client.post(f"{server}/v1/completions", json={
                "prompt": "hello", "max_tokens": 2})
            small_done = time.monotonic() - started
            assert not slow.done(), "the big prompt was tokenized within the small request"
            slow_response = await slow
            return small, small_done, slow_response, time.monotonic() - started

    small, small_done, slow, slow_done = asyncio.run(main())
    assert small.status_code == 200 and len(small.json()["choices"]) == 1
    assert_error(slow, 400, "prompt", "max_model_len")
    assert small_done < slow_done


def test_a_client_stalled_mid_body_holds_up_nobody(server):
    """A client that sends headers and part of its body, then nothing: other requests are
    served meanwhile (several, one after another), and so is the next one after it leaves."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as stalled:
        stalled.sendall(headers("/v1/completions", "Content-Length: 1000\r\n").encode()
                        + b'\r\n{"prompt": "abc", ')
        for _ in range(3):
            r = post(server, "/v1/completions", {"prompt": "still served", "max_tokens": 2},
                     timeout=30)
            assert r.status_code == 200
        stalled.settimeout(0.2)
        with pytest.raises(TimeoutError):
            stalled.recv(1)  # it is still waiting for its body: no answer yet
    r = post(server, "/v1/completions", {"prompt": "after", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200


# ---------------------------------------------------------------- fuzzing the OpenAPI schema
# examples per operation and mode (a GET without parameters needs one): the whole run takes
# about 30 s on two cores
FUZZ_EXAMPLES = {"POST": 20, "GET": 2}


def test_openapi_fuzzing_finds_no_server_error(server):
    """schemathesis over /openapi.json, valid and invalid requests (derandomized: the same
    cases every run): no 5xx, and every 4xx is OpenAI's error envelope."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_dict(
        httpx.get(f"{server}/openapi.json", headers=auth(), timeout=30).json())
    failures, calls = [], 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE,
                     schemathesis.GenerationMode.NEGATIVE):

            @settings(max_examples=FUZZ_EXAMPLES[operation.method.upper()], derandomize=True,
                      deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                nonlocal calls
                calls += 1
                response = case.call(base_url=server, headers=auth(), timeout=60)
                where = f"{case.method} {case.path} {case.body!r:.300}"
                if response.status_code >= 500:
                    failures.append(f"{response.status_code} for {where}: {response.text:.300}")
                elif response.status_code >= 400:
                    try:
                        error = response.json()["error"]
                        ok = set(error) == {"message", "type", "param", "code"}
                    except (ValueError, KeyError, TypeError):
                        ok = False
                    if not ok:
                        failures.append(f"{response.status_code} without the envelope for "
                                        f"{where}: {response.text:.300}")

            try:
                run()
            except Unsatisfiable:  # nothing to make invalid (a GET without parameters)
                assert mode == schemathesis.GenerationMode.NEGATIVE
    assert calls > 50
    assert not failures, "\n".join(failures[:20])
    assert httpx.get(f"{server}/health").status_code == 200
    r = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
