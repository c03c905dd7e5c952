"""The engine: requests in, tokens out, one `step()` at a time (schedule -> run -> update).

Greedy, sampled and beam-search requests share every step. A beam-search request is a group of
num_beams sequences, each in its own KV slot, admitted and retired together; after each step the
group's slots are reordered to follow the beams its `BeamSearch` kept (the same rule
`gptj.decode.beam_search` uses). Each row attends over its own slot only, so a request's tokens
do not depend on what else shares the step (up to float rounding; exact in float32 in the tests).

    schedule  admit waiting requests, first come first served, while KV slots, the running-
              sequence cap and the prefill-token budget allow; never skip ahead of the oldest
    run       one forward for every running sequence's next token (each at its own position),
              then one forward per newly admitted prompt (prefill, written into its slot)
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
from gptj.engine.kv import KVPool, SlotBatch, slots_from_memory
from gptj.errors import GptjError
from gptj.model import GPTJForCausalLM

WAITING, RUNNING, FINISHED, ABORTED, FAILED = "waiting", "running", "finished", "aborted", "failed"


@dataclass(frozen=True)
class EngineConfig:
    n_slots: int | None = None  # KV slots (sequences in memory at once); None: from free memory
    slot_len: int | None = None  # tokens per slot; None: the model's n_positions
    max_batch_size: int | None = None  # running sequences per step (beams count each); None: n_slots
    max_prefill_tokens: int = 4096  # prompt tokens prefilled per step (at least one prompt)
    memory_fraction: float = 0.5  # of free memory, when sizing slots from it

    def __post_init__(self) -> None:
        for name in ("n_slots", "slot_len", "max_batch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise GptjError(f"engine {name} must be a positive integer, got {value!r}")
        if self.max_prefill_tokens < 1:
            raise GptjError(f"engine max_prefill_tokens must be positive, got {self.max_prefill_tokens}")
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
    slots: list[int] = field(default_factory=list)
    length: int = 0  # positions each of its sequences holds in KV
    next_tokens: list[int] = field(default_factory=list)  # to feed at the next step, one per sequence
    beam: BeamSearch | None = None
    generator: torch.Generator | None = None

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
        w = model.lm_head.weight
        slot_len = min(config.slot_len or model.config.n_positions, model.config.n_positions)
        n_slots = config.n_slots or slots_from_memory(model.config, w.dtype if w.is_floating_point() else
                                                      torch.bfloat16, w.device, slot_len, config.memory_fraction)
        kv_dtype = model.transformer.wte.weight.dtype  # the activations' dtype (weights may be quantized)
        self.pool = KVPool(model.config, n_slots, slot_len, kv_dtype, w.device)
        self.max_batch_size = config.max_batch_size or n_slots
        self.device = w.device
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.steps = 0
        self.decode_batch_sizes: list[int] = []  # sequences per decode forward, for stats and tests

    # --- requests ---

    def validate(self, prompt: Sequence[int], gen: GenerationConfig) -> None:
        """GptjError unless the request can ever run here (thread-safe: reads only configuration)."""
        check_prompts(self.model, [prompt], gen)
        if len(prompt) + gen.max_new_tokens > self.pool.slot_len:
            raise GptjError(f"prompt of {len(prompt)} tokens + max_new_tokens {gen.max_new_tokens} exceeds the "
                            f"engine's {self.pool.slot_len} tokens per sequence")
        if gen.num_beams > min(self.pool.n_slots, self.max_batch_size):
            raise GptjError(f"num_beams {gen.num_beams} exceeds the engine's "
                            f"{min(self.pool.n_slots, self.max_batch_size)} sequences at once")

    def add_request(self, prompt: Sequence[int], gen: GenerationConfig, request_id: str | None = None,
                    on_token: Callable[[Request, int], None] | None = None,
                    on_finish: Callable[[Request], None] | None = None) -> Request:
        self.validate(prompt, gen)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise GptjError(f"request id {rid!r} is already in use")
        req = Request(rid, [int(t) for t in prompt], gen, on_token, on_finish)
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
        """Admit, run one forward for the running sequences and one per new prompt; return the finished."""
        admitted = self._schedule()
        decoding = [r for r in self.running if r not in admitted]
        finished: list[Request] = []
        with torch.inference_mode():
            if decoding:
                self._run(decoding, self._decode, finished)
            for req in admitted:
                self._run([req], self._prefill, finished)
        self.steps += 1
        return finished

    def _schedule(self) -> list[Request]:
        admitted: list[Request] = []
        running_seqs = sum(r.n_seqs for r in self.running)
        budget = self.config.max_prefill_tokens
        while self.waiting:
            req = self.waiting[0]
            if req.n_seqs > self.pool.free_slots or running_seqs + req.n_seqs > self.max_batch_size:
                break
            if admitted and len(req.prompt) > budget:
                break
            self.waiting.popleft()
            req.slots = self.pool.allocate(req.n_seqs)
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
        slots, starts, tokens = [], [], []
        for req in reqs:
            slots += req.slots
            starts += [req.length] * req.n_seqs
            tokens += req.next_tokens
        ids = torch.tensor(tokens, device=self.device)[:, None]  # (N, 1)
        positions = torch.tensor(starts, device=self.device)[:, None]
        logits = self.model(ids, position_ids=positions, cache=SlotBatch(self.pool, slots, starts))[:, -1]  # (N, V)
        self.decode_batch_sizes.append(len(tokens))
        row = 0
        for req in reqs:
            req.length += 1
            self._update(req, logits[row:row + req.n_seqs])
            row += req.n_seqs

    def _prefill(self, reqs: list[Request]) -> None:
        (req,) = reqs
        T = len(req.prompt)
        ids = torch.tensor([req.prompt], device=self.device)
        positions = torch.arange(T, device=self.device)[None]
        logits = self.model(ids, position_ids=positions, cache=SlotBatch(self.pool, req.slots[:1], [0]),
                            logits_to_keep=1)[:, -1]  # (1, V)
        req.length = T
        if req.n_seqs > 1:  # every beam starts from the prompt: copy its KV to the group's other slots
            self.pool.copy(req.slots[:1] * (req.n_seqs - 1), req.slots[1:], T)
            logits = logits.expand(req.n_seqs, -1)
        self._update(req, logits)

    def _update(self, req: Request, logits: torch.Tensor) -> None:
        """Choose the next token(s) from this step's logits (n_seqs, V); retire when done."""
        gen = req.gen
        if req.beam is None and gen.num_beams > 1:
            req.beam = BeamSearch(1, gen, self.device)
        if req.beam is not None:
            source, next_tokens = req.beam.step(logits)
            if req.beam.finished:
                tokens, scores = req.beam.best()
                req.output, req.score = tokens[0], scores[0]
                eos = gen.eos_token_id
                self._retire(req, FINISHED, "stop" if eos is not None and req.output[-1:] == [eos] else "length")
                return
            src = source.tolist()
            moved = [k for k in range(req.n_seqs) if src[k] != k]
            self.pool.copy([req.slots[src[k]] for k in moved], [req.slots[k] for k in moved], req.length)
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
        if req.slots:
            self.pool.release(req.slots)
            req.slots = []
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
