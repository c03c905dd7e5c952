"""The paged KV memory: every layer's keys and values in blocks (the tensors; engine/kv.py keeps the
bookkeeping of which block holds what)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gptj.config import GPTJConfig
from gptj.device import to_device
from gptj.engine.config import KV_SCALE_DTYPE, QUANTIZED_KV, kv_bytes_per_token
from gptj.errors import GptjError
from gptj.quant.ops import quantize_rows_fp8, quantize_rows_int8


class PagedKV:
    """Every layer's keys and values in blocks of B tokens: k[layer], v[layer] (n_blocks, H, B, D).

    Which block holds what is engine/kv.py's bookkeeping; a sequence's token t lies in block
    blocks[t // B], row t % B. n_head: the key/value heads this rank stores (the model's kv_heads:
    GPT-J's n_head, or its share under tensor parallelism; Llama's num_key_value_heads, fewer than its
    query heads under grouped-query attention).

    `dtype` is the storage (engine.config.kv_storage). int8 (`quantized`): each token's head vector
    of D values is stored as round(x / s) with s = max |x| / 127 in k_scale / v_scale[layer]
    (n_blocks, H, B), float32, and read back as q * s in `compute` (the model's dtype): |error| <= s / 2.
    e4m3 (`quantized` too): e4m3(x / s) with s = max |x| / 448, read back the same way, within
    gptj.quant.ops.fp8_error_bound."""

    def __init__(self, config: GPTJConfig, n_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, n_head: int | None = None, compute: torch.dtype | None = None) -> None:
        shape = (n_blocks, n_head or config.n_head, block_size, config.head_dim)
        self.quantized = dtype in QUANTIZED_KV.values()
        self.compute = compute or (torch.float32 if self.quantized else dtype)
        try:  # zeros, not empty: every page is touched now, not by the first requests (a page fault each)
            # each kind one tensor for all layers (a layer's is a view of it), so that a block's copy
            # moves every layer's rows at once (`copy`)
            self.stacked = [torch.zeros((config.n_layer, *shape), dtype=dtype, device=device) for _ in "kv"]
            if self.quantized:
                self.stacked += [torch.zeros((config.n_layer, *shape[:3]), dtype=KV_SCALE_DTYPE, device=device)
                                 for _ in "kv"]
        except (RuntimeError, MemoryError) as e:
            gb = n_blocks * block_size * kv_bytes_per_token(config, dtype, shape[1]) / 1e9
            raise GptjError(f"cannot allocate {gb:.1f} GB of KV memory ({n_blocks} blocks of {block_size} tokens): "
                            f"{str(e).splitlines()[0]}") from None
        self.k, self.v = (list(t.unbind(0)) for t in self.stacked[:2])
        if self.quantized:
            self.k_scale, self.v_scale = (list(t.unbind(0)) for t in self.stacked[2:])
        self.block_size = block_size

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def copy(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """Copy-on-write: block dst gets the first n tokens of block src, for each (src, dst, n), in
        every layer. The rows from n on are not the sequence's yet: it writes each of them before
        anything reads it (a sequence's reads stop at its length), so they are left as they are.

        On a CPU each copy moves its n rows of every layer in one strided copy per tensor kind, read
        once and written once, several times faster than an indexed copy of whole blocks
        (`t[:, dst] = t[:, src]`: a gather into a temporary, then a scatter; figures:
        docs/PERFORMANCE.md#offline-mlperf-shaped). Elsewhere (a GPU without the cuda backend's copy
        kernel) the indexed copy stays: one launch per tensor kind, not one per copy."""
        if copies:
            (copy_rows if self.device.type == "cpu" else copy_whole_blocks)(self.stacked, copies)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
              offsets: torch.Tensor) -> None:
        """Token n's key and value k[n], v[n] (N, H, D) into block blocks[n], row offsets[n], by
        indexing (int8 / e4m3 storage: rounded by quantize_heads first). A backend's `store` may do it its
        own way; this is the reference."""
        kc, vc = self.k[layer], self.v[layer]
        if not self.quantized:
            kc[blocks, :, offsets] = k
            vc[blocks, :, offsets] = v
            return
        for x, cache, scales in ((k, kc, self.k_scale[layer]), (v, vc, self.v_scale[layer])):
            q, s = quantize_heads(x, cache.dtype)
            cache[blocks, :, offsets] = q
            scales[blocks, :, offsets] = s

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Quantized blocks' (k_scale, v_scale) of a layer; (None, None) for float blocks."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.quantized else (None, None)

    def blocks(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the blocks `index` (any shape I) as (*I, H, B, D) in the compute dtype."""
        kc, vc = self.k[layer][index], self.v[layer][index]
        if not self.quantized:
            return kc, vc
        return (dequantize_heads(kc, self.k_scale[layer][index], self.compute),
                dequantize_heads(vc, self.v_scale[layer][index], self.compute))

    def gather(self, layer: int, index: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` keys and values of a block table `index` (a long tensor on the KV's
        device) as (H, length, D) tensors in the compute dtype."""
        kc = self.k[layer]
        H, D = kc.shape[1], kc.shape[3]
        if len(index) == 0 or length == 0:
            empty = torch.empty((H, 0, D), dtype=self.compute, device=kc.device)
            return empty, empty
        k, v = self.blocks(layer, index)
        return (k.transpose(0, 1).reshape(H, -1, D)[:, :length], v.transpose(0, 1).reshape(H, -1, D)[:, :length])


def quantize_heads(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> (q (..., D) of `dtype`, float32 scale (...)): per head vector, symmetric,
    s = max |x| / 127 (int8) or / 448 (e4m3): gptj.quant's per-row rounding, each head vector a row."""
    q, s = quantize_rows_int8(x) if dtype == torch.int8 else quantize_rows_fp8(x)
    return q, s[..., 0]


def dequantize_heads(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * s, computed in float32 and rounded once to `dtype`."""
    return (q.float() * s[..., None]).to(dtype)


def copy_rows(stacked: Sequence[torch.Tensor], copies: Sequence[tuple[int, int, int]]) -> None:
    """Each (src, dst, n): rows 0..n-1 of block src into block dst, every layer's and head's, in one
    strided copy per copy and tensor kind; the other rows of dst stay as they are."""
    for src, dst, n in copies:
        for t in stacked:  # (layers, blocks, heads, block rows, ...)
            t[:, dst, :, :n].copy_(t[:, src, :, :n])


def copy_whole_blocks(stacked: Sequence[torch.Tensor], copies: Sequence[tuple[int, int, int]]) -> None:
    """Each (src, dst, n): the whole block src into block dst (its first n rows are the contract),
    one indexed copy per tensor kind, whatever the copies. The dst blocks are fresh: none is a src."""
    src, dst = to_device(torch.tensor([[c[0] for c in copies], [c[1] for c in copies]], dtype=torch.long),
                         stacked[0].device)
    for t in stacked:
        t[:, dst] = t[:, src]
