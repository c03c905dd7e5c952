"""What every architecture's model file shares: the exact-dtype rule, attention over keys and values
(HF's float32 math, torch's SDPA below float32), the contiguous KV cache of `decode.generate`, and
the masks and positions of padded batches, and `CausalLM`: the model's forward, written once.

Shapes: B batch, T new tokens, S = past + T keys, H heads, D head_dim.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gptj.config import GPTJConfig


def exact(dtype: torch.dtype) -> bool:
    """Whether `dtype` runs the exact path (float32: HF's math, op for op), not the fast one."""
    return dtype == torch.float32


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              causal: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v with scores and softmax in float32, as HF GPTJAttention._attn.

    q: (B, H, T, D); k, v: (B, H, S, D); mask: additive float32, broadcastable to (B, H, T, S), or None.
    causal: mask is the plain causal mask of T queries over S = T keys (the fused kernel then skips
    the masked half instead of reading a mask). Returns (B, H, T, D) in v's dtype.

    float32 runs this exact math (`exact`). bfloat16/float16 go through torch's
    fused SDPA instead (softmax accumulated in float32 inside the kernel), which never materialises
    float32 copies of the keys and values — the same formula, a different rounding; tests bound the
    difference.
    """
    if not exact(q.dtype) and q.dtype == k.dtype == v.dtype:
        if causal and q.shape[-2] == k.shape[-2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        bool_mask = None if mask is None else mask == 0  # additive 0 / min -> True where allowed
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, KV, S, D) -> (B, KV * groups, S, D): query head h reads KV head h // groups."""
    if groups == 1:
        return x
    B, KV, S, D = x.shape
    return x[:, :, None].expand(B, KV, groups, S, D).reshape(B, KV * groups, S, D)


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T * D^-0.5 + mask) v for q (B, H, T, D) over k, v (B, KV, S, D); (B, H, T, D).

    float32: HF's eager attention op for op (scale as a multiplication by D^-0.5, softmax in
    float32; models.llama's attention); below float32: `attention` (torch's SDPA) on the repeated keys and
    values. The engine's reference backend (engine/attention/reference.py) runs it over paged keys.
    """
    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    if not exact(q.dtype):
        return attention(q, k, v, mask)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, H, T, S)
    if mask is not None:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)


class KVCache:
    """Keys and values of every layer, preallocated for `max_len` positions.

    k[layer], v[layer]: (B, H, max_len, D). Positions [0, length) are filled; a forward
    pass writes its T new positions after them and attends over [0, length + T).
    """

    def __init__(self, config: GPTJConfig, batch_size: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str, n_head: int | None = None) -> None:
        # n_head: the heads this process computes (tensor parallel: n_head / world size)
        shape = (batch_size, n_head or config.n_head, max_len, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.max_len = max_len
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H, T, D) after the filled positions; return all keys and values so far."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions > max_len {self.max_len}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Store this call's k, v and attend over everything cached: (B, H, T, D)."""
        k, v = self.update(layer, k, v)
        return attention(q, k, v, mask)

    def advance(self, n: int) -> None:
        self.length += n

    def rows(self, rows: slice) -> KVCache:
        """A view of some rows (a pipeline micro-batch): writes land in this cache; the caller
        advances this cache, not the view."""
        view = object.__new__(KVCache)
        view.k, view.v = [t[rows] for t in self.k], [t[rows] for t in self.v]
        view.max_len, view.length = self.max_len, self.length
        return view

    def reorder(self, index: torch.Tensor) -> None:
        """Row b becomes old row index[b] (beam search keeps the beams it selected)."""
        n = self.length
        for cache in (self.k, self.v):
            for layer, t in enumerate(cache):
                if t.shape[0] == index.shape[0]:
                    t[:, :, :n] = t[:, :, :n].index_select(0, index)
                else:  # batch size changes: allocate anew
                    cache[layer] = t.index_select(0, index)


def causal_mask(attention_mask: torch.Tensor, T: int) -> torch.Tensor:
    """Additive float32 mask (B, 1, T, S) from a (B, S) padding mask whose last T entries are the queries.

    Query i (absolute position S - T + i) sees key j if j <= S - T + i and key j is not padding.
    Masked entries get float32's most negative value (not -inf), so a row that sees nothing
    (a padding query) stays finite, as in HF.
    """
    B, S = attention_mask.shape
    q_pos = torch.arange(S - T, S, device=attention_mask.device)[:, None]  # (T, 1)
    k_pos = torch.arange(S, device=attention_mask.device)[None, :]  # (1, S)
    allowed = (k_pos <= q_pos)[None, None] & attention_mask.bool()[:, None, None, :]  # (B, 1, T, S)
    zero = torch.zeros((), dtype=torch.float32, device=attention_mask.device)
    return torch.where(allowed, zero, torch.finfo(torch.float32).min)


def position_ids_from_mask(attention_mask: torch.Tensor, T: int) -> torch.Tensor:
    """Position of each of the last T tokens: count of real tokens before it (HF generate's rule)."""
    pos = attention_mask.long().cumsum(-1) - 1
    pos = pos.masked_fill(attention_mask == 0, 1)
    return pos[:, -T:]


def kept_positions(h: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """h (B, T, E) at the positions whose logits are computed (see GPTJForCausalLM.forward)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return h[:, logits_to_keep]
    return h[:, -logits_to_keep:] if logits_to_keep > 0 else h


class CausalLM(nn.Module):
    """What gptj's decode loops and engine call on a causal language model, written once for every
    architecture: forward = step_inputs -> run_layers -> logits. A subclass (gptj.models.gptj,
    gptj.models.llama) holds `config` (with n_positions), `transformer` (wte, h, ln_f) and `lm_head`, and
    gives `rotary` (the tables its blocks take after h, from the positions), `init_buffers` (its
    float32 rotary buffer, rebuilt on the weights' device) and `kv_heads`."""

    config: Any
    transformer: nn.Module
    lm_head: nn.Module

    def rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        raise NotImplementedError

    @property
    def kv_heads(self) -> int:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - torch.nn.Module's signature
        # .to(dtype) / .cuda() would cast the rotary buffer with the weights; rebuild it in float32
        # on the weights' device instead, so precision changes never degrade positions.
        super()._apply(fn, recurse)
        self.init_buffers(self.transformer.wte.weight.device)
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
        """Logits (B, T', vocab) in float32: all T positions, the last `logits_to_keep` if > 0, or the
        positions it lists if it is a tensor (HF's logits_to_keep).

        input_ids: (B, T) new tokens. attention_mask: (B, past + T), 1 for tokens, 0 for padding;
        None means no padding. position_ids: (B, T); by default derived from the mask.
        cache: filled with this call's keys/values and advanced by T. A cache that tracks each
        sequence's own length (the engine's, `per_sequence = True`) makes its own masks; it needs
        position_ids and no attention_mask.
        """
        position_ids, mask = self.step_inputs(input_ids, attention_mask, position_ids, cache)
        h = self.run_layers(self.transformer.wte(input_ids), position_ids, mask, cache)  # (B, T, E)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        return self.logits(h, logits_to_keep)

    def step_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor | None, cache: KVCache | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward's position_ids (B, T) and attention mask (None: the cache makes its own), checked."""
        B, T = input_ids.shape
        if getattr(cache, "per_sequence", False):
            if position_ids is None:
                raise ValueError("a per-sequence cache needs explicit position_ids")
            return position_ids, None
        past = cache.length if cache is not None else 0
        if attention_mask is None:
            attention_mask = torch.ones(B, past + T, dtype=torch.long, device=input_ids.device)
        if attention_mask.shape != (B, past + T):
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != {(B, past + T)}")
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask, T)
        # (the engine's cache checks lengths at admission: no device-to-host sync per forward there)
        if int(position_ids.max()) >= self.config.n_positions:
            raise ValueError(f"position {int(position_ids.max())} exceeds n_positions {self.config.n_positions}")
        return position_ids, causal_mask(attention_mask, T)

    def run_layers(self, h: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                   cache: KVCache | None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """h (B, T, E) through layers [start, stop) (default: all of them)."""
        tables = self.rotary(position_ids, h.dtype)
        for i, block in enumerate(itertools.islice(self.transformer.h, start, stop), start):
            h = block(h, *tables, mask, cache, i)
        return h

    def logits(self, h: torch.Tensor, logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
        """The float32 logits of the last layer's h (B, T, E) at the positions forward keeps."""
        return self.lm_head(self.transformer.ln_f(kept_positions(h, logits_to_keep))).float()

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        """A contiguous cache of this model's KV heads, in the activations' dtype (wte is never quantized)."""
        w = self.transformer.wte.weight
        return KVCache(self.config, batch_size, max_len, dtype=w.dtype, device=w.device, n_head=self.kv_heads)
