"""Running the app on uvicorn: `serve(cfg)` blocks until SIGINT/SIGTERM (then drains) or a
start-up model fails to load (then it raises GptjError); `ServerThread` runs one in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading

import uvicorn

from gptj.errors import GptjError
from gptj.serve.app import ServerState, create_app
from gptj.serve.registry import ServerConfig


class _Server(uvicorn.Server):
    """uvicorn, but on SIGTERM/SIGINT the app first starts answering 503 (and /health says
    draining) while uvicorn stops accepting and waits for running requests."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.gptj_state = state

    def handle_exit(self, sig, frame) -> None:  # noqa: ANN001
        self.gptj_state.status = "draining"
        super().handle_exit(sig, frame)

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


def build_server(cfg: ServerConfig, log_level: str = "info", own_process: bool = True) -> _Server:
    """`own_process`: let uvicorn configure logging (dictConfig). Inside another program (tests,
    benchmarks) that would replace, and close, the program's own logging handlers."""
    state = ServerState(cfg)
    app = create_app(cfg, state)
    extra = {} if own_process else {"log_config": None}
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=log_level,
                            timeout_graceful_shutdown=cfg.drain_timeout_s, access_log=False, lifespan="on", **extra)
    server = _Server(config, state)

    def failed(message: str) -> None:
        server.should_exit = True

    state.on_failure = failed
    return server


def serve(cfg: ServerConfig, log_level: str = "info") -> None:
    server = build_server(cfg, log_level)
    try:
        server.run()
    except OSError as e:  # e.g. the port is taken
        raise GptjError(f"cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}") from None
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
        import time

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

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        self.stop()
