"""Finite values: the one finiteness check of everything gptj loads (a checkpoint's tensors, a LoRA
adapter's, a slim checkpoint's pieces), and of what it writes."""

from __future__ import annotations

import torch

from gptj.errors import CheckpointError


def all_finite(tensor: torch.Tensor) -> bool:
    """True if no element is NaN or infinite.

    A sum is non-finite exactly when an element is (NaN and inf propagate) or the sum overflows,
    and summing is ~30x faster than torch.isfinite on CPU (0.02 s vs 0.7 s for 64M bf16 values),
    which matters for 6B parameters. Only when the sum is not finite do we look element by element.
    """
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    if bool(torch.isfinite(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())  # an overflowing sum of finite values is still fine


def check_finite(tensor: torch.Tensor, name: str, file: object) -> None:
    """CheckpointError naming `file` and tensor `name` unless every value of `tensor` is finite: the one
    finiteness check of everything gptj loads (a checkpoint's tensors, a LoRA adapter's)."""
    if not all_finite(tensor):
        raise CheckpointError(f"{file}: tensor {name} has NaN or infinite values")
