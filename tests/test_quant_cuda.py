"""gptj.quant.cuda's Triton kernels (weight-only int8 / e4m3 and int4 linears for decode's rows)
against float64 arithmetic on the dequantized weight, within a bound derived from the kernels'
float32 arithmetic; a row's result the same bit for bit whatever else is in the call; bad inputs
refused with ValueError.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1), in float32 and float16: the interpreter has no bfloat16 arithmetic (its casts to
bfloat16 truncate, its bfloat16 dot is wrong; triton-lang/triton issues 4972, 11584), so bfloat16
inputs run on a GPU only. The interpreter runs each program in Python: the shapes are small.
"""

from __future__ import annotations

import pytest
import torch

from gptj.quant import cuda
from gptj.quant.cuda import bits, launch
from gptj.quant.ops import (
    dequantize_fp8,
    dequantize_int8,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    quantize_rows_fp8,
    quantize_rows_int8,
    unpack_int4,
)
from test_attention_backends import triton_reason

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


REASON = triton_reason("gptj.quant.cuda's kernels")
pytestmark = [pytest.mark.cuda,  # gpu_check.py's tests step (-m cuda)
              pytest.mark.skipif(REASON is not None, reason=str(REASON))]

X_DTYPES = [torch.float32, torch.float16,
            pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
                DEVICE == "cpu", reason="Triton's interpreter has no bfloat16 arithmetic"))]
EPS32 = 2.0**-23  # float32's machine epsilon: one rounding's relative error at most, to nearest or not
# half an ulp of each output dtype, relative: the one rounding of the float32 sum to y's dtype
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def error_bound(x: torch.Tensor, terms: torch.Tensor, bias: torch.Tensor | None, y_ref: torch.Tensor) -> torch.Tensor:
    """The most |y - y_ref| can be for a kernel's y, elementwise.

    terms (N, K): the size of what each input multiplies as the kernel forms it (int8: |q * scale|;
    int4: |(q - 8) * scale| + |zero|, its two terms taken apart). Each output is made in float32 from
    the products (exact for float16 and bfloat16 x: 11 or 8 bits times 8; rounded once for float32 x)
    by additions in some order (up to K - 1 on any product's path, split-K's included), then the
    scale's product, the zero's term, the bias: at most K + 4 roundings of at most EPS32 each on
    sum_k |x| terms + |bias| (a sum's error bound; EPS32 also covers tensor cores that truncate).
    Then the cast to y's dtype: half an ulp of |y|, UNIT * (|y_ref| + that error)."""
    mags = x.double().abs() @ terms.double().T
    if bias is not None:
        mags = mags + bias.double().abs()
    acc = (x.shape[1] + 4) * EPS32 * mags
    return acc + UNIT[x.dtype] * (y_ref.abs() + acc)


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, terms: torch.Tensor, bias: torch.Tensor | None) -> None:
    """y against x @ w.T + bias in float64, w the exact dequantized weight (N, K) in float64."""
    assert y.dtype == x.dtype and y.shape == (x.shape[0], w.shape[0])
    y_ref = x.double() @ w.T + (0 if bias is None else bias.double())
    err = (y.double() - y_ref).abs()
    bound = error_bound(x, terms, bias, y_ref)
    worst = int((err - bound).argmax())
    assert (err <= bound).all(), f"error {err.flatten()[worst]:.3g} past its bound {bound.flatten()[worst]:.3g}"


def inputs(M: int, N: int, K: int, dtype: torch.dtype, with_bias: bool, seed: int = 0):
    """x (M, K), a float32 weight (N, K) to quantize, and a bias (N,) or None."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(N, K, generator=gen) * 0.1
    w[:, : K // 4] += 0.3  # groups with an offset (an int4 zero far from 0)
    bias = torch.randn(N, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    return x, w.to(DEVICE), bias


def int8_weight(w: torch.Tensor):
    q, scale = quantize_int8(w)
    exact = dequantize_int8(q, scale).double()  # q * scale: 7 bits times 8, exact in float32
    return q, scale, exact


def int4_weight(w: torch.Tensor, group_size: int):
    """(packed, scale, zero, the exact weight (N, K) float64, its terms' sizes)."""
    packed, scale, zero = quantize_int4(w, group_size)
    N, K = w.shape
    q = unpack_int4(packed).double().view(N, K // group_size, group_size) - 8
    s, z = scale.double()[..., None], zero.double()[..., None]
    exact = (q * s + z).view(N, K)
    terms = ((q * s).abs() + z.abs()).view(N, K)
    return packed, scale, zero, exact, terms


def test_module_facts():
    assert cuda.available()
    assert cuda.MAX_ROWS == 16
    assert cuda.TILES.kind == "mma" and cuda.TILES.rows == 16 and cuda.KINDS == ("mma", "swapped", "fma")
    assert cuda.TILES.convert == "cast" and cuda.CONVERTS == ("cast", "bits")


# --- Tiles.convert "bits": the recipes (gptj.quant.cuda.bits' constants), replayed in torch
# on every byte, and the kernels' own helpers run under the interpreter (integer operations and bit
# casts only: it runs those right; the int4 helper's bfloat16 subtraction it cannot)


def int8_bits(q: torch.Tensor) -> torch.Tensor:
    """int8_bf16's steps in torch: bits-as-float32(int32(q) + INT8_MAGIC) - INT8_MAGIC_VALUE, high half."""
    f = (q.to(torch.int32) + cuda.INT8_MAGIC).view(torch.float32) - cuda.INT8_MAGIC_VALUE
    return (f.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


def e4m3_bits(b: torch.Tensor) -> torch.Tensor:
    """e4m3_bf16's steps in torch: (int32(int8(b)) << E4M3_SHIFT) & E4M3_MASK as bfloat16 bits."""
    v = b.view(torch.int8).to(torch.int32)
    return ((v << cuda.E4M3_SHIFT) & cuda.E4M3_MASK).to(torch.int16).view(torch.bfloat16)


def int4_bits(n: torch.Tensor) -> torch.Tensor:
    """int4_bf16's steps in torch: bfloat16 bits INT4_MAGIC | n, less INT4_MAGIC_VALUE in bfloat16."""
    b = (n.to(torch.int32) | cuda.INT4_MAGIC).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(b.double(), 128.0 + n.double())  # before the subtraction: 128 + n, exactly
    return b - torch.tensor(cuda.INT4_MAGIC_VALUE, dtype=torch.bfloat16)


ALL_INT8 = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8)
ALL_E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
E4M3_FINITE = ~torch.isnan(ALL_E4M3.float())  # all but 0x7F and 0xFF


def test_bits_recipes_are_exact_on_every_value():
    """int8: every byte (-128 included) gives bfloat16(q) exactly; e4m3: every finite byte, subnormals
    and -0 included, gives e4m3(b) * 2^-120 exactly (the NaN bytes a finite value); int4: every nibble
    n - 8. The e4m3 path's powers of two cancel: x * 2^64, the weight * 2^-120, the sum * 2^56."""
    assert torch.equal(int8_bits(ALL_INT8), ALL_INT8.to(torch.bfloat16))
    assert torch.equal(int8_bits(ALL_INT8).double(), ALL_INT8.double())
    got = e4m3_bits(ALL_E4M3)
    assert torch.equal(got.double()[E4M3_FINITE], ALL_E4M3.double()[E4M3_FINITE] * 2.0**cuda.E4M3_LOG2)
    assert torch.equal(got.view(torch.int16) < 0, ALL_E4M3.view(torch.uint8) >= 128)  # the sign, -0 too
    assert torch.isfinite(got.double()).all() and got.double().abs().max() == 480 * 2.0**cuda.E4M3_LOG2
    assert ((got.double().abs() < 2.0**-126) & (got.double() != 0)).sum() == 14  # e4m3's subnormals stay so
    assert cuda.X_PRESCALE * 2.0**cuda.E4M3_LOG2 * cuda.E4M3_UNSCALE == 1.0
    nibbles = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(int4_bits(nibbles).double(), nibbles.double() - 8)


if cuda.available():
    import triton
    import triton.language as tl

    @triton.jit
    def _bits_probe(q_ptr, e_ptr, q_out, e_out, N: tl.constexpr):
        """The kernels' helpers on N bytes, their bfloat16 results stored as int16 bits."""
        i = tl.arange(0, N)
        tl.store(q_out + i, bits.int8_bf16(tl.load(q_ptr + i)).to(tl.int16, bitcast=True))
        tl.store(e_out + i, bits.e4m3_bf16(tl.load(e_ptr + i)).to(tl.int16, bitcast=True))


@pytest.mark.skipif(DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9),
                    reason="Triton loads e4m3 on compute capability 8.9 and up")
def test_the_kernels_bits_helpers_on_every_byte():
    """int8_bf16 and e4m3_bf16 as the kernels run them (the interpreter on CPU, the GPU's code on a
    GPU): the torch recipes' bits exactly, every byte."""
    q_out = torch.empty(256, dtype=torch.int16, device=DEVICE)
    e_out = torch.empty(256, dtype=torch.int16, device=DEVICE)
    _bits_probe[(1,)](ALL_INT8.to(DEVICE), ALL_E4M3.to(DEVICE), q_out, e_out, N=256)
    assert torch.equal(q_out.cpu(), int8_bits(ALL_INT8).view(torch.int16))
    assert torch.equal(e_out.cpu(), e4m3_bits(ALL_E4M3).view(torch.int16))


BITS_PLANS = [cuda.Tiles(convert="bits"), cuda.Tiles(kind="swapped", block_n=32, int8_block_k=128, rows=8,
                                                     convert="bits")]


@pytest.mark.parametrize("tiles", BITS_PLANS, ids=["mma", "swapped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_bits_keeps_cast_for_other_dtypes(dtype, tiles):
    """convert="bits" with float16 / float32 x: the "cast" kernel's result, bit for bit (int8, e4m3,
    int4; K split in two)."""
    cast = cuda.Tiles(**{**tiles.__dict__, "convert": "cast"})
    x, w, bias = inputs(3, 40, 512, dtype, True)
    q, scale, _ = int8_weight(w)
    assert torch.equal(cuda.int8_linear(x, q, scale, bias, tiles=tiles),
                       cuda.int8_linear(x, q, scale, bias, tiles=cast))
    if DEVICE == "cpu" or torch.cuda.get_device_capability() >= (8, 9):
        q, scale = quantize_fp8(w)
        assert torch.equal(cuda.int8_linear(x, q, scale, tiles=tiles), cuda.int8_linear(x, q, scale, tiles=cast))
    packed, scale, zero, _, _ = int4_weight(w, 128)
    assert torch.equal(cuda.int4_linear(x, packed, scale, zero, 128, bias, tiles=tiles),
                       cuda.int4_linear(x, packed, scale, zero, 128, bias, tiles=cast))


# bfloat16 x (GPU only): the kernels with convert="bits" on the bound, batch invariance, and exactly
# on every byte (a tensor core that flushed subnormal inputs would zero e4m3's subnormals here)
BF16_ONLY = pytest.mark.skipif(DEVICE == "cpu", reason="Triton's interpreter has no bfloat16 arithmetic")
FP8_UNITS = pytest.mark.skipif(DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9),
                               reason="Triton loads e4m3 on compute capability 8.9 and up")


@BF16_ONLY
@pytest.mark.parametrize("tiles", BITS_PLANS, ids=["mma", "swapped"])
@pytest.mark.parametrize("kind", ["int8", pytest.param("e4m3", marks=FP8_UNITS), "int4"])
def test_bits_on_bfloat16(kind, tiles):
    """Within the bound, K split (512 inputs) and not (split_k=1), and each row the same bit for bit
    alone as among 16."""
    x, w, bias = inputs(16, 72, 512, torch.bfloat16, True)
    if kind == "int4":
        packed, scale, zero, exact, terms = int4_weight(w, 64)

        def run(rows, split_k=None):
            return cuda.int4_linear(rows, packed, scale, zero, 64, bias, split_k=split_k, tiles=tiles)
    else:
        q, scale = quantize_int8(w) if kind == "int8" else quantize_fp8(w)
        exact = q.double() * scale.double()[:, None]
        terms = exact.abs()

        def run(rows, split_k=None):
            return cuda.int8_linear(rows, q, scale, bias, split_k=split_k, tiles=tiles)
    y = run(x)
    check(y, x, exact, terms, bias)
    check(run(x, 1), x, exact, terms, bias)
    for i in (0, 5, 15):
        assert torch.equal(run(x[i:i + 1]), y[i:i + 1]), f"row {i}"


@BF16_ONLY
@pytest.mark.parametrize("tiles", BITS_PLANS, ids=["mma", "swapped"])
@pytest.mark.parametrize("kind", ["int8", pytest.param("e4m3", marks=FP8_UNITS)])
def test_bits_exact_on_every_byte(kind, tiles):
    """x one-hot rows of powers of two (2^-20 .. 2^25): y[m, n] is one product, x * weight * scale,
    exact in float32, so y must be its bfloat16 exactly, for all 256 bytes (e4m3: the 254 finite
    ones, subnormals included)."""
    K = 16
    if kind == "int8":
        q = ALL_INT8.view(16, K).to(DEVICE)
    else:
        q = torch.where(E4M3_FINITE, ALL_E4M3.view(torch.uint8), 0).view(torch.float8_e4m3fn).view(16, K).to(DEVICE)
    scale = (torch.rand(16, generator=torch.Generator().manual_seed(1)) + 0.5).to(torch.bfloat16).to(DEVICE)
    x = torch.diag(2.0 ** torch.linspace(-20, 25, K)).to(torch.bfloat16).to(DEVICE)  # row m: x[m, m] only
    want = (x.float().diagonal()[:, None] * q.float().T * scale.float()[None, :]).to(torch.bfloat16)
    assert torch.equal(cuda.int8_linear(x, q, scale, tiles=tiles), want)


# The kernel designs (Tiles.kind), each under a plan that exercises its edges on these small shapes:
# the default; the weight as tl.dot's A operand, 8 rows a program (M = 16: two row tiles; int4: groups
# of 32 four to a step, of 64 two); float32 multiply-adds, 4 rows a program (M = 2, 5: rows past M;
# a 256-input step: int4 groups of 32 to 128 eight to two to a step, so K = 64 in groups of 32 is
# one step with six groups past K; K = 300 a partial step)
PLANS = [cuda.TILES, cuda.Tiles(kind="swapped", block_n=32, int8_block_k=128, rows=8),
         cuda.Tiles(kind="fma", block_n=32, int8_block_k=256, rows=4)]
PLAN_IDS = ["mma", "swapped", "fma"]
# the bias-free case under the default plan only (the bias is added in the same code for every kind)
BIAS_PLANS = pytest.mark.parametrize("with_bias,tiles", [(False, PLANS[0]), *((True, t) for t in PLANS)],
                                     ids=["no-bias", *(f"bias-{i}" for i in PLAN_IDS)])


@pytest.mark.parametrize("bad", [dict(kind="dot"), dict(rows=3), dict(rows=256), dict(kind="swapped", rows=32),
                                 dict(kind="fma", rows=8), dict(block_n=48), dict(int8_block_k=0), dict(rows=True),
                                 dict(convert="bit"), dict(kind="fma", convert="bits", rows=1)], ids=str)
def test_bad_plans(bad):
    with pytest.raises(ValueError):
        cuda.Tiles(**bad)


def test_row_tiles_per_kind():
    """The kind mma takes row tiles up to MMA_MAX_ROWS (the GEMM plans'), swapped up to MAX_ROWS, fma
    up to FMA_MAX_ROWS; the refusal names the kind's limit."""
    assert cuda.Tiles(rows=cuda.MMA_MAX_ROWS).rows == 128
    assert cuda.Tiles(kind="swapped", rows=cuda.MAX_ROWS).rows == 16
    with pytest.raises(ValueError, match="at most 128 for the kind mma"):
        cuda.Tiles(rows=256)
    with pytest.raises(ValueError, match="at most 16 for the kind swapped"):
        cuda.Tiles(kind="swapped", rows=32)


# (M, N, K): N = 72 and 200 not multiples of the kernels' 32 outputs per program; K = 300 not a multiple
# of the int8 kernel's 256 inputs per step; K = 512 splits K in two (the plan without a GPU, N small)
INT8_SHAPES = [(1, 64, 64), (2, 72, 256), (5, 200, 512), (16, 72, 300)]


@BIAS_PLANS
@pytest.mark.parametrize("dtype", X_DTYPES, ids=str)
@pytest.mark.parametrize("M,N,K", INT8_SHAPES)
def test_int8_linear(M, N, K, dtype, with_bias, tiles):
    x, w, bias = inputs(M, N, K, dtype, with_bias)
    q, scale, exact = int8_weight(w)
    check(cuda.int8_linear(x, q, scale, bias, tiles=tiles), x, exact, exact.abs(), bias)


@pytest.mark.skipif(DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9),
                    reason="Triton converts e4m3 on compute capability 8.9 and up (FP8 units)")
@pytest.mark.parametrize("tiles", PLANS, ids=PLAN_IDS)
@pytest.mark.parametrize("dtype", X_DTYPES, ids=str)
@pytest.mark.parametrize("M,N,K", [(1, 72, 256), (5, 40, 300)])
def test_int8_linear_on_e4m3_weights(M, N, K, dtype, tiles):
    """The same kernels on float8_e4m3fn weights (Fp8Linear's decode): e4m3 values are exact in x's
    dtype; K = 300 has masked inputs, whose unloaded bytes must not reach the sums (NaN)."""
    x, w, bias = inputs(M, N, K, dtype, True)
    q, scale = quantize_fp8(w)
    exact = dequantize_fp8(q, scale).double()  # 4 bits times 8: exact in float32
    check(cuda.int8_linear(x, q, scale, bias, tiles=tiles), x, exact, exact.abs(), bias)


# (M, N, K, group size): K = 512 in groups of 32 or 64 splits K into 8 slices (the plan without a GPU)
INT4_SHAPES = [(1, 64, 64, 32), (2, 72, 256, 64), (5, 200, 512, 128), (16, 40, 512, 64), (3, 32, 512, 256)]


@BIAS_PLANS
@pytest.mark.parametrize("dtype", X_DTYPES, ids=str)
@pytest.mark.parametrize("M,N,K,group_size", INT4_SHAPES)
def test_int4_linear(M, N, K, group_size, dtype, with_bias, tiles):
    x, w, bias = inputs(M, N, K, dtype, with_bias)
    packed, scale, zero, exact, terms = int4_weight(w, group_size)
    check(cuda.int4_linear(x, packed, scale, zero, group_size, bias, tiles=tiles), x, exact, terms, bias)


@pytest.mark.parametrize("split_k,tiles", [(1, PLANS[0]), (3, PLANS[0]), (8, PLANS[0]), (3, PLANS[1]), (8, PLANS[1]),
                                           (3, PLANS[2]), (8, PLANS[2])],
                         ids=["1", "3", "8", "3-swapped", "8-swapped", "3-fma", "8-fma"])
def test_any_split_of_k(split_k, tiles):
    """The K slices (one; uneven; more than K has blocks, capped) all within the bound. int8: 600
    inputs, 3 blocks of 256 (the default's) or 5 of 128, the last partial; int4: 6 groups of 64, one
    a step (the default) or two (the other kinds': the last slice of 3 a step past the groups)."""
    x, w, bias = inputs(3, 72, 600, torch.float16, True)
    q, scale, exact = int8_weight(w)
    check(cuda.int8_linear(x, q, scale, bias, split_k=split_k, tiles=tiles), x, exact, exact.abs(), bias)
    x, w, bias = inputs(3, 72, 384, torch.float16, True)
    packed, scale, zero, exact, terms = int4_weight(w, 64)
    check(cuda.int4_linear(x, packed, scale, zero, 64, bias, split_k=split_k, tiles=tiles), x, exact, terms, bias)


@pytest.mark.parametrize("tiles", [cuda.Tiles(block_n=64, int8_block_k=128, num_warps=8, split=2, num_stages=3),
                                   cuda.Tiles(block_n=16, int8_block_k=512, num_warps=2),
                                   cuda.Tiles(kind="swapped", block_n=64, int8_block_k=64, rows=16, split=2),
                                   cuda.Tiles(kind="fma", block_n=32, int8_block_k=128, rows=2, split=3, num_stages=3)],
                         ids=["64x128-w8-split2", "16x512-w2", "swapped-r16-64x64-split2", "fma-r2-32x128-split3-s3"])
def test_other_tiles_give_the_same_function(tiles):
    """Another launch plan (benchmarks/gemv_sweep.py times them): within the bound, and each row the
    same bit for bit in a call of 1 row and of 11 (batch invariance holds under any plan). N = 72:
    under each plan's block_n (16, 32, 64) two or more programs of outputs, the last partial (as
    N = 200 gave, in under half the interpreter's programs)."""
    x, w, bias = inputs(11, 72, 640, torch.float16, True)
    q, scale, exact = int8_weight(w)
    y = cuda.int8_linear(x, q, scale, bias, tiles=tiles)
    check(y, x, exact, exact.abs(), bias)
    assert torch.equal(cuda.int8_linear(x[3:4], q, scale, bias, tiles=tiles), y[3:4])
    packed, scale, zero, exact, terms = int4_weight(w, 64)
    y = cuda.int4_linear(x, packed, scale, zero, 64, bias, tiles=tiles)
    check(y, x, exact, terms, bias)
    assert torch.equal(cuda.int4_linear(x[3:4], packed, scale, zero, 64, bias, tiles=tiles), y[3:4])


@pytest.mark.parametrize("tiles", [cuda.Tiles(kind="swapped", block_n=16, int8_block_k=256, rows=1, num_warps=2),
                                   cuda.Tiles(kind="fma", block_n=8, int8_block_k=256, rows=1, num_stages=3)],
                         ids=["swapped-r1", "fma-r1"])
def test_one_row_a_program(tiles):
    """Plans of one row a program (decode's batch 1), within the bound; a row alike alone or not."""
    x, w, bias = inputs(3, 40, 320, torch.float16, True)
    q, scale, exact = int8_weight(w)
    y = cuda.int8_linear(x, q, scale, bias, tiles=tiles)
    check(y, x, exact, exact.abs(), bias)
    assert torch.equal(cuda.int8_linear(x[1:2], q, scale, bias, tiles=tiles), y[1:2])
    packed, scale, zero, exact, terms = int4_weight(w, 64)
    y = cuda.int4_linear(x, packed, scale, zero, 64, bias, tiles=tiles)
    check(y, x, exact, terms, bias)
    assert torch.equal(cuda.int4_linear(x[1:2], packed, scale, zero, 64, bias, tiles=tiles), y[1:2])


def test_calls_without_a_plan_run_plan_fors_by_rows():
    """Where no plan is given, a call of 1 row runs the one-row plan of its weight's kind (the kind
    fma) and a call of 2 to 16 rows the few-rows plan: each call equals that plan's, bit for bit, and
    a row stays the same bit for bit within its class (here 2 rows and 7). e4m3 and int8 share the
    int8 kernel; each kind has a plan of its own."""
    assert {cuda.plan_for(w, 1).kind for w in ("int8", "e4m3", "int4")} == {"fma"}
    assert cuda.plan_for("int8", 2) == cuda.plan_for("int8", 16) != cuda.plan_for("int8", 1)
    assert cuda.plan_for("e4m3", 1) != cuda.plan_for("int8", 1)
    x, w, bias = inputs(7, 40, 256, torch.float16, True)
    q, scale, _ = int8_weight(w)
    for rows, plan in ((x[:1], cuda.plan_for("int8", 1)), (x[:2], cuda.plan_for("int8", 2)),
                       (x, cuda.FEW_ROWS["int8"])):
        assert torch.equal(cuda.int8_linear(rows, q, scale, bias), cuda.int8_linear(rows, q, scale, bias, tiles=plan))
    assert torch.equal(cuda.int8_linear(x[:2], q, scale, bias), cuda.int8_linear(x, q, scale, bias)[:2])
    packed, scale, zero, _, _ = int4_weight(w, 64)
    for rows, plan in ((x[:1], cuda.ONE_ROW["int4"]), (x, cuda.FEW_ROWS["int4"])):
        assert torch.equal(cuda.int4_linear(rows, packed, scale, zero, 64, bias),
                           cuda.int4_linear(rows, packed, scale, zero, 64, bias, tiles=plan))


def test_more_rows_than_one_tile():
    """The few-rows plans on M past their 16-row tile: a second tile of rows, each computed as in the first."""
    x, w, bias = inputs(20, 40, 128, torch.float32, True)
    q, scale, exact = int8_weight(w)
    check(cuda.int8_linear(x, q, scale, bias, tiles=cuda.FEW_ROWS["int8"]), x, exact, exact.abs(), bias)
    packed, scale, zero, exact, terms = int4_weight(w, 32)
    check(cuda.int4_linear(x, packed, scale, zero, 32, bias, tiles=cuda.FEW_ROWS["int4"]), x, exact, terms, bias)


# --- the GEMM plans (MANY_ROWS: calls past MAX_ROWS rows) ----------------------------------------


def test_the_gemm_plans_are_chosen_past_max_rows_and_never_split_k():
    """plan_for gives MANY_ROWS' plans from MAX_ROWS + 1 rows on: the kind mma in row tiles past
    MAX_ROWS, split 1 (partials (split, M, N) would grow with prefill's rows; split must not depend on
    M), and their pipeline stages within Hopper's shared memory twice over (two programs an SM)."""
    for weight in ("int8", "e4m3", "int4"):
        plan = cuda.MANY_ROWS[weight]
        assert cuda.plan_for(weight, cuda.MAX_ROWS + 1) == cuda.plan_for(weight, 4096) == plan
        assert cuda.plan_for(weight, cuda.MAX_ROWS) == cuda.FEW_ROWS[weight] != plan
        before = cuda.plan_for(weight, 4096, (8, 0))  # Ampere, Ada: int4 in a smaller tile (no wgmma)
        assert cuda.plan_for(weight, cuda.MAX_ROWS + 1, (8, 9)) == before == cuda.MANY_ROWS_BEFORE_HOPPER[weight]
        assert (before == plan) == (weight != "int4")
        for plan in (plan, before):
            assert plan.kind == "mma" and plan.split == 1
            if weight == "int4":  # a K step is one group (the default 128), x in bfloat16
                step = plan.block_n * 128 // 2 + plan.rows * 128 * 2
            else:
                step = plan.block_n * plan.int8_block_k + plan.rows * plan.int8_block_k * 2
            assert (plan.num_stages or launch._stages(step)) * step <= 228 * 1024 // 2, weight
    assert cuda.MANY_ROWS["int8"].rows == cuda.MMA_MAX_ROWS


# 136 rows: two of the int8 / e4m3 plan's 128-row tiles (the second of 8 rows), three of int4's 64;
# N = 72: int4's 64 outputs a program twice, the second partial; K = 128: int8's 64-input step twice,
# int4's groups of 32 four times
GEMM_M, GEMM_N, GEMM_K = 136, 72, 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["int8", "e4m3", "int4", "int4-before-hopper"])
def test_the_gemm_plans_within_the_bound(kind, dtype):
    """A call of 136 rows (no plan given: MANY_ROWS'; int4's plan before Hopper named) against the
    float64 product of x and the exact dequantized weight, within error_bound (float32 sums of exact
    products, scale and bias, one rounding to x's dtype)."""
    x, w, bias = inputs(GEMM_M, GEMM_N, GEMM_K, dtype, True, seed=5)
    if kind.startswith("int4"):
        packed, scale, zero, exact, terms = int4_weight(w, 32)
        tiles = cuda.MANY_ROWS_BEFORE_HOPPER["int4"] if kind != "int4" else None
        y = cuda.int4_linear(x, packed, scale, zero, 32, bias, tiles=tiles)
    else:
        if kind == "e4m3" and DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("Triton converts e4m3 on compute capability 8.9 and up (FP8 units)")
        q, scale = quantize_int8(w) if kind == "int8" else quantize_fp8(w)
        exact = q.double() * scale.double()[:, None]
        terms = exact.abs()
        y = cuda.int8_linear(x, q, scale, bias)
    check(y, x, exact, terms, bias)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_gemm_plans_batch_invariance(kind):
    """Within the class past MAX_ROWS a row's result is the same bit for bit whatever else is in the
    call: rows 0-16 in calls of 17, 40 and 136 rows, and rows 23-39 (at other places in their tile)
    in a call of their own 17; each equal to the call under MANY_ROWS' plan named. (Under the
    interpreter, whose tl.dot is numpy's matmul, this checks the rows' indexing: these float16 sums
    come out alike in any order there; the order is the GPU's to keep, and plan_for's, tested above,
    that one plan serves the class.)"""
    x, w, bias = inputs(GEMM_M, GEMM_N, GEMM_K, torch.float16, True, seed=6)
    if kind == "int8":
        q, scale, _ = int8_weight(w)

        def run(rows, tiles=None):
            return cuda.int8_linear(rows, q, scale, bias, tiles=tiles)
    else:
        packed, scale, zero, _, _ = int4_weight(w, 32)

        def run(rows, tiles=None):
            return cuda.int4_linear(rows, packed, scale, zero, 32, bias, tiles=tiles)
    y40 = run(x[:40])
    assert torch.equal(y40, run(x[:40], cuda.MANY_ROWS[kind]))
    assert torch.equal(run(x[:17]), y40[:17])
    assert torch.equal(run(x)[:40], y40)
    assert torch.equal(run(x[23:40]), y40[23:40])


def test_rows_of_a_wider_tensor():
    """x's rows need only be contiguous each: a column slice (row stride past K) reads the same."""
    x, w, _ = inputs(4, 40, 256, torch.float16, False)
    wide = torch.zeros(4, 320, dtype=x.dtype, device=DEVICE)
    wide[:, 32:288] = x
    view = wide[:, 32:288]
    q, scale, _ = int8_weight(w)
    assert torch.equal(cuda.int8_linear(view, q, scale), cuda.int8_linear(x, q, scale))
    packed, scale, zero, _, _ = int4_weight(w, 64)
    assert torch.equal(cuda.int4_linear(view, packed, scale, zero, 64), cuda.int4_linear(x, packed, scale, zero, 64))


@pytest.mark.parametrize("tiles", PLANS, ids=PLAN_IDS)
@pytest.mark.parametrize("dtype", X_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_batch_invariance(kind, dtype, tiles):
    """Row i of a 16-row call equals the 1-row call on row i, bit for bit (K split in two here),
    under each kind's plan (a row's place in its program's rows differs between the calls)."""
    x, w, bias = inputs(16, 40, 512, dtype, True)
    if kind == "int8":
        q, scale, _ = int8_weight(w)

        def run(rows):
            return cuda.int8_linear(rows, q, scale, bias, tiles=tiles)
    else:
        packed, scale, zero, _, _ = int4_weight(w, 128)

        def run(rows):
            return cuda.int4_linear(rows, packed, scale, zero, 128, bias, tiles=tiles)
    y = run(x)
    same = _same_rows(x, w, dtype)
    # every row under the default; under the others rows at every place in a program's 4 or 8 rows
    for i in range(0, x.shape[0], 1 if tiles == cuda.TILES else 3):
        assert same(run(x[i:i + 1]), y[i:i + 1], i), f"row {i}"
    assert same(run(x[5:8]), y[5:8], 5)


def _same_rows(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype):
    """Bit for bit on a GPU, which is what the kernels promise. Triton's interpreter computes a
    float32 tl.dot with numpy's matmul, whose BLAS may sum a 1-row and a 16-row product in different
    orders (OpenBLAS on an AVX2 EPYC does): there, rows agree within float32's rounding of a K-term sum,
    K * 2^-24 * sum |x_k w_k| (the dequantized weight within 1.5x of w's magnitude), doubled for both."""
    if DEVICE == "cuda" or dtype != torch.float32:
        return lambda got, want, first: torch.equal(got, want)
    K = x.shape[1]

    def close(got: torch.Tensor, want: torch.Tensor, first: int) -> bool:
        rows = x[first:first + got.shape[0]].float().abs()
        bound = 2 * K * 2.0 ** -24 * 1.5 * (rows @ w.float().abs().t().to(rows.device))
        return bool(((got.float() - want.float()).abs() <= bound).all())

    return close


def bad_int8_calls():
    x, w, bias = inputs(2, 40, 64, torch.float32, True)
    q, scale, _ = int8_weight(w)
    return {
        "x int": lambda: cuda.int8_linear(x.to(torch.int32), q, scale),
        "x float64": lambda: cuda.int8_linear(x.double(), q, scale),
        "x 1-D": lambda: cuda.int8_linear(x[0], q, scale),
        "x no rows": lambda: cuda.int8_linear(x[:0], q, scale),
        "x columns strided": lambda: cuda.int8_linear(x.t().contiguous().t(), q, scale),
        "x inputs past the weight's": lambda: cuda.int8_linear(torch.cat([x, x], 1), q, scale),
        "weight float16": lambda: cuda.int8_linear(x, q.half(), scale),
        "weight uint8": lambda: cuda.int8_linear(x, q.view(torch.uint8), scale),
        "weight not contiguous": lambda: cuda.int8_linear(x, torch.cat([q, q], 1)[:, ::2], scale),
        "scale float32": lambda: cuda.int8_linear(x, q, scale.float()),
        "scale (N, 1)": lambda: cuda.int8_linear(x, q, scale[:, None]),
        "scale short": lambda: cuda.int8_linear(x, q, scale[1:]),
        "bias short": lambda: cuda.int8_linear(x, q, scale, bias[1:]),
        "bias int": lambda: cuda.int8_linear(x, q, scale, bias.to(torch.int32)),
        "split_k 0": lambda: cuda.int8_linear(x, q, scale, split_k=0),
    }


def bad_int4_calls():
    x, w, bias = inputs(2, 40, 128, torch.float32, True)
    packed, scale, zero, _, _ = int4_weight(w, 64)
    return {
        "group size 48": lambda: cuda.int4_linear(x, packed, scale, zero, 48),
        "group size True": lambda: cuda.int4_linear(x, packed, scale, zero, True),
        "group size past K": lambda: cuda.int4_linear(x[:, :96], packed[:, :48], scale, zero, 64),
        "packed int8": lambda: cuda.int4_linear(x, packed.view(torch.int8), scale, zero, 64),
        "packed unpacked": lambda: cuda.int4_linear(x, unpack_int4(packed), scale, zero, 64),
        "scale (N,)": lambda: cuda.int4_linear(x, packed, scale[:, 0].contiguous(), zero, 64),
        "scale float16": lambda: cuda.int4_linear(x, packed, scale.half(), zero, 64),
        "zero of other groups": lambda: cuda.int4_linear(x, packed, scale, zero[:, :1].contiguous(), 64),
        "zero not contiguous": lambda: cuda.int4_linear(x, packed, scale, zero.t().contiguous().t(), 64),
        "bias (1, N)": lambda: cuda.int4_linear(x, packed, scale, zero, 64, bias[None, :]),
        "x float64": lambda: cuda.int4_linear(x.double(), packed, scale, zero, 64),
    }


@pytest.mark.parametrize("name", list(bad_int8_calls()))
def test_bad_int8_inputs(name):
    with pytest.raises(ValueError):
        bad_int8_calls()[name]()


@pytest.mark.parametrize("name", list(bad_int4_calls()))
def test_bad_int4_inputs(name):
    with pytest.raises(ValueError):
        bad_int4_calls()[name]()


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_the_quantized_modules_run_these_kernels_where_the_policy_says(kind, monkeypatch):
    """Int8Linear, Int4Linear and Fp8Linear on the policy's TRITON path (forced here: the policy
    chooses it on CUDA only) call these kernels, on the module's own buffers, with its bias."""
    from gptj import policy
    from gptj.quant import Fp8Linear, Int4Linear, Int8Linear
    from gptj.quant.base import pin_path

    x, w, _ = inputs(3, 72, 128, torch.float32, False, seed=4)
    lin = torch.nn.Linear(128, 72).to(DEVICE)
    with torch.no_grad():
        lin.weight.copy_(w)
    m = {"int8": Int8Linear.from_float, "fp8": Fp8Linear.from_float,
         "int4": lambda lin: Int4Linear.from_float(lin, 32)}[kind](lin)
    calls = []
    for name in ("int8_linear", "int4_linear"):
        real = getattr(cuda, name)
        monkeypatch.setattr(cuda, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    pin_path(m, policy.TRITON, x.dtype)
    y = m(x[None])[0]
    assert calls == ["int4_linear" if kind == "int4" else "int8_linear"]
    exact = m.dequantized_weight(torch.float64)
    terms = exact.abs() if kind != "int4" else int4_weight(w, 32)[4]
    check(y, x, exact, terms, m.bias)


def test_the_quantizers_scales_are_correctly_rounded_divisions_on_the_device():
    """quantize_rows_int8 / _fp8 and the per-channel weight scales divide max |x| by 127 or 448
    exactly (one rounding of the true quotient, which float64 gives for float32 operands): CUDA's
    torch divides by a Python number as a multiplication by its reciprocal, a unit in the last place
    off for some x, which the Triton KV store (dividing exactly) would then not match bit for bit."""
    from gptj.quant.ops import divide, quantize_rows_fp8, quantize_rows_int8

    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    amax = x.abs().amax(dim=-1, keepdim=True)
    for d, (_, scale) in ((127, quantize_rows_int8(x)), (448, quantize_rows_fp8(x))):
        exact = (amax.double() / d).float()
        assert torch.equal(scale, exact)
        assert torch.equal(divide(amax, d), exact)
    # the reason for `divide`: a multiplication by the reciprocal is not the division for every x
    assert not torch.equal(amax * torch.full_like(amax, 1 / 127), (amax.double() / 127).float())


@pytest.mark.parametrize("dtype", X_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["int8", "e4m3"])
@pytest.mark.parametrize("with_mul", [False, True], ids=["plain", "times-smoothing"])
def test_quantize_rows_is_torchs_rounding_bit_for_bit(kind, dtype, with_mul):
    """gptj.quant.cuda.quantize_rows (one launch: fp8's and w8a8's per-token rounding on CUDA) gives
    gptj.quant.ops' values and scales bit for bit: rows of 2,500 inputs (past one 1,024-value loop
    step, not a power of two) spanning 2^-20 to 2^12, a zero row (its tiny scale), a row of one
    outlier, negative values rounding to zero, and a per-column float32 factor (W8A8's 1 / smooth)."""
    g = torch.Generator().manual_seed(3)
    K = 2500
    x = torch.randn(6, K, generator=g) * 2.0 ** torch.randint(-20, 12, (6, 1), generator=g).float()
    x[2] = 0.0
    x[3] = 1e-3
    x[3, 77] = -900.0  # the rest rounds to (signed) zero or e4m3's subnormals
    x = x.to(dtype).to(DEVICE)
    mul = (torch.rand(K, generator=g) + 0.25).to(DEVICE) if with_mul else None
    q, s = cuda.quantize_rows(x, kind, mul)
    xf = x.float() if mul is None else x.float() * mul
    want_q, want_s = quantize_rows_int8(xf) if kind == "int8" else quantize_rows_fp8(xf)
    assert q.dtype == want_q.dtype and s.shape == want_s.shape == (6, 1)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    with pytest.raises(ValueError, match="mul must be"):
        cuda.quantize_rows(x, kind, torch.ones(K + 1, device=DEVICE))
