"""One engine over several ranks (`--tp N` / `--pp N` on serve and mlperf): rank 0 leads, the others follow.

Under tensor or pipeline parallelism every rank runs the same engine on its share of the model, and
the ranks' collectives only line up if every engine sees the same requests, the same aborts and the
same steps, in the same order. Requests arrive only on rank 0 (its HTTP server or its LoadGen), so
rank 0's `EngineLoop` is the leader: before each engine step it broadcasts, over a gloo group of its
own, what it applied since the last one (new requests with their settings, aborts); the followers
apply the same and step too. Loading each rank's share of the model is gptj.runtime.build's. It first broadcasts how to build the engine (a picklable function), so
all ranks build theirs alike, and at the end it broadcasts "stop". While idle it sends an empty
message every few seconds, so that a follower's wait never reaches the group's timeout.

Sampling without a seed would draw from each rank's own global RNG; the leader gives each such
request a random seed, which every rank then uses.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gptj.errors import GptjError

_state: dict[str, Any] = {"group": None, "tp": 1, "pp": 1, "stopped": False, "tp_group": None, "pp_group": None}


def configure(tp: int = 1, pp: int = 1) -> None:
    """Called by every rank at the start of a parallel job (a collective: the control group and,
    under --tp and --pp together, the grid's groups).

    The tp x pp ranks form a grid: global rank r is tensor rank r % tp of pipeline stage r // tp, so
    a stage's tensor ranks are neighbours (one machine, when a job spans several) and each tensor
    rank t has its own pipeline, stages t, t + tp, t + 2 tp, ..."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        _check_grid(tp, pp, world)
    _state.update(tp=tp, pp=pp, stopped=False, tp_group=None, pp_group=None)
    if world > 1:
        _state["group"] = dist.new_group(backend="gloo")
    if tp > 1 and pp > 1:  # every rank creates every group, in the same order
        rank = dist.get_rank()
        for stage in range(pp):
            ranks = list(range(stage * tp, (stage + 1) * tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                _state["tp_group"] = group
        for t in range(tp):
            ranks = list(range(t, world, tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                _state["pp_group"] = group


def _check_grid(tp: int, pp: int, world: int) -> None:
    if tp * pp != world:
        raise GptjError(f"--tp {tp} --pp {pp} needs {tp * pp} ranks, the job has {world}")


def active() -> bool:
    """True on the ranks of a parallel job (configure() was called and there are several ranks)."""
    return _state["group"] is not None


def split_model(model: Any, rank: int, sharded: bool = False) -> Any:  # GPTJForCausalLM
    """Cut a full float model down to `rank`'s share of the configured plan, in place: its tensor
    shard (when tp > 1, unless already `sharded`), then its pipeline stage (when pp > 1)."""
    from gptj.parallel.pp import pipeline_model
    from gptj.parallel.tp import shard_model

    tp, pp = _state["tp"], _state["pp"]
    if tp > 1 and not sharded:
        shard_model(model, rank % tp, tp, group=_state["tp_group"])
    if pp > 1:
        stage, column = rank // tp, rank % tp
        pipeline_model(model, stage, pp, micro_batches=pp, group=_state["pp_group"],
                       peers=[column + i * tp for i in range(pp)])
    return model


def check_plan(tp: int, pp: int) -> int:
    """This rank, after checking that the job was configured for `tp` x `pp` ranks."""
    world = dist.get_world_size()
    _check_grid(tp, pp, world)
    if (tp, pp) != (_state["tp"], _state["pp"]):
        raise GptjError(f"--tp {tp} --pp {pp} asked of a job configured for --tp {_state['tp']} --pp {_state['pp']}")
    return dist.get_rank()


def tp_group():  # noqa: ANN201 - a process group, or None for the whole job
    """The group of this rank's tensor-parallel peers (None: every rank is one, under --tp alone)."""
    return _state["tp_group"]


def least(value: int) -> int:
    """The smallest of every rank's `value` (a collective: every rank calls it, at the same point,
    e.g. while building its engine, so that all plan the same KV memory)."""
    box = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(box, op=dist.ReduceOp.MIN, group=_state["group"])
    return int(box.item())


def _send(message: tuple) -> None:
    dist.broadcast_object_list([message], src=0, group=_state["group"])


def _receive() -> tuple:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=_state["group"])
    return box[0]


def leader_build(build: Callable[[], Any]) -> Callable[[], Any]:
    """Rank 0's engine factory: first tell the followers how to build theirs (`build` must pickle:
    a module-level function or a functools.partial of one)."""

    def run() -> Any:
        _send(("build", build))
        return build()

    return run


class Leader:
    """What rank 0's EngineLoop calls (see gptj.engine.loop)."""

    def add(self, op: Any) -> Any:  # gptj.engine.request.AddRequest
        """A new request as the followers will apply it: unseeded sampling gets a seed here."""
        if op.gen.do_sample and op.gen.seed is None:
            op = dataclasses.replace(op, gen=dataclasses.replace(op.gen, seed=random.getrandbits(62)))
        return op

    def sync(self, ops: list[Any], step: bool) -> None:
        _send(("ops", ops, step))

    def stop(self) -> None:
        finish()


def finish() -> None:
    """Rank 0: tell the followers to stop (once; safe to call again)."""
    if active() and not _state["stopped"]:
        _state["stopped"] = True
        _send(("stop",))


def follow() -> None:
    """Ranks > 0: build the engine rank 0 builds, then apply its requests and steps until "stop"."""
    message = _receive()
    if message[0] == "stop":  # rank 0 failed before building
        return
    engine = message[1]()
    while (message := _receive())[0] != "stop":
        _, ops, step = message
        for op in ops:
            engine.apply(op)
        if step:
            engine.step()


def follower_job(rank: int, world: int, payload: dict) -> None:
    """A rank > 0 of a served model (`gptj serve --tp/--pp`, a Ray Serve replica over several ranks)
    or an MLPerf run: join the plan, then follow rank 0's engine until it says "stop". Signals are
    left to rank 0, which drains before it stops the others. payload: tp, pp, optional threads."""
    import signal

    if payload.get("threads"):
        torch.set_num_threads(payload["threads"])
    configure(payload["tp"], payload["pp"])
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    follow()


def engine_loop(build: Callable[[], Any], batch_wait_ms: float = 0.0):  # noqa: ANN201 - EngineLoop
    """An EngineLoop for `build`; on rank 0 of a parallel job, one that leads the other ranks
    (one engine per job: the ranks' collectives follow a single loop)."""
    from gptj.engine import EngineLoop

    if not active():
        return EngineLoop(build, batch_wait_ms)
    if _state.get("leading"):
        raise GptjError("--tp / --pp serve one model per job")
    _state["leading"] = True
    return EngineLoop(leader_build(build), batch_wait_ms, leader=Leader())
