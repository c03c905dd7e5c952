"""LoadGen's QSL and SUT over gptj's generation.

The SUT's issue callback never blocks: it stamps the samples and puts them on a queue. One
worker thread forms batches (the scenario's `Batching` policy), runs the backend, and answers
LoadGen with the new token ids as raw int64 bytes and their count, as the MLCommons reference
does, so MLCommons' own evaluation script reads the accuracy log unchanged.

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
from typing import Protocol

import mlperf_loadgen as lg
import numpy as np

from gptj.decode import GenerationConfig
from gptj.mlperf.dataset import Dataset

SCENARIOS = ("Offline", "Server", "SingleStream")


@dataclass(frozen=True)
class Batching:
    max_batch_size: int = 1
    wait_ms: float = 0.0  # Server: how long to hold a batch open for more samples
    sort_by_length: bool = False  # Offline: group prompts of similar length (less padding)


def default_batching(scenario: str, max_batch_size: int | None = None, wait_ms: float | None = None) -> Batching:
    if scenario == "SingleStream":
        return Batching(1, 0.0, False)
    if scenario == "Server":
        return Batching(max_batch_size or 8, 40.0 if wait_ms is None else wait_ms, False)
    return Batching(max_batch_size or 8, 0.0 if wait_ms is None else wait_ms, True)


class Backend(Protocol):
    """What the SUT runs: token ids in, new token ids out (in-process model or a remote server)."""

    def generate(self, prompts: Sequence[Sequence[int]], gen: GenerationConfig,
                 on_first_token: Callable[[list[int]], None] | None = None) -> list[list[int]]: ...


class LocalBackend:
    """gptj's generation on a model in this process."""

    def __init__(self, model) -> None:  # noqa: ANN001 - a GPTJForCausalLM
        self.model = model

    def generate(self, prompts, gen, on_first_token=None):  # noqa: ANN001 - see Backend
        import torch

        from gptj.decode import generate

        with torch.inference_mode():
            return generate(self.model, prompts, gen, on_first_token=on_first_token)


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
    first_token_s: list[float] = field(default_factory=list)  # issue -> first token (greedy only)
    new_tokens: int = 0
    answered: collections.Counter = field(default_factory=collections.Counter)  # index -> answers

    @property
    def max_batch(self) -> int:
        return max(self.batch_sizes, default=0)

    @property
    def mean_batch(self) -> float:
        return self.samples / self.batches if self.batches else 0.0


class SUT:
    def __init__(self, backend: Backend, dataset: Dataset, gen: GenerationConfig, batching: Batching,
                 on_complete: Callable[[int], None] | None = None) -> None:
        self.backend, self.dataset, self.gen, self.batching = backend, dataset, gen, batching
        self.stats = SUTStats()
        self.error: BaseException | None = None
        self._on_complete = on_complete
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._pending: list[_Item] = []
        self._worker = threading.Thread(target=self._loop, name="gptj-sut", daemon=True)
        self._worker.start()
        self.sut = lg.ConstructSUT(self._issue_queries, self._flush_queries)

    # --- LoadGen callbacks (must not block) ---

    def _issue_queries(self, samples: Sequence[lg.QuerySample]) -> None:
        now = time.perf_counter()
        for s in samples:
            self._queue.put(_Item(s.id, s.index, now))

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
            prompts = [self.dataset.input_ids[it.index] for it in batch]
            on_first = (lambda toks, b=batch: self._first_tokens(b, toks)) if self.gen.num_beams == 1 else None
            try:
                outputs = self.backend.generate(prompts, self.gen, on_first_token=on_first)
            except BaseException as e:  # noqa: BLE001 - LoadGen must still get answers or it waits forever
                if self.error is None:
                    self.error = e
                outputs = [[] for _ in batch]
            self._complete(batch, outputs)

    def _first_tokens(self, batch: list[_Item], tokens: list[int]) -> None:
        now = time.perf_counter()
        arrays = [np.array([t], dtype=np.int64) for t in tokens]
        responses = [lg.QuerySampleResponse(it.sample_id, a.ctypes.data, a.nbytes, 1) for it, a in zip(batch, arrays)]
        lg.FirstTokenComplete(responses)
        self.stats.first_token_s.extend(now - it.issued for it in batch)

    def _complete(self, batch: list[_Item], outputs: list[list[int]]) -> None:
        arrays = [np.asarray(out, dtype=np.int64) for out in outputs]  # kept alive until LoadGen copied them
        responses = [lg.QuerySampleResponse(it.sample_id, a.ctypes.data, a.nbytes, len(a))
                     for it, a in zip(batch, arrays)]
        lg.QuerySamplesComplete(responses)
        now = time.perf_counter()
        st = self.stats
        st.batches += 1
        st.batch_sizes[len(batch)] += 1
        st.samples += len(batch)
        st.new_tokens += sum(len(a) for a in arrays)
        st.latencies_s.extend(now - it.issued for it in batch)
        st.answered.update(it.index for it in batch)
        if self._on_complete is not None:
            self._on_complete(len(batch))

    def stop(self) -> None:
        self._queue.put(None)
        self._worker.join()
        lg.DestroySUT(self.sut)
