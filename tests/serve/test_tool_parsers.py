"""The tool-call parsers on hand-written model texts: the exact calls each format holds, and
the same calls (and content) from the streamed deltas however the text is cut up, as the
openai client accumulates them (header first, then argument fragments appended).

The oracle is the hand-worked expected calls, compared as decoded JSON (a call's arguments
are a JSON string: `json.dumps` of the parsed value whole, the model's own text streamed)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from jaxpage.serve.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    RequiredParser,
    ToolCallStream,
    get_tool_parser,
    required_schema,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}

# (parser, text, content, [(name, arguments)])
CASES = [
    (HermesParser(), 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>{"name": "get_time", '
     '"arguments": {}}</tool_call>',
     "Let me look.\n", [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]),
    (HermesParser(), '<tool_call>{"name": "f", "arguments": {"s": "a}b\\"</tool_call>{", '
     '"n": [1, {"x": null}]}}</tool_call>', None,
     [("f", {"s": 'a}b"</tool_call>{', "n": [1, {"x": None}]})]),
    (HermesParser(), "No tools needed: 1 < 2 and <tool is not a tag.", "No tools needed: 1 < 2 "
     "and <tool is not a tag.", []),
    (HermesParser(), 'x <tool_call>{"name": 3}</tool_call>', 'x <tool_call>{"name": 3}'
     "</tool_call>", []),  # not a call: all content, as vLLM answers it
    (HermesParser(), '<tool_call>{"name": "get_time"}</tool_call>', None, [("get_time", {})]),
    (Llama3JsonParser(), '<|python_tag|>{"name": "get_weather", "parameters": {"city": '
     '"Oslo"}}; {"name": "get_time", "parameters": {"tz": "a;b"}}', None,
     [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "a;b"})]),
    (Llama3JsonParser(), '  {"name": "get_time", "parameters": {}}', None,
     [("get_time", {})]),
    (Llama3JsonParser(), "The weather is {fine}.", "The weather is {fine}.", []),
    (Llama3JsonParser(), "{not json", "{not json", []),
    (RequiredParser(), '[{"name": "get_weather", "parameters": {"city": "Rome"}}, '
     '{"name": "get_time", "parameters": {}}]', None,
     [("get_weather", {"city": "Rome"}), ("get_time", {})]),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_extract_finds_the_exact_calls(parser, text, content, calls):
    got_content, got_calls = parser.extract(text)
    assert got_content == content
    assert [(name, json.loads(args)) for name, args in got_calls] == calls
    for _name, args in got_calls:  # vLLM's: json.dumps of the value
        assert args == json.dumps(json.loads(args), ensure_ascii=False)


def accumulate(parser, text: str, cuts: list[int], named: str | None = None):
    """The content and calls a streaming client puts together from the deltas of `text`
    cut at `cuts`."""
    stream = ToolCallStream(parser, named)
    content, calls = "", {}
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    for text_delta, call_deltas in deltas:
        content += text_delta
        for d in call_deltas:
            if d["index"] not in calls:  # its first delta: the header
                assert d["id"].startswith("chatcmpl-tool-") and d["type"] == "function"
                assert d["function"]["name"] and d["function"]["arguments"] == ""
                assert d["index"] == len(calls)
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "args": ""}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]]["args"] += d["function"]["arguments"]
    assert len({c["id"] for c in calls.values()}) == len(calls)
    return content, [(c["name"], json.loads(c["args"])) for c in calls.values()], stream


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_streamed_deltas_add_up_to_the_calls(parser, text, content, calls):
    rng = random.Random(0)
    cuttings = [list(range(1, len(text))), []]  # a character at a time, all at once
    cuttings += [sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
                 for _ in range(20)]
    for cuts in cuttings:
        got_content, got_calls, stream = accumulate(parser, text, cuts)
        assert got_content == (content or "")
        assert got_calls == calls
        assert stream.called == bool(calls)


def test_a_streamed_call_goes_out_name_first_then_arguments():
    """The header is sent as soon as the name is complete, before the arguments end."""
    stream = ToolCallStream(HermesParser())
    assert stream.feed("Hi <tool_ca") == ("Hi ", [])  # a tag may be starting: held back
    assert stream.feed('ll>{"name": "get_wea') == ("", [])
    content, deltas = stream.feed('ther", "arguments": {"ci')
    assert content == "" and len(deltas) == 2
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[1] == {"index": 0, "function": {"arguments": '{"ci'}}
    assert stream.feed('ty": "Paris"}}</tool_call>') == (
        "", [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}])


def test_named_function_streams_the_whole_text_as_arguments():
    text = '{"city": "Lima"}'
    content, calls, stream = accumulate(None, text, [3, 9], named="get_weather")
    assert content == "" and calls == [("get_weather", {"city": "Lima"})] and stream.called


def test_required_schema_is_vllms_array_of_calls():
    schema = required_schema([WEATHER, TIME])
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "parameters": {"city": "Rome"}},
          {"name": "get_time", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"unit": "c"}}],
                [{"name": "nope", "parameters": {}}], [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    # $defs move to the top, where the branches' $refs resolve
    with_defs = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
        "$defs": {"P": {"type": "integer"}}}}}
    schema = required_schema([with_defs])
    assert schema["$defs"] == {"P": {"type": "integer"}}
    jsonschema.validate([{"name": "g", "parameters": {"p": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "g", "parameters": {"p": "x"}}], schema)


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("mistral")
