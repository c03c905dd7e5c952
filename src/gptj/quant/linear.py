"""The model-level swaps of the quantized linears: quantize a float model in place
(`quantize_model`), make empty quantized modules to load a checkpoint into
(`swap_quantized_modules`), prepare them for their device (`prepare_model`).

The model stays the plain-math GPT-J of `gptj.models.gptj`; its `nn.Linear` layers (q/k/v/out_proj,
mlp.fc_in/fc_out and lm_head; the embedding `wte` stays float) become one of the layers of
gptj.quant's kind files: `Int8Linear` (int8), `Int4Linear` (int4) — activations keep the model's float
dtype, only the weights are quantized, gpt-fast style — `W4A8Linear` (w4a8: int4's weights, the
activations rounded to int8 per block of 32 inputs at each call, llama.cpp's Q4_0 style), `W8A8Linear`
(w8a8: the activations too, per token at each call, SmoothQuant style) or `Fp8Linear` (fp8: e4m3 weights; e4m3 activations per token
in big calls, on GPUs with FP8 matrix units). Each chooses its kernels once per device and dtype
(gptj.quant.base; the table is gptj.policy's LINEAR_TABLE). The buffers are the checkpoint's
tensors (gptj.quant.format)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gptj.errors import GptjError
from gptj.quant.base import KERNEL_DTYPE, QuantLinear, choose_methods
from gptj.quant.format import GROUPED, _float_meta_model, make_quantization
from gptj.quant.fp8 import Fp8Linear
from gptj.quant.int4 import Int4Linear
from gptj.quant.int8 import Int8Linear
from gptj.quant.w4a8 import W4A8Linear
from gptj.quant.w8a8 import W8A8Linear, int_mm

__all__ = ["KERNEL_DTYPE", "QuantLinear", "Int8Linear", "Int4Linear", "W4A8Linear", "W8A8Linear", "Fp8Linear", "int_mm",
           "choose_methods", "linear_names", "swap_quantized_modules", "prepare_model", "is_quantized",
           "quantize_model", "LAYERS"]

LAYERS = {"int8": Int8Linear, "int4": Int4Linear, "w4a8": W4A8Linear, "w8a8": W8A8Linear,
          "fp8": Fp8Linear}  # by mode


def linear_names(model_or_config: Any) -> list[str]:
    """Names of every linear layer of a model (or of a float model with this config), in module order."""
    model = model_or_config if isinstance(model_or_config, nn.Module) else _float_meta_model(model_or_config)
    return [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, QuantLinear))]


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
        if quantization["mode"] in GROUPED:
            kw["group_size"] = quantization["group_size"]
        new = LAYERS[quantization["mode"]](lin.in_features, lin.out_features, lin.bias is not None, **kw)
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
                new = LAYERS[mode].from_float(lin, q["group_size"])  # int4, w4a8
            _set_module(model, name, new)
    model.config = model.config.replace(quantization=q)
    return q
