"""W4A8Linear: int4's weights (4 bits, a scale and a zero per group of inputs) times activations rounded
to int8 per block of 32 inputs at each call, multiplied on the integers: llama.cpp's Q4_0 x Q8_0
arithmetic, on int4's groups and zero points.

    y = x' @ ((q - 8) * scale + zero).T + bias,   x' = d * round(x / d) per block of 32 inputs of a row,
                                                   d = max |x| / 127 (gptj.quant.ops.quantize_blocks_int8)

The checkpoint holds int4's tensors (gptj.quant.format); only the call differs: int4 multiplies x as
it is, W4A8 rounds it first. So a layer's sums are exact integers per block (VNNI's vpdpbusd, AVX2's
vpmaddubsw): per 32 weights about 4 vector operations on AVX2 (1.5 with VNNI) where int4's float32
GEMV needs 15, which is what a CPU without bfloat16 arithmetic is bound by at one row
(docs/PERFORMANCE.md#w4a8). x' differs from x by at most d / 2 per input: the rounding W8A8 also makes
per token, here per 32 inputs (no calibration).

Its kernels, by the policy's table (gptj.policy.LINEAR_TABLE, "w4a8"):
  NATIVE  gptj.native's W4A8 GEMM (w4a8.c, every ISA's library) on the weight in W4A8's panels (pack_w4a8)
  UPCAST  the same product in float32: x' and the dequantized weight (a chunk of rows at a time), F.linear
"""

from __future__ import annotations

import torch

from gptj import native
from gptj.errors import GptjError
from gptj.policy import NATIVE, UPCAST, Capabilities
from gptj.quant.base import Kernel, scales_as_values, with_bias
from gptj.quant.int4 import Int4Linear
from gptj.quant.ops import W4A8_BLOCK, W4A8_PANEL, pack_w4a8, round_blocks_int8, unpack_w4a8


class W4A8Linear(Int4Linear):
    """int4's buffers and checkpoint (Int4Linear's); in memory after `prepare()` on CPU, where the layer
    has outputs in 16s, `weight` holds W4A8's panels instead (same shape and dtype, the only copy;
    `layout` "w4a8") and `_sz` the scales and zeros in the panels' order."""

    mode = weight_kind = "w4a8"
    _sz: torch.Tensor | None = None

    def prepare(self) -> W4A8Linear:
        """Pack the weight into W4A8's panels on CPU (once; again after a move or a load)."""
        if self._prepared or self.weight.device.type == "meta":
            return self
        if self.group_size % W4A8_BLOCK:
            raise GptjError(f"w4a8 needs groups of a multiple of {W4A8_BLOCK} inputs, not {self.group_size}")
        scales_as_values(self, "weight_scale", "weight_zero")
        self._to_portable()
        self._sz = None
        if self.weight.device.type == "cpu" and self.out_features % W4A8_PANEL == 0:
            self.weight, self._sz = pack_w4a8(self.nibbles(), self.weight_scale, self.weight_zero)
            self.layout = "w4a8"
        self._prepared = True
        return super(Int4Linear, self).prepare()

    def nibbles(self) -> torch.Tensor:
        return unpack_w4a8(self.weight) if self.layout == "w4a8" else super().nibbles()

    def _nibbles_rows(self, a: int, b: int) -> torch.Tensor:  # a, b: whole panels (_row_chunks: 256 rows)
        return unpack_w4a8(self.weight[a:b]) if self.layout == "w4a8" else super()._nibbles_rows(a, b)

    def kernels(self, caps: Capabilities, dtype: torch.dtype) -> dict[str, Kernel]:
        return {NATIVE: W4A8Linear._native if self.layout == "w4a8" else W4A8Linear._upcast,
                UPCAST: W4A8Linear._upcast}

    def _native(self, x2: torch.Tensor) -> torch.Tensor:
        y = native.linear_w4a8(x2.float().contiguous(), self.weight, self._sz, self.group_size)
        return with_bias(self, y).to(x2.dtype)

    def _upcast(self, x2: torch.Tensor) -> torch.Tensor:
        """x rounded per block, times the dequantized weight in float32 (int4's matmul, a chunk of rows at a
        time)."""
        return with_bias(self, self._dequant_linear(round_blocks_int8(x2, torch.float32))).to(x2.dtype)
