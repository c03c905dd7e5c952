/* gptj.native's vector layer for AVX-512 F/BW/VL/DQ (simd.h includes it under GPTJ_ISA_AVX512): vf is 16
   float32 lanes (__m512), vi 16 int32 / 32 int16 lanes (__m512i). Two libraries compile it:
   - avx512-bf16 (with BF16 and VNNI, -march=native on such a CPU): HAVE_DP says the kernels may use
     bfloat16 dot products (vdpbf16ps) directly, in the sections gemv.c and attention.c keep under
     `#if HAVE_DP`; float32 -> bfloat16 is vcvtneps2bf16, int16 pairs vpdpwssd;
   - avx512 (F/BW/VL/DQ only: Intel Skylake-SP, Cascade Lake, Ice Lake): HAVE_DP 0, so the kernels
     run the layer's code, as on AVX2 but 16 lanes wide; float32 -> bfloat16 rounds in integers (as
     simd.h's f32_to_bf16), int16 pairs are vpmaddwd + vpaddd. */

#ifndef GPTJ_NATIVE_SIMD_AVX512_H
#define GPTJ_NATIVE_SIMD_AVX512_H

#include <immintrin.h>

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define HAVE_DP 1  /* AVX512-BF16's vdpbf16ps */
#else
#define HAVE_DP 0
#endif
#define VREGS 32   /* vector registers */
typedef __m512 vf;
#define VW 16
#define vf_zero() _mm512_setzero_ps()
#define vf_set1(a) _mm512_set1_ps(a)
#define vf_add(a, b) _mm512_add_ps(a, b)
#define vf_mul(a, b) _mm512_mul_ps(a, b)
#define vf_fmadd(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vf_fnmadd(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define vf_sub(a, b) _mm512_sub_ps(a, b)
#define vf_div(a, b) _mm512_div_ps(a, b)
#define vf_max(a, b) _mm512_max_ps(a, b)
#define vf_min(a, b) _mm512_min_ps(a, b)
#define vf_abs(a) _mm512_abs_ps(a)
#define vf_round(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vf_reduce_add(a) _mm512_reduce_add_ps(a)
#define vf_reduce_max(a) _mm512_reduce_max_ps(a)
#define vf_loadu(p) _mm512_loadu_ps(p)
#define vf_storeu(p, v) _mm512_storeu_ps(p, v)
#define VMASK(n) ((__mmask16)((1u << (n)) - 1))
static inline vf vf_loadu_n(const float *p, int n) { return _mm512_maskz_loadu_ps(VMASK(n), p); }
static inline vf vf_load_i8(const int8_t *p)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf vf_load_i8_n(const int8_t *p, int n)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(VMASK(n), p)));
}
/* the VW bytes at p: their low nibbles (lo) and high nibbles (hi) as float32 (exact) */
static inline void vf_load_u4(const uint8_t *p, vf *lo, vf *hi)
{
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4));
}
static inline vf vf_load_bf16(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vf_load_bf16_n(const uint16_t *p, int n)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(VMASK(n), p)), 16));
}
static inline void vf_store_f32_n(float *p, vf v, int n) { _mm512_mask_storeu_ps(p, VMASK(n), v); }
#if HAVE_DP
/* v's 16 lanes rounded to bfloat16 (nearest even, NaN kept), in 16 int16 lanes */
static inline __m256i bf16_of(vf v) { return (__m256i)_mm512_cvtneps_pbh(v); }
/* v rounded to bfloat16, as float32 */
static inline vf vf_round_bf16(vf v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_of(v)), 16)); }
#else
/* as f32_to_bf16 in each int32 lane, the bfloat16 in the lane's upper half (low half zero) */
static inline __m512i bf16_hi(vf v)
{
    const __m512i u = _mm512_castps_si512(v);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                   _mm512_set1_epi32(0x7f800000));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));  /* quiet NaN */
    return _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
}
static inline __m256i bf16_of(vf v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_hi(v), 16)); }
static inline vf vf_round_bf16(vf v) { return _mm512_castsi512_ps(bf16_hi(v)); }
#endif
static inline void vf_store_bf16_n(uint16_t *p, vf v, int n) { _mm256_mask_storeu_epi16(p, VMASK(n), bf16_of(v)); }
static inline void vf_store_bf16(uint16_t *p, vf v) { _mm256_storeu_si256((__m256i *)p, bf16_of(v)); }
/* vi: VW int32 lanes (VI16 int16) for W8A8's exact integer dot products: vi_load_i8_i16 widens VI16 int8,
   vi_bcast_pair repeats one pair of int16 in every lane, vi_dot_i16 adds each lane's pair of products
   to its int32, vi_to_vf converts the lanes to float32 (rounded to nearest) */
typedef __m512i vi;
#define VI16 32
#define vi_zero() _mm512_setzero_si512()
static inline vi vi_load_i8_i16(const int8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static inline vi vi_bcast_pair(const int16_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
static inline vi vi_load(const int32_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline vi vi_load_i16(const int16_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline void vi_store(int32_t *p, vi v) { _mm512_storeu_si512((void *)p, v); }
#if defined(__AVX512VNNI__)
static inline vi vi_dot_i16(vi acc, vi a, vi b) { return _mm512_dpwssd_epi32(acc, a, b); }
#else
static inline vi vi_dot_i16(vi acc, vi a, vi b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#endif
static inline vf vi_to_vf(vi v) { return _mm512_cvtepi32_ps(v); }
/* W4A8's bytes (simd_avx2.h's comment): with VNNI two vpdpbusd into int32 lanes, else vpmaddubsw's int16 sums
   (at most 4 calls a block), then vpmaddwd */
static inline vi vi_load_bytes(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline vi vi_bcast_quad(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
static inline void vi_nibbles(vi v, vi *lo, vi *hi)
{
    const __m512i m = _mm512_set1_epi8(0x0f);
    *lo = _mm512_and_si512(v, m);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
}
#if defined(__AVX512VNNI__)
static inline vi vi_dot_u8x2(vi acc, vi u1, vi s1, vi u2, vi s2)
{
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, u1, s1), u2, s2);
}
static inline vi vi_block_sums(vi acc) { return acc; }
#else
static inline vi vi_dot_u8x2(vi acc, vi u1, vi s1, vi u2, vi s2)
{
    return _mm512_add_epi16(acc, _mm512_add_epi16(_mm512_maddubs_epi16(u1, s1), _mm512_maddubs_epi16(u2, s2)));
}
static inline vi vi_block_sums(vi acc) { return _mm512_madd_epi16(acc, _mm512_set1_epi16(1)); }
#endif
/* VW integral float32 values in int16's range -> int16 at p */
static inline void vf_store_i16(int16_t *p, vf v) { _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(v))); }
/* p * 2^n, n integral */
static inline vf vf_scale2n(vf p, vf n) { return _mm512_scalef_ps(p, n); }
/* lanes [n, VW) zeroed */
static inline vf vf_keep_n(vf v, int n) { return _mm512_maskz_mov_ps(VMASK(n), v); }
/* lanes [0, n) replaced by fill */
static inline vf vf_fill_below(vf v, int n, vf fill) { return _mm512_mask_mov_ps(v, VMASK(n), fill); }
/* v where s is not -inf, else 0 */
static inline vf vf_zero_where_neginf(vf v, vf s)
{
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ), v);
}
/* rotary's partner: lane 2i gets -v[2i+1], lane 2i+1 gets v[2i] */
static inline vf vf_rotate_pairs(vf v)
{
    const __m512 sign = _mm512_castsi512_ps(_mm512_set_epi32(0, (int)0x80000000, 0, (int)0x80000000, 0,
        (int)0x80000000, 0, (int)0x80000000, 0, (int)0x80000000, 0, (int)0x80000000, 0, (int)0x80000000, 0,
        (int)0x80000000));
    return _mm512_xor_ps(_mm512_permute_ps(v, 0xB1), sign);
}
/* the first n lanes of v (integral float32 values) plus zp, as bytes (their low 8 bits) */
static inline void vf_store_bytes_n(uint8_t *p, vf v, int zp, int n)
{
    _mm_mask_storeu_epi8(p, VMASK(n), _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(zp))));
}


/* r[i] = sum of the 16 lanes of v[i], for 16 vectors (45 shuffles and adds) */
static inline __m512 hsum16(const __m512 *v, long stride)
{
    __m512 t[8], u[4], s0, s1;
    /* the shuffles below leave sum(in[4q + l]) in lane 4l + q: feed in[4q + l] = v[4l + q] */
#define IN(j) v[(4 * ((j) % 4) + (j) / 4) * stride]
    for (int i = 0; i < 8; i++) {
        __m512 a = IN(2 * i), b = IN(2 * i + 1);
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
#undef IN
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    s0 = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
    s1 = _mm512_add_ps(_mm512_shuffle_ps(u[2], u[3], 0x88), _mm512_shuffle_ps(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_ps(s0, s1, 0x88), _mm512_shuffle_ps(s0, s1, 0xDD));
}

static inline vf vf_hsum(const vf *v, long stride) { return hsum16(v, stride); }

#endif
