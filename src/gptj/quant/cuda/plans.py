"""The launch plans of gptj.quant.cuda's weight-only GEMVs and GEMMs: Tiles (a kernel design and its
block sizes), the defaults and the tables the calls choose from by rows (plan_for).

A plan depends on the weight's kind, the call's row class and the GPU's compute capability, never on
the other rows of a call: within a class, a row's result is the same bit for bit in a call of any
number of rows (the package's docstring: batch invariance).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class Tiles:
    """A launch plan (TILES: the defaults above; benchmarks/gemv_sweep.py times others).

    kind: the kernel design (gptj.quant.cuda's docstring): "mma" (x as tl.dot's A operand, the weight
      transposed as its B), "swapped" (the weight as A in its own K-contiguous layout, x transposed
      as B) or "fma" (no tl.dot: float32 multiply-adds, the K reduction once after the loop).
    rows: rows of x per program (a power of two: the kind mma 1 to MMA_MAX_ROWS, swapped 1 to
      MAX_ROWS, fma 1, 2 or 4); a call of M rows runs cdiv(M, rows) programs per block of outputs,
      each reading its weight tile (so M > rows reads the weight again, from L2 where the programs
      run together: the kinds swapped and fma put the row tiles on the grid's fastest axis).
    block_n: output channels per program. int8_block_k: the int8 / e4m3 K step; the int4 K step of
      the kinds "swapped" and "fma" is int8_block_k // group_size groups (at least one), of "mma" one
      group. num_warps as Triton's. split / num_stages None: from the call (launch's _plan, _stages).
    convert (kinds "mma" and "swapped"; "fma" converts to float32 by bit operations already): how the
      weight becomes x's dtype for tl.dot. "cast" (the default): w.to(x.dtype), conversion
      instructions (int8 -> float32 -> bfloat16: two a weight, which may bound the GEMV). "bits": for
      bfloat16 x, integer operations (the recipes of gptj.quant.cuda.bits: int8 and int4 exact for every
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
