"""The kinds "mma" and "swapped" of gptj.quant.cuda's weight-only linears (Tiles.kind): the tensor
cores' kernels, each weight tile dequantized in registers and run through tl.dot against a tile of
rows of x, float32 sums.

  "mma"      grid (n block, row tile, K slice): x as tl.dot's A operand, the weight tile converted to
             x's dtype and transposed to its B; row tiles of 16 (decode) up to MMA_MAX_ROWS (the GEMM
             plans MANY_ROWS).
  "swapped"  grid (row tile, n block, K slice): the weight tile as A, as it lies in memory (K
             contiguous, no transpose), x^T as B; out^T tiles stored transposed, 8 rows (mma.sync's
             n) or fewer a program.

The weight becomes x's dtype by a cast, or (Tiles.convert "bits", bfloat16 x) by gptj.quant.cuda.bits'
integer recipes. The epilogue (scale, bias, split-K partials) is gptj.quant.cuda.epilogue's.

Needs Triton: gptj.quant.cuda.launch imports it only where Triton is installed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gptj.quant.cuda.bits import e4m3_bf16, e4m3_prescale, int4_bf16, int8_bf16
from gptj.quant.cuda.epilogue import store_tile


@triton.jit(do_not_specialize=["M"])
def _int8_kernel(x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, k_slice,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                 BITS: tl.constexpr, INT8: tl.constexpr, UNSCALE: tl.constexpr):
    """Program (n block, row tile, K slice): sum over its K slice of x[m, k] * q[n, k]. BITS
    (bfloat16 x): the weight converted by int8_bf16 / e4m3_bf16 (e4m3: x * 2^64 first, the
    sums 2^-56 times "cast"'s, UNSCALE 2^56 back in the epilogue)."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + cols.to(tl.int64)[:, None] * K
    k_start = tl.program_id(2) * k_slice
    k_end = tl.minimum(k_start + k_slice, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        kmask = (k + kk) < K
        x = tl.load(x_rows + (k + kk)[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        # no `other` (e4m3 has no integer zero to cast); masked inputs zeroed after the cast:
        # x is 0 there too, but an unloaded e4m3 byte could be NaN
        w = tl.load(q_rows + (k + kk)[None, :], mask=(cols < N)[:, None] & kmask[None, :])
        if BITS:  # any byte a finite bfloat16: masked inputs need no zeroing (x is 0 there)
            if INT8:
                w = tl.trans(int8_bf16(w))
            else:
                x = e4m3_prescale(x)  # exact for |x| < 2^64
                w = tl.trans(e4m3_bf16(w))
        else:
            w = w.to(x.dtype)  # exact: int8 and e4m3 values are values of every x dtype
            w = tl.trans(tl.where(kmask[None, :], w, tl.zeros_like(w)))  # (BLOCK_K, BLOCK_N)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    store_tile(acc, rows, cols, M, N, scale_ptr, bias_ptr, out_ptr, SPLIT, True, HAS_BIAS, UNSCALE)


@triton.jit(do_not_specialize=["M"])
def _int4_kernel(x_ptr, p_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, groups,
                 g_slice, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                 SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BITS: tl.constexpr):
    """Program (n block, row tile, slice of groups): per group g of its slice,
    scale[n, g] * sum_k (q[n, k] - 8) * x[m, k] + zero[n, g] * sum_k x[m, k]. BITS (bfloat16 x):
    q - 8 by int4_bf16."""
    HALF: tl.constexpr = GROUP // 2
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    nmask = cols < N
    j = tl.arange(0, HALF)
    x_even = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + 2 * j[None, :]  # a group's inputs 2j
    p_rows = p_ptr + cols.to(tl.int64)[:, None] * (K // 2) + j[None, :]
    sz_rows = cols.to(tl.int64) * groups  # scale, zero (N, groups)
    g_start = tl.program_id(2) * g_slice
    g_end = tl.minimum(g_start + g_slice, groups)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for g in range(g_start, g_end):
        xe = tl.load(x_even + g * GROUP, mask=rmask[:, None], other=0.0)  # (BLOCK_M, HALF)
        xo = tl.load(x_even + g * GROUP + 1, mask=rmask[:, None], other=0.0)
        p = tl.load(p_rows + g * HALF, mask=nmask[:, None], other=0)  # (BLOCK_N, HALF) uint8
        if BITS:
            hi = tl.trans(int4_bf16(p >> 4))
            lo = tl.trans(int4_bf16(p & 15))
        else:
            hi = tl.trans(((p >> 4).to(tl.int8) - 8).to(xe.dtype))  # q[n, 2j] - 8, exact in x's dtype
            lo = tl.trans(((p & 15).to(tl.int8) - 8).to(xe.dtype))  # q[n, 2j + 1] - 8
        if IEEE:
            qx = tl.dot(xo, lo, tl.dot(xe, hi, input_precision="ieee"), input_precision="ieee")
        else:
            qx = tl.dot(xo, lo, tl.dot(xe, hi))
        sx = tl.sum(xe.to(tl.float32), axis=1) + tl.sum(xo.to(tl.float32), axis=1)  # (BLOCK_M,)
        s = tl.load(scale_ptr + sz_rows + g, mask=nmask, other=0.0).to(tl.float32)
        z = tl.load(zero_ptr + sz_rows + g, mask=nmask, other=0.0).to(tl.float32)
        acc += qx * s[None, :] + sx[:, None] * z[None, :]
    store_tile(acc, rows, cols, M, N, scale_ptr, bias_ptr, out_ptr, SPLIT, False, HAS_BIAS, 1.0)


@triton.jit(do_not_specialize=["M"])
def _int8_swapped_kernel(x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, k_slice,
                         ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                         BITS: tl.constexpr, INT8: tl.constexpr, UNSCALE: tl.constexpr):
    """The weight as tl.dot's A operand, (BLOCK_N, BLOCK_K) as it lies in memory, x^T (BLOCK_K,
    ROWS) as B: out^T tiles (BLOCK_N, ROWS), stored transposed. Sums (and BITS) as _int8_kernel's."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    nmask = cols < N
    kk = tl.arange(0, BLOCK_K)
    x_cols = x_ptr + rows.to(tl.int64)[None, :] * stride_xm  # x^T: row m of x is column m
    q_rows = q_ptr + cols.to(tl.int64)[:, None] * K
    k_start = tl.program_id(2) * k_slice
    k_end = tl.minimum(k_start + k_slice, K)
    acc = tl.zeros((BLOCK_N, ROWS), tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        kmask = (k + kk) < K
        xt = tl.load(x_cols + (k + kk)[:, None], mask=kmask[:, None] & rmask[None, :], other=0.0)
        w = tl.load(q_rows + (k + kk)[None, :], mask=nmask[:, None] & kmask[None, :])
        if BITS:  # as _int8_kernel's
            if INT8:
                w = int8_bf16(w)
            else:
                xt = e4m3_prescale(xt)
                w = e4m3_bf16(w)
        else:
            w = w.to(xt.dtype)  # exact; masked inputs zeroed after the cast (e4m3: see _int8_kernel)
            w = tl.where(kmask[None, :], w, tl.zeros_like(w))
        if IEEE:
            acc = tl.dot(w, xt, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
    store_tile(tl.trans(acc), rows, cols, M, N, scale_ptr, bias_ptr, out_ptr, SPLIT, True, HAS_BIAS, UNSCALE)


@triton.jit(do_not_specialize=["M"])
def _int4_swapped_kernel(x_ptr, p_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, groups,
                         g_slice, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                         STEP: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                         IEEE: tl.constexpr, BITS: tl.constexpr):
    """_int4_kernel's sums (and BITS) with the weight as tl.dot's A operand (no transpose of it),
    STEP groups a loop step (unrolled: their loads issued together), out^T tiles (BLOCK_N, ROWS)."""
    HALF: tl.constexpr = GROUP // 2
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    nmask = cols < N
    j = tl.arange(0, HALF)
    x_even = x_ptr + rows.to(tl.int64)[None, :] * stride_xm + 2 * j[:, None]  # (HALF, ROWS): x^T's
    p_rows = p_ptr + cols.to(tl.int64)[:, None] * (K // 2) + j[None, :]
    sz_rows = cols.to(tl.int64) * groups
    g_start = tl.program_id(2) * g_slice
    g_end = tl.minimum(g_start + g_slice, groups)
    acc = tl.zeros((BLOCK_N, ROWS), tl.float32)
    for g0 in range(g_start, g_end, STEP):
        for i in tl.static_range(STEP):
            g = g0 + i
            # a group past the slice (its last step's): x 0, the slice's last group's weight (any
            # finite one: valid addresses), so it adds 0
            gw = tl.minimum(g, g_end - 1)
            xmask = rmask[None, :] & ((g * HALF + j) < g_end * HALF)[:, None]
            xe = tl.load(x_even + g * GROUP, mask=xmask, other=0.0)
            xo = tl.load(x_even + g * GROUP + 1, mask=xmask, other=0.0)
            p = tl.load(p_rows + gw * HALF, mask=nmask[:, None], other=0)  # (BLOCK_N, HALF)
            if BITS:
                hi = int4_bf16(p >> 4)
                lo = int4_bf16(p & 15)
            else:
                hi = ((p >> 4).to(tl.int8) - 8).to(xe.dtype)
                lo = ((p & 15).to(tl.int8) - 8).to(xe.dtype)
            if IEEE:
                qx = tl.dot(lo, xo, tl.dot(hi, xe, input_precision="ieee"), input_precision="ieee")
            else:
                qx = tl.dot(lo, xo, tl.dot(hi, xe))
            sx = tl.sum(xe.to(tl.float32), axis=0) + tl.sum(xo.to(tl.float32), axis=0)  # (ROWS,)
            s = tl.load(scale_ptr + sz_rows + gw, mask=nmask, other=0.0).to(tl.float32)
            z = tl.load(zero_ptr + sz_rows + gw, mask=nmask, other=0.0).to(tl.float32)
            acc += qx * s[:, None] + sx[None, :] * z[:, None]
    store_tile(tl.trans(acc), rows, cols, M, N, scale_ptr, bias_ptr, out_ptr, SPLIT, False, HAS_BIAS, 1.0)
