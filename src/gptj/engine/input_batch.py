"""The decode rows of the running requests, kept from step to step (vLLM v1's InputBatch idea).

A request holds rows here — one per sequence, a beam request's K beams side by side — from the
step after its prompt is stored until it finishes, is preempted or stalls for want of a block. The
rows keep the scheduler's order (its `decode` list), moving up when rows before them are freed.
What a row holds stays in host arrays between steps, and a step writes only what changed:

    every step       each row's token (its request's next token) and position (one on), the row of
                     its last block its token goes to, its group's lengths
    the step's diff  a sequence's new last block (SchedulerOutput.new_blocks: allocated, or its own
                     copy of a shared one), a beam request's rows reordered (`reorder`, from
                     engine/update.py), requests that join (written from their Sequences) or leave

The arrays are laid out as the decode kernels read a step (DecodeTables: gptj.native's and the CUDA
kernel's int32 layout), so a step hands them over as views: a single sequence's group reads its row
of `tables` as its shared blocks; a beam group reads its prompt's full blocks from `prompts` (at its
first row), then each beam its own blocks from its row of `tables`. On CUDA the host arrays are
pinned, and a step copies the rows it runs to the device buffers (non_blocking, two or three
copies); a graphed step (engine/graphs.py) reads the first rows of those same device buffers, its
bucket's, the rows past the step's padded to write the scratch block. On a CPU the device buffers
are the host arrays themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gptj.engine.attention.base import ALIGN_BYTES, DecodeRows, DecodeTables, row_tile
from gptj.engine.request import Request
from gptj.engine.scheduler import SchedulerOutput

ALL_SHARED = 1 << 30  # a single sequence's cap: all its tokens are read as its group's "shared" ones


@dataclass
class BatchRows:
    """A forward's decode rows on the device: token ids and positions (rows,) long, what the
    attention reads (DecodeRows), and the decode kernels' tile (the largest group's rows, a power
    of two)."""

    ids: torch.Tensor
    positions: torch.Tensor
    decode: DecodeRows
    tile: int


class _Buffer:
    """A host tensor (pinned on CUDA) and its device copy (on a CPU, the same tensor), cut into
    sections that each start 16-byte aligned (Triton specializes a kernel on its pointers'
    alignment): `host`, numpy views of the sections; `device`, tensor views."""

    def __init__(self, sizes: list[int], dtype: torch.dtype, device: torch.device) -> None:
        align = ALIGN_BYTES // dtype.itemsize
        self.starts, total = [], 0
        for n in sizes:
            self.starts.append(total)
            total += -(-n // align) * align
        self.host_tensor = torch.zeros(total, dtype=dtype, pin_memory=device.type == "cuda")
        self.device_tensor = (self.host_tensor if device.type == "cpu"
                              else torch.zeros(total, dtype=dtype, device=device))
        array = _numpy(self.host_tensor)
        self.host = [array[at:at + n] for at, n in zip(self.starts, sizes)]
        self.device = [self.device_tensor[at:at + n] for at, n in zip(self.starts, sizes)]

    @property
    def copied(self) -> bool:
        """Whether the device buffers are a copy (not the host's own memory)."""
        return self.device_tensor is not self.host_tensor

    def copy(self, start: int, end: int) -> None:
        """host[start:end] to the device, queued on the stream (non_blocking: the host is pinned)."""
        self.device_tensor[start:end].copy_(self.host_tensor[start:end], non_blocking=True)


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A host tensor's memory as a numpy array: the same memory, written with numpy's cheap element
    and slice writes."""
    return t.numpy()


class InputBatch:
    """The decoding requests' rows (the module's docstring): `requests` in row order, `rows` each
    one's first row; `n` rows in `groups` groups (a request each), the widest of `widest` rows.

    max_rows: the engine's max_seqs; blocks_per_seq: a sequence's most blocks (M); scratch: the KV
    block padding rows write (the pool's extra one)."""

    def __init__(self, max_rows: int, blocks_per_seq: int, block_size: int, device: torch.device | str,
                 scratch: int, draft_rows: int = 0) -> None:
        N, M = max_rows + draft_rows, blocks_per_seq  # room for a row a sequence, and the drafts' (KVPlan.draft_rows)
        self.max_rows, self.max_seqs, self.M, self.B, self.scratch = N, max_rows, M, block_size, scratch
        device = torch.device(device)
        self.longs = _Buffer([N] * 4, torch.long, device)  # rows' token ids, positions, write blocks, write offsets
        # groups' row0 (N + 1), soff, slen, olen; the rows' own tables and the beam groups' prompts (N x M each)
        self.ints = _Buffer([N + 1, N, N, N, N * M, N * M], torch.int32, device)
        self.ids, self.pos, self.wb, self.wo = self.longs.host
        self.row0, self.soff, self.slen, self.olen, tables, prompts = self.ints.host
        self.tables, self.prompts = tables.reshape(N, M), prompts.reshape(N, M)
        self.prompts_at = self.ints.starts[5] - self.ints.starts[4]  # `prompts` in the shared tables (stab)
        self.stair_tensor = torch.zeros(N, dtype=torch.int32)  # per group (DecodeTables.stair; CPU backends only)
        self.stair = _numpy(self.stair_tensor)
        self.stairs = False  # this step's drafts' rows in staired groups (update's `stairs`)
        self.first = np.zeros(N, dtype=np.int64)  # each group's first row
        self.cap = np.zeros(N, dtype=np.int64)  # its shared tokens: a beam group's prompt blocks', else ALL_SHARED
        self.lens = np.zeros(N, dtype=np.int64)  # its tokens this step, this one's included
        self.requests: list[Request] = []
        self.rows: dict[Request, int] = {}  # each request's first row
        self.width: dict[Request, int] = {}  # and its rows: one a sequence, or a draft's tokens (below)
        self.drafts: dict[Request, list[int]] = {}  # this step's verified requests: their next token and draft
        self.n = self.groups = self.widest = 0
        self.copied = None  # CUDA: an event after the last copies (the host arrays are free after it)
        self.prompts_changed = True  # `prompts` written since its last copy to the device
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # (rows, groups) -> device views

    # --- the step's diff ---

    def update(self, sched: SchedulerOutput, stairs: bool = False) -> None:
        """Bring the rows to this step: every row that decoded in the last one a token on, the rows
        of the requests that decode now (sched.decode, in its order, then sched.verify's), their new
        last blocks, this step's tokens and the lengths that follow.

        A verified request (a next token and its draft, engine/scheduler.Verify) takes a row for each
        of its tokens: the row of its token at position L + i attends over the sequence's first
        L + i + 1 tokens, as decoding them one at a time would, and writes its key and value where
        that token goes (the rows before it in the step wrote theirs first: every decode row stores
        before any attends). Where the backend reads stairs (`stairs`), its rows are one group: the
        sequence's full blocks before L shared (read once for all of them), the rest its rows' own,
        each row one token more than the one before (DecodeTables.stair); elsewhere a group a row.
        Its rows are written afresh at every step that verifies it and at the next (how far it got
        is the update's). `stairs`: the attention backend's (AttentionBackend.stairs)."""
        self._writable()
        self.stairs = stairs
        self.pos[:self.n] += 1  # each row stored its token in the last step
        drafts = {v.request: v.tokens for v in sched.verify}
        requests = sched.decode + list(drafts)
        if requests != self.requests or drafts or self.drafts:
            self._regroup(requests, drafts)
        for req, i in sched.new_blocks:
            self._last_block(req, i)
        n, G = self.n, self.groups
        self.ids[:n] = [token for req in self.requests for token in self.drafts.get(req, req.next_tokens)]
        np.remainder(self.pos[:n], self.B, out=self.wo[:n])
        lens = self.lens[:G]
        np.take(self.pos, self.first[:G], out=lens)
        lens += 1
        np.minimum(lens, self.cap[:G], out=self.slen[:G])  # a beam group's prompt tokens; one sequence's all
        np.subtract(lens, self.slen[:G], out=self.olen[:G])  # each beam's own tokens; one sequence's none

    def reorder(self, req: Request, source: list[int]) -> None:
        """Beam k of `req` continues beam source[k] (engine/update.py): its row takes that beam's own
        blocks and write block (the prompt's blocks and the position are every beam's). A request
        that has no rows yet (its first token) is written whole when it joins."""
        row = self.rows.get(req)
        if row is None:
            return
        self._writable()
        at = [row + k for k in source]
        self.tables[row:row + len(at)] = self.tables[at]
        self.wb[row:row + len(at)] = self.wb[at]

    def clear(self) -> None:
        """Forget the rows (graphs' warm-up writes padding over them): the next step writes each row
        afresh from its request."""
        self._writable()
        self.requests, self.rows, self.width, self.drafts = [], {}, {}, {}
        self.n = self.groups = self.widest = 0

    def _regroup(self, requests: list[Request], drafts: dict[Request, list[int]]) -> None:
        """The rows of `requests`, in its order: a request that decoded in the last step and decodes
        now keeps what its rows hold (moved past the rows freed or taken before them); a newcomer's
        rows, and a verified request's (`drafts`: its tokens) now or in the last step, are written
        from its sequences. The groups' first rows, table offsets and caps follow: a group a
        request (a verified request's: one staired group with `stairs`, else a group a token)."""
        rows, width, fresh, at, source, row = {}, {}, [], [], [], 0
        for req in requests:
            old = None if req in drafts or req in self.drafts else self.rows.get(req)
            width[req] = len(drafts[req]) if req in drafts else req.n_seqs
            if old is None:
                fresh.append(req)
            elif old != row:
                at += range(row, row + width[req])
                source += range(old, old + width[req])
            rows[req] = row
            row += width[req]
        if at:  # (the right-hand sides are copies: rows may move either way)
            for array in (self.pos, self.wb, self.tables, self.prompts):
                array[at] = array[source]
        self.requests, self.rows, self.width, self.drafts, self.n = list(requests), rows, width, drafts, row
        for req in fresh:
            self._write(req, rows[req], width[req] if req in drafts else 0)
        stairs = self.stairs
        groups = [g for req in requests  # (its request, its rows)
                  for g in ([(req, 1)] * width[req] if req in drafts and not stairs else [(req, width[req])])]
        G = len(groups)
        seqs = np.fromiter((k for _, k in groups), dtype=np.int64, count=G)
        np.cumsum(seqs, out=self.row0[1:G + 1])
        self.first[:G] = self.row0[:G]
        beams = seqs > 1  # (a staired draft's rows too: its shared blocks in `prompts`)
        self.cap[:G] = np.where(beams, [self._shared_tokens(req, req in drafts) for req, _ in groups], ALL_SHARED)
        if stairs:
            self.stair[:G] = [int(req in drafts) for req, _ in groups]
        self.soff[:G] = self.first[:G] * self.M + beams * self.prompts_at
        self.groups, self.widest = G, int(seqs.max()) if G else 0
        self.prompts_changed = True

    def _shared_tokens(self, req: Request, draft: bool) -> int:
        """A group of several rows' shared tokens: a beam request's prompt blocks', a staired draft's
        full blocks before its first token."""
        return req.seqs[0].length // self.B * self.B if draft else req.shared * self.B

    def _write(self, req: Request, row: int, draft: int = 0) -> None:
        """A request's rows from its sequences: positions, write blocks and block tables (a beam
        request's prompt blocks once, in `prompts` at its first row; each beam's own in its row).
        draft > 0: a verified request's `draft` rows, its token i at position L + i; each row with the
        sequence's blocks, or, staired, the full blocks before L in `prompts` and the rest its own."""
        if draft:
            (seq,) = req.seqs
            at = seq.length + np.arange(draft)
            self.pos[row:row + draft] = at
            self.wb[row:row + draft] = np.asarray(seq.blocks)[at // self.B]
            shared = seq.length // self.B if self.stairs else 0
            self.prompts[row, :shared] = seq.blocks[:shared]
            self.tables[row:row + draft, :len(seq.blocks) - shared] = seq.blocks[shared:]
            return
        shared = req.shared if req.n_seqs > 1 else 0
        for i, seq in enumerate(req.seqs):
            own = seq.blocks[shared:]
            self.pos[row + i] = seq.length
            self.wb[row + i] = seq.blocks[seq.length // self.B]
            self.tables[row + i, :len(own)] = own
        if shared:
            self.prompts[row, :shared] = req.seqs[0].blocks[:shared]

    def _last_block(self, req: Request, i: int) -> None:
        """Sequence i of `req` has a new last block (allocated, or its own copy of a shared one): its
        table ends with it, and its row's token goes there (the scheduler gives a sequence the block
        of its next token last)."""
        row = self.rows.get(req)
        if row is None:  # (not decoding: the scheduler gives blocks only to the requests it decodes)
            return
        blocks = req.seqs[i].blocks
        self.tables[row + i, len(blocks) - 1 - (req.shared if req.n_seqs > 1 else 0)] = blocks[-1]
        self.wb[row + i] = blocks[-1]

    def _writable(self) -> None:
        """Wait until the last copies out of the host arrays are done (CUDA: done already when the
        last step's choices were read, which came after them)."""
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None

    # --- the step's rows on the device ---

    def tile(self, group_rows: int = 1) -> int:
        """The decode kernels' tile of this step padded with groups of group_rows rows."""
        return row_tile(max(self.widest, group_rows))

    def step(self) -> BatchRows:
        """This step's rows as they are (an eager forward's), on the device."""
        n, G = self.n, self.groups
        self._commit(n)
        spans = (self.row0[:G + 1], self.soff[:G], self.slen[:G], self.olen[:G]) + ((self.stair[:G],) if self.stairs else ())
        return self._rows(n, G, self.widest, int(self.slen[:G].max()) if G else 0, spans)

    def padded(self, size: int, group_rows: int = 1) -> BatchRows:
        """This step's rows padded to `size` (a graph's bucket), on the device: rows n .. size - 1 are
        padding, in groups of group_rows rows, each writing its token (0, at position 0) into row 0 of
        the scratch block and reading that one token back; the groups past them read nothing. Its
        splits cover a sequence's most tokens (M blocks), whatever the step's lengths."""
        self._writable()
        n, G, K = self.n, self.groups, group_rows
        self.ids[n:size] = self.pos[n:size] = self.wo[n:size] = 0
        self.wb[n:size] = self.tables[n:size, 0] = self.scratch
        pads = (size - n) // K
        starts = n + K * np.arange(pads + 1)  # each padding group's first row, then their end
        self.row0[G + 1:G + pads + 1] = starts[1:]
        self.row0[G + pads + 1:size + 1] = starts[-1]
        self.soff[G:G + pads], self.slen[G:G + pads] = starts[:-1] * self.M, 1
        self.soff[G + pads:size] = self.slen[G + pads:size] = self.olen[G:size] = 0
        self._commit(size)
        return self._rows(size, size, self.tile(K), self.M * self.B, None)

    def _commit(self, rows: int) -> None:
        """CUDA: queue the copies of the first `rows` rows and every group's values to the device
        buffers (the beam groups' prompt tables only when they changed), and mark when they are
        done. On a CPU the device buffers are the host arrays: nothing to copy."""
        if not self.longs.copied:
            return
        self.longs.copy(0, self.longs.starts[3] + rows)
        self.ints.copy(0, self.ints.starts[4] + rows * self.M)
        if self.prompts_changed:
            self.ints.copy(self.ints.starts[5], self.ints.starts[5] + rows * self.M)
            self.prompts_changed = False
        self.copied = torch.cuda.Event()
        self.copied.record()

    def _rows(self, rows: int, groups: int, max_rows: int, max_shared: int,
              spans: tuple[np.ndarray, ...] | None) -> BatchRows:
        """The device buffers' first `rows` rows and first `groups` groups, as a forward reads them."""
        views = self._views.get((rows, groups))
        if views is None:  # (made once for each size: a step's sizes change only when its requests do)
            if len(self._views) > 64:
                self._views.clear()
            row0, soff, slen, olen, tables, _ = self.ints.device
            stab = self.ints.device_tensor[self.ints.starts[4]:self.ints.starts[5] + self.max_rows * self.M]
            views = self._views[rows, groups] = (
                *(t[:rows] for t in self.longs.device), row0[:groups + 1], stab, soff[:groups], slen[:groups],
                tables.view(self.max_rows, self.M)[:rows], olen[:groups])
        ids, pos, wb, wo, *table_views = views
        stair = self.stair_tensor[:groups] if self.stairs else None
        decode = DecodeRows(wb, wo, DecodeTables(*table_views, max_rows, max_shared, stair), self.B, spans)
        return BatchRows(ids, pos, decode, row_tile(max_rows))
