"""Which kernel runs: the one rule, per device, dtype and row count. Nothing else re-derives it.

float32 is the exact path everywhere: the plain eager math of gptj.model (HF's formulas), never
fused, packed, compiled or sent to a native kernel. Lower precision takes the fast paths:

  linear layers (`linear_path`; `weight` names what the layer holds)
  device  weight                      rows (tokens in the call)        path
  cpu     float, native layout        <= NATIVE_MAX_ROWS (8)           NATIVE       gptj.native bf16 GEMV (AVX-512:
                                                                                    bf16 dot products; AVX2: float32 FMAs)
          (PackedLinear "native")     more                             TORCH        F.linear
          ...on a CPU without bfloat16 <= NATIVE_EMULATED_BF16_MAX_ROWS NATIVE      (512: the GEMV, 8 rows at a time)
          arithmetic (`cpu_bf16`)     more                             UPCAST       the weight made float32 a chunk
                                                                                    at a time, F.linear in float32
  cpu     float, oneDNN layout        any                              ONEDNN       oneDNN-packed bf16 GEMM
          (PackedLinear "onednn")
  cpu     int8, AMX, in % 64 == 0     AMX_INT8_MIN_ROWS (2) to         AMX          gptj.native's AMX GEMM (amx.c)
          (`native_amx_available`)    AMX_INT8_MAX_ROWS (256)
          int8                        <= NATIVE_INT8_MAX_ROWS (512;    NATIVE       gptj.native int8 GEMV, 8-row tiles
                                      16 with AMX, 1024 where the                   (AVX-512 or AVX2, as above); from
                                      library has the int8 GEMM:                    32 rows AVX512-BF16's int8 GEMM
                                      `native_int8_max_rows`)
          (without gptj.native)       <= KERNEL_MAX_ROWS["int8"] (16)  WEIGHT_ONLY  torch._weight_int8pack_mm
                                      more                             DEQUANTIZE   dequantize + F.linear
          ...bfloat16 x on a CPU without bfloat16 arithmetic   UPCAST       the same in float32, rounded once
  cpu     int4, bfloat16 x, on a CPU  >= INT4_NATIVE_MIN_ROWS (2)      NATIVE       gptj.native's int4 GEMV (GEMM from
          with AVX512-BF16, no AMX                                                  32 rows) on torch's CPU layout
          (`native_int4_rows`)                                                      (blocks of 32 or 64 rows)
          ...on an AVX2 CPU          1 to INT4_AVX2_MAX_ROWS (512)    NATIVE       the vector layer's int4 GEMV
          int4                        <= int4_kernel_max_rows (512;        WEIGHT_ONLY  torch._weight_int4pack_mm_for_cpu
                                      bfloat16: 16 with AMX, 64 with
                                      AVX512-BF16)
                                      more                             DEQUANTIZE   (or UPCAST, as int8's; the CPU
                                                                                    layout unpacked by gptj.native)
  cpu     w8a8, packed               any, in the form `w8a8_form`      ONEDNN       oneDNN's u8 x s8 GEMM, int32 sums
          (PackedW8A8Linear)          names: SHIFTED (VNNI) or SPLIT                (SPLIT: twice the rows)
                                      any, form NATIVE (no VNNI,        NATIVE       gptj.native's W8A8 GEMM on its packed
                                      gptj.native loaded)                           panels, exact int32 sums (vpmaddwd)
  cpu     w8a8 (int8 x int8)          any, CPU with VNNI               INT_MM       torch._int_mm, int32 sums
                                      any, CPU without                 DEQUANTIZE   float32 products, exact (see below)
  cuda    w8a8                        > 16, in and out % 8 == 0        INT_MM       torch._int_mm (cuBLASLt)
                                      else                             DEQUANTIZE   the same products in float32
  W8A8's integer sums are exact on every path: oneDNN's (and so torch._int_mm's) u8 x s8 kernels sum
  in int32 only on CPUs with AVX-512 VNNI (gptj.cpu.int8_sums_exact); without it they add pairs of
  products in 16 bits, which saturate. There the packed layer takes gptj.native's GEMM (NATIVE) or,
  without gptj.native, the SPLIT form, and the plain one DEQUANTIZE, whose float32 sums run
  EXACT_F32_INT8_TERMS inputs at a time (each below 2**24, exact).
  cuda    int8                        <= TRITON_MAX_ROWS (16)          TRITON       gptj.quant.cuda's GEMV: the int8
                                                                                    weight read once, scaled in the kernel
                                      more                             DEQUANTIZE
  cuda    int4, bfloat16 activations  <= KERNEL_MAX_ROWS["int4"]       WEIGHT_ONLY  torch._weight_int4pack_mm
  cuda    int4, other activations     <= TRITON_MAX_ROWS               TRITON       gptj.quant.cuda's int4 GEMV
  cuda    fp8, FP8 matrix units       <= TRITON_MAX_ROWS               TRITON       the int8 GEMV on e4m3 weights
          (`fp8_supported`)           more, in and out % 16 == 0       SCALED_MM    torch._scaled_mm: e4m3 activations
                                                                                    per token x e4m3 weights
  any     fp8 elsewhere               any                              DEQUANTIZE   (the commands refuse fp8 there:
                                                                                    `check_fp8_device`; the math runs
                                                                                    for checks, e.g. quant-report on CPU)
  cuda    float                       any                              TORCH
  TRITON needs Triton installed (`triton_available`); where it is not, DEQUANTIZE runs.
  NATIVE needs gptj.native's GEMV built and loaded here (`native_gemv_available`: the library of the
  CPU's best ISA, AVX-512-BF16 or AVX2 + FMA); where it is not, the next row down runs. A module may
  still fall back further when its weight could not be packed for the kernel (Int4Linear without a
  CPU/CUDA int4 layout dequantizes).

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
  `exact`             float32: gptj.model.attention's exact math; below: torch's fused SDPA
  `attention_path`    the engine's decode attention: gptj.native's kernel for bfloat16 or int8 KV of a
                      bfloat16 model on CPU
                      (kernels "auto"), else torch.compile'd sums below float32 (compile "auto") or
                      always ("on") where `compile_trusted` (CUDA, not CPU), else the eager formulas
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from gptj import cpu, native
from gptj.errors import GptjError

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
TRITON = "triton"  # gptj.quant.cuda's weight-only GEMV (CUDA, few rows)
SCALED_MM = "scaled-mm"  # e4m3 activations x e4m3 weights, float32 sums (torch._scaled_mm)

WEIGHT_KINDS = ("native-layout", "onednn-layout", "int8", "int4", "w8a8", "fp8")

# gptj.quant.cuda's Triton GEMVs read the quantized weight once per call and stream every row
# through it: memory bound at decode's few rows, where torch has no int8 / fp8 weight-only kernel
# on CUDA (dequantizing first reads the weight three times over). Past 16 rows the GEMMs win.
TRITON_MAX_ROWS = 16
# FP8 matrix units (torch._scaled_mm with e4m3): compute capability 8.9 (Ada) and 9.0 (Hopper) on.
FP8_MIN_CAPABILITY = (8, 9)

# gptj.native's GEMV beats the alternatives up to 8 rows: bf16 1.4-1.8x oneDNN at 1-2 rows
# (benchmarks/native_gemv.py), int8 1.4-3x torch._weight_int8pack_mm.
NATIVE_MAX_ROWS = 8
# gptj.native's int8 GEMV runs any number of rows, 8 at a time over the weight. It stays ahead of
# dequantizing the weight for F.linear up to about 512 rows. Measured with a throwaway script at 2
# threads on the 2-core AVX512 box (best of 3, ms; the dequantize path is what KERNEL_MAX_ROWS
# below sends bigger calls to):
#   rows                       16    32    64   128   256   512   768
#   16384 x 4096  native      3.6   6.2  12.7  26.1  50.9 100.7 156.6
#                 dequantize 41.2  44.3  48.1  56.2  78.9 118.9 158.4
#   4096 x 16384  native        -     -     -     -  49.2 102.9 190.9
#                 dequantize    -     -     -     -  78.7 109.8 151.9
# The AVX2 library (float32 FMAs, 8 lanes) keeps the same lead up to 512 rows: on the same Zen 4 under
# ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 (an AVX2-only CPU's code), 2 threads, best of 3, ms:
#   16384 x 4096, rows                       8    16    32    64   128   256   512
#   native (avx2)                          7.7  15.2  29.6  61.2   119   236   480
#   dequantize + F.linear, bf16 x         76.7  98.9   137   224   401   749  1450
#   dequantize + F.linear, float32 x       127   131   148   174   221   310   489
NATIVE_INT8_MAX_ROWS = 512
# The AVX512-BF16 library has an int8 GEMM besides (gemv.c: each weight converted once per call, a
# register tile of bfloat16 dot products), which linear_int8 runs from 32 rows (its own crossover with
# the GEMV, gptj.native.int8_gemm_min_rows). It runs at 0.86-0.98x oneDNN's bfloat16 GEMM on bfloat16
# weights at 32-64 rows and 0.89-1.04x from 128, and stays ahead of dequantizing for that GEMM to 1024
# rows (`python benchmarks/native_gemv.py --int8-gemm --rows 8 16 24 32 48 64 128 512 1024 2048
# --rounds 5`, 2 threads, Zen 4, 2026-11-29, median of 5, ms):
#   rows                          24     32     64    128    512   1024   2048
#   16384 x 4096  GEMV          10.5   13.7   25.8   53.1    205    427    978
#                 GEMM          10.8   13.2   22.8   41.6    157    314    675
#                 dequantize    18.4   21.2   30.8   50.8    171    352    699
#                 (bf16 oneDNN  10.1   12.2   21.4   40.4    154    327    661)
#   4096 x 16384  GEMM          11.0   13.3   23.5   41.7    165    335    728
#                 dequantize    19.4   21.4   31.6   51.5    183    358    703
NATIVE_INT8_GEMM_MAX_ROWS = 1024
# A CPU with AMX (Intel Sapphire Rapids on) runs oneDNN's bfloat16 GEMM on its tile units, about 10x
# the AVX-512 GEMV's arithmetic, so the weight dequantized for F.linear (a chunk at a time into one
# reused buffer: gptj.quant.ops.chunked_linear) wins from a few rows on. A throwaway script, 2-core
# Intel Xeon with AMX, 2 threads, best of 3, 2026-11-28, ms:
#   rows                              8     16     32    128    512
#   28672 x 4096 (q|k|v|fc_in) native 13.5   27.5   53.2    214    910
#                 dequantize         31.0   30.4   33.9   48.5    103
#   4096 x 16384 (fc_out)     native  8.3   16.1   30.2    121    496
#                 dequantize         19.0   19.4   22.7   29.0   57.6
#   4096 x 4096               native  2.3    3.7    7.6   30.4    122
#                 dequantize          3.8    3.6    4.1    6.7   12.9
# The same CPU without AMX (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16) crossed over between 64 and 256 rows
# (at 512: 463-871 against 344-628 ms), about where NATIVE_INT8_MAX_ROWS' Zen 4 table, measured
# before the reused buffer, puts it.
NATIVE_INT8_AMX_MAX_ROWS = 16
# ...and gptj.native's own AMX GEMM (amx.c: the int8 weight made bfloat16 64 inputs at a time by byte
# lookups, in L1 or L2, and multiplied on the tiles) beats both from 2 rows to a few hundred. Same CPU,
# 2 threads, median of 7 (GEMV, AMX) or best of 3 (dequantize, the table above), ms:
#   rows                              1     2     4      8     16     32    128    256    512
#   28672 x 4096   GEMV             2.9   5.0   7.3   12.4   24.5   49.9    210    410    844
#                  AMX GEMM         4.6   4.4   4.5    4.9    5.4    7.9   23.0   46.9    102
#                  dequantize         -     -     -   31.0   30.4   33.9   48.5   56.8   93.6
#   50400 x 4096   GEMV             8.1  10.9  13.6   21.8   43.3   85.1      -      -      -
#   (lm_head)      AMX GEMM         9.8   9.1   9.3    9.5   10.4   14.1   40.7   81.1    184
#   4096 x 16384   GEMV             1.6   2.8   4.2    7.4   14.2   28.0    122    227    449
#                  AMX GEMM         2.8   2.7   2.9    3.0    3.1    3.9   21.6   37.1   69.6
#                  dequantize         -     -     -   19.0   19.4   22.7   29.0   34.7   49.2
# (one row: the GEMV streams the weight at 25-40 GB/s; from 2 rows the AMX GEMM, which at 8 rows of
# lm_head streams at 22 GB/s, the DRAM's rate here; past 32 rows it keeps the whole converted block in
# L2 for every 32 rows of x, and past 256 oneDNN's blocking wins)
AMX_INT8_MIN_ROWS, AMX_INT8_MAX_ROWS = 2, 256
# An engine of at most this many rows per step takes the native layout for its bfloat16 linears:
# bf16 GEMV 1.4-1.8x oneDNN at 1-2 rows, ~1x at 4, 0.83-0.99x at 8 rows with K = 4096. Holding
# both layouts would double the weights' memory, so the layout is chosen once, when packing.
NATIVE_LAYOUT_MAX_ROWS = 4
# A CPU without bfloat16 arithmetic (AVX2, AVX-512 without BF16) has no oneDNN bfloat16 layout, and
# torch's bfloat16 F.linear is slow there; gptj.native's bfloat16 GEMV (the AVX2 library) stays ahead
# of both it and of upcasting the weight to float32 up to 512 rows. 16384 x 4096 bf16, the Zen 4 under
# ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2, 2 threads, best of 3, ms:
#   rows                        8    16    32    64   128   256   512
#   native (avx2)             8.9  16.1  31.3  64.7   119   238   479
#   upcast + F.linear float32  108   111   122   145   189   278   493
#   F.linear bfloat16         24.5  45.8  88.8   175   348   695  1403
# So there every bfloat16 linear takes the native layout (`pack_layout`), whatever the engine's rows.
# On AVX-512 without BF16 oneDNN packs bfloat16 but emulates its arithmetic: a bench engine of 8 rows
# on its layout decoded at 33.1 tok/s and prefilled 89.2 (GPT-J's shapes, 2 layers, AVX512_CORE
# ceiling, benchmarks/cpu_kinds.py), the native layout there at 95-100 and 157 (docs/PERFORMANCE.md).
# Such a CPU's own library (avx512, 16 lanes) keeps the lead to 512 rows too (AVX512_CORE ceiling, the
# same shape, best of 3, ms; 2026-11-29, a throwaway script):
#   rows                        64   128   256   512  1024
#   native (avx512)           54.2   105   214   410   995
#   upcast + F.linear float32  193   253   354   556   979
NATIVE_EMULATED_BF16_MAX_ROWS = 512

# Weight-only kernels: calls with at most this many rows use torch's kernel; bigger ones dequantize
# the weight (a chunk at a time) and use F.linear. Measured with a throwaway script on this
# project's 2-core AVX512 CPU box (min of 7 runs; the box was shared, so +-50%), forcing each path
# on 4096x4096, 16384x4096 (fc_in) and 4096x16384 (fc_out) layers:
#   4096x4096, bf16, ms      rows: 1     8    64   128   256   512  1024
#   int8 kernel                    0.7   7.9   32    64     -     -     -
#   int8 dequantize + F.linear      23    26   40    48     -     -     -
#   int4 kernel                    0.5     -   14    25    50   101   337
#   int4 dequantize + F.linear       -     -   44    58    65   186   377
#   bfloat16 F.linear (unquantized) 2.1    -   16    24    72    95     -
# int8: the kernel wins up to 64 rows, dequantizing from 128 on, for all three shapes. int4: the
# CPU kernel stays close to a bfloat16 GEMM per row and dequantizing its layout is expensive, so
# the crossover is between 512 and 1024 rows. float32 activations: the kernels run in bfloat16
# and win to even more rows, but the dequantize path keeps float32 precision, so the bfloat16
# crossovers are used for every activation dtype.
KERNEL_MAX_ROWS = {"int8": 16, "int4": 512}
# int4 on a CPU with AMX, bfloat16 activations: gptj.native unpacks torch's CPU int4 layout
# (native.int4_dequant_t, about 0.17 ns a weight where torch's ops took 3) and oneDNN multiplies on
# AMX's tiles, so the dequantized matmul wins from 32 rows. Xeon with AMX, 2 threads, 2026-11-28,
# mean of 5 after a warm-up, ms (a throwaway script timing both paths of one Int4Linear, group 128):
#   rows                           16     32     64    128    512
#   28672 x 4096  int4 kernel     23.4   45.9   94.6  194.6  768.4
#                 dequantize      35.0   28.2   33.3   40.8   96.3
#   4096 x 16384  int4 kernel     12.6   25.8   51.7  103.1  417.3
#                 dequantize      16.6   18.9   19.3   23.3   61.6
# Without AMX (the same CPU under ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16) they crossed between 128 and
# 512 rows (at 512: 680 against 747 and 389 against 408 ms): KERNEL_MAX_ROWS["int4"] stays there.
INT4_AMX_KERNEL_MAX_ROWS = 16
# Without AMX but with bfloat16 arithmetic (AMD Zen 4 and 5, Intel Cooper Lake), the same unpacking and
# oneDNN's AVX512-BF16 GEMM overtake torch's int4 kernel at about 64 rows on a Zen 4 (2 threads,
# 2026-11-29, median of 5, ms; a throwaway script timing both paths of one Int4Linear, group 128, with
# oneDNN's bfloat16 GEMM on bfloat16 weights beside):
#   rows                           32     48     64     96    128    512
#   16384 x 4096  int4 kernel     25.4   38.5   52.0   77.4    102    414
#                 dequantize      39.7   46.3   51.3   61.7   70.5    214
#                 (bf16 oneDNN    12.0   16.8   21.5   33.0   40.7    167)
#   4096 x 16384  int4 kernel     27.7   38.6   51.5   77.8    108    443
#                 dequantize      43.6   43.9   48.5   59.2   77.7    195
#   28672 x 4096  int4 kernel     44.0   66.9   90.3    133    177    713
#                 dequantize      69.8   80.4   86.1    138    126    339
# (The Xeon above, held to AVX512_CORE_BF16, crossed between 128 and 512 rows; such CPUs in service
# without AMX are mostly AMD's, so the Zen 4's crossover is the rule.)
INT4_BF16_KERNEL_MAX_ROWS = 64  # (where gptj.native's int4 GEMM cannot take the layer's layout)
# There gptj.native's int4 kernels beat both from 2 rows: its GEMV (gemv.c: the weight's integers in
# bfloat16 dot products, scaled once a group) below 32 rows, its GEMM (the int8 GEMM's tiles on panels
# dequantized once per call) from 32 (the crossover is gemv.c's I4G_MIN_ROWS). Zen 4, 2 threads,
# 2026-11-29, median of 7 (1-4 rows) and 5, ms, group 128, `benchmarks/native_gemv.py --int4-gemm
# --rows 1 2 3 4` and `--rows 4 8 12 16 24 32` (one weight; "oneDNN bf16": bfloat16 weights in
# oneDNN's layout, what bfloat16 runs; a busier day than the table above, whose GEMM then ran at 1.6-1.8x
# torch's kernel from 16 rows):
#   rows                           1      2      3      4      8     16     24     32
#   16384 x 4096  int4 kernel    2.03   2.92   3.68   4.44   7.47   14.8   22.3   29.7
#                 int4 GEMV      2.17   3.25   3.41   4.09   4.87   8.35   11.7   15.3
#                 int4 GEMM         -      -      -      -   7.57   9.98   12.5   14.9
#                 (oneDNN bf16   6.21   6.49   6.09   6.24   7.89   9.31   11.8   14.2)
#   4096 x 16384  int4 kernel    2.10   2.57   3.00   3.27   7.53   14.8   22.3   29.5
#                 int4 GEMV      2.42   2.77   2.95   2.76   5.18   8.47   12.1   15.9
#                 int4 GEMM         -      -      -      -   8.05   10.5   12.8   15.4
#   50400 x 4096  int4 kernel    6.06   7.77   9.50   11.8   19.5   39.1   58.4   78.2
#                 int4 GEMV      7.19   8.32   10.1   12.0   13.9   23.2   32.8   41.9
#                 int4 GEMM         -      -      -      -   19.8   27.7   34.8   42.7
#   28672 x 4096  int4 kernel    3.50   4.52   5.55   6.52
#                 int4 GEMV      3.43   4.43   4.50   5.66
# On one weight torch's kernel was faster at 1-2 rows. Decode streams its weights: there (8 copies of the
# weight in turn, median of 7) the GEMV took 2.05-2.19 ms against torch's 2.38 at 2 rows of 16384 x 4096,
# 2.13 against 2.32 of 4096 x 16384, and tied at 1 row (2.06-2.13 against 2.01; 1.79-1.91 against 1.79);
# `cpu_kinds.py --modes none,int4` decoded batches of 2 at 91.5-93.6 tok/s with the GEMV against
# 84.5-87.0 with torch's kernel (3 rounds each, alternated), batch 1 at 52.8-54.7 against 48.6-55.1
# (noise). Torch's kernel keeps 1 row.
INT4_NATIVE_MIN_ROWS = 2
# On an AVX2 CPU (gptj.cpu's avx2 kind, gptj.native's avx2 library) the vector layer's int4 GEMV (gemv.c's
# gemv_int4_vf: the nibbles converted to float32 in registers, float32 FMAs, each group's sums scaled once;
# tiles of 5 rows) beats torch's int4 kernel at every row count from 1 to 512, and the dequantized matmul
# in float32 (UPCAST) takes over between 512 and 1024. Zen 4 held to AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2
# ATEN_CPU_CAPABILITY=avx2`), 2 threads, 2026-11-29, group 128, median of 5 (512 and 1024: of 3), ms,
# `benchmarks/native_gemv.py --int4-gemm --rows 1 2 4 8 16 24 32 64 128 256` (one weight; "native bf16":
# the bfloat16 GEMV on bfloat16 weights, what bfloat16 runs there):
#   rows                           1      2      4      8     16     24     32     64    128    256
#   16384 x 4096  int4 kernel    4.25   4.37   6.95   11.2   20.1   31.0   39.7   79.3    166    333
#                 int4 GEMV      2.41   3.73   6.06   8.15   17.4   23.1   29.9   53.6    105    201
#                 (native bf16   4.20   6.01   8.56   9.33   16.0   22.9   29.0   58.2    114    220)
#   4096 x 16384  int4 kernel    4.14   4.21   5.07   9.91   21.2   29.6   39.5   81.0    164    333
#                 int4 GEMV      3.58   3.92   4.57   7.81   14.2   20.7   27.6   55.7    112    263
#   at 512 and 1024 rows of 4096 x 16384: int4 kernel 648, 1312; dequantized in float32 647, 1055; GEMV 514, 1452.
# On AVX-512 without BF16 (the avx512 library, 16 lanes) torch's int4 kernel was faster at 1-8 rows (1.95
# against 2.45 ms at 1 row of 16384 x 4096) and level from 16: there torch's kernel stays (the same command
# under `ONEDNN_MAX_CPU_ISA=AVX512_CORE ATEN_CPU_CAPABILITY=avx512`, --rows 1 2 4 8 16 32).
INT4_AVX2_MAX_ROWS = 512

# W8A8 on CPU: one kernel at every row count, with exact int32 sums, so a row's result is the same
# whatever else is in the call (batch invariance by construction). Serving packs the weight for
# oneDNN's u8 x s8 GEMM (torch.ops.onednn.qlinear_*, activations shifted to uint8 with zero point
# 128); a model as loaded runs torch._int_mm, which reorders the weight at every call. Measured on
# this project's 2-core AVX512-VNNI box, 1 thread, a 16384 x 4096 int8 weight (fc_in), best of 5, ms:
#   rows                                  1     4     8    16    32    64   128   256
#   oneDNN packed u8 x s8 (serving)     1.8   2.1   2.7   3.6   6.2  10.2  18.6  35.5
#   torch._int_mm (as loaded)           2.4  10.5  11.3  12.5  14.4  18.6  27.2  44.4
#   gptj.native int8 GEMV (bf16 x int8) 1.7   2.4   4.9   7.7     -     -     -     -
# (oneDNN's s8 x s8 variant of the same op took about 1 s a call here: never used.)
# CUDA's _int_mm (cuBLASLt) wants more than 16 rows and in / out features divisible by 8.
INT_MM_CUDA_MIN_ROWS = 17

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
# 2 threads, the Intel Xeon with AMX, 2026-11-28, median of 7, ms (AMX / oneDNN SHIFTED):
#   rows                     1          8          32         128        512
#   28672 x 4096        3.2 / 3.8  3.3 / 4.3  4.2 / 7.2  9.6 / 12.1  44.9 / 59.6
#   50400 x 4096        8.1 / 10.6 8.4 / 10.8 9.7 / 14.8 20.5 / 21.7 81.4 / 96.7
#   4096 x 16384        1.5 / 1.7  1.6 / 1.7  1.7 / 2.1  5.5 / 5.7   27.0 / 23.7
#   4096 x 4096         0.45/ 0.53 0.45/ 0.46 0.50/ 0.60 1.24/ 1.29  5.8 / 4.4
W8A8_FORMS = (SHIFTED, SPLIT, NATIVE, AMX)


# W8A8 without VNNI: gptj.native's W8A8 GEMM (native.linear_w8a8: int8 weights packed in panels of 16
# output channels, x widened to int16, vpmaddwd's pairs of products summed into int32, exact) against
# oneDNN's SPLIT GEMM. benchmarks/w8a8_gemm.py, 2026-11-28, the 2-core Zen 4 under the AVX2 ceiling
# (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2), 2 threads, ms per call:
#   rows                            1      8     32    128    512
#   4096 x 4096    native        0.21   1.13   3.90   14.2   58.1
#                  oneDNN SPLIT  3.87   4.79   8.59   23.3   86.9
#   16384 x 4096   native        2.21   6.19   18.3   75.5    249
#                  oneDNN SPLIT  14.4   18.8   38.7   95.1    376
#   4096 x 16384   native        2.21   8.15   21.0   78.3    301
#                  oneDNN SPLIT  15.5   19.0   40.3    112    419
# so the native GEMM at every row count where the CPU lacks VNNI (1.4-18x), on its own packed weight
# alone (no oneDNN copy: W8A8's weight memory, not twice it). With VNNI (the same run without the
# ceiling) oneDNN's SHIFTED GEMM (vpdpbusd: 4 products a lane) took 0.45-0.86x the native one's time
# (vpdpwssd: 2 a lane) from 8 rows on; the native one won only at 1 row (1.7-2.0x on the large
# shapes), not worth a second copy of the weights, so never there.


def exact(dtype: torch.dtype) -> bool:
    """Whether `dtype` runs the exact path (float32), not the fast one."""
    return dtype == torch.float32


def auto_dtype(device: torch.device | str) -> torch.dtype:
    """`--dtype auto`: bfloat16 where it runs fast — a GPU that has it; a CPU that computes it
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


def native_int8_max_rows() -> int:
    """The most rows of a call that gptj.native's int8 kernels take (more: the dequantized matmul):
    NATIVE_INT8_AMX_MAX_ROWS on a CPU with AMX, NATIVE_INT8_GEMM_MAX_ROWS where the loaded library
    has the int8 GEMM (AVX512-BF16's), else NATIVE_INT8_MAX_ROWS (the GEMV's)."""
    if cpu_amx():
        return NATIVE_INT8_AMX_MAX_ROWS
    return NATIVE_INT8_GEMM_MAX_ROWS if native.int8_gemm_min_rows() > 0 else NATIVE_INT8_MAX_ROWS


def int4_kernel_max_rows(device: torch.device | str, dtype: torch.dtype) -> int:
    """The most rows of an int4 call that torch's int4 kernel takes (more: the dequantized matmul): for
    bfloat16 on a CPU with gptj.native (its unpacking), INT4_AMX_KERNEL_MAX_ROWS with AMX and
    INT4_BF16_KERNEL_MAX_ROWS with AVX512-BF16; else KERNEL_MAX_ROWS["int4"]."""
    if native_elementwise(device, dtype) and cpu_amx():
        return INT4_AMX_KERNEL_MAX_ROWS
    if native_elementwise(device, dtype) and cpu_bf16():
        return INT4_BF16_KERNEL_MAX_ROWS
    return KERNEL_MAX_ROWS["int4"]


def native_int4_rows(device: torch.device | str, dtype: torch.dtype) -> range:
    """The rows of int4 calls of `dtype` activations on `device` that gptj.native's int4 kernels take
    (native.linear_int4), bfloat16 on a CPU: with AVX512-BF16 but no AMX, where the loaded library has the
    int4 GEMM (AVX512-BF16's), from INT4_NATIVE_MIN_ROWS rows on (its GEMV, its GEMM from 32 rows); on an
    AVX2 CPU with the avx2 library loaded, 1 to INT4_AVX2_MAX_ROWS rows (the vector layer's GEMV). None
    elsewhere (an empty range): with AMX oneDNN's GEMM on the unpacked weight is faster, on AVX-512 without
    BF16 torch's int4 kernel."""
    if not native_elementwise(device, dtype) or not native.int4_gemm_available():
        return range(0)
    if cpu_bf16() and not cpu_amx() and native.int4_gemm_min_rows() > 0:
        return range(INT4_NATIVE_MIN_ROWS, 1 << 62)
    lib = native.isa()
    if cpu.kind() == cpu.AVX2 and lib is not None and lib.name == "avx2":
        return range(1, INT4_AVX2_MAX_ROWS + 1)
    return range(0)


def native_elementwise(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a fused block's GELU and rotary, and the engine's KV stores, of `dtype` activations
    on `device` run gptj.native's one-pass kernels (bfloat16 on CPU) instead of torch's ops."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and native_available()


def argmax_path(device: torch.device | str) -> str:
    """How the sampler takes a greedy step's argmax over float32 logits: "native" on a CPU with
    gptj.native's elementwise kernels (native.argmax_rows: 0.06 against torch's 0.67-1.30 ms for 32
    rows of GPT-J's vocabulary, 2 threads, Zen 4, 2026-11-29), else "torch" (torch.max's indices:
    the same indices)."""
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


def linear_path(device: torch.device | str, dtype: torch.dtype, rows: int, weight: str,
                features: tuple[int, int] = (8, 8)) -> str:
    """The kernel for a linear layer's call: `rows` rows of `dtype` activations on `device`, the
    layer holding `weight` (one of WEIGHT_KINDS). One of NATIVE, AMX, ONEDNN, WEIGHT_ONLY, INT_MM, TRITON,
    SCALED_MM, DEQUANTIZE, UPCAST, TORCH. `features`: the layer's (in, out) features (CUDA's INT_MM needs both
    divisible by 8, SCALED_MM by 16)."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if weight == "onednn-layout":
        return ONEDNN
    if weight == "native-layout":
        if not cpu_bf16():
            return NATIVE if rows <= NATIVE_EMULATED_BF16_MAX_ROWS and native_gemv_available() else UPCAST
        return NATIVE if rows <= NATIVE_MAX_ROWS and native_gemv_available() else TORCH
    if weight == "fp8":
        if not fp8_supported(device):
            return DEQUANTIZE
        if rows <= TRITON_MAX_ROWS and triton_available():
            return TRITON
        return SCALED_MM if not (features[0] | features[1]) % 16 else DEQUANTIZE
    if weight == "int8":
        if kind != "cpu":
            return TRITON if kind == "cuda" and rows <= TRITON_MAX_ROWS and triton_available() else DEQUANTIZE
        if AMX_INT8_MIN_ROWS <= rows <= AMX_INT8_MAX_ROWS and native_amx_available() and amx_fits(features[0]):
            return AMX
        if rows <= native_int8_max_rows() and native_gemv_available():
            return NATIVE
        return WEIGHT_ONLY if rows <= KERNEL_MAX_ROWS["int8"] else _dequantize(kind, dtype)
    if weight == "w8a8":
        if kind == "cpu":
            return INT_MM if cpu.int8_sums_exact() else DEQUANTIZE
        if kind == "cuda" and rows >= INT_MM_CUDA_MIN_ROWS and not (features[0] | features[1]) % 8:
            return INT_MM
        return DEQUANTIZE
    if weight == "int4":
        if rows in native_int4_rows(kind, dtype):
            return NATIVE
        if rows > int4_kernel_max_rows(kind, dtype):
            return _dequantize(kind, dtype)
        if kind == "cpu" or (kind == "cuda" and dtype == torch.bfloat16):
            return WEIGHT_ONLY
        if kind == "cuda" and rows <= TRITON_MAX_ROWS and triton_available():
            return TRITON
        return DEQUANTIZE
    raise ValueError(f"unknown weight kind {weight!r} (one of {', '.join(WEIGHT_KINDS)})")


def _dequantize(kind: str, dtype: torch.dtype) -> str:
    """A weight-only layer's many-row path: the weight dequantized for F.linear in the activations'
    dtype (DEQUANTIZE), or in float32 (UPCAST) for bfloat16 on a CPU without bfloat16 arithmetic,
    where F.linear in bfloat16 takes 3x float32's time (NATIVE_INT8_MAX_ROWS' table)."""
    return UPCAST if kind == "cpu" and dtype == torch.bfloat16 and not cpu_bf16() else DEQUANTIZE


def fp8_supported(device: torch.device | str) -> bool:
    """Whether `device` has FP8 matrix units (a CUDA GPU of compute capability 8.9 or more)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def check_fp8_device(device: torch.device | str) -> None:
    """GptjError, in one line, unless FP8 weights run on `device` (what every command that
    generates checks before loading them)."""
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
                   compile_mode: str, compute: torch.dtype | None = None, head_dim: int = 256) -> AttentionPath:
    """The attention backend for KV stored as `kv_dtype` and computed in `compute` (the model's float
    dtype; None: kv_dtype) on `device`, heads of `head_dim`, under the engine's kernels mode
    ("auto" / "off") and compile mode ("auto": below float32, "on", "off"):

        cpu-native  kernels "auto", CPU, a bfloat16 model, bfloat16 or int8 KV, heads a multiple of 16
                    up to 512, gptj.native available
        cuda        kernels "auto", CUDA, Triton installed (any float dtype; float, int8 or e4m3 KV)
        reference   otherwise: torch's forms, compiled per compile_mode where compile_trusted
    """
    compute = kv_dtype if compute is None else compute
    kind = torch.device(device).type
    if kernels_mode == "auto":
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
