"""KV memory as paged blocks: who holds which block, which blocks hold a reusable prefix, what to evict.

The keys and values themselves are tensors the runner owns (engine/attention/kv_cache.py, `PagedKV`:
per layer (n_blocks, H, block_size, D)); this file is the bookkeeping over block ids, pure Python.

    block table   each sequence lists its blocks in order: token t sits in blocks[t // B] at t % B
    ref counts    a block is held by every sequence whose table lists it; the beams of a request
                  share their prompt's blocks and own only what they write (a shared block that
                  is about to be written is first copied: copy-on-write, decided by the scheduler)
    prefix cache  a full block of a prompt is keyed by its whole token prefix (a hash chained over
                  the blocks before it, as vLLM's automatic prefix caching); a new request whose
                  prompt starts with the same blocks takes them instead of computing them
    free queue    blocks no sequence holds, in eviction order: never-cached blocks first, then
                  cached ones least recently released first. Allocating takes the front; taking a
                  cached block evicts its key. A held block is never in the queue, so never evicted.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from gptj.errors import GptjError

ROOT_KEY = b"gptj-kv-prefix"


def block_keys(tokens: Sequence[int], block_size: int, n_blocks: int | None = None, salt: bytes = b"") -> list[bytes]:
    """The prefix key of each full block of `tokens` (at most n_blocks): key i = sha256(key i-1 ++ block i).
    `salt` starts the chain: what else the keys and values depend on (a LoRA adapter's name).

    sha256 rather than Python's hash: two different prefixes sharing a key would silently give a
    request another prompt's keys and values."""
    full = len(tokens) // block_size
    if n_blocks is not None:
        full = min(full, n_blocks)
    keys, parent = [], ROOT_KEY + salt
    for i in range(full):
        chunk = tokens[i * block_size:(i + 1) * block_size]
        parent = hashlib.sha256(parent + b"".join(int(t).to_bytes(4, "little") for t in chunk)).digest()
        keys.append(parent)
    return keys


class KVCacheManager:
    """Block ids, reference counts, the prefix cache and the free queue of one engine's KV memory."""

    def __init__(self, n_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if n_blocks < 1:
            raise GptjError(f"KV memory needs at least one block, got {n_blocks}")
        self.n_blocks, self.block_size, self.prefix_caching = n_blocks, block_size, prefix_caching
        self.ref = [0] * n_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(n_blocks))
        self._key_of: dict[int, bytes] = {}  # cached block -> its prefix key
        self._block_of: dict[bytes, int] = {}  # prefix key -> the block holding it
        self.queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of which were found

    # --- counts ---

    @property
    def free(self) -> int:
        """Blocks that can be allocated now (cached blocks nobody holds count: they can be evicted)."""
        return len(self._free)

    @property
    def cached(self) -> int:
        return len(self._key_of)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # --- allocation ---

    def allocate(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            key = self._key_of.pop(b, None)
            if key is not None:  # evicted: its prefix is no longer cached
                del self._block_of[key]
            self.ref[b] = 1
            blocks.append(b)
        return blocks

    def hold(self, blocks: Sequence[int]) -> None:
        """One more holder for each block (a beam taking another's table; a prefix-cache hit)."""
        for b in blocks:
            if self.ref[b] == 0:
                del self._free[b]
            self.ref[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """One holder fewer for each block; a block nobody holds joins the free queue. A sequence's
        blocks are released last first, so its later blocks are evicted before its earlier ones
        (those are the prefixes other prompts are likelier to share)."""
        for b in reversed(blocks):
            if self.ref[b] <= 0:
                raise RuntimeError(f"KV block {b} released more often than held")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self._free[b] = None
                if b not in self._key_of:  # nothing to keep: reuse it first
                    self._free.move_to_end(b, last=False)

    # --- the prefix cache ---

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of `keys` from the first (not yet held)."""
        if not self.prefix_caching:
            return []
        found = []
        for key in keys:
            b = self._block_of.get(key)
            if b is None:
                break
            found.append(b)
        return found

    def count_lookup(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    def register(self, block: int, key: bytes) -> None:
        """`block` (full, computed) holds the prefix `key`; if another block already does, keep that one."""
        if not self.prefix_caching or key in self._block_of or block in self._key_of:
            return
        self._block_of[key] = block
        self._key_of[block] = key

    def forget(self) -> None:
        """Forget every cached prefix and the lookup counts (after a warm-up: what follows runs as on
        a fresh engine)."""
        self._key_of.clear()
        self._block_of.clear()
        self.queried_tokens = self.hit_tokens = 0

    def check(self) -> None:
        """Invariants (tests): free == unheld, every key maps both ways."""
        unheld = {b for b in range(self.n_blocks) if self.ref[b] == 0}
        assert set(self._free) == unheld, "free queue != blocks nobody holds"
        assert all(self._block_of[k] == b for b, k in self._key_of.items()), "prefix cache maps disagree"
