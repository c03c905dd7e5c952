"""The attention backend interface: what a step hands a backend, and what a backend does with it.

A step's forward carries decode rows (one new token per sequence) and prompt chunks. The decode
rows come as `DecodeRows`: where each row's new key and value go, and `DecodeTables` over its
groups (a request's rows: one sequence, or the beams of one request sharing their prompt's
blocks). The engine keeps them in persistent buffers (engine/input_batch.py) and hands them in
as they are; `build_step` makes them from plain data instead — `DecodeGroup`s and write slots —
for the backends' tests. Prompt chunks come as `PrefillSegment`s. The backend's `build` turns
the step into `StepMetadata`: device tensors made once per step (one pinned, non_blocking
host-to-device copy, which also carries the runner's token ids, positions and kept rows of the
chunks), which every layer then reads. Per layer the model calls `PagedBatch.attend`, which only
delegates:

    store    the step's new keys and values into their blocks       backend.store
    decode   each decode row over its group's blocks                  backend.decode
    prefill  each chunk's queries, causally over its sequence's blocks backend.prefill

Backends (gptj.policy.attention_path names one; engine.attention.make_backend builds it):
reference.py (torch's eager and compiled forms: the ground truth every other one is tested
against), cpu_native.py (gptj.native's kernels, AVX-512 or AVX2), cuda.py (a Triton kernel for the whole
decode batch). Scores and softmax are float32 in all of them (HF's rule).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch

from gptj.device import to_device
from gptj.engine.attention.kv_cache import PagedKV


@dataclass
class DecodeGroup:
    """A request's rows in a decode step: one row per sequence (beams: several).

    Every row reads the group's shared blocks (holding shared_len tokens) and then its own blocks
    (own_len tokens each, this step's token included). A single sequence has all its blocks
    shared and none of its own."""

    shared: list[int]
    shared_len: int
    own: list[list[int]]
    own_len: int

    @property
    def rows(self) -> int:
        return len(self.own)


@dataclass
class PrefillSegment:
    """A prompt chunk in a forward: its tokens are at positions start .. start + length - 1 of the
    sequence whose blocks are `blocks` (its first `start` tokens already stored)."""

    blocks: list[int]
    start: int
    length: int


@dataclass
class DecodeTables:
    """Every decode group of a step as int32 tables (gptj.native's attention_paged and the CUDA
    kernel read this layout): rows row0[g] .. row0[g + 1] - 1 are group g's; its shared blocks are
    stab[soff[g]:], holding slen[g] tokens; row n's own blocks are otab[n] (padded with block 0),
    holding olen[g] tokens."""

    row0: torch.Tensor  # (G + 1,)
    stab: torch.Tensor  # (sum of shared blocks, at least 1,)
    soff: torch.Tensor  # (G,)
    slen: torch.Tensor  # (G,)
    otab: torch.Tensor  # (N, omax)
    olen: torch.Tensor  # (G,)
    max_rows: int  # the most rows of one group (a host int: kernels size their tiles by it)
    max_shared: int = 0  # the most shared tokens of one group (a host int: the CUDA kernel's splits)
    # (G,) int32 or None: group g's i-th row owns olen[g] + i * stair[g] tokens, a speculative draft's
    # rows one more each (engine/input_batch.py, where the backend reads it: AttentionBackend.stairs)
    stair: torch.Tensor | None = None

    def astuple(self) -> tuple[torch.Tensor, ...]:
        return self.row0, self.stab, self.soff, self.slen, self.otab, self.olen


@dataclass
class SegmentSlots:
    """A prefill segment's tensors: where each of its tokens goes, and its sequence's blocks."""

    blocks: torch.Tensor  # (T,) the block of each token
    offsets: torch.Tensor  # (T,) its row in that block
    table: torch.Tensor  # (ceil(end / B),) the sequence's blocks up to the chunk's end
    positions: torch.Tensor  # (T,)


class GroupSpan(NamedTuple):
    """A decode group as the host knows it: its rows row0 .. row0 + rows - 1, its shared blocks from
    stab[soff], holding shared_len tokens, and own_len tokens in each row's own blocks."""

    row0: int
    rows: int
    soff: int
    shared_len: int
    own_len: int  # its first row's; each next row's `stair` more (a speculative draft's rows: 1)
    stair: int = 0

    @property
    def most_own(self) -> int:
        """The own tokens of its last row, the most of any."""
        return self.own_len + (self.rows - 1) * self.stair


@dataclass
class DecodeRows:
    """A step's decode rows on the device: where each row's new key and value go, and the
    DecodeTables of its groups. `spans`: the groups' (row0, soff, slen, olen[, stair]) on the host (lists or
    arrays), for backends that walk the groups one by one (the reference); None where none does (a
    graph's padded step)."""

    write_blocks: torch.Tensor  # (N,) long: decode row r's new key and value go to this block ...
    write_offsets: torch.Tensor  # (N,) long: ... at this row
    tables: DecodeTables
    block_size: int
    spans: tuple[Sequence[int], ...] | None = None


@dataclass
class StepMetadata:
    """What every layer of one forward reads: the decode rows (engine/input_batch.py's, or made by
    `build_step`) and the prompt chunks' slots, made once per step."""

    decode: DecodeRows | None
    segments: list[PrefillSegment] = field(default_factory=list)
    slots: list[SegmentSlots] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # a backend's own per-step values
    rows: list[torch.Tensor] = field(default_factory=list)  # build's `rows` on the device (int64), in order

    @property
    def n_decode(self) -> int:
        return 0 if self.decode is None else len(self.decode.write_blocks)

    @property
    def write_blocks(self) -> torch.Tensor | None:
        return None if self.decode is None else self.decode.write_blocks

    @property
    def write_offsets(self) -> torch.Tensor | None:
        return None if self.decode is None else self.decode.write_offsets

    @property
    def tables(self) -> DecodeTables | None:
        return None if self.decode is None else self.decode.tables

    @cached_property
    def groups(self) -> list[GroupSpan]:
        """The decode groups, on the host (none where the decode rows carry no spans)."""
        if self.decode is None or self.decode.spans is None:
            return []
        row0, soff, slen, olen, *stair = (list(map(int, values)) for values in self.decode.spans)
        stair = stair[0] if stair else [0] * len(soff)
        return [GroupSpan(row0[g], row0[g + 1] - row0[g], soff[g], slen[g], olen[g], stair[g]) for g in range(len(soff))]

    @cached_property
    def group_blocks(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per group: its shared blocks (m,) and its rows' own blocks (rows, m'), views of the tables
        (int32), as many as its lengths cover."""
        tables, B = self.decode.tables, self.decode.block_size
        return [(tables.stab[g.soff:g.soff - (-g.shared_len // B)],
                 tables.otab[g.row0:g.row0 + g.rows, :-(-g.most_own // B)]) for g in self.groups]


def row_tile(rows: int) -> int:
    """The tile of rows a decode kernel computes a group of `rows` rows in: the power of two at or above
    (a step's tile is its largest group's; the kernels' tiles and the graphs' buckets follow it)."""
    return 1 << (max(1, rows) - 1).bit_length()


ALIGN_BYTES = 16  # where each part of a step's flat index tensor starts (see _aligned)


def _aligned(parts: Sequence[Sequence[int]], align: int) -> tuple[list[int], list[int]]:
    """(the parts as one list, each padded with zeros to a multiple of `align` elements; each part's
    start in it). A step's tensors are views of one copy, and Triton specializes a kernel on whether
    each pointer is 16-byte aligned: views at offsets that vary with the step's sizes would compile
    the same kernel again mid-run (tests/test_warm_compiles.py); aligned starts compile it once."""
    flat: list[int] = []
    starts = []
    for p in parts:
        starts.append(len(flat))
        flat += p
        flat += [0] * (-len(p) % align)
    return flat, starts


def _views(flat: torch.Tensor, parts: Sequence[Sequence[int]], starts: Sequence[int]) -> list[torch.Tensor]:
    return [flat[at:at + len(p)] for p, at in zip(parts, starts)]


def host_tensor(values: Sequence[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A CPU int32 / int64 tensor of Python ints, converted by array.array, which is several times
    faster than torch.tensor on the long lists of a step's tables (some 10,000 ints for 64 beam
    requests)."""
    if len(values) == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_ARRAY_CODE[dtype], values), dtype=dtype)


_ARRAY_CODE = {torch.int32: "i", torch.int64: "q"}


def _table_parts(groups: Sequence[DecodeGroup]) -> tuple[list[list[int]], int]:
    """DecodeTables' six sections as host lists, in its order (row0, stab, soff, slen, otab, olen),
    and omax: the own tables are padded with block 0 to the step's longest (at least 1)."""
    row0, stab, soff, slen, own, olen = [0], [], [], [], [], []
    for g in groups:
        soff.append(len(stab))
        stab += g.shared
        slen.append(g.shared_len)
        olen.append(g.own_len)
        own += g.own
        row0.append(row0[-1] + g.rows)
    omax = max(1, max(map(len, own)))
    otab = [b for o in own for b in o + [0] * (omax - len(o))]
    return [row0, stab or [0], soff, slen, otab, olen], omax


def build_step(kv: PagedKV, groups: Sequence[DecodeGroup] = (), write_blocks: Sequence[int] = (),
               write_offsets: Sequence[int] = (), segments: Sequence[PrefillSegment] = (),
               rows: Sequence[Sequence[int]] = (), decode: DecodeRows | None = None) -> StepMetadata:
    """The step's metadata: every index tensor made on the host as one int64 tensor and moved to the
    KV's device in one copy, pinned and non_blocking (gptj.device.to_device): no host-device round
    trip per group or per layer, and on CUDA the host goes on to the step's launches instead of
    waiting for the work already queued (a decode graph just replayed) to finish first.

    The decode rows: `decode` as given (the engine's persistent ones), or made from `groups` and
    their rows' write slots: DecodeTables whose int32 sections ride in the same int64 copy and are
    cast on the device, where a cast is one more queued kernel (a second, int32 copy would save a few
    KB of a copy that takes microseconds, for a second pinned staging and copy on the host's side).
    rows: int lists the caller wants on the device too (the runner's chunk tokens, positions, logits
    to keep, LoRA adapters), carried in the same copy: StepMetadata.rows, int64 views, in order."""
    B, device = kv.block_size, kv.device
    parts: list[list[int]] = [list(write_blocks), list(write_offsets)] if groups else []
    for seg in segments:
        end = seg.start + seg.length
        table = seg.blocks[:-(-end // B)]
        positions = list(range(seg.start, end))
        parts += [[table[p // B] for p in positions], [p % B for p in positions], table, positions]
    parts += [list(r) for r in rows]
    table_parts, omax = _table_parts(groups) if groups else ([], 0)
    if not parts:
        return StepMetadata(decode, list(segments))
    longs, starts = _aligned(parts, ALIGN_BYTES // 8)
    ints, int_starts = _aligned(table_parts, ALIGN_BYTES // 4)
    n = len(longs)
    flat = to_device(host_tensor(longs + ints), device)
    views = iter(_views(flat, parts, starts))
    if groups:
        wb, wo = next(views), next(views)
        r, s, so, sl, ot, ol = _views(flat[n:].to(torch.int32), table_parts, int_starts)
        tables = DecodeTables(r, s, so, sl, ot.view(-1, omax), ol, max(g.rows for g in groups),
                              max(g.shared_len for g in groups))
        row0, _, soff, slen, _, olen = table_parts
        decode = DecodeRows(wb, wo, tables, B, spans=(row0, soff, slen, olen))
    slots = [SegmentSlots(*(next(views) for _ in range(4))) for _ in segments]
    return StepMetadata(decode, list(segments), slots, rows=list(views))


class AttentionBackend:
    """One way of computing attention over paged KV memory. Subclasses implement store, decode and
    prefill; `build` makes the step's metadata (`build_step`). `reads_tables`: its decode reads the
    step's DecodeTables in one call (a kernel's), not group by group."""

    name = "?"
    reads_tables = False
    # its decode reads DecodeTables.stair (GroupSpan.stair): a speculative draft's rows come as one
    # group, the sequence's KV read once for all of them; else a group of one row each
    stairs = False

    def __init__(self, compiled: bool = False) -> None:
        self.compiled = compiled  # torch.compile'd forms (the reference backend's, on CUDA)

    def build(self, kv: PagedKV, groups: Sequence[DecodeGroup] = (), write_blocks: Sequence[int] = (),
              write_offsets: Sequence[int] = (), segments: Sequence[PrefillSegment] = (),
              rows: Sequence[Sequence[int]] = (), decode: DecodeRows | None = None) -> StepMetadata:
        return build_step(kv, groups, write_blocks, write_offsets, segments, rows=rows, decode=decode)

    def copy(self, kv: PagedKV, copies: Sequence[tuple[int, int, int]]) -> None:
        """Copy-on-write before a step's forward: block dst gets the first n tokens of block src, for
        each (src, dst, n), in every layer (PagedKV.copy's contract)."""
        kv.copy(copies)

    def store(self, kv: PagedKV, layer: int, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
              offsets: torch.Tensor) -> None:
        """Token n's key and value k[n], v[n] (N, H, D) into block blocks[n], row offsets[n]."""
        kv.write(layer, k, v, blocks, offsets)

    def decode(self, kv: PagedKV, layer: int, q: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """q (N, H, D): each decode row's query over its group's blocks -> (N, H, D) in kv.compute."""
        raise NotImplementedError

    def prefill(self, kv: PagedKV, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: StepMetadata, i: int) -> torch.Tensor:
        """Segment i's q (T, H, D), k, v (T, KV, D), its keys and values already stored: causal attention
        over its sequence's blocks -> (T, H, D)."""
        raise NotImplementedError


class PagedBatch:
    """The KV cache one forward pass sees (the model calls `attend` once per layer).

    The forward's tokens, in order: one per decode row, then each prefill segment's tokens. No
    padding: requests of any lengths share a forward, and each attends over its own blocks only.
    The model may lay the tokens out as (rows, 1) or (1, tokens); `attend` reads them in that flat
    order.
    """

    per_sequence = True  # the model builds no padding mask, and leaves position checks to admission

    def __init__(self, kv: PagedKV, backend: AttentionBackend, meta: StepMetadata) -> None:
        self.kv, self.backend, self.meta = kv, backend, meta

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """q (B, H, T, D), k, v (B, KV, T, D), B * T tokens in the order above -> (B, H, T, D).

        KV: the key/value heads the PagedKV stores (the model's kv_heads); fewer than H is grouped-query
        attention, query head h reading KV head h // (H / KV) (every backend computes it where KV
        divides H: gptj.policy.attention_path)."""
        Bq, H, T, D = q.shape
        qt = q.transpose(1, 2).reshape(Bq * T, H, D)  # (tokens, H, D)
        kt, vt = (x.transpose(1, 2).reshape(Bq * T, x.shape[1], D) for x in (k, v))  # (tokens, KV, D)
        out = torch.empty((Bq * T, H, D), dtype=v.dtype, device=v.device)
        meta, n = self.meta, self.meta.n_decode
        if n:
            self.backend.store(self.kv, layer, kt[:n], vt[:n], meta.write_blocks, meta.write_offsets)
            out[:n] = self.backend.decode(self.kv, layer, qt[:n], meta)
        for i, (seg, slots) in enumerate(zip(meta.segments, meta.slots)):
            end = n + seg.length
            self.backend.store(self.kv, layer, kt[n:end], vt[n:end], slots.blocks, slots.offsets)
            out[n:end] = self.backend.prefill(self.kv, layer, qt[n:end], kt[n:end], vt[n:end], meta, i)
            n = end
        return out.view(Bq, T, H, D).transpose(1, 2)

    def advance(self, n: int) -> None:
        pass  # lengths are the engine's bookkeeping
