"""Tensor parallelism with torch.distributed: each rank holds a slice of every projection.

As gpt-fast's tp.py does, each rank keeps a slice of every projection of a full model and runs the
model's own math on it, plus one collective per layer (`TensorParallelBlock`, built with the
rank's shapes):

    q_proj, k_proj, v_proj   column-parallel: output rows, whole heads, n_head / world per rank
    fc_in                    column-parallel: output rows (and bias), inner_dim / world per rank
    out_proj, fc_out         row-parallel: input columns; each rank's product is a partial sum;
                             fc_out's bias stays on rank 0 only, so the sum has it once
    block                    GPT-J computes attention and MLP from the same LayerNorm output and
                             adds them: the two partial sums are added locally and reduced with ONE
                             all-reduce per layer, then the residual is added
    lm_head                  vocabulary rows; the logits are all-gathered (VocabParallelHead)
    wte, LayerNorms          replicated

The KV cache holds only the rank's heads (`GPTJForCausalLM.kv_heads`). Every rank runs the same
decoding code on the same (gathered) logits, so all ranks choose the same tokens; sampling needs
the same seed on every rank. Backends: gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from gptj.config import GPTJConfig
from gptj.errors import GptjError
from gptj.models.base import KVCache
from gptj.models.gptj import Block, GPTJForCausalLM, build_model
from gptj.parallel.pp import OtherStage


class AllReduce:
    """The sum of the ranks' partial outputs, in place; counts its calls (tests, stats)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group, self.calls = group, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x


def column_parallel(in_features: int, out_features: int, world: int, bias: bool) -> nn.Linear:
    """A linear over a 1 / world slice of the output rows: this rank's part of the whole output."""
    return nn.Linear(in_features, out_features // world, bias=bias)


def row_parallel(in_features: int, out_features: int, world: int, bias: bool) -> nn.Linear:
    """A linear over a 1 / world slice of the input columns: this rank's partial sum of the output."""
    return nn.Linear(in_features // world, out_features, bias=bias)


class TensorParallelBlock(Block):
    """A GPT-J block over this rank's heads and inner columns (made on the meta device, its tensors
    loaded with assign=True): q, k, v and fc_in column-parallel, out_proj and fc_out row-parallel, so
    attn(x) + mlp(x) is a partial sum, all-reduced once before the residual is added. Fusing it for
    serving (gptj.kernels.fuse_block) keeps that: the same update, from fused weights."""

    def __init__(self, config: GPTJConfig, world: int, all_reduce: AllReduce) -> None:
        super().__init__(config)
        E, inner, attn, mlp = config.n_embd, config.inner_dim, self.attn, self.mlp
        attn.q_proj, attn.k_proj, attn.v_proj = (column_parallel(E, E, world, bias=False) for _ in range(3))
        attn.out_proj = row_parallel(E, E, world, bias=False)
        mlp.fc_in = column_parallel(E, inner, world, bias=True)
        mlp.fc_out = row_parallel(inner, E, world, bias=True)
        attn.n_head = config.n_head // world
        self.all_reduce = all_reduce

    def forward(self, h: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None, layer: int) -> torch.Tensor:
        return self.all_reduce(self.update(h, sin, cos, mask, cache, layer)) + h


class VocabParallelHead(nn.Module):
    """lm_head over this rank's slice of the vocabulary; forward all-gathers the full logits.
    Made with meta parameters of shape (V / world, E); the rank's tensors are loaded into it."""

    def __init__(self, rows: int, n_embd: int, bias: bool, dtype: torch.dtype, world: int,
                 group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty((rows, n_embd), dtype=dtype, device="meta"), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(rows, dtype=dtype, device="meta"), requires_grad=False) if bias else None
        self.world, self.group = world, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = nn.functional.linear(x, self.weight, self.bias).contiguous()  # (..., V / world)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)


def vocab_head(config: GPTJConfig, dtype: torch.dtype, world: int,
               group: dist.ProcessGroup | None = None) -> VocabParallelHead:
    """A rank's lm_head (GPT-J's has a bias): its 1 / world of the vocabulary."""
    return VocabParallelHead(config.vocab_size // world, config.n_embd, True, dtype, world, group)


def check_plan(config: GPTJConfig, world: int) -> None:
    for what, n in (("n_head", config.n_head), ("inner_dim", config.inner_dim), ("vocab_size", config.vocab_size)):
        if n % world:
            raise GptjError(f"tensor parallel over {world} ranks needs {what} ({n}) divisible by {world}")


def part(n: int, rank: int, world: int) -> slice:
    return slice(rank * n // world, (rank + 1) * n // world)


def shard_state_dict(state_dict: Mapping[str, torch.Tensor], config: GPTJConfig, rank: int,
                     world: int) -> dict[str, torch.Tensor]:
    """Rank's tensors of a full float state dict, under the plan above (the one source of it)."""
    check_plan(config, world)
    heads, ffn = part(config.n_embd, rank, world), part(config.inner_dim, rank, world)
    vocab = part(config.vocab_size, rank, world)
    out = {}
    for name, t in state_dict.items():
        leaf = name.split(".", 3)[-1] if name.startswith("transformer.h.") else name
        if leaf in ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"):
            t = t[heads]
        elif leaf == "attn.out_proj.weight":
            t = t[:, heads]
        elif leaf in ("mlp.fc_in.weight", "mlp.fc_in.bias"):
            t = t[ffn]
        elif leaf == "mlp.fc_out.weight":
            t = t[:, ffn]
        elif leaf == "mlp.fc_out.bias" and rank != 0:
            t = torch.zeros_like(t)
        elif name in ("lm_head.weight", "lm_head.bias"):
            t = t[vocab]
        elif t.dtype in (torch.int8, torch.uint8):
            raise GptjError("tensor parallel shards a float model; shard before quantizing")
        out[name] = t.contiguous().clone() if world > 1 else t
    return out


def reshape_for_rank(model: GPTJForCausalLM, world: int, group: dist.ProcessGroup | None = None) -> AllReduce:
    """Give `model` rank-sized (meta) blocks and head: TensorParallelBlock and VocabParallelHead,
    which share one AllReduce (returned: its `calls` counts the all-reduces). The rank's tensors
    are then loaded into them (load_state_dict(assign=True)). One rank: the model as it was. The
    layers of other pipeline stages (OtherStage) hold nothing to shard."""
    c = model.config
    check_plan(c, world)
    reduce = AllReduce(group)
    if world == 1:
        return reduce
    blocks = model.transformer.h
    here = [i for i, block in enumerate(blocks) if not isinstance(block, OtherStage)]  # (a pipeline stage's)
    for i in here:
        block = blocks[i]
        if (type(block) is not Block or block.w_in is not None or type(block.attn.q_proj) is not nn.Linear
                or type(block.mlp.fc_in) is not nn.Linear):
            raise GptjError("tensor parallel shards a plain float model; shard before quantizing or fusing")
    dtype = model.lm_head.weight.dtype
    with torch.device("meta"):
        for i in here:
            blocks[i] = TensorParallelBlock(c, world, reduce).to(dtype)
    model.lm_head = vocab_head(c, dtype, world, group)
    return reduce


def shard_model(model: GPTJForCausalLM, rank: int, world: int,
                group: dist.ProcessGroup | None = None) -> AllReduce:
    """Cut `model` (a full float model, plain blocks) down to rank's share, in place.

    Returns the AllReduce every block now calls (its `calls` counts the all-reduces)."""
    if not 0 <= rank < world:
        raise GptjError(f"rank {rank} is not in [0, {world})")
    device = model.transformer.wte.weight.device
    sd = shard_state_dict(model.state_dict(), model.config, rank, world)
    reduce = reshape_for_rank(model, world, group)
    if world > 1:
        model.load_state_dict(sd, strict=True, assign=True)
        model.init_buffers(device)
    return reduce


def load_gptj_rank(config: GPTJConfig, sd: dict[str, torch.Tensor], world: int, dtype: torch.dtype,
                   device: torch.device | str, group: dist.ProcessGroup | None = None) -> GPTJForCausalLM:
    """A rank's GPT-J holding its shard's tensors `sd` (gptj.parallel.shards.load_rank read them and
    folded any adapter in), built with its rank-sized blocks and head."""
    check_plan(config, world)
    reduce, head = AllReduce(group), vocab_head(config, dtype, world, group)
    model = build_model(config, device="meta", dtype=dtype, block=lambda c: TensorParallelBlock(c, world, reduce),
                        head=head)
    model.load_state_dict({n: t.to(dtype) if t.is_floating_point() else t for n, t in sd.items()}, strict=True,
                          assign=True)
    model.init_buffers(device)
    return model.eval()
