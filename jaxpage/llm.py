"""`LLM`: the offline facade over LLMEngine (vLLM-shaped)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxpage.config import EngineConfig
from jaxpage.engine.engine import LLMEngine
from jaxpage.outputs import CompletionOutput, RequestOutput
from jaxpage.sampling_params import BeamSearchParams, SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Load a model and generate from batches of prompts.

    `model` is "smollm2-135m-instruct" (default), an HF directory, a .gguf file or a
    jaxpage checkpoint; or pass a model object with `params` (and optionally `tokenizer`)
    to serve your own model. Other keyword arguments are EngineConfig fields.
    """

    def __init__(self, model: Any = None, *, params: Any = None, tokenizer: Any = None,
                 config: EngineConfig | None = None, **engine_kwargs: Any) -> None:
        if isinstance(model, str) or model is None:
            from jaxpage.loading import DEFAULT_MODEL, load_model
            from jaxpage.models.llama import LlamaModel

            if config is None:
                config = EngineConfig(model=model or DEFAULT_MODEL, **engine_kwargs)
            model_config, params, loaded_tokenizer = load_model(config.model, config.dtype)
            model = LlamaModel(model_config)
            tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
        else:
            from jaxpage.model_protocol import validate_model

            if params is None:
                raise ValueError("params must be given when model is a model object")
            validate_model(model, params)
            if config is None:
                config = EngineConfig(model=type(model).__name__, **engine_kwargs)
        self.engine = LLMEngine(config, model, params, tokenizer)
        self.tokenizer = tokenizer
        self._next_id = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or many (strings or token-id lists); one SamplingParams
        for all or one per prompt. Returns one finished RequestOutput per prompt, in order."""
        prompt_list = _as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} SamplingParams for "
                                 f"{len(prompt_list)} prompts")
        adds = [lambda rid, prompt=prompt, p=p: self.engine.add_request(rid, prompt, p)
                for prompt, p in zip(prompt_list, params_list, strict=True)]
        return self._run(self._add_all("gen", adds), use_tqdm)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, *,
                    use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Beam search for each prompt; outputs[i].outputs are the `beam_width` best
        hypotheses, best first (token_ids = generated tokens, cumulative_logprob set)."""
        adds = [lambda rid, prompt=prompt: self.engine.add_beam_request(rid, prompt, params)
                for prompt in _as_prompt_list(prompts)]
        return self._run(self._add_all("beam", adds), use_tqdm)

    def _add_all(self, prefix: str, adds: list) -> list[str]:
        """Add a batch of requests (each `add(request_id)`) all or nothing: a bad one aborts
        those already added and re-raises its ValueError."""
        request_ids: list[str] = []
        try:
            for add in adds:
                request_id = f"{prefix}-{self._next_id}"
                self._next_id += 1
                add(request_id)
                request_ids.append(request_id)
        except ValueError:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return request_ids

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | None = None, **kwargs: Any) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or many, then generate."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [chat_token_ids(self.tokenizer, conv) for conv in conversations]
        return self.generate(prompts, params, **kwargs)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while requests are in flight."""
        return self.engine.reset_prefix_cache()

    def _run(self, request_ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        pending = set(request_ids)
        final: dict[str, RequestOutput] = {}
        merged: dict[str, dict[int, CompletionOutput]] = {}
        bar = None
        if use_tqdm or (use_tqdm is None and len(request_ids) > 1):
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="requests", unit="req")
        while pending:
            for out in self.engine.step():
                if out.request_id not in pending:
                    continue
                completions = merge_delta(merged.setdefault(out.request_id, {}), out)
                if out.finished:
                    out.outputs = completions
                    final[out.request_id] = out
                    pending.discard(out.request_id)
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [final[r] for r in request_ids]


def merge_delta(merged: dict[int, CompletionOutput], out: RequestOutput) -> list[CompletionOutput]:
    """Accumulate a streaming delta into the request's full completions (by sample index);
    returns them in index order."""
    for delta in out.outputs:
        full = merged.setdefault(delta.index, CompletionOutput(
            index=delta.index, logprobs=None if delta.logprobs is None else []))
        full.text += delta.text
        full.token_ids.extend(delta.token_ids)
        if full.logprobs is not None and delta.logprobs:
            full.logprobs.extend(delta.logprobs)
        full.cumulative_logprob = delta.cumulative_logprob
        full.finish_reason, full.stop_reason = delta.finish_reason, delta.stop_reason
    return [merged[i] for i in sorted(merged)]


def chat_token_ids(tokenizer: Any, conversation: list[dict]) -> list[int]:
    """Token ids of a conversation under the tokenizer's chat template, ready to generate."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    encoded = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                            tokenize=True)
    if hasattr(encoded, "keys"):  # transformers >= 5 returns a BatchEncoding
        encoded = encoded["input_ids"]
    return list(encoded)


def _as_prompt_list(prompts: Any) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    if not prompts:
        raise ValueError("prompts must not be empty")
    return prompts

