"""gptj.cpu (what the CPU offers) and the choices gptj.policy makes for each kind of CPU, with its
flags faked; and W8A8 on oneDNN's own kernels for CPUs without VNNI, run here under oneDNN's ceiling."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import force_fallback
from cpu_kinds import AMX, FLAGS, fake_cpu

from gptj import cpu, native, policy, quant


@pytest.mark.parametrize("kind", cpu.KINDS)
def test_each_kind_is_named_from_its_flags(kind):
    assert cpu.kind(FLAGS[kind]) == kind
    assert cpu.int8_sums_exact(FLAGS[kind]) is (kind in (cpu.AVX512_BF16, cpu.AVX512_VNNI))


def test_a_ceiling_takes_away_what_the_level_does_not_have():
    zen4 = FLAGS[cpu.AVX512_BF16]
    assert cpu.cap(zen4, None) == zen4
    assert cpu.kind(cpu.cap(zen4, "avx2")) == cpu.AVX2
    assert not any(f.startswith("avx512") for f in cpu.cap(zen4, "avx2_vnni_2"))
    assert cpu.kind(cpu.cap(zen4, "avx512_core")) == cpu.AVX512
    assert cpu.kind(cpu.cap(zen4, "avx512_core_vnni")) == cpu.AVX512_VNNI
    assert cpu.kind(cpu.cap(zen4, "avx512_core_bf16")) == cpu.AVX512_BF16
    assert cpu.kind(cpu.cap(zen4, "avx")) == cpu.OTHER
    assert cpu.cap(FLAGS[cpu.AVX2], "avx512_core") == FLAGS[cpu.AVX2]  # a ceiling never adds


@pytest.mark.parametrize(("value", "level"), [("AVX2", "avx2"), (" avx512_core_vnni ", "avx512_core_vnni"),
                                              ("AVX512_CORE_AMX", "avx10_1_512_amx"), ("ALL", None),
                                              ("DEFAULT", None), ("no-such-isa", None), ("", None)])
def test_the_ceiling_is_read_as_onednn_reads_it(value, level):
    assert cpu.ceiling({"ONEDNN_MAX_CPU_ISA": value}) == level
    assert cpu.ceiling({}) is None


def test_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma avx512f\nbugs\t\t: none\n")
    assert cpu.read_flags(str(info)) == {"fpu", "avx2", "fma", "avx512f"}
    assert cpu.read_flags(str(tmp_path / "missing")) == frozenset()


def test_this_machine_is_described_in_one_line():
    line = cpu.describe()
    assert line.split()[0] in cpu.KINDS and "\n" not in line
    assert cpu.kind() == line.split()[0]


# --- the policy's choices, per kind --------------------------------------------------------------


@pytest.mark.parametrize("kind", cpu.KINDS)
def test_w8a8_takes_an_exact_form_on_every_kind(kind, monkeypatch):
    fake_cpu(monkeypatch, kind)
    vnni = kind in (cpu.AVX512_BF16, cpu.AVX512_VNNI)
    assert policy.w8a8_form() == (policy.SHIFTED if vnni else policy.NATIVE if policy.native_gemv_available()
                                  else policy.SPLIT)
    monkeypatch.setattr(policy, "native_gemv_available", lambda: False)  # without gptj.native: oneDNN's
    assert policy.w8a8_form() == (policy.SHIFTED if vnni else policy.SPLIT)
    assert policy.w8a8_form("cuda") is None and not policy.can_pack_int8("cuda")
    for rows in (1, 64, 4096):
        assert policy.linear_path("cpu", torch.bfloat16, rows, "w8a8") == (policy.INT_MM if vnni else policy.DEQUANTIZE)
    # CUDA's choice does not depend on the host CPU
    assert policy.linear_path("cuda", torch.bfloat16, 64, "w8a8", (4096, 4096)) == policy.INT_MM


@pytest.mark.parametrize("kind", cpu.KINDS)
def test_w4a8_takes_the_native_gemm_wherever_a_library_loads(kind, monkeypatch):
    """Every library has W4A8's GEMM (w4a8.c, on the vector layer): on each kind whose library loads, W4A8
    layers of outputs in 16s take it at every row count; without gptj.native (the OTHER kind), or outputs
    not in 16s, the same product in float32."""
    fake_cpu(monkeypatch, kind)
    native_here = policy.native_gemv_available()
    assert kind != cpu.OTHER or not native_here  # no library for a CPU without AVX2
    for rows in (1, 8, 4096):
        assert policy.linear_path("cpu", torch.bfloat16, rows, "w4a8", (4096, 4096)) == (
            policy.NATIVE if native_here else policy.UPCAST)
        assert policy.linear_path("cpu", torch.bfloat16, rows, "w4a8", (4096, 200)) == policy.UPCAST


@pytest.mark.parametrize("kind", cpu.KINDS)
def test_the_native_kernels_and_bf16_packing_follow_the_kind(kind, monkeypatch):
    if kind == cpu.AVX512_BF16:  # this CPU's own kernels: faking its flags cannot build them
        if native.unavailable_reason() is not None:
            pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
        fake_cpu(monkeypatch, kind)
        assert policy.native_available()
        most = policy.native_int8_max_rows()  # the int8 GEMM's limit where the loaded library has it
        gemm = policy.NATIVE_INT8_GEMM_MAX_ROWS if native.int8_gemm_min_rows() else policy.NATIVE_INT8_MAX_ROWS
        assert most == (policy.NATIVE_INT8_AMX_MAX_ROWS if policy.cpu_amx() else gemm)
        assert policy.linear_path("cpu", torch.bfloat16, most, "int8") in (policy.NATIVE, policy.AMX)
        # past it, bfloat16 sums where the CPU has them
        assert policy.linear_path("cpu", torch.bfloat16, most + 1, "int8") == policy.DEQUANTIZE
        return
    fake_cpu(monkeypatch, kind)
    reason = native.unavailable_reason()
    want = {cpu.AVX2: "avx2", cpu.AVX512: "avx512", cpu.AVX512_VNNI: "avx512"}.get(kind)
    lib = want is not None and native.open_isa(want) is not None  # the kind's library runs here
    assert policy.native_available() is policy.native_gemv_available() is lib
    if lib:  # every kernel, the kind's library's: the GEMV (native layout), attention, the elementwise passes
        assert reason is None and native.isa().name == want
        assert native.has("attention") and native.has("elementwise")
        assert policy.pack_layout(1) == policy.NATIVE and policy.can_pack(torch.bfloat16, "cpu", policy.NATIVE)
        assert policy.linear_path("cpu", torch.bfloat16, 1, "native-layout") == policy.NATIVE
        assert policy.linear_path("cpu", torch.float32, policy.NATIVE_INT8_MAX_ROWS, "int8") == policy.NATIVE
        assert policy.native_elementwise("cpu", torch.bfloat16) and not policy.native_elementwise("cpu", torch.float32)
        assert policy.attention_path("cpu", torch.bfloat16, "auto", "auto").backend == policy.CPU_NATIVE
        # without bfloat16 arithmetic (AVX2; AVX-512 without BF16, where oneDNN only emulates it) the
        # native layout at any rows: the GEMV to 512 rows, then UPCAST
        assert policy.pack_layout(None) == policy.NATIVE
        big = policy.NATIVE_EMULATED_BF16_MAX_ROWS
        assert policy.linear_path("cpu", torch.bfloat16, big, "native-layout") == policy.NATIVE
        assert policy.linear_path("cpu", torch.bfloat16, big + 1, "native-layout") == policy.UPCAST
        # ...and weight-only layers past their kernels' rows dequantize for float32 sums
        many = policy.NATIVE_INT8_MAX_ROWS + 1
        assert policy.linear_path("cpu", torch.bfloat16, many, "int8") == policy.UPCAST
        assert policy.linear_path("cpu", torch.bfloat16, quant.KERNEL_MAX_ROWS["int4"] + 1, "int4") == policy.UPCAST
        assert policy.linear_path("cpu", torch.float32, many, "int8") == policy.DEQUANTIZE
    else:
        assert reason is not None and "\n" not in reason
        assert policy.pack_layout(1) == policy.ONEDNN  # no native layout without the native GEMV
        assert policy.linear_path("cpu", torch.bfloat16, 1, "int8") == policy.WEIGHT_ONLY
        assert policy.attention_path("cpu", torch.bfloat16, "auto", "auto").backend == policy.REFERENCE
    if kind in (cpu.AVX2, cpu.OTHER):
        assert not policy.can_pack(torch.bfloat16, "cpu")  # torch's oneDNN bfloat16 wants AVX-512
    assert policy.attention_path("cpu", torch.float32, "auto", "auto").backend == policy.REFERENCE  # exact


@pytest.mark.parametrize("gemm", [True, False])
def test_int8_layers_leave_the_gemv_after_a_few_rows_where_amx_runs_bf16_gemms(gemm, monkeypatch):
    """With AMX, the dequantized weight through oneDNN's bfloat16 GEMM beats gptj.native's int8 GEMV
    past NATIVE_INT8_AMX_MAX_ROWS rows; without it (Zen 4, or AMX under a lower ceiling) past
    NATIVE_INT8_GEMM_MAX_ROWS where the loaded library has the int8 GEMM (AVX512-BF16's), else past
    the GEMV's NATIVE_INT8_MAX_ROWS."""
    monkeypatch.setattr(policy, "native_gemv_available", lambda: True)
    monkeypatch.setattr(native, "int8_gemm_min_rows", lambda rows=None: 32 if gemm else 0)
    below_amx = cpu.cap(AMX, "avx512_core_bf16")
    assert cpu.kind(AMX) == cpu.kind(below_amx) == cpu.AVX512_BF16 and "amx_bf16" not in below_amx
    without_amx = policy.NATIVE_INT8_GEMM_MAX_ROWS if gemm else policy.NATIVE_INT8_MAX_ROWS
    for flags, most in ((AMX, policy.NATIVE_INT8_AMX_MAX_ROWS), (FLAGS[cpu.AVX512_BF16], without_amx),
                        (below_amx, without_amx)):
        monkeypatch.setattr(cpu, "flags", lambda f=flags: f)
        assert policy.native_int8_max_rows() == most
        assert policy.linear_path("cpu", torch.bfloat16, most, "int8") == policy.NATIVE
        assert policy.linear_path("cpu", torch.bfloat16, most + 1, "int8") == policy.DEQUANTIZE
    assert policy.NATIVE_INT8_AMX_MAX_ROWS < policy.NATIVE_INT8_MAX_ROWS < policy.NATIVE_INT8_GEMM_MAX_ROWS


def test_int4_layers_dequantize_from_a_few_rows_where_amx_runs_bf16_gemms(monkeypatch):
    """bfloat16 int4 calls leave torch's int4 kernel past INT4_AMX_KERNEL_MAX_ROWS rows on a CPU with
    AMX and gptj.native (which unpacks the layout), past INT4_BF16_KERNEL_MAX_ROWS with AVX512-BF16 but
    no AMX (Zen 4, AMX under a lower ceiling) where gptj.native has no int4 GEMM; past
    KERNEL_MAX_ROWS["int4"] without bfloat16 arithmetic, without gptj.native, and for float32
    activations."""
    monkeypatch.setattr(policy, "native_available", lambda: True)
    monkeypatch.setattr(native, "int4_gemm_available", lambda layout=None: False)
    below_amx = cpu.cap(AMX, "avx512_core_bf16")
    few, bf16, many = policy.INT4_AMX_KERNEL_MAX_ROWS, policy.INT4_BF16_KERNEL_MAX_ROWS, quant.KERNEL_MAX_ROWS["int4"]
    assert few < bf16 < many
    for flags, most, past in ((AMX, few, policy.DEQUANTIZE), (FLAGS[cpu.AVX512_BF16], bf16, policy.DEQUANTIZE),
                              (below_amx, bf16, policy.DEQUANTIZE), (FLAGS[cpu.AVX2], many, policy.UPCAST),
                              (FLAGS[cpu.AVX512], many, policy.UPCAST)):  # (float32 sums without bfloat16's)
        monkeypatch.setattr(cpu, "flags", lambda f=flags: f)
        assert policy.int4_kernel_max_rows("cpu", torch.bfloat16) == most
        assert policy.linear_path("cpu", torch.bfloat16, most, "int4") == policy.WEIGHT_ONLY
        assert policy.linear_path("cpu", torch.bfloat16, most + 1, "int4") == past
    monkeypatch.setattr(cpu, "flags", lambda: AMX)
    assert policy.int4_kernel_max_rows("cpu", torch.float32) == many
    monkeypatch.setattr(policy, "triton_available", lambda: False)
    assert policy.int4_kernel_max_rows("cuda", torch.bfloat16) == many
    monkeypatch.setattr(policy, "triton_available", lambda: True)  # (past it: Triton's int4 GEMM)
    assert policy.int4_kernel_max_rows("cuda", torch.bfloat16) == policy.TRITON_MAX_ROWS
    monkeypatch.setattr(policy, "native_available", lambda: False)
    assert policy.int4_kernel_max_rows("cpu", torch.bfloat16) == many


@pytest.mark.parametrize("gemm", [True, False], ids=["int4-gemm", "no-int4-gemm"])
def test_int4_layers_take_the_native_int4_gemm_from_a_few_rows_on_avx512_bf16_without_amx(monkeypatch, gemm):
    """Where the loaded library has the int4 GEMV and GEMM (AVX512-BF16's), bfloat16 int4 calls take them from
    INT4_NATIVE_MIN_ROWS rows (one: every row count) on a CPU with AVX512-BF16 and no AMX; below, torch's int4 kernel.
    Not with AMX (oneDNN's AMX GEMM on the unpacked weight), not without bfloat16 arithmetic, not for
    float32 activations, and not where the library has no GEMM (then as before: torch's kernel, then the
    dequantized matmul)."""
    monkeypatch.setattr(policy, "native_available", lambda: True)
    monkeypatch.setattr(native, "int4_gemm_available", lambda layout=None: True)
    monkeypatch.setattr(native, "int4_gemm_min_rows", lambda rows=None: 32 if gemm else 0)
    monkeypatch.setattr(native, "isa", lambda: native.ISAS[0])  # AVX512-BF16's library (the avx2 one: below)
    lo = policy.INT4_NATIVE_MIN_ROWS
    assert 1 <= lo <= policy.INT4_BF16_KERNEL_MAX_ROWS
    for flags in (FLAGS[cpu.AVX512_BF16], cpu.cap(AMX, "avx512_core_bf16")):
        monkeypatch.setattr(cpu, "flags", lambda f=flags: f)
        assert (lo in policy.native_int4_rows("cpu", torch.bfloat16)) == gemm
        if lo > 1:
            assert policy.linear_path("cpu", torch.bfloat16, lo - 1, "int4") == policy.WEIGHT_ONLY
        for rows in (lo, policy.INT4_BF16_KERNEL_MAX_ROWS + 1, 4096):
            want = policy.NATIVE if gemm else (policy.WEIGHT_ONLY if rows <= policy.INT4_BF16_KERNEL_MAX_ROWS
                                               else policy.DEQUANTIZE)
            assert policy.linear_path("cpu", torch.bfloat16, rows, "int4") == want, rows
        assert policy.linear_path("cpu", torch.float32, 4096, "int4") == policy.DEQUANTIZE
    for flags in (AMX, FLAGS[cpu.AVX2], FLAGS[cpu.AVX512]):
        monkeypatch.setattr(cpu, "flags", lambda f=flags: f)
        assert not policy.native_int4_rows("cpu", torch.bfloat16)
        assert policy.linear_path("cpu", torch.bfloat16, 4096, "int4") != policy.NATIVE


@pytest.mark.parametrize("library", ["avx2", "generic", "avx512"])
def test_int4_layers_take_the_vector_layers_int4_gemv_on_avx2(monkeypatch, library):
    """On an AVX2 CPU with gptj.native's avx2 library, bfloat16 int4 calls of 1 to INT4_AVX2_MAX_ROWS rows
    take its int4 GEMV (the vector layer's: the library has no GEMM), more the dequantized matmul in
    float32; float32 activations, the portable library (unmeasured), and the avx512 library on AVX-512
    without BF16 (torch's int4 kernel was faster there) keep torch's paths."""
    monkeypatch.setattr(policy, "native_available", lambda: True)
    monkeypatch.setattr(native, "int4_gemm_available", lambda layout=None: True)
    monkeypatch.setattr(native, "int4_gemm_min_rows", lambda rows=None: 0)
    monkeypatch.setattr(native, "isa", lambda: next(i for i in native.ISAS if i.name == library))
    most = policy.INT4_AVX2_MAX_ROWS
    assert most <= policy.KERNEL_MAX_ROWS["int4"]
    monkeypatch.setattr(cpu, "flags", lambda: FLAGS[cpu.AVX512] if library == "avx512" else FLAGS[cpu.AVX2])
    for rows, want in ((1, policy.NATIVE), (most, policy.NATIVE), (most + 1, policy.UPCAST)):
        if library != "avx2":
            want = policy.WEIGHT_ONLY if rows <= policy.KERNEL_MAX_ROWS["int4"] else policy.UPCAST
        assert policy.linear_path("cpu", torch.bfloat16, rows, "int4") == want, rows
    assert policy.linear_path("cpu", torch.float32, 1, "int4") == policy.WEIGHT_ONLY
    monkeypatch.setattr(cpu, "flags", lambda: FLAGS[cpu.AVX512_BF16])  # the avx2 library forced on AVX-512
    assert policy.linear_path("cpu", torch.bfloat16, 1, "int4") == policy.WEIGHT_ONLY


def test_int8_layers_take_the_amx_gemm_where_it_runs(monkeypatch):
    """gptj.native's AMX GEMM from AMX_INT8_MIN_ROWS to AMX_INT8_MAX_ROWS rows, for inputs in steps of
    64; the GEMV below (it streams the weight), the dequantized matmul above."""
    monkeypatch.setattr(cpu, "flags", lambda: AMX)
    monkeypatch.setattr(policy, "native_gemv_available", lambda: True)
    monkeypatch.setattr(policy, "native_amx_available", lambda: True)
    lo, hi = policy.AMX_INT8_MIN_ROWS, policy.AMX_INT8_MAX_ROWS
    gptj_j = (4096, 4096)
    assert policy.linear_path("cpu", torch.bfloat16, lo - 1, "int8", gptj_j) == policy.NATIVE
    assert policy.linear_path("cpu", torch.bfloat16, lo, "int8", gptj_j) == policy.AMX
    assert policy.linear_path("cpu", torch.bfloat16, hi, "int8", gptj_j) == policy.AMX
    assert policy.linear_path("cpu", torch.bfloat16, hi + 1, "int8", gptj_j) == policy.DEQUANTIZE
    assert policy.linear_path("cpu", torch.bfloat16, lo, "int8", (4128, 4096)) == policy.NATIVE  # 4128 % 64
    assert policy.w8a8_form() == policy.AMX and policy.can_pack_int8("cpu")
    assert policy.w8a8_form("cpu", 4096) == policy.AMX and policy.w8a8_form("cpu", 96) != policy.AMX
    monkeypatch.setattr(policy, "native_amx_available", lambda: False)
    assert policy.linear_path("cpu", torch.bfloat16, lo, "int8", gptj_j) == policy.NATIVE
    assert policy.w8a8_form() != policy.AMX


@pytest.mark.parametrize("kind", cpu.KINDS)
def test_the_decode_attention_is_compiled_on_cuda_only(kind, monkeypatch):
    fake_cpu(monkeypatch, kind)
    assert not policy.compile_trusted("cpu") and policy.compile_trusted("cuda")
    for mode in ("auto", "on"):
        assert not policy.attention_path("cpu", torch.bfloat16, "off", mode).compiled
        assert policy.attention_path("cuda", torch.bfloat16, "off", mode).compiled
    assert not policy.attention_path("cuda", torch.bfloat16, "off", "off").compiled


# --- oneDNN's own kernels for CPUs without VNNI ----------------------------------------------------

_PROBE = r"""
import json, torch
from gptj import cpu, native, policy, quant
from gptj.kernels import fused
g = torch.Generator().manual_seed(0)
K, N = 1024, 96                      # each half's sum stays below 2**24: equal, not just close
qx = torch.randint(-127, 128, (6, K), generator=g, dtype=torch.int8)
qx[0], qx[1], qx[2, ::2], qx[2, 1::2] = 127, -127, 127, -127   # the pair sums that saturate 16 bits
lin = torch.nn.Linear(K, N)
m = quant.W8A8Linear.from_float(lin)
m.weight[0], m.weight[1] = 127, -127
sx = torch.rand(6, 1, generator=g) + 0.5
x = qx.float() * sx / 127 * 127                # rows whose per-row rounding gives back qx
q2, s2 = m.quantize_input(x)
assert torch.equal(q2, qx)
truth = (q2.long() @ m.weight.long().t()).float()
want = (truth * m.weight_scale.float() * s2).to(torch.float32) + lin.bias.detach()
def same(y): return bool(torch.equal(y, want))
with torch.no_grad():
    out = {"kind": cpu.kind(), "native": native.available(), "form": policy.w8a8_form(),
           "path": policy.linear_path("cpu", torch.float32, 6, "w8a8"),
           "plain": same(m(x)), "chosen_packed": same(fused.PackedW8A8Linear(m)(x)),
           "split": same(fused.PackedW8A8Linear(m, policy.SPLIT)(x)),
           "shifted": same(fused.PackedW8A8Linear(m, policy.SHIFTED)(x)),
           "native_form": same(fused.PackedW8A8Linear(m, policy.NATIVE)(x)) if native.available() else None,
           "int_mm": bool(torch.equal(torch._int_mm(q2, m.weight.t()).float(), truth))}
print(json.dumps(out))
"""


def _has_avx2() -> str | None:
    have = cpu.read_flags()
    return None if {"avx2", "fma"} <= have else "oneDNN's AVX2 kernels need an x86-64 CPU with AVX2"


@pytest.mark.skipif(_has_avx2() is not None, reason=str(_has_avx2()))
@pytest.mark.skipif(not policy.onednn_int8("cpu"), reason="oneDNN's int8 GEMM is not in this torch build")
@pytest.mark.parametrize(("isa", "kind"), [("AVX2", cpu.AVX2), ("AVX512_CORE", cpu.AVX512)])
def test_w8a8_is_exact_on_onednns_kernels_for_cpus_without_vnni(isa, kind):
    """Under ONEDNN_MAX_CPU_ISA, oneDNN runs the kernels such a CPU runs (an AVX-512 ceiling on an
    AVX2 CPU is AVX2's). gptj sees the ceiling and chooses SPLIT and the exact float32 sums: the
    int32 sums come out exact, where the one-GEMM SHIFTED form saturates (why it is not chosen there)."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa}
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["kind"] in ((kind, cpu.AVX2) if kind == cpu.AVX512 else (kind,))
    assert got["native"] is (native.unavailable_reason() is None)  # AVX2's library, where this CPU runs one
    # gptj.native's GEMM where its library runs, else oneDNN's SPLIT form: both exact
    assert got["form"] == (policy.NATIVE if got["native"] else policy.SPLIT) and got["path"] == policy.DEQUANTIZE
    assert got["plain"] and got["chosen_packed"] and got["split"] and got["native_form"] in (True, None)
    # the one-GEMM SHIFTED form saturates without VNNI (why it is not chosen there); torch._int_mm does
    # on some CPUs under an AVX2 ceiling (AVX-512 ones) and not on others (a real AVX2 EPYC): gptj runs it
    # only on CPUs with VNNI, so either is fine here
    assert not got["shifted"] and got["int_mm"] in (True, False)


@pytest.mark.parametrize("kind", cpu.KINDS)
def test_dtype_fast_is_bfloat16_where_it_runs_fast(kind, monkeypatch):
    """--dtype fast (gptj.policy.fast_dtype, resolved once in ModelSpec): bfloat16 on AVX512-BF16 (or
    AMX) CPUs and where gptj.native's GEMV runs (AVX2 and up), float32 where neither (torch's own
    bfloat16 is emulated there)."""
    from gptj.runtime.spec import ModelSpec

    if kind == cpu.AVX512_BF16 and native.unavailable_reason() is not None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    fake_cpu(monkeypatch, kind)
    want = torch.bfloat16 if kind == cpu.AVX512_BF16 or policy.native_gemv_available() else torch.float32
    assert (want == torch.bfloat16) is (kind != cpu.OTHER and native.open_isa("avx2") is not None)
    assert policy.fast_dtype("cpu") == want
    assert ModelSpec(dtype="fast", device="cpu").torch_dtype == want
    force_fallback(monkeypatch)  # no gptj.native: bfloat16 only where the CPU computes it
    assert policy.fast_dtype("cpu") == (torch.bfloat16 if kind == cpu.AVX512_BF16 else torch.float32)
    monkeypatch.setattr(cpu, "flags", lambda: FLAGS[cpu.AVX512] | {"amx_tile", "amx_bf16"})  # AMX
    assert policy.fast_dtype("cpu") == torch.bfloat16


def test_dtype_fast_for_a_gpu_this_machine_lacks_is_bfloat16(monkeypatch):
    """`gptj serve --ray --device cuda --dtype fast` on a head node without a GPU: the spec says
    bfloat16 for the nodes' GPUs, where the model loads and the device is checked, not an error here."""
    from gptj.errors import GptjError
    from gptj.runtime.spec import ModelSpec

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ModelSpec(dtype="fast", device="cuda").torch_dtype == torch.bfloat16
    assert ModelSpec(dtype="fast", device="cuda:1").torch_dtype == torch.bfloat16
    with pytest.raises(GptjError, match="unknown device"):
        ModelSpec(dtype="fast", device="gpu7")


def test_a_bfloat16_linear_without_bfloat16_arithmetic_upcasts_big_calls(monkeypatch):
    """UPCAST (a CPU without bfloat16 arithmetic, more rows than the GEMV serves): the float32 product
    of the bfloat16 weight, rounded once to bfloat16 (up to float32's sum order: K u sum|x w|)."""
    from gptj.kernels.fused import PackedLinear

    fake_cpu(monkeypatch, cpu.AVX2)
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(96, 560, dtype=torch.bfloat16)  # 560 rows: chunks of the weight and a tail
    with torch.no_grad():
        lin.weight.copy_(torch.randn(560, 96, generator=g))
    m = PackedLinear(lin, policy.NATIVE)
    monkeypatch.setattr("gptj.kernels.dense.UPCAST_CHUNK_ELEMENTS", 100 * 96)  # chunks of 100 rows, in any rows
    from gptj.quant.ops import _row_chunks

    assert len(list(_row_chunks(560, 96, 100 * 96, 1))) == 6  # 5 of 100 and a tail of 60
    x = torch.randn(policy.NATIVE_EMULATED_BF16_MAX_ROWS + 1, 96, generator=g).bfloat16()
    assert policy.linear_path("cpu", torch.bfloat16, x.shape[0], "native-layout") == policy.UPCAST
    y = m(x)
    want = x.double() @ lin.weight.double().t() + lin.bias.double()
    bound = 2.0**-8 * want.abs() + 96 * 2.0**-24 * (x.double().abs() @ lin.weight.double().abs().t() + 1)
    assert y.dtype == torch.bfloat16 and ((y.double() - want).abs() <= bound).all()
