"""Decode attention over paged KV memory (one new token per sequence), and the paged memory itself.

`PagedKV` holds every layer's keys and values in blocks (n_blocks, H, B, D); `PagedBatch` is the
cache one forward pass sees: it writes the new keys/values into their blocks and attends. A
decode step's requests are groups (`DecodeGroup`):

    one sequence   q (H, D) over its own blocks                                   greedy, sampled
    a beam group   q (N, H, D) over the prompt's blocks, shared, then each beam's  beam search
                   own blocks; softmax over [shared | own]

With gptj.native (a bfloat16 model on an AVX-512 CPU, bfloat16 or int8 KV) one call computes
every group of a step, reading the blocks in place and a shared prompt once per 8 beams; a prompt
chunk's prefill likewise attends over its blocks in place (causal, no mask, no gathered copy), and
the new keys and values are stored (int8: rounded) in one pass. Otherwise each group's blocks are
gathered into one tensor (int8 blocks dequantized to the model's dtype) and computed by the forms
below. Scores and softmax are float32 (HF's
rule). Eagerly, float32 runs gptj.model.attention's exact math and the beam groups matmuls plus
float32 products; at these shapes (a single query row per head) torch's batched matmuls and CPU
SDPA are slow — SDPA took 965 us for 16 heads x 1000 keys x 64 where a compiled loop takes ~150
us. So the compiled form writes the same formula as products and sums, which inductor turns into
one pass over the keys and one over the values.

Each group is computed on its own tensors, so a request's result never depends on what else
shares the step (batch invariance holds in every mode). Which form runs is
gptj.policy.attention_path's choice: compiled only below float32 under "auto" (the compiled
form rounds differently from the eager one) and only on CUDA (policy.compile_trusted: torch
2.13's CPU code for these forms was wrong), native only for bfloat16 on CPU.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gptj.config import GPTJConfig
from gptj.engine.config import COMPILE_MODES, KV_SCALE_DTYPE, kv_bytes_per_token
from gptj.errors import GptjError
from gptj.policy import attention_path, exact
from gptj.quant.ops import quantize_rows_int8
from gptj.model import attention

log = logging.getLogger(__name__)


# --- eager ------------------------------------------------------------------------------------------

def one_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (H, D), k, v (H, L, D) -> (H, D): gptj.model.attention on one query (float32: exact).

    Below float32: matmuls in the dtype, scores and softmax in float32 (CPU SDPA is 2x slower
    for a single query row)."""
    if exact(q.dtype):
        return attention(q[None, :, None], k[None], v[None], None)[0, :, 0]
    s = torch.matmul(q[:, None, :], k.transpose(-1, -2)).float() * (1.0 / math.sqrt(q.shape[-1]))  # (H, 1, L)
    return torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)[:, 0]


def group_eager(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, tk: torch.Tensor,
                tv: torch.Tensor) -> torch.Tensor:
    """q (N, H, D) over [shared prompt pk, pv (H, P, D) | own tails tk, tv (N, H, T, D)] -> (N, H, D)."""
    scale = math.sqrt(q.shape[-1])
    qh = q.transpose(0, 1)  # (H, N, D): all of the group's sequences against the prompt in one matmul
    s_prompt = torch.matmul(qh.float() if exact(q.dtype) else qh, pk.transpose(-1, -2)).float()  # (H, N, P)
    # The tails are short (<= max_new_tokens): float32 products and sums beat many tiny batched matmuls.
    s_tail = (q.float()[:, :, None, :] * tk.float()).sum(-1).transpose(0, 1)  # (H, N, T)
    probs = torch.softmax(torch.cat([s_prompt, s_tail], dim=-1) / scale, dim=-1)  # float32
    P = pk.shape[1]
    out = torch.matmul(probs[..., :P].to(pv.dtype), pv)  # (H, N, D)
    out_tail = (probs[..., P:].transpose(0, 1)[..., None] * tv.float()).sum(-2)  # (N, H, D) float32
    return out.transpose(0, 1) + out_tail.to(pv.dtype)


# --- the compiled forms (the same formulas as products and sums) --------------------------------------

def one_sums(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    s = (k.float() * q.float()[:, None, :]).sum(-1) * (1.0 / math.sqrt(q.shape[-1]))  # (H, L)
    p = torch.softmax(s, dim=-1)
    return (p[..., None] * v.float()).sum(-2).to(v.dtype)


def group_sums(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, tk: torch.Tensor,
               tv: torch.Tensor) -> torch.Tensor:
    qf = q.float()[:, :, None, :]  # (N, H, 1, D)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s_prompt = (pk.float()[None] * qf).sum(-1)  # (N, H, P)
    s_tail = (tk.float() * qf).sum(-1)  # (N, H, T)
    p = torch.softmax(torch.cat([s_prompt, s_tail], dim=-1) * scale, dim=-1)
    P = pk.shape[1]
    out = (p[..., :P, None] * pv.float()[None]).sum(-2) + (p[..., P:, None] * tv.float()).sum(-2)
    return out.to(pv.dtype)


class DecodeAttention:
    """The engine's decode attention: `one` and `group`, compiled or eager by `mode`.

    mode "auto" compiles when the compute dtype is below float32 (and torch.compile works here),
    "on" compiles whatever the dtype, "off" never does; on CUDA only (policy.compile_trusted).
    native=True (the engine's kernels "auto"):
    a bfloat16 model's KV on CPU (bfloat16 or int8 blocks) goes first to gptj.native's attention
    kernels when they are available (policy.attention_path). If
    compiling or running a compiled form fails, it logs one warning and stays eager from then on.
    """

    # Groups with fewer keys than this run eager. Measured on slot views (16 heads, bf16): compiled
    # 62-150 us vs eager 194-567 us from 40 to 160 keys, so compiled forms are used at every length.
    min_context = 0

    def __init__(self, mode: str, kv_dtype: torch.dtype, native: bool = False,
                 device: torch.device | str = "cpu", compute: torch.dtype | None = None) -> None:
        """native: the engine's kernels mode is "auto" (gptj.native where the policy allows it).
        kv_dtype: the KV storage; compute: the model's float dtype (None: kv_dtype)."""
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
        # gptj.native's kernel reads a shared prompt once for all beams: 2x the compiled form at
        # GPT-J 6B's head shapes (16 x 256, 800-token prompt, 4 beams: 1.75 vs 3.78 ms per layer).
        path = attention_path(device, kv_dtype, "auto" if native else "off", mode, compute)
        self.native, self.compiled = path.native, path.compiled
        if self.native:
            from gptj import native as _native

            self._kernels = _native
        self._one, self._group = one_eager, group_eager
        if self.compiled:
            try:
                self._one = torch.compile(one_sums, dynamic=True)
                self._group = torch.compile(group_sums, dynamic=True)
            except Exception as e:  # noqa: BLE001 - torch.compile unavailable: eager it is
                self._fall_back(e)

    def _fall_back(self, error: Exception) -> None:
        first = str(error).splitlines()[0] if str(error) else ""
        log.warning("torch.compile failed (%s: %s); decode attention runs eagerly", type(error).__name__, first)
        self.compiled = False
        self._one, self._group = one_eager, group_eager

    def _use_native(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        return self.native and k.is_cpu and k.dtype == torch.bfloat16 and q.shape[-1] % 16 == 0

    def native_paged(self, kc: torch.Tensor) -> bool:
        """Whether a decode batch over these key blocks (n_blocks, H, B, D) runs gptj.native's paged
        kernel (bfloat16 blocks, or int8 ones with their scales)."""
        return (self.native and kc.is_cpu and kc.dtype in (torch.bfloat16, torch.int8) and kc.shape[-1] % 16 == 0
                and kc.shape[-1] <= 512)

    def paged(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: tuple[torch.Tensor, ...],
              scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)) -> torch.Tensor:
        """q (N, H, D) over paged blocks, every group at once (gptj.native.attention_paged) -> float32.
        scales: int8 blocks' (k_scale, v_scale)."""
        return self._kernels.attention_paged(q, kc, vc, *tables, *scales)

    def prefill(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, start: int,
                scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)) -> torch.Tensor:
        """A prompt chunk's queries q (T, H, D) from position `start`, causal over the blocks of `table`
        (gptj.native.prefill_paged; where native_paged holds) -> (T, H, D) bfloat16."""
        return self._kernels.prefill_paged(q, kc, vc, table, start, *scales)

    def native_store(self, kc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                     offsets: torch.Tensor) -> bool:
        """Whether gptj.native stores these keys and values (`store`): blocks it reads, bfloat16 keys and
        values whose heads lie side by side (the fused block's q|k|v), int64 block ids and offsets."""
        D = k.shape[-1]
        return (self.native_paged(kc) and k.dtype == v.dtype == torch.bfloat16 and k.stride(-1) == v.stride(-1) == 1
                and k.stride(-2) == v.stride(-2) == D and blocks.dtype == offsets.dtype == torch.int64)

    def store(self, kc: torch.Tensor, vc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
              offsets: torch.Tensor, scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)) -> None:
        """Token n's key and value k[n], v[n] (N, H, D) into block blocks[n], row offsets[n], of
        kc, vc (n_blocks, H, B, D), int8 blocks rounded per head with their `scales`
        (gptj.native.store_kv; where native_store holds)."""
        self._kernels.store_kv(k, v, kc, vc, blocks, offsets, *scales)

    def one(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._use_native(q, k):
            return self._kernels.attention_group(q[None], k, v)[0].to(v.dtype)
        if not self.compiled:
            return one_eager(q, k, v)
        try:
            return self._one(q, k, v)
        except Exception as e:  # noqa: BLE001 - e.g. no C++ compiler for inductor
            self._fall_back(e)
            return one_eager(q, k, v)

    def group(self, q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, tk: torch.Tensor,
              tv: torch.Tensor) -> torch.Tensor:
        if self._use_native(q, pk):
            return self._kernels.attention_group(q, pk, pv, tk, tv).to(pv.dtype)
        if not self.compiled:
            return group_eager(q, pk, pv, tk, tv)
        try:
            return self._group(q, pk, pv, tk, tv)
        except Exception as e:  # noqa: BLE001
            self._fall_back(e)
            return group_eager(q, pk, pv, tk, tv)


# --- paged keys and values --------------------------------------------------------------------------

class PagedKV:
    """Every layer's keys and values in blocks of B tokens: k[layer], v[layer] (n_blocks, H, B, D).

    Which block holds what is engine/kv.py's bookkeeping; a sequence's token t lies in block
    blocks[t // B], row t % B. n_head: this rank's heads (tensor parallel).

    `dtype` is the storage (engine.config.kv_storage). int8 (`quantized`): each token's head vector
    of D values is stored as round(x / s) with s = max |x| / 127 in k_scale / v_scale[layer]
    (n_blocks, H, B), float32, and read back as q * s in `compute` (the model's dtype): |error| <= s / 2."""

    def __init__(self, config: GPTJConfig, n_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, n_head: int | None = None, compute: torch.dtype | None = None) -> None:
        shape = (n_blocks, n_head or config.n_head, block_size, config.head_dim)
        self.quantized = dtype == torch.int8
        self.compute = compute or (torch.float32 if self.quantized else dtype)
        try:  # zeros, not empty: every page is touched now, not by the first requests (a page fault each)
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
            self.v = [torch.zeros_like(t) for t in self.k]
            if self.quantized:
                self.k_scale = [torch.zeros(shape[:3], dtype=KV_SCALE_DTYPE, device=device) for _ in self.k]
                self.v_scale = [torch.zeros_like(t) for t in self.k_scale]
        except (RuntimeError, MemoryError) as e:
            gb = n_blocks * block_size * kv_bytes_per_token(config, dtype, shape[1]) / 1e9
            raise GptjError(f"cannot allocate {gb:.1f} GB of KV memory ({n_blocks} blocks of {block_size} tokens): "
                            f"{str(e).splitlines()[0]}") from None
        self.block_size = block_size

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.k, *self.v, *(self.k_scale + self.v_scale if self.quantized else ()))

    def copy(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """Copy-on-write: block dst gets the first n tokens of block src, for each (src, dst, n)."""
        for src, dst, n in copies:
            for t in self._tensors():
                t[dst, :, :n] = t[src, :, :n]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
              decode: DecodeAttention) -> None:
        """Token n's key and value k[n], v[n] (N, H, D) into block blocks[n], row offsets[n]: by
        gptj.native where DecodeAttention.native_store holds, else by indexing (int8 storage:
        quantize_heads first; the native store rounds the same way)."""
        kc, vc = self.k[layer], self.v[layer]
        if decode.native_store(kc, k, v, blocks, offsets):
            decode.store(kc, vc, k, v, blocks, offsets, self.scales(layer))
        elif not self.quantized:
            kc[blocks, :, offsets] = k
            vc[blocks, :, offsets] = v
        else:
            for x, cache, scales in ((k, kc, self.k_scale[layer]), (v, vc, self.v_scale[layer])):
                q, s = quantize_heads(x)
                cache[blocks, :, offsets] = q
                scales[blocks, :, offsets] = s

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """int8 blocks' (k_scale, v_scale) of a layer; (None, None) for float blocks."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.quantized else (None, None)

    def blocks(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the blocks `index` (any shape I) as (*I, H, B, D) in the compute dtype."""
        kc, vc = self.k[layer][index], self.v[layer][index]
        if not self.quantized:
            return kc, vc
        return (dequantize_heads(kc, self.k_scale[layer][index], self.compute),
                dequantize_heads(vc, self.v_scale[layer][index], self.compute))

    def gather(self, layer: int, blocks: Sequence[int] | torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` keys and values of a block table as (H, length, D) tensors (compute dtype)."""
        kc = self.k[layer]
        H, D = kc.shape[1], kc.shape[3]
        if len(blocks) == 0 or length == 0:
            empty = torch.empty((H, 0, D), dtype=self.compute, device=kc.device)
            return empty, empty
        if len(blocks) == 1 and not self.quantized:
            b = int(blocks[0])
            return kc[b, :, :length], self.v[layer][b, :, :length]
        index = blocks if isinstance(blocks, torch.Tensor) else torch.tensor(blocks, device=kc.device, dtype=torch.long)
        k, v = self.blocks(layer, index)
        return (k.transpose(0, 1).reshape(H, -1, D)[:, :length], v.transpose(0, 1).reshape(H, -1, D)[:, :length])


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> (int8 (..., D), float32 scale (...)): per head vector, symmetric, s = max |x| / 127
    (gptj.quant's per-row rounding, each head vector a row)."""
    q, s = quantize_rows_int8(x)
    return q, s[..., 0]


def dequantize_heads(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * s, computed in float32 and rounded once to `dtype`."""
    return (q.float() * s[..., None]).to(dtype)


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


class PagedBatch:
    """The KV cache one forward pass sees (model.py calls `attend` once per layer).

    The forward's tokens, in order: one per decode row (row r's new key/value goes to block
    write_blocks[r] at write_offsets[r]; each group attends over its own blocks only), then each
    prefill segment's tokens (stored in its sequence's blocks; its queries attend causally over
    everything stored before them and themselves). No padding: requests of any lengths share a
    forward, and a request's result does not depend on what shares it. The model may lay the
    tokens out as (rows, 1) or (1, tokens); `attend` reads them in that flat order.
    """

    per_sequence = True  # the model builds no padding mask

    def __init__(self, kv: PagedKV, decode: DecodeAttention, *, groups: Sequence[DecodeGroup] = (),
                 write_blocks: Sequence[int] = (), write_offsets: Sequence[int] = (),
                 segments: Sequence[PrefillSegment] = ()) -> None:
        self.kv, self.decode, self.groups, self.segments = kv, decode, list(groups), list(segments)
        device = kv.k[0].device
        self.n_decode = len(write_blocks)
        self._wb = torch.tensor(list(write_blocks), device=device, dtype=torch.long)
        self._wo = torch.tensor(list(write_offsets), device=device, dtype=torch.long)
        native = decode.native_paged(kv.k[0])
        self._native = _native_tables(self.groups) if self.groups and native else None
        self._native_prefill = native
        B = kv.block_size
        self._slots = []  # per segment: where its tokens go, and its block table (the same for every layer)
        for seg in self.segments:
            end = seg.start + seg.length
            pos = torch.arange(seg.start, end, device=device)
            table = torch.tensor(seg.blocks[:-(-end // B)], device=device, dtype=torch.long)
            self._slots.append((table[pos // B], pos % B, table, table.to(torch.int32) if native else None, pos))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """q, k, v: (B, H, T, D), B * T tokens in the order above -> (B, H, T, D)."""
        Bq, H, T, D = q.shape
        qt, kt, vt = (x.transpose(1, 2).reshape(Bq * T, H, D) for x in (q, k, v))  # (tokens, H, D)
        out = torch.empty((Bq * T, H, D), dtype=v.dtype, device=v.device)
        n = self.n_decode
        if n:
            self.kv.store(layer, kt[:n], vt[:n], self._wb, self._wo, self.decode)  # each row's new key, value
            out[:n] = self._decode(layer, qt[:n])
        for seg, slots in zip(self.segments, self._slots):
            out[n:n + seg.length] = self._prefill(layer, seg, slots, qt[n:n + seg.length], kt[n:n + seg.length],
                                                  vt[n:n + seg.length])
            n += seg.length
        return out.view(Bq, T, H, D).transpose(1, 2)

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q (N, H, D): each decode row's query over its group's blocks -> (N, H, D)."""
        kc, vc = self.kv.k[layer], self.kv.v[layer]
        if self._native is not None:
            return self.decode.paged(q, kc, vc, self._native, self.kv.scales(layer)).to(self.kv.compute)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        row = 0
        for g in self.groups:
            n = g.rows
            pk, pv = self.kv.gather(layer, g.shared, g.shared_len)
            if not g.own_len:  # one sequence: all of it is "shared"
                out[row] = self.decode.one(q[row], pk, pv)
            else:
                tables = torch.tensor(g.own, device=q.device, dtype=torch.long)  # (n, m)
                H, D = kc.shape[1], kc.shape[3]
                ok, ov = self.kv.blocks(layer, tables)  # (n, m, H, B, D)
                tk = ok.transpose(1, 2).reshape(n, H, -1, D)[:, :, :g.own_len]  # (n, H, own_len, D)
                tv = ov.transpose(1, 2).reshape(n, H, -1, D)[:, :, :g.own_len]
                out[row:row + n] = self.decode.group(q[row:row + n], pk, pv, tk, tv)
            row += n
        return out

    def _prefill(self, layer: int, seg: PrefillSegment, slots: tuple, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        """A segment's q, k, v (T, H, D): store k, v, then causal attention -> (T, H, D)."""
        T, start = seg.length, seg.start
        end = start + T
        kc, vc = self.kv.k[layer], self.kv.v[layer]
        rows, offsets, table, table32, pos = slots
        self.kv.store(layer, k, v, rows, offsets, self.decode)
        if self._native_prefill:  # over the blocks in place: no mask, no gathered copy of the keys
            return self.decode.prefill(q, kc, vc, table32, start, self.kv.scales(layer))
        qh = q.transpose(0, 1)[None]  # (1, H, T, D)
        causal = torch.zeros((T, end), dtype=torch.float32, device=q.device)
        causal.masked_fill_(torch.arange(end, device=q.device)[None, :] > pos[:, None], torch.finfo(torch.float32).min)
        if start == 0 and not self.kv.quantized:  # nothing stored before: this call's keys are all of them
            out = attention(qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal, causal=True)
        else:
            keys, values = self.kv.gather(layer, table, end)
            out = attention(qh, keys[None], values[None], causal)
        return out[0].transpose(0, 1)

    def advance(self, n: int) -> None:
        pass  # lengths are the engine's bookkeeping


def _native_tables(groups: Sequence[DecodeGroup]) -> tuple[torch.Tensor, ...]:
    """gptj.native.attention_paged's int32 tables for these groups (built once per forward)."""
    row0, stab, soff, slen, olen, own = [0], [], [], [], [], []
    for g in groups:
        soff.append(len(stab))
        stab += g.shared
        slen.append(g.shared_len)
        olen.append(g.own_len)
        own += g.own
        row0.append(row0[-1] + g.rows)
    omax = max(map(len, own))
    otab = [o + [0] * (omax - len(o)) for o in own]
    i32 = torch.int32
    return (torch.tensor(row0, dtype=i32), torch.tensor(stab or [0], dtype=i32), torch.tensor(soff, dtype=i32),
            torch.tensor(slen, dtype=i32), torch.tensor(otab, dtype=i32).reshape(len(own), omax),
            torch.tensor(olen, dtype=i32))
