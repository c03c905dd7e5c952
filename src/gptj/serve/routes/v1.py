"""OpenAI's API: POST /v1/completions and /v1/chat/completions (plain or streamed) and GET /v1/models,
behind the API key."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gptj.serve import chat
from gptj.serve.completions import Completion, Plan, plan, precheck
from gptj.serve.errors import ERRORS, draining_error
from gptj.serve.guards import check_key
from gptj.serve.protocol import (APIError, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                 CompletionResponse, ModelCard, ModelList, SamplingRequest)
from gptj.serve.registry import ServedModel
from gptj.serve.state import ServerState, State
from gptj.serve.stream import EventStream, events

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def list_models(request: Request, state: State) -> ModelList:
    check_key(request, state.cfg.api_key, "API key")
    return ModelList(data=[ModelCard(id=m.name, created=m.created, root=m.path, max_model_len=m.max_model_len,
                                     parent=m.base.name if m.base is not None else None,
                                     status="unloading" if m.unloading else "failed" if m.failure else "ready",
                                     error=m.failure)
                           for m in state.models.values()])


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
async def completions(body: CompletionRequest, request: Request, state: State) -> Response:
    return await _serve(body, request, state, precheck, plan, Completion)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State) -> Response:
    return await _serve(body, request, state, chat.precheck, chat.plan, chat.ChatCompletion)


async def _serve(body: SamplingRequest, request: Request, state: ServerState, check: Callable, make_plan: Callable,
                 start_run: Callable[..., Completion]) -> Response:
    """A (chat) completion request: checked and admitted (`check`, then `make_plan` off the event loop),
    run on the engine as `start_run(body, served, plan)`, answered whole or streamed."""
    start = time.perf_counter()
    served, the_plan = await _admit(body, request, state, check, make_plan)
    run = start_run(body, served, the_plan)
    run.start = start
    run.on_tokens = lambda n: state.metrics.count_tokens(served.name, n)
    run.submit()
    state.running.add(run)
    state.metrics.prompt_tokens.labels(served.name).inc(sum(len(p) for p in the_plan.prompts))
    if body.stream:
        return EventStream(events(run, state.cfg.request_timeout_s),
                           on_close=lambda status: _finish(run, state, status, request), headers=the_plan.headers)
    status = 500
    try:
        waiter = asyncio.create_task(_collect(run, state.cfg.request_timeout_s))
        gone = asyncio.create_task(_disconnected(request))
        done, _ = await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if waiter not in done:
            waiter.cancel()
            status = 499  # the client closed the connection (nginx's code)
            return Response(status_code=499)
        response = waiter.result()
        status = 200
        return JSONResponse(response.model_dump(), headers=the_plan.headers)  # X-Gptj-Ignored-Fields
    except APIError as e:
        status = e.status
        raise
    finally:
        _finish(run, state, status, request)  # cancels what still runs (a disconnect, a timeout, an error)


async def _admit(body: SamplingRequest, request: Request, state: ServerState, check: Callable,
                 make_plan: Callable) -> tuple[ServedModel, Plan]:
    """The request's model and plan, its engine requests admitted; else the APIError it is answered
    (counted in the metrics), nothing admitted."""
    admitted = 0
    try:
        check_key(request, state.cfg.api_key, "API key")
        if state.status == "draining":
            raise draining_error()
        served = state.model(body.model)
        # Cheap checks first (sizes, counts: no tokenizing), then admission, and only then the
        # expensive part: an invalid or unadmitted request costs the server next to nothing.
        n_jobs = check(body, served)
        if not served.admit(n_jobs):
            wait = served.retry_after(n_jobs)
            raise APIError(429, f"model {served.name!r} is at capacity ({served.capacity} requests running "
                                f"or queued); retry in {wait} s", code="queue_full",
                           headers={"Retry-After": str(wait)})
        admitted = n_jobs
        # Tokenizing long texts (and rendering a chat template) takes a while: off the event loop, on the
        # server's own small executor, so that however many requests tokenize at once they take one
        # thread's share (planning only reads the model's limits).
        the_plan = await asyncio.get_running_loop().run_in_executor(state.tokenizing, make_plan, body, served)
        if state.status == "draining":  # it began while this request was being tokenized
            raise draining_error()
    except APIError as e:
        if admitted:
            served.release(admitted)
        state.metrics.requests.labels(body.model if body.model in state.models else "", str(e.status)).inc()
        raise
    except BaseException:
        if admitted:
            served.release(admitted)
        raise
    return served, the_plan


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so only a disconnect arrives)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(run: Completion, timeout_s: float) -> CompletionResponse | ChatCompletionResponse:
    try:
        async with asyncio.timeout(timeout_s):
            while not run.done:
                await run.next_event()
    except TimeoutError:
        raise APIError(408, f"the request took longer than the server's {timeout_s:g} s limit",
                       code="timeout") from None
    if run.ended is not None:
        raise APIError(503, run.ended, code="shutting_down")
    if run.error is not None:
        raise APIError(500, f"generation failed: {run.error}", code="engine_error")
    return run.response()


def _finish(run: Completion, state: ServerState, status: int, request: Request) -> None:
    state.running.discard(run)
    run.cancel()
    name = run.served.name
    now = time.perf_counter()
    state.metrics.observe(name, status, run.start, run.first_token, now, run.new_tokens)
    ttft = f" ttft={run.first_token - run.start:.3f}s" if run.first_token is not None else ""
    request.state.access = (f"model={name} prompt_tokens={sum(len(p) for p in run.plan.prompts)} "
                            f"completion_tokens={run.new_tokens}{ttft}")
