/* Helpers shared by gptj.native's kernels (gemv.c, attention.c, elementwise.c): AVX-512 loads of
   bfloat16, a transposed 16-way horizontal sum, e^x for softmax and GELU, software prefetch. All
   static inline: each kernel file gets its own copy, compiled into the one library. */

#ifndef GPTJ_NATIVE_SIMD_H
#define GPTJ_NATIVE_SIMD_H

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* one bfloat16 -> float32 (exact) */
static inline float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

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

/* e^x, 16 lanes, for x <= 0 (softmax after subtracting the maximum): x = n ln2 + r, |r| <= ln2/2,
   e^r by its Taylor series to r^7 (relative error < 5e-9, below float32's 6e-8 rounding), times 2^n.
   x below -87.3 gives 2^-126-ish, not 0: negligible beside the maximum's e^0 = 1. */
static inline __m512 exp_ps(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x); /* ln2 = hi + lo (Cody-Waite) */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* the cache lines of [p, p + bytes) toward L1: a block's head rows one block ahead of their use
   (the blocks of a table lie anywhere in the pool: the hardware prefetchers cannot guess the next) */
static inline void prefetch_span(const void *p, long bytes)
{
    for (long o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T0);
}
#endif
