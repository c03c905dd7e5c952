"""Which kernel runs: the one rule, per device, dtype and row count. Nothing else re-derives it.

float32 is the exact path everywhere: the plain eager math of gptj.models (HF's formulas), never
fused, packed, compiled or sent to a native kernel. Lower precision takes the fast paths:

  linear layers: LINEAR_TABLE below, one route per line (weight kind, device, rows, path, the
  condition, and where its threshold's figures are). A layer's kernels are chosen once for its
  device and activation dtype, from one `Capabilities` probe (`linear_plan`: rows -> path); the
  call then switches on its row count alone. W8A8's integer sums are exact on every path (see
  EXACT_F32_INT8_TERMS and the W8A8 forms). TRITON needs Triton (`triton_available`), NATIVE
  gptj.native's library of the CPU's best ISA; where one is missing, the next route runs. A layer
  may fall back further when its weight could not be packed for a kernel (Int4Linear without a
  CPU/CUDA int4 layout dequantizes). `python -m gptj.policy` prints the table.

  building a model for serving (gptj.kernels.prepare_for_serving)
  `fusable`      a block is fused (q|k|v|fc_in in one matmul) when quantized or below float32
  `can_pack`     a float linear is packed when bfloat16 on a CPU with oneDNN bfloat16 (the oneDNN
                 layout), or with gptj.native's GEMV (the native layout)
  `can_pack_int8` a W8A8 linear is packed (PackedW8A8Linear) on a CPU with oneDNN's int8 GEMM or gptj.native
  `w8a8_form`    ...for gptj.native's AMX-INT8 GEMM (AMX), else oneDNN's GEMM of activations shifted to
                 uint8 (SHIFTED, VNNI), else gptj.native's (NATIVE), else oneDNN's on two halves (SPLIT)
  `pack_layout`  into gptj.native's layout when no step has more than NATIVE_LAYOUT_MAX_ROWS rows
                 and gptj.native's GEMV is available, or at any rows where oneDNN has no bfloat16
                 (AVX2), else oneDNN's

  a fused block's elementwise steps (GELU, rotary; the engine's KV stores)
  `native_elementwise`  gptj.native's for bfloat16 on CPU where it is available (one pass, float32
                        inside, rounded once), else torch's ops
  `elementwise_path`    the rotary's: NATIVE as above, TRITON (one kernel, the same arithmetic) on
                        CUDA below float32, else TORCH

  attention
  `exact`             float32: gptj.models.base.attention's exact math; below: torch's fused SDPA
  `attention_path`    the engine's decode attention: gptj.native's kernel for bfloat16 or int8 KV of a
                      bfloat16 model on CPU
                      (kernels "auto"), else torch.compile'd sums below float32 (compile "auto") or
                      always ("on") where `compile_trusted` (CUDA, not CPU), else the eager formulas;
                      grouped-query attention (KV heads < query heads: Llama) always the reference's
                      eager gqa_attention (neither gptj.native's kernels nor the Triton one take it yet)
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gptj import cpu, native
from gptj.device import FP8_MIN_CAPABILITY, check_fp8_device, fp8_supported  # noqa: F401  (the device's FP8 units)
from gptj.models.base import exact  # the rule (float32), beside the math it chooses; re-exported here

PACK_MODES = ("auto", "off")  # the serving kernels' switch: "auto" follows this table, "off" keeps the model as loaded

# Linear paths (see the table above).
TORCH = "torch"  # F.linear on the weight as it is (float32: the exact path)
NATIVE = "native"  # gptj.native's GEMV (AVX-512 or AVX2)
AMX = "amx"  # gptj.native's int8 GEMM on AMX's tiles (amx.c)
ONEDNN = "onednn"  # oneDNN's bfloat16 GEMM on its packed layout
WEIGHT_ONLY = "weight-only"  # torch's int8 / int4 weight-only kernels
DEQUANTIZE = "dequantize"  # the weight dequantized to the activations' dtype, then F.linear
INT_MM = "int-mm"  # int8 activations x int8 weights, exact int32 sums (torch._int_mm)
UPCAST = "upcast"  # a bfloat16 weight made float32 a chunk at a time, F.linear in float32, rounded back
TRITON = "triton"  # gptj.quant.cuda's weight-only GEMVs and GEMMs (CUDA)
SCALED_MM = "scaled-mm"  # e4m3 activations x e4m3 weights, float32 sums (torch._scaled_mm)


# gptj.quant.cuda's Triton GEMVs read the quantized weight once per call and stream every row
# through it: memory bound at decode's few rows, where torch has no int8 / fp8 weight-only kernel
# on CUDA (dequantizing first reads the weight three times over). Past TRITON_MAX_ROWS its GEMM plans
# (gptj.quant.cuda.MANY_ROWS) take int8 and int4 weights with 16-bit activations at any rows: each
# weight tile is converted in registers, where dequantizing writes and reads the whole weight in
# bfloat16 at every call (3x the int8 bytes at batch 32). fp8 past TRITON_MAX_ROWS runs
# torch._scaled_mm (FP8 tensor cores). float32 activations past it dequantize: their IEEE products
# run on CUDA cores in either path, and the GEMM tile spills there (cuBLAS's float32 GEMM on the
# dequantized weight is the better kernel). Reasoned and compiled for sm_90a, not timed on a GPU.
TRITON_MAX_ROWS = 16
TRITON_GEMM_DTYPES = (torch.bfloat16, torch.float16)

# gptj.native's GEMV is ahead of oneDNN's bf16 GEMM and torch's int8 kernel up to 8 rows.
# Figures: docs/PERFORMANCE.md#policy-native-max-rows
NATIVE_MAX_ROWS = 8
# gptj.native's int8 GEMV runs any rows, 8 at a time, and stays ahead of dequantizing the
# weight for F.linear up to 512 rows (AVX-512 and AVX2 libraries alike).
# Figures: docs/PERFORMANCE.md#policy-native-int8-max-rows
NATIVE_INT8_MAX_ROWS = 512
# The AVX512-BF16 library's int8 GEMM (gemv.c, from gptj.native.int8_gemm_min_rows rows) runs near
# oneDNN's bfloat16 GEMM and stays ahead of dequantizing for it up to 1024 rows.
# Figures: docs/PERFORMANCE.md#policy-native-int8-gemm-max-rows
NATIVE_INT8_GEMM_MAX_ROWS = 1024
# With AMX, oneDNN's bfloat16 GEMM runs on the tiles, so the weight dequantized for F.linear (a
# chunk at a time into one reused buffer: gptj.quant.ops.chunked_linear) wins past 16 rows.
# Figures: docs/PERFORMANCE.md#policy-native-int8-amx-max-rows
NATIVE_INT8_AMX_MAX_ROWS = 16
# ...and gptj.native's own AMX GEMM (amx.c: the int8 weight made bfloat16 64 inputs at a time by
# byte lookups and multiplied on the tiles) beats both from 2 rows to 256; past that oneDNN's
# blocking wins. Figures: docs/PERFORMANCE.md#policy-amx-int8-rows
AMX_INT8_MIN_ROWS, AMX_INT8_MAX_ROWS = 2, 256
# An engine of at most this many rows per step takes the native layout for its bfloat16 linears
# (the GEMV leads oneDNN at 1-2 rows, ties at 4); holding both layouts would double the weights'
# memory, so the layout is chosen once, when packing. Figures: docs/PERFORMANCE.md#policy-native-layout-max-rows
NATIVE_LAYOUT_MAX_ROWS = 4
# A CPU without bfloat16 arithmetic (AVX2, AVX-512 without BF16) has no fast bfloat16 F.linear;
# gptj.native's bfloat16 GEMV stays ahead of it and of upcasting to float32 up to 512 rows, so every
# bfloat16 linear there takes the native layout (`pack_layout`).
# Figures: docs/PERFORMANCE.md#policy-native-emulated-bf16-max-rows
NATIVE_EMULATED_BF16_MAX_ROWS = 512

# Weight-only kernels: calls of at most this many rows use torch's kernel, bigger ones dequantize
# the weight (a chunk at a time) for F.linear. The bfloat16 crossovers serve every activation dtype:
# the dequantize path keeps float32 precision.
# Figures: docs/PERFORMANCE.md#policy-kernel-max-rows
KERNEL_MAX_ROWS = {"int8": 16, "int4": 512}
# int4 on a CPU with AMX, bfloat16 activations: gptj.native unpacks torch's CPU int4 layout
# (native.int4_dequant_t) and oneDNN multiplies on AMX's tiles, so the dequantized matmul wins from
# 32 rows. Figures: docs/PERFORMANCE.md#policy-int4-amx-kernel-max-rows
INT4_AMX_KERNEL_MAX_ROWS = 16
# Without AMX but with bfloat16 arithmetic (AMD Zen 4 and 5, Intel Cooper Lake) the same unpacking
# and oneDNN's AVX512-BF16 GEMM overtake torch's int4 kernel at about 64 rows.
# Figures: docs/PERFORMANCE.md#policy-int4-bf16-kernel-max-rows
INT4_BF16_KERNEL_MAX_ROWS = 64  # (where gptj.native's int4 GEMM cannot take the layer's layout)
# There gptj.native's int4 kernels take every row count: its GEMV below 32 rows, its GEMM from 32
# (gemv.c's I4G_MIN_ROWS). At one row the GEMV ties torch's int4 kernel on Zen 4 and decodes faster
# on Zen 5, and its rows do not depend on the call: a row sums alike at 1 row and at a speculative
# draft's several. Figures: docs/PERFORMANCE.md#policy-int4-native-min-rows
INT4_NATIVE_MIN_ROWS = 1
# On an AVX2 CPU the vector layer's int4 GEMV (gemv.c's gemv_int4_vf) beats torch's int4 kernel
# from 1 to 512 rows; past 512 the dequantized matmul in float32 (UPCAST) runs. On AVX-512 without
# BF16 torch's int4 kernel stays.
# Figures: docs/PERFORMANCE.md#policy-int4-avx2-max-rows
INT4_AVX2_MAX_ROWS = 512

# W8A8 on CPU: one kernel at every row count, with exact int32 sums, so a row's result is the same
# whatever else is in the call (batch invariance by construction). Serving packs the weight for
# oneDNN's u8 x s8 GEMM (torch.ops.onednn.qlinear_*, activations shifted to uint8 with zero point
# 128); a model as loaded runs torch._int_mm, which reorders the weight at every call.
# Figures: docs/PERFORMANCE.md#policy-w8a8-cpu
# CUDA's _int_mm (cuBLASLt) wants more than 16 rows and in / out features divisible by 8. A call of
# fewer rows runs it on its rows padded with zero rows up to INT_MM_CUDA_MIN_ROWS (int_mm_min_rows):
# exact int32 sums of each row alike, the int8 weight read once, where the float32 sums (DEQUANTIZE)
# would make the whole weight float32 at every decode step.
INT_MM_CUDA_MIN_ROWS = 17


def int_mm_min_rows(device: torch.device | str) -> int:
    """The rows torch._int_mm takes at least on `device` (the W8A8 linear pads fewer up to it)."""
    return INT_MM_CUDA_MIN_ROWS if torch.device(device).type == "cuda" else 1

# The forms of the packed W8A8 GEMM (PackedW8A8Linear), all with int32 sums of the same products:
SHIFTED = "shifted"  # q + 128 as uint8 (zero point 128), one GEMM: exact with VNNI's int32 dot products
SPLIT = "split"  # q = p - n with p, n = max(+-q, 0) in [0, 127], stacked as twice the rows of one GEMM
# with zero point 0: a pair of products is at most 2 * 127 * 127 = 32258 < 2**15, so the 16-bit pair
# sums of CPUs without VNNI cannot saturate. It costs twice the rows' arithmetic, not the weight's reads.
# NATIVE, the path of that name, is the third form: gptj.native's W8A8 GEMM (q widened to int16, pairs of
# products summed into int32: exact without VNNI).
# float32 sums of int8 x int8 products (each at most 127**2) are exact while they stay below 2**24:
# up to 1040 products; W8A8's DEQUANTIZE path sums this many inputs at a time, then adds in int32.
EXACT_F32_INT8_TERMS = 1024
# AMX, the path of that name, is the fourth: gptj.native's GEMM on AMX-INT8 (tdpbssd: int8 x int8 into
# int32, exact) on the plain int8 weight, the same float32 result as SHIFTED's bit for bit (amx.c).
# Figures against SHIFTED: docs/PERFORMANCE.md#policy-w8a8-amx
W8A8_FORMS = (SHIFTED, SPLIT, NATIVE, AMX)


# W8A8 without VNNI: gptj.native's W8A8 GEMM (native.linear_w8a8: int8 weights packed in panels of 16
# output channels, x widened to int16, vpmaddwd's pairs summed into int32, exact) beats oneDNN's SPLIT
# GEMM at every row count, on one packed copy; with VNNI oneDNN's SHIFTED form is ahead from 8 rows,
# so `w8a8_form` never picks NATIVE there. Figures: docs/PERFORMANCE.md#policy-w8a8-native


def fast_dtype(device: torch.device | str) -> torch.dtype:
    """`--dtype fast`: bfloat16 where it runs fast — a GPU that has it; a CPU that computes it
    (AVX512-BF16, AMX-BF16: gptj.cpu's flags, ceilings applied) or where gptj.native's kernels run
    (AVX2: decode 2.9-4.1x float32's tokens/s at batch 1-8, prefill 0.94-1.10x, serving 1.55-1.89x;
    docs/PERFORMANCE.md) — else float32 (torch's own bfloat16 there is 2.8-3.6x slower than float32);
    float16 on a GPU without bfloat16. A CUDA device this machine lacks (a Ray node's GPU, named on a
    head node without one; the node checks it where the model loads): bfloat16."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return torch.bfloat16
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_bf16() or native_gemv_available() else torch.float32


def native_available() -> bool:
    """All of gptj.native's kernels are built and loaded here: one of its ISAs' libraries
    (gptj.native caches the answer; GPTJ_NATIVE=0 says no). The attention and elementwise paths need it."""
    return native.available()


def native_gemv_available() -> bool:
    """gptj.native's decode GEMV is loaded here: one of its ISAs' libraries."""
    return native.has("gemv")


def cpu_bf16() -> bool:
    """This CPU computes bfloat16 natively: AVX512-BF16 or AMX-BF16 (gptj.cpu's flags, ceilings applied)."""
    flags = cpu.flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def native_amx_available() -> bool:
    """gptj.native's AMX GEMMs (int8 weights, W8A8) run here (native.amx_available: the AVX-512
    library, AMX's tiles)."""
    return native.amx_available()


def amx_fits(in_features: int) -> bool:
    """A layer of `in_features` inputs can run gptj.native's AMX GEMMs (they take inputs 64 at a time)."""
    return in_features % native.AMX_K_MULTIPLE == 0


def cpu_amx() -> bool:
    """This CPU has AMX's bfloat16 tiles (gptj.cpu's flags, ceilings applied), which oneDNN's
    bfloat16 GEMMs run on."""
    return "amx_bf16" in cpu.flags()


def native_int8_max_rows(caps: Capabilities | None = None) -> int:
    """The most rows of a call that gptj.native's int8 kernels take (more: the dequantized matmul):
    NATIVE_INT8_AMX_MAX_ROWS on a CPU with AMX, NATIVE_INT8_GEMM_MAX_ROWS where the loaded library
    has the int8 GEMM (AVX512-BF16's), else NATIVE_INT8_MAX_ROWS (the GEMV's)."""
    caps = caps or Capabilities.probe("cpu")
    if caps.cpu_amx:
        return NATIVE_INT8_AMX_MAX_ROWS
    return NATIVE_INT8_GEMM_MAX_ROWS if caps.native_int8_gemm else NATIVE_INT8_MAX_ROWS


def int4_kernel_max_rows(device: torch.device | str, dtype: torch.dtype, caps: Capabilities | None = None) -> int:
    """The most rows of an int4 call that torch's int4 kernel takes (more: the dequantized matmul, or on
    CUDA Triton's GEMM): on CUDA with Triton, TRITON_MAX_ROWS (tinygemm is a GEMV-shaped kernel, made for
    decode's few rows as gpt-fast runs it; reasoned, not timed); for bfloat16 on a CPU with gptj.native
    (its unpacking), INT4_AMX_KERNEL_MAX_ROWS with AMX and INT4_BF16_KERNEL_MAX_ROWS with AVX512-BF16;
    else KERNEL_MAX_ROWS["int4"]."""
    caps = caps or Capabilities.probe(device)
    if caps.device == "cuda" and caps.triton:
        return TRITON_MAX_ROWS
    if caps.native_elementwise(dtype) and caps.cpu_amx:
        return INT4_AMX_KERNEL_MAX_ROWS
    if caps.native_elementwise(dtype) and caps.cpu_bf16:
        return INT4_BF16_KERNEL_MAX_ROWS
    return KERNEL_MAX_ROWS["int4"]


def native_int4_rows(device: torch.device | str, dtype: torch.dtype, caps: Capabilities | None = None) -> range:
    """The rows of int4 calls of `dtype` activations on `device` that gptj.native's int4 kernels take
    (native.linear_int4), bfloat16 on a CPU: with AVX512-BF16 but no AMX, where the loaded library has the
    int4 GEMM (AVX512-BF16's), from INT4_NATIVE_MIN_ROWS rows on (its GEMV, its GEMM from 32 rows); on an
    AVX2 CPU with the avx2 library loaded, 1 to INT4_AVX2_MAX_ROWS rows (the vector layer's GEMV). None
    elsewhere (an empty range): with AMX oneDNN's GEMM on the unpacked weight is faster, on AVX-512 without
    BF16 torch's int4 kernel."""
    caps = caps or Capabilities.probe(device)
    if not caps.native_elementwise(dtype) or not caps.native_int4:
        return range(0)
    if caps.cpu_bf16 and not caps.cpu_amx and caps.native_int4_gemm:
        return range(INT4_NATIVE_MIN_ROWS, ALL_ROWS + 1)
    if caps.cpu_kind == cpu.AVX2 and caps.native_isa == "avx2":
        return range(1, INT4_AVX2_MAX_ROWS + 1)
    return range(0)


def native_elementwise(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a fused block's GELU and rotary, and the engine's KV stores, of `dtype` activations
    on `device` run gptj.native's one-pass kernels (bfloat16 on CPU) instead of torch's ops."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and native_available()


def argmax_path(device: torch.device | str) -> str:
    """How the sampler takes a greedy step's argmax over float32 logits: "native" on a CPU with
    gptj.native's elementwise kernels (native.argmax_rows: one vector pass finds the maximum's block,
    where torch's CPU kernel tracks the index at every element), else "torch" (torch.max's indices:
    the same indices). Figures: docs/PERFORMANCE.md#serving-vs-vllm"""
    return "native" if torch.device(device).type == "cpu" and native.has("elementwise") else "torch"


def elementwise_path(device: torch.device | str, dtype: torch.dtype) -> str:
    """A fused block's rotary of `dtype` activations on `device`: NATIVE (gptj.native's one pass,
    `native_elementwise`), TRITON (gptj.kernels.triton_elementwise's one kernel: CUDA below float32,
    Triton installed; float32 inside, rounded once, as NATIVE), else TORCH (torch's ops)."""
    if native_elementwise(device, dtype):
        return NATIVE
    if torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16) and triton_available():
        return TRITON
    return TORCH


def can_pack(dtype: torch.dtype, device: torch.device | str, layout: str | None = None) -> bool:
    """Whether a `dtype` linear on `device` is packed into `layout` (ONEDNN, NATIVE; None: ONEDNN).
    oneDNN packing helps bfloat16 on a CPU that has it (AVX512-BF16 / AMX, or its emulation on
    AVX-512: torch's own test, which gptj.cpu's flags must pass too, so a ceiling applies); the
    native layout is the plain weight, for gptj.native's GEMV (any ISA it has a library for)."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return False
    if layout == NATIVE:
        return native_gemv_available()
    if not torch.backends.mkldnn.is_available() or not (cpu.AVX512_CORE <= cpu.flags()
                                                         or "avx_ne_convert" in cpu.flags()):
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def onednn_int8(device: torch.device | str) -> bool:
    """oneDNN's int8 GEMM on packed weights (torch.ops.onednn.qlinear_prepack) runs on this CPU."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.onednn, "qlinear_prepack") and hasattr(torch.ops.onednn, "qlinear_pointwise")


def w8a8_form(device: torch.device | str = "cpu", in_features: int | None = None) -> str | None:
    """The form of a packed W8A8 GEMM (PackedW8A8Linear) of `in_features` inputs (None: any layer) on
    this CPU: AMX where gptj.native's AMX GEMMs run and take the layer (`amx_fits`); else SHIFTED where
    oneDNN sums u8 x s8 in int32 (VNNI); else NATIVE where gptj.native's GEMM is loaded; else oneDNN's
    SPLIT (see above; all exact); None where none of them runs (not a CPU, no oneDNN and no
    gptj.native): the layer stays as loaded."""
    if torch.device(device).type != "cpu":
        return None
    if native_amx_available() and (in_features is None or amx_fits(in_features)):
        return AMX
    onednn = onednn_int8(device)
    if onednn and cpu.int8_sums_exact():
        return SHIFTED
    if native_gemv_available():
        return NATIVE
    return SPLIT if onednn else None


def can_pack_int8(device: torch.device | str) -> bool:
    """A W8A8 linear on `device` is packed for serving (PackedW8A8Linear, in `w8a8_form`'s form)."""
    return w8a8_form(device) is not None


def pack_layout(max_rows: int | None) -> str:
    """The layout a packable linear takes for an engine of at most `max_rows` rows per step
    (None: unbounded): NATIVE for few rows where gptj.native's GEMV runs, and at any rows where the
    CPU has no bfloat16 arithmetic (`cpu_bf16`: AVX2, and AVX-512 without BF16, where oneDNN's
    bfloat16 is emulated; see NATIVE_EMULATED_BF16_MAX_ROWS); else ONEDNN."""
    if not native_gemv_available():
        return ONEDNN
    if max_rows is not None and max_rows <= NATIVE_LAYOUT_MAX_ROWS:
        return NATIVE
    return ONEDNN if cpu_bf16() and can_pack(torch.bfloat16, "cpu") else NATIVE


def fusable(dtype: torch.dtype | None) -> bool:
    """Whether a block whose projections hold float weights of `dtype` (None: quantized ones) is
    fused for serving: quantized or below float32, never the exact float32 math."""
    return dtype is None or not exact(dtype)


ALL_ROWS = 1 << 62  # a route's "any number of rows"


@dataclass(frozen=True)
class Capabilities:
    """What runs on one device in this process: CPU flags (gptj.cpu, ceilings applied), gptj.native's
    libraries, Triton, FP8 units. Probed once where a model is prepared (`probe`), and handed to the
    tables below, so a layer's kernels are chosen from one consistent answer."""

    device: str  # the device type: "cpu", "cuda", ...
    cpu_kind: str  # gptj.cpu.kind(): AVX2, AVX512, AVX512_BF16, ...
    cpu_bf16: bool  # the CPU computes bfloat16 (AVX512-BF16, AMX-BF16)
    cpu_amx: bool  # AMX's bfloat16 tiles (oneDNN's bfloat16 GEMMs run on them)
    int8_sums_exact: bool  # oneDNN's u8 x s8 sums are int32 (VNNI)
    native: bool  # all of gptj.native (elementwise, attention)
    native_gemv: bool  # gptj.native's GEMVs
    native_amx: bool  # gptj.native's AMX GEMMs
    native_int8_gemm: bool  # the loaded library has the int8 GEMM (AVX512-BF16's)
    native_int4: bool  # gptj.native's int4 kernels take torch's CPU int4 layout
    native_int4_gemm: bool  # ...and the loaded library has the int4 GEMM (AVX512-BF16's)
    native_isa: str | None  # the loaded library's ISA name
    triton: bool  # Triton installed (gptj.quant.cuda's kernels)
    fp8: bool  # FP8 matrix units on the device (compute capability 8.9 on)

    @classmethod
    def probe(cls, device: torch.device | str) -> Capabilities:
        """Ask once: every answer of this module's probes (tests patch those) for `device`."""
        lib = native.isa()
        return cls(device=torch.device(device).type, cpu_kind=cpu.kind(), cpu_bf16=cpu_bf16(), cpu_amx=cpu_amx(),
                   int8_sums_exact=cpu.int8_sums_exact(), native=native_available(),
                   native_gemv=native_gemv_available(), native_amx=native_amx_available(),
                   native_int8_gemm=native.int8_gemm_min_rows() > 0, native_int4=native.int4_gemm_available(),
                   native_int4_gemm=native.int4_gemm_min_rows() > 0, native_isa=None if lib is None else lib.name,
                   triton=triton_available(), fp8=fp8_supported(device))

    def native_elementwise(self, dtype: torch.dtype) -> bool:
        """`native_elementwise` on this device: gptj.native's one-pass kernels for bfloat16 on CPU."""
        return dtype == torch.bfloat16 and self.device == "cpu" and self.native

    def upcasts(self, dtype: torch.dtype) -> bool:
        """bfloat16 on a CPU without bfloat16 arithmetic: a dequantized matmul runs in float32 (UPCAST),
        where F.linear in bfloat16 takes 3x float32's time (NATIVE_INT8_MAX_ROWS' table)."""
        return self.device == "cpu" and dtype == torch.bfloat16 and not self.cpu_bf16


Features = tuple[int, int]  # a layer's (in, out) features
Rows = tuple[int, int] | Callable[[Capabilities, torch.dtype], tuple[int, int]]
ANY = "any"  # a route for every device


def _always(caps: Capabilities, dtype: torch.dtype, features: Features) -> bool:
    return True


# The routes' conditions, by name (describe_linear_table prints them).
def bf16_cpu_gemv(c: Capabilities, d: torch.dtype, f: Features) -> bool:
    return c.cpu_bf16 and c.native_gemv


def bf16_cpu(c: Capabilities, d: torch.dtype, f: Features) -> bool:
    return c.cpu_bf16


def gemv(c: Capabilities, d: torch.dtype, f: Features) -> bool:
    return c.native_gemv


def w4a8_panels(c: Capabilities, d: torch.dtype, f: Features) -> bool:
    return c.native_gemv and f[1] % native.W4A8_PANEL == 0  # W4A8's panels: its outputs in 16s


def no_fp8_units(c: Capabilities, d: torch.dtype, f: Features) -> bool:
    return not c.fp8


def triton(c: Capabilities, d: torch.dtype, f: Features) -> bool:
    return c.triton


def triton_16bit(c: Capabilities, d: torch.dtype, f: Features) -> bool:
    return c.triton and d in TRITON_GEMM_DTYPES


def features_16(c: Capabilities, d: torch.dtype, f: Features) -> bool:
    return not (f[0] | f[1]) % 16


def features_8(c: Capabilities, d: torch.dtype, f: Features) -> bool:
    return not (f[0] | f[1]) % 8


def amx_takes(c: Capabilities, d: torch.dtype, f: Features) -> bool:
    return c.native_amx and amx_fits(f[0])


def upcasts(c: Capabilities, d: torch.dtype, f: Features) -> bool:
    return c.upcasts(d)


def int8_sums_exact(c: Capabilities, d: torch.dtype, f: Features) -> bool:
    return c.int8_sums_exact


def bfloat16(c: Capabilities, d: torch.dtype, f: Features) -> bool:
    return d == torch.bfloat16


@dataclass(frozen=True)
class Route:
    """One line of the linear table: a layer holding `weight` on `device` (or ANY) whose `when` holds
    runs calls of `rows` (lo, hi; or a function of the probe and dtype giving them) on `path`.
    `figures`: the docs/PERFORMANCE.md section behind the threshold (or the reason, where none is timed)."""

    weight: str
    device: str
    path: str
    rows: Rows = (0, ALL_ROWS)
    when: Callable[[Capabilities, torch.dtype, Features], bool] = _always
    figures: str = ""


def _upto(n: int) -> tuple[int, int]:
    return (0, n)


def _range(r: range) -> tuple[int, int]:
    return (r.start, r.stop - 1) if r else (1, 0)


def _gemm_dtype(dtype: torch.dtype) -> bool:
    return dtype in TRITON_GEMM_DTYPES


# The routes, first match wins (per weight kind, in this order). Every threshold is a constant above,
# with its figures; CUDA's past 16 rows are reasoned and compiled for sm_90a, not yet timed on a GPU.
LINEAR_TABLE: tuple[Route, ...] = (
    Route("onednn-layout", ANY, ONEDNN, figures="#cpu-kernels"),
    # bfloat16 in gptj.native's layout (PackedLinear "native"): its GEMV at few rows
    Route("native-layout", ANY, NATIVE, _upto(NATIVE_MAX_ROWS), bf16_cpu_gemv, "#policy-native-max-rows"),
    Route("native-layout", ANY, TORCH, when=bf16_cpu),
    # ...on a CPU without bfloat16 arithmetic, the GEMV 8 rows at a time, then the weight upcast
    Route("native-layout", ANY, NATIVE, _upto(NATIVE_EMULATED_BF16_MAX_ROWS), gemv,
          "#policy-native-emulated-bf16-max-rows"),
    Route("native-layout", ANY, UPCAST),
    # fp8: FP8 units only (elsewhere the commands refuse it: check_fp8_device; the math runs for checks)
    Route("fp8", ANY, DEQUANTIZE, when=no_fp8_units),
    Route("fp8", ANY, TRITON, _upto(TRITON_MAX_ROWS), triton, "reasoned: the weight read once"),
    Route("fp8", ANY, SCALED_MM, when=features_16),
    Route("fp8", ANY, DEQUANTIZE),
    # int8 weight-only on CUDA: the Triton GEMVs, then the GEMM plans for 16-bit activations
    Route("int8", "cuda", TRITON, _upto(TRITON_MAX_ROWS), triton, "reasoned: the weight read once"),
    Route("int8", "cuda", TRITON, when=triton_16bit, figures="reasoned: gptj.quant.cuda's MANY_ROWS"),
    # int8 weight-only on CPU
    Route("int8", "cpu", AMX, (AMX_INT8_MIN_ROWS, AMX_INT8_MAX_ROWS), amx_takes, "#policy-amx-int8-rows"),
    Route("int8", "cpu", NATIVE, lambda c, d: (0, native_int8_max_rows(c)), gemv,
          "#policy-native-int8-max-rows, #policy-native-int8-gemm-max-rows, #policy-native-int8-amx-max-rows"),
    Route("int8", "cpu", WEIGHT_ONLY, _upto(KERNEL_MAX_ROWS["int8"]), figures="#policy-kernel-max-rows"),
    Route("int8", "cpu", UPCAST, when=upcasts),
    Route("int8", ANY, DEQUANTIZE),
    # W8A8: exact int32 sums (CPU: with VNNI; CUDA: cuBLASLt, fewer than 17 rows padded)
    Route("w8a8", "cpu", INT_MM, when=int8_sums_exact, figures="#policy-w8a8-cpu"),
    Route("w8a8", "cuda", INT_MM, when=features_8),
    Route("w8a8", ANY, DEQUANTIZE),
    # int4: gptj.native's kernels where they take the layout, then torch's (tinygemm on CUDA), Triton
    Route("int4", ANY, NATIVE, lambda c, d: _range(native_int4_rows(c.device, d, c)),
          figures="#policy-int4-native-min-rows, #policy-int4-avx2-max-rows"),
    Route("int4", "cuda", WEIGHT_ONLY, lambda c, d: _upto(int4_kernel_max_rows(c.device, d, c)), bfloat16,
          "reasoned: tinygemm is GEMV-shaped"),
    Route("int4", "cuda", TRITON, _upto(TRITON_MAX_ROWS), triton, "reasoned: the weight read once"),
    Route("int4", "cuda", TRITON, when=triton_16bit),
    Route("int4", "cpu", WEIGHT_ONLY, lambda c, d: _upto(int4_kernel_max_rows(c.device, d, c)),
          figures="#policy-kernel-max-rows, #policy-int4-amx-kernel-max-rows, #policy-int4-bf16-kernel-max-rows"),
    Route("int4", "cpu", UPCAST, when=upcasts),
    Route("int4", ANY, DEQUANTIZE),
    # w4a8: gptj.native's GEMM on the integers (every library), else the same product in float32
    Route("w4a8", "cpu", NATIVE, when=w4a8_panels, figures="#w4a8"),
    Route("w4a8", ANY, UPCAST),
)
WEIGHT_KINDS = tuple(dict.fromkeys(r.weight for r in LINEAR_TABLE))


@dataclass(frozen=True)
class RowPlan:
    """A layer's paths by row count, for one device and activation dtype: (lo, hi, path) in the
    table's order; a call of `rows` rows takes the first span holding it."""

    spans: tuple[tuple[int, int, str], ...]

    def path(self, rows: int) -> str:
        return next(p for lo, hi, p in self.spans if lo <= rows <= hi)

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p for _, _, p in self.spans))


def linear_plan(caps: Capabilities, dtype: torch.dtype, weight: str, features: Features = (8, 8)) -> RowPlan:
    """The routes of LINEAR_TABLE a layer holding `weight` (one of WEIGHT_KINDS) with (in, out)
    `features` takes for `dtype` activations on the probed device, as a RowPlan."""
    if weight not in WEIGHT_KINDS:
        raise ValueError(f"unknown weight kind {weight!r} (one of {', '.join(WEIGHT_KINDS)})")
    spans = []
    for r in LINEAR_TABLE:
        if r.weight == weight and r.device in (ANY, caps.device) and r.when(caps, dtype, features):
            lo, hi = r.rows(caps, dtype) if callable(r.rows) else r.rows
            if lo <= hi:
                spans.append((lo, hi, r.path))
    return RowPlan(tuple(spans))


def linear_path(device: torch.device | str, dtype: torch.dtype, rows: int, weight: str,
                features: Features = (8, 8)) -> str:
    """The kernel for one call: `rows` rows of `dtype` activations on `device`, the layer holding
    `weight` (one of WEIGHT_KINDS) of (in, out) `features` (CUDA's INT_MM needs both divisible by 8,
    SCALED_MM by 16). A layer asks `linear_plan` once instead; this is for reports and tests."""
    return linear_plan(Capabilities.probe(device), dtype, weight, features).path(rows)


def describe_linear_table() -> str:
    """LINEAR_TABLE as text, a route per line (what `python -m gptj.policy` prints)."""
    lines = []
    for r in LINEAR_TABLE:
        rows = "by probe" if callable(r.rows) else ("any" if r.rows == (0, ALL_ROWS) else f"{r.rows[0]}-{r.rows[1]}")
        cond = "" if r.when is _always else r.when.__name__
        lines.append(f"{r.weight:14} {r.device:5} rows {rows:9} {r.path:11} {cond:14} {r.figures}")
    return "\n".join(lines)


@dataclass(frozen=True)
class AttentionPath:
    """The engine's attention backend (a name in gptj.engine.attention.BACKENDS), and whether the
    reference backend's forms are torch.compile'd."""

    backend: str
    compiled: bool


REFERENCE, CPU_NATIVE, CUDA = "reference", "cpu-native", "cuda"


def triton_available() -> bool:
    """Triton is installed (the CUDA attention backend's kernels are written in it)."""
    return importlib.util.find_spec("triton") is not None


def attention_path(device: torch.device | str, kv_dtype: torch.dtype, kernels_mode: str,
                   compile_mode: str, compute: torch.dtype | None = None, head_dim: int = 256,
                   heads: int | None = None, kv_heads: int | None = None) -> AttentionPath:
    """The attention backend for KV stored as `kv_dtype` and computed in `compute` (the model's float
    dtype; None: kv_dtype) on `device`, heads of `head_dim`, `heads` query heads over `kv_heads`
    key/value heads (None: as many as the query heads), under the engine's kernels mode ("auto" /
    "off") and compile mode ("auto": below float32, "on", "off"):

        cpu-native  kernels "auto", CPU, a bfloat16 model, bfloat16 or int8 KV, heads a multiple of 16
                    up to 512, gptj.native available
        cuda        kernels "auto", CUDA, Triton installed (any float dtype; float, int8 or e4m3 KV)
        reference   otherwise: torch's forms, compiled per compile_mode where compile_trusted

    Grouped-query attention (kv_heads < heads: Llama) runs on the same terms where kv_heads divides
    heads (both backends' kernels read KV head h // (heads // kv_heads) for query head h, a KV head's
    blocks once for its group of query heads); other head counts go to the reference, which computes
    any grouping, eagerly.
    """
    compute = kv_dtype if compute is None else compute
    kind = torch.device(device).type
    # the kernels' grouping: whole groups of query heads per KV head
    groups_fit = heads is None or kv_heads is None or (0 < kv_heads <= heads and heads % kv_heads == 0)
    if kernels_mode == "auto" and groups_fit:
        if (kind == "cpu" and compute == torch.bfloat16 and kv_dtype in (torch.bfloat16, torch.int8)
                and head_dim % 16 == 0 and head_dim <= 512 and native_available()):
            return AttentionPath(CPU_NATIVE, False)
        if kind == "cuda" and triton_available():
            return AttentionPath(CUDA, False)
    compiled = (compile_mode == "on" or (compile_mode == "auto" and not exact(compute))) and compile_trusted(device)
    return AttentionPath(REFERENCE, compiled)


def compile_trusted(device: torch.device | str) -> bool:
    """Whether the decode attention's forms may be torch.compile'd on `device`: not on CPU. torch
    2.13's inductor built wrong CPU code for them (engine.attention.reference's one_sums / group_sums against the
    eager forms, 1 to 40 keys, heads of 16 to 256): with 256-bit (AVX2) code wrong sums in 3 to 42 of
    42 cases, with 512-bit (AVX-512) code kernels that corrupted the heap ("double free or
    corruption"), in bfloat16 and float32, whichever sizes were marked dynamic. The eager forms are
    no slower at GPT-J's heads (16 x 256, 800 keys, 2 threads, bfloat16, timed with a throwaway
    script on the 2-core Zen 4: one query 544 us eager against 766 us compiled with 256-bit code;
    a 4-beam group 1,504 against 1,703 us; 512-bit code, where it ran, 326 and 1,314 us), and a
    bfloat16 model on an AVX-512-BF16 CPU runs gptj.native's kernels anyway. CUDA compiles."""
    return torch.device(device).type != "cpu"


if __name__ == "__main__":
    print(describe_linear_table())
