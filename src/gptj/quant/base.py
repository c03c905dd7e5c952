"""What every quantized linear shares: its kernels chosen once, and the pieces of its math.

A quantized linear (gptj.quant.int8, int4, w8a8, fp8) holds its checkpoint's buffers and, after
every load, move or cast, `prepare()`s them for its device (scales' dtypes, packed layouts). Its
kernels are chosen once per activation dtype (vLLM's linear methods, TGI's get_linear: the choice at
load, not in the forward): `QuantLinear.method` asks gptj.policy's `linear_plan` for the layer's
paths by row count, from one `Capabilities` probe, and binds each path to the layer's function for
it (`kernels`). A call then looks up its row count in that plan and runs the function:

    y = self.method(x.dtype, x.device).apply(self, x2)      # x2 (rows, in) -> (rows, out)

`choose_methods(model, dtype)` makes every layer's choice where a model is prepared for serving.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gptj.policy import ALL_ROWS, Capabilities, RowPlan, linear_plan
from gptj.quant.ops import SCALE_DTYPE, quantize_rows_fp8, quantize_rows_int8

KERNEL_DTYPE = torch.bfloat16  # the CPU kernels run in bfloat16 (their float32 paths are 10-30x slower)

Kernel = Callable[[Any, torch.Tensor], torch.Tensor]  # (layer, x2 (rows, in)) -> (rows, out) in x2's dtype


class LinearMethod:
    """A layer's kernels for one device and activation dtype: (lo, hi, kernel) spans of row counts,
    in the policy's order. `apply` switches on the call's rows alone."""

    __slots__ = ("plan", "spans")

    def __init__(self, plan: RowPlan, kernels: dict[str, Kernel]) -> None:
        self.plan = plan
        self.spans = tuple((lo, hi, kernels[path]) for lo, hi, path in plan.spans)

    def apply(self, layer: nn.Module, x2: torch.Tensor) -> torch.Tensor:
        rows = x2.shape[0]
        for lo, hi, kernel in self.spans:
            if lo <= rows <= hi:
                return kernel(layer, x2)
        raise AssertionError(f"no span of {self.plan} takes {rows} rows")  # the table ends in an unbounded route

    def path(self, rows: int) -> str:
        return self.plan.path(rows)


class QuantLinear(nn.Module):
    """A quantized linear layer: `weight_kind` (policy.WEIGHT_KINDS), `prepare()` after every load,
    move or cast, and `kernels(caps, dtype)` mapping each path of the policy's plan to a function of
    (layer, x2). The methods made from them are kept per (device, dtype) until the next prepare."""

    weight_kind = ""
    in_features: int
    out_features: int

    def __init__(self) -> None:
        super().__init__()
        self._methods: dict[tuple[torch.device, torch.dtype], LinearMethod] = {}

    def prepare(self) -> QuantLinear:
        """Ready the buffers for the device; subclasses extend it. Forgets the chosen kernels."""
        self._methods = {}
        return self

    def kernels(self, caps: Capabilities, dtype: torch.dtype) -> dict[str, Kernel]:
        raise NotImplementedError

    def choose(self, caps: Capabilities, dtype: torch.dtype) -> LinearMethod:
        """The layer's method for `dtype` activations on the probed device (made once, then kept)."""
        key = (self.weight.device, dtype)
        method = self._methods.get(key)
        if method is None:
            plan = linear_plan(caps, dtype, self.weight_kind, (self.in_features, self.out_features))
            kernels = self.kernels(caps, dtype)
            method = self._methods[key] = LinearMethod(plan, {p: kernels[p] for p in plan.paths})
        return method

    def method(self, dtype: torch.dtype, device: torch.device) -> LinearMethod:
        method = self._methods.get((device, dtype))
        return method if method is not None else self.choose(Capabilities.probe(device), dtype)

    def path(self, x: torch.Tensor) -> str:
        """The path a call on x takes (reports and tests)."""
        return self.method(x.dtype, x.device).path(rows_of(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = self.method(x.dtype, x.device).apply(self, x2)
        return y.view(*x.shape[:-1], self.out_features)

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's signature
        super()._apply(fn, recurse)
        return self.prepare()  # (a .to(float32) would cast the scales: prepare makes them bfloat16 values again)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.prepare()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def choose_methods(model: nn.Module, dtype: torch.dtype) -> int:
    """Choose every quantized layer's kernels for `dtype` activations now, from one probe per device
    (where a model is prepared for serving); returns how many layers."""
    probes: dict[torch.device, Capabilities] = {}
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for m in layers:
        device = m.weight.device
        if device not in probes:
            probes[device] = Capabilities.probe(device)
        m.choose(probes[device], dtype)
    return len(layers)


def pin_path(model: nn.Module, path: str, dtype: torch.dtype) -> None:
    """Make every quantized layer of `model` (or the layer itself) run `path` for `dtype` activations at
    any row count, to compare one kernel's math alone (tests, benchmarks/quant_trained.py); the next
    prepare() (a move, a cast, a load) forgets it."""
    for m in model.modules():
        if isinstance(m, QuantLinear):
            plan = RowPlan(((0, ALL_ROWS, path),))
            m._methods[(m.weight.device, dtype)] = LinearMethod(plan, m.kernels(Capabilities.probe(m.weight.device),
                                                                                 dtype))


def rows_of(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def with_bias(m: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """A quantized linear's (rows, out) product plus its bias, in y's dtype."""
    return y if m.bias is None else y + m.bias.to(y.dtype)


def quantize_rows(x2: torch.Tensor, kind: str, mul: torch.Tensor | None, triton: bool) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """Activations rounded per row (kind "int8" or "e4m3") after a per-column float32 factor mul (W8A8's
    smoothing) -> (q, scale (rows, 1)): on CUDA with Triton one kernel (gptj.quant.cuda.quantize_rows),
    elsewhere torch's forms (gptj.quant.ops); the same values, bit for bit."""
    if triton and x2.is_cuda and x2.shape[0]:  # (the kernel takes 1 row or more)
        from gptj.quant import cuda

        return cuda.quantize_rows(x2 if x2.stride(-1) == 1 else x2.contiguous(), kind, mul)
    xf = x2.float() if mul is None else x2.float() * mul
    return quantize_rows_int8(xf) if kind == "int8" else quantize_rows_fp8(xf)


def per_channel_buffers(m: nn.Module, in_features: int, out_features: int, bias: bool,
                        device: torch.device | str | None, dtype: torch.dtype | None,
                        weight_dtype: torch.dtype = torch.int8) -> None:
    """A per-channel quantized linear's checkpoint buffers: weight int8 (or e4m3) (out, in), weight_scale
    (out,), bias."""
    m.in_features, m.out_features = in_features, out_features
    m.register_buffer("weight", torch.empty(out_features, in_features, dtype=weight_dtype, device=device))
    m.register_buffer("weight_scale", torch.ones(out_features, dtype=SCALE_DTYPE, device=device))
    m.register_buffer("bias", torch.zeros(out_features, dtype=dtype or torch.float32, device=device) if bias else None)


def per_channel_from_float(cls: type, linear: nn.Linear, quantize: Callable) -> nn.Module:
    """A per-channel quantized `cls` (Int8Linear, Fp8Linear) of a float linear: `quantize`'s
    (weight, scale) and the bias as it is."""
    m = cls(linear.in_features, linear.out_features, linear.bias is not None, device=linear.weight.device,
            dtype=linear.weight.dtype)
    m.weight, m.weight_scale = quantize(linear.weight.detach())
    if linear.bias is not None:
        m.bias = linear.bias.detach().clone()
    return m.prepare()


def scales_as_values(m: nn.Module, *names: str) -> None:
    """The named scale buffers in their checkpoint dtype (bfloat16 values), whatever a cast made them."""
    for name in names:
        if getattr(m, name).dtype != SCALE_DTYPE:
            setattr(m, name, getattr(m, name).to(SCALE_DTYPE))
