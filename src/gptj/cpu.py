"""What this CPU's instruction set offers gptj's kernels: the one reader of /proc/cpuinfo.

Every choice that depends on the instruction set asks here (gptj.native's build, gptj.policy's
kernel table), so a test fakes one function, `flags`, to see the choices of any CPU kind.

Kinds, by what gptj's kernels and oneDNN's int8 GEMM can use (`kind`):

  kind          the CPU has                                   e.g.
  avx512-bf16   AVX-512 F/BW/VL with BF16 and VNNI            AMD Zen 4/5, Intel Cooper Lake, Sapphire Rapids
                (with AMX from Sapphire Rapids on: gptj.policy's `cpu_amx` reads it)
  avx512-vnni   AVX-512 with VNNI, no BF16                    Intel Cascade Lake, Ice Lake
  avx512        AVX-512 without VNNI                          Intel Skylake-SP/X
  avx2          AVX2 and FMA, no AVX-512                      AMD Zen 2/3, Intel Haswell to Comet Lake, Alder Lake
  other         an older x86-64, or not x86-64

gptj.native's libraries (every kernel, the same sources): avx512-bf16 on that kind, avx512 on the
other AVX-512 kinds, avx2 on avx2, and its portable one, by request only, on any (gptj.native.ISAS).
oneDNN's u8 x s8 GEMM sums its products in int32 only with VNNI
(vpdpbusd); without it (avx512, avx2) the kernels add pairs of products in 16 bits first
(vpmaddubsw), which saturate at 32767: 2 * 255 * 127 does not fit, so W8A8 takes another form
there (gptj.policy.w8a8_form).

A ceiling, to run as an older CPU would on a newer one: oneDNN's own switch ONEDNN_MAX_CPU_ISA caps
what gptj sees too, so gptj's choices and oneDNN's kernels agree; ATEN_CPU_CAPABILITY does the same
for torch's own kernels. The test suite as an AVX2-only CPU runs it:

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python -m pytest -q
"""

from __future__ import annotations

import functools
import os
import platform

AVX512_BF16, AVX512_VNNI, AVX512, AVX2, OTHER = "avx512-bf16", "avx512-vnni", "avx512", "avx2", "other"
KINDS = (AVX512_BF16, AVX512_VNNI, AVX512, AVX2, OTHER)

AVX512_CORE = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"})

# ONEDNN_MAX_CPU_ISA's levels, lowest first, with the flags each adds (oneDNN's names; aliases below).
# A ceiling removes the flags of every level above it; below avx512_core, every avx512* and amx* flag.
_LEVELS = (
    ("sse41", frozenset()),
    ("avx", frozenset({"avx"})),
    ("avx2", frozenset({"avx2", "fma", "f16c"})),
    ("avx2_vnni", frozenset({"avx_vnni"})),
    ("avx2_vnni_2", frozenset({"avx_vnni_int8", "avx_ne_convert"})),
    ("avx512_core", AVX512_CORE),
    ("avx512_core_vnni", frozenset({"avx512_vnni"})),
    ("avx512_core_bf16", frozenset({"avx512_bf16"})),
    ("avx10_1_512", frozenset({"avx512_fp16"})),
    ("avx10_1_512_amx", frozenset({"amx_tile", "amx_int8", "amx_bf16"})),
    ("avx10_1_512_amx_fp16", frozenset({"amx_fp16"})),
)
_ALIASES = {"avx512_core_fp16": "avx10_1_512", "avx512_core_amx": "avx10_1_512_amx",
            "avx512_core_amx_fp16": "avx10_1_512_amx_fp16"}
_LEVEL_NAMES = tuple(name for name, _ in _LEVELS)


def read_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's flags as the kernel lists them (empty where there is no such file or line)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def ceiling(env: dict[str, str] | os._Environ | None = None) -> str | None:
    """ONEDNN_MAX_CPU_ISA as one of _LEVELS' names, or None (unset, ALL/DEFAULT, or a name oneDNN
    would not know either: it ignores those too)."""
    value = (os.environ if env is None else env).get("ONEDNN_MAX_CPU_ISA", "").strip().lower()
    value = _ALIASES.get(value, value)
    return value if value in _LEVEL_NAMES else None


def cap(flags: frozenset[str], level: str | None) -> frozenset[str]:
    """`flags` less what a CPU capped at `level` (one of _LEVELS' names; None: no cap) may use."""
    if level is None:
        return frozenset(flags)
    above = _LEVEL_NAMES.index(level) + 1
    removed = frozenset().union(*(added for _, added in _LEVELS[above:]))
    kept = {f for f in flags if f not in removed}
    if level in _LEVEL_NAMES[:_LEVEL_NAMES.index("avx512_core")]:  # below AVX-512: none of its extensions
        kept = {f for f in kept if not f.startswith(("avx512", "amx"))}
    return frozenset(kept)


@functools.cache
def _flags() -> frozenset[str]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    return cap(read_flags(), ceiling())


def flags() -> frozenset[str]:
    """This CPU's flags under ONEDNN_MAX_CPU_ISA's ceiling (read once; empty off x86-64)."""
    return _flags()


def kind(have: frozenset[str] | None = None) -> str:
    """One of KINDS for a CPU with `have` flags (None: this one's)."""
    have = flags() if have is None else have
    if AVX512_CORE <= have:
        if "avx512_vnni" in have:
            return AVX512_BF16 if "avx512_bf16" in have else AVX512_VNNI
        return AVX512
    return AVX2 if {"avx2", "fma"} <= have else OTHER


def int8_sums_exact(have: frozenset[str] | None = None) -> bool:
    """Whether oneDNN's u8 x s8 kernels (and torch._int_mm, which runs on them) sum a product of
    8-bit values in int32 for any operands on this CPU: with AVX-512 VNNI. Without it they add pairs
    of products in 16 bits, which saturate. (AVX-VNNI alone, as on Alder Lake, is not counted: it
    was never measured here, and the form chosen without it is exact on every CPU.)"""
    return "avx512_vnni" in (flags() if have is None else have)


def describe(have: frozenset[str] | None = None) -> str:
    """One line for reports: the kind, and the ceiling where one applies."""
    line = kind(have)
    level = ceiling() if have is None else None
    return f"{line} (capped by ONEDNN_MAX_CPU_ISA={level.upper()})" if level else line
