"""The reference backend: torch's own ops, one decode group at a time. The ground truth every other
backend is tested against, and what runs where none of them applies (float32 — exact —, kernels
"off", CPUs without gptj.native, devices without a backend of their own).

Each group's blocks are gathered into one tensor (quantized blocks dequantized to the model's dtype) and
computed by the forms below:

    one sequence   q (H, D) over its own blocks                                   greedy, sampled
    a beam group   q (N, H, D) over the prompt's blocks, shared, then each beam's  beam search
                   own blocks; softmax over [shared | own]

Grouped-query attention (the PagedKV holds KV < H heads, each serving H / KV query heads: Llama) runs
gptj.models.base.gqa_attention — models.llama's own attention, float32 op for op — on each row's
gathered keys and values (a beam's: the shared prompt's, then its own), eagerly in every mode (the
cpu-native and cuda backends compute it in their kernels: gptj.policy.attention_path).

Scores and softmax are float32 (HF's rule). Eagerly, float32 runs gptj.models.base.attention's exact
math and the beam groups matmuls plus float32 products; at these shapes (a single query row per
head) torch's batched matmuls and CPU SDPA are slow — SDPA took 965 us for 16 heads x 1000 keys
x 64 where a compiled loop takes ~150 us. So the compiled form (CUDA only:
policy.compile_trusted) writes the same formula as products and sums, which inductor turns into
one pass over the keys and one over the values. Each group is computed on its own tensors, so a
request's result never depends on what else shares the step (batch invariance in every mode).
"""

from __future__ import annotations

import logging
import math

import torch

from gptj.engine.attention.base import AttentionBackend, StepMetadata
from gptj.engine.attention.kv_cache import PagedKV
from gptj.fallback import Fallbacks
from gptj.models.base import attention, gqa_attention
from gptj.policy import exact

log = logging.getLogger(__name__)


# --- eager ------------------------------------------------------------------------------------------

def one_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (H, D), k, v (H, L, D) -> (H, D): gptj.models.base.attention on one query (float32: exact).

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


class ReferenceAttention(AttentionBackend):
    """torch's forms, group by group; `compiled`: the torch.compile'd sums (policy.attention_path
    decides). If compiling or running a compiled form fails, it logs one warning and stays eager."""

    name = "reference"
    stairs = True  # a draft's rows as one group (decode: each over its own keys)

    def __init__(self, compiled: bool = False) -> None:
        self.compiled = compiled
        self.fallbacks = Fallbacks(log)  # the paths that failed here (this class's: "compile")
        self._one, self._group = one_eager, group_eager
        if compiled:
            try:
                self._one = torch.compile(one_sums, dynamic=True)
                self._group = torch.compile(group_sums, dynamic=True)
            except Exception as e:  # noqa: BLE001 - torch.compile unavailable: eager it is
                self._fall_back(e)

    def _fall_back(self, error: Exception) -> None:
        self.fallbacks.fail("compile", "torch.compile", error, "decode attention runs eagerly")
        self.compiled = False
        self._one, self._group = one_eager, group_eager

    def one(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.compiled:
            try:
                return self._one(q, k, v)
            except Exception as e:  # noqa: BLE001 - e.g. no compiler for inductor
                self._fall_back(e)
        return one_eager(q, k, v)

    def group(self, q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, tk: torch.Tensor,
              tv: torch.Tensor) -> torch.Tensor:
        if self.compiled:
            try:
                return self._group(q, pk, pv, tk, tv)
            except Exception as e:  # noqa: BLE001
                self._fall_back(e)
        return group_eager(q, pk, pv, tk, tv)

    def decode(self, kv: PagedKV, layer: int, q: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        if kv.k[layer].shape[1] < q.shape[1]:
            return self.decode_grouped(kv, layer, q, meta)
        out = torch.empty(q.shape, dtype=kv.compute, device=q.device)
        H, D = q.shape[1], q.shape[2]
        row = 0
        for g, (shared, own) in zip(meta.groups, meta.group_blocks):
            n = g.rows
            pk, pv = kv.gather(layer, shared, g.shared_len)
            if not g.most_own:  # one sequence: all of it is "shared"
                out[row] = self.one(q[row], pk, pv)
            elif g.stair:
                self._staired(kv, layer, q, g, pk, pv, own, out, self.one)
            else:
                ok, ov = kv.blocks(layer, own)  # (n, m, H, B, D)
                tk = ok.transpose(1, 2).reshape(n, H, -1, D)[:, :, :g.own_len]  # (n, H, own_len, D)
                tv = ov.transpose(1, 2).reshape(n, H, -1, D)[:, :, :g.own_len]
                out[row:row + n] = self.group(q[row:row + n], pk, pv, tk, tv)
            row += n
        return out

    def decode_grouped(self, kv: PagedKV, layer: int, q: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """decode under grouped-query attention: q (N, H, D) over KV < H heads; each group's rows over
        [its shared keys | each row's own] by gqa_attention (beams: the shared keys repeated per row)."""
        out = torch.empty(q.shape, dtype=kv.compute, device=q.device)
        KV, D = kv.k[layer].shape[1], q.shape[2]
        for g, (shared, own) in zip(meta.groups, meta.group_blocks):
            n, rows = g.rows, slice(g.row0, g.row0 + g.rows)
            pk, pv = kv.gather(layer, shared, g.shared_len)  # (KV, P, D)
            if g.stair:
                self._staired(kv, layer, q, g, pk, pv, own, out,
                              lambda q1, k, v: gqa_attention(q1[None, :, None], k[None], v[None], None)[0, :, 0])
                continue
            k, v = pk.expand(n, -1, -1, -1), pv.expand(n, -1, -1, -1)  # (n, KV, P, D)
            if g.own_len:
                ok, ov = kv.blocks(layer, own)  # (n, m, KV, B, D)
                k = torch.cat([k, ok.transpose(1, 2).reshape(n, KV, -1, D)[:, :, :g.own_len]], dim=2)
                v = torch.cat([v, ov.transpose(1, 2).reshape(n, KV, -1, D)[:, :, :g.own_len]], dim=2)
            out[rows] = gqa_attention(q[rows, :, None], k, v, None)[:, :, 0]
        return out

    @staticmethod
    def _staired(kv: PagedKV, layer: int, q: torch.Tensor, g, pk: torch.Tensor, pv: torch.Tensor,
                 own: torch.Tensor, out: torch.Tensor, one) -> None:
        """A staired group's rows (a speculative draft's, GroupSpan.stair): row i over the shared keys
        pk, pv (heads, P, D) and the first own_len + i * stair of its own, by `one`(q (H, D), k, v
        (heads, L, D)) -> (H, D): the keys and the call decoding its token alone would have."""
        ok, ov = kv.blocks(layer, own)  # (rows, m, heads, B, D)
        heads, D = pk.shape[0], pk.shape[-1]
        for i in range(g.rows):
            L = g.own_len + i * g.stair
            tk, tv = (x[i].transpose(0, 1).reshape(heads, -1, D)[:, :L] for x in (ok, ov))  # (heads, L, D)
            out[g.row0 + i] = one(q[g.row0 + i], torch.cat([pk, tk], dim=1), torch.cat([pv, tv], dim=1))

    def prefill(self, kv: PagedKV, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: StepMetadata, i: int) -> torch.Tensor:
        """gptj.models.base.attention (grouped-query: gqa_attention) with a causal mask; over this call's
        keys when nothing was stored before (and the blocks are not quantized), else over the gathered blocks."""
        seg, slots = meta.segments[i], meta.slots[i]
        T, end = seg.length, seg.start + seg.length
        qh = q.transpose(0, 1)[None]  # (1, H, T, D)
        causal = torch.zeros((T, end), dtype=torch.float32, device=q.device)
        keys_at = torch.arange(end, device=q.device)[None, :]
        causal.masked_fill_(keys_at > slots.positions[:, None], torch.finfo(torch.float32).min)
        if seg.start == 0 and not kv.quantized:  # nothing stored before: this call's keys are all of them
            keys, values = k.transpose(0, 1), v.transpose(0, 1)
        else:
            keys, values = kv.gather(layer, slots.table, end)
        if keys.shape[0] < q.shape[1]:  # grouped-query attention (KV < H heads)
            out = gqa_attention(qh, keys[None], values[None], causal)
        else:
            out = attention(qh, keys[None], values[None], causal, causal=seg.start == 0 and not kv.quantized)
        return out[0].transpose(0, 1)
