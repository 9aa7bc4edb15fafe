"""Structured outputs, tool calls, logit_bias and prompt log-probs through the real server
(`python -m jaxpage.serve --enable-auto-tool-choice --tool-call-parser hermes` on 127.0.0.1,
a tiny random-weight Llama whose chat template renders `tools`), driven by the real `openai`
client and by `httpx`.

Oracles: `jsonschema` (every constrained output validates against its schema, every tool
call's arguments against its function's parameters), `re.fullmatch` for regexes, the exact
calls a hand-built Hermes text holds, and `LLM` in this process for what the server must
pass through unchanged (the same greedy tokens, the engine's prompt log-probs).
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from conftest import build_hf_model, byte_level_bpe_tokenizer
from test_server import API_KEY, ENGINE, MODEL, auth, running_server

from jaxpage import LLM, SamplingParams

TOOLS_TEMPLATE = (
    "{% if tools %}<s>tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n"
    "{% endif %}{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}"
    "</tool_call>{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<s>assistant:"
    "{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
        "required": ["hour"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0,
                                              "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1,
     "maxItems": 3},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "tag": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
     "required": ["ok", "tag"], "additionalProperties": False},
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools_model")
    tokenizer = byte_level_bpe_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    build_hf_model("llama", 0, vocab_size=len(tokenizer)).save_pretrained(
        path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir, "--enable-auto-tool-choice", "--tool-call-parser",
                        "hermes") as url:
        yield url


@pytest.fixture(scope="module")
def oracle(model_dir):
    return LLM(model_dir, **ENGINE)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL, **body}, headers=auth(),
                      timeout=120)


def error_of(r: httpx.Response, param: str | None) -> dict:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    return error


def streamed_choices(stream) -> dict[int, dict]:
    """Each choice's content, tool calls and finish reason, accumulated from the openai
    client's chunks as its own stream helper does (calls by index, arguments appended)."""
    choices: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            acc = choices.setdefault(c.index, {"content": "", "calls": {}, "finish": None})
            acc["content"] += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = acc["calls"].setdefault(d.index, {"id": None, "name": None,
                                                         "arguments": ""})
                if d.id:
                    assert call["id"] is None, "a call's id is sent once"
                    call["id"] = d.id
                if d.function and d.function.name:
                    call["name"] = d.function.name
                if d.function and d.function.arguments:
                    assert call["name"] is not None, "arguments before the name"
                    call["arguments"] += d.function.arguments
            if c.finish_reason:
                acc["finish"] = c.finish_reason
    return choices


def check_call(name: str, arguments: str) -> None:
    """A call names one of TOOLS and its arguments validate against that one's schema."""
    tool = next(t for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


# ---------------------------------------------------------------- without the engine's part
def test_tools_reach_the_template_and_none_is_plain_text(client, oracle):
    """tool_choice "none": the tools are in the prompt (the chat template's rendering, token
    for token), the answer is LLM's greedy text for that prompt, as content."""
    def template(**tools):
        return oracle.tokenizer.encode(oracle.tokenizer.apply_chat_template(
            USER, add_generation_prompt=True, tokenize=False, **tools),
            add_special_tokens=False)

    ids = template(tools=TOOLS)
    assert len(ids) > len(template())
    want = oracle.generate([ids], SamplingParams(max_tokens=8, temperature=0.0,
                                                 ignore_eos=True))[0].outputs[0].text
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                       tool_choice="none", max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == want and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "length"


def test_tool_call_history_reaches_the_template(server, oracle):
    """An assistant's earlier tool call (arguments a JSON string, as OpenAI sends them) and
    the tool's answer: the template sees the call's arguments decoded."""
    messages = [*USER, {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    rendered = oracle.tokenizer.apply_chat_template(
        [*messages[:1], {**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0],
                                                         "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
         messages[2]], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '"arguments": {"city": "Paris"' in rendered
    r = post(server, "/v1/chat/completions", {"messages": messages, "tools": TOOLS,
                                               "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(oracle.tokenizer.encode(
        rendered, add_special_tokens=False))


@pytest.mark.parametrize("body, param, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"logit_bias": {"abc": 3}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"400": 1}}, "logit_bias", "[0, 400)"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "[0, 400)"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
     "only one kind"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
])
def test_bad_fields_are_400s_naming_them(server, body, param, words):
    r = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, **body})
    assert words in error_of(r, param)["message"]


def test_required_tool_choice_with_another_constraint_is_a_400(server):
    r = post(server, "/v1/chat/completions", {
        "messages": USER, "tools": TOOLS, "tool_choice": "required",
        "response_format": {"type": "json_object"}})
    error_of(r, "tool_choice")


# ---------------------------------------------------------------- structured outputs
@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_validates(client, stream):
    """Sampled (n=2, temperature 1) outputs under three schemas: every one validates."""
    for i, schema in enumerate(SCHEMAS):
        kwargs = dict(model=MODEL, messages=USER, n=2, temperature=1.0, seed=i,
                      max_tokens=200, response_format={"type": "json_schema", "json_schema": {
                          "name": f"s{i}", "schema": schema, "strict": True}})
        if stream:
            outs = [(c["content"], c["finish"]) for c in streamed_choices(
                client.chat.completions.create(stream=True, **kwargs)).values()]
        else:
            r = client.chat.completions.create(**kwargs)
            outs = [(c.message.content, c.finish_reason) for c in r.choices]
        assert len(outs) == 2
        for text, finish in outs:
            assert finish == "stop", text
            jsonschema.validate(json.loads(text), schema)


def test_completions_structured_fields(server):
    """Completions with each spelling: guided_regex, guided_choice, structured_outputs
    (regex, choice, json), response_format json_object, guided_json."""
    base = {"prompt": "The answer:", "max_tokens": 60, "temperature": 1.0, "n": 3,
            "seed": 7}
    regex = r"[0-9]{3}-[a-z]{2}"
    cases = [
        ({"guided_regex": regex}, lambda t: re.fullmatch(regex, t)),
        ({"structured_outputs": {"regex": regex}}, lambda t: re.fullmatch(regex, t)),
        ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"guided_json": SCHEMAS[1]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[1])
         or True),
        ({"structured_outputs": {"json": json.dumps(SCHEMAS[0]),
                                 "disable_any_whitespace": True}},
         lambda t: jsonschema.validate(json.loads(t), SCHEMAS[0]) or True),
    ]
    for extra, ok in cases:
        r = post(server, "/v1/completions", {**base, **extra})
        assert r.status_code == 200, (extra, r.text)
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "stop" and ok(choice["text"]), (extra, choice)
    # any JSON object: its strings are unbounded, so a random model may run out of tokens
    # inside one; a finished one is an object, an unfinished one is on its way to one
    r = post(server, "/v1/completions", {**base, "response_format": {"type": "json_object"}})
    for choice in r.json()["choices"]:
        text = choice["text"]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert text.lstrip().startswith("{"), text
            with pytest.raises(json.JSONDecodeError, match="Unterminated|Expecting"):
                json.loads(text)


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}},
    {"guided_regex": "(unclosed"},
    {"guided_grammar": "start: ???"},
])
def test_a_bad_schema_or_grammar_is_a_400(server, body):
    r = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    ok = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2})
    assert ok.status_code == 200  # nothing else was harmed


# ---------------------------------------------------------------- tool calls
@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice(client, stream):
    """A named function: one call of it, arguments valid for its schema; finish_reason
    "stop" (OpenAI and vLLM keep "tool_calls" for auto and required)."""
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, n=2, temperature=1.0, seed=3,
                  max_tokens=100, tool_choice={"type": "function",
                                               "function": {"name": "get_time"}})
    if stream:
        choices = streamed_choices(client.chat.completions.create(stream=True, **kwargs))
        calls = [(list(c["calls"].values()), c["finish"], c["content"])
                 for c in choices.values()]
        calls = [([(x["id"], x["name"], x["arguments"]) for x in cs], f, t)
                 for cs, f, t in calls]
    else:
        r = client.chat.completions.create(**kwargs)
        calls = [([(x.id, x.function.name, x.function.arguments)
                   for x in c.message.tool_calls], c.finish_reason, c.message.content or "")
                 for c in r.choices]
    assert len(calls) == 2
    for call_list, finish, content in calls:
        assert finish == "stop" and content == ""
        ((call_id, name, arguments),) = call_list
        assert call_id.startswith("chatcmpl-tool-") and name == "get_time"
        check_call(name, arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice(client, stream):
    """"required": one call or more, each of a listed function with valid arguments;
    finish_reason "tool_calls". vLLM's array schema bounds neither the number of calls nor
    the whitespace, and a random model fills both until it runs out of tokens: such a choice
    ends with "length", its text as content when whole (it is not a complete array), and
    streamed, every call but the last one cut off is whole and valid."""
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, n=2, temperature=1.0, seed=5,
                  max_tokens=240, tool_choice="required")
    if stream:
        choices = streamed_choices(client.chat.completions.create(stream=True, **kwargs))
        got = [([(x["name"], x["arguments"]) for x in c["calls"].values()], c["finish"],
                c["content"]) for c in choices.values()]
    else:
        r = client.chat.completions.create(**kwargs)
        got = [([(x.function.name, x.function.arguments)
                 for x in c.message.tool_calls or []], c.finish_reason,
                c.message.content or "") for c in r.choices]
    assert len(got) == 2
    checked = 0
    for calls, finish, content in got:
        assert finish in ("tool_calls", "length")
        if finish == "length":
            if not stream:
                assert not calls and content.lstrip().startswith("[")
            calls = calls[:-1]  # the last one may be cut off
        else:
            assert calls and content == ""
        for name, arguments in calls:
            check_call(name, arguments)
            checked += 1
    assert checked or not stream


HERMES = (r'Sure\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
          r'"unit": "(c|f)"\}\}</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_are_parsed_from_the_text(client, stream):
    """tool_choice "auto" with the hermes parser: the model is made to write a Hermes tool
    call (a regex constraint), and the server's parser turns it into content and a call."""
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="auto", n=2,
                  temperature=1.0, seed=11, max_tokens=120,
                  extra_body={"structured_outputs": {"regex": HERMES}})
    if stream:
        choices = streamed_choices(client.chat.completions.create(stream=True, **kwargs))
        got = [(c["content"], [(x["name"], x["arguments"]) for x in c["calls"].values()],
                c["finish"]) for c in choices.values()]
    else:
        r = client.chat.completions.create(**kwargs)
        got = [(c.message.content, [(x.function.name, x.function.arguments)
                                    for x in c.message.tool_calls or []], c.finish_reason)
               for c in r.choices]
    for content, calls, finish in got:
        assert content == "Sure." and finish == "tool_calls"
        ((name, arguments),) = calls
        assert name == "get_weather" and json.loads(arguments)["city"] in ("Paris", "Rome")
        check_call(name, arguments)


# ---------------------------------------------------------------- logit_bias, prompt log-probs
def test_logit_bias_moves_greedy_choices(server, oracle):
    """+100 on one token: greedy decoding emits it at every step; -100 on the token greedy
    decoding picks first: it is not picked."""
    prompt = "The café on the corner"
    first = oracle.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[
        0].outputs[0].token_ids[0]
    target = (first + 37) % 400
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}
    r = post(server, "/v1/completions", {**body, "logit_bias": {str(target): 100}})
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    assert tokens == [f"token_id:{target}"] * 4
    r = post(server, "/v1/completions", {**body, "logit_bias": {str(first): -100}})
    assert r.json()["choices"][0]["logprobs"]["tokens"][0] != f"token_id:{first}"


def test_echo_with_logprobs_puts_the_prompts_first(server, oracle):
    """echo + logprobs: the prompt's tokens come first with the engine's prompt log-probs
    (the first one null), then the completion's; prompt_logprobs as vLLM returns them."""
    prompt = "Plain English text about"
    ids = oracle.engine.tokenize(prompt)
    out = oracle.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, logprobs=2,
                                                   prompt_logprobs=2, ignore_eos=True))[0]
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                         "logprobs": 2, "echo": True, "ignore_eos": True,
                                         "prompt_logprobs": 2,
                                         "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    all_ids = ids + out.outputs[0].token_ids
    assert lp["tokens"] == [f"token_id:{t}" for t in all_ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    entries = out.prompt_logprobs[1:] + out.outputs[0].logprobs
    want = [e[t] for t, e in zip(all_ids[1:], entries, strict=True)]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
    for top, e in zip(lp["top_logprobs"][1:], entries, strict=True):
        assert top == pytest.approx({f"token_id:{t}": v for t, v in e.items()}, abs=1e-5)
    assert choice["text"].startswith(prompt)
    prompt_lps = choice["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
    for token, got, e in zip(ids[1:], prompt_lps[1:], out.prompt_logprobs[1:], strict=True):
        assert set(got) == {str(t) for t in e} and str(token) in got
        assert got[str(token)]["logprob"] == pytest.approx(e[token], abs=1e-5)
        ranks = sorted((v["rank"] for k, v in got.items() if v["rank"] is not None))
        assert ranks == list(range(1, len(ranks) + 1)) and len(ranks) >= 2


def test_allowed_token_ids_and_bad_words_pass_through(server, oracle):
    """vLLM's allowed_token_ids and bad_words reach the engine: the server's greedy tokens
    are LLM's under the same parameters, and every one is an allowed token."""
    prompt = "The café on the corner"
    allowed = list(range(100, 140))
    for extra in ({"allowed_token_ids": allowed}, {"bad_words": ["the", " corner"]}):
        want = oracle.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0,
                                                        ignore_eos=True, **extra))[0]
        r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 6,
                                             "temperature": 0, "ignore_eos": True,
                                             "logprobs": 0,
                                             "return_tokens_as_token_ids": True, **extra})
        tokens = [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
        assert tokens == want.outputs[0].token_ids
        if "allowed_token_ids" in extra:
            assert set(tokens) <= set(allowed)
