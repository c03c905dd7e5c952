"""How many threads torch computes with: the usable cores, the cores kept beside the compute, --threads;
and the OpenMP teams of threads that no longer compute.

torch is imported inside the functions so that `gptj --help` starts without it.
"""

from __future__ import annotations

import threading

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


class ThreadTuner:
    """Chooses, step by step, how many threads an engine computes with, from the steps' own times.

    Why: a parallel region ends when its slowest thread does. On quiet cores every thread runs at
    once and all the cores are fastest; on cores shared with other busy processes a thread is often
    descheduled, and every region then waits a scheduler's time slice for it: beside two busy
    processes on 2 cores, 1 thread decodes several times faster than 2 (docs/PERFORMANCE.md#contention),
    on quiet cores 2 threads are faster. No setting fits both, so the engine measures.

    What it reads: each timed step's wall time and the process's CPU time over it. Their ratio per
    thread, the utilization, is near 1 while the threads have the cores (a waiting OpenMP thread
    spins, which counts) and falls toward the cores' share when other work takes them (0.5 for 2
    threads beside 2 busy processes on 2 cores). Steps are compared by `key` (the engine's: decode
    steps by their rows, in powers of two); other steps are not timed.

    What it does: it runs `current` threads and tries a neighbour (half or twice) for `probe_steps`
    steps, moving when those steps' median time beats the current's recent median by `margin`:
      - fewer threads, when the recent utilization falls below `low` (the cores are shared);
      - more threads, when it rises above `high` (they are free again), and now and then anyway.
    Each reason waits `interval[reason]` steps between its probes, doubled by a probe that loses (up
    to `max_interval`) and reset by a move; a probe step 3x slower than the current's loses at once. On quiet cores at every thread it never probes: the
    steps cost what they did. Plain data in, a thread count out: the engine sets it."""

    def __init__(self, max_threads: int, probe_steps: int = 3, window: int = 8, min_interval: int = 4,
                 max_interval: int = 1024, margin: float = 0.1, low: float = 0.8, high: float = 0.92) -> None:
        if max_threads < 1:
            raise GptjError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads, self.current = max_threads, max_threads
        self.probe_steps, self.window, self.margin, self.low, self.high = probe_steps, window, margin, low, high
        self.min_interval, self.max_interval = min_interval, max_interval
        self.interval = self._fresh_intervals()  # steps between probes, by why they are made
        self.why = ""  # why the probe under way was made
        self.since = 0  # timed steps at `current` since the last probe ended (or the count changed)
        self.probing: int | None = None  # the thread count being tried
        self.probe_times: dict[object, list[float]] = {}  # key -> the probe's step times
        self.probe_left = 0  # steps the probe may still take (a probe of keys that never repeat ends)
        self.times: dict[tuple, list[float]] = {}  # (key, threads) -> recent step times
        self.usage: list[float] = []  # utilization of the current's recent steps
        self.moves = 0  # how often the count changed (stats, tests)
        self.steps_at: dict[int, int] = {}  # timed steps run at each thread count

    @property
    def threads(self) -> int:
        """The thread count for the next step."""
        return self.probing if self.probing is not None else self.current

    def observe(self, key: object, seconds: float, cpu_seconds: float | None = None) -> None:
        """A step of `key` took `seconds` of wall time and the process `cpu_seconds` of CPU time
        (None: unknown, read as the cores being free) with `self.threads` threads."""
        threads = self.threads
        self.steps_at[threads] = self.steps_at.get(threads, 0) + 1
        if self.max_threads == 1:
            return
        if self.probing is not None:
            self._record(key, self.probing, seconds)
            times = self.probe_times.setdefault(key, [])
            times.append(seconds)
            self.probe_left -= 1
            mine = self.times.get((key, self.current), [])[-self.probe_steps:]
            if mine and seconds > 3 * _median(mine):  # clearly worse: one such step is enough to know
                self._lost(self.probing)
            elif len(times) >= self.probe_steps:
                self._decide(key, times)
            elif self.probe_left <= 0:  # no key came often enough to compare: stay, and try later
                self._lost(self.probing)
            return
        recent = self._record(key, self.current, seconds)
        self.usage.append(1.0 if cpu_seconds is None or seconds <= 0 else cpu_seconds / (seconds * threads))
        del self.usage[:-8]
        self.since += 1
        if len(recent) < self.probe_steps or len(self.usage) < 4:
            return
        if self.current > 1 and _median(self.usage[-4:]) < self.low:  # shared: soon said, soon acted on
            self._maybe_probe("shared", max(1, self.current // 2))
        elif self.current < self.max_threads:  # free again: the scheduler gives a core for a few steps at a
            # time, so a longer view (8 steps) tells a core of its own from a lucky stretch
            free = len(self.usage) == 8 and _median(self.usage) > self.high
            self._maybe_probe("free" if free else "now and then", min(self.max_threads, self.current * 2))

    def _fresh_intervals(self) -> dict[str, int]:
        # cores shared: try fewer soon; cores free again: try more soon; otherwise more, now and then
        return {"shared": self.min_interval, "free": self.min_interval, "now and then": 4 * self.min_interval}

    def _maybe_probe(self, why: str, threads: int) -> None:
        if self.since >= self.interval[why]:
            self.why = why
            self._start_probe(threads)

    def _record(self, key: object, threads: int, seconds: float) -> list[float]:
        times = self.times.setdefault((key, threads), [])
        times.append(seconds)
        del times[:-self.window]
        return times

    def _start_probe(self, threads: int) -> None:
        self.probing, self.probe_times, self.probe_left = threads, {}, 4 * self.probe_steps
        for k in [k for k in self.times if k[1] == threads]:  # its old times may be from other conditions
            del self.times[k]

    def _decide(self, key: object, tried_times: list[float]) -> None:
        tried = self.probing
        mine = self.times.get((key, self.current), [])[-self.probe_steps:]  # its latest: conditions change
        if mine and _median(tried_times) < _median(mine) * (1 - self.margin):
            self.interval = self._fresh_intervals()
            self.current, self.probing, self.probe_times, self.since, self.usage = tried, None, {}, 0, []
            self.moves += 1
        else:
            self._lost(tried)

    def _lost(self, tried: int) -> None:
        self.interval[self.why] = min(self.max_interval, self.interval[self.why] * 2)
        self.probing, self.probe_times, self.since = None, {}, 0


def name_os_thread(name: str) -> bool:
    """Give the calling thread `name` (up to 15 bytes) as the OS sees it (Linux: /proc/PID/task/TID/comm,
    `top -H`, py-spy). Threads it starts later (its OpenMP team's workers) inherit the name, so a
    profile tells the engine's compute from the event loop's. False where the OS has no such call."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        return libc.prctl(15, name.encode()[:15], 0, 0, 0) == 0  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        return False


_tuners = threading.local()  # each thread's tuner, kept from one engine to the next (tuner_for)


def tuner_for(threads: int) -> ThreadTuner:
    """The calling thread's ThreadTuner for engines stepped here with up to `threads` threads: the one an
    earlier engine left (what it learned of the cores holds for the next: an engine rebuilt per call
    starts where the last one ended) when `threads` is its ceiling or its choice, else a fresh one up
    to `threads` (the caller set another count)."""
    tuner = getattr(_tuners, "tuner", None)
    if tuner is None or threads not in (tuner.max_threads, tuner.threads):
        tuner = _tuners.tuner = ThreadTuner(threads)
    return tuner


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
