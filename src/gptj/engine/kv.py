"""KV memory in fixed slots: one slot holds one sequence's keys and values for up to `slot_len` tokens.

    k[layer], v[layer]: (n_slots, H, slot_len, D)

A forward pass binds its rows to slots (`SlotBatch`): row b writes its T new positions into its
slot after the `start` it already holds, and attends over its own slot only — no padding, no
gather: each row reads a view of its slot, so sequences of any lengths share one forward.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from gptj.config import GPTJConfig
from gptj.errors import GptjError
from gptj.model import attention


def kv_bytes_per_token(config: GPTJConfig, dtype: torch.dtype) -> int:
    """Bytes of keys + values one token takes over all layers."""
    return 2 * config.n_layer * config.n_embd * torch.empty((), dtype=dtype).element_size()


def available_memory_bytes(device: torch.device) -> int:
    """Free memory now: CUDA's free bytes, or MemAvailable from /proc/meminfo."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def slots_from_memory(config: GPTJConfig, dtype: torch.dtype, device: torch.device, slot_len: int,
                      fraction: float = 0.5, max_slots: int = 64) -> int:
    """How many slots fit in `fraction` of the free memory (at least 1)."""
    per_slot = kv_bytes_per_token(config, dtype) * slot_len
    return max(1, min(max_slots, int(available_memory_bytes(device) * fraction) // per_slot))


class KVPool:
    def __init__(self, config: GPTJConfig, n_slots: int, slot_len: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if n_slots < 1 or slot_len < 1:
            raise GptjError(f"KV memory needs at least one slot of one token (got {n_slots} x {slot_len})")
        shape = (n_slots, config.n_head, slot_len, config.head_dim)
        try:
            self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
            self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        except (RuntimeError, MemoryError) as e:
            gb = 2 * config.n_layer * n_slots * slot_len * config.n_embd * torch.empty((), dtype=dtype).element_size()
            raise GptjError(f"cannot allocate KV memory for {n_slots} slots x {slot_len} tokens "
                            f"({gb / 1e9:.1f} GB): {str(e).splitlines()[0]}") from None
        self.n_slots, self.slot_len = n_slots, slot_len
        self._free = list(range(n_slots - 1, -1, -1))  # a stack: the lowest slot is taken first

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.n_slots - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV slots, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, slots: list[int]) -> None:
        for s in slots:
            if s in self._free:
                raise RuntimeError(f"KV slot {s} released twice")
            self._free.append(s)
        self._free.sort(reverse=True)

    def copy(self, src: list[int], dst: list[int], length: int) -> None:
        """Slot dst[i] gets the first `length` positions of slot src[i] (all read before any write)."""
        if not dst or length == 0:
            return
        src_t = torch.tensor(src, device=self.k[0].device)
        dst_t = torch.tensor(dst, device=self.k[0].device)
        for pool in (self.k, self.v):
            for t in pool:
                t[dst_t, :, :length] = t[src_t, :, :length]  # advanced indexing reads a copy first


@dataclass
class SlotBatch:
    """The cache of one forward pass: row b writes into slot `slots[b]` from position `starts[b]`."""

    pool: KVPool
    slots: list[int]
    starts: list[int]
    per_sequence = True  # the model then builds no padding mask; each row attends over its own slot

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """q, k, v: (B, H, T, D) -> (B, H, T, D); causal within the T new tokens of each row."""
        T = q.shape[2]
        K, V = self.pool.k[layer], self.pool.v[layer]
        out = torch.empty(q.shape, dtype=v.dtype, device=v.device)
        for b, (slot, start) in enumerate(zip(self.slots, self.starts)):
            end = start + T
            K[slot, :, start:end] = k[b]
            V[slot, :, start:end] = v[b]
            causal = None
            if T > 1:  # query i (position start + i) sees keys j <= start + i
                q_pos = torch.arange(start, end, device=q.device)[:, None]
                k_pos = torch.arange(end, device=q.device)[None, :]
                causal = torch.zeros((T, end), dtype=torch.float32, device=q.device)
                causal.masked_fill_(k_pos > q_pos, torch.finfo(torch.float32).min)
            out[b] = attention(q[b:b + 1], K[slot:slot + 1, :, :end], V[slot:slot + 1, :, :end], causal)[0]
        return out

    def advance(self, n: int) -> None:
        pass  # lengths are the engine's bookkeeping
