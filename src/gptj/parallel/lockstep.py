"""One engine over several ranks (`--tp N` / `--pp N` on serve and mlperf): rank 0 leads, the others follow.

Under tensor or pipeline parallelism every rank runs the same engine on its share of the model, and
the ranks' collectives only line up if every engine sees the same requests, the same aborts and the
same steps, in the same order. Requests arrive only on rank 0 (its HTTP server or its LoadGen), so
rank 0's `EngineLoop` is the leader: before each engine step it broadcasts, over a gloo group of its
own, what it applied since the last one (new requests with their settings, aborts); the followers
apply the same and step too. It first broadcasts how to build the engine (a picklable function), so
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


def load_model(path: Any, dtype: torch.dtype, device: str, quantize: str | None = None,
               group_size: int | None = None, progress: bool | None = None):  # noqa: ANN201 - GPTJForCausalLM
    """The model for this rank: whole on one rank; under --tp its shard (from `gptj convert --tp N`
    files when present), under --pp its stage (both: its stage's shard), quantized after
    splitting if asked.

    Quantizing after sharding: q/k/v and fc_in keep whole rows, so their per-row int8 scales (and
    int4 groups) are those of the whole model; out_proj and fc_out keep a slice of each row, so
    each rank's scales cover its slice (finer than the whole model's). The vocabulary-parallel
    head stays in the float dtype. A pipeline stage quantizes its layers as the whole model would."""
    from gptj.parallel.launch import rank_device
    from gptj.parallel.tp import load_rank, shard_file
    from gptj.runtime import resolve_device
    from gptj.weights.io import load_model as load_whole

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return load_whole(path, dtype=dtype, device=resolve_device(device), quantize=quantize, group_size=group_size,
                          progress=progress)
    rank, world = dist.get_rank(), dist.get_world_size()
    tp, pp = _state["tp"], _state["pp"]
    _check_grid(tp, pp, world)  # (configure() was called with this plan)
    device = resolve_device(rank_device(device))
    if tp > 1 and shard_file(path, rank % tp, tp).is_file():
        model = split_model(load_rank(path, rank % tp, tp, dtype, device, group=_state["tp_group"]), rank,
                            sharded=True)
    else:
        model = split_model(load_whole(path, dtype=dtype, device=device), rank)
    if quantize:
        from gptj.quant import quantize_model

        quantize_model(model, quantize, group_size, skip=("lm_head",) if tp > 1 else ())
    return model


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

    def add(self, op: tuple) -> tuple:
        """An "add" op as the followers will apply it: unseeded sampling gets a seed here."""
        gen = op[3]
        if gen.do_sample and gen.seed is None:
            op = (*op[:3], dataclasses.replace(gen, seed=random.getrandbits(62)), *op[4:])
        return op

    def sync(self, ops: list[tuple], step: bool) -> None:
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
    from gptj.engine.loop import apply_op

    message = _receive()
    if message[0] == "stop":  # rank 0 failed before building
        return
    engine = message[1]()
    while (message := _receive())[0] != "stop":
        _, ops, step = message
        for op in ops:
            apply_op(engine, op)
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
