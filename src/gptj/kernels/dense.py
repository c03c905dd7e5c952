"""PackedLinear: a bfloat16 nn.Linear repacked for serving on CPU, in one of two layouts chosen when it
is built (gptj.policy.pack_layout).

"onednn": the weight reordered for oneDNN's bfloat16 GEMM (fast at any number of rows). torch's
F.linear in bfloat16 on CPU reads a plain row-major weight; at the few rows of a decode step it
reaches about half the memory bandwidth of the same weight in oneDNN's blocked layout
(docs/PERFORMANCE.md#cpu-kernels).
"native": the plain weight, for gptj.native's GEMV at few rows (AVX-512: 1.4-1.8x oneDNN at 1-2 rows)
and F.linear above. Chosen when the engine never runs more rows than policy.NATIVE_LAYOUT_MAX_ROWS per
step (batch-1 latency); holding both layouts would double the weights' memory. On a CPU where oneDNN
has no bfloat16 (AVX2) it is the only layout: the GEMV up to 512 rows (2-3x F.linear bfloat16 at 2-8
rows), the weight upcast to float32 above (UPCAST). Its kernels by row count are the policy table's
"native-layout" routes, chosen once when it is built.

The packed weight serves (the engine, `decode.generate`) but is not saved, moved to another device or
cast; load the checkpoint again for that.
"""

from __future__ import annotations

import torch
from torch import nn

from gptj import native
from gptj.policy import NATIVE, ONEDNN, TORCH, UPCAST, Capabilities, linear_plan
from gptj.quant import chunked_linear
from gptj.quant.base import LinearMethod
from gptj.quant.ops import UPCAST_CHUNK_ELEMENTS


class PackedLinear(nn.Module):
    """nn.Linear's forward in bfloat16 on CPU, its weight in `layout` (ONEDNN or NATIVE)."""

    def __init__(self, linear: nn.Linear, layout: str = ONEDNN) -> None:
        super().__init__()
        if layout not in (ONEDNN, NATIVE):
            raise ValueError(f"unknown layout {layout!r}")
        self.in_features, self.out_features, self.layout = linear.in_features, linear.out_features, layout
        w = linear.weight.detach().contiguous()
        # Buffers (counted by memory and bandwidth reports) that state_dict() leaves out.
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(w, 1) if layout == ONEDNN else w,
                             persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().contiguous())
        plan = linear_plan(Capabilities.probe("cpu"), torch.bfloat16, f"{layout}-layout")
        self.method = LinearMethod(plan, {ONEDNN: PackedLinear._onednn, NATIVE: PackedLinear._native,
                                          UPCAST: PackedLinear._upcast, TORCH: PackedLinear._torch})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise RuntimeError(f"PackedLinear takes bfloat16 CPU input, got {x.dtype} on {x.device}")
        y = self.method.apply(self, x.reshape(-1, self.in_features))
        return y.view(*x.shape[:-1], self.out_features)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        return native.linear_bf16(x, self.packed, self.bias)

    def _upcast(self, x: torch.Tensor) -> torch.Tensor:
        """The weight made float32 a chunk at a time, F.linear in float32, rounded once."""
        return chunked_linear(x, self.packed, torch.float32, bias=self.bias, out_dtype=torch.bfloat16,
                              chunk_elements=UPCAST_CHUNK_ELEMENTS)

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.packed, self.bias)

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's signature
        raise RuntimeError("a PackedLinear cannot be moved or cast; load the checkpoint again instead")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bfloat16 {self.layout}"
