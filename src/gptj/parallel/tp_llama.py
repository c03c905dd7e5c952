"""Tensor parallelism for Llama: gptj.parallel.tp's plan on Llama's block.

    q_proj                   column-parallel: output rows, whole query heads, n_head / world per rank
    k_proj, v_proj           column-parallel: whole key/value heads, n_kv_head / world per rank (the
                             rank's query heads are the groups of its KV heads: query head h reads KV
                             head h // (n_head / n_kv_head), so rank r's slices line up)
    gate_proj, up_proj       column-parallel: intermediate_size / world rows per rank
    o_proj, down_proj        row-parallel: input columns; each rank's product is a partial sum
    block                    Llama adds attention, then the MLP, each to the residual after its own
                             norm: TWO all-reduces per layer (GPT-J's parallel block needs one)
    lm_head                  vocabulary rows, the logits all-gathered (tp.VocabParallelHead, no bias)
    embed_tokens, norms      replicated

The KV cache holds only the rank's KV heads (`LlamaForCausalLM.kv_heads` reads the block's).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from gptj.errors import GptjError
from gptj.models.base import KVCache
from gptj.models.llama import Block, LlamaConfig, LlamaForCausalLM, build_model
from gptj.parallel.pp import OtherStage
from gptj.parallel.tp import AllReduce, VocabParallelHead, column_parallel, part, row_parallel


def check_llama_plan(config: LlamaConfig, world: int) -> None:
    """GptjError unless every sliced size divides by `world`."""
    for what, n in (("num_attention_heads", config.num_attention_heads),
                    ("num_key_value_heads", config.num_key_value_heads),
                    ("intermediate_size", config.intermediate_size), ("vocab_size", config.vocab_size)):
        if n % world:
            raise GptjError(f"tensor parallel over {world} ranks needs {what} ({n}) divisible by {world}")


class LlamaTensorParallelBlock(Block):
    """A Llama block over this rank's query and KV heads and intermediate rows (made on the meta
    device, its tensors loaded with assign=True); attention and MLP each a partial sum, all-reduced
    before it is added to the residual."""

    def __init__(self, config: LlamaConfig, world: int, all_reduce: AllReduce) -> None:
        super().__init__(config)
        E, D, inner, attn, mlp = config.hidden_size, config.head_dim, config.intermediate_size, self.attn, self.mlp
        attn.q_proj = column_parallel(E, attn.n_head * D, world, bias=False)
        attn.k_proj, attn.v_proj = (column_parallel(E, attn.n_kv_head * D, world, bias=False) for _ in range(2))
        attn.o_proj = row_parallel(attn.n_head * D, E, world, bias=False)
        mlp.gate_proj, mlp.up_proj = (column_parallel(E, inner, world, bias=False) for _ in range(2))
        mlp.down_proj = row_parallel(inner, E, world, bias=False)
        attn.n_head, attn.n_kv_head = attn.n_head // world, attn.n_kv_head // world
        self.all_reduce = all_reduce

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None, layer: int) -> torch.Tensor:
        h = h + self.all_reduce(self.self_attention(self.ln_1(h), cos, sin, mask, cache, layer))
        return h + self.all_reduce(self.mlp(self.ln_2(h)))


def shard_llama_state_dict(state_dict: Mapping[str, torch.Tensor], config: LlamaConfig, rank: int,
                           world: int) -> dict[str, torch.Tensor]:
    """Rank's tensors of a full float Llama state dict (gptj's names), under the plan above."""
    check_llama_plan(config, world)
    D = config.head_dim
    heads = part(config.num_attention_heads * D, rank, world)
    kv = part(config.num_key_value_heads * D, rank, world)
    inner, vocab = part(config.intermediate_size, rank, world), part(config.vocab_size, rank, world)
    rows = {"attn.q_proj.weight": heads, "attn.k_proj.weight": kv, "attn.v_proj.weight": kv,
            "mlp.gate_proj.weight": inner, "mlp.up_proj.weight": inner}
    cols = {"attn.o_proj.weight": heads, "mlp.down_proj.weight": inner}
    out = {}
    for name, t in state_dict.items():
        leaf = name.split(".", 3)[-1] if name.startswith("transformer.h.") else name
        if t.dtype in (torch.int8, torch.uint8):
            raise GptjError("tensor parallel shards a float model; shard before quantizing")
        if leaf in rows:
            t = t[rows[leaf]]
        elif leaf in cols:
            t = t[:, cols[leaf]]
        elif name == "lm_head.weight":
            t = t[vocab]
        out[name] = t.contiguous().clone()
    return out


def reshape_llama_for_rank(model: LlamaForCausalLM, world: int, group: dist.ProcessGroup | None = None) -> AllReduce:
    """Give `model` rank-sized (meta) blocks and head (LlamaTensorParallelBlock, VocabParallelHead),
    sharing one AllReduce (returned); the rank's tensors are then assigned. A pipeline stage's other
    layers (OtherStage) hold nothing to shard."""
    c, reduce, dtype = model.config, AllReduce(group), model.lm_head.weight.dtype
    check_llama_plan(c, world)
    blocks = model.transformer.h
    here = [i for i, block in enumerate(blocks) if not isinstance(block, OtherStage)]
    if any(type(blocks[i]) is not Block for i in here):
        raise GptjError("tensor parallel shards a plain float model; shard before quantizing")
    with torch.device("meta"):
        for i in here:
            blocks[i] = LlamaTensorParallelBlock(c, world, reduce).to(dtype)
    model.lm_head = VocabParallelHead(c.vocab_size // world, c.hidden_size, False, dtype, world, group)
    return reduce


def shard_llama(model: LlamaForCausalLM, rank: int, world: int, group: dist.ProcessGroup | None = None) -> AllReduce:
    """Cut `model` (a whole float Llama, plain blocks; a pipeline stage's other layers hold nothing)
    down to rank's share, in place. Returns the AllReduce every block now calls."""
    if not 0 <= rank < world:
        raise GptjError(f"rank {rank} is not in [0, {world})")
    device = model.transformer.wte.weight.device
    sd = shard_llama_state_dict(model.state_dict(), model.config, rank, world)
    reduce = reshape_llama_for_rank(model, world, group)
    model.load_state_dict(sd, strict=True, assign=True)
    model.init_buffers(device)
    return reduce


def load_llama_rank(config: LlamaConfig, sd: dict[str, torch.Tensor], world: int, dtype: torch.dtype,
                    device: torch.device | str, group: dist.ProcessGroup | None = None) -> LlamaForCausalLM:
    """A rank's Llama holding its shard's tensors `sd` (gptj's names; gptj.parallel.shards.load_rank
    read them and folded any adapter in), built with its rank-sized blocks and head."""
    model = build_model(config, device="meta", dtype=dtype)
    reshape_llama_for_rank(model, world, group)
    model.load_state_dict({n: t.to(dtype) for n, t in sd.items()}, strict=True, assign=True)
    model.init_buffers(device)
    return model.eval()
