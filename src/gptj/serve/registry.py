"""What the server serves: named models, each an engine on its own loop thread, and its limits.

`ServerConfig` is the server's typed config (the CLI maps `gptj serve` flags onto it).
A `ServedModel` owns one `EngineLoop`; the HTTP layer submits token ids to it and never touches a
tensor. Its `outstanding` count (engine requests submitted and not yet finished) is only changed on
the event loop's thread, which makes the admission check (backpressure) race-free.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from gptj.errors import GptjError
from gptj.serve.protocol import MODEL_NAME


# `gptj serve`'s default threads leave this many cores to the event loop (HTTP, tokenizing,
# streaming): torch's OpenMP threads spin while they wait, and an event loop sharing their cores
# waits whole time slices to answer. On 2 busy cores, 16 concurrent requests finished 5-15x sooner
# with 1 compute thread than with 2 (tiny and small presets; docs/PERFORMANCE.md, "Threads").
SERVE_RESERVED_CORES = 1


@dataclass(frozen=True)
class ServerConfig:
    models: tuple[tuple[str, str], ...] = ()  # (name, checkpoint folder), loaded at start
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = 8  # sequences per engine step (beams count each)
    batch_wait_ms: float = 0.0  # an idle engine waits this long for more requests before a step
    max_queue: int = 64  # engine requests waiting beyond a full batch; more get 429
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 30.0  # on SIGTERM: how long running requests may finish
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1 routes when set
    admin_token: str | None = None  # enables /admin routes (same header)
    model_root: str | None = None  # admin loads must lie under it (default: the working directory)
    dtype: str = "float32"
    device: str = "cpu"
    quantize: str | None = None
    group_size: int | None = None
    kv_slots: int | None = None  # sequences in KV memory (default: max_batch_size, as memory allows)
    max_model_len: int | None = None  # prompt + new tokens (default: the model's n_positions)
    prefill_chunk: int | None = 512  # prompt tokens prefilled per engine step (None: whole prompts)
    compile: str = "auto"
    kernels: str = "auto"
    # torch compute threads, set where the engine is built (None: leave torch's setting; `gptj serve`
    # passes the usable cores less SERVE_RESERVED_CORES); split over the ranks under --tp/--pp
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise GptjError(f"server threads must be an integer >= 1, got {self.threads!r}")
        for name in ("max_batch_size", "max_queue"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (1 if name == "max_batch_size" else 0):
                raise GptjError(f"server {name} must be a {'positive' if name == 'max_batch_size' else 'non-negative'}"
                                f" integer, got {value!r}")
        for name in ("request_timeout_s", "drain_timeout_s"):
            if not getattr(self, name) > 0:
                raise GptjError(f"server {name} must be positive, got {getattr(self, name)!r}")
        names = [n for n, _ in self.models]
        for n in names:
            check_model_name(n)
        if len(set(names)) != len(names):
            raise GptjError(f"model names must be unique, got {', '.join(names)}")


def check_model_name(name: str) -> None:
    if not re.fullmatch(MODEL_NAME, name):
        raise GptjError(f"model name {name!r} must be 1-64 letters, digits, '.', '_' or '-'")


def parse_model_arg(text: str) -> tuple[str, str]:
    """'NAME=DIR' or 'DIR' (named after the folder)."""
    name, sep, path = text.partition("=")
    if not sep:
        path, name = text, Path(text.rstrip("/")).name or "model"
    if not path:
        raise GptjError(f"--model {text!r}: give NAME=DIR or DIR")
    check_model_name(name)
    return name, path


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
    _idle: asyncio.Event | None = None

    def admit(self, k: int) -> bool:
        """Take k places if there is room (the event loop's thread only)."""
        if self.outstanding + k > self.capacity:
            return False
        self.outstanding += k
        return True

    def release(self, k: int) -> None:
        self.outstanding -= k
        if self.outstanding <= 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self) -> None:
        while self.outstanding > 0:
            self._idle = asyncio.Event()
            await self._idle.wait()

    # what /metrics reads (from the scraping thread: len() of the engine's containers is atomic)
    def queue_depth(self) -> int:
        return self.loop.pending + len(self.engine.waiting)

    def running_sequences(self) -> int:
        return sum(r.n_seqs for r in list(self.engine.running))

    def kv_usage(self) -> float:
        tails = self.engine.pool.tails
        return 1.0 - tails.free / tails.n

    def shutdown(self) -> None:
        self.loop.shutdown()


def build_served_engine(path: str, cfg: ServerConfig):  # noqa: ANN201 - Engine
    """Load `path` and make its engine (on the engine's own thread: see EngineLoop). Module-level,
    so that under --tp / --pp rank 0 can hand it to the other ranks (gptj.parallel.lockstep)."""
    from gptj.engine import Engine, EngineConfig
    from gptj.engine.kv import groups_from_memory
    from gptj.parallel import lockstep
    from gptj.runtime import parse_dtype, set_threads

    # Here, on the thread that runs the engine, before it computes: OpenMP keeps a count per thread.
    if cfg.threads is not None:
        import torch.distributed as dist

        set_threads(max(1, cfg.threads // (dist.get_world_size() if lockstep.active() else 1)))  # each rank builds

    model = lockstep.load_model(path, parse_dtype(cfg.dtype), cfg.device, quantize=cfg.quantize,
                                group_size=cfg.group_size)
    n_positions = model.config.n_positions
    max_len = min(cfg.max_model_len or n_positions, n_positions)
    w = model.transformer.wte.weight
    # Each sequence holds a prompt slot and a tail of up to max_len new tokens.
    n_seqs = cfg.kv_slots or min(cfg.max_batch_size, groups_from_memory(model.config, w.dtype, w.device, max_len,
                                                                        max_len, 1, fraction=0.8))
    return Engine(model, EngineConfig(n_slots=n_seqs, slot_len=max_len, max_new_tokens=max_len,
                                      max_batch_size=min(cfg.max_batch_size, n_seqs),
                                      prefill_chunk=cfg.prefill_chunk, compile=cfg.compile, kernels=cfg.kernels))


def load_served_model(name: str, path: str, cfg: ServerConfig) -> ServedModel:
    """Load a checkpoint and start its engine (blocking: seconds to minutes)."""
    from gptj.parallel import lockstep
    from gptj.tokenizer import tokenizer_for_model

    if not Path(path).is_dir():
        raise GptjError(f"{path}: not a model folder")
    tokenizer = tokenizer_for_model(path)
    loop = lockstep.engine_loop(functools.partial(build_served_engine, path, cfg), batch_wait_ms=cfg.batch_wait_ms)
    engine = loop.engine
    return ServedModel(name, str(path), engine, loop, tokenizer, engine.pool.prompt_len,
                       engine.model.config.vocab_size, capacity=engine.max_batch_size + cfg.max_queue)


def check_under_root(path: str, root: str | None) -> Path:
    """The resolved path, or GptjError if it lies outside `root` (symlinks resolved first)."""
    base = Path(root or ".").resolve()
    resolved = (base / path).resolve() if not Path(path).is_absolute() else Path(path).resolve()
    if resolved != base and base not in resolved.parents:
        raise PermissionError(f"{path}: outside the server's model root")
    return resolved
