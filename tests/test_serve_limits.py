"""The server's input side under hostile load: giant prompts refused before tokenizing, admission
before tokenizing, admin paths the file system refuses, header/body read timeouts, the body cap and
the connection cap. Loopback only; every wait is bounded by a socket timeout, none is asserted."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from gptj.cli import main
from gptj.serve.registry import token_bytes_bound
from gptj.tokenizer import load_tokenizer
from serve_util import server_thread

READ_TIMEOUT_S = 0.5  # the server's, in these tests: a stalled connection is closed after it


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("limits-models")
    assert main(["init", "--preset", "tiny", "--out", str(root / "tiny"), "--seed", "1"]) == 0
    return root


@pytest.fixture(scope="module")
def server(models):
    with server_thread({"tiny": models / "tiny"}, admin_token="adm", model_root=str(models),
                       read_timeout_s=READ_TIMEOUT_S) as thread:
        yield thread


@pytest.fixture
def encodes(server, monkeypatch):
    """Counts the served tokenizer's calls (every text prompt goes through encode_batch)."""
    tok = server.state.models["tiny"].tokenizer
    calls = []
    real = tok.encode_batch

    def counting(texts):
        calls.append(len(list(texts)))
        return real(texts)

    monkeypatch.setattr(tok, "encode_batch", counting)
    return calls


def post(url, body=None, raw=None, path="/v1/completions", headers=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# --- item 2: giant prompts -----------------------------------------------------------------------

def test_token_bytes_bound_is_a_lower_bound_on_the_token_count():
    tok = load_tokenizer()
    bound = token_bytes_bound(tok)
    assert bound is not None and bound >= 1
    for text in ("=" * 5000, "-" * 777, " " * 999, "hello world " * 50, "日本語のテキスト" * 40, "🙂" * 300,
                 "<|endoftext|>" * 30, "\x00\x01\xff" * 100, "a" * 4096):
        assert len(tok.encode(text)) >= -(-len(text.encode()) // bound), text[:20]
    assert token_bytes_bound(object()) is None  # not a tokenizers backend: no bound, always tokenized


def test_giant_prompts_are_refused_without_tokenizing(server, encodes):
    served = server.state.models["tiny"]
    giant = "x" * (served.max_model_len * served.max_token_bytes + 1)  # more tokens than the context, surely
    status, out = post(server.url, {"model": "tiny", "prompt": giant, "max_tokens": 1})
    assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
    status, out = post(server.url, {"model": "tiny", "prompt": ["hi", giant], "max_tokens": 1})
    assert status == 400 and "prompt 1" in out["error"]["message"], out
    limit = server.state.body_limit()
    status, out = post(server.url, {"model": "tiny", "prompt": "y" * (limit + 1)})
    assert status == 413 and str(limit) in out["error"]["message"], out
    assert encodes == []  # none of them was tokenized
    # a prompt just within the bound is tokenized, and measured exactly
    status, out = post(server.url, {"model": "tiny", "prompt": "hello " * 4, "max_tokens": 2, "temperature": 0})
    assert status == 200 and encodes == [1], out


def test_a_full_model_refuses_with_429_before_tokenizing(server, encodes):
    served = server.state.models["tiny"]
    served.outstanding += served.capacity  # as if every place were taken
    try:
        status, out = post(server.url, {"model": "tiny", "prompt": "hello", "max_tokens": 1})
    finally:
        served.outstanding -= served.capacity
    assert status == 429 and out["error"]["code"] == "queue_full", out
    assert encodes == []
    # a request that fails after admission gives its places back
    status, _ = post(server.url, {"model": "tiny", "prompt": "hello", "max_tokens": 0})  # 0 needs echo+logprobs
    assert status == 400 and encodes == [1] and served.outstanding == 0


def test_a_small_completion_completes_while_giant_prompts_are_refused(server):
    served = server.state.models["tiny"]
    giant = json.dumps({"model": "tiny", "prompt": "z" * (server.state.body_limit() - 100),
                        "max_tokens": 1}).encode()
    refused: list[int] = []

    def flood() -> None:
        for _ in range(3):
            refused.append(post(server.url, raw=giant)[0])

    floods = [threading.Thread(target=flood) for _ in range(4)]
    for t in floods:
        t.start()
    status, out = post(server.url, {"model": "tiny", "prompt": "once upon a", "max_tokens": 4, "temperature": 0})
    for t in floods:
        t.join()
    assert status == 200 and out["usage"]["completion_tokens"] == 4, out
    assert refused == [400] * 12 and served.outstanding == 0


# --- item 6: admin paths -------------------------------------------------------------------------

def test_admin_paths_the_file_system_refuses_are_4xx_naming_the_path(server, models):
    (models / "loop-a").symlink_to(models / "loop-b")
    (models / "loop-b").symlink_to(models / "loop-a")
    for path in ("a" * 300, "tiny/" + "b" * 256 + "/c", str(models / ("d" * 400)), "loop-a", "loop-a/x"):
        status, out = post(server.url, {"name": "x", "path": path}, path="/admin/models",
                           headers={"Authorization": "Bearer adm"})
        assert status == 400 and out["error"]["param"] == "path", (path[:20], out)
        assert path[:50] in out["error"]["message"], out
    assert "x" not in server.state.models


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every folder")
def test_admin_unreadable_folder_is_403(server, models):
    locked = models / "locked"
    (locked / "m").mkdir(parents=True)
    locked.chmod(0)
    try:
        status, out = post(server.url, {"name": "x", "path": "locked/m"}, path="/admin/models",
                           headers={"Authorization": "Bearer adm"})
    finally:
        locked.chmod(0o755)
    assert status in (400, 403) and "locked/m" in out["error"]["message"], out


# --- item 7: read timeouts, body and connection caps ----------------------------------------------

def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)  # bounds every wait below
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_unfinished_headers_are_closed_after_the_read_timeout(server):
    silent, partial = _connect(server.url), _connect(server.url)
    partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
    try:
        assert _read_all(silent) == b"" and _read_all(partial) == b""  # closed, nothing answered
    finally:
        silent.close()
        partial.close()
    # a keep-alive connection: its first request answered, an unfinished second one is closed too
    sock = _connect(server.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /hea")
    try:
        data = _read_all(sock)
    finally:
        sock.close()
    assert data.startswith(b"HTTP/1.1 200") and data.count(b"HTTP/1.1") == 1


def test_a_declared_giant_body_gets_413_at_once(server):
    sock = _connect(server.url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 9000000000\r\n\r\n")
    try:
        head = sock.recv(65536)  # the answer comes before any of the body was sent
        rest = _read_all(sock)
    finally:
        sock.close()
    assert head.startswith(b"HTTP/1.1 413"), head
    assert b"exceeds" in head + rest


def test_a_body_that_stops_arriving_gets_408_and_is_closed(server):
    sock = _connect(server.url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"model\": ")
    try:
        data = _read_all(sock)
    finally:
        sock.close()
    assert data.startswith(b"HTTP/1.1 408") and b"read timeout" in data, data


def test_connections_beyond_the_cap_get_a_json_503_and_health_still_answers(models):
    """Issue 55: beyond --max-connections a request gets OpenAI's error format with Retry-After and its
    connection is closed; GET /health is answered on any connection; once a held connection closes, a
    new one is served."""
    def ask(url: str, path: str) -> bytes:
        sock = _connect(url)
        try:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            return _read_all(sock)
        finally:
            sock.close()

    with server_thread({"tiny": models / "tiny"}, max_connections=3) as thread:
        held = [_connect(thread.url) for _ in range(3)]
        try:
            refused = ask(thread.url, "/v1/models")
            health = ask(thread.url, "/health")
            held.pop().close()
            for _ in range(100):  # until the server has seen the close (its event loop, not a clock)
                served = ask(thread.url, "/v1/models")
                if served.startswith(b"HTTP/1.1 200"):
                    break
                time.sleep(0.05)
        finally:
            for s in held:
                s.close()
    head, _, body = refused.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), refused
    assert b"retry-after: 1" in head.lower() and b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "too_many_connections" and "limit of 3 open connections" in error["message"]
    assert health.startswith(b"HTTP/1.1 200") and b'"status":"ok"' in health
    assert served.startswith(b"HTTP/1.1 200")
