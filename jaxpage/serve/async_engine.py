"""AsyncEngine: the LLMEngine behind an asyncio server.

One engine thread owns the engine: it is the only thread that calls it. New requests and
aborts reach it through a thread-safe inbox; it runs `step()` while any request is
unfinished and sleeps on an event when idle. LoRA adapters are added and removed through the
same inbox (`add_lora`, `remove_lora`), in order with the requests: a request queued before
an adapter's removal is added first. Each HTTP request's outputs reach its
coroutine through its own `asyncio.Queue`, handed to the event loop once per step (one
`call_soon_threadsafe` for the whole step, not one per output).

A failed step leaves the engine as it was (the engine's contract), so a failure is retried;
`max_consecutive_failures` failures in a row mean the device is not coming back: the loop
dies, every waiting coroutine gets `EngineDeadError`, and the server reports itself
unhealthy. A coroutine that stops listening (its client disconnected) aborts its requests,
which frees their blocks at the engine thread's next turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from jaxpage.outputs import RequestOutput
from jaxpage.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxpage.lora import LoRARequest

logger = logging.getLogger("jaxpage.serve")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request will be served."""


class OverloadedError(RuntimeError):
    """More requests are in flight than the server takes; try again later."""


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """One prompt for the engine (an HTTP request may carry several), with the LoRA adapter it
    runs under (None: the base model)."""

    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None


@dataclasses.dataclass(eq=False)
class _Stream:
    """Where one HTTP request's outputs go: its event loop and queue."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """Runs `engine` on its own thread; `submit` queues requests and returns their stream.

    `on_output(output)` is called on the engine thread for every output of every step
    (metrics); `max_in_flight` bounds the requests accepted and not yet finished (beyond it
    `submit` raises OverloadedError).
    """

    def __init__(self, engine: Any, *, max_in_flight: int = 4096,
                 max_consecutive_failures: int = 3,
                 on_output: Callable[[RequestOutput], None] | None = None) -> None:
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.max_consecutive_failures = max_consecutive_failures
        self.on_output = on_output
        self.error: BaseException | None = None  # why the loop died
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._lock = threading.Lock()  # orders submissions against the loop's death
        self._in_flight = 0
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._thread = threading.Thread(target=self._loop, name="jaxpage-engine", daemon=True)

    # ---------------------------------------------------------------- life cycle
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop after its current step (requests still in flight are aborted)."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    # ---------------------------------------------------------------- requests
    async def submit(self, requests: list[EngineRequest]) -> RequestStream:
        """Queue `requests`, all or none, and return once the engine has taken them: a bad
        one raises its ValueError here (and none runs); too many in flight raise
        OverloadedError (more than `max_in_flight` in one call: ValueError, as it never
        fits), a dead engine EngineDeadError. Iterate the returned stream for the
        outputs; closing it (or leaving its iteration early) aborts what has not finished."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        handle = RequestStream(self, [r.request_id for r in requests], stream)
        self._submit(("add", requests, stream), len(requests))
        try:
            item = await stream.queue.get()
        except BaseException:  # cancelled while waiting (the client went away)
            handle.close()
            raise
        if isinstance(item, BaseException):
            handle.pending.clear()  # the engine thread has forgotten them
            raise item
        return handle

    # ---------------------------------------------------------------- LoRA adapters
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """`engine.add_lora` on the engine thread (the adapter is read and checked there): its
        ValueError naming what is wrong with the adapter is raised here."""
        return await self._call(self.engine.add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """`engine.remove_lora` on the engine thread: a ValueError while requests use it."""
        return await self._call(self.engine.remove_lora, lora_int_id)

    async def _call(self, fn: Callable, *args: Any) -> Any:
        """fn(*args) on the engine thread, between steps; its result, or its exception."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._submit(("call", (fn, args), stream), 0)
        item = await stream.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def _submit(self, message: tuple, count: int) -> None:
        with self._lock:
            if self.error is not None or self._stopping:
                raise EngineDeadError(f"the engine has stopped: {self.error}")
            if count > self.max_in_flight:  # never fits: a bad request, not a busy server
                raise ValueError(f"prompt: {count} prompts in one request, but the server "
                                 f"takes at most {self.max_in_flight} in flight")
            if self._in_flight + count > self.max_in_flight:
                raise OverloadedError(f"the server has {self._in_flight} requests in flight "
                                      f"(at most {self.max_in_flight}); try again later")
            self._in_flight += count
            self._post(message)

    def _post(self, message: tuple) -> None:
        self._inbox.put(message)
        self._wake.set()

    # ---------------------------------------------------------------- engine thread
    def _loop(self) -> None:
        failures = 0
        try:
            while not self._stopping:
                self._wake.clear()
                self._take_inbox()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=1.0)
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as exc:
                    failures += 1
                    logger.exception("engine step failed (%d in a row)", failures)
                    if failures >= self.max_consecutive_failures:
                        raise EngineDeadError(
                            f"{failures} engine steps failed in a row; last: "
                            f"{type(exc).__name__}: {exc}") from exc
                    continue
                failures = 0
                self._publish(outputs)
            self._abort_all()
        except BaseException as exc:  # the loop is dead: nobody may wait forever
            logger.exception("engine loop died")
            self._die(exc if isinstance(exc, EngineDeadError) else EngineDeadError(
                f"the engine loop died: {type(exc).__name__}: {exc}"))

    def _take_inbox(self) -> None:
        while True:
            try:
                kind, payload, stream = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(payload, stream)
            elif kind == "call":
                fn, args = payload
                try:
                    result = fn(*args)
                except Exception as exc:  # the caller's to answer (a bad adapter: a 400)
                    result = exc
                _send(stream.loop, stream.queue.put_nowait, result)
            else:
                for request_id in payload:
                    if self._streams.pop(request_id, None) is not None:
                        self.engine.abort_request(request_id)  # its output: metrics only

    def _add(self, requests: list[EngineRequest], stream: _Stream) -> None:
        added = []
        try:
            for r in requests:
                self.engine.add_request(r.request_id, r.prompt, r.params,
                                        cache_salt=r.cache_salt, lora_request=r.lora_request)
                added.append(r.request_id)
        except Exception as exc:  # a bad request: none of the batch runs
            for request_id in added:
                self.engine.abort_request(request_id)
            self._finished(len(requests) - len(added))
            _send(stream.loop, stream.queue.put_nowait, exc)
            return
        for request_id in added:
            self._streams[request_id] = stream
        _send(stream.loop, stream.queue.put_nowait, _ACCEPTED)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their coroutines, one call per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        finished = 0
        for out in outputs:
            if out.finished:
                finished += 1
            if self.on_output is not None:
                self.on_output(out)
            stream = (self._streams.pop(out.request_id, None) if out.finished
                      else self._streams.get(out.request_id))
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        self._finished(finished)
        for loop, items in by_loop.items():
            _send(loop, _deliver, items)

    def _finished(self, count: int) -> None:
        with self._lock:
            self._in_flight -= count

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
        self._die(EngineDeadError("the server is shutting down"))

    def _die(self, error: EngineDeadError) -> None:
        with self._lock:  # no submission gets in after this
            self.error = error
        while True:  # requests submitted but never added
            try:
                kind, _payload, stream = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind in ("add", "call"):
                _send(stream.loop, stream.queue.put_nowait, error)
        for stream in {id(s): s for s in self._streams.values()}.values():
            _send(stream.loop, stream.queue.put_nowait, error)
        self._streams.clear()


class RequestStream:
    """The outputs of one `submit`: async-iterate for RequestOutputs (streaming deltas) until
    every request has finished; `close()` aborts those that have not."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], stream: _Stream) -> None:
        self._engine = engine
        self._stream = stream
        self.pending = set(request_ids)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while self.pending:
                item = await self._stream.queue.get()
                if isinstance(item, BaseException):
                    self.pending.clear()  # the engine thread has forgotten them
                    raise item
                if item.finished:
                    self.pending.discard(item.request_id)
                yield item
        finally:
            self.close()

    def close(self) -> None:
        if self.pending:
            self._engine._post(("abort", list(self.pending), None))
            self.pending.clear()


_ACCEPTED = object()  # the engine thread's answer to a good submission


def _send(loop: asyncio.AbstractEventLoop, fn: Callable, arg: Any) -> None:
    """Run fn(arg) on `loop` (a loop already closed has nobody left to tell)."""
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:
        pass


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
