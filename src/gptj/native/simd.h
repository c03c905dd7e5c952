/* Helpers shared by gptj.native's kernels (gemv.c, attention.c, elementwise.c), on a vector layer
   that is the only place the instruction set shows. All static inline: each kernel file gets its own
   copy, compiled into its ISA's library.

   The build defines one ISA (gptj/native/__init__.py's ISAS, one library per ISA, chosen at load from
   the CPU's flags), and this header includes its file:
     GPTJ_ISA_AVX512   simd_avx512.h   AVX-512 F/BW/VL, 16 lanes; with BF16 and VNNI (the avx512-bf16
                                       library) HAVE_DP: bfloat16 dot products (vdpbf16ps) in the
                                       GEMV's and attention's own sections, int16 ones (vpdpwssd);
                                       without (avx512: Skylake-SP to Ice Lake) the layer's code
     GPTJ_ISA_AVX2     simd_avx2.h     AVX2 + FMA + F16C (AMD Zen 2/3, Intel Haswell on), 8 lanes:
                                       float32 FMAs on bfloat16 and int8 widened (exact), int16 pairs
                                       (vpmaddwd)
     GPTJ_ISA_GENERIC  simd_generic.h  any CPU GCC or Clang targets (ARM's NEON among them), 8 lanes of
                                       GCC's vector extensions: portable C the compiler maps onto the
                                       target's vectors
   Every kernel is written once against the layer; only where a target has an instruction the layer
   does not express (HAVE_DP: AVX512-BF16's bfloat16 dot products) do gemv.c and attention.c keep a
   section of their own under `#if HAVE_DP`. Another ISA (ARM NEON intrinsics, SVE) is one more file
   defining what follows, and one more entry in ISAS.

   What an ISA file defines (lanes are float32 in vf, int32 in vi, loads and stores unaligned):
     VW, VI16        float32 lanes of vf; int16 lanes of vi (2 VW)
     VREGS           vector registers (tiles are sized so their sums stay in them)
     HAVE_DP         1 where the kernels' bfloat16 dot-product sections apply (AVX512-BF16), else 0
     vf_zero() vf_set1(a) vf_add vf_sub vf_mul vf_div vf_max vf_min vf_abs(a) vf_fmadd(a, b, c) = a b + c
       vf_fnmadd(a, b, c) = c - a b  vf_round(a) (to nearest even)  vf_reduce_add(a) vf_reduce_max(a)
     vf_loadu(p) vf_storeu(p, v) vf_loadu_n(p, n) vf_store_f32_n(p, v, n)   float32; *_n: the first n < VW
       lanes (zeros after on loads)
     vf_load_i8(p) vf_load_i8_n(p, n) vf_load_bf16(p) vf_load_bf16_n(p, n)   widened to float32 (exact)
     vf_load_u4(p, &lo, &hi)         VW bytes: their low nibbles in lo, high nibbles in hi, as float32
     vf_store_bf16(p, v) vf_store_bf16_n(p, v, n) vf_round_bf16(v)   rounded to bfloat16, nearest even,
       NaN kept a (quiet) NaN
     vf_store_i16(p, v)              VW integral values in int16's range, as int16
     vf_store_bytes_n(p, v, zp, n)   the first n integral lanes plus zp, their low 8 bits as bytes
     vf_hsum(v, stride)              lane i: the sum of the lanes of v[i * stride], for VW vectors
     vf_scale2n(p, n)                p 2^n, n integral in [-252, 254]
     vf_keep_n(v, n) vf_fill_below(v, n, fill) vf_zero_where_neginf(v, s) vf_rotate_pairs(v)
       lanes >= n zeroed; lanes < n set to fill; v where s is not -inf, else 0; lane 2i gets -v[2i + 1],
       lane 2i + 1 gets v[2i]
     vi_zero() vi_load(p) vi_store(p, v) vi_load_i16(p) vi_load_i8_i16(p) vi_bcast_pair(p) vi_to_vf(v)
       int32 lanes; VI16 int16 (from int16, or from int8 widened); one pair of int16 in every lane;
       int32 -> float32 (nearest)
     vi_dot_i16(acc, a, b)           acc + each lane's two int16 products (exact: |a b| <= 2^30)
     vi_load_bytes(p) vi_bcast_quad(p) vi_nibbles(v, &lo, &hi)   4 VW bytes; 4 int8 in every lane; bytes'
       low and high nibbles, as bytes (W4A8, w4a8.c)
     vi_dot_u8x2(acc, u1, s1, u2, s2)   a block's sums (from vi_zero) + each lane's 4 + 4 products of unsigned
       bytes (at most 15) by signed ones (at most 127 in magnitude), at most 4 calls a block; in the ISA's form
       (AVX2: two int16 a lane), vi_block_sums(acc) the lanes' int32 sums: exact */

#ifndef GPTJ_NATIVE_SIMD_H
#define GPTJ_NATIVE_SIMD_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(GPTJ_ISA_AVX512) && !defined(GPTJ_ISA_AVX2) && !defined(GPTJ_ISA_GENERIC)
#error "build gptj.native with -DGPTJ_ISA_AVX512, -DGPTJ_ISA_AVX2 or -DGPTJ_ISA_GENERIC (gptj/native/__init__.py does)"
#endif

/* one bfloat16 -> float32 (exact) */
static inline float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* one float32 -> bfloat16, rounded to nearest even (as vcvtneps2bf16; NaN stays NaN) */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

#if defined(GPTJ_ISA_AVX512)
#include "simd_avx512.h"
#elif defined(GPTJ_ISA_AVX2)
#include "simd_avx2.h"
#else
#include "simd_generic.h"
#endif

/* ---- on the vector layer, every ISA ---- */

/* the first n < VI16 int8 at p widened to int16, zeros after (through a zeroed copy: only a key row's
   tail where D is not a multiple of VI16 takes it) */
static inline vi vi_load_i8_i16_n(const int8_t *p, int n)
{
    int8_t t[VI16] = {0};
    memcpy(t, p, (size_t)n);
    return vi_load_i8_i16(t);
}

/* the first min(n, VW) values at p (zeros after), and their store */
static inline vf vf_load_bf16_upto(const uint16_t *p, long n) { return n >= VW ? vf_load_bf16(p) : vf_load_bf16_n(p, (int)n); }
static inline vf vf_loadu_upto(const float *p, long n) { return n >= VW ? vf_loadu(p) : vf_loadu_n(p, (int)n); }
static inline void vf_store_bf16_upto(uint16_t *p, vf v, long n)
{
    if (n >= VW) vf_store_bf16(p, v);
    else vf_store_bf16_n(p, v, (int)n);
}

/* max |x| over vectors v, as the rounding of a row to integers wants it: vf_max drops NaNs (x86's max
   returns its second operand), so beside the running max m an accumulation n of v * 0 (0 where v is
   finite, NaN where it is NaN or infinite) carries them; absmax_of(m, n) is the largest |x|, NaN where
   x holds a NaN, infinite where it holds an infinity and no NaN (the definitions' torch.amax gives) */
static inline void absmax_add(vf *m, vf *n, vf v)
{
    *m = vf_max(*m, vf_abs(v));
    *n = vf_add(*n, vf_mul(v, vf_zero()));
}
static inline float absmax_of(vf m, vf n)
{
    const float top = vf_reduce_max(m);
    return vf_reduce_add(n) == 0.0f || top == INFINITY ? top : NAN;
}

/* e^x, VW lanes: x = n ln2 + r, |r| <= ln2/2, e^r by its Taylor series to r^7 (relative error < 5e-9,
   below float32's 6e-8 rounding), times 2^n. x is clamped to [-87.3, 88.8]: below, 2^-126-ish
   instead of 0 (negligible beside softmax's maximum, e^0 = 1); above, infinity, as e^x overflows
   float32 there anyway (the clamp keeps 2^n in vf_scale2n's range). */
static inline vf vf_exp(vf x)
{
    x = vf_min(vf_max(x, vf_set1(-87.3f)), vf_set1(88.8f));
    const vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnmadd(n, vf_set1(0.693145751953125f), x); /* ln2 = hi + lo (Cody-Waite) */
    r = vf_fnmadd(n, vf_set1(1.428606765330187e-06f), r);
    vf p = vf_set1(1.0f / 5040);
    p = vf_fmadd(p, r, vf_set1(1.0f / 720));
    p = vf_fmadd(p, r, vf_set1(1.0f / 120));
    p = vf_fmadd(p, r, vf_set1(1.0f / 24));
    p = vf_fmadd(p, r, vf_set1(1.0f / 6));
    p = vf_fmadd(p, r, vf_set1(0.5f));
    p = vf_fmadd(p, r, vf_set1(1.0f));
    p = vf_fmadd(p, r, vf_set1(1.0f));
    return vf_scale2n(p, n);
}

/* the cache lines of [p, p + bytes) into L2: a block's head rows one block ahead of their use
   (the blocks of a table lie anywhere in the pool: the hardware prefetchers cannot guess the next).
   One block ahead is every head's rows: 64 KB for GPT-J's 16 heads of 256 in int8, twice in
   bfloat16, more than L1 holds (32-48 KB): pulled into L1 (T0) they would evict the rows in use, so
   they go to L2 (T1). Figures: docs/PERFORMANCE.md#cpu-kernels */
static inline void prefetch_span(const void *p, long bytes)
{
    for (long o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, 2); /* x86: prefetcht1 */
}

#endif
