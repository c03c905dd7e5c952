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
  benchmarks/gemv_sweep.py times them all; plan_for's tables (plans) say which the calls run.
  Tiles.convert "bits" (kinds "mma" and "swapped", bfloat16 x only; float16 / float32 x run "cast"):
      the weight made bfloat16 by integer operations instead of w.to(x.dtype): the recipes and their
      ranges in bits (int8, int4 exact for every byte; e4m3 exact for every finite byte,
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

The package, a module a concern:
  plans     Tiles, the default plans and plan_for's tables (ONE_ROW, FEW_ROWS, MANY_ROWS)
  launch    int8_linear, int4_linear: the checks, split-K, the launches
  mma       the kinds "mma" and "swapped" (tl.dot on the tensor cores)
  fma       the kind "fma" (float32 multiply-adds)
  bits      Tiles.convert "bits": the recipes, their constants and jit helpers
  epilogue  a tile's scale and bias, split-K's partial sums and their fixed-order second pass
  rows      quantize_rows (per-row int8 / e4m3 activations) and its jit helpers (the KV store's too)
"""

from gptj.quant.cuda.bits import (
    E4M3_LOG2,
    E4M3_MASK,
    E4M3_SHIFT,
    E4M3_UNSCALE,
    INT4_MAGIC,
    INT4_MAGIC_VALUE,
    INT8_MAGIC,
    INT8_MAGIC_VALUE,
    X_PRESCALE,
)
from gptj.quant.cuda.launch import available, int4_linear, int8_linear
from gptj.quant.cuda.plans import (
    BLOCK_M,
    CONVERTS,
    DEFAULT_SMS,
    FEW_ROWS,
    FMA_MAX_ROWS,
    HOPPER,
    KINDS,
    MANY_ROWS,
    MANY_ROWS_BEFORE_HOPPER,
    MAX_ROWS,
    MAX_SPLIT,
    MAX_STAGES,
    MMA_MAX_ROWS,
    ONE_ROW,
    PROGRAMS_PER_SM,
    STAGE_BYTES,
    TILES,
    Tiles,
    plan_for,
)
from gptj.quant.cuda.rows import ROW_BLOCK, ROW_KINDS, quantize_rows

if available():  # the jit helpers the KV store's kernels call (gptj.engine.attention.cuda)
    from gptj.quant.cuda.rows import quantize_values, round_e4m3, row_scale
