"""W8A8: int8 weights per output channel and int8 activations per token (SmoothQuant style).

W8A8Linear is the layer as loaded: y = sx * sw * (qx @ qw.T) + bias, the activations quantized at
each call from x / input_smooth, the weight from W * input_smooth (gptj.quant.ops). Its kernels, by
the policy's table (gptj.policy.LINEAR_TABLE, "w8a8"): INT_MM (torch._int_mm, exact int32 sums: on
CPUs with VNNI, and on CUDA with rows padded to 17) or DEQUANTIZE (the same products in float32,
EXACT_F32_INT8_TERMS inputs at a time: exact too). PackedW8A8Linear is the layer repacked for serving
on a CPU's int8 GEMM, in the form policy.w8a8_form names. The integer sums are exact on every path,
so each row's output is the same whatever rows share the call.
"""

from __future__ import annotations

import torch
from torch import nn

from gptj import native
from gptj.policy import (AMX, DEQUANTIZE, EXACT_F32_INT8_TERMS, INT_MM, NATIVE, SHIFTED, SPLIT, W8A8_FORMS,
                         Capabilities, int_mm_min_rows, native_elementwise, w8a8_form)
from gptj.quant.base import Kernel, QuantLinear, per_channel_buffers, quantize_rows, scales_as_values, with_bias
from gptj.quant.ops import SCALE_DTYPE, dequantize_int8, int8_sums, quantize_int8, quantize_rows_int8


def int_mm(qx: torch.Tensor, weight: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
    """torch._int_mm(qx, weight.T): int32 sums (rows, out) of int8 qx (rows, in) and weight (out, in);
    qx padded with zero rows up to min_rows where it has fewer (policy.int_mm_min_rows: CUDA's takes
    17 or more), whose sums are dropped. The sums are exact, so each row's are the same padded or not."""
    rows = qx.shape[0]
    if rows < min_rows:
        qx = torch.cat([qx, qx.new_zeros(min_rows - rows, qx.shape[1])])
    return torch._int_mm(qx, weight.t())[:rows]


class W8A8Linear(QuantLinear):
    """y = sx * sw * (qx @ qw.T) + bias. Buffers as in the checkpoint: weight int8 (out, in),
    weight_scale bf16 (out,), input_smooth bf16 (in,), bias."""

    mode = weight_kind = "w8a8"

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        per_channel_buffers(self, in_features, out_features, bias, device, dtype)
        self.register_buffer("input_smooth", torch.ones(in_features, dtype=SCALE_DTYPE, device=device))
        self._triton, self._min_rows = False, 1

    @classmethod
    def from_float(cls, linear: nn.Linear, smooth: torch.Tensor | None = None) -> W8A8Linear:
        """smooth (in,): the calibrated smoothing factors (gptj.quant.calibrate); None: none (all 1)."""
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, device=linear.weight.device,
                dtype=linear.weight.dtype)
        if smooth is not None:
            m.input_smooth = smooth.to(device=linear.weight.device, dtype=SCALE_DTYPE)
        m.weight, m.weight_scale = quantize_int8(linear.weight.detach(), m.input_smooth)
        if linear.bias is not None:
            m.bias = linear.bias.detach().clone()
        return m.prepare()

    def prepare(self) -> W8A8Linear:
        """Scales and smoothing factors as bfloat16 values; the float32 divisor used at each call."""
        scales_as_values(self, "weight_scale", "input_smooth")
        self._inv_smooth = None if self.input_smooth.device.type == "meta" else 1 / self.input_smooth.float()
        return super().prepare()

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight it stands for: (q * scale) / smooth per input column."""
        return (dequantize_int8(self.weight, self.weight_scale) / self.input_smooth.float()[None, :]).to(dtype)

    def quantize_input(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(qx int8 (rows, in), sx float32 (rows, 1)) for the rows x2 (rows, in)."""
        return quantize_rows(x2, "int8", self._inv_smooth, self._triton)

    def kernels(self, caps: Capabilities, dtype: torch.dtype) -> dict[str, Kernel]:
        self._triton, self._min_rows = caps.triton, int_mm_min_rows(caps.device)
        return {INT_MM: W8A8Linear._int_mm, DEQUANTIZE: W8A8Linear._float_sums}

    def _int_mm(self, x2: torch.Tensor) -> torch.Tensor:
        qx, sx = self.quantize_input(x2)
        return self._scaled(int_mm(qx, self.weight, self._min_rows).float(), sx, x2.dtype)

    def _float_sums(self, x2: torch.Tensor) -> torch.Tensor:
        """The same products in float32, exact (where torch._int_mm's sums would not be, or it cannot run)."""
        qx, sx = self.quantize_input(x2)
        return self._scaled(int8_sums(qx, self.weight, EXACT_F32_INT8_TERMS), sx, x2.dtype)

    def _scaled(self, acc: torch.Tensor, sx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return with_bias(self, (acc * self.weight_scale.float() * sx).to(dtype))  # the order oneDNN's packed kernel takes


class PackedW8A8Linear(nn.Module):
    """A W8A8Linear's forward on a CPU's int8 GEMM, its weight packed once (policy.can_pack_int8).

    Each row x is quantized as W8A8Linear does (x / input_smooth, per-token int8 scale) and goes to the
    GEMM in the form policy.w8a8_form names for the CPU:

      AMX (CPUs with AMX)       gptj.native's AMX-INT8 GEMM (native.linear_w8a8_amx) on the plain
                                int8 weight: SHIFTED's float32 result, bit for bit, faster (docs/PERFORMANCE.md#policy-w8a8-amx)
      SHIFTED (CPUs with VNNI)  oneDNN's u8 x s8 GEMM on q + 128 with zero point 128; it returns
                                sum * weight_scale in float32
      NATIVE (CPUs without,     gptj.native's W8A8 GEMM (native.linear_w8a8) on its own packed panels:
      gptj.native loaded)       q widened to int16, pairs of products summed into int32 (vpmaddwd)
      SPLIT (CPUs without,      oneDNN's GEMM on p = max(q, 0) and n = max(-q, 0), stacked as twice the
      no gptj.native)           rows, zero point 0; sum = sum(p) - sum(n), each half's float32 exact
                                below 2**24

    The int32 sums are exact in every form; then x's scale and the bias follow, in W8A8Linear's order:
    the same numbers as the module it replaces (SPLIT: whenever each half's sum stays below 2**24,
    else within float32's rounding of it). Like PackedLinear it serves, and is not saved, moved or cast.
    The module keeps one packed copy of the weight: oneDNN's or gptj.native's.

    In bfloat16 where gptj.native is available (policy.native_elementwise), the rounding before the
    GEMM and the scaling after are one pass each (gptj.native.quantize_rows_u8, scale_rows), and a
    SHIFTED call runs CHUNK_ROWS rows at a time, so the GEMM's float32 sums are still in cache when they
    are scaled (gptj.native's GEMM scales its own sums). torch's ops take several passes over the whole
    call, which took several times the GEMM's own time at prefill sizes (docs/PERFORMANCE.md#cpu-kernels)."""

    CHUNK_ROWS = 256

    def __init__(self, m: W8A8Linear, form: str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = m.in_features, m.out_features
        self.form = w8a8_form(m.weight.device, m.in_features) if form is None else form
        if self.form not in W8A8_FORMS:
            raise ValueError(f"unknown W8A8 form {self.form!r}")
        if self.form == AMX:
            packed = m.weight.contiguous()  # the AMX GEMM reads the plain weight
        elif self.form == NATIVE:
            packed = native.pack_w8a8(m.weight)
        else:
            packed = torch.ops.onednn.qlinear_prepack(m.weight, None)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("weight_scale", m.weight_scale.float(), persistent=False)
        onednn = self.form not in (NATIVE, AMX)  # oneDNN's GEMM takes its scales and zero points as tensors
        self.register_buffer("unit_scale", torch.ones(m.out_features) if onednn else None, persistent=False)
        self.register_buffer("zero_points", torch.zeros(m.out_features, dtype=torch.int64) if onednn else None,
                             persistent=False)
        self.register_buffer("inv_smooth", 1 / m.input_smooth.float(), persistent=False)
        self.register_buffer("bias", None if m.bias is None else m.bias.detach(), persistent=False)
        # chosen once: gptj.native's one-pass rounding and scaling for bfloat16 rows (policy.native_elementwise)
        self.native_rows = native_elementwise(m.weight.device, torch.bfloat16)
        self._form_forward = {NATIVE: PackedW8A8Linear._native, SHIFTED: PackedW8A8Linear._onednn,
                              AMX: PackedW8A8Linear._onednn, SPLIT: PackedW8A8Linear._onednn}[self.form]

    def _gemm(self, qu: torch.Tensor, zero_point: int = 128, scale: torch.Tensor | None = None) -> torch.Tensor:
        """oneDNN's u8 x s8 GEMM of uint8 rows qu (q + zero_point) -> float32 sums * scale (weight_scale)."""
        if self.form == AMX:  # the same float32 sums * weight_scale, bit for bit (zero point 128 alone)
            return native.linear_w8a8_amx(qu, self.packed, self.weight_scale)
        scale = self.weight_scale if scale is None else scale
        return torch.ops.onednn.qlinear_pointwise(qu, 1.0, zero_point, self.packed, scale, self.zero_points,
                                                  None, 1.0, 0, torch.float32, "none", [], "")

    def _split_sums(self, qx: torch.Tensor) -> torch.Tensor:
        """The SPLIT form: float32 sums of qx's products, from one GEMM of both halves (unit scales)."""
        halves = self._gemm(torch.cat((qx, -qx)).clamp_(min=0).view(torch.uint8), 0, self.unit_scale)
        rows = qx.shape[0]
        return halves[:rows] - halves[rows:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._form_forward(self, x.reshape(-1, self.in_features))
        return y.view(*x.shape[:-1], self.out_features)

    def _onednn(self, x2: torch.Tensor) -> torch.Tensor:
        """The SHIFTED, AMX and SPLIT forms."""
        if self.form != SPLIT and self.native_rows and x2.dtype == torch.bfloat16:
            y = torch.empty((x2.shape[0], self.out_features), dtype=x2.dtype)
            bias = None if self.bias is None else self.bias.to(x2.dtype)
            for r in range(0, x2.shape[0], self.CHUNK_ROWS):
                qu, sx = native.quantize_rows_u8(x2[r:r + self.CHUNK_ROWS], self.inv_smooth)
                native.scale_rows(self._gemm(qu), sx, bias, out=y[r:r + self.CHUNK_ROWS])
            return y
        qx, sx = quantize_rows_int8(x2.float() * self.inv_smooth)
        if self.form == SPLIT:
            acc = self._split_sums(qx) * self.weight_scale
        else:
            acc = self._gemm((qx.to(torch.int16) + 128).to(torch.uint8))
        return with_bias(self, (acc * sx).to(x2.dtype))

    def _native(self, x2: torch.Tensor) -> torch.Tensor:
        """The NATIVE form: bfloat16 rows rounded in gptj.native's one pass and scaled, biased and rounded
        in its GEMM; other dtypes rounded by torch's ops, the GEMM's float32 result then cast and biased
        as W8A8Linear does."""
        if self.native_rows and x2.dtype == torch.bfloat16:
            qu, sx = native.quantize_rows_u8(x2, self.inv_smooth)
            bias = None if self.bias is None else self.bias.to(x2.dtype)
            return native.linear_w8a8(qu, sx, self.packed, self.weight_scale, bias)
        qx, sx = quantize_rows_int8(x2.float() * self.inv_smooth)
        qu = (qx.to(torch.int16) + 128).to(torch.uint8)
        y = native.linear_w8a8(qu, sx.contiguous(), self.packed, self.weight_scale, None, torch.float32).to(x2.dtype)
        return with_bias(self, y)

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's signature
        raise RuntimeError("a PackedW8A8Linear cannot be moved or cast; load the checkpoint again instead")

    def extra_repr(self) -> str:
        kernel = "gptj.native" if self.form in (NATIVE, AMX) else "onednn"
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8 {kernel} {self.form}"
