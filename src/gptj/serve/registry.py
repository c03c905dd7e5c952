"""What the server serves: named models, each an engine on its own loop thread, and its limits.

`ServerConfig` is the server's typed config (the CLI maps `gptj serve` flags onto it): how each
model runs (a ModelSpec, gptj.runtime.spec) and how big its engine is (an EngineConfig), then the
server's own settings.
A `ServedModel` owns one `EngineLoop`; the HTTP layer submits token ids to it and never touches a
tensor. Its `outstanding` count (engine requests submitted and not yet finished) is only changed on
the event loop's thread, which makes the admission check (backpressure) race-free.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import heapq
import json
import math
import os
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gptj.errors import GptjError
from gptj.generation_config import SPECULATE_NGRAM
from gptj.runtime.spec import ModelSpec
from gptj.serve.protocol import MODEL_NAME

if TYPE_CHECKING:
    from gptj.engine.config import EngineConfig
    from gptj.parallel.context import ParallelContext


def serve_engine_config(**settings) -> EngineConfig:  # noqa: ANN003 - EngineConfig's fields
    """A served model's engine: prompts prefilled in chunks by default (runtime.flags.SERVE_PREFILL_CHUNK),
    and its compute threads chosen from its steps' times (EngineConfig.adapt_threads)."""
    from gptj.engine.config import EngineConfig
    from gptj.runtime.flags import SERVE_PREFILL_CHUNK

    return EngineConfig(**{"prefill_chunk": SERVE_PREFILL_CHUNK, "adapt_threads": True} | settings)


@dataclass(frozen=True)
class ServerConfig:
    models: tuple[tuple[str, str], ...] = ()  # (name, checkpoint folder), loaded at start
    lora: tuple[tuple[str, str], ...] = ()  # (name, adapter folder): LoRA adapters served over the one model
    host: str = "127.0.0.1"
    port: int = 8000
    model: ModelSpec = field(default_factory=ModelSpec)  # how every model runs (its path: each of `models`)
    engine: EngineConfig = field(default_factory=serve_engine_config)  # each model's engine
    batch_wait_ms: float = 0.0  # an idle engine waits this long for more requests before a step
    max_queue: int = 64  # engine requests waiting beyond the running ones; more get 429
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 30.0  # on SIGTERM: how long running requests may finish
    # a connection must finish each request's headers, and then its body, within this (else closed / 408)
    read_timeout_s: float = 30.0
    max_connections: int = 512  # open connections at most; beyond, a JSON 503 (GET /health is always answered)
    access_log: bool = True  # a log line per request: status, latency, and a completion's tokens
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1 routes when set
    # with an api_key: /metrics, and the API's documents (/docs, /redoc, /openapi.json), need it too
    # unless made public (a Prometheus scraper without the key; docs for anyone who can reach the port)
    public_metrics: bool = False
    public_docs: bool = False
    admin_token: str | None = None  # enables /admin routes (same header)
    model_root: str | None = None  # admin loads must lie under it (default: the working directory)
    # torch compute threads, set where the engine is built (None: leave torch's setting; `gptj serve`
    # passes the usable cores less gptj.threads.RESERVED_CORES); split over the ranks under --tp/--pp
    threads: int | None = None
    # prompt-lookup speculation for requests that do not say (GenerationConfig's prompt_lookup_num_tokens:
    # None is off; a request's `speculate` field turns it on or off): `gptj serve --speculate ngram`
    speculate_tokens: int | None = None
    speculate_ngram: int = SPECULATE_NGRAM
    # `gptj serve --max-batch-size`'s old name for engine.max_seqs (sequences per step, beams count each)
    max_batch_size: InitVar[int | None] = None

    def __post_init__(self, max_batch_size: int | None) -> None:
        if max_batch_size is not None:
            object.__setattr__(self, "engine", dataclasses.replace(self.engine, max_seqs=max_batch_size))
        from gptj.serve.auth import check_secret

        check_secret(self.api_key, "the server's api_key")  # an empty secret would open its door
        check_secret(self.admin_token, "the server's admin_token")
        if self.threads is not None:
            from gptj.threads import compute_threads

            compute_threads(self.threads)  # a bad value fails here, in one line
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise GptjError(f"server max_queue must be a non-negative integer, got {self.max_queue!r}")
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) \
                or self.max_connections < 1:
            raise GptjError(f"server max_connections must be an integer >= 1, got {self.max_connections!r}")
        for name in ("request_timeout_s", "drain_timeout_s", "read_timeout_s"):
            if not getattr(self, name) > 0:
                raise GptjError(f"server {name} must be positive, got {getattr(self, name)!r}")
        names = [n for n, _ in self.models] + [n for n, _ in self.lora]
        if self.lora and len(self.models) != 1:
            raise GptjError("LoRA adapters are served over one model: give exactly one --model")
        for n in names:
            check_model_name(n)
        if len(set(names)) != len(names):
            raise GptjError(f"model names must be unique, got {', '.join(names)}")


def check_model_name(name: str) -> None:
    if not re.fullmatch(MODEL_NAME, name):
        raise GptjError(f"model name {name!r} must be 1-64 letters, digits, '.', '_' or '-'")


def parse_model_arg(text: str, flag: str = "--model") -> tuple[str, str]:
    """'NAME=DIR' or 'DIR' (named after the folder)."""
    name, sep, path = text.partition("=")
    if not sep:
        path, name = text, Path(text.rstrip("/")).name or "model"
    if not path:
        raise GptjError(f"{flag} {text!r}: give NAME=DIR or DIR")
    check_model_name(name)
    return name, path


# Retry-After never says more than this (a client may always come back sooner than a long outage).
MAX_RETRY_AFTER_S = 60


class RetryAdvisor:
    """What a refused request (429) is told to wait: Retry-After, from the queue and the measured rate.

    The rate is completions (engine requests finished) per second over the last `window` of them,
    counted from when the model last became busy (so an idle hour does not read as a slow engine),
    and measured up to now (so a stalled engine reads as a slow one). A refused request needing k
    places waits until `excess` places have freed (outstanding + k - capacity) plus those promised to
    requests refused before it and not yet due back: wait = (excess + promised) / rate, rounded up to
    whole seconds and clamped to [1, MAX_RETRY_AFTER_S]; it is then promised its k places at that time.
    So refused clients come back spread over the time the engine needs to make room for them, instead
    of all at once a second later (where all but a few are refused again). With no rate measured yet
    (a model that has finished nothing since it became busy) the answer is 1 s and nothing is promised.

    Event loop thread only, like ServedModel's counts; `clock` is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window: int = 64,
                 max_s: int = MAX_RETRY_AFTER_S) -> None:
        self.clock, self.max_s = clock, max_s
        self.times: deque[float] = deque(maxlen=window + 1)  # [busy start or oldest kept, completions...]
        self.promised: list[tuple[float, int]] = []  # heap of (due time, places)

    def busy(self) -> None:
        """The model went from idle to busy: measure from now."""
        self.times.clear()
        self.times.append(self.clock())

    def completed(self, k: int = 1) -> None:
        now = self.clock()
        if not self.times:
            self.times.append(now)
        self.times.extend([now] * k)

    def rate(self) -> float | None:
        """Completions per second since the oldest kept time, or None if none measured."""
        span = self.clock() - self.times[0] if self.times else 0.0
        done = len(self.times) - 1
        return done / span if done > 0 and span > 0 else None

    def retry_after(self, excess: int, k: int) -> int:
        now = self.clock()
        while self.promised and self.promised[0][0] <= now:
            heapq.heappop(self.promised)
        rate = self.rate()
        if rate is None:
            return 1
        ahead = max(excess, 0) + sum(places for _, places in self.promised)
        wait = min(self.max_s, max(1, math.ceil(ahead / rate)))
        heapq.heappush(self.promised, (now + wait, k))
        return wait


@dataclass(eq=False)
class ServedModel:
    name: str
    path: str
    engine: object  # gptj.engine.Engine
    loop: object  # gptj.engine.EngineLoop
    tokenizer: object  # gptj.tokenizer.Tokenizer
    max_model_len: int
    vocab_size: int
    capacity: int  # engine requests admitted at once (running + queued)
    created: int = field(default_factory=lambda: int(time.time()))
    outstanding: int = 0  # engine requests submitted, not finished (event loop thread only)
    unloading: bool = False
    # the most UTF-8 bytes one token covers (None: no such bound holds; see token_bytes_bound)
    max_token_bytes: int | None = None
    retry: RetryAdvisor = field(default_factory=RetryAdvisor)
    _idle: asyncio.Event | None = None
    # a LoRA adapter served over `base`'s engine: requests run with it; places are counted on the base
    adapter: str | None = None
    base: ServedModel | None = None
    threads: int = 0  # torch compute threads of its engine's thread (the start-up summary says it)
    speculate: tuple[int | None, int] = (None, SPECULATE_NGRAM)  # the server's (speculate_tokens, speculate_ngram)

    def adapter_view(self, name: str, folder: str) -> ServedModel:
        """The model name `name` for this engine's LoRA adapter `name` (from `folder`): the base's
        engine, loop and places."""
        return ServedModel(name, str(folder), self.engine, self.loop, self.tokenizer, self.max_model_len,
                           self.vocab_size, self.capacity, max_token_bytes=self.max_token_bytes, adapter=name,
                           base=self, speculate=self.speculate)

    @property
    def failure(self) -> str | None:
        """Why its engine stopped, in one line (None while it runs); an adapter's is its base's."""
        return self.loop.failure

    def admit(self, k: int) -> bool:
        """Take k places if there is room (the event loop's thread only)."""
        if self.base is not None:
            return self.base.admit(k)
        if self.outstanding + k > self.capacity:
            return False
        if self.outstanding == 0:
            self.retry.busy()
        self.outstanding += k
        return True

    def retry_after(self, k: int) -> int:
        """Seconds a request refused for want of k places should wait (see RetryAdvisor)."""
        if self.base is not None:
            return self.base.retry_after(k)
        return self.retry.retry_after(self.outstanding + k - self.capacity, k)

    def finished(self, k: int = 1) -> None:
        """k engine requests ended (done, failed or cancelled): their places free, the rate is measured."""
        if self.base is not None:
            return self.base.finished(k)
        self.retry.completed(k)
        self.release(k)

    def release(self, k: int) -> None:
        if self.base is not None:
            return self.base.release(k)
        self.outstanding -= k
        if self.outstanding <= 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self) -> None:
        while self.outstanding > 0:
            self._idle = asyncio.Event()
            await self._idle.wait()

    def describe(self) -> str:
        """One line for the server's log: what this model runs with and how big its engine is."""
        if self.base is not None:
            return f"{self.name}: LoRA adapter from {self.path} over {self.base.name}"
        engine, plan = self.engine, self.engine.plan
        model = engine.model
        q = getattr(model.config, "quantization", None)  # a Llama config has none
        quant = (q or {}).get("mode", "quantized") if q else "none"
        cfg = engine.config
        from gptj.engine.config import kv_storage

        dtype = model.transformer.wte.weight.dtype
        return (f"{self.name}: {self.path}; {str(dtype).removeprefix('torch.')} on {engine.device}, quantization "
                f"{quant}, KV {str(kv_storage(dtype, cfg.kv_dtype)).removeprefix('torch.')} in {plan.n_blocks:,} blocks of {plan.block_size} tokens "
                f"({plan.tokens:,} tokens, {plan.bytes / 2**20:,.1f} MiB), up to {plan.max_seqs} sequences of "
                f"{plan.max_len:,} tokens, {self.capacity} requests admitted (running + queued), "
                f"prefix caching {'on' if cfg.prefix_caching else 'off'}, {self.threads} compute threads")

    # what /metrics reads (from the scraping thread): the engine's stats(), never its fields
    def stats(self):  # noqa: ANN201 - gptj.engine.config.EngineStats
        return self.engine.stats()

    def queue_depth(self) -> int:
        return self.loop.pending + self.stats().waiting

    def running_sequences(self) -> int:
        return self.stats().running_seqs

    def kv_usage(self) -> float:
        return self.stats().kv_usage

    def shutdown(self) -> None:
        self.loop.shutdown()


def build_served_engine(path: str, cfg: ServerConfig, adapters: tuple[tuple[str, str], ...],
                        ctx: ParallelContext):  # noqa: ANN201 - Engine
    """Load `path` and make its engine for this rank of `ctx` (on the engine's own thread: see
    EngineLoop). Module-level, so that under --tp / --pp rank 0 can hand it to the other ranks
    (gptj.parallel.lockstep), each of which calls it with its own context."""
    from gptj.runtime.build import build_engine, load_model, set_rank_threads

    # Here, on the thread that runs the engine, before it computes: OpenMP keeps a count per thread.
    set_rank_threads(cfg.threads, ctx)
    from gptj.decode import GenerationConfig

    spec = cfg.model.at(path)
    # on CUDA: every batch size's graph captured before the first request (one request each)
    return build_engine(load_model(spec, ctx), cfg.engine, warm=GenerationConfig(max_new_tokens=2), adapters=adapters,
                        ctx=ctx)


def load_served_model(name: str, path: str, cfg: ServerConfig, adapters: tuple[tuple[str, str], ...] = (),
                      ctx: ParallelContext | None = None) -> ServedModel:
    """Load a checkpoint and start its engine (blocking: seconds to minutes), with `adapters` (name,
    folder) served over it (ServedModel.adapter_view gives each its name). `ctx`: the job's context
    under --tp / --pp (this process is its rank 0, and leads); None: one process."""
    from gptj.parallel import lockstep
    from gptj.parallel.context import SINGLE
    from gptj.tokenizer import tokenizer_for_model

    if not Path(path).is_dir():
        raise GptjError(f"{path}: not a model folder")
    tokenizer = tokenizer_for_model(path)
    loop = lockstep.engine_loop(functools.partial(build_served_engine, path, cfg, adapters), ctx or SINGLE,
                                batch_wait_ms=cfg.batch_wait_ms)
    engine = loop.engine
    stats = engine.stats()
    return ServedModel(name, str(path), engine, loop, tokenizer, stats.max_len, engine.model.config.vocab_size,
                       capacity=stats.max_seqs + cfg.max_queue, max_token_bytes=token_bytes_bound(tokenizer),
                       threads=loop.threads, speculate=(cfg.speculate_tokens, cfg.speculate_ngram))


def token_bytes_bound(tokenizer) -> int | None:  # noqa: ANN001 - gptj.tokenizer.Tokenizer
    """B, the most UTF-8 bytes of text that one token can stand for, where the tokenizer makes that
    a bound: then a text of N bytes has at least ceil(N / B) tokens, and a prompt whose lower bound
    already exceeds the context is refused without tokenizing it (gptj.serve.completions.precheck).

    Why it holds for a byte-level BPE (GPT-2's, GPT-J's): with no normalizer, the ByteLevel
    pre-tokenizer maps every byte of the text's UTF-8 to one symbol and drops none, BPE only merges
    symbols (with no fused unknown token), and added tokens that strip no whitespace match their own
    text; so the tokens' pieces concatenate to exactly the text's bytes, and each piece is at most
    the longest vocabulary entry (GPT-J: 128 bytes). Note the other direction, "N bytes give at most N
    tokens", is true but useless here: refusing needs a lower bound on the count. A tokenizer of any
    other shape (a normalizer that may shrink text, a pre-tokenizer that drops whitespace, fused
    unknowns, stripping added tokens) gets None: its prompts are always tokenized to be measured."""
    backend = getattr(tokenizer, "_backend", None)
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 - not a `tokenizers` backend: no bound, only the exact count
        return None
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    added = spec.get("added_tokens") or []
    if (spec.get("normalizer") is not None or pre.get("type") != "ByteLevel" or model.get("type") != "BPE"
            or model.get("fuse_unk") or any(a.get("lstrip") or a.get("rstrip") for a in added)):
        return None
    # a vocabulary entry has one symbol per byte (ByteLevel's alphabet); an added token is plain text
    sizes = [*(len(p) for p in model.get("vocab") or {}), *(len(a.get("content", "").encode()) for a in added)]
    return max(sizes, default=0) or None


def check_under_root(path: str, root: str | None) -> Path:
    """The resolved path, or GptjError if it lies outside `root` (symlinks resolved first)."""
    try:
        base = Path(root or ".").resolve()
        resolved = (base / path).resolve() if not Path(path).is_absolute() else Path(path).resolve()
    except RuntimeError:  # pathlib's "Symlink loop from ...": the OSError it stands for
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path) from None
    if resolved != base and base not in resolved.parents:
        raise PermissionError(f"{path}: outside the server's model root")
    return resolved
