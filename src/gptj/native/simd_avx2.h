/* gptj.native's vector layer for AVX2 + FMA + F16C (simd.h includes it under GPTJ_ISA_AVX2): vf is 8
   float32 lanes (__m256), vi 8 int32 / 16 int16 lanes (__m256i). No bfloat16 arithmetic: bfloat16 and
   int8 are widened to float32 (exact) and summed with FMAs; int8 pairs with vpmaddwd. */

#ifndef GPTJ_NATIVE_SIMD_AVX2_H
#define GPTJ_NATIVE_SIMD_AVX2_H

#include <immintrin.h>

#define HAVE_DP 0
#define VREGS 16
typedef __m256 vf;
#define VW 8
#define vf_zero() _mm256_setzero_ps()
#define vf_set1(a) _mm256_set1_ps(a)
#define vf_add(a, b) _mm256_add_ps(a, b)
#define vf_mul(a, b) _mm256_mul_ps(a, b)
#define vf_fmadd(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vf_fnmadd(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define vf_sub(a, b) _mm256_sub_ps(a, b)
#define vf_div(a, b) _mm256_div_ps(a, b)
#define vf_max(a, b) _mm256_max_ps(a, b)
#define vf_min(a, b) _mm256_min_ps(a, b)
#define vf_abs(a) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a)
#define vf_round(a) _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vf_loadu(p) _mm256_loadu_ps(p)
#define vf_storeu(p, v) _mm256_storeu_ps(p, v)
/* lanes [0, n) all ones: maskload / maskstore take the sign bit of each 32-bit lane */
static inline __m256i lanes_n(int n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vf vf_loadu_n(const float *p, int n) { return _mm256_maskload_ps(p, lanes_n(n)); }
static inline vf vf_load_i8(const int8_t *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf vf_load_i8_n(const int8_t *p, int n)  /* no byte masks: through a zeroed copy */
{
    int8_t t[8] = {0};
    memcpy(t, p, (size_t)n);
    return vf_load_i8(t);
}
/* the VW bytes at p: their low nibbles (lo) and high nibbles (hi) as float32 (exact) */
static inline void vf_load_u4(const uint8_t *p, vf *lo, vf *hi)
{
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
}
static inline vf vf_load_bf16(const uint16_t *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vf_load_bf16_n(const uint16_t *p, int n)
{
    uint16_t t[8] = {0};
    memcpy(t, p, (size_t)n * 2);
    return vf_load_bf16(t);
}
static inline void vf_store_f32_n(float *p, vf v, int n) { _mm256_maskstore_ps(p, lanes_n(n), v); }
/* v rounded to bfloat16 in the integer domain, u + 0x7fff + (u >> 16 & 1) (NaN: quieted), its high
   halves as 16-bit lanes 0-7 of the result */
static inline __m128i bf16_bits(vf v)
{
    __m256i u = _mm256_castps_si256(v);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    r = _mm256_srli_epi32(r, 16);  /* below 2^16: packus keeps each lane's 16 bits */
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
static inline void vf_store_bf16(uint16_t *p, vf v) { _mm_storeu_si128((__m128i *)p, bf16_bits(v)); }
static inline void vf_store_bf16_n(uint16_t *p, vf v, int n)
{
    uint16_t t[8];
    _mm_storeu_si128((__m128i *)t, bf16_bits(v));
    memcpy(p, t, (size_t)n * 2);
}
static inline vf vf_round_bf16(vf v)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_bits(v)), 16));
}
static inline float vf_reduce_add(vf v)
{
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
static inline float vf_reduce_max(vf v)
{
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
}
/* p * 2^n for integral n in [-252, 254], as two exponent factors, each a normal float32 */
static inline vf vf_scale2n(vf p, vf n)
{
    const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const vf f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const vf f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}
typedef __m256i vi;
#define VI16 16
#define vi_zero() _mm256_setzero_si256()
static inline vi vi_load_i8_i16(const int8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline vi vi_bcast_pair(const int16_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
static inline vi vi_load(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi vi_load_i16(const int16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void vf_store_i16(int16_t *p, vf v)
{
    const __m256i i = _mm256_cvtps_epi32(v);
    _mm_storeu_si128((__m128i *)p, _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)));
}
static inline void vi_store(int32_t *p, vi v) { _mm256_storeu_si256((__m256i *)p, v); }
static inline vi vi_dot_i16(vi acc, vi a, vi b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }  /* vpmaddwd */
static inline vf vi_to_vf(vi v) { return _mm256_cvtepi32_ps(v); }
/* W4A8's bytes: vi_load_bytes loads 4 VW bytes, vi_bcast_quad repeats 4 int8 in every lane, vi_nibbles splits
   bytes into their low and high nibbles (as bytes 0-15), vi_dot_u8x2 adds each lane's 4 + 4 products of
   unsigned bytes (nibbles, <= 15) by signed ones (|s| <= 127) to a block's sums, here as the lane's two int16
   (vpmaddubsw's pairs, added: 7,620 at most a call, so 4 calls stay below 2^15, exactly), vi_block_sums
   makes them the lanes' int32 sums (vpmaddwd by 1s): one vpmaddwd a block instead of one a call */
static inline vi vi_load_bytes(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi vi_bcast_quad(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
static inline void vi_nibbles(vi v, vi *lo, vi *hi)
{
    const __m256i m = _mm256_set1_epi8(0x0f);
    *lo = _mm256_and_si256(v, m);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
}
static inline vi vi_dot_u8x2(vi acc, vi u1, vi s1, vi u2, vi s2)
{
    return _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(u1, s1), _mm256_maddubs_epi16(u2, s2)));
}
static inline vi vi_block_sums(vi acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
static inline vf vf_keep_n(vf v, int n) { return _mm256_and_ps(v, _mm256_castsi256_ps(lanes_n(n))); }
static inline vf vf_fill_below(vf v, int n, vf fill) { return _mm256_blendv_ps(v, fill, _mm256_castsi256_ps(lanes_n(n))); }
static inline vf vf_zero_where_neginf(vf v, vf s)
{
    return _mm256_and_ps(v, _mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_NEQ_UQ));
}
static inline vf vf_rotate_pairs(vf v)
{
    const __m256 sign = _mm256_castsi256_ps(_mm256_set_epi32(0, (int)0x80000000, 0, (int)0x80000000, 0,
                                                             (int)0x80000000, 0, (int)0x80000000));
    return _mm256_xor_ps(_mm256_permute_ps(v, 0xB1), sign);
}
static inline void vf_store_bytes_n(uint8_t *p, vf v, int zp, int n)
{
    const __m256i i = _mm256_add_epi32(_mm256_cvtps_epi32(v), _mm256_set1_epi32(zp));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)); /* -127..255: exact */
    const __m128i b = _mm_shuffle_epi8(w, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1));
    if (n == 8) _mm_storel_epi64((__m128i *)p, b);
    else {
        uint8_t t[16];
        _mm_storeu_si128((__m128i *)t, b);
        memcpy(p, t, (size_t)n);
    }
}
/* r[i] = sum of the 8 lanes of v[i * stride], for 8 vectors */
static inline vf vf_hsum(const vf *v, long stride)
{
    __m256 a[4], b[2];
    for (int i = 0; i < 4; i++) a[i] = _mm256_hadd_ps(v[(2 * i) * stride], v[(2 * i + 1) * stride]);
    b[0] = _mm256_hadd_ps(a[0], a[1]);  /* [v0..v3's sums of lanes 0-3 | v0..v3's sums of lanes 4-7] */
    b[1] = _mm256_hadd_ps(a[2], a[3]);  /* the same for v4..v7 */
    __m256 lo = _mm256_permute2f128_ps(b[0], b[1], 0x20), hi = _mm256_permute2f128_ps(b[0], b[1], 0x31);
    return _mm256_add_ps(lo, hi);
}

#endif
