"""`gptj serve` as a process: ready only once loaded, SIGTERM drains running requests, user errors."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from gptj.cli import main
from test_serve import _open_stream, call


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli-models") / "tiny"
    assert main(["init", "--preset", "tiny", "--out", str(out), "--seed", "1"]) == 0
    return out


def start(args):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "gptj.cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def wait_healthy(proc, url):
    while True:
        assert proc.poll() is None, proc.communicate()
        try:
            status = call(url, "GET", "/health", timeout=5)[0]
        except OSError:
            status = None
        if status == 200:
            return
        time.sleep(0.1)


def test_sigterm_drains_running_requests_then_exits(tiny):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(["--model", f"tiny={tiny}", "--port", str(port), "--drain-timeout-s", "60"])
    try:
        wait_healthy(proc, url)
        conn, resp = _open_stream(url, {"model": "tiny", "prompt": "drain", "max_tokens": 300, "temperature": 0,
                                        "ignore_eos": True})
        assert resp.readline().startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        rest = []
        reader = threading.Thread(target=lambda: rest.append(resp.read().decode()))
        reader.start()
        # new connections are refused once it stops listening (or answered 503 while it drains)
        while True:
            try:
                status = call(url, body={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=5)[0]
            except OSError:
                break
            assert status == 503
            time.sleep(0.02)
        reader.join()
        conn.close()
        text = rest[0]
        assert text.rstrip().endswith("data: [DONE]")
        events = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_serve_user_errors_are_one_line(tiny, tmp_path):
    for args, message in ((["--model", str(tmp_path / "missing")], "no such model folder"),
                          (["--model", f"bad name={tiny}"], "model name"),
                          (["--model", f"a={tiny}", "--model", f"a={tiny}"], "unique")):
        proc = subprocess.run([sys.executable, "-m", "gptj.cli", "serve", *args], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 1, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr


def test_a_model_that_fails_to_load_stops_the_server(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    proc = subprocess.run([sys.executable, "-m", "gptj.cli", "serve", "--model", f"b={tmp_path / 'broken'}",
                           "--port", str(free_port()), "--log-level", "critical"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("gptj serve: error:"), proc.stderr
