"""What the engine's parts pass around: a request, its status, and the operations a loop applies.

A `Request` holds what was asked (prompt, generation settings, callbacks), what came out (tokens,
log-probabilities, the finish reason) and the engine's bookkeeping for it (`Sequence`s and their
KV blocks, beam state). Operations (`AddRequest`, `AbortRequest`) are how a loop, or the leader
of a parallel job, tells an engine what to do; they are plain, picklable data.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from gptj.beam import BeamSearch
from gptj.decode import GenerationConfig


class Status(str, Enum):
    """A request's state; a str, so `status == "failed"` reads as it did."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


WAITING, RUNNING, FINISHED, ABORTED, FAILED = (Status.WAITING, Status.RUNNING, Status.FINISHED, Status.ABORTED,
                                               Status.FAILED)
DONE = (FINISHED, ABORTED, FAILED)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and the `top` most likely tokens at its position (id, logprob)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Sequence:
    """One sequence's KV memory: its block table (block ids, position // block_size) and how many
    tokens those blocks hold. A beam group's sequences share their leading `shared` blocks (the
    prompt's full blocks) and own the rest."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens stored


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    gen: GenerationConfig
    on_token: Callable[[Request, int], None] | None = None  # each final new token (greedy/sampled)
    on_finish: Callable[[Request], None] | None = None
    arrival: float = field(default_factory=time.perf_counter)
    status: Status = WAITING
    output: list[int] = field(default_factory=list)  # new tokens (for beams: the best, at the end)
    finish_reason: str | None = None  # "stop" (EOS), "length", "abort", "error"
    error: str | None = None
    score: float | None = None  # beam search: the best hypothesis's score
    first_token_time: float | None = None
    finish_time: float | None = None
    # log-probabilities (log_softmax of the raw logits, float32), computed only when asked for
    logprobs: int | None = None  # top alternatives per new token (0: only the chosen token's)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (the first has none)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token
    prompt_token_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    hypotheses: list[tuple[list[int], float]] = field(default_factory=list)  # beam search: best first
    adapter: int = -1  # the LoRA adapter it runs with (an index of Engine.adapters), -1: the base model
    # --- the engine's state ---
    seqs: list[Sequence] = field(default_factory=list)  # one per beam (greedy, sampled: one)
    shared: int = 0  # leading blocks every sequence of the group shares (beam search: the prompt's full ones)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    block_keys: list[bytes] = field(default_factory=list)  # prefix keys of its context's full blocks
    registered: int = 0  # of its blocks, how many are in the prefix cache (or were found there)
    next_tokens: list[int] = field(default_factory=list)  # to feed at the next step, one per sequence
    beam: BeamSearch | None = None
    generator: torch.Generator | None = None
    preemptions: int = 0  # times its memory was taken back to let older requests go on
    # speculation (engine/draft.py): tokens to draft at most now (None: the request's setting), and
    # steps to decode without drafting after drafts that were all rejected (engine/update.py's back-off)
    draft_len: int | None = None
    draft_wait: int = 0
    # penalties (engine/sampler.py keeps them, on the device, while the request samples with any):
    counts: torch.Tensor | None = None  # (V,) float32: each token's count in `output`
    tokens_state: torch.Tensor | None = None  # (len(prompt) + max_new_tokens,) long: prompt, output, then prompt[0]
    counted: int = 0  # of `output`, the tokens counts and tokens_state hold

    @property
    def n_seqs(self) -> int:
        return self.gen.num_beams

    @property
    def done(self) -> bool:
        return self.status in DONE

    @property
    def n_computed(self) -> int:
        """Tokens whose keys and values are stored (while prefilling: of its context so far)."""
        return self.seqs[0].length if self.seqs else 0

    @property
    def n_prefilled(self) -> int:
        """Prompt tokens in KV (chunked prefill: < len(prompt) for a while)."""
        return min(self.n_computed, len(self.prompt))


# --- operations: what a loop (or a parallel job's leader) applies to an engine ---------------------

@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: list[int]
    gen: GenerationConfig
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    adapter: str | None = None  # a LoRA adapter's name (Engine.adapters), None: the base model


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


Operation = AddRequest | AbortRequest
