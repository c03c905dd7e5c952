"""`gptj serve` as a process: ready only once loaded, SIGTERM drains running requests, user errors."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from gptj.cli import main
from serve_util import GATED_SERVE
from test_serve import _open_stream, call, metric


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


def free_port() -> int:
    """A free port below the kernel's ephemeral range, so no connection a server's own ranks open
    (gloo's, under --tp / --pp, take ephemeral ports) can take it between this and the server's bind,
    as one bound to port 0 here could be taken (seen once: "port is in use")."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low) if low > 2048 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port below the ephemeral range")


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


def poll(fn, until, tries=3000):
    """fn() until until(result) holds: a bound on the tries (never a claim about time)."""
    for _ in range(tries):
        result = fn()
        if until(result):
            return result
        time.sleep(0.01)
    raise AssertionError(f"still {result!r} after {tries} tries")


def keep_alive_call(conn, method, path, body=None):
    conn.request(method, path, json.dumps(body) if body is not None else None, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read()), resp.headers


# the `gptj` command as its console script runs it (main() with no argv), and an exit handler that
# shows whether the interpreter's teardown ran
CONSOLE_SERVE = """
import atexit, sys
atexit.register(print, "interpreter teardown ran", flush=True)
sys.argv = ["gptj", "serve", *sys.argv[1:]]
from gptj.cli import main
sys.exit(main())
"""


def test_sigterm_on_an_idle_server_ends_the_process_without_the_interpreters_teardown(tiny):
    """An idle `gptj serve` on SIGTERM: drains (nothing runs), logs its shutdown, exits 0 at once: the
    interpreter's teardown (freeing the model's tensors one by one: most of a second, more for big
    models) is skipped, the output flushed first. In-process callers of main() keep their teardown."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", CONSOLE_SERVE, "--model", f"tiny={tiny}", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Finished server process" in err and "Traceback" not in err, err
    assert "interpreter teardown ran" not in out


def test_sigterm_keeps_listening_answers_503_and_lets_running_requests_finish(tiny, tmp_path):
    """SIGTERM: new requests get 503 + Retry-After on a new and on a kept-alive connection, /health
    says draining, the running stream and plain request finish whole, and the process exits 0.
    The engine is held (GATED_SERVE) while the test looks, so nothing depends on timing."""
    hold = tmp_path / "hold"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", GATED_SERVE, str(hold), "--model", f"tiny={tiny}", "--port",
                             str(port), "--drain-timeout-s", "600"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)
    log: list[str] = []
    logger = threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True)
    logger.start()
    try:
        wait_healthy(proc, url)
        hold.touch()
        conn, resp = _open_stream(url, {"model": "tiny", "prompt": "drain", "max_tokens": 5, "temperature": 0,
                                        "ignore_eos": True})
        plain = []
        sender = threading.Thread(target=lambda: plain.append(call(url, body={
            "model": "tiny", "prompt": "plain", "max_tokens": 3, "temperature": 0, "ignore_eos": True}, timeout=300)))
        sender.start()
        # Both requests handed to the engine (queued or running), not only admitted: one still being
        # tokenized when the drain begins is refused like a new one.
        poll(lambda: metric(url, "gptj_queue_depth", model="tiny") + metric(url, "gptj_running_sequences",
                                                                            model="tiny"), lambda n: n == 2)
        assert metric(url, "gptj_outstanding_requests", model="tiny") == 2
        keep = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        assert keep_alive_call(keep, "GET", "/health")[0] == 200
        proc.send_signal(signal.SIGTERM)
        # The server has acted on the signal (uvicorn's own handling would have stopped listening by then).
        poll(lambda: "".join(log), lambda text: "draining" in text or "Shutting down" in text)
        # The kept-alive connection stays open: /health on it says draining ...
        status, health, _ = keep_alive_call(keep, "GET", "/health")
        assert status == 503 and health["status"] == "draining"
        # ... and a completion on it is refused 503 in OpenAI's format, with Retry-After.
        status, out, headers = keep_alive_call(keep, "POST", "/v1/completions", {"model": "tiny", "prompt": "x",
                                                                                 "max_tokens": 2})
        assert status == 503 and out["error"]["type"] == "service_unavailable", out
        assert int(headers["Retry-After"]) > 0
        keep.close()
        # A new connection is accepted and answered the same way.
        status, out, headers = call(url, body={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert status == 503 and out["error"]["type"] == "service_unavailable" and int(headers["Retry-After"]) > 0
        status, health, _ = call(url, "GET", "/health")
        assert status == 503 and health["status"] == "draining"
        assert proc.poll() is None  # still draining: the running requests are held
        hold.unlink()
        text = resp.read().decode()
        conn.close()
        assert text.rstrip().endswith("data: [DONE]")
        events = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        sender.join()
        status, out, _ = plain[0]
        assert status == 200 and out["choices"][0]["finish_reason"] == "length", out
        assert proc.wait(timeout=300) == 0
    finally:
        if hold.exists():
            hold.unlink()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        logger.join()
    err = "".join(log)
    assert "Traceback" not in err and "CancelledError" not in err, err


def test_a_port_in_use_is_one_line_before_loading(tiny):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "gptj.cli", "serve", "--model", f"tiny={tiny}", "--port",
                               str(port)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gptj serve: error:") and str(port) in lines[0], proc.stderr
    assert "in use" in lines[0]


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


def test_serve_threads_default_is_the_usable_cores(tiny, monkeypatch):
    """`gptj serve` hands its thread count to the server config: --threads, or the usable cores less
    RESERVED_CORES (none: measured faster on a quiet machine; at least 1)."""
    import gptj.serve.server
    from gptj.threads import RESERVED_CORES, usable_cores

    seen = []
    monkeypatch.setattr(gptj.serve.server, "serve", lambda cfg, log_level="info": seen.append(cfg))
    assert main(["serve", "--model", f"tiny={tiny}", "--port", "0"]) == 0
    assert main(["serve", "--model", f"tiny={tiny}", "--port", "0", "--threads", "3"]) == 0
    assert RESERVED_CORES == 0
    assert [cfg.threads for cfg in seen] == [usable_cores(), 3]
