"""Int4Linear: 4-bit weights per group of inputs (scale and zero per group), activations in the
model's float dtype (weight-only, gpt-fast style).

Its kernels, by the policy's table (gptj.policy.LINEAR_TABLE, "int4"):
  NATIVE       gptj.native's int4 GEMV / GEMM on torch's CPU layout (AVX512-BF16 without AMX; AVX2)
  WEIGHT_ONLY  torch._weight_int4pack_mm_for_cpu (bfloat16), torch._weight_int4pack_mm on CUDA (tinygemm)
  TRITON       gptj.quant.cuda's int4 GEMV / GEMM (CUDA; the weight in the portable layout)
  DEQUANTIZE   the weight dequantized a chunk at a time (gptj.native unpacks the CPU layout), F.linear
  UPCAST       the same in float32, rounded once
The packed layout the CPU kernel wants is made at load time, on the device (`prepare`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gptj import native
from gptj.errors import GptjError
from gptj.policy import DEQUANTIZE, NATIVE, TRITON, UPCAST, WEIGHT_ONLY, Capabilities, native_elementwise
from gptj.quant.base import KERNEL_DTYPE, Kernel, QuantLinear, scales_as_values, with_bias
from gptj.quant.ops import (DEFAULT_GROUP_SIZE, SCALE_DTYPE, _chunk_buffer, _cpu_int4_kernel_ok, _dequant_int4_values,
                            _pack_cpu_int4, _row_chunks, _unpack_cpu_int4, check_group_size, cpu_int4_layout,
                            pack_int4, quantize_int4, unpack_int4)


class Int4Linear(QuantLinear):
    """y = x @ ((q - 8) * scale + zero).T + bias, q 4-bit per group of `group_size` inputs.

    `state_dict()` always gives the portable checkpoint layout. In memory, after `prepare()` on
    CPU, `weight` holds the CPU kernel's packed layout instead (same shape and dtype) when this
    process knows how to unpack it (`cpu_int4_layout()`), so no second copy is kept; `layout`
    says which ("portable" or "cpu").
    """

    mode = weight_kind = "int4"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group_size: int = DEFAULT_GROUP_SIZE,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        check_group_size(group_size)
        if in_features % group_size or in_features % 2:
            raise GptjError(f"{self.mode} group size {group_size} does not divide in_features {in_features}")
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
        self._prepared, self._methods = False, {}

    def prepare(self) -> Int4Linear:
        """Pack the weight for the kernel of its device (once; again after a move or a load)."""
        if self._prepared or self.weight.device.type == "meta":
            return self
        scales_as_values(self, "weight_scale", "weight_zero")
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
        return super().prepare()

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

    # forward: the kernels, chosen once per device and dtype (after prepare: they depend on the packing)

    def use_kernel(self, x: torch.Tensor) -> bool:
        """Whether a call on x runs torch's int4 kernel: where the policy says so and the weight packed
        for it (on CUDA, only if torch could pack it)."""
        if not self._prepared:
            self.prepare()
        return self._torch_kernel_ready(x.device) and self.path(x) == WEIGHT_ONLY

    def _torch_kernel_ready(self, device: torch.device) -> bool:
        return self._scales_and_zeros is not None and (device.type == "cpu" or self._kernel_weight is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._prepared:
            self.prepare()
        return super().forward(x)

    def kernels(self, caps: Capabilities, dtype: torch.dtype) -> dict[str, Kernel]:
        """NATIVE where gptj.native takes the weight's layout, WEIGHT_ONLY where torch's kernel has its
        packing; either else the dequantized matmul in the activations' dtype."""
        torch_kernel = Int4Linear._torch_int4 if self._torch_kernel_ready(self.weight.device) else Int4Linear._dequantize
        return {TRITON: Int4Linear._triton, WEIGHT_ONLY: torch_kernel, DEQUANTIZE: Int4Linear._dequantize,
                NATIVE: Int4Linear._native_gemm if self._native_gemm_ready() else Int4Linear._dequantize,
                UPCAST: Int4Linear._upcast}

    def _triton(self, x2: torch.Tensor) -> torch.Tensor:
        from gptj.quant import cuda

        return cuda.int4_linear(x2.contiguous(), self.weight, self.weight_scale, self.weight_zero, self.group_size,
                                self.bias)  # on CUDA the weight stays in the portable layout

    def _torch_int4(self, x2: torch.Tensor) -> torch.Tensor:
        if x2.device.type == "cpu":
            w = self.weight if self.layout == "cpu" else self._kernel_weight
            y = torch._weight_int4pack_mm_for_cpu(x2.to(KERNEL_DTYPE).contiguous(), w, self.group_size,
                                                  self._scales_and_zeros)
        else:
            y = torch._weight_int4pack_mm(x2.contiguous(), self._kernel_weight, self.group_size, self._scales_and_zeros)
        return with_bias(self, y.to(x2.dtype)).to(x2.dtype)

    def _dequantize(self, x2: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        y = self._dequant_linear(x2.to(dtype or x2.dtype))
        return with_bias(self, y).to(x2.dtype)

    def _upcast(self, x2: torch.Tensor) -> torch.Tensor:
        return self._dequantize(x2, torch.float32)

    def _native_gemm_ready(self) -> bool:
        """Whether gptj.native's int4 GEMV and GEMM can take this weight: in torch's CPU layout, in blocks
        they take."""
        return self.layout == "cpu" and native.int4_gemm_available(cpu_int4_layout())

    def _native_gemm(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 (rows, in) bfloat16 times the weight: its whole blocks by native.linear_int4 (its GEMV below 32
        rows, on the exact weights as torch's int4 kernel; its GEMM from there, on the dequantized
        matmul's; float32 sums rounded once)."""
        x2, K, layout = x2.contiguous(), self.in_features, cpu_int4_layout()
        y = self._by_blocks(x2, [(0, self.out_features)], lambda a, c, out: native.linear_int4(
            x2, self.weight[a:c], K, layout, self.weight_scale[a:c], self.weight_zero[a:c], self.group_size, out=out))
        return with_bias(self, y).to(x2.dtype)

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
