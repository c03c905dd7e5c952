"""Running the app on uvicorn: `serve(cfg)` blocks until SIGINT/SIGTERM (then drains) or a
start-up model fails to load (then it raises GptjError); `ServerThread` runs one in a thread.

The drain: uvicorn's own SIGTERM handling closes the listening socket and idle keep-alive
connections at once, so a load balancer would see refused connections. Here the signal only
starts the drain: the server keeps listening, answers 503 (with Retry-After) to new requests on
new and kept-alive connections alike, /health says "draining", and running requests finish. Once
none runs, or --drain-timeout-s has passed (then what still runs is answered 503: a plain request
in OpenAI's error format, a stream with an error event and `[DONE]`), uvicorn is told to exit. A
second signal ends the drain at once, the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING

import uvicorn

from gptj.errors import GptjError
from gptj.serve.app import create_app
from gptj.serve.registry import ServerConfig
from gptj.serve.state import ConnectionGate, ServerState

if TYPE_CHECKING:
    from gptj.parallel.context import ParallelContext

log = logging.getLogger("uvicorn.error")  # the drain's steps, beside uvicorn's own start and shutdown lines

# After the drain, how long uvicorn waits for connections still sending (a 503, a stream's [DONE]).
_CLOSE_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn, with gptj's drain between the signal and uvicorn's own shutdown (see the module)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.gptj_state = state
        self.drain_requested = 0  # signals received (set from the signal handler: plain writes only)
        self._deadline: float | None = None  # when running requests are answered 503
        self._expired_at: float | None = None

    def handle_exit(self, sig, frame) -> None:  # noqa: ANN001
        self.gptj_state.status = "draining"  # read by the app on the event loop's thread
        self.drain_requested += 1

    async def on_tick(self, counter: int) -> bool:
        if self.drain_requested and not self.should_exit:
            self._drain_tick()
        return await super().on_tick(counter)

    def _drain_tick(self) -> None:
        state, now = self.gptj_state, time.monotonic()
        if self._deadline is None:
            self._deadline = now + self.gptj_state.cfg.drain_timeout_s
            log.info("draining: new requests get 503; waiting up to %g s for %d running request(s) (a second "
                     "signal: at once)", state.cfg.drain_timeout_s, len(state.running))
        if not state.running:
            self.should_exit = True
        elif self._expired_at is None and (now >= self._deadline or self.drain_requested > 1):
            self._expired_at = now
            log.warning("drain %s: answering %d running request(s) 503",
                        "stopped by a second signal" if self.drain_requested > 1 else "timed out", len(state.running))
            state.end_running("the server shut down before this request finished")
        elif self._expired_at is not None and now - self._expired_at > _CLOSE_S:
            self.should_exit = True  # what is still open, uvicorn closes

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if sockets and self.started:
            self._log_started_message(sockets)  # uvicorn only says where it listens for sockets it bound

    @contextlib.contextmanager
    def capture_signals(self):  # noqa: ANN201
        # uvicorn re-raises the signal after shutting down; a drained server exits 0 instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def bind(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for host:port (one per address the host resolves to, as asyncio binds
    them), or GptjError in one line: a port in use is found before any model is loaded."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise GptjError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sockets: list[socket.socket] = []
    bound = port  # with port 0, every address gets the port the first one got
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no obstacle
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((address[0], bound, *address[2:]))
            sock.listen(2048)
            bound = sock.getsockname()[1]
    except OSError as e:
        for sock in sockets:
            sock.close()
        what = "the port is in use" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
        raise GptjError(f"cannot listen on {host}:{port}: {what} (choose another --port or --host)") from None
    return sockets


def check_port(host: str, port: int) -> None:
    """GptjError (one line) if host:port cannot be listened on; nothing stays bound."""
    for sock in bind(host, port):
        sock.close()


def _http_protocol(read_timeout_s: float, gate: ConnectionGate | None = None) -> type:
    """uvicorn's HTTP protocol (httptools, else h11) with a read timeout for request headers: from
    the moment a connection opens, and again after each response, the next request's headers must
    have arrived within `read_timeout_s`, or the connection is closed. uvicorn has no such timeout
    of its own (its keep-alive timeout starts only after a first response), so a client that opens
    connections and sends nothing, or half a header, would hold their file descriptors for ever. The
    body's own timeout is the app's (gptj.serve.middleware.BodyLimit): past its headers a request is in ASGI.

    `gate`: every connection is counted there as it opens and closes (gptj.serve.state.ConnectionGate:
    the app answers those beyond the limit)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    from uvicorn.protocols.utils import get_remote_addr

    class ReadTimeoutProtocol(AutoHTTPProtocol):
        _headers_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # noqa: ANN001
            super().connection_made(transport)
            if gate is not None:
                gate.opened(get_remote_addr(transport))  # as the request's scope names its client
            self._expect_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._expect_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._headers_timer is not None:
                self._headers_timer.cancel()
            if gate is not None:
                gate.closed(get_remote_addr(self.transport))
            super().connection_lost(exc)

        def _expect_headers(self) -> None:
            if self._headers_timer is not None:
                self._headers_timer.cancel()
            before = self.cycle  # uvicorn makes a new cycle once a request's headers are complete
            self._headers_timer = self.loop.call_later(read_timeout_s, self._headers_late, before)

        def _headers_late(self, before) -> None:  # noqa: ANN001
            self._headers_timer = None
            idle = before is None or before.response_complete  # (not a pipelined request being answered)
            if self.cycle is before and idle and not self.transport.is_closing():
                self.transport.close()

    return ReadTimeoutProtocol


def _log_like_uvicorn(level: str) -> None:
    """gptj's own server lines (each model's start-up summary, the access log, the drain) on stderr
    beside uvicorn's, in its format, at the server's log level."""
    from uvicorn.logging import DefaultFormatter

    logger = logging.getLogger("gptj")
    if not any(getattr(h, "gptj_server", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
        handler.gptj_server = True
        logger.addHandler(handler)
    logger.setLevel(level.upper())


def build_server(cfg: ServerConfig, log_level: str = "info", own_process: bool = True,
                 ctx: ParallelContext | None = None) -> _Server:
    """`own_process`: let uvicorn configure logging (dictConfig). Inside another program (tests,
    benchmarks) that would replace, and close, the program's own logging handlers. `ctx`: the
    job's context when this server is rank 0 of --tp / --pp ranks (None: one process)."""
    state = ServerState(cfg, ctx)
    app = create_app(cfg, state)
    extra = {} if own_process else {"log_config": None}
    if own_process:
        _log_like_uvicorn(log_level)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=log_level,
                            timeout_graceful_shutdown=min(_CLOSE_S, cfg.drain_timeout_s), access_log=False,
                            lifespan="on", http=_http_protocol(cfg.read_timeout_s, state.connections), **extra)
    server = _Server(config, state)

    def failed(message: str) -> None:
        server.should_exit = True

    state.on_failure = failed
    return server


def serve(cfg: ServerConfig, log_level: str = "info", ctx: ParallelContext | None = None) -> None:
    sockets = bind(cfg.host, cfg.port)  # first: a port in use is one line, before anything loads
    server = build_server(cfg, log_level, ctx=ctx)
    try:
        server.run(sockets=sockets)
    except SystemExit as e:  # uvicorn's start-up failure (it has logged why)
        raise GptjError(f"the server did not start on {cfg.host}:{cfg.port} (exit {e.code})") from None
    finally:
        for sock in sockets:
            sock.close()
    state = server.gptj_state
    if state.load_error is not None:
        raise GptjError(state.load_error)
    if not server.started:
        raise GptjError(f"the server did not start on {cfg.host}:{cfg.port}")


class ServerThread:
    """A server on a background thread (tests, benchmarks): `with ServerThread(cfg) as url:`."""

    def __init__(self, cfg: ServerConfig, wait_ready: bool = True, log_level: str = "warning") -> None:
        self.server = build_server(cfg, log_level, own_process=False)
        self.cfg, self.wait_ready = cfg, wait_ready
        self.thread = threading.Thread(target=self._run, name="gptj-server", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve())
        except BaseException as e:  # noqa: BLE001 - reported to the starting thread
            self.error = e

    @property
    def state(self) -> ServerState:
        return self.server.gptj_state

    @property
    def url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://{self.cfg.host}:{port}"

    def start(self) -> str:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise GptjError(f"the server did not start: {self.error or self.state.load_error}")
            time.sleep(0.01)
        while self.wait_ready and self.state.status == "loading":
            time.sleep(0.01)
        if self.wait_ready and self.state.status != "ok":
            self.stop()
            raise GptjError(f"loading failed: {self.state.load_error}")
        return self.url

    def drain(self) -> None:
        """What SIGTERM does to `gptj serve`: start the drain (the thread ends when it is done)."""
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        self.stop()
