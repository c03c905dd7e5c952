"""The app's ASGI middleware: what answers a request before a route sees it (create_app stacks
them, outermost first: AccessLog, ConnectionLimit, Draining, BodyLimit, KeyGate)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from gptj.serve.auth import has_secret
from gptj.serve.errors import draining_error, error_response
from gptj.serve.guards import key_error
from gptj.serve.protocol import MAX_BODY_BYTES, APIError
from gptj.serve.registry import ServerConfig
from gptj.serve.state import ConnectionGate, ServerState

access_log = logging.getLogger("gptj.serve.access")

CONNECTIONS_RETRY_AFTER_S = 1  # at the connection limit: connections free as requests end, often within a second


class BodyLimit:
    """ASGI middleware: a request body over `limit()` bytes gets 413 at once, whether it says its
    length (answered before reading any) or is chunked (answered once the limit has arrived); a body
    that does not arrive whole within `read_timeout_s` of its headers gets 408. Either way the
    connection is closed. The body is read here, whole, and passed on."""

    def __init__(self, app, limit=lambda: MAX_BODY_BYTES, read_timeout_s: float = 30.0) -> None:  # noqa: ANN001
        self.app, self.limit, self.read_timeout_s = app, limit, read_timeout_s

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit()
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and not (length.isdigit() and int(length) <= limit):
            return await self._refuse(receive, send, limit, {"more_body": length.isdigit()}, 0)
        chunks, seen, message = [], 0, {"more_body": True}
        try:
            async with asyncio.timeout(self.read_timeout_s):
                while message.get("more_body"):
                    message = await receive()
                    if message["type"] != "http.request":
                        return  # the client left
                    chunks.append(message.get("body", b""))
                    seen += len(chunks[-1])
                    if seen > limit:
                        return await self._refuse(receive, send, limit, message, seen)
        except TimeoutError:
            return await error_response(APIError(408, f"the request body did not arrive within the server's "
                                                      f"{self.read_timeout_s:g} s read timeout", code="timeout",
                                                 headers={"Connection": "close"}))(scope, receive, send)
        whole, replayed = b"".join(chunks), False

        async def replay():  # noqa: ANN202
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": whole, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, receive, send, limit: int, message, seen: int) -> None:  # noqa: ANN001
        """Send the whole 413 at once; then read (and drop) what the client still sends, up to 4x the
        limit and the read timeout, so a client still sending gets to read the 413 instead of a reset
        connection; then end the response, which closes the connection."""
        response = error_response(APIError(413, f"the request body exceeds {limit} bytes",
                                           headers={"Connection": "close"}))
        await send({"type": "http.response.start", "status": 413, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": True})
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.read_timeout_s):
                while message.get("more_body") and seen <= 4 * limit:
                    message = await receive()
                    if message["type"] != "http.request":
                        break
                    seen += len(message.get("body", b""))
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class AccessLog:
    """ASGI middleware: one log line per HTTP request once its response has ended: the client, the
    method and path, the status, the latency, and for a completion what the handler left in the
    request's state (`access`: model, tokens in and out, time to the first token)."""

    def __init__(self, app) -> None:  # noqa: ANN001 - an ASGI app
        self.app = app

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 0

        async def sent(message) -> None:  # noqa: ANN001
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            extra = scope.get("state", {}).get("access", "")
            access_log.info('%s "%s %s" %s %.3fs%s', who, scope["method"], scope["path"], status or "-",
                            time.perf_counter() - start, f" {extra}" if extra else "")


class ConnectionLimit:
    """ASGI middleware: a request on a connection beyond the limit (ConnectionGate) is answered 503 in
    OpenAI's format with Retry-After, before its body is read, and its connection closed; GET
    /health is answered as usual."""

    def __init__(self, app, gate: ConnectionGate) -> None:  # noqa: ANN001 - an ASGI app
        self.app, self.gate = app, gate

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        if scope["type"] != "http" or scope["path"] == "/health" or self.gate.allows(_peer(scope)):
            return await self.app(scope, receive, send)
        await error_response(APIError(503, f"the server is at its limit of {self.gate.limit} open connections; "
                                           "retry shortly", code="too_many_connections",
                                      headers={"Retry-After": str(CONNECTIONS_RETRY_AFTER_S),
                                               "Connection": "close"}))(scope, receive, send)


def _peer(scope):  # noqa: ANN001, ANN202 - the (host, port) the transport reports, as the gate keys it
    client = scope.get("client")
    return tuple(client) if client is not None else None


class Draining:
    """ASGI middleware: while the server drains, every new request but GET /health and /metrics is
    answered 503 at once (before its body is read), on new and kept-alive connections alike; the
    answer closes the connection, so a client's next request goes through its load balancer anew."""

    OPEN = ("/health", "/metrics")

    def __init__(self, app, state: ServerState) -> None:  # noqa: ANN001 - an ASGI app
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        if scope["type"] != "http" or self.state.status != "draining" or scope["path"] in self.OPEN:
            return await self.app(scope, receive, send)
        if scope["path"] == "/v1/completions":
            self.state.metrics.requests.labels("", "503").inc()
        await error_response(draining_error())(scope, receive, send)


class KeyGate:
    """ASGI middleware: with an API key set, /metrics and the API's documents (/docs, /redoc,
    /openapi.json) need it too, unless the server made them public (--public-metrics, --public-docs).
    (The /v1 routes check the key themselves; /health stays open for load balancers.)"""

    DOCS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")

    def __init__(self, app, cfg: ServerConfig) -> None:  # noqa: ANN001 - an ASGI app
        self.app, self.cfg = app, cfg
        self.gated = set() if cfg.api_key is None else \
            ({"/metrics"} if not cfg.public_metrics else set()) | (set(self.DOCS) if not cfg.public_docs else set())

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        if scope["type"] != "http" or scope["path"] not in self.gated:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if has_secret(headers, self.cfg.api_key):
            return await self.app(scope, receive, send)
        await error_response(key_error("API key"))(scope, receive, send)
