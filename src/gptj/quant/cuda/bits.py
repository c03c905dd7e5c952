"""Tiles.convert "bits": the weight made bfloat16 by integer operations (bfloat16 x only), the recipes,
their constants and the kernels' helpers (int8_bf16, e4m3_bf16, int4_bf16, e4m3_prescale), shared by
the kinds "mma" and "swapped" and by the exhaustive tests of tests/test_quant_cuda.py (which replay
the same steps in torch and run the helpers):
  int8 q: f = bits-as-float32(int32(q) + INT8_MAGIC) - INT8_MAGIC_VALUE, the bfloat16 of f's high
    16 bits. int32(q) + 0x4B000080 is 0x4B000000 + (q + 128), q + 128 in 0..255 (no carry out of the
    low byte): the float32 2^23 + 128 + q exactly (its ulp is 1 in [2^23, 2^24)); less 2^23 + 128
    (exact: Sterbenz) it is q, an integer of at most 8 significant bits, so its low 16 bits are 0 and
    the high half is bfloat16(q) exactly. Every byte (-128..127) is exact: no range condition.
  e4m3 byte b: the bfloat16 bits ((b & 0x80) << 8) | ((b & 0x7F) << 4), computed as
    (int32(int8(b)) << E4M3_SHIFT) & E4M3_MASK (the sign-extended byte: its bit 7 lands on bit 15),
    are exactly e4m3(b) * 2^E4M3_LOG2 (2^-120; e4m3's exponent bias 7, bfloat16's 127, 3 mantissa
    bits into the top of 7) for every finite byte, subnormals included (m/8 * 2^-6 becomes the
    bfloat16 subnormal (16 m / 128) * 2^-126); the NaN bytes 0x7F / 0xFF become 480 * 2^-120 (finite),
    as does any unloaded (masked) byte: no NaN reaches the sums, x is 0 there. Those weights are tiny
    (at most 448 * 2^-120, subnormal below 2^-126 for e4m3's subnormals), so x is scaled first by
    X_PRESCALE = 2^64 (exact in bfloat16 for |x| < 2^64; past that x * 2^64 is inf and so is y) and
    the float32 sums, x * e4m3 * 2^-56 each, scaled back by E4M3_UNSCALE = 2^56 before the channel
    scale (exact: a power of two, no overflow: |sum| <= K * 2^64 * 448 * 2^-120). A product
    x * e4m3 is then a normal float32 when |x * e4m3| >= 2^-70 (2^-126 * 2^56); smaller ones
    (|x| < 2^-61 against e4m3's smallest, 2^-9) may be flushed to 0 by the tensor cores, an
    absolute error under 2^-70 * |scale| a product ("cast" keeps products down to 2^-126). The
    mma's bfloat16 inputs include subnormal weights (e4m3's subnormals): a tensor core that flushed
    subnormal inputs would zero them (tests/test_quant_cuda.py's one-hot test checks this on a GPU).
  int4 nibble n (0..15): the bfloat16 bits INT4_MAGIC | n are 128 + n exactly (ulp 1 in [128, 256)),
    less INT4_MAGIC_VALUE (136) in bfloat16 it is n - 8 exactly (Sterbenz: both in [120, 143]).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # gptj.quant.cuda.available() says so; the calls refuse before any kernel runs
    triton = None

INT8_MAGIC = 0x4B000080  # float32 bits of 2^23 + 128
INT8_MAGIC_VALUE = 8388736.0  # 2^23 + 128
E4M3_SHIFT = 4
E4M3_MASK = 0x87F0  # bit 15 (the sign) and bits 4..10 (e4m3's exponent and mantissa)
E4M3_LOG2 = -120  # bfloat16 from a byte = e4m3 value * 2^E4M3_LOG2
X_PRESCALE = 2.0**64
E4M3_UNSCALE = 2.0**56  # 2^120 / X_PRESCALE
INT4_MAGIC = 0x4300  # bfloat16 bits of 128
INT4_MAGIC_VALUE = 136.0  # 128 + 8


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
    def int8_bf16(w):
        """int8 -> bfloat16 exactly by integer operations and one float32 subtraction (the recipe
        of the module's docstring): float32(2^23 + 128 + q) from its bits, less 2^23 + 128, its high half."""
        f = (w.to(tl.int32) + _INT8_MAGIC).to(tl.float32, bitcast=True) - _INT8_MAGIC_VALUE
        return (f.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def e4m3_bf16(w):
        """e4m3 -> bfloat16 e4m3 * 2^-120 by a shift and a mask (the module's recipe): any
        byte gives a finite value (NaN bytes too), so masked loads need no zeroing."""
        v = w.to(tl.int8, bitcast=True).to(tl.int32)  # sign-extended: bit 7 is copied to bit 15
        return ((v << _E4M3_SHIFT) & _E4M3_MASK).to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def int4_bf16(n):
        """A nibble n (0..15, any integer dtype) -> bfloat16 n - 8 exactly: the bfloat16 128 + n from
        its bits, less 136 in bfloat16 (the module's recipe)."""
        b = (n.to(tl.int32) | _INT4_MAGIC).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return b - tl.full(b.shape, _INT4_MAGIC_VALUE, tl.bfloat16)  # bfloat16 both: no float32

    @triton.jit
    def e4m3_prescale(x):
        """bfloat16 x times X_PRESCALE (2^64, exact for |x| < 2^64): the e4m3 recipe's other factor."""
        return x * tl.full(x.shape, _X_PRESCALE, tl.bfloat16)
