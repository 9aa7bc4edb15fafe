"""`LLM`: the offline facade over LLMEngine (vLLM-shaped)."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Sequence
from typing import Any

from jaxpage.config import EngineConfig
from jaxpage.engine.data_parallel import build_engine
from jaxpage.lora import LoRARequest
from jaxpage.outputs import CompletionOutput, RequestOutput
from jaxpage.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from jaxpage.validation import is_int, is_vector

Prompt = str | Sequence[int]
PromptInput = Prompt | dict  # dicts: {"prompt" | "prompt_token_ids": ..., "cache_salt": ...}


class LLM:
    """Load a model and generate from batches of prompts.

    `model` is "smollm2-135m-instruct" (default), an HF directory, a .gguf file, a
    jaxpage checkpoint or a Hugging Face Hub id ("org/name", at `revision`); or pass a model
    object with `params` (and optionally `tokenizer`) to serve your own model. Other keyword
    arguments are EngineConfig fields.
    """

    def __init__(self, model: Any = None, *, params: Any = None, tokenizer: Any = None,
                 config: EngineConfig | None = None, **engine_kwargs: Any) -> None:
        if isinstance(model, str) or model is None:
            from jaxpage.constants import DEFAULT_MODEL
            from jaxpage.loading import load_model
            from jaxpage.models import build_model

            if config is None:
                config = EngineConfig(model=model or DEFAULT_MODEL, **engine_kwargs)
            import jax

            if jax.default_backend() == "cpu":  # a first start builds the CPU kernels meanwhile
                from pallas_kernels import cpu_library

                cpu_library.start_build()
            model_config, params, loaded_tokenizer = load_model(
                config.model, config.dtype, config.cache_gguf, config.revision,
                config.quantization)
            model = build_model(model_config)
            tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
        else:
            from jaxpage.model_protocol import validate_model

            if params is None:
                raise ValueError("params must be given when model is a model object")
            validate_model(model, params)
            if config is None:
                config = EngineConfig(model=type(model).__name__, **engine_kwargs)
            if config.quantization is not None:
                raise ValueError(f"quantization {config.quantization!r} applies to a model "
                                 "jaxpage loads; a model object's params are served as given")
        self.engine = build_engine(config, model, params, tokenizer)
        self.tokenizer = tokenizer
        self._next_id = 0
        # generate() may be called from several threads: the lock orders request ids and
        # steps, and each step's outputs wait in the mailbox of the call that owns them
        self._lock = threading.Lock()
        self._owned: set[str] = set()
        self._mailbox: dict[str, list[RequestOutput]] = {}

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or many; one SamplingParams for all or one per prompt,
        and (an engine built with enable_lora) one LoRA adapter for all or one per prompt
        (None: the base model).
        A prompt is a string, a list of token ids, or a dict as vLLM takes it:
        `{"prompt": text}` or `{"prompt_token_ids": ids}`, either with `"cache_salt"` (a
        tenant's prefix-cache isolation). Returns one finished RequestOutput per prompt, in
        order; a request the engine had to end has finish_reason "abort" and `error` set."""
        prompt_list = _as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} SamplingParams for "
                                 f"{len(prompt_list)} prompts")

        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list = [lora_request] * len(prompt_list)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompt_list):
                raise ValueError(f"got {len(lora_list)} LoRA requests for "
                                 f"{len(prompt_list)} prompts")

        def add(request_id: str, prompt: PromptInput, p: SamplingParams,
                lora: LoRARequest | None) -> None:
            prompt, cache_salt = _unpack_prompt(prompt)
            self.engine.add_request(request_id, prompt, p, cache_salt=cache_salt,
                                    lora_request=lora)

        # only the end is kept: the engine builds no outputs (nor text, without stop strings)
        # before it, as vLLM's LLM asks for
        final_only: dict[int, SamplingParams] = {}
        for p in params_list:
            if isinstance(p, SamplingParams) and id(p) not in final_only:
                final_only[id(p)] = dataclasses.replace(
                    p, output_kind=RequestOutputKind.FINAL_ONLY)
        adds = [functools.partial(add, prompt=prompt, p=final_only.get(id(p), p), lora=lora)
                for prompt, p, lora in zip(prompt_list, params_list, lora_list, strict=True)]
        return self._run(self._add_all("gen", adds), use_tqdm)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, *,
                    use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Beam search for each prompt; outputs[i].outputs are the `beam_width` best
        hypotheses, best first (token_ids = generated tokens, cumulative_logprob set)."""
        adds = [functools.partial(self.engine.add_beam_request, prompt=prompt, params=params)
                for prompt in _as_prompt_list(prompts)]
        return self._run(self._add_all("beam", adds), use_tqdm)

    def _add_all(self, prefix: str, adds: list) -> list[str]:
        """Add a batch of requests (each `add(request_id)`) all or nothing: any error aborts
        those already added and is re-raised. The ids are this LLM's: outputs for them are
        kept for the call that added them, whichever thread steps the engine."""
        request_ids: list[str] = []
        try:
            for add in adds:
                with self._lock:
                    request_id = f"{prefix}-{self._next_id}"
                    self._next_id += 1
                    self._owned.add(request_id)
                request_ids.append(request_id)
                add(request_id)
        except BaseException:
            self._forget(request_ids)
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

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check a LoRA adapter now (requests naming it later skip the read);
        False if it was known already."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter no running request uses; False if it was not known."""
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_loras()

    @property
    def attention_backend(self) -> str:
        """The attention backend the engine runs, "auto" resolved for this platform ("cpp"
        or "jnp" on CPU, "pallas_gpu", "pallas_tpu"; jaxpage.attention.select_backend)."""
        replicas = getattr(self.engine, "replicas", None)  # data parallel: all alike
        return (replicas[0] if replicas else self.engine).runner.backend

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while requests are in flight."""
        return self.engine.reset_prefix_cache()

    def _run(self, request_ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        """Step the engine until every one of `request_ids` has finished. Several threads
        may run this at once: the engine steps one at a time, and whichever caller steps
        leaves each output in the mailbox of the call that owns its request. If this call
        fails (or is interrupted), its unfinished requests are aborted."""
        pending = set(request_ids)
        final: dict[str, RequestOutput] = {}
        merged: dict[str, dict[int, CompletionOutput]] = {}
        bar = None
        if use_tqdm or (use_tqdm is None and len(request_ids) > 1):
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="requests", unit="req")
        try:
            while pending:
                with self._lock:
                    mine = self._collect(pending)
                    if not mine:
                        for out in self.engine.step():
                            if out.request_id in self._owned:
                                self._mailbox.setdefault(out.request_id, []).append(out)
                        mine = self._collect(pending)
                for out in mine:
                    completions = merge_delta(merged.setdefault(out.request_id, {}), out)
                    if out.finished:
                        out.outputs = completions
                        final[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            self._forget(request_ids)  # aborts whatever did not finish
        return [final[r] for r in request_ids]

    def _collect(self, pending: set[str]) -> list[RequestOutput]:
        """Take the outputs waiting for `pending` requests (each request's in order): a pass
        over the mailbox (outputs not yet taken), not over every pending request."""
        mine = [request_id for request_id in self._mailbox if request_id in pending]
        return [out for request_id in mine for out in self._mailbox.pop(request_id)]

    def _forget(self, request_ids: list[str]) -> None:
        """Abort those of `request_ids` still running and drop their outputs."""
        with self._lock:
            for request_id in request_ids:
                self.engine.abort_request(request_id)  # nothing if already finished
                self._owned.discard(request_id)
                self._mailbox.pop(request_id, None)


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


def chat_token_ids(tokenizer: Any, conversation: list[dict],
                   tools: list[dict] | None = None) -> list[int]:
    """Token ids of a conversation under the tokenizer's chat template, ready to generate
    (`tools`: the function definitions the template shows the model, OpenAI's form)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    extra = {} if tools is None else {"tools": tools}
    encoded = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                            tokenize=True, **extra)
    if hasattr(encoded, "keys"):  # transformers >= 5 returns a BatchEncoding
        encoded = encoded["input_ids"]
    return list(encoded)


def _as_prompt_list(prompts: Any) -> list[PromptInput]:
    if prompts is None:
        raise ValueError("prompts must be a string, a list of token ids, a prompt dict or a "
                         "list of these, got None")
    if isinstance(prompts, str | dict):
        return [prompts]
    if is_vector(prompts):  # numpy token ids
        return [prompts.tolist()]
    if not hasattr(prompts, "__iter__"):
        raise ValueError(f"prompts must be a string, a list of token ids, a prompt dict or a "
                         f"list of these, got {type(prompts).__name__}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts must not be empty")
    if all(is_int(t) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def _unpack_prompt(prompt: PromptInput) -> tuple[Prompt, str | None]:
    """(text or token ids, cache salt) of a prompt; dicts as vLLM's TextPrompt and
    TokensPrompt."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
    if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict takes exactly one of 'prompt' or 'prompt_token_ids', "
                         f"and optionally 'cache_salt'; got keys {sorted(prompt)}")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"'prompt' must be a string, got {type(text).__name__}")
    return (text if text is not None else prompt["prompt_token_ids"]), prompt.get("cache_salt")
