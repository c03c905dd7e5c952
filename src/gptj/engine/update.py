"""After the forward: store what was computed, choose each request's next token(s), retire the done.

The tokens are engine/sampler.py's choice (greedy and sampled requests as
gptj.decode.greedy_or_sample, beam-search requests by gptj.beam.BeamSearch), made for the whole
step at once. Its beams start as one
sequence (the prompt); at its first token the prompt's blocks are shared by all of them (held once
per beam), and after each step every beam takes the block table of the beam it continues (its
blocks held again, the old ones released) — the blocks are shared, not copied, until one is written
(the scheduler's copy-on-write); the engine's InputBatch reorders the beams' rows alike.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import torch

from gptj.beam import BeamSearch
from gptj.device import to_device
from gptj.engine.config import StepTimes
from gptj.engine.input_batch import InputBatch
from gptj.engine.kv import KVCacheManager
from gptj.engine.request import FAILED, FINISHED, Request, Sequence, Status, TokenLogprob
from gptj.engine.runner import RunnerOutput
from gptj.engine.sampler import NOT_FINITE, Choice, choose, verify
from gptj.engine.scheduler import Scheduler, SchedulerOutput


def token_logprobs(logits: torch.Tensor, tokens: Seq[int], k: int) -> list[TokenLogprob]:
    """logits (N, V) of N positions and the token chosen at each -> their log-probabilities."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    index = to_device(torch.tensor(tokens), lp.device)
    chosen = lp.gather(1, index[:, None])[:, 0].tolist()
    if k > 0:
        values, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(int(t), c, top) for t, c, top in zip(tokens, chosen, tops)]


class Updater:
    def __init__(self, kv: KVCacheManager, scheduler: Scheduler, batch: InputBatch, requests: dict[str, Request],
                 device: torch.device, times: StepTimes | None = None) -> None:
        self.kv, self.scheduler, self.batch, self.requests, self.device = kv, scheduler, batch, requests, device
        self.times = times if times is not None else StepTimes()  # the sampler adds its wait here
        self.prefill_tokens = 0
        self.drafted = self.accepted = 0  # speculation: draft tokens verified, and those taken

    def apply(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Apply one step's results; return the requests it finished."""
        finished: list[Request] = []
        for req, message in result.errors.items():
            if not req.done:
                req.error = message
                self.retire(req, FAILED, "error")
                finished.append(req)
        for chunk in sched.prefill:
            if not chunk.request.done:
                self._stored(chunk.request, chunk.start, chunk.end, result.prompt_logits.get(chunk.request))
        for req in sched.decode:
            if not req.done:
                for seq in req.seqs:
                    seq.length += 1
        drafts = {v.request: v.draft for v in sched.verify if not v.request.done}
        rows = {req: r for req, r in result.rows.items() if not req.done and req not in drafts}
        for req in rows:
            self._prepare(req)
        greedy = {req: result.rows[req] for req in drafts if not req.gen.sampling}  # their rows ride along
        # every request's next token(s), and each greedy draft row's: batched, one device-to-host copy
        choices = choose(result.logits, rows, self.times, verified=greedy)
        for req, r in rows.items():
            self._next(req, result.logits, r.start, choices[req])
            if req.done:
                finished.append(req)
        sampled = {req: result.rows[req] for req in drafts if req.gen.sampling}
        verified = {req: (choices[req].tokens, choices[req].ok) for req in greedy}
        verified.update(verify(result.logits, sampled, drafts))
        for req, (tokens, ok) in verified.items():
            self._accept(req, drafts[req], tokens, ok, result.logits, result.rows[req].start)
            if req.done:
                finished.append(req)
        return finished

    def _stored(self, req: Request, start: int, end: int, prompt_logits: torch.Tensor | None) -> None:
        """A prefill chunk's keys and values are in its blocks: count them, cache full prompt blocks."""
        self.prefill_tokens += end - start
        seq = req.seqs[0]
        seq.length = end
        full = min(end // self.kv.block_size, len(req.block_keys))
        for i in range(req.registered, full):
            self.kv.register(seq.blocks[i], req.block_keys[i])
        req.registered = max(req.registered, full)
        if prompt_logits is not None:  # position t predicts token t + 1; the first token has none
            targets = req.prompt[start + 1:end + 1]
            req.prompt_token_logprobs = ([None] if start == 0 else req.prompt_token_logprobs) + token_logprobs(
                prompt_logits[:len(targets)], targets, req.prompt_logprobs)

    def _prepare(self, req: Request) -> None:
        """A beam request's first token: its beams start from the prompt, which they share (its one
        row of logits is every beam's)."""
        if req.gen.num_beams > 1 and req.beam is None:
            req.beam = BeamSearch(1, req.gen, self.device)
            self._fork(req)

    def _next(self, req: Request, logits: torch.Tensor, row: int, choice: Choice) -> None:
        """Apply the sampler's choice of this step (logits: the step's, the request's at `row`, for
        log-probabilities); retire the request when it is done."""
        gen = req.gen
        if choice.error is not None:  # its numbers went non-finite: it fails alone, the step goes on
            req.error = choice.error
            self.retire(req, FAILED, "error")
            return
        if req.beam is not None:
            if choice.done:
                req.hypotheses = req.beam.ranked(0)
                req.output, req.score = req.hypotheses[0]
                self.retire(req, FINISHED, "stop" if req.output[-1:] and req.output[-1] in gen.eos_ids else "length")
                return
            self._reorder(req, choice.source)
            req.next_tokens = choice.tokens
            return
        (token,) = choice.tokens
        if self._emit(req, token, logits, row):
            req.next_tokens = [token]

    def _emit(self, req: Request, token: int, logits: torch.Tensor, row: int) -> bool:
        """A greedy or sampled request's new token (its logits at `row`); retire it when it is done.
        True while it goes on."""
        req.output.append(token)
        if req.logprobs is not None:
            req.token_logprobs += token_logprobs(logits[row:row + 1], [token], req.logprobs)
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        if req.on_token is not None:
            req.on_token(req, token)
        if token in req.gen.eos_ids:
            self.retire(req, FINISHED, "stop")
        elif len(req.output) >= req.gen.max_new_tokens:
            self.retire(req, FINISHED, "length")
        else:
            return True
        return False

    def _accept(self, req: Request, draft: list[int], tokens: list[int], ok: list[bool], logits: torch.Tensor,
                row: int) -> None:
        """A verified draft: the token chosen at each of its rows (`tokens`, the first row the request's
        next token's; engine/sampler.verify), taken while they equal the draft, then the one chosen
        where they differ; so the tokens are those decoding one at a time gives. The accepted drafts' keys and values are
        stored (the sequence's length moves past them); the rejected ones' slots lie past it, never
        read, and written over by the tokens that follow (blocks only they reached are released)."""
        seq = req.seqs[0]
        stored = seq.length + 1  # the next token's; each accepted draft token one more
        self.drafted += len(draft)
        back_off(req, draft, tokens)
        for i, token in enumerate(tokens):
            if not ok[i]:  # its numbers went non-finite: it fails here, as a step of its own would
                req.error = NOT_FINITE["sampled" if req.gen.sampling else "greedy"]
                self.retire(req, FAILED, "error")
                return
            taken = i < len(draft) and token == draft[i]
            self.accepted += taken
            if not self._emit(req, token, logits, row + i):
                return
            if not taken:
                break
            stored += 1
        seq.length = stored
        req.next_tokens = [token]
        keep = self.kv.blocks_for(stored)
        self.kv.release(seq.blocks[keep:])
        del seq.blocks[keep:]

    def _fork(self, req: Request) -> None:
        (prompt,) = req.seqs
        for _ in range(req.n_seqs - 1):
            self.kv.hold(prompt.blocks)
        req.seqs = [prompt] + [Sequence(list(prompt.blocks), prompt.length) for _ in range(req.n_seqs - 1)]
        req.shared = prompt.length // self.kv.block_size  # full prompt blocks: read once for all beams

    def _reorder(self, req: Request, source: list[int]) -> None:
        """Beam k continues beam source[k]: it takes that beam's block table. The prompt's full blocks
        (the first req.shared) are every beam's, held once per beam before and after: only the
        blocks after them change holders (a beam request's prompt can be 60 blocks, its own 1 to 8)."""
        if source == list(range(req.n_seqs)):
            return
        old, s = req.seqs, req.shared
        req.seqs = [Sequence(list(old[k].blocks), old[k].length) for k in source]
        for seq in req.seqs:
            self.kv.hold(seq.blocks[s:])
        for seq in old:
            self.kv.release(seq.blocks[s:])
        self.batch.reorder(req, source)

    def retire(self, req: Request, status: Status, reason: str) -> None:
        self.scheduler.remove(req)
        req.status, req.finish_reason = status, reason
        req.counts = req.tokens_state = None  # (views of the step's stacked token state: let it go)
        req.finish_time = time.perf_counter()
        self.requests.pop(req.request_id, None)
        if req.on_finish is not None:
            req.on_finish(req)


DRAFT_WAIT = 8  # steps without drafts after a one-token draft was rejected


def back_off(req: Request, draft: list[int], tokens: list[int]) -> None:
    """The next draft's length after this one (HF assisted generation's rule, plus a pause): two more
    tokens (up to the request's setting) when all were taken, half as many when none was, and after
    a rejected one-token draft DRAFT_WAIT steps without drafts, then one token. Drafts that keep
    failing (a model that does not copy its input) then cost a few rows every DRAFT_WAIT steps."""
    taken = next((i for i, (d, t) in enumerate(zip(draft, tokens)) if d != t), len(draft))
    limit = req.gen.prompt_lookup_num_tokens
    if taken == len(draft):
        req.draft_len = min(limit, len(draft) + 2)
    elif taken == 0:
        req.draft_len = len(draft) // 2 or 1
        if len(draft) == 1:
            req.draft_wait = DRAFT_WAIT
