"""CPU kinds for tests that check the choices gptj makes on CPUs other than the one running them.

Each kind's flags are what /proc/cpuinfo lists on such a CPU, cut to the ones gptj.cpu reads.
`fake_cpu` makes gptj.cpu.flags() return them until the test ends, and loads that kind's gptj.native
library (the avx512 one on AVX-512 without BF16, AVX2's on AVX2) where this machine runs it, or takes gptj.native
away (conftest.force_fallback: its library is loaded once a process)."""

from __future__ import annotations

import pytest
from conftest import force_fallback, unload_native

from gptj import cpu

_BASE = frozenset({"sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
_AVX512 = _BASE | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}

FLAGS = {
    cpu.AVX512_BF16: _AVX512 | {"avx512_vnni", "avx512_bf16", "avx512vbmi"},  # AMD Zen 4
    cpu.AVX512_VNNI: _AVX512 | {"avx512_vnni"},  # Intel Cascade Lake
    cpu.AVX512: _AVX512,  # Intel Skylake-SP
    cpu.AVX2: _BASE,  # AMD Zen 2/3
    cpu.OTHER: frozenset({"sse4_1", "sse4_2"}),
}
# Intel Sapphire Rapids and later: the avx512-bf16 kind with AMX's tiles, which oneDNN's GEMMs run on
AMX = FLAGS[cpu.AVX512_BF16] | {"avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"}


def fake_cpu(monkeypatch: pytest.MonkeyPatch, kind: str) -> frozenset[str]:
    """gptj.cpu.flags() answers as a CPU of `kind` (one of gptj.cpu.KINDS) does, and gptj.native
    loads that kind's library (its best ISA's: avx512 for the AVX-512 kinds without BF16, avx2 for
    AVX2) where this machine can run it too, or none."""
    from gptj import native
    from gptj.native import build, loader

    flags = FLAGS[kind]
    real = cpu.flags()
    monkeypatch.setattr(cpu, "flags", lambda: flags)
    if kind == cpu.AVX512_BF16:
        if not FLAGS[kind] <= real:  # a library loaded under these flags (it cannot run here) stays in this test
            monkeypatch.setattr(loader, "_state", dict(loader._state))
            for bound in loader.BOUND:
                monkeypatch.setattr(loader, bound, getattr(loader, bound))
        return flags
    isa = native.best_isa(flags)
    if isa is not None and all(f in real for f in isa.cpu_flags) and not build.disabled():
        unload_native(monkeypatch)  # load() looks again and picks the kind's library
        if native.isa() is not None and native.isa().name == isa.name:
            return flags
    force_fallback(monkeypatch)
    return flags
