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


class ThreadTuner:
    """Chooses, step by step, how many threads an engine computes with, from the steps' own times.

    Why: a parallel region ends when its slowest thread does. On quiet cores every thread runs at
    once and all the cores are fastest; on cores shared with other busy processes a thread is often
    descheduled, and every region then waits a scheduler's time slice for it: a 0.2B model's batch-1
    decode fell from 87 to 2 tok/s at 2 threads beside two busy processes on 2 cores, where 1 thread
    gave 10 (docs/PERFORMANCE.md#contention). No setting fits both, so the engine measures.

    How: steps are timed by `key` (the engine's: decode-only steps by their rows, in powers of two;
    other steps are not compared). The engine runs `current` threads; every `interval` timed steps
    it tries a neighbour (half or twice `current`, within [1, max_threads]) for `probe_steps` steps
    and moves to it if those steps' median time beats the current's recent median by `margin`. A
    probe that loses doubles the interval (up to `max_interval`: on quiet cores the probes cost
    little); a move, or a sudden change of the current's step times (its last few steps' median
    `shift` times slower or faster than at the last decision: other work came or went), probes again
    soon. Plain data in, a thread count out: the engine sets it (gptj.engine.core)."""

    def __init__(self, max_threads: int, probe_steps: int = 3, window: int = 8, min_interval: int = 16,
                 max_interval: int = 1024, margin: float = 0.1, shift: float = 1.5) -> None:
        if max_threads < 1:
            raise GptjError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads, self.current = max_threads, max_threads
        self.probe_steps, self.window, self.margin, self.shift = probe_steps, window, margin, shift
        self.min_interval, self.max_interval = min_interval, max_interval
        self.interval = probe_steps  # the first probe comes early: a short generation gains from it too
        self.since = 0  # timed steps since the last probe ended
        self.probing: int | None = None  # the thread count being tried
        self.probe_times: dict[object, list[float]] = {}  # key -> the probe's step times
        self.probe_left = 0  # steps the probe may still take (a probe of keys that never repeat ends)
        self.times: dict[tuple, list[float]] = {}  # (key, threads) -> recent step times
        self.settled: dict[tuple, float] = {}  # key -> the current's median at the last decision
        self.down = True  # the direction of the next probe when both are possible
        self.moves = 0  # how often the count changed (stats, tests)
        self.steps_at: dict[int, int] = {}  # timed steps run at each thread count

    @property
    def threads(self) -> int:
        """The thread count for the next step."""
        return self.probing if self.probing is not None else self.current

    def observe(self, key: object, seconds: float) -> None:
        """A step of `key` took `seconds` with `self.threads` threads."""
        self.steps_at[self.threads] = self.steps_at.get(self.threads, 0) + 1
        if self.max_threads == 1:
            return
        if self.probing is not None:
            self._record(key, self.probing, seconds)
            times = self.probe_times.setdefault(key, [])
            times.append(seconds)
            self.probe_left -= 1
            if len(times) >= self.probe_steps:
                self._decide(key, times)
            elif self.probe_left <= 0:  # no key came often enough to compare: stay, and try later
                self.probing, self.probe_times = None, {}
                self.interval = min(self.max_interval, self.interval * 2)
            return
        recent = self._record(key, self.current, seconds)
        self.since += 1
        settled = self.settled.get(key)
        if settled is None and len(recent) >= self.probe_steps:
            self.settled[key] = _median(recent)
        elif settled is not None and len(recent) >= 4:
            now = _median(recent[-4:])
            if now > settled * self.shift or now * self.shift < settled:  # other work came or went
                del recent[:-4]  # the probe is compared with the current's times since the change
                self.settled[key] = now
                self.interval = self.min_interval
                self._start_probe()
                return
        if self.since >= self.interval and len(recent) >= self.probe_steps:
            self._start_probe()

    def _record(self, key: object, threads: int, seconds: float) -> list[float]:
        times = self.times.setdefault((key, threads), [])
        times.append(seconds)
        del times[:-self.window]
        return times

    def _start_probe(self) -> None:
        lower, higher = max(1, self.current // 2), min(self.max_threads, self.current * 2)
        options = [n for n in ((lower, higher) if self.down else (higher, lower)) if n != self.current]
        self.down = not self.down
        self.probing, self.probe_times, self.since = options[0], {}, 0
        self.probe_left = 4 * self.probe_steps
        for k in [k for k in self.times if k[1] == self.probing]:  # its old times may be from other conditions
            del self.times[k]

    def _decide(self, key: object, tried_times: list[float]) -> None:
        tried, self.probing = self.probing, None
        mine = self.times.get((key, self.current), [])
        if mine and _median(tried_times) < _median(mine) * (1 - self.margin):
            self.current, self.interval = tried, self.min_interval
            self.moves += 1
        else:
            self.interval = min(self.max_interval, self.interval * 2)
        recent = self.times.get((key, self.current), [])
        if recent:
            self.settled[key] = _median(recent)
        self.probe_times = {}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
