"""The kind "fma" of gptj.quant.cuda's weight-only linears (Tiles.kind): no tensor cores, for 1, 2 or 4
rows a program (decode's single row above all). Per row a float32 (BLOCK_N, BLOCK_K) accumulator of
products over the K loop, the weight converted to float32 by bit operations (not conversion
instructions), reduced along K once after it; the loop's loads pipelined by tl.range's num_stages
(Triton pipelines only loads that feed a tl.dot otherwise). Grid (row tile, n block, K slice).

Needs Triton: gptj.quant.cuda.launch imports it only where Triton is installed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gptj.quant.cuda.epilogue import store_tile


@triton.jit(do_not_specialize=["M"])
def _int8_fma_kernel(x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, k_slice,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, INT8: tl.constexpr, STAGES: tl.constexpr):
    """No tensor cores, for ROWS = 1, 2 or 4 rows a program: per row r a (BLOCK_N, BLOCK_K) float32
    accumulator, acc_r[n, j] += float32(q[n, k + j]) * float32(x[m_r, k + j]) over the K slice in
    steps of BLOCK_K (each product exact for float16 / bfloat16 x), then one sum over j per n
    (tl.sum's fixed tree) after the loop. Every tensor is 2-D in the weight tile's layout (one
    accumulator per row, not a 3-D one: with that, Triton moved each weight tile through shared
    memory to another layout). A row past M reads row M - 1 (valid addresses, no row masks) and
    stores nothing. The helpers are written out in the loop: Triton's interpreter spends
    milliseconds a call of a jit function."""
    m0 = tl.program_id(0) * ROWS
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols < N
    kk = tl.arange(0, BLOCK_K)
    q_rows = q_ptr + cols.to(tl.int64)[:, None] * K
    x0 = x_ptr + tl.minimum(m0, M - 1).to(tl.int64) * stride_xm + kk
    x1 = x_ptr + tl.minimum(m0 + 1, M - 1).to(tl.int64) * stride_xm + kk
    x2 = x_ptr + tl.minimum(m0 + 2, M - 1).to(tl.int64) * stride_xm + kk
    x3 = x_ptr + tl.minimum(m0 + 3, M - 1).to(tl.int64) * stride_xm + kk
    k_start = tl.program_id(2) * k_slice
    k_end = tl.minimum(k_start + k_slice, K)
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):  # loads pipelined (no tl.dot here)
        kmask = (k + kk) < K
        w = tl.load(q_rows + (k + kk)[None, :], mask=nmask[:, None] & kmask[None, :])
        if INT8:
            # int8 -> float32 exactly without a conversion instruction (a quarter of the FMA rate
            # on recent GPUs): the byte's bits, sign flipped (q + 128 in 0..255), as the low bits
            # of 2^23's float32, less 2^23 + 128. Any byte is a finite value: a masked input's
            # product is x's 0 times it, 0.
            u = w.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x80
            w = (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        else:  # e4m3: an unloaded byte could be NaN, zeroed after the cast
            w = w.to(tl.float32)
            w = tl.where(kmask[None, :], w, tl.zeros_like(w))
        acc0 += w * tl.load(x0 + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
        if ROWS > 1:
            acc1 += w * tl.load(x1 + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
        if ROWS > 2:
            acc2 += w * tl.load(x2 + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
            acc3 += w * tl.load(x3 + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
    tile = _row_tile(tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), tl.sum(acc2, axis=1), tl.sum(acc3, axis=1),
                     ROWS, BLOCK_N)
    store_tile(tile, m0 + tl.arange(0, ROWS), cols, M, N, scale_ptr, bias_ptr, out_ptr, SPLIT, True, HAS_BIAS, 1.0)


@triton.jit
def _row_tile(s0, s1, s2, s3, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(ROWS, BLOCK_N) from the rows' (BLOCK_N,) sums s0, s1, ... (the first ROWS of them)."""
    if ROWS == 1:
        tile = s0[None, :]
    elif ROWS == 2:
        tile = tl.trans(tl.join(s0, s1))
    else:  # t[n, i, j] = (s0, s2)[i] if j == 0 else (s1, s3)[i]: row 2 i + j
        tile = tl.trans(tl.reshape(tl.join(tl.join(s0, s2), tl.join(s1, s3)), (BLOCK_N, 4)))
    return tile


@triton.jit(do_not_specialize=["M"])
def _int4_fma_kernel(x_ptr, p_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, groups,
                     g_slice, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                     STEP: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, STAGES: tl.constexpr):
    """No tensor cores, ROWS = 1, 2 or 4: each weight dequantized in float32, w = (q - 8) * scale +
    zero (one rounding: (q - 8) * scale is exact), then per row a (BLOCK_N, GROUP / 2) float32
    accumulator += w * x as _int8_fma_kernel's, the even inputs (a group's inputs loaded whole,
    split in pairs) against the high nibbles, the odd against the low; STEP groups a loop step
    (unrolled: their loads issued together)."""
    HALF: tl.constexpr = GROUP // 2
    m0 = tl.program_id(0) * ROWS
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols < N
    j = tl.arange(0, HALF)
    kk = tl.arange(0, GROUP)
    p_rows = p_ptr + cols.to(tl.int64)[:, None] * (K // 2) + j[None, :]
    sz_rows = cols.to(tl.int64) * groups
    x0 = x_ptr + tl.minimum(m0, M - 1).to(tl.int64) * stride_xm + kk
    x1 = x_ptr + tl.minimum(m0 + 1, M - 1).to(tl.int64) * stride_xm + kk
    x2 = x_ptr + tl.minimum(m0 + 2, M - 1).to(tl.int64) * stride_xm + kk
    x3 = x_ptr + tl.minimum(m0 + 3, M - 1).to(tl.int64) * stride_xm + kk
    g_start = tl.program_id(2) * g_slice
    g_end = tl.minimum(g_start + g_slice, groups)
    acc0 = tl.zeros((BLOCK_N, HALF), tl.float32)
    acc1 = tl.zeros((BLOCK_N, HALF), tl.float32)
    acc2 = tl.zeros((BLOCK_N, HALF), tl.float32)
    acc3 = tl.zeros((BLOCK_N, HALF), tl.float32)
    for g0 in tl.range(g_start, g_end, STEP, num_stages=STAGES):  # loads pipelined
        for i in tl.static_range(STEP):
            g = g0 + i
            # a group past the slice (its last step's): x 0, the slice's last group's weight (any
            # finite one, at valid addresses), so it adds 0
            gw = tl.minimum(g, g_end - 1)
            xmask = (g * GROUP + kk) < g_end * GROUP
            p = tl.load(p_rows + gw * HALF, mask=nmask[:, None], other=0)  # (BLOCK_N, HALF)
            s = tl.load(scale_ptr + sz_rows + gw, mask=nmask, other=0.0).to(tl.float32)[:, None]
            z = tl.load(zero_ptr + sz_rows + gw, mask=nmask, other=0.0).to(tl.float32)[:, None]
            # q - 8 in float32 as _int8_fma_kernel converts a byte: q as the low bits of 2^23's float32
            w_hi = (((p >> 4).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * s + z
            w_lo = (((p & 15).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * s + z
            xe, xo = tl.split(tl.reshape(tl.load(x0 + g * GROUP, mask=xmask, other=0.0).to(tl.float32), (HALF, 2)))
            acc0 += w_hi * xe[None, :]
            acc0 += w_lo * xo[None, :]
            if ROWS > 1:
                xe, xo = tl.split(tl.reshape(tl.load(x1 + g * GROUP, mask=xmask, other=0.0).to(tl.float32),
                                             (HALF, 2)))
                acc1 += w_hi * xe[None, :]
                acc1 += w_lo * xo[None, :]
            if ROWS > 2:
                xe, xo = tl.split(tl.reshape(tl.load(x2 + g * GROUP, mask=xmask, other=0.0).to(tl.float32),
                                             (HALF, 2)))
                acc2 += w_hi * xe[None, :]
                acc2 += w_lo * xo[None, :]
                xe, xo = tl.split(tl.reshape(tl.load(x3 + g * GROUP, mask=xmask, other=0.0).to(tl.float32),
                                             (HALF, 2)))
                acc3 += w_hi * xe[None, :]
                acc3 += w_lo * xo[None, :]
    tile = _row_tile(tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), tl.sum(acc2, axis=1), tl.sum(acc3, axis=1),
                     ROWS, BLOCK_N)
    store_tile(tile, m0 + tl.arange(0, ROWS), cols, M, N, scale_ptr, bias_ptr, out_ptr, SPLIT, False, HAS_BIAS,
                1.0)
