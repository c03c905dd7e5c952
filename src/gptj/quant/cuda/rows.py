"""Per-row quantization of activations on CUDA (fp8's and w8a8's larger calls): quantize_rows rounds
each row of x (times a per-column factor) to int8 or e4m3 with its own scale in one kernel launch,
bit for bit gptj.quant.ops' rounding; its jit helpers (quantize_values, row_scale, round_e4m3) are the
KV store's too (gptj.engine.attention.cuda).
"""

from __future__ import annotations

import torch

from gptj.quant.cuda.launch import check_x, need_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # gptj.quant.cuda.available() says so; quantize_rows refuses first
    triton = None

ROW_KINDS = {"int8": (1, torch.int8), "e4m3": (2, torch.float8_e4m3fn)}  # the kernels' QUANT code, q's dtype
ROW_BLOCK = 1024  # a row's values a loop step

if triton is not None:
    @triton.jit
    def round_e4m3(y):
        """float32 y within +-448 rounded to the nearest e4m3 value, ties to even, as a float32 (whose
        cast to e4m3 is then exact, whichever way a conversion rounds): the addition of 1.5 x 2^23 ulps
        rounds y to whole ulps of its e4m3 binade (2^-9 below 2^-6: the subnormals')."""
        exponent = tl.maximum((tl.abs(y).to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
        ulp = ((exponent - 3) << 23).to(tl.float32, bitcast=True)
        big = ulp * 12582912.0
        r = (y + big) - big
        return tl.where(r == 0.0, y * 0.0, r)  # a negative value rounded to zero keeps its sign, as a cast does

    @triton.jit
    def quantize_values(xf, scale, QUANT: tl.constexpr):
        """float32 values xf over their scale (IEEE division), within +-qmax, rounded to nearest: QUANT 1
        an int8 value (ties to even), 2 an e4m3 one; as float32, their cast to the type exact.
        gptj.quant.ops' quantize_rows_int8 / quantize_rows_fp8 (and the KV store's) values, bit for bit."""
        qmax = 127.0 if QUANT == 1 else 448.0
        y = tl.math.div_rn(xf, tl.zeros_like(xf) + scale)
        y = tl.minimum(tl.maximum(y, -qmax), qmax)
        if QUANT == 1:
            y = (y + 12582912.0) - 12582912.0  # 1.5 x 2^23: float32 addition rounds to an integer, ties to even
        else:
            y = round_e4m3(y)
        return y

    @triton.jit
    def row_scale(amax, QUANT: tl.constexpr):
        """max |x| of a row or head -> its scale: amax / qmax (IEEE division), at least 2^-120."""
        qmax = 127.0 if QUANT == 1 else 448.0
        return tl.maximum(tl.math.div_rn(amax, qmax), 2.0**-120)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, mul_ptr, q_ptr, s_ptr, K, stride_x, BLOCK: tl.constexpr, QUANT: tl.constexpr,
                              MUL: tl.constexpr):
        """Program m: row m of x (times mul, per column, if MUL) -> its scale and quantized values:
        one pass for max |x|, one to quantize (the row is read twice, from L2 the second time)."""
        m = tl.program_id(0).to(tl.int64)
        row = x_ptr + m * stride_x
        amax = tl.zeros((BLOCK,), tl.float32)
        for k in range(0, K, BLOCK):
            i = k + tl.arange(0, BLOCK)
            xf = tl.load(row + i, mask=i < K, other=0.0).to(tl.float32)
            if MUL:
                xf = xf * tl.load(mul_ptr + i, mask=i < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(xf))
        scale = row_scale(tl.max(amax, axis=0), QUANT)
        for k in range(0, K, BLOCK):
            i = k + tl.arange(0, BLOCK)
            xf = tl.load(row + i, mask=i < K, other=0.0).to(tl.float32)
            if MUL:
                xf = xf * tl.load(mul_ptr + i, mask=i < K, other=0.0)
            tl.store(q_ptr + m * K + i, quantize_values(xf, scale, QUANT).to(q_ptr.dtype.element_ty), mask=i < K)
        tl.store(s_ptr + m, scale)


def quantize_rows(x2: torch.Tensor, kind: str, mul: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gptj.quant.ops.quantize_rows_int8 (kind "int8") or quantize_rows_fp8 ("e4m3") of x2.float() * mul
    (mul float32 (K,), per column, or None), bit for bit, in one kernel launch where torch's forms
    take some eight (their cost at MLPerf's shape: docs/PERFORMANCE.md#gpu) -> (q (M, K), scale float32
    (M, 1))."""
    need_triton()
    M, K = check_x(x2)
    code, dtype = ROW_KINDS[kind]
    if mul is not None and (mul.dtype != torch.float32 or mul.shape != (K,) or not mul.is_contiguous()):
        raise ValueError(f"quantize_rows: mul must be a contiguous float32 ({K},), got {mul.dtype} {tuple(mul.shape)}")
    q = torch.empty((M, K), dtype=dtype, device=x2.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x2.device)
    _quantize_rows_kernel[(M,)](x2, x2 if mul is None else mul, q, scale, K, x2.stride(0),
                                BLOCK=min(ROW_BLOCK, triton.next_power_of_2(K)), QUANT=code, MUL=mul is not None)
    return q, scale

