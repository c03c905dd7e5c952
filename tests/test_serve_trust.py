"""Issue 55 (serve): an empty secret never opens a door; one request whose numbers go non-finite
fails alone; a stopped engine is reported, unpublished and published again; responses are strict
JSON; the connection limit answers in OpenAI's format while /health stays reachable; stop token ids
and content types are checked."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from gptj.cli import main
from gptj.errors import UsageError
from gptj.serve.app import create_app
from gptj.serve.auth import ADMIN_TOKEN_ENV, API_KEY_ENV, check_secret, has_secret, secret
from gptj.serve.registry import ServerConfig

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
