"""Prometheus metrics of one server (its own registry, so several apps can share a process).

Counters and histograms are updated by the handlers as requests finish; the engine's figures (queue
depth, running sequences, KV blocks used and cached, the prefix cache's hit rate, preemptions,
speculation's drafted and accepted tokens, tokens/s) are read from each served model's engine stats() when /metrics is scraped, so they are
current without a polling thread.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RATE_WINDOW_S = 10.0

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector:
    def __init__(self, models: Callable[[], Iterable], rate: Callable[[str], float]) -> None:
        self.models, self.rate = models, rate

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        queue = GaugeMetricFamily("gptj_queue_depth", "Requests waiting to be scheduled", labels=["model"])
        running = GaugeMetricFamily("gptj_running_sequences", "Sequences in the running batch", labels=["model"])
        kv = GaugeMetricFamily("gptj_kv_usage_ratio", "Share of KV blocks in use", labels=["model"])
        blocks = GaugeMetricFamily("gptj_kv_blocks", "KV blocks by state: used (held by a request), cached "
                                   "(holding a reusable prefix), total", labels=["model", "state"])
        hit_rate = GaugeMetricFamily("gptj_prefix_cache_hit_rate",
                                     "Share of prompt tokens found in the prefix cache since the start", labels=["model"])
        hits = CounterMetricFamily("gptj_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
                                   labels=["model"])
        queried = CounterMetricFamily("gptj_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                      labels=["model"])
        preempted = CounterMetricFamily("gptj_preemptions", "Requests whose KV blocks were taken back for older ones",
                                        labels=["model"])
        stalls = CounterMetricFamily("gptj_kv_stalls", "Request-steps a request waited for a free KV block",
                                     labels=["model"])
        outstanding = GaugeMetricFamily("gptj_outstanding_requests", "Engine requests admitted and unfinished",
                                        labels=["model"])
        rate = GaugeMetricFamily("gptj_generation_tokens_per_second",
                                 f"New tokens per second over the last {RATE_WINDOW_S:g} s", labels=["model"])
        steps = CounterMetricFamily("gptj_engine_steps", "Engine steps run since the server started",
                                    labels=["model"])
        step_seconds = CounterMetricFamily("gptj_engine_step_seconds", "Wall time inside the engine's steps by "
                                           "phase: schedule, forward, wait (a GPU's device-to-host copy), update",
                                           labels=["model", "phase"])
        decode_rows = CounterMetricFamily("gptj_engine_decode_rows", "Sequences decoded, summed over the steps",
                                          labels=["model"])
        prefill_steps = CounterMetricFamily("gptj_engine_prefill_steps", "Engine steps that prefilled a prompt "
                                            "chunk (the rest only decoded)", labels=["model"])
        prefill_seconds = CounterMetricFamily("gptj_engine_prefill_step_seconds", "Wall time of the steps that "
                                              "prefilled (all phases)", labels=["model"])
        thread_steps = CounterMetricFamily("gptj_engine_thread_steps", "Decode steps the thread tuner timed at "
                                           "each compute thread count (its choices and its probes; CPU)",
                                           labels=["model", "threads"])
        drafted = CounterMetricFamily("gptj_spec_draft_tokens", "Speculation: drafted tokens verified (prompt "
                                      "lookup)", labels=["model"])
        accepted = CounterMetricFamily("gptj_spec_accepted_tokens", "Speculation: drafted tokens taken",
                                       labels=["model"])
        threads = GaugeMetricFamily("gptj_compute_threads", "Threads the engine's next step computes with (CPU)",
                                    labels=["model"])
        for m in list(self.models()):
            st = m.stats()  # gptj.engine.config.EngineStats: a snapshot
            queue.add_metric([m.name], m.queue_depth())
            running.add_metric([m.name], st.running_seqs)
            kv.add_metric([m.name], st.kv_usage)
            blocks.add_metric([m.name, "used"], st.blocks_total - st.blocks_free)
            blocks.add_metric([m.name, "cached"], st.blocks_cached)
            blocks.add_metric([m.name, "total"], st.blocks_total)
            hit_rate.add_metric([m.name], st.prefix_hit_rate)
            hits.add_metric([m.name], st.prefix_hit_tokens)
            queried.add_metric([m.name], st.prefix_queried_tokens)
            preempted.add_metric([m.name], st.preemptions)
            stalls.add_metric([m.name], st.stalls)
            drafted.add_metric([m.name], st.draft_tokens)
            accepted.add_metric([m.name], st.accepted_tokens)
            outstanding.add_metric([m.name], m.outstanding)
            rate.add_metric([m.name], self.rate(m.name))
            if st.times is not None:
                steps.add_metric([m.name], st.times.steps)
                decode_rows.add_metric([m.name], st.times.decode_rows)
                prefill_steps.add_metric([m.name], st.times.prefill_steps)
                prefill_seconds.add_metric([m.name], st.times.prefill_seconds)
                for phase in st.times.PHASES:
                    step_seconds.add_metric([m.name, phase], getattr(st.times, phase))
            threads.add_metric([m.name], st.threads or m.threads)
            for n, count in st.thread_steps:
                thread_steps.add_metric([m.name, str(n)], count)
        yield from (queue, running, kv, blocks, hit_rate, hits, queried, preempted, stalls, outstanding, rate,
                    steps, step_seconds, decode_rows, prefill_steps, prefill_seconds, threads, thread_steps, drafted,
                    accepted)


class ServerMetrics:
    def __init__(self, models: Callable[[], Iterable]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("gptj_requests", "Completion requests by model and HTTP status",
                                ["model", "status"], registry=r)
        self.prompt_tokens = Counter("gptj_prompt_tokens", "Prompt tokens processed", ["model"], registry=r)
        self.generation_tokens = Counter("gptj_generation_tokens", "New tokens generated", ["model"], registry=r)
        self.ttft = Histogram("gptj_time_to_first_token_seconds", "Arrival to first new token",
                              ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("gptj_time_per_output_token_seconds", "Mean time between new tokens of a request",
                              ["model"], buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("gptj_request_latency_seconds", "Arrival to last token", ["model"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self._recent: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._lock = threading.Lock()
        r.register(_EngineCollector(models, self.tokens_per_second))

    def count_tokens(self, model: str, n: int) -> None:
        self.generation_tokens.labels(model).inc(n)
        with self._lock:
            self._recent[model].append((time.monotonic(), n))

    def tokens_per_second(self, model: str) -> float:
        now = time.monotonic()
        with self._lock:
            recent = self._recent[model]
            while recent and recent[0][0] < now - RATE_WINDOW_S:
                recent.popleft()
            return sum(n for _, n in recent) / RATE_WINDOW_S

    def observe(self, model: str, status: int, start: float, first_token: float | None, end: float,
                new_tokens: int) -> None:
        """One finished HTTP request (times from time.perf_counter())."""
        self.requests.labels(model, str(status)).inc()
        if status != 200:
            return
        self.e2e.labels(model).observe(end - start)
        if first_token is not None:
            self.ttft.labels(model).observe(first_token - start)
            if new_tokens > 1:
                self.tpot.labels(model).observe((end - first_token) / (new_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
