"""The sampler: every request's next token(s) of a step, chosen on the device in a few batched ops,
then one device-to-host copy of the whole step's choices.

    greedy    one argmax over the rows of every greedy request (min_new_tokens: EOS masked per row,
              HF's MinNewTokensLengthLogitsProcessor)
    sampled   HF's warpers and one multinomial draw per request, from its own generator (so a
              seed's tokens do not depend on what shares the step)
    beams     gptj.decode.BeamSearch.step_all: the requests of one GenerationConfig (MLPerf's: all)
              stacked and advanced in one batched pass, each at its own step; device ops only, each
              search's `done` flag a device tensor read with the rest

The tokens are exactly those of gptj.decode.greedy_or_sample and beam_search (the same ops on the
same rows). `choose` returns plain data (`Choice` per request) that engine/update.py applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gptj.decode import BeamSearch, block_eos, warp
from gptj.engine.request import Request


@dataclass
class Choice:
    """A request's choice in one step: the next token of each of its sequences; beams: which beam
    each continues (`source`), and whether the search is over (`done`)."""

    tokens: list[int]
    source: list[int] | None = None
    done: bool = False


def choose(items: Sequence[tuple[Request, torch.Tensor]]) -> dict[Request, Choice]:
    """items: (request, its logits (n_seqs, V) float32) -> each request's Choice. A beam request's
    `beam` (a BeamSearch) is advanced; nothing else of a request is changed."""
    greedy = [(req, logits) for req, logits in items if req.beam is None and not req.gen.sampling]
    sampled = [(req, logits) for req, logits in items if req.beam is None and req.gen.sampling]
    beams = [(req, logits) for req, logits in items if req.beam is not None]
    parts: list[torch.Tensor] = []
    if greedy:
        parts.append(_argmax(greedy))
    for req, logits in sampled:  # one draw each, from the request's own generator
        probs = torch.softmax(warp(block_eos(logits, len(req.output), req.gen), req.gen), dim=-1)
        parts.append(torch.multinomial(probs, num_samples=1, generator=req.generator)[0])
    by_config: dict = {}  # beam requests of one GenerationConfig advance together, in one batched pass
    for req, logits in beams:
        by_config.setdefault(req.gen, []).append((req, logits))
    stepped = {}
    for group in by_config.values():
        results = BeamSearch.step_all([req.beam for req, _ in group], [logits for _, logits in group])
        stepped.update((req, result) for (req, _), result in zip(group, results))
    for req, _ in beams:
        source, tokens = stepped[req]
        parts += [source, tokens, req.beam.done_now.long()[None]]
    if not parts:
        return {}
    flat = torch.cat([p.long() for p in parts]).tolist()  # the step's one device-to-host copy
    out, at = {}, 0
    for req, _ in greedy + sampled:
        out[req] = Choice([flat[at]])
        at += 1
    for req, _ in beams:
        K = req.n_seqs
        out[req] = Choice(flat[at + K:at + 2 * K], flat[at:at + K], bool(flat[at + 2 * K]))
        at += 2 * K + 1
    return out


def _argmax(rows: Sequence[tuple[Request, torch.Tensor]]) -> torch.Tensor:
    """The greedy requests' next tokens (R,): argmax of their logits stacked, EOS masked on the
    rows still short of min_new_tokens."""
    scores = torch.cat([logits[:1] for _, logits in rows])  # (R, V), a copy: masked in place
    blocked = [(r, req.gen.eos_token_id) for r, (req, _) in enumerate(rows)
               if req.gen.eos_token_id is not None and len(req.output) < req.gen.min_new_tokens]
    if blocked:
        r, eos = zip(*blocked)
        scores[list(r), list(eos)] = -float("inf")
    return torch.argmax(scores, dim=-1)

