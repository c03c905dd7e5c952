"""`gptj mlperf --server URL`: the SUT's HTTP backend against a fake server, and against a real one."""

import http.server
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from gptj.cli import main
from gptj.decode import GenerationConfig
from gptj.errors import GptjError
from gptj.mlperf.remote import HTTPBackend, parse_server_url, request_body

# `gptj mlperf` sets torch's thread count for the process: each test gives the next one its count back
pytestmark = pytest.mark.usefixtures("keep_torch_threads")


# --- a fake server ---------------------------------------------------------------------------


class FakeServer:
    """A stdlib HTTP/1.1 server that answers /v1/models and /v1/completions as `respond` says.

    `respond(body) -> (status, headers, payload)`; payload a dict (JSON), bytes, or a list of
    dicts/strings to stream as server-sent events. Every request body is kept in `bodies`.
    """

    def __init__(self, models=("tiny",), respond=None, max_model_len=2048, api_key=None):
        self.api_key = api_key  # like `gptj serve --api-key`: /v1 routes answer 401 without it
        self.models = [{"id": m, "object": "model", "max_model_len": max_model_len} for m in models]
        self.respond = respond or (lambda body: (200, {}, completion(body)))
        self.bodies, self.ports, self.auth = [], set(), []
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive

            def log_message(self, *args):
                pass

            def _send(self, status, headers, payload):
                if isinstance(payload, list):  # server-sent events, chunked
                    self.send_response(status)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    for event in payload:
                        data = event if isinstance(event, str) else json.dumps(event)
                        raw = f"data: {data}\n\n".encode()
                        self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    return
                raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(raw)

            def _refused(self):
                if fake.api_key is None or self.headers.get("Authorization") == f"Bearer {fake.api_key}":
                    return False
                self._send(401, {}, {"error": {"message": "invalid or missing API key", "type": "auth_error"}})
                return True

            def do_GET(self):
                if self._refused():
                    return
                if self.path == "/v1/models":
                    self._send(200, {}, {"object": "list", "data": fake.models})
                else:
                    self._send(404, {}, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self._refused():
                    return
                with fake.lock:
                    fake.bodies.append(body)
                    fake.auth.append(self.headers.get("Authorization"))
                    fake.ports.add(self.client_address[1])
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    self._send(*fake.respond(body))
                finally:
                    with fake.lock:
                        fake.in_flight -= 1

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def fake_tokens(body):
    """What the fake 'generates': max_tokens ids derived from the prompt."""
    return [(sum(body["prompt"]) + i) % 50000 for i in range(body["max_tokens"])]


def completion(body, finish="length"):
    ids = fake_tokens(body)
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "text": "x", "finish_reason": finish, "logprobs": None, "token_ids": ids}],
            "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids),
                      "total_tokens": len(body["prompt"]) + len(ids)}}


class Results:
    """on_done/on_first_token callbacks that collect answers, and wait for n of them."""

    def __init__(self):
        self.done, self.first = {}, {}
        self.cond = threading.Condition()

    def on_done(self, key):
        def cb(tokens, error):
            with self.cond:
                self.done[key] = (tokens, error, threading.current_thread().name)
                self.cond.notify_all()
        return cb

    def on_first(self, key):
        return lambda tok: self.first.setdefault(key, tok)

    def wait(self, n, timeout=30):
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.done) >= n, timeout), self.done
        return self.done


GREEDY = GenerationConfig(max_new_tokens=5)


# --- the request -----------------------------------------------------------------------------


def test_generation_config_maps_onto_the_request():
    assert request_body("m", [1, 2], GenerationConfig.mlperf()) == {
        "model": "m", "prompt": [1, 2], "max_tokens": 128, "min_tokens": 30, "use_beam_search": True, "best_of": 4,
        "n": 1, "temperature": 0, "length_penalty": 1.0, "early_stopping": True, "return_token_ids": True}
    assert request_body("m", [3], GenerationConfig(max_new_tokens=7, eos_token_id=None)) == {
        "model": "m", "prompt": [3], "max_tokens": 7, "min_tokens": 0, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}
    sample = GenerationConfig(do_sample=True, temperature=0.7, top_k=40, top_p=0.9, seed=3, max_new_tokens=4)
    body = request_body("m", [3], sample, stream=True)
    assert {k: body[k] for k in ("temperature", "top_k", "top_p", "seed", "stream")} == \
        {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "seed": 3, "stream": True}
    assert "use_beam_search" not in body
    beams = request_body("m", [3], GenerationConfig(num_beams=3, early_stopping="never", length_penalty=0.5))
    assert (beams["best_of"], beams["early_stopping"], beams["length_penalty"]) == (3, "never", 0.5)


@pytest.mark.parametrize("url, expected", [
    ("http://127.0.0.1:8000", ("http", "127.0.0.1", 8000, "")),
    ("127.0.0.1:8000/", ("http", "127.0.0.1", 8000, "")),
    ("https://example.org/gptj/", ("https", "example.org", 443, "/gptj")),
])
def test_server_urls(url, expected):
    assert parse_server_url(url) == expected


@pytest.mark.parametrize("url", ["ftp://host:1", "http://", "http://host:99999", "http://h:1/?q=1"])
def test_bad_server_urls_fail_in_one_line(url):
    with pytest.raises(GptjError, match="bad server URL"):
        parse_server_url(url)


# --- the backend against the fake -----------------------------------------------------------


def test_samples_run_concurrently_on_keep_alive_connections():
    barrier = threading.Barrier(4, timeout=20)

    def respond(body):
        barrier.wait()  # answers only once 4 requests are in flight together
        return 200, {}, completion(body)

    with FakeServer(respond=respond) as server:
        backend = HTTPBackend(server.url, concurrency=4)
        assert backend.model == "tiny" and backend.max_model_len == 2048
        results = Results()
        try:
            for i in range(12):
                backend.submit([i, 1], GREEDY, results.on_done(i))
            done = results.wait(12)
        finally:
            backend.close()
    assert all(done[i][:2] == (fake_tokens({"prompt": [i, 1], "max_tokens": 5}), None) for i in range(12))
    assert all(name != threading.current_thread().name for _, _, name in done.values())
    assert server.max_in_flight == 4  # never more than `concurrency`
    assert len(server.ports) == 4  # one connection per worker, kept alive across its requests
    assert server.bodies[0] == {"model": "tiny", "prompt": [server.bodies[0]["prompt"][0], 1], "max_tokens": 5,
                                "min_tokens": 0, "temperature": 0, "return_token_ids": True}


def test_429_is_retried_after_retry_after_and_bounded():
    calls = {"n": 0}

    def respond(body):
        calls["n"] += 1
        if body["prompt"][0] == 7 or calls["n"] <= 2:  # prompt 7: busy forever
            return 429, {"Retry-After": "2"}, {"error": {"message": "queue full", "type": "rate_limit"}}
        return 200, {}, completion(body)

    with FakeServer(respond=respond) as server:
        backend = HTTPBackend(server.url, concurrency=1, max_retries=3)
        waits = []
        backend._sleep = waits.append
        results = Results()
        try:
            backend.submit([1], GREEDY, results.on_done("ok"))
            results.wait(1)
            backend.submit([7], GREEDY, results.on_done("busy"))
            done = results.wait(2)
        finally:
            backend.close()
    assert done["ok"][:2] == (fake_tokens({"prompt": [1], "max_tokens": 5}), None)
    assert waits == [2.0] * 5  # two before "ok" was served, three before "busy" gave up
    assert done["busy"][0] == [] and "429" in done["busy"][1] and "3 retries" in done["busy"][1]
    assert backend.retries == 5


def test_retry_after_is_capped():
    n = {"calls": 0}

    def respond(body):
        n["calls"] += 1
        if n["calls"] == 1:
            return 429, {"Retry-After": "100000"}, {"error": {"message": "busy"}}
        if n["calls"] == 2:
            return 429, {}, {"error": {"message": "busy"}}  # no Retry-After: a second
        return 200, {}, completion(body)

    with FakeServer(respond=respond) as server:
        backend = HTTPBackend(server.url, concurrency=1, max_retry_wait_s=5.0)
        waits = []
        backend._sleep = waits.append
        results = Results()
        backend.submit([1], GREEDY, results.on_done(0))
        done = results.wait(1)
        backend.close()
    assert waits == [5.0, 1.0] and done[0][1] is None


@pytest.mark.parametrize("status, payload, expected", [
    (400, {"error": {"message": "max_tokens must be >= 1", "type": "invalid_request_error"}},
     "HTTP 400 Bad Request: max_tokens must be >= 1"),
    (404, {"error": {"message": "model 'x' not found\nsecond line"}},
     "HTTP 404 Not Found: model 'x' not found second line"),
    (500, b"<html>\n<body>oops</body>\n</html>", "HTTP 500 Internal Server Error: <html> <body>oops</body> </html>"),
    (200, b"not json", "not JSON"),
    (200, {"choices": [{"text": "no ids"}]}, "no token_ids"),
])
def test_failures_are_one_line_errors(status, payload, expected):
    with FakeServer(respond=lambda body: (status, {}, payload)) as server:
        backend = HTTPBackend(server.url, concurrency=2)
        results = Results()
        backend.submit([1], GREEDY, results.on_done(0))
        backend.submit([2], GREEDY, results.on_done(1))  # the connection is still usable after an error
        done = results.wait(2)
        backend.close()
    for tokens, error, _ in done.values():
        assert tokens == [] and expected in error and "\n" not in error


def test_a_server_gone_after_start_fails_each_sample():
    with FakeServer() as server:
        backend = HTTPBackend(server.url, concurrency=2)
    results = Results()
    for i in range(3):
        backend.submit([i], GREEDY, results.on_done(i))
    done = results.wait(3)
    backend.close()
    assert all(t == [] and "connection refused" in e for t, e, _ in done.values())


def test_stop_keeps_the_eos_the_engine_would_return():
    with FakeServer(respond=lambda body: (200, {}, completion(body, finish="stop"))) as server:
        backend = HTTPBackend(server.url)
        results = Results()
        backend.submit([1], GREEDY, results.on_done(0))
        done = results.wait(1)
        backend.close()
    assert done[0][0] == fake_tokens({"prompt": [1], "max_tokens": 5}) + [50256]


def test_with_several_eos_ids_the_servers_own_last_token_is_kept():
    """Llama 3.1's answers end at any of several EOS ids: only the server knows which one stopped an answer
    (gptj's lists it in token_ids), so nothing is appended, and what it lists is kept as it is."""
    def respond(body):
        answer = completion(body, finish="stop")
        if body["prompt"] == [2]:  # this answer lists the EOS that stopped it
            answer["choices"][0]["token_ids"][-1] = 511
        return 200, {}, answer

    llama = GREEDY.replace(eos_token_id=(510, 511))
    with FakeServer(respond=respond) as server:
        backend = HTTPBackend(server.url)
        results = Results()
        backend.submit([1], llama, results.on_done(0))
        backend.submit([2], llama, results.on_done(1))
        done = results.wait(2)
        backend.close()
    assert done[0][0] == fake_tokens({"prompt": [1], "max_tokens": 5})
    assert done[1][0] == fake_tokens({"prompt": [2], "max_tokens": 5})[:-1] + [511]


def test_streaming_reports_the_first_token():
    def respond(body):
        assert body["stream"] is True
        ids = fake_tokens(body)
        chunks = [{"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": None}]}]
        chunks += [{"choices": [{"index": 0, "text": "t", "token_ids": ids[i:i + 2],
                                 "finish_reason": "length" if i + 2 >= len(ids) else None}]}
                   for i in range(0, len(ids), 2)]
        chunks += [{"choices": [], "usage": {"completion_tokens": len(ids)}}, "[DONE]"]
        return 200, {}, chunks

    with FakeServer(respond=respond) as server:
        backend = HTTPBackend(server.url, concurrency=2)
        results = Results()
        for i in range(3):
            backend.submit([i + 10], GREEDY, results.on_done(i), on_first_token=results.on_first(i))
        done = results.wait(3)
        backend.close()
    for i in range(3):
        ids = fake_tokens({"prompt": [i + 10], "max_tokens": 5})
        assert done[i][:2] == (ids, None) and results.first[i] == ids[0]


def test_an_error_event_in_a_stream_fails_that_sample_only():
    def respond(body):
        if body["prompt"] == [1]:
            return 200, {}, [{"error": {"message": "generation failed: boom", "type": "server_error"}}, "[DONE]"]
        return 200, {}, [completion(body), "[DONE]"]

    with FakeServer(respond=respond) as server:
        backend = HTTPBackend(server.url, concurrency=1, api_key="sekret")
        results = Results()
        for i in (1, 2):
            backend.submit([i], GREEDY, results.on_done(i), on_first_token=results.on_first(i))
        done = results.wait(2)
        backend.close()
    assert done[1][:2] == ([], "server error: generation failed: boom")
    assert done[2][:2] == (fake_tokens({"prompt": [2], "max_tokens": 5}), None)
    assert server.auth == ["Bearer sekret"] * 2


def test_a_stream_cut_short_is_an_error():
    with FakeServer(respond=lambda body: (200, {}, [completion(body)])) as server:  # no [DONE]
        backend = HTTPBackend(server.url)
        results = Results()
        backend.submit([1], GREEDY, results.on_done(0), on_first_token=results.on_first(0))
        done = results.wait(1)
        backend.close()
    assert done[0][0] == [] and "before [DONE]" in done[0][1]


def test_the_served_model_is_picked_or_named():
    with FakeServer(models=("a", "b")) as server:
        with pytest.raises(GptjError, match="serves 2 models .*--server-model"):
            HTTPBackend(server.url)
        with pytest.raises(GptjError, match="does not serve a model 'c'"):
            HTTPBackend(server.url, model_name="c")
        backend = HTTPBackend(server.url, model_name="b")
        results = Results()
        backend.submit([1], GREEDY, results.on_done(0))
        results.wait(1)
        backend.close()
        assert server.bodies[0]["model"] == "b"


# --- the CLI ---------------------------------------------------------------------------------


def test_cli_without_a_server_listening_fails_in_one_line(tmp_path, capsys):
    code = main(["mlperf", "--server", "http://127.0.0.1:9", "--log-dir", str(tmp_path / "logs"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "http://127.0.0.1:9" in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("key", [None, "wrong"])
def test_cli_a_server_wanting_an_api_key_names_the_variable_to_set(tmp_path, capsys, monkeypatch, key):
    if key is None:
        monkeypatch.delenv("GPTJ_SERVER_API_KEY", raising=False)
    else:
        monkeypatch.setenv("GPTJ_SERVER_API_KEY", key)
    with FakeServer(api_key="sekret") as server:
        code = main(["mlperf", "--server", server.url, "--log-dir", str(tmp_path / "logs"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "401" in err[0] and "$GPTJ_SERVER_API_KEY" in err[0]
    assert ("refused" in err[0]) == (key is not None)
    assert "sekret" not in err[0] and "wrong" not in err[0]  # the key itself is never printed
    assert not (tmp_path / "logs").exists()


def test_cli_with_the_api_key_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GPTJ_SERVER_API_KEY", "sekret")
    with FakeServer(api_key="sekret") as server:
        code = main(["mlperf", "--server", server.url, "--log-dir", str(tmp_path / "logs"), "--quiet",
                     "--max-examples", "2"])
    assert code == 0 and server.auth == ["Bearer sekret"] * 2


def test_cli_needs_a_model_or_a_server(capsys):
    assert main(["mlperf", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model" in err[0] and "--server" in err[0]


def test_cli_prompts_too_long_for_the_server(tmp_path, capsys):
    with FakeServer(max_model_len=64) as server:
        code = main(["mlperf", "--server", server.url, "--log-dir", str(tmp_path / "logs"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "max_model_len 64" in err[0]


def test_cli_a_failing_server_fails_the_run_in_one_line(tmp_path, capsys):
    bad = {"error": {"message": "use_beam_search is not supported", "type": "invalid_request_error"}}
    with FakeServer(respond=lambda body: (400, {}, bad)) as server:
        code = main(["mlperf", "--server", server.url, "--log-dir", str(tmp_path / "logs"), "--quiet",
                     "--max-examples", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("gptj mlperf: error: sample ")
    assert "use_beam_search is not supported" in err[-1]


def read_accuracy_log(log_dir):
    entries = json.loads((Path(log_dir) / "mlperf_log_accuracy.json").read_text())
    return {e["qsl_idx"]: np.frombuffer(bytes.fromhex(e["data"]), np.int64).tolist() for e in entries}


def test_cli_accuracy_run_against_the_fake(tmp_path, capsys):
    """The whole run over HTTP, no model here: LoadGen's log holds what the server returned."""
    with FakeServer() as server:
        code = main(["mlperf", "--server", server.url, "--log-dir", str(tmp_path / "logs"), "--quiet",
                     "--max-examples", "3", "--max-new-tokens", "6", "--min-new-tokens", "2",
                     "--server-concurrency", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    answers = read_accuracy_log(tmp_path / "logs")
    prompts = {tuple(b["prompt"]) for b in server.bodies}
    assert len(answers) == 3 and len(prompts) == 3
    assert sorted(map(tuple, answers.values())) == sorted(tuple(fake_tokens({"prompt": list(p), "max_tokens": 6}))
                                                         for p in prompts)
    assert all(b["use_beam_search"] and b["best_of"] == 4 and b["min_tokens"] == 2 for b in server.bodies)
    run = json.loads((tmp_path / "logs" / "run.json").read_text())
    assert run["remote"]["url"] == server.url and run["remote"]["model"] == "tiny"
    assert run["settings"]["server"] == server.url and run["settings"]["model"] is None
    assert any("remote gptj server" in n for n in run["notes"])
    summary = (tmp_path / "logs" / "summary.md").read_text()
    assert f"gptj server at `{server.url}`" in summary


# --- against a real gptj server --------------------------------------------------------------


@pytest.mark.parametrize("scenario, gen_args", [
    ("Offline", ["--num-beams", "4", "--max-new-tokens", "12", "--min-new-tokens", "3"]),
    ("Server", ["--num-beams", "1", "--max-new-tokens", "6", "--min-new-tokens", "0"]),  # streams (first tokens)
])
def test_a_run_over_the_network_equals_the_run_in_process(tiny_checkpoint, tmp_path, capsys, scenario, gen_args):
    from serve_util import running_server

    common = ["--scenario", scenario, "--mode", "accuracy", "--max-examples", "3", "--target-qps", "100", "--quiet",
              *gen_args]
    assert main(["mlperf", "--model", str(tiny_checkpoint), "--log-dir", str(tmp_path / "local"), *common]) == 0
    with running_server({"tiny": tiny_checkpoint}, max_batch_size=8) as url:
        assert main(["mlperf", "--server", url, "--log-dir", str(tmp_path / "remote"), "--server-concurrency", "3",
                     *common]) == 0
    capsys.readouterr()
    local, remote = read_accuracy_log(tmp_path / "local"), read_accuracy_log(tmp_path / "remote")
    assert sorted(local) == [0, 1, 2] and remote == local
    assert all(len(ids) >= 3 for ids in local.values())
    accuracy = [json.loads((tmp_path / d / "accuracy.json").read_text()) for d in ("local", "remote")]
    for a in accuracy:
        assert a.pop("log_path").endswith("mlperf_log_accuracy.json")
    assert accuracy[0] == accuracy[1] and accuracy[0]["gen_num"] == 3
    run = json.loads((tmp_path / "remote" / "run.json").read_text())
    assert run["remote"]["model"] == "tiny" and run["remote"]["max_model_len"] == 2048
    assert run["sut"]["samples"] == 3 and run["sut"]["duplicate_answers"] == 0
    if scenario == "Server":  # greedy samples stream: their first tokens reached LoadGen early
        assert run["sut"]["first_tokens"] == 3
