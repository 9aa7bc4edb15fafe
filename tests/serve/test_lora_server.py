"""Multi-LoRA through the OpenAI-compatible server, as vLLM serves it: `python -m jaxpage.serve
--enable-lora --lora-modules a0=... a1=... --allow-runtime-lora-updating` in a subprocess on
127.0.0.1 over a tiny random-weight Llama (byte-level BPE tokenizer, chat template), driven by
the real `openai` client and by `httpx`.

The oracle is HF PEFT: a request naming adapter `aI` gets the greedy tokens of PEFT's model
with that adapter (`hf_greedy`), the base model's name those of the base model. The server
returns token ids through vLLM's `return_tokens_as_token_ids` (log-probs' tokens as
`token_id:<id>`): the tiny tokenizer's byte tokens would decode to the same `\ufffd`.

Start-up refusals, the flag forms and the runtime routes' switch (the environment variable)
are checked in this process, without a server subprocess.
"""

from __future__ import annotations

import asyncio
import types

import httpx
import pytest
from conftest import hf_greedy
from test_server import API_KEY, MODEL, auth, running_server, save_chat_model

pytest.importorskip("peft")
from engine.test_lora import make_adapters  # noqa: E402  (PEFT adapters of the tiny model)

from jaxpage import LLM  # noqa: E402
from jaxpage.llm import chat_token_ids  # noqa: E402
from jaxpage.serve import build_app  # noqa: E402
from jaxpage.serve.__main__ import main, parse_args  # noqa: E402

NEW_TOKENS = 8
LORA_FLAGS = ("--enable-lora", "--max-loras", "2")  # 2 device slots: runtime adapters take turns
PROMPTS = [[5, 17, 99, 230, 41, 8, 77], [300, 12, 64, 150, 9, 3, 211, 48, 19, 120]]
AS_IDS = {"return_tokens_as_token_ids": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The model directory (weights, tokenizer, chat template), the HF model and its four
    PEFT adapters [(path, PEFT model)]."""
    path = tmp_path_factory.mktemp("lora_serve_model")
    model, tokenizer = save_chat_model(path)
    adapters = make_adapters(model, str(tmp_path_factory.mktemp("lora_serve_adapters")))
    return types.SimpleNamespace(path=str(path), model=model, tokenizer=tokenizer,
                                 adapters=adapters)


@pytest.fixture(scope="module")
def lora_llm(tiny):
    """A small LLM with LoRA on for the in-process app tests (no step runs: nothing
    compiles)."""
    return LLM(tiny.path, enable_lora=True, num_blocks=16)


@pytest.fixture(scope="module")
def server(tiny):
    modules = [f"a{i}={tiny.adapters[i][0]}" for i in range(2)]
    with running_server(tiny.path, *LORA_FLAGS, "--lora-modules", *modules,
                        "--allow-runtime-lora-updating") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def oracle(tiny, name: str):
    """The HF model a request's `model` names: the base model or PEFT's with adapter aI."""
    return tiny.model if name == MODEL else tiny.adapters[int(name[1:])][1]


def token_ids(tokens: list[str]) -> list[int]:
    """Token ids from log-probs' `token_id:<id>` tokens."""
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t[len("token_id:"):]) for t in tokens]


def completion_ids(client, name: str, prompt, stream: bool = False) -> list[list[int]]:
    """Each choice's greedy token ids from /v1/completions under model `name`."""
    kwargs = dict(model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, logprobs=1,
                  extra_body=AS_IDS)
    if not stream:
        response = client.completions.create(**kwargs)
        assert response.model == name
        return [token_ids(c.logprobs.tokens) for c in response.choices]
    ids: dict[int, list[int]] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        assert chunk.model == name
        for c in chunk.choices:
            ids.setdefault(c.index, []).extend(token_ids(c.logprobs.tokens))
    return [ids[i] for i in sorted(ids)]


# ---------------------------------------------------------------- routing to adapters
def test_completions_run_under_the_named_adapter(tiny, client):
    """Base, a0 and a1, streamed and not, one prompt and two: each request's tokens are its
    model's; the adapters change them."""
    for name in (MODEL, "a0", "a1"):
        want = [hf_greedy(oracle(tiny, name), p, NEW_TOKENS) for p in PROMPTS]
        assert completion_ids(client, name, PROMPTS) == want, name
        assert completion_ids(client, name, PROMPTS[0], stream=True) == want[:1], name
    base = [hf_greedy(tiny.model, p, NEW_TOKENS) for p in PROMPTS]
    for i in range(2):
        assert [hf_greedy(tiny.adapters[i][1], p, NEW_TOKENS) for p in PROMPTS] != base


def test_chat_runs_under_the_named_adapter(tiny, client):
    messages = [{"role": "user", "content": "Tell me about the café."}]
    prompt = chat_token_ids(tiny.tokenizer, messages)
    for name in ("a1", MODEL):
        want = hf_greedy(oracle(tiny, name), prompt, NEW_TOKENS)
        kwargs = dict(model=name, messages=messages, max_tokens=NEW_TOKENS, temperature=0,
                      logprobs=True, extra_body=AS_IDS)
        response = client.chat.completions.create(**kwargs)
        assert response.model == name
        assert token_ids([t.token for t in response.choices[0].logprobs.content]) == want
        streamed = []
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            assert chunk.model == name
            for c in chunk.choices:
                if c.logprobs is not None:
                    streamed += token_ids([t.token for t in c.logprobs.content])
        assert streamed == want, name


def test_concurrent_requests_mixing_adapters(tiny, server):
    """Base and adapter requests at once (one batch mixes them): each gets its own tokens."""
    import openai

    jobs = [(name, p) for p in PROMPTS for name in (MODEL, "a0", "a1")] * 2

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY,
                                      max_retries=0, timeout=120) as aclient:
            responses = await asyncio.gather(*(aclient.completions.create(
                model=name, prompt=p, max_tokens=NEW_TOKENS, temperature=0, logprobs=1,
                extra_body=AS_IDS) for name, p in jobs))
        return [token_ids(r.choices[0].logprobs.tokens) for r in responses]

    got = asyncio.run(run())
    assert got == [hf_greedy(oracle(tiny, name), p, NEW_TOKENS) for name, p in jobs]


def test_models_lists_the_base_model_and_each_adapter(tiny, server):
    data = httpx.get(f"{server}/v1/models", headers=auth(), timeout=30).json()["data"]
    assert [m["id"] for m in data] == [MODEL, "a0", "a1"]
    assert data[0]["root"] == tiny.path and "parent" not in data[0]
    for i, entry in enumerate(data[1:]):
        assert entry["object"] == "model" and entry["parent"] == MODEL
        assert entry["root"] == tiny.adapters[i][0]


def test_an_unknown_model_is_404_and_the_server_goes_on(tiny, server, client):
    import openai

    for route, body in (("completions", {"prompt": PROMPTS[0]}),
                        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for stream in (False, True):
            r = httpx.post(f"{server}/v1/{route}", headers=auth(), timeout=30,
                           json={**body, "model": "a7", "stream": stream})
            assert r.status_code == 404, r.text
            assert r.json() == {"error": {"message": "The model `a7` does not exist.",
                                          "type": "invalid_request_error", "param": "model",
                                          "code": "model_not_found"}}
    r = httpx.post(f"{server}/tokenize", headers=auth(), json={"prompt": "x", "model": "a7"})
    assert r.status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a7", prompt="x", max_tokens=2)
    want = hf_greedy(tiny.adapters[0][1], PROMPTS[1], NEW_TOKENS)
    assert completion_ids(client, "a0", PROMPTS[1]) == [want]


# ---------------------------------------------------------------- runtime updating
def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", headers=auth(), json=body, timeout=60)


def test_load_use_and_unload_adapters_at_run_time(tiny, server, client):
    """Load a2, run it (its PEFT tokens), refuse a second load of the name, a bad adapter
    and an unload while a request uses an adapter; unload it: requests naming it are 404."""
    path2 = tiny.adapters[2][0]
    r = post(server, "load_lora_adapter", {"lora_name": "a2", "lora_path": path2})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a2' added successfully."
    listed = httpx.get(f"{server}/v1/models", headers=auth()).json()["data"]
    assert [(m["id"], m["root"], m.get("parent")) for m in listed[3:]] == [
        ("a2", path2, MODEL)]
    want = [hf_greedy(tiny.adapters[2][1], p, NEW_TOKENS) for p in PROMPTS]
    assert completion_ids(client, "a2", PROMPTS) == want
    assert completion_ids(client, "a0", PROMPTS[:1]) == [
        hf_greedy(tiny.adapters[0][1], PROMPTS[0], NEW_TOKENS)]  # 2 slots: a2 took a turn

    def refused(route: str, body: dict, status: int, param: str, *words: str) -> None:
        r = post(server, route, body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
        assert all(w in error["message"] for w in words), error

    refused("load_lora_adapter", {"lora_name": "a2", "lora_path": path2}, 400, "lora_name",
            "The lora adapter 'a2' has already been loaded.")
    refused("load_lora_adapter", {"lora_name": MODEL, "lora_path": path2}, 400, "lora_name",
            "served model's name")
    missing = tiny.path + "/no-such-adapter"
    refused("load_lora_adapter", {"lora_name": "bad", "lora_path": missing}, 400, "lora_path",
            missing, "no adapter_config.json")
    refused("load_lora_adapter", {"lora_name": "bad", "lora_path": tiny.path}, 400,
            "lora_path", "no adapter_config.json")  # a model, not an adapter
    refused("load_lora_adapter", {"lora_name": "bad"}, 400, "lora_path", "Field required")

    # an adapter in use cannot be unloaded; once its request is done it can
    stream = client.completions.create(model="a2", prompt=PROMPTS[0], max_tokens=120,
                                       temperature=0, stream=True, extra_body=AS_IDS)
    chunks = iter(stream)
    next(chunks)
    refused("unload_lora_adapter", {"lora_name": "a2"}, 400, "lora_name",
            "'a2' has 1 unfinished requests")
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert completion_ids(client, "a2", PROMPTS[:1]) == want[:1]  # still served

    r = post(server, "unload_lora_adapter", {"lora_name": "a2"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a2' removed successfully."
    refused("unload_lora_adapter", {"lora_name": "a2"}, 404, "lora_name",
            "The lora adapter 'a2' cannot be found.")
    r = post(server, "completions", {"model": "a2", "prompt": PROMPTS[0]})
    assert r.status_code == 404 and "`a2` does not exist" in r.json()["error"]["message"]
    assert [m["id"] for m in httpx.get(f"{server}/v1/models", headers=auth()).json()[
        "data"]] == [MODEL, "a0", "a1"]

    # loaded again under a new name (a new id), it runs again; then it goes
    r = post(server, "load_lora_adapter", {"lora_name": "a2-again", "lora_path": path2})
    assert r.status_code == 200, r.text
    assert completion_ids(client, "a2-again", PROMPTS[1:]) == want[1:]
    assert post(server, "unload_lora_adapter", {"lora_name": "a2-again"}).status_code == 200


# ---------------------------------------------------------------- in this process
def test_lora_modules_take_both_of_vllms_forms(capsys):
    args = parse_args(["--enable-lora", "--lora-modules", "a0=/x/y=z",
                       '{"name": "a1", "path": "/p"}', "--max-loras", "2"])
    assert args.lora_modules == [("a0", "/x/y=z"), ("a1", "/p")]
    assert args.max_loras == 2 and args.enable_lora and not args.allow_runtime_lora_updating
    for bad in ("a0", "=p", "a0=", '{"name": "a"}', '{"name": "a", "path": "p", "x": 1}',
                '{"name": '):
        with pytest.raises(SystemExit):
            parse_args(["--lora-modules", bad])
        assert "--lora-modules" in capsys.readouterr().err


def test_start_up_refuses_bad_lora_flags(tiny, capsys):
    """--lora-modules or --allow-runtime-lora-updating without --enable-lora, a bad adapter
    and an adapter named as the served model: each fails start-up naming it (exit code 2)."""
    common = ["--model", tiny.path, "--no-warmup", "--compile-cache", "", "--num-blocks", "16"]
    good = f"a0={tiny.adapters[0][0]}"
    for flags in (["--lora-modules", good], ["--allow-runtime-lora-updating"]):
        assert main([*common, *flags]) == 2
        err = capsys.readouterr().err
        assert f"error: {flags[0]} needs --enable-lora" in err, err
    for module, words in ((f"a1={tiny.path}", "no adapter_config.json"),
                          (f"{tiny.path}={tiny.adapters[0][0]}", "served model's name")):
        assert main([*common, "--enable-lora", "--lora-modules", good, module]) == 2
        err = capsys.readouterr().err
        assert f"error: --lora-modules {module}: " in err and words in err, err
        assert "Traceback" not in err


@pytest.mark.parametrize("env, flag, routes", [
    (None, None, False), ("0", None, False), ("1", None, True), ("True", None, True),
    ("1", False, False), (None, True, True)])
def test_runtime_routes_only_when_allowed(tiny, lora_llm, monkeypatch, env, flag, routes):
    """The load/unload routes exist with VLLM_ALLOW_RUNTIME_LORA_UPDATING true-ish or the
    flag (build_app's allow_runtime_lora_updating), else they are 404s in the envelope."""
    from fastapi.testclient import TestClient

    if env is None:
        monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", env)
    engine = lora_llm.engine
    app = build_app(engine, model_name=MODEL, allow_runtime_lora_updating=flag)
    with TestClient(app) as http:
        r = http.post("/v1/load_lora_adapter",
                      json={"lora_name": "x", "lora_path": tiny.adapters[3][0]})
        if not routes:
            assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"
            return
        assert r.status_code == 200, r.text
        assert [lora.lora_name for lora in engine.list_loras()] == ["x"]
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL, "x"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 200
        assert engine.list_loras() == []
