"""Weight-only quantization's tensor math: quantize / dequantize int8 and int4, and pack int4.

Schemes (all scales and zeros are bfloat16 VALUES, the dtype the kernels consume):

  int8  per output channel, symmetric, range [-127, 127] (-128 is never used):
            scale[n] = max_k |w[n, k]| / 127  (rounded UP to bfloat16, so nothing clips)
            q[n, k]  = clamp(round(w[n, k] / scale[n]), -127, 127)
            w ~= q * scale                                  |w - w~| <= scale / 2
  int4  per group of `group_size` consecutive inputs (32, 64, 128 or 256; default 128, or the
        largest that divides the layers' inputs where 128 does not),
        asymmetric with a float zero point, as the tinygemm kernels (CPU and CUDA) define it:
            w ~= (q - 8) * scale + zero,   q in [0, 15]     |w - w~| <= scale / 2
        scale ~= (max - min) / 15 and zero ~= min + 8 * scale, both bfloat16, chosen so that
        [zero - 8 * scale, zero + 7 * scale] covers the group's [min, max].

Two int4 layouts: the portable one of the checkpoint (`pack_int4`, see gptj.quant.format) and the
CPU kernel's packed one, made at load time (`_pack_cpu_int4`, probed by `cpu_int4_layout`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable

import torch

from gptj.errors import GptjError
from gptj.native.ops import W4A8_BLOCK, W4A8_PANEL  # W4A8's kernel's: inputs per rounding of x, outputs a panel

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the tinygemm kernels (CPU and CUDA) accept
DEFAULT_GROUP_SIZE = 128
SCALE_DTYPE = torch.bfloat16  # scales and zeros: bfloat16 values (the kernels need them in the activation dtype)

# Largest weight chunk (elements) dequantized at once in the big-rows path: bounds the
# temporary to 32 MiB of bfloat16 (a 4096x4096 layer in one go; lm_head in 13 chunks).
DEQUANT_CHUNK_ELEMENTS = 4096 * 4096


# --- quantizing tensors ------------------------------------------------------------------------


def _ceil_bf16(x: torch.Tensor) -> torch.Tensor:
    """Positive float32 values rounded UP to the nearest bfloat16 (exactly representable) value."""
    bits = x.float().contiguous().view(torch.int32)
    bits = (bits + 0xFFFF) & -0x10000  # clear the low 16 bits, rounding toward +inf (x > 0)
    return bits.view(torch.float32).to(SCALE_DTYPE)


# A float weight made float32 for F.linear (bfloat16 on a CPU without bfloat16 arithmetic: the policy's
# UPCAST) goes a chunk of this many elements at a time: 4 MiB of float32, which stays in the caches
# between its conversion and the GEMM that reads it, where DEQUANT_CHUNK_ELEMENTS' chunk (a whole
# layer) went to memory and back. Figures: docs/PERFORMANCE.md#upcast-chunks
UPCAST_CHUNK_ELEMENTS = 1024 * 1024


def _row_chunks(n_rows: int, n_cols: int, elements: int | None = None,
                multiple: int = 256) -> Iterable[tuple[int, int]]:
    """Row ranges of about `elements` elements (default DEQUANT_CHUNK_ELEMENTS); boundaries at multiples
    of `multiple` rows (256: whole blocks of the CPU int4 layout, so a chunk of its packed rows unpacks
    on its own)."""
    elements = DEQUANT_CHUNK_ELEMENTS if elements is None else elements
    step = max(multiple, elements // max(1, n_cols) // multiple * multiple)
    for a in range(0, n_rows, step):
        yield a, min(n_rows, a + step)


def quantize_int8(w: torch.Tensor, smooth: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 (out, in), scale bfloat16 (out,)) with w ~= q * scale[:, None], |error| <= scale / 2.

    smooth (in,): quantize w * smooth[None, :] instead (W8A8's smoothed weight, see below).
    """
    return _per_channel(w, "int8", torch.int8, 127, lambda v: torch.round(v).clamp_(-127, 127).to(torch.int8), smooth)


def divide(x: torch.Tensor, d: float) -> torch.Tensor:
    """x / d correctly rounded on every device. On CUDA torch divides by a Python number as a
    multiplication by its reciprocal, a unit in the last place off for some x; a tensor divisor
    divides. The Triton kernels that quantize as this module does (the KV store) divide exactly,
    so the scales agree bit for bit on every device."""
    return x / torch.full_like(x, d)


def _per_channel(w: torch.Tensor, what: str, qdtype: torch.dtype, qmax: float,
                 to_q: Callable[[torch.Tensor], torch.Tensor],
                 smooth: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-output-channel symmetric quantization of w (out, in) to `qdtype`: scale = max |w row| /
    qmax rounded UP to bfloat16 (nothing clips), q = to_q(w / scale). Computed in float32 a chunk of
    rows at a time (no float32 copy of a big weight); smooth as in quantize_int8."""
    if w.dim() != 2 or not w.is_floating_point():
        raise GptjError(f"{what} quantization needs a 2-D float weight, got {tuple(w.shape)} {w.dtype}")
    if smooth is not None and smooth.shape != (w.shape[1],):
        raise GptjError(f"smoothing factors of shape {tuple(smooth.shape)} for a weight of {w.shape[1]} inputs")
    q = torch.empty(w.shape, dtype=qdtype, device=w.device)
    scale = torch.empty(w.shape[0], dtype=SCALE_DTYPE, device=w.device)
    for a, b in _row_chunks(*w.shape):
        wf = w[a:b].float()
        if smooth is not None:
            wf = wf * smooth.float()[None, :]  # not in place: .float() of a float32 weight is the weight itself
        s = _ceil_bf16(divide(wf.abs().amax(dim=1), qmax).clamp_(min=2.0**-120))
        q[a:b] = to_q(wf / s.float()[:, None])
        scale[a:b] = s
    return q, scale


_scratch = threading.local()  # per thread: {(dtype, device): a flat buffer} for chunked_linear's chunks


def _chunk_buffer(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (rows, cols) `dtype` buffer on a CPU `device`, reused from call to call (one per thread and
    dtype, grown as needed: at most DEQUANT_CHUNK_ELEMENTS elements for _row_chunks' chunks).

    Why: a chunk of 32 MiB is above glibc's largest mmap threshold, so a fresh tensor for each chunk
    is a fresh mapping, and writing it page-faults every 4 KiB; a reused buffer pays that once.
    Figures: docs/PERFORMANCE.md#amx-int8-gemm"""
    cache = getattr(_scratch, "buffers", None)
    if cache is None:
        cache = _scratch.buffers = {}
    buf = cache.get((dtype, device))
    if buf is None or buf.numel() < rows * cols:
        with torch.inference_mode(False):  # a normal tensor: one made under inference_mode could not be
            buf = torch.empty(rows * cols, dtype=dtype, device=device)  # written outside it later
        cache[(dtype, device)] = buf
    return buf[:rows * cols].view(rows, cols)


def chunked_linear(x2: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                   chunk_elements: int | None = None) -> torch.Tensor:
    """x2 (rows, in) @ w.T in `dtype`, (rows, out): the weight (any dtype: int8, e4m3, bfloat16) made
    `dtype` a chunk of rows at a time (no full-size copy of a big weight), F.linear with the bias,
    then times the per-output-channel `scale`, each in `dtype`; the result in `out_dtype` (default
    `dtype`), each chunk's columns rounded once as they are written.

    On CPU, outside autograd, each chunk is converted into one reused buffer (`_chunk_buffer`) and
    multiplied into one product buffer for the call; where autograd records the call (a LoRA adapter
    over a quantized base) each chunk is a tensor of its own, as backward needs it, and on CUDA the
    caching allocator reuses memory already. `chunk_elements`: the chunks' size, in any rows (default
    DEQUANT_CHUNK_ELEMENTS, in whole blocks of 256 rows, as int4's layout needs)."""
    xd = x2.to(dtype)
    rows = x2.shape[0]
    y = torch.empty(rows, w.shape[0], dtype=out_dtype or dtype, device=x2.device)
    reuse = x2.device.type == "cpu" and not (torch.is_grad_enabled() and (x2.requires_grad or w.requires_grad))
    chunks = list(_row_chunks(*w.shape) if chunk_elements is None else _row_chunks(*w.shape, chunk_elements, 1))
    product = (torch.empty(rows * (chunks[0][1] - chunks[0][0]), dtype=dtype, device=x2.device)
               if reuse and chunks else None)
    for a, b in chunks:
        if w.dtype == dtype or not reuse:
            wd = w[a:b].to(dtype)  # (the weight itself where it is `dtype` already)
        else:
            wd = _chunk_buffer(b - a, w.shape[1], dtype, w.device).copy_(w[a:b])
        bias_ab = None if bias is None else bias[a:b].to(dtype)
        if product is not None:  # every chunk's product in one buffer (the first chunk is the largest)
            part = product[:rows * (b - a)].view(rows, b - a)
            if bias_ab is None:
                torch.mm(xd, wd.t(), out=part)
            else:
                torch.addmm(bias_ab, xd, wd.t(), out=part)
        else:
            part = torch.nn.functional.linear(xd, wd, bias_ab)
        if scale is None:
            y[:, a:b] = part
        elif reuse:
            torch.mul(part, scale[a:b].to(dtype), out=y[:, a:b])  # no temporary (not under autograd)
        else:
            y[:, a:b] = part * scale[a:b].to(dtype)
    return y


def int8_sums(qx: torch.Tensor, qw: torch.Tensor, terms: int) -> torch.Tensor:
    """qx (rows, K) int8 times qw (N, K) int8, transposed: float32 (rows, N), the exact integer sums
    rounded once to float32 (as torch._int_mm's int32, converted), from float32 matmuls on any device.

    A float32 sum of products of values in [-127, 127] is exact, in any order, while every partial
    sum stays below 2**24: `terms` (at most 1040) inputs at a time; those partial sums are added in
    int32. The weight is made float a chunk at a time (no float copy of a big weight)."""
    if not 0 < terms <= 2**24 // 127**2:
        raise ValueError(f"{terms} int8 products can sum past 2**24 in float32")
    xf = qx.float()
    if qx.shape[1] <= terms:
        return torch.nn.functional.linear(xf, qw.float())
    acc = torch.zeros(qx.shape[0], qw.shape[0], dtype=torch.int32, device=qx.device)
    for a, b in _row_chunks(qw.shape[0], terms):
        for k in range(0, qx.shape[1], terms):
            part = torch.nn.functional.linear(xf[:, k:k + terms], qw[a:b, k:k + terms].float())
            acc[:, a:b] += part.to(torch.int32)
    return acc.float()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(out, in) values 0..15 -> the portable layout: uint8 (out, in / 2), high nibble first."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] << 4) | q[:, 1::2]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The portable layout uint8 (out, in / 2) -> uint8 values 0..15 (out, in)."""
    return torch.stack((packed >> 4, packed & 15), dim=-1).flatten(-2)


def quantize_int4(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 (out, in/2), scale bf16 (out, groups), zero bf16 (out, groups)).

    w ~= (q - 8) * scale + zero per group of `group_size` inputs, |error| <= scale / 2.
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise GptjError(f"int4 quantization needs a 2-D float weight, got {tuple(w.shape)} {w.dtype}")
    N, K = w.shape
    check_group_size(group_size)
    if K % group_size:
        raise GptjError(f"int4 group size {group_size} does not divide the weight's {K} inputs")
    G = K // group_size
    packed = torch.empty(N, K // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(N, G, dtype=SCALE_DTYPE, device=w.device)
    zero = torch.empty(N, G, dtype=SCALE_DTYPE, device=w.device)
    for a, b in _row_chunks(N, K):
        wf = w[a:b].float().view(b - a, G, group_size)
        lo, hi = wf.amin(dim=-1), wf.amax(dim=-1)
        s0 = _ceil_bf16(divide(hi - lo, 15).clamp_(min=2.0**-120)).float()
        z = (lo + 8 * s0).to(SCALE_DTYPE).float()  # bfloat16 rounding moves the range a little:
        s = _ceil_bf16(torch.maximum(s0, torch.maximum(divide(z - lo, 8), divide(hi - z, 7))))  # widen to cover it
        sf = s.float()
        q = torch.round((wf - z[..., None]) / sf[..., None]).add_(8).clamp_(0, 15)
        packed[a:b] = pack_int4(q.view(b - a, K))
        scale[a:b] = s
        zero[a:b] = z.to(SCALE_DTYPE)
    return packed, scale, zero


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale in float32, rounded once to `dtype`."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q - 8) * scale + zero in float32 from the portable layout, rounded once to `dtype`."""
    return _dequant_int4_values(unpack_int4(packed), scale, zero, dtype)


def _dequant_int4_values(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    N, K = q.shape
    G = scale.shape[1]
    w = (q.view(N, G, K // G).float() - 8) * scale.float()[..., None] + zero.float()[..., None]
    return w.view(N, K).to(dtype)


# --- W4A8: int4's weights, activations rounded to int8 per block of 32 inputs -----------------------------
#
#   x       d[m, b] = max_{k in b} |x[m, k]| / 127 (float32)   xq = round(x * (1 / d)) in [-127, 127] (0 where d is)
#   weight  int4's q, scale, zero (above); in memory in W4A8's panels (pack_w4a8), gptj.native's w4a8.c says why



def quantize_blocks_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (m, k), k a multiple of 32 -> (q int8 (m, k), d float32 (m, k / 32)), x ~= q d per block of 32 inputs
    of a row, |error| <= d / 2: the float32 operations of gptj.native's w4a8.c (x times the reciprocal of d,
    rounded to nearest even), so both round every x alike."""
    m, k = x.shape
    xb = x.float().reshape(m, k // W4A8_BLOCK, W4A8_BLOCK)
    d = divide(xb.abs().amax(dim=-1), 127)
    inv = torch.where(d > 0, torch.full_like(d, 1.0) / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(m, k), d


def round_blocks_int8(x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """x as W4A8 multiplies it: rounded to int8 per block of 32 inputs and back, in `dtype` (float64: each
    value exact; float32: each rounded once)."""
    q, d = quantize_blocks_int8(x)
    m, k = x.shape
    return (q.to(dtype).view(m, -1, W4A8_BLOCK) * d.to(dtype)[..., None]).view(m, k)


def pack_w4a8(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4's values q (out, in) uint8 in 0..15 and scale, zero (out, groups) -> W4A8's layout: (packed uint8
    (out, in / 2): panels of 16 outputs, each its inputs in units of 8, byte 4 c + j of unit u holding
    q[c, 8 u + j] | q[c, 8 u + 4 + j] << 4; sz bfloat16 (out / 16, groups, 2, 16): a panel's scales then zeros
    per group). out must be a multiple of 16, in of 8."""
    N, K, P = q.shape[0], q.shape[1], W4A8_PANEL
    q5 = q.to(torch.uint8).reshape(N // P, P, K // 8, 2, 4).permute(0, 2, 1, 3, 4)  # (panel, unit, c, half, j)
    packed = (q5[:, :, :, 0] | (q5[:, :, :, 1] << 4)).reshape(N, K // 2)
    G = scale.shape[1]
    sz = torch.stack((scale.reshape(N // P, P, G), zero.reshape(N // P, P, G)), dim=1)  # (panel, 2, c, g)
    return packed.contiguous(), sz.permute(0, 3, 1, 2).to(SCALE_DTYPE).contiguous()


def unpack_w4a8(packed: torch.Tensor) -> torch.Tensor:
    """W4A8's packed weight (out, in / 2) -> int4's values (out, in) uint8, pack_w4a8's inverse."""
    N, K, P = packed.shape[0], 2 * packed.shape[1], W4A8_PANEL
    p = packed.reshape(N // P, K // 8, P, 4)
    q5 = torch.stack((p & 15, p >> 4), dim=3)  # (panel, unit, c, half, j)
    return q5.permute(0, 2, 1, 3, 4).reshape(N, K)



# --- FP8 (e4m3): weights per output channel, activations per token --------------------------------
#
#   weight  scale[n] = max_k |w[n, k]| / 448 (rounded UP to bfloat16)   q[n, k] = e4m3(w[n, k] / scale[n])
#   rows    s[m] = max_k |x[m, k]| / 448 (float32)                       q[m, k] = e4m3(x[m, k] / s[m])
# e4m3 (torch.float8_e4m3fn) has 3 mantissa bits and a largest value of 448: a normal value rounds
# to within 2**-4 of itself (relative), a subnormal one (below 2**-6) to within 2**-10 absolute, so
#   |w - q * scale| <= max(2**-4 |w|, 2**-10 scale)                    (`fp8_error_bound`)
# The product of two e4m3 values is exact in float32, so an FP8 GEMM's sums are float32 sums of
# exact products (torch._scaled_mm's, and `fp8_sums`).

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_REL_ERROR = 2.0**-4  # half the spacing of e4m3's normal values, relative
FP8_SUBNORMAL_ERROR = 2.0**-10  # half e4m3's subnormal spacing (2**-9), in units of the scale


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    """float32 values within [-448, 448] (clamped: a cast past them gives NaN) -> e4m3, rounded to nearest."""
    return x.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn (out, in), scale bfloat16 (out,)) with w ~= q * scale[:, None], within
    `fp8_error_bound`."""
    return _per_channel(w, "fp8", FP8_DTYPE, FP8_MAX, _to_fp8)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale (per row) in float32, rounded once to `dtype`."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def fp8_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The most |x - e4m3(x / scale) * scale| can be, elementwise, for rows x (..., k) of `scale` (...)."""
    s = scale.float()[..., None]
    return torch.maximum(FP8_REL_ERROR * x.float().abs(), FP8_SUBNORMAL_ERROR * s)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn (..., k), scale float32 (..., 1)) per row: x ~= q * scale within
    `fp8_error_bound` (a zero row gets a tiny scale and q = 0)."""
    xf = x.float()
    scale = divide(xf.abs().amax(dim=-1, keepdim=True), FP8_MAX).clamp_(min=2.0**-120)
    return _to_fp8(xf / scale), scale


def fp8_sums(qx: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """qx (rows, K) e4m3 times qw (N, K) e4m3, transposed, float32 (rows, N): what an FP8 GEMM sums
    (each product exact in float32; the order of the float32 additions is the only difference).
    The weight is made float a chunk of rows at a time (no float copy of a big weight)."""
    xf = qx.float()
    out = torch.empty(qx.shape[0], qw.shape[0], dtype=torch.float32, device=qx.device)
    for a, b in _row_chunks(*qw.shape):
        out[:, a:b] = torch.nn.functional.linear(xf, qw[a:b].float())
    return out



# --- W8A8: int8 activations (per token, dynamic) x int8 weights (per output channel) ------------
#
#   y[m, n] = sx[m] * sw[n] * sum_k qx[m, k] * qw[n, k]      (the sum exact, in int32)
#   x'      = x / smooth      qx, sx = quantize_rows_int8(x')       (per token, at run time)
#   W'      = W * smooth      qw, sw = quantize_int8(W, smooth)     (per output channel, once)
# smooth (per input channel, SmoothQuant) moves the activations' outlier channels into the weights:
# x' @ W'.T = x @ W.T exactly before rounding. Every row is quantized on its own and the integer
# sums are exact, so a row's result does not depend on the other rows of the call.

SMOOTH_ALPHA = 0.5  # SmoothQuant's migration strength: s = max|X|^a / max|W|^(1 - a)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 (m, k), scale float32 (m, 1)) with x ~= q * scale, per row, symmetric, |error| <= scale / 2.

    scale = max_k |x[m, k]| / 127 in float32 (a zero row gets a tiny scale and q = 0)."""
    xf = x.float()
    scale = divide(xf.abs().amax(dim=-1, keepdim=True), 127).clamp_(min=2.0**-120)
    return torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), scale


def smoothing_factors(act_absmax: torch.Tensor, weight_absmax: torch.Tensor,
                      alpha: float = SMOOTH_ALPHA) -> torch.Tensor:
    """Per input channel s = max|X|^alpha / max|W|^(1 - alpha) (SmoothQuant, Xiao et al. 2023, eq. 4),
    as bfloat16 values; 1 where a channel never saw an activation or has no weight."""
    if not 0 <= alpha <= 1:
        raise GptjError(f"smoothing alpha must be in [0, 1], got {alpha}")
    a, w = act_absmax.float(), weight_absmax.float()
    s = a.pow(alpha) / w.pow(1 - alpha)
    s = torch.where((a > 0) & (w > 0) & torch.isfinite(s), s, torch.ones_like(s))
    return s.clamp_(2.0**-20, 2.0**20).to(SCALE_DTYPE)


def check_group_size(group_size: object) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in INT4_GROUP_SIZES:
        raise GptjError(f"bad int4 group size {group_size!r} (choose from {', '.join(map(str, INT4_GROUP_SIZES))})")
    return group_size



# --- the CPU int4 kernel's packed layout ---------------------------------------------------------
#
# torch._convert_weight_to_int4pack_for_cpu(int32 (N, K) values 0..15, innerKTiles) returns
# uint8 (N, K/2) in a layout that depends on the CPU build (AVX512: blocks of 64 rows, AVX2: 32,
# ...). To avoid keeping a second, portable copy of every int4 weight in memory, we unpack it
# for the big-rows path and for state_dict(). The layout is not documented, so it is probed
# once per process against candidates; if none matches, modules keep the portable copy too.

_PACK_CHUNK_ROWS = 4096  # a multiple of every block size: packing by chunks = packing at once


def _pack_cpu_int4(q: torch.Tensor, portable: bool = False) -> torch.Tensor:
    """Values 0..15 (N, K), or the portable layout (N, K/2) if `portable`, -> the CPU kernel's
    packed uint8 (N, K/2), a chunk of rows at a time (small int32 temporaries)."""
    N = q.shape[0]
    K = q.shape[1] * (2 if portable else 1)
    out = torch.empty(N, K // 2, dtype=torch.uint8)
    for a in range(0, N, _PACK_CHUNK_ROWS):
        b = min(N, a + _PACK_CHUNK_ROWS)
        rows = unpack_int4(q[a:b]) if portable else q[a:b]
        out[a:b] = torch._convert_weight_to_int4pack_for_cpu(rows.to(torch.int32), 1)
    return out


def _unpack_cpu_int4(packed: torch.Tensor, layout: tuple[int, bool]) -> torch.Tensor:
    """Inverse of `_pack_cpu_int4` for `layout` = (block rows, full blocks store rows i and i + block/2
    in one byte (else rows 2i and 2i + 1)); partial blocks at the end store row pairs (2i, 2i + 1)."""
    block, split = layout
    N, K = packed.shape[0], packed.shape[1] * 2
    flat = packed.reshape(-1)
    out = torch.empty(N, K, dtype=torch.uint8, device=packed.device)
    n_full = N // block
    if n_full:
        blk = flat[: n_full * block * K // 2].view(n_full, K, block // 2)
        if split:
            rows = torch.cat((blk & 15, blk >> 4), dim=2)
        else:
            rows = torch.stack((blk & 15, blk >> 4), dim=3).view(n_full, K, block)
        out[: n_full * block] = rows.permute(0, 2, 1).reshape(n_full * block, K)
    tail = N - n_full * block
    if tail:
        blk = flat[n_full * block * K // 2:].view(K, tail // 2)
        out[n_full * block:] = torch.stack((blk & 15, blk >> 4), dim=2).view(K, tail).t()
    return out


@functools.cache
def cpu_int4_layout() -> tuple[int, bool] | None:
    """The CPU int4 kernel's packed layout in this process (probed), or None if unknown."""
    if not hasattr(torch, "_convert_weight_to_int4pack_for_cpu"):
        return None
    gen = torch.Generator().manual_seed(0)
    probes = [torch.randint(0, 16, (n, 64), generator=gen, dtype=torch.uint8)
              for n in (16, 32, 48, 64, 80, 112, 128, 176)]
    try:
        packed = [_pack_cpu_int4(q) for q in probes]
    except (RuntimeError, NotImplementedError):
        return None
    for layout in ((64, True), (32, True), (64, False), (32, False), (16, False)):
        if all(torch.equal(_unpack_cpu_int4(p, layout), q) for p, q in zip(packed, probes)):
            return layout
    return None


def _cpu_int4_kernel_ok(out_features: int) -> bool:
    """torch >= 2.6 has the CPU int4 ops under these names; the packing wants out_features % 16 == 0."""
    return (hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")
            and out_features % 16 == 0)
