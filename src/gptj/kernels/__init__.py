"""Serving kernels: `fused` (the fused blocks and packed linears that prepare_for_serving builds
from a loaded model), and the names of gptj.policy (which kernel runs, per device, dtype and row
count) that its users reach for here.

gptj.policy sits above the model files (gptj.models: plain math, asking no policy) and below
gptj.quant; `fused` builds on both. The names of `fused` load on first use (PEP 562's module __getattr__), so importing
this package stays as light as gptj.policy.
"""

from __future__ import annotations

from typing import Any

from gptj.policy import NATIVE_LAYOUT_MAX_ROWS, NATIVE_MAX_ROWS, PACK_MODES, can_pack

_FUSED = ("KernelOps", "fuse_block", "PackedLinear", "PackedW8A8Linear", "concat_in_features", "concat_out_features", "fuse_model", "pack_model",
          "prepare_for_serving")

__all__ = ["NATIVE_LAYOUT_MAX_ROWS", "NATIVE_MAX_ROWS", "PACK_MODES", "can_pack", *_FUSED]


def __getattr__(name: str) -> Any:  # noqa: ANN401 - whichever of fused's names was asked for
    if name in _FUSED:
        from gptj.kernels import fused

        return getattr(fused, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
