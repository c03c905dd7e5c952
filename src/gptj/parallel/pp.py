"""Pipeline parallelism with torch.distributed: the layers split over ranks, micro-batches in flight.

Stage r (`PipelineStage`, a module around the model) runs layers [r L / N, (r + 1) L / N); stage 0
also embeds, the last stage also applies ln_f and lm_head. A forward pass cuts the batch into
micro-batches: rank r sends a micro-batch's hidden states on (isend) and starts the next while rank
r + 1 works on it, so the ranks overlap (GPipe's forward schedule). The last rank broadcasts the logits, so every rank runs the same
decoding code and chooses the same tokens. Each rank stores keys/values only of its own layers
(the others' cache tensors stay untouched).

The engine's cache (per-sequence groups) runs as one micro-batch; decode.generate's KVCache is
split by rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from gptj.config import GPTJConfig
from gptj.errors import GptjError
from gptj.models.base import KVCache
from gptj.models.gptj import GPTJForCausalLM


def check_split(n_layer: int, world: int) -> None:
    if n_layer < world:
        raise GptjError(f"pipeline parallel over {world} ranks needs at least {world} layers, got {n_layer}")


class PipelineStage(nn.Module):
    """Stage `stage` of `stages` of a pipeline around `model`, which keeps only this stage's layers
    (the others become OtherStage: no weights). Called as the model is, with the same arguments and
    the same logits on every stage, so the engine and decode.generate run it as they run the model.

    `peers[i]` is stage i's global rank (default: stage i is rank i; under --tp T --pp P, a pipeline
    is a column of the grid: stage i is global rank i T + t)."""

    def __init__(self, model: GPTJForCausalLM, stage: int, stages: int, micro_batches: int = 2,
                 group: dist.ProcessGroup | None = None, peers: list[int] | None = None) -> None:
        super().__init__()
        if not 0 <= stage < stages:
            raise GptjError(f"rank {stage} is not in [0, {stages})")
        n_layer = model.config.n_layer
        check_split(n_layer, stages)
        self.stage, self.stages, self.group = stage, stages, group
        self.peers = list(range(stages)) if peers is None else list(peers)
        if len(self.peers) != stages:
            raise GptjError(f"a pipeline of {stages} stages needs {stages} peers, got {len(self.peers)}")
        self.layers = range(stage * n_layer // stages, (stage + 1) * n_layer // stages)
        self.micro_batches = max(1, micro_batches)
        self.sends = 0  # micro-batches sent on (tests, stats)
        blocks = model.transformer.h
        for i in range(len(blocks)):
            if i not in self.layers:
                blocks[i] = OtherStage()  # its weights are released here
        self.model = model

    @property
    def config(self) -> GPTJConfig:
        return self.model.config

    @property
    def transformer(self) -> nn.Module:
        return self.model.transformer

    @property
    def kv_heads(self) -> int:
        """Key/value heads each of this stage's layers holds (its tensor rank's share under --tp)."""
        return self.model.kv_heads

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        """A cache of every layer, this stage's heads (it fills only its own layers')."""
        w = self.model.transformer.wte.weight
        return KVCache(self.config, batch_size, max_len, dtype=w.dtype, device=w.device, n_head=self.kv_heads)

    def _chunks(self, B: int, cache: object) -> list[slice]:
        m = 1 if cache is not None and not isinstance(cache, KVCache) else min(self.micro_batches, B)
        bounds = [B * i // m for i in range(m + 1)]
        return [slice(bounds[i], bounds[i + 1]) for i in range(m)]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: object = None,
                logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
        """The model's logits (GPTJForCausalLM.forward), this stage's part computed here."""
        model = self.model
        position_ids, mask = model.step_inputs(input_ids, attention_mask, position_ids, cache)
        B, T = input_ids.shape
        E, V = model.config.n_embd, model.config.vocab_size
        dtype, device = model.transformer.wte.weight.dtype, input_ids.device
        first, last = self.stage == 0, self.stage == self.stages - 1
        chunks = self._chunks(B, cache)
        outs, sending = [], []
        for rows in chunks:
            if first:
                h = model.transformer.wte(input_ids[rows])
            else:
                h = torch.empty((rows.stop - rows.start, T, E), dtype=dtype, device=device)
                dist.recv(h, src=self.peers[self.stage - 1], group=self.group)
            part = cache if len(chunks) == 1 else cache.rows(rows) if cache is not None else None
            part_mask = mask if mask is None or len(chunks) == 1 else mask[rows]
            h = model.run_layers(h, position_ids[rows], part_mask, part, self.layers.start, self.layers.stop)
            if not last:
                h = h.contiguous()
                sending.append((dist.isend(h, dst=self.peers[self.stage + 1], group=self.group), h))
                self.sends += 1
                continue
            outs.append(model.logits(h, logits_to_keep))
        for work, _ in sending:
            work.wait()
        if cache is not None:
            cache.advance(T)
        kept = (len(logits_to_keep) if isinstance(logits_to_keep, torch.Tensor)
                else logits_to_keep if logits_to_keep > 0 else T)
        logits = torch.cat(outs) if last else torch.empty((B, kept, V), dtype=torch.float32, device=device)
        dist.broadcast(logits, src=self.peers[-1], group=self.group)
        return logits


class OtherStage(nn.Module):
    """A layer another rank runs: no weights here (kernels and quantization pass it by)."""

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError("this layer runs on another pipeline stage")
