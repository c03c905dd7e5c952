"""What runs in a step: `Scheduler.schedule()` returns a `SchedulerOutput`, plain data.

Order of a step (first come, first served; nobody skips ahead of an older request):

    1. decode    every running request that has its prompt stored gets its sequences' next token.
                 Each sequence needs room for it: a new block when its last one is full, or its own
                 copy of a block it shares with another beam (copy-on-write). When the free blocks
                 run out, a request younger than the oldest running one waits a step, keeping its
                 blocks (older requests finish and free theirs; nothing is computed twice). Only
                 the oldest request preempts: the youngest running request's blocks are released
                 and it waits at the head of the queue to be computed again (greedy and sampled
                 requests keep their tokens and recompute prompt + output; beam search starts over).
                 The oldest always goes on, and fits alone (Engine.validate), so all finish.
    2. prefill   requests admitted before and still prefilling (prefill_chunk) get their next chunk.
    3. admit     (none while a running request waits for blocks) waiting requests, oldest first,
                 while the running-sequence cap, the prompt-token budget and the free blocks
                 allow: a request takes the blocks of the longest prefix of its prompt found in
                 the prefix cache and new blocks for the rest, and is prefilled in this step
                 (within prefill_chunk).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gptj.engine.config import EngineConfig, KVPlan, admission_watermark
from gptj.engine.draft import ngram_draft
from gptj.engine.kv import KVCacheManager, block_keys
from gptj.engine.request import RUNNING, WAITING, Request, Sequence


@dataclass
class PrefillChunk:
    request: Request
    start: int  # context tokens stored before this chunk
    end: int  # stored after it


@dataclass
class Verify:
    """A request whose next token and a draft of the tokens after it (gptj.engine.draft) run this
    step: len(draft) + 1 positions from its stored length on, each row's logits kept."""

    request: Request
    draft: list[int]

    @property
    def tokens(self) -> list[int]:
        return self.request.next_tokens + self.draft


@dataclass
class SchedulerOutput:
    decode: list[Request] = field(default_factory=list)  # one new token for each of their sequences
    verify: list[Verify] = field(default_factory=list)  # a next token and its draft each
    prefill: list[PrefillChunk] = field(default_factory=list)
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # before the forward: (src, dst, tokens)
    # (request, i): its sequence i has a new last block, where its next token goes (a new block, or
    # its own copy of one it shared): the step's change to the block tables (engine/input_batch.py)
    new_blocks: list[tuple[Request, int]] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    stalled: list[Request] = field(default_factory=list)  # prefilled, but no free block for their next token

    @property
    def empty(self) -> bool:
        return not (self.decode or self.verify or self.prefill)


class Scheduler:
    def __init__(self, kv: KVCacheManager, plan: KVPlan, config: EngineConfig) -> None:
        self.kv, self.plan = kv, plan
        self.max_prefill_tokens, self.prefill_chunk = config.max_prefill_tokens, config.prefill_chunk
        self.watermark = admission_watermark(plan.n_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the youngest
        self.preemptions = 0
        self.stalls = 0  # request-steps skipped for want of a free block

    @property
    def running_seqs(self) -> int:
        return sum(r.n_seqs for r in self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Forget a request (finished, aborted, failed); its blocks go back to the free queue."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)

    # --- the step ---

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.prefill_chunk
        rows = self.plan.draft_rows  # the rows drafts may still add to this step's decode rows
        for req in list(self.running):
            if req in self.running and prefilled(req):
                verify = self._draft(req, budget, rows)
                if verify is not None:
                    out.verify.append(verify)
                    budget = None if budget is None else budget - len(verify.tokens)
                    rows -= len(verify.draft)
                else:
                    self._room_for_next_token(req, out)
        for req in self.running:
            if not prefilled(req) and (budget is None or budget > 0):
                budget = self._prefill(req, budget, out)
        if not out.stalled:  # new requests would take the blocks the stalled ones wait for
            self._admit(budget, out)
        return out

    def _room_for_next_token(self, req: Request, out: SchedulerOutput) -> None:
        """Make every sequence of `req` able to store its next token. When the free blocks do not
        suffice, `req` stalls this step if an older request runs; the oldest preempts the youngest
        requests until they do."""
        B = self.kv.block_size
        while True:
            needs = 0
            writers: dict[int, int] = {}  # a partly filled last block -> how many of the sequences write it
            for seq in req.seqs:
                if seq.length == len(seq.blocks) * B:
                    needs += 1
                else:
                    writers[seq.blocks[-1]] = writers.get(seq.blocks[-1], 0) + 1
            # each writer of a shared block copies it, except the last one when nobody else holds it
            needs += sum(k - (self.kv.ref[b] == k) for b, k in writers.items())
            if needs <= self.kv.free:
                break
            if req is not self.running[0]:
                out.stalled.append(req)
                self.stalls += 1
                return
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return
        for i, seq in enumerate(req.seqs):
            if seq.length == len(seq.blocks) * B:  # the last block is full (or there is none)
                seq.blocks += self.kv.allocate(1)
            elif self.kv.ref[seq.blocks[-1]] > 1:  # shared with another beam: copy before writing
                (new,) = self.kv.allocate(1)
                out.copies.append((seq.blocks[-1], new, seq.length % B))
                self.kv.release([seq.blocks[-1]])
                seq.blocks[-1] = new
            else:
                continue
            out.new_blocks.append((req, i))
        out.decode.append(req)

    def _draft(self, req: Request, budget: int | None, rows: int) -> Verify | None:
        """A speculating request's draft (gptj.engine.draft) with the blocks for it, when there is one
        and room for it: within the step's token budget, the `rows` drafts may still add to the step
        (KVPlan.draft_rows) and the free blocks, and never more tokens than the request may still
        produce. None: it decodes its next token as any other."""
        gen = req.gen
        if not gen.speculates or req.n_seqs > 1:
            return None
        if req.draft_wait > 0:  # backing off after rejected drafts (engine/update.py)
            req.draft_wait -= 1
            return None
        limit = gen.prompt_lookup_num_tokens if req.draft_len is None else req.draft_len
        k = min(limit, gen.max_new_tokens - len(req.output) - 1, rows)
        if budget is not None:
            k = min(k, budget - 1)
        if k <= 0:
            return None
        draft = ngram_draft(req.prompt + req.output, k, gen.max_matching_ngram_size)
        (seq,) = req.seqs
        new = self.kv.blocks_for(seq.length + 1 + len(draft)) - len(seq.blocks)
        if not draft or new > self.kv.free:
            return None
        seq.blocks += self.kv.allocate(new) if new > 0 else []
        return Verify(req, draft)

    def _prefill(self, req: Request, budget: int | None, out: SchedulerOutput) -> int | None:
        start = req.n_computed
        end = len(context(req)) if budget is None else min(len(context(req)), start + budget)
        out.prefill.append(PrefillChunk(req, start, end))
        return None if budget is None else budget - (end - start)

    def _admit(self, budget: int | None, out: SchedulerOutput) -> None:
        tokens_left = self.max_prefill_tokens
        running_seqs = self.running_seqs
        while self.waiting and (budget is None or budget > 0):
            req = self.waiting[0]
            ctx = context(req)
            if running_seqs + req.n_seqs > self.plan.max_seqs or (out.admitted and len(ctx) > tokens_left):
                return
            if not self._allocate(req, ctx):
                return
            self.waiting.popleft()
            req.status = RUNNING
            self.running.append(req)
            out.admitted.append(req)
            running_seqs += req.n_seqs
            tokens_left -= len(ctx)
            budget = self._prefill(req, budget, out)

    def _allocate(self, req: Request, ctx: list[int]) -> bool:
        """Blocks for the request's context: cached prefix blocks, new ones for the rest. False (and
        nothing taken) when the free blocks do not suffice."""
        kv = self.kv
        # a prompt whose logprobs are wanted is computed whole; at least one token is always computed
        reuse = kv.prefix_caching and req.prompt_logprobs is None
        salt = b"" if req.adapter < 0 else f"lora:{req.adapter}".encode()  # an adapter's KV is its own
        req.block_keys = block_keys(ctx, kv.block_size, salt=salt) if kv.prefix_caching else []
        hits = kv.lookup(req.block_keys[:(len(ctx) - 1) // kv.block_size]) if reuse else []
        new = kv.blocks_for(len(ctx)) - len(hits)
        idle = sum(kv.ref[b] == 0 for b in hits)  # cached blocks nobody holds: taking them uses free ones
        # beside running requests, keep room for each new sequence's first token and a watermark
        spare = req.n_seqs + self.watermark if self.running else 0
        if new + idle + spare > kv.free:
            return False
        kv.hold(hits)
        req.seqs = [Sequence(hits + kv.allocate(new), len(hits) * kv.block_size)]
        req.shared = 0
        req.cached_tokens = len(hits) * kv.block_size
        req.registered = len(hits)
        kv.count_lookup(len(ctx) if reuse else 0, req.cached_tokens)
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = WAITING
        req.preemptions += 1
        req.next_tokens = []  # computed again from its context
        req.beam = None  # beam search starts over
        self.waiting.appendleft(req)
        self.preemptions += 1
        out.preempted.append(req)

    def _release(self, req: Request) -> None:
        for seq in req.seqs:
            self.kv.release(seq.blocks)
        req.seqs = []


def context(req: Request) -> list[int]:
    """The tokens whose keys and values a request needs stored before it decodes: its prompt, and
    for a greedy or sampled request computed again after preemption, its output so far."""
    return req.prompt if req.n_seqs > 1 or not req.output else req.prompt + req.output


def prefilled(req: Request) -> bool:
    """Whether a request decodes: its context is stored and its next token chosen."""
    return bool(req.seqs) and bool(req.next_tokens)
