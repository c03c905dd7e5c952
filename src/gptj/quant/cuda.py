"""Triton kernels for weight-only quantized linear layers on CUDA: decode's row counts (1 to MAX_ROWS),
where the quantized weight is read once per call and dequantized inside the kernel, so a call moves
int8 / int4 bytes instead of bfloat16 ones (the work is memory bound), and bigger calls (batched decode,
prefill: the GEMM plans MANY_ROWS), which dequantize each weight tile in registers as well, never the
whole weight.

  int8_linear(x2, q, scale, bias)   q int8 (N, K), or e4m3 (torch.float8_e4m3fn, GPUs with FP8
                                    units) in the same layout; scale bfloat16 (N,), per output channel:
                                        y = (x2 @ q.T) * scale + bias     (scale after the K-sum)
  int4_linear(x2, packed, scale, zero, group_size, bias)
                                    packed uint8 (N, K/2), the portable layout of gptj.quant.ops:
                                    byte[n, j] = q[n, 2j] << 4 | q[n, 2j + 1] (high nibble first), q in
                                    0..15; scale, zero bfloat16 (N, K / group_size):
                                        w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g],  g = k // group_size
                                    computed per group as scale * sum((q - 8) * x) + zero * sum(x), the
                                    even inputs against the high nibbles, the odd ones against the low.

x2 (M, K) float32, float16 or bfloat16, each row contiguous; y (M, N) in x2's dtype. The sums are
float32 sums of exact products (x times the weight's integer or e4m3 values, exact in x's dtype and
in float32 for float16 / bfloat16 x; rounded once for float32 x), the scales and zeros applied in
float32. A launch plan (Tiles) picks one of three kernel designs, its kind:

  "mma" (TILES, the default): x as tl.dot's A operand in tiles of 16 rows (one tile for decode's
      calls: the weight is read once for all rows), the weight tile converted to x's dtype and
      transposed (tl.trans) to tl.dot's B operand. With float casts it moves half bfloat16's bytes in
      about bfloat16's time (figures: docs/PERFORMANCE.md#gpu-quant-gemv). Its row tiles (on the
      grid's second axis) may be larger, up to MMA_MAX_ROWS: the GEMM plans (MANY_ROWS) of calls past
      MAX_ROWS rows.
  "swapped": the weight tile (BLOCK_N, BLOCK_K) as tl.dot's A operand, as it lies in memory (K
      contiguous, no transpose), x^T (BLOCK_K, rows) as B: out^T tiles (BLOCK_N, rows), stored
      transposed. rows (Tiles.rows) may be 8 (mma.sync's n) or fewer: less padding than 16.
  "fma": no tensor cores, for 1, 2 or 4 rows a program: per row a float32 (BLOCK_N, BLOCK_K)
      accumulator of products over the K loop (the weight converted to float32 by bit operations,
      not conversion instructions), reduced along K once after it; the loop's loads pipelined by
      tl.range's num_stages (Triton pipelines only loads that feed a tl.dot otherwise).
  The kinds "swapped" and "fma" put the row tiles on the grid's fastest axis (programs of one block
  of outputs run together: a call of more rows than a program's reads the weight again, mostly from
  L2) and take int8_block_k // group_size int4 groups a loop step (unrolled).
  benchmarks/gemv_sweep.py times them all; plan_for's table (below TILES) says which the calls run.
  Tiles.convert "bits" (kinds "mma" and "swapped", bfloat16 x only; float16 / float32 x run "cast"):
      the weight made bfloat16 by integer operations instead of w.to(x.dtype): the recipes and their
      ranges above INT8_MAGIC (int8, int4 exact for every byte; e4m3 exact for every finite byte,
      with x scaled by 2^64, so |x| < 2^64, products under 2^-70 maybe flushed). e4m3's cast is
      conversion instructions, which "bits" replaces by permutes, a shift and a mask; int4's drops the
      int8 -> bfloat16 conversions. The mma kind's int8 and e4m3 GEMVs run faster with "bits" (the
      SASS study and timings: docs/PERFORMANCE.md#gpu-quant-gemv).

Batch invariance: every row is computed alike whatever else is in the call (under every kind, a
row's sums do not depend on the other rows of its program, nor on its place among them; rows past M
are masked or read row M - 1 and are not stored), and the plan (kind, block sizes, rows a program,
K split) depends on N, K and the device only, so for a fixed plan a row's result is the same bit for
bit in a call of any number of rows. Different plans sum in different orders: their results may
differ in the last bits. The calls choose their plan by rows (plan_for: one for a call of 1 row, one
for 2 to MAX_ROWS, as timed on an H200, one for more than MAX_ROWS, the GEMM plans MANY_ROWS, reasoned
and compiled but not yet timed on a GPU), so a row is the same bit for bit within each class.

Tested under Triton's interpreter (TRITON_INTERPRET=1, on CPU tensors, float32 and float16: the
interpreter has no bfloat16 arithmetic) and on a GPU (tests/test_quant_cuda.py with -m cuda,
bfloat16 "bits" kernels included; the record: docs/PERFORMANCE.md#gpu-quant-gemv).
The "bits" recipes are tested on every byte in torch and, for int8 and e4m3, as the kernels' own
helpers under the interpreter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the caller (gptj.policy) sends calls here only where Triton is installed
    triton = None

MAX_ROWS = 16  # the GEMV plans' most rows (one tile of 16); past it the GEMM plans (MANY_ROWS)

# Block sizes of the default plan (TILES below, the kind "mma"): starting points from the arithmetic,
# which benchmarks/gemv_sweep.py times against others (docs/PERFORMANCE.md#gpu-quant-gemv):
#   BLOCK_M 16: tl.dot's smallest tile. Decode's 1..16 rows are one tile, so each weight tile is read
#     once for every row, and M = 1 and M = 16 run the same code (tensor cores do the 16 rows for
#     the price of one; the padding rows are masked loads of x, no memory traffic). The kernels are
#     not specialized on M (do_not_specialize): one binary for every row count.
#   BLOCK_N 32: output channels per program. N = 4096 gives 128 programs, under one per SM on an
#     H100 (132), so the K range is split (below) to put a few programs on each SM: a GEMV only
#     reaches the memory's bandwidth with enough bytes in flight per SM (some 16-32 KiB).
#   K step: int8 256 inputs (8 KiB of weight per step, 256 B per row of the tile: whole 128-byte
#     lines); int4 one group (group_size / 2 bytes per row: 2 KiB per step at the default 128), so
#     the int4 kernel runs more pipeline stages to keep as many bytes in flight.
#   num_warps 4: a 16 x 32 output tile is one mma per warp; more warps would only split K further.
#   num_stages: Triton's software pipelining of the loads over K (the bytes in flight per program):
#     up to MAX_STAGES, as many as fit STAGE_BYTES of shared memory (every stage holds a step's weight
#     and x tiles; 64 KiB leaves room on GPUs with 100 KiB per SM, and for two programs on an H100).
BLOCK_M = 16
MAX_STAGES = 6
STAGE_BYTES = 64 * 1024
# Split-K: where N gives fewer than PROGRAMS_PER_SM programs per SM, the K range is cut into up to
# MAX_SPLIT slices (a power of two); each writes float32 partial sums, and a second small kernel adds
# them in a fixed order (no atomics: the result does not depend on which slice ends first).
PROGRAMS_PER_SM = 2
MAX_SPLIT = 8
DEFAULT_SMS = 132  # an H100's SMs: the plan where there is no GPU (the interpreter), as it would run there
HOPPER = (9, 0)  # the compute capability plans assume where there is no GPU, as DEFAULT_SMS


KINDS = ("mma", "swapped", "fma")
FMA_MAX_ROWS = 4  # the kind "fma" keeps one accumulator per row of its program: 1, 2 or 4
MMA_MAX_ROWS = 128  # the kind "mma"'s largest row tile (the GEMM plans'); "swapped" up to MAX_ROWS
CONVERTS = ("cast", "bits")  # Tiles.convert: how the kinds "mma" and "swapped" make bfloat16 weights

# Tiles.convert "bits": the weight to bfloat16 by integer operations (bfloat16 x only), the recipes'
# constants (shared by the kernels' helpers _int8_bf16, _e4m3_bf16, _int4_bf16 and the exhaustive
# tests of tests/test_quant_cuda.py, which replay the same steps in torch and run the helpers):
#   int8 q: f = bits-as-float32(int32(q) + INT8_MAGIC) - INT8_MAGIC_VALUE, the bfloat16 of f's high
#     16 bits. int32(q) + 0x4B000080 is 0x4B000000 + (q + 128), q + 128 in 0..255 (no carry out of the
#     low byte): the float32 2^23 + 128 + q exactly (its ulp is 1 in [2^23, 2^24)); less 2^23 + 128
#     (exact: Sterbenz) it is q, an integer of at most 8 significant bits, so its low 16 bits are 0 and
#     the high half is bfloat16(q) exactly. Every byte (-128..127) is exact: no range condition.
#   e4m3 byte b: the bfloat16 bits ((b & 0x80) << 8) | ((b & 0x7F) << 4), computed as
#     (int32(int8(b)) << E4M3_SHIFT) & E4M3_MASK (the sign-extended byte: its bit 7 lands on bit 15),
#     are exactly e4m3(b) * 2^E4M3_LOG2 (2^-120; e4m3's exponent bias 7, bfloat16's 127, 3 mantissa
#     bits into the top of 7) for every finite byte, subnormals included (m/8 * 2^-6 becomes the
#     bfloat16 subnormal (16 m / 128) * 2^-126); the NaN bytes 0x7F / 0xFF become 480 * 2^-120 (finite),
#     as does any unloaded (masked) byte: no NaN reaches the sums, x is 0 there. Those weights are tiny
#     (at most 448 * 2^-120, subnormal below 2^-126 for e4m3's subnormals), so x is scaled first by
#     X_PRESCALE = 2^64 (exact in bfloat16 for |x| < 2^64; past that x * 2^64 is inf and so is y) and
#     the float32 sums, x * e4m3 * 2^-56 each, scaled back by E4M3_UNSCALE = 2^56 before the channel
#     scale (exact: a power of two, no overflow: |sum| <= K * 2^64 * 448 * 2^-120). A product
#     x * e4m3 is then a normal float32 when |x * e4m3| >= 2^-70 (2^-126 * 2^56); smaller ones
#     (|x| < 2^-61 against e4m3's smallest, 2^-9) may be flushed to 0 by the tensor cores, an
#     absolute error under 2^-70 * |scale| a product ("cast" keeps products down to 2^-126). The
#     mma's bfloat16 inputs include subnormal weights (e4m3's subnormals): a tensor core that flushed
#     subnormal inputs would zero them (tests/test_quant_cuda.py's one-hot test checks this on a GPU).
#   int4 nibble n (0..15): the bfloat16 bits INT4_MAGIC | n are 128 + n exactly (ulp 1 in [128, 256)),
#     less INT4_MAGIC_VALUE (136) in bfloat16 it is n - 8 exactly (Sterbenz: both in [120, 143]).
INT8_MAGIC = 0x4B000080  # float32 bits of 2^23 + 128
INT8_MAGIC_VALUE = 8388736.0  # 2^23 + 128
E4M3_SHIFT = 4
E4M3_MASK = 0x87F0  # bit 15 (the sign) and bits 4..10 (e4m3's exponent and mantissa)
E4M3_LOG2 = -120  # bfloat16 from a byte = e4m3 value * 2^E4M3_LOG2
X_PRESCALE = 2.0**64
E4M3_UNSCALE = 2.0**56  # 2^120 / X_PRESCALE
INT4_MAGIC = 0x4300  # bfloat16 bits of 128
INT4_MAGIC_VALUE = 136.0  # 128 + 8


@dataclass(frozen=True)
class Tiles:
    """A launch plan (TILES: the defaults above; benchmarks/gemv_sweep.py times others).

    kind: the kernel design (the module's docstring): "mma" (x as tl.dot's A operand, the weight
      transposed as its B), "swapped" (the weight as A in its own K-contiguous layout, x transposed
      as B) or "fma" (no tl.dot: float32 multiply-adds, the K reduction once after the loop).
    rows: rows of x per program (a power of two: the kind mma 1 to MMA_MAX_ROWS, swapped 1 to
      MAX_ROWS, fma 1, 2 or 4); a call of M rows runs cdiv(M, rows) programs per block of outputs,
      each reading its weight tile (so M > rows reads the weight again, from L2 where the programs
      run together: the kinds swapped and fma put the row tiles on the grid's fastest axis).
    block_n: output channels per program. int8_block_k: the int8 / e4m3 K step; the int4 K step of
      the kinds "swapped" and "fma" is int8_block_k // group_size groups (at least one), of "mma" one
      group. num_warps as Triton's. split / num_stages None: from the plan (_plan, _stages).
    convert (kinds "mma" and "swapped"; "fma" converts to float32 by bit operations already): how the
      weight becomes x's dtype for tl.dot. "cast" (the default): w.to(x.dtype), conversion
      instructions (int8 -> float32 -> bfloat16: two a weight, which may bound the GEMV). "bits": for
      bfloat16 x, integer operations (the recipes above INT8_MAGIC: int8 and int4 exact for every
      byte; e4m3 scales x by 2^64, so |x| must stay under 2^64, and products under 2^-70 may be
      flushed, see there); float16 / float32 x keep "cast" (the same kernel as "cast", bit for bit).
      benchmarks/gemv_sweep.py times it against "cast" (docs/PERFORMANCE.md#gpu-quant-gemv).
    Any plan computes a row alike in a call of any number of rows; different plans sum in
    different orders (so their results may differ in the last bits)."""

    block_n: int = 32
    int8_block_k: int = 256
    num_warps: int = 4
    split: int | None = None
    num_stages: int | None = None
    kind: str = "mma"
    rows: int = BLOCK_M
    convert: str = "cast"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Tiles.kind must be one of {KINDS}, got {self.kind!r}")
        if self.convert not in CONVERTS:
            raise ValueError(f"Tiles.convert must be one of {CONVERTS}, got {self.convert!r}")
        if self.convert == "bits" and self.kind == "fma":
            raise ValueError("Tiles.convert 'bits' is for the kinds mma and swapped (fma converts to float32 by bits)")
        for name in ("rows", "block_n", "int8_block_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"Tiles.{name} must be a power of two, got {v!r}")
        most = {"mma": MMA_MAX_ROWS, "swapped": MAX_ROWS, "fma": FMA_MAX_ROWS}[self.kind]
        if self.rows > most:
            raise ValueError(f"Tiles.rows must be at most {most} for the kind {self.kind} (mma {MMA_MAX_ROWS}, "
                             f"swapped {MAX_ROWS}, fma {FMA_MAX_ROWS}), got {self.rows}")


TILES = Tiles()  # the first default: reasoned, not timed (the kind "mma", float casts)

# The plans the calls run where none is given (plan_for), the fastest of benchmarks/gemv_sweep.py's on an
# H200 (figures: docs/PERFORMANCE.md#gpu-quant-gemv): one row, the kind "fma"; 2 to MAX_ROWS rows, "mma"
# with "bits" for int8 and e4m3, "swapped" for int4 (bfloat16 x's int4 runs torch's tinygemm: policy).
# The kind "fma" of one row reads the weight once per row, so it is slow for more rows.
# Batch invariance therefore holds within each class of calls (1 row; 2 to MAX_ROWS rows; more: MANY_ROWS
# below): a row's result is the same bit for bit in any call of its class; between classes the sums'
# order differs.
ONE_ROW = {"int8": Tiles(kind="fma", rows=1, block_n=32, int8_block_k=256),
           "e4m3": Tiles(kind="fma", rows=1, block_n=16, int8_block_k=512),
           "int4": Tiles(kind="fma", rows=1, block_n=32, int8_block_k=256)}
FEW_ROWS = {"int8": Tiles(block_n=64, int8_block_k=128, convert="bits"),
            "e4m3": Tiles(block_n=64, int8_block_k=128, convert="bits"),
            "int4": Tiles(kind="swapped", rows=16, block_n=128, int8_block_k=128)}


# Past MAX_ROWS (batched decode, prefill chunks up to 2,048 rows): GEMM plans of the kind "mma", reasoned
# and compiled for sm_90a (docs/GPU.md), not yet timed on a GPU. Each program converts its weight tile
# in registers (never the whole weight) and runs it against `rows` rows of x on the tensor cores (wgmma
# on Hopper, by warpgroups of 4 warps, as the compiled PTX shows).
#   rows: the MMA work a weight tile's conversion is spread over. A weight's conversion takes some 2 to 4
#     integer or float operations (1/32 to 1/16 of a clock of an SM's 64 integer lanes), its MMA against
#     128 rows 256 FLOPs (1/16 of a clock at Hopper's 4,096 bfloat16 FLOPs a clock per SM): at 128 rows
#     the conversion takes at most the MMA's time (and overlaps it), at 64 rows it could bound prefill's
#     GEMM. Calls of 17 to 127 rows pad to 128 on the tensor cores: they are memory bound (an int8
#     weight is 1 byte for 2 M FLOPs; Hopper's bfloat16 ridge, ~300 FLOPs a byte, lies near M = 150),
#     and padding rows are masked loads, no DRAM traffic.
#   block_n 128, K step 64 (int8 / e4m3): a 128 x 128 float32 accumulator over 8 warps (64 registers a
#     thread); a stage holds 8 KiB of weight and 16 KiB of x, 3 stages 72 KiB of shared memory (80 KiB
#     as compiled: two programs an SM fit Hopper's 228 KiB). N = 4,096 gives 32 programs per 128
#     rows, a quarter of an H100's SMs: the calls of a few dozen rows on out_proj and fc_out are the
#     plan's weak spot (a smaller block_n or a class of its own is what a GPU should time first).
#   int4: the K step is one group (128 inputs), and the kernel keeps a group's product (qx) beside the
#     accumulator to scale it, so its tiles take more registers: at 8 warps 128 x 128 spilled 1.9 KB,
#     64 x 128 64 B, 128 x 64 used all 255 registers (0 B; at 4 warps 904 B), under Triton 3.9; so
#     64 rows x 64 outputs, 8 warps (132 registers, 0 B spilled; a group's x 16 KiB and weight 4 KiB:
#     _stages' 3 stages, 40 KiB of shared memory as compiled). More programs as well: 64 per 64 rows at
#     N = 4,096. int4 halves int8's bytes, so its calls stay memory bound to about twice the rows.
#   split 1: no split-K. Its float32 partials (split, M, N) would be 235 MB a slice at 2,048 rows of
#     the fused 28,672 outputs, and split may depend on N and K only (batch invariance), not on M.
#   float32 x: its IEEE products run on CUDA cores and the 128 x 128 tile spills ~41 KB; the policy
#     sends float32 calls past MAX_ROWS to the dequantized matmul (policy.triton_takes).
#   Before Hopper (no wgmma: tl.dot is mma.sync, whose B operand lies in registers) the int4 tile of
#     64 rows used 251-255 registers on sm_80 / sm_89 and spilled 16-144 B under some block sizes, so
#     there int4 takes 32 rows x 64 outputs at 4 warps (133-166 registers, 0 B in bfloat16; 12 B in
#     float16 on sm_89): MANY_ROWS_BEFORE_HOPPER. The int8 / e4m3 plan compiles there unchanged
#     (150-156 registers in bfloat16, 0 B).
MANY_ROWS = {"int8": Tiles(rows=128, block_n=128, int8_block_k=64, num_warps=8, split=1, num_stages=3,
                           convert="bits"),
             "e4m3": Tiles(rows=128, block_n=128, int8_block_k=64, num_warps=8, split=1, num_stages=3,
                           convert="bits"),
             "int4": Tiles(rows=64, block_n=64, num_warps=8, split=1, convert="bits")}
MANY_ROWS_BEFORE_HOPPER = {**MANY_ROWS, "int4": Tiles(rows=32, block_n=64, num_warps=4, split=1, convert="bits")}


def plan_for(weight: str, rows: int, capability: tuple[int, int] = HOPPER) -> Tiles:
    """The launch plan of a call of `rows` rows on a weight of kind "int8", "e4m3" or "int4" on a GPU of
    `capability`: ONE_ROW's for 1 row, FEW_ROWS' for 2 to MAX_ROWS, MANY_ROWS' (the GEMM plans) for more
    (MANY_ROWS_BEFORE_HOPPER's below compute capability 9.0)."""
    if rows > MAX_ROWS:
        return (MANY_ROWS if capability >= HOPPER else MANY_ROWS_BEFORE_HOPPER)[weight]
    return (ONE_ROW if rows == 1 else FEW_ROWS)[weight]

_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT8_WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)  # both exact in every x dtype
_GROUP_SIZES = (32, 64, 128, 256)


def available() -> bool:
    """Triton is importable (whether the device suits is the caller's to decide)."""
    return triton is not None


if triton is not None:
    # the "bits" recipes' constants as the kernels read them (globals must be constexpr in Triton)
    _INT8_MAGIC = tl.constexpr(INT8_MAGIC)
    _INT8_MAGIC_VALUE = tl.constexpr(INT8_MAGIC_VALUE)
    _E4M3_SHIFT = tl.constexpr(E4M3_SHIFT)
    _E4M3_MASK = tl.constexpr(E4M3_MASK)
    _X_PRESCALE = tl.constexpr(X_PRESCALE)
    _INT4_MAGIC = tl.constexpr(INT4_MAGIC)
    _INT4_MAGIC_VALUE = tl.constexpr(INT4_MAGIC_VALUE)

    @triton.jit
    def _int8_bf16(w):
        """int8 -> bfloat16 exactly by integer operations and one float32 subtraction (the recipe
        above INT8_MAGIC): float32(2^23 + 128 + q) from its bits, less 2^23 + 128, its high half."""
        f = (w.to(tl.int32) + _INT8_MAGIC).to(tl.float32, bitcast=True) - _INT8_MAGIC_VALUE
        return (f.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _e4m3_bf16(w):
        """e4m3 -> bfloat16 e4m3 * 2^-120 by a shift and a mask (the recipe above INT8_MAGIC): any
        byte gives a finite value (NaN bytes too), so masked loads need no zeroing."""
        v = w.to(tl.int8, bitcast=True).to(tl.int32)  # sign-extended: bit 7 is copied to bit 15
        return ((v << _E4M3_SHIFT) & _E4M3_MASK).to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _int4_bf16(n):
        """A nibble n (0..15, any integer dtype) -> bfloat16 n - 8 exactly: the bfloat16 128 + n from
        its bits, less 136 in bfloat16 (the recipe above INT8_MAGIC)."""
        b = (n.to(tl.int32) | _INT4_MAGIC).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return b - tl.full(b.shape, _INT4_MAGIC_VALUE, tl.bfloat16)  # bfloat16 both: no float32

    @triton.jit
    def _store_tile(acc, rows, cols, M, N, scale_ptr, bias_ptr, out_ptr,
                    SPLIT: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                    UNSCALE: tl.constexpr):
        """A (BLOCK_M, BLOCK_N) float32 tile of sums: with SPLIT > 1 the raw partial sum of this
        program's K slice (into partials (SPLIT, M, N)); else * UNSCALE (a power of two: 1, or the
        e4m3 "bits" sums' 2^56, exact) * scale[n] + bias[n], in x's dtype."""
        nmask = cols < N
        mask = (rows < M)[:, None] & nmask[None, :]
        at = rows.to(tl.int64)[:, None] * N + cols[None, :]
        if SPLIT > 1:
            tl.store(out_ptr + tl.program_id(2).to(tl.int64) * M * N + at, acc, mask=mask)
        else:
            if UNSCALE != 1.0:
                acc = acc * UNSCALE
            if HAS_SCALE:
                acc = acc * tl.load(scale_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
            if HAS_BIAS:
                acc = acc + tl.load(bias_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["M"])
    def _int8_kernel(x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, k_slice,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                     BITS: tl.constexpr, INT8: tl.constexpr, UNSCALE: tl.constexpr):
        """Program (n block, row tile, K slice): sum over its K slice of x[m, k] * q[n, k]. BITS
        (bfloat16 x): the weight converted by _int8_bf16 / _e4m3_bf16 (e4m3: x * 2^64 first, the
        sums 2^-56 times "cast"'s, UNSCALE 2^56 back in the epilogue)."""
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < M
        kk = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        q_rows = q_ptr + cols.to(tl.int64)[:, None] * K
        k_start = tl.program_id(2) * k_slice
        k_end = tl.minimum(k_start + k_slice, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            kmask = (k + kk) < K
            x = tl.load(x_rows + (k + kk)[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            # no `other` (e4m3 has no integer zero to cast); masked inputs zeroed after the cast:
            # x is 0 there too, but an unloaded e4m3 byte could be NaN
            w = tl.load(q_rows + (k + kk)[None, :], mask=(cols < N)[:, None] & kmask[None, :])
            if BITS:  # any byte a finite bfloat16: masked inputs need no zeroing (x is 0 there)
                if INT8:
                    w = tl.trans(_int8_bf16(w))
                else:
                    x = x * tl.full(x.shape, _X_PRESCALE, tl.bfloat16)  # exact for |x| < 2^64
                    w = tl.trans(_e4m3_bf16(w))
            else:
                w = w.to(x.dtype)  # exact: int8 and e4m3 values are values of every x dtype
                w = tl.trans(tl.where(kmask[None, :], w, tl.zeros_like(w)))  # (BLOCK_K, BLOCK_N)
            if IEEE:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        _store_tile(acc, rows, cols, M, N, scale_ptr, bias_ptr, out_ptr, SPLIT, True, HAS_BIAS, UNSCALE)

    @triton.jit(do_not_specialize=["M"])
    def _int4_kernel(x_ptr, p_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, groups,
                     g_slice, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                     SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BITS: tl.constexpr):
        """Program (n block, row tile, slice of groups): per group g of its slice,
        scale[n, g] * sum_k (q[n, k] - 8) * x[m, k] + zero[n, g] * sum_k x[m, k]. BITS (bfloat16 x):
        q - 8 by _int4_bf16."""
        HALF: tl.constexpr = GROUP // 2
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < M
        nmask = cols < N
        j = tl.arange(0, HALF)
        x_even = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + 2 * j[None, :]  # a group's inputs 2j
        p_rows = p_ptr + cols.to(tl.int64)[:, None] * (K // 2) + j[None, :]
        sz_rows = cols.to(tl.int64) * groups  # scale, zero (N, groups)
        g_start = tl.program_id(2) * g_slice
        g_end = tl.minimum(g_start + g_slice, groups)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for g in range(g_start, g_end):
            xe = tl.load(x_even + g * GROUP, mask=rmask[:, None], other=0.0)  # (BLOCK_M, HALF)
            xo = tl.load(x_even + g * GROUP + 1, mask=rmask[:, None], other=0.0)
            p = tl.load(p_rows + g * HALF, mask=nmask[:, None], other=0)  # (BLOCK_N, HALF) uint8
            if BITS:
                hi = tl.trans(_int4_bf16(p >> 4))
                lo = tl.trans(_int4_bf16(p & 15))
            else:
                hi = tl.trans(((p >> 4).to(tl.int8) - 8).to(xe.dtype))  # q[n, 2j] - 8, exact in x's dtype
                lo = tl.trans(((p & 15).to(tl.int8) - 8).to(xe.dtype))  # q[n, 2j + 1] - 8
            if IEEE:
                qx = tl.dot(xo, lo, tl.dot(xe, hi, input_precision="ieee"), input_precision="ieee")
            else:
                qx = tl.dot(xo, lo, tl.dot(xe, hi))
            sx = tl.sum(xe.to(tl.float32), axis=1) + tl.sum(xo.to(tl.float32), axis=1)  # (BLOCK_M,)
            s = tl.load(scale_ptr + sz_rows + g, mask=nmask, other=0.0).to(tl.float32)
            z = tl.load(zero_ptr + sz_rows + g, mask=nmask, other=0.0).to(tl.float32)
            acc += qx * s[None, :] + sx[:, None] * z[None, :]
        _store_tile(acc, rows, cols, M, N, scale_ptr, bias_ptr, out_ptr, SPLIT, False, HAS_BIAS, 1.0)

    # --- the kinds "swapped" and "fma" (Tiles.kind): grid (row tile, n block, K slice) ----------

    @triton.jit(do_not_specialize=["M"])
    def _int8_swapped_kernel(x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, k_slice,
                             ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                             BITS: tl.constexpr, INT8: tl.constexpr, UNSCALE: tl.constexpr):
        """The weight as tl.dot's A operand, (BLOCK_N, BLOCK_K) as it lies in memory, x^T (BLOCK_K,
        ROWS) as B: out^T tiles (BLOCK_N, ROWS), stored transposed. Sums (and BITS) as _int8_kernel's."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < M
        nmask = cols < N
        kk = tl.arange(0, BLOCK_K)
        x_cols = x_ptr + rows.to(tl.int64)[None, :] * stride_xm  # x^T: row m of x is column m
        q_rows = q_ptr + cols.to(tl.int64)[:, None] * K
        k_start = tl.program_id(2) * k_slice
        k_end = tl.minimum(k_start + k_slice, K)
        acc = tl.zeros((BLOCK_N, ROWS), tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            kmask = (k + kk) < K
            xt = tl.load(x_cols + (k + kk)[:, None], mask=kmask[:, None] & rmask[None, :], other=0.0)
            w = tl.load(q_rows + (k + kk)[None, :], mask=nmask[:, None] & kmask[None, :])
            if BITS:  # as _int8_kernel's
                if INT8:
                    w = _int8_bf16(w)
                else:
                    xt = xt * tl.full(xt.shape, _X_PRESCALE, tl.bfloat16)
                    w = _e4m3_bf16(w)
            else:
                w = w.to(xt.dtype)  # exact; masked inputs zeroed after the cast (e4m3: see _int8_kernel)
                w = tl.where(kmask[None, :], w, tl.zeros_like(w))
            if IEEE:
                acc = tl.dot(w, xt, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, xt, acc)
        _store_tile(tl.trans(acc), rows, cols, M, N, scale_ptr, bias_ptr, out_ptr, SPLIT, True, HAS_BIAS, UNSCALE)

    @triton.jit(do_not_specialize=["M"])
    def _int4_swapped_kernel(x_ptr, p_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, groups,
                             g_slice, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                             STEP: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                             IEEE: tl.constexpr, BITS: tl.constexpr):
        """_int4_kernel's sums (and BITS) with the weight as tl.dot's A operand (no transpose of it),
        STEP groups a loop step (unrolled: their loads issued together), out^T tiles (BLOCK_N, ROWS)."""
        HALF: tl.constexpr = GROUP // 2
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < M
        nmask = cols < N
        j = tl.arange(0, HALF)
        x_even = x_ptr + rows.to(tl.int64)[None, :] * stride_xm + 2 * j[:, None]  # (HALF, ROWS): x^T's
        p_rows = p_ptr + cols.to(tl.int64)[:, None] * (K // 2) + j[None, :]
        sz_rows = cols.to(tl.int64) * groups
        g_start = tl.program_id(2) * g_slice
        g_end = tl.minimum(g_start + g_slice, groups)
        acc = tl.zeros((BLOCK_N, ROWS), tl.float32)
        for g0 in range(g_start, g_end, STEP):
            for i in tl.static_range(STEP):
                g = g0 + i
                # a group past the slice (its last step's): x 0, the slice's last group's weight (any
                # finite one: valid addresses), so it adds 0
                gw = tl.minimum(g, g_end - 1)
                xmask = rmask[None, :] & ((g * HALF + j) < g_end * HALF)[:, None]
                xe = tl.load(x_even + g * GROUP, mask=xmask, other=0.0)
                xo = tl.load(x_even + g * GROUP + 1, mask=xmask, other=0.0)
                p = tl.load(p_rows + gw * HALF, mask=nmask[:, None], other=0)  # (BLOCK_N, HALF)
                if BITS:
                    hi = _int4_bf16(p >> 4)
                    lo = _int4_bf16(p & 15)
                else:
                    hi = ((p >> 4).to(tl.int8) - 8).to(xe.dtype)
                    lo = ((p & 15).to(tl.int8) - 8).to(xe.dtype)
                if IEEE:
                    qx = tl.dot(lo, xo, tl.dot(hi, xe, input_precision="ieee"), input_precision="ieee")
                else:
                    qx = tl.dot(lo, xo, tl.dot(hi, xe))
                sx = tl.sum(xe.to(tl.float32), axis=0) + tl.sum(xo.to(tl.float32), axis=0)  # (ROWS,)
                s = tl.load(scale_ptr + sz_rows + gw, mask=nmask, other=0.0).to(tl.float32)
                z = tl.load(zero_ptr + sz_rows + gw, mask=nmask, other=0.0).to(tl.float32)
                acc += qx * s[:, None] + sx[None, :] * z[:, None]
        _store_tile(tl.trans(acc), rows, cols, M, N, scale_ptr, bias_ptr, out_ptr, SPLIT, False, HAS_BIAS, 1.0)

    @triton.jit(do_not_specialize=["M"])
    def _int8_fma_kernel(x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, k_slice,
                         ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, INT8: tl.constexpr, STAGES: tl.constexpr):
        """No tensor cores, for ROWS = 1, 2 or 4 rows a program: per row r a (BLOCK_N, BLOCK_K) float32
        accumulator, acc_r[n, j] += float32(q[n, k + j]) * float32(x[m_r, k + j]) over the K slice in
        steps of BLOCK_K (each product exact for float16 / bfloat16 x), then one sum over j per n
        (tl.sum's fixed tree) after the loop. Every tensor is 2-D in the weight tile's layout (one
        accumulator per row, not a 3-D one: with that, Triton moved each weight tile through shared
        memory to another layout). A row past M reads row M - 1 (valid addresses, no row masks) and
        stores nothing. The helpers are written out in the loop: Triton's interpreter spends
        milliseconds a call of a jit function."""
        m0 = tl.program_id(0) * ROWS
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols < N
        kk = tl.arange(0, BLOCK_K)
        q_rows = q_ptr + cols.to(tl.int64)[:, None] * K
        x0 = x_ptr + tl.minimum(m0, M - 1).to(tl.int64) * stride_xm + kk
        x1 = x_ptr + tl.minimum(m0 + 1, M - 1).to(tl.int64) * stride_xm + kk
        x2 = x_ptr + tl.minimum(m0 + 2, M - 1).to(tl.int64) * stride_xm + kk
        x3 = x_ptr + tl.minimum(m0 + 3, M - 1).to(tl.int64) * stride_xm + kk
        k_start = tl.program_id(2) * k_slice
        k_end = tl.minimum(k_start + k_slice, K)
        acc0 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        acc1 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        acc3 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for k in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):  # loads pipelined (no tl.dot here)
            kmask = (k + kk) < K
            w = tl.load(q_rows + (k + kk)[None, :], mask=nmask[:, None] & kmask[None, :])
            if INT8:
                # int8 -> float32 exactly without a conversion instruction (a quarter of the FMA rate
                # on recent GPUs): the byte's bits, sign flipped (q + 128 in 0..255), as the low bits
                # of 2^23's float32, less 2^23 + 128. Any byte is a finite value: a masked input's
                # product is x's 0 times it, 0.
                u = w.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x80
                w = (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
            else:  # e4m3: an unloaded byte could be NaN, zeroed after the cast
                w = w.to(tl.float32)
                w = tl.where(kmask[None, :], w, tl.zeros_like(w))
            acc0 += w * tl.load(x0 + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
            if ROWS > 1:
                acc1 += w * tl.load(x1 + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
            if ROWS > 2:
                acc2 += w * tl.load(x2 + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
                acc3 += w * tl.load(x3 + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
        tile = _row_tile(tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), tl.sum(acc2, axis=1), tl.sum(acc3, axis=1),
                         ROWS, BLOCK_N)
        _store_tile(tile, m0 + tl.arange(0, ROWS), cols, M, N, scale_ptr, bias_ptr, out_ptr, SPLIT, True, HAS_BIAS, 1.0)

    @triton.jit
    def _row_tile(s0, s1, s2, s3, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        """(ROWS, BLOCK_N) from the rows' (BLOCK_N,) sums s0, s1, ... (the first ROWS of them)."""
        if ROWS == 1:
            tile = s0[None, :]
        elif ROWS == 2:
            tile = tl.trans(tl.join(s0, s1))
        else:  # t[n, i, j] = (s0, s2)[i] if j == 0 else (s1, s3)[i]: row 2 i + j
            tile = tl.trans(tl.reshape(tl.join(tl.join(s0, s2), tl.join(s1, s3)), (BLOCK_N, 4)))
        return tile

    @triton.jit(do_not_specialize=["M"])
    def _int4_fma_kernel(x_ptr, p_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, groups,
                         g_slice, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                         STEP: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, STAGES: tl.constexpr):
        """No tensor cores, ROWS = 1, 2 or 4: each weight dequantized in float32, w = (q - 8) * scale +
        zero (one rounding: (q - 8) * scale is exact), then per row a (BLOCK_N, GROUP / 2) float32
        accumulator += w * x as _int8_fma_kernel's, the even inputs (a group's inputs loaded whole,
        split in pairs) against the high nibbles, the odd against the low; STEP groups a loop step
        (unrolled: their loads issued together)."""
        HALF: tl.constexpr = GROUP // 2
        m0 = tl.program_id(0) * ROWS
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols < N
        j = tl.arange(0, HALF)
        kk = tl.arange(0, GROUP)
        p_rows = p_ptr + cols.to(tl.int64)[:, None] * (K // 2) + j[None, :]
        sz_rows = cols.to(tl.int64) * groups
        x0 = x_ptr + tl.minimum(m0, M - 1).to(tl.int64) * stride_xm + kk
        x1 = x_ptr + tl.minimum(m0 + 1, M - 1).to(tl.int64) * stride_xm + kk
        x2 = x_ptr + tl.minimum(m0 + 2, M - 1).to(tl.int64) * stride_xm + kk
        x3 = x_ptr + tl.minimum(m0 + 3, M - 1).to(tl.int64) * stride_xm + kk
        g_start = tl.program_id(2) * g_slice
        g_end = tl.minimum(g_start + g_slice, groups)
        acc0 = tl.zeros((BLOCK_N, HALF), tl.float32)
        acc1 = tl.zeros((BLOCK_N, HALF), tl.float32)
        acc2 = tl.zeros((BLOCK_N, HALF), tl.float32)
        acc3 = tl.zeros((BLOCK_N, HALF), tl.float32)
        for g0 in tl.range(g_start, g_end, STEP, num_stages=STAGES):  # loads pipelined
            for i in tl.static_range(STEP):
                g = g0 + i
                # a group past the slice (its last step's): x 0, the slice's last group's weight (any
                # finite one, at valid addresses), so it adds 0
                gw = tl.minimum(g, g_end - 1)
                xmask = (g * GROUP + kk) < g_end * GROUP
                p = tl.load(p_rows + gw * HALF, mask=nmask[:, None], other=0)  # (BLOCK_N, HALF)
                s = tl.load(scale_ptr + sz_rows + gw, mask=nmask, other=0.0).to(tl.float32)[:, None]
                z = tl.load(zero_ptr + sz_rows + gw, mask=nmask, other=0.0).to(tl.float32)[:, None]
                # q - 8 in float32 as _int8_fma_kernel converts a byte: q as the low bits of 2^23's float32
                w_hi = (((p >> 4).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * s + z
                w_lo = (((p & 15).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * s + z
                xe, xo = tl.split(tl.reshape(tl.load(x0 + g * GROUP, mask=xmask, other=0.0).to(tl.float32), (HALF, 2)))
                acc0 += w_hi * xe[None, :]
                acc0 += w_lo * xo[None, :]
                if ROWS > 1:
                    xe, xo = tl.split(tl.reshape(tl.load(x1 + g * GROUP, mask=xmask, other=0.0).to(tl.float32),
                                                 (HALF, 2)))
                    acc1 += w_hi * xe[None, :]
                    acc1 += w_lo * xo[None, :]
                if ROWS > 2:
                    xe, xo = tl.split(tl.reshape(tl.load(x2 + g * GROUP, mask=xmask, other=0.0).to(tl.float32),
                                                 (HALF, 2)))
                    acc2 += w_hi * xe[None, :]
                    acc2 += w_lo * xo[None, :]
                    xe, xo = tl.split(tl.reshape(tl.load(x3 + g * GROUP, mask=xmask, other=0.0).to(tl.float32),
                                                 (HALF, 2)))
                    acc3 += w_hi * xe[None, :]
                    acc3 += w_lo * xo[None, :]
        tile = _row_tile(tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), tl.sum(acc2, axis=1), tl.sum(acc3, axis=1),
                         ROWS, BLOCK_N)
        _store_tile(tile, m0 + tl.arange(0, ROWS), cols, M, N, scale_ptr, bias_ptr, out_ptr, SPLIT, False, HAS_BIAS,
                    1.0)

    @triton.jit(do_not_specialize=["M"])
    def _finish_kernel(part_ptr, scale_ptr, bias_ptr, out_ptr, M, N,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                       HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, UNSCALE: tl.constexpr):
        """Split-K's second pass: the SPLIT partial sums added in order 0, 1, ..., then * UNSCALE, scale, bias."""
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        at = rows.to(tl.int64)[:, None] * N + cols[None, :]
        acc = tl.load(part_ptr + at, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(part_ptr + s * M * N + at, mask=mask, other=0.0)
        _store_tile(acc, rows, cols, M, N, scale_ptr, bias_ptr, out_ptr, 1, HAS_SCALE, HAS_BIAS, UNSCALE)


# --- the calls -----------------------------------------------------------------------------------


def int8_linear(x2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                *, split_k: int | None = None, tiles: Tiles | None = None) -> torch.Tensor:
    """(x2 @ q.T) * scale + bias -> (M, N) in x2's dtype, float32 sums; see the module's docstring.

    split_k: the number of K slices (None: tiles.split, else the plan's, from N, K and the device);
    tiles: the launch plan (None: plan_for's for the weight and M; others for tests and tuning)."""
    _need_triton()
    M, K = _check_x(x2)
    if q.dtype not in _INT8_WEIGHT_DTYPES or q.dim() != 2 or q.shape[1] != K or not q.is_contiguous():
        raise ValueError(f"int8_linear: the weight must be a contiguous int8 or e4m3 (N, {K}), "
                         f"got {q.dtype} {tuple(q.shape)}")
    N = q.shape[0]
    _check_param(scale, "scale", (N,))
    _check_bias(bias, N)
    _check_devices(x2, q, scale, bias)
    tiles = tiles or plan_for("int8" if q.dtype == torch.int8 else "e4m3", M, _capability(x2.device))
    bn, bk, rows = tiles.block_n, tiles.int8_block_k, tiles.rows
    k_blocks = triton.cdiv(K, bk)
    split, per_slice = _plan(N, k_blocks, x2.device, tiles.split if split_k is None else split_k, bn)
    out, dest = _outputs(x2, N, split)
    args = (x2, q, scale, scale if bias is None else bias, dest, M, N, K, x2.stride(0), per_slice * bk)
    sizes = dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, HAS_BIAS=bias is not None, num_warps=tiles.num_warps,
                 num_stages=tiles.num_stages or _stages(bn * bk * q.element_size() + rows * bk * x2.element_size()))
    bits = _bits(tiles, x2)
    int8 = q.dtype == torch.int8
    unscale = E4M3_UNSCALE if bits and not int8 else 1.0  # the e4m3 "bits" sums are 2^-56 times the others'
    if tiles.kind == "mma":
        _int8_kernel[(triton.cdiv(N, bn), triton.cdiv(M, rows), split)](
            *args, BLOCK_M=rows, IEEE=x2.dtype == torch.float32, BITS=bits, INT8=int8, UNSCALE=unscale, **sizes)
    elif tiles.kind == "swapped":
        _int8_swapped_kernel[(triton.cdiv(M, rows), triton.cdiv(N, bn), split)](
            *args, ROWS=rows, IEEE=x2.dtype == torch.float32, BITS=bits, INT8=int8, UNSCALE=unscale, **sizes)
    else:
        _int8_fma_kernel[(triton.cdiv(M, rows), triton.cdiv(N, bn), split)](
            *args, ROWS=rows, INT8=int8, STAGES=sizes["num_stages"], **sizes)
    return _finish(dest, out, scale, bias, has_scale=True, tiles=tiles, unscale=unscale)


def int4_linear(x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None, *, split_k: int | None = None,
                tiles: Tiles | None = None) -> torch.Tensor:
    """x2 @ w.T + bias with w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g] from the portable
    packed layout -> (M, N) in x2's dtype, float32 sums; see the module's docstring.

    split_k: the number of K slices, in whole K steps (None: tiles.split, else the plan's); tiles:
    the launch plan (None: plan_for's; a K step: one group for the kind "mma", int8_block_k //
    group_size groups, at least one, for the others)."""
    _need_triton()
    M, K = _check_x(x2)
    if isinstance(group_size, bool) or group_size not in _GROUP_SIZES:
        raise ValueError(f"int4_linear: group size {group_size!r} is not one of {_GROUP_SIZES}")
    if K % group_size:
        raise ValueError(f"int4_linear: group size {group_size} does not divide the {K} inputs")
    if (packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] * 2 != K
            or not packed.is_contiguous()):
        raise ValueError(f"int4_linear: the packed weight must be a contiguous uint8 (N, {K // 2}), "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    N, groups = packed.shape[0], K // group_size
    _check_param(scale, "scale", (N, groups))
    _check_param(zero, "zero", (N, groups))
    _check_bias(bias, N)
    _check_devices(x2, packed, scale, zero, bias)
    tiles = tiles or plan_for("int4", M, _capability(x2.device))
    bn, rows = tiles.block_n, tiles.rows
    step = 1 if tiles.kind == "mma" else max(1, tiles.int8_block_k // group_size)  # groups a loop step
    split, per_slice = _plan(N, triton.cdiv(groups, step), x2.device, tiles.split if split_k is None else split_k, bn)
    out, dest = _outputs(x2, N, split)
    args = (x2, packed, scale, zero, scale if bias is None else bias, dest, M, N, K, x2.stride(0), groups,
            per_slice * step)
    sizes = dict(BLOCK_N=bn, GROUP=group_size, SPLIT=split, HAS_BIAS=bias is not None, num_warps=tiles.num_warps,
                 num_stages=tiles.num_stages or _stages(step * (bn * group_size // 2 + rows * group_size
                                                                * x2.element_size())))
    if tiles.kind == "mma":
        _int4_kernel[(triton.cdiv(N, bn), triton.cdiv(M, rows), split)](
            *args, BLOCK_M=rows, IEEE=x2.dtype == torch.float32, BITS=_bits(tiles, x2), **sizes)
    elif tiles.kind == "swapped":
        _int4_swapped_kernel[(triton.cdiv(M, rows), triton.cdiv(N, bn), split)](
            *args, ROWS=rows, STEP=step, IEEE=x2.dtype == torch.float32, BITS=_bits(tiles, x2), **sizes)
    else:
        _int4_fma_kernel[(triton.cdiv(M, rows), triton.cdiv(N, bn), split)](
            *args, ROWS=rows, STEP=step, STAGES=sizes["num_stages"], **sizes)
    return _finish(dest, out, scale, bias, has_scale=False, tiles=tiles)


# --- per-row quantization of activations (fp8's and w8a8's larger calls) -------------------------

ROW_KINDS = {"int8": (1, torch.int8), "e4m3": (2, torch.float8_e4m3fn)}  # the kernels' QUANT code, q's dtype
ROW_BLOCK = 1024  # a row's values a loop step

if triton is not None:
    @triton.jit
    def round_e4m3(y):
        """float32 y within +-448 rounded to the nearest e4m3 value, ties to even, as a float32 (whose
        cast to e4m3 is then exact, whichever way a conversion rounds): the addition of 1.5 x 2^23 ulps
        rounds y to whole ulps of its e4m3 binade (2^-9 below 2^-6: the subnormals')."""
        exponent = tl.maximum((tl.abs(y).to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
        ulp = ((exponent - 3) << 23).to(tl.float32, bitcast=True)
        big = ulp * 12582912.0
        r = (y + big) - big
        return tl.where(r == 0.0, y * 0.0, r)  # a negative value rounded to zero keeps its sign, as a cast does

    @triton.jit
    def quantize_values(xf, scale, QUANT: tl.constexpr):
        """float32 values xf over their scale (IEEE division), within +-qmax, rounded to nearest: QUANT 1
        an int8 value (ties to even), 2 an e4m3 one; as float32, their cast to the type exact.
        gptj.quant.ops' quantize_rows_int8 / quantize_rows_fp8 (and the KV store's) values, bit for bit."""
        qmax = 127.0 if QUANT == 1 else 448.0
        y = tl.math.div_rn(xf, tl.zeros_like(xf) + scale)
        y = tl.minimum(tl.maximum(y, -qmax), qmax)
        if QUANT == 1:
            y = (y + 12582912.0) - 12582912.0  # 1.5 x 2^23: float32 addition rounds to an integer, ties to even
        else:
            y = round_e4m3(y)
        return y

    @triton.jit
    def row_scale(amax, QUANT: tl.constexpr):
        """max |x| of a row or head -> its scale: amax / qmax (IEEE division), at least 2^-120."""
        qmax = 127.0 if QUANT == 1 else 448.0
        return tl.maximum(tl.math.div_rn(amax, qmax), 2.0**-120)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, mul_ptr, q_ptr, s_ptr, K, stride_x, BLOCK: tl.constexpr, QUANT: tl.constexpr,
                              MUL: tl.constexpr):
        """Program m: row m of x (times mul, per column, if MUL) -> its scale and quantized values:
        one pass for max |x|, one to quantize (the row is read twice, from L2 the second time)."""
        m = tl.program_id(0).to(tl.int64)
        row = x_ptr + m * stride_x
        amax = tl.zeros((BLOCK,), tl.float32)
        for k in range(0, K, BLOCK):
            i = k + tl.arange(0, BLOCK)
            xf = tl.load(row + i, mask=i < K, other=0.0).to(tl.float32)
            if MUL:
                xf = xf * tl.load(mul_ptr + i, mask=i < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(xf))
        scale = row_scale(tl.max(amax, axis=0), QUANT)
        for k in range(0, K, BLOCK):
            i = k + tl.arange(0, BLOCK)
            xf = tl.load(row + i, mask=i < K, other=0.0).to(tl.float32)
            if MUL:
                xf = xf * tl.load(mul_ptr + i, mask=i < K, other=0.0)
            tl.store(q_ptr + m * K + i, quantize_values(xf, scale, QUANT).to(q_ptr.dtype.element_ty), mask=i < K)
        tl.store(s_ptr + m, scale)


def quantize_rows(x2: torch.Tensor, kind: str, mul: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gptj.quant.ops.quantize_rows_int8 (kind "int8") or quantize_rows_fp8 ("e4m3") of x2.float() * mul
    (mul float32 (K,), per column, or None), bit for bit, in one kernel launch where torch's forms
    take some eight (their cost at MLPerf's shape: docs/PERFORMANCE.md#gpu) -> (q (M, K), scale float32
    (M, 1))."""
    _need_triton()
    M, K = _check_x(x2)
    code, dtype = ROW_KINDS[kind]
    if mul is not None and (mul.dtype != torch.float32 or mul.shape != (K,) or not mul.is_contiguous()):
        raise ValueError(f"quantize_rows: mul must be a contiguous float32 ({K},), got {mul.dtype} {tuple(mul.shape)}")
    q = torch.empty((M, K), dtype=dtype, device=x2.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x2.device)
    _quantize_rows_kernel[(M,)](x2, x2 if mul is None else mul, q, scale, K, x2.stride(0),
                                BLOCK=min(ROW_BLOCK, triton.next_power_of_2(K)), QUANT=code, MUL=mul is not None)
    return q, scale


# --- helpers -------------------------------------------------------------------------------------


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return HOPPER
    return torch.cuda.get_device_capability(device)


def _plan(n: int, k_blocks: int, device: torch.device, split_k: int | None,
          block_n: int = TILES.block_n) -> tuple[int, int]:
    """(slices of K, K blocks per slice): the fewest slices (a power of two, at most MAX_SPLIT) that
    give PROGRAMS_PER_SM programs per SM from N alone (never from M: batch invariance), each slice
    at least one block; or split_k's. The slices are whole blocks, so none is empty."""
    if split_k is None:
        want = PROGRAMS_PER_SM * _sm_count(device)
        split = 1
        while split < MAX_SPLIT and triton.cdiv(n, block_n) * split < want:
            split *= 2
    elif isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"split_k must be a positive int, got {split_k!r}")
    else:
        split = split_k
    per_slice = triton.cdiv(k_blocks, min(split, k_blocks))
    return triton.cdiv(k_blocks, per_slice), per_slice


def _stages(step_bytes: int) -> int:
    """Pipeline stages for a K step's tiles of `step_bytes` (weight and x): 2 to MAX_STAGES, in STAGE_BYTES."""
    return max(2, min(MAX_STAGES, STAGE_BYTES // step_bytes))


def _outputs(x2: torch.Tensor, n: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the output, where the main kernel writes: the output, or float32 partials (split, M, N))."""
    out = torch.empty((x2.shape[0], n), dtype=x2.dtype, device=x2.device)
    if split == 1:
        return out, out
    return out, torch.empty((split, x2.shape[0], n), dtype=torch.float32, device=x2.device)


def _finish(dest: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
            has_scale: bool, tiles: Tiles = TILES, unscale: float = 1.0) -> torch.Tensor:
    if dest is out:
        return out
    split, M, N = dest.shape
    _finish_kernel[(triton.cdiv(N, tiles.block_n), triton.cdiv(M, BLOCK_M))](
        dest, scale, scale if bias is None else bias, out, M, N, BLOCK_M=BLOCK_M, BLOCK_N=tiles.block_n,
        SPLIT=split, HAS_SCALE=has_scale, HAS_BIAS=bias is not None, UNSCALE=unscale, num_warps=tiles.num_warps)
    return out


def _bits(tiles: Tiles, x2: torch.Tensor) -> bool:
    """Whether the kernel converts the weight by bits (Tiles.convert): "bits" plans with bfloat16 x;
    float16 / float32 x keep "cast" (the recipes make bfloat16)."""
    return tiles.convert == "bits" and x2.dtype == torch.bfloat16


def _need_triton() -> None:
    if triton is None:
        raise RuntimeError("gptj.quant.cuda's kernels need Triton (pip install triton)")


def _check_x(x2: torch.Tensor) -> tuple[int, int]:
    if x2.dtype not in _X_DTYPES or x2.dim() != 2 or x2.shape[0] < 1 or x2.shape[1] < 1 or x2.stride(1) != 1:
        raise ValueError(f"the input must be (M >= 1, K >= 1) float32, float16 or bfloat16 with contiguous rows, "
                         f"got {x2.dtype} {tuple(x2.shape)} strides {x2.stride()}")
    return x2.shape[0], x2.shape[1]


def _check_param(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    if t.dtype != torch.bfloat16 or tuple(t.shape) != shape or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous bfloat16 {shape}, got {t.dtype} {tuple(t.shape)}")


def _check_bias(bias: torch.Tensor | None, n: int) -> None:
    if bias is not None and (not bias.is_floating_point() or tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        raise ValueError(f"the bias must be a contiguous float ({n},), got {bias.dtype} {tuple(bias.shape)}")


def _check_devices(*tensors: torch.Tensor | None) -> None:
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"the tensors are on different devices: {sorted(map(str, devices))}")
