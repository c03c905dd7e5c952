"""Int8Linear: int8 weights per output channel, activations in the model's float dtype (weight-only,
gpt-fast style).

Its kernels, by the policy's table (gptj.policy.LINEAR_TABLE, "int8"):
  NATIVE / AMX  gptj.native's int8 GEMV (8-row tiles, AVX-512 or AVX2; its GEMM from 32 rows on
                AVX512-BF16) / its AMX GEMM, in bfloat16
  WEIGHT_ONLY   torch._weight_int8pack_mm in bfloat16 (activations of other dtypes are cast for the
                call: the kernel's float32 path is 10-30x slower). It faults on some weights that do
                not start on a 64-byte boundary (torch 2.13, CPU), as a checkpoint's weight viewed in its
                mapped file may not (gptj.weights.hf): such a weight is copied once, on its first call
  TRITON        gptj.quant.cuda's GEMV / GEMM plans (CUDA; each weight tile converted in registers)
  DEQUANTIZE    the weight dequantized to the activations' dtype a chunk at a time, F.linear
  UPCAST        the same in float32, rounded to the activations' dtype once
"""

from __future__ import annotations

import torch

from gptj import native
from gptj.policy import AMX, DEQUANTIZE, NATIVE, TRITON, UPCAST, WEIGHT_ONLY, Capabilities
from gptj.quant.base import (KERNEL_DTYPE, Kernel, QuantLinear, per_channel_buffers, per_channel_from_float,
                             scales_as_values, with_bias)
from gptj.quant.ops import chunked_linear, dequantize_int8, quantize_int8


WEIGHT_ALIGN = 64  # bytes: where torch._weight_int8pack_mm's weight must start


class Int8Linear(QuantLinear):
    """y = x @ (q * scale).T + bias, q int8 per output channel. Buffers as in the checkpoint."""

    mode = weight_kind = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        per_channel_buffers(self, in_features, out_features, bias, device, dtype)

    @classmethod
    def from_float(cls, linear: torch.nn.Linear) -> Int8Linear:
        return per_channel_from_float(cls, linear, quantize_int8)

    def prepare(self) -> Int8Linear:
        """Make the module ready for its device (int8 needs no packing: scales to bfloat16)."""
        scales_as_values(self, "weight_scale")
        return super().prepare()

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8(self.weight, self.weight_scale, dtype)

    def use_kernel(self, x: torch.Tensor) -> bool:
        """Whether a call on x runs a kernel (gptj.native's or torch's), not the dequantized matmul."""
        return self.path(x) not in (DEQUANTIZE, UPCAST)

    def kernels(self, caps: Capabilities, dtype: torch.dtype) -> dict[str, Kernel]:
        return {NATIVE: Int8Linear._native, AMX: Int8Linear._amx, WEIGHT_ONLY: Int8Linear._weight_only,
                TRITON: Int8Linear._triton, DEQUANTIZE: Int8Linear._dequantize, UPCAST: Int8Linear._upcast}

    def _native(self, x2: torch.Tensor) -> torch.Tensor:
        return self._cpu_kernel(native.linear_int8, x2)

    def _amx(self, x2: torch.Tensor) -> torch.Tensor:
        return self._cpu_kernel(native.linear_int8_amx, x2)

    def _cpu_kernel(self, kernel: Kernel, x2: torch.Tensor) -> torch.Tensor:
        if x2.dtype == KERNEL_DTYPE and self.bias is not None and self.bias.dtype == KERNEL_DTYPE:
            # bfloat16 in and out: the kernel adds the bias (one rounding, no extra pass)
            return kernel(x2, self.weight, self.weight_scale, self.bias)
        y = kernel(x2.to(KERNEL_DTYPE), self.weight, self.weight_scale).to(x2.dtype)
        return with_bias(self, y).to(x2.dtype)

    def _weight_only(self, x2: torch.Tensor) -> torch.Tensor:
        if self.weight.data_ptr() % WEIGHT_ALIGN:  # (see the module's docstring); a plain tensor, even in inference mode
            with torch.inference_mode(False):
                self.weight = self.weight.clone()  # torch's allocator aligns to 64 bytes
        y = torch._weight_int8pack_mm(x2.to(KERNEL_DTYPE).contiguous(), self.weight, self.weight_scale)
        return with_bias(self, y.to(x2.dtype)).to(x2.dtype)

    def _triton(self, x2: torch.Tensor) -> torch.Tensor:
        from gptj.quant import cuda

        return cuda.int8_linear(x2.contiguous(), self.weight, self.weight_scale, self.bias)

    def _dequantize(self, x2: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        y = chunked_linear(x2, self.weight, dtype or x2.dtype, self.weight_scale)
        return with_bias(self, y).to(x2.dtype)

    def _upcast(self, x2: torch.Tensor) -> torch.Tensor:
        return self._dequantize(x2, torch.float32)
