"""How many threads torch computes with: the usable cores, the cores kept beside the compute, --threads.

torch is imported inside the functions so that `gptj --help` starts without it.
"""

from __future__ import annotations

from gptj.errors import GptjError


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask: a container's or taskset's share)."""
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# Cores a command that has threads besides the compute keeps for them when --threads is not given.
# `gptj mlperf`: none. LoadGen's issuing and logging threads and the SUT's need little; on 2 quiet cores
# (the ~0.2 B model, AVX2 paths, 2026-11-27) computing on both gave 1.9x Offline's samples/s, Server
# p50 latency 1.3 s against 8.8 s at 1 QPS, SingleStream p50 0.8 s against 1.3 s. On 2 cores shared
# with other work, every core computing was 5-30x slower (docs/PERFORMANCE.md, "Threads in gptj
# mlperf"): there, --threads 1. An MLPerf run wants a machine of its own anyway.
RESERVED_CORES = 0
# `gptj serve`: none. Its event loop (HTTP, tokenizing, streaming) needs little beside the compute:
# on a quiet 2-core machine, 2 compute threads served the ~0.2 B model 1.5-1.9x the output tokens/s
# of 1 with about half the TTFT p99 (600-token prompts, 1-32 clients on the same cores), and the tiny
# model alike (docs/PERFORMANCE.md, "Threads in gptj serve"). Keeping a core paid only on cores
# shared with other work; --threads is for that.
SERVE_RESERVED_CORES = 0


def compute_threads(requested: int | None = None, reserve: int = 0) -> int:
    """How many threads torch computes with: `requested` (--threads) if given, else the usable cores
    less `reserve` (cores left to threads that must stay responsive beside the compute: see
    RESERVED_CORES), and at least 1."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise GptjError(f"threads must be an integer >= 1, got {requested!r}")
        return requested
    return max(1, usable_cores() - max(0, reserve))


def set_threads(requested: int | None = None, reserve: int = 0) -> int:
    """torch.set_num_threads(compute_threads(requested, reserve)); returns the number set."""
    import torch

    n = compute_threads(requested, reserve)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
