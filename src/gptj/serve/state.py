"""What the server's rooms share: ServerState (the config, the served models, the status, the
metrics, the connection gate, the running completions, the tokenizing thread), one per app, kept
on `app.state.gptj`; a route asks for it as a FastAPI dependency (`State`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from gptj.serve.completions import Completion
from gptj.serve.metrics import ServerMetrics
from gptj.serve.protocol import MAX_BODY_BYTES, MAX_PROMPTS, APIError
from gptj.serve.registry import ServedModel, ServerConfig, load_served_model

if TYPE_CHECKING:
    from gptj.parallel.context import ParallelContext

log = logging.getLogger("gptj.serve")

# The body cap follows the served models' context: a valid request holds at most MAX_PROMPTS prompts
# of at most max_model_len tokens each, and BODY_BYTES_PER_TOKEN covers a token written as JSON (an
# id and its separator: "50399, " is 7 bytes; English text ~4 bytes, escaped non-ASCII text ~6-12).
# Never above MAX_BODY_BYTES, never below MIN_BODY_BYTES (one prompt of any valid text fits).
BODY_BYTES_PER_TOKEN = 16
MIN_BODY_BYTES = 1024 * 1024


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


class ServerState:
    """One app's shared state: what its middleware and routes read and change (event loop thread,
    but for the drain's `status`, which gptj.serve.server sets from its signal handler)."""

    def __init__(self, cfg: ServerConfig, ctx: ParallelContext | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx  # the job's, when this server is rank 0 of --tp / --pp ranks (None: one process)
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
                served = await asyncio.to_thread(load_served_model, name, path, self.cfg, self.cfg.lora, self.ctx)
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


async def server_state(request: Request) -> ServerState:
    """The app's ServerState (create_app puts it on app.state.gptj). Async: FastAPI runs a plain
    function dependency on its thread pool, this one stays on the event loop."""
    return request.app.state.gptj


State = Annotated[ServerState, Depends(server_state)]  # a route's parameter `state: State`
