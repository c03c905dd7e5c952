/* Matrix x few-rows kernels for LLM decode on x86-64 CPUs with AVX-512 (F, BW, VL, BF16).

   y[m, n] = sum_k x[m, k] * w[n, k]     (then * scale[n] for int8 weights, then + bias[n])

   x: (M, K) bfloat16, w: (N, K) row-major (int8, per-output-channel symmetric, or bfloat16),
   y: (M, N) bfloat16 (or float32 for the *_f32 variants). Accumulation is float32; x is used
   as stored (weight-only quantization: x is never quantized).

   At a few rows of x the work is reading w once from memory, so everything serves a single
   sequential stream of weight bytes per thread:

   - Each thread owns a contiguous range of rows of w, i.e. one contiguous range of memory, and
     walks it in address order, one row at a time, against up to 8 rows of x (a row of w is
     converted once and used for all of them; more rows of x re-read that row of w from L1).
     Sequential order is what DRAM and the hardware prefetchers like best.
   - Software prefetch `g_pf_dist` bytes ahead of the read position, one cache line per line
     consumed. It runs across row boundaries, so rows as short as 1 KiB (K = 1024 int8) stream
     as well as long ones.
   - int8 with 1-2 rows of x: x is converted to float32 once per call; per 16 weights one
     sign-extension, one int->float conversion and one FMA per row of x.
   - bfloat16 weights, and int8 with 3 or more rows of x: AVX512-BF16 `vdpbf16ps` (32
     multiply-adds per instruction; both products of a pair exact in float32, summed in float32).
     int8 weights are turned into bfloat16 exactly (every integer in [-256, 256] is a bfloat16):
     sign-extend, convert to float32, pack two vectors into one of 32 bfloat16; that conversion
     is then shared by all rows of x.
   - Several independent accumulators per row of x hide the FMA / dot-product latency.
   - K tails use masked loads (zeros beyond K).
   - OpenMP over the threads' row ranges (static). Built with -fopenmp and loaded into a process
     that already has torch's libgomp.so.1, the kernels run on the same OpenMP runtime (and
     thread pool) as torch's own kernels.
*/

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAXMT 8  /* rows of x per pass over a row of w */
#define F_MAXMT 2  /* int8 against at most this many rows of x (in a pass) uses float32 x */
#define ROW_ALIGN 16  /* thread ranges start at multiples of this many rows */

static long g_pf_dist = 8192;       /* prefetch distance in bytes; 0 turns prefetch off */
static long g_min_parallel = 65536; /* weight bytes below which a call runs on one thread */

/* Tuning knobs (benchmarks): a negative value leaves that setting as it is. */
void gemv_set_tuning(int pf_dist, int min_parallel_bytes)
{
    if (pf_dist >= 0) g_pf_dist = pf_dist;
    if (min_parallel_bytes >= 0) g_min_parallel = min_parallel_bytes;
}

int gemv_get_prefetch(void) { return (int)g_pf_dist; }

int gemv_omp_max_threads(void) { return omp_get_max_threads(); }

/* ---- scalar bfloat16 helpers ---- */

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f)  /* round to nearest even; NaN stays NaN */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* ---- weight loaders ---- */

/* 32 int8 weights -> 32 bfloat16 (exact), element order kept */
static inline __m512bh load_w_i8(const int8_t *p)
{
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
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

/* 16 int8 weights -> 16 float32 */
static inline __m512 load_w_i8_f32(const int8_t *p)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

static inline __m512 load_w_i8_f32_tail(const int8_t *p, __mmask16 mask)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p)));
}

/* ---- row kernels ----
   One row of w (K elements at w) against MT rows of x (row stride ldx); out[m] = the dot
   products. The main loop consumes 256 bytes (4 cache lines) of w per iteration and, when
   pfd > 0, prefetches the 4 lines pfd bytes further on (past the row's end: the next rows). NA
   independent accumulators per row of x. */

#define IT_BYTES 256

#define PREFETCH_4(p)                                                                          \
    do {                                                                                      \
        _mm_prefetch((p), _MM_HINT_T0);                                                       \
        _mm_prefetch((p) + 64, _MM_HINT_T0);                                                  \
        _mm_prefetch((p) + 128, _MM_HINT_T0);                                                 \
        _mm_prefetch((p) + 192, _MM_HINT_T0);                                                 \
    } while (0)

/* bfloat16 products (vdpbf16ps): x bfloat16 */
#define ROW_DP(NAME, WT, LOAD, LOADT, MT, NA)                                                    \
static void NAME(const uint16_t *x, long ldx, const WT *w, long K, float *out, long pfd)     \
{                                                                                             \
    __m512 acc[NA][MT];                                                                       \
    _Pragma("GCC unroll 8") for (int a = 0; a < NA; a++)                                       \
    _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) acc[a][m] = _mm512_setzero_ps();     \
    enum { PER_IT = IT_BYTES / (int)sizeof(WT) };                                             \
    const char *pf = (const char *)w + pfd;                                                   \
    long k = 0;                                                                               \
    for (; k + PER_IT <= K; k += PER_IT) {                                                    \
        if (pfd) { PREFETCH_4(pf); pf += IT_BYTES; }                                          \
        _Pragma("GCC unroll 8") for (int h = 0; h < PER_IT / 32; h++) {                        \
            __m512bh wv = LOAD(w + k + 32 * h);                                               \
            _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                            \
                __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + m * ldx + k + 32 * h)); \
                acc[h % NA][m] = _mm512_dpbf16_ps(acc[h % NA][m], wv, xv);                    \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (; k < K; k += 32) {                                                                  \
        __mmask32 mask = (K - k) >= 32 ? (__mmask32)0xffffffffu                               \
                                       : (__mmask32)((1u << (K - k)) - 1);                    \
        __m512bh wv = LOADT(w + k, mask);                                                     \
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                                \
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k);          \
            acc[0][m] = _mm512_dpbf16_ps(acc[0][m], wv, xv);                                  \
        }                                                                                     \
    }                                                                                         \
    _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                                    \
        __m512 t = acc[0][m];                                                                 \
        _Pragma("GCC unroll 8") for (int a = 1; a < NA; a++) t = _mm512_add_ps(t, acc[a][m]); \
        out[m] = _mm512_reduce_add_ps(t);                                                     \
    }                                                                                         \
}

/* int8 weights against float32 x (FMA) */
#define ROW_F(NAME, MT, NA)                                                                       \
static void NAME(const float *x, long ldx, const int8_t *w, long K, float *out, long pfd)     \
{                                                                                             \
    __m512 acc[NA][MT];                                                                       \
    _Pragma("GCC unroll 8") for (int a = 0; a < NA; a++)                                       \
    _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) acc[a][m] = _mm512_setzero_ps();     \
    const char *pf = (const char *)w + pfd;                                                   \
    long k = 0;                                                                               \
    for (; k + IT_BYTES <= K; k += IT_BYTES) {                                                \
        if (pfd) { PREFETCH_4(pf); pf += IT_BYTES; }                                          \
        _Pragma("GCC unroll 16") for (int h = 0; h < IT_BYTES / 16; h++) {                     \
            __m512 wv = load_w_i8_f32(w + k + 16 * h);                                        \
            _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++)                              \
                acc[h % NA][m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * ldx + k + 16 * h), \
                                                 acc[h % NA][m]);                             \
        }                                                                                     \
    }                                                                                         \
    for (; k < K; k += 16) {                                                                  \
        __mmask16 mask = (K - k) >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);\
        __m512 wv = load_w_i8_f32_tail(w + k, mask);                                          \
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++)                                  \
            acc[0][m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + m * ldx + k), acc[0][m]); \
    }                                                                                         \
    _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                                    \
        __m512 t = acc[0][m];                                                                 \
        _Pragma("GCC unroll 8") for (int a = 1; a < NA; a++) t = _mm512_add_ps(t, acc[a][m]); \
        out[m] = _mm512_reduce_add_ps(t);                                                     \
    }                                                                                         \
}

#define ROW_DP_ALL(PFX, WT, LOAD, LOADT)                                                         \
    ROW_DP(PFX##_1, WT, LOAD, LOADT, 1, 4)                                                        \
    ROW_DP(PFX##_2, WT, LOAD, LOADT, 2, 4)                                                        \
    ROW_DP(PFX##_3, WT, LOAD, LOADT, 3, 2)                                                        \
    ROW_DP(PFX##_4, WT, LOAD, LOADT, 4, 2)                                                        \
    ROW_DP(PFX##_5, WT, LOAD, LOADT, 5, 2)                                                        \
    ROW_DP(PFX##_6, WT, LOAD, LOADT, 6, 1)                                                        \
    ROW_DP(PFX##_7, WT, LOAD, LOADT, 7, 1)                                                        \
    ROW_DP(PFX##_8, WT, LOAD, LOADT, 8, 1)

ROW_DP_ALL(dpi8, int8_t, load_w_i8, load_w_i8_tail)
ROW_DP_ALL(dpbf, uint16_t, load_w_bf16, load_w_bf16_tail)
ROW_F(fi8_1, 1, 4)
ROW_F(fi8_2, 2, 4)

typedef void (*row_i8_fn)(const uint16_t *, long, const int8_t *, long, float *, long);
typedef void (*row_bf_fn)(const uint16_t *, long, const uint16_t *, long, float *, long);
typedef void (*row_f_fn)(const float *, long, const int8_t *, long, float *, long);

static const row_i8_fn DP_I8[MAXMT + 1] = {0, dpi8_1, dpi8_2, dpi8_3, dpi8_4, dpi8_5, dpi8_6, dpi8_7, dpi8_8};
static const row_bf_fn DP_BF[MAXMT + 1] = {0, dpbf_1, dpbf_2, dpbf_3, dpbf_4, dpbf_5, dpbf_6, dpbf_7, dpbf_8};
static const row_f_fn F_I8[F_MAXMT + 1] = {0, fi8_1, fi8_2};

/* ---- drivers ---- */

typedef struct {
    const uint16_t *x;
    const void *w;
    const uint16_t *scale;  /* NULL: no scale */
    const uint16_t *bias;   /* NULL: no bias */
    void *y;
    int y_f32;              /* y is float32 instead of bfloat16 */
    int is_i8;
    long M, N, K;
    const float *xf;        /* int8: rows [xf_m0, M) of x in float32 (row stride K), or NULL */
    long xf_m0;
} job_t;

static inline void store_row(const job_t *j, long n, long m0, int mt, const float *out)
{
    float s = j->scale ? bf16_to_f32(j->scale[n]) : 1.0f;
    float b = j->bias ? bf16_to_f32(j->bias[n]) : 0.0f;
    for (int m = 0; m < mt; m++) {
        float v = out[m];
        if (j->scale) v = v * s;
        if (j->bias) v = v + b;
        long idx = (m0 + m) * j->N + n;
        if (j->y_f32) ((float *)j->y)[idx] = v;
        else ((uint16_t *)j->y)[idx] = f32_to_bf16(v);
    }
}

/* rows [n0, n1) of w against all M rows of x */
static void run_rows(const job_t *j, long n0, long n1)
{
    const long K = j->K;
    float out[MAXMT];
    for (long n = n0; n < n1; n++) {
        /* prefetch ahead on the first pass over a row only; later passes read it from L1 */
        long pfd = g_pf_dist;
        for (long m0 = 0; m0 < j->M; m0 += MAXMT, pfd = 0) {
            int mt = (int)((j->M - m0) < MAXMT ? (j->M - m0) : MAXMT);
            if (j->is_i8) {
                const int8_t *w = (const int8_t *)j->w + n * K;
                if (j->xf && m0 == j->xf_m0) F_I8[mt](j->xf, K, w, K, out, pfd);
                else DP_I8[mt](j->x + m0 * K, K, w, K, out, pfd);
            } else {
                DP_BF[mt](j->x + m0 * K, K, (const uint16_t *)j->w + n * K, K, out, pfd);
            }
            store_row(j, n, m0, mt, out);
        }
    }
}

static void run(job_t *j, int nthreads)
{
    if (j->M <= 0 || j->N <= 0) return;
    if (j->K <= 0) {  /* empty sums: y = bias (or 0) */
        float zero[MAXMT] = {0};
        for (long n = 0; n < j->N; n++)
            for (long m0 = 0; m0 < j->M; m0 += MAXMT)
                store_row(j, n, m0, (int)((j->M - m0) < MAXMT ? (j->M - m0) : MAXMT), zero);
        return;
    }
    float *xf = NULL;
    long last_m0 = (j->M - 1) / MAXMT * MAXMT;
    if (j->is_i8 && j->M - last_m0 <= F_MAXMT) {
        /* the last pass's rows of x (all of x when M <= 2) go the float32 way */
        long cnt = (j->M - last_m0) * j->K;
        xf = (float *)aligned_alloc(64, ((size_t)cnt * sizeof(float) + 63) / 64 * 64);
        if (xf) {
            const uint16_t *src = j->x + last_m0 * j->K;
            long i = 0;
            for (; i + 16 <= cnt; i += 16)
                _mm512_storeu_ps(xf + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i))), 16)));
            for (; i < cnt; i++) xf[i] = bf16_to_f32(src[i]);
            j->xf = xf;
            j->xf_m0 = last_m0;
        }
    }
    long nblocks = (j->N + ROW_ALIGN - 1) / ROW_ALIGN;
    long bytes = j->N * j->K * (j->is_i8 ? 1 : 2) * ((j->M + MAXMT - 1) / MAXMT);
    if (nthreads < 1) nthreads = 1;
    if (nthreads > nblocks) nthreads = (int)nblocks;
    if (bytes < g_min_parallel) nthreads = 1;
    if (nthreads == 1) {
        run_rows(j, 0, j->N);
    } else {
#pragma omp parallel for num_threads(nthreads) schedule(static, 1)
        for (int t = 0; t < nthreads; t++) {
            long n0 = nblocks * t / nthreads * ROW_ALIGN;
            long n1 = nblocks * (t + 1) / nthreads * ROW_ALIGN;
            run_rows(j, n0, n1 < j->N ? n1 : j->N);
        }
    }
    free(xf);
}

/* ---- exported entry points ---- */

void gemv_int8(const uint16_t *x, const int8_t *w, const uint16_t *scale, const uint16_t *bias,
               uint16_t *y, int M, int N, int K, int nthreads)
{
    job_t j = {x, w, scale, bias, y, 0, 1, M, N, K, NULL, 0};
    run(&j, nthreads);
}

void gemv_int8_f32(const uint16_t *x, const int8_t *w, const uint16_t *scale, const uint16_t *bias,
                   float *y, int M, int N, int K, int nthreads)
{
    job_t j = {x, w, scale, bias, y, 1, 1, M, N, K, NULL, 0};
    run(&j, nthreads);
}

void gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
               int M, int N, int K, int nthreads)
{
    job_t j = {x, w, NULL, bias, y, 0, 0, M, N, K, NULL, 0};
    run(&j, nthreads);
}

void gemv_bf16_f32(const uint16_t *x, const uint16_t *w, const uint16_t *bias, float *y,
                   int M, int N, int K, int nthreads)
{
    job_t j = {x, w, NULL, bias, y, 1, 0, M, N, K, NULL, 0};
    run(&j, nthreads);
}
