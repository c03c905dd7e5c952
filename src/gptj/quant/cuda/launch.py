"""The calls of gptj.quant.cuda's weight-only linears: int8_linear (int8 or e4m3 weights) and int4_linear
check their tensors, take a launch plan (gptj.quant.cuda.plans: plan_for's by rows where none is
given), cut K into slices where N alone gives too few programs to fill the GPU (split-K), and launch
the plan's kernel (gptj.quant.cuda.mma, .fma), then split-K's second pass (gptj.quant.cuda.epilogue).
"""

from __future__ import annotations

import functools

import torch

from gptj.quant.cuda.bits import E4M3_UNSCALE
from gptj.quant.cuda.plans import (
    BLOCK_M,
    DEFAULT_SMS,
    HOPPER,
    MAX_SPLIT,
    MAX_STAGES,
    PROGRAMS_PER_SM,
    STAGE_BYTES,
    TILES,
    Tiles,
    plan_for,
)

try:
    import triton
except ImportError:  # the caller (gptj.policy) sends calls here only where Triton is installed
    triton = None

if triton is not None:
    from gptj.quant.cuda.epilogue import _finish_kernel
    from gptj.quant.cuda.fma import _int4_fma_kernel, _int8_fma_kernel
    from gptj.quant.cuda.mma import _int4_kernel, _int4_swapped_kernel, _int8_kernel, _int8_swapped_kernel

_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT8_WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)  # both exact in every x dtype
_GROUP_SIZES = (32, 64, 128, 256)


def available() -> bool:
    """Triton is importable (whether the device suits is the caller's to decide)."""
    return triton is not None


def int8_linear(x2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                *, split_k: int | None = None, tiles: Tiles | None = None) -> torch.Tensor:
    """(x2 @ q.T) * scale + bias -> (M, N) in x2's dtype, float32 sums; see gptj.quant.cuda's docstring.

    split_k: the number of K slices (None: tiles.split, else the plan's, from N, K and the device);
    tiles: the launch plan (None: plan_for's for the weight and M; others for tests and tuning)."""
    need_triton()
    M, K = check_x(x2)
    if q.dtype not in _INT8_WEIGHT_DTYPES or q.dim() != 2 or q.shape[1] != K or not q.is_contiguous():
        raise ValueError(f"int8_linear: the weight must be a contiguous int8 or e4m3 (N, {K}), "
                         f"got {q.dtype} {tuple(q.shape)}")
    N = q.shape[0]
    _check_param(scale, "scale", (N,))
    _check_bias(bias, N)
    _check_devices(x2, q, scale, bias)
    tiles = tiles or plan_for("int8" if q.dtype == torch.int8 else "e4m3", M, _capability(x2.device))
    bn, bk, rows = tiles.block_n, tiles.int8_block_k, tiles.rows
    k_blocks = triton.cdiv(K, bk)
    split, per_slice = _plan(N, k_blocks, x2.device, tiles.split if split_k is None else split_k, bn)
    out, dest = _outputs(x2, N, split)
    args = (x2, q, scale, scale if bias is None else bias, dest, M, N, K, x2.stride(0), per_slice * bk)
    sizes = dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, HAS_BIAS=bias is not None, num_warps=tiles.num_warps,
                 num_stages=tiles.num_stages or _stages(bn * bk * q.element_size() + rows * bk * x2.element_size()))
    bits = _bits(tiles, x2)
    int8 = q.dtype == torch.int8
    unscale = E4M3_UNSCALE if bits and not int8 else 1.0  # the e4m3 "bits" sums are 2^-56 times the others'
    grid = _grid(tiles, M, N, split)
    if tiles.kind == "mma":
        _int8_kernel[grid](*args, BLOCK_M=rows, IEEE=x2.dtype == torch.float32, BITS=bits, INT8=int8,
                           UNSCALE=unscale, **sizes)
    elif tiles.kind == "swapped":
        _int8_swapped_kernel[grid](*args, ROWS=rows, IEEE=x2.dtype == torch.float32, BITS=bits, INT8=int8,
                                   UNSCALE=unscale, **sizes)
    else:
        _int8_fma_kernel[grid](*args, ROWS=rows, INT8=int8, STAGES=sizes["num_stages"], **sizes)
    return _finish(dest, out, scale, bias, has_scale=True, tiles=tiles, unscale=unscale)


def int4_linear(x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None, *, split_k: int | None = None,
                tiles: Tiles | None = None) -> torch.Tensor:
    """x2 @ w.T + bias with w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g] from the portable
    packed layout -> (M, N) in x2's dtype, float32 sums; see gptj.quant.cuda's docstring.

    split_k: the number of K slices, in whole K steps (None: tiles.split, else the plan's); tiles:
    the launch plan (None: plan_for's; a K step: one group for the kind "mma", int8_block_k //
    group_size groups, at least one, for the others)."""
    need_triton()
    M, K = check_x(x2)
    if isinstance(group_size, bool) or group_size not in _GROUP_SIZES:
        raise ValueError(f"int4_linear: group size {group_size!r} is not one of {_GROUP_SIZES}")
    if K % group_size:
        raise ValueError(f"int4_linear: group size {group_size} does not divide the {K} inputs")
    if (packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] * 2 != K
            or not packed.is_contiguous()):
        raise ValueError(f"int4_linear: the packed weight must be a contiguous uint8 (N, {K // 2}), "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    N, groups = packed.shape[0], K // group_size
    _check_param(scale, "scale", (N, groups))
    _check_param(zero, "zero", (N, groups))
    _check_bias(bias, N)
    _check_devices(x2, packed, scale, zero, bias)
    tiles = tiles or plan_for("int4", M, _capability(x2.device))
    bn, rows = tiles.block_n, tiles.rows
    step = 1 if tiles.kind == "mma" else max(1, tiles.int8_block_k // group_size)  # groups a loop step
    split, per_slice = _plan(N, triton.cdiv(groups, step), x2.device, tiles.split if split_k is None else split_k, bn)
    out, dest = _outputs(x2, N, split)
    args = (x2, packed, scale, zero, scale if bias is None else bias, dest, M, N, K, x2.stride(0), groups,
            per_slice * step)
    sizes = dict(BLOCK_N=bn, GROUP=group_size, SPLIT=split, HAS_BIAS=bias is not None, num_warps=tiles.num_warps,
                 num_stages=tiles.num_stages or _stages(step * (bn * group_size // 2 + rows * group_size
                                                                * x2.element_size())))
    grid = _grid(tiles, M, N, split)
    if tiles.kind == "mma":
        _int4_kernel[grid](*args, BLOCK_M=rows, IEEE=x2.dtype == torch.float32, BITS=_bits(tiles, x2), **sizes)
    elif tiles.kind == "swapped":
        _int4_swapped_kernel[grid](*args, ROWS=rows, STEP=step, IEEE=x2.dtype == torch.float32,
                                   BITS=_bits(tiles, x2), **sizes)
    else:
        _int4_fma_kernel[grid](*args, ROWS=rows, STEP=step, STAGES=sizes["num_stages"], **sizes)
    return _finish(dest, out, scale, bias, has_scale=False, tiles=tiles)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return HOPPER
    return torch.cuda.get_device_capability(device)


def _plan(n: int, k_blocks: int, device: torch.device, split_k: int | None,
          block_n: int = TILES.block_n) -> tuple[int, int]:
    """(slices of K, K blocks per slice): the fewest slices (a power of two, at most MAX_SPLIT) that
    give PROGRAMS_PER_SM programs per SM from N alone (never from M: batch invariance), each slice
    at least one block; or split_k's. The slices are whole blocks, so none is empty."""
    if split_k is None:
        want = PROGRAMS_PER_SM * _sm_count(device)
        split = 1
        while split < MAX_SPLIT and triton.cdiv(n, block_n) * split < want:
            split *= 2
    elif isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"split_k must be a positive int, got {split_k!r}")
    else:
        split = split_k
    per_slice = triton.cdiv(k_blocks, min(split, k_blocks))
    return triton.cdiv(k_blocks, per_slice), per_slice


def _grid(tiles: Tiles, m: int, n: int, split: int) -> tuple[int, int, int]:
    """A call's programs: (n block, row tile, K slice) for the kind "mma"; the kinds "swapped" and "fma"
    put the row tiles on the fastest axis (row tile, n block, K slice)."""
    row_tiles, n_blocks = triton.cdiv(m, tiles.rows), triton.cdiv(n, tiles.block_n)
    return (n_blocks, row_tiles, split) if tiles.kind == "mma" else (row_tiles, n_blocks, split)


def _stages(step_bytes: int) -> int:
    """Pipeline stages for a K step's tiles of `step_bytes` (weight and x): 2 to MAX_STAGES, in STAGE_BYTES."""
    return max(2, min(MAX_STAGES, STAGE_BYTES // step_bytes))


def _outputs(x2: torch.Tensor, n: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the output, where the main kernel writes: the output, or float32 partials (split, M, N))."""
    out = torch.empty((x2.shape[0], n), dtype=x2.dtype, device=x2.device)
    if split == 1:
        return out, out
    return out, torch.empty((split, x2.shape[0], n), dtype=torch.float32, device=x2.device)


def _finish(dest: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
            has_scale: bool, tiles: Tiles = TILES, unscale: float = 1.0) -> torch.Tensor:
    if dest is out:
        return out
    split, M, N = dest.shape
    _finish_kernel[(triton.cdiv(N, tiles.block_n), triton.cdiv(M, BLOCK_M))](
        dest, scale, scale if bias is None else bias, out, M, N, BLOCK_M=BLOCK_M, BLOCK_N=tiles.block_n,
        SPLIT=split, HAS_SCALE=has_scale, HAS_BIAS=bias is not None, UNSCALE=unscale, num_warps=tiles.num_warps)
    return out


def _bits(tiles: Tiles, x2: torch.Tensor) -> bool:
    """Whether the kernel converts the weight by bits (Tiles.convert): "bits" plans with bfloat16 x;
    float16 / float32 x keep "cast" (the recipes make bfloat16)."""
    return tiles.convert == "bits" and x2.dtype == torch.bfloat16


def need_triton() -> None:
    """Refuse a call where Triton is not installed (a RuntimeError naming the package to install)."""
    if triton is None:
        raise RuntimeError("gptj.quant.cuda's kernels need Triton (pip install triton)")


def check_x(x2: torch.Tensor) -> tuple[int, int]:
    """(M, K) of a call's input x2: a 2-D float32, float16 or bfloat16 tensor with contiguous rows."""
    if x2.dtype not in _X_DTYPES or x2.dim() != 2 or x2.shape[0] < 1 or x2.shape[1] < 1 or x2.stride(1) != 1:
        raise ValueError(f"the input must be (M >= 1, K >= 1) float32, float16 or bfloat16 with contiguous rows, "
                         f"got {x2.dtype} {tuple(x2.shape)} strides {x2.stride()}")
    return x2.shape[0], x2.shape[1]


def _check_param(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    if t.dtype != torch.bfloat16 or tuple(t.shape) != shape or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous bfloat16 {shape}, got {t.dtype} {tuple(t.shape)}")


def _check_bias(bias: torch.Tensor | None, n: int) -> None:
    if bias is not None and (not bias.is_floating_point() or tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        raise ValueError(f"the bias must be a contiguous float ({n},), got {bias.dtype} {tuple(bias.shape)}")


def _check_devices(*tensors: torch.Tensor | None) -> None:
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"the tensors are on different devices: {sorted(map(str, devices))}")
