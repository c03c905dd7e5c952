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

The decode rows come from the persistent InputBatch (engine/input_batch.py), brought up to the step
from the scheduler's output: their tokens, positions and block tables are not rebuilt each step. A
speculating request's next token and draft (SchedulerOutput.verify) are decode rows too, a row a
token at its own position, every one's logits kept. The
step's logits come back as one tensor (rows, V) and a map of whose rows they are (`RunnerOutput.rows`):
the decode rows first, in the batch's order, as the forward computed them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gptj.engine.attention import PagedBatch, PagedKV, PrefillSegment, make_backend
from gptj.engine.config import EngineConfig, KVPlan, kv_storage
from gptj.engine.graphs import CaptureFailed, GraphRunner
from gptj.engine.input_batch import InputBatch
from gptj.engine.request import Request
from gptj.engine.scheduler import PrefillChunk, SchedulerOutput, context
from gptj.lora import multi_lora_modules, rows_by_adapter
from gptj.models.gptj import GPTJForCausalLM
from gptj.policy import attention_path


@dataclass
class RunnerOutput:
    """A step's results. `logits` (R, V) float32: the rows a token is chosen from, every request's in
    one tensor; `rows`: which of them are each request's (its sequences' in order; a request's first
    token: its prompt's last row, one for all its beams)."""

    logits: torch.Tensor | None = None
    rows: dict[Request, range] = field(default_factory=dict)
    prompt_logits: dict[Request, torch.Tensor] = field(default_factory=dict)  # (chunk, V): prompt logprobs
    errors: dict[Request, str] = field(default_factory=dict)  # the forward that ran it raised this
    decode_rows: int = 0  # sequences in the decode forward
    parts: list[tuple[torch.Tensor, dict[Request, range]]] = field(default_factory=list, repr=False)  # per forward

    def add(self, logits: torch.Tensor, rows: dict[Request, range]) -> None:
        """A forward's logits and the rows of them tokens are chosen from (`join` makes them one)."""
        if rows:
            self.parts.append((logits, rows))

    def join(self) -> None:
        """The forwards' logits as one tensor: the one forward's as it is (most steps), else those
        with rows to choose from, one after another."""
        if len(self.parts) == 1:
            (self.logits, self.rows), = self.parts
        elif self.parts:
            at = 0
            for logits, rows in self.parts:
                self.rows.update({req: range(at + r.start, at + r.stop) for req, r in rows.items()})
                at += logits.shape[0]
            self.logits = torch.cat([logits for logits, _ in self.parts])
        self.parts = []

    def of(self, req: Request) -> torch.Tensor:
        """A request's rows of `logits` (a view)."""
        r = self.rows[req]
        return self.logits[r.start:r.stop]


class ModelRunner:
    def __init__(self, model: GPTJForCausalLM, plan: KVPlan, config: EngineConfig) -> None:
        self.model = model
        w = model.transformer.wte.weight
        self.device = w.device
        kv_dtype = kv_storage(w.dtype, config.kv_dtype)  # the activations' dtype (weights may be quantized), or int8 / e4m3
        # plan.n_blocks blocks for the sequences, and one more: the scratch block graphs' padding rows write
        self.kv = PagedKV(model.config, plan.n_blocks + 1, plan.block_size, kv_dtype, w.device, n_head=model.kv_heads,
                          compute=w.dtype)
        self.batch = InputBatch(plan.max_seqs, plan.blocks_per_seq, plan.block_size, w.device, scratch=plan.n_blocks,
                                draft_rows=plan.draft_rows)
        c = model.config  # query heads: the KV heads times each one's group (Llama's GQA; GPT-J: 1)
        groups = c.n_head // c.n_kv_head
        self.attention = make_backend(attention_path(w.device, kv_dtype, config.kernels, config.compile, w.dtype,
                                                     c.head_dim, heads=model.kv_heads * groups,
                                                     kv_heads=model.kv_heads))
        self.graphs = None  # decode-only steps from captured CUDA graphs (engine/graphs.py)
        self.lora = multi_lora_modules(model)  # LoRA adapters served over the model: each row's is set per forward
        one_process = plan.ranks == 1  # no collectives to capture
        if (config.cuda_graphs == "auto" and w.device.type == "cuda" and self.attention.name == "cuda" and one_process
                and not self.lora):  # (a step's adapters choose its kernels: not one graph per bucket)
            self.graphs = GraphRunner(model, self.kv, self.attention, self.batch, capture=True)

    def run(self, sched: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        # the decode rows (the drafts' too, a row a token): what the scheduler changed
        self.batch.update(sched, stairs=self.attention.stairs)
        self.attention.copy(self.kv, sched.copies)
        decode = self.batch.requests
        if sched.prefill and self.graphs is not None and self.graphs.takes(self.batch.n):
            # CUDA graphs: the decode rows from their graph, every chunk in one forward (an eager
            # forward costs the host a launch per kernel: tens of ms for 28 layers, graphs' rows included)
            parts = [(decode, []), ([], sched.prefill)]
        else:  # one forward per prompt chunk, the decode rows riding with the first (or alone)
            parts = [(decode, sched.prefill[:1]), *(([], [chunk]) for chunk in sched.prefill[1:])]
        with torch.inference_mode():
            for decode, prefill in parts:
                if decode or prefill:
                    self._run_part(decode, prefill, out)
        out.join()
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
        """One forward of the decode rows (`decode`: the batch's requests, or none; a verified request's
        rows are its next token's and its draft's) and these prompt chunks; logits into `out`."""
        n = self.batch.n if decode else 0
        if not prefill and self.graphs is not None and self.graphs.takes(n):
            try:
                logits = self.graphs.forward(n)  # decode only: replayed from a captured graph
            except CaptureFailed:  # (logged once) this bucket's steps run eagerly
                pass
            except Exception:  # noqa: BLE001 - a kernel that failed (logged): this step eagerly
                if self.graphs.ready:
                    raise
            else:
                self._hand_out(decode, [], [], logits, out)
                return
        step = self.batch.step() if decode else None
        tokens, positions, keep = [], [], list(range(n)) if prefill else []
        segments, kept = [], []  # per chunk: (first kept row, rows kept)
        for chunk in prefill:
            req, start, end = chunk.request, chunk.start, chunk.end
            segments.append(PrefillSegment(req.seqs[0].blocks, start, end - start))
            want_all = req.prompt_logprobs is not None and start < len(req.prompt)
            n_keep = end - start if want_all else 1
            kept.append((len(keep), n_keep))
            at = n + len(tokens) + end - start
            keep += range(at - n_keep, at)
            positions += range(start, end)
            tokens += context(req)[start:end]
        # each adapter's rows (the decode rows', then each chunk's), grouped on the host
        lora = rows_by_adapter([r.adapter for r in decode for _ in range(self.batch.width[r])]
                               + [c.request.adapter for c in prefill for _ in range(c.end - c.start)]) \
            if self.lora else []
        # The chunks' index tensors and rows, in one pinned, non_blocking copy: the host goes on to
        # the forward's launches while the GPU finishes what is queued (AttentionBackend.build)
        meta = self.attention.build(self.kv, segments=segments, rows=([tokens, positions, keep] if prefill else [])
                                    + [rows for _, rows in lora], decode=step.decode if step else None)
        if prefill:
            ids, pos, keep_rows, *adapter_rows = meta.rows
            if step is not None:
                ids, pos = torch.cat([step.ids, ids]), torch.cat([step.positions, pos])
        else:  # decode only: the batch's rows as they are, every row's logits
            ids, pos, keep_rows, adapter_rows = step.ids, step.positions, 0, meta.rows
        for m in self.lora:
            m.selection, m.n_rows = [(i, sel) for (i, _), sel in zip(lora, adapter_rows)], n + len(tokens)
        cache = PagedBatch(self.kv, self.attention, meta)
        logits = self.model(ids[None], position_ids=pos[None], cache=cache, logits_to_keep=keep_rows)[0]  # (kept, V)
        self._hand_out(decode, prefill, kept, logits, out)

    def _hand_out(self, decode: list[Request], prefill: list[PrefillChunk], kept: list[tuple[int, int]],
                  logits: torch.Tensor, out: RunnerOutput) -> None:
        """The forward's logits and whose rows they are: the decode rows first (the batch's: a verified
        request's every row), then each chunk's kept rows."""
        batch = self.batch
        rows = {req: range(batch.rows[req], batch.rows[req] + batch.width[req]) for req in decode}
        out.decode_rows += batch.n if decode else 0
        for chunk, (first, n_keep) in zip(prefill, kept):
            req = chunk.request
            if req.prompt_logprobs is not None and chunk.start < len(req.prompt):
                out.prompt_logits[req] = logits[first:first + n_keep]
            if chunk.end == len(context(req)):
                rows[req] = range(first + n_keep - 1, first + n_keep)  # its first (next) token
        out.add(logits, rows)


def _fail(reqs: list[Request], error: Exception, out: RunnerOutput) -> None:
    message = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    for req in reqs:
        out.errors[req] = message
