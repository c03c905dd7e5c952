/* gptj.native's vector layer in portable C (simd.h includes it under GPTJ_ISA_GENERIC): vf is 8 float32
   lanes, vi 8 int32 / 16 int16 lanes, as GCC's (and Clang's) vector extensions, which the compiler maps
   onto the target's vectors: NEON on 64-bit ARM (two registers a vector), SSE2 on an x86-64 built with
   no -m flags. So any CPU those compilers target runs every kernel: no intrinsic here, no instruction
   assumed. What is lost against a file of the target's own intrinsics: masked loads and stores go
   through a zeroed copy, horizontal sums lane by lane, and `a * b + c` is fused only where the target
   has an FMA (AArch64 has; the build passes -ffp-contract=fast, as GCC fuses nothing under -std=c11
   otherwise), so on a plain x86-64 every product is rounded once more than on AVX2 (the tests' bounds
   allow it).

   It is the reference a NEON (or SVE) file would be measured and tested against, with the same
   kernels: GPTJ_NATIVE_ISA=generic builds and loads it on any machine (never chosen on its own:
   gptj/native/__init__.py says why). */

#ifndef GPTJ_NATIVE_SIMD_GENERIC_H
#define GPTJ_NATIVE_SIMD_GENERIC_H

#define HAVE_DP 0
#define VREGS 16 /* AArch64: 32 registers of 4 lanes, so 16 of vf's 8 */
#define VW 8
#define VI16 16

typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));  /* 8 int32; or 16 int16 where vi_dot_i16 reads it */
typedef uint32_t vu_ __attribute__((vector_size(32)));
typedef int16_t vi16_ __attribute__((vector_size(32)));
typedef int8_t vi8_ __attribute__((vector_size(16)));
typedef int8_t vi8x8_ __attribute__((vector_size(8)));
typedef uint8_t vu8x8_ __attribute__((vector_size(8)));
typedef uint16_t vu16x8_ __attribute__((vector_size(16)));
typedef int16_t vi16x8_ __attribute__((vector_size(16)));

static const vi LANE_ = {0, 1, 2, 3, 4, 5, 6, 7};

/* a where the lane's mask m is all ones, else b (m from a comparison: -1 or 0 per lane) */
static inline vf vf_select_(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }

static inline vf vf_zero(void) { return (vf){0}; }
static inline vf vf_set1(float a) { return (vf){a, a, a, a, a, a, a, a}; }
static inline vf vf_add(vf a, vf b) { return a + b; }
static inline vf vf_sub(vf a, vf b) { return a - b; }
static inline vf vf_mul(vf a, vf b) { return a * b; }
static inline vf vf_div(vf a, vf b) { return a / b; }
static inline vf vf_fmadd(vf a, vf b, vf c) { return a * b + c; }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return c - a * b; }
/* as x86's maxps / minps: b where either is NaN */
static inline vf vf_max(vf a, vf b) { return vf_select_(a > b, a, b); }
static inline vf vf_min(vf a, vf b) { return vf_select_(a < b, a, b); }
static inline vf vf_abs(vf a) { return (vf)((vi)a & 0x7fffffff); }
/* to nearest, ties to even (the current rounding mode's): |a| < 2^23 by adding and taking away 2^23
   with a's sign; from 2^23 on every float32 is an integer already */
static inline vf vf_round(vf a)
{
    const vf big = (vf)(((vi)a & (int32_t)0x80000000) | 0x4b000000); /* +-2^23 */
    return vf_select_(vf_abs(a) < vf_set1(8388608.0f), (a + big) - big, a);
}
static inline float vf_reduce_add(vf a)
{
    float s = a[0];
    for (int i = 1; i < VW; i++) s += a[i];
    return s;
}
static inline float vf_reduce_max(vf a)
{
    float m = a[0];
    for (int i = 1; i < VW; i++) m = a[i] > m ? a[i] : m;
    return m;
}

static inline vf vf_loadu(const float *p)
{
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void vf_storeu(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf vf_loadu_n(const float *p, int n)
{
    vf v = vf_zero();
    memcpy(&v, p, sizeof(float) * n);
    return v;
}
static inline void vf_store_f32_n(float *p, vf v, int n) { memcpy(p, &v, sizeof(float) * n); }

/* int8 -> int16 -> int32 -> float32: in steps, each a widening the target has (SSE2's unpacks; one
   conversion from int8 to float32 GCC does lane by lane there) */
static inline vf vf_from_i8_(vi8x8_ b)
{
    return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(b, vi16x8_), vi), vf);
}
static inline vf vf_load_i8_n(const int8_t *p, int n)
{
    vi8x8_ b = {0};
    memcpy(&b, p, (size_t)n);
    return vf_from_i8_(b);
}
static inline vf vf_load_i8(const int8_t *p) { return vf_load_i8_n(p, VW); } /* the zeros are dead stores */
/* the VW bytes at p: their low nibbles (lo) and high nibbles (hi) as float32 (exact) */
static inline void vf_load_u4(const uint8_t *p, vf *lo, vf *hi)
{
    vu8x8_ b;
    memcpy(&b, p, VW);
    const vi c = __builtin_convertvector(b, vi);
    *lo = __builtin_convertvector(c & 15, vf);
    *hi = __builtin_convertvector(c >> 4, vf);
}
static inline vf vf_from_bf16_(vu16x8_ h) { return (vf)(__builtin_convertvector(h, vu_) << 16); }
static inline vf vf_load_bf16_n(const uint16_t *p, int n)
{
    vu16x8_ h = {0};
    memcpy(&h, p, sizeof(uint16_t) * n);
    return vf_from_bf16_(h);
}
static inline vf vf_load_bf16(const uint16_t *p) { return vf_load_bf16_n(p, VW); }
/* v rounded to bfloat16 (nearest even, in the integer domain as f32_to_bf16; NaN quieted) */
static inline vu16x8_ bf16_bits_(vf v)
{
    const vu_ u = (vu_)v;
    vu_ r = u + 0x7fff + ((u >> 16) & 1);
    const vi nan = (vi)(u & 0x7fffffff) > 0x7f800000;
    r = (vu_)(((vi)(u | 0x400000) & nan) | ((vi)r & ~nan));
    return __builtin_convertvector(r >> 16, vu16x8_);
}
static inline void vf_store_bf16(uint16_t *p, vf v)
{
    const vu16x8_ h = bf16_bits_(v);
    memcpy(p, &h, sizeof h);
}
static inline void vf_store_bf16_n(uint16_t *p, vf v, int n)
{
    const vu16x8_ h = bf16_bits_(v);
    memcpy(p, &h, sizeof(uint16_t) * n);
}
static inline vf vf_round_bf16(vf v) { return vf_from_bf16_(bf16_bits_(v)); }
static inline void vf_store_i16(int16_t *p, vf v)
{
    const vi16x8_ h = __builtin_convertvector(v, vi16x8_);
    memcpy(p, &h, sizeof h);
}
static inline void vf_store_bytes_n(uint8_t *p, vf v, int zp, int n)
{
    const vu8x8_ b = __builtin_convertvector((vu_)(__builtin_convertvector(v, vi) + zp), vu8x8_);
    memcpy(p, &b, (size_t)n);
}

static inline vf vf_hsum(const vf *v, long stride)
{
    vf r;
    for (int i = 0; i < VW; i++) r[i] = vf_reduce_add(v[i * stride]);
    return r;
}
/* p 2^n for integral n in [-252, 254], as two exponent factors, each a normal float32 */
static inline vf vf_scale2n(vf p, vf n)
{
    const vi ni = __builtin_convertvector(n, vi), n1 = ni >> 1, n2 = ni - n1;
    return p * (vf)((n1 + 127) << 23) * (vf)((n2 + 127) << 23);
}
static inline vf vf_keep_n(vf v, int n) { return (vf)((vi)v & (LANE_ < n)); }
static inline vf vf_fill_below(vf v, int n, vf fill) { return vf_select_(LANE_ < n, fill, v); }
static inline vf vf_zero_where_neginf(vf v, vf s) { return (vf)((vi)v & (s != vf_set1(-INFINITY))); }
static inline vf vf_rotate_pairs(vf v)
{
    const vi sign = {(int32_t)0x80000000, 0, (int32_t)0x80000000, 0, (int32_t)0x80000000, 0, (int32_t)0x80000000, 0};
    return (vf)((vi)__builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6) ^ sign);
}

static inline vi vi_zero(void) { return (vi){0}; }
static inline vi vi_load(const int32_t *p)
{
    vi v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void vi_store(int32_t *p, vi v) { memcpy(p, &v, sizeof v); }
static inline vi vi_load_i16(const int16_t *p) { return vi_load((const int32_t *)(const void *)p); }
static inline vi vi_load_i8_i16(const int8_t *p)
{
    vi8_ b;
    memcpy(&b, p, sizeof b);
    return (vi)__builtin_convertvector(b, vi16_);
}
static inline vi vi_bcast_pair(const int16_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return (vi){v, v, v, v, v, v, v, v};
}
/* each int32 lane holds two int16, low and high half: both products, added (each |a b| <= 2^30; their
   sum wraps as vpmaddwd's does, only at (-2^15)^2 twice, which q_prepare's saturation never makes) */
static inline vi vi_dot_i16(vi acc, vi a, vi b)
{
    const vi alo = (vi)((vu_)a << 16) >> 16, ahi = a >> 16, blo = (vi)((vu_)b << 16) >> 16, bhi = b >> 16;
    return (vi)((vu_)acc + (vu_)(alo * blo) + (vu_)(ahi * bhi));
}
static inline vf vi_to_vf(vi v) { return __builtin_convertvector(v, vf); }
/* W4A8's bytes (simd_avx2.h's comment): 4 VW bytes a vector, byte 4 i + j of lane i */
static inline vi vi_load_bytes(const uint8_t *p) { return vi_load((const int32_t *)(const void *)p); }
static inline vi vi_bcast_quad(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return (vi){v, v, v, v, v, v, v, v};
}
static inline void vi_nibbles(vi v, vi *lo, vi *hi)
{
    *lo = v & 0x0f0f0f0f;
    *hi = (vi)((vu_)v >> 4) & 0x0f0f0f0f;
}
static inline vi vi_dot_u8x2(vi acc, vi u1, vi s1, vi u2, vi s2)
{
    uint8_t a[32], c[32];
    int8_t b[32], d[32];
    int32_t r[8];
    memcpy(a, &u1, 32), memcpy(b, &s1, 32), memcpy(c, &u2, 32), memcpy(d, &s2, 32), memcpy(r, &acc, 32);
    for (int i = 0; i < 32; i++) r[i / 4] += a[i] * b[i] + c[i] * d[i];
    return vi_load(r);
}
static inline vi vi_block_sums(vi acc) { return acc; }  /* the lanes' int32 sums already */

#endif
