"""W8A8 calibration (SmoothQuant): run calibration prompts through the float model, keep each
linear's input |max| per channel, and turn it into per-input-channel smoothing factors.

  absmax = input_absmax(model, prompts)        {linear: (in,) float32}, over every prompt token
  smooth = smoothing(model, absmax, alpha)     {linear: (in,) bfloat16}, s = max|X|^a / max|W|^(1-a)

Linears that read the same tensor share one factor vector, computed over all their weights (GPT-J's
q, k, v and fc_in all read ln_1's output: the fused serving block, gptj.kernels.fused, quantizes
that input once for the four of them; Llama's q, k, v read ln_1's, its gate and up ln_2's).

A float checkpoint keeps its factors in `calibration.safetensors` beside its weights, and
config.json's `calibration` entry records how they were made (gptj.quant.format's `make_record`,
`check_record`, re-exported here); a
W8A8 checkpoint holds them in each layer's `input_smooth` and the same record in its
`quantization` entry. MLPerf's closed division allows this: quantization calibrated on its
calibration list (cnn_dailymail_calibration.json, 1,000 training-set articles).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptj.errors import CheckpointError, GptjError
from gptj.files import model_file
from gptj.quant.format import CALIBRATION_VERSION, METHOD, check_record, linear_in_features, make_record  # noqa: F401
from gptj.quant.ops import SMOOTH_ALPHA, smoothing_factors

CALIBRATION_FILE = "calibration.safetensors"

# The linears of a block (gptj.models' names) that read one norm's output: GPT-J's attention and MLP run
# in parallel on ln_1's; Llama's attention reads ln_1's, its MLP's gate and up ln_2's.
_READS_NORM = {"attn.q_proj": "ln_1", "attn.k_proj": "ln_1", "attn.v_proj": "ln_1", "mlp.fc_in": "ln_1",
               "mlp.gate_proj": "ln_2", "mlp.up_proj": "ln_2"}


def input_group(name: str) -> str:
    """The tensor a linear reads, as a name: `<block>.ln_1` / `<block>.ln_2` for the linears that
    read a norm's output (_READS_NORM), else the linear itself."""
    for leaf, norm in _READS_NORM.items():
        if name.endswith("." + leaf):
            return name[: -len(leaf)] + norm
    return name


@torch.no_grad()
def input_absmax(model: nn.Module, prompts: Iterable[list[int]]) -> tuple[dict[str, torch.Tensor], int]:
    """({linear name: max |input| per input channel, float32 (in,)}, tokens seen) over the prompts,
    each run whole through the (float, unfused) model."""
    absmax: dict[str, torch.Tensor] = {}
    hooks = []

    def record(name: str):  # noqa: ANN202 - a forward pre-hook
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0].detach()
            m = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
            absmax[name] = m if name not in absmax else torch.maximum(absmax[name], m)
        return hook

    for name, m in model.named_modules():
        if type(m) is nn.Linear:
            hooks.append(m.register_forward_pre_hook(record(name)))
    if not hooks:
        raise GptjError("calibration needs the float model (no nn.Linear layers found: quantized or fused?)")
    device = next(model.parameters()).device
    tokens = 0
    try:
        for ids in prompts:
            if not ids:
                continue
            model(torch.tensor([ids], device=device))
            tokens += len(ids)
    finally:
        for h in hooks:
            h.remove()
    if not tokens:
        raise GptjError("calibration got no prompt tokens")
    return absmax, tokens


def smoothing(model: nn.Module, absmax: Mapping[str, torch.Tensor],
              alpha: float = SMOOTH_ALPHA) -> dict[str, torch.Tensor]:
    """{linear name: smoothing factors (in,) bfloat16}, one vector per input group (input_group)."""
    groups: dict[str, list[str]] = {}
    for name in absmax:
        groups.setdefault(input_group(name), []).append(name)
    out: dict[str, torch.Tensor] = {}
    for names in groups.values():
        act = torch.stack([absmax[n] for n in names]).amax(dim=0)
        w = torch.stack([model.get_submodule(n).weight.detach().abs().amax(dim=0).float() for n in names]).amax(dim=0)
        s = smoothing_factors(act, w, alpha).cpu()
        out.update({n: s for n in names})
    return out


def save_factors(smooth: Mapping[str, torch.Tensor], folder: Path) -> Path:
    """Write the factors as `folder/calibration.safetensors`, atomically (a temp file renamed)."""
    from safetensors.torch import save

    from gptj.files import atomic_write_bytes

    # one copy per layer: the layers of an input group share one tensor, and safetensors refuses shared storage
    tensors = {f"{n}.input_smooth": t.clone() for n, t in sorted(smooth.items())}
    return atomic_write_bytes(Path(folder) / CALIBRATION_FILE, save(tensors))


def load_factors(folder: Path, modules: Iterable[str], in_features: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """{linear: factors} for `modules` from `folder/calibration.safetensors`, checked (shape, finite, > 0)."""
    from safetensors import safe_open

    path = Path(folder) / CALIBRATION_FILE
    if not path.is_file():
        raise GptjError(f"{folder}: no W8A8 calibration ({CALIBRATION_FILE}): run `gptj calibrate --model {folder}` "
                        "first")
    out = {}
    with safe_open(str(path), framework="pt") as f:
        have = set(f.keys())
        for name in modules:
            key = f"{name}.input_smooth"
            if key not in have:
                raise CheckpointError(f"{path}: no smoothing factors for {name}")
            t = f.get_tensor(key)
            if tuple(t.shape) != (in_features[name],):
                raise CheckpointError(f"{path}: {key} has shape {list(t.shape)}, expected [{in_features[name]}]")
            if not t.is_floating_point() or not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
                raise CheckpointError(f"{path}: {key} must hold finite positive factors")
            out[name] = t
    return out


def w8a8_factors(q: Mapping[str, Any] | None, config: Any, folder: str | Path) -> dict[str, torch.Tensor] | None:
    """The smoothing factors a w8a8 quantization `q` of the float checkpoint in `folder` needs (else None),
    from its calibration file (a link out of the folder is refused, gptj.files.model_file)."""
    if q is None or q["mode"] != "w8a8":
        return None
    model_file(folder, CALIBRATION_FILE)
    return load_factors(Path(folder), q["modules"], linear_in_features(config))
