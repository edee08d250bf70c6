"""Runs one request through the AsyncEngine for a route: timeouts, metrics, errors."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from mindspec.engine.outputs import RequestOutput
from mindspec.text_generator.sampling.params import SamplingParams

from .async_engine import AsyncEngine, Prompt, RequestError
from .errors import ApiError
from .metrics import ServiceMetrics


@dataclass
class Timeouts:
    token: float = 600.0  # ServerConfig.tokenTimeout: longest wait for the next tokens
    e2e: float = 600.0  # ServerConfig.e2eTimeout: longest a request may take


class RequestRunner:
    def __init__(self, engine: AsyncEngine, metrics: ServiceMetrics, timeouts: Timeouts):
        self.engine, self.metrics, self.timeouts = engine, metrics, timeouts

    async def stream(self, prompt: Prompt, params: SamplingParams, request_id: str, add=None,
                     share_prefix_with: Optional[str] = None,
                     timeout: Optional[float] = None) -> AsyncIterator[RequestOutput]:
        """Engine outputs as they come. Raises ApiError for a refused request (before any output)
        or a timeout; leaving the iteration early aborts the request. ``add``: see AsyncEngine.
        ``share_prefix_with``: the request id of an n > 1 sibling whose prompt KV this one reuses.
        ``timeout``: the request's own end-to-end limit in seconds (MindIE's ``timeout``
        parameter), never longer than e2eTimeout."""
        start = time.monotonic()
        first: Optional[float] = None
        last: Optional[RequestOutput] = None
        status = "error"
        e2e, e2e_name = self.timeouts.e2e, "e2eTimeout"
        if timeout is not None and timeout < e2e:
            e2e, e2e_name = timeout, "the request's timeout"
        extra = {}
        if add is not None:
            extra["add"] = add
        if share_prefix_with is not None:
            extra["share_prefix_with"] = share_prefix_with
        gen = self.engine.generate(prompt, params, request_id, **extra)
        try:
            while True:
                remaining = e2e - (time.monotonic() - start)
                if remaining <= 0:
                    raise ApiError(408, f"request exceeded {e2e_name} ({e2e:g} s)")
                try:
                    out = await asyncio.wait_for(gen.__anext__(), min(self.timeouts.token, remaining))
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    if remaining < self.timeouts.token:
                        raise ApiError(408, f"request exceeded {e2e_name} ({e2e:g} s)") from None
                    raise ApiError(408, f"no tokens within tokenTimeout ({self.timeouts.token:g} s)") from None
                except RequestError as exc:
                    raise ApiError(getattr(exc, "status", 400), str(exc)) from None
                if first is None and out.token_ids:
                    first = time.monotonic() - start
                last = out
                yield out
                if out.finished:
                    status = "success"
                    break
        finally:
            await gen.aclose()
            if status == "success" and last is not None:
                self.metrics.request_finished("success", len(last.prompt_token_ids), len(last.token_ids),
                                              first, time.monotonic() - start)
            elif last is None:
                self.metrics.request_finished("rejected")

    async def complete(self, prompt: Prompt, params: SamplingParams, request_id: str,
                       share_prefix_with: Optional[str] = None, timeout: Optional[float] = None) -> RequestOutput:
        final = None
        async for out in self.stream(prompt, params, request_id, share_prefix_with=share_prefix_with, timeout=timeout):
            final = out
        return final
