"""The server: the official openai client against `gptj generate`, concurrency, backpressure,
disconnects, bad input, schema fuzzing, admin, auth, faults, metrics. Loopback only."""

from __future__ import annotations

import http.client
import json
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib

import openai
import pytest

from gptj.cli import main
from gptj.serve.registry import MAX_RETRY_AFTER_S
from gptj.tokenizer import load_tokenizer
from serve_util import running_server, server_thread

TOK = load_tokenizer()
# Schema fuzzing runs the same cases every time in CI; FUZZ_EXAMPLES=N explores N fresh random ones.
DERANDOMIZE = "FUZZ_EXAMPLES" not in os.environ


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-models")
    for name, seed in (("tiny", 1), ("other", 2)):
        assert main(["init", "--preset", "tiny", "--out", str(root / name), "--seed", str(seed)]) == 0
    return root


@pytest.fixture(scope="module")
def server(models):
    with server_thread({"tiny": models / "tiny", "other": models / "other"}, max_batch_size=8, max_queue=64,
                       admin_token="adm", model_root=str(models)) as thread:
        yield thread


def call(url, method="POST", path="/v1/completions", body=None, raw=None, headers=None, timeout=120):
    """(status, parsed JSON or text, headers) without raising on 4xx/5xx."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text, hdrs = r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        status, text, hdrs = e.code, e.read().decode(), e.headers
    try:
        return status, json.loads(text), hdrs
    except ValueError:
        return status, text, hdrs


def generate_cli(model_dir, capsys, *args):
    assert main(["generate", "--model", str(model_dir), "--json", *args]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def text_of(ids):
    return TOK.decode(ids, skip_special_tokens=True)


def metric(url, name, absent=None, **labels):
    """The sample of `name` with `labels` on /metrics; `absent` where there is none (None: an error;
    a counter has no sample for a model until it first counts)."""
    _, text, _ = call(url, "GET", "/metrics")
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            return float(m.group(2))
    if absent is not None:
        return absent
    raise AssertionError(f"{name}{{{want}}} not in /metrics")


def thread_steps(url, model):
    """gptj_engine_thread_steps_total of `model` on /metrics: {threads: decode steps timed at that count}."""
    _, text, _ = call(url, "GET", "/metrics")
    found = re.findall(rf'^gptj_engine_thread_steps_total\{{model="{model}",threads="(\d+)"\}} (\S+)$', text, re.M)
    return {int(n): float(v) for n, v in found}


# --- the openai client equals gptj generate ------------------------------------------


SETTINGS = [
    (dict(temperature=0), ["--temperature", "0"]),
    (dict(temperature=0.8, top_p=0.9, seed=7, extra_body={"top_k": 40}),
     ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "40", "--seed", "7"]),
    (dict(temperature=0, n=1, best_of=3, extra_body={"use_beam_search": True, "min_tokens": 4, "early_stopping": True}),
     ["--num-beams", "3", "--min-new-tokens", "4"]),
]


@pytest.mark.parametrize("kwargs,flags", SETTINGS, ids=["greedy", "sampled", "beam"])
def test_openai_client_equals_generate(server, models, capsys, kwargs, flags):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompt = "The quick brown fox"
    (want,) = generate_cli(models / "tiny", capsys, "--prompt", prompt, "--max-new-tokens", "12", *flags)
    kwargs = dict(kwargs)
    extra = {**kwargs.pop("extra_body", {}), "return_token_ids": True}
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, extra_body=extra, **kwargs)
    choice = plain.choices[0]
    assert choice.token_ids == want["token_ids"]
    assert choice.text == text_of(want["token_ids"])
    assert choice.finish_reason in ("stop", "length")
    assert plain.usage.prompt_tokens == len(TOK.encode(prompt))
    assert plain.usage.completion_tokens == len(want["token_ids"])

    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, stream=True,
                                       stream_options={"include_usage": True}, extra_body=extra, **kwargs)
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])]
    assert ids == want["token_ids"] and text == text_of(want["token_ids"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == len(want["token_ids"])
    if "use_beam_search" not in extra:
        assert len([c for c in chunks if c.choices]) > 1  # streamed token by token, not at the end


def test_token_prompts_several_prompts_n_and_models(server, models, capsys):
    ids = [[464, 2068, 7586], [15496, 995]]
    want = generate_cli(models / "other", capsys, "--prompt-ids", "464,2068,7586", "--prompt-ids", "15496,995",
                        "--max-new-tokens", "6")
    status, body, _ = call(server.url, body={"model": "other", "prompt": ids, "max_tokens": 6, "temperature": 0,
                                             "n": 2, "return_token_ids": True})
    assert status == 200
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in body["choices"]] == [want[0]["token_ids"]] * 2 + [want[1]["token_ids"]] * 2
    assert body["usage"]["prompt_tokens"] == 5
    _, tiny, _ = call(server.url, body={"model": "tiny", "prompt": ids[0], "max_tokens": 6, "temperature": 0,
                                        "return_token_ids": True})
    assert tiny["choices"][0]["token_ids"] != want[0]["token_ids"]  # a different model answered


def test_beam_search_returns_the_n_best(server):
    _, body, _ = call(server.url, body={"model": "tiny", "prompt": "Hello", "max_tokens": 8, "use_beam_search": True,
                                        "best_of": 4, "n": 3, "return_token_ids": True})
    beams = [c["token_ids"] for c in body["choices"]]
    assert len(beams) == 3 and len({tuple(b) for b in beams}) == 3


def test_logprobs_echo_stop_and_stop_tokens(server):
    base = {"model": "tiny", "prompt": "Hello world", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    _, full, _ = call(server.url, body=base)
    ids = full["choices"][0]["token_ids"]
    text = full["choices"][0]["text"]

    _, lp, _ = call(server.url, body={**base, "logprobs": 3, "echo": True})
    c = lp["choices"][0]
    assert c["text"] == "Hello world" + text
    n_prompt = len(TOK.encode("Hello world"))
    assert len(c["logprobs"]["tokens"]) == n_prompt + len(ids)
    assert c["logprobs"]["token_logprobs"][0] is None
    for chosen, top in zip(c["logprobs"]["token_logprobs"][n_prompt:], c["logprobs"]["top_logprobs"][n_prompt:]):
        assert len(top) == 3 and chosen <= 0 and max(top.values()) == pytest.approx(chosen, abs=1e-5)  # greedy

    _, streamed, _ = call(server.url, body={**base, "logprobs": 3, "echo": True, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.split("\n\n") if line.startswith("data: {")]
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    values = [v for e in events for v in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert tokens == c["logprobs"]["tokens"] and values == pytest.approx(c["logprobs"]["token_logprobs"])
    assert [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]] == c["logprobs"]["text_offset"]
    assert "".join(e["choices"][0]["text"] for e in events) == c["text"]

    # a temperature so small that logits / temperature overflow decodes greedily (found by the fuzzer)
    _, tiny_t, _ = call(server.url, body={**base, "temperature": 1e-308})
    assert tiny_t["choices"][0]["token_ids"] == ids

    # max_tokens 0 + echo + logprobs scores the prompt (what lm-eval's loglikelihood requests send)
    _, scored, _ = call(server.url, body={**base, "max_tokens": 0, "logprobs": 0, "echo": True})
    s = scored["choices"][0]
    assert s["text"] == "Hello world" and s["finish_reason"] == "length" and scored["usage"]["completion_tokens"] == 0
    assert s["logprobs"]["token_logprobs"] == pytest.approx(c["logprobs"]["token_logprobs"][:n_prompt])
    assert call(server.url, body={**base, "max_tokens": 0})[0] == 400

    _, cut, _ = call(server.url, body={**base, "stop_token_ids": [ids[3]]})
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["choices"][0]["token_ids"] == ids[:4]
    assert cut["choices"][0]["text"] == text_of(ids[:3])

    stop = text[len(text_of(ids[:2])):][:3]
    assert stop
    for stream in (False, True):
        status, out, _ = call(server.url, body={**base, "stop": [stop], "stream": stream})
        assert status == 200
        got = out["choices"][0]["text"] if not stream else "".join(
            json.loads(line[6:])["choices"][0]["text"] for line in out.split("\n\n")
            if line.startswith("data: {"))
        assert got == text[:text.index(stop)]


# --- load: concurrency, backpressure, disconnects ------------------------------------


def test_64_concurrent_clients_equal_their_solo_results(server):
    prompts = [[(i * 37 + k * 11) % 50000 + 1 for k in range(3 + i % 9)] for i in range(64)]
    body = {"model": "tiny", "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    solo = [call(server.url, body={**body, "prompt": p})[1]["choices"][0]["token_ids"] for p in prompts[:8]]
    results = [None] * 64

    def client(i):
        results[i] = call(server.url, body={**body, "prompt": prompts[i]})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None and r[0] == 200 for r in results)
    assert [r[1]["choices"][0]["token_ids"] for r in results[:8]] == solo
    again = [call(server.url, body={**body, "prompt": p})[1]["choices"][0]["token_ids"] for p in prompts[8:]]
    assert [r[1]["choices"][0]["token_ids"] for r in results[8:]] == again


def test_small_queue_refuses_the_excess_with_429(models):
    with running_server({"tiny": models / "tiny"}, max_batch_size=2, max_queue=2) as url:
        results = []
        lock = threading.Lock()

        def client(i):
            r = call(url, body={"model": "tiny", "prompt": [i + 1, 2, 3], "max_tokens": 40, "temperature": 0,
                                "ignore_eos": True})
            with lock:
                results.append(r)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        statuses = sorted(r[0] for r in results)
        assert len(results) == 24 and set(statuses) == {200, 429}
        refused = [r for r in results if r[0] == 429]
        assert all(1 <= int(r[2]["Retry-After"]) <= MAX_RETRY_AFTER_S and r[1]["error"]["type"] == "rate_limit_error"
                   for r in refused)
        assert all(len(r[1]["choices"][0]["text"]) > 0 for r in results if r[0] == 200)
        assert metric(url, "gptj_outstanding_requests", model="tiny") == 0
        assert call(url, body={"model": "tiny", "prompt": "ok", "max_tokens": 2})[0] == 200  # still serving


def _open_stream(url, body):
    parsed = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def test_dropped_stream_leaves_the_engine(server):
    name = "tiny"
    engine = server.state.models[name].engine
    steps_before = engine.steps
    max_tokens = 1500
    # read before the stream opens: once it has, the engine may count its first tokens before we look
    tokens_before = metric(server.url, "gptj_generation_tokens_total", absent=0.0, model=name)
    conn, resp = _open_stream(server.url, {"model": name, "prompt": "Once upon a time", "max_tokens": max_tokens,
                                           "temperature": 0, "ignore_eos": True})
    for _ in range(3):
        assert resp.readline().startswith(b"data: ")
        resp.readline()
    assert metric(server.url, "gptj_running_sequences", model=name) == 1
    assert metric(server.url, "gptj_generation_tokens_total", model=name) >= tokens_before + 3  # counted as made
    conn.sock.shutdown(2)
    conn.close()
    dropped = time.perf_counter()
    while metric(server.url, "gptj_running_sequences", model=name) != 0:
        time.sleep(0.01)
    left_after = time.perf_counter() - dropped
    # It was cancelled, not run out: far fewer engine steps than the tokens it asked for.
    assert engine.steps - steps_before < max_tokens // 3, left_after
    assert metric(server.url, "gptj_outstanding_requests", model=name) == 0
    while metric(server.url, "gptj_requests_total", model=name, status="499") < 1:
        time.sleep(0.01)


def test_dropped_plain_request_is_cancelled_too(server):
    name = "other"
    engine = server.state.models[name].engine
    steps_before = engine.steps
    parsed = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": name, "prompt": "x", "max_tokens": 1500,
                                                        "temperature": 0, "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    while metric(server.url, "gptj_running_sequences", model=name) != 1:
        time.sleep(0.005)
    conn.sock.shutdown(2)
    conn.close()
    while metric(server.url, "gptj_outstanding_requests", model=name) != 0:
        time.sleep(0.01)
    assert engine.steps - steps_before < 500


# --- bad input -----------------------------------------------------------------------


BAD = [
    (dict(prompt="x", max_tokens=5000), 400, "maximum context length is 2048"),
    (dict(prompt=[1] * 2040, max_tokens=16), 400, "maximum context length is 2048"),
    (dict(prompt="x", max_tokens=-1), 400, "max_tokens"),
    (dict(prompt="x", max_tokens=0), 400, "max_tokens 0 only scores the prompt"),
    (dict(prompt="x", max_tokens=10**12), 400, "max_tokens"),
    (dict(prompt="x", max_tokens="5"), 400, "max_tokens"),
    (dict(prompt="x", max_tokens=5.5), 400, "max_tokens"),
    (dict(prompt="x", temperature=-1), 400, "temperature"),
    (dict(prompt="x", temperature=1e9), 400, "temperature"),
    (dict(prompt="x", temperature="hot"), 400, "temperature"),
    (dict(prompt="x", top_p=0), 400, "top_p"),
    (dict(prompt="x", top_k=-5), 400, "top_k"),
    (dict(prompt="x", n=0), 400, "n"),
    (dict(prompt="x", n=1000), 400, "n"),
    (dict(prompt="x", seed=-3), 400, "seed"),
    (dict(prompt="x", logprobs=100), 400, "logprobs"),
    (dict(prompt="x", stream="yes"), 400, "stream"),
    (dict(prompt="x", stop=[""]), 400, "stop"),
    (dict(prompt="x", stop=["a"] * 100), 400, "stop"),
    (dict(prompt="x", min_tokens=10, max_tokens=5), 400, "min_tokens"),
    (dict(prompt="x", use_beam_search=True, best_of=2, n=3), 400, "n"),
    (dict(prompt="x", use_beam_search=True, logprobs=1), 400, "logprobs"),
    (dict(prompt="x", best_of=3), 400, "best_of"),
    (dict(prompt="x", suffix="y"), 400, "suffix"),
    (dict(prompt="x", frequency_penalty=3.0), 400, "frequency_penalty must be from -2 to 2"),
    (dict(prompt="x", presence_penalty="high"), 400, "presence_penalty"),  # (unknown fields: accepted, ignored)
    (dict(prompt=""), 400, "empty"),
    (dict(prompt=[]), 400, "prompt"),
    (dict(prompt=[[1, 2], []]), 400, "prompt 1 is empty"),
    (dict(prompt=[99999999]), 400, "outside the vocabulary"),
    (dict(prompt=[-1]), 400, "prompt"),
    (dict(prompt=[1.5]), 400, "prompt"),
    (dict(prompt={"text": "x"}), 400, "prompt"),
    (dict(prompt=None), 400, "prompt"),
    (dict(max_tokens=3), 400, "prompt"),
    (dict(model="nope", prompt="x"), 404, "'nope' does not exist"),
    (dict(model=5, prompt="x"), 400, "model"),
    (dict(prompt="x", stream_options={"include_usage": "yes"}), 400, "include_usage"),
]


@pytest.mark.parametrize("body,status,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_a_4xx_naming_the_field(server, body, status, message):
    got, out, _ = call(server.url, body={"model": "tiny", **body})
    assert got == status, out
    assert set(out["error"]) == {"message", "type", "param", "code"}
    assert message in out["error"]["message"], out["error"]["message"]


@pytest.mark.parametrize("raw,message", [
    (b'{"model": "tiny", "prompt": ', "malformed JSON"),
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', "UTF-8"),
    (b'[1, 2, 3]', "body"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": NaN}', "max_tokens"),
    (b'', "body"),
])
def test_malformed_bodies_are_400(server, raw, message):
    status, out, _ = call(server.url, raw=raw)
    assert status == 400 and message in out["error"]["message"], out


def test_oversized_bodies_are_413(server):
    from gptj.serve.protocol import MAX_BODY_BYTES

    big = json.dumps({"model": "tiny", "prompt": "x" * (MAX_BODY_BYTES + 10)}).encode()
    status, out, _ = call(server.url, raw=big)
    assert status == 413 and "exceeds" in out["error"]["message"]
    # without a Content-Length (chunked): refused once the limit has arrived
    parsed = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    conn.request("POST", "/v1/completions", iter([big[i:i + 65536] for i in range(0, len(big), 65536)]),
                 {"Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and "exceeds" in json.loads(resp.read())["error"]["message"]
    conn.close()
    assert call(server.url, body={"model": "tiny", "prompt": [[1]] * 300})[0] == 400  # too many prompts
    assert call(server.url, "GET", "/health")[0] == 200


def test_other_routes_answer_in_openai_format(server):
    status, out, _ = call(server.url, "GET", "/v1/nothing")
    assert status == 404 and "message" in out["error"]
    status, out, _ = call(server.url, "GET", "/v1/completions")
    assert status == 405 and "message" in out["error"]
    assert call(server.url, "GET", "/health")[0] == 200


def test_schema_fuzzing_finds_no_5xx(server):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    spec = json.loads(urllib.request.urlopen(server.url + "/openapi.json").read())
    operation = schemathesis.openapi.from_dict(spec)["/v1/completions"]["POST"]
    seen = {}
    for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
        @settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 40)), deadline=None, database=None,
                  derandomize=DERANDOMIZE, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case):
            if isinstance(case.body, dict):
                # crc32, not hash(): str hashes differ per process (PYTHONHASHSEED), and with them which
                # cases reach the model, so a run could see no 200 at all
                if zlib.crc32(json.dumps(case.body, sort_keys=True, default=str).encode()) % 2:
                    case.body["model"] = "tiny"  # reach past the model lookup
                if isinstance(case.body.get("max_tokens"), int) and case.body["max_tokens"] > 4:
                    case.body["max_tokens"] = 4
                case.body.pop("stream", None)
            response = case.call(base_url=server.url, timeout=120)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.body, response.text)

        check()
    assert any(s == 200 for s in seen) and any(400 <= s < 500 for s in seen), seen
    assert call(server.url, "GET", "/health")[0] == 200


def test_schema_fuzzing_of_every_route_finds_no_5xx(models):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    from hypothesis.errors import Unsatisfiable

    # its own server: the fuzzer may load and unload models through the admin routes
    with running_server({"tiny": models / "tiny"}, admin_token="adm", model_root=str(models)) as url:
        spec = json.loads(urllib.request.urlopen(url + "/openapi.json").read())
        schema = schemathesis.openapi.from_dict(spec)
        operations = [(path, method) for path, methods in spec["paths"].items() for method in methods
                      if path != "/v1/completions"]
        assert len(operations) >= 5
        for path, method in operations:
            operation = schema[path][method.upper()]
            for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
                @settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 15)), deadline=None, database=None,
                          derandomize=DERANDOMIZE, suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode))
                def check(case):
                    headers = {"Authorization": "Bearer adm"} if hash(repr(case.body)) % 2 else {}
                    response = case.call(base_url=url, headers=headers, timeout=120)
                    assert response.status_code < 500, (path, case.body, response.text)

                try:
                    check()
                except Unsatisfiable:  # nothing to make invalid (a route without parameters)
                    assert mode == schemathesis.GenerationMode.NEGATIVE
        assert call(url, "GET", "/health")[0] == 200


# --- faults, timeouts, auth -------------------------------------------------------------


def test_engine_error_fails_only_that_request(models):
    with server_thread({"tiny": models / "tiny"}) as thread:
        runner = thread.state.models["tiny"].engine.runner  # the engine's only caller of the model
        real = runner._forward

        def faulty(decode, prefill, *args):
            if any(chunk.request.prompt[0] == 666 for chunk in prefill):
                raise RuntimeError("injected fault")
            return real(decode, prefill, *args)

        runner._forward = faulty
        status, out, _ = call(thread.url, body={"model": "tiny", "prompt": [666, 1], "max_tokens": 4})
        assert status == 500 and out["error"]["type"] == "server_error" and "injected fault" in out["error"]["message"]
        status, out, _ = call(thread.url, body={"model": "tiny", "prompt": [666, 1], "max_tokens": 4, "stream": True})
        assert status == 200 and "injected fault" in out and out.rstrip().endswith("data: [DONE]")
        assert call(thread.url, body={"model": "tiny", "prompt": [5, 1], "max_tokens": 4})[0] == 200
        assert metric(thread.url, "gptj_requests_total", model="tiny", status="500") == 2


def test_a_stopped_engine_loop_fails_its_requests_then_every_request(models):
    """The loop itself failing (under --tp/--pp: a rank that died) is a 500 for the requests it
    held, never an empty 200, and a 503 naming the failed model for its later requests (not a hang)."""
    with server_thread({"tiny": models / "tiny"}) as thread:
        engine = thread.state.models["tiny"].engine

        def broken() -> None:
            raise RuntimeError("injected loop fault")

        engine.step = broken
        status, out, _ = call(thread.url, body={"model": "tiny", "prompt": "x", "max_tokens": 4})
        assert status == 500 and "injected loop fault" in out["error"]["message"], out
        status, out, _ = call(thread.url, body={"model": "tiny", "prompt": "x", "max_tokens": 4})
        assert status == 503 and out["error"]["code"] == "model_failed", out
        assert "has failed: its engine stopped (RuntimeError: injected loop fault)" in out["error"]["message"]


def test_request_timeout_is_408_and_frees_the_engine(models):
    with running_server({"tiny": models / "tiny"}, request_timeout_s=0.2) as url:
        status, out, _ = call(url, body={"model": "tiny", "prompt": "x", "max_tokens": 2000, "ignore_eos": True,
                                         "temperature": 0})
        assert status == 408 and "0.2 s" in out["error"]["message"]
        while metric(url, "gptj_outstanding_requests", model="tiny") != 0:
            time.sleep(0.01)
        assert call(url, body={"model": "tiny", "prompt": "x", "max_tokens": 2})[0] == 200


def test_api_key(models):
    with running_server({"tiny": models / "tiny"}, api_key="s3cret") as url:
        assert call(url, body={"model": "tiny", "prompt": "x", "max_tokens": 2})[0] == 401
        assert call(url, "GET", "/v1/models")[0] == 401
        ok = call(url, body={"model": "tiny", "prompt": "x", "max_tokens": 2},
                  headers={"Authorization": "Bearer s3cret"})
        assert ok[0] == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert call(url, "GET", "/health")[0] == 200  # health stays open to probes
        assert call(url, "GET", "/metrics")[0] == 401  # metrics need the key (--public-metrics opens them)


# --- models, admin, metrics -------------------------------------------------------------


def test_models_health_metrics(server):
    status, out, _ = call(server.url, "GET", "/v1/models")
    assert status == 200 and {m["id"] for m in out["data"]} >= {"tiny", "other"}
    assert all(m["max_model_len"] == 2048 for m in out["data"])
    status, out, _ = call(server.url, "GET", "/health")
    assert status == 200 and out["status"] == "ok"
    call(server.url, body={"model": "tiny", "prompt": "metrics", "max_tokens": 3, "temperature": 0})
    assert metric(server.url, "gptj_requests_total", model="tiny", status="200") >= 1
    assert metric(server.url, "gptj_time_to_first_token_seconds_count", model="tiny") >= 1
    assert metric(server.url, "gptj_time_per_output_token_seconds_count", model="tiny") >= 1
    assert metric(server.url, "gptj_generation_tokens_total", model="tiny") >= 3
    assert metric(server.url, "gptj_queue_depth", model="tiny") == 0
    assert 0 <= metric(server.url, "gptj_kv_usage_ratio", model="tiny") <= 1
    assert metric(server.url, "gptj_generation_tokens_per_second", model="tiny") >= 0
    # the engine's step counters (benchmarks/serve_profile.py's reading): a request of 4 new tokens is
    # a prefill step and 3 decode steps, each decoding its one row, and every phase takes time
    keys = ("gptj_engine_steps_total", "gptj_engine_decode_rows_total", "gptj_engine_prefill_steps_total")
    before = {k: metric(server.url, k, model="tiny") for k in keys}
    tuned = thread_steps(server.url, "tiny")
    forward = metric(server.url, "gptj_engine_step_seconds_total", model="tiny", phase="forward")
    call(server.url, body={"model": "tiny", "prompt": "steps", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert metric(server.url, "gptj_engine_steps_total", model="tiny") - before["gptj_engine_steps_total"] == 4
    assert metric(server.url, "gptj_engine_decode_rows_total", model="tiny") - before["gptj_engine_decode_rows_total"] == 3
    assert metric(server.url, "gptj_engine_prefill_steps_total", model="tiny") - before["gptj_engine_prefill_steps_total"] == 1
    assert metric(server.url, "gptj_engine_step_seconds_total", model="tiny", phase="forward") > forward
    assert metric(server.url, "gptj_compute_threads", model="tiny") >= 1
    # the thread tuner (on: no --threads) timed the 3 decode-only steps, at whatever counts it chose
    now = thread_steps(server.url, "tiny")
    assert sum(now.values()) - sum(tuned.values()) == 3 and all(1 <= n <= os.cpu_count() for n in now)
    spec = call(server.url, "GET", "/openapi.json")[1]
    assert "CompletionRequest" in spec["components"]["schemas"]


def test_publish_ls_unpublish(server, models, tmp_path, capsys):
    url = server.url
    assert main(["publish", "late", str(models / "tiny"), "--server", url, "--admin-token", "adm"]) == 0
    assert main(["ls", "--server", url]) == 0
    listing = capsys.readouterr().out
    assert re.search(r"^late\s+ready\s+2048", listing, re.M) and re.search(r"^tiny\s", listing, re.M)
    _, a, _ = call(url, body={"model": "late", "prompt": "x", "max_tokens": 5, "temperature": 0,
                              "return_token_ids": True})
    _, b, _ = call(url, body={"model": "tiny", "prompt": "x", "max_tokens": 5, "temperature": 0,
                              "return_token_ids": True})
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]  # same checkpoint

    # unpublish waits for a running stream, which completes
    conn, resp = _open_stream(url, {"model": "late", "prompt": "y", "max_tokens": 60, "ignore_eos": True})
    resp.readline()
    done = []
    t = threading.Thread(target=lambda: done.append(main(["unpublish", "late", "--server", url,
                                                          "--admin-token", "adm"])))
    t.start()
    rest = resp.read().decode()
    conn.close()
    t.join()
    assert done == [0] and rest.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in rest
    assert call(url, body={"model": "late", "prompt": "x", "max_tokens": 2})[0] == 404
    assert "late" not in {m["id"] for m in call(url, "GET", "/v1/models")[1]["data"]}

    # refused: wrong token, outside the model root, duplicate name, not a model
    outside = tmp_path / "outside"
    outside.mkdir()
    for args, message in ((["publish", "x", str(models / "tiny"), "--admin-token", "bad"], "401"),
                          (["publish", "x", str(outside)], "outside the server's model root"),
                          (["publish", "x", "../../etc"], "outside the server's model root"),
                          (["publish", "tiny", str(models / "tiny")], "already served"),
                          (["publish", "x", str(models)], "400"),
                          (["unpublish", "nothing"], "does not exist")):
        if "--admin-token" not in args:
            args = args + ["--admin-token", "adm"]
        assert main(args + ["--server", url]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    assert main(["ls", "--server", "http://127.0.0.1:9"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_admin_paths_that_are_not_paths_are_400(server):
    for path in ("000\x00", "a" * 5000, "x/" * 2000):
        status, out, _ = call(server.url, body={"name": "x", "path": path}, path="/admin/models",
                              headers={"Authorization": "Bearer adm"})
        assert status in (400, 403) and out["error"]["param"] == "path", (path[:20], out)
    assert call(server.url, "GET", "/health")[0] == 200


@pytest.mark.parametrize("field, value", [("n_layer", 10**9), ("n_positions", 10**10), ("eos_token_id", -1)])
def test_publishing_a_hostile_config_is_a_400_naming_the_field(server, models, field, value):
    """A config.json alone could make the server allocate without bound (issue 16): it is refused
    before anything is built, and the server goes on serving."""
    import shutil

    folder = models / f"hostile-{field}"
    if not folder.exists():
        shutil.copytree(models / "tiny", folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {field: value}))
    status, out, _ = call(server.url, body={"name": "hostile", "path": str(folder)}, path="/admin/models",
                          headers={"Authorization": "Bearer adm"})
    assert status == 400 and field in out["error"]["message"], out
    assert call(server.url, "GET", "/health")[0] == 200
    assert sorted(m["id"] for m in call(server.url, "GET", "/v1/models")[1]["data"]) == ["other", "tiny"]


def test_admin_disabled_without_token(models):
    with running_server({"tiny": models / "tiny"}) as url:
        status, out, _ = call(url, body={"name": "x", "path": str(models / "tiny")}, path="/admin/models")
        assert status == 403 and "--admin-token" in out["error"]["message"]


def test_health_is_503_until_the_models_are_loaded(models, monkeypatch):
    import gptj.serve.state as state_module
    from gptj.serve import ServerConfig
    from gptj.serve.server import ServerThread

    gate = threading.Event()
    real = state_module.load_served_model

    def slow_load(*args):
        gate.wait()
        return real(*args)

    monkeypatch.setattr(state_module, "load_served_model", slow_load)
    thread = ServerThread(ServerConfig(models=(("tiny", str(models / "tiny")),), port=0), wait_ready=False)
    url = thread.start()
    try:
        status, out, _ = call(url, "GET", "/health")
        assert status == 503 and out["status"] == "loading"
        status, out, headers = call(url, body={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert status == 503 and "still loading" in out["error"]["message"] and headers["Retry-After"]
        gate.set()
        while call(url, "GET", "/health")[0] != 200:
            time.sleep(0.01)
        assert call(url, body={"model": "tiny", "prompt": "x", "max_tokens": 2})[0] == 200
    finally:
        gate.set()
        thread.stop()


def test_a_drain_that_runs_out_answers_503_and_ends_quietly(models, caplog):
    """--drain-timeout-s running out: the running plain request gets 503 in OpenAI's format, the
    stream an error event then [DONE]; the server stops, and the log has no traceback. The engine
    is held, so the requests are surely still running when the drain ends."""
    import signal

    gate = threading.Event()
    with caplog.at_level("INFO"), server_thread({"tiny": models / "tiny"}, drain_timeout_s=0.2) as thread:
        engine = thread.state.models["tiny"].engine
        step = engine.step

        def held():  # noqa: ANN202
            gate.wait()
            return step()

        engine.step = held
        try:
            conn, resp = _open_stream(thread.url, {"model": "tiny", "prompt": "x", "max_tokens": 4})
            plain = []
            sender = threading.Thread(target=lambda: plain.append(call(thread.url, body={
                "model": "tiny", "prompt": "y", "max_tokens": 4})))
            sender.start()
            while metric(thread.url, "gptj_outstanding_requests", model="tiny") != 2:
                time.sleep(0.01)
            thread.server.handle_exit(signal.SIGTERM, None)  # what SIGTERM calls
            text = resp.read().decode()
            conn.close()
            sender.join()
        finally:
            gate.set()
        thread.thread.join(timeout=120)
        assert not thread.thread.is_alive()  # it stopped by itself
    events = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
    assert events[-1]["error"]["type"] == "service_unavailable", text
    assert text.rstrip().endswith("data: [DONE]")
    status, out, _ = plain[0]
    assert status == 503 and out["error"]["type"] == "service_unavailable", out
    assert not [r for r in caplog.records if r.exc_info or "CancelledError" in r.getMessage()]


def test_threads_are_set_where_the_engine_is_built(models):
    import torch

    before = torch.get_num_threads()
    want = 1 if before > 1 else 2
    try:
        with server_thread({"tiny": models / "tiny"}, threads=want) as thread:
            engine = thread.state.models["tiny"].engine
            step, seen = engine.step, []

            def recording():  # noqa: ANN202 - runs on the engine's thread
                seen.append(torch.get_num_threads())
                return step()

            engine.step = recording
            assert call(thread.url, body={"model": "tiny", "prompt": "x", "max_tokens": 2})[0] == 200
        assert seen and set(seen) == {want}  # (OpenMP keeps a thread count per thread)
    finally:
        torch.set_num_threads(before)
