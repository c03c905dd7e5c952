"""The HTTP server: OpenAI's completions API over gptj's engine (FastAPI on uvicorn).

    POST /v1/completions    text or token-id prompts; plain or streamed (server-sent events)
    GET  /v1/models         served models
    GET  /health            200 once every model given at start is loaded; 503 while loading/draining
    GET  /metrics           Prometheus (gptj.serve.metrics); needs the API key, if set, unless public_metrics
    POST /admin/models      {name, path}: load a checkpoint under the model root (admin token)
    DELETE /admin/models/N  unload N after its requests finish (admin token)
    GET  /openapi.json      the schemas of gptj.serve.protocol (and /docs, /redoc); need the API key,
                            if set, unless public_docs

Load and faults: each model admits at most max_batch_size + max_queue engine requests; beyond that
a request gets 429 with Retry-After (from the queue and the measured completion rate: RetryAdvisor
in gptj.serve.registry). A request past request_timeout_s is cancelled (408). A client
that disconnects has its requests cancelled, which frees their KV at the engine's next step. On
SIGTERM the server keeps listening but answers 503 with Retry-After to every new request (/health:
503 "draining"), lets running ones finish up to drain_timeout_s, answers 503 to those still running
then, and exits (gptj.serve.server). An engine failure fails only the requests it hit (500, OpenAI's
error format).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gptj.errors import GptjError
from gptj.serve.completions import Completion, plan, precheck
from gptj.serve.auth import has_secret
from gptj.serve.metrics import CONTENT_TYPE, ServerMetrics
from gptj.serve.protocol import (MAX_BODY_BYTES, MAX_PROMPTS, APIError, CompletionRequest, CompletionResponse,
                                 ErrorResponse, Health, LoadModelRequest, ModelCard, ModelList, ModelStatus)
from gptj.serve.registry import ServedModel, ServerConfig, check_under_root, load_served_model

log = logging.getLogger("gptj.serve")

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what} for code, what in
    ((400, "invalid request"), (401, "missing or wrong API key (or admin token)"),
     (403, "admin API disabled, or a path outside the model root"), (404, "unknown model"),
     (408, "timed out (the request, or reading its body)"), (409, "model already served"),
     (413, "request body too large"), (415, "the body is not sent as application/json"),
     (429, "queue full (see Retry-After)"), (500, "engine failure"),
     (503, "loading, draining, or too many connections"))}


# The body cap follows the served models' context: a valid request holds at most MAX_PROMPTS prompts
# of at most max_model_len tokens each, and BODY_BYTES_PER_TOKEN covers a token written as JSON (an
# id and its separator: "50399, " is 7 bytes; English text ~4 bytes, escaped non-ASCII text ~6-12).
# Never above MAX_BODY_BYTES, never below MIN_BODY_BYTES (one prompt of any valid text fits).
BODY_BYTES_PER_TOKEN = 16
MIN_BODY_BYTES = 1024 * 1024


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
            return await _error(APIError(408, f"the request body did not arrive within the server's "
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
        response = _error(APIError(413, f"the request body exceeds {limit} bytes",
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


# While draining: what a new request is told (a load balancer moves on; a client retries elsewhere).
DRAIN_RETRY_AFTER_S = 5


access_log = logging.getLogger("gptj.serve.access")


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


class ConnectionGate:
    """The connection limit (--max-connections). The protocol (gptj.serve.server) reports each
    connection as it opens and closes, by its peer address; the first `limit` open ones are admitted,
    and one opened beyond them is admitted once an admitted one closes. A request on a connection not
    admitted gets a JSON 503 with Retry-After and the connection is closed (ConnectionLimit), except
    GET /health, which is always answered: a load balancer can still tell the server is alive and
    busy. Event loop thread only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.admitted: set = set()
        self.beyond: set = set()

    def opened(self, peer) -> None:  # noqa: ANN001 - a socket's peer address
        (self.admitted if len(self.admitted) < self.limit else self.beyond).add(peer)

    def closed(self, peer) -> None:  # noqa: ANN001
        self.admitted.discard(peer)
        self.beyond.discard(peer)

    def allows(self, peer) -> bool:  # noqa: ANN001
        """Whether a request on this connection is served (a connection the gate never saw is: tests'
        in-process clients)."""
        if peer in self.beyond and len(self.admitted) < self.limit:
            self.beyond.discard(peer)
            self.admitted.add(peer)
        return peer not in self.beyond


CONNECTIONS_RETRY_AFTER_S = 1  # at the connection limit: connections free as requests end, often within a second


class ConnectionLimit:
    """ASGI middleware: a request on a connection beyond the limit (ConnectionGate) is answered 503 in
    OpenAI's format with Retry-After, before its body is read, and its connection closed; GET
    /health is answered as usual."""

    def __init__(self, app, gate: ConnectionGate) -> None:  # noqa: ANN001 - an ASGI app
        self.app, self.gate = app, gate

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        if scope["type"] != "http" or scope["path"] == "/health" or self.gate.allows(_peer(scope)):
            return await self.app(scope, receive, send)
        await _error(APIError(503, f"the server is at its limit of {self.gate.limit} open connections; retry "
                                   "shortly", code="too_many_connections",
                              headers={"Retry-After": str(CONNECTIONS_RETRY_AFTER_S),
                                       "Connection": "close"}))(scope, receive, send)


def _peer(scope):  # noqa: ANN001, ANN202 - the (host, port) the transport reports, as the gate keys it
    client = scope.get("client")
    return tuple(client) if client is not None else None


def _draining_error() -> APIError:
    return APIError(503, "the server is shutting down; retry on another replica or later", code="shutting_down",
                    headers={"Retry-After": str(DRAIN_RETRY_AFTER_S), "Connection": "close"})


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
        await _error(_draining_error())(scope, receive, send)


def _key_error(what: str) -> APIError:
    return APIError(401, f"missing or wrong {what} (send 'Authorization: Bearer ...')", code="invalid_api_key")


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
        await _error(_key_error("API key"))(scope, receive, send)


class ServerState:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.models: dict[str, ServedModel] = {}
        self.status = "loading"  # -> "ok" | "failed"; "draining" on shutdown
        self.load_error: str | None = None
        # one entry per engine: an adapter's name shares its base's (its requests are counted there)
        self.metrics = ServerMetrics(lambda: [m for m in self.models.values() if m.base is None])
        self.on_failure = None  # called (from the event loop) if a start-up model fails to load
        self.connections = ConnectionGate(cfg.max_connections)
        self.running: set[Completion] = set()  # admitted completions not yet answered (a drain waits for them)
        # Prompts are tokenized here, one request at a time: a burst of long prompts queues for this
        # one thread instead of taking every worker of the default executor (and the cores) at once.
        self.tokenizing = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gptj-tokenize")

    def body_limit(self) -> int:
        """The request body cap (413 beyond it): see BODY_BYTES_PER_TOKEN."""
        longest = max((m.max_model_len for m in self.models.values()), default=0)
        return min(MAX_BODY_BYTES, max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * MAX_PROMPTS * longest))

    def end_running(self, message: str) -> None:
        """Answer every running completion 503 now (a drain that ran out of time); event loop only."""
        for run in list(self.running):
            run.end(message)

    def model(self, name: str) -> ServedModel:
        served = self.models.get(name)
        if served is None and self.status == "loading" and name in dict(self.cfg.models):
            raise APIError(503, f"model {name!r} is still loading", "model", headers={"Retry-After": "5"})
        if served is not None and served.failure is not None and not served.unloading:
            raise APIError(503, f"model {name!r} has failed: its engine stopped ({served.failure}); unpublish it and "
                                "publish it again, or restart the server", code="model_failed")
        if served is None or served.unloading:
            known = ", ".join(n for n, m in self.models.items() if not m.unloading) or "none"
            raise APIError(404, f"model {name!r} does not exist (served: {known})", "model", "model_not_found")
        return served

    async def load_startup_models(self) -> None:
        try:
            for name, path in self.cfg.models:
                if name in self.models:  # loaded before the app started (a Ray Serve replica)
                    continue
                log.info("loading model %s from %s", name, path)
                served = await asyncio.to_thread(load_served_model, name, path, self.cfg, self.cfg.lora)
                self.models[name] = served
                log.info("model %s", served.describe())
                for adapter, folder in self.cfg.lora:  # (ServerConfig: adapters go with its one model)
                    self.models[adapter] = served.adapter_view(adapter, folder)
                    log.info("model %s", self.models[adapter].describe())
            if self.status == "loading":
                self.status = "ok"
        except Exception as e:  # noqa: BLE001 - reported on /health and by the CLI, one line
            self.status = "failed"
            self.load_error = str(e).splitlines()[0] if str(e) else type(e).__name__
            log.error("loading failed: %s", self.load_error)
            if self.on_failure is not None:
                self.on_failure(self.load_error)

    def shutdown(self) -> None:
        for served in self.models.values():
            served.shutdown()
        self.models.clear()


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _shown(path: str) -> str:
    """A path as an error message shows it: whole, or its start and end if long."""
    return repr(path) if len(path) <= 200 else repr(path[:100] + "..." + path[-60:])


def _path_error(path: str, e: OSError | ValueError) -> APIError:
    """/admin/models: a path the file system refuses is the client's error (4xx), named, never a 500:
    403 where it may not be read, 400 otherwise (ENAMETOOLONG, ELOOP, ENOTDIR, a NUL byte ...)."""
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    if isinstance(e, PermissionError):
        return APIError(403, f"path {_shown(path)}: the server may not read it ({why})", "path")
    return APIError(400, f"path {_shown(path)}: not a usable model folder ({why})", "path")


# What a field of a union type takes, as its 400 says when a value fits none of its forms (pydantic
# names the forms by internal tags: "prompt.constrained-str: Input should be a valid string").
UNION_EXPECTED = {
    "prompt": "expected a string, a list of strings, a list of token ids (integers >= 0) or a list of such lists",
    "stop": "expected a string (1-1000 characters) or a list of such strings",
    "early_stopping": 'expected true, false or "never"',
}
# pydantic's type errors, as a user reads them
_EXPECTED = {"int_type": "expected an integer", "int_parsing": "expected an integer",
             "string_type": "expected a string",
             "bool_type": "expected true or false", "float_type": "expected a number", "list_type": "expected a list",
             "dict_type": "expected an object", "model_type": "expected an object",
             "model_attributes_type": "expected an object", "int_from_float": "expected an integer"}
_TYPE_ERRORS = set(_EXPECTED) | {"literal_error", "enum", "none_required", "is_instance_of"}


def _json_media_type(content_type: str | None) -> bool:
    """Whether a Content-Type header names JSON (application/json, or a +json type), as FastAPI
    requires before it reads a body."""
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _where(field: str, rest: tuple) -> str:
    """A location as the user wrote it: prompt[0][3], stream_options.include_usage."""
    return field + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in rest)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = tuple(p for p in err.get("loc", ()) if p != "body")
    if err.get("type") == "json_invalid":
        return f"malformed JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    if err.get("type") == "extra_forbidden":
        where = _where(str(loc[0]), loc[1:]) if loc else "?"
        return f"unknown field {where!r}", where
    if not loc:
        return ("request body: a JSON object is required" if err.get("type") in ("missing", *_EXPECTED)
                else f"request body: {err.get('msg')}"), None
    field = str(loc[0])
    if err.get("type") == "missing":
        where = _where(field, loc[1:])
        return f"{where}: field required", where
    if field in UNION_EXPECTED and len(loc) > 1:
        # pydantic tried each form (loc[1] names it): if the value has one form's shape and breaks only
        # its limits (a length, a bound), say which; if it has no form's shape, say what the forms are.
        forms: dict[str, list[dict]] = {}
        for e in errors:
            e_loc = tuple(p for p in e.get("loc", ()) if p != "body")
            if len(e_loc) > 1 and e_loc[0] == field:
                forms.setdefault(str(e_loc[1]), []).append(e)
        for form_errors in forms.values():
            if all(e.get("type") not in _TYPE_ERRORS for e in form_errors):
                e = form_errors[0]
                where = _where(field, tuple(p for p in e["loc"] if p != "body")[2:])
                return f"{where}: {e.get('msg', 'invalid value')}", field
        return f"{field}: {UNION_EXPECTED[field]}", field
    where = _where(field, loc[1:])
    what = _EXPECTED.get(err.get("type", ""), err.get("msg", "invalid value"))
    return f"{where}: {what}", where


def create_app(cfg: ServerConfig, state: ServerState | None = None) -> FastAPI:
    state = state or ServerState(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(state.load_startup_models())
        try:
            yield
        finally:
            loader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loader
            await asyncio.to_thread(state.shutdown)
            state.tokenizing.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="gptj", version=_version(), lifespan=lifespan,
                  description="OpenAI-compatible completions over gptj's GPT-J engine.")
    app.state.gptj = state
    app.add_middleware(KeyGate, cfg=cfg)
    app.add_middleware(BodyLimit, limit=state.body_limit, read_timeout_s=cfg.read_timeout_s)
    app.add_middleware(Draining, state=state)  # a draining server reads no body
    app.add_middleware(ConnectionLimit, gate=state.connections)  # beyond the limit, nothing is read
    if cfg.access_log:
        app.add_middleware(AccessLog)  # outermost: every answer is logged, refusals included

    # --- errors: always OpenAI's format ---

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        kind = request.headers.get("content-type")
        if request.method == "POST" and not _json_media_type(kind):  # FastAPI read no body: say why
            return _error(APIError(415, f"the request body must be sent as Content-Type: application/json "
                                        f"(got {kind or 'no Content-Type'!r})", code="unsupported_media_type"))
        message, param = _validation_message(exc)
        return _error(APIError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in message:
            message = "the request body is not valid JSON in UTF-8"
        return _error(APIError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return _error(APIError(500, f"internal error: {type(exc).__name__}"))

    # --- auth ---

    def check_key(request: Request, token: str | None, what: str) -> None:
        if token is None:
            return
        if not has_secret(request.headers, token):
            raise _key_error(what)

    def check_admin(request: Request) -> None:
        if cfg.admin_token is None:
            raise APIError(403, "the admin API is disabled (start the server with --admin-token)")
        check_key(request, cfg.admin_token, "admin token")

    def ready_model(request: Request, name: str) -> ServedModel:
        check_key(request, cfg.api_key, "API key")
        if state.status == "draining":
            raise _draining_error()
        return state.model(name)

    # --- routes ---

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health() -> JSONResponse:
        failed = {n: m.failure for n, m in state.models.items() if m.failure is not None and not m.unloading}
        status = "failed" if failed and state.status == "ok" else state.status
        body = Health(status=status, models=list(state.models), failed=failed).model_dump()
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models(request: Request) -> ModelList:
        check_key(request, cfg.api_key, "API key")
        return ModelList(data=[ModelCard(id=m.name, created=m.created, root=m.path, max_model_len=m.max_model_len,
                                         parent=m.base.name if m.base is not None else None,
                                         status="unloading" if m.unloading else "failed" if m.failure else "ready",
                                         error=m.failure)
                               for m in state.models.values()])

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        start = time.perf_counter()
        admitted = 0
        try:
            served = ready_model(request, body.model)
            # Cheap checks first (sizes, counts: no tokenizing), then admission, and only then the
            # expensive part: an invalid or unadmitted request costs the server next to nothing.
            n_jobs = precheck(body, served)
            if not served.admit(n_jobs):
                wait = served.retry_after(n_jobs)
                raise APIError(429, f"model {served.name!r} is at capacity ({served.capacity} requests running "
                                    f"or queued); retry in {wait} s", code="queue_full",
                               headers={"Retry-After": str(wait)})
            admitted = n_jobs
            # Tokenizing long texts takes a while: off the event loop, on the server's own small
            # executor, so that however many requests tokenize at once they take one thread's share
            # (plan only reads the model's limits).
            the_plan = await asyncio.get_running_loop().run_in_executor(state.tokenizing, plan, body, served)
            if state.status == "draining":  # it began while this request was being tokenized
                raise _draining_error()
        except APIError as e:
            if admitted:
                served.release(admitted)
            state.metrics.requests.labels(body.model if body.model in state.models else "", str(e.status)).inc()
            raise
        except BaseException:
            if admitted:
                served.release(admitted)
            raise
        run = Completion(body, served, the_plan)
        run.start = start
        run.on_tokens = lambda n: state.metrics.count_tokens(served.name, n)
        run.submit()
        state.running.add(run)
        state.metrics.prompt_tokens.labels(served.name).inc(sum(len(p) for p in the_plan.prompts))
        if body.stream:
            return EventStream(_stream(run, state), on_close=lambda status: _finish(run, state, status, request),
                               headers=the_plan.headers)
        status = 500
        try:
            waiter = asyncio.create_task(_collect(run, cfg.request_timeout_s))
            gone = asyncio.create_task(_disconnected(request))
            done, _ = await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if waiter not in done:
                waiter.cancel()
                status = 499  # the client closed the connection (nginx's code)
                return Response(status_code=499)
            response = waiter.result()
            status = 200
            return JSONResponse(response.model_dump(), headers=the_plan.headers)  # X-Gptj-Ignored-Fields
        except APIError as e:
            status = e.status
            raise
        finally:
            _finish(run, state, status, request)  # cancels what still runs (a disconnect, a timeout, an error)

    @app.post("/admin/models", response_model=ModelStatus, status_code=201, responses=_ERRORS)
    async def load(body: LoadModelRequest, request: Request) -> ModelStatus:
        check_admin(request)
        if body.name in state.models:
            failed = state.models[body.name].failure
            raise APIError(409, f"model {body.name!r} is already served" +
                           (f" (failed: {failed}; unpublish it first)" if failed else ""), "name")
        try:
            path = check_under_root(body.path, cfg.model_root)
        except PermissionError as e:
            raise APIError(403, str(e), "path") from None
        except (ValueError, OSError) as e:  # a NUL byte, a name too long, a loop of links
            raise _path_error(body.path, e) from None
        try:  # stat() raises what is_dir() does not swallow: ENAMETOOLONG, EACCES, EIO ...
            if not path.is_dir():
                raise APIError(400, f"{_shown(body.path)}: no such model folder", "path")
        except OSError as e:
            raise _path_error(body.path, e) from None
        state.models.pop(body.name, None)
        try:
            served = await asyncio.to_thread(load_served_model, body.name, str(path), cfg)
        except GptjError as e:
            raise APIError(400, f"{_shown(body.path)}: {e}", "path") from None
        except OSError as e:  # a file in the folder unreadable, a name too long, a loop of links
            raise _path_error(body.path, e) from None
        if body.name in state.models:  # loaded twice at once: keep the first
            await asyncio.to_thread(served.shutdown)
            raise APIError(409, f"model {body.name!r} is already served", "name")
        state.models[body.name] = served
        log.info("model %s (published)", served.describe())
        return ModelStatus(name=body.name, status="ready")

    @app.delete("/admin/models/{name}", response_model=ModelStatus, responses=_ERRORS)
    async def unload(name: str, request: Request) -> ModelStatus:
        check_admin(request)
        served = state.models.get(name)
        if served is None or served.failure is None:
            served = state.model(name)  # a failed model is unloaded as it is; others as state.model finds them
        if served.base is not None:  # a LoRA adapter's name: new requests get 404, the engine goes on
            served.unloading = True
            state.models.pop(name, None)
            return ModelStatus(name=name, status="unloaded")
        views = [n for n, m in state.models.items() if m.base is served]
        for m in [served, *(state.models[n] for n in views)]:
            m.unloading = True  # new requests get 404; running ones finish
        if served.failure is None:  # (a stopped engine has failed what it held; nothing will finish)
            await served.wait_idle()
        for n in [name, *views]:
            state.models.pop(n, None)
        await asyncio.to_thread(served.shutdown)
        log.info("model %s unpublished%s", name, f" (it had failed: {served.failure})" if served.failure else "")
        return ModelStatus(name=name, status="unloaded")

    return app


def _version() -> str:
    from gptj import __version__

    return __version__


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so only a disconnect arrives)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(run: Completion, timeout_s: float) -> CompletionResponse:
    try:
        async with asyncio.timeout(timeout_s):
            while not run.done:
                await run.next_event()
    except TimeoutError:
        raise APIError(408, f"the request took longer than the server's {timeout_s:g} s limit",
                       code="timeout") from None
    if run.ended is not None:
        raise APIError(503, run.ended, code="shutting_down")
    if run.error is not None:
        raise APIError(500, f"generation failed: {run.error}", code="engine_error")
    return run.response()


def _finish(run: Completion, state: ServerState, status: int, request: Request) -> None:
    state.running.discard(run)
    run.cancel()
    name = run.served.name
    now = time.perf_counter()
    state.metrics.observe(name, status, run.start, run.first_token, now, run.new_tokens)
    ttft = f" ttft={run.first_token - run.start:.3f}s" if run.first_token is not None else ""
    request.state.access = (f"model={name} prompt_tokens={sum(len(p) for p in run.plan.prompts)} "
                            f"completion_tokens={run.new_tokens}{ttft}")


def _sse(obj: Any) -> bytes:
    """One server-sent event of strict JSON (no NaN or Infinity literals: what would need one is null)."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'), allow_nan=False)}\n\n".encode()


async def _stream(run: Completion, state: ServerState) -> AsyncIterator[tuple[bytes, int | None]]:
    """Server-sent events: (bytes, final status or None) pairs; ends with `data: [DONE]`."""
    timeout = state.cfg.request_timeout_s
    first = [True] * len(run.choices)
    status = 200
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
                    yield _sse(run.envelope(chunks)), None
    except TimeoutError:
        status = 408
        err = APIError(408, f"the request took longer than the server's {timeout:g} s limit", code="timeout")
        yield _sse(err.body()), None
    if status == 200 and run.ended is not None:
        status = 503
        yield _sse(APIError(503, run.ended, code="shutting_down").body()), None
    if status == 200 and run.error is not None:
        status = 500
        yield _sse(APIError(500, f"generation failed: {run.error}", code="engine_error").body()), None
    if status == 200:
        opts = run.body.stream_options
        if opts is not None and opts.include_usage:
            yield _sse(run.envelope([], run.usage())), None
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
