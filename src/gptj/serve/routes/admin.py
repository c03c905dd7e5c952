"""The admin API, behind the admin token (disabled without one): POST /admin/models loads a
checkpoint under the model root and serves it by name; DELETE /admin/models/NAME unloads it once
its requests finish."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request

from gptj.errors import GptjError
from gptj.serve.errors import ERRORS
from gptj.serve.guards import check_admin
from gptj.serve.protocol import APIError, LoadModelRequest, ModelStatus
from gptj.serve.registry import check_under_root, load_served_model
from gptj.serve.state import State

log = logging.getLogger("gptj.serve")

router = APIRouter()


@router.post("/admin/models", response_model=ModelStatus, status_code=201, responses=ERRORS)
async def load(body: LoadModelRequest, request: Request, state: State) -> ModelStatus:
    cfg = state.cfg
    check_admin(request, cfg)
    if body.name in state.models:
        failed = state.models[body.name].failure
        raise APIError(409, f"model {body.name!r} is already served" +
                       (f" (failed: {failed}; unpublish it first)" if failed else ""), "name")
    try:
        path = check_under_root(body.path, cfg.model_root)
    except PermissionError as e:
        raise APIError(403, str(e), "path") from None
    except (ValueError, OSError) as e:  # a NUL byte, a name too long, a loop of links
        raise _path_error(body.path, e) from None
    try:  # stat() raises what is_dir() does not swallow: ENAMETOOLONG, EACCES, EIO ...
        if not path.is_dir():
            raise APIError(400, f"{_shown(body.path)}: no such model folder", "path")
    except OSError as e:
        raise _path_error(body.path, e) from None
    state.models.pop(body.name, None)
    try:
        served = await asyncio.to_thread(load_served_model, body.name, str(path), cfg)
    except GptjError as e:
        raise APIError(400, f"{_shown(body.path)}: {e}", "path") from None
    except OSError as e:  # a file in the folder unreadable, a name too long, a loop of links
        raise _path_error(body.path, e) from None
    if body.name in state.models:  # loaded twice at once: keep the first
        await asyncio.to_thread(served.shutdown)
        raise APIError(409, f"model {body.name!r} is already served", "name")
    state.models[body.name] = served
    log.info("model %s (published)", served.describe())
    return ModelStatus(name=body.name, status="ready")


@router.delete("/admin/models/{name}", response_model=ModelStatus, responses=ERRORS)
async def unload(name: str, request: Request, state: State) -> ModelStatus:
    check_admin(request, state.cfg)
    served = state.models.get(name)
    if served is None or served.failure is None:
        served = state.model(name)  # a failed model is unloaded as it is; others as state.model finds them
    if served.base is not None:  # a LoRA adapter's name: new requests get 404, the engine goes on
        served.unloading = True
        state.models.pop(name, None)
        return ModelStatus(name=name, status="unloaded")
    views = [n for n, m in state.models.items() if m.base is served]
    for m in [served, *(state.models[n] for n in views)]:
        m.unloading = True  # new requests get 404; running ones finish
    if served.failure is None:  # (a stopped engine has failed what it held; nothing will finish)
        await served.wait_idle()
    for n in [name, *views]:
        state.models.pop(n, None)
    await asyncio.to_thread(served.shutdown)
    log.info("model %s unpublished%s", name, f" (it had failed: {served.failure})" if served.failure else "")
    return ModelStatus(name=name, status="unloaded")


def _shown(path: str) -> str:
    """A path as an error message shows it: whole, or its start and end if long."""
    return repr(path) if len(path) <= 200 else repr(path[:100] + "..." + path[-60:])


def _path_error(path: str, e: OSError | ValueError) -> APIError:
    """/admin/models: a path the file system refuses is the client's error (4xx), named, never a 500:
    403 where it may not be read, 400 otherwise (ENAMETOOLONG, ELOOP, ENOTDIR, a NUL byte ...)."""
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    if isinstance(e, PermissionError):
        return APIError(403, f"path {_shown(path)}: the server may not read it ({why})", "path")
    return APIError(400, f"path {_shown(path)}: not a usable model folder ({why})", "path")
