"""How an engine is sized: `EngineConfig` (what was asked) and `plan_kv` (the one rule that turns it,
the model and the free memory into a `KVPlan`: blocks, tokens per sequence, sequences per step).

KV memory is paged (engine/kv.py): `n_blocks` blocks of `block_size` tokens, each holding every
layer's keys and values for those tokens. A sequence takes blocks as it grows, so a 300-token
prompt holds 300 tokens' worth, not the longest prompt's; requests are admitted by free blocks.
"""

from __future__ import annotations

import math
import os
import dataclasses
from dataclasses import dataclass

import torch

from gptj.config import GPTJConfig
from gptj.errors import GptjError
from gptj.policy import PACK_MODES

COMPILE_MODES = ("auto", "on", "off")
GRAPH_MODES = ("auto", "off")  # CUDA-graph decode (engine/graphs.py): auto = on CUDA with the cuda attention backend
# KV storage: "auto" the model's float dtype; "int8" int8 keys and values with a float32 scale per
# token and head (max |x| / 127 of that head's D values, as vLLM's and TensorRT-LLM's int8 / fp8 KV
# caches scale theirs): (D + 4) bytes where bfloat16 takes 2 D, so 1.97x the tokens at GPT-J's D = 256.
# "fp8": e4m3 values with the same kind of scale (max |x| / 448), the same bytes: within 2**-4 of
# each value (relative) where int8 is within s / 2 of it (absolute), so e4m3 is the closer of the two
# for values below 1/16 of their head's largest, int8 above (gptj.quant.ops's FP8 bounds). TensorRT-LLM's
# MLPerf GPT-J runs use an FP8 KV cache; on CUDA the attention kernels read either in place.
KV_DTYPES = ("auto", "int8", "fp8")
QUANTIZED_KV = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}  # kv_dtype -> storage
KV_SCALE_DTYPE = torch.float32
BLOCK_SIZES = (8, 16, 32, 64, 128)
DEFAULT_MAX_SEQS = 256  # running sequences per step when nothing else bounds them (vLLM's max_num_seqs)


@dataclass(frozen=True)
class EngineConfig:
    max_seqs: int | None = None  # sequences running at once (beams count each); None: as KV memory allows
    max_len: int | None = None  # prompt + new tokens per sequence; None: the model's n_positions
    kv_blocks: int | None = None  # KV blocks; None: max_seqs full-length sequences, within memory_fraction
    block_size: int = 16  # tokens per KV block
    prefix_caching: bool = True  # reuse full blocks of a prompt prefix computed before
    memory_fraction: float = 0.5  # of free memory, at most, when sizing KV blocks from it
    max_prefill_tokens: int = 4096  # prompt tokens admitted per step (at least one prompt)
    prefill_chunk: int | None = None  # prompt tokens prefilled per step, in chunks; None: whole prompts
    kernels: str = "auto"  # decode attention by gptj.native when it can ("auto"), or never ("off")
    compile: str = "auto"  # decode attention by torch.compile: "auto" (below float32), "on", "off"
    kv_dtype: str = "auto"  # KV storage (KV_DTYPES): the model's float dtype, or int8 / fp8 with per-token-head scales
    cuda_graphs: str = "auto"  # decode-only steps replayed from CUDA graphs (GRAPH_MODES)
    # on a CPU: choose the compute threads (up to those set where the engine steps) from the decode
    # steps' own times, so cores shared with other work do not stall every step (gptj.threads.ThreadTuner).
    # The commands turn it on unless --threads is given (runtime.flags.engine_config, serve_engine_config);
    # off here, an engine used as a library keeps its caller's thread count.
    adapt_threads: bool = False

    def __post_init__(self) -> None:
        for name in ("max_seqs", "max_len", "kv_blocks", "prefill_chunk"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise GptjError(f"engine {name} must be a positive integer, got {value!r}")
        if self.block_size not in BLOCK_SIZES:
            raise GptjError(f"engine block_size must be one of {', '.join(map(str, BLOCK_SIZES))}, "
                            f"got {self.block_size!r}")
        if self.max_prefill_tokens < 1:
            raise GptjError(f"engine max_prefill_tokens must be positive, got {self.max_prefill_tokens}")
        if self.kernels not in PACK_MODES:
            raise GptjError(f"engine kernels must be one of {', '.join(PACK_MODES)}, got {self.kernels!r}")
        if self.compile not in COMPILE_MODES:
            raise GptjError(f"engine compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        if self.cuda_graphs not in GRAPH_MODES:
            raise GptjError(f"engine cuda_graphs must be one of {', '.join(GRAPH_MODES)}, got {self.cuda_graphs!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise GptjError(f"engine kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if not 0 < self.memory_fraction <= 1:
            raise GptjError(f"engine memory_fraction must be in (0, 1], got {self.memory_fraction}")


DRAFT_ROWS_PER_SEQ = 16  # KVPlan.draft_rows: room for HF's default prompt_lookup_num_tokens (10) at every sequence


@dataclass(frozen=True)
class KVPlan:
    """An engine's size, decided once by `plan_kv`."""

    block_size: int
    n_blocks: int
    max_len: int  # prompt + new tokens per sequence
    max_seqs: int  # sequences running at once
    block_bytes: int  # one block, all layers, keys and values
    ranks: int = 1  # the ranks whose forwards run together (--tp / --pp): more than one, each forward is collective

    @property
    def draft_rows(self) -> int:
        """The decode rows a step's drafts may add beyond one a sequence (speculation: a draft of k
        tokens is k more rows, engine/scheduler.py), DRAFT_ROWS_PER_SEQ a running sequence."""
        return self.max_seqs * DRAFT_ROWS_PER_SEQ

    @property
    def blocks_per_seq(self) -> int:
        """Blocks one sequence of max_len tokens takes."""
        return math.ceil(self.max_len / self.block_size)

    @property
    def tokens(self) -> int:
        return self.n_blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.n_blocks * self.block_bytes


def kv_storage(model_dtype: torch.dtype, kv_dtype: str = "auto") -> torch.dtype:
    """The dtype KV memory holds: the model's float dtype, or int8 / e4m3 (EngineConfig.kv_dtype)."""
    return QUANTIZED_KV.get(kv_dtype, model_dtype)


def kv_bytes_per_token(config: GPTJConfig, dtype: torch.dtype, n_head: int | None = None) -> int:
    """Bytes of keys + values one token takes over all layers (n_head: this rank's heads); `dtype`
    the storage (kv_storage): int8 and e4m3 add one KV_SCALE_DTYPE scale per head."""
    heads = n_head or config.n_head
    per_head = config.head_dim * torch.empty((), dtype=dtype).element_size()
    if dtype in QUANTIZED_KV.values():
        per_head += torch.empty((), dtype=KV_SCALE_DTYPE).element_size()
    return 2 * config.n_layer * heads * per_head


def available_memory_bytes(device: torch.device) -> int:
    """Free memory now: CUDA's free bytes, or MemAvailable from /proc/meminfo."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def admission_watermark(n_blocks: int) -> int:
    """Blocks the scheduler keeps free when it admits a request beside running ones, so that they
    can grow a while before anyone waits for a block (vLLM keeps 1 %)."""
    return max(1, n_blocks // 100)


def blocks_to_admit(needed: int) -> int:
    """The fewest blocks of which `needed` are free beyond the admission watermark: a pool that
    admits requests holding `needed` blocks all in one step."""
    n = needed + 1
    while n - admission_watermark(n) < needed:
        n += 1
    return n


def plan_kv(model_config: GPTJConfig, model_dtype: torch.dtype, device: torch.device | str, cfg: EngineConfig,
            n_head: int | None = None, free_bytes: int | None = None) -> KVPlan:
    """The engine's KV blocks and limits; the only place they are derived. KV storage: cfg.kv_dtype
    over the model's float dtype (kv_storage).

    n_blocks: `kv_blocks` when given; else enough for `max_seqs` (default DEFAULT_MAX_SEQS) sequences
    of max_len tokens, but at most memory_fraction of the free memory, and at least one sequence of
    max_len tokens (a request that fits max_len must be able to run alone).
    max_seqs: as given, else DEFAULT_MAX_SEQS, but no more than the blocks can start (one each).
    """
    device = torch.device(device)
    B = cfg.block_size
    max_len = min(cfg.max_len or model_config.n_positions, model_config.n_positions)
    block_bytes = kv_bytes_per_token(model_config, kv_storage(model_dtype, cfg.kv_dtype), n_head) * B
    per_seq = math.ceil(max_len / B)
    if cfg.kv_blocks is not None:
        n_blocks = cfg.kv_blocks
    else:
        free = available_memory_bytes(device) if free_bytes is None else free_bytes
        n_blocks = min((cfg.max_seqs or DEFAULT_MAX_SEQS) * per_seq, int(free * cfg.memory_fraction) // block_bytes)
        n_blocks = max(n_blocks, per_seq)
    max_seqs = cfg.max_seqs or min(DEFAULT_MAX_SEQS, n_blocks)
    return KVPlan(B, n_blocks, max_len, max_seqs, block_bytes)


@dataclass
class StepTimes:
    """Where the engine's steps spent the host's wall time, in seconds summed since the start (or
    since Engine.warm). On a GPU the forward and the sampler only queue work, and the step's one
    device-to-host copy (the sampler's) is where the host waits for the device: `wait` large against
    the rest means the device bounds the step; small, the host does (its time adds to the device's,
    not overlapping it). On a CPU the forward's compute is in `forward`."""

    steps: int = 0
    decode_rows: int = 0  # sequences decoded, summed over the steps
    schedule: float = 0.0  # the scheduler: what runs, admissions, block tables
    forward: float = 0.0  # the runner: inputs, the forward (on a GPU: queued)
    wait: float = 0.0  # the sampler's device-to-host copy of the step's choices
    update: float = 0.0  # the rest of the update: the sampler's ops, beams' state, block tables, retiring
    prefill_steps: int = 0  # of the steps, those that prefilled (a prompt chunk, with or without decode rows)
    prefill_seconds: float = 0.0  # their wall time, all phases (the rest is decode-only steps')

    PHASES = ("schedule", "forward", "wait", "update")

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default)

    def per_step_ms(self) -> dict[str, float]:
        """Each phase's mean per step, in ms, with the step's total and its mean decode rows."""
        n = max(self.steps, 1)
        out = {k: 1000 * getattr(self, k) / n for k in self.PHASES}
        return {**out, "step": sum(out.values()), "decode_rows": self.decode_rows / n}

    def decode_step_ms(self) -> float:
        """The mean wall time of the steps that only decoded (no prompt chunk), in ms (nan: none ran)."""
        n = self.steps - self.prefill_steps
        total = sum(getattr(self, k) for k in self.PHASES) - self.prefill_seconds
        return 1000 * total / n if n > 0 else float("nan")

    def line(self) -> str:
        """One line for a report: per step, each phase's ms."""
        ms = self.per_step_ms()
        return (f"{self.steps} steps, {ms['decode_rows']:.1f} sequences decoded a step on average; per step "
                f"{ms['step']:.2f} ms: " + ", ".join(f"{k} {ms[k]:.2f}" for k in self.PHASES))


@dataclass(frozen=True)
class EngineStats:
    """What serve, metrics and tests read of an engine (a snapshot; cheap to take)."""

    waiting: int  # requests admitted to the engine, not yet running
    running: int  # requests running
    running_seqs: int  # their sequences (beams count each)
    max_seqs: int
    max_len: int
    blocks_total: int
    blocks_free: int  # free now, counting cached blocks no request holds (they can be evicted)
    blocks_cached: int  # blocks that hold a reusable prompt prefix (held or not)
    prefix_queried_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int  # of which found
    preemptions: int  # times a request's blocks were taken back for older ones
    stalls: int  # request-steps a prefilled request waited for a free block (keeping its own)
    prefill_tokens: int  # tokens prefilled (computed, not found in the prefix cache), since the start
    steps: int
    draft_tokens: int = 0  # speculation: drafted tokens verified (gptj.engine.draft), since the start
    accepted_tokens: int = 0  # of which taken (each one a token that cost no step of its own)
    times: StepTimes | None = None  # where the steps' time went (a copy)
    threads: int = 0  # the compute threads of the next step (the thread tuner's choice on a CPU; 0: unknown)
    thread_steps: tuple[tuple[int, int], ...] = ()  # (threads, decode steps the tuner timed at that count)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.blocks_free / self.blocks_total

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0
