"""Where this process stands in a parallel job: `ParallelContext`, made once when the job starts and
passed to what loads and runs the model (`gptj.runtime.build.load_model(spec, ctx)`).

    ctx = ParallelContext.join(tp, pp)     every rank, at the start of a --tp / --pp job (a collective)
    ctx = SINGLE                           one process: the whole model, no collectives

The tp x pp ranks form a grid: global rank r is tensor rank r % tp of pipeline stage r // tp, so a
stage's tensor ranks are neighbours (one machine, when a job spans several) and each tensor rank t
has its own pipeline, stages t, t + tp, t + 2 tp, ... The context holds the grid's process groups and
cuts a model to this rank's share of it (`share`); gptj.parallel.lockstep sends rank 0's engine
steps to the other ranks over its control group.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gptj.errors import GptjError

if TYPE_CHECKING:
    from torch import nn

    from gptj.models.gptj import GPTJForCausalLM
    from gptj.weights.checkpoint import Checkpoint


def check_grid(tp: int, pp: int, world: int) -> None:
    """A job of `world` ranks runs --tp tp --pp pp only when tp x pp is world."""
    if tp * pp != world:
        raise GptjError(f"--tp {tp} --pp {pp} needs {tp * pp} ranks, the job has {world}")


class ParallelContext:
    """This rank of a tp x pp job: its place in the grid and its process groups.

    control: a gloo group of every rank (rank 0's lockstep messages; None: one process, no job).
    tp_group, pp_group: this rank's tensor peers and its pipeline (None under --tp alone or --pp
    alone: the whole job is the one group). `stopped` and `leading` are rank 0's lockstep state
    (gptj.parallel.lockstep): it has told the others to stop; it runs the job's one engine loop."""

    def __init__(self, tp: int = 1, pp: int = 1, rank: int = 0, control: dist.ProcessGroup | None = None,
                 tp_group: dist.ProcessGroup | None = None, pp_group: dist.ProcessGroup | None = None) -> None:
        self.tp, self.pp, self.rank = tp, pp, rank
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0")) if control is not None else 0  # its GPU's index
        self.control, self.tp_group, self.pp_group = control, tp_group, pp_group
        self.stopped = self.leading = False

    @classmethod
    def join(cls, tp: int = 1, pp: int = 1) -> ParallelContext:
        """Every rank of a job, once, at its start (a collective: the control group and, under --tp
        and --pp together, the grid's groups). Without a process group of several ranks: one process."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
            return cls(tp, pp)
        check_grid(tp, pp, world)
        rank = dist.get_rank()
        ctx = cls(tp, pp, rank, control=dist.new_group(backend="gloo"))
        if tp > 1 and pp > 1:  # every rank creates every group, in the same order
            for stage in range(pp):
                ranks = list(range(stage * tp, (stage + 1) * tp))
                group = dist.new_group(ranks)
                if rank in ranks:
                    ctx.tp_group = group
            for t in range(tp):
                ranks = list(range(t, world, tp))
                group = dist.new_group(ranks)
                if rank in ranks:
                    ctx.pp_group = group
        return ctx

    @property
    def parallel(self) -> bool:
        """True on the ranks of a job of several ranks."""
        return self.control is not None

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    def check(self, tp: int, pp: int) -> None:
        """Refuse a model asked for with --tp tp --pp pp that this job was not started for."""
        if not self.parallel:
            if tp * pp > 1:
                raise GptjError(f"--tp {tp} --pp {pp} runs on {tp * pp} ranks: start it with gptj (which spawns "
                                "them) or torchrun")
            return
        check_grid(tp, pp, dist.get_world_size())
        if (tp, pp) != (self.tp, self.pp):
            raise GptjError(f"--tp {tp} --pp {pp} asked of a job configured for --tp {self.tp} --pp {self.pp}")

    def load(self, folder: str, dtype: torch.dtype, device: str, quantize: str | None = None,
             group_size: int | None = None, progress: bool | None = None, lora: str | None = None) -> nn.Module:
        """This rank's share (see share_of) of the checkpoint in `folder`, on the device `device` names
        (under a job on CUDA, this rank's own GPU), with the LoRA adapter in the folder `lora` folded
        into its float weights as they are read, then quantized as `quantize` asks. Before any tensor
        is read (gptj.weights.checkpoint.Checkpoint): the adapter (a bad one is refused in one line) and the
        checkpoint's config, once; then the device, where fp8 or w4a8 weights (asked for, or recorded in the
        checkpoint) are refused unless they can run (gptj.device.check_fp8_device, check_w4a8_device)."""
        from gptj.device import check_fp8_device, check_w4a8_device, rank_device, resolve_device
        from gptj.weights.checkpoint import Checkpoint

        checkpoint = Checkpoint.read(folder, self.tp_rank, self.tp if self.parallel else 1, lora=lora)
        device = resolve_device(rank_device(device, self.local_rank) if self.parallel else device)
        mode = quantize or checkpoint.mode
        if mode == "fp8":
            check_fp8_device(device)
        elif mode == "w4a8":
            check_w4a8_device(device)
        return self.share_of(checkpoint, dtype, device, quantize, group_size, progress)

    def share_of(self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, quantize: str | None = None,
                 group_size: int | None = None, progress: bool | None = None) -> nn.Module:
        """This rank's share of `checkpoint`: the whole model in one process; under --tp its shard
        (from `gptj convert --tp N` files when present, else cut from the whole model), under --pp
        its stage (both: its stage's shard), then quantized as `quantize` asks."""
        from gptj.weights.io import load

        if self.parallel:
            return self._rank_share(checkpoint, dtype, device, quantize, group_size, progress)
        return load(checkpoint, dtype, device, quantize, group_size, progress)

    def _rank_share(self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, quantize: str | None,
                    group_size: int | None, progress: bool | None) -> nn.Module:
        """share_of under --tp / --pp. Quantizing after sharding: q/k/v and fc_in keep whole rows, so
        their per-row int8 scales (and int4 groups) are those of the whole model; out_proj and fc_out
        keep a slice of each row, so each rank's scales cover its slice (finer than the whole model's).
        The vocabulary-parallel head stays in the float dtype. A pipeline stage quantizes its layers as
        the whole model would."""
        from gptj.parallel.shards import load_rank
        from gptj.weights.io import load

        if quantize == "w8a8":  # its smoothing factors would have to be sliced as the shards are
            raise GptjError("--quantize w8a8 with --tp / --pp is not supported yet")
        sharded = checkpoint.shard is not None
        if sharded:
            model = load_rank(checkpoint, self.tp_rank, self.tp, dtype, device, group=self.tp_group)
        else:
            model = load(checkpoint, dtype, device, progress=progress)
        share = self.share(model, sharded)  # the model, or its stage around it
        if quantize:
            from gptj.quant import quantize_model

            quantize_model(model, quantize, group_size, skip=("lm_head",) if self.tp > 1 else ())
        return share

    def share(self, model: GPTJForCausalLM, sharded: bool = False) -> nn.Module:
        """`model` (a whole float model, or this tensor rank's shard when `sharded`) cut to this
        rank's share: under --pp its stage (gptj.parallel.pp.PipelineStage, around the same model;
        the other stages' layers are released first), under --tp its tensor shard of what is left."""
        from gptj.models.llama import LlamaForCausalLM
        from gptj.parallel.pp import PipelineStage
        from gptj.parallel.tp import shard_model
        from gptj.parallel.tp_llama import shard_llama

        share = model
        if self.pp > 1:
            share = PipelineStage(model, self.stage, self.pp, micro_batches=self.pp, group=self.pp_group,
                                  peers=[self.tp_rank + i * self.tp for i in range(self.pp)])
        if self.tp > 1 and not sharded:
            shard = shard_llama if isinstance(model, LlamaForCausalLM) else shard_model
            shard(model, self.tp_rank, self.tp, group=self.tp_group)
        return share

    def least(self, value: int) -> int:
        """The smallest of every rank's `value` (a collective: every rank calls it, at the same point,
        e.g. while building its engine, so that all plan the same KV memory); `value` in one process."""
        if not self.parallel:
            return value
        box = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.control)
        return int(box.item())


SINGLE = ParallelContext()  # one process: the whole model (never joins a job, so never changes)
