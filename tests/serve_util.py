"""A live gptj server on loopback for tests: `with running_server({"tiny": model_dir}) as url:`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from gptj.serve import ServerConfig
from gptj.serve.server import ServerThread


@contextlib.contextmanager
def running_server(models: dict[str, str], **settings) -> Iterator[str]:
    """Serve `models` (name -> folder) on 127.0.0.1 at a free port; yields the base URL."""
    settings.setdefault("port", 0)
    cfg = ServerConfig(models=tuple((name, str(path)) for name, path in models.items()), **settings)
    with ServerThread(cfg) as url:
        yield url


@contextlib.contextmanager
def server_thread(models: dict[str, str], **settings) -> Iterator[ServerThread]:
    """Like running_server, but yields the ServerThread (its .url, and .state for fault injection)."""
    settings.setdefault("port", 0)
    cfg = ServerConfig(models=tuple((name, str(path)) for name, path in models.items()), **settings)
    thread = ServerThread(cfg)
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()


# `python -c GATED_SERVE HOLD_FILE ARGS...` runs `gptj serve ARGS...` whose engine does not step while
# HOLD_FILE exists: a test holds requests running for as long as it needs, with no timing involved.
GATED_SERVE = """
import os, sys, time
from gptj.engine.core import Engine
hold, step = sys.argv[1], Engine.step
def gated(self, *args, **kwargs):
    while os.path.exists(hold):
        time.sleep(0.01)
    return step(self, *args, **kwargs)
Engine.step = gated
from gptj.cli import main
sys.exit(main(["serve", *sys.argv[2:]]))
"""
