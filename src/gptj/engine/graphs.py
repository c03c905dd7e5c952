"""CUDA-graph decode: a decode-only step replayed from a graph captured for its batch-size bucket.

At batch 1, GPT-J's 28 layers launch a few hundred kernels a step, each a few microseconds of the
GPU's time but more of the host's: replaying them as one CUDA graph takes the host out of the step
(vLLM's FULL_DECODE_ONLY; gpt-fast's torch.compile mode="reduce-overhead").

A graph replays fixed addresses and shapes, so a decode-only step reads the engine's persistent
input buffers (engine/input_batch.py: token ids, positions, write slots, and the attention
backend's DecodeTables — own tables (rows, blocks_per_seq), the decode kernels' splits covering
blocks_per_seq blocks, whatever the step's lengths): the first rows of them, as many as its
batch-size bucket (BUCKETS up to the engine's max_seqs, and on to the rows drafts may add: a draft's
tokens are decode rows, engine/input_batch.py). The step's rows are padded up to the
bucket: each padding row is a group of its own that writes its key and value into the scratch
block (the KV pool's last block, which no sequence holds) and reads that one token back. A graph
is captured for each (bucket, rows-per-group tile) at its first use — the kernel's tile of a
group's rows is a compile-time size — and replayed after; its logits rows past the step's are
dropped. The batch's host arrays reach the GPU in two or three copies, with no device-to-host sync
in the step.

Where graphs cannot be captured (CPU: the tests), the same padded step runs eagerly from the same
buffers, so the padding and bucketing are tested without a GPU.
"""

from __future__ import annotations

import logging

import torch

from gptj.engine.attention import AttentionBackend, PagedBatch, PagedKV, StepMetadata
from gptj.engine.attention.base import row_tile
from gptj.engine.input_batch import BatchRows, InputBatch
from gptj.fallback import Fallbacks, first_line
from gptj.models.gptj import GPTJForCausalLM

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # rows a graph is captured for


def bucket_for(rows: int, max_rows: int, max_seqs: int | None = None) -> int:
    """The smallest bucket that holds `rows`: BUCKETS below max_rows, then max_rows (the batch's rows
    at most: the engine's max_seqs, and its drafts' rows, InputBatch), with max_seqs a bucket too."""
    sizes = {b for b in BUCKETS if b < max_rows} | {max_rows} | ({max_seqs} if max_seqs else set())
    return min((b for b in sizes if b >= rows), default=max_rows)


class CaptureFailed(RuntimeError):
    """A decode step's graph could not be captured (logged once): the caller runs the step eagerly."""


class GraphRunner:
    """Decode-only forwards from the engine's InputBatch (its device buffers, padded to a bucket),
    captured as CUDA graphs per bucket (`capture`), or run eagerly from the same buffers (CPU)."""

    def __init__(self, model: GPTJForCausalLM, kv: PagedKV, backend: AttentionBackend, batch: InputBatch,
                 capture: bool) -> None:
        if not backend.reads_tables or backend.name == "cpu-native":
            raise ValueError(f"CUDA-graph decode needs the cuda attention backend, not {backend.name!r}")
        self.model, self.kv, self.backend, self.batch, self.capture = model, kv, backend, batch, capture
        self.max_rows, self.max_seqs = batch.max_rows, batch.max_seqs
        self.buckets: dict[int, dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]] = {}  # rows -> tile -> graph
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.captured = 0  # graphs captured so far (tests, stats)
        self.fallbacks = Fallbacks(log)  # (bucket, tile) whose capture failed: those steps run eagerly

    @property
    def ready(self) -> bool:
        """Whether steps can run here: the backend's kernel works (a padded step's metadata has only
        the kernel's tables)."""
        return getattr(self.backend, "kernel_ok", True)

    def takes(self, rows: int) -> bool:
        """Whether a decode-only step of `rows` rows (a sequence's each, a draft's token's each) runs
        from a graph here."""
        return self.ready and 0 < rows <= self.max_rows

    def forward(self, rows: int, size: int | None = None, group_rows: int = 1) -> torch.Tensor:
        """The logits (rows, V) float32 of the batch's `rows` rows (only while `ready`), padded up to
        `size` (default: their bucket) with groups of group_rows rows (warm's beams: num_beams)."""
        size = bucket_for(rows, self.max_rows, self.max_seqs) if size is None else size
        tile = self.batch.tile(group_rows)
        if not self.fallbacks.ok((size, tile)):
            raise CaptureFailed(f"no graph for {size} rows")
        graphs = self.buckets.setdefault(size, {})
        step = self.batch.padded(size, group_rows)
        if not self.capture:
            logits = self._run(step)
            if not self.ready:  # the kernel failed in this step: its result is not the step's
                raise RuntimeError("the attention backend's kernel is unavailable")
            return logits[:rows]
        if tile not in graphs:
            try:
                graphs[tile] = self._capture(step)
            except Exception as e:  # noqa: BLE001 - capturing failed: this bucket's steps run eagerly
                self.fallbacks.fail((size, tile), f"CUDA-graph capture of {size} rows (groups of {tile})", e,
                                    "those decode steps run eagerly")
                raise CaptureFailed(first_line(e)) from e
        graph, logits = graphs[tile]
        graph.replay()
        return logits[:rows]

    def warm(self, rows_per_group: int) -> int:
        """Make every bucket's graph for groups of `rows_per_group` rows (beam search: num_beams) now,
        before the steps that need them, as vLLM captures at start: a run's first step at each batch
        size then replays instead of paying a capture (two forwards and the capture) among timed
        steps. The steps are padding only (they write and read the scratch block); the batch's rows
        are written afresh at the next step. -> buckets warmed (captured on CUDA; run eagerly from
        the same buffers elsewhere)."""
        tile = row_tile(rows_per_group)
        sizes = [b for b in BUCKETS if b < self.max_seqs] + [self.max_seqs]  # (steps with drafts: at first use)
        warmed = 0
        self.batch.clear()
        for size in reversed(sizes):  # largest first, as vLLM: the smaller graphs reuse its memory pool
            graphs = self.buckets.get(size)
            made = graphs is not None and (tile in graphs or not self.capture)
            if size < rows_per_group or not self.ready or made:
                continue
            try:
                with torch.inference_mode():  # as the runner's steps
                    self.forward(0, size, rows_per_group)
            except CaptureFailed:  # (logged) that bucket's steps run eagerly; the others may still capture
                continue
            except Exception:  # noqa: BLE001 - a kernel that failed (logged): the steps run eagerly
                if self.ready:
                    raise
                break
            warmed += 1
        return warmed

    def replay_ms(self, rows: int, n: int = 20) -> float | None:
        """The device time of a decode step of `rows` rows: its bucket's captured graph replayed n
        times back to back, with no host work between (a step's time less this is the host's part).
        None where no graph of that bucket was captured. The replays write the last step's slots
        again: measure after a run, never within one."""
        graphs = self.buckets.get(bucket_for(rows, self.max_rows, self.max_seqs))
        if not self.capture or not graphs:
            return None
        graph, _ = next(iter(graphs.values()))
        graph.replay()  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n

    def _run(self, step: BatchRows) -> torch.Tensor:
        cache = PagedBatch(self.kv, self.backend, StepMetadata(step.decode))
        return self.model(step.ids[None], position_ids=step.positions[None], cache=cache)[0]

    def _capture(self, step: BatchRows) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (kernels compiled, allocator settled), then capture one forward.
        The warm-up and the capture write only the step's own slots and the scratch block, as the
        replay does."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run(step)
        torch.cuda.current_stream().wait_stream(stream)
        if not self.ready:  # the kernel failed in the warm-up: its steps must run unpadded
            raise RuntimeError("the attention backend's kernel is unavailable")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._run(step)
        self.captured += 1
        return graph, logits
