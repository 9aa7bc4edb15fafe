"""The OpenAI API's request bodies (and vLLM's extra sampling fields), and how they map onto
SamplingParams. Range checks are SamplingParams' and the engine's own (one owner): a bad value
is their ValueError, which the server answers with a 400 naming the field. What only the
HTTP surface has (logit_bias' string keys, response_format, tool_choice) is checked here.

Structured outputs come in four spellings, at most one per request: OpenAI's `response_format`
(`json_object`, `json_schema`), vLLM's `structured_outputs` (its StructuredOutputsParams'
fields), vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and
(chat) a `tool_choice` of "required" or a named function, which constrains the output to the
calls' JSON (tool_parsers.py).

Unknown fields are ignored, as OpenAI and vLLM ignore them; fields jaxpage cannot honour
(`suffix`, `best_of` other than n) are refused.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxpage.sampling_params import MAX_LOGIT_BIAS, RequestOutputKind, SamplingParams
from jaxpage.serve.tool_parsers import required_schema, tool_parameters
from jaxpage.structured import StructuredOutputsParams


class UnsupportedError(ValueError):
    """A field the server understands but cannot honour."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema under `schema` (`strict` is implied: the
    output always follows it)."""

    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` request field: exactly one of json, regex, choice, grammar,
    json_object. Fields jaxpage does not have (structural_tag, backend choices) are refused
    rather than ignored: the output would not be what the client asked for."""

    model_config = ConfigDict(extra="forbid")

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None


def _structured_params(field: str, **kwargs: Any) -> StructuredOutputsParams:
    """StructuredOutputsParams(**kwargs); the engine checks the schema or grammar itself (a
    ValueError at add_request), its constructor which kinds are given."""
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise UnsupportedError(field, str(e)) from None


class _SamplingRequest(BaseModel):
    """Fields common to completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None
    return_tokens_as_token_ids: bool | None = None  # log-probs' tokens as "token_id:<id>"
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    # structured outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: one backend

    def sampling_params(self, max_tokens: int, logprobs: int | None, *, prompt_len: int,
                        max_model_len: int, vocab_size: int,
                        prompt_logprobs: int | None = None,
                        structured: Any = None) -> SamplingParams:
        """SamplingParams of this request; `structured` (a StructuredOutputsParams) is the
        tool choice's constraint, which no other structured-output field may join."""
        if max_tokens > max_model_len - prompt_len:
            raise UnsupportedError("max_tokens", f"the prompt has {prompt_len} tokens and the "
                                                 f"model's context (max_model_len) is "
                                                 f"{max_model_len}: max_tokens must be <= "
                                                 f"{max_model_len - prompt_len}, got "
                                                 f"{max_tokens}")
        own = self.structured_outputs_params()
        if own is not None and structured is not None:
            raise UnsupportedError("tool_choice", "a required or named tool choice is "
                                                  "structured output itself and cannot be "
                                                  "combined with response_format, "
                                                  "structured_outputs or guided_*")
        structured = own if structured is None else structured
        optional = {"temperature": self.temperature, "top_p": self.top_p,
                    "top_k": self.top_k, "min_p": self.min_p,
                    "repetition_penalty": self.repetition_penalty,
                    # the newer fields go only where asked for
                    "logit_bias": self.logit_bias_ids(vocab_size),
                    "allowed_token_ids": self.allowed_token_ids,
                    "bad_words": self.bad_words, "prompt_logprobs": prompt_logprobs,
                    "structured_outputs": structured}
        optional = {k: v for k, v in optional.items() if v is not None}
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed,
            stop=self.stop or (), stop_token_ids=self.stop_token_ids or (),
            ignore_eos=self.ignore_eos, logprobs=logprobs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            # a response not streamed needs the end alone (the engine builds nothing before)
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            **optional,
        )

    def logit_bias_ids(self, vocab_size: int) -> dict[int, float] | None:
        """OpenAI's logit_bias ({"token id": bias}) with integer keys, each a token of the
        vocabulary and each bias in [-100, 100]."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise UnsupportedError("logit_bias", f"keys must be token ids, got "
                                                     f"{key!r}") from None
            if not 0 <= token < vocab_size:
                raise UnsupportedError("logit_bias", f"token ids must be in [0, "
                                                     f"{vocab_size}), got {token}")
            if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
                raise UnsupportedError("logit_bias", f"biases must be in [-100, 100], got "
                                                     f"{value!r} for token {token}")
            bias[token] = float(value)
        return bias

    def structured_outputs_params(self) -> Any:
        """The one structured-output constraint the request asks for (a
        StructuredOutputsParams), None for none; two spellings at once are a 400."""
        asked: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise UnsupportedError("response_format", "type json_schema needs "
                                                          "json_schema.schema")
            asked.append(("response_format", {"json": fmt.json_schema.json_schema}))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            kinds = {"json": so.json_, "regex": so.regex, "choice": so.choice,
                     "grammar": so.grammar, "json_object": so.json_object or None}
            given = {k: v for k, v in kinds.items() if v is not None}
            if len(given) != 1:
                raise UnsupportedError("structured_outputs", f"give exactly one of "
                                                             f"{sorted(kinds)}, got "
                                                             f"{sorted(given) or 'none'}")
            asked.append(("structured_outputs", {
                **given, "disable_any_whitespace": so.disable_any_whitespace,
                "whitespace_pattern": so.whitespace_pattern}))
        for field, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                            ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, field)
            if value is not None:
                asked.append((field, {kind: value,
                                      "whitespace_pattern": self.guided_whitespace_pattern}))
        if not asked:
            return None
        if len(asked) > 1:
            raise UnsupportedError(asked[1][0], f"only one kind of structured output per "
                                                f"request; {asked[0][0]} is given too")
        field, kwargs = asked[0]
        if isinstance(kwargs.get("json"), str):
            try:
                json.loads(kwargs["json"])
            except json.JSONDecodeError as e:
                raise UnsupportedError(field, f"the JSON schema is not JSON: {e}") from None
        return _structured_params(field, **{k: v for k, v in kwargs.items()
                                            if v is not None and v is not False})

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def to_sampling_params(self, prompt_len: int, max_model_len: int,
                           vocab_size: int) -> SamplingParams:
        if self.suffix:
            raise UnsupportedError("suffix", "is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedError("best_of", f"must equal n ({self.n}) when given, got "
                                              f"{self.best_of}")
        max_tokens = max_model_len - prompt_len if self.max_tokens is None else self.max_tokens
        return self.sampling_params(max_tokens, self.logprobs, prompt_len=prompt_len,
                                    max_model_len=max_model_len, vocab_size=vocab_size,
                                    prompt_logprobs=self.num_prompt_logprobs)

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The prompt log-probs the engine computes: `prompt_logprobs`, and with `echo`, the
        echoed prompt's `logprobs` (legacy completions put its tokens first)."""
        wanted = [k for k in (self.prompt_logprobs,
                              self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    def prompts(self) -> list[str | list[int]]:
        """The prompts: a string, a list of strings, token ids or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: the call it answers

    def as_template_input(self) -> dict[str, Any]:
        """The message for the chat template: content parts joined into one text, an
        assistant's tool calls with their arguments decoded (templates iterate them, as
        vLLM hands them over)."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise UnsupportedError("messages", "content parts must be "
                                                       "{'type': 'text', 'text': ...}")
                texts.append(part["text"])
            content = "\n".join(texts)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                function = call.get("function")
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise UnsupportedError("messages", "tool_calls must be {'type': "
                                                       "'function', 'function': {'name': ..., "
                                                       "'arguments': ...}}")
                arguments = function.get("arguments", "{}")
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments)
                    except json.JSONDecodeError:
                        pass  # the template gets the text
                calls.append({**call, "function": {**function, "arguments": arguments}})
            message["tool_calls"] = calls
        return message


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; "required" may return several

    def tool_plan(self, auto_parser: bool) -> tuple[str, str | None]:
        """(mode, function name): mode "none" (text only), "auto" (parsed from the text),
        "required" (an array of calls) or "named" (that function's arguments). As vLLM: no
        tool_choice means "auto" when tools are given; "auto" needs the server's tool-call
        parser; "required" with no tools is "none"."""
        choice = self.tool_choice
        if choice is None:
            choice = "auto" if self.tools else "none"
        if choice == "none":
            return "none", None
        if self.tools is None:
            raise UnsupportedError("tool_choice", "needs tools")
        if choice == "required" and not self.tools:
            return "none", None
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t.function.name for t in self.tools}:
                raise UnsupportedError("tool_choice", f"names the function "
                                                      f"{choice.function.name!r}, which is "
                                                      f"not among the tools")
            return "named", choice.function.name
        if choice == "auto" and not auto_parser:
            raise UnsupportedError("tool_choice", '"auto" tool choice requires '
                                                  '--enable-auto-tool-choice and '
                                                  '--tool-call-parser to be set')
        return choice, None

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (OpenAI's JSON)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_constraint(self, mode: str, name: str | None) -> Any:
        """The StructuredOutputsParams that enforces a required or named tool choice."""
        tools = self.tool_dicts() or []
        if mode == "named":
            tool = next(t for t in tools if t["function"]["name"] == name)
            return _structured_params("tool_choice", json=tool_parameters(tool))
        if mode == "required":
            return _structured_params("tool_choice", json=required_schema(tools))
        return None

    def to_sampling_params(self, prompt_len: int, max_model_len: int, vocab_size: int,
                           structured: Any = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedError("top_logprobs", "needs logprobs: true")
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = max_model_len - prompt_len
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, prompt_len=prompt_len,
                                    max_model_len=max_model_len, vocab_size=vocab_size,
                                    prompt_logprobs=self.prompt_logprobs,
                                    structured=structured)


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's `POST /v1/load_lora_adapter` body."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's `POST /v1/unload_lora_adapter` body (its optional `lora_int_id` is ignored: the
    name says which)."""

    lora_name: str
