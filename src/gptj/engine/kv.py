"""KV memory: a prompt slot per request, a tail slot per sequence.

    prompt_k[layer], prompt_v[layer]: (n_prompt_slots, H, prompt_len, D)   the prompt's keys/values
    tail_k[layer],   tail_v[layer]:   (n_tail_slots,   H, tail_len,   D)   each sequence's new tokens

The num_beams sequences of a beam-search request share their prompt (identical for every beam)
and own only their generated tokens. So a beam group's prompt is stored once, reordering beams
copies only the short tails (<= max_new_tokens), and one matmul reads the prompt's keys for all
of the group's beams at once. A greedy or sampled request is a group of one.

A group of one sequence (greedy, sampled) writes its new tokens after its prompt in the prompt
slot (which holds prompt + new tokens) and attends over that slot alone; its tail slot stays
unused. The decode attention itself (eager or compiled) is engine/attention.py.

A forward pass binds its rows to groups (`GroupBatch`): each group attends over its own prompt
and tails only — no padding, no gather of the prompt — so requests of any lengths share a forward.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from gptj.config import GPTJConfig
from gptj.engine.attention import DecodeAttention
from gptj.errors import GptjError
from gptj.model import attention

_EAGER = DecodeAttention("off", torch.float32)


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


def groups_from_memory(config: GPTJConfig, dtype: torch.dtype, device: torch.device, prompt_len: int,
                       tail_len: int, seqs_per_group: int, fraction: float = 0.5, max_groups: int = 64) -> int:
    """How many request groups (a prompt slot + seqs_per_group tails) fit in `fraction` of free memory."""
    per_group = kv_bytes_per_token(config, dtype) * (prompt_len + seqs_per_group * tail_len)
    return max(1, min(max_groups, int(available_memory_bytes(device) * fraction) // per_group))


class _Slots:
    """A free list of slot indices; the lowest free slot is taken first."""

    def __init__(self, n: int, what: str) -> None:
        self.n, self.what = n, what
        self._free = list(range(n - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, k: int) -> list[int]:
        """k slots, consecutive when possible (a group's tails are then one view, no gather)."""
        if k > len(self._free):
            raise RuntimeError(f"asked for {k} {self.what} slots, {len(self._free)} free")
        free = sorted(self._free)
        for i in range(len(free) - k + 1):
            if free[i + k - 1] - free[i] == k - 1:
                run = free[i:i + k]
                self._free = [s for s in self._free if s not in run]
                return run
        return [self._free.pop() for _ in range(k)]

    def release(self, slots: list[int]) -> None:
        for s in slots:
            if s in self._free:
                raise RuntimeError(f"{self.what} slot {s} released twice")
            self._free.append(s)
        self._free.sort(reverse=True)


class KVPool:
    def __init__(self, config: GPTJConfig, n_prompt_slots: int, prompt_len: int, n_tail_slots: int,
                 tail_len: int, dtype: torch.dtype, device: torch.device | str, n_head: int | None = None) -> None:
        if min(n_prompt_slots, prompt_len, n_tail_slots, tail_len) < 1:
            raise GptjError(f"KV memory needs at least one slot of one token (prompts {n_prompt_slots} x "
                            f"{prompt_len}, tails {n_tail_slots} x {tail_len})")
        H, D = n_head or config.n_head, config.head_dim  # n_head: this rank's heads (tensor parallel)
        try:
            self.prompt_k = [torch.empty((n_prompt_slots, H, prompt_len, D), dtype=dtype, device=device)
                             for _ in range(config.n_layer)]
            self.prompt_v = [torch.empty_like(t) for t in self.prompt_k]
            self.tail_k = [torch.empty((n_tail_slots, H, tail_len, D), dtype=dtype, device=device)
                           for _ in range(config.n_layer)]
            self.tail_v = [torch.empty_like(t) for t in self.tail_k]
        except (RuntimeError, MemoryError) as e:
            tokens = n_prompt_slots * prompt_len + n_tail_slots * tail_len
            gb = tokens * kv_bytes_per_token(config, dtype) / 1e9
            raise GptjError(f"cannot allocate {gb:.1f} GB of KV memory ({n_prompt_slots} prompts x {prompt_len} "
                            f"tokens, {n_tail_slots} sequences x {tail_len} new tokens): "
                            f"{str(e).splitlines()[0]}") from None
        self.prompt_len, self.tail_len = prompt_len, tail_len
        self.prompts = _Slots(n_prompt_slots, "prompt")
        self.tails = _Slots(n_tail_slots, "sequence")

    @property
    def n_tail_slots(self) -> int:
        return self.tails.n

    @property
    def free_slots(self) -> int:
        """Sequences that could start now (a new request also needs a free prompt slot)."""
        return self.tails.free if self.prompts.free else 0

    def copy_tails(self, src: list[int], dst: list[int], length: int) -> None:
        """Tail dst[i] gets the first `length` new tokens of tail src[i] (all read before any write)."""
        if not dst or length == 0:
            return
        device = self.tail_k[0].device
        src_t, dst_t = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        for pool in (self.tail_k, self.tail_v):
            for t in pool:
                t[dst_t, :, :length] = t[src_t, :, :length]  # advanced indexing reads a copy first


@dataclass
class Group:
    """One request's rows in a forward: its prompt slot and, when decoding, its sequences' tails."""

    prompt_slot: int
    prompt_len: int  # prompt tokens already stored (prefill: 0)
    tails: list[int]  # tail slot of each row (prefill: [])
    tail_len: int  # new tokens already stored in every tail


@dataclass
class GroupBatch:
    """The cache of one forward pass: rows are the groups' rows in order.

    Prefill: one group, one row, T = the prompt; its keys/values go to the prompt slot.
    Decode: T = 1; each row's key/value goes to its tail at `tail_len`.
    """

    pool: KVPool
    groups: list[Group]
    decode: DecodeAttention
    per_sequence = True  # the model builds no padding mask; each group attends over its own memory

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """q, k, v: (B, H, T, D) -> (B, H, T, D)."""
        pool = self.pool
        Pk, Pv, Tk, Tv = pool.prompt_k[layer], pool.prompt_v[layer], pool.tail_k[layer], pool.tail_v[layer]
        out = torch.empty(q.shape, dtype=v.dtype, device=v.device)
        row = 0
        out = torch.empty(q.shape, dtype=v.dtype, device=v.device)
        row = 0
        for g in self.groups:
            if not g.tails:  # prefill: causal attention over the prompt, stored in the prompt slot
                T = q.shape[2]
                start, end = g.prompt_len, g.prompt_len + T
                Pk[g.prompt_slot, :, start:end] = k[row]
                Pv[g.prompt_slot, :, start:end] = v[row]
                q_pos = torch.arange(start, end, device=q.device)[:, None]
                k_pos = torch.arange(end, device=q.device)[None, :]
                causal = torch.zeros((T, end), dtype=torch.float32, device=q.device)
                causal.masked_fill_(k_pos > q_pos, torch.finfo(torch.float32).min)
                s = g.prompt_slot
                out[row] = attention(q[row:row + 1], Pk[s:s + 1, :, :end], Pv[s:s + 1, :, :end], causal)[0]
                row += 1
                continue
            n = len(g.tails)
            # A compiled call's fixed cost (~100-250 us) pays only over long contexts; the choice
            # depends on the group's own length, so a request is computed the same way whatever
            # shares its step.
            decode = self.decode if g.prompt_len + g.tail_len + 1 >= self.decode.min_context else _EAGER
            if n == 1:  # one sequence: its new tokens follow its prompt in the prompt slot; plain attention
                s, end = g.prompt_slot, g.prompt_len + g.tail_len + 1
                Pk[s, :, end - 1] = k[row, :, 0]
                Pv[s, :, end - 1] = v[row, :, 0]
                out[row, :, 0] = decode.one(q[row, :, 0], Pk[s, :, :end], Pv[s, :, :end])
                row += 1
                continue
            rows = slice(row, row + n)
            t0 = g.tails[0]
            if g.tails == list(range(t0, t0 + n)):  # consecutive tails: views, no gather
                tails = slice(t0, t0 + n)
            else:
                tails = torch.tensor(g.tails, device=q.device)
            Tk[tails, :, g.tail_len] = k[rows, :, 0]
            Tv[tails, :, g.tail_len] = v[rows, :, 0]
            out[rows, :, 0] = decode.group(
                q[rows, :, 0], Pk[g.prompt_slot, :, :g.prompt_len], Pv[g.prompt_slot, :, :g.prompt_len],
                Tk[tails, :, :g.tail_len + 1], Tv[tails, :, :g.tail_len + 1])
            row += n
        return out

    def advance(self, n: int) -> None:
        pass  # lengths are the engine's bookkeeping

