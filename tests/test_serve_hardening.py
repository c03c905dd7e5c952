"""Issue 16, items 8 and 10 (serve): Retry-After from the queue and the measured completion rate;
validation messages in the user's terms; /metrics and the API documents behind the API key."""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
import typing
import urllib.parse

import pytest
from fastapi.testclient import TestClient

from gptj.cli import _server_config, build_parser, main
from gptj.engine.core import Engine
from gptj.serve.app import create_app
from gptj.serve.errors import UNION_EXPECTED
from gptj.serve.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from gptj.serve.registry import MAX_RETRY_AFTER_S, RetryAdvisor, ServerConfig
from serve_util import server_thread

# --- item 10: validation messages ----------------------------------------------------------------

PROMPT_EXPECTED = ("prompt: expected a string, a list of strings, a list of token ids (integers >= 0) "
                   "or a list of such lists")


@pytest.fixture(scope="module")
def bare():
    """The app with no model (validation answers before any model is looked up)."""
    return TestClient(create_app(ServerConfig()))


@pytest.mark.parametrize("fields,message,param", [
    (dict(prompt=123), PROMPT_EXPECTED, "prompt"),
    (dict(prompt=None), PROMPT_EXPECTED, "prompt"),
    (dict(prompt=[1, "a"]), PROMPT_EXPECTED, "prompt"),
    (dict(prompt={"text": "x"}), PROMPT_EXPECTED, "prompt"),
    (dict(prompt=[[1, -2]]), "prompt[0][1]: Input should be greater than or equal to 0", "prompt"),
    (dict(prompt=[-1]), "prompt[0]: Input should be greater than or equal to 0", "prompt"),
    (dict(prompt="x" * 1_000_001), "prompt: String should have at most 1000000 characters", "prompt"),
    (dict(prompt="a", stop=5), "stop: expected a string (1-1000 characters) or a list of such strings", "stop"),
    (dict(prompt="a", stop=[""]), "stop[0]: String should have at least 1 character", "stop"),
    (dict(prompt="a", early_stopping="x"), 'early_stopping: expected true, false or "never"', "early_stopping"),
    (dict(prompt="a", logit_bias={"1": "2"}), "logit_bias.1: expected a number", "logit_bias.1"),
    (dict(prompt="a", logit_bias=5), "logit_bias: expected an object", "logit_bias"),
    (dict(prompt="a", frequency_penalty="0.5"), "frequency_penalty: expected a number", "frequency_penalty"),
    (dict(prompt="a", repetition_penalty=[1.2]), "repetition_penalty: expected a number", "repetition_penalty"),
    (dict(prompt="a", max_tokens="5"), "max_tokens: expected an integer", "max_tokens"),
    (dict(prompt="a", stop_token_ids=[3, -1]), "stop_token_ids[1]: Input should be greater than or equal to 0",
     "stop_token_ids[1]"),
    (dict(prompt="a", stream_options={"include_usage": 1}), "stream_options.include_usage: expected true or false",
     "stream_options.include_usage"),
])
def test_validation_messages_name_the_field_as_written(bare, fields, message, param):
    r = bare.post("/v1/completions", json={"model": "m", **fields})
    err = r.json()["error"]
    assert (r.status_code, err["message"], err["param"]) == (400, message, param)


def test_no_validation_message_shows_pydantic_internal_names(bare):
    bodies = [{"model": "m", "prompt": p} for p in (123, 1.5, True, [None], [[None]], [[1], "a"], [[1]] * 300)]
    bodies += [{"model": "m", "prompt": "a", "stop": s} for s in (0, [0], "", ["a"] * 100, ["x" * 1001])]
    bodies += [{"model": "m", "prompt": "a", "early_stopping": v} for v in (1, "always", None)]
    for body in bodies:
        r = bare.post("/v1/completions", json=body)
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and message.split(":")[0].split("[")[0] in ("prompt", "stop", "early_stopping")
        for internal in ("constrained", "list[", "function-", "literal[", ".bool", "json-or-python"):
            assert internal not in message, (body, message)


def test_every_union_field_has_an_expected_message():
    fields = CompletionRequest.model_fields | ChatCompletionRequest.model_fields | ChatMessage.model_fields
    unions = {name for name, f in fields.items()
              if typing.get_origin(f.annotation) in (typing.Union, getattr(__import__("types"), "UnionType"))
              and len([a for a in typing.get_args(f.annotation) if a is not type(None)]) > 1}
    assert unions == set(UNION_EXPECTED)


# --- item 10: /metrics and the documents behind the API key ---------------------------------------

DOCS = ("/docs", "/redoc", "/openapi.json")


@pytest.mark.parametrize("public_metrics,public_docs", [(False, False), (True, False), (False, True)])
def test_metrics_and_docs_need_the_api_key_unless_public(public_metrics, public_docs):
    client = TestClient(create_app(ServerConfig(api_key="k", public_metrics=public_metrics, public_docs=public_docs)))
    key = {"Authorization": "Bearer k"}
    for path, public in [("/metrics", public_metrics), *((p, public_docs) for p in DOCS)]:
        r = client.get(path)
        assert r.status_code == (200 if public else 401), path
        if not public:
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get(path, headers=key).status_code == 200, path
    assert client.get("/health").status_code == 503  # open (no model loaded: not ready), never 401


def test_without_an_api_key_metrics_and_docs_are_open():
    client = TestClient(create_app(ServerConfig()))
    assert all(client.get(p).status_code == 200 for p in ("/metrics", *DOCS))


def test_serve_flags_open_metrics_and_docs():
    args = build_parser().parse_args(["serve", "--model", "m", "--api-key", "k", "--public-metrics"])
    cfg = _server_config(args)
    assert (cfg.api_key, cfg.public_metrics, cfg.public_docs) == ("k", True, False)
    args = build_parser().parse_args(["serve", "--model", "m", "--api-key", "k", "--public-docs"])
    assert (_server_config(args).public_metrics, _server_config(args).public_docs) == (False, True)


# --- item 8: Retry-After -------------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_retry_advisor_spreads_refused_requests_at_the_measured_rate():
    clock = FakeClock()
    advisor = RetryAdvisor(clock=clock)
    advisor.busy()
    assert advisor.retry_after(1, 1) == 1  # nothing finished yet: no rate, the shortest wait
    for _ in range(8):  # 8 completions in 4 s: 2 per second
        clock.now += 0.5
        advisor.completed()
    assert advisor.rate() == pytest.approx(2.0)
    waits = [advisor.retry_after(1, 1) for _ in range(10)]
    # the i-th refused request (from 1) waits for its own place and the i - 1 promised before it
    assert waits == [max(1, math.ceil(i / 2.0)) for i in range(1, 11)]
    clock.now += max(waits)  # every promise came due: the queue of promises is empty again
    # 4 s more with nothing finished: 8 completions in 8 s, a stalled engine reads as a slower one
    assert advisor.rate() == pytest.approx(8 / (4 + max(waits)))
    assert advisor.retry_after(3, 1) == math.ceil(3 / advisor.rate())
    # a long queue is clamped; an idle spell before the model was busy again does not count
    assert advisor.retry_after(10_000, 1) == MAX_RETRY_AFTER_S
    clock.now += 3600
    advisor.busy()
    clock.now += 1
    advisor.completed(4)
    assert advisor.rate() == pytest.approx(4.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening-models")
    assert main(["init", "--preset", "tiny", "--out", str(root / "tiny"), "--seed", "1"]) == 0
    return root


def _post(url: str, body: dict) -> tuple[int, dict, dict]:
    parsed = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read()), r.headers
    finally:
        conn.close()


def test_a_full_queue_answers_429_with_a_retry_after_from_the_queue_and_the_rate(models, monkeypatch):
    """The engine is held (no step runs), so the queue stays full and nothing the test does not
    record is measured; the clock is the test's, so the expected waits follow from its numbers."""
    hold = threading.Event()
    step = Engine.step

    def gated(self, *args, **kwargs):
        hold.wait()
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "step", gated)
    with server_thread({"tiny": models / "tiny"}, max_batch_size=1, max_queue=1) as server:
        served = server.state.models["tiny"]
        clock = FakeClock()
        served.retry.clock = clock
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        held = [threading.Thread(target=_post, args=(server.url, body)) for _ in range(served.capacity)]
        try:
            for t in held:
                t.start()
            for _ in range(10_000):  # until both are admitted (bounded; no time limit asserted)
                if served.outstanding == served.capacity:
                    break
                time.sleep(0.01)
            assert served.outstanding == served.capacity == 2
            # the model measured 8 completions in 2 s since it became busy: 4 per second
            for _ in range(8):
                clock.now += 0.25
                served.retry.completed()
            rate = 4.0
            waits = []
            for prompts in (1, 1, 2, 1, 2, 2, 1, 2):
                status, out, headers = _post(server.url, {**body, "prompt": ["hello"] * prompts})
                assert status == 429 and out["error"]["code"] == "queue_full", out
                waits.append((prompts, int(headers["Retry-After"])))
            # each waits for the places beyond capacity it needs, plus those promised before it
            promised, expected = 0, []
            for k, _ in waits:
                ahead = (served.outstanding + k - served.capacity) + promised
                expected.append((k, min(MAX_RETRY_AFTER_S, max(1, math.ceil(ahead / rate)))))
                promised += k
            assert waits == expected and waits[-1][1] > waits[0][1], waits
            assert f"retry in {waits[-1][1]} s" in out["error"]["message"]
            # a slower measured rate (a held engine finishes nothing for 10 s more) asks for longer
            clock.now += 10 + max(w for _, w in waits)  # the promises came due
            slower = served.retry.rate()
            assert slower == pytest.approx(8 / (2 + 10 + max(w for _, w in waits)))
            status, _, headers = _post(server.url, {**body, "prompt": ["hello"] * 2})
            assert status == 429 and int(headers["Retry-After"]) == math.ceil(2 / slower) > math.ceil(2 / rate)
        finally:
            hold.set()
            for t in held:
                t.join()
        assert served.outstanding == 0
