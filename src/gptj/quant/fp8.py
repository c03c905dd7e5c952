"""Fp8Linear: e4m3 (torch.float8_e4m3fn) weights per output channel, for GPUs with FP8 matrix units
(policy.fp8_supported).

Its kernels, by the policy's table (gptj.policy.LINEAR_TABLE, "fp8"):
  TRITON      (decode's few rows) weight-only: the e4m3 weight read once, x in its own dtype
  SCALED_MM   (more rows) FP8 x FP8: x rounded to e4m3 per token (scale max |x| / 448, at each
              call, no calibration), torch._scaled_mm's float32 sums of exact products, both scales after
  DEQUANTIZE  (a device without FP8 units: the commands refuse it there) the weight-only math
so a row's result depends on whether its call has more than policy.TRITON_MAX_ROWS rows.
"""

from __future__ import annotations

import torch

from gptj.policy import DEQUANTIZE, SCALED_MM, TRITON, Capabilities
from gptj.quant.base import (Kernel, QuantLinear, per_channel_buffers, per_channel_from_float, quantize_rows,
                             scales_as_values, with_bias)
from gptj.quant.ops import FP8_DTYPE, chunked_linear, dequantize_fp8, quantize_fp8


class Fp8Linear(QuantLinear):
    """y = x @ (q * scale).T + bias, q e4m3 per output channel. Buffers as in the checkpoint: weight
    e4m3 (out, in), weight_scale bf16 (out,), bias."""

    mode = weight_kind = "fp8"

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        per_channel_buffers(self, in_features, out_features, bias, device, dtype, weight_dtype=FP8_DTYPE)
        self.prepare()

    @classmethod
    def from_float(cls, linear: torch.nn.Linear) -> Fp8Linear:
        return per_channel_from_float(cls, linear, quantize_fp8)

    def prepare(self) -> Fp8Linear:
        """Scales as bfloat16 values, and as the float32 row (1, out) torch._scaled_mm takes."""
        scales_as_values(self, "weight_scale")
        self._scale_row = self.weight_scale.float()[None, :]
        self._one = torch.ones((), dtype=torch.float32, device=self.weight.device)  # _scaled_mm's unit scales
        self._triton = False
        return super().prepare()

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale, dtype)

    def kernels(self, caps: Capabilities, dtype: torch.dtype) -> dict[str, Kernel]:
        self._triton = caps.triton  # (the row rounding's kernel, for SCALED_MM)
        return {TRITON: Fp8Linear._triton_gemv, SCALED_MM: Fp8Linear._scaled, DEQUANTIZE: Fp8Linear._dequantize}

    def scaled_mm(self, x2: torch.Tensor) -> torch.Tensor:
        """SCALED_MM's product (rows, out) in x2's dtype, without the bias: bfloat16 rows take the
        scales in torch._scaled_mm's epilogue (row-wise scaling), other dtypes float32 sums, then the
        scales. Runs wherever torch._scaled_mm does (CUDA with FP8 units; torch's CPU form, slowly)."""
        qx, sx = quantize_rows(x2, "e4m3", None, self._triton)
        w = self.weight.t()  # column-major (in, out), as the GEMM wants its second operand
        if x2.dtype == torch.bfloat16:
            return torch._scaled_mm(qx, w, scale_a=sx, scale_b=self._scale_row, out_dtype=torch.bfloat16)
        acc = torch._scaled_mm(qx, w, scale_a=self._one, scale_b=self._one, out_dtype=torch.float32)
        return (acc * sx * self._scale_row).to(x2.dtype)

    def _triton_gemv(self, x2: torch.Tensor) -> torch.Tensor:
        from gptj.quant import cuda

        return cuda.int8_linear(x2.contiguous(), self.weight, self.weight_scale, self.bias)

    def _scaled(self, x2: torch.Tensor) -> torch.Tensor:
        return with_bias(self, self.scaled_mm(x2))

    def _dequantize(self, x2: torch.Tensor) -> torch.Tensor:
        return with_bias(self, chunked_linear(x2, self.weight, x2.dtype, self.weight_scale))
