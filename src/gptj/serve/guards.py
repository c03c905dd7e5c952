"""Who may call a route: the API key (the /v1 routes) and the admin token (/admin/models) checked
on a request, with gptj.serve.auth's one rule (constant-time, an empty secret never matches).
A route calls these once its body has been validated (a bad body is a 400 before a 401)."""

from __future__ import annotations

from fastapi import Request

from gptj.serve.auth import has_secret
from gptj.serve.protocol import APIError
from gptj.serve.registry import ServerConfig


def key_error(what: str) -> APIError:
    return APIError(401, f"missing or wrong {what} (send 'Authorization: Bearer ...')", code="invalid_api_key")


def check_key(request: Request, token: str | None, what: str) -> None:
    """401 unless the request carries `token` (no token set: every request may)."""
    if token is None:
        return
    if not has_secret(request.headers, token):
        raise key_error(what)


def check_admin(request: Request, cfg: ServerConfig) -> None:
    """403 while the admin API is disabled (no admin token), 401 without the admin token."""
    if cfg.admin_token is None:
        raise APIError(403, "the admin API is disabled (start the server with --admin-token)")
    check_key(request, cfg.admin_token, "admin token")
