"""Decode-step attention (one new token per sequence), eager or compiled with torch.compile.

Two shapes occur in a decode step (see engine/kv.py):

    one sequence   q (H, D) over its own keys/values k, v (H, L, D)        greedy and sampled requests
    a beam group   q (N, H, D) over a shared prompt pk, pv (H, P, D) and   beam search
                   its own tails tk, tv (N, H, T, D); softmax over [prompt | tail]

Scores and softmax are float32 (HF's rule). Eagerly, float32 runs gptj.model.attention's exact
math and the beam groups matmuls plus float32 products; at these shapes (a single query row per
head) torch's batched matmuls and CPU SDPA are slow — SDPA took 965 us for 16 heads x 1000 keys x
64 where a compiled loop takes ~150 us. So the compiled form writes the same formula as
products and sums, which inductor turns into one pass over the keys and one over the values.

Each group calls these on its own tensors, so a request's result never depends on what else
shares the step (batch invariance holds in either mode). The compiled form rounds differently
from the eager one; `DecodeAttention("auto")` therefore compiles only below float32 and leaves
float32 on the exact eager math.
"""

from __future__ import annotations

import logging
import math

import torch

from gptj.model import attention

COMPILE_MODES = ("auto", "on", "off")

log = logging.getLogger(__name__)


# --- eager ------------------------------------------------------------------------------------------

def one_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (H, D), k, v (H, L, D) -> (H, D): gptj.model.attention on one query (float32: exact).

    Below float32: matmuls in the dtype, scores and softmax in float32 (CPU SDPA is 2x slower
    for a single query row)."""
    if q.dtype == torch.float32:
        return attention(q[None, :, None], k[None], v[None], None)[0, :, 0]
    s = torch.matmul(q[:, None, :], k.transpose(-1, -2)).float() * (1.0 / math.sqrt(q.shape[-1]))  # (H, 1, L)
    return torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)[:, 0]


def group_eager(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, tk: torch.Tensor,
                tv: torch.Tensor) -> torch.Tensor:
    """q (N, H, D) over [shared prompt pk, pv (H, P, D) | own tails tk, tv (N, H, T, D)] -> (N, H, D)."""
    scale = math.sqrt(q.shape[-1])
    exact = q.dtype == torch.float32
    qh = q.transpose(0, 1)  # (H, N, D): all of the group's sequences against the prompt in one matmul
    s_prompt = torch.matmul(qh.float() if exact else qh, pk.transpose(-1, -2)).float()  # (H, N, P)
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

    mode "auto" compiles when the KV dtype is below float32 (and torch.compile works here),
    "on" compiles whatever the dtype, "off" never does. native=True (the engine's kernels "auto"):
    bfloat16 KV on CPU goes first to gptj.native's attention kernel when it is available. If
    compiling or running a compiled form fails, it logs one warning and stays eager from then on.
    """

    # Groups with fewer keys than this run eager. Measured on slot views (16 heads, bf16): compiled
    # 62-150 us vs eager 194-567 us from 40 to 160 keys, so compiled forms are used at every length.
    min_context = 0

    def __init__(self, mode: str, kv_dtype: torch.dtype, native: bool = False) -> None:
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
        self.native, self._kernels = False, None
        if native and kv_dtype == torch.bfloat16:
            from gptj import native as _native

            self._kernels = _native
            # gptj.native's kernel reads a shared prompt once for all beams: 2x the compiled form at
            # GPT-J 6B's head shapes (16 x 256, 800-token prompt, 4 beams: 1.75 vs 3.78 ms per layer).
            self.native = _native.available()
        self.compiled = mode == "on" or (mode == "auto" and kv_dtype != torch.float32)
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
