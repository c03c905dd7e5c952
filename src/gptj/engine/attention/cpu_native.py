"""The CPU native backend: gptj.native's kernels, AVX-512 or AVX2 (a bfloat16 model's bfloat16 or int8 KV).

One call computes every decode group of a step (native.attention_paged over the step's
DecodeTables), reading the blocks in place and a shared prompt once per 8 beams: 2x the compiled
form at GPT-J 6B's head shapes (16 x 256, 800-token prompt, 4 beams: 1.75 against 3.78 ms per
layer). A prompt chunk attends over its blocks in place (native.prefill_paged: causal, no mask, no
gathered copy), and the new keys and values are stored (int8: rounded) in one pass
(native.store_kv). gptj.policy.attention_path chooses it only where all of that holds; a store
whose keys are laid out otherwise goes through the reference's indexing.

Grouped-query attention (Llama: the blocks hold fewer KV heads than the model has query heads, a
divisor of them): both kernels read KV head h // group for query head h, and decode walks each KV
head's rows of a block once for all of its query heads (tests/test_attention_gqa.py).
"""

from __future__ import annotations

import torch

from gptj import native
from gptj.engine.attention.base import AttentionBackend, StepMetadata
from gptj.engine.attention.kv_cache import PagedKV


class NativeAttention(AttentionBackend):
    name = "cpu-native"
    reads_tables = True
    stairs = True

    def build(self, kv: PagedKV, *args, **kwargs) -> StepMetadata:
        meta = super().build(kv, *args, **kwargs)
        meta.extra["tables32"] = [s.table.to(torch.int32) for s in meta.slots]  # what prefill_paged reads
        return meta

    def store(self, kv: PagedKV, layer: int, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
              offsets: torch.Tensor) -> None:
        """native.store_kv where each token's heads lie side by side (the fused block's q|k|v)."""
        D = k.shape[-1]
        if (k.dtype == v.dtype == torch.bfloat16 and k.stride(-1) == v.stride(-1) == 1
                and k.stride(-2) == v.stride(-2) == D):
            native.store_kv(k, v, kv.k[layer], kv.v[layer], blocks, offsets, *kv.scales(layer))
        else:
            kv.write(layer, k, v, blocks, offsets)

    def decode(self, kv: PagedKV, layer: int, q: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        out = native.attention_paged(q, kv.k[layer], kv.v[layer], *meta.tables.astuple(), *kv.scales(layer),
                                     stair=meta.tables.stair)
        return out.to(kv.compute)

    def prefill(self, kv: PagedKV, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: StepMetadata, i: int) -> torch.Tensor:
        table = meta.extra["tables32"][i]
        return native.prefill_paged(q, kv.k[layer], kv.v[layer], table, meta.segments[i].start, *kv.scales(layer))
