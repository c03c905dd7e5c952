"""The server's errors, always in OpenAI's format ({"error": {"message", "type", "param", "code"}}):
the JSON response of an APIError, the app's exception handlers (FastAPI's own validation and HTTP
errors rewritten into that format, with messages that name a field as the user wrote it), and the
error that both the drain and a route answer.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gptj.serve.protocol import APIError, ErrorResponse

log = logging.getLogger("gptj.serve")

# The error answers a route documents (its OpenAPI `responses`).
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what} for code, what in
    ((400, "invalid request"), (401, "missing or wrong API key (or admin token)"),
     (403, "admin API disabled, or a path outside the model root"), (404, "unknown model"),
     (408, "timed out (the request, or reading its body)"), (409, "model already served"),
     (413, "request body too large"), (415, "the body is not sent as application/json"),
     (429, "queue full (see Retry-After)"), (500, "engine failure"),
     (503, "loading, draining, or too many connections"))}

# While draining: what a new request is told (a load balancer moves on; a client retries elsewhere).
DRAIN_RETRY_AFTER_S = 5


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def draining_error() -> APIError:
    return APIError(503, "the server is shutting down; retry on another replica or later", code="shutting_down",
                    headers={"Retry-After": str(DRAIN_RETRY_AFTER_S), "Connection": "close"})


# --- the exception handlers (create_app installs HANDLERS) ---

async def api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    kind = request.headers.get("content-type")
    if request.method == "POST" and not _json_media_type(kind):  # FastAPI read no body: say why
        return error_response(APIError(415, f"the request body must be sent as Content-Type: application/json "
                                            f"(got {kind or 'no Content-Type'!r})", code="unsupported_media_type"))
    message, param = validation_message(exc)
    return error_response(APIError(400, message, param))


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = str(exc.detail)
    if exc.status_code == 400 and "parsing the body" in message:
        message = "the request body is not valid JSON in UTF-8"
    return error_response(APIError(exc.status_code, message, headers=getattr(exc, "headers", None)))


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error")
    return error_response(APIError(500, f"internal error: {type(exc).__name__}"))


HANDLERS = {APIError: api_error, RequestValidationError: validation_error, StarletteHTTPException: http_error,
            Exception: internal_error}


# --- validation messages ---

# What a field of a union type takes, as its 400 says when a value fits none of its forms (pydantic
# names the forms by internal tags: "prompt.constrained-str: Input should be a valid string").
UNION_EXPECTED = {
    "prompt": "expected a string, a list of strings, a list of token ids (integers >= 0) or a list of such lists",
    "stop": "expected a string (1-1000 characters) or a list of such strings",
    "early_stopping": 'expected true, false or "never"',
    "content": 'expected a string or a list of {"type": "text", "text": ...} parts',  # a chat message's
}
# pydantic's type errors, as a user reads them
_EXPECTED = {"int_type": "expected an integer", "int_parsing": "expected an integer",
             "string_type": "expected a string",
             "bool_type": "expected true or false", "float_type": "expected a number", "list_type": "expected a list",
             "dict_type": "expected an object", "model_type": "expected an object",
             "model_attributes_type": "expected an object", "int_from_float": "expected an integer"}
_TYPE_ERRORS = set(_EXPECTED) | {"literal_error", "enum", "none_required", "is_instance_of"}


def _json_media_type(content_type: str | None) -> bool:
    """Whether a Content-Type header names JSON (application/json, or a +json type), as FastAPI
    requires before it reads a body."""
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _where(field: str, rest: tuple) -> str:
    """A location as the user wrote it: prompt[0][3], stream_options.include_usage."""
    return field + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in rest)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A request's first validation error as (the 400's message, its param)."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = tuple(p for p in err.get("loc", ()) if p != "body")
    if err.get("type") == "json_invalid":
        return f"malformed JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    if err.get("type") == "extra_forbidden":
        where = _where(str(loc[0]), loc[1:]) if loc else "?"
        return f"unknown field {where!r}", where
    if not loc:
        return ("request body: a JSON object is required" if err.get("type") in ("missing", *_EXPECTED)
                else f"request body: {err.get('msg')}"), None
    field = str(loc[0])
    if err.get("type") == "missing":
        where = _where(field, loc[1:])
        return f"{where}: field required", where
    at = _union_at(loc)
    if at is not None:
        return _union_message(loc[:at + 1], errors)
    where = _where(field, loc[1:])
    what = _EXPECTED.get(err.get("type", ""), err.get("msg", "invalid value"))
    return f"{where}: {what}", where


def _union_at(loc: tuple) -> int | None:
    """Where in `loc` a union field of UNION_EXPECTED stands, followed by pydantic's name of the form
    it tried (prompt, or messages[0].content); None where there is none."""
    for i, part in enumerate(loc[:-1]):
        if part in UNION_EXPECTED and isinstance(loc[i + 1], str) and (i == 0 or isinstance(loc[i - 1], int)):
            return i
    return None


def _union_message(field_loc: tuple, errors: list[dict]) -> tuple[str, str]:
    """pydantic tried each form of a union field (the part of an error's loc after `field_loc` names
    it): if the value has one form's shape and breaks only its limits (a length, a bound), say which;
    if it has no form's shape, say what the forms are."""
    n = len(field_loc)
    field = _where(str(field_loc[0]), field_loc[1:])
    forms: dict[str, list[dict]] = {}
    for e in errors:
        e_loc = tuple(p for p in e.get("loc", ()) if p != "body")
        if len(e_loc) > n and e_loc[:n] == field_loc:
            forms.setdefault(str(e_loc[n]), []).append(e)
    for form_errors in forms.values():
        if all(e.get("type") not in _TYPE_ERRORS for e in form_errors):
            e = form_errors[0]
            where = _where(field, tuple(p for p in e["loc"] if p != "body")[n + 1:])
            return f"{where}: {e.get('msg', 'invalid value')}", field
    return f"{field}: {UNION_EXPECTED[field_loc[-1]]}", field
