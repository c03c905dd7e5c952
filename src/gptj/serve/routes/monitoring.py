"""What a load balancer and Prometheus read: GET /health (200 once every model given at start is
loaded; 503 while loading, draining or failed) and GET /metrics (gptj.serve.metrics)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from gptj.serve.metrics import CONTENT_TYPE
from gptj.serve.protocol import Health
from gptj.serve.state import State

router = APIRouter()


@router.get("/health", response_model=Health, responses={503: {"model": Health}})
async def health(state: State) -> JSONResponse:
    failed = {n: m.failure for n, m in state.models.items() if m.failure is not None and not m.unloading}
    status = "failed" if failed and state.status == "ok" else state.status
    body = Health(status=status, models=list(state.models), failed=failed).model_dump()
    return JSONResponse(body, status_code=200 if status == "ok" else 503)


@router.get("/metrics", response_class=Response)
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
