"""A fused block's rotary on CUDA in one Triton kernel (policy.elementwise_path's TRITON): q and k
of every token rotated in place, float32 inside, rounded once to the activations' dtype, as
gptj.native's rotary_ does on CPU. torch's forms take six kernels a layer (a negation, a stack,
two products, a sum, the copy back); at batch 1 a decode step's ~1,000 small kernels cost more of
an H200's time than reading the weights does (docs/GPU.md).

Runs under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1), which is how it is tested
without a GPU (float16 there: the interpreter has no bfloat16 arithmetic).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # policy.elementwise_path chooses TRITON only where Triton is installed
    triton = None


if triton is not None:
    @triton.jit
    def _rotary_kernel(y_ptr, sin_ptr, cos_ptr, s_yt, s_st, HALF: tl.constexpr, BLOCK: tl.constexpr, D):
        """Program (token, head of q then k): pairs (x[2i], x[2i+1]) of the first 2 HALF dims become
        (x[2i] c - x[2i+1] s, x[2i+1] c + x[2i] s), c, s the token's cos and sin of pair i."""
        t = tl.program_id(0)
        head = tl.program_id(1)
        i = tl.arange(0, BLOCK)
        mask = i < HALF
        base = y_ptr + t.to(tl.int64) * s_yt + head * D
        even = tl.load(base + 2 * i, mask=mask, other=0.0).to(tl.float32)
        odd = tl.load(base + 2 * i + 1, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t.to(tl.int64) * s_st + 2 * i, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t.to(tl.int64) * s_st + 2 * i, mask=mask, other=0.0).to(tl.float32)
        ty = y_ptr.dtype.element_ty
        tl.store(base + 2 * i, (even * c - odd * s).to(ty), mask=mask)
        tl.store(base + 2 * i + 1, (odd * c + even * s).to(ty), mask=mask)


def rotary_qk_(y: torch.Tensor, n_head: int, head_dim: int, sin: torch.Tensor, cos: torch.Tensor) -> None:
    """Rotary on q and k in place: y (tokens, width), each token's row [q heads | k heads | ...] of
    n_head x head_dim each (the fused block's q|k|v|fc_in output); sin, cos (tokens, R) from
    gptj.models.gptj.rotary_tables (each angle twice, for its pair), R even and at most head_dim."""
    if triton is None:
        raise RuntimeError("the Triton rotary needs Triton (pip install triton)")
    T, W = y.shape
    R = sin.shape[-1]
    if y.stride(1) != 1 or W < 2 * n_head * head_dim or R % 2 or R > head_dim or sin.shape != (T, R) \
            or cos.shape != (T, R) or sin.stride() != cos.stride() or sin.stride(1) != 1:
        raise ValueError(f"rotary_qk_: y (tokens, >= 2 x {n_head} x {head_dim}) with contiguous rows, sin and cos "
                         f"(tokens, R <= {head_dim}, R even) alike; got {tuple(y.shape)}, {tuple(sin.shape)}")
    if T == 0 or R == 0:
        return
    _rotary_kernel[(T, 2 * n_head)](y, sin, cos, y.stride(0), sin.stride(0), HALF=R // 2,
                                    BLOCK=triton.next_power_of_2(R // 2), D=head_dim)
