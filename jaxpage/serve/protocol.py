"""The OpenAI API's request bodies (and vLLM's extra sampling fields), and how they map onto
SamplingParams. Range checks are SamplingParams' own (one owner): a bad value is its
ValueError, which the server answers with a 400 naming the field.

Unknown fields are ignored, as OpenAI and vLLM ignore them; fields jaxpage cannot honour
(`logit_bias`, `suffix`, `best_of` other than n, `echo` with `logprobs`) are refused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from jaxpage.sampling_params import SamplingParams


class UnsupportedError(ValueError):
    """A field the server understands but cannot honour."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


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

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if self.logit_bias:
            raise UnsupportedError("logit_bias", "is not supported")
        optional = {"temperature": self.temperature, "top_p": self.top_p,
                    "top_k": self.top_k, "min_p": self.min_p,
                    "repetition_penalty": self.repetition_penalty}
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed,
            stop=self.stop or (), stop_token_ids=self.stop_token_ids or (),
            ignore_eos=self.ignore_eos, logprobs=logprobs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            **{k: v for k, v in optional.items() if v is not None},
        )

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

    def to_sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        if self.suffix:
            raise UnsupportedError("suffix", "is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedError("best_of", f"must equal n ({self.n}) when given, got "
                                              f"{self.best_of}")
        if self.echo and self.logprobs is not None:
            raise UnsupportedError("echo", "with logprobs needs prompt log-probabilities, "
                                           "which jaxpage does not compute")
        max_tokens = max_model_len - prompt_len if self.max_tokens is None else self.max_tokens
        return self.sampling_params(max_tokens, self.logprobs)

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

    def as_template_input(self) -> dict[str, Any]:
        """The message for the chat template: content parts joined into one text."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise UnsupportedError("messages", "content parts must be "
                                                       "{'type': 'text', 'text': ...}")
                texts.append(part["text"])
            content = "\n".join(texts)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: Literal["none"] | None = None

    def to_sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedError("top_logprobs", "needs logprobs: true")
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = max_model_len - prompt_len
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)


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
