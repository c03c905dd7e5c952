"""The runner: the only caller of the model. It owns the KV tensors and turns a `SchedulerOutput`
into logits (`RunnerOutput`), changing no request.

A step is one forward for every decoding sequence's next token (each at its own position, each
request attending over its own blocks), then one forward per prefill chunk. A forward that raises
fails only the requests it ran; the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gptj.engine.attention import DecodeAttention, DecodeGroup, PagedBatch, PagedKV
from gptj.engine.config import EngineConfig, KVPlan
from gptj.engine.request import Request
from gptj.engine.scheduler import PrefillChunk, SchedulerOutput, context
from gptj.model import GPTJForCausalLM


@dataclass
class RunnerOutput:
    logits: dict[Request, torch.Tensor] = field(default_factory=dict)  # (n_seqs, V): choose next tokens
    prompt_logits: dict[Request, torch.Tensor] = field(default_factory=dict)  # (chunk, V): prompt logprobs
    errors: dict[Request, str] = field(default_factory=dict)  # the forward that ran it raised this
    decode_rows: int = 0  # sequences in the decode forward


class ModelRunner:
    def __init__(self, model: GPTJForCausalLM, plan: KVPlan, config: EngineConfig) -> None:
        self.model = model
        w = model.transformer.wte.weight
        self.device = w.device
        kv_dtype = w.dtype  # the activations' dtype (weights may be quantized)
        self.kv = PagedKV(model.config, plan.n_blocks, plan.block_size, kv_dtype, w.device, n_head=model.kv_heads)
        self.attention = DecodeAttention(config.compile, kv_dtype, native=config.kernels == "auto", device=w.device)

    def run(self, sched: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        self.kv.copy(sched.copies)
        with torch.inference_mode():
            if sched.decode:
                self._guard(sched.decode, out, lambda: self._decode(sched.decode, out))
            for chunk in sched.prefill:
                self._guard([chunk.request], out, lambda chunk=chunk: self._prefill(chunk, out))
        return out

    @staticmethod
    def _guard(reqs: list[Request], out: RunnerOutput, forward) -> None:  # noqa: ANN001 - a thunk
        try:
            forward()
        except Exception as e:  # noqa: BLE001 - fail these requests, keep serving the others
            message = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            for req in reqs:
                out.errors[req] = message

    def _decode(self, reqs: list[Request], out: RunnerOutput) -> None:
        B = self.kv.block_size
        groups, positions, tokens, wb, wo = [], [], [], [], []
        for req in reqs:
            L = req.seqs[0].length  # tokens stored; this step's token goes to position L
            if req.n_seqs == 1:
                groups.append(DecodeGroup(req.seqs[0].blocks, L + 1, [[]], 0))
            else:  # the prompt's full blocks, shared by every beam, then each beam's own
                s = req.shared
                groups.append(DecodeGroup(req.seqs[0].blocks[:s], s * B, [q.blocks[s:] for q in req.seqs], L + 1 - s * B))
            for seq in req.seqs:
                wb.append(seq.blocks[L // B])
                wo.append(L % B)
            positions += [L] * req.n_seqs
            tokens += req.next_tokens
        ids = torch.tensor(tokens, device=self.device)[:, None]  # (N, 1)
        pos = torch.tensor(positions, device=self.device)[:, None]
        cache = PagedBatch(self.kv, self.attention, groups=groups, write_blocks=wb, write_offsets=wo)
        logits = self.model(ids, position_ids=pos, cache=cache)[:, -1]  # (N, V)
        out.decode_rows = len(tokens)
        row = 0
        for req in reqs:
            out.logits[req] = logits[row:row + req.n_seqs]
            row += req.n_seqs

    def _prefill(self, chunk: PrefillChunk, out: RunnerOutput) -> None:
        req, start, end = chunk.request, chunk.start, chunk.end
        ids = torch.tensor([context(req)[start:end]], device=self.device)
        positions = torch.arange(start, end, device=self.device)[None]
        cache = PagedBatch(self.kv, self.attention, prefill_blocks=req.seqs[0].blocks, prefill_start=start)
        want_prompt = req.prompt_logprobs is not None and start < len(req.prompt)
        keep = end - start if want_prompt else 1
        logits = self.model(ids, position_ids=positions, cache=cache, logits_to_keep=keep)  # (1, keep, V)
        if want_prompt:
            out.prompt_logits[req] = logits[0]
        if end == len(context(req)):
            out.logits[req] = logits[:, -1]  # (1, V): its first (next) token
