"""A streamed completion (or chat completion): its server-sent events (strict JSON chunks, an error event where it
failed, the usage chunk if asked for, then `data: [DONE]`) and EventStream, the response that
sends them and cancels the generation as soon as the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response

from gptj.serve.completions import Completion
from gptj.serve.protocol import APIError


def sse(obj: Any) -> bytes:
    """One server-sent event of strict JSON (no NaN or Infinity literals: what would need one is null)."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'), allow_nan=False)}\n\n".encode()


async def events(run: Completion, timeout: float) -> AsyncIterator[tuple[bytes, int | None]]:
    """Server-sent events: (bytes, final status or None) pairs; ends with `data: [DONE]`."""
    first = [True] * len(run.choices)
    status = 200
    opening = run.opening()
    if opening:
        yield sse(run.envelope(opening)), None
    try:
        async with asyncio.timeout(timeout):
            while not run.done:
                changed = await run.next_event()
                chunks = []
                for c in changed:
                    chunk = run.chunk(c, first[c])
                    if chunk is not None:
                        first[c] = False
                        chunks.append(chunk)
                if chunks:
                    yield sse(run.envelope(chunks)), None
    except TimeoutError:
        status = 408
        err = APIError(408, f"the request took longer than the server's {timeout:g} s limit", code="timeout")
        yield sse(err.body()), None
    if status == 200 and run.ended is not None:
        status = 503
        yield sse(APIError(503, run.ended, code="shutting_down").body()), None
    if status == 200 and run.error is not None:
        status = 500
        yield sse(APIError(500, f"generation failed: {run.error}", code="engine_error").body()), None
    if status == 200:
        opts = run.body.stream_options
        if opts is not None and opts.include_usage:
            yield sse(run.envelope([], run.usage())), None
    yield b"data: [DONE]\n\n", status


class EventStream(Response):
    """A text/event-stream response that also listens for the client going away: then the producer
    is cancelled at once (not at its next write), which cancels the generation."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[tuple[bytes, int | None]], on_close,  # noqa: ANN001
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content=None, status_code=200, media_type=self.media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]  # chunked
        self.events, self.on_close = events, on_close

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        status = 499

        async def produce() -> None:
            nonlocal status
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for data, final in self.events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
                if final is not None:
                    status = final
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        producer, listener = asyncio.create_task(produce()), asyncio.create_task(listen())
        try:
            done, pending = await asyncio.wait({producer, listener}, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task
            if producer in done and producer.exception() is not None and not isinstance(producer.exception(), OSError):
                raise producer.exception()
        finally:
            with contextlib.suppress(Exception):
                await self.events.aclose()
            self.on_close(status)
