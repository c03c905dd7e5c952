"""Dtype and device names and a host-to-device copy: the small helpers the CLI and the library share.

torch is imported inside the functions so that `gptj --help` starts without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gptj.errors import GptjError

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(name, torch.dtype):
        return name
    canonical = _ALIASES.get(name, name)
    if canonical not in DTYPE_NAMES:
        raise GptjError(f"unknown dtype {name!r} (choose from {', '.join(DTYPE_NAMES)})")
    return getattr(torch, canonical)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def named_device(name: str) -> torch.device:
    """The device `name` names ('cpu', 'cuda', 'cuda:N'; 'auto': CUDA when present here), checked as a
    name only: a CUDA device may be a Ray node's, not this machine's."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise GptjError(f"unknown device {name!r} (use cpu, cuda, cuda:N or auto)") from None
    if device.type not in ("cpu", "cuda"):
        raise GptjError(f"unsupported device {name!r} (use cpu, cuda, cuda:N or auto)")
    return device


def resolve_device(name: str) -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or 'auto' (CUDA when present); an unavailable device is a user error."""
    import torch

    device = named_device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GptjError(f"device {name!r} requested but CUDA is not available on this machine")
    return device


def rank_device(name: str, local_rank: int) -> str:
    """The device `name` means on the rank of a job whose index on its machine is `local_rank`:
    cuda -> cuda:local_rank (one GPU per rank); cpu stays cpu."""
    return f"cuda:{local_rank}" if name.startswith("cuda") else name


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`, without making the host wait for the device: how the engine's step
    moves host data to a GPU (tests/test_step_syncs.py holds it to that).

    On CUDA a copy from ordinary (pageable) memory is staged by the driver and may stall the host;
    a blocking one, as torch.tensor(x, device=) and .to(device) make, first waits for every kernel
    already queued (a replayed decode graph: most of a step). From pinned memory a non_blocking copy
    is queued on the stream like a kernel and the call returns at once. The pinned copy need not be
    kept alive here: pin_memory() takes it from PyTorch's caching host allocator, which records the
    copy's stream on the block and does not hand the block out again until that copy has completed.
    Elsewhere a plain .to (on a CPU, the tensor itself)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


# FP8 matrix units (torch._scaled_mm with e4m3): compute capability 8.9 (Ada) and 9.0 (Hopper) on.
FP8_MIN_CAPABILITY = (8, 9)


def fp8_supported(device: torch.device | str) -> bool:
    """Whether `device` has FP8 matrix units (a CUDA GPU of compute capability 8.9 or more)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def check_w4a8_device(device: torch.device | str) -> None:
    """GptjError, in one line, unless W4A8 runs on `device`: a CPU (gptj.native's integer GEMM; elsewhere
    only its float32 emulation, for checks)."""
    import torch

    device = torch.device(device)
    if device.type != "cpu":
        raise GptjError(f"w4a8 runs on CPUs (gptj.native's integer GEMM); this runs on {device.type} "
                        "(use --quantize int4: the same weights)")


def check_fp8_device(device: torch.device | str) -> None:
    """GptjError, in one line, unless FP8 weights run on `device` (what every command that
    generates checks before loading them)."""
    import torch

    if fp8_supported(device):
        return
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        where = f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}"
    else:
        where = f"this runs on {device.type}"
    raise GptjError(f"fp8 weights need a GPU with FP8 matrix units (compute capability "
                    f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} or more: Ada, Hopper); {where} "
                    "(use --quantize int8, int4 or w8a8)")
