"""CUDA-graph decode: a decode-only step replayed from a graph captured for its batch-size bucket.

At batch 1, GPT-J's 28 layers launch a few hundred kernels a step, each a few microseconds of the
GPU's time but more of the host's: replaying them as one CUDA graph takes the host out of the step
(vLLM's FULL_DECODE_ONLY; gpt-fast's torch.compile mode="reduce-overhead").

A graph replays fixed addresses and shapes, so a decode-only step's inputs go into persistent
buffers, one set per bucket (BUCKETS up to the engine's max_seqs): token ids, positions, write
slots, and the attention backend's DecodeTables (shared tables up to rows x blocks_per_seq blocks,
own tables (rows, blocks_per_seq); the decode kernels' splits cover blocks_per_seq blocks, whatever the
step's lengths). The step's rows are padded up to the bucket: each padding row is
a group of its own that writes its key and value into the scratch block (the KV pool's last block,
which no sequence holds) and reads that one token back. A graph is captured for each (bucket,
rows-per-group tile) at its first use — the kernel's tile of a group's rows is a compile-time size —
and replayed after; its logits rows past the step's are dropped. The host's inputs reach the GPU
in two copies (one int64, one int32 buffer), with no device-to-host sync in the step.

Where graphs cannot be captured (CPU: the tests), the same padded step runs eagerly from the same
buffers, so the padding and bucketing are tested without a GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from gptj.engine.attention import (AttentionBackend, DecodeGroup, DecodeTables, PagedBatch, PagedKV,
                                   StepMetadata)
from gptj.engine.attention.base import host_tensor, row_tile, table_lists
from gptj.fallback import Fallbacks, first_line
from gptj.models.gptj import GPTJForCausalLM

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # rows a graph is captured for


def bucket_for(rows: int, max_rows: int) -> int:
    """The smallest bucket that holds `rows` (the engine's max_seqs is the last bucket)."""
    return next((b for b in BUCKETS if b >= rows and b < max_rows), max_rows)


@dataclass
class DecodeInputs:
    """A decode-only step as host lists: the rows' tokens and positions, their write slots, their groups."""

    tokens: list[int]
    positions: list[int]
    write_blocks: list[int]
    write_offsets: list[int]
    groups: list[DecodeGroup]


class _Bucket:
    """The persistent buffers of one bucket (rows, M blocks per sequence) and its captured graphs.

    Each step is written into host buffers of the same layout (pinned on CUDA, so the copies are
    asynchronous: the step's one device-to-host read, in the sampler, comes after them) and copied over
    in two transfers. Only the parts a step uses are written, not the rows x M own-table padding."""

    def __init__(self, rows: int, M: int, block_size: int, device: torch.device) -> None:
        self.rows, self.M, self.block_size = rows, M, block_size
        # int64: ids, positions, write blocks, write offsets; int32: row0, stab, soff, slen, otab, olen
        self.long_sizes = [rows] * 4
        self.int_sizes = [rows + 1, rows * M, rows, rows, rows * M, rows]
        self.offsets = [sum(self.int_sizes[:i]) for i in range(len(self.int_sizes))]
        self.longs = torch.zeros(sum(self.long_sizes), dtype=torch.long, device=device)
        self.ints = torch.zeros(sum(self.int_sizes), dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self.host_longs = torch.zeros(self.longs.shape, dtype=torch.long, pin_memory=pin)
        self.host_ints = torch.zeros(self.ints.shape, dtype=torch.int32, pin_memory=pin)
        self.ids, self.positions, self.wb, self.wo = torch.split(self.longs, self.long_sizes)
        row0, stab, soff, slen, otab, olen = torch.split(self.ints, self.int_sizes)
        self.tables = (row0, stab, soff, slen, otab.view(rows, M), olen)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # tile -> (graph, logits)
        self.copied = None  # CUDA: the event after the last step's copies (its host buffers are free after it)

    def fill(self, step: DecodeInputs, scratch: int) -> int:
        """Write the step (padded to the bucket) into the buffers; -> the group tile (rows per group, a
        power of two)."""
        R, M = self.rows, self.M
        n = len(step.tokens)
        if self.copied is not None:  # (a step whose results nobody read may still be copying them)
            self.copied.synchronize()
        pad = R - n
        groups = step.groups + [DecodeGroup([scratch], 1, [[]], 0)] * pad
        row0, stab, soff, slen, own_rows, olen = table_lists(groups)
        empty = R - len(groups)  # a bucket has as many groups as rows at most; the rest: empty groups after them
        row0 += [row0[-1]] * empty
        soff, slen, olen = (values + [0] * empty for values in (soff, slen, olen))  # empty groups read nothing
        # Every section is written whole except the block tables, whose entries past what a group's
        # lengths cover are never read (so they are not cleared: 2 x rows x M ints a step).
        ints = self.host_ints
        o_row0, o_stab, o_soff, o_slen, o_otab, o_olen = self.offsets
        for at, values in ((o_row0, row0), (o_stab, stab), (o_soff, soff), (o_slen, slen), (o_olen, olen)):
            ints[at:at + len(values)] = host_tensor(values, torch.int32)
        lens = [len(blocks) for blocks in own_rows]
        if any(lens):  # row r's own blocks at otab[r, :len]
            counts = host_tensor(lens)
            starts = torch.repeat_interleave(torch.arange(len(lens)) * M - (counts.cumsum(0) - counts), counts)
            ints[starts + torch.arange(int(counts.sum())) + o_otab] = host_tensor(
                [b for blocks in own_rows for b in blocks], torch.int32)
        longs = self.host_longs
        zeros = [0] * pad
        for i, values in enumerate((step.tokens, step.positions, step.write_blocks, step.write_offsets)):
            longs[i * R:(i + 1) * R] = host_tensor(list(values) + (zeros if i != 2 else [scratch] * pad))
        # (padding rows: token 0 at position 0, written into row 0 of the scratch block)
        self.longs.copy_(longs, non_blocking=True)
        self.ints.copy_(ints, non_blocking=True)
        if self.longs.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()
        return tile_of(groups)

    def metadata(self, tile: int) -> StepMetadata:
        # (a sequence's most tokens, M blocks: the splits are the bucket's, whatever the step's lengths)
        return StepMetadata(self.wb, self.wo, [], [], [], [],
                            DecodeTables(*self.tables, max_rows=tile, max_shared=self.M * self.block_size))


class CaptureFailed(RuntimeError):
    """A decode step's graph could not be captured (logged once): the caller runs the step eagerly."""


def tile_of(groups) -> int:  # noqa: ANN001 - DecodeGroups
    """The decode kernels' tile of a step: its largest group's rows, rounded up to a power of two."""
    return row_tile(max([g.rows for g in groups], default=1))


class GraphRunner:
    """Decode-only forwards from persistent buffers, captured as CUDA graphs per bucket (`capture`),
    or run eagerly from the same buffers (CPU)."""

    def __init__(self, model: GPTJForCausalLM, kv: PagedKV, backend: AttentionBackend, max_rows: int,
                 blocks_per_seq: int, scratch: int, capture: bool) -> None:
        if not backend.reads_tables or backend.name == "cpu-native":
            raise ValueError(f"CUDA-graph decode needs the cuda attention backend, not {backend.name!r}")
        self.model, self.kv, self.backend = model, kv, backend
        self.max_rows, self.M, self.scratch, self.capture = max_rows, blocks_per_seq, scratch, capture
        self.buckets: dict[int, _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.captured = 0  # graphs captured so far (tests, stats)
        self.fallbacks = Fallbacks(log)  # (bucket, tile) whose capture failed: those steps run eagerly

    @property
    def ready(self) -> bool:
        """Whether steps can run here: the backend's kernel works (a padded step's metadata has only
        the kernel's tables)."""
        return getattr(self.backend, "kernel_ok", True)

    def takes(self, rows: int) -> bool:
        """Whether a decode-only step of `rows` sequences runs from a graph here."""
        return self.ready and 0 < rows <= self.max_rows

    def forward(self, step: DecodeInputs) -> torch.Tensor:
        """The step's logits (rows, V) float32 (only while `ready`)."""
        rows = len(step.tokens)
        size = bucket_for(rows, self.max_rows)
        if not self.fallbacks.ok((size, tile_of(step.groups))):
            raise CaptureFailed(f"no graph for {size} rows")
        bucket = self.buckets.get(size)
        if bucket is None:
            bucket = self.buckets[size] = _Bucket(size, self.M, self.kv.block_size, self.kv.device)
        tile = bucket.fill(step, self.scratch)
        if not self.capture:
            logits = self._run(bucket, tile)
            if not self.ready:  # the kernel failed in this step: its result is not the step's
                raise RuntimeError("the attention backend's kernel is unavailable")
            return logits[:rows]
        if tile not in bucket.graphs:
            try:
                bucket.graphs[tile] = self._capture(bucket, tile)
            except Exception as e:  # noqa: BLE001 - capturing failed: this bucket's steps run eagerly
                self.fallbacks.fail((size, tile), f"CUDA-graph capture of {size} rows (groups of {tile})", e,
                                    "those decode steps run eagerly")
                raise CaptureFailed(first_line(e)) from e
        graph, logits = bucket.graphs[tile]
        graph.replay()
        return logits[:rows]

    def warm(self, rows_per_group: int) -> int:
        """Make every bucket's graph for groups of `rows_per_group` rows (beam search: num_beams) now,
        before the steps that need them, as vLLM captures at start: a run's first step at each batch
        size then replays instead of paying a capture (two forwards and the capture) among timed
        steps. The steps are padding only (they write and read the scratch block). -> buckets warmed
        (captured on CUDA; run eagerly from the same buffers elsewhere)."""
        tile = row_tile(rows_per_group)
        sizes = [b for b in BUCKETS if b < self.max_rows] + [self.max_rows]
        warmed = 0
        for size in reversed(sizes):  # largest first, as vLLM: the smaller graphs reuse its memory pool
            bucket = self.buckets.get(size)
            made = bucket is not None and (tile in bucket.graphs or not self.capture)
            if size < rows_per_group or not self.ready or made:
                continue
            groups = [DecodeGroup([self.scratch], 1, [[]] * rows_per_group, 0)] * (size // rows_per_group)
            try:
                with torch.inference_mode():  # as the runner's steps
                    self.forward(DecodeInputs([0] * size, [0] * size, [self.scratch] * size, [0] * size, groups))
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
        bucket = self.buckets.get(bucket_for(rows, self.max_rows))
        if not self.capture or bucket is None or not bucket.graphs:
            return None
        graph, _ = next(iter(bucket.graphs.values()))
        graph.replay()  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n

    def _run(self, bucket: _Bucket, tile: int) -> torch.Tensor:
        cache = PagedBatch(self.kv, self.backend, bucket.metadata(tile))
        return self.model(bucket.ids[None], position_ids=bucket.positions[None], cache=cache)[0]

    def _capture(self, bucket: _Bucket, tile: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (kernels compiled, allocator settled), then capture one forward.
        The warm-up and the capture write only the step's own slots and the scratch block, as the
        replay does."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run(bucket, tile)
        torch.cuda.current_stream().wait_stream(stream)
        if not self.ready:  # the kernel failed in the warm-up: its steps must run unpadded
            raise RuntimeError("the attention backend's kernel is unavailable")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._run(bucket, tile)
        self.captured += 1
        return graph, logits

