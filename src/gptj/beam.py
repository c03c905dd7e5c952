"""Beam search's state machine, HF's semantics, one token a step, for any number of searches at once:
`BeamSearch` is one request's (or `gptj.decode.beam_search`'s batch of prompts') beams, and
`BeamSearch.advance` steps a batch of them in one pass (the engine's step: every beam request of
one GenerationConfig together). Between steps the searches' state stays stacked (`_Stack`), each
search reading its rows of it through the `_State` fields.

Shapes: B prompts (of a search, or of a batch of searches), K beams, V vocabulary, L = max_new_tokens.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gptj.device import to_device
from gptj.generation_config import GenerationConfig

# HF marks impossible beams with this score instead of -inf, so sums stay finite.
_NEG = -1.0e9


class _State:
    """A state tensor of a BeamSearch (one row per prompt): the search's own until its first step,
    then its rows of the stack that step left (`_Stack`)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, search: BeamSearch | None, owner: type | None = None) -> torch.Tensor:
        if search is None:
            return self  # type: ignore[return-value] - the class attribute itself
        if search._stack is None:
            return search._own[self.name]
        return search._stack.state[self.name][search._at:search._at + search.B]


class BeamSearch:
    """Beam search state of B prompts x K beams, advanced one token per `step` (HF semantics).

    The caller runs the model: it feeds the logits of the K running beams of every prompt (row
    b * K + k), and gets back which row each new running beam continues (reorder the KV cache
    accordingly) and its new token. Used by `beam_search` above and by the engine, so both follow
    exactly the same rule.

    Per step and prompt, HF's semantics:
      1. log_softmax the logits of each running beam, THEN apply min_new_tokens (EOS -> -inf; the
         other tokens are not renormalized), add the beam's running score.
      2. Take the top 2K candidates over all K beams x V tokens (sorted, best first).
      3. A candidate "ends" if its token is EOS or it reaches max_new_tokens. Ending candidates
         among the top K (by rank among the 2K, not by beam) become finished hypotheses, scored
         with the length penalty where the length counts the new tokens including EOS, unless
         the prompt is already done (see 5). Finished hypotheses keep the best K.
      4. The K best non-ending candidates are the next running beams.
      5. A prompt is done when early_stopping is True and it has K finished hypotheses, or when
         it has K and HF's heuristic says no running beam can beat the worst of them:
         best running score / n ** length_penalty <= worst finished score, where n is the new
         length so far (max_new_tokens with early_stopping="never" and length_penalty > 0).
      Decoding stops when every prompt is done or at max_new_tokens, when the top K candidates
      all end and so become hypotheses.
    """

    # The state's tensors, each with a row per prompt: a search's own (after __init__), or its rows of
    # the stack that the last step left for all the searches it advanced (see `_Stack`).
    STATE = ("run_tokens", "run_scores", "fin_tokens", "fin_scores", "fin_lens", "fin_valid", "improvable")
    run_tokens = _State()  # (B, K, L) the running beams' new tokens
    run_scores = _State()  # (B, K) their sums of log-probabilities
    fin_tokens = _State()  # (B, K, L) finished hypotheses, best first
    fin_scores = _State()  # (B, K) their length-penalized scores (-inf: an empty slot)
    fin_lens = _State()  # (B, K) their new tokens, EOS included
    fin_valid = _State()  # (B, K) False: an empty slot
    improvable = _State()  # (B,) HF's is_early_stop_heuristic_unsatisfied

    def __init__(self, batch_size: int, gen: GenerationConfig, device: torch.device | str) -> None:
        B, K, L = batch_size, gen.num_beams, gen.max_new_tokens
        self.gen, self.B, self.K, self.L = gen, B, K, L
        self.n_steps = 0
        dev = device
        self._stack: _Stack | None = None
        self._at = 0  # with a stack: this search's first row there
        self._index = 0  # and its place among the stack's searches (its done flag's)
        self._done_now = torch.zeros((), dtype=torch.bool, device=dev)  # every prompt done (on the device)
        own = self._own = {}
        # Running beams. All K start as the prompt; only beam 0 is live at first (the others score
        # -1e9) so the first step does not pick the same token K times.
        own["run_tokens"] = torch.full((B, K, L), gen.pad_token_id, dtype=torch.long, device=dev)
        own["run_scores"] = torch.zeros((B, K), dtype=torch.float32, device=dev)
        own["run_scores"][:, 1:] = _NEG
        # Finished hypotheses, best first; `fin_valid` False marks an empty slot (score -inf).
        own["fin_tokens"] = torch.full((B, K, L), gen.pad_token_id, dtype=torch.long, device=dev)
        own["fin_scores"] = torch.full((B, K), -math.inf, dtype=torch.float32, device=dev)
        own["fin_lens"] = torch.zeros((B, K), dtype=torch.long, device=dev)
        own["fin_valid"] = torch.zeros((B, K), dtype=torch.bool, device=dev)
        own["improvable"] = torch.ones(B, dtype=torch.bool, device=dev)  # HF: is_early_stop_heuristic_unsatisfied
        self.beam_offset = torch.arange(B, device=dev)[:, None] * K  # (B, 1): row of beam 0 of each prompt

    @property
    def done_now(self) -> torch.Tensor:
        """Every prompt of this search is done: a device tensor (reading it syncs)."""
        return self._done_now if self._stack is None else self._stack.done[self._index]

    def step(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits (B*K, V) of the running beams -> (source_rows (B*K,), next_tokens (B*K,))."""
        return BeamSearch.step_all([self], [logits])[0]

    @staticmethod
    def step_all(searches: Sequence[BeamSearch], logits: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Advance searches of one GenerationConfig by a token each, in one batched pass: their
        prompts stacked as rows, each row at its own step (the engine's requests start at different
        times). logits[i]: search i's (B_i*K, V). -> each search's (source_rows, next_tokens), as
        `step`. No device-to-host sync: each search's `done_now` stays on the device."""
        source_rows, next_tokens, _, _ = BeamSearch.advance(searches, logits)
        out, at = [], 0
        for s in searches:
            n = s.B * s.K
            out.append((source_rows[at:at + n], next_tokens[at:at + n]))
            at += n
        return out

    @staticmethod
    def advance(searches: Sequence[BeamSearch], logits: Sequence[torch.Tensor], reuse_logits: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """step_all's pass, its results flat: (source_rows, next_tokens), each search's B*K in turn
        (source_rows within the search's own rows, as `step`), done (len(searches),) bool, each
        search's done_now, and finite (len(searches),) bool, False where a search's scores went NaN or
        infinite this step (its tokens are then meaningless): device tensors, for the engine's one
        copy to the host.

        The searches' state stays stacked between steps (`_Stack`): a step of the searches the last
        one advanced, in the same order, reads the stack as it is; others gather their rows (a few
        kernels whatever the number of searches, not a few per search).

        reuse_logits: the caller reads the logits no more (the engine's), so the log-probabilities
        may be written over them. Each full-vocabulary pass is one read and one write of (B*K, V)
        float32; a new such tensor costs the CPU its page faults too (103 MB at 512 rows)."""
        gen = searches[0].gen
        if any(s.gen != gen for s in searches):
            raise ValueError("BeamSearch.step_all advances searches of one GenerationConfig")
        state = _Stack.gather(searches)
        x = stacked_rows(logits)  # (B*K, V): a view of the caller's logits or a copy of them
        reuse_logits = reuse_logits or not any(x.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                                               for t in logits)
        rows = _Rows.of(searches, x.device)
        scores = _scores(x, state["run_scores"], rows, gen, reuse_logits)  # (B, K V)
        cand_scores, cand_beam, cand_tokens, ends = _candidates(scores, state["run_tokens"], rows, gen)
        state = _merge_finished(state, cand_scores, cand_tokens, ends, rows, gen)

        # Next running beams: the K best candidates that did not end (HF: ended ones get -1e9).
        K = gen.num_beams
        penalized = cand_scores + ends.float() * _NEG
        keep = torch.topk(penalized, K, dim=1).indices  # (B, K)
        state["run_scores"] = run_scores = torch.take_along_dim(penalized, keep, dim=1)
        state["run_tokens"] = run_tokens = torch.take_along_dim(cand_tokens, keep[:, :, None], dim=1)
        source = torch.take_along_dim(cand_beam, keep, dim=1)  # (B, K): the beam of its prompt it continues
        next_tokens = torch.take_along_dim(run_tokens, rows.at.expand(-1, K, 1), dim=2)[:, :, 0]  # (B, K)
        # Can a running beam still beat the worst finished hypothesis? (HF's heuristic; it only
        # matters once all K slots are full: before that, improvable stays True.)
        fin_valid, improvable = state["fin_valid"], state["improvable"]
        best_possible = run_scores[:, 0] / rows.best_norm  # (B,)
        worst_finished = state["fin_scores"].min(dim=1).values
        state["improvable"] = improvable = improvable & (~fin_valid.all(dim=1) | (best_possible > worst_finished))
        done = ~improvable | (fin_valid.all(dim=1) & (gen.early_stopping is True)) | rows.last  # (B,)
        # A row's numbers went non-finite (NaN or infinite logits make its log-probabilities NaN, and
        # topk ranks NaN first; all -inf leaves no candidate): its best candidate's score says so.
        finite = torch.isfinite(cand_scores[:, 0])  # (B,)
        source, done_each, finite_each = _restack(searches, state, source, done, finite, rows)
        return source.reshape(-1), next_tokens.reshape(-1), done_each, finite_each

    @property
    def finished(self) -> bool:
        """Every prompt is done (reads the device's flag: a sync; the engine reads done_now with the
        rest of its step instead)."""
        return self.n_steps == self.L or bool(self.done_now)

    def ranked(self, b: int) -> list[tuple[list[int], float]]:
        """Prompt b's finished hypotheses, best first: (new tokens, score) each."""
        valid, lens = self.fin_valid[b].tolist(), self.fin_lens[b].tolist()
        return [(row[:n], score) for row, n, score, ok in
                zip(self.fin_tokens[b].tolist(), lens, self.fin_scores[b].tolist(), valid) if ok]

    def best(self) -> tuple[list[list[int]], list[float]]:
        """The best finished hypothesis of each prompt: its new tokens and its score."""
        lens = self.fin_lens[:, 0].tolist()
        tokens = [row[:n] for row, n in zip(self.fin_tokens[:, 0].tolist(), lens)]
        return tokens, self.fin_scores[:, 0].tolist()


@dataclass
class _Rows:
    """A step's per-prompt values, made on the host and moved in a few small copies: each row's step
    (its new tokens so far) and what follows from it."""

    steps: list[int]  # each prompt row's new tokens before this step
    norm: torch.Tensor  # (B,) float32: (its new tokens, this one included) ** length_penalty
    best_norm: torch.Tensor  # (B,) the same for HF's best-possible score (max_new_tokens with "never")
    at: torch.Tensor  # (B, 1, 1) long: where this step's token goes in a row's tokens
    last: torch.Tensor  # (B,) bool: this step is the row's last (max_new_tokens)
    device: torch.device

    @staticmethod
    def of(searches: Sequence[BeamSearch], device: torch.device) -> _Rows:
        gen, L = searches[0].gen, searches[0].L
        steps = [s.n_steps for s in searches for _ in range(s.B)]
        n_new = [t + 1 for t in steps]  # new tokens of each candidate, this one included
        best_len = [L if gen.early_stopping == "never" and gen.length_penalty > 0.0 else n for n in n_new]
        # length ** penalty in double on the host, rounded to float32: as a Python scalar divides a tensor
        return _Rows(steps, _on(device, [n ** gen.length_penalty for n in n_new], torch.float32),
                     _on(device, [n ** gen.length_penalty for n in best_len], torch.float32),
                     _on(device, steps, torch.long)[:, None, None], _on(device, [n == L for n in n_new], torch.bool),
                     device)


def _on(device: torch.device, values: list, dtype: torch.dtype) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)


def _scores(x: torch.Tensor, run_scores: torch.Tensor, rows: _Rows, gen: GenerationConfig,
            reuse_logits: bool) -> torch.Tensor:
    """Each candidate's score (B, K V): log_softmax of its beam's logits x (B*K, V), min_new_tokens
    applied after it (HF: EOS -inf, no renormalizing), plus the beam's running score."""
    B, K = run_scores.shape
    V, eos = x.shape[-1], list(gen.eos_ids)
    if reuse_logits and x.is_contiguous() and not x.requires_grad:  # (a backward reads log_softmax's output)
        # the same kernel, its output over its input: each element written after its row's max and sum
        log_probs = torch.log_softmax(x, dim=-1, out=x)
    else:
        log_probs = F.log_softmax(x, dim=-1)  # (B*K, V)
    short = [beam for p, t in enumerate(rows.steps) if t < gen.min_new_tokens for beam in range(p * K, p * K + K)]
    if eos and short:
        log_probs[_on(rows.device, short, torch.long)[:, None], _on(rows.device, eos, torch.long)] = -math.inf
    return log_probs.view(B, K, V).add_(run_scores[:, :, None]).view(B, K * V)  # in place: log_probs is ours


def _candidates(scores: torch.Tensor, run_tokens: torch.Tensor, rows: _Rows, gen: GenerationConfig
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top 2K candidates of each prompt, best first: (their scores (B, 2K), the running beam each
    extends (B, 2K), their tokens (B, 2K, L), whether each ends: EOS or the last step (B, 2K))."""
    B, K, V = scores.shape[0], gen.num_beams, scores.shape[1] // gen.num_beams
    cand_scores, flat = torch.topk(scores, 2 * K, dim=1)  # (B, 2K), best first
    cand_beam = flat // V  # (B, 2K) which running beam it extends
    cand_token = flat % V
    cand_tokens = torch.take_along_dim(run_tokens, cand_beam[:, :, None], dim=1)  # (B, 2K, L)
    cand_tokens.scatter_(2, rows.at.expand(B, 2 * K, 1), cand_token[:, :, None])
    eos = gen.eos_ids  # one id (GPT-J's, most models'): compared as a number, no host-to-device copy a step
    if len(eos) <= 1:
        ends = cand_token == eos[0] if eos else torch.zeros_like(cand_token, dtype=torch.bool)
    else:
        ends = torch.isin(cand_token, _on(rows.device, list(eos), torch.long))
    return cand_scores, cand_beam, cand_tokens, ends | rows.last[:, None]


def _merge_finished(state: dict[str, torch.Tensor], cand_scores: torch.Tensor, cand_tokens: torch.Tensor,
                    ends: torch.Tensor, rows: _Rows, gen: GenerationConfig) -> dict[str, torch.Tensor]:
    """The finished hypotheses with this step's accepted candidates merged into the K best so far:
    the ending candidates among the top K (by rank), unless the prompt is done. Ties keep the older
    hypothesis first (HF's layout: old slots, then candidates). Done every step, though most accept
    nothing (the valid ones then stay as they were): asking would cost a device-to-host sync per step."""
    B, K = cand_scores.shape[0], gen.num_beams
    fin_valid = state["fin_valid"]
    in_top_k = torch.arange(2 * K, device=rows.device) < K  # (2K,) rank of a candidate among the 2K
    full = fin_valid.all(dim=1) & (gen.early_stopping is True)  # (B,)
    accept = ends & in_top_k[None, :] & (state["improvable"] & ~full)[:, None]  # (B, 2K)
    normalized = cand_scores / rows.norm[:, None]  # float32, as HF
    merged_scores = torch.cat([state["fin_scores"], normalized.masked_fill(~accept, -math.inf)], dim=1)  # (B, 3K)
    best = torch.topk(merged_scores, K, dim=1).indices  # (B, K)
    cand_lens = (rows.at[:, :, 0] + 1).expand(B, 2 * K)
    return dict(state, fin_scores=torch.take_along_dim(merged_scores, best, dim=1),
                fin_tokens=torch.take_along_dim(torch.cat([state["fin_tokens"], cand_tokens], dim=1),
                                                best[:, :, None], dim=1),
                fin_lens=torch.take_along_dim(torch.cat([state["fin_lens"], cand_lens], dim=1), best, dim=1),
                fin_valid=torch.take_along_dim(torch.cat([fin_valid, accept], dim=1), best, dim=1))


def _restack(searches: Sequence[BeamSearch], state: dict[str, torch.Tensor], source: torch.Tensor,
             done: torch.Tensor, finite: torch.Tensor, rows: _Rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next state stacked for the next step, each search pointed at its rows of it (and advanced a
    step) -> (source rows within each search's own rows (B, K), each search's done, each's finite)."""
    K = searches[0].K
    starts = list(itertools.accumulate((s.B for s in searches), initial=0))
    if all(s.B == 1 for s in searches):  # a search's beams are its rows 0..K-1: source as it is
        done_each, finite_each = done, finite
    elif len(searches) == 1:
        source, done_each, finite_each = source + searches[0].beam_offset, done.all()[None], finite.all()[None]
    else:  # each row's beam 0 within its own search: (row - its search's first row) * K
        source = source + _on(rows.device, [(b - first) * K for s, first in zip(searches, starts) for b in
                                            range(first, first + s.B)], torch.long)[:, None]
        done_each = torch.stack([done[first:first + s.B].all() for s, first in zip(searches, starts)])
        finite_each = torch.stack([finite[first:first + s.B].all() for s, first in zip(searches, starts)])
    stack = _Stack({name: state[name] for name in BeamSearch.STATE}, done_each)
    for i, (s, first) in enumerate(zip(searches, starts)):
        s._stack, s._own, s._at, s._index = stack, None, first, i
        s.n_steps += 1
    return source, done_each, finite_each


def stacked_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """parts (n_i, V) stacked (sum n_i, V): a view when they lie one after another in one storage (the
    engine's rows of one forward's logits, in order), else a copy (torch.cat). A copy of the MLPerf
    step's logits (512 rows x 50,400 float32: 103 MB) cost the CPU more than the forward of a small
    model: a fresh allocation's page faults, then the write."""
    first = parts[0]
    if len(parts) == 1:
        return first
    V, storage = first.shape[-1], first.untyped_storage().data_ptr()
    rows, at = 0, first.data_ptr()
    for t in parts:
        if (t.dim() != 2 or t.shape[1] != V or not t.is_contiguous() or t.dtype != first.dtype
                or t.data_ptr() != at or t.untyped_storage().data_ptr() != storage):
            return torch.cat(list(parts))
        rows += t.shape[0]
        at += t.numel() * t.element_size()
    return first.as_strided((rows, V), (V, 1))  # (a 1-row part's row stride can be anything)


class _Stack:
    """The state of the searches one BeamSearch.advance advanced, row by row (search i's B rows from
    its `_at`), and each one's done flag: what the next step starts from. Each search reads its own
    rows as views; a search holds the stack it was last advanced in (its result, after it ends). The
    stack does not hold its searches (no reference cycle: a step's old stack is freed at once)."""

    __slots__ = ("state", "done")

    def __init__(self, state: dict[str, torch.Tensor], done: torch.Tensor) -> None:
        self.state, self.done = state, done

    @staticmethod
    def gather(searches: Sequence[BeamSearch]) -> dict[str, torch.Tensor]:
        """The searches' rows of each state tensor, stacked in their order: the last stack itself
        when it holds exactly these searches in this order (a step where none joined or ended);
        else its rows and any other search's, in one gather per tensor."""
        first = searches[0]._stack
        # exactly the stack's searches, in order: each of its places is one search's, so it is enough
        # that all point to it, each at its own place, and that there are as many as it has places
        if first is not None and len(searches) == first.done.shape[0] and all(
                s._stack is first and s._index == i for i, s in enumerate(searches)):
            return first.state
        if len(searches) == 1 and first is None:
            return dict(searches[0]._own)
        sources: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}  # id -> (first row in `pool`, tensors)
        rows, size = [], 0
        for s in searches:
            tensors = s._own if s._stack is None else s._stack.state
            key = id(s) if s._stack is None else id(s._stack)
            if key not in sources:
                sources[key] = (size, tensors)
                size += tensors["run_scores"].shape[0]
            base = sources[key][0] + (0 if s._stack is None else s._at)
            rows.extend(range(base, base + s.B))
        parts = [tensors for _, tensors in sources.values()]
        dev = searches[0].beam_offset.device
        index = _on(dev, rows, torch.long)
        out = {}
        for name in BeamSearch.STATE:
            pool = parts[0][name] if len(parts) == 1 else torch.cat([p[name] for p in parts])
            out[name] = pool.index_select(0, index)
        return out
