"""The server's two secrets, one rule for both: the API key (the /v1 routes) and the admin token
(/admin/models), as given by a flag or, failing that, an environment variable.

A secret is either absent (None: that door is open, or for the admin API, shut) or a non-empty
string without whitespace at its ends or control characters. An empty or blank one is refused
where it is given, never read as "no secret": `--admin-token "$T"` with T unset would otherwise
open the admin API to anyone. A request's bearer token is compared in constant time.

Torch-free: the CLI's clients, the server and Ray Serve's replicas import it.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

from gptj.errors import UsageError

API_KEY_ENV = "GPTJ_SERVER_API_KEY"  # the server's --api-key, for `gptj serve` and every client command
ADMIN_TOKEN_ENV = "GPTJ_ADMIN_TOKEN"  # the server's --admin-token, for `gptj serve` and publish/unpublish


def check_secret(value: str | None, what: str) -> str | None:
    """`value` if it is a usable secret, None if absent; UsageError (one line) if it is empty, blank,
    padded with whitespace or holds a control character (it could never match a header)."""
    if value is None:
        return None
    if not value.strip():
        raise UsageError(f"{what} is empty: give a non-empty secret, or leave it out")
    if value != value.strip() or any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise UsageError(f"{what} has whitespace at its ends or a control character; a bearer token cannot carry it")
    return value


def secret(flag_value: str | None, flag: str, env: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The secret a command runs with: its flag if given, else the environment variable if set
    (set but empty is refused like an empty flag), else None."""
    environ = os.environ if environ is None else environ
    if flag_value is not None:
        return check_secret(flag_value, flag)
    return check_secret(environ.get(env), f"${env}")


def bearer(headers: Mapping[str, str]) -> str:
    """The token of an 'Authorization: Bearer TOKEN' header ('' if none); `headers` keyed in lower case."""
    header = headers.get("authorization", "")
    return header[7:] if header[:7].lower() == "bearer " else ""


def has_secret(headers: Mapping[str, str], expected: str) -> bool:
    """Whether the request carries `expected` as its bearer token, compared in constant time. An
    empty `expected` never matches (check_secret keeps it out of a config; this holds regardless)."""
    given = bearer(headers)
    return bool(expected) and hmac.compare_digest(given.encode(), expected.encode())
