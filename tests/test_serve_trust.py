"""Issue 55 (serve): an empty secret never opens a door; one request whose numbers go non-finite
fails alone; a stopped engine is reported, unpublished and published again; responses are strict
JSON; the connection limit answers in OpenAI's format while /health stays reachable; stop token ids
and content types are checked."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
from fastapi.testclient import TestClient

from gptj.cli import main
from gptj.errors import UsageError
from gptj.serve.app import create_app
from gptj.serve.auth import ADMIN_TOKEN_ENV, API_KEY_ENV, check_secret, has_secret, secret
from gptj.serve.registry import ServerConfig
from serve_util import server_thread
from test_serve import call

# --- secrets ---------------------------------------------------------------------------------------

BLANK = ["", " ", "\t", "  \n"]


@pytest.mark.parametrize("value", BLANK)
@pytest.mark.parametrize("field", ["api_key", "admin_token"])
def test_a_server_config_refuses_an_empty_secret(field, value):
    with pytest.raises(UsageError, match="empty"):
        ServerConfig(**{field: value})


@pytest.mark.parametrize("value", [" k", "k ", "k\n", "a\x00b"])
def test_a_secret_that_no_header_can_carry_is_refused(value):
    with pytest.raises(UsageError, match="whitespace at its ends or a control character"):
        check_secret(value, "--api-key")


def test_an_empty_expected_secret_never_matches():
    assert not has_secret({}, "")
    assert not has_secret({"authorization": "Bearer "}, "")
    assert has_secret({"authorization": "Bearer k"}, "k") and has_secret({"authorization": "bearer k"}, "k")
    assert not has_secret({"authorization": "Bearer kk"}, "k") and not has_secret({"authorization": "k"}, "k")


def test_the_flag_wins_over_the_environment_and_an_empty_variable_is_refused():
    assert secret("flag", "--api-key", API_KEY_ENV, {API_KEY_ENV: "env"}) == "flag"
    assert secret(None, "--api-key", API_KEY_ENV, {API_KEY_ENV: "env"}) == "env"
    assert secret(None, "--api-key", API_KEY_ENV, {}) is None
    with pytest.raises(UsageError, match=r"\$GPTJ_SERVER_API_KEY is empty"):
        secret(None, "--api-key", API_KEY_ENV, {API_KEY_ENV: ""})


@pytest.mark.parametrize("argv,env", [
    (["serve", "--model", "m", "--admin-token", ""], {}),
    (["serve", "--model", "m", "--api-key", "  "], {}),
    (["serve", "--model", "m"], {ADMIN_TOKEN_ENV: ""}),
    (["serve", "--model", "m"], {API_KEY_ENV: " "}),
    (["publish", "--server", "http://127.0.0.1:9", "x", "y", "--admin-token", ""], {}),
    (["unpublish", "--server", "http://127.0.0.1:9", "x"], {ADMIN_TOKEN_ENV: ""}),
    (["ls", "--server", "http://127.0.0.1:9", "--api-key", ""], {}),
])
def test_every_command_refuses_an_empty_secret_in_one_line_exit_2(argv, env, monkeypatch, capsys):
    for name in (API_KEY_ENV, ADMIN_TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == 2  # before any model folder or server is looked at
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is empty" in err, err


def test_the_admin_api_with_a_token_refuses_requests_without_it():
    client = TestClient(create_app(ServerConfig(admin_token="t")))
    body = {"name": "x", "path": "nowhere"}
    assert client.post("/admin/models", json=body).status_code == 401
    assert client.post("/admin/models", json=body, headers={"Authorization": "Bearer "}).status_code == 401
    assert client.post("/admin/models", json=body, headers={"Authorization": "Bearer t"}).status_code == 400


# --- one request non-finite, served --------------------------------------------------------------

MARK = 777  # a prompt starting with this token goes non-finite (the runner's logits corrupted)


def _corrupt_marked(served, fill):
    """From its second step on, a request whose prompt starts with MARK gets `fill(logits)` applied
    to its logits: after one good token, its numbers go bad in steps it shares with the others."""
    import torch

    engine, run, seen = served.engine, served.engine.runner.run, {}

    def corrupted(scheduled):
        result = run(scheduled)
        for req in result.rows:  # (each request's rows of the step's one logits tensor)
            logits = result.of(req)
            seen[req.request_id] = seen.get(req.request_id, -1) + 1
            if req.prompt[0] == MARK and seen[req.request_id] >= 1:
                with torch.inference_mode():
                    fill(logits)
        return result

    engine.runner.run = corrupted


def _strict(text: str):
    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _post_raw(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _events(text: str) -> list:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [_strict(x) for x in lines[:-1]]


def _concurrently(url: str, bodies: list[dict]) -> list[tuple[int, str]]:
    out: list = [None] * len(bodies)

    def send(i):
        out[i] = _post_raw(url, bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _served(tiny_checkpoint, **settings):
    from gptj.serve.registry import serve_engine_config

    # a batch of 4 starts only once 4 are waiting: the requests share their steps, with no timing
    return server_thread({"tiny": tiny_checkpoint}, **{"engine": serve_engine_config(max_seqs=4),
                                                        "batch_wait_ms": 600_000, **settings})


def test_a_served_request_that_goes_non_finite_fails_alone_while_others_share_its_steps(tiny_checkpoint):
    import math

    good = [dict(model="tiny", prompt=[5, 17, 300, 2, 9], max_tokens=8, temperature=0, return_token_ids=True),
            dict(model="tiny", prompt=[41, 7, 1000, 12], max_tokens=8, temperature=0, return_token_ids=True,
                 stream=True)]
    bad = [dict(model="tiny", prompt=[MARK, 1, 2], max_tokens=8, temperature=1.0, seed=3),
           dict(model="tiny", prompt=[MARK, 3, 4], max_tokens=8, temperature=0, stream=True)]
    with _served(tiny_checkpoint) as thread:
        served = thread.state.models["tiny"]
        _corrupt_marked(served, lambda logits: logits.fill_(math.nan))
        first = _concurrently(thread.url, good + bad)
        assert max(served.engine.decode_batch_sizes) == 4  # all four decoded in the same steps
        (s0, plain), (s1, stream), (s2, failed), (s3, failed_stream) = first
        assert (s0, s1, s3) == (200, 200, 200)  # a stream's status is sent before its tokens
        assert s2 == 500 and "not finite" in _strict(failed)["error"]["message"]
        events = _events(failed_stream)
        assert "not finite" in events[-1]["error"]["message"] and events[-1]["error"]["code"] == "engine_error"
        assert events[0]["choices"][0]["text"]  # its first token came before its numbers went bad
        tokens = [_strict(plain)["choices"][0]["token_ids"],
                  [t for e in _events(stream) for c in e["choices"] for t in c.get("token_ids") or []]]
        # later requests are served as ever, and the two that shared steps with the failures got
        # exactly the tokens they get without them
        again = _concurrently(thread.url, [dict(b, stream=False) for b in good] * 2)
        assert all(status == 200 for status, _ in again)
        assert [_strict(text)["choices"][0]["token_ids"] for _, text in again] == tokens * 2
        assert _strict(_post_raw(thread.url, {"model": "x"})[1])  # (the server answers JSON)
        assert call(thread.url, "GET", "/health")[0] == 200


def test_logprobs_that_are_not_finite_are_null_in_strict_json(tiny_checkpoint):
    """Finite but extreme logits (one at 3e38, the rest at -3e38): the chosen token's log-probability
    is 0, its alternatives' are -inf, which JSON cannot carry: null, streamed or not."""
    def extreme(logits):
        logits.fill_(-3e38)
        logits[:, 11] = 3e38

    body = dict(model="tiny", prompt=[MARK, 5, 6], max_tokens=3, temperature=0, logprobs=3)
    with _served(tiny_checkpoint, batch_wait_ms=0.0) as thread:
        _corrupt_marked(thread.state.models["tiny"], extreme)
        status, text = _post_raw(thread.url, body)
        assert status == 200, text
        lp = _strict(text)["choices"][0]["logprobs"]
        assert lp["token_logprobs"][1:] == [0.0, 0.0]
        assert all(None in top.values() for top in lp["top_logprobs"][1:])
        status, text = _post_raw(thread.url, dict(body, stream=True))
        streamed = [c["logprobs"] for e in _events(text) for c in e["choices"] if c["logprobs"]]
        assert status == 200 and any(None in top.values() for lp in streamed for top in lp["top_logprobs"])


def test_a_model_whose_engine_stopped_is_reported_unpublished_and_published_again(tiny_checkpoint, capsys):
    root = str(tiny_checkpoint.parent)
    with _served(tiny_checkpoint, batch_wait_ms=0.0, admin_token="t", model_root=root) as thread:
        url, served = thread.url, thread.state.models["tiny"]

        def broken():
            raise MemoryError("a step ran out of memory")

        served.engine.step = broken
        status, body, _ = call(url, body=dict(model="tiny", prompt=[1, 2], max_tokens=2))
        assert status == 500 and "engine loop stopped: MemoryError: a step ran out of memory" in body["error"]["message"]
        status, health, _ = call(url, "GET", "/health")
        assert status == 503 and health["status"] == "failed"
        assert health["failed"] == {"tiny": "MemoryError: a step ran out of memory"}
        status, body, _ = call(url, body=dict(model="tiny", prompt=[1, 2], max_tokens=2))
        assert status == 503 and body["error"]["code"] == "model_failed" and "unpublish" in body["error"]["message"]
        assert main(["ls", "--server", url]) == 0
        assert "failed (MemoryError: a step ran out of memory)" in capsys.readouterr().out
        assert main(["publish", "--server", url, "tiny", str(tiny_checkpoint), "--admin-token", "t"]) == 1
        assert "already served (failed: MemoryError" in capsys.readouterr().err
        assert main(["unpublish", "--server", url, "tiny", "--admin-token", "t"]) == 0
        assert main(["publish", "--server", url, "tiny", str(tiny_checkpoint), "--admin-token", "t"]) == 0
        status, body, _ = call(url, body=dict(model="tiny", prompt=[1, 2], max_tokens=2))
        assert status == 200 and len(body["choices"][0]["text"]) > 0
        assert call(url, "GET", "/health")[0] == 200


# --- what a client sent wrong, said plainly ---------------------------------------------------------

@pytest.mark.parametrize("content_type", ["text/plain", None, "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_told_its_content_type(content_type):
    client = TestClient(create_app(ServerConfig(admin_token="t")))
    headers = {"Content-Type": content_type} if content_type else {}
    for path, body in (("/v1/completions", b'{"model": "m", "prompt": "a"}'),
                       ("/admin/models", b'{"name": "m", "path": "a"}')):
        r = client.post(path, content=body, headers={**headers, "Authorization": "Bearer t"})
        assert r.status_code == 415, (path, r.text)
        assert "Content-Type: application/json" in r.json()["error"]["message"]
        assert repr(content_type or "no Content-Type") in r.json()["error"]["message"]
    r = client.post("/v1/completions", content=b'{"model": "m", "prompt": "a"}',
                    headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 404  # JSON with a charset is JSON: the unknown model is what is wrong


def test_stop_token_ids_outside_the_vocabulary_are_refused(tiny_checkpoint):
    with _served(tiny_checkpoint, batch_wait_ms=0.0) as thread:
        V = thread.state.models["tiny"].vocab_size
        status, body, _ = call(thread.url, body=dict(model="tiny", prompt="a", stop_token_ids=[3, V]))
        assert status == 400 and body["error"]["param"] == "stop_token_ids"
        assert f"token id {V} outside the vocabulary [0, {V})" in body["error"]["message"]
        status, _, _ = call(thread.url, body=dict(model="tiny", prompt="a", max_tokens=2, stop_token_ids=[V - 1]))
        assert status == 200


# --- what the server says about itself -------------------------------------------------------------

def test_the_server_logs_each_models_summary_and_a_line_per_request(tiny_checkpoint, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="gptj.serve")
    with _served(tiny_checkpoint, batch_wait_ms=0.0) as thread:
        served = thread.state.models["tiny"]
        status, body, _ = call(thread.url, body=dict(model="tiny", prompt=[1, 2, 3], max_tokens=4, ignore_eos=True))
        assert status == 200
        call(thread.url, body=dict(model="nope", prompt="a"))
        call(thread.url, "GET", "/health")
        plan = served.engine.plan
    lines = [r.getMessage() for r in caplog.records]
    summary = next(line for line in lines if line.startswith("model tiny: "))
    for part in ("float32 on cpu", "quantization none", f"{plan.n_blocks:,} blocks of {plan.block_size} tokens",
                 f"up to {plan.max_seqs} sequences of {plan.max_len:,} tokens", f"{served.threads} compute threads"):
        assert part in summary, (part, summary)
    access = [line for line in lines if '"POST /v1/completions"' in line]
    assert any(" 200 " in a and "model=tiny prompt_tokens=3 completion_tokens=4 ttft=" in a for a in access), access
    assert any(" 404 " in a for a in access), access
    assert any('"GET /health" 200' in line for line in lines)


def test_no_access_log_turns_the_request_lines_off(tiny_checkpoint, caplog):
    import logging

    from gptj.cli import _server_config, build_parser

    assert _server_config(build_parser().parse_args(["serve", "--model", "m", "--no-access-log"])).access_log is False
    assert _server_config(build_parser().parse_args(["serve", "--model", "m"])).access_log is True
    caplog.set_level(logging.INFO, logger="gptj.serve")
    with _served(tiny_checkpoint, batch_wait_ms=0.0, access_log=False) as thread:
        assert call(thread.url, "GET", "/health")[0] == 200
    assert not [r for r in caplog.records if r.name == "gptj.serve.access"]


def test_unknown_field_names_a_header_cannot_carry_are_encoded(tiny_checkpoint):
    """The schema fuzzer's find: a field named with characters beyond Latin-1 (or a line break) made
    the X-Gptj-Ignored-Fields header raise a 500; each name is percent-encoded, and so in the log."""
    names = ["\u01ab", "a\nb", "ok_name"] + [f"f{i}" for i in range(20)]
    with _served(tiny_checkpoint, batch_wait_ms=0.0) as thread:
        body = dict(model="tiny", prompt=[1, 2], max_tokens=1, **{n: 1 for n in names})
        status, _, headers = call(thread.url, body=body)
    assert status == 200
    shown = headers["X-Gptj-Ignored-Fields"].split(",")
    assert shown[:3] == ["%C6%AB", "a%0Ab", "ok_name"] and shown[-1] == "(+7 more)" and len(shown) == 17
