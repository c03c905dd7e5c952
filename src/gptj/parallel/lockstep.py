"""One engine over several ranks (`--tp N` / `--pp N` on serve and mlperf): rank 0 leads, the others follow.

Under tensor or pipeline parallelism every rank runs the same engine on its share of the model, and
the ranks' collectives only line up if every engine sees the same requests, the same aborts and the
same steps, in the same order. Requests arrive only on rank 0 (its HTTP server or its LoadGen), so
rank 0's `EngineLoop` is the leader: before each engine step it broadcasts, over a gloo group of its
own (the ParallelContext's control group), what it applied since the last one (new requests with
their settings, aborts); the followers apply the same and step too. It first broadcasts how to build
the engine (a picklable function of the rank's context: loading each rank's share of the model is
gptj.runtime.build's), so all ranks build theirs alike, and at the end it broadcasts "stop". While
idle it sends an empty message every few seconds, so that a follower's wait never reaches the
group's timeout.

Sampling without a seed would draw from each rank's own global RNG; the leader gives each such
request a random seed, which every rank then uses.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gptj.errors import GptjError
from gptj.parallel.context import ParallelContext

Build = Callable[[ParallelContext], Any]  # makes a rank's engine (gptj.engine.Engine) for its context


def _send(ctx: ParallelContext, message: tuple) -> None:
    dist.broadcast_object_list([message], src=0, group=ctx.control)


def _receive(ctx: ParallelContext) -> tuple:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=ctx.control)
    return box[0]


def leader_build(build: Build, ctx: ParallelContext) -> Callable[[], Any]:
    """Rank 0's engine factory: first tell the followers how to build theirs (`build` must pickle:
    a module-level function or a functools.partial of one), then build its own."""

    def run() -> Any:
        _send(ctx, ("build", build))
        return build(ctx)

    return run


class Leader:
    """What rank 0's EngineLoop calls (see gptj.engine.loop)."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx

    def add(self, op: Any) -> Any:  # gptj.engine.request.AddRequest
        """A new request as the followers will apply it: unseeded sampling gets a seed here."""
        if op.gen.do_sample and op.gen.seed is None:
            op = dataclasses.replace(op, gen=dataclasses.replace(op.gen, seed=random.getrandbits(62)))
        return op

    def sync(self, ops: list[Any], step: bool) -> None:
        _send(self.ctx, ("ops", ops, step))

    def stop(self) -> None:
        finish(self.ctx)


def finish(ctx: ParallelContext) -> None:
    """Rank 0: tell the followers to stop (once; safe to call again, and a no-op in one process)."""
    if ctx.parallel and not ctx.stopped:
        ctx.stopped = True
        _send(ctx, ("stop",))


def follow(ctx: ParallelContext) -> None:
    """Ranks > 0: build the engine rank 0 builds, then apply its requests and steps until "stop"."""
    message = _receive(ctx)
    if message[0] == "stop":  # rank 0 failed before building
        return
    engine = message[1](ctx)
    while (message := _receive(ctx))[0] != "stop":
        _, ops, step = message
        for op in ops:
            engine.apply(op)
        if step:
            engine.step()


def follower_job(rank: int, world: int, payload: dict) -> None:
    """A rank > 0 of a served model (`gptj serve --tp/--pp`, a Ray Serve replica over several ranks)
    or an MLPerf run: join the job, then follow rank 0's engine until it says "stop". Signals are
    left to rank 0, which drains before it stops the others. payload: tp, pp, optional threads."""
    import signal

    if payload.get("threads"):
        torch.set_num_threads(payload["threads"])
    ctx = ParallelContext.join(payload["tp"], payload["pp"])
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    follow(ctx)


def engine_loop(build: Build, ctx: ParallelContext, batch_wait_ms: float = 0.0):  # noqa: ANN201 - EngineLoop
    """An EngineLoop whose engine `build(ctx)` makes; on rank 0 of a parallel job, one that leads the
    other ranks (one engine per job: the ranks' collectives follow a single loop)."""
    from gptj.engine import EngineLoop

    if not ctx.parallel:
        return EngineLoop(functools.partial(build, ctx), batch_wait_ms)
    if ctx.leading:
        raise GptjError("--tp / --pp serve one model per job")
    ctx.leading = True
    return EngineLoop(leader_build(build, ctx), batch_wait_ms, leader=Leader(ctx))
