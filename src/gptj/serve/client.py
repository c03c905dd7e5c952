"""A small JSON client for a gptj server (the CLI's publish / unpublish / ls)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from gptj.errors import GptjError


def request_json(base_url: str, method: str, path: str, body: dict | None = None, token: str | None = None,
                 timeout: float = 600.0, token_source: str = "") -> dict[str, Any]:
    """Call the server; its error (OpenAI's format) or a connection failure becomes one GptjError line.
    `token_source` names where the token comes from (a flag and its environment variable): a 401
    says to give it there."""
    parsed = urllib.parse.urlparse(base_url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise GptjError(f"--server {base_url!r}: expected a URL like http://127.0.0.1:8000")
    url = base_url.rstrip("/") + path
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        if e.code == 401 and token_source:
            message += f" ({'the token given was refused; ' if token else ''}give the server's secret as {token_source})"
        raise GptjError(f"{method} {url}: {e.code} {message}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise GptjError(f"cannot reach {base_url}: {reason}") from None
