"""AsyncEngine: one engine loop for every connection.

The LLMEngine is synchronous and single-threaded; it runs in one background thread that drains a
command queue (new requests, aborts) between steps and pushes each RequestOutput to the asyncio
queue of its request. Handlers await those queues. A request that fails validation is answered
at once with its error; nothing a request does can stop the loop or touch another request.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional, Union

from mindspec.engine.llm_engine import LLMEngine
from mindspec.engine.outputs import RequestOutput
from mindspec.text_generator.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = Union[str, list[int]]


@dataclass
class _Pending:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)
    # How the request enters the engine (None: engine.add_request). PD nodes pass their own (a
    # prefill hand-off, an adopted prefilled request), which may return a first output.
    add: Optional[Callable[[LLMEngine], Optional[RequestOutput]]] = None
    # n > 1: the id of a request with the same prompt, added before this one, whose prompt KV
    # blocks this one shares (LLMEngine.add_request)
    share_prefix_with: Optional[str] = None


class RequestError(Exception):
    """A request the engine refused (bad prompt, limits); the message is for the client.
    ``status``: the HTTP status to answer with (503 when a peer or rank is gone)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.Queue = queue.Queue()
        self._live: dict[str, _Pending] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mindspec-engine", daemon=True)
        self.healthy = True

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def new_request_id(self, prefix: str = "cmpl") -> str:
        return f"{prefix}-{next(self._ids)}"

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str, add=None,
                       share_prefix_with: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Yields one RequestOutput per engine step that produced tokens; the last is finished.
        If the consumer stops early (client gone) the request is aborted and its blocks freed.
        ``share_prefix_with``: see LLMEngine.add_request (the engine adds requests in the order
        generate is first iterated, so a parent's generator must be started before its children's)."""
        pending = _Pending(request_id, prompt, params, asyncio.get_running_loop(), asyncio.Queue(), add=add,
                           share_prefix_with=share_prefix_with)
        self._commands.put(("add", pending))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await pending.outputs.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    async def call(self, fn: Callable[[LLMEngine], object]):
        """Run ``fn(engine)`` on the engine thread between steps (management calls such as
        reset_prefix_cache); its result, or its exception raised here."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(("call", (fn, loop, done)))
        self._wake.set()
        return await done

    # ---- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        if self.metrics is not None:  # gauges of the idle engine (KV blocks, warm-up's step accounting) from the start
            self.metrics.observe_engine(self.engine)
        while not self._stop.is_set():
            if self._drain_commands() and self.metrics is not None:
                self.metrics.observe_engine(self.engine)  # aborts free blocks without a step
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug in a step must not hang every client: fail the live ones
                logger.exception("engine step failed")
                self.healthy = False
                if hasattr(exc, "http_status"):  # a multi-process engine lost a rank: say which
                    self._fail_all(RequestError(str(exc), status=exc.http_status))
                else:
                    self._fail_all(RuntimeError(f"internal engine error: {type(exc).__name__}"))
                continue
            for out in outputs:
                self._deliver(out)
            if self.metrics is not None:
                self.metrics.observe_engine(self.engine)

    def _drain_commands(self) -> int:
        handled = 0
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return handled
            handled += 1
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                self._abort(payload)
            elif kind == "call":
                self._call(*payload)

    def _call(self, fn, loop: asyncio.AbstractEventLoop, done: asyncio.Future) -> None:
        try:
            result = fn(self.engine)
        except Exception as exc:  # reported to the caller; the loop goes on
            loop.call_soon_threadsafe(done.set_exception, exc)
        else:
            loop.call_soon_threadsafe(done.set_result, result)

    def _add(self, pending: _Pending) -> None:
        try:
            first = None
            if pending.add is None:
                self._add_request(pending)
            else:
                first = pending.add(self.engine)
        except Exception as exc:  # RequestRejected, bad token ids, tokenizer errors, a lost rank
            self._push(pending, RequestError(str(exc), status=getattr(exc, "http_status", 400)))
            return
        self._live[pending.request_id] = pending
        if first is not None:
            self._deliver(first)

    def _add_request(self, pending: _Pending) -> None:
        self.engine.add_request(pending.prompt, pending.params, request_id=pending.request_id,
                                share_prefix_with=pending.share_prefix_with)

    def _abort(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None:
            self.engine.abort(request_id)
            if self.metrics is not None:
                self.metrics.request_aborted()

    def _deliver(self, out: RequestOutput) -> None:
        pending = self._live.get(out.request_id)
        if pending is None:
            return
        if out.finished:
            del self._live[out.request_id]
        self._push(pending, out)

    @staticmethod
    def _push(pending: _Pending, item) -> None:
        pending.loop.call_soon_threadsafe(pending.outputs.put_nowait, item)

    def _fail_all(self, exc: Exception) -> None:
        for request_id, pending in list(self._live.items()):
            self.engine.abort(request_id)
            self._push(pending, exc if isinstance(exc, RequestError) else RequestError(str(exc)))
        self._live.clear()
