"""How many threads torch computes with: the usable cores, the cores kept beside the compute, --threads;
and the OpenMP teams of threads that no longer compute.

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


# Cores a command that has threads besides the compute (`gptj mlperf`: LoadGen's issuing and logging
# threads and the SUT's; `gptj serve`: the event loop, for HTTP, tokenizing, streaming) keeps for them
# when --threads is not given: none, as those threads need little, and on quiet cores computing on every
# core is faster in every scenario. On cores shared with other work, --threads 1 answers sooner.
# Figures: docs/PERFORMANCE.md#threads-mlperf and #threads-serve
RESERVED_CORES = 0


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


def openmp_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes (libgomp / libiomp / libomp) mapped into this process (Linux; else [])."""
    import os

    found: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if line.count(" ") >= 5 else ""
                name = os.path.basename(path)
                if name.startswith(("libgomp", "libiomp", "libomp")) and ".so" in name and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def release_openmp_threads() -> int:
    """Let the calling thread's OpenMP team go (`omp_pause_resource_all(omp_pause_soft)` in every OpenMP
    runtime mapped here): its worker threads exit; a later parallel region on this thread makes a new
    team. Returns how many runtimes did so.

    Why: torch (and gptj.native, on torch's libgomp) keeps a team of workers for each thread that has
    run a parallel region, for as long as that thread lives. libgomp counts the workers of all teams;
    once they outnumber the cores, every team's workers spin only briefly (its throttled spin count)
    before sleeping, so every parallel region pays a wake-up: a 1,024 x 1,024 GEMV took 2.5x its time
    while a thread that had run one region with 2 threads lived on beside it (2 cores). A thread that
    computed once (loaded a model) and then only waits should call this (docs/PERFORMANCE.md, "Which
    thread runs the engine")."""
    import ctypes

    released = 0
    for path in openmp_runtimes():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all  # the copy already mapped
        except (OSError, AttributeError):
            continue  # a runtime before OpenMP 5.0
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        if pause(1) == 0:  # 1: omp_pause_soft
            released += 1
    return released
