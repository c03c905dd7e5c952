"""Native CPU kernels (the C files here), built at first use, one library per instruction set (ISA).

    build.py    the compiler driver: the ISAs and their flags, the cache folder, its lock, the atomic install
    loader.py   the library this CPU runs (or GPTJ_NATIVE_ISA's), loaded once; availability and why not
    ops.py      the Python wrappers: tensors checked, then the library's function called on their data

    from gptj import native
    if native.available():
        y = native.linear_int8(x, w_int8, scale)   # x (..., K) bf16, w (N, K) int8, scale (N,) bf16
        y = native.linear_bf16(x, w, bias)         # x (..., K) bf16, w (N, K) bf16
"""

from __future__ import annotations

from gptj.native.build import (AVX2_CPU_FLAGS, AVX512_CPU_FLAGS, CFLAGS, HEADERS, ISAS, KERNELS, REQUIRED_CPU_FLAGS,
                               SOURCES, Isa, best_isa, cache_dir)
from gptj.native.loader import (amx_available, available, has, int4_gemm_min_rows, int8_gemm_min_rows, isa, load,
                                open_isa, requested_isa, unavailable_reason)
from gptj.native.ops import (AMX_K_MULTIPLE, INT4_GEMM_BLOCKS, INT4_MAX_BLOCK, W4A8_BLOCK, W4A8_PANEL, W8A8_MAX_K,
                             argmax_rows, attention_group, attention_paged, gelu, int4_dequant_t, int4_gemm_available, linear_bf16, linear_int4,
                             linear_int8, linear_int8_amx, linear_w4a8, linear_w8a8, linear_w8a8_amx, pack_w8a8,
                             prefill_paged, quantize_rows_u8, rotary_, scale_rows, store_kv, w4a8_available)

__all__ = ["AMX_K_MULTIPLE", "AVX2_CPU_FLAGS", "AVX512_CPU_FLAGS", "CFLAGS", "HEADERS", "INT4_GEMM_BLOCKS",
           "INT4_MAX_BLOCK", "ISAS", "Isa", "KERNELS", "REQUIRED_CPU_FLAGS", "SOURCES", "W4A8_BLOCK", "W4A8_PANEL",
           "W8A8_MAX_K", "amx_available", "argmax_rows", "attention_group", "attention_paged", "available", "best_isa", "cache_dir", "gelu", "has",
           "int4_dequant_t", "int4_gemm_available", "int4_gemm_min_rows", "int8_gemm_min_rows", "isa", "linear_bf16",
           "linear_int4", "linear_int8", "linear_int8_amx", "linear_w4a8", "linear_w8a8", "linear_w8a8_amx", "load",
           "open_isa", "pack_w8a8", "prefill_paged", "quantize_rows_u8", "requested_isa", "rotary_", "scale_rows", "store_kv",
           "unavailable_reason", "w4a8_available"]
