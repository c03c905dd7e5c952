"""The end of gptj.quant.cuda's weight-only linears, shared by every kind: a program's float32 tile of
sums stored either as a split-K slice's raw partial sums, or scaled (the channel scale, bias) into x's
dtype; and the second pass of split-K, which adds the slices' partials in a fixed order (no atomics:
the result does not depend on which slice ends first).

Needs Triton: gptj.quant.cuda.launch imports it only where Triton is installed.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_tile(acc, rows, cols, M, N, scale_ptr, bias_ptr, out_ptr,
               SPLIT: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
               UNSCALE: tl.constexpr):
    """A (BLOCK_M, BLOCK_N) float32 tile of sums: with SPLIT > 1 the raw partial sum of this
    program's K slice (into partials (SPLIT, M, N)); else * UNSCALE (a power of two: 1, or the
    e4m3 "bits" sums' 2^56, exact) * scale[n] + bias[n], in x's dtype."""
    nmask = cols < N
    mask = (rows < M)[:, None] & nmask[None, :]
    at = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if SPLIT > 1:
        tl.store(out_ptr + tl.program_id(2).to(tl.int64) * M * N + at, acc, mask=mask)
    else:
        if UNSCALE != 1.0:
            acc = acc * UNSCALE
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _finish_kernel(part_ptr, scale_ptr, bias_ptr, out_ptr, M, N,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                   HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, UNSCALE: tl.constexpr):
    """Split-K's second pass: the SPLIT partial sums added in order 0, 1, ..., then * UNSCALE, scale, bias."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    at = rows.to(tl.int64)[:, None] * N + cols[None, :]
    acc = tl.load(part_ptr + at, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * M * N + at, mask=mask, other=0.0)
    store_tile(acc, rows, cols, M, N, scale_ptr, bias_ptr, out_ptr, 1, HAS_SCALE, HAS_BIAS, UNSCALE)
