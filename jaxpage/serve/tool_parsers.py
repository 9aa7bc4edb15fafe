"""Tool calls: the JSON schemas that enforce `tool_choice` "required" and a named function,
and the parsers that read "auto" tool calls out of a model's text (`--tool-call-parser`).

Every parser reads the whole text at the end of a completion (`extract`: content and calls,
each call's arguments as `json.dumps` of the parsed value, as vLLM's) and, while streaming,
the text so far (`ToolCallStream`): a call's header (index, id, name) goes out once its name
is complete, then its arguments as the raw text the model wrote, fragment by fragment, so that
the openai client's accumulated `arguments` is that call's JSON. Text that is not a tool call
is content; a tail that may still become a tool-call tag is held back until it cannot.

Formats:
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, content
  before the first; the one Qwen 2.5/3 and Hermes models are trained on.
- `llama3_json`: the text is (after an optional `<|python_tag|>`) one or more
  `{"name": ..., "parameters": {...}}` objects separated by `;`; Llama 3.1/3.2's JSON format.
- the array that `tool_choice="required"` constrains the output to (vLLM's):
  `[{"name": ..., "parameters": {...}}, ...]`.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


# ---------------------------------------------------------------- schemas
def tool_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema (a function without one takes an empty object)."""
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}}


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """What `tool_choice="required"` constrains the output to (vLLM's schema): a non-empty
    array of calls, each `{"name": one of the functions, "parameters": its schema}`. Each
    function's `$defs` are lifted to the top, where the `$ref`s of every branch find them."""
    branches, defs = [], {}
    for tool in tools:
        params = dict(tool_parameters(tool))
        for name, schema in params.pop("$defs", {}).items():
            if name in defs and defs[name] != schema:
                raise ValueError(f"tools: $defs {name!r} differs between functions")
            defs[name] = schema
        branches.append({"properties": {"name": {"type": "string",
                                                 "enum": [tool["function"]["name"]]},
                                        "parameters": params},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": branches}}
    if defs:
        schema["$defs"] = defs
    return schema


# ---------------------------------------------------------------- a JSON scanner
# Finds where values end in JSON text that may stop part-way (a stream's text so far): no
# value is decoded until it is complete.
_WS = " \t\r\n"


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """The end (exclusive) of the string starting at text[i] == '"', None if cut off."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """The end (exclusive) of the JSON value starting at text[i], None if the text stops
    first (a number or literal at the very end may still go on)."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    while i < len(text) and text[i] not in _WS + ",}]":
        i += 1
    return i if i < len(text) else None


@dataclasses.dataclass
class _Partial:
    """One call object as far as the text goes: its name once complete, where its arguments'
    value starts and (once complete) ends, and where the object ends."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None  # the object's end (exclusive), once closed
    bad: bool = False  # not a call object: the text is content after all


def _scan_call(text: str, i: int, args_keys: tuple[str, ...]) -> _Partial:
    """The call object starting at text[i] == '{' (keys 'name' and one of `args_keys`)."""
    call = _Partial()
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return call
        if text[i] == "}":
            call.end = i + 1
            return call
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            call.bad = True
            return call
        key_end = _string_end(text, i)
        if key_end is None:
            return call
        key = json.loads(text[i:key_end])
        i = _skip_ws(text, key_end)
        if i >= len(text):
            return call
        if text[i] != ":":
            call.bad = True
            return call
        start = _skip_ws(text, i + 1)
        end = _value_end(text, start)
        if key == "name" and end is not None:
            try:
                name = json.loads(text[start:end])
            except json.JSONDecodeError:
                call.bad = True
                return call
            if not isinstance(name, str):
                call.bad = True
                return call
            call.name = name
        elif key in args_keys and start < len(text):
            call.args_start, call.args_end = start, end
        if end is None:
            return call
        i = end


def _decode_call(obj: Any, args_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) of a decoded call object; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return obj["name"], json.dumps(args, ensure_ascii=False)


# ---------------------------------------------------------------- parsers
@dataclasses.dataclass
class _Parsed:
    """What a parser found in the text so far: the content (final, never taken back), the
    calls (complete or not), and whether the text is now known to hold tool calls."""

    content: str
    calls: list[_Partial]
    text: str


class ToolParser:
    """A `--tool-call-parser` format."""

    name = ""
    args_keys: tuple[str, ...] = ("arguments", "parameters")

    def extract(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        """(content, [(name, arguments JSON)]) of a finished completion; a text whose calls do
        not parse is all content, with no calls (as vLLM answers it)."""
        raise NotImplementedError

    def scan(self, text: str, final: bool) -> _Parsed:
        """The text so far as content and partial calls (`final`: no more text comes)."""
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    start, stop = "<tool_call>", "</tool_call>"

    def extract(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        decoder, calls, i = json.JSONDecoder(), [], at
        while i >= 0:  # each tag's JSON object: a "</tool_call>" inside a string is text
            try:
                obj, end = decoder.raw_decode(text, _skip_ws(text, i + len(self.start)))
            except json.JSONDecodeError:
                return text, []
            call = _decode_call(obj, self.args_keys)
            if call is None:
                return text, []
            calls.append(call)
            i = text.find(self.start, end)
        return text[:at] or None, calls

    def scan(self, text: str, final: bool) -> _Parsed:
        at = text.find(self.start)
        if at < 0:
            keep = 0 if final else _held_back(text, self.start)
            return _Parsed(text[:len(text) - keep], [], text)
        calls = []
        i = at
        while i >= 0:
            j = _skip_ws(text, i + len(self.start))
            if j >= len(text):
                break
            if text[j] != "{":
                calls.append(_Partial(bad=True))
                break
            call = _scan_call(text, j, self.args_keys)
            calls.append(call)
            if call.end is None or call.bad:
                break
            i = text.find(self.start, call.end)
        return _Parsed(text[:at], calls, text)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def _body(self, text: str) -> int | None:
        """Where the calls start: None when the text is not calls (no leading `{`)."""
        i = _skip_ws(text, 0)
        if text.startswith(self.python_tag, i):
            i = _skip_ws(text, i + len(self.python_tag))
        return i if text.startswith("{", i) else None

    def extract(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        i = self._body(text)
        if i is None:
            return text, []
        decoder, calls = json.JSONDecoder(), []
        while i < len(text):
            try:
                obj, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                return text, []
            call = _decode_call(obj, self.args_keys)
            if call is None:
                return text, []
            calls.append(call)
            i = _skip_ws(text, i)
            if i < len(text) and text[i] == ";":
                i = _skip_ws(text, i + 1)
        return None, calls

    def scan(self, text: str, final: bool) -> _Parsed:
        stripped = text.lstrip(_WS)
        if not final and (not stripped or self.python_tag.startswith(stripped)):
            return _Parsed("", [], text)  # cannot tell yet
        i = self._body(text)
        if i is None:
            return _Parsed(text, [], text)
        return _Parsed("", _scan_sequence(text, i, self.args_keys, ";"), text)


class RequiredParser(ToolParser):
    """The JSON array `tool_choice="required"` makes the model write."""

    name = "required"

    def extract(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        try:
            calls = [_decode_call(obj, self.args_keys) for obj in json.loads(text)]
        except (json.JSONDecodeError, TypeError):
            return text, []
        return (text, []) if None in calls else (None, calls)

    def scan(self, text: str, final: bool) -> _Parsed:
        i = _skip_ws(text, 0)
        if i >= len(text):
            return _Parsed("", [], text)
        if text[i] != "[":
            return _Parsed(text, [], text)
        return _Parsed("", _scan_sequence(text, _skip_ws(text, i + 1), self.args_keys, ","),
                       text)


def _scan_sequence(text: str, i: int, args_keys: tuple[str, ...], sep: str) -> list[_Partial]:
    """Call objects from text[i] on, separated by `sep` and whitespace."""
    calls = []
    while i < len(text) and text[i] == "{":
        call = _scan_call(text, i, args_keys)
        calls.append(call)
        if call.end is None or call.bad:
            break
        i = _skip_ws(text, call.end)
        if i < len(text) and text[i] == sep:
            i = _skip_ws(text, i + 1)
    return calls


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesParser.name: HermesParser, Llama3JsonParser.name: Llama3JsonParser}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, "
                         f"got {name!r}")
    return TOOL_PARSERS[name]()


# ---------------------------------------------------------------- streaming
class ToolCallStream:
    """One choice's streamed text turned into content and tool-call deltas.

    `feed(delta_text)` returns (content delta, [tool-call deltas]); `finish()` the rest once
    the completion has ended. A named function's arguments (`named=...`) are the whole text.
    """

    def __init__(self, parser: ToolParser | None, named: str | None = None) -> None:
        self.parser, self.named = parser, named
        self.text = ""
        self.content_sent = 0
        self.calls: list[dict[str, Any]] = []  # per call sent: id, args sent so far
        self.called = False  # a call went out (finish_reason "tool_calls" for auto)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        if self.named is not None:
            return "", self._named_deltas()
        parsed = self.parser.scan(self.text, final)
        if final and not self.calls and not any(c.name for c in parsed.calls if not c.bad):
            parsed = _Parsed(self.text, [], self.text)  # no call after all: all content
        content = parsed.content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(parsed.content))
        deltas = []
        for index, call in enumerate(parsed.calls):
            if call.bad or call.name is None:
                break
            if index == len(self.calls):
                self.calls.append({"id": tool_call_id(), "sent": 0})
                deltas.append({"index": index, "id": self.calls[index]["id"],
                               "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            sent = self.calls[index]
            if call.args_start is not None:
                end = call.args_end if call.args_end is not None else len(self.text)
                fragment = self.text[call.args_start + sent["sent"]:end]
                if fragment:
                    sent["sent"] += len(fragment)
                    deltas.append({"index": index, "function": {"arguments": fragment}})
            elif call.end is not None and sent["sent"] == 0:  # a call without arguments
                sent["sent"] = 2
                deltas.append({"index": index, "function": {"arguments": "{}"}})
        self.called = self.called or bool(self.calls)
        return content, deltas

    def _named_deltas(self) -> list[dict[str, Any]]:
        deltas = []
        if not self.calls:
            self.calls.append({"id": tool_call_id(), "sent": 0})
            deltas.append({"index": 0, "id": self.calls[0]["id"], "type": "function",
                           "function": {"name": self.named, "arguments": ""}})
        fragment = self.text[self.calls[0]["sent"]:]
        if fragment:
            self.calls[0]["sent"] += len(fragment)
            deltas.append({"index": 0, "function": {"arguments": fragment}})
        self.called = True
        return deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self.feed("", final=True)
