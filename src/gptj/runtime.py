"""Small runtime helpers shared by the CLI and the library: dtype and device names."""

from __future__ import annotations

import torch

from gptj.errors import GptjError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise GptjError(f"unknown dtype {name!r} (choose from {', '.join(DTYPE_NAMES)})") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_device(name: str) -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or 'auto' (CUDA when present); an unavailable device is a user error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise GptjError(f"unknown device {name!r} (use cpu, cuda, cuda:N or auto)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GptjError(f"device {name!r} requested but CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise GptjError(f"unsupported device {name!r} (use cpu, cuda, cuda:N or auto)")
    return device
