"""From a spec to a running engine, in two calls every command makes:

    model = load_model(spec, ctx)                             read -> shard -> quantize
    engine = build_engine(model, engine_config, ctx=ctx)      plan the KV -> prepare kernels -> Engine

`ctx` (gptj.parallel.context.ParallelContext, made once when a --tp / --pp job starts; SINGLE in one
process) says which share of the model this rank loads; each rank builds its own engine, and the
ranks must schedule alike, so they plan their KV memory within the least free memory of any rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gptj.engine.config import EngineConfig, KVPlan, available_memory_bytes, plan_kv
from gptj.errors import GptjError
from gptj.parallel.context import SINGLE, ParallelContext
from gptj.runtime.spec import ModelSpec

if TYPE_CHECKING:
    from torch import nn

    from gptj.decode import GenerationConfig
    from gptj.engine import Engine


def load_model(spec: ModelSpec, ctx: ParallelContext = SINGLE, progress: bool | None = None) -> nn.Module:
    """The model for this rank of `ctx` (ParallelContext.load): whole in one process; under --tp its
    shard, under --pp its stage (both: its stage's shard), quantized after splitting if asked, with
    the spec's LoRA adapter merged into its float weights first. progress: bars on stderr (None: for
    a big model on a terminal). A bad adapter, and fp8 weights (asked for, or in the checkpoint)
    where they cannot run (gptj.device.check_fp8_device), are refused in one line, before the load."""
    if spec.path is None:
        raise GptjError("no model folder given")
    ctx.check(spec.tp, spec.pp)
    return ctx.load(spec.path, spec.torch_dtype, spec.device, spec.quantize, spec.group_size, progress, lora=spec.lora)


def plan_for(model: nn.Module, config: EngineConfig, free_bytes: int | None = None,
             ctx: ParallelContext = SINGLE) -> KVPlan:
    """The KV plan of `model`'s engine (its KV in its float dtype, on its device, its rank's heads):
    plan_kv within the free memory now, or `free_bytes`; under --tp / --pp, the least of any rank."""
    w = model.transformer.wte.weight
    if free_bytes is None and config.kv_blocks is None:
        free_bytes = ctx.least(available_memory_bytes(w.device))
    plan = plan_kv(model.config, w.dtype, w.device, config, n_head=model.kv_heads, free_bytes=free_bytes)
    return dataclasses.replace(plan, ranks=ctx.world if ctx.parallel else 1)


def build_engine(model: nn.Module, config: EngineConfig, progress: bool | None = None,
                 free_bytes: int | None = None, warm: GenerationConfig | None = None,
                 adapters: Sequence[tuple[str, str]] = (), ctx: ParallelContext = SINGLE) -> Engine:
    """The engine for `model`: its KV plan (plan_for), then the serving kernels prepared for up to
    plan.max_seqs rows (gptj.kernels.prepare_for_serving: config.kernels "auto" or "off"), then
    Engine with the plan's numbers fixed in its config (so the engine sizes nothing again). `warm`:
    where decode steps replay CUDA graphs, run requests of this kind once and capture every batch
    size's graph now (Engine.warm), before the work a caller times or serves. The engine is probed
    first (Engine.probe): a model or adapter whose logits are not finite is refused. `adapters`: (name, folder)
    of LoRA adapters served over the model by name, unmerged (gptj.lora.attach_adapters; requests
    choose one with Engine.add_request's `adapter`). `ctx`: the rank's context, as load_model's."""
    from gptj.engine import Engine
    from gptj.kernels import prepare_for_serving

    plan = plan_for(model, config, free_bytes, ctx)
    prepare_for_serving(model, config.kernels, max_rows=plan.max_seqs, progress=progress)
    if adapters:
        from gptj.lora import attach_adapters, read_adapter

        attach_adapters(model, [read_adapter(path) for _, path in adapters], [name for name, _ in adapters])
    fixed = dataclasses.replace(config, kv_blocks=plan.n_blocks, max_seqs=plan.max_seqs, max_len=plan.max_len)
    engine = Engine(model, fixed, plan)  # the plan handed over, not derived again
    engine.probe()  # logits that overflow are refused at load, in one line
    if warm is not None and engine.runner.graphs is not None:
        engine.warm(warm)
    return engine


def set_rank_threads(threads: int | None, ctx: ParallelContext = SINGLE) -> None:
    """torch's compute threads on this thread: `threads` split over the ranks of ctx's job (each
    rank builds its own engine), or left as they are when None."""
    if threads is None:
        return
    from gptj.threads import set_threads

    set_threads(max(1, threads // (ctx.world if ctx.parallel else 1)))
