/* Matrix x few-rows kernels for LLM decode on x86-64 CPUs with AVX-512 (F, BW, VL, BF16).

   y[m, n] = sum_k x[m, k] * w[n, k]     (then * scale[n] for int8 weights, then + bias[n])

   x: (M, K) bfloat16, w: (N, K) row-major (int8, per-output-channel symmetric, or bfloat16),
   y: (M, N) bfloat16 (or float32 for the *_f32 variants). Accumulation is float32.

   The weights are streamed exactly once per call (M <= 8; larger M re-reads a block of rows
   from L1/L2 for every 8 rows of x). Design:

   - Products use AVX512-BF16 `vdpbf16ps`: 32 multiply-adds per instruction, both products of a
     pair exact in float32, summed in float32. x is used as stored (bfloat16), never quantized.
     int8 weights are turned into bfloat16 exactly (every integer in [-256, 256] is a bfloat16):
     sign-extend to int32, convert to float32, pack two vectors into one of 32 bfloat16.
   - A register tile of R weight rows x MT rows of x (R * MT float32 accumulators); each load of
     x serves R rows of w, each converted weight vector serves MT rows of x.
   - Software prefetch: the rows a thread owns are one contiguous range of memory; while it
     works on a block of rows it prefetches linearly `g_pf_dist` bytes ahead of the block at the
     rate it consumes bytes. Rows of K = 1024 int8 are only 16 cache lines, too short for the
     hardware stream prefetchers to ramp up on their own.
   - OpenMP over contiguous ranges of row blocks, one per thread (static). Built with -fopenmp
     and loaded into a process that already has torch's libgomp.so.1, the kernels run on the
     same OpenMP runtime (and thread pool) as torch's own kernels.
   - K tails (K % 32) use masked loads (zeros beyond K); N tails run one row at a time.
*/

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define MAXMT 8   /* rows of x per register tile */
#define GROUP 8   /* rows of w per block; every R below divides it */

static int g_pf_dist = 4096;    /* bytes ahead of the current block; 0 turns prefetch off */
static int g_min_parallel = 65536;  /* weight bytes below which a call runs on one thread */

void gemv_set_tuning(int pf_dist, int min_parallel_bytes)
{
    if (pf_dist >= 0) g_pf_dist = pf_dist;
    if (min_parallel_bytes >= 0) g_min_parallel = min_parallel_bytes;
}

int gemv_get_prefetch(void) { return g_pf_dist; }

int gemv_omp_max_threads(void) { return omp_get_max_threads(); }

/* ---- scalar bfloat16 helpers ---- */

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f)  /* round to nearest even, NaN stays NaN */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* ---- weight loaders: 32 weights of one row -> 32 bfloat16 ---- */

static inline __m512bh load_w_i8(const int8_t *p)
{
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);  /* low half <- lo: element order kept */
}

static inline __m512bh load_w_i8_tail(const int8_t *p, __mmask32 mask)
{
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8((__mmask16)mask, p)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8((__mmask16)(mask >> 16), p + 16)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

static inline __m512bh load_w_bf16(const uint16_t *p)
{
    return (__m512bh)_mm512_loadu_si512((const void *)p);
}

static inline __m512bh load_w_bf16_tail(const uint16_t *p, __mmask32 mask)
{
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

/* 16 horizontal sums -> one vector (lane i = sum of v[i]) */
static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

/* ---- register-tile kernels ----
   BLK(NAME, WT, LOAD, LOADT, R, MT): one block of R rows of w (row stride K elements) against
   MT rows of x (row stride ldx), writing the R*MT float32 dot products to out[r*MT + m].
   `pf` (may be NULL): where to prefetch; advanced by the bytes of w consumed per step. */

#define BLK(NAME, WT, LOAD, LOADT, R, MT)                                                        \
static void NAME(const uint16_t *x, long ldx, const WT *w, long K, float *out, const char *pf)  \
{                                                                                             \
    __m512 acc[R][MT];                                                                        \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                        \
    _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) acc[r][m] = _mm512_setzero_ps();     \
    const long step = (long)R * 32 * (long)sizeof(WT);                                        \
    long k = 0;                                                                               \
    for (; k + 32 <= K; k += 32) {                                                            \
        if (pf) {                                                                             \
            _Pragma("GCC unroll 16") for (long j = 0; j < step; j += 64)                       \
                _mm_prefetch(pf + j, _MM_HINT_T0);                                            \
            pf += step;                                                                       \
        }                                                                                     \
        __m512bh wv[R];                                                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) wv[r] = LOAD(w + r * K + k);      \
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                                \
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + m * ldx + k));      \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                               \
                acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv[r], xv);                           \
        }                                                                                     \
    }                                                                                         \
    if (k < K) {                                                                              \
        __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);                                  \
        __m512bh wv[R];                                                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) wv[r] = LOADT(w + r * K + k, mask);\
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                                \
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k);          \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                               \
                acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv[r], xv);                           \
        }                                                                                     \
    }                                                                                         \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                        \
    _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) out[r * MT + m] = hsum(acc[r][m]);   \
}

typedef void (*blk_i8_fn)(const uint16_t *, long, const int8_t *, long, float *, const char *);
typedef void (*blk_bf_fn)(const uint16_t *, long, const uint16_t *, long, float *, const char *);

/* rows per block for MT rows of x: keeps R*MT accumulators + R weight vectors in 32 registers */
static const int ROWS_FOR_MT[MAXMT + 1] = {0, 8, 8, 4, 4, 4, 4, 2, 2};

#define DEFS(PFX, WT, LOAD, LOADT)                                                               \
    BLK(PFX##_8_1, WT, LOAD, LOADT, 8, 1)                                                         \
    BLK(PFX##_8_2, WT, LOAD, LOADT, 8, 2)                                                         \
    BLK(PFX##_4_3, WT, LOAD, LOADT, 4, 3)                                                         \
    BLK(PFX##_4_4, WT, LOAD, LOADT, 4, 4)                                                         \
    BLK(PFX##_4_5, WT, LOAD, LOADT, 4, 5)                                                         \
    BLK(PFX##_4_6, WT, LOAD, LOADT, 4, 6)                                                         \
    BLK(PFX##_2_7, WT, LOAD, LOADT, 2, 7)                                                         \
    BLK(PFX##_2_8, WT, LOAD, LOADT, 2, 8)                                                         \
    BLK(PFX##_1_1, WT, LOAD, LOADT, 1, 1)                                                         \
    BLK(PFX##_1_2, WT, LOAD, LOADT, 1, 2)                                                         \
    BLK(PFX##_1_3, WT, LOAD, LOADT, 1, 3)                                                         \
    BLK(PFX##_1_4, WT, LOAD, LOADT, 1, 4)                                                         \
    BLK(PFX##_1_5, WT, LOAD, LOADT, 1, 5)                                                         \
    BLK(PFX##_1_6, WT, LOAD, LOADT, 1, 6)                                                         \
    BLK(PFX##_1_7, WT, LOAD, LOADT, 1, 7)                                                         \
    BLK(PFX##_1_8, WT, LOAD, LOADT, 1, 8)

DEFS(bi8, int8_t, load_w_i8, load_w_i8_tail)
DEFS(bbf, uint16_t, load_w_bf16, load_w_bf16_tail)

static const blk_i8_fn I8_BLK[MAXMT + 1] = {0, bi8_8_1, bi8_8_2, bi8_4_3, bi8_4_4, bi8_4_5, bi8_4_6, bi8_2_7, bi8_2_8};
static const blk_i8_fn I8_ROW[MAXMT + 1] = {0, bi8_1_1, bi8_1_2, bi8_1_3, bi8_1_4, bi8_1_5, bi8_1_6, bi8_1_7, bi8_1_8};
static const blk_bf_fn BF_BLK[MAXMT + 1] = {0, bbf_8_1, bbf_8_2, bbf_4_3, bbf_4_4, bbf_4_5, bbf_4_6, bbf_2_7, bbf_2_8};
static const blk_bf_fn BF_ROW[MAXMT + 1] = {0, bbf_1_1, bbf_1_2, bbf_1_3, bbf_1_4, bbf_1_5, bbf_1_6, bbf_1_7, bbf_1_8};

/* ---- drivers ---- */

typedef struct {
    const uint16_t *x;
    const void *w;
    const uint16_t *scale;  /* NULL: no scale (bfloat16 weights) */
    const uint16_t *bias;   /* may be NULL */
    void *y;
    int y_f32;              /* y is float32 instead of bfloat16 */
    long M, N, K;
    int is_i8;
} job_t;

static inline void store_tile(const job_t *j, long n, long m0, int R, int MT, const float *out)
{
    for (int r = 0; r < R; r++) {
        float s = j->scale ? bf16_to_f32(j->scale[n + r]) : 1.0f;
        float b = j->bias ? bf16_to_f32(j->bias[n + r]) : 0.0f;
        for (int m = 0; m < MT; m++) {
            float v = out[r * MT + m];
            if (j->scale) v = v * s;
            if (j->bias) v = v + b;
            long idx = (m0 + m) * j->N + n + r;
            if (j->y_f32) ((float *)j->y)[idx] = v;
            else ((uint16_t *)j->y)[idx] = f32_to_bf16(v);
        }
    }
}

/* rows [n0, n1) of w against all M rows of x */
static void run_rows(const job_t *j, long n0, long n1)
{
    const long K = j->K;
    const long esz = j->is_i8 ? 1 : 2;
    const char *wb = (const char *)j->w;
    float out[GROUP * MAXMT];
    long n = n0;
    for (; n + GROUP <= n1; n += GROUP) {
        for (long m0 = 0; m0 < j->M; m0 += MAXMT) {
            int mt = (int)((j->M - m0) < MAXMT ? (j->M - m0) : MAXMT);
            int R = ROWS_FOR_MT[mt];
            for (int r0 = 0; r0 < GROUP; r0 += R) {
                /* prefetch on the first pass over the rows only (later passes hit cache) */
                const char *pf = (g_pf_dist > 0 && m0 == 0) ? wb + ((n + r0) * K) * esz + g_pf_dist : NULL;
                const uint16_t *xm = j->x + m0 * K;
                if (j->is_i8) I8_BLK[mt](xm, K, (const int8_t *)j->w + (n + r0) * K, K, out, pf);
                else BF_BLK[mt](xm, K, (const uint16_t *)j->w + (n + r0) * K, K, out, pf);
                store_tile(j, n + r0, m0, R, mt, out);
            }
        }
    }
    for (; n < n1; n++) {
        for (long m0 = 0; m0 < j->M; m0 += MAXMT) {
            int mt = (int)((j->M - m0) < MAXMT ? (j->M - m0) : MAXMT);
            const uint16_t *xm = j->x + m0 * K;
            if (j->is_i8) I8_ROW[mt](xm, K, (const int8_t *)j->w + n * K, K, out, NULL);
            else BF_ROW[mt](xm, K, (const uint16_t *)j->w + n * K, K, out, NULL);
            store_tile(j, n, m0, 1, mt, out);
        }
    }
}

static void run(const job_t *j, int nthreads)
{
    if (j->M <= 0 || j->N <= 0) return;
    if (j->K <= 0) {  /* empty sum: y = bias (or 0) */
        float zero[MAXMT] = {0};
        for (long n = 0; n < j->N; n++)
            for (long m0 = 0; m0 < j->M; m0 += MAXMT) {
                int mt = (int)((j->M - m0) < MAXMT ? (j->M - m0) : MAXMT);
                store_tile(j, n, m0, 1, mt, zero);
            }
        return;
    }
    long nblocks = (j->N + GROUP - 1) / GROUP;
    long bytes = j->N * j->K * (j->is_i8 ? 1 : 2);
    if (nthreads < 1) nthreads = 1;
    if (nthreads > nblocks) nthreads = (int)nblocks;
    if (bytes < g_min_parallel) nthreads = 1;
    if (nthreads == 1) {
        run_rows(j, 0, j->N);
        return;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static, 1)
    for (int t = 0; t < nthreads; t++) {
        long b0 = nblocks * t / nthreads, b1 = nblocks * (t + 1) / nthreads;
        long n0 = b0 * GROUP, n1 = b1 * GROUP;
        if (n1 > j->N) n1 = j->N;
        run_rows(j, n0, n1);
    }
}

/* ---- exported entry points ---- */

void gemv_int8(const uint16_t *x, const int8_t *w, const uint16_t *scale, const uint16_t *bias,
               uint16_t *y, int M, int N, int K, int nthreads)
{
    job_t j = {x, w, scale, bias, y, 0, M, N, K, 1};
    run(&j, nthreads);
}

void gemv_int8_f32(const uint16_t *x, const int8_t *w, const uint16_t *scale, const uint16_t *bias,
                   float *y, int M, int N, int K, int nthreads)
{
    job_t j = {x, w, scale, bias, y, 1, M, N, K, 1};
    run(&j, nthreads);
}

void gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
               int M, int N, int K, int nthreads)
{
    job_t j = {x, w, NULL, bias, y, 0, M, N, K, 0};
    run(&j, nthreads);
}

void gemv_bf16_f32(const uint16_t *x, const uint16_t *w, const uint16_t *bias, float *y,
                   int M, int N, int K, int nthreads)
{
    job_t j = {x, w, NULL, bias, y, 1, M, N, K, 0};
    run(&j, nthreads);
}
