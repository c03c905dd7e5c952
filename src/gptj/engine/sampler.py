"""The sampler: every request's next token(s) of a step, chosen on the device in a few batched ops,
then one device-to-host copy of the whole step's choices.

    greedy    one argmax over the rows of every greedy request (min_new_tokens: EOS masked per row,
              HF's MinNewTokensLengthLogitsProcessor; then the logit bias and the repetition,
              frequency and presence penalties of the rows that have them, as vLLM orders them)
    sampled   the same masks, bias and penalties, then HF's warpers (each row's temperature, top_k, top_p) over all sampled rows at once,
              then one multinomial draw per request from its own generator (so a seed's tokens do
              not depend on what shares the step)
    beams     gptj.beam.BeamSearch.step_all: the requests of one GenerationConfig (MLPerf's: all)
              stacked and advanced in one batched pass, each at its own step; device ops only, each
              search's `done` flag a device tensor read with the rest
    drafts    a greedy speculating request's rows (its next token's and its draft's) each take their
              argmax in the same copy (`verified`); a sampled one's draws are `verify`'s

The tokens are exactly those of gptj.decode.greedy_or_sample and beam_search (the same ops on the
same rows). The step's logits come as the runner's one tensor and a map of each request's rows in
it: each kind's rows are read as a view where they lie in order (most steps), else gathered once.
`choose` returns plain data (`Choice` per request) that engine/update.py applies.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from gptj import native, policy
from gptj.beam import BeamSearch, stacked_rows
from gptj.decode import penalize, penalty_args
from gptj.device import to_device
from gptj.engine.config import StepTimes
from gptj.engine.request import Request


@dataclass
class Choice:
    """A request's choice in one step: the next token of each of its sequences; beams: which beam
    each continues (`source`), and whether the search is over (`done`). `error`: the request's
    numbers went non-finite this step, so it has no next token (it fails alone)."""

    tokens: list[int]
    source: list[int] | None = None
    done: bool = False
    error: str | None = None
    ok: list[bool] | None = None  # a verified draft's rows (choose's `verified`): each one's numbers finite


# Why a request fails when its numbers are not finite (a checkpoint whose weights overflow on some
# inputs, an adapter gone bad): said once, for the request's error and the server's 500.
NOT_FINITE = {
    "greedy": "the model's logits are not finite (NaN or infinity) at this token",
    "sampled": "the sampling probabilities are not finite (NaN or infinity in the logits, or after the temperature)",
    "beams": "the beam scores are not finite (NaN or infinity in the model's logits)",
}


@torch.inference_mode()  # the runner's logits are inference tensors, and the beams' pass writes over them
def choose(logits: torch.Tensor | None, rows: Mapping[Request, range],
           times: StepTimes | None = None, verified: Mapping[Request, range] | None = None) -> dict[Request, Choice]:
    """logits (R, V) float32, the step's; rows: which of them are each request's (its sequences', in
    order; a beam request's first token: one row, its prompt's last, for all its beams) -> each
    request's Choice. A beam request's `beam` (a BeamSearch) is advanced; nothing else of a request
    is changed. `times.wait` gets the time of the step's device-to-host copy (where the host waits
    for the device's work).

    A request whose numbers are not finite gets a Choice with `error` set and no meaningful token;
    the others' tokens are those they would have had without it (rows are never mixed). The checks
    are device ops read with the step's one copy: a greedy row's chosen logit (torch's argmax picks
    NaN and +inf first, so a finite maximum means a usable row), a sampled row's probability sum,
    a beam search's best candidate score.

    `verified`: greedy speculating requests' rows (engine/scheduler.Verify: the next token's, then the
    draft's), each row's argmax as `verify` chooses it, in the same copy: their Choice holds a token
    a row and `ok`, whether each row's numbers are finite."""
    greedy = [req for req in rows if req.beam is None and not req.gen.sampling]
    sampled = [req for req in rows if req.beam is None and req.gen.sampling]
    by_config: dict = {}  # beam requests of one GenerationConfig advance together, in one batched pass
    for req in rows:
        if req.beam is not None:
            by_config.setdefault(req.gen, []).append(req)
    beams = [req for group in by_config.values() for req in group]  # in the order their results come
    parts: list[torch.Tensor] = []
    finite: list[torch.Tensor] = []  # per request, greedy then sampled then beams: its numbers are finite
    if greedy:
        tokens, ok = _argmax(logits, greedy, [rows[req].start for req in greedy])
        parts.append(tokens)
        finite.append(ok)
    if sampled:
        probs = _warped_probs(logits, sampled, [rows[req].start for req in sampled])  # (S, V): every sampled row
        total = probs.sum(dim=-1)
        ok = torch.isfinite(total) & (total > 0)
        # a row that is no distribution draws from a uniform one instead (its request fails; a draw
        # from it would raise and take the step down with it)
        probs = probs.masked_fill(~ok[:, None], 1.0)
        finite.append(ok)
        for i, req in enumerate(sampled):  # one draw each, from the request's own generator
            parts.append(torch.multinomial(probs[i:i + 1], num_samples=1, generator=req.generator)[0])
    if verified:  # (after the one-token kinds: their rows, then the beams', are read from `flat` in order)
        drafted_tokens, drafted_ok = _argmax_rows(_verify_scores(logits, verified)[0])
    dones = []
    for group in by_config.values():  # each group's results flat: sources, tokens (K a request each), dones
        K = group[0].gen.num_beams
        index = [i for req in group for i in (rows[req] if len(rows[req]) == K else [rows[req].start] * K)]
        sources, tokens, done, ok = BeamSearch.advance([req.beam for req in group], [rows_of(logits, index)],
                                                       reuse_logits=True)  # (update.py reads no beam request's)
        parts.append(torch.stack([sources.view(-1, K), tokens.view(-1, K)], dim=1).view(-1))
        dones.append(done)
        finite.append(ok)
    drafted = [drafted_tokens, drafted_ok] if verified else []
    if not parts and not drafted:
        return {}
    flat = torch.cat([p.long() for p in parts + drafted + dones + finite])
    t0 = time.perf_counter()
    flat = flat.tolist()  # the step's one device-to-host copy
    if times is not None:
        times.wait += time.perf_counter() - t0
    requests = greedy + sampled + beams
    finite_at = len(flat) - len(requests)
    errors = {req: None if flat[finite_at + i] else NOT_FINITE[kind]
              for i, (req, kind) in enumerate(zip(requests, ["greedy"] * len(greedy) + ["sampled"] * len(sampled)
                                                  + ["beams"] * len(beams)))}
    out, at = {}, 0
    for req in greedy + sampled:
        out[req] = Choice([flat[at]], error=errors[req])
        at += 1
    done_at = finite_at - len(beams)
    for i, req in enumerate(beams):
        K = req.n_seqs
        out[req] = Choice(flat[at + K:at + 2 * K], flat[at:at + K], bool(flat[done_at + i]), errors[req])
        at += 2 * K
    n = sum(len(r) for r in (verified or {}).values())
    for req, r in (verified or {}).items():
        out[req] = Choice(flat[at:at + len(r)], ok=[bool(x) for x in flat[at + n:at + n + len(r)]])
        at += len(r)
    return out


def rows_of(logits: torch.Tensor, index: Sequence[int]) -> torch.Tensor:
    """logits' rows `index` (len(index), V): a view where they are consecutive and in order (the
    rows of one kind in most steps: no copy of a large step's logits), else a copy (gathered)."""
    first = index[0]
    if index[-1] - first == len(index) - 1 and list(index) == list(range(first, first + len(index))):
        return logits[first:first + len(index)]
    return logits.index_select(0, to_device(torch.tensor(index, dtype=torch.long), logits.device))


def _stacked(logits: torch.Tensor, reqs: Sequence[Request], index: Sequence[int]) -> torch.Tensor:
    """The requests' rows `index` of logits (R, V), EOS -inf on the rows still short of
    min_new_tokens (gptj.decode.block_eos, row by row; then a copy, else possibly a view of the
    runner's logits), then the logit bias and penalties of the rows that have any (`_penalized`)."""
    blocked = [(r, eos) for r, req in enumerate(reqs) if len(req.output) < req.gen.min_new_tokens
               for eos in req.gen.eos_ids]
    if not blocked:  # read only: a view where the rows lie in order (one forward's), as most steps'
        return _penalized(reqs, rows_of(logits, index))
    scores = logits.index_select(0, to_device(torch.tensor(index, dtype=torch.long), logits.device))
    r, eos = zip(*blocked)
    scores[list(r), list(eos)] = -math.inf
    return _penalized(reqs, scores)


def _penalized(reqs: Sequence[Request], scores: torch.Tensor) -> torch.Tensor:
    """scores (R, V) with each request's logit bias and penalties applied (gptj.decode.penalize, in
    vLLM's order, as greedy_or_sample applies them): the rows of the requests that have any, at once;
    a new tensor (scores may be the runner's logits, which log-probabilities read later). A step where
    no request has any returns scores as they are: no extra pass."""
    at = [r for r, req in enumerate(reqs) if req.gen.penalized]
    if not at:
        return scores
    penalized = [reqs[r] for r in at]
    gens = [req.gen for req in penalized]
    tokens, counts = _token_state(penalized, scores.device, scores.shape[-1]) if any(g.penalties for g in gens) \
        else (None, None)
    if len(at) == len(reqs):
        return penalize(scores, **penalty_args(gens, scores.device, tokens, counts))
    idx = to_device(torch.tensor(at, dtype=torch.long), scores.device)
    part = penalize(scores[idx], **penalty_args(gens, scores.device, tokens, counts))
    return scores.index_copy(0, idx, part)


def _token_state(reqs: Sequence[Request], device: torch.device, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The requests' token state, stacked and brought up to date with the tokens appended since the
    last step (`Request.counted`: usually one each), in one write per tensor:

      tokens  (P, S) long: each request's prompt and output tokens so far, S the longest (a shorter
              row goes on with its first token: its own, so the penalties' writes repeat a value)
      counts  (P, V) float32: each token's count in the request's output

    Kept on the device, each request's rows a view of one stacked tensor (`Request.tokens_state`:
    room for its prompt and max_new_tokens, first token beyond what is written): a step with the same
    requests in the same order as the last one writes in place; when they change, the stack is copied
    once and each request takes its row of the copy. A request's state starts at its first penalized
    step (its prompt written once). No host read."""
    rows, cols, new_tokens = [], [], []
    for i, req in enumerate(reqs):
        if req.counts is None:
            prompt = to_device(torch.tensor(req.prompt, dtype=torch.long), device)
            req.tokens_state = torch.cat([prompt, prompt[:1].expand(req.gen.max_new_tokens)])
            req.counts = torch.zeros(V, dtype=torch.float32, device=device)
            req.counted = 0
        new = req.output[req.counted:]
        rows += [i] * len(new)
        cols += range(len(req.prompt) + req.counted, len(req.prompt) + req.counted + len(new))
        new_tokens += new
        req.counted = len(req.output)
    counts = stacked_rows([req.counts[None] for req in reqs])
    if counts.data_ptr() != reqs[0].counts.data_ptr():  # a copy: each request takes its row of it
        for i, req in enumerate(reqs):
            req.counts = counts[i]
    width = max(len(req.prompt) + req.gen.max_new_tokens for req in reqs)
    if all(req.tokens_state.shape[0] == width for req in reqs):
        tokens = stacked_rows([req.tokens_state[None] for req in reqs])  # a view when in order, in one stack
    else:  # rows of different lengths: each row's own, then its first token (when the requests change)
        tokens = torch.empty((len(reqs), width), dtype=torch.long, device=device)
        for i, req in enumerate(reqs):
            n = min(req.tokens_state.shape[0], width)
            tokens[i, :n] = req.tokens_state[:n]
            tokens[i, n:] = req.tokens_state[0]
    if tokens.data_ptr() != reqs[0].tokens_state.data_ptr():  # a copy: each request takes its row of it
        for i, req in enumerate(reqs):
            req.tokens_state = tokens[i]
    if new_tokens:
        at, new, col = to_device(torch.tensor([rows, new_tokens, cols], dtype=torch.long), device)  # one copy
        counts.index_put_((at, new), torch.ones(len(new_tokens), dtype=torch.float32, device=device), accumulate=True)
        tokens.index_put_((at, col), new)
    longest = max(len(req.prompt) + len(req.output) for req in reqs)
    return tokens[:, :longest], counts


def _argmax(logits: torch.Tensor, reqs: Sequence[Request], index: Sequence[int]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy requests' next tokens (R,), from their rows `index` of logits: the first index of
    each row's largest logit (as torch.argmax, ties and NaN alike): gptj.native's on a CPU
    (policy.argmax_path), else torch.max's indices (faster than torch.argmax on CPU:
    docs/PERFORMANCE.md); and whether each row's chosen logit is finite (R,) bool (NaN and +inf are
    chosen first; all -inf leaves -inf)."""
    return _argmax_rows(_stacked(logits, reqs, index))


def _argmax_rows(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (_argmax's) and whether its chosen score is finite."""
    if scores.dtype is torch.float32 and scores.stride(-1) == 1 and policy.argmax_path(scores.device) == "native":
        tokens = native.argmax_rows(scores)
    else:
        tokens = scores.max(dim=-1).indices
    return tokens, torch.isfinite(scores.gather(1, tokens[:, None].long())[:, 0])


@torch.inference_mode()
def verify(logits: torch.Tensor | None, rows: Mapping[Request, range], drafts: Mapping[Request, list[int]]
           ) -> dict[Request, tuple[list[int], list[bool]]]:
    """Sampled speculating requests (a next token and its draft each, engine/scheduler.Verify; a greedy
    one's rows are chosen in `choose`'s copy, its `verified`): the token at each of a request's rows
    and whether its numbers are finite, chosen as `choose` chooses a token there (row i as the
    request's (len(output) + i)-th new token: EOS masked below min_new_tokens): the rows' warped
    probabilities at once, then one draw a row from the request's generator, in order, stopping
    after the first token that is not the draft's: so the generator gives exactly the draws it gives
    without speculation (a seeded request's tokens are the same), and a drafted token is taken with
    its probability, else the token drawn is one of the rest with their renormalized probabilities
    (the standard rejection rule for a draft that is one token for sure)."""
    out: dict[Request, tuple[list[int], list[bool]]] = {}
    sampled = rows  # (the greedy ones' rows ride in choose's copy: engine/update.py splits them)
    if sampled:
        scores, index = _verify_scores(logits, sampled)
        probs = _warp(scores, [req.gen for req, r in sampled.items() for _ in r])
        total = probs.sum(dim=-1)
        usable = (torch.isfinite(total) & (total > 0)).tolist()
        at = 0
        for req, r in sampled.items():
            tokens, ok = [], []
            for i in range(len(r)):
                if not usable[at + i]:
                    tokens.append(0)
                    ok.append(False)
                    break
                tokens.append(int(torch.multinomial(probs[at + i:at + i + 1], num_samples=1,
                                                    generator=req.generator)[0]))
                ok.append(True)
                if i == len(drafts[req]) or tokens[-1] != drafts[req][i]:
                    break
            out[req] = (tokens, ok)
            at += len(r)
    return out


def _verify_scores(logits: torch.Tensor, rows: Mapping[Request, range]) -> tuple[torch.Tensor, list[int]]:
    """The requests' rows of logits, EOS -inf on each row still short of min_new_tokens, and their index."""
    index: list[int] = []
    blocked: list[tuple[int, int]] = []
    for req, r in rows.items():
        short = max(0, req.gen.min_new_tokens - len(req.output))  # its first rows may not end it
        blocked += [(len(index) + i, eos) for i in range(min(short, len(r))) for eos in req.gen.eos_ids]
        index += r
    scores = rows_of(logits, index)
    if blocked:
        scores = scores.clone()
        at, eos = zip(*blocked)
        scores[list(at), list(eos)] = -math.inf
    return scores, index


def _warped_probs(logits: torch.Tensor, reqs: Sequence[Request], index: Sequence[int]) -> torch.Tensor:
    """The sampled requests' probabilities (S, V), from their rows `index` of logits: gptj.decode.warp's
    temperature -> top_k -> top_p (HF's order), each with the row's own setting, applied to all rows
    at once; a row's values are those warp gives it alone (the same per-row ops; scalars rounded to
    float32 as torch rounds a Python scalar)."""
    return _warp(_stacked(logits, reqs, index), [req.gen for req in reqs])


def _warp(scores: torch.Tensor, gens: Sequence) -> torch.Tensor:
    """Rows of scores -> probabilities, each row warped by its GenerationConfig (_warped_probs)."""
    dev, V = scores.device, scores.shape[-1]

    def column(values: list[float]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.float32), dev)[:, None]

    if any(g.temperature != 1.0 for g in gens):
        scores = scores / column([g.temperature for g in gens])  # (x / 1.0 is x)
    with_k = [r for r, g in enumerate(gens) if g.top_k]
    if with_k:  # top_k_filter: -inf below each row's k-th largest score (ties with it kept)
        ks = [min(gens[r].top_k, V) for r in with_k]
        idx, k = to_device(torch.tensor([with_k, ks], dtype=torch.long), dev)  # one copy
        part = scores[idx]
        top = torch.topk(part, max(ks), dim=-1).values
        kth = top.gather(1, k[:, None] - 1)
        scores = scores.index_copy(0, idx, part.masked_fill(part < kth, -math.inf))
    with_p = [r for r, g in enumerate(gens) if g.top_p < 1.0]
    if with_p:  # top_p_filter: the smallest set of top tokens reaching p (sorted ascending, cumulative)
        idx = to_device(torch.tensor(with_p, dtype=torch.long), dev)
        part = scores[idx]
        sorted_scores, order = torch.sort(part, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= column([1 - gens[r].top_p for r in with_p])
        drop_sorted[..., -1:] = False
        drop = drop_sorted.scatter(1, order, drop_sorted)
        scores = scores.index_copy(0, idx, part.masked_fill(drop, -math.inf))
    return torch.softmax(scores, dim=-1)

