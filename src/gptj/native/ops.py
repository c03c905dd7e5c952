"""The native kernels' Python face: each checks its tensors' dtypes, shapes and strides, then calls the
loaded library's function (gptj.native.loader binds them) on their data pointers with
torch.get_num_threads() threads. Where the library lacks a kernel, a call raises RuntimeError naming it.

torch's CPU kernels leave much of the memory bandwidth unused when a linear layer sees one row (a
decode step): `torch._weight_int8pack_mm` reads a 7168 x 1024 int8 weight at about 12 GB/s and
oneDNN's packed bfloat16 kernel about 16-23 GB/s, on a machine whose streaming read (torch.sum)
does 30-50 GB/s. `gemv.c` (next to this file) reads each weight once per call, sequentially, with
software prefetch, at about the streaming rate for one row (benchmarks/native_gemv.py measures
it): float32 FMAs (int8, one row of x) or AVX512-BF16 dot products, float32 accumulation, x used
as given (never quantized).

    from gptj import native
    if native.available():
        y = native.linear_int8(x, w_int8, scale)   # x (..., K) bf16, w (N, K) int8, scale (N,) bf16
        y = native.linear_bf16(x, w, bias)         # x (..., K) bf16, w (N, K) bf16
"""

from __future__ import annotations

import torch

from gptj.native import loader
from gptj.native.loader import amx_available, has, load

# --- linears: x @ weight.T for int8, bfloat16 and W8A8's int8 x int8 weights --------------------------

_MAX_DIM = 2**31 - 1
_bf16 = torch.bfloat16
_i8 = torch.int8


def _bad(name: str, what: str) -> ValueError:
    return ValueError(f"{name}: {what}")


def _check_vec(v: torch.Tensor, N: int, what: str, name: str) -> None:
    if not isinstance(v, torch.Tensor) or v.dtype is not _bf16 or not v.is_cpu:
        raise _bad(name, f"{what} must be a bfloat16 CPU tensor")
    if v.shape != (N,) or not v.is_contiguous():
        raise _bad(name, f"{what} must be contiguous with shape ({N},), got {tuple(v.shape)}")


def _prepare(name: str, x: torch.Tensor, weight: torch.Tensor, wdtype: torch.dtype,
             bias: torch.Tensor | None, out: torch.Tensor | None
             ) -> tuple[torch.Tensor, int, int, int, torch.Tensor]:
    """Validated (contiguous x, M, N, K, output) for x (..., K) @ weight (N, K).T."""
    try:
        if weight.dtype is not wdtype or not weight.is_cpu:
            raise _bad(name, f"weight must be a {wdtype} CPU tensor")
        wshape = weight.shape
        if len(wshape) != 2 or not weight.is_contiguous():
            raise _bad(name, f"weight must be a contiguous (N, K) matrix, got shape {tuple(wshape)}")
        if x.dtype is not _bf16 or not x.is_cpu:
            raise _bad(name, "x must be a bfloat16 CPU tensor")
        xshape = x.shape
    except AttributeError:
        raise _bad(name, "x and weight must be tensors") from None
    N, K = wshape
    if not xshape or xshape[-1] != K:
        raise _bad(name, f"x must have shape (..., {K}), got {tuple(xshape)}")
    if not x.is_contiguous():
        x = x.contiguous()
    if bias is not None:
        _check_vec(bias, N, "bias", name)
    lead = xshape[:-1]
    M = x.numel() // K if K else lead.numel()
    if M > _MAX_DIM or N > _MAX_DIM or K > _MAX_DIM:
        raise _bad(name, "dimensions must be below 2**31")
    if out is None:
        return x, M, N, K, torch.empty((*lead, N), dtype=_bf16)
    if (not isinstance(out, torch.Tensor) or out.dtype is not _bf16 or not out.is_cpu
            or not out.is_contiguous() or out.shape != (*lead, N)):
        raise _bad(name, f"out must be a contiguous bfloat16 CPU tensor of shape {(*lead, N)}")
    return x, M, N, K, out


def _lib_or_raise(name: str, kernel: str = "gemv") -> None:
    if not has(kernel):
        raise RuntimeError(f"{name}: the native {kernel} kernels are not available on this machine")


def linear_int8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """bfloat16(x @ (weight * scale[:, None]).T + bias), float32 accumulation (scale applied to the sums).

    x (..., K) bfloat16; weight (N, K) int8 (per-output-channel symmetric); scale (N,) bfloat16;
    bias (N,) bfloat16 or None. Returns (..., N) bfloat16: `out` when given (it must not overlap
    the inputs; reusing one spares an allocation per call). Uses torch.get_num_threads() threads.
    """
    if loader._gemv_int8 is None:
        _lib_or_raise("linear_int8")
    x, M, N, K, y = _prepare("linear_int8", x, weight, _i8, bias, out)
    _check_vec(scale, N, "scale", "linear_int8")
    if M and N and loader._gemv_int8(x.data_ptr(), weight.data_ptr(), scale.data_ptr(),
                                     None if bias is None else bias.data_ptr(), y.data_ptr(),
                                     M, N, K, torch.get_num_threads()):
        raise MemoryError("linear_int8: no memory for the kernel's copy of x")
    return y


AMX_K_MULTIPLE = 64  # the AMX GEMM converts its weight 64 inputs at a time (amx.c)


def linear_int8_amx(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """linear_int8's formula on AMX's tiles (amx.c): float32 sums of the same products, added 32 at a
    time, then scaled, biased and rounded once. K must be a multiple of AMX_K_MULTIPLE; `amx_available()`
    says whether it runs here."""
    if not amx_available():
        raise RuntimeError("linear_int8_amx: gptj.native's AMX kernel is not available on this machine")
    x, M, N, K, y = _prepare("linear_int8_amx", x, weight, _i8, bias, out)
    _check_vec(scale, N, "scale", "linear_int8_amx")
    if K % AMX_K_MULTIPLE:
        raise _bad("linear_int8_amx", f"K = {K} is not a multiple of {AMX_K_MULTIPLE}")
    if M and N and loader._gemm_int8_amx(x.data_ptr(), weight.data_ptr(), scale.data_ptr(),
                                         None if bias is None else bias.data_ptr(), y.data_ptr(),
                                         M, N, K, torch.get_num_threads()):
        raise MemoryError("linear_int8_amx: no memory for x's tile layout")
    return y


def linear_w8a8_amx(qu: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """W8A8's integer sums on AMX's tiles (amx.c's gemm_w8a8_amx, tdpbssd: exact int32), times
    weight_scale, in float32: qu (M, K) uint8, q + 128 as quantize_rows_u8 writes it; weight (N, K)
    int8; weight_scale (N,) float32. Returns (M, N) float32: what oneDNN's u8 x s8 GEMM returns for
    the same operands (PackedW8A8Linear's SHIFTED form), bit for bit. K a multiple of AMX_K_MULTIPLE."""
    if not amx_available():
        raise RuntimeError("linear_w8a8_amx: gptj.native's AMX kernels are not available on this machine")
    if qu.dtype is not torch.uint8 or qu.dim() != 2 or not qu.is_contiguous():
        raise _bad("linear_w8a8_amx", "qu must be a contiguous uint8 (M, K) tensor")
    if weight.dtype is not _i8 or weight.dim() != 2 or not weight.is_contiguous() or weight.shape[1] != qu.shape[1]:
        raise _bad("linear_w8a8_amx", f"weight must be a contiguous int8 (N, {qu.shape[1]}) tensor")
    M, K = qu.shape
    N = weight.shape[0]
    if weight_scale.dtype is not torch.float32 or weight_scale.shape != (N,) or not weight_scale.is_contiguous():
        raise _bad("linear_w8a8_amx", f"weight_scale must be a contiguous float32 ({N},) tensor")
    if K % AMX_K_MULTIPLE:
        raise _bad("linear_w8a8_amx", f"K = {K} is not a multiple of {AMX_K_MULTIPLE}")
    y = torch.empty(M, N)
    if M and N and loader._gemm_w8a8_amx(qu.data_ptr(), weight.data_ptr(), weight_scale.data_ptr(), y.data_ptr(),
                                         M, N, K, torch.get_num_threads()):
        raise MemoryError("linear_w8a8_amx: no memory for x's tile layout")
    return y


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """bfloat16(x @ weight.T + bias) with float32 accumulation.

    x (..., K) bfloat16; weight (N, K) bfloat16; bias (N,) bfloat16 or None. Returns (..., N)
    bfloat16: `out` when given (as in linear_int8). Uses torch.get_num_threads() threads.
    """
    if loader._gemv_bf16 is None:
        _lib_or_raise("linear_bf16")
    x, M, N, K, y = _prepare("linear_bf16", x, weight, _bf16, bias, out)
    if M and N and loader._gemv_bf16(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                     y.data_ptr(), M, N, K, torch.get_num_threads()):
        raise MemoryError("linear_bf16: no memory for x's float32 copy")
    return y


W8A8_MAX_K = 131072  # int32 sums of int8 x int8 products stay exact up to this many terms (gemv.c)


def pack_w8a8(weight: torch.Tensor) -> torch.Tensor:
    """W8A8's int8 weight (N, K) in the loaded library's packed layout for linear_w8a8: panels of P
    output channels (P = 16 for AVX2, 32 for AVX-512), each pair of inputs' weights side by side,
    zeros past N and K: shape (ceil(N / P), ceil(K / 2), P, 2), int8. A pure rearrangement: the same
    bytes (N x K of them) plus the padding."""
    if loader._gemm_w8a8 is None:
        _lib_or_raise("pack_w8a8")
    if weight.dtype is not _i8 or weight.dim() != 2:
        raise _bad("pack_w8a8", "weight must be an int8 (N, K) tensor")
    N, K = weight.shape
    P = loader._w8a8_panel
    padded = torch.nn.functional.pad(weight.cpu(), (0, K % 2, 0, -N % P))
    return padded.view(-(-N // P), P, (K + 1) // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear_w8a8(qu: torch.Tensor, row_scale: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, dtype: torch.dtype = _bf16) -> torch.Tensor:
    """W8A8's linear: (int32 sums of q x weight, exact) * weight_scale * row_scale, then `dtype`
    (bfloat16: rounded, then + bias rounded again; float32: + bias), W8A8Linear's numbers, at any rows.

    qu (M, K) uint8, q + 128 (quantize_rows_u8's form); row_scale (M, 1) float32; packed: the int8
    weight (N, K) as pack_w8a8 lays it out; weight_scale (N,) float32 (N is its length); bias (N,)
    bfloat16 or None. Returns (M, N) of `dtype`. int16 pairs of products (vpmaddwd on AVX2, vpdpwssd
    on AVX-512), 6 rows x one panel a tile; torch.get_num_threads() threads."""
    if loader._gemm_w8a8 is None:
        _lib_or_raise("linear_w8a8")
    if qu.dtype is not torch.uint8 or qu.dim() != 2 or not qu.is_contiguous() or not qu.is_cpu:
        raise _bad("linear_w8a8", "qu must be a contiguous uint8 (M, K) CPU tensor")
    M, K = qu.shape
    if K > W8A8_MAX_K:
        raise _bad("linear_w8a8", f"K = {K} is above {W8A8_MAX_K}: its int32 sums could overflow")
    if weight_scale.dtype is not torch.float32 or weight_scale.dim() != 1 or not weight_scale.is_contiguous():
        raise _bad("linear_w8a8", "weight_scale must be a contiguous float32 (N,) tensor")
    N, P = weight_scale.numel(), loader._w8a8_panel
    shape = (-(-N // P), (K + 1) // 2, P, 2)
    if packed.dtype is not _i8 or tuple(packed.shape) != shape or not packed.is_contiguous():
        raise _bad("linear_w8a8", f"packed must be pack_w8a8's int8 {shape} tensor for {N} outputs of {K} "
                                  f"inputs, got {packed.dtype} {tuple(packed.shape)}")
    if row_scale.dtype is not torch.float32 or row_scale.numel() != M or not row_scale.is_contiguous():
        raise _bad("linear_w8a8", f"row_scale must be a contiguous float32 tensor of {M} values")
    if bias is not None:
        _check_vec(bias, N, "bias", "linear_w8a8")
    if dtype not in (_bf16, torch.float32):
        raise _bad("linear_w8a8", f"dtype must be bfloat16 or float32, got {dtype}")
    y = torch.empty((M, N), dtype=dtype)
    if M and N and loader._gemm_w8a8(qu.data_ptr(), row_scale.data_ptr(), packed.data_ptr(), weight_scale.data_ptr(),
                                     None if bias is None else bias.data_ptr(), y.data_ptr(),
                                     int(dtype == torch.float32), M, N, K, torch.get_num_threads()):
        raise MemoryError("linear_w8a8: no memory for q's int16 copy")
    return y


# --- int4 weights in torch's CPU layout ---------------------------------------------------------------

INT4_MAX_BLOCK = 128  # the layout's rows a block, at most (int4_dequant_t's buffer)
INT4_GEMM_BLOCKS = (32, 64)  # the blocks linear_int4 takes: a 32-channel panel is a block or half of one


def _check_int4(name: str, packed: torch.Tensor, K: int, layout: tuple[int, bool], scale: torch.Tensor,
                zero: torch.Tensor, group: int) -> int:
    """int4_dequant_t's and linear_int4's weight arguments checked; returns the rows n."""
    block = layout[0]
    n = packed.shape[0] if packed.dim() == 2 else 0
    if (packed.dtype is not torch.uint8 or packed.dim() != 2 or packed.shape[1] * 2 != K or not packed.is_contiguous()
            or not packed.is_cpu):
        raise _bad(name, f"packed must be a contiguous uint8 CPU (n, {K // 2}) tensor")
    if block % 16 or block > INT4_MAX_BLOCK or n % block:  # 16: a vector's lanes on every ISA (8 or 16)
        raise _bad(name, f"{n} rows are not whole blocks of {block} (a multiple of 16, at most {INT4_MAX_BLOCK})")
    if group < 1 or K % group:
        raise _bad(name, f"group {group} does not divide K = {K}")
    for t, what in ((scale, "scale"), (zero, "zero")):
        if t.dtype is not _bf16 or t.shape != (n, K // group) or not t.is_contiguous() or not t.is_cpu:
            raise _bad(name, f"{what} must be a contiguous bfloat16 CPU ({n}, {K // group}) tensor")
    return n


def int4_dequant_t(packed: torch.Tensor, K: int, layout: tuple[int, bool], scale: torch.Tensor,
                   zero: torch.Tensor, group: int, out: torch.Tensor) -> torch.Tensor:
    """Whole blocks of an int4 weight in torch's CPU layout (`layout` = gptj.quant.ops.cpu_int4_layout(),
    packed: (n, K/2) uint8 rows of it, n a multiple of the block) dequantized and transposed into
    `out` (K, n) bfloat16 (rows may be strided): out[k, r] = bfloat16(q[r, k] * s + zp), s = scale[r, g],
    zp = bfloat16(zero[r, g] - 8 s), g = k // group; scale, zero (n, K / group) bfloat16:
    Int4Linear._dequant_rows' values, transposed. Returns out."""
    if loader._int4_dequant is None:
        _lib_or_raise("int4_dequant_t", "elementwise")
    n = _check_int4("int4_dequant_t", packed, K, layout, scale, zero, group)
    block, split = layout
    if out.dtype is not _bf16 or out.shape != (K, n) or out.stride(1) != 1 or not out.is_cpu:
        raise _bad("int4_dequant_t", f"out must be a bfloat16 CPU ({K}, {n}) tensor with contiguous rows")
    if n and K and loader._int4_dequant(packed.data_ptr(), K, n // block, block, int(split), scale.data_ptr(),
                                        zero.data_ptr(), group, out.data_ptr(), out.stride(0), torch.get_num_threads()):
        raise MemoryError("int4_dequant_t: no memory for the scales' buffers")
    return out


def int4_gemm_available(layout: tuple[int, bool] | None = None) -> bool:
    """Whether linear_int4 runs here: a library is loaded (each has an int4 GEMV; AVX512-BF16's a GEMM
    too) and, when given, `layout`'s block is one it takes (INT4_GEMM_BLOCKS)."""
    load()
    return loader._gemm_int4 is not None and (layout is None or layout[0] in INT4_GEMM_BLOCKS)


def linear_int4(x: torch.Tensor, packed: torch.Tensor, K: int, layout: tuple[int, bool], scale: torch.Tensor,
                zero: torch.Tensor, group: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) bfloat16 times the transpose of the int4 weight (int4_dequant_t's arguments: whole blocks
    of torch's CPU layout, blocks of INT4_GEMM_BLOCKS rows): (M, n) bfloat16, float32 sums rounded once;
    no bias. Into `out` ((M, n) bfloat16, rows may be strided: columns of a wider output) when given.
    The loaded library's int4 GEMV (gemv.c: the integers in float32 sums, each group's sums scaled once;
    on AVX512-BF16's library in bfloat16 dot products) multiplies the weights (q - 8) s + zero exactly, as
    torch's int4 kernel does: on AVX512-BF16's library below int4_gemm_min_rows() rows (32), on the others
    at every row count. From there AVX512-BF16's GEMM (each weight dequantized once per call into panels,
    a register tile) multiplies int4_dequant_t's bfloat16 roundings of them. Returns out."""
    if not int4_gemm_available():
        _lib_or_raise("linear_int4")
    n = _check_int4("linear_int4", packed, K, layout, scale, zero, group)
    block, split = layout
    if block not in INT4_GEMM_BLOCKS:
        raise _bad("linear_int4", f"blocks of {block} rows (it takes {' or '.join(map(str, INT4_GEMM_BLOCKS))})")
    if group % 16:
        raise _bad("linear_int4", f"groups of {group} inputs (it takes multiples of 16)")
    if x.dtype is not _bf16 or x.dim() != 2 or x.shape[1] != K or not x.is_contiguous() or not x.is_cpu:
        raise _bad("linear_int4", f"x must be a contiguous bfloat16 CPU (M, {K}) tensor")
    M = x.shape[0]
    if out is None:
        out = torch.empty((M, n), dtype=_bf16)
    if out.dtype is not _bf16 or out.shape != (M, n) or out.stride(1) != 1 or not out.is_cpu:
        raise _bad("linear_int4", f"out must be a bfloat16 CPU ({M}, {n}) tensor with contiguous rows")
    if M and n and loader._gemm_int4(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), zero.data_ptr(), out.data_ptr(),
                                     M, n, K, block, int(split), group, out.stride(0), torch.get_num_threads()):
        raise MemoryError("linear_int4: no memory for the kernel's copy of x")
    return out


W4A8_PANEL = 16  # the outputs of one of W4A8's panels (w4a8.c): a layer's outputs must come in these
W4A8_BLOCK = 32  # the inputs x is rounded over at once, and what the group must be a multiple of


def w4a8_available() -> bool:
    """Whether linear_w4a8 runs here (every library has the W4A8 GEMM)."""
    load()
    return loader._gemm_w4a8 is not None


def linear_w4a8(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group: int, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) float32, rounded to int8 per block of 32 inputs, times the transpose of the int4 weight in
    W4A8's layout (gptj.quant.ops.pack_w4a8: packed (N, K / 2) uint8, sz (N / 16, K / group, 2, 16) its
    scales and zeros): (M, N) float32, on exact int32 sums per block (w4a8.c says the arithmetic); no bias.
    Into `out` ((M, N) float32, rows may be strided) when given. Returns out."""
    if not w4a8_available():
        _lib_or_raise("linear_w4a8")
    if packed.dtype is not torch.uint8 or packed.dim() != 2 or not packed.is_contiguous() or not packed.is_cpu:
        raise _bad("linear_w4a8", "the packed weight must be a contiguous uint8 CPU (N, K / 2) tensor")
    N, K = packed.shape[0], 2 * packed.shape[1]
    P = W4A8_PANEL
    if N % P or group <= 0 or group % W4A8_BLOCK or K % group:
        raise _bad("linear_w4a8", f"{N} outputs in groups of {group} of {K} inputs (it takes outputs in {P}s, groups "
                                  f"of a multiple of {W4A8_BLOCK} inputs)")
    G = K // group
    if sz.dtype is not _bf16 or tuple(sz.shape) != (N // P, G, 2, P) or not sz.is_contiguous() or not sz.is_cpu:
        raise _bad("linear_w4a8", f"the scales must be a contiguous bfloat16 CPU ({N // P}, {G}, 2, {P}) tensor")
    if x.dtype is not torch.float32 or x.dim() != 2 or x.shape[1] != K or not x.is_contiguous() or not x.is_cpu:
        raise _bad("linear_w4a8", f"x must be a contiguous float32 CPU (M, {K}) tensor")
    M = x.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=torch.float32)
    if out.dtype is not torch.float32 or out.shape != (M, N) or out.stride(1) != 1 or not out.is_cpu:
        raise _bad("linear_w4a8", f"out must be a float32 CPU ({M}, {N}) tensor with contiguous rows")
    if M and N and loader._gemm_w4a8(x.data_ptr(), packed.data_ptr(), sz.data_ptr(), out.data_ptr(), M, N, K, group,
                                     out.stride(0), torch.get_num_threads()):
        raise MemoryError("linear_w4a8: no memory for the kernel's rounded x")
    return out


# --- paged attention ----------------------------------------------------------------------------------

def attention_group(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, tk: torch.Tensor | None = None,
                    tv: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of N queries over a shared prompt and a tail each, float32 scores and softmax.

    q (N, H, D); pk, pv (H, P, D) bfloat16 views (same strides, last dim contiguous); tk, tv
    (N, H, T, D) bfloat16 views likewise, or None. Returns (N, H, D) float32:
    softmax(q . [pk | tk[n]] / sqrt(D)) @ [pv | tv[n]]. The prompt's keys and values are read once
    per 8 queries; heads are split across torch.get_num_threads() threads.
    """
    if loader._attend_group is None:
        _lib_or_raise("attention_group", "attention")
    N, H, D = q.shape
    if D % 16 or pk.dtype is not _bf16 or pv.dtype is not _bf16 or pk.shape != (H, pk.shape[1], D):
        raise _bad("attention_group", "needs bfloat16 keys/values (H, P, D) with D a multiple of 16")
    if pk.stride() != pv.stride() or pk.stride(-1) != 1 or not (pk.is_cpu and pv.is_cpu):
        raise _bad("attention_group", "prompt keys and values must be CPU views with equal strides, d contiguous")
    P = pk.shape[1]
    if tk is None:
        tk, tv, T, ts = pk, pv, 0, (0, 0, 0)
    else:
        if tk.shape[:2] != (N, H) or tk.shape[3] != D or tk.dtype is not _bf16 or tv.dtype is not _bf16:
            raise _bad("attention_group", f"tails must be bfloat16 ({N}, {H}, T, {D})")
        if tk.stride() != tv.stride() or tk.stride(-1) != 1 or not (tk.is_cpu and tv.is_cpu):
            raise _bad("attention_group", "tail keys and values must be CPU views with equal strides, d contiguous")
        T, ts = tk.shape[2], tk.stride()[:3]
    if P + T < 1:
        raise _bad("attention_group", "nothing to attend over")
    qf = q.to(torch.float32).contiguous()
    out = torch.empty((N, H, D), dtype=torch.float32)
    rc = loader._attend_group(qf.data_ptr(), N, H, D, pk.data_ptr(), pv.data_ptr(), pk.stride(0), pk.stride(1), P,
                              tk.data_ptr(), tv.data_ptr(), ts[0], ts[1], ts[2], T, out.data_ptr(),
                              1.0 / float(D) ** 0.5, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"attention_group: native kernel failed ({rc})")
    return out


def _pages(name: str, kc: torch.Tensor, vc: torch.Tensor, k_scale: torch.Tensor | None,
           v_scale: torch.Tensor | None) -> tuple[int, int, int, int, int, int]:
    """Validated paged KV blocks: kc, vc (n_blocks, H, B, D) contiguous on CPU, bfloat16 without
    scales or int8 with k_scale, v_scale (n_blocks, H, B) float32. Returns (n_blocks, H, B, D, and
    the scales' pointers or 0 for bfloat16)."""
    shape = kc.shape
    if len(shape) != 4 or vc.shape != shape or not (kc.is_contiguous() and vc.is_contiguous() and kc.is_cpu
                                                    and vc.is_cpu):
        raise _bad(name, "key and value blocks must be contiguous CPU tensors of one shape (n_blocks, H, B, D)")
    n_blocks, H, B, D = shape
    if D % 16 or D > 512:
        raise _bad(name, f"head_dim must be a multiple of 16 up to 512, got {D}")
    if kc.dtype is _bf16 and vc.dtype is _bf16 and k_scale is None and v_scale is None:
        return n_blocks, H, B, D, 0, 0
    if kc.dtype is _i8 and vc.dtype is _i8 and k_scale is not None and v_scale is not None:
        for t in (k_scale, v_scale):
            if t.dtype is not torch.float32 or t.shape != shape[:3] or not t.is_contiguous() or not t.is_cpu:
                raise _bad(name, f"int8 blocks need contiguous float32 scales of shape {tuple(shape[:3])}")
        return n_blocks, H, B, D, k_scale.data_ptr(), v_scale.data_ptr()
    raise _bad(name, "blocks must be bfloat16 (no scales) or int8 with k_scale and v_scale")


def attention_paged(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, row0: torch.Tensor, stab: torch.Tensor,
                    soff: torch.Tensor, slen: torch.Tensor, otab: torch.Tensor, olen: torch.Tensor,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    stair: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of a whole batch over paged keys/values, float32 scores and softmax.

    q (N, H, D); kc, vc (n_blocks, KH, B, D) contiguous: bfloat16, or int8 whose values are
    q * k_scale, v_scale (n_blocks, KH, B) float32; KH dividing H (grouped-query attention: query
    head h reads KV head h // (H // KH), a KV head's rows read once for its query heads). int32 CPU tensors, contiguous:
    row0 (G + 1,) the first query row of each group (row0[G] = N); stab the groups' shared block
    tables one after another, group g's from soff[g], holding slen[g] tokens; otab (N, omax) each
    row's own blocks, holding olen[g] tokens for the rows of group g (stair (G,) int32: olen[g] + i * stair[g]
    for its i-th row, a speculative draft's rows one token apart; None: all alike). Returns (N, H, D) float32.
    Block ids and lengths are the caller's to keep in range: the kernel reads what they point at.
    """
    if loader._attend_paged is None:
        _lib_or_raise("attention_paged", "attention")
    N, H, D = q.shape
    _, h, B, d, ks, vs = _pages("attention_paged", kc, vc, k_scale, v_scale)
    if d != D or H % h:
        raise _bad("attention_paged", f"blocks of {h} heads of {d} do not match queries of {H} heads of {D}")
    ints = (row0, stab, soff, slen, otab, olen) + (() if stair is None else (stair,))
    if any(t.dtype is not torch.int32 or not t.is_contiguous() for t in ints):
        raise _bad("attention_paged", "tables and lengths must be contiguous int32 tensors")
    G = slen.shape[0]
    if (row0.shape != (G + 1,) or soff.shape != (G,) or olen.shape != (G,) or otab.dim() != 2 or otab.shape[0] != N
            or (stair is not None and stair.shape != (G,))):
        raise _bad("attention_paged", f"tables do not match {G} groups of {N} rows")
    qf = q.to(torch.float32).contiguous()
    out = torch.empty((N, H, D), dtype=torch.float32)
    rc = loader._attend_paged(qf.data_ptr(), N, H, h, D, kc.data_ptr(), vc.data_ptr(), ks, vs, B, G, row0.data_ptr(),
                              stab.data_ptr(), soff.data_ptr(), slen.data_ptr(), otab.data_ptr(), otab.shape[1],
                              olen.data_ptr(), None if stair is None else stair.data_ptr(), out.data_ptr(),
                              1.0 / float(D) ** 0.5, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"attention_paged: native kernel failed ({rc})")
    return out


def prefill_paged(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, start: int,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a prompt chunk over paged keys/values already stored (the chunk's too).

    q (T, H, D) bfloat16 on CPU, the queries of positions start .. start + T - 1, each head's D
    values contiguous (any stride between tokens: a view into the fused q|k|v projection serves);
    kc, vc (n_blocks, KH, B, D), B even, KH dividing H (query head h reads KV head h // (H // KH)):
    bfloat16, or int8 with scales (as attention_paged's); table:
    the sequence's blocks, int32, at least ceil((start + T) / B) of them. Returns (T, H, D)
    bfloat16: float32 scores (exact bfloat16 products) and softmax; the probabilities rounded to
    bfloat16 (as HF rounds them to the values' dtype) and summed against the values in float32,
    rounded once. Block ids are the caller's to keep in range.
    """
    if loader._prefill_paged is None:
        _lib_or_raise("prefill_paged", "attention")
    T, H, D = q.shape
    _, h, B, d, ks, vs = _pages("prefill_paged", kc, vc, k_scale, v_scale)
    if q.dtype is not _bf16 or not q.is_cpu or d != D or H % h:
        raise _bad("prefill_paged", f"queries must be bfloat16 on CPU, heads of the blocks' {d} values, a multiple "
                   f"of their {h} heads")
    if B % 2:
        raise _bad("prefill_paged", f"blocks must hold an even number of tokens, got {B}")
    if table.dtype is not torch.int32 or not table.is_contiguous() or table.numel() * B < start + T:
        raise _bad("prefill_paged", f"the block table must be contiguous int32 covering {start + T} positions")
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    out = torch.empty((T, H, D), dtype=_bf16)
    rc = loader._prefill_paged(q.data_ptr(), q.stride(0), T, H, h, D, kc.data_ptr(), vc.data_ptr(), ks, vs, B,
                               table.data_ptr(), int(start), out.data_ptr(), H * D, 1.0 / float(D) ** 0.5,
                               torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"prefill_paged: native kernel failed ({rc})")
    return out


# --- a fused block's elementwise steps ----------------------------------------------------------------

def _rows(x: torch.Tensor, name: str, what: str, write: bool = False) -> torch.Tensor:
    """x (..., N) bfloat16 on CPU as a (M, N) view with contiguous rows: a copy if no such view
    exists, an error if x is written to (`write`) and none exists."""
    if not isinstance(x, torch.Tensor) or x.dtype is not _bf16 or not x.is_cpu:
        raise _bad(name, f"{what} must be a bfloat16 CPU tensor")
    try:
        x2 = x.view(-1, x.shape[-1])
        if x2.stride(-1) == 1:
            return x2
    except RuntimeError:
        pass
    if write:
        raise _bad(name, f"{what} must be viewable as rows of contiguous values")
    return x.reshape(-1, x.shape[-1]).contiguous()


def gelu(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """GELU's tanh form of bfloat16 x (..., N), float32 inside and rounded once: x / (1 + e^(-2u)),
    u = sqrt(2 / pi) (x + 0.044715 x^3) — 0.5 x (1 + tanh u) without its cancellation below 0.
    x's rows may be strided (a view into a wider matrix); so may `out` (same shape, x itself or
    not overlapping it), which receives the result. Returns out."""
    if loader._gelu is None:
        _lib_or_raise("gelu", "elementwise")
    x2 = _rows(x, "gelu", "x")
    if out is None:
        out = torch.empty(x.shape, dtype=_bf16)
    if out.shape != x.shape:
        raise _bad("gelu", f"out must have shape {tuple(x.shape)}, got {tuple(out.shape)}")
    y2 = _rows(out, "gelu", "out", write=True)
    M, N = x2.shape
    if M and N:
        loader._gelu(x2.data_ptr(), x2.stride(0), y2.data_ptr(), y2.stride(0), M, N, torch.get_num_threads())
    return out


def rotary_(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """GPT-J's rotary embedding in place on the first R dims of each head: x (M, heads, D) bfloat16
    whose heads lie one after another (a token's q and k heads side by side serve), any stride
    between tokens; sin, cos (M, R) bfloat16 (gptj.models.gptj.rotary_tables', each angle repeated for
    its pair), R a multiple of 16. float32 inside, rounded once. Returns x."""
    if loader._rotary is None:
        _lib_or_raise("rotary_", "elementwise")
    M, nh, D = x.shape
    R = sin.shape[-1]
    if x.dtype is not _bf16 or not x.is_cpu or x.stride(2) != 1 or x.stride(1) != D:
        raise _bad("rotary_", "x must be a bfloat16 CPU (tokens, heads, D) view with each token's heads contiguous")
    if R % 16 or R > D or sin.shape != (M, R) or cos.shape != (M, R):
        raise _bad("rotary_", f"sin and cos must be ({M}, R) with R a multiple of 16 up to {D}")
    sin, cos = sin.contiguous(), cos.contiguous()
    if sin.dtype is not _bf16 or cos.dtype is not _bf16:
        raise _bad("rotary_", "sin and cos must be bfloat16")
    if M:
        loader._rotary(x.data_ptr(), x.stride(0), M, nh, D, R, sin.data_ptr(), cos.data_ptr(), torch.get_num_threads())
    return x


def store_kv(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, blocks: torch.Tensor,
             offsets: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """kc[blocks[n], :, offsets[n]] = k[n] and vc likewise, for N tokens: k, v (N, H, D) bfloat16 views
    with each token's heads contiguous (any stride between tokens); kc, vc (n_blocks, H, B, D)
    contiguous, bfloat16, or int8 with scales (as attention_paged's): then each head vector is
    rounded as gptj.quant.ops.quantize_rows_int8 rounds a row, its scale stored at the same place of
    k_scale / v_scale. blocks, offsets (N,) int64. Ids and offsets are the caller's to keep in range."""
    if loader._store_kv is None:
        _lib_or_raise("store_kv", "elementwise")
    N, H, D = k.shape
    for t in (k, v):
        if t.shape != (N, H, D) or t.dtype is not _bf16 or not t.is_cpu or t.stride(2) != 1 or t.stride(1) != D:
            raise _bad("store_kv", "k and v must be bfloat16 CPU (N, H, D) views with each token's heads contiguous")
    _, h, B, d, ks, vs = _pages("store_kv", kc, vc, k_scale, v_scale)
    if (h, d) != (H, D):
        raise _bad("store_kv", f"blocks of {h} heads of {d} do not match keys of {H} heads of {D}")
    for t in (blocks, offsets):
        if t.dtype is not torch.int64 or t.shape != (N,) or not t.is_contiguous():
            raise _bad("store_kv", f"blocks and offsets must be contiguous int64 ({N},)")
    if N:
        loader._store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), N, H, D, kc.data_ptr(), vc.data_ptr(),
                         ks, vs, B, blocks.data_ptr(), offsets.data_ptr(), torch.get_num_threads())


# --- the sampler's greedy token -----------------------------------------------------------------------

def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value, as torch.max(x, dim=-1).indices (ties to the first,
    a NaN the largest): x (M, N) float32 on CPU whose rows are contiguous, any stride between them.
    int64 (M,). torch's CPU kernel tracks the index at every element; this finds the maximum's first
    block of 256 in one vector pass, then its index there, about as fast as torch's maximum alone
    (figures: docs/PERFORMANCE.md#serving-vs-vllm)."""
    if loader._argmax_rows is None:
        _lib_or_raise("argmax_rows", "elementwise")
    if (not isinstance(x, torch.Tensor) or x.dtype is not torch.float32 or not x.is_cpu or x.dim() != 2
            or x.shape[1] < 1 or x.stride(1) != 1):
        raise _bad("argmax_rows", "x must be a float32 CPU (M, N) tensor, N >= 1, of contiguous rows")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        loader._argmax_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


# --- W8A8 linears: the activations' rounding before oneDNN's int8 GEMM, and its sums after ------------

def quantize_rows_u8(x: torch.Tensor, inv_smooth: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) bfloat16 (rows may be strided) times inv_smooth (K,) float32, rounded per row as
    gptj.quant.ops.quantize_rows_int8 rounds it (the same q and scale), in one pass per row.
    Returns (q + 128 as uint8 (M, K), scale float32 (M, 1)): oneDNN's u8 form, zero point 128."""
    if loader._quantize_rows is None:
        _lib_or_raise("quantize_rows_u8", "elementwise")
    if isinstance(x, torch.Tensor) and x.dim() != 2:
        raise _bad("quantize_rows_u8", f"x must be (M, K), got {tuple(x.shape)}")
    x2 = _rows(x, "quantize_rows_u8", "x")
    M, K = x2.shape
    if inv_smooth is not None and (inv_smooth.dtype is not torch.float32 or inv_smooth.shape != (K,)
                                   or not inv_smooth.is_contiguous() or not inv_smooth.is_cpu):
        raise _bad("quantize_rows_u8", f"inv_smooth must be a contiguous float32 CPU tensor of shape ({K},)")
    qu = torch.empty((M, K), dtype=torch.uint8)
    scale = torch.empty((M, 1), dtype=torch.float32)
    if M and K:
        loader._quantize_rows(x2.data_ptr(), x2.stride(0), None if inv_smooth is None else inv_smooth.data_ptr(),
                              qu.data_ptr(), scale.data_ptr(), M, K, torch.get_num_threads())
    return qu, scale


def scale_rows(acc: torch.Tensor, row_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """bfloat16(acc * row_scale) + bias, each step rounded to bfloat16 (W8A8Linear's order): acc (M, N)
    float32 with contiguous rows, row_scale (M, 1) float32, bias (N,) bfloat16 or None. Into `out`
    ((M, N) bfloat16, rows may be strided) when given. Returns out."""
    if loader._scale_rows is None:
        _lib_or_raise("scale_rows", "elementwise")
    if acc.dtype is not torch.float32 or acc.dim() != 2 or acc.stride(-1) != 1 or not acc.is_cpu:
        raise _bad("scale_rows", "acc must be a float32 CPU (M, N) tensor with contiguous rows")
    M, N = acc.shape
    if row_scale.dtype is not torch.float32 or row_scale.numel() != M or not row_scale.is_contiguous():
        raise _bad("scale_rows", f"row_scale must be a contiguous float32 tensor of {M} values")
    if bias is not None:
        _check_vec(bias, N, "bias", "scale_rows")
    if out is None:
        out = torch.empty((M, N), dtype=_bf16)
    if out.shape != (M, N):
        raise _bad("scale_rows", f"out must have shape {(M, N)}, got {tuple(out.shape)}")
    y2 = _rows(out, "scale_rows", "out", write=True)
    if M and N:
        loader._scale_rows(acc.data_ptr(), acc.stride(0), row_scale.data_ptr(),
                           None if bias is None else bias.data_ptr(), y2.data_ptr(), y2.stride(0), M, N,
                           torch.get_num_threads())
    return out
