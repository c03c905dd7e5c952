"""LoadGen's QSL and SUT over gptj's generation.

The SUT's issue callback never blocks: it stamps the samples and puts them on a queue. One
worker thread forms batches (the scenario's `Batching` policy), runs the backend, and answers
LoadGen with the new token ids as raw bytes (gptj-99: int64; llama3.1-8b: int32) and their count,
as the MLCommons references do, so MLCommons' own evaluation scripts read the accuracy log unchanged.
Greedy answers report their first token to LoadGen (FirstTokenComplete) as soon as the engine makes it.

    Offline       whole issued query, sorted by prompt length, cut into batches of max_batch_size
    Server        dynamic batching: after the first sample, wait up to wait_ms for more,
                  up to max_batch_size (SAX's "BS32 Wait40")
    SingleStream  one sample at a time
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import mlperf_loadgen as lg
import numpy as np

from gptj.decode import GenerationConfig
from gptj.errors import GptjError
from gptj.mlperf.dataset import Dataset

if TYPE_CHECKING:
    from gptj.parallel.context import ParallelContext

SCENARIOS = ("Offline", "Server", "SingleStream")


@dataclass(frozen=True)
class Batching:
    max_batch_size: int = 1
    wait_ms: float = 0.0  # Server: how long to hold a batch open for more samples
    sort_by_length: bool = False  # Offline: group prompts of similar length (less padding)


# Samples at once by default, per scenario and device (the engine runs x num_beams sequences; the
# KV pool still admits only what fits). CPU: 8, where a step's time grows with its rows. CUDA: Offline
# gains samples/s up to 256 at once; Server 64 holds its latency bound.
# Figures: docs/PERFORMANCE.md#gpu-defaults
DEFAULT_BATCH = {("Offline", "cpu"): 8, ("Server", "cpu"): 8, ("Offline", "cuda"): 256, ("Server", "cuda"): 64}


def default_batching(scenario: str, max_batch_size: int | None = None, wait_ms: float | None = None,
                     device: str = "cpu") -> Batching:
    """The scenario's batching; max_batch_size None: DEFAULT_BATCH's for the device's kind."""
    if scenario == "SingleStream":
        return Batching(1, 0.0, False)
    size = max_batch_size or DEFAULT_BATCH[scenario, "cuda" if device.startswith("cuda") else "cpu"]
    if scenario == "Server":
        return Batching(size, 40.0 if wait_ms is None else wait_ms, False)
    return Batching(size, 0.0 if wait_ms is None else wait_ms, True)


class Backend(Protocol):
    """What the SUT runs requests on: the engine in this process (or, later, a remote server).

    `submit` returns at once; `on_done(tokens, error)` is called when the request finishes (from
    another thread), `on_first_token(token)` when its first new token is final (greedy/sampled).
    """

    def submit(self, prompt: Sequence[int], gen: GenerationConfig, on_done: Callable[[list[int], str | None], None],
               on_first_token: Callable[[int], None] | None = None) -> None: ...

    def cancel_all(self) -> None:
        """Stop the work in hand without waiting for it (a Ctrl-C); later `on_done` calls may still come."""

    def close(self) -> None: ...


class EngineBackend:
    """gptj's continuous-batching engine on a background thread. `build(ctx)` makes the engine (loads
    the model) on that thread, which runs it faster than a model loaded elsewhere (EngineLoop);
    `ctx`: the job's context (under --tp / --pp this engine leads the other ranks')."""

    def __init__(self, build, ctx: ParallelContext) -> None:  # noqa: ANN001 - Callable[[ParallelContext], Engine]
        from gptj.parallel import lockstep

        self.loop = lockstep.engine_loop(build, ctx)  # leads the other ranks under --tp / --pp
        self.engine = self.loop.engine
        self._handles: dict[str, object] = {}  # request id -> RequestHandle, until it finishes
        self._lock = threading.Lock()

    def submit(self, prompt, gen, on_done, on_first_token=None) -> None:  # noqa: ANN001 - see Backend
        def on_token(req, token):  # noqa: ANN001
            if on_first_token is not None and len(req.output) == 1:
                on_first_token(token)

        def on_finish(req):  # noqa: ANN001
            with self._lock:
                self._handles.pop(req.request_id, None)
            on_done(req.output, req.error)

        handle = self.loop.submit(prompt, gen, on_token=on_token if gen.num_beams == 1 else None, on_finish=on_finish)
        with self._lock:
            if not handle.done():
                self._handles[handle.request_id] = handle

    def cancel_all(self) -> None:
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            handle.cancel()  # the loop aborts it before its next step and frees its KV

    def close(self) -> None:
        self.loop.shutdown()


class QSL:
    """The dataset is tokenized into RAM up front, so load/unload only track indices."""

    def __init__(self, dataset: Dataset, performance_sample_count: int | None = None) -> None:
        self.dataset = dataset
        self.loaded: set[int] = set()
        count = len(dataset)
        self.performance_sample_count = min(performance_sample_count or count, count)
        self.qsl = lg.ConstructQSL(count, self.performance_sample_count, self._load, self._unload)

    def _load(self, indices: Sequence[int]) -> None:
        self.loaded.update(indices)

    def _unload(self, indices: Sequence[int]) -> None:
        self.loaded.difference_update(indices)

    def destroy(self) -> None:
        lg.DestroyQSL(self.qsl)


@dataclass
class _Item:
    sample_id: int
    index: int
    issued: float  # time.perf_counter() when LoadGen issued it


@dataclass
class SUTStats:
    """What the SUT did: how it batched, and each sample's latency as it saw it."""

    samples: int = 0
    batches: int = 0
    batch_sizes: collections.Counter = field(default_factory=collections.Counter)
    latencies_s: list[float] = field(default_factory=list)  # issue -> complete, per sample
    issued_s: list[float] = field(default_factory=list)  # each of those samples' issue time (perf_counter)
    first_token_s: list[float] = field(default_factory=list)  # issue -> first token (greedy only)
    new_tokens: int = 0
    answered: collections.Counter = field(default_factory=collections.Counter)  # index -> answers
    interrupted: int = 0  # samples answered empty after a Ctrl-C

    @property
    def max_batch(self) -> int:
        return max(self.batch_sizes, default=0)

    @property
    def mean_batch(self) -> float:
        return self.samples / self.batches if self.batches else 0.0


class SUT:
    def __init__(self, backend: Backend, dataset: Dataset, gen: GenerationConfig, batching: Batching,
                 on_complete: Callable[[int], None] | None = None, first_token_at_end: bool = False,
                 token_dtype: type = np.int64) -> None:
        """`first_token_at_end`: report each answer's first token to LoadGen with the answer (beam
        search has no final token before it ends; LoadGen's use_token_latencies wants one).
        `token_dtype`: how the answers' token ids are laid out for LoadGen (its accuracy log)."""
        self.backend, self.dataset, self.gen, self.batching = backend, dataset, gen, batching
        self.token_dtype = token_dtype
        self.first_token_at_end = first_token_at_end
        self.stats = SUTStats()
        self._lock = threading.Lock()  # completions arrive on the engine's thread
        self.error: BaseException | None = None
        self._on_complete = on_complete
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._pending: list[_Item] = []
        # Every sample LoadGen issued and nobody answered yet (sample id -> item). An answer is sent
        # only for a sample taken out of it, under _answer_lock, so each sample is answered once
        # and its first token never follows its completion, even when interrupt() answers for it.
        self._outstanding: dict[int, _Item] = {}
        self._answer_lock = threading.Lock()
        self.interrupted = False  # interrupt(): every sample is answered at once, empty
        self.abandoned = False  # abandon(): no more answers (the process is about to exit)
        self._worker = threading.Thread(target=self._loop, name="gptj-sut", daemon=True)
        self._worker.start()
        self.sut = lg.ConstructSUT(self._issue_queries, self._flush_queries)

    # --- LoadGen callbacks (must not block) ---

    def _issue_queries(self, samples: Sequence[lg.QuerySample]) -> None:
        now = time.perf_counter()
        items = [_Item(s.id, s.index, now) for s in samples]
        with self._answer_lock:
            for item in items:
                self._outstanding[item.sample_id] = item
        if self.interrupted:
            self._answer_empty(items)
            return
        for item in items:
            self._queue.put(item)

    def _flush_queries(self) -> None:
        pass  # every issued sample is answered as soon as its batch is done

    # --- worker ---

    def _next_batch(self) -> list[_Item] | None:
        if not self._pending:
            first = self._queue.get()
            if first is None:
                return None
            self._pending.append(first)
            deadline = time.perf_counter() + self.batching.wait_ms / 1000.0
            while len(self._pending) < self.batching.max_batch_size:
                left = deadline - time.perf_counter()
                try:
                    item = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)  # stop after this batch
                    break
                self._pending.append(item)
        while True:  # take whatever else is already waiting (Offline: the rest of the query)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)
                break
            self._pending.append(item)
        if self.batching.sort_by_length:
            self._pending.sort(key=lambda it: len(self.dataset.input_ids[it.index]), reverse=True)
        n = self.batching.max_batch_size
        batch, self._pending = self._pending[:n], self._pending[n:]
        return batch

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            if self.interrupted:
                self._pending.clear()  # interrupt() answered these, and the rest
                continue
            with self._lock:
                self.stats.batches += 1
                self.stats.batch_sizes[len(batch)] += 1
            for item in batch:  # submitted together, so the engine admits them in the same step
                on_first = (lambda tok, it=item: self._first_token(it, tok)) if self.gen.num_beams == 1 else None
                try:
                    self.backend.submit(self.dataset.input_ids[item.index], self.gen,
                                        on_done=lambda toks, err, it=item: self._complete(it, toks, err),
                                        on_first_token=on_first)
                except BaseException as e:  # noqa: BLE001 - LoadGen must still get an answer or it waits forever
                    self._complete(item, [], f"{type(e).__name__}: {e}")

    def _first_token(self, item: _Item, token: int) -> None:
        a = np.array([token], dtype=self.token_dtype)
        with self._answer_lock:
            if self.abandoned or self._outstanding.get(item.sample_id) is not item:
                return  # already answered (interrupted)
            lg.FirstTokenComplete([lg.QuerySampleResponse(item.sample_id, a.ctypes.data, a.nbytes, 1)])
        with self._lock:
            self.stats.first_token_s.append(time.perf_counter() - item.issued)

    def _complete(self, item: _Item, tokens: list[int], error: str | None) -> None:
        a = np.asarray([] if error is not None else tokens, dtype=self.token_dtype)  # alive until LoadGen copied it
        with self._answer_lock:
            if self.abandoned or self._outstanding.pop(item.sample_id, None) is not item:
                return  # already answered (interrupted): a late answer of a cancelled request
            if error is not None:
                with self._lock:
                    self.error = self.error or GptjError(f"sample {item.index}: {error}")
            if self.first_token_at_end:
                lg.FirstTokenComplete([lg.QuerySampleResponse(item.sample_id, a.ctypes.data, a.itemsize if len(a) else 0,
                                                              min(1, len(a)))])
            lg.QuerySamplesComplete([lg.QuerySampleResponse(item.sample_id, a.ctypes.data, a.nbytes, len(a))])
        with self._lock:
            st = self.stats
            st.samples += 1
            st.new_tokens += len(a)
            st.latencies_s.append(time.perf_counter() - item.issued)
            st.issued_s.append(item.issued)
            st.answered[item.index] += 1
        if self._on_complete is not None:
            self._on_complete(1)

    # --- Ctrl-C ---

    def _answer_empty(self, items: Sequence[_Item]) -> None:
        with self._answer_lock:
            if self.abandoned:
                return
            taken = [it for it in items if self._outstanding.pop(it.sample_id, None) is it]
            if taken:
                lg.QuerySamplesComplete([lg.QuerySampleResponse(it.sample_id, 0, 0, 0) for it in taken])
        with self._lock:
            self.stats.interrupted += len(taken)

    def interrupt(self) -> None:
        """Answer every outstanding sample now, and every later one as it comes, with no tokens, and
        cancel the backend's work: LoadGen then ends its test as soon as its schedule lets it
        (Offline at once; Server and SingleStream performance runs keep their schedule's time)."""
        self.interrupted = True
        with self._answer_lock:
            items = list(self._outstanding.values())
        self._answer_empty(items)
        self.backend.cancel_all()

    def abandon(self) -> None:
        """Answer nothing more: the process exits with LoadGen's test still running, and its logs
        must stop growing."""
        with self._answer_lock:
            self.abandoned = True
            self.interrupted = True

    def stop(self) -> None:
        self._queue.put(None)
        self._worker.join()
        self.backend.close()
        lg.DestroySUT(self.sut)
