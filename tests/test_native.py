"""gptj.native's kernels on every ISA this CPU runs (the AVX2 library on an AVX-512 machine too): the
decode GEMV against F.linear, attention and the elementwise passes against float64 or gptj's own
rounding; validation, loading."""

from __future__ import annotations

import contextlib
import ctypes
import math
import dataclasses
import os
import platform
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import force_fallback, unload_native

from gptj import cpu, native
from gptj.native import build, loader
from gptj.threads import openmp_runtimes

WHY_NOT = native.unavailable_reason()
needs_native = pytest.mark.skipif(WHY_NOT is not None, reason=f"native kernels unavailable: {WHY_NOT}")


@pytest.fixture
def gemv_isa(native_isa: str) -> ctypes.CDLL:
    """gptj.native's library of one ISA (conftest.native_isa: skipped, with the reason, where this CPU
    cannot run it): every GEMV test runs each ISA the machine can, whichever load() picks."""
    return native.load()


MS = (1, 3, 8, 17)
KS = (64, 1000, 1024, 4096)
NS = (1, 33, 1024)


def _int8_case(M: int, N: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000003 + M * 10007 + N * 101 + K)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    scale = (torch.rand(N, generator=g) * 0.02 + 0.001).bfloat16()
    bias = torch.randn(N, generator=g).bfloat16()
    return x, w, scale, bias


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """bfloat16 outputs: a few units of bfloat16 rounding, relative to the outputs' magnitude."""
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    mag = float(ref.float().abs().max()) if ref.numel() else 1.0
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2 * max(mag, 1e-6))


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("M", MS)
def test_int8_matches_f_linear(M: int, K: int, gemv_isa: ctypes.CDLL) -> None:
    for N in NS:
        x, w, scale, bias = _int8_case(M, N, K)
        wf = w.float() * scale.float()[:, None]
        _close(native.linear_int8(x, w, scale), F.linear(x.float(), wf).bfloat16())
        _close(native.linear_int8(x, w, scale, bias), F.linear(x.float(), wf, bias.float()).bfloat16())


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("M", MS)
def test_bf16_matches_f_linear(M: int, K: int, gemv_isa: ctypes.CDLL) -> None:
    for N in NS:
        g = torch.Generator().manual_seed(M * 7919 + N * 31 + K)
        x = torch.randn(M, K, generator=g).bfloat16()
        w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
        b = torch.randn(N, generator=g).bfloat16()
        _close(native.linear_bf16(x, w), F.linear(x.float(), w.float()).bfloat16())
        _close(native.linear_bf16(x, w, b), F.linear(x.float(), w.float(), b.float()).bfloat16())


@pytest.mark.parametrize("M,N,K", [(1, 1024, 4096), (3, 33, 1000), (8, 50, 1024), (17, 97, 300), (9, 16, 64),
                                   (8, 40, 4100), (4, 70, 3000), (2, 5000, 40), (40, 50, 1030)])
def test_float32_outputs_are_float32_accurate(M: int, N: int, K: int, gemv_isa: ctypes.CDLL) -> None:
    """The *_f32 entry points expose the float32 sums: accurate to float32 rounding of the sums
    (this catches a dropped or doubled block that bfloat16 output tolerances could hide).

    Bound: the products are exact in float32 (bf16 x bf16, int8 x bf16 fit 24 bits); each of the
    16 lanes of an AVX-512 accumulator adds K/16 of them (<= 2 roundings each: DPBF16PS may round
    after each of its pair; AVX2's 8 lanes add K/8 with one rounding each), then the lanes are
    summed (<= 16) and scale and bias applied (2):
    |error| <= (K/8 + 18) u sum|terms| (Higham 3.1). The int8 GEMM (AVX512-BF16's, from
    int8_gemm_min_rows rows) sums each output in one lane, every product rounded once: (K + 2) u. A
    dropped or doubled block of 16 products moves a sum by ~16/K of sum|terms|, far more."""
    u = 2.0**-24
    lib = gemv_isa
    x, w, scale, bias = _int8_case(M, N, K, seed=1)
    y = torch.empty(M, N)
    lib.gemv_int8_f32(x.data_ptr(), w.data_ptr(), scale.data_ptr(), bias.data_ptr(), y.data_ptr(), M, N, K, 2)
    xd, wd = x.double(), w.double() * scale.double()[:, None]
    ref = xd @ wd.T + bias.double()
    k = (K / 8 + 18) * u
    gemm = 0 < native.int8_gemm_min_rows() <= M
    bound = (xd.abs() @ wd.abs().T + bias.double().abs()) * ((K + 2) * u if gemm else k) + 1e-30
    assert ((y.double() - ref).abs() <= bound).all()

    wb = (torch.randn(N, K) * 0.05).bfloat16()
    yb = torch.empty(M, N)
    lib.gemv_bf16_f32(x.data_ptr(), wb.data_ptr(), None, yb.data_ptr(), M, N, K, 2)
    refb = xd @ wb.double().T
    boundb = (xd.abs() @ wb.double().abs().T) * k + 1e-30
    assert ((yb.double() - refb).abs() <= boundb).all()


@pytest.mark.parametrize("K", (64, 1000, 4100, 16384))
def test_bf16_rows_sum_in_one_order_whatever_rows_share_the_call(K: int, gemv_isa: ctypes.CDLL) -> None:
    """bfloat16 weights: gemv.c's CHAINS accumulators per output at every row count, added only when the
    outputs are stored, so a row's float32 sums are the same alone and beside 1-19 other rows (passes of
    8 rows, K chunks whose size depends on the pass's rows, tails of K), and with the bias and bfloat16
    outputs too. A draft's verifying rows decode exactly as a row alone because of it (test_speculate).
    Before, 1, 2 and 3+ rows summed with 4, 2 and 1 accumulators, and every ISA's library failed this."""
    N = 40
    g = torch.Generator().manual_seed(K)
    x = torch.randn(20, K, generator=g).bfloat16()
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16()

    def f32(rows: torch.Tensor) -> torch.Tensor:
        y = torch.empty(rows.shape[0], N)
        assert gemv_isa.gemv_bf16_f32(rows.data_ptr(), w.data_ptr(), None, y.data_ptr(), rows.shape[0], N, K, 2) == 0
        return y

    alone = torch.cat([f32(x[i:i + 1]) for i in range(20)])
    alone16 = torch.cat([native.linear_bf16(x[i:i + 1], w, b) for i in range(20)])
    for M in (2, 3, 4, 5, 6, 7, 8, 9, 13, 20):
        assert torch.equal(f32(x[:M]), alone[:M]), M
        assert torch.equal(f32(x[20 - M:]), alone[20 - M:]), M
        assert torch.equal(native.linear_bf16(x[:M], w, b), alone16[:M]), M
    assert torch.equal(_at_one_thread(lambda: f32(x)), alone)


def test_a_rows_output_is_the_same_in_any_call_of_three_rows_or_more(gemv_isa: ctypes.CDLL) -> None:
    """Each output of a pass of 3-8 rows of x is one accumulator summed in k order: a row's result
    does not depend on the rows beside it, where no pass of 8 is left with 1 or 2 rows (those take
    more accumulators, and AVX-512's int8 takes float32 x for a last pass of one). The M below
    leave none. (int8 calls of int8_gemm_min_rows rows or more take the GEMM where the library has
    one: here the knob keeps them on the GEMV; the GEMM's rows are compared in its own test.)"""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 1000, generator=g).bfloat16()
    w8 = torch.randint(-128, 128, (300, 1000), generator=g, dtype=torch.int8)
    scale = (torch.rand(300, generator=g) * 0.02).bfloat16()
    wb = (torch.randn(300, 1000, generator=g) * 0.05).bfloat16()
    crossover = native.int8_gemm_min_rows(1 << 30)  # (0, and nothing set, where the library has no GEMM)
    try:
        full8, fullb = native.linear_int8(x[:24], w8, scale), native.linear_bf16(x, wb)
        for M in (3, 8, 12, 13, 16, 24):
            assert torch.equal(native.linear_int8(x[:M], w8, scale), full8[:M]), M
            assert torch.equal(native.linear_bf16(x[-M:], wb), fullb[-M:]), M
    finally:
        native.int8_gemm_min_rows(crossover or None)


def _at_one_thread(call):
    """call() with torch's (and so the kernels') thread count at 1, then as it was."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return call()
    finally:
        torch.set_num_threads(before)


def _needs_int8_gemm() -> None:
    if not native.int8_gemm_min_rows():
        pytest.skip(f"the {native.isa().name} library has no int8 GEMM (AVX512-BF16's only)")


@pytest.mark.parametrize("M,N,K", [(32, 33, 64), (45, 100, 1001), (70, 32, 4096), (33, 50, 9000), (1030, 17, 40),
                                   (40, 40, 100)])
def test_int8_gemm_is_within_float32_sums_and_one_bfloat16_rounding(M, N, K, gemv_isa):
    """AVX512-BF16's int8 GEMM (from int8_gemm_min_rows rows): tails of every kind (N not a multiple of its 32-channel
    panels, M of its tiles of up to 12 rows (split as evenly as they go: 40 rows are 10 + 10 + 10 + 10, 1030 are 86
    tiles of 11 or 12 and one of 6), an odd K, K in three slices of 2048 pairs, M past its 1024-row blocks). Each
    output is one float32 lane over K products rounded once each, times the scale, plus the bias: within (K + 2) u
    sum|terms| of the float64 value (float32 outputs), and that value rounded once to bfloat16 (its unit roundoff,
    2^-8, more) for bfloat16 outputs."""
    _needs_int8_gemm()
    assert M >= native.int8_gemm_min_rows()
    u = 2.0**-24
    x, w, scale, bias = _int8_case(M, N, K, seed=3)
    xd, wd = x.double(), w.double() * scale.double()[:, None]
    terms = xd.abs() @ wd.abs().T + bias.double().abs()
    for b in (None, bias):
        ref = xd @ wd.T + (0 if b is None else b.double())
        y32 = torch.empty(M, N)
        gemv_isa.gemv_int8_f32(x.data_ptr(), w.data_ptr(), scale.data_ptr(), None if b is None else b.data_ptr(),
                               y32.data_ptr(), M, N, K, 2)
        f32 = terms * (K + 2) * u + 1e-30
        assert ((y32.double() - ref).abs() <= f32).all()
        y = native.linear_int8(x, w, scale, b)  # bfloat16's unit roundoff: 2^-8
        assert ((y.double() - ref).abs() <= f32 + (ref.abs() + f32) * 2.0**-8).all()


def test_int8_gemm_rows_do_not_depend_on_their_call_or_the_threads(gemv_isa):
    """One lane per output, its products added in k order: a row's result is the same in every call
    of the GEMM's rows and at any thread count; and within both kernels' bounds of the GEMV's."""
    _needs_int8_gemm()
    lo = native.int8_gemm_min_rows()
    x, w, scale, bias = _int8_case(lo + 40, 70, 4100, seed=4)
    full = native.linear_int8(x, w, scale, bias)
    for M in (lo, lo + 1, lo + 13):
        assert torch.equal(native.linear_int8(x[-M:], w, scale, bias), full[-M:]), M
    assert torch.equal(_at_one_thread(lambda: native.linear_int8(x, w, scale, bias)), full)

    def f32():  # float32 outputs: where the order of additions shows
        y = torch.empty(x.shape[0], 70)
        gemv_isa.gemv_int8_f32(x.data_ptr(), w.data_ptr(), scale.data_ptr(), bias.data_ptr(), y.data_ptr(),
                               x.shape[0], 70, 4100, 2)
        return y

    gemm32 = f32()
    native.int8_gemm_min_rows(1 << 30)
    try:
        gemv, gemv32 = native.linear_int8(x, w, scale, bias), f32()
    finally:
        native.int8_gemm_min_rows(lo)
    assert native.int8_gemm_min_rows() == lo
    _close(full, gemv)
    assert not torch.equal(gemm32, gemv32)  # the GEMV's order of additions is another: the knob chose it


def _amx_reason() -> str | None:
    if not {"amx_tile", "amx_bf16"} <= cpu.flags():
        return f"this CPU ({cpu.describe()}) has no AMX bfloat16 tiles"
    return None if native.amx_available() else f"gptj.native's AMX kernel is not loaded here ({WHY_NOT or 'no AMX'})"


needs_amx = pytest.mark.skipif(_amx_reason() is not None, reason=str(_amx_reason()))


@needs_amx
@pytest.mark.parametrize("M,N,K", [(1, 16, 64), (3, 100, 64), (16, 32, 4096), (17, 33, 128), (33, 70, 1024),
                                   (40, 1024, 4096), (100, 50, 192)])
def test_amx_int8_gemm_is_within_float32_sums_and_one_bfloat16_rounding(M, N, K):
    """amx.c's GEMM: float32 sums of the exact products (every int8 weight is a bfloat16, every product
    of two bfloat16 values a float32), then scale and bias, rounded once to bfloat16. tdpbf16ps adds
    each product pair into the float32 sum in k order (<= 2 roundings a pair), so |sum error| <=
    (K + 2) u sum|terms| (Higham 3.1, u = 2^-24); scale and bias add 2 more; bfloat16's rounding
    at most 2^-8 of the value. Shapes: rows past the 16- and 32-row tiles, channels past a block of 32,
    the decode (<= 32 rows) and prefill paths."""
    x, w, scale, bias = _int8_case(M, N, K, seed=2)
    y = native.linear_int8_amx(x, w, scale, bias)
    xd, wd = x.double(), w.double() * scale.double()[:, None]
    ref = xd @ wd.T + bias.double()
    sums = (K + 4) * 2.0**-24 * (xd.abs() @ wd.abs().T + bias.double().abs())
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert ((y.double() - ref).abs() <= 2.0**-8 * (ref.abs() + sums) + sums + 1e-30).all()
    assert torch.equal(native.linear_int8_amx(x, w, scale), native.linear_int8_amx(x, w, scale, torch.zeros_like(bias)))


@needs_amx
def test_amx_int8_gemm_rows_do_not_depend_on_their_call_or_the_threads():
    """Each output is one tile accumulator summed in k order whatever the rows beside it (the few-row
    path, <= 32 rows, and the blocked one alike) or the thread count: batch invariance."""
    x, w, scale, bias = _int8_case(70, 200, 1024, seed=3)
    full = native.linear_int8_amx(x, w, scale, bias)
    for rows in (slice(0, 1), slice(5, 8), slice(0, 32), slice(30, 70), slice(1, 70)):
        assert torch.equal(native.linear_int8_amx(x[rows], w, scale, bias), full[rows]), rows
    assert torch.equal(_at_one_thread(lambda: native.linear_int8_amx(x, w, scale, bias)), full)


@needs_amx
@pytest.mark.parametrize("M,N,K", [(1, 16, 64), (8, 100, 256), (17, 64, 4096), (40, 33, 128), (70, 300, 1024)])
def test_amx_w8a8_gemm_returns_onednns_float32_bit_for_bit(M, N, K):
    """amx.c's W8A8 GEMM (tdpbssd) against oneDNN's u8 x s8 GEMM with zero point 128 (the SHIFTED form):
    exact int32 sums in both, converted to float32 and multiplied by the weight scale once: equal."""
    g = torch.Generator().manual_seed(M * 31 + N + K)
    qu = torch.randint(0, 256, (M, K), generator=g, dtype=torch.uint8)
    w = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    ws = torch.rand(N, generator=g) * 0.01
    y = native.linear_w8a8_amx(qu, w, ws)
    exact = (qu.long() - 128) @ w.long().T  # int64: the integer sums
    assert torch.equal(y, exact.float() * ws)
    if hasattr(torch.ops.onednn, "qlinear_prepack"):
        ref = torch.ops.onednn.qlinear_pointwise(qu, 1.0, 128, torch.ops.onednn.qlinear_prepack(w, None), ws,
                                                 torch.zeros(N, dtype=torch.int64), None, 1.0, 0, torch.float32,
                                                 "none", [], "")
        assert torch.equal(y, ref)
    with pytest.raises(ValueError, match="multiple of 64"):
        native.linear_w8a8_amx(qu[:, :K - 32].contiguous() if K > 32 else qu, w[:, :K - 32].contiguous(), ws)


@needs_amx
def test_amx_int8_gemm_refuses_inputs_not_in_steps_of_64():
    x, w, scale, _ = _int8_case(4, 8, 96)
    with pytest.raises(ValueError, match="multiple of 64"):
        native.linear_int8_amx(x, w, scale)


def test_shapes_layouts_and_threads(gemv_isa: ctypes.CDLL) -> None:
    x, w, scale, bias = _int8_case(6, 70, 512)
    x3 = x.reshape(2, 3, 512)
    y = native.linear_int8(x3, w, scale, bias)
    assert y.shape == (2, 3, 70)
    assert torch.equal(y.reshape(6, 70), native.linear_int8(x, w, scale, bias))
    # 1-D x, and a non-contiguous x (made contiguous)
    assert torch.equal(native.linear_int8(x[0], w, scale), native.linear_int8(x[:1], w, scale)[0])
    xt = torch.randn(512, 6).bfloat16().T
    assert torch.equal(native.linear_bf16(xt, w.bfloat16()), native.linear_bf16(xt.contiguous(), w.bfloat16()))
    # every output row is summed by one thread in a fixed order: thread count changes nothing
    wide = torch.randint(-128, 128, (4096, 512), dtype=torch.int8)
    sw = torch.rand(4096).bfloat16()
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.linear_int8(x, wide, sw)
        torch.set_num_threads(2)
        two = native.linear_int8(x, wide, sw)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


def test_out_argument(gemv_isa: ctypes.CDLL) -> None:
    x, w, scale, bias = _int8_case(3, 40, 256)
    out = torch.empty(3, 40, dtype=torch.bfloat16)
    assert native.linear_int8(x, w, scale, bias, out=out) is out
    assert torch.equal(out, native.linear_int8(x, w, scale, bias))
    wb = w.bfloat16()
    assert native.linear_bf16(x, wb, out=out) is out
    assert torch.equal(out, native.linear_bf16(x, wb))
    for bad in (torch.empty(3, 41, dtype=torch.bfloat16), torch.empty(3, 40), torch.empty(40, 3, dtype=torch.bfloat16).T):
        with pytest.raises(ValueError):
            native.linear_int8(x, w, scale, out=bad)
        with pytest.raises(ValueError):
            native.linear_bf16(x, wb, out=bad)


def test_empty_sizes(gemv_isa: ctypes.CDLL) -> None:
    w = torch.randint(-5, 5, (33, 64), dtype=torch.int8)
    s = torch.ones(33).bfloat16()
    assert native.linear_int8(torch.zeros(0, 64).bfloat16(), w, s).shape == (0, 33)
    assert native.linear_bf16(torch.zeros(2, 64).bfloat16(), w[:0].bfloat16()).shape == (2, 0)
    b = torch.randn(33).bfloat16()
    assert torch.equal(native.linear_bf16(torch.zeros(2, 0).bfloat16(), torch.zeros(33, 0).bfloat16(), b),
                       b.expand(2, 33))


def test_bad_arguments_raise_value_error(gemv_isa: ctypes.CDLL) -> None:
    x, w, scale, bias = _int8_case(2, 8, 64)
    wb = w.bfloat16()
    bad_int8 = [
        (x.float(), w, scale, None),                   # x dtype
        (x[:, :32], w, scale, None),                   # K mismatch
        (x, w.float(), scale, None),                   # weight dtype
        (x, w[None], scale, None),                     # weight not 2-D
        (x, w.T.contiguous().T, scale, None),          # weight not contiguous
        (x, w, scale[:4], None),                       # scale shape
        (x, w, scale.float(), None),                   # scale dtype
        (x, w, scale, bias[:3]),                       # bias shape
        (x, w, scale, bias.float()),                   # bias dtype
        (x, w, None, None),                            # no scale
        ([1.0] * 64, w, scale, None),                  # not a tensor
    ]
    for args in bad_int8:
        with pytest.raises(ValueError):
            native.linear_int8(*args)
    for args in [(x.half(), wb, None), (x, w, None), (x, wb[:, :10], None), (x, wb, bias[:2]),
                 (x, wb.T, None), (x, wb, bias.double())]:
        with pytest.raises(ValueError):
            native.linear_bf16(*args)


def test_switched_off_or_unsupported_gives_none(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    assert loader._open({"GPTJ_NATIVE": "0", "GPTJ_CACHE_DIR": str(tmp_path)}) is None
    monkeypatch.setattr(cpu, "flags", lambda: frozenset({"avx2", "avx512f"}))
    assert loader._open({"GPTJ_CACHE_DIR": str(tmp_path)}) is None
    monkeypatch.undo()
    assert loader._open({"CC": "no-such-compiler-gptj", "GPTJ_CACHE_DIR": str(tmp_path)}) is None
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(build, "ISAS", tuple(dataclasses.replace(i, sources=(bad,)) for i in build.ISAS))
    assert loader._open({"GPTJ_CACHE_DIR": str(tmp_path / "c")}) is None
    assert not any((tmp_path / "c").glob("*"))  # no partial files left behind


def test_switched_off_in_process_a_direct_call_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """conftest.force_fallback reaches what gptj.native.ops calls (gptj.native.loader's bound functions):
    a kernel called directly raises, naming itself, as on a machine without the library."""
    native.load()  # bound, where this machine runs the kernels: force_fallback must take them away
    force_fallback(monkeypatch)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="linear_int8: the native gemv kernels are not available"):
        native.linear_int8(x, torch.zeros(32, 64, dtype=torch.int8), torch.ones(32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="gelu: the native elementwise kernels are not available"):
        native.gelu(x)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_build_names_by_hash_and_reuses(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The build cache, on any x86-64 CPU with gcc (a trivial source; the CPU's flags faked)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"native kernels are for x86-64, this is {platform.machine()}")
    monkeypatch.setattr(cpu, "flags", lambda: frozenset(native.REQUIRED_CPU_FLAGS))
    src = tmp_path / "tiny.c"
    src.write_text("int gemv_tiny(void) { return 7; }\n")
    monkeypatch.setattr(build, "ISAS", tuple(dataclasses.replace(i, sources=(src,)) for i in build.ISAS))
    env = {"GPTJ_CACHE_DIR": str(tmp_path / "cache")}
    path = build.library_path(env)
    assert path is not None and path.parent == tmp_path / "cache" and path.suffix == ".so"
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    mtime = path.stat().st_mtime_ns
    assert build.library_path(env) == path and path.stat().st_mtime_ns == mtime  # reused, not rebuilt
    src.write_text("int gemv_tiny(void) { return 8; }\n")
    assert build.library_path(env) != path  # another source, another name


def test_only_the_library_built_for_this_cpu_is_named_by_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """The AVX-512 library is compiled for the building CPU (-march=native): its name holds that CPU's
    flags as /proc/cpuinfo lists them, whatever a ceiling or a faked kind says. A fixed instruction
    set's library (AVX2, generic) is the same on every CPU: its name holds none, so a capped or faked
    kind (tests/test_cpu.py's) loads the one already built."""
    by = {i.name: i for i in native.ISAS}
    fixed = [by["avx2"], by["generic"]]
    monkeypatch.setattr(cpu, "flags", lambda: frozenset({"avx2", "fma", "f16c"}))  # a faked kind
    monkeypatch.setattr(cpu, "read_flags", lambda path="/proc/cpuinfo": frozenset({"avx512f", "avx512_bf16"}))
    assert all(build._build_flags(i) == frozenset() for i in fixed)
    assert build._build_flags(by["avx512-bf16"]) == {"avx512f", "avx512_bf16"}
    names = {build._library_name(b"src", "gcc 12", build._build_flags(by["avx512-bf16"]), by["avx512-bf16"])}
    monkeypatch.setattr(cpu, "read_flags", lambda path="/proc/cpuinfo": frozenset({"avx512f", "avx512_bf16", "amx"}))
    names.add(build._library_name(b"src", "gcc 12", build._build_flags(by["avx512-bf16"]), by["avx512-bf16"]))
    assert len(names) == 2  # another CPU, another build


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_builds_started_together_compile_once(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Processes that need the library at once (pytest-xdist's workers, torchrun's ranks) build it once:
    the others wait on the cache folder's lock, then load what the first wrote. Threads here: each opens
    the folder itself, so their flocks exclude each other as two processes' do; the compile is slowed so
    that, without the lock, all four would be compiling at once."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(cpu, "flags", lambda: frozenset(native.REQUIRED_CPU_FLAGS))
    src = tmp_path / "tiny.c"
    src.write_text("int gemv_tiny(void) { return 7; }\n")
    monkeypatch.setattr(build, "ISAS", tuple(dataclasses.replace(i, sources=(src,)) for i in build.ISAS))
    compiles, real, start = [], build._compile, threading.Barrier(4)

    def slow_compile(cc, target, isa):
        compiles.append(target)
        time.sleep(0.5)
        return real(cc, target, isa)

    def build_together(_):
        start.wait()
        return build.library_path({"GPTJ_CACHE_DIR": str(tmp_path / "cache")})

    monkeypatch.setattr(build, "_compile", slow_compile)
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(build_together, range(4)))
    assert len(compiles) == 1 and len(set(paths)) == 1 and paths[0].is_file()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [paths[0].name]  # no lock file left either


@needs_native
def test_one_openmp_runtime() -> None:
    """The library's libgomp.so.1 dependency resolves to the runtime torch already loaded."""
    native.load()
    runtimes = openmp_runtimes()
    assert len(runtimes) == 1, runtimes


@needs_native
def test_load_is_cached() -> None:
    assert native.load() is native.load()
    assert isinstance(native.load(), ctypes.CDLL)


def _attention_reference(q, pk, pv, tk, tv):
    """float64 softmax(q . [pk | tk[n]] / sqrt(D)) @ [pv | tv[n]] per query."""
    outs = []
    for n in range(q.shape[0]):
        k = torch.cat([pk, tk[n]], dim=1).double() if tk is not None else pk.double()
        v = torch.cat([pv, tv[n]], dim=1).double() if tv is not None else pv.double()
        s = (k @ q[n].double()[:, :, None])[..., 0] / q.shape[-1] ** 0.5  # (H, L)
        outs.append((torch.softmax(s, -1)[:, None, :] @ v)[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("L, k, kv_heads", [(21, 5, 4), (16, 3, 4), (3, 6, 2), (40, 12, 1)])
def test_a_staired_groups_rows_are_each_rows_own_decode_bit_for_bit(L, k, kv_heads, native_isa):
    """A speculative draft's k rows as one group (attention_paged's `stair`: the sequence's full blocks
    before position L shared, row i owning L % B + 1 + i tokens of the blocks after) give each row what
    a group of that row alone over its L + 1 + i tokens gives, bit for bit (bfloat16 and int8 KV;
    grouped-query heads too); a group's stair must not be negative."""
    B, H, D, n_blocks = 8, 4, 32, 12
    g = torch.Generator().manual_seed(L * 10 + k)
    blocks = torch.randperm(n_blocks, generator=g)[:-(-(L + k) // B)].tolist()
    q = torch.randn(k, H, D, generator=g)
    kc, vc = (torch.randn(n_blocks, kv_heads, B, D, generator=g).bfloat16() for _ in range(2))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    s = L // B
    for scales in ((), tuple(torch.rand(n_blocks, kv_heads, B, generator=g) * 0.02 for _ in range(2))):
        kv = (kc, vc) if not scales else tuple((x.float() * 40).round().clamp(-127, 127).to(torch.int8) for x in (kc, vc))
        staired = native.attention_paged(q, *kv, i32([0, k]), i32(blocks[:s] or [0]), i32([0]), i32([s * B]),
                                         i32([blocks[s:] + [0] * (s + len(blocks) - len(blocks))] * k),
                                         i32([L + 1 - s * B]), *scales, stair=i32([1]))
        alone = native.attention_paged(q, *kv, i32(list(range(k + 1))), i32(blocks * k), i32([len(blocks) * i for i in range(k)]),
                                       i32([L + 1 + i for i in range(k)]), i32([[0]] * k), i32([0] * k), *scales)
        assert torch.equal(staired, alone), bool(scales)
    with pytest.raises(RuntimeError, match="failed"):
        native.attention_paged(q, kc, vc, i32([0, k]), i32(blocks[:s] or [0]), i32([0]), i32([s * B]),
                               i32([blocks[s:]] * k), i32([L + 1 - s * B]), stair=i32([-1]))


@pytest.mark.parametrize("N, T", [(1, 0), (4, 1), (4, 9), (11, 3)])
def test_attention_group_matches_float64_over_strided_views(N, T, native_isa):
    g = torch.Generator().manual_seed(N * 10 + T)
    H, D, P = 3, 32, 21
    pool = torch.randn(3, H, P + 5, D, generator=g).bfloat16()
    tails = torch.randn(N + 2, H, T + 4, D, generator=g).bfloat16()
    q = torch.randn(N, H, D, generator=g)
    pk, pv = pool[0, :, :P], pool[2, :, :P]  # views with the pool's strides
    tk, tv = (tails[:N, :, :T], tails[2:, :, :T]) if T else (None, None)
    got = native.attention_group(q, pk, pv, tk, tv)
    assert got.dtype == torch.float32 and got.shape == (N, H, D)
    # Float32 throughout: a score is off by <= D u sum|q k| / sqrt(D) (S below), and moves its
    # probability by <= that relatively (2x: its own exp and the normaliser's); the L exps are
    # summed (L u) and the L weighted values too (L u of max|v|). So
    # |error| <= max|v| (2 D u S + (2 L + 6) u).
    u, L = 2.0**-24, P + T
    keys = [torch.cat([pk, tk[n]], 1) if T else pk for n in range(N)]  # (H, L, D) each
    S = max(float((k.double().abs() @ q[n].double().abs()[:, :, None]).max()) for n, k in enumerate(keys)) / D**0.5
    vmax = max(float(pv.double().abs().max()), float(tv.double().abs().max()) if T else 0.0)
    bound = vmax * (2 * D * u * S + (2 * L + 6) * u)
    torch.testing.assert_close(got.double(), _attention_reference(q, pk, pv, tk, tv), rtol=0, atol=bound)


@pytest.mark.parametrize("K", [37, 256, 1000])
def test_w8a8_gemm_is_the_exact_integer_sum_then_w8a8s_roundings(K, native_isa):
    """int32 sums of int8 x int8 products are exact on every ISA (vpmaddwd / vpdpwssd), so the result
    is W8A8Linear's expression to the bit: (sum * ws * sx) rounded to bfloat16, + bias rounded again.
    N = 70 ends in a part-filled panel (and vector); the row counts cover every tile height (1-6 rows),
    tiles past the first, and (K = 1000, 200 rows) an x too large for L2, in blocks of rows (126 there)
    and slices of K."""
    g = torch.Generator().manual_seed(K)
    N = 70
    w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    w[0] = 127  # the largest sums: every product 127 x (q + 128 - 128) at its extremes
    w[1] = -127
    ws = torch.rand(N, generator=g) * 0.01
    bias = torch.randn(N, generator=g).bfloat16()
    packed = native.pack_w8a8(w)
    assert packed.shape[1:] == ((K + 1) // 2, packed.shape[2], 2) and packed.shape[0] * packed.shape[2] >= N
    for M in (1, 2, 3, 4, 5, 6, 9, 13) + ((200,) if K == 1000 else ()):
        qu = torch.randint(0, 256, (M, K), generator=g, dtype=torch.uint8)
        qu[0] = 255
        qu[-1] = 0  # q = -128: with w = -127 the largest positive products
        sx = torch.rand(M, 1, generator=g) + 0.1
        acc = ((qu.long() - 128) @ w.long().t()).float()
        for dtype, b in ((torch.bfloat16, bias), (torch.bfloat16, None), (torch.float32, bias), (torch.float32, None)):
            y = native.linear_w8a8(qu, sx, packed, ws, b, dtype)
            want = (acc * ws * sx).to(dtype)
            if b is not None:
                want = want + b.to(dtype)
            assert y.dtype == dtype and torch.equal(y, want), (M, dtype, b is None)


@pytest.mark.parametrize("K, M", [(4096, 130), (9000, 13)])
def test_w8a8_gemm_rows_do_not_depend_on_their_call(K, M, native_isa):
    """Each output is its lane's own sum in k order, carried across slices of K exactly (int32): a row's
    result is the same alone (one pass over K), in any tile height, among 130 rows (K = 4096: slices of
    1024 inputs, blocks of 126 rows) and among 13 (K = 9000: decode's rows, each panel, too long to stay
    in L2, in slices of 1024 inputs that every tile passes over), at 1 and 2 threads, and it is the exact
    sum's."""
    g = torch.Generator().manual_seed(5)
    N = 40
    w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    packed, ws = native.pack_w8a8(w), torch.rand(N, generator=g)
    qu = torch.randint(0, 256, (M, K), generator=g, dtype=torch.uint8)
    sx = torch.rand(M, 1, generator=g)
    whole = native.linear_w8a8(qu, sx, packed, ws, dtype=torch.float32)
    assert torch.equal(whole, ((qu.long() - 128) @ w.long().t()).float() * ws * sx)
    for r in (0, 5, M - 3, M - 1):
        assert torch.equal(native.linear_w8a8(qu[r:r + 1], sx[r:r + 1], packed, ws, dtype=torch.float32),
                           whole[r:r + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native.linear_w8a8(qu, sx, packed, ws, dtype=torch.float32), whole)
    finally:
        torch.set_num_threads(threads)


def test_w8a8_gemm_refuses_bad_inputs(native_isa):
    qu, w = torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(8, 64, dtype=torch.int8)
    sx, ws = torch.ones(2, 1), torch.ones(8)
    with pytest.raises(ValueError, match="int8"):
        native.pack_w8a8(w.float())
    with pytest.raises(ValueError, match="pack_w8a8's int8"):
        native.linear_w8a8(qu, sx, w, ws)  # the plain layout
    packed = native.pack_w8a8(w)
    with pytest.raises(ValueError, match="pack_w8a8's int8"):
        native.linear_w8a8(qu[:, :62].contiguous(), sx, packed, ws)  # packed for another K
    with pytest.raises(ValueError, match="weight_scale"):
        native.linear_w8a8(qu, sx, packed, ws.bfloat16())
    with pytest.raises(ValueError, match="above 131072"):
        native.linear_w8a8(torch.zeros(1, 131073, dtype=torch.uint8), sx[:1], packed, ws)


def test_attention_group_refuses_bad_inputs(native_isa):
    q = torch.randn(2, 3, 24)
    k = torch.randn(3, 5, 24).bfloat16()
    with pytest.raises(ValueError, match="multiple of 16"):
        native.attention_group(q, k, k)
    q = torch.randn(2, 3, 32)
    k = torch.randn(3, 5, 32).bfloat16()
    with pytest.raises(ValueError, match="tails must be bfloat16"):
        native.attention_group(q, k, k, torch.randn(2, 3, 4, 32), torch.randn(2, 3, 4, 32))


def test_the_kernels_build_wherever_the_cpu_can_run_them():
    """On a CPU with AVX2 + FMA + F16C (or AVX-512), gcc and GPTJ_NATIVE unset, a failing build is a
    failure, not a skip of every native test; elsewhere the reason is one line. The library is the
    best ISA's (AVX-512-BF16's where the CPU runs it), or GPTJ_NATIVE_ISA's."""
    best = native.best_isa()
    can_run = (platform.machine() in ("x86_64", "AMD64") and best is not None
               and shutil.which(os.environ.get("CC") or "gcc") is not None and not build.disabled())
    assert native.available() is can_run, WHY_NOT
    assert native.has("gemv") is native.has("attention") is native.has("elementwise") is can_run
    if not can_run:
        assert WHY_NOT and "\n" not in WHY_NOT
    elif not os.environ.get("GPTJ_NATIVE_ISA"):
        assert native.isa() == best
    assert "GPTJ_NATIVE=0" in native.unavailable_reason({"GPTJ_NATIVE": "0"})
    assert "not one of avx512-bf16, avx512, avx2, generic" in native.unavailable_reason({"GPTJ_NATIVE_ISA": "sse9"})


def test_each_cpu_kind_gets_the_best_library_it_runs():
    """AVX-512 with BF16 and VNNI: the avx512-bf16 library; AVX-512 without BF16 (Cascade Lake, Ice
    Lake, Skylake-SP): the avx512 one; AVX2: avx2's; an older x86-64: none."""
    from cpu_kinds import AMX, FLAGS

    want = {cpu.AVX512_BF16: "avx512-bf16", cpu.AVX512_VNNI: "avx512", cpu.AVX512: "avx512", cpu.AVX2: "avx2",
            cpu.OTHER: None}
    assert set(want) == set(cpu.KINDS)
    for kind, name in want.items():
        assert getattr(native.best_isa(FLAGS[kind]), "name", None) == name, kind
    assert native.best_isa(AMX).name == "avx512-bf16"
    # a ceiling below BF16 on an AVX-512-BF16 CPU: the avx512 library, as on the CPU it stands for
    capped = cpu.cap(FLAGS[cpu.AVX512_BF16], cpu.ceiling({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}))
    assert native.best_isa(capped).name == "avx512"


def test_gptj_native_isa_picks_a_lower_isa_only_where_the_cpu_runs_it(monkeypatch):
    avx2 = next(i for i in native.ISAS if i.name == "avx2")
    monkeypatch.setattr(cpu, "flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    assert native.requested_isa({"GPTJ_NATIVE_ISA": "avx2"}) == (avx2, None)
    assert native.requested_isa({}) == (avx2, None)
    for name in ("AVX512-BF16", "avx512"):
        isa, why = native.requested_isa({"GPTJ_NATIVE_ISA": name})
        assert isa is None and "lacks avx512f" in why and f"GPTJ_NATIVE_ISA={name.lower()}" in why
    monkeypatch.setattr(cpu, "flags", lambda: frozenset({"sse4_2"}))
    assert native.requested_isa({}) == (None, None)
    assert "lacks avx2, fma, f16c" in native.unavailable_reason({})
    assert "GPTJ_NATIVE_ISA=generic" in native.unavailable_reason({})


def test_the_generic_library_runs_only_when_asked_for_on_any_cpu(monkeypatch):
    """The portable library is chosen by GPTJ_NATIVE_ISA=generic alone, on any CPU (ARM's flags are no
    x86 flags: gptj.cpu reads none there); never by the CPU's flags, even where no other runs."""
    generic = next(i for i in native.ISAS if i.name == "generic")
    assert not generic.auto and generic.cpu_flags == ()
    for flags in (frozenset(native.REQUIRED_CPU_FLAGS), frozenset({"avx2", "fma", "f16c"}), frozenset()):
        monkeypatch.setattr(cpu, "flags", lambda flags=flags: flags)
        assert native.best_isa() is not generic
        assert native.requested_isa({"GPTJ_NATIVE_ISA": "generic"}) == (generic, None)
    assert native.best_isa() is None  # no x86 flags: torch's kernels, unless asked
    if shutil.which(os.environ.get("CC") or "gcc") is not None:  # asked: it builds, loads and says nothing is wrong
        monkeypatch.setenv("GPTJ_NATIVE_ISA", "generic")
        monkeypatch.delenv("GPTJ_NATIVE", raising=False)  # (a run with the native kernels switched off)
        unload_native(monkeypatch)
        assert native.unavailable_reason() is None and native.isa() is generic and native.available()
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    why = native.unavailable_reason({})
    assert "not an x86-64 CPU (aarch64)" in why and "GPTJ_NATIVE_ISA=generic" in why
    assert native.unavailable_reason({"GPTJ_NATIVE": "0", "GPTJ_NATIVE_ISA": "generic"}).startswith("switched off")


def test_the_generic_kernels_compile_for_aarch64(tmp_path):
    """simd_generic.h is the vector layer an ARM CPU would build (GCC's vector extensions, no intrinsic):
    every kernel source compiles with it for AArch64, by zig's clang, a cross compiler pip installs
    (`pip install ziglang`: not a test extra, 400 MB; skipped without it). Linking would need an
    OpenMP runtime zig does not ship: the sources are compiled, not linked, against a header declaring
    the OpenMP functions they call."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("ziglang") is None:
        pytest.skip("no AArch64 cross compiler here (pip install ziglang provides one)")
    (tmp_path / "omp.h").write_text("int omp_get_max_threads(void);\nint omp_get_thread_num(void);\n")
    generic = next(i for i in native.ISAS if i.name == "generic")
    for src in native.SOURCES:
        obj = tmp_path / f"{src.stem}.o"
        proc = subprocess.run([sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-gnu", "-O2", "-std=c11",
                               "-fopenmp", f"-I{tmp_path}", *generic.cflags, "-c", str(src), "-o", str(obj)],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        head = obj.read_bytes()[:20]
        assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183  # e_machine: EM_AARCH64


_QEMU_DRIVER = r"""
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
int gemv_int8_f32(const uint16_t *, const int8_t *, const uint16_t *, const uint16_t *, float *, int, int, int, int);
int gemv_bf16_f32(const uint16_t *, const uint16_t *, const uint16_t *, float *, int, int, int, int);
int gemm_w8a8(const uint8_t *, const float *, const int8_t *, const float *, const uint16_t *, void *, int, int, int,
              int, int);
void gelu_bf16(const uint16_t *, long, uint16_t *, long, long, long, int);
int attend_group_bf16(const float *, int, int, int, const uint16_t *, const uint16_t *, long, long, int,
                      const uint16_t *, const uint16_t *, long, long, long, int, float *, float, int);
static FILE *in;
static void *next(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p || fread(p, 1, n, in) != n) exit(3);
    return p;
}
/* argv[1]: kind (int32), M, N, K, then the kernel's arrays in order; argv[2]: its float32 or bfloat16 out
   (M x N values; attention: M queries x N heads x K dimensions, after two more int32: prompt and tail) */
int main(int argc, char **argv)
{
    if (argc != 3 || !(in = fopen(argv[1], "rb"))) return 2;
    const int32_t *h = next(16);
    const long M = h[1], N = h[2] * (h[0] == 4 ? h[3] : 1), K = h[3], P = 16;  /* P: the W8A8 panel */
    void *y = malloc(M * N * 4);
    int rc = 0;
    if (h[0] == 4) {
        const int32_t *pt = next(8);
        const long H = h[2], L = pt[0], T = pt[1];
        const void *q = next(M * H * K * 4), *pk = next(H * L * K * 2), *pv = next(H * L * K * 2);
        const void *tk = next(M * H * T * K * 2), *tv = next(M * H * T * K * 2);
        rc = attend_group_bf16(q, M, H, K, pk, pv, L * K, K, L, tk, tv, H * T * K, T * K, K, T, y, 1.0f / sqrtf(K), 1);
    }
    if (h[0] == 0) {
        const void *x = next(M * K * 2), *w = next(N * K), *s = next(N * 2), *b = next(N * 2);
        rc = gemv_int8_f32(x, w, s, b, y, M, N, K, 1);
    } else if (h[0] == 1) {
        const void *x = next(M * K * 2), *w = next(N * K * 2), *b = next(N * 2);
        rc = gemv_bf16_f32(x, w, b, y, M, N, K, 1);
    } else if (h[0] == 2) {
        const void *q = next(M * K), *sx = next(M * 4), *w = next((N + P - 1) / P * P * ((K + 1) / 2) * 2);
        const void *ws = next(N * 4), *b = next(N * 2);
        rc = gemm_w8a8(q, sx, w, ws, b, y, 1, M, N, K, 1);
    } else if (h[0] == 3) {
        const void *x = next(M * N * 2);
        gelu_bf16(x, N, y, N, M, N, 1);
    }
    FILE *out = fopen(argv[2], "wb");
    if (rc || !out || fwrite(y, h[0] == 3 ? 2 : 4, M * N, out) != (size_t)(M * N)) return 4;
    return fclose(out);
}
"""


def test_the_generic_kernels_run_on_aarch64(tmp_path):
    """The portable library's kernels built for AArch64 (zig's clang, static against musl) and run by
    Debian's qemu-user (`apt-get install qemu-user`; skipped without it or ziglang): an ARM CPU's
    NEON code from GCC's vector extensions, with its fused multiply-adds. Each output within the bounds
    the x86 libraries' tests use: the GEMVs' float32 sums, W8A8's exact integer sums then its float32
    scaling, GELU its float64 value rounded once to bfloat16, decode attention's float32 softmax. One
    thread: zig ships no OpenMP runtime, so a header stands for the three OpenMP functions the sources
    call, and their loops run serially."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("ziglang") is None or shutil.which("qemu-aarch64") is None:
        pytest.skip("needs an AArch64 cross compiler and emulator (pip install ziglang; apt-get install qemu-user)")
    (tmp_path / "omp.h").write_text("static inline int omp_get_max_threads(void) { return 1; }\n"
                                    "static inline int omp_get_thread_num(void) { return 0; }\n"
                                    "static inline int omp_get_num_threads(void) { return 1; }\n")
    (tmp_path / "driver.c").write_text(_QEMU_DRIVER)
    generic = next(i for i in native.ISAS if i.name == "generic")
    exe = tmp_path / "kernels"
    proc = subprocess.run([sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-musl", "-O2", "-std=c11",
                           f"-I{tmp_path}", *generic.cflags, str(tmp_path / "driver.c"), *map(str, native.SOURCES),
                           "-o", str(exe), "-lm"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]

    def run(kind: int, M: int, N: int, K: int, *arrays: torch.Tensor, out=torch.float32) -> torch.Tensor:
        data = torch.tensor([kind, M, N, K], dtype=torch.int32).numpy().tobytes()
        data += b"".join(a.contiguous().view(torch.uint8).numpy().tobytes() for a in arrays)
        (tmp_path / "in").write_bytes(data)
        done = subprocess.run(["qemu-aarch64", str(exe), str(tmp_path / "in"), str(tmp_path / "out")],
                              capture_output=True, timeout=600)
        assert done.returncode == 0, done
        raw = bytearray((tmp_path / "out").read_bytes())
        return torch.frombuffer(raw, dtype=out).view(M, -1)

    u = 2.0**-24
    for M, N, K in ((1, 40, 1000), (5, 33, 64), (9, 70, 300)):
        x, w, scale, bias = _int8_case(M, N, K, seed=7)
        xd, wd = x.double(), w.double() * scale.double()[:, None]
        bound = (xd.abs() @ wd.abs().T + bias.double().abs()) * (K / 8 + 18) * u + 1e-30
        y = run(0, M, N, K, x, w, scale, bias)
        assert ((y.double() - (xd @ wd.T + bias.double())).abs() <= bound).all(), (M, N, K)
        wb = (torch.randn(N, K) * 0.05).bfloat16()
        y = run(1, M, N, K, x, wb, bias)
        ref = xd @ wb.double().T + bias.double()
        assert ((y.double() - ref).abs() <= (xd.abs() @ wb.double().abs().T + bias.double().abs())
                * (K / 8 + 18) * u + 1e-30).all(), (M, N, K)
        # W8A8: int8 x int8 summed exactly, then float(sum) * ws * sx + bias in float32 (2 roundings of the
        # product, 1 of the sum)
        q = torch.randint(-128, 128, (M, K), dtype=torch.int8)
        sx, ws = torch.rand(M) * 0.01 + 1e-3, torch.rand(N) * 0.01 + 1e-3
        packed = F.pad(w, (0, K % 2, 0, -N % 16)).view(-(-N // 16), 16, (K + 1) // 2, 2).permute(0, 2, 1, 3)
        y = run(2, M, N, K, (q.to(torch.int16) + 128).to(torch.uint8), sx, packed, ws, bias)
        prod = (q.double() @ w.double().T) * ws.double() * sx.double()[:, None]  # the sums < 2^24: exact in float32
        exact = prod + bias.double()
        assert ((y.double() - exact).abs() <= prod.abs() * 3 * u + exact.abs() * u + 1e-30).all(), (M, N, K)
    x = torch.cat([torch.linspace(-14, 8, 3000), 3 * torch.randn(1000, generator=torch.Generator().manual_seed(8))])
    x = x.bfloat16().view(4, 1000)
    got, want = run(3, 4, 1000, 0, x, out=torch.bfloat16).double(), _gelu64(x)
    assert ((got - want).abs() <= want.abs() * (U_BF16 + 1e-5) + 1e-30).all()
    # decode attention over a shared prompt and a tail each: the bound of the x86 test above
    g = torch.Generator().manual_seed(9)
    N, H, D, P, T = 3, 2, 32, 21, 5
    q = torch.randn(N, H, D, generator=g)
    pk, pv = torch.randn(2, H, P, D, generator=g).bfloat16()
    tk, tv = torch.randn(2, N, H, T, D, generator=g).bfloat16()
    got = run(4, N, H, D, torch.tensor([P, T], dtype=torch.int32), q, pk, pv, tk, tv).view(N, H, D)
    S = max(float((torch.cat([pk, tk[n]], 1).double().abs() @ q[n].double().abs()[:, :, None]).max())
            for n in range(N)) / D**0.5
    vmax = max(float(pv.double().abs().max()), float(tv.double().abs().max()))
    bound = vmax * (2 * D * u * S + (2 * (P + T) + 6) * u)
    torch.testing.assert_close(got.double(), _attention_reference(q, pk, pv, tk, tv), rtol=0, atol=bound)


# --- a fused block's elementwise steps ------------------------------------------------------------

U_BF16 = 2.0**-8  # bfloat16's unit roundoff: rounding to nearest moves a value by <= 2^-8 of it


def _gelu64(x: torch.Tensor) -> torch.Tensor:
    """0.5 x (1 + tanh u) in float64, as x / (1 + e^(-2u)) (the same function, without the cancellation
    that leaves nothing of it below x = -7 even in float64)."""
    x = x.double()
    u = (2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)
    return x / (1 + torch.exp(-2 * u))


def test_gelu_is_the_float64_value_rounded_once_to_bfloat16(native_isa):
    g = torch.Generator().manual_seed(5)
    x = torch.cat([torch.linspace(-14, 8, 40001).bfloat16().unique(), (3 * torch.randn(5000, generator=g)).bfloat16(),
                   torch.tensor([0.0, -0.0, 1e4, -1e4, 100.0, -100.0]).bfloat16()])
    got, want = native.gelu(x).double(), _gelu64(x)
    # float32 inside (exp to 5e-9, a few roundings: ~1e-6 of the value), then one rounding to bfloat16
    normal = want.abs() >= 2.0**-120
    assert ((got - want).abs() <= (U_BF16 + 1e-6) * want.abs())[normal].all()
    # values below 2^-120 (x < -10): e^(-2u) overflows float32 there and gives -0
    assert ((got - want).abs() <= 2.0**-120)[~normal].all()
    # torch's own tanh GELU agrees wherever it has no cancellation (x > -3)
    ok = x > -3
    torch.testing.assert_close(got[ok], F.gelu(x[ok], approximate="tanh").double(), rtol=2 * U_BF16, atol=0)


def test_gelu_reads_and_writes_strided_rows_in_place(native_isa):
    g = torch.Generator().manual_seed(6)
    y = torch.randn(2, 5, 70, generator=g).bfloat16()  # [q k v | fc_in] of a fused block, say
    out = torch.full((2, 5, 50), 7.0).bfloat16()
    native.gelu(y[..., 30:], out=out[..., 10:])
    assert torch.equal(out[..., 10:], native.gelu(y[..., 30:].contiguous()))
    assert (out[..., :10] == 7).all()  # nothing outside the view written
    with pytest.raises(ValueError, match="shape"):
        native.gelu(y, out=out)
    with pytest.raises(ValueError, match="bfloat16"):
        native.gelu(y.float())
    with pytest.raises(ValueError, match="rows of contiguous"):
        native.gelu(y[..., :5], out=torch.empty(5, 2, 10).bfloat16().transpose(0, 1)[..., ::2])


@pytest.mark.parametrize("R, D", [(16, 16), (32, 64), (64, 256)])
def test_rotary_rotates_q_and_k_pairs_in_place(R, D, native_isa):
    from gptj.models.gptj import rope_table, rotary_tables, rotate_every_two

    g = torch.Generator().manual_seed(R + D)
    T, H = 9, 3
    qkv = torch.randn(T, 3, H, D, generator=g).bfloat16()
    sin, cos = (t.reshape(T, R) for t in rotary_tables(rope_table(64, R), torch.arange(20, 20 + T)[None], torch.bfloat16))
    before = qkv.clone()
    native.rotary_(qkv.view(T, 3 * H, D)[:, :2 * H], sin, cos)
    x = before[:, :2, :, :R].double()
    s, c = sin.double()[:, None, None], cos.double()[:, None, None]
    want = x * c + rotate_every_two(x) * s
    # exact bfloat16 products, one float32 sum (2^-24 of the terms), one rounding to bfloat16
    terms = (x * c).abs() + (rotate_every_two(x) * s).abs()
    assert ((qkv[:, :2, :, :R].double() - want).abs() <= U_BF16 * want.abs() + 2.0**-23 * terms).all()
    assert torch.equal(qkv[:, :2, :, R:], before[:, :2, :, R:]) and torch.equal(qkv[:, 2], before[:, 2])
    with pytest.raises(ValueError, match="multiple of 16"):
        native.rotary_(qkv.view(T, 3 * H, D), sin[:, :8], cos[:, :8])


def test_store_kv_puts_each_token_in_its_block_row(native_isa):
    g = torch.Generator().manual_seed(7)
    N, H, D, B = 11, 3, 32, 4
    qkv = torch.randn(N, 3, H, D, generator=g).bfloat16()
    k, v = qkv[:, 1], qkv[:, 2]  # (N, H, D) views, each token's heads side by side
    kc, vc = torch.zeros(6, H, B, D).bfloat16(), torch.zeros(6, H, B, D).bfloat16()
    blocks = torch.tensor([5, 5, 5, 5, 0, 0, 0, 0, 3, 3, 2])
    offsets = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 3])
    native.store_kv(k, v, kc, vc, blocks, offsets)
    wk, wv = torch.zeros_like(kc), torch.zeros_like(vc)
    wk[blocks, :, offsets], wv[blocks, :, offsets] = k, v
    assert torch.equal(kc, wk) and torch.equal(vc, wv)
    with pytest.raises(ValueError, match="int64"):
        native.store_kv(k, v, kc, vc, blocks.int(), offsets)
    with pytest.raises(ValueError, match="heads contiguous"):
        native.store_kv(k.transpose(0, 1), v.transpose(0, 1), kc, vc, blocks[:3], offsets[:3])


@pytest.mark.parametrize("K", [16, 1000, 5120])
def test_w8a8_rounding_is_gptj_quants_to_the_bit(K, native_isa):
    """quantize_rows_u8 gives quantize_rows_int8's q (+ 128) and scale, on strided rows, with and
    without smoothing, a zero row included; scale_rows gives torch's two bfloat16 roundings."""
    from gptj.quant.ops import quantize_rows_int8

    g = torch.Generator().manual_seed(K)
    wide = (torch.randn(9, K + 48, generator=g) * torch.rand(9, 1, generator=g) * 8).bfloat16()
    x = wide[:, 16:16 + K]  # rows strided, not contiguous
    x[3] = 0
    inv = torch.rand(K, generator=g) + 0.5
    for smooth in (inv, None):
        qu, s = native.quantize_rows_u8(x, smooth)
        q, s_ref = quantize_rows_int8(x.float() * (1 if smooth is None else smooth))
        assert qu.dtype == torch.uint8 and torch.equal(qu.int() - 128, q.int()) and torch.equal(s, s_ref)
    acc = torch.randn(9, 40, generator=g) * 300
    bias = torch.randn(40, generator=g).bfloat16()
    out = torch.zeros(9, 64).bfloat16()
    native.scale_rows(acc, s, bias, out=out[:, 8:48])
    assert torch.equal(out[:, 8:48], (acc * s).bfloat16() + bias) and not out[:, :8].any() and not out[:, 48:].any()
    assert torch.equal(native.scale_rows(acc, s), (acc * s).bfloat16())
    with pytest.raises(ValueError, match="inv_smooth"):
        native.quantize_rows_u8(x, inv[:-1])
    with pytest.raises(ValueError, match="row_scale"):
        native.scale_rows(acc, s[:-1])


def pack_int4_cpu_layout(q: torch.Tensor, block: int, split: bool) -> torch.Tensor:
    """Whole blocks of nibbles q (n, K) in torch's CPU int4 layout as gptj.quant.ops._unpack_cpu_int4
    reads it: per block, K columns of block / 2 bytes, byte j holding rows j and j + block / 2 (split)
    or rows 2j and 2j + 1."""
    n, K = q.shape
    b = q.view(n // block, block, K).permute(0, 2, 1)  # (blocks, K, block)
    lo, hi = (b[..., :block // 2], b[..., block // 2:]) if split else (b[..., 0::2], b[..., 1::2])
    return (lo | (hi << 4)).contiguous().view(n, K // 2)


@pytest.mark.parametrize("block, split", [(64, True), (32, False), (16, True)])
def test_int4_dequantize_is_int4_linears_values_transposed(block, split, native_isa):
    """int4_dequant_t: torch's CPU int4 layout (either byte order, blocks of 16 to 64 rows) to the
    bfloat16 values Int4Linear._dequant_rows computes (addcmul of q with the scale onto zero - 8 *
    scale rounded to bfloat16), transposed, bit for bit, into a strided output; bad shapes refused."""
    from gptj.quant.ops import _unpack_cpu_int4

    g = torch.Generator().manual_seed(block)
    n, K, group = 2 * block, 256, 64
    q = torch.randint(0, 16, (n, K), generator=g, dtype=torch.uint8)
    packed = pack_int4_cpu_layout(q, block, split)
    assert torch.equal(_unpack_cpu_int4(packed, (block, split)), q)
    scale = (torch.rand(n, K // group, generator=g) * 0.1).bfloat16()
    zero = (torch.randn(n, K // group, generator=g) * 0.3).bfloat16()
    zp = (zero.float() - 8 * scale.float()).bfloat16()
    want = torch.addcmul(zp[..., None], q.view(n, K // group, group).bfloat16(), scale[..., None]).view(n, K)
    out = torch.zeros(K, n + 8).bfloat16()
    native.int4_dequant_t(packed, K, (block, split), scale, zero, group, out[:, 4:4 + n])
    assert torch.equal(out[:, 4:4 + n], want.t()) and not out[:, :4].any() and not out[:, 4 + n:].any()
    with pytest.raises(ValueError, match="whole blocks"):
        native.int4_dequant_t(packed[:block // 2], K, (block, split), scale[:block // 2], zero[:block // 2], group,
                              out[:, :block // 2])
    with pytest.raises(ValueError, match="scale must"):
        native.int4_dequant_t(packed, K, (block, split), scale.t(), zero, group, out[:, :n])


def _int4_case(n: int, K: int, group: int, block: int, split: bool, seed: int):
    """An int4 weight in torch's CPU layout (whole blocks), its scales and zeros, the bfloat16 values
    int4_dequant_t makes of it (n, K): Int4Linear._dequant_rows' formula, and its integers q (n, K)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, K), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, K // group, generator=g) * 0.1 + 0.01).bfloat16()
    zero = (torch.randn(n, K // group, generator=g) * 0.3).bfloat16()
    zp = (zero.float() - 8 * scale.float()).bfloat16()
    want = torch.addcmul(zp[..., None], q.view(n, K // group, group).bfloat16(), scale[..., None]).view(n, K)
    return pack_int4_cpu_layout(q, block, split), scale, zero, want, q


def _needs_int4_gemm() -> None:
    """Skips where the bound library has no int4 GEMM (AVX512-BF16's only: the others run their GEMV at
    every row count) or gptj.native is unavailable."""
    if not native.available():
        pytest.skip(f"native kernels unavailable: {WHY_NOT}")
    if not native.int4_gemm_min_rows():
        pytest.skip(f"the {native.isa().name} library has no int4 GEMM (AVX512-BF16's only)")


def _int4_gemv_offset() -> int:
    """What the bound library's int4 GEMV adds to each nibble q in its sums: 128 on AVX512-BF16's (the
    bfloat16 128 + q), 0 on the vector layer's (q in float32)."""
    return 128 if native.int4_gemm_min_rows() else 0


@contextlib.contextmanager
def _int4_kernel(kind: str):
    """linear_int4 runs its GEMV ("gemv") or its GEMM ("gemm") at every row count until the block ends."""
    before = native.int4_gemm_min_rows(1 << 30 if kind == "gemv" else 1)
    try:
        yield
    finally:
        native.int4_gemm_min_rows(before)


INT4_LAYOUTS = [(64, True), (32, True), (64, False), (32, False)]
INT4_SHAPES = [(1, 64, 256, 32), (13, 128, 4352, 128), (45, 192, 512, 256), (28, 64, 128, 64), (1030, 64, 64, 64)]


@pytest.mark.parametrize("block, split", INT4_LAYOUTS)
@pytest.mark.parametrize("M,n,K,group", INT4_SHAPES)
def test_int4_gemm_is_within_float32_sums_and_one_bfloat16_rounding(block, split, M, n, K, group):
    """linear_int4's GEMM (AVX512-BF16's; forced at every row count) on torch's CPU layout, in each byte
    order and block it takes: each output is one float32 lane over the products of x with int4_dequant_t's
    bfloat16 weights, each product exact (bfloat16 x bfloat16) and each addition rounded once, then
    rounded to bfloat16: within (K + 2) u sum|terms| of the float64 value, plus bfloat16's unit roundoff
    (2^-8) of it. The shapes take a row, tiles of 6 to 12 rows (28: 10 + 9 + 9), K in three slices (4352
    inputs: 2048 + 128 pairs), every group size, and M past the 1024-row block; the output is columns of
    a wider tensor, left alone elsewhere."""
    _needs_int4_gemm()
    packed, scale, zero, want, _ = _int4_case(n, K, group, block, split, seed=M + n + K)
    g = torch.Generator().manual_seed(K)
    x = torch.randn(M, K, generator=g).bfloat16()
    out = torch.zeros(M, n + 8).bfloat16()
    with _int4_kernel("gemm"):
        native.linear_int4(x, packed, K, (block, split), scale, zero, group, out=out[:, 4:4 + n])
    xd, wd = x.double(), want.double()
    ref = xd @ wd.T
    f32 = (xd.abs() @ wd.abs().T) * (K + 2) * 2.0**-24 + 1e-30
    y = out[:, 4:4 + n].double()
    assert ((y - ref).abs() <= f32 + (ref.abs() + f32) * 2.0**-8).all()
    assert not out[:, :4].any() and not out[:, 4 + n:].any()


@pytest.mark.parametrize("block, split", INT4_LAYOUTS)
@pytest.mark.parametrize("M,n,K,group", INT4_SHAPES[:4] + [(8, 256, 1024, 32), (2, 128, 4352, 128)])
def test_int4_gemv_is_within_float32_sums_of_the_exact_weights_and_one_bfloat16_rounding(block, split, M, n, K,
                                                                                        group, native_isa):
    """linear_int4's GEMV (forced at every row count on AVX512-BF16's library; the others have no other)
    multiplies the weights (q - 8) s + zero exactly, as torch's int4 kernel does, not their bfloat16
    roundings: per group, x's products with o + q (o = 128 on AVX512-BF16's library: the bfloat16 128 + q;
    0 on the vector layer's, x and q in float32) in float32 lanes (each product exact, each addition
    rounded once: at most K u of sum|x| (o + q)), scaled once by s and corrected by (zero - (o + 8) s)
    times x's float32 group sum (a rounding each), then rounded once to bfloat16. So within (K + 2 G + 4) u
    of sum|x| (s (o + q) + |zero - (o + 8) s|) (G: the groups) of the float64 value, plus bfloat16's unit
    roundoff of it. Every layout, a row to 45 (tiles of up to 8, 6 or 4 rows; 2 rows: 2 units a tile), every
    group size; the output is columns of a wider tensor, left alone elsewhere."""
    packed, scale, zero, _, q = _int4_case(n, K, group, block, split, seed=M + n + K)
    q, o = q.double(), _int4_gemv_offset()
    s, z = (t.double().repeat_interleave(group, 1) for t in (scale, zero))
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(K)).bfloat16()
    out = torch.zeros(M, n + 8).bfloat16()
    with _int4_kernel("gemv"):
        native.linear_int4(x, packed, K, (block, split), scale, zero, group, out=out[:, 4:4 + n])
    xd = x.double()
    ref = xd @ ((q - 8) * s + z).T
    f32 = (xd.abs() @ (s * (o + q) + (z - (o + 8) * s).abs()).T) * (K + 2 * K // group + 4) * 2.0**-24 + 1e-30
    y = out[:, 4:4 + n].double()
    assert ((y - ref).abs() <= f32 + (ref.abs() + f32) * 2.0**-8).all()
    assert not out[:, :4].any() and not out[:, 4 + n:].any()


def test_int4_gemm_rows_do_not_depend_on_their_call_or_the_threads(native_isa):
    """One lane per output, its products added in k order, in the GEMV and (AVX512-BF16's library) the
    GEMM: a row's result is the same in every call of either and at any thread count; by default the GEMV
    runs below int4_gemm_min_rows() rows (32), the GEMM from there; the other libraries have no GEMM
    (int4_gemm_min_rows() 0) and run the GEMV at every row count. Layouts it does not take, and bad
    arguments, are refused in one line."""
    packed, scale, zero, _, _ = _int4_case(128, 4352, 128, 64, True, seed=11)
    x = torch.randn(40, 4352, generator=torch.Generator().manual_seed(12)).bfloat16()

    def run(rows: torch.Tensor) -> torch.Tensor:
        return native.linear_int4(rows, packed, 4352, (64, True), scale, zero, 128)

    gemm = native.int4_gemm_min_rows() != 0
    assert native.int4_gemm_min_rows() == (32 if native_isa == "avx512-bf16" else 0)
    for kind in ("gemv", "gemm") if gemm else ("gemv",):
        with _int4_kernel(kind):
            full = run(x)
            for M in (1, 2, 3, 8, 12, 13, 27):
                assert torch.equal(run(x[-M:]), full[-M:]), (kind, M)
            assert torch.equal(_at_one_thread(lambda: run(x)), full), kind
        if kind == "gemv":
            assert torch.equal(run(x[:31]), full[:31])  # the default below 32 rows
            gemv = full
    assert torch.equal(run(x), full) and torch.equal(gemv, full) != gemm  # the GEMM from 32 rows, where it is
    with pytest.raises(ValueError, match="blocks of 16 rows"):
        native.linear_int4(x, packed, 4352, (16, True), scale, zero, 128)
    with pytest.raises(ValueError, match="x must be"):
        native.linear_int4(x.float(), packed, 4352, (64, True), scale, zero, 128)
    with pytest.raises(ValueError, match="out must be"):
        native.linear_int4(x, packed, 4352, (64, True), scale, zero, 128, out=torch.empty(40, 64).bfloat16())
    with pytest.raises(ValueError, match="scale must"):
        native.linear_int4(x, packed, 4352, (64, True), scale[:, :4].contiguous(), zero, 128)
    with pytest.raises(ValueError, match="groups of 8 inputs"):
        native.linear_int4(x, packed, 4352, (64, True), torch.zeros(128, 544).bfloat16(),
                           torch.zeros(128, 544).bfloat16(), 8)


def test_store_kv_rounds_int8_blocks_as_quantize_heads_does(native_isa):
    """int8 blocks: each token's head vectors rounded per head (gptj.quant's rounding) with the scale
    beside them; other slots untouched. Blocks without their scales, or scales of the wrong shape,
    are refused in one line."""
    from gptj.engine.attention import quantize_heads

    g = torch.Generator().manual_seed(8)
    N, H, D, B = 7, 3, 48, 4
    qkv = (torch.randn(N, 3, H, D, generator=g) * torch.logspace(-2, 1, N)[:, None, None, None]).bfloat16()
    k, v = qkv[:, 1], qkv[:, 2]
    kc, vc = torch.zeros(5, H, B, D, dtype=torch.int8), torch.zeros(5, H, B, D, dtype=torch.int8)
    ks, vs = torch.zeros(5, H, B), torch.zeros(5, H, B)
    blocks, offsets = torch.tensor([4, 4, 0, 2, 2, 2, 1]), torch.tensor([0, 3, 1, 0, 1, 2, 3])
    native.store_kv(k, v, kc, vc, blocks, offsets, ks, vs)
    for x, cache, scales in ((k, kc, ks), (v, vc, vs)):
        q, s = quantize_heads(x)
        assert torch.equal(cache[blocks, :, offsets], q) and torch.equal(scales[blocks, :, offsets], s)
        untouched = torch.ones(5, B, dtype=torch.bool)
        untouched[blocks, offsets] = False
        assert not cache.transpose(1, 2)[untouched].any() and not scales.transpose(1, 2)[untouched].any()
    with pytest.raises(ValueError, match="bfloat16 .no scales. or int8 with k_scale and v_scale"):
        native.store_kv(k, v, kc, vc, blocks, offsets)
    with pytest.raises(ValueError, match="float32 scales of shape"):
        native.store_kv(k, v, kc, vc, blocks, offsets, ks[:, :, :2].contiguous(), vs)


# --- the greedy step's argmax -----------------------------------------------------------------------


def test_a_row_holding_a_nan_or_an_infinity_gets_a_non_finite_scale(native_isa):
    """W8A8's activations and int8 KV round a row to int8 with s = max |x| / 127. A NaN in the row makes
    the definition's s NaN (gptj.quant.ops.quantize_rows_int8; an infinity makes it infinite), so the row
    comes back non-finite. The vector max drops NaNs: before this, s ignored the NaN, which was rounded
    to a finite byte, and the row came back finite. The other rows are as without them."""
    from gptj.quant.ops import quantize_rows_int8

    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(3)).bfloat16()
    q0, s0 = native.quantize_rows_u8(x)
    for bad in (math.nan, math.inf, -math.inf):
        xb = x.clone()
        xb[1, 7] = xb[3, 299] = bad  # a first vector and a tail
        q, s = native.quantize_rows_u8(xb)
        _, ref = quantize_rows_int8(xb)
        for row in (1, 3):
            assert math.isnan(s[row, 0]) == math.isnan(ref[row, 0]) and not math.isfinite(s[row, 0]), (bad, row)
        assert torch.equal(q[[0, 2, 4]], q0[[0, 2, 4]]) and torch.equal(s[[0, 2, 4]], s0[[0, 2, 4]]), bad


@pytest.mark.parametrize("int8_kv", [False, True])
def test_a_query_holding_a_nan_gives_nan_attention(int8_kv, native_isa):
    """A NaN in a query makes its head's output NaN, as the float reference's, with bfloat16 or int8 keys.
    Before, the softmax's max and exp dropped NaN scores (every key the same weight: the values' mean, a
    finite output), and with int8 keys the query's int16 scale ignored the NaN. Other heads and queries
    are as without it."""
    B, H, D, n_blocks, L = 8, 2, 64, 3, 20
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, H, D, generator=g)
    kc, vc = (torch.randn(n_blocks, H, B, D, generator=g).bfloat16() for _ in range(2))
    scales = ()
    if int8_kv:
        scales = tuple(torch.full((n_blocks, H, B), 0.02) for _ in range(2))
        kc, vc = ((x.float() * 50).round().clamp(-127, 127).to(torch.int8) for x in (kc, vc))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    args = (i32([0, 1, 2]), i32([0, 1, 2] * 2), i32([0, 3]), i32([L, L]), i32([[0]] * 2), i32([0, 0]))
    clean = native.attention_paged(q, kc, vc, *args, *scales)
    q[1, 0, 5] = math.nan
    out = native.attention_paged(q, kc, vc, *args, *scales)
    assert torch.isnan(out[1, 0]).all(), int8_kv
    assert torch.equal(out[0], clean[0]) and torch.equal(out[1, 1], clean[1, 1]), int8_kv


@pytest.mark.parametrize("N", [1, 7, 16, 50400])
def test_argmax_rows_is_torch_max_indices_with_ties_infinities_and_nans(N, native_isa):
    """gptj.native.argmax_rows gives torch.max(dim=-1)'s indices: the first of tied maxima (rows of few
    distinct values; maxima in two of the kernel's blocks), -0.0 and 0.0 equal, an infinity as large as
    it is, a NaN the largest (its first); rows that are views into a wider matrix; one thread or more."""
    g = torch.Generator().manual_seed(N)
    wide = torch.randint(-3, 3, (12, N + 5), generator=g).float()  # ties in every row
    x = wide[:, 2:N + 2]  # rows strided, N + 5 apart
    x[1] = -math.inf
    x[2, N // 2] = math.inf
    x[3, N - 1] = math.nan
    x[4, N // 3] = math.nan
    x[4, N - 1] = math.nan
    x[5] = -0.0
    x[5, N - 1] = 0.0
    x[6, N // 2] = -math.inf
    x[7] = torch.randn(N, generator=g) * 1e30
    x[8, 0] = math.inf
    x[8, N - 1] = math.inf
    x[9] = torch.randn(N, generator=g)
    x[9, N - 1] = 100.0  # the maximum in the last of the kernel's blocks of 256
    x[10] = 0.0
    x[10, (N * 2) // 3] = 5.0  # tied maxima in two blocks: the first wins
    x[10, N - 1] = 5.0
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got = native.argmax_rows(x)
        finally:
            torch.set_num_threads(before)
        assert got.dtype is torch.int64 and torch.equal(got, x.max(dim=-1).indices), (threads, got)
    assert native.argmax_rows(x[:0]).shape == (0,)
    for bad in (x.double(), x.t(), x[0], torch.empty(3, 0), [[1.0]]):
        with pytest.raises(ValueError):
            native.argmax_rows(bad)
