"""The engine: requests in, tokens out, one `step()` at a time (schedule -> run -> update).

Greedy, sampled and beam-search requests share every step. A beam-search request is a group of
num_beams sequences that share one stored prompt (see engine/kv.py) and own a tail of new tokens
each; they are admitted and retired together, and after each step the group's tails are reordered
to follow the beams its `BeamSearch` kept (the same rule `gptj.decode.beam_search` uses). Each
group attends over its own memory only, so a request's tokens do not depend on what else shares
the step (up to float rounding; equal tokens in float32 in the tests).

    schedule  admit waiting requests, first come first served, while KV slots, the running-
              sequence cap and the prefill-token budget allow; never skip ahead of the oldest
    run       one forward for every running sequence's next token (each at its own position),
              then one forward per newly admitted prompt (prefill, written into its slot; with
              prefill_chunk, at most that many prompt tokens per step, long prompts over steps)
    update    pick each request's next token(s); finished requests free their slots at once
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from gptj.decode import BeamSearch, GenerationConfig, block_eos, check_prompts, warp
from gptj.engine.attention import COMPILE_MODES, DecodeAttention
from gptj.engine.kv import Group, GroupBatch, KVPool, groups_from_memory
from gptj.errors import GptjError
from gptj.kernels import PACK_MODES, prepare_for_serving
from gptj.model import GPTJForCausalLM

WAITING, RUNNING, FINISHED, ABORTED, FAILED = "waiting", "running", "finished", "aborted", "failed"


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and the `top` most likely tokens at its position (id, logprob)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    """logits (N, V) of N positions and the token chosen at each -> their log-probabilities."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if k > 0:
        values, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(int(t), c, top) for t, c, top in zip(tokens, chosen, tops)]


@dataclass(frozen=True)
class EngineConfig:
    n_slots: int | None = None  # sequences in memory at once (beams count each); None: from free memory
    slot_len: int | None = None  # prompt + new tokens per sequence; None: the model's n_positions
    max_new_tokens: int | None = None  # new tokens per sequence (its tail); None: slot_len
    n_prompts: int | None = None  # requests in memory at once (one stored prompt each); None: n_slots
    max_batch_size: int | None = None  # running sequences per step; None: n_slots
    max_prefill_tokens: int = 4096  # prompt tokens prefilled per step (at least one prompt)
    memory_fraction: float = 0.5  # of free memory, when sizing slots from it
    prefill_chunk: int | None = None  # prompt tokens prefilled per step, in chunks; None: whole prompts
    kernels: str = "auto"  # "auto": fused blocks + oneDNN-packed bfloat16 weights (not float32); "off"
    compile: str = "auto"  # decode attention by torch.compile: "auto" (below float32), "on", "off"
    progress: bool | None = None  # a bar while the kernels prepare; None: for a big model on a terminal

    def __post_init__(self) -> None:
        for name in ("n_slots", "slot_len", "max_new_tokens", "n_prompts", "max_batch_size", "prefill_chunk"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise GptjError(f"engine {name} must be a positive integer, got {value!r}")
        if self.max_prefill_tokens < 1:
            raise GptjError(f"engine max_prefill_tokens must be positive, got {self.max_prefill_tokens}")
        if self.kernels not in PACK_MODES:
            raise GptjError(f"engine kernels must be one of {', '.join(PACK_MODES)}, got {self.kernels!r}")
        if self.compile not in COMPILE_MODES:
            raise GptjError(f"engine compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        if not 0 < self.memory_fraction <= 1:
            raise GptjError(f"engine memory_fraction must be in (0, 1], got {self.memory_fraction}")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    gen: GenerationConfig
    on_token: Callable[[Request, int], None] | None = None  # each final new token (greedy/sampled)
    on_finish: Callable[[Request], None] | None = None
    arrival: float = field(default_factory=time.perf_counter)
    status: str = WAITING
    output: list[int] = field(default_factory=list)  # new tokens (for beams: the best, at the end)
    finish_reason: str | None = None  # "stop" (EOS), "length", "abort", "error"
    error: str | None = None
    score: float | None = None  # beam search: the best hypothesis's score
    first_token_time: float | None = None
    finish_time: float | None = None
    # engine state
    prompt_slot: int | None = None
    tails: list[int] = field(default_factory=list)  # one tail slot per sequence
    n_new: int = 0  # new tokens each of its sequences holds in KV (its tail length)
    n_prefilled: int = 0  # prompt tokens in KV (chunked prefill: < len(prompt) for a while)
    next_tokens: list[int] = field(default_factory=list)  # to feed at the next step, one per sequence
    beam: BeamSearch | None = None
    generator: torch.Generator | None = None
    # log-probabilities (log_softmax of the raw logits, float32), computed only when asked for
    logprobs: int | None = None  # top alternatives per new token (0: only the chosen token's)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (the first has none)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token
    prompt_token_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    hypotheses: list[tuple[list[int], float]] = field(default_factory=list)  # beam search: best first

    @property
    def n_seqs(self) -> int:
        return self.gen.num_beams

    @property
    def done(self) -> bool:
        return self.status in (FINISHED, ABORTED, FAILED)


class Engine:
    def __init__(self, model: GPTJForCausalLM, config: EngineConfig | None = None) -> None:
        self.model = model
        self.config = config = config or EngineConfig()
        # The engine takes the model over: below float32 its blocks are fused and, on CPU in
        # bfloat16, its Linear weights repacked for oneDNN, in place (gptj.kernels).
        w = model.transformer.wte.weight
        kv_dtype = model.transformer.wte.weight.dtype  # the activations' dtype (weights may be quantized)
        slot_len = min(config.slot_len or model.config.n_positions, model.config.n_positions)
        tail_len = min(config.max_new_tokens or slot_len, slot_len)
        n_slots = config.n_slots or groups_from_memory(model.config, kv_dtype, w.device, slot_len, tail_len, 1,
                                                       config.memory_fraction)
        self.pool = KVPool(model.config, config.n_prompts or n_slots, slot_len, n_slots, tail_len, kv_dtype, w.device,
                           n_head=model.kv_heads)
        self.max_batch_size = config.max_batch_size or n_slots
        self.kernels = prepare_for_serving(model, config.kernels, max_rows=min(self.max_batch_size, n_slots),
                                           progress=config.progress)
        self.attention = DecodeAttention(config.compile, kv_dtype, native=config.kernels == "auto")
        self.device = w.device
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.steps = 0
        self.decode_batch_sizes: list[int] = []  # sequences per decode forward, for stats and tests

    # --- requests ---

    def validate(self, prompt: Sequence[int], gen: GenerationConfig, logprobs: int | None = None) -> None:
        """GptjError unless the request can ever run here (thread-safe: reads only configuration)."""
        check_prompts(self.model, [prompt], gen)
        if logprobs is not None and gen.num_beams > 1:
            raise GptjError("logprobs are not available with beam search")
        if len(prompt) + gen.max_new_tokens > self.pool.prompt_len:
            raise GptjError(f"prompt of {len(prompt)} tokens + max_new_tokens {gen.max_new_tokens} exceeds the "
                            f"engine's {self.pool.prompt_len} tokens per sequence")
        if gen.max_new_tokens > self.pool.tail_len:
            raise GptjError(f"max_new_tokens {gen.max_new_tokens} exceeds the engine's {self.pool.tail_len} "
                            f"new tokens per sequence")
        if gen.num_beams > min(self.pool.n_tail_slots, self.max_batch_size):
            raise GptjError(f"num_beams {gen.num_beams} exceeds the engine's "
                            f"{min(self.pool.n_tail_slots, self.max_batch_size)} sequences at once")

    def add_request(self, prompt: Sequence[int], gen: GenerationConfig, request_id: str | None = None,
                    on_token: Callable[[Request, int], None] | None = None,
                    on_finish: Callable[[Request], None] | None = None,
                    logprobs: int | None = None, prompt_logprobs: int | None = None) -> Request:
        """Queue a request. `logprobs` / `prompt_logprobs` (top-k, 0 for the chosen token only) ask for
        log-probabilities of the new tokens (not with beam search) / of the prompt's tokens."""
        self.validate(prompt, gen, logprobs)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise GptjError(f"request id {rid!r} is already in use")
        req = Request(rid, [int(t) for t in prompt], gen, on_token, on_finish,
                      logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        if gen.sampling and gen.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(gen.seed)
        self.requests[rid] = req
        self.waiting.append(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV slots; False if it is unknown or already done."""
        req = self.requests.get(request_id)
        if req is None or req.done:
            return False
        if req.status == WAITING:
            self.waiting.remove(req)
        self._retire(req, ABORTED, "abort")
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- the step ---

    def step(self) -> list[Request]:
        """Admit, run one forward for the running sequences and one per prompt (chunk) to prefill;
        return the finished.

        With `prefill_chunk`, a step prefills at most that many prompt tokens (the oldest prompts
        first, a long one over several steps), so a long prompt no longer stalls every running
        sequence for its whole prefill."""
        self._schedule()
        decoding = [r for r in self.running if r.n_prefilled == len(r.prompt)]
        prefilling = [r for r in self.running if r.n_prefilled < len(r.prompt)]
        finished: list[Request] = []
        with torch.inference_mode():
            if decoding:
                self._run(decoding, self._decode, finished)
            budget = self.config.prefill_chunk
            for req in prefilling:
                left = len(req.prompt) - req.n_prefilled
                n = left if budget is None else min(left, budget)
                if n <= 0:
                    break
                self._run([req], lambda reqs, n=n: self._prefill(reqs, n), finished)
                if budget is not None:
                    budget -= n
        self.steps += 1
        return finished

    def _schedule(self) -> list[Request]:
        admitted: list[Request] = []
        running_seqs = sum(r.n_seqs for r in self.running)
        budget = self.config.max_prefill_tokens
        while self.waiting:
            req = self.waiting[0]
            if (not self.pool.prompts.free or req.n_seqs > self.pool.tails.free
                    or running_seqs + req.n_seqs > self.max_batch_size):
                break
            if admitted and len(req.prompt) > budget:
                break
            self.waiting.popleft()
            req.prompt_slot = self.pool.prompts.allocate(1)[0]
            req.tails = self.pool.tails.allocate(req.n_seqs)
            req.status = RUNNING
            self.running.append(req)
            admitted.append(req)
            running_seqs += req.n_seqs
            budget -= len(req.prompt)
        return admitted

    def _run(self, reqs: list[Request], forward: Callable[[list[Request]], None], finished: list[Request]) -> None:
        try:
            forward(reqs)
        except Exception as e:  # noqa: BLE001 - fail these requests, keep serving the others
            message = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            for req in reqs:
                if not req.done:
                    req.error = message
                    self._retire(req, FAILED, "error")
        finished.extend(r for r in reqs if r.done)

    def _decode(self, reqs: list[Request]) -> None:
        groups, positions, tokens = [], [], []
        for req in reqs:
            groups.append(Group(req.prompt_slot, len(req.prompt), req.tails, req.n_new))
            positions += [len(req.prompt) + req.n_new] * req.n_seqs
            tokens += req.next_tokens
        ids = torch.tensor(tokens, device=self.device)[:, None]  # (N, 1)
        pos = torch.tensor(positions, device=self.device)[:, None]
        logits = self.model(ids, position_ids=pos, cache=GroupBatch(self.pool, groups, self.attention))[:, -1]  # (N, V)
        self.decode_batch_sizes.append(len(tokens))
        row = 0
        for req in reqs:
            req.n_new += 1
            self._update(req, logits[row:row + req.n_seqs])
            row += req.n_seqs

    def _prefill(self, reqs: list[Request], n: int) -> None:
        """Store the prompt's next n tokens in its slot; once it is whole, choose the first new token."""
        (req,) = reqs
        T, start = len(req.prompt), req.n_prefilled
        end = start + n
        ids = torch.tensor([req.prompt[start:end]], device=self.device)
        positions = torch.arange(start, end, device=self.device)[None]
        cache = GroupBatch(self.pool, [Group(req.prompt_slot, start, [], 0)], self.attention)
        keep = n if req.prompt_logprobs is not None else 1
        all_logits = self.model(ids, position_ids=positions, cache=cache, logits_to_keep=keep)  # (1, keep, V)
        if req.prompt_logprobs is not None:  # position t predicts token t + 1; the first token has none
            targets = req.prompt[start + 1:end + 1]
            req.prompt_token_logprobs = ([None] if start == 0 else req.prompt_token_logprobs) + token_logprobs(
                all_logits[0, :len(targets)], targets, req.prompt_logprobs)
        req.n_prefilled = end
        if end < T:
            return
        logits = all_logits[:, -1]  # (1, V)
        # Every beam starts from the prompt, which they share: no copy, just the same logits.
        self._update(req, logits.expand(req.n_seqs, -1))

    def _update(self, req: Request, logits: torch.Tensor) -> None:
        """Choose the next token(s) from this step's logits (n_seqs, V); retire when done."""
        gen = req.gen
        if req.beam is None and gen.num_beams > 1:
            req.beam = BeamSearch(1, gen, self.device)
        if req.beam is not None:
            source, next_tokens = req.beam.step(logits)
            if req.beam.finished:
                req.hypotheses = req.beam.ranked(0)
                req.output, req.score = req.hypotheses[0]
                eos = gen.eos_token_id
                self._retire(req, FINISHED, "stop" if eos is not None and req.output[-1:] == [eos] else "length")
                return
            src = source.tolist()
            moved = [k for k in range(req.n_seqs) if src[k] != k]
            self.pool.copy_tails([req.tails[src[k]] for k in moved], [req.tails[k] for k in moved], req.n_new)
            req.next_tokens = next_tokens.tolist()
            return
        # Greedy or sampled, as gptj.decode.greedy_or_sample: min_new_tokens on the raw logits first.
        scores = block_eos(logits, len(req.output), gen)
        if gen.sampling:
            probs = torch.softmax(warp(scores, gen), dim=-1)
            token = int(torch.multinomial(probs, num_samples=1, generator=req.generator)[0, 0])
        else:
            token = int(torch.argmax(scores[0]))
        req.output.append(token)
        if req.logprobs is not None:
            req.token_logprobs += token_logprobs(logits[:1], [token], req.logprobs)
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        if req.on_token is not None:
            req.on_token(req, token)
        if gen.eos_token_id is not None and token == gen.eos_token_id:
            self._retire(req, FINISHED, "stop")
        elif len(req.output) >= gen.max_new_tokens:
            self._retire(req, FINISHED, "length")
        else:
            req.next_tokens = [token]

    def _retire(self, req: Request, status: str, reason: str) -> None:
        if req.prompt_slot is not None:
            self.pool.prompts.release([req.prompt_slot])
            self.pool.tails.release(req.tails)
            req.prompt_slot, req.tails = None, []
        if req in self.running:
            self.running.remove(req)
        req.status, req.finish_reason = status, reason
        req.finish_time = time.perf_counter()
        self.requests.pop(req.request_id, None)
        if req.on_finish is not None:
            req.on_finish(req)

    # --- offline use ---

    def generate(self, prompts: Sequence[Sequence[int]], gen: GenerationConfig | Sequence[GenerationConfig]
                 ) -> list[list[int]]:
        """New tokens of every prompt (one GenerationConfig for all, or one each), run to completion."""
        gens = [gen] * len(prompts) if isinstance(gen, GenerationConfig) else list(gen)
        if len(gens) != len(prompts):
            raise GptjError(f"{len(prompts)} prompts but {len(gens)} generation configs")
        reqs = [self.add_request(p, g) for p, g in zip(prompts, gens)]
        while any(not r.done for r in reqs):
            self.step()
        failed = [r for r in reqs if r.status == FAILED]
        if failed:
            raise GptjError(f"generation failed: {failed[0].error}")
        return [r.output for r in reqs]
