"""Native matrix x few-rows kernels (decode GEMV) for x86-64 CPUs with AVX-512, built at first use.

torch's CPU kernels leave a lot of memory bandwidth unused when a linear layer sees one row (one
decode step): `torch._weight_int8pack_mm` reaches about 12 GB/s on a 7168 x 1024 int8 weight and
oneDNN's packed bfloat16 about 23 GB/s, on a machine that streams 35+ GB/s. `gemv.c` (next to
this file) streams the weight once per call with AVX512-BF16 products and float32 accumulation.

`load()` compiles `gemv.c` with gcc the first time it is needed, into a cache folder
(`$GPTJ_CACHE_DIR`, else `~/.cache/gptj/native/`) under a name that hashes the source, the flags
and the machine type, and loads it with ctypes. It returns None, and never raises, when the native
path cannot or should not be used: `GPTJ_NATIVE=0`, a CPU without AVX-512 F/BW/VL/BF16, no gcc,
or a failed build. The kernels use OpenMP; built with `-fopenmp` and loaded after torch, whose
CPU wheel ships and loads `libgomp.so.1`, they run on torch's OpenMP runtime and thread pool.

    from gptj import native
    if native.available():
        y = native.linear_int8(x, w_int8, scale)   # x (..., K) bf16, w (N, K) int8, scale (N,) bf16
        y = native.linear_bf16(x, w, bias)         # x (..., K) bf16, w (N, K) bf16
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["available", "linear_bf16", "linear_int8", "load"]

SOURCE = Path(__file__).with_name("gemv.c")
CFLAGS = ("-O3", "-march=native", "-std=c11", "-fopenmp", "-shared", "-fPIC")
# What the kernels execute; `-march=native` may use more, but only on the CPU that built it (the
# cache name holds the CPU's flags, so another CPU type builds its own copy).
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded CDLL or None, once load() has run


def _cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _disabled(env: dict[str, str] | os._Environ | None = None) -> bool:
    value = (os.environ if env is None else env).get("GPTJ_NATIVE", "").strip().lower()
    return value in ("0", "false", "no", "off")


def cache_dir(env: dict[str, str] | os._Environ | None = None) -> Path:
    env = os.environ if env is None else env
    base = env.get("GPTJ_CACHE_DIR")
    return Path(base) if base else Path.home() / ".cache" / "gptj" / "native"


def _library_name(source: bytes, compiler: str, flags: set[str]) -> str:
    h = hashlib.sha256()
    for part in (source, " ".join(CFLAGS).encode(), compiler.encode(), platform.machine().encode(),
                 " ".join(sorted(flags)).encode()):
        h.update(part)
        h.update(b"\0")
    return f"gemv-{platform.machine()}-{h.hexdigest()[:16]}.so"


def _compiler_id(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else cc
    except (OSError, subprocess.SubprocessError):
        return cc


def _build(env: dict[str, str] | os._Environ | None = None) -> Path | None:
    """The path of the compiled library (building it if needed), or None."""
    env = os.environ if env is None else env
    if _disabled(env) or platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = _cpu_flags()
    if not all(f in flags for f in REQUIRED_CPU_FLAGS):
        return None
    cc = env.get("CC") or "gcc"
    cc_path = shutil.which(cc)
    if cc_path is None:
        return None
    source = SOURCE.read_bytes()
    folder = cache_dir(env)
    target = folder / _library_name(source, _compiler_id(cc_path), flags)
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=folder)
    os.close(fd)
    try:
        proc = subprocess.run([cc_path, *CFLAGS, "-o", tmp, str(SOURCE)],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            return None
        os.replace(tmp, target)  # atomic: a concurrent loader sees the old state or the whole file
        return target
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_SIGNATURES = {
    # name: argument types after the pointer arguments' count
    "gemv_int8": [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4,
    "gemv_int8_f32": [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4,
    "gemv_bf16": [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4,
    "gemv_bf16_f32": [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4,
    "gemv_set_tuning": [ctypes.c_int, ctypes.c_int],
}


def _load_path(path: Path) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = None
        lib.gemv_get_prefetch.restype = ctypes.c_int
        lib.gemv_get_prefetch.argtypes = []
        lib.gemv_omp_max_threads.restype = ctypes.c_int
        lib.gemv_omp_max_threads.argtypes = []
        return lib
    except (OSError, AttributeError):
        return None


def load() -> ctypes.CDLL | None:
    """The kernels' library (built on first use, then cached on disk and in the process), or None."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    with _lock:
        if "lib" not in _state:
            lib = None
            try:
                path = _build()
                lib = _load_path(path) if path is not None else None
            except Exception:  # noqa: BLE001 - the native path is optional: any failure means "not available"
                lib = None
            _state["lib"] = lib
            if lib is not None:
                _bind(lib)
    return _state["lib"]  # type: ignore[return-value]


def available() -> bool:
    return load() is not None


# Bound ctypes functions, set by load(): module globals keep the per-call overhead small.
_gemv_int8 = _gemv_bf16 = None


def _bind(lib: ctypes.CDLL) -> None:
    global _gemv_int8, _gemv_bf16
    _gemv_int8 = lib.gemv_int8
    _gemv_bf16 = lib.gemv_bf16


def _check_x(x: torch.Tensor, K: int, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: x must be a tensor")
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError(f"{name}: x must be a bfloat16 CPU tensor, got {x.dtype} on {x.device}")
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"{name}: x must have shape (..., {K}), got {tuple(x.shape)}")
    return x if x.is_contiguous() else x.contiguous()


def _check_vec(v: torch.Tensor | None, N: int, what: str, name: str) -> None:
    if v is None:
        return
    if not isinstance(v, torch.Tensor) or v.dtype != torch.bfloat16 or v.device.type != "cpu":
        raise ValueError(f"{name}: {what} must be a bfloat16 CPU tensor")
    if v.shape != (N,) or not v.is_contiguous():
        raise ValueError(f"{name}: {what} must be contiguous with shape ({N},), got {tuple(v.shape)}")


def _check_w(w: torch.Tensor, dtype: torch.dtype, name: str) -> tuple[int, int]:
    if not isinstance(w, torch.Tensor) or w.dtype != dtype or w.device.type != "cpu":
        raise ValueError(f"{name}: weight must be a {dtype} CPU tensor")
    if w.dim() != 2 or not w.is_contiguous():
        raise ValueError(f"{name}: weight must be a contiguous (N, K) matrix, got {tuple(w.shape)}")
    return w.shape[0], w.shape[1]


def _lib_or_raise(name: str) -> None:
    if load() is None:
        raise RuntimeError(f"{name}: the native kernels are not available on this machine")


def linear_int8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """bfloat16(x @ (weight * scale[:, None]).T + bias) with float32 accumulation.

    x (..., K) bfloat16; weight (N, K) int8 (per-output-channel symmetric); scale (N,) bfloat16;
    bias (N,) bfloat16 or None. Returns (..., N) bfloat16.
    """
    if _gemv_int8 is None:
        _lib_or_raise("linear_int8")
    N, K = _check_w(weight, torch.int8, "linear_int8")
    x = _check_x(x, K, "linear_int8")
    _check_vec(scale, N, "scale", "linear_int8")
    if scale is None:
        raise ValueError("linear_int8: scale is required")
    _check_vec(bias, N, "bias", "linear_int8")
    M = 1
    for d in x.shape[:-1]:
        M *= d
    y = torch.empty((*x.shape[:-1], N), dtype=torch.bfloat16)
    if M and N:
        _gemv_int8(x.data_ptr(), weight.data_ptr(), scale.data_ptr(),
                   None if bias is None else bias.data_ptr(), y.data_ptr(),
                   M, N, K, torch.get_num_threads())
    return y


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """bfloat16(x @ weight.T + bias) with float32 accumulation.

    x (..., K) bfloat16; weight (N, K) bfloat16; bias (N,) bfloat16 or None. Returns (..., N).
    """
    if _gemv_bf16 is None:
        _lib_or_raise("linear_bf16")
    N, K = _check_w(weight, torch.bfloat16, "linear_bf16")
    x = _check_x(x, K, "linear_bf16")
    _check_vec(bias, N, "bias", "linear_bf16")
    M = 1
    for d in x.shape[:-1]:
        M *= d
    y = torch.empty((*x.shape[:-1], N), dtype=torch.bfloat16)
    if M and N:
        _gemv_bf16(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                   y.data_ptr(), M, N, K, torch.get_num_threads())
    return y
