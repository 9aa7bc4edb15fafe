"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI).

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`,
`GET /metrics`, `POST /tokenize`, `POST /detokenize`, `GET /version`, and with runtime LoRA
updating on, vLLM's `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`.
Streaming answers are server-sent events: `data: {json}` chunks, a usage chunk when asked for,
`data: [DONE]`. Every error has OpenAI's envelope `{"error": {"message", "type", "param",
"code"}}`: 400 for a bad request (the engine's ValueError, naming the field), 401 for a wrong
API key, 404 for an unknown model, 503 while overloaded or after the engine died; an
unexpected failure is a 500 whose message says so, never a traceback.

Limits, each a 4xx naming it: a body over `max_request_body_bytes` is a 413 before it is
read (its Content-Length) or as soon as it passes the limit (a chunked body); a prompt of
max_model_len tokens or more, max_tokens beyond what the context leaves, n beyond the
engine's running slots and a list of more prompts than `max_in_flight` are 400s. Prompts and
chat templates are tokenized on worker threads: a large prompt does not hold up other
requests (the event loop only parses JSON).

Structured outputs and tool calls (protocol.py, tool_parsers.py): `response_format`,
`structured_outputs` and `guided_*` constrain the output; `tools` go to the chat template,
`tool_choice` "required" or a named function constrains the output to the calls' JSON and
returns them as `message.tool_calls`, "auto" parses them out of the text with the server's
`tool_parser` (vLLM's `--tool-call-parser`).

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
from jaxpage.serve.tool_parsers import (
    RequiredParser,
    ToolCallStream,
    ToolParser,
    get_tool_parser,
    tool_call_id,
)

logger = logging.getLogger("jaxpage.serve")

# Fields a ValueError's message may start with (SamplingParams' and the engine's checks):
# the envelope's `param`.
_PARAMS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
           "stop", "stop_token_ids", "logprobs", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "prompt", "cache_salt", "messages", "top_logprobs",
           "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs",
           "structured_outputs", "response_format", "tools", "tool_choice", "guided_json",
           "guided_regex", "guided_choice", "guided_grammar")

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20


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
              allow_runtime_lora_updating: bool | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              tool_parser: str | None = None) -> FastAPI:
    """The server's app over an LLMEngine `engine`; its engine thread starts and stops with
    the app (uvicorn's lifespan), and `on_ready()` is called once it runs.

    The LoRA adapters the engine knows now (`engine.list_loras()`) are served under their
    names; `allow_runtime_lora_updating` (None: from `VLLM_ALLOW_RUNTIME_LORA_UPDATING`) adds
    the routes that load and unload adapters while serving. `tool_parser` (a name in
    tool_parsers.TOOL_PARSERS) turns on `tool_choice="auto"`."""
    auto_parser = None if tool_parser is None else get_tool_parser(tool_parser)
    if max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be >= 1, got {max_request_body_bytes}")
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

    # outermost: a body over the limit is refused before any other middleware reads it
    app.add_middleware(BodyLimit, max_bytes=max_request_body_bytes)

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

    def check_count(num_prompts: int) -> None:
        """A list of prompts that can never be in flight at once is a 400, not a 503."""
        if num_prompts > async_engine.max_in_flight:
            raise UnsupportedError("prompt", f"{num_prompts} prompts in one request, but the "
                                             f"server takes at most {async_engine.max_in_flight}"
                                             f" in flight (--max-in-flight)")

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
        texts = body.prompts()
        check_count(len(texts))

        def tokenize() -> list[tuple[list[int], str | None]]:
            return [(engine.tokenize(p), p) if isinstance(p, str) else (list(p), None)
                    for p in texts]

        prompts = await asyncio.to_thread(tokenize)
        for ids, _text in prompts:
            check_length(len(ids), "prompt")
        base = f"cmpl-{uuid.uuid4().hex}"
        engine_requests = [
            EngineRequest(f"{base}-{i}", ids,
                          body.to_sampling_params(len(ids), engine.max_model_len,
                                                  engine.vocab_size),
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
        mode, function = body.tool_plan(auto_parser is not None)
        constraint = body.tool_constraint(mode, function)
        conversation = [m.as_template_input() for m in body.messages]
        ids = await asyncio.to_thread(chat_token_ids, need_tokenizer(), conversation,
                                      body.tool_dicts())
        check_length(len(ids), "messages")
        base = f"chatcmpl-{uuid.uuid4().hex}"
        engine_requests = [EngineRequest(
            f"{base}-0", ids, body.to_sampling_params(len(ids), engine.max_model_len,
                                                      engine.vocab_size, constraint),
            body.cache_salt, lora)]
        stream = await async_engine.submit(engine_requests)
        parser = {"auto": auto_parser, "required": RequiredParser()}.get(mode)
        view = _ChatView(base, lora.lora_name if lora else model_name, body, len(ids),
                         tokenizer, mode, function, parser, ids)
        if body.stream:
            return _sse(view.chunks(stream))
        return await _unless_disconnected(request, stream, view.response)

    return app


# ---------------------------------------------------------------- helpers
class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is a 413 in OpenAI's envelope. A
    Content-Length over it is refused before a byte of the body is read; a body without one
    (chunked) is counted as it arrives and refused once it passes the limit, so that the
    server never holds more than `max_bytes` of it. The body read here is handed on whole."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self.refuse(send, f"{int(length)} bytes")
            return
        chunks, size, message = [], 0, {"type": "http.request", "more_body": True}
        while message["type"] == "http.request" and message.get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left: the app sees the disconnect
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self.refuse(send, f"over {self.max_bytes} bytes")
                return
        replay = ({"type": "http.request", "body": b"".join(chunks), "more_body": False}
                  if message["type"] == "http.request" else message)
        sent = False

        async def receive_again() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return replay
            return await receive()

        await self.app(scope, receive_again, send)

    async def refuse(self, send: Callable, size: str) -> None:
        body = json.dumps(error_body(
            f"the request body ({size}) is larger than the server takes "
            f"(--max-request-body-bytes {self.max_bytes})", "invalid_request_error",
            code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


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


def _lp(value: float) -> float:
    """A log-prob as JSON can carry it: -inf (a token masked out) as -9999.0, as vLLM."""
    return max(value, -9999.0)


class _View:
    """What both endpoints share: the response header fields and merging deltas."""

    object_name = ""
    chunk_name = ""

    def __init__(self, base: str, model: str, tokenizer: Any) -> None:
        self.id, self.model, self.tokenizer = base, model, tokenizer
        self.created = int(time.time())
        self.prompt_lps: dict[str, list | None] = {}  # per request, once the engine has them

    def token_text(self, token_id: int) -> str:
        return _token_text(self.tokenizer, token_id,
                           bool(self.body.return_tokens_as_token_ids))

    def header(self, chunk: bool) -> dict[str, Any]:
        return {"id": self.id, "object": self.chunk_name if chunk else self.object_name,
                "created": self.created, "model": self.model}

    prompt_tokens = 0

    def note(self, out: RequestOutput) -> None:
        """Keep a request's prompt log-probs (the engine sends them once)."""
        lps = out.prompt_logprobs
        if lps is not None:
            self.prompt_lps[out.request_id] = lps

    def prompt_logprobs_json(self, request_id: str, prompt_ids: list[int]) -> list | None:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
        rank, decoded_token}} of that token and its position's top-k (rank: 1 for the most
        likely; None for the prompt token where it is not among the top-k)."""
        lps = self.prompt_lps.get(request_id)
        if lps is None:
            return None
        k = self.body.prompt_logprobs or 0
        result = []
        for token_id, entry in zip(prompt_ids, lps, strict=False):
            if entry is None:
                result.append(None)
                continue
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])
            # more than k entries: the prompt token is the one beyond the top-k
            top = [t for t, _ in ranked if len(entry) <= k or t != token_id]
            rank = {t: i + 1 for i, t in enumerate(top)}
            result.append({str(t): {"logprob": _lp(lp), "rank": rank.get(t),
                                    "decoded_token": self.token_text(t)}
                           for t, lp in ranked})
        return result

    def delta_choice(self, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        """The streamed choice of one completion's delta."""
        raise NotImplementedError

    def stream_extras(self, out: RequestOutput) -> dict[str, Any]:
        """Top-level fields of a chunk besides its choices."""
        return {}

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
                self.note(out)
                for c in out.outputs:
                    generated += len(c.token_ids)
                    yield {**self.header(True), "choices": [self.delta_choice(out, c)],
                           **self.stream_extras(out)}
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
            self.note(out)
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

    def logprobs(self, completion: CompletionOutput, offset: int,
                 prompt: tuple[list[int], list] | None = None) -> dict | None:
        """Legacy completions' log-probs; with `prompt` (echo: its token ids and their
        log-probs), the prompt's tokens first, the first one's log-prob and top null."""
        if completion.logprobs is None:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        steps = list(zip(completion.token_ids, completion.logprobs, strict=True))
        if prompt is not None:
            steps = list(zip(*prompt, strict=False)) + steps
        for token_id, entry in steps:
            text = self.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(None if entry is None else _lp(entry[token_id]))
            top.append(None if entry is None else {self.token_text(t): _lp(lp)
                                                   for t, lp in entry.items()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}

    def echoed(self, request_id: str, i: int) -> tuple[list[int], list] | None:
        """The prompt's token ids and log-probs that echo puts before the completion's."""
        if not (self.body.echo and self.body.logprobs is not None):
            return None
        lps = self.prompt_lps.get(request_id)
        return None if lps is None else (self.prompts[i][0], lps)

    def choice(self, request_id: str, i: int, c: CompletionOutput, text: str, offset: int,
               first: bool) -> dict[str, Any]:
        choice = {"index": i * self.body.n + c.index, "text": text,
                  "logprobs": self.logprobs(c, offset,
                                            self.echoed(request_id, i) if first else None),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.body.prompt_logprobs is not None and first:
            choice["prompt_logprobs"] = self.prompt_logprobs_json(request_id,
                                                                  self.prompts[i][0])
        return choice

    async def response(self, stream: RequestStream) -> dict[str, Any]:
        final = await self.collect(stream)
        choices, generated = [], 0
        for request_id, i in self.index_of.items():
            echo = self.prompt_text(i) if self.body.echo else ""
            # with the prompt's log-probs, text offsets count from the prompt's first token
            offset = 0 if self.echoed(request_id, i) else len(echo)
            for c in final[request_id]:
                choices.append(self.choice(request_id, i, c, echo + c.text, offset, True))
                generated += len(c.token_ids)
        return {**self.header(False), "choices": choices,
                "usage": _usage(self.prompt_tokens, generated)}

    def delta_choice(self, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        i = self.index_of[out.request_id]
        key = (i, c.index)
        text = c.text
        first = key not in self.offsets
        if self.body.echo and first:  # its first delta carries the prompt
            text = self.prompt_text(i) + text
        offset = self.offsets.get(key, 0)
        choice = self.choice(out.request_id, i, c, text, offset, first)
        self.offsets[key] = offset + (len(text) if choice["logprobs"] is None else sum(
            map(len, choice["logprobs"]["tokens"])))
        return choice


class _ChatView(_View):
    """Chat completions; with tools, `mode` says how the text becomes tool calls ("none":
    it does not; "named": it is the named function's arguments; "required" and "auto":
    `parser` reads the calls out of it)."""

    object_name, chunk_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, base: str, model: str, body: ChatCompletionRequest, prompt_tokens: int,
                 tokenizer: Any, mode: str = "none", function: str | None = None,
                 parser: ToolParser | None = None, prompt_ids: list[int] | None = None) -> None:
        super().__init__(base, model, tokenizer)
        self.body, self.prompt_tokens = body, prompt_tokens
        self.mode, self.function, self.parser = mode, function, parser
        self.prompt_ids = prompt_ids or []
        self.started: set[int] = set()  # choices whose role was sent
        self.streams: dict[int, ToolCallStream] = {}
        self.sent_prompt_logprobs = False

    def logprobs(self, completion: CompletionOutput) -> dict | None:
        if completion.logprobs is None:
            return None

        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": _lp(logprob),
                    "bytes": list(text.encode("utf-8"))}

        content = []
        k = self.body.top_logprobs or 0
        for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
            content.append({**item(token_id, entry[token_id]),
                            "top_logprobs": [item(t, lp) for t, lp in top]})
        return {"content": content}

    def finish_reason(self, c: CompletionOutput, called: bool) -> str | None:
        """OpenAI's: "tool_calls" when auto found calls or required ended them (vLLM's
        rule), the engine's reason otherwise (a named function's too)."""
        if c.finish_reason is None:
            return None
        if called and (self.mode == "auto" or (self.mode == "required"
                                               and c.finish_reason == "stop")):
            return "tool_calls"
        return c.finish_reason

    def message(self, c: CompletionOutput) -> tuple[dict[str, Any], bool]:
        """The choice's message and whether it holds tool calls."""
        if self.mode == "none":
            return {"role": "assistant", "content": c.text}, False
        if self.mode == "named":
            content, calls = None, [(self.function, c.text)]
        else:
            content, calls = self.parser.extract(c.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"id": tool_call_id(), "type": "function",
                                      "function": {"name": name, "arguments": arguments}}
                                     for name, arguments in calls]
        return message, bool(calls)

    async def response(self, stream: RequestStream) -> dict[str, Any]:
        final = await self.collect(stream)
        ((request_id, completions),) = final.items()
        choices = []
        for c in completions:
            message, called = self.message(c)
            choices.append({"index": c.index, "message": message,
                            "logprobs": self.logprobs(c),
                            "finish_reason": self.finish_reason(c, called),
                            "stop_reason": c.stop_reason})
        generated = sum(len(c.token_ids) for c in completions)
        response = {**self.header(False), "choices": choices,
                    "usage": _usage(self.prompt_tokens, generated)}
        if self.body.prompt_logprobs is not None:
            response["prompt_logprobs"] = self.prompt_logprobs_json(request_id,
                                                                    self.prompt_ids)
        return response

    def stream_extras(self, out: RequestOutput) -> dict[str, Any]:
        if self.body.prompt_logprobs is None or self.sent_prompt_logprobs:
            return {}
        self.sent_prompt_logprobs = True  # the first chunk carries them
        return {"prompt_logprobs": self.prompt_logprobs_json(out.request_id, self.prompt_ids)}

    def delta_choice(self, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if c.index not in self.started:
            self.started.add(c.index)
            delta["role"] = "assistant"
        called = False
        if self.mode == "none":
            if c.text or "role" in delta:
                delta["content"] = c.text
        else:
            tools = self.streams.setdefault(c.index, ToolCallStream(
                self.parser, self.function if self.mode == "named" else None))
            content, calls = tools.feed(c.text)
            if c.finish_reason is not None:
                more_content, more_calls = tools.finish()
                content, calls = content + more_content, calls + more_calls
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
            called = tools.called
        return {"index": c.index, "delta": delta, "logprobs": self.logprobs(c),
                "finish_reason": self.finish_reason(c, called), "stop_reason": c.stop_reason}
