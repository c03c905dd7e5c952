"""Tensor parallelism with torch.distributed: a sharding plan applied to the unchanged model.

As gpt-fast's tp.py does, each rank keeps a slice of every projection of a full model and the
forward pass is the model's own, plus one collective per layer:

    q_proj, k_proj, v_proj   output rows: whole heads, n_head / world per rank
    fc_in                    output rows (and bias): inner_dim / world per rank
    out_proj, fc_out         input columns: each rank's product is a partial sum; fc_out's bias
                             stays on rank 0 only, so the sum has it once
    block                    GPT-J computes attention and MLP from the same LayerNorm output and
                             adds them: the two partial sums are added locally and reduced with ONE
                             all-reduce per layer (Block.reduce), then the residual is added
    lm_head                  vocabulary rows; the logits are all-gathered
    wte, LayerNorms          replicated

The KV cache holds only the rank's heads (`GPTJForCausalLM.kv_heads`). Every rank runs the same
decoding code on the same (gathered) logits, so all ranks choose the same tokens; sampling needs
the same seed on every rank. Backends: gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from gptj.errors import GptjError
from gptj.model import GPTJForCausalLM


class AllReduce:
    """Block.reduce: sum the ranks' partial outputs in place; counts its calls (tests, stats)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group, self.calls = group, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x


class VocabParallelHead(nn.Module):
    """lm_head over this rank's slice of the vocabulary; forward all-gathers the full logits."""

    def __init__(self, head: nn.Linear, rank: int, world: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        V = head.out_features
        part = V // world
        rows = slice(rank * part, (rank + 1) * part)
        self.weight = nn.Parameter(head.weight.detach()[rows].clone(), requires_grad=False)
        self.bias = None if head.bias is None else nn.Parameter(head.bias.detach()[rows].clone(), requires_grad=False)
        self.world, self.group = world, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = nn.functional.linear(x, self.weight, self.bias).contiguous()  # (..., V / world)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)


def _keep_rows(linear: nn.Linear, rows: slice) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_cols(linear: nn.Linear, cols: slice, keep_bias: bool) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[:, cols].clone(), requires_grad=False)
    if linear.bias is not None and not keep_bias:
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    linear.in_features = linear.weight.shape[1]


def check_plan(model: GPTJForCausalLM, world: int) -> None:
    c = model.config
    for what, n in (("n_head", c.n_head), ("inner_dim", c.inner_dim), ("vocab_size", c.vocab_size)):
        if n % world:
            raise GptjError(f"tensor parallel over {world} ranks needs {what} ({n}) divisible by {world}")


def shard_model(model: GPTJForCausalLM, rank: int, world: int,
                group: dist.ProcessGroup | None = None) -> AllReduce:
    """Cut `model` (a full float model, plain blocks) down to rank's share, in place.

    Returns the AllReduce every block now calls (its `calls` counts the all-reduces)."""
    if not 0 <= rank < world:
        raise GptjError(f"rank {rank} is not in [0, {world})")
    check_plan(model, world)
    reduce = AllReduce(group)
    if world == 1:
        return reduce
    c = model.config
    E, inner = c.n_embd, c.inner_dim
    heads = slice(rank * E // world, (rank + 1) * E // world)  # whole heads: rows h*D .. (h+1)*D
    ffn = slice(rank * inner // world, (rank + 1) * inner // world)
    for block in model.transformer.h:
        if type(block.attn.q_proj) is not nn.Linear or type(block.mlp.fc_in) is not nn.Linear:
            raise GptjError("tensor parallel shards a plain float model; shard before quantizing or fusing")
        attn, mlp = block.attn, block.mlp
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            _keep_rows(proj, heads)
        attn.n_head = c.n_head // world
        _keep_cols(attn.out_proj, heads, keep_bias=True)  # out_proj has no bias
        _keep_rows(mlp.fc_in, ffn)
        _keep_cols(mlp.fc_out, ffn, keep_bias=rank == 0)
        block.reduce = reduce
    model.lm_head = VocabParallelHead(model.lm_head, rank, world, group)
    return reduce
