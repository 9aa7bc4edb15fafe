"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI).

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`,
`GET /metrics`, `POST /tokenize`, `POST /detokenize`, `GET /version`, and with runtime LoRA
updating on, vLLM's `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`.
Streaming answers are server-sent events: `data: {json}` chunks, a usage chunk when asked for,
`data: [DONE]`. Every error has OpenAI's envelope `{"error": {"message", "type", "param",
"code"}}`: 400 for a bad request (the engine's ValueError, naming the field), 401 for a wrong
API key, 404 for an unknown model, 503 while overloaded or after the engine died; an
unexpected failure is a 500 whose message says so, never a traceback.

Multi-LoRA as vLLM serves it: a request's `model` names the base model or a LoRA adapter
(the adapters the engine knows when the app is built, and those loaded at run time), and
`/v1/models` lists the adapters after the base model, each with its path as `root` and the
base model as `parent`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxpage
from jaxpage.llm import chat_token_ids, merge_delta
from jaxpage.lora import LoRARequest
from jaxpage.outputs import CompletionOutput, RequestOutput
from jaxpage.serve.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineRequest,
    OverloadedError,
    RequestStream,
)
from jaxpage.serve.metrics import ServerMetrics
from jaxpage.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    UnsupportedError,
)

logger = logging.getLogger("jaxpage.serve")

# Fields a ValueError's message may start with (SamplingParams' and the engine's checks):
# the envelope's `param`.
_PARAMS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
           "stop", "stop_token_ids", "logprobs", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "prompt", "cache_salt", "messages", "top_logprobs")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)


def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _param_of(message: str) -> str | None:
    match = re.match(r"'?([a-z_]+)'?\b", message)
    return match.group(1) if match and match.group(1) in _PARAMS else None


RUNTIME_LORA_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating_allowed(environ: Any = None) -> bool:
    """Whether the environment turns runtime LoRA updating on, as vLLM reads it
    (`VLLM_ALLOW_RUNTIME_LORA_UPDATING` = 1 / true / yes / on)."""
    value = (os.environ if environ is None else environ).get(RUNTIME_LORA_UPDATING_ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def build_app(engine: Any, *, model_name: str, api_key: str | None = None,
              max_in_flight: int = 4096, on_ready: Callable[[], None] | None = None,
              allow_runtime_lora_updating: bool | None = None) -> FastAPI:
    """The server's app over an LLMEngine `engine`; its engine thread starts and stops with
    the app (uvicorn's lifespan), and `on_ready()` is called once it runs.

    The LoRA adapters the engine knows now (`engine.list_loras()`) are served under their
    names; `allow_runtime_lora_updating` (None: from `VLLM_ALLOW_RUNTIME_LORA_UPDATING`) adds
    the routes that load and unload adapters while serving."""
    metrics = ServerMetrics(model_name, engine.stats)
    async_engine = AsyncEngine(engine, max_in_flight=max_in_flight, on_output=metrics.observe)
    tokenizer = engine.tokenizer
    created = int(time.time())
    # the adapters a request's `model` may name, in the order /v1/models lists them; changed
    # on the event loop only, under lora_lock
    loras: dict[str, LoRARequest] = {}
    for lora in getattr(engine, "list_loras", list)():
        if lora.lora_name == model_name:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} has the served model's name")
        loras[lora.lora_name] = lora
    lora_lock = asyncio.Lock()
    if allow_runtime_lora_updating is None:
        allow_runtime_lora_updating = runtime_lora_updating_allowed()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        async_engine.start()
        if on_ready is not None:
            on_ready()
        yield
        await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="jaxpage", version=jaxpage.__version__, lifespan=lifespan)
    app.state.engine = async_engine
    app.state.metrics = metrics

    # ------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError):
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('msg', '')}"
            param = None
        else:
            param = loc[0] if loc else None
            message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid')}"
            if "input" in first and loc:
                message += f", got {first['input']!r}"[:300]
        return JSONResponse(error_body(message, "invalid_request_error", param), 400)

    @app.exception_handler(ValueError)
    async def _value_error(_request: Request, exc: ValueError):
        param = exc.param if isinstance(exc, UnsupportedError) else _param_of(str(exc))
        return JSONResponse(error_body(str(exc), "invalid_request_error", param), 400)

    @app.exception_handler(OverloadedError)
    async def _overloaded(_request: Request, exc: OverloadedError):
        return JSONResponse(error_body(str(exc), "server_overloaded", code="overloaded"), 503)

    @app.exception_handler(EngineDeadError)
    async def _dead(_request: Request, exc: EngineDeadError):
        return JSONResponse(error_body(str(exc), "service_unavailable",
                                       code="engine_dead"), 503)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"),
                            exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception):
        logger.exception("unexpected error")
        return JSONResponse(error_body(f"internal error ({type(exc).__name__}); see the "
                                       f"server log", "internal_server_error"), 500)

    @app.middleware("http")
    async def _check_api_key(request: Request, call_next):
        if api_key is not None and request.url.path not in ("/health", "/metrics",
                                                             "/version"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return JSONResponse(error_body("invalid API key", "invalid_request_error",
                                               code="invalid_api_key"), 401)
        return await call_next(request)

    def check_model(name: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model); a 404 for a name
        this server does not serve, as vLLM's."""
        if name is None or name == model_name:
            return None
        lora = loras.get(name)
        if lora is None:
            raise APIError(404, f"The model `{name}` does not exist.", "invalid_request_error",
                           "model", "model_not_found")
        return lora

    def need_tokenizer() -> Any:
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; send token ids")
        return tokenizer

    def check_length(num_tokens: int, param: str) -> None:
        if num_tokens >= engine.max_model_len:
            raise UnsupportedError(param, f"the prompt has {num_tokens} tokens but the "
                                          f"model's context (max_model_len) is "
                                          f"{engine.max_model_len}")

    # ------------------------------------------------------------ info routes
    @app.get("/health")
    async def health():
        if not async_engine.alive:
            return JSONResponse(error_body(f"the engine is not running: {async_engine.error}",
                                           "service_unavailable", code="engine_dead"), 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": jaxpage.__version__}

    @app.get("/metrics")
    def prometheus_metrics():  # sync: a scrape waits for a step's lock on a worker thread
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        base = {"id": model_name, "object": "model", "created": created, "owned_by": "jaxpage",
                "root": engine.config.model, "max_model_len": engine.max_model_len}
        adapters = [{"id": name, "object": "model", "created": created, "owned_by": "jaxpage",
                     "root": os.fspath(lora.lora_path), "parent": model_name,
                     "max_model_len": engine.max_model_len} for name, lora in loras.items()]
        return {"object": "list", "data": [base, *adapters]}

    # ------------------------------------------------------------ LoRA adapters at run time
    if allow_runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest):
            if not body.lora_name or not body.lora_path:
                raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                               "invalid_request_error",
                               "lora_path" if body.lora_name else "lora_name")
            # shielded, as is unloading: a client that goes away mid-way does not leave the
            # engine and `loras` disagreeing
            await asyncio.shield(load_lora(body.lora_name, body.lora_path))
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                     f"successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
            await asyncio.shield(unload_lora(body.lora_name))
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                     f"successfully.")

    async def load_lora(name: str, path: str) -> None:
        async with lora_lock:
            if name in loras:
                raise APIError(400, f"The lora adapter '{name}' has already been loaded.",
                               "invalid_request_error", "lora_name")
            if name == model_name:
                raise APIError(400, f"'{name}' is the served model's name",
                               "invalid_request_error", "lora_name")
            lora_id = max((lora.lora_int_id for lora in loras.values()), default=0) + 1
            lora = LoRARequest(name, lora_id, path)
            try:
                await async_engine.add_lora(lora)  # read and checked on the engine thread
            except ValueError as exc:  # what is wrong with the adapter
                raise APIError(400, str(exc), "invalid_request_error", "lora_path") from exc
            loras[name] = lora
        logger.info("loaded LoRA adapter %r (id %d) from %s", name, lora_id, path)

    async def unload_lora(name: str) -> None:
        async with lora_lock:
            lora = loras.get(name)
            if lora is None:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.",
                               "invalid_request_error", "lora_name", "model_not_found")
            # A request naming it from now on is a 404; one that named it before has reached
            # the engine thread's inbox ahead of the removal, and keeps the adapter in use.
            listed = dict(loras)
            del loras[name]
            try:
                await async_engine.remove_lora(lora.lora_int_id)
            except BaseException as exc:
                loras.clear()
                loras.update(listed)  # served again, in its place
                if isinstance(exc, ValueError):  # requests still use it
                    raise APIError(400, str(exc), "invalid_request_error", "lora_name") from exc
                raise
        logger.info("unloaded LoRA adapter %r (id %d)", name, lora.lora_int_id)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise UnsupportedError("prompt", "give exactly one of prompt or messages")
        if body.messages is not None:
            tokens = chat_token_ids(need_tokenizer(),
                                    [m.as_template_input() for m in body.messages])
        else:
            tokens = list(need_tokenizer().encode(body.prompt,
                                                  add_special_tokens=body.add_special_tokens))
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        for t in body.tokens:
            if not 0 <= t < engine.vocab_size:
                raise UnsupportedError("tokens", f"token ids must be in [0, "
                                                 f"{engine.vocab_size}), got {t}")
        return {"prompt": need_tokenizer().decode(body.tokens)}

    # ------------------------------------------------------------ generation
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        lora = check_model(body.model)
        prompts = []
        for prompt in body.prompts():
            ids = engine.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
            check_length(len(ids), "prompt")
            text = prompt if isinstance(prompt, str) else None
            prompts.append((ids, text))
        base = f"cmpl-{uuid.uuid4().hex}"
        engine_requests = [
            EngineRequest(f"{base}-{i}", ids,
                          body.to_sampling_params(len(ids), engine.max_model_len),
                          body.cache_salt, lora)
            for i, (ids, _text) in enumerate(prompts)]
        stream = await async_engine.submit(engine_requests)
        view = _CompletionView(base, lora.lora_name if lora else model_name, body, prompts,
                               tokenizer, engine_requests)
        if body.stream:
            return _sse(view.chunks(stream))
        return await _unless_disconnected(request, stream, view.response)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        lora = check_model(body.model)
        ids = chat_token_ids(need_tokenizer(), [m.as_template_input() for m in body.messages])
        check_length(len(ids), "messages")
        base = f"chatcmpl-{uuid.uuid4().hex}"
        engine_requests = [EngineRequest(
            f"{base}-0", ids, body.to_sampling_params(len(ids), engine.max_model_len),
            body.cache_salt, lora)]
        stream = await async_engine.submit(engine_requests)
        view = _ChatView(base, lora.lora_name if lora else model_name, body, len(ids),
                         tokenizer)
        if body.stream:
            return _sse(view.chunks(stream))
        return await _unless_disconnected(request, stream, view.response)

    return app


# ---------------------------------------------------------------- helpers
# Characters some line readers end a line at (Python's splitlines, httpx's aiter_lines)
# though SSE does not: escaped inside the JSON strings they can only appear in.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(events: AsyncIterator[dict | str]) -> StreamingResponse:
    async def body():
        async for event in events:
            data = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False)
            yield f"data: {data.translate(_LINE_BREAKS)}\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _unless_disconnected(request: Request, stream: RequestStream, respond) -> Any:
    """`await respond(stream)`, but if the client disconnects first, abort the requests."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(respond(stream))
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not work.done():
        work.cancel()
        stream.close()
        return Response(status_code=499)  # nobody reads it
    return work.result()


def _engine_error(out: RequestOutput) -> APIError:
    return APIError(500, f"the engine ended this request: {out.error}", "internal_server_error")


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _token_text(tokenizer: Any, token_id: int, as_id: bool = False) -> str:
    """A token as log-probs show it: its text, or vLLM's `token_id:<id>` when the request
    asked for return_tokens_as_token_ids (a byte fragment's text says nothing)."""
    if as_id:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


class _View:
    """What both endpoints share: the response header fields and merging deltas."""

    object_name = ""
    chunk_name = ""

    def __init__(self, base: str, model: str, tokenizer: Any) -> None:
        self.id, self.model, self.tokenizer = base, model, tokenizer
        self.created = int(time.time())

    def token_text(self, token_id: int) -> str:
        return _token_text(self.tokenizer, token_id,
                           bool(self.body.return_tokens_as_token_ids))

    def header(self, chunk: bool) -> dict[str, Any]:
        return {"id": self.id, "object": self.chunk_name if chunk else self.object_name,
                "created": self.created, "model": self.model}

    prompt_tokens = 0

    def delta_choice(self, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        """The streamed choice of one completion's delta."""
        raise NotImplementedError

    async def chunks(self, stream: RequestStream) -> AsyncIterator[dict | str]:
        """The SSE events: a chunk per delta, an error event if the engine ended a request
        or died, the usage chunk when asked for, then [DONE]."""
        generated = 0
        try:
            async for out in stream:
                if out.error is not None:
                    yield error_body(f"the engine ended this request: {out.error}",
                                     "internal_server_error")
                    continue
                for c in out.outputs:
                    generated += len(c.token_ids)
                    yield {**self.header(True), "choices": [self.delta_choice(out, c)]}
        except (EngineDeadError, OverloadedError) as exc:
            yield error_body(str(exc), "service_unavailable")
        if self.body.include_usage:
            yield {**self.header(True), "choices": [],
                   "usage": _usage(self.prompt_tokens, generated)}
        yield "[DONE]"

    async def collect(self, stream: RequestStream) -> dict[str, list[CompletionOutput]]:
        """Every request's full completions, by request id."""
        merged: dict[str, dict[int, CompletionOutput]] = {}
        final: dict[str, list[CompletionOutput]] = {}
        async for out in stream:
            if out.error is not None:
                raise _engine_error(out)
            completions = merge_delta(merged.setdefault(out.request_id, {}), out)
            if out.finished:
                final[out.request_id] = completions
        return final


class _CompletionView(_View):
    object_name = chunk_name = "text_completion"

    def __init__(self, base: str, model: str, body: CompletionRequest,
                 prompts: list[tuple[list[int], str | None]], tokenizer: Any,
                 requests: list[EngineRequest]) -> None:
        super().__init__(base, model, tokenizer)
        self.body, self.prompts = body, prompts
        self.index_of = {r.request_id: i for i, r in enumerate(requests)}
        self.prompt_tokens = sum(len(ids) for ids, _ in prompts)
        self.offsets: dict[tuple[int, int], int] = {}  # streamed text of each choice

    def prompt_text(self, i: int) -> str:
        ids, text = self.prompts[i]
        return text if text is not None else (
            self.tokenizer.decode(ids) if self.tokenizer is not None else "")

    def logprobs(self, completion: CompletionOutput, offset: int) -> dict | None:
        if completion.logprobs is None:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            text = self.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(entry[token_id])
            top.append({self.token_text(t): lp for t, lp in entry.items()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}

    def choice(self, i: int, c: CompletionOutput, text: str, offset: int) -> dict[str, Any]:
        return {"index": i * self.body.n + c.index, "text": text,
                "logprobs": self.logprobs(c, offset), "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    async def response(self, stream: RequestStream) -> dict[str, Any]:
        final = await self.collect(stream)
        choices, generated = [], 0
        for request_id, i in self.index_of.items():
            echo = self.prompt_text(i) if self.body.echo else ""
            for c in final[request_id]:
                choices.append(self.choice(i, c, echo + c.text, len(echo)))
                generated += len(c.token_ids)
        return {**self.header(False), "choices": choices,
                "usage": _usage(self.prompt_tokens, generated)}

    def delta_choice(self, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        i = self.index_of[out.request_id]
        key = (i, c.index)
        text = c.text
        if self.body.echo and key not in self.offsets:  # its first delta carries the prompt
            text = self.prompt_text(i) + text
        offset = self.offsets.get(key, 0)
        self.offsets[key] = offset + len(text)
        return self.choice(i, c, text, offset)


class _ChatView(_View):
    object_name, chunk_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, base: str, model: str, body: ChatCompletionRequest, prompt_tokens: int,
                 tokenizer: Any) -> None:
        super().__init__(base, model, tokenizer)
        self.body, self.prompt_tokens = body, prompt_tokens
        self.started: set[int] = set()  # choices whose role was sent

    def logprobs(self, completion: CompletionOutput) -> dict | None:
        if completion.logprobs is None:
            return None

        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = []
        k = self.body.top_logprobs or 0
        for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
            content.append({**item(token_id, entry[token_id]),
                            "top_logprobs": [item(t, lp) for t, lp in top]})
        return {"content": content}

    async def response(self, stream: RequestStream) -> dict[str, Any]:
        final = await self.collect(stream)
        (completions,) = final.values()
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.logprobs(c), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in completions]
        generated = sum(len(c.token_ids) for c in completions)
        return {**self.header(False), "choices": choices,
                "usage": _usage(self.prompt_tokens, generated)}

    def delta_choice(self, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if c.index not in self.started:
            self.started.add(c.index)
            delta["role"] = "assistant"
        if c.text or "role" in delta:
            delta["content"] = c.text
        return {"index": c.index, "delta": delta, "logprobs": self.logprobs(c),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
