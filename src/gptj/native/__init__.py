"""Native CPU kernels, built at first use, one library per instruction set (ISA).

    ISA           CPUs                                   arithmetic
    avx512-bf16   AVX-512 F/BW/VL with BF16 and VNNI     bfloat16 dot products (vdpbf16ps), int16 ones
    avx512        AVX-512 F/BW/VL/DQ without BF16        as avx2, 16 lanes (Skylake-SP, Cascade Lake, Ice Lake)
    avx2          AVX2 + FMA + F16C (Zen 2/3, Haswell…)  float32 FMAs on bfloat16 / int8 widened, int16 pairs
    generic       any CPU gcc targets (ARM's NEON…)      as avx2, in portable C (GCC's vector extensions);
                                                         only when asked for: GPTJ_NATIVE_ISA=generic

Each library holds every kernel: the decode GEMV, paged decode and prefill attention, the elementwise
passes. The AVX-512 one also holds amx.c's int8 and W8A8 GEMMs on AMX's tiles, compiled for AMX
whatever the building CPU and used only where the CPU has AMX and Linux grants the tiles
(`amx_available`). The same C sources are compiled per ISA: the vector layer (simd.h, and one file
per ISA: simd_avx512.h, simd_avx2.h, simd_generic.h) is where the instruction set shows, plus the
GEMV's and attention's bfloat16 dot-product sections for AVX512-BF16 (`HAVE_DP`). `isa()` is the best
ISA this CPU's flags allow (gptj.cpu, so ONEDNN_MAX_CPU_ISA's ceiling applies); `has(kernel)` says
whether its library holds a kernel ("gemv", "attention", "elementwise"); `available()` is true where
all of them are. GPTJ_NATIVE_ISA=avx2 (or avx512) picks that library on a CPU that runs a better one
(to measure or test it there); GPTJ_NATIVE_ISA=generic the portable one, on any CPU. The generic library
is never chosen on its own: on x86-64 it is what an AVX2 CPU runs, less the instructions, and where
it would be the only one (ARM, which cannot be tested or timed here) torch's kernels stay the
default until it has been measured against them there.

torch's CPU kernels leave much of the memory bandwidth unused when a linear layer sees one row (a
decode step): `torch._weight_int8pack_mm` reads a 7168 x 1024 int8 weight at about 12 GB/s and
oneDNN's packed bfloat16 kernel about 16-23 GB/s, on a machine whose streaming read (torch.sum)
does 30-50 GB/s. `gemv.c` (next to this file) reads each weight once per call, sequentially, with
software prefetch, at about the streaming rate for one row (benchmarks/native_gemv.py measures
it): float32 FMAs (int8, one row of x) or AVX512-BF16 dot products, float32 accumulation, x used
as given (never quantized).

`load()` compiles the ISA's C files (simd.h and simd_*.h their shared helpers) with gcc the first time
it is needed, into a cache folder (`$GPTJ_CACHE_DIR`, else `~/.cache/gptj/native/`; a temporary folder if
that cannot be written) under a name that hashes the sources, the ISA and its flags, the compiler,
the machine type and, for the library compiled for this CPU (-march=native), the CPU's flags. It
writes it atomically, one process at a time (the others that need it wait on a lock on the folder,
then load the one built), and loads it with ctypes. It returns
None, and never raises, when the native path cannot or should not be used: `GPTJ_NATIVE=0`, a CPU
without even AVX2 + FMA, no gcc, or a failed build. The kernels use OpenMP; built with `-fopenmp` and loaded
after torch, whose CPU wheel ships and loads `libgomp.so.1`, they run on torch's OpenMP runtime
and thread pool (the dynamic linker resolves the library's libgomp.so.1 to the one loaded).

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
from dataclasses import dataclass
from pathlib import Path

import torch

from gptj import cpu

__all__ = ["ISAS", "Isa", "amx_available", "argmax_rows", "attention_group", "attention_paged", "available",
           "best_isa", "gelu", "has", "int4_dequant_t", "int4_gemm_available", "int4_gemm_min_rows",
           "int8_gemm_min_rows", "isa",
           "linear_bf16", "linear_int4", "linear_int8", "linear_int8_amx", "linear_w8a8", "linear_w8a8_amx", "load",
           "open_isa", "pack_w8a8", "prefill_paged", "quantize_rows_u8", "requested_isa", "rotary_", "scale_rows",
           "store_kv", "unavailable_reason"]

HERE = Path(__file__).parent
SOURCES = tuple(HERE / name for name in ("gemv.c", "attention.c", "elementwise.c"))  # one library
HEADERS = tuple(HERE / name for name in ("simd.h", "simd_avx512.h", "simd_avx2.h", "simd_generic.h"))  # what
# the sources include: part of what the build's name hashes
# -falign-loops=64: every loop starts on a cache line. Without it the GEMV's hot loops ran 10-20 %
# slower once the kernels were split into three files (int8 at 8 rows, 2 threads: 3.8 against 3.0 ms
# for 28672 x 4096; the same code, placed elsewhere), and as fast with it as the single file was.
CFLAGS = ("-O3", "-falign-loops=64", "-std=c11", "-fopenmp", "-shared", "-fPIC", "-lm")
# What the AVX-512 kernels execute (gptj.cpu's avx512-bf16 kind); `-march=native` may use more, but only
# on the CPU that built it (the cache name holds the CPU's flags, so another CPU type builds its own copy).
# gptj.cpu.flags() is what is checked: a ceiling set by ONEDNN_MAX_CPU_ISA switches these kernels off.
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni")
AVX512_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c")  # gptj.cpu's avx512 kinds
AVX2_CPU_FLAGS = ("avx2", "fma", "f16c")
KERNELS = ("gemv", "attention", "elementwise")


@dataclass(frozen=True)
class Isa:
    """One library's instruction set: the CPU flags it needs, how it is compiled, what it holds."""

    name: str
    cpu_flags: tuple[str, ...]
    cflags: tuple[str, ...]  # beside CFLAGS
    sources: tuple[Path, ...]
    kernels: tuple[str, ...]
    auto: bool = True  # chosen from the CPU's flags; False: only by GPTJ_NATIVE_ISA


# Best first. The AVX2 and AVX-512 libraries are built for their flags alone (-mavx2 / -mavx512f..., not
# -march=native): on a better CPU they run the code a CPU of their kind runs (how their tests run there).
ISAS = (
    Isa("avx512-bf16", REQUIRED_CPU_FLAGS, ("-march=native", "-DGPTJ_ISA_AVX512"), (*SOURCES, HERE / "amx.c"),
        KERNELS),
    # AVX-512 without BF16 (Intel Skylake-SP, Cascade Lake, Ice Lake): simd_avx512.h's layer, HAVE_DP 0
    Isa("avx512", AVX512_CPU_FLAGS, ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
                                     "-mtune=native", "-DGPTJ_ISA_AVX512"), SOURCES, KERNELS),
    Isa("avx2", AVX2_CPU_FLAGS, ("-mavx2", "-mfma", "-mf16c", "-mtune=native", "-DGPTJ_ISA_AVX2"), SOURCES,
        KERNELS),
    # the target's baseline (no -m flags): SSE2 on x86-64, NEON on AArch64; -ffp-contract=fast: a * b + c
    # becomes an FMA where the target has one (GCC contracts nothing under -std=c11 otherwise)
    Isa("generic", (), ("-ffp-contract=fast", "-Wno-psabi", "-DGPTJ_ISA_GENERIC"), SOURCES, KERNELS, auto=False),
)


def best_isa(flags: set[str] | frozenset[str] | None = None) -> Isa | None:
    """The best ISA a CPU with `flags` (default: this one's, ceilings applied) runs, or None."""
    flags = cpu.flags() if flags is None else flags
    return next((i for i in ISAS if i.auto and all(f in flags for f in i.cpu_flags)), None)


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

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded CDLL or None, once load() has run


def _disabled(env: dict[str, str] | os._Environ | None = None) -> bool:
    value = (os.environ if env is None else env).get("GPTJ_NATIVE", "").strip().lower()
    return value in ("0", "false", "no", "off")


def cache_dir(env: dict[str, str] | os._Environ | None = None) -> Path:
    env = os.environ if env is None else env
    base = env.get("GPTJ_CACHE_DIR")
    return Path(base) if base else Path.home() / ".cache" / "gptj" / "native"


def _source_bytes(isa: Isa = ISAS[0]) -> bytes:
    return b"\0".join(p.read_bytes() for p in (*isa.sources, *HEADERS) if p.exists())


def _library_name(source: bytes, compiler: str, flags: set[str], isa: Isa = ISAS[0]) -> str:
    h = hashlib.sha256()
    for part in (source, " ".join((*CFLAGS, *isa.cflags)).encode(), compiler.encode(), platform.machine().encode(),
                 " ".join(sorted(flags)).encode()):
        h.update(part)
        h.update(b"\0")
    return f"gptj-{isa.name}-{platform.machine()}-{h.hexdigest()[:16]}.so"


def _build_flags(isa: Isa) -> frozenset[str]:
    """What a build depends on of the CPU building it: its flags as /proc/cpuinfo lists them where the
    ISA compiles for that CPU (-march=native: the compiler reads the real CPU, whatever a ceiling or a
    test's fake says), none for a fixed instruction set, whose library is the same on every CPU (so a
    capped or faked CPU kind reuses it instead of building it again: 7-9 s a kind in tests/test_cpu.py)."""
    return cpu.read_flags() if "-march=native" in isa.cflags else frozenset()


def _compiler_id(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else cc
    except (OSError, subprocess.SubprocessError):
        return cc


def _compile(cc: str, target: Path, isa: Isa = ISAS[0]) -> bool:
    """Compile the ISA's sources into target: into a temporary file beside it, then renamed into
    place (atomic: a concurrent process sees no file or the whole file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *CFLAGS, *isa.cflags, "-o", tmp, *map(str, isa.sources)],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            return False
        os.replace(tmp, target)
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build(env: dict[str, str] | os._Environ | None = None, isa: Isa | None = None) -> Path | None:
    """The path of the compiled library of `isa` (default: the best this CPU runs), building it if
    needed, or None where the native kernels are switched off (GPTJ_NATIVE=0), cannot run here or
    cannot be built."""
    env = os.environ if env is None else env
    if _disabled(env):
        return None
    flags = cpu.flags()  # empty off x86-64: there only the generic library, when asked for
    isa = best_isa(flags) if isa is None else isa
    if isa is None or not all(f in flags for f in isa.cpu_flags):
        return None
    cc_path = shutil.which(env.get("CC") or "gcc")
    if cc_path is None:
        return None
    name = _library_name(_source_bytes(isa), _compiler_id(cc_path), _build_flags(isa), isa)
    folders = [cache_dir(env), Path(tempfile.gettempdir()) / f"gptj-native-{os.getuid()}"]
    for folder in folders:  # the second where the cache folder cannot be written
        target = folder / name
        if target.exists():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with _folder_lock(folder):  # one build at a time: the others wait, then find its library
                if target.exists():
                    return target
                return target if _compile(cc_path, target, isa) else None
        except OSError:
            continue
    return None


class _folder_lock:
    """An exclusive flock on the cache folder while a library is built in it, so that processes
    starting together (pytest-xdist's workers, torchrun's ranks) compile it once, not once each.
    Where flock is missing (not POSIX) it locks nothing: each process then builds its own copy and
    the atomic rename keeps whichever lands last, as before."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.fd: int | None = None

    def __enter__(self) -> None:
        try:
            import fcntl
        except ImportError:
            return
        self.fd = os.open(self.folder, os.O_RDONLY)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor of the open file releases its lock


_SIGNATURES = {  # the GEMV's exported functions (every ISA): argument types, return type
    "gemv_int8": ([ctypes.c_void_p] * 5 + [ctypes.c_int] * 4, ctypes.c_int),
    "gemv_int8_f32": ([ctypes.c_void_p] * 5 + [ctypes.c_int] * 4, ctypes.c_int),
    "gemv_bf16": ([ctypes.c_void_p] * 4 + [ctypes.c_int] * 4, ctypes.c_int),
    "gemv_bf16_f32": ([ctypes.c_void_p] * 4 + [ctypes.c_int] * 4, ctypes.c_int),
    "gemv_set_tuning": ([ctypes.c_int, ctypes.c_int], None),
    "gemm_w8a8": ([ctypes.c_void_p] * 6 + [ctypes.c_int] * 5, ctypes.c_int),
    "w8a8_panel": ([], ctypes.c_int),
    "int8_gemm_set_min_rows": ([ctypes.c_int], ctypes.c_int),
    "int4_gemm_set_min_rows": ([ctypes.c_int], ctypes.c_int),
    "gemm_int4": ([ctypes.c_void_p] * 5 + [ctypes.c_int] * 6 + [ctypes.c_long, ctypes.c_int], ctypes.c_int),
    "gemm_int4_available": ([], ctypes.c_int),
}


def _load_path(path: Path) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(path))
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = restype
        for name in ("gemv_get_prefetch", "gemv_omp_max_threads"):
            getattr(lib, name).argtypes = []
            getattr(lib, name).restype = ctypes.c_int
        return lib
    except (OSError, AttributeError):
        return None


def _open(env: dict[str, str] | os._Environ | None = None, isa: Isa | None = None) -> ctypes.CDLL | None:
    """Build (if needed) and load the library, uncached; None, never an exception, on failure."""
    try:
        path = _build(env, isa)
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
    if _disabled(env):
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


# Bound ctypes functions, set by load(): module globals keep the per-call overhead small.
_gemv_int8 = _gemv_bf16 = _gemm_w8a8 = _attend_group = _attend_paged = _prefill_paged = None
_gelu = _rotary = _store_kv = _quantize_rows = _scale_rows = _int4_dequant = _argmax_rows = None
_gemm_int8_amx = _gemm_w8a8_amx = _amx_init = None  # the AVX-512 library's AMX GEMMs (amx.c)
_w8a8_panel = 0  # the loaded library's W8A8 panel width (output channels), 0 before load()
_int8_gemm_rows = 0  # the loaded library's int8 GEMM crossover; 0: it has none (int8_gemm_min_rows)
_gemm_int4 = None  # the loaded library's int4 GEMV (and AVX512-BF16's GEMM), None before a library is bound
_int4_gemm_rows = 0  # their crossover (int4_gemm_min_rows); 0: no GEMM, the GEMV at every row count
# what a test clears to take the native path away
BOUND = ("_gemv_int8", "_gemv_bf16", "_gemm_w8a8", "_w8a8_panel", "_int8_gemm_rows", "_gemm_int4", "_int4_gemm_rows",
         "_attend_group",
         "_attend_paged", "_prefill_paged", "_gelu", "_rotary", "_store_kv", "_quantize_rows", "_scale_rows",
         "_int4_dequant", "_argmax_rows", "_gemm_int8_amx", "_gemm_w8a8_amx", "_amx_init")


def _bind(lib: ctypes.CDLL, chosen: Isa) -> None:
    global _gemv_int8, _gemv_bf16, _gemm_w8a8, _w8a8_panel, _attend_group, _attend_paged, _prefill_paged, _gelu, _rotary
    global _int8_gemm_rows, _gemm_int4, _int4_gemm_rows
    global _store_kv, _quantize_rows, _scale_rows, _int4_dequant, _argmax_rows
    global _gemm_int8_amx, _amx_init, _gemm_w8a8_amx
    _gemv_int8 = lib.gemv_int8
    _gemv_bf16 = lib.gemv_bf16
    _gemm_w8a8 = lib.gemm_w8a8
    _w8a8_panel = lib.w8a8_panel()
    _int8_gemm_rows = lib.int8_gemm_set_min_rows(0)  # (0 sets nothing)
    _gemm_int4 = lib.gemm_int4 if lib.gemm_int4_available() else None
    _int4_gemm_rows = lib.int4_gemm_set_min_rows(0)
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
    _attend_paged.argtypes = [P, I, I, I, P, P, P, P, I, I, P, P, P, P, P, I, P, P, ctypes.c_float, I]
    _attend_paged.restype = I
    _prefill_paged = lib.prefill_paged
    _prefill_paged.argtypes = [P, L, I, I, I, P, P, P, P, I, P, I, P, L, ctypes.c_float, I]
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


_MAX_DIM = 2**31 - 1
_bf16 = torch.bfloat16
_i8 = torch.int8


def _bad(name: str, what: str) -> ValueError:
    return ValueError(f"{name}: {what}")


def _check_vec(v: torch.Tensor, N: int, what: str, name: str) -> None:
    if not isinstance(v, torch.Tensor) or v.dtype is not _bf16 or not v.is_cpu:
        raise _bad(name, f"{what} must be a bfloat16 CPU tensor")
    if v.shape != (N,) or not v.is_contiguous():
        raise _bad(name, f"{what} must be contiguous with shape ({N},), got {tuple(v.shape)}")


def _prepare(name: str, x: torch.Tensor, weight: torch.Tensor, wdtype: torch.dtype,
             bias: torch.Tensor | None, out: torch.Tensor | None
             ) -> tuple[torch.Tensor, int, int, int, torch.Tensor]:
    """Validated (contiguous x, M, N, K, output) for x (..., K) @ weight (N, K).T."""
    try:
        if weight.dtype is not wdtype or not weight.is_cpu:
            raise _bad(name, f"weight must be a {wdtype} CPU tensor")
        wshape = weight.shape
        if len(wshape) != 2 or not weight.is_contiguous():
            raise _bad(name, f"weight must be a contiguous (N, K) matrix, got shape {tuple(wshape)}")
        if x.dtype is not _bf16 or not x.is_cpu:
            raise _bad(name, "x must be a bfloat16 CPU tensor")
        xshape = x.shape
    except AttributeError:
        raise _bad(name, "x and weight must be tensors") from None
    N, K = wshape
    if not xshape or xshape[-1] != K:
        raise _bad(name, f"x must have shape (..., {K}), got {tuple(xshape)}")
    if not x.is_contiguous():
        x = x.contiguous()
    if bias is not None:
        _check_vec(bias, N, "bias", name)
    lead = xshape[:-1]
    M = x.numel() // K if K else lead.numel()
    if M > _MAX_DIM or N > _MAX_DIM or K > _MAX_DIM:
        raise _bad(name, "dimensions must be below 2**31")
    if out is None:
        return x, M, N, K, torch.empty((*lead, N), dtype=_bf16)
    if (not isinstance(out, torch.Tensor) or out.dtype is not _bf16 or not out.is_cpu
            or not out.is_contiguous() or out.shape != (*lead, N)):
        raise _bad(name, f"out must be a contiguous bfloat16 CPU tensor of shape {(*lead, N)}")
    return x, M, N, K, out


def _lib_or_raise(name: str, kernel: str = "gemv") -> None:
    if not has(kernel):
        raise RuntimeError(f"{name}: the native {kernel} kernels are not available on this machine")


def linear_int8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """bfloat16(x @ (weight * scale[:, None]).T + bias), float32 accumulation (scale applied to the sums).

    x (..., K) bfloat16; weight (N, K) int8 (per-output-channel symmetric); scale (N,) bfloat16;
    bias (N,) bfloat16 or None. Returns (..., N) bfloat16: `out` when given (it must not overlap
    the inputs; reusing one spares an allocation per call). Uses torch.get_num_threads() threads.
    """
    if _gemv_int8 is None:
        _lib_or_raise("linear_int8")
    x, M, N, K, y = _prepare("linear_int8", x, weight, _i8, bias, out)
    _check_vec(scale, N, "scale", "linear_int8")
    if M and N and _gemv_int8(x.data_ptr(), weight.data_ptr(), scale.data_ptr(),
                              None if bias is None else bias.data_ptr(), y.data_ptr(),
                              M, N, K, torch.get_num_threads()):
        raise MemoryError("linear_int8: no memory for the kernel's copy of x")
    return y


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


AMX_K_MULTIPLE = 64  # the AMX GEMM converts its weight 64 inputs at a time (amx.c)


def linear_int8_amx(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """linear_int8's formula on AMX's tiles (amx.c): float32 sums of the same products, added 32 at a
    time, then scaled, biased and rounded once. K must be a multiple of AMX_K_MULTIPLE; `amx_available()`
    says whether it runs here."""
    if not amx_available():
        raise RuntimeError("linear_int8_amx: gptj.native's AMX kernel is not available on this machine")
    x, M, N, K, y = _prepare("linear_int8_amx", x, weight, _i8, bias, out)
    _check_vec(scale, N, "scale", "linear_int8_amx")
    if K % AMX_K_MULTIPLE:
        raise _bad("linear_int8_amx", f"K = {K} is not a multiple of {AMX_K_MULTIPLE}")
    if M and N and _gemm_int8_amx(x.data_ptr(), weight.data_ptr(), scale.data_ptr(),
                                  None if bias is None else bias.data_ptr(), y.data_ptr(),
                                  M, N, K, torch.get_num_threads()):
        raise MemoryError("linear_int8_amx: no memory for x's tile layout")
    return y


def linear_w8a8_amx(qu: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """W8A8's integer sums on AMX's tiles (amx.c's gemm_w8a8_amx, tdpbssd: exact int32), times
    weight_scale, in float32: qu (M, K) uint8, q + 128 as quantize_rows_u8 writes it; weight (N, K)
    int8; weight_scale (N,) float32. Returns (M, N) float32: what oneDNN's u8 x s8 GEMM returns for
    the same operands (PackedW8A8Linear's SHIFTED form), bit for bit. K a multiple of AMX_K_MULTIPLE."""
    if not amx_available():
        raise RuntimeError("linear_w8a8_amx: gptj.native's AMX kernels are not available on this machine")
    if qu.dtype is not torch.uint8 or qu.dim() != 2 or not qu.is_contiguous():
        raise _bad("linear_w8a8_amx", "qu must be a contiguous uint8 (M, K) tensor")
    if weight.dtype is not _i8 or weight.dim() != 2 or not weight.is_contiguous() or weight.shape[1] != qu.shape[1]:
        raise _bad("linear_w8a8_amx", f"weight must be a contiguous int8 (N, {qu.shape[1]}) tensor")
    M, K = qu.shape
    N = weight.shape[0]
    if weight_scale.dtype is not torch.float32 or weight_scale.shape != (N,) or not weight_scale.is_contiguous():
        raise _bad("linear_w8a8_amx", f"weight_scale must be a contiguous float32 ({N},) tensor")
    if K % AMX_K_MULTIPLE:
        raise _bad("linear_w8a8_amx", f"K = {K} is not a multiple of {AMX_K_MULTIPLE}")
    y = torch.empty(M, N)
    if M and N and _gemm_w8a8_amx(qu.data_ptr(), weight.data_ptr(), weight_scale.data_ptr(), y.data_ptr(),
                                  M, N, K, torch.get_num_threads()):
        raise MemoryError("linear_w8a8_amx: no memory for x's tile layout")
    return y


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """bfloat16(x @ weight.T + bias) with float32 accumulation.

    x (..., K) bfloat16; weight (N, K) bfloat16; bias (N,) bfloat16 or None. Returns (..., N)
    bfloat16: `out` when given (as in linear_int8). Uses torch.get_num_threads() threads.
    """
    if _gemv_bf16 is None:
        _lib_or_raise("linear_bf16")
    x, M, N, K, y = _prepare("linear_bf16", x, weight, _bf16, bias, out)
    if M and N and _gemv_bf16(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                              y.data_ptr(), M, N, K, torch.get_num_threads()):
        raise MemoryError("linear_bf16: no memory for x's float32 copy")
    return y


W8A8_MAX_K = 131072  # int32 sums of int8 x int8 products stay exact up to this many terms (gemv.c)


def pack_w8a8(weight: torch.Tensor) -> torch.Tensor:
    """W8A8's int8 weight (N, K) in the loaded library's packed layout for linear_w8a8: panels of P
    output channels (P = 16 for AVX2, 32 for AVX-512), each pair of inputs' weights side by side,
    zeros past N and K: shape (ceil(N / P), ceil(K / 2), P, 2), int8. A pure rearrangement: the same
    bytes (N x K of them) plus the padding."""
    if _gemm_w8a8 is None:
        _lib_or_raise("pack_w8a8")
    if weight.dtype is not _i8 or weight.dim() != 2:
        raise _bad("pack_w8a8", "weight must be an int8 (N, K) tensor")
    N, K = weight.shape
    P = _w8a8_panel
    padded = torch.nn.functional.pad(weight.cpu(), (0, K % 2, 0, -N % P))
    return padded.view(-(-N // P), P, (K + 1) // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear_w8a8(qu: torch.Tensor, row_scale: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, dtype: torch.dtype = _bf16) -> torch.Tensor:
    """W8A8's linear: (int32 sums of q x weight, exact) * weight_scale * row_scale, then `dtype`
    (bfloat16: rounded, then + bias rounded again; float32: + bias), W8A8Linear's numbers, at any rows.

    qu (M, K) uint8, q + 128 (quantize_rows_u8's form); row_scale (M, 1) float32; packed: the int8
    weight (N, K) as pack_w8a8 lays it out; weight_scale (N,) float32 (N is its length); bias (N,)
    bfloat16 or None. Returns (M, N) of `dtype`. int16 pairs of products (vpmaddwd on AVX2, vpdpwssd
    on AVX-512), 6 rows x one panel a tile; torch.get_num_threads() threads."""
    if _gemm_w8a8 is None:
        _lib_or_raise("linear_w8a8")
    if qu.dtype is not torch.uint8 or qu.dim() != 2 or not qu.is_contiguous() or not qu.is_cpu:
        raise _bad("linear_w8a8", "qu must be a contiguous uint8 (M, K) CPU tensor")
    M, K = qu.shape
    if K > W8A8_MAX_K:
        raise _bad("linear_w8a8", f"K = {K} is above {W8A8_MAX_K}: its int32 sums could overflow")
    if weight_scale.dtype is not torch.float32 or weight_scale.dim() != 1 or not weight_scale.is_contiguous():
        raise _bad("linear_w8a8", "weight_scale must be a contiguous float32 (N,) tensor")
    N, P = weight_scale.numel(), _w8a8_panel
    shape = (-(-N // P), (K + 1) // 2, P, 2)
    if packed.dtype is not _i8 or tuple(packed.shape) != shape or not packed.is_contiguous():
        raise _bad("linear_w8a8", f"packed must be pack_w8a8's int8 {shape} tensor for {N} outputs of {K} "
                                  f"inputs, got {packed.dtype} {tuple(packed.shape)}")
    if row_scale.dtype is not torch.float32 or row_scale.numel() != M or not row_scale.is_contiguous():
        raise _bad("linear_w8a8", f"row_scale must be a contiguous float32 tensor of {M} values")
    if bias is not None:
        _check_vec(bias, N, "bias", "linear_w8a8")
    if dtype not in (_bf16, torch.float32):
        raise _bad("linear_w8a8", f"dtype must be bfloat16 or float32, got {dtype}")
    y = torch.empty((M, N), dtype=dtype)
    if M and N and _gemm_w8a8(qu.data_ptr(), row_scale.data_ptr(), packed.data_ptr(), weight_scale.data_ptr(),
                              None if bias is None else bias.data_ptr(), y.data_ptr(), int(dtype == torch.float32),
                              M, N, K, torch.get_num_threads()):
        raise MemoryError("linear_w8a8: no memory for q's int16 copy")
    return y


def attention_group(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, tk: torch.Tensor | None = None,
                    tv: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of N queries over a shared prompt and a tail each, float32 scores and softmax.

    q (N, H, D); pk, pv (H, P, D) bfloat16 views (same strides, last dim contiguous); tk, tv
    (N, H, T, D) bfloat16 views likewise, or None. Returns (N, H, D) float32:
    softmax(q . [pk | tk[n]] / sqrt(D)) @ [pv | tv[n]]. The prompt's keys and values are read once
    per 8 queries; heads are split across torch.get_num_threads() threads.
    """
    if _attend_group is None:
        _lib_or_raise("attention_group", "attention")
    N, H, D = q.shape
    if D % 16 or pk.dtype is not _bf16 or pv.dtype is not _bf16 or pk.shape != (H, pk.shape[1], D):
        raise _bad("attention_group", "needs bfloat16 keys/values (H, P, D) with D a multiple of 16")
    if pk.stride() != pv.stride() or pk.stride(-1) != 1 or not (pk.is_cpu and pv.is_cpu):
        raise _bad("attention_group", "prompt keys and values must be CPU views with equal strides, d contiguous")
    P = pk.shape[1]
    if tk is None:
        tk, tv, T, ts = pk, pv, 0, (0, 0, 0)
    else:
        if tk.shape[:2] != (N, H) or tk.shape[3] != D or tk.dtype is not _bf16 or tv.dtype is not _bf16:
            raise _bad("attention_group", f"tails must be bfloat16 ({N}, {H}, T, {D})")
        if tk.stride() != tv.stride() or tk.stride(-1) != 1 or not (tk.is_cpu and tv.is_cpu):
            raise _bad("attention_group", "tail keys and values must be CPU views with equal strides, d contiguous")
        T, ts = tk.shape[2], tk.stride()[:3]
    if P + T < 1:
        raise _bad("attention_group", "nothing to attend over")
    qf = q.to(torch.float32).contiguous()
    out = torch.empty((N, H, D), dtype=torch.float32)
    rc = _attend_group(qf.data_ptr(), N, H, D, pk.data_ptr(), pv.data_ptr(), pk.stride(0), pk.stride(1), P,
                       tk.data_ptr(), tv.data_ptr(), ts[0], ts[1], ts[2], T, out.data_ptr(),
                       1.0 / float(D) ** 0.5, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"attention_group: native kernel failed ({rc})")
    return out


def _pages(name: str, kc: torch.Tensor, vc: torch.Tensor, k_scale: torch.Tensor | None,
           v_scale: torch.Tensor | None) -> tuple[int, int, int, int, int, int]:
    """Validated paged KV blocks: kc, vc (n_blocks, H, B, D) contiguous on CPU, bfloat16 without
    scales or int8 with k_scale, v_scale (n_blocks, H, B) float32. Returns (n_blocks, H, B, D, and
    the scales' pointers or 0 for bfloat16)."""
    shape = kc.shape
    if len(shape) != 4 or vc.shape != shape or not (kc.is_contiguous() and vc.is_contiguous() and kc.is_cpu
                                                    and vc.is_cpu):
        raise _bad(name, "key and value blocks must be contiguous CPU tensors of one shape (n_blocks, H, B, D)")
    n_blocks, H, B, D = shape
    if D % 16 or D > 512:
        raise _bad(name, f"head_dim must be a multiple of 16 up to 512, got {D}")
    if kc.dtype is _bf16 and vc.dtype is _bf16 and k_scale is None and v_scale is None:
        return n_blocks, H, B, D, 0, 0
    if kc.dtype is _i8 and vc.dtype is _i8 and k_scale is not None and v_scale is not None:
        for t in (k_scale, v_scale):
            if t.dtype is not torch.float32 or t.shape != shape[:3] or not t.is_contiguous() or not t.is_cpu:
                raise _bad(name, f"int8 blocks need contiguous float32 scales of shape {tuple(shape[:3])}")
        return n_blocks, H, B, D, k_scale.data_ptr(), v_scale.data_ptr()
    raise _bad(name, "blocks must be bfloat16 (no scales) or int8 with k_scale and v_scale")


def attention_paged(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, row0: torch.Tensor, stab: torch.Tensor,
                    soff: torch.Tensor, slen: torch.Tensor, otab: torch.Tensor, olen: torch.Tensor,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of a whole batch over paged keys/values, float32 scores and softmax.

    q (N, H, D); kc, vc (n_blocks, H, B, D) contiguous: bfloat16, or int8 whose values are
    q * k_scale, v_scale (n_blocks, H, B) float32. int32 CPU tensors, contiguous:
    row0 (G + 1,) the first query row of each group (row0[G] = N); stab the groups' shared block
    tables one after another, group g's from soff[g], holding slen[g] tokens; otab (N, omax) each
    row's own blocks, holding olen[g] tokens for the rows of group g. Returns (N, H, D) float32.
    Block ids and lengths are the caller's to keep in range: the kernel reads what they point at.
    """
    if _attend_paged is None:
        _lib_or_raise("attention_paged", "attention")
    N, H, D = q.shape
    _, h, B, d, ks, vs = _pages("attention_paged", kc, vc, k_scale, v_scale)
    if (h, d) != (H, D):
        raise _bad("attention_paged", f"blocks of {h} heads of {d} do not match queries of {H} heads of {D}")
    ints = (row0, stab, soff, slen, otab, olen)
    if any(t.dtype is not torch.int32 or not t.is_contiguous() for t in ints):
        raise _bad("attention_paged", "tables and lengths must be contiguous int32 tensors")
    G = slen.shape[0]
    if row0.shape != (G + 1,) or soff.shape != (G,) or olen.shape != (G,) or otab.dim() != 2 or otab.shape[0] != N:
        raise _bad("attention_paged", f"tables do not match {G} groups of {N} rows")
    qf = q.to(torch.float32).contiguous()
    out = torch.empty((N, H, D), dtype=torch.float32)
    rc = _attend_paged(qf.data_ptr(), N, H, D, kc.data_ptr(), vc.data_ptr(), ks, vs, B, G, row0.data_ptr(),
                       stab.data_ptr(), soff.data_ptr(), slen.data_ptr(), otab.data_ptr(), otab.shape[1],
                       olen.data_ptr(), out.data_ptr(), 1.0 / float(D) ** 0.5, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"attention_paged: native kernel failed ({rc})")
    return out


def prefill_paged(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, start: int,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a prompt chunk over paged keys/values already stored (the chunk's too).

    q (T, H, D) bfloat16 on CPU, the queries of positions start .. start + T - 1, each head's D
    values contiguous (any stride between tokens: a view into the fused q|k|v projection serves);
    kc, vc (n_blocks, H, B, D), B even: bfloat16, or int8 with scales (as attention_paged's); table:
    the sequence's blocks, int32, at least ceil((start + T) / B) of them. Returns (T, H, D)
    bfloat16: float32 scores (exact bfloat16 products) and softmax; the probabilities rounded to
    bfloat16 (as HF rounds them to the values' dtype) and summed against the values in float32,
    rounded once. Block ids are the caller's to keep in range.
    """
    if _prefill_paged is None:
        _lib_or_raise("prefill_paged", "attention")
    T, H, D = q.shape
    _, h, B, d, ks, vs = _pages("prefill_paged", kc, vc, k_scale, v_scale)
    if q.dtype is not _bf16 or not q.is_cpu or (h, d) != (H, D):
        raise _bad("prefill_paged", f"queries must be bfloat16 on CPU with the blocks' {h} heads of {d}")
    if B % 2:
        raise _bad("prefill_paged", f"blocks must hold an even number of tokens, got {B}")
    if table.dtype is not torch.int32 or not table.is_contiguous() or table.numel() * B < start + T:
        raise _bad("prefill_paged", f"the block table must be contiguous int32 covering {start + T} positions")
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    out = torch.empty((T, H, D), dtype=_bf16)
    rc = _prefill_paged(q.data_ptr(), q.stride(0), T, H, D, kc.data_ptr(), vc.data_ptr(), ks, vs, B, table.data_ptr(),
                        int(start), out.data_ptr(), H * D, 1.0 / float(D) ** 0.5, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"prefill_paged: native kernel failed ({rc})")
    return out


# --- a fused block's elementwise steps ----------------------------------------------------------------

def _rows(x: torch.Tensor, name: str, what: str, write: bool = False) -> torch.Tensor:
    """x (..., N) bfloat16 on CPU as a (M, N) view with contiguous rows: a copy if no such view
    exists, an error if x is written to (`write`) and none exists."""
    if not isinstance(x, torch.Tensor) or x.dtype is not _bf16 or not x.is_cpu:
        raise _bad(name, f"{what} must be a bfloat16 CPU tensor")
    try:
        x2 = x.view(-1, x.shape[-1])
        if x2.stride(-1) == 1:
            return x2
    except RuntimeError:
        pass
    if write:
        raise _bad(name, f"{what} must be viewable as rows of contiguous values")
    return x.reshape(-1, x.shape[-1]).contiguous()


def gelu(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """GELU's tanh form of bfloat16 x (..., N), float32 inside and rounded once: x / (1 + e^(-2u)),
    u = sqrt(2 / pi) (x + 0.044715 x^3) — 0.5 x (1 + tanh u) without its cancellation below 0.
    x's rows may be strided (a view into a wider matrix); so may `out` (same shape, x itself or
    not overlapping it), which receives the result. Returns out."""
    if _gelu is None:
        _lib_or_raise("gelu", "elementwise")
    x2 = _rows(x, "gelu", "x")
    if out is None:
        out = torch.empty(x.shape, dtype=_bf16)
    if out.shape != x.shape:
        raise _bad("gelu", f"out must have shape {tuple(x.shape)}, got {tuple(out.shape)}")
    y2 = _rows(out, "gelu", "out", write=True)
    M, N = x2.shape
    if M and N:
        _gelu(x2.data_ptr(), x2.stride(0), y2.data_ptr(), y2.stride(0), M, N, torch.get_num_threads())
    return out


def rotary_(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """GPT-J's rotary embedding in place on the first R dims of each head: x (M, heads, D) bfloat16
    whose heads lie one after another (a token's q and k heads side by side serve), any stride
    between tokens; sin, cos (M, R) bfloat16 (gptj.models.gptj.rotary_tables', each angle repeated for
    its pair), R a multiple of 16. float32 inside, rounded once. Returns x."""
    if _rotary is None:
        _lib_or_raise("rotary_", "elementwise")
    M, nh, D = x.shape
    R = sin.shape[-1]
    if x.dtype is not _bf16 or not x.is_cpu or x.stride(2) != 1 or x.stride(1) != D:
        raise _bad("rotary_", "x must be a bfloat16 CPU (tokens, heads, D) view with each token's heads contiguous")
    if R % 16 or R > D or sin.shape != (M, R) or cos.shape != (M, R):
        raise _bad("rotary_", f"sin and cos must be ({M}, R) with R a multiple of 16 up to {D}")
    sin, cos = sin.contiguous(), cos.contiguous()
    if sin.dtype is not _bf16 or cos.dtype is not _bf16:
        raise _bad("rotary_", "sin and cos must be bfloat16")
    if M:
        _rotary(x.data_ptr(), x.stride(0), M, nh, D, R, sin.data_ptr(), cos.data_ptr(), torch.get_num_threads())
    return x


def store_kv(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, blocks: torch.Tensor,
             offsets: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """kc[blocks[n], :, offsets[n]] = k[n] and vc likewise, for N tokens: k, v (N, H, D) bfloat16 views
    with each token's heads contiguous (any stride between tokens); kc, vc (n_blocks, H, B, D)
    contiguous, bfloat16, or int8 with scales (as attention_paged's): then each head vector is
    rounded as gptj.quant.ops.quantize_rows_int8 rounds a row, its scale stored at the same place of
    k_scale / v_scale. blocks, offsets (N,) int64. Ids and offsets are the caller's to keep in range."""
    if _store_kv is None:
        _lib_or_raise("store_kv", "elementwise")
    N, H, D = k.shape
    for t in (k, v):
        if t.shape != (N, H, D) or t.dtype is not _bf16 or not t.is_cpu or t.stride(2) != 1 or t.stride(1) != D:
            raise _bad("store_kv", "k and v must be bfloat16 CPU (N, H, D) views with each token's heads contiguous")
    _, h, B, d, ks, vs = _pages("store_kv", kc, vc, k_scale, v_scale)
    if (h, d) != (H, D):
        raise _bad("store_kv", f"blocks of {h} heads of {d} do not match keys of {H} heads of {D}")
    for t in (blocks, offsets):
        if t.dtype is not torch.int64 or t.shape != (N,) or not t.is_contiguous():
            raise _bad("store_kv", f"blocks and offsets must be contiguous int64 ({N},)")
    if N:
        _store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), N, H, D, kc.data_ptr(), vc.data_ptr(), ks, vs,
                  B, blocks.data_ptr(), offsets.data_ptr(), torch.get_num_threads())


# --- W8A8 linears: the activations' rounding before oneDNN's int8 GEMM, and its sums after ------------

def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value, as torch.max(x, dim=-1).indices (ties to the first,
    a NaN the largest): x (M, N) float32 on CPU whose rows are contiguous, any stride between them.
    int64 (M,). torch's CPU kernel tracks the index at every element; this finds the maximum's first
    block of 256 in one vector pass, then its index there, about as fast as torch's maximum alone
    (figures: docs/PERFORMANCE.md#serving-vs-vllm)."""
    if _argmax_rows is None:
        _lib_or_raise("argmax_rows", "elementwise")
    if (not isinstance(x, torch.Tensor) or x.dtype is not torch.float32 or not x.is_cpu or x.dim() != 2
            or x.shape[1] < 1 or x.stride(1) != 1):
        raise _bad("argmax_rows", "x must be a float32 CPU (M, N) tensor, N >= 1, of contiguous rows")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        _argmax_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def quantize_rows_u8(x: torch.Tensor, inv_smooth: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) bfloat16 (rows may be strided) times inv_smooth (K,) float32, rounded per row as
    gptj.quant.ops.quantize_rows_int8 rounds it (the same q and scale), in one pass per row.
    Returns (q + 128 as uint8 (M, K), scale float32 (M, 1)): oneDNN's u8 form, zero point 128."""
    if _quantize_rows is None:
        _lib_or_raise("quantize_rows_u8", "elementwise")
    if isinstance(x, torch.Tensor) and x.dim() != 2:
        raise _bad("quantize_rows_u8", f"x must be (M, K), got {tuple(x.shape)}")
    x2 = _rows(x, "quantize_rows_u8", "x")
    M, K = x2.shape
    if inv_smooth is not None and (inv_smooth.dtype is not torch.float32 or inv_smooth.shape != (K,)
                                   or not inv_smooth.is_contiguous() or not inv_smooth.is_cpu):
        raise _bad("quantize_rows_u8", f"inv_smooth must be a contiguous float32 CPU tensor of shape ({K},)")
    qu = torch.empty((M, K), dtype=torch.uint8)
    scale = torch.empty((M, 1), dtype=torch.float32)
    if M and K:
        _quantize_rows(x2.data_ptr(), x2.stride(0), None if inv_smooth is None else inv_smooth.data_ptr(),
                       qu.data_ptr(), scale.data_ptr(), M, K, torch.get_num_threads())
    return qu, scale


INT4_MAX_BLOCK = 128  # the layout's rows a block, at most (int4_dequant_t's buffer)
INT4_GEMM_BLOCKS = (32, 64)  # the blocks linear_int4 takes: a 32-channel panel is a block or half of one


def _check_int4(name: str, packed: torch.Tensor, K: int, layout: tuple[int, bool], scale: torch.Tensor,
                zero: torch.Tensor, group: int) -> int:
    """int4_dequant_t's and linear_int4's weight arguments checked; returns the rows n."""
    block = layout[0]
    n = packed.shape[0] if packed.dim() == 2 else 0
    if (packed.dtype is not torch.uint8 or packed.dim() != 2 or packed.shape[1] * 2 != K or not packed.is_contiguous()
            or not packed.is_cpu):
        raise _bad(name, f"packed must be a contiguous uint8 CPU (n, {K // 2}) tensor")
    if block % 16 or block > INT4_MAX_BLOCK or n % block:  # 16: a vector's lanes on every ISA (8 or 16)
        raise _bad(name, f"{n} rows are not whole blocks of {block} (a multiple of 16, at most {INT4_MAX_BLOCK})")
    if group < 1 or K % group:
        raise _bad(name, f"group {group} does not divide K = {K}")
    for t, what in ((scale, "scale"), (zero, "zero")):
        if t.dtype is not _bf16 or t.shape != (n, K // group) or not t.is_contiguous() or not t.is_cpu:
            raise _bad(name, f"{what} must be a contiguous bfloat16 CPU ({n}, {K // group}) tensor")
    return n


def int4_dequant_t(packed: torch.Tensor, K: int, layout: tuple[int, bool], scale: torch.Tensor,
                   zero: torch.Tensor, group: int, out: torch.Tensor) -> torch.Tensor:
    """Whole blocks of an int4 weight in torch's CPU layout (`layout` = gptj.quant.ops.cpu_int4_layout(),
    packed: (n, K/2) uint8 rows of it, n a multiple of the block) dequantized and transposed into
    `out` (K, n) bfloat16 (rows may be strided): out[k, r] = bfloat16(q[r, k] * s + zp), s = scale[r, g],
    zp = bfloat16(zero[r, g] - 8 s), g = k // group; scale, zero (n, K / group) bfloat16:
    Int4Linear._dequant_rows' values, transposed. Returns out."""
    if _int4_dequant is None:
        _lib_or_raise("int4_dequant_t", "elementwise")
    n = _check_int4("int4_dequant_t", packed, K, layout, scale, zero, group)
    block, split = layout
    if out.dtype is not _bf16 or out.shape != (K, n) or out.stride(1) != 1 or not out.is_cpu:
        raise _bad("int4_dequant_t", f"out must be a bfloat16 CPU ({K}, {n}) tensor with contiguous rows")
    if n and K and _int4_dequant(packed.data_ptr(), K, n // block, block, int(split), scale.data_ptr(),
                                 zero.data_ptr(), group, out.data_ptr(), out.stride(0), torch.get_num_threads()):
        raise MemoryError("int4_dequant_t: no memory for the scales' buffers")
    return out


def int4_gemm_min_rows(rows: int | None = None) -> int:
    """The rows of x from which linear_int4 runs the loaded library's int4 GEMM (weights dequantized into
    panels once per call) instead of its int4 GEMV (on the integers, scaled per group); 0 where the
    library has no GEMM (all but AVX512-BF16's: the GEMV at every row count) or none is loaded. `rows`
    sets it for this process (benchmarks/native_gemv.py times both sides of it); the value before is
    returned."""
    return _gemm_min_rows("int4", rows)


def int4_gemm_available(layout: tuple[int, bool] | None = None) -> bool:
    """Whether linear_int4 runs here: a library is loaded (each has an int4 GEMV; AVX512-BF16's a GEMM
    too) and, when given, `layout`'s block is one it takes (INT4_GEMM_BLOCKS)."""
    load()
    return _gemm_int4 is not None and (layout is None or layout[0] in INT4_GEMM_BLOCKS)


def linear_int4(x: torch.Tensor, packed: torch.Tensor, K: int, layout: tuple[int, bool], scale: torch.Tensor,
                zero: torch.Tensor, group: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) bfloat16 times the transpose of the int4 weight (int4_dequant_t's arguments: whole blocks
    of torch's CPU layout, blocks of INT4_GEMM_BLOCKS rows): (M, n) bfloat16, float32 sums rounded once;
    no bias. Into `out` ((M, n) bfloat16, rows may be strided: columns of a wider output) when given.
    The loaded library's int4 GEMV (gemv.c: the integers in float32 sums, each group's sums scaled once;
    on AVX512-BF16's library in bfloat16 dot products) multiplies the weights (q - 8) s + zero exactly, as
    torch's int4 kernel does: on AVX512-BF16's library below int4_gemm_min_rows() rows (32), on the others
    at every row count. From there AVX512-BF16's GEMM (each weight dequantized once per call into panels,
    a register tile) multiplies int4_dequant_t's bfloat16 roundings of them. Returns out."""
    if not int4_gemm_available():
        _lib_or_raise("linear_int4")
    n = _check_int4("linear_int4", packed, K, layout, scale, zero, group)
    block, split = layout
    if block not in INT4_GEMM_BLOCKS:
        raise _bad("linear_int4", f"blocks of {block} rows (it takes {' or '.join(map(str, INT4_GEMM_BLOCKS))})")
    if group % 16:
        raise _bad("linear_int4", f"groups of {group} inputs (it takes multiples of 16)")
    if x.dtype is not _bf16 or x.dim() != 2 or x.shape[1] != K or not x.is_contiguous() or not x.is_cpu:
        raise _bad("linear_int4", f"x must be a contiguous bfloat16 CPU (M, {K}) tensor")
    M = x.shape[0]
    if out is None:
        out = torch.empty((M, n), dtype=_bf16)
    if out.dtype is not _bf16 or out.shape != (M, n) or out.stride(1) != 1 or not out.is_cpu:
        raise _bad("linear_int4", f"out must be a bfloat16 CPU ({M}, {n}) tensor with contiguous rows")
    if M and n and _gemm_int4(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), zero.data_ptr(), out.data_ptr(),
                              M, n, K, block, int(split), group, out.stride(0), torch.get_num_threads()):
        raise MemoryError("linear_int4: no memory for the kernel's copy of x")
    return out


def scale_rows(acc: torch.Tensor, row_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """bfloat16(acc * row_scale) + bias, each step rounded to bfloat16 (W8A8Linear's order): acc (M, N)
    float32 with contiguous rows, row_scale (M, 1) float32, bias (N,) bfloat16 or None. Into `out`
    ((M, N) bfloat16, rows may be strided) when given. Returns out."""
    if _scale_rows is None:
        _lib_or_raise("scale_rows", "elementwise")
    if acc.dtype is not torch.float32 or acc.dim() != 2 or acc.stride(-1) != 1 or not acc.is_cpu:
        raise _bad("scale_rows", "acc must be a float32 CPU (M, N) tensor with contiguous rows")
    M, N = acc.shape
    if row_scale.dtype is not torch.float32 or row_scale.numel() != M or not row_scale.is_contiguous():
        raise _bad("scale_rows", f"row_scale must be a contiguous float32 tensor of {M} values")
    if bias is not None:
        _check_vec(bias, N, "bias", "scale_rows")
    if out is None:
        out = torch.empty((M, N), dtype=_bf16)
    if out.shape != (M, N):
        raise _bad("scale_rows", f"out must have shape {(M, N)}, got {tuple(out.shape)}")
    y2 = _rows(out, "scale_rows", "out", write=True)
    if M and N:
        _scale_rows(acc.data_ptr(), acc.stride(0), row_scale.data_ptr(), None if bias is None else bias.data_ptr(),
                    y2.data_ptr(), y2.stride(0), M, N, torch.get_num_threads())
    return out
