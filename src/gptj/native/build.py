"""The native kernels' compiler driver: one library per instruction set (ISA), compiled with gcc.

    ISA           CPUs                                   arithmetic
    avx512-bf16   AVX-512 F/BW/VL with BF16 and VNNI     bfloat16 dot products (vdpbf16ps), int16 ones
    avx512        AVX-512 F/BW/VL/DQ without BF16        as avx2, 16 lanes (Skylake-SP, Cascade Lake, Ice Lake)
    avx2          AVX2 + FMA + F16C (Zen 2/3, Haswell…)  float32 FMAs on bfloat16 / int8 widened, int16 pairs
    generic       any CPU gcc targets (ARM's NEON…)      as avx2, in portable C (GCC's vector extensions);
                                                         only when asked for: GPTJ_NATIVE_ISA=generic

Each library holds every kernel: the decode GEMV, paged decode and prefill attention, the elementwise
passes. The AVX-512 one also holds amx.c's int8 and W8A8 GEMMs on AMX's tiles, compiled for AMX
whatever the building CPU and used only where the CPU has AMX and Linux grants the tiles
(loader.amx_available). The same C sources are compiled per ISA: the vector layer (simd.h, and one
file per ISA: simd_avx512.h, simd_avx2.h, simd_generic.h) is where the instruction set shows, plus the
GEMV's and attention's bfloat16 dot-product sections for AVX512-BF16 (`HAVE_DP`). `best_isa()` is the
best ISA this CPU's flags allow (gptj.cpu, so ONEDNN_MAX_CPU_ISA's ceiling applies). The generic library
is never chosen on its own: on x86-64 it is what an AVX2 CPU runs, less the instructions, and where
it would be the only one (ARM, which cannot be tested or timed here) torch's kernels stay the
default until it has been measured against them there.

`library_path()` compiles the ISA's C files (simd.h and simd_*.h their shared helpers) with gcc the
first time it is needed, into a cache folder (`$GPTJ_CACHE_DIR`, else `~/.cache/gptj/native/`; a
temporary folder if that cannot be written) under a name that hashes the sources, the ISA and its
flags, the compiler, the machine type and, for the library compiled for this CPU (-march=native), the
CPU's flags. It writes it atomically, one process at a time (the others that need it wait on a lock
on the folder, then load the one built). It returns None where the library should not or cannot be
built: `GPTJ_NATIVE=0`, a CPU without the ISA's flags, no gcc, or a failed build.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gptj import cpu

HERE = Path(__file__).parent
SOURCES = tuple(HERE / name for name in ("gemv.c", "w4a8.c", "attention.c", "elementwise.c"))  # one library
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


def disabled(env: dict[str, str] | os._Environ | None = None) -> bool:
    """GPTJ_NATIVE switches the native kernels off (0, false, no or off)."""
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


def library_path(env: dict[str, str] | os._Environ | None = None, isa: Isa | None = None) -> Path | None:
    """The path of the compiled library of `isa` (default: the best this CPU runs), building it if
    needed, or None where the native kernels are switched off (GPTJ_NATIVE=0), cannot run here or
    cannot be built."""
    env = os.environ if env is None else env
    if disabled(env):
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
