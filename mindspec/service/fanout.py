"""Several engine requests behind one HTTP request (n > 1, a list of prompts), merged into one
stream of (choice index, output)."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Sequence

from mindspec.engine.outputs import RequestOutput

_DONE = object()


async def primed(outs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """Wait for the first output before answering, so a refused request still gets its 4xx."""
    first = await outs.__anext__()

    async def rest():
        try:
            yield first
            async for out in outs:
                yield out
        finally:
            await outs.aclose()

    return rest()


async def primed_fan_in(streams: Sequence[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run every stream at once; return once each has produced its first output (so a refused
    request is still a 4xx before any byte is sent), then yield (stream index, output) in arrival
    order. An error in any stream ends the whole iteration with it; leaving early, or an error,
    cancels the other streams, which aborts their engine requests."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except Exception as exc:  # ApiError and the like: the consumer re-raises it
            queue.put_nowait((index, exc))
        finally:
            await stream.aclose()
        queue.put_nowait((index, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]

    async def stop() -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    buffered: list[tuple[int, RequestOutput]] = []
    seen: set[int] = set()
    finished: set[int] = set()
    try:
        while len(seen | finished) < len(tasks):
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            (finished if item is _DONE else seen).add(index)
            if item is not _DONE:
                buffered.append((index, item))
    except BaseException:
        await stop()
        raise

    async def rest():
        try:
            for pair in buffered:
                yield pair
            running = len(tasks) - len(finished)
            while running:
                index, item = await queue.get()
                if item is _DONE:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            await stop()

    return rest()

