"""The runner: the only caller of the model. It owns the KV tensors and turns a `SchedulerOutput`
into logits (`RunnerOutput`), changing no request.

A step is one forward per prompt chunk, the decoding sequences' next tokens riding with the first
(each at its own position, each request attending over its own blocks; one forward alone when no
prompt is being prefilled): the decode rows add a few rows to a chunk's matmuls instead of reading
every weight once more. Each further chunk is a forward of its own (all of a step's chunks in one
forward was tried on CPU and measured no faster). With CUDA graphs the decode rows replay their
graph and all of the step's chunks share one eager forward: there an eager forward costs the host a
kernel launch per op, which a graph does not. Logits are computed only
where a token is chosen (and over a chunk whose prompt log-probabilities were asked for). A
forward that raises fails only the requests it ran (decode rows and chunk apart); the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gptj.engine.attention import DecodeGroup, PagedBatch, PagedKV, PrefillSegment, make_backend
from gptj.engine.config import EngineConfig, KVPlan, kv_storage
from gptj.engine.graphs import CaptureFailed, DecodeInputs, GraphRunner
from gptj.engine.request import Request
from gptj.engine.scheduler import PrefillChunk, SchedulerOutput, context
from gptj.lora import multi_lora_modules, rows_by_adapter
from gptj.models.gptj import GPTJForCausalLM
from gptj.policy import attention_path


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
        kv_dtype = kv_storage(w.dtype, config.kv_dtype)  # the activations' dtype (weights may be quantized), or int8 / e4m3
        # plan.n_blocks blocks for the sequences, and one more: the scratch block graphs' padding rows write
        self.kv = PagedKV(model.config, plan.n_blocks + 1, plan.block_size, kv_dtype, w.device, n_head=model.kv_heads,
                          compute=w.dtype)
        self.attention = make_backend(attention_path(w.device, kv_dtype, config.kernels, config.compile, w.dtype,
                                                     model.config.head_dim))
        self.graphs = None  # decode-only steps from captured CUDA graphs (engine/graphs.py)
        self.lora = multi_lora_modules(model)  # LoRA adapters served over the model: each row's is set per forward
        one_process = model.pipeline is None and model.kv_heads == model.config.n_head  # no collectives to capture
        if (config.cuda_graphs == "auto" and w.device.type == "cuda" and self.attention.name == "cuda" and one_process
                and not self.lora):  # (a step's adapters choose its kernels: not one graph per bucket)
            self.graphs = GraphRunner(model, self.kv, self.attention, plan.max_seqs, plan.blocks_per_seq,
                                      scratch=plan.n_blocks, capture=True)

    def run(self, sched: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        self.attention.copy(self.kv, sched.copies)
        if sched.prefill and self.graphs is not None and self.graphs.takes(sum(req.n_seqs for req in sched.decode)):
            # CUDA graphs: the decode rows from their graph, every chunk in one forward (an eager
            # forward costs the host a launch per kernel: tens of ms for 28 layers, graphs' rows included)
            parts = [(sched.decode, []), ([], sched.prefill)]
        else:  # one forward per prompt chunk, the decode rows riding with the first (or alone)
            parts = [(sched.decode, sched.prefill[:1]), *(([], [chunk]) for chunk in sched.prefill[1:])]
        with torch.inference_mode():
            for decode, prefill in parts:
                if decode or prefill:
                    self._run_part(decode, prefill, out)
        return out

    def _run_part(self, decode: list[Request], prefill: list[PrefillChunk], out: RunnerOutput) -> None:
        """One forward; if it raises, the requests it ran fail, and only those: decode rows that shared
        it with a chunk run again alone, and the chunk fails only if they go through (it is not run
        again) or if it fails alone too."""
        try:
            self._forward(decode, prefill, out)
        except Exception as e:  # noqa: BLE001 - fail these requests, keep serving the others
            if not decode and len(prefill) > 1:  # chunks that shared a forward: each alone, to fail only its own
                for chunk in prefill:
                    self._run_part([], [chunk], out)
                return
            if decode and prefill:
                try:
                    self._forward(decode, [], out)
                except Exception as e_decode:  # noqa: BLE001
                    _fail(decode, e_decode, out)
                    self._run_part([], prefill, out)
                    return
                decode = []
            _fail(decode + [chunk.request for chunk in prefill], e, out)

    def _forward(self, decode: list[Request], prefill: list[PrefillChunk], out: RunnerOutput) -> None:
        """One forward of these decode requests' next tokens and these prompt chunks; logits into `out`."""
        step = decode_inputs(decode, self.kv.block_size)
        if not prefill and self.graphs is not None and self.graphs.takes(len(step.tokens)):
            try:
                logits = self.graphs.forward(step)  # decode only: replayed from a captured graph
            except CaptureFailed:  # (logged once) this bucket's steps run eagerly
                pass
            except Exception:  # noqa: BLE001 - a kernel that failed (logged): this step eagerly
                if self.graphs.ready:
                    raise
            else:
                self._hand_out(decode, [], [], logits, out)
                return
        tokens, positions, keep = list(step.tokens), list(step.positions), list(range(len(step.tokens)))
        segments, kept = [], []  # per chunk: (first kept row, rows kept)
        for chunk in prefill:
            req, start, end = chunk.request, chunk.start, chunk.end
            segments.append(PrefillSegment(req.seqs[0].blocks, start, end - start))
            want_prompt = req.prompt_logprobs is not None and start < len(req.prompt)
            n_keep = end - start if want_prompt else 1
            kept.append((len(keep), n_keep))
            keep += range(len(tokens) + end - start - n_keep, len(tokens) + end - start)
            positions += range(start, end)
            tokens += context(req)[start:end]
        # each adapter's rows (the decode rows', then each chunk's), grouped on the host
        lora = rows_by_adapter([r.adapter for r in decode for _ in range(r.n_seqs)]
                               + [c.request.adapter for c in prefill for _ in range(c.end - c.start)]) \
            if self.lora else []
        # The step's index tensors and these rows, in one pinned, non_blocking copy: the host goes on
        # to the forward's launches while the GPU finishes what is queued (AttentionBackend.build)
        meta = self.attention.build(self.kv, step.groups, step.write_blocks, step.write_offsets, segments,
                                    rows=[tokens, positions, keep, *(rows for _, rows in lora)])
        ids, pos, keep_rows, *adapter_rows = meta.rows
        for m in self.lora:
            m.selection, m.n_rows = [(i, sel) for (i, _), sel in zip(lora, adapter_rows)], len(tokens)
        cache = PagedBatch(self.kv, self.attention, meta)
        logits = self.model(ids[None], position_ids=pos[None], cache=cache, logits_to_keep=keep_rows)[0]  # (kept, V)
        self._hand_out(decode, prefill, kept, logits, out)

    def _hand_out(self, decode: list[Request], prefill: list[PrefillChunk], kept: list[tuple[int, int]],
                  logits: torch.Tensor, out: RunnerOutput) -> None:
        """Each request's rows of the forward's logits: the decode rows first, then each chunk's kept rows."""
        row = 0
        for req in decode:
            out.logits[req] = logits[row:row + req.n_seqs]
            row += req.n_seqs
        out.decode_rows += row
        for chunk, (first, n_keep) in zip(prefill, kept):
            req = chunk.request
            if req.prompt_logprobs is not None and chunk.start < len(req.prompt):
                out.prompt_logits[req] = logits[first:first + n_keep]
            if chunk.end == len(context(req)):
                out.logits[req] = logits[first + n_keep - 1:first + n_keep]  # (1, V): its first (next) token


def decode_inputs(reqs: list[Request], block_size: int) -> DecodeInputs:
    """The decode rows of these running requests: each request's sequences, this step's token at
    position L (its stored length), written to block L // B, row L % B of each sequence's blocks; a
    beam request's rows share its prompt's full blocks (req.shared of them)."""
    B = block_size
    step = DecodeInputs([], [], [], [], [])
    for req in reqs:
        L = req.seqs[0].length
        if req.n_seqs == 1:
            step.groups.append(DecodeGroup(req.seqs[0].blocks, L + 1, [[]], 0))
        else:
            s = req.shared
            step.groups.append(DecodeGroup(req.seqs[0].blocks[:s], s * B, [q.blocks[s:] for q in req.seqs],
                                           L + 1 - s * B))
        for seq in req.seqs:
            step.write_blocks.append(seq.blocks[L // B])
            step.write_offsets.append(L % B)
        step.positions += [L] * req.n_seqs
        step.tokens += req.next_tokens
    return step


def _fail(reqs: list[Request], error: Exception, out: RunnerOutput) -> None:
    message = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    for req in reqs:
        out.errors[req] = message
