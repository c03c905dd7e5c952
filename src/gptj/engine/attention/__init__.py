"""Attention over paged KV memory, behind one interface (base.py) with one implementation per file:

    base.py        the protocol: DecodeRows (the engine's persistent ones, or made from DecodeGroups)
                   and PrefillSegments in, StepMetadata (device tensors, once per step) out of
                   `build`; store, decode, prefill; PagedBatch, the model's cache
    kv_cache.py    PagedKV: every layer's keys and values in blocks (float, or int8 / e4m3 with scales)
    reference.py   torch's eager and compiled forms, group by group: the ground truth (and the only
                   one for grouped-query attention: fewer KV heads than query heads)
    cpu_native.py  gptj.native's kernels (AVX-512 or AVX2)
    cuda.py        the whole decode batch in one Triton kernel per layer

gptj.policy.attention_path names the backend (the one place that rule lives); `make_backend`
builds it by that name.
"""

from __future__ import annotations

import importlib

from gptj.engine.attention.base import (AttentionBackend, DecodeGroup, DecodeRows, DecodeTables, GroupSpan, PagedBatch,
                                        PrefillSegment, StepMetadata, build_step)
from gptj.engine.attention.kv_cache import PagedKV, dequantize_heads, quantize_heads
from gptj.policy import AttentionPath

# name -> (module, class): imported when asked for (cuda.py imports Triton, cpu_native.py gptj.native)
BACKENDS = {
    "reference": ("gptj.engine.attention.reference", "ReferenceAttention"),
    "cpu-native": ("gptj.engine.attention.cpu_native", "NativeAttention"),
    "cuda": ("gptj.engine.attention.cuda", "CudaAttention"),
}

__all__ = ["BACKENDS", "AttentionBackend", "DecodeGroup", "DecodeRows", "DecodeTables", "GroupSpan", "PagedBatch",
           "PagedKV", "PrefillSegment", "StepMetadata", "build_step", "dequantize_heads", "make_backend", "quantize_heads"]


def make_backend(path: AttentionPath) -> AttentionBackend:
    """The backend gptj.policy.attention_path chose."""
    module, cls = BACKENDS[path.backend]
    return getattr(importlib.import_module(module), cls)(compiled=path.compiled)
