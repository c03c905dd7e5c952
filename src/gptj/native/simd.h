/* Helpers shared by gptj.native's kernels (gemv.c, attention.c, elementwise.c), per instruction set.
   All static inline: each kernel file gets its own copy, compiled into its ISA's library.

   The build defines one ISA (gptj/native/__init__.py's ISAS, one library per ISA, chosen at load from
   the CPU's flags):
     GPTJ_ISA_AVX512  AVX-512 F/BW/VL with BF16 and VNNI: bfloat16 dot products (vdpbf16ps) in the
                      GEMV and attention's scores, int16 ones (vpdpwssd) for int8 keys
     GPTJ_ISA_AVX2    AVX2 + FMA + F16C (AMD Zen 2/3, Intel Haswell on): float32 FMAs on bfloat16 and
                      int8 widened (exact), int16 pairs (vpmaddwd) for int8 keys
   Every kernel is written once against the vector layer below (vf: VW float32 lanes); the few
   steps that differ by more than the width (attention's key dot products, prefill's tile) have a
   section per ISA in attention.c. Another ISA (ARM NEON / SVE) is one more section here. */

#ifndef GPTJ_NATIVE_SIMD_H
#define GPTJ_NATIVE_SIMD_H

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(GPTJ_ISA_AVX512) && !defined(GPTJ_ISA_AVX2)
#error "build gptj.native with -DGPTJ_ISA_AVX512 or -DGPTJ_ISA_AVX2 (gptj/native/__init__.py does)"
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

/* ---- the vector layer: vf holds VW float32 lanes ----
   vf_load_i8 / vf_load_bf16: VW weights widened to float32 (exact); *_n: the first n (< VW), zeros
   after; vf_hsum: the VW lane sums of VW vectors v[0], v[stride], ... as one vector (lane i: v[i]'s);
   vf_store_f32_n / vf_store_bf16_n: the first n lanes (bfloat16 rounded to nearest even).
   vi: int32 lanes; vi_dot_i16 adds the products of int16 pairs (exact: |a b| <= 2^30 per pair). */
#if defined(GPTJ_ISA_AVX512)
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
static inline vf vf_load_bf16(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vf_load_bf16_n(const uint16_t *p, int n)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(VMASK(n), p)), 16));
}
static inline void vf_store_f32_n(float *p, vf v, int n) { _mm512_mask_storeu_ps(p, VMASK(n), v); }
static inline void vf_store_bf16_n(uint16_t *p, vf v, int n)
{
    _mm256_mask_storeu_epi16(p, VMASK(n), (__m256i)_mm512_cvtneps_pbh(v));
}
static inline void vf_store_bf16(uint16_t *p, vf v) { _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v)); }
static inline vf vf_hsum(const vf *v, long stride);  /* hsum16, below */
/* vi: VW int32 lanes (VI16 int16) for W8A8's exact integer dot products: vi_load_i8_i16 widens VI16 int8,
   vi_bcast_pair repeats one pair of int16 in every lane, vi_dot_i16 adds each lane's pair of products
   to its int32, vi_to_vf converts the lanes to float32 (rounded to nearest) */
typedef __m512i vi;
#define VI16 32
#define vi_zero() _mm512_setzero_si512()
static inline vi vi_load_i8_i16(const int8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static inline vi vi_bcast_pair(const int16_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
static inline vi vi_load(const int32_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline void vi_store(int32_t *p, vi v) { _mm512_storeu_si512((void *)p, v); }
static inline vi vi_dot_i16(vi acc, vi a, vi b) { return _mm512_dpwssd_epi32(acc, a, b); }  /* VNNI */
static inline vf vi_to_vf(vi v) { return _mm512_cvtepi32_ps(v); }
/* v rounded to bfloat16 (nearest even), as float32 */
static inline vf vf_round_bf16(vf v)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
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

#elif defined(GPTJ_ISA_AVX2)
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
static inline void vi_store(int32_t *p, vi v) { _mm256_storeu_si256((__m256i *)p, v); }
static inline vi vi_dot_i16(vi acc, vi a, vi b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }  /* vpmaddwd */
static inline vf vi_to_vf(vi v) { return _mm256_cvtepi32_ps(v); }
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

#if defined(GPTJ_ISA_AVX512)
/* 16 int8 -> 16 float32 (exact) */
static inline __m512 i8_16(const int8_t *p)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* 16 bfloat16 -> 16 float32 (exact) */
static inline __m512 bf16_16(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 load_bf16x16(const uint16_t *p, __mmask16 mask)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
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
#endif /* GPTJ_ISA_AVX512 */

/* ---- on the vector layer, every ISA ---- */

/* the first min(n, VW) values at p (zeros after), and their store */
static inline vf vf_load_bf16_upto(const uint16_t *p, long n) { return n >= VW ? vf_load_bf16(p) : vf_load_bf16_n(p, (int)n); }
static inline vf vf_loadu_upto(const float *p, long n) { return n >= VW ? vf_loadu(p) : vf_loadu_n(p, (int)n); }
static inline void vf_store_bf16_upto(uint16_t *p, vf v, long n)
{
    if (n >= VW) vf_store_bf16(p, v);
    else vf_store_bf16_n(p, v, (int)n);
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
   bfloat16, more than L1 holds (32-48 KB). Pulled into L1 (T0) they evicted the rows in use:
   benchmarks/native_attention.py, 2 threads, Zen 4, 2026-11-28, 32 rows of 800 tokens, T0 -> T1:
   int8 KV 16.3-19.5 -> 9.8-11.5 ms, bfloat16 25.8-25.9 -> 19.8-20.6 (NTA slower, T2 as T1); in an
   engine (2 layers of GPT-J's width, W8A8, int8 KV, 32 greedy rows of 600+ tokens) 7.8-8.1 -> 5.1-6.3 ms
   a layer's call. */
static inline void prefetch_span(const void *p, long bytes)
{
    for (long o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T1);
}

#endif
