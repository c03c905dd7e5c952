"""The quantized linear modules (Int8Linear, Int4Linear, W8A8Linear, Fp8Linear) and the model-level
swaps that use them.

The model stays the plain-math GPT-J of `gptj.models.gptj`; `quantize_model` replaces its `nn.Linear`
layers (q/k/v/out_proj, mlp.fc_in/fc_out and lm_head; the embedding `wte` stays float) with
`Int8Linear` / `Int4Linear` (activations keep the model's float dtype; only the weights are
quantized, gpt-fast style), `W8A8Linear` (the activations too, per token at each call,
SmoothQuant style) or `Fp8Linear` (e4m3 weights; e4m3 activations per token in big calls, on GPUs
with FP8 matrix units). The buffers are the checkpoint's tensors (gptj.quant.format).

Kernels. Which one a call runs is gptj.policy's `linear_path`, by device, dtype and rows:
gptj.native's int8 GEMV for a few rows on CPU (and its int8 GEMM for more, and its int4 GEMV and GEMM
from 2 rows, on AVX512-BF16 without AMX); torch's weight-only kernels (torch._weight_int8pack_mm /
torch._weight_int4pack_mm_for_cpu) in bfloat16 up to KERNEL_MAX_ROWS[mode] rows (activations of
other dtypes are cast to bfloat16 for the call: the kernels' float32 paths are not vectorized and
measured 10-30x slower than their bfloat16 paths, slower than a float32 F.linear on the unquantized
weight); on CUDA, gptj.quant.cuda's Triton GEMVs for decode's few rows (int8, fp8, and int4 beside
torch._weight_int4pack_mm, which bfloat16 takes up to 16 rows), its GEMM plans for int8's and int4's
bigger calls of 16-bit activations (each weight tile dequantized in registers), and torch._scaled_mm
for fp8's; otherwise (CPU prefill, float32 on CUDA, odd shapes) the weight dequantized to the
activation dtype, a chunk of output rows at a time, and F.linear.
The CUDA paths are tested here under Triton's interpreter and torch's CPU torch._scaled_mm, not on a
GPU. The packed layout the CPU int4 kernel wants is made at load time, on the device (see
`Int4Linear.prepare`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gptj import native
from gptj.errors import GptjError
from gptj.policy import (AMX, DEQUANTIZE, EXACT_F32_INT8_TERMS, INT_MM, NATIVE, SCALED_MM, TRITON, UPCAST, WEIGHT_ONLY,
                         int_mm_min_rows, linear_path, native_elementwise, triton_available)
from gptj.quant.format import _float_meta_model, make_quantization
from gptj.quant.ops import (
    DEFAULT_GROUP_SIZE,
    FP8_DTYPE,
    SCALE_DTYPE,
    _chunk_buffer,
    _cpu_int4_kernel_ok,
    _dequant_int4_values,
    _pack_cpu_int4,
    _row_chunks,
    _unpack_cpu_int4,
    check_group_size,
    chunked_linear,
    cpu_int4_layout,
    dequantize_fp8,
    dequantize_int8,
    int8_sums,
    pack_int4,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    quantize_rows_fp8,
    quantize_rows_int8,
    unpack_int4,
)

KERNEL_DTYPE = torch.bfloat16  # the CPU kernels run in bfloat16 (their float32 paths are 10-30x slower)


def _quantize_rows(x2: torch.Tensor, kind: str, mul: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations rounded per row (kind "int8" or "e4m3") after a per-column float32 factor mul (W8A8's
    smoothing) -> (q, scale (rows, 1)): on CUDA one Triton kernel (gptj.quant.cuda.quantize_rows),
    elsewhere torch's forms (gptj.quant.ops); the same values, bit for bit."""
    if x2.is_cuda and x2.shape[0] and triton_available():  # (the kernel takes 1 row or more)
        from gptj.quant import cuda

        return cuda.quantize_rows(x2 if x2.stride(-1) == 1 else x2.contiguous(), kind, mul)
    xf = x2.float() if mul is None else x2.float() * mul
    return quantize_rows_int8(xf) if kind == "int8" else quantize_rows_fp8(xf)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _finish(m: nn.Module, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A quantized linear's (rows, out) product plus its bias, in x's leading shape."""
    if m.bias is not None:
        y = y + m.bias.to(y.dtype)
    return y.view(*x.shape[:-1], m.out_features)


def _dequantize_dtype(path: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a dequantized weight's F.linear runs in: float32 on policy's UPCAST path, else x's."""
    return torch.float32 if path == UPCAST else dtype


class _Prepared(nn.Module):
    """A quantized linear whose `prepare()` (the scales' dtypes, what is derived from them) runs again
    after every move or cast and every load."""

    def prepare(self) -> nn.Module:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's signature
        super()._apply(fn, recurse)
        return self.prepare()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.prepare()


def _per_channel_from_float(cls: type, linear: nn.Linear, quantize: Any) -> nn.Module:
    """A per-channel quantized `cls` (Int8Linear, Fp8Linear) of a float linear: `quantize`'s
    (weight, scale) and the bias as it is."""
    m = cls(linear.in_features, linear.out_features, linear.bias is not None, device=linear.weight.device,
            dtype=linear.weight.dtype)
    m.weight, m.weight_scale = quantize(linear.weight.detach())
    if linear.bias is not None:
        m.bias = linear.bias.detach().clone()
    return m.prepare()


def _int8_buffers(m: nn.Module, in_features: int, out_features: int, bias: bool,
                  device: torch.device | str | None, dtype: torch.dtype | None,
                  weight_dtype: torch.dtype = torch.int8) -> None:
    """A per-channel quantized linear's checkpoint buffers: weight int8 (or e4m3) (out, in), weight_scale
    (out,), bias."""
    m.in_features, m.out_features = in_features, out_features
    m.register_buffer("weight", torch.empty(out_features, in_features, dtype=weight_dtype, device=device))
    m.register_buffer("weight_scale", torch.ones(out_features, dtype=SCALE_DTYPE, device=device))
    m.register_buffer("bias", torch.zeros(out_features, dtype=dtype or torch.float32, device=device) if bias else None)


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T + bias, q int8 per output channel. Buffers as in the checkpoint."""

    mode = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        _int8_buffers(self, in_features, out_features, bias, device, dtype)

    @classmethod
    def from_float(cls, linear: nn.Linear) -> Int8Linear:
        return _per_channel_from_float(cls, linear, quantize_int8)

    def prepare(self) -> Int8Linear:
        """Make the module ready for its device (int8 needs no packing: scales to bfloat16)."""
        if self.weight_scale.dtype != SCALE_DTYPE:
            self.weight_scale = self.weight_scale.to(SCALE_DTYPE)
        return self

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's signature
        super()._apply(fn, recurse)
        return self.prepare()  # .to(float32) would cast the scales: they stay bfloat16 values

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8(self.weight, self.weight_scale, dtype)

    def use_kernel(self, x: torch.Tensor) -> bool:
        """Whether a call on x runs a kernel (gptj.native's or torch's), not the dequantized matmul."""
        return self._path(x) not in (DEQUANTIZE, UPCAST)

    def _path(self, x: torch.Tensor) -> str:
        return linear_path(x.device, x.dtype, _rows(x), "int8", (self.in_features, self.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        path = self._path(x)
        if path in (NATIVE, AMX):
            kernel = native.linear_int8 if path == NATIVE else native.linear_int8_amx
            if x.dtype == KERNEL_DTYPE and self.bias is not None and self.bias.dtype == KERNEL_DTYPE:
                # bfloat16 in and out: the kernel adds the bias (one rounding, no extra pass)
                y = kernel(x2, self.weight, self.weight_scale, self.bias)
                return y.view(*x.shape[:-1], self.out_features)
            y = kernel(x2.to(KERNEL_DTYPE), self.weight, self.weight_scale).to(x.dtype)
        elif path == WEIGHT_ONLY:
            y = torch._weight_int8pack_mm(x2.to(KERNEL_DTYPE).contiguous(), self.weight, self.weight_scale)
            y = y.to(x.dtype)
        elif path == TRITON:
            from gptj.quant import cuda

            return cuda.int8_linear(x2.contiguous(), self.weight, self.weight_scale, self.bias).view(
                *x.shape[:-1], self.out_features)
        else:  # DEQUANTIZE, or UPCAST: the same in float32, rounded to x's dtype once
            y = chunked_linear(x2, self.weight, _dequantize_dtype(path, x2.dtype), self.weight_scale)
        return _finish(self, y, x).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def int_mm(qx: torch.Tensor, weight: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
    """torch._int_mm(qx, weight.T): int32 sums (rows, out) of int8 qx (rows, in) and weight (out, in);
    qx padded with zero rows up to min_rows where it has fewer (policy.int_mm_min_rows: CUDA's takes
    17 or more), whose sums are dropped. The sums are exact, so each row's are the same padded or not."""
    rows = qx.shape[0]
    if rows < min_rows:
        qx = torch.cat([qx, qx.new_zeros(min_rows - rows, qx.shape[1])])
    return torch._int_mm(qx, weight.t())[:rows]


class W8A8Linear(_Prepared):
    """y = sx * sw * (qx @ qw.T) + bias: int8 activations (per token, quantized at each call from
    x / input_smooth) times int8 weights (per output channel, of W * input_smooth), see gptj.quant.ops.

    The integer sums are exact (int32), so each row's output is the same whatever rows share the
    call. Buffers as in the checkpoint: weight int8 (out, in), weight_scale bf16 (out,),
    input_smooth bf16 (in,), bias."""

    mode = "w8a8"

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        _int8_buffers(self, in_features, out_features, bias, device, dtype)
        self.register_buffer("input_smooth", torch.ones(in_features, dtype=SCALE_DTYPE, device=device))

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
        for name in ("weight_scale", "input_smooth"):
            if getattr(self, name).dtype != SCALE_DTYPE:
                setattr(self, name, getattr(self, name).to(SCALE_DTYPE))
        self._inv_smooth = None if self.input_smooth.device.type == "meta" else 1 / self.input_smooth.float()
        return self

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight it stands for: (q * scale) / smooth per input column."""
        return (dequantize_int8(self.weight, self.weight_scale) / self.input_smooth.float()[None, :]).to(dtype)

    def quantize_input(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(qx int8 (rows, in), sx float32 (rows, 1)) for the rows x2 (rows, in)."""
        return _quantize_rows(x2, "int8", self._inv_smooth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        qx, sx = self.quantize_input(x2)
        path = linear_path(x.device, x.dtype, _rows(x), "w8a8", (self.in_features, self.out_features))
        if path == INT_MM:
            acc = int_mm(qx, self.weight, int_mm_min_rows(x.device)).float()
        else:  # the same products in float32, exact (where torch._int_mm's sums would not be, or it cannot run)
            acc = int8_sums(qx, self.weight, EXACT_F32_INT8_TERMS)
        y = (acc * self.weight_scale.float() * sx).to(x.dtype)  # the order oneDNN's packed kernel takes
        return _finish(self, y, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Fp8Linear(_Prepared):
    """y = x @ (q * scale).T + bias, q e4m3 (torch.float8_e4m3fn) per output channel; for GPUs with
    FP8 matrix units (policy.fp8_supported). Buffers as in the checkpoint: weight e4m3 (out, in),
    weight_scale bf16 (out,), bias.

    Which math a call does is policy.linear_path's:
      TRITON      (decode's few rows) weight-only: the e4m3 weight read once, x in its own dtype
      SCALED_MM   (more rows) FP8 x FP8: x rounded to e4m3 per token (scale max |x| / 448, at each
                  call, no calibration), torch._scaled_mm's float32 sums of exact products, both scales after
      DEQUANTIZE  (a device without FP8 units: the commands refuse it there) the weight-only math
    so a row's result depends on whether its call has more than policy.TRITON_MAX_ROWS rows."""

    mode = "fp8"

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        _int8_buffers(self, in_features, out_features, bias, device, dtype, weight_dtype=FP8_DTYPE)
        self.prepare()

    @classmethod
    def from_float(cls, linear: nn.Linear) -> Fp8Linear:
        return _per_channel_from_float(cls, linear, quantize_fp8)

    def prepare(self) -> Fp8Linear:
        """Scales as bfloat16 values, and as the float32 row (1, out) torch._scaled_mm takes."""
        if self.weight_scale.dtype != SCALE_DTYPE:
            self.weight_scale = self.weight_scale.to(SCALE_DTYPE)
        self._scale_row = self.weight_scale.float()[None, :]
        self._one = torch.ones((), dtype=torch.float32, device=self.weight.device)  # _scaled_mm's unit scales
        return self

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale, dtype)

    def scaled_mm(self, x2: torch.Tensor) -> torch.Tensor:
        """SCALED_MM's product (rows, out) in x2's dtype, without the bias: bfloat16 rows take the
        scales in torch._scaled_mm's epilogue (row-wise scaling), other dtypes float32 sums, then the
        scales. Runs wherever torch._scaled_mm does (CUDA with FP8 units; torch's CPU form, slowly)."""
        qx, sx = _quantize_rows(x2, "e4m3")
        w = self.weight.t()  # column-major (in, out), as the GEMM wants its second operand
        if x2.dtype == torch.bfloat16:
            return torch._scaled_mm(qx, w, scale_a=sx, scale_b=self._scale_row, out_dtype=torch.bfloat16)
        acc = torch._scaled_mm(qx, w, scale_a=self._one, scale_b=self._one, out_dtype=torch.float32)
        return (acc * sx * self._scale_row).to(x2.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        path = linear_path(x.device, x.dtype, _rows(x), "fp8", (self.in_features, self.out_features))
        if path == TRITON:
            from gptj.quant import cuda

            return cuda.int8_linear(x2.contiguous(), self.weight, self.weight_scale, self.bias).view(
                *x.shape[:-1], self.out_features)
        y = self.scaled_mm(x2) if path == SCALED_MM else chunked_linear(x2, self.weight, x2.dtype, self.weight_scale)
        return _finish(self, y, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4Linear(nn.Module):
    """y = x @ ((q - 8) * scale + zero).T + bias, q 4-bit per group of `group_size` inputs.

    `state_dict()` always gives the portable checkpoint layout. In memory, after `prepare()` on
    CPU, `weight` holds the CPU kernel's packed layout instead (same shape and dtype) when this
    process knows how to unpack it (`cpu_int4_layout()`), so no second copy is kept; `layout`
    says which ("portable" or "cpu").
    """

    mode = "int4"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group_size: int = DEFAULT_GROUP_SIZE,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        check_group_size(group_size)
        if in_features % group_size or in_features % 2:
            raise GptjError(f"int4 group size {group_size} does not divide in_features {in_features}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        G = in_features // group_size
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, G, dtype=SCALE_DTYPE, device=device))
        self.register_buffer("weight_zero", torch.zeros(out_features, G, dtype=SCALE_DTYPE, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype or torch.float32, device=device)
                             if bias else None)
        self.layout = "portable"
        self._kernel_weight: torch.Tensor | None = None  # packed for the kernel (CPU or CUDA)
        self._scales_and_zeros: torch.Tensor | None = None  # (groups, out, 2) bfloat16, as the kernels want
        self._prepared = False

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE) -> Int4Linear:
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, group_size,
                device=linear.weight.device, dtype=linear.weight.dtype)
        m.weight, m.weight_scale, m.weight_zero = quantize_int4(linear.weight.detach(), group_size)
        if linear.bias is not None:
            m.bias = linear.bias.detach().clone()
        return m.prepare()

    # layouts

    def nibbles(self) -> torch.Tensor:
        """The 4-bit values, uint8 (out, in), whatever the layout in memory."""
        if self.layout == "cpu":
            return _unpack_cpu_int4(self.weight, cpu_int4_layout())
        return unpack_int4(self.weight)

    def portable_weight(self) -> torch.Tensor:
        return self.weight if self.layout == "portable" else pack_int4(self.nibbles())

    def _to_portable(self) -> None:
        if self.layout != "portable":
            self.weight = self.portable_weight()
            self.layout = "portable"
        self._kernel_weight = self._scales_and_zeros = None
        self._prepared = False

    def prepare(self) -> Int4Linear:
        """Pack the weight for the kernel of its device (once; again after a move or a load)."""
        if self._prepared or self.weight.device.type == "meta":
            return self
        for name in ("weight_scale", "weight_zero"):
            if getattr(self, name).dtype != SCALE_DTYPE:
                setattr(self, name, getattr(self, name).to(SCALE_DTYPE))
        self._to_portable()
        sz = torch.stack((self.weight_scale, self.weight_zero), dim=-1).transpose(0, 1).contiguous()
        device = self.weight.device
        if device.type == "cpu" and _cpu_int4_kernel_ok(self.out_features):
            packed = _pack_cpu_int4(self.weight, portable=True)
            self._scales_and_zeros = sz
            if cpu_int4_layout() is not None:
                self.weight, self.layout = packed, "cpu"  # the only copy
            else:
                self._kernel_weight = packed  # unknown layout: keep the portable copy for unpacking
        elif device.type == "cuda" and hasattr(torch, "_convert_weight_to_int4pack"):
            inner = next((t for t in (8, 4, 2) if self.in_features % (16 * t) == 0), None)
            if inner is not None and self.out_features % 8 == 0:
                try:  # torch >= 2.5 takes the portable uint8 (out, in/2) layout; not tested here (no GPU)
                    self._kernel_weight = torch._convert_weight_to_int4pack(self.weight.contiguous(), inner)
                    self._scales_and_zeros = sz
                except (RuntimeError, NotImplementedError):
                    self._kernel_weight = None
        self._prepared = True
        return self

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's signature
        self._to_portable()  # the packed layouts are device specific
        super()._apply(fn, recurse)
        return self.prepare()

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001 - nn.Module's signature
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.portable_weight()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        self._to_portable()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return _dequant_int4_values(self.nibbles(), self.weight_scale, self.weight_zero, dtype)

    # forward

    def use_kernel(self, x: torch.Tensor) -> bool:
        """Whether a call on x runs torch's int4 kernel: where the policy says so and the weight packed
        for it (on CUDA, only if torch could pack it)."""
        return self._torch_kernel(x, linear_path(x.device, x.dtype, _rows(x), "int4"))

    def _torch_kernel(self, x: torch.Tensor, path: str) -> bool:
        if self._scales_and_zeros is None or path != WEIGHT_ONLY:
            return False
        return x.device.type == "cpu" or self._kernel_weight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._prepared:
            self.prepare()
        x2 = x.reshape(-1, self.in_features)
        path = linear_path(x.device, x.dtype, _rows(x), "int4")
        if path == TRITON:
            from gptj.quant import cuda

            y = cuda.int4_linear(x2.contiguous(), self.weight, self.weight_scale, self.weight_zero, self.group_size,
                                 self.bias)  # on CUDA the weight stays in the portable layout
            return y.view(*x.shape[:-1], self.out_features)
        if path == NATIVE and self._native_gemm_ready():
            y = self._native_gemm(x2)
        elif self._torch_kernel(x, path):
            if x.device.type == "cpu":
                w = self.weight if self.layout == "cpu" else self._kernel_weight
                y = torch._weight_int4pack_mm_for_cpu(x2.to(KERNEL_DTYPE).contiguous(), w, self.group_size,
                                                      self._scales_and_zeros)
            else:
                y = torch._weight_int4pack_mm(x2.contiguous(), self._kernel_weight, self.group_size,
                                              self._scales_and_zeros)
            y = y.to(x.dtype)
        else:  # DEQUANTIZE, or UPCAST: the same in float32, rounded to x's dtype once (also NATIVE's
            y = self._dequant_linear(x2.to(_dequantize_dtype(path, x2.dtype)))  # math where it cannot run)
        return _finish(self, y, x).to(x.dtype)

    def _native_gemm_ready(self) -> bool:
        """Whether gptj.native's int4 GEMV and GEMM can take this weight: in torch's CPU layout, in blocks
        they take."""
        return self.layout == "cpu" and native.int4_gemm_available(cpu_int4_layout())

    def _native_gemm(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 (rows, in) bfloat16 times the weight: its whole blocks by native.linear_int4 (its GEMV below 32
        rows, on the exact weights as torch's int4 kernel; its GEMM from there, on the dequantized
        matmul's; float32 sums rounded once)."""
        x2, K, layout = x2.contiguous(), self.in_features, cpu_int4_layout()
        return self._by_blocks(x2, [(0, self.out_features)], lambda a, c, out: native.linear_int4(
            x2, self.weight[a:c], K, layout, self.weight_scale[a:c], self.weight_zero[a:c], self.group_size, out=out))

    def _by_blocks(self, x2: torch.Tensor, spans: list[tuple[int, int]],
                   whole: Callable[[int, int, torch.Tensor], object]) -> torch.Tensor:
        """x2 times the weight's rows, span by span (each starting a block of torch's CPU layout): a span's
        whole blocks a:c by whole(a, c, y[:, a:c]), a last partial block (lm_head's 50,400 rows: 32 past
        787 blocks of 64) by the dequantized matmul."""
        y = torch.empty(x2.shape[0], self.out_features, dtype=x2.dtype, device=x2.device)
        block = cpu_int4_layout()[0]
        for a, b in spans:
            c = a + (b - a) // block * block
            if c > a:
                whole(a, c, y[:, a:c])
            if b > c:
                y[:, c:b] = F.linear(x2, self._dequant_rows(c, b, x2.dtype))
        return y

    def _nibbles_rows(self, a: int, b: int) -> torch.Tensor:
        if self.layout == "cpu":  # a starts a block of the layout (b ends one, or the weight): whole blocks
            return _unpack_cpu_int4(self.weight[a:b], cpu_int4_layout())
        return unpack_int4(self.weight[a:b])

    def _dequant_rows(self, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows a:b of the weight in `dtype`: one fused multiply-add, zero' = zero - 8 * scale."""
        s = self.weight_scale[a:b].float()
        zp = (self.weight_zero[a:b].float() - 8 * s).to(dtype)
        q = self._nibbles_rows(a, b).view(b - a, s.shape[1], self.group_size).to(dtype)
        return torch.addcmul(zp[..., None], q, s.to(dtype)[..., None]).view(b - a, self.in_features)

    def _dequant_linear(self, x2: torch.Tensor) -> torch.Tensor:
        dt = x2.dtype
        chunks = list(_row_chunks(self.out_features, self.in_features))
        if self._native_dequant(x2):  # gptj.native unpacks the CPU layout, into one reused buffer
            return self._native_dequant_linear(x2, chunks)
        if len(chunks) == 1:
            return F.linear(x2, self._dequant_rows(0, self.out_features, dt))
        y = torch.empty(x2.shape[0], self.out_features, dtype=dt, device=x2.device)
        for a, b in chunks:
            y[:, a:b] = F.linear(x2, self._dequant_rows(a, b, dt))
        return y

    def _native_dequant(self, x2: torch.Tensor) -> bool:
        """Whether the dequantized matmul's weight comes from gptj.native's int4_dequant_t: bfloat16 on
        a CPU with gptj.native, the weight in torch's CPU layout in whole blocks, outside autograd:
        torch's own unpacking of that layout is many times slower (docs/PERFORMANCE.md#amx-int8-gemm)."""
        layout = cpu_int4_layout() if self.layout == "cpu" else None
        return (layout is not None and native_elementwise(x2.device, x2.dtype)
                and not (torch.is_grad_enabled() and x2.requires_grad))

    def _native_dequant_linear(self, x2: torch.Tensor, chunks: list[tuple[int, int]]) -> torch.Tensor:
        """The chunks' whole blocks by native.int4_dequant_t into one reused buffer, then x2 @ it (the
        chunks start at multiples of 256 rows: block boundaries)."""
        K, layout = self.in_features, cpu_int4_layout()

        def whole(a: int, c: int, out: torch.Tensor) -> None:
            wt = native.int4_dequant_t(self.weight[a:c], K, layout, self.weight_scale[a:c], self.weight_zero[a:c],
                                       self.group_size, _chunk_buffer(K, c - a, x2.dtype, x2.device))
            out.copy_(x2 @ wt)  # x2 @ the weight's rows a:c, transposed

        return self._by_blocks(x2, chunks, whole)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, group_size={self.group_size}, layout={self.layout}")


QuantLinear = (Int8Linear, Int4Linear, W8A8Linear, Fp8Linear)


def linear_names(model_or_config: Any) -> list[str]:
    """Names of every linear layer of a model (or of a float model with this config), in module order."""
    model = model_or_config if isinstance(model_or_config, nn.Module) else _float_meta_model(model_or_config)
    return [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, *QuantLinear))]


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def swap_quantized_modules(model: nn.Module, quantization: Mapping[str, Any]) -> nn.Module:
    """Replace the linears `quantization` names with EMPTY quantized modules on the same device
    (for loading a quantized state dict with `load_state_dict(assign=True)`; then `prepare_model`)."""
    for name in quantization["modules"]:
        lin = model.get_submodule(name)
        if not isinstance(lin, nn.Linear):
            raise GptjError(f"{name} is not a float nn.Linear (already quantized?)")
        kw = {"device": lin.weight.device, "dtype": lin.weight.dtype}
        if quantization["mode"] == "int8":
            new = Int8Linear(lin.in_features, lin.out_features, lin.bias is not None, **kw)
        elif quantization["mode"] == "fp8":
            new = Fp8Linear(lin.in_features, lin.out_features, lin.bias is not None, **kw)
        elif quantization["mode"] == "w8a8":
            new = W8A8Linear(lin.in_features, lin.out_features, lin.bias is not None, **kw)
        else:
            new = Int4Linear(lin.in_features, lin.out_features, lin.bias is not None, quantization["group_size"], **kw)
        _set_module(model, name, new)
    return model


def prepare_model(model: nn.Module) -> nn.Module:
    """Pack every quantized module for its device (after loading)."""
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.prepare()
    return model


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QuantLinear) for m in model.modules())


def quantize_model(model: nn.Module, mode: str, group_size: int | None = None, skip: Sequence[str] = (),
                   smooth: Mapping[str, torch.Tensor] | None = None,
                   calibration: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Quantize a float GPT-J in place (module swaps); returns the `quantization` dict, also set on
    `model.config` so that saving the model records it. lm_head is quantized unless skipped.
    A pipeline stage (`gptj.parallel.pp`) quantizes the layers it holds.
    w8a8: `smooth` {module: factors} for every layer it quantizes, and their `calibration` record
    (gptj.quant.calibrate)."""
    if is_quantized(model):
        raise GptjError("the model is already quantized")
    q = make_quantization(model.config, mode, group_size, skip, calibration)
    present = dict(model.named_modules())
    with torch.no_grad():
        for name in q["modules"]:
            lin = present.get(name)
            if lin is None:  # a layer of another pipeline stage
                continue
            if mode == "w8a8":
                if smooth is None or name not in smooth:
                    raise GptjError(f"w8a8: no smoothing factors for {name} (gptj calibrate)")
                new = W8A8Linear.from_float(lin, smooth[name])
            elif mode == "int8":
                new = Int8Linear.from_float(lin)
            elif mode == "fp8":
                new = Fp8Linear.from_float(lin)
            else:
                new = Int4Linear.from_float(lin, q["group_size"])
            _set_module(model, name, new)
    model.config = model.config.replace(quantization=q)
    return q
