"""The HTTP server: OpenAI's completions and chat completions APIs over gptj's engine (FastAPI on
uvicorn). create_app assembles it from one router per concern (gptj.serve.routes), the middleware
that answers before a route (gptj.serve.middleware), the error handlers (gptj.serve.errors), all
over one ServerState (gptj.serve.state) that the routes receive as a dependency.

    POST /v1/completions    text or token-id prompts; plain or streamed (server-sent events)   routes/v1.py
    POST /v1/chat/completions  messages in the model's chat template (gptj.chat_template), plain or  routes/v1.py
                            streamed; the reply ends at any of the model's end-of-turn tokens
    GET  /v1/models         served models                                                      routes/v1.py
    GET  /health            200 once every model given at start is loaded; 503 while           routes/monitoring.py
                            loading/draining
    GET  /metrics           Prometheus (gptj.serve.metrics); needs the API key, if set,        routes/monitoring.py
                            unless public_metrics
    POST /admin/models      {name, path}: load a checkpoint under the model root (admin token) routes/admin.py
    DELETE /admin/models/N  unload N after its requests finish (admin token)                   routes/admin.py
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
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from gptj.serve.errors import HANDLERS
from gptj.serve.middleware import AccessLog, BodyLimit, ConnectionLimit, Draining, KeyGate
from gptj.serve.registry import ServerConfig
from gptj.serve.routes import admin, monitoring, v1
from gptj.serve.state import ServerState


def create_app(cfg: ServerConfig, state: ServerState | None = None) -> FastAPI:
    """The app over `state` (a new ServerState if none): its routers, its middleware, its error
    handlers; its lifespan loads the start-up models and shuts them down."""
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

    app = FastAPI(title="gptj", version=_version(), lifespan=lifespan, exception_handlers=HANDLERS,
                  description="OpenAI-compatible completions and chat completions over gptj's engine.")
    app.state.gptj = state  # what the routes' dependency (gptj.serve.state.State) reads
    for routes in (monitoring, v1, admin):
        app.include_router(routes.router)
    app.add_middleware(KeyGate, cfg=cfg)
    app.add_middleware(BodyLimit, limit=state.body_limit, read_timeout_s=cfg.read_timeout_s)
    app.add_middleware(Draining, state=state)  # a draining server reads no body
    app.add_middleware(ConnectionLimit, gate=state.connections)  # beyond the limit, nothing is read
    if cfg.access_log:
        app.add_middleware(AccessLog)  # outermost: every answer is logged, refusals included
    return app


def _version() -> str:
    from gptj import __version__

    return __version__
