"""Pipeline parallelism with torch.distributed: the layers split over ranks, micro-batches in flight.

Rank r runs layers [r L / N, (r + 1) L / N); rank 0 also embeds, the last rank also applies ln_f
and lm_head. A forward pass cuts the batch into micro-batches: rank r sends a micro-batch's
hidden states on (isend) and starts the next while rank r + 1 works on it, so the ranks overlap
(GPipe's forward schedule). The last rank broadcasts the logits, so every rank runs the same
decoding code and chooses the same tokens. Each rank stores keys/values only of its own layers
(the others' cache tensors stay untouched).

The engine's cache (per-sequence groups) runs as one micro-batch; decode.generate's KVCache is
split by rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from gptj.errors import GptjError
from gptj.models.base import KVCache, kept_positions
from gptj.models.gptj import GPTJForCausalLM, rotary_tables


def check_split(n_layer: int, world: int) -> None:
    if n_layer < world:
        raise GptjError(f"pipeline parallel over {world} ranks needs at least {world} layers, got {n_layer}")


class Pipeline:
    """Stage `rank` of `world`; `peers[i]` is stage i's global rank (default: stage i is rank i;
    under --tp T --pp P, a pipeline is a column of the grid: stage i is global rank i T + t)."""

    def __init__(self, rank: int, world: int, n_layer: int, micro_batches: int = 2,
                 group: dist.ProcessGroup | None = None, peers: list[int] | None = None) -> None:
        check_split(n_layer, world)
        self.rank, self.world, self.group = rank, world, group
        self.peers = list(range(world)) if peers is None else list(peers)
        if len(self.peers) != world:
            raise GptjError(f"a pipeline of {world} stages needs {world} peers, got {len(self.peers)}")
        self.layers = range(rank * n_layer // world, (rank + 1) * n_layer // world)
        self.micro_batches = max(1, micro_batches)
        self.sends = 0  # micro-batches sent on (tests, stats)

    def _chunks(self, B: int, cache: object) -> list[slice]:
        m = 1 if cache is not None and not isinstance(cache, KVCache) else min(self.micro_batches, B)
        bounds = [B * i // m for i in range(m + 1)]
        return [slice(bounds[i], bounds[i + 1]) for i in range(m)]

    def run(self, model: GPTJForCausalLM, input_ids: torch.Tensor, position_ids: torch.Tensor,
            mask: torch.Tensor | None, cache: object, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        E, V = model.config.n_embd, model.config.vocab_size
        dtype, device = model.transformer.wte.weight.dtype, input_ids.device
        first, last = self.rank == 0, self.rank == self.world - 1
        chunks = self._chunks(B, cache)
        outs, sending = [], []
        for rows in chunks:
            n = rows.stop - rows.start
            if first:
                h = model.transformer.wte(input_ids[rows])
            else:
                h = torch.empty((n, T, E), dtype=dtype, device=device)
                dist.recv(h, src=self.peers[self.rank - 1], group=self.group)
            sin, cos = rotary_tables(model.rope, position_ids[rows], h.dtype)
            part = cache if len(chunks) == 1 else cache.rows(rows) if cache is not None else None
            part_mask = mask if mask is None or len(chunks) == 1 else mask[rows]
            for i in self.layers:
                h = model.transformer.h[i](h, sin, cos, part_mask, part, i)
            if not last:
                h = h.contiguous()
                sending.append((dist.isend(h, dst=self.peers[self.rank + 1], group=self.group), h))
                self.sends += 1
                continue
            outs.append(model.lm_head(model.transformer.ln_f(kept_positions(h, logits_to_keep))).float())
        for work, _ in sending:
            work.wait()
        if cache is not None:
            cache.advance(T)
        kept = (len(logits_to_keep) if isinstance(logits_to_keep, torch.Tensor)
                else logits_to_keep if logits_to_keep > 0 else T)
        logits = torch.cat(outs) if last else torch.empty((B, kept, V), dtype=torch.float32, device=device)
        dist.broadcast(logits, src=self.peers[-1], group=self.group)
        return logits


def pipeline_model(model: GPTJForCausalLM, rank: int, world: int, micro_batches: int = 2,
                   group: dist.ProcessGroup | None = None, peers: list[int] | None = None) -> Pipeline:
    """Make `model` run rank's stage; the other layers' weights are released."""
    if not 0 <= rank < world:
        raise GptjError(f"rank {rank} is not in [0, {world})")
    stage = Pipeline(rank, world, model.config.n_layer, micro_batches, group, peers)
    if world > 1:
        for i, block in enumerate(model.transformer.h):
            if i not in stage.layers:
                model.transformer.h[i] = OtherStage(block.attn.n_head)
        model.pipeline = stage
    return stage


class OtherStage(nn.Module):
    """A layer another rank runs: no weights here (kernels and quantization pass it by)."""

    def __init__(self, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError("this layer runs on another pipeline stage")
