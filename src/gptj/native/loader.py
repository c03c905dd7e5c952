"""Which native library this process runs, loaded once: chosen for this CPU (gptj.cpu's flags) or by
GPTJ_NATIVE_ISA, built by gptj.native.build, opened with ctypes and its functions bound with their
signatures.

`isa()` is the loaded library's ISA: the best this CPU's flags allow, or GPTJ_NATIVE_ISA's: avx2 (or
avx512) picks that library on a CPU that runs a better one (to measure or test it there), generic the
portable one, on any CPU. `has(kernel)` says whether the library holds a kernel ("gemv", "attention",
"elementwise"); `available()` is true where all of them are; `unavailable_reason()` says why not, in
one line. `load()` returns None, and never raises, when the native path cannot or should not be used:
`GPTJ_NATIVE=0`, a CPU without even AVX2 + FMA, no gcc, or a failed build. The kernels use OpenMP;
built with `-fopenmp` and loaded after torch, whose CPU wheel ships and loads `libgomp.so.1`, they
run on torch's OpenMP runtime and thread pool (the dynamic linker resolves the library's
libgomp.so.1 to the one loaded).

The library's functions, bound by load(), are this module's globals (`BOUND`), which gptj.native.ops
reads at each call: a test that takes the native path away, or loads another ISA's library, resets
them and `_state` here (tests/conftest.py).
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import threading
from pathlib import Path

from gptj import cpu
from gptj.native.build import AVX2_CPU_FLAGS, ISAS, KERNELS, SOURCES, Isa, best_isa, disabled, library_path


_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded CDLL or None, once load() has run

# Bound ctypes functions, set by load(): module globals, which gptj.native.ops reads at each call
# (`loader._gelu`: one lookup, the per-call overhead stays small).
_gemv_int8 = _gemv_bf16 = _gemm_w8a8 = _attend_group = _attend_paged = _prefill_paged = None
_gelu = _rotary = _store_kv = _quantize_rows = _scale_rows = _int4_dequant = _argmax_rows = None
_gemm_int8_amx = _gemm_w8a8_amx = _amx_init = None  # the AVX-512 library's AMX GEMMs (amx.c)
_w8a8_panel = 0  # the loaded library's W8A8 panel width (output channels), 0 before load()
_int8_gemm_rows = 0  # the loaded library's int8 GEMM crossover; 0: it has none (int8_gemm_min_rows)
_gemm_int4 = None  # the loaded library's int4 GEMV (and AVX512-BF16's GEMM), None before a library is bound
_gemm_w4a8 = None  # the loaded library's W4A8 GEMM (w4a8.c), None before a library is bound
_int4_gemm_rows = 0  # their crossover (int4_gemm_min_rows); 0: no GEMM, the GEMV at every row count
# what a test clears (with _state) to take the native path away or load another ISA's library
BOUND = ("_gemv_int8", "_gemv_bf16", "_gemm_w8a8", "_w8a8_panel", "_int8_gemm_rows", "_gemm_int4", "_int4_gemm_rows",
         "_gemm_w4a8", "_attend_group", "_attend_paged", "_prefill_paged", "_gelu", "_rotary", "_store_kv",
         "_quantize_rows", "_scale_rows", "_int4_dequant", "_argmax_rows", "_gemm_int8_amx", "_gemm_w8a8_amx", "_amx_init")


def requested_isa(env: dict[str, str] | os._Environ | None = None) -> tuple[Isa | None, str | None]:
    """(the ISA load() uses, why there is none): GPTJ_NATIVE_ISA's (one of ISAS' names, where this CPU
    runs it: how to run the AVX2 kernels on an AVX-512 machine, as CTranslate2's CT2_FORCE_CPU_ISA
    does), else the best this CPU runs."""
    env = os.environ if env is None else env
    name = env.get("GPTJ_NATIVE_ISA", "").strip().lower()
    if not name:
        return best_isa(), None
    isa = next((i for i in ISAS if i.name == name), None)
    if isa is None:
        return None, f"GPTJ_NATIVE_ISA={name} is not one of {', '.join(i.name for i in ISAS)}"
    missing = [f for f in isa.cpu_flags if f not in cpu.flags()]
    if missing:
        return None, f"the CPU lacks {', '.join(missing)} for GPTJ_NATIVE_ISA={name}"
    return isa, None


_SIGNATURES = {  # the GEMV's exported functions (every ISA): argument types, return type
    "gemv_int8": ([ctypes.c_void_p] * 5 + [ctypes.c_int] * 4, ctypes.c_int),
    "gemv_int8_f32": ([ctypes.c_void_p] * 5 + [ctypes.c_int] * 4, ctypes.c_int),
    "gemv_bf16": ([ctypes.c_void_p] * 4 + [ctypes.c_int] * 4, ctypes.c_int),
    "gemv_bf16_f32": ([ctypes.c_void_p] * 4 + [ctypes.c_int] * 4, ctypes.c_int),
    "gemv_set_tuning": ([ctypes.c_int, ctypes.c_int], None),
    "gemv_set_prefetch_bf16": ([ctypes.c_int], None),
    "gemm_w8a8": ([ctypes.c_void_p] * 6 + [ctypes.c_int] * 5, ctypes.c_int),
    "w8a8_panel": ([], ctypes.c_int),
    "int8_gemm_set_min_rows": ([ctypes.c_int], ctypes.c_int),
    "int4_gemm_set_min_rows": ([ctypes.c_int], ctypes.c_int),
    "gemm_int4": ([ctypes.c_void_p] * 5 + [ctypes.c_int] * 6 + [ctypes.c_long, ctypes.c_int], ctypes.c_int),
    "gemm_int4_available": ([], ctypes.c_int),
    "gemm_w4a8": ([ctypes.c_void_p] * 4 + [ctypes.c_int] * 4 + [ctypes.c_long, ctypes.c_int], ctypes.c_int),
}


def _load_path(path: Path) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(path))
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = restype
        for name in ("gemv_get_prefetch", "gemv_get_prefetch_bf16", "gemv_omp_max_threads"):
            getattr(lib, name).argtypes = []
            getattr(lib, name).restype = ctypes.c_int
        return lib
    except (OSError, AttributeError):
        return None


def _open(env: dict[str, str] | os._Environ | None = None, isa: Isa | None = None) -> ctypes.CDLL | None:
    """Build (if needed) and load the library, uncached; None, never an exception, on failure."""
    try:
        path = library_path(env, isa)
        return _load_path(path) if path is not None else None
    except Exception:  # noqa: BLE001 - the native path is optional: any failure means "not available"
        return None


def open_isa(name: str) -> ctypes.CDLL | None:
    """The library of the ISA `name` (one of ISAS), built if needed, uncached and unbound: how tests
    run an ISA below this CPU's best (the AVX2 kernels on an AVX-512 machine). None where the CPU
    cannot run it or it cannot be built."""
    return _open(isa=next(i for i in ISAS if i.name == name))


def load() -> ctypes.CDLL | None:
    """The library of this CPU's best ISA (built on first use, then cached on disk and in the
    process), or None."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    with _lock:
        if "lib" not in _state:
            chosen = requested_isa()[0]
            lib = _open(isa=chosen) if chosen is not None else None
            if lib is not None:
                try:
                    _bind(lib, chosen)
                except AttributeError:  # a library without its kernels: not the source's build
                    lib = None
            _state["isa"] = chosen if lib is not None else None
            _state["kernels"] = frozenset(chosen.kernels) if lib is not None else frozenset()
            _state["lib"] = lib
    return _state["lib"]  # type: ignore[return-value]


def _bind(lib: ctypes.CDLL, chosen: Isa) -> None:
    global _gemv_int8, _gemv_bf16, _gemm_w8a8, _w8a8_panel, _attend_group, _attend_paged, _prefill_paged, _gelu, _rotary
    global _int8_gemm_rows, _gemm_int4, _int4_gemm_rows, _gemm_w4a8
    global _store_kv, _quantize_rows, _scale_rows, _int4_dequant, _argmax_rows
    global _gemm_int8_amx, _amx_init, _gemm_w8a8_amx
    _gemv_int8 = lib.gemv_int8
    _gemv_bf16 = lib.gemv_bf16
    _gemm_w8a8 = lib.gemm_w8a8
    _w8a8_panel = lib.w8a8_panel()
    _int8_gemm_rows = lib.int8_gemm_set_min_rows(0)  # (0 sets nothing)
    _gemm_int4 = lib.gemm_int4 if lib.gemm_int4_available() else None
    _int4_gemm_rows = lib.int4_gemm_set_min_rows(0)
    _gemm_w4a8 = lib.gemm_w4a8
    if hasattr(lib, "gemm_int8_amx"):  # the AVX-512 library's (amx.c)
        _gemm_int8_amx = lib.gemm_int8_amx
        _gemm_int8_amx.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4
        _gemm_int8_amx.restype = ctypes.c_int
        _amx_init = lib.amx_init
        _amx_init.argtypes = []
        _amx_init.restype = ctypes.c_int
        _gemm_w8a8_amx = lib.gemm_w8a8_amx
        _gemm_w8a8_amx.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
        _gemm_w8a8_amx.restype = ctypes.c_int
    if "attention" not in chosen.kernels:  # a library without them (none of ISAS today)
        return
    _attend_group = lib.attend_group_bf16
    P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    _attend_group.argtypes = [P, I, I, I, P, P, L, L, I, P, P, L, L, L, I, P, ctypes.c_float, I]
    _attend_group.restype = I
    _attend_paged = lib.attend_paged
    _attend_paged.argtypes = [P, I, I, I, I, P, P, P, P, I, I, P, P, P, P, P, I, P, P, P, ctypes.c_float, I]
    _attend_paged.restype = I
    _prefill_paged = lib.prefill_paged
    _prefill_paged.argtypes = [P, L, I, I, I, I, P, P, P, P, I, P, I, P, L, ctypes.c_float, I]
    _prefill_paged.restype = I
    _gelu = lib.gelu_bf16
    _gelu.argtypes = [P, L, P, L, L, L, I]
    _gelu.restype = None
    _rotary = lib.rotary_bf16
    _rotary.argtypes = [P, L, I, I, I, I, P, P, I]
    _rotary.restype = None
    _store_kv = lib.store_kv
    _store_kv.argtypes = [P, L, P, L, I, I, I, P, P, P, P, I, P, P, I]
    _store_kv.restype = None
    _quantize_rows = lib.quantize_rows_u8
    _quantize_rows.argtypes = [P, L, P, P, P, L, L, I]
    _quantize_rows.restype = None
    _scale_rows = lib.scale_rows_bf16
    _scale_rows.argtypes = [P, L, P, P, P, L, L, L, I]
    _scale_rows.restype = None
    _int4_dequant = lib.int4_dequant_t_bf16
    _int4_dequant.argtypes = [P, L, I, I, I, P, P, I, P, L, I]
    _int4_dequant.restype = I
    _argmax_rows = getattr(lib, "argmax_rows_f32", None)  # None: an earlier commit's build (benchmarks' --library)
    if _argmax_rows is not None:
        _argmax_rows.argtypes = [P, L, L, L, P, I]
        _argmax_rows.restype = None


def isa() -> Isa | None:
    """The ISA of the loaded library (None where there is none): GPTJ_NATIVE_ISA's, else the best."""
    load()
    return _state.get("isa")  # type: ignore[return-value]


def amx_available() -> bool:
    """gptj.native's AMX int8 GEMM (amx.c) runs here: the AVX-512 library is loaded, the CPU has AMX's
    bfloat16 tiles (gptj.cpu's flags, so a ceiling below AMX says no) and Linux lets this process use
    them (asked once)."""
    load()
    if _gemm_int8_amx is None or not {"amx_tile", "amx_bf16", "avx512vbmi"} <= cpu.flags():
        return False
    if "amx" not in _state:
        with _lock:
            if "amx" not in _state:
                _state["amx"] = _amx_init() == 0
    return bool(_state["amx"])


def has(kernel: str) -> bool:
    """Whether the loaded library holds `kernel` ("gemv", "attention", "elementwise")."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r} (one of {', '.join(KERNELS)})")
    load()
    return kernel in _state["kernels"]  # set by load(), with the library (the policy asks on every call)


def available() -> bool:
    """Every native kernel is loaded here (a library of either ISA); see `has` for one kind."""
    load()
    return len(_state["kernels"]) == len(KERNELS)


def unavailable_reason(env: dict[str, str] | os._Environ | None = None) -> str | None:
    """Why the native kernels cannot be used here, in one line (None where they can): what
    a skipped test or a log line should say."""
    env = os.environ if env is None else env
    if disabled(env):
        return f"switched off (GPTJ_NATIVE={env.get('GPTJ_NATIVE')})"
    chosen, why = requested_isa(env)
    if why is not None:
        return why
    if chosen is None and platform.machine() not in ("x86_64", "AMD64"):
        return (f"not an x86-64 CPU ({platform.machine()}): torch's kernels run (GPTJ_NATIVE_ISA=generic builds "
                "the portable ones)")
    if chosen is None:  # no ISA of the CPU's flags, none asked for
        capped = f" under ONEDNN_MAX_CPU_ISA={cpu.ceiling().upper()}" if cpu.ceiling() else ""
        missing = [f for f in AVX2_CPU_FLAGS if f not in cpu.flags()]
        return (f"the CPU lacks {', '.join(missing)}{capped} (gptj.native needs AVX2 with FMA and F16C, or AVX-512; "
                "GPTJ_NATIVE_ISA=generic builds the portable kernels)")
    if shutil.which(env.get("CC") or "gcc") is None:
        return f"no C compiler ({env.get('CC') or 'gcc'}) to build {SOURCES[0].parent}"
    if load() is None:
        return f"the kernels in {SOURCES[0].parent} failed to build or load"
    return None


def int8_gemm_min_rows(rows: int | None = None) -> int:
    """The rows of x from which linear_int8 runs the loaded library's int8 GEMM (gemv.c: a register
    tile on bfloat16 dot products, each weight converted once per call) instead of its GEMV; 0 where the
    library has none (only AVX512-BF16's has). `rows` sets it for this process (benchmarks/native_gemv.py
    times both sides of it); the value before is returned. Read without a call into the library: the
    policy asks on every int8 layer's call."""
    return _gemm_min_rows("int8", rows)


def _gemm_min_rows(kind: str, rows: int | None) -> int:
    """int8_gemm_min_rows' and int4_gemm_min_rows': the crossover `kind`'s kernels keep in the library
    and, bound with it, in _int8_gemm_rows or _int4_gemm_rows."""
    name = f"_{kind}_gemm_rows"
    lib = load()
    before = globals()[name]
    if lib is None or not before:
        return 0
    if rows is not None and rows > 0:
        getattr(lib, f"{kind}_gemm_set_min_rows")(rows)
        globals()[name] = rows
    return before


def int4_gemm_min_rows(rows: int | None = None) -> int:
    """The rows of x from which linear_int4 runs the loaded library's int4 GEMM (weights dequantized into
    panels once per call) instead of its int4 GEMV (on the integers, scaled per group); 0 where the
    library has no GEMM (all but AVX512-BF16's: the GEMV at every row count) or none is loaded. `rows`
    sets it for this process (benchmarks/native_gemv.py times both sides of it); the value before is
    returned."""
    return _gemm_min_rows("int4", rows)
