/* Matrix x few-rows kernels for LLM decode on x86-64 CPUs with AVX-512 (F, BW, VL, BF16).

   y[m, n] = sum_k x[m, k] * w[n, k]     (then * scale[n] for int8 weights, then + bias[n])

   x: (M, K) bfloat16, w: (N, K) row-major (int8, per-output-channel symmetric, or bfloat16),
   y: (M, N) bfloat16 (or float32 for the *_f32 variants). Accumulation is float32; x is used
   as stored (weight-only quantization: x is never quantized).

   At a few rows of x the work is reading w from memory once, so the design serves one
   sequential stream of weight bytes per thread:

   - OpenMP threads (static) each own a contiguous range of rows of w, i.e. one contiguous range
     of memory. They walk it in groups of 16 rows: in address order, row after row (or R rows
     side by side, R = 2..4 for 2..8 rows of x, so that a load of x serves R rows of w).
   - A software prefetch cursor runs g_pf_dist bytes ahead of the reads, into L2, one line per
     line read, across row boundaries: rows as short as 1 KiB (K = 1024 int8) stream as well as
     long ones, whatever order the tiles read the lines of their group in. The lines between a
     thread's start and the cursor's start are requested all at once when the thread starts.
   - x beyond X_L1_BYTES (many rows of x, long K) is split along K into chunks that stay in L1;
     each chunk serves the group's 16 rows (the cursor then runs a group further ahead).
   - One row of x and int8 weights: x is converted to float32 once per call; per 16 weights one
     sign-extension, one int->float conversion and one FMA.
   - bfloat16 weights, and int8 with 2+ rows of x: AVX512-BF16 `vdpbf16ps` (32 multiply-adds
     per instruction; both products of a pair exact in float32, summed in float32). int8 weights
     become bfloat16 exactly (every integer in [-256, 256] is a bfloat16): sign-extend, convert
     to float32, pack two vectors into one of 32 bfloat16, shared by all rows of x.
   - Several independent accumulators per (row of w, row of x) hide the FMA latency; the 16
     partial sums of 16 rows are reduced together (shuffles), then scaled, biased, rounded to
     bfloat16 (nearest even) and stored 16 outputs at a time.
   - K tails use masked loads (zeros beyond K).
   - Built with -fopenmp and loaded into a process that already has torch's libgomp.so.1, the
     kernels run on the same OpenMP runtime (and thread pool) as torch's own kernels.
   Every output is summed by one thread in a fixed order: results do not depend on the thread
   count.
*/

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAXMT 8  /* rows of x per pass over a group of rows of w */
#define F_MAXMT 1  /* int8 against at most this many rows of x (in a pass) uses float32 x */
#define ROW_ALIGN 16  /* thread ranges start at multiples of this many rows (a GROUP) */

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

/* ---- tile kernels ----
   nrows (a multiple of R) consecutive rows of w (row stride ldw elements), R at a time, against
   MT rows of x (row stride ldx), over `len` elements of K. Accumulates into accio[r * MT + m]
   (16 partial sums each; zeroed first when init). The main loop consumes 256 bytes (4 cache
   lines) of each row per iteration; NA independent accumulators per (row of w, row of x).

   Prefetch: *pfp (when pfp != NULL) is the thread's prefetch cursor, a fixed distance ahead of
   its reads in its contiguous range of w; every iteration prefetches (into L2) as many lines
   at the cursor as the iteration reads, and moves it on, up to the end of the thread's range
   (past the end of the weights lie other data or unmapped pages). The hardware sees one
   sequential stream per thread whatever order the tiles read their group of rows in. */

#define IT_BYTES 256

typedef struct {
    const char *at;   /* next line to prefetch */
    const char *end;  /* end of the thread's rows: nothing is prefetched from there on */
} cursor_t;

/* PF_HINT, X_L1_BYTES and the R_* tile sizes can be overridden with -D for experiments */
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif

#define TILE_BEGIN(R, MT, NA)                                                                  \
    const char *pf = pfp ? pfp->at : NULL, *const pf_end = pfp ? pfp->end : NULL;            \
    for (long rr = 0; rr < nrows; rr += R, w += R * ldw, accio += R * MT) {                   \
    __m512 acc[R][NA][MT];                                                                    \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                        \
    _Pragma("GCC unroll 8") for (int a = 0; a < NA; a++)                                       \
    _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++)                                      \
        acc[r][a][m] = (a == 0 && !init) ? accio[r * MT + m] : _mm512_setzero_ps();

#define TILE_PREFETCH(R)                                                                       \
    if (pf < pf_end) {                                                                        \
        _Pragma("GCC unroll 16") for (int l = 0; l < 4 * (R); l++)                            \
            _mm_prefetch(pf + 64 * l, PF_HINT);                                               \
        pf += (R) * IT_BYTES;                                                                 \
    }

#define TILE_END(R, MT, NA)                                                                    \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                        \
    _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                                    \
        __m512 t = acc[r][0][m];                                                              \
        _Pragma("GCC unroll 8") for (int a = 1; a < NA; a++) t = _mm512_add_ps(t, acc[r][a][m]); \
        accio[r * MT + m] = t;                                                                \
    }                                                                                         \
    }                                                                                         \
    if (pfp) pfp->at = pf;

#define TILE_ARGS(XT, WT)                                                                      \
    const XT *x, long ldx, const WT *w, long ldw, long len, long nrows, __m512 *accio,         \
    int init, cursor_t *pfp

/* bfloat16 products (vdpbf16ps) against bfloat16 x */
#define TILE_DP(NAME, WT, LOAD, LOADT, R, MT, NA)                                                \
static void NAME(TILE_ARGS(uint16_t, WT))                                                     \
{                                                                                             \
    TILE_BEGIN(R, MT, NA)                                                                     \
    enum { PER_IT = IT_BYTES / (int)sizeof(WT) };                                             \
    long k = 0;                                                                               \
    for (; k + PER_IT <= len; k += PER_IT) {                                                  \
        TILE_PREFETCH(R)                                                                      \
        _Pragma("GCC unroll 8") for (int h = 0; h < PER_IT / 32; h++) {                        \
            __m512bh wv[R];                                                                   \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) wv[r] = LOAD(w + r * ldw + k + 32 * h); \
            _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                            \
                __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + m * ldx + k + 32 * h)); \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                           \
                    acc[r][h % NA][m] = _mm512_dpbf16_ps(acc[r][h % NA][m], wv[r], xv);       \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (; k < len; k += 32) {                                                                \
        __mmask32 mask = (len - k) >= 32 ? (__mmask32)0xffffffffu                             \
                                         : (__mmask32)((1u << (len - k)) - 1);                \
        __m512bh wv[R];                                                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) wv[r] = LOADT(w + r * ldw + k, mask); \
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                                \
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k);          \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                               \
                acc[r][0][m] = _mm512_dpbf16_ps(acc[r][0][m], wv[r], xv);                     \
        }                                                                                     \
    }                                                                                         \
    TILE_END(R, MT, NA)                                                                       \
}

/* int8 weights against float32 x (FMA) */
#define TILE_F(NAME, R, MT, NA)                                                                   \
static void NAME(TILE_ARGS(float, int8_t))                                                    \
{                                                                                             \
    TILE_BEGIN(R, MT, NA)                                                                     \
    long k = 0;                                                                               \
    for (; k + IT_BYTES <= len; k += IT_BYTES) {                                              \
        TILE_PREFETCH(R)                                                                      \
        _Pragma("GCC unroll 16") for (int h = 0; h < IT_BYTES / 16; h++) {                     \
            __m512 wv[R];                                                                     \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) wv[r] = load_w_i8_f32(w + r * ldw + k + 16 * h); \
            _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                            \
                __m512 xv = _mm512_loadu_ps(x + m * ldx + k + 16 * h);                        \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                           \
                    acc[r][h % NA][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][h % NA][m]);        \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (; k < len; k += 16) {                                                                \
        __mmask16 mask = (len - k) >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (len - k)) - 1); \
        __m512 wv[R];                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) wv[r] = load_w_i8_f32_tail(w + r * ldw + k, mask); \
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                                \
            __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * ldx + k);                         \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                               \
                acc[r][0][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][0][m]);                      \
        }                                                                                     \
    }                                                                                         \
    TILE_END(R, MT, NA)                                                                       \
}

/* Tiles per rows of x (MT): R rows of w and NA accumulators, so that R*MT*NA accumulators,
   R weight vectors and a vector of x fit the 32 registers; plus a one-row tile per MT for the
   rows left over at the end of a thread's range. */
#ifndef R_DP2
#define R_DP2 2
#endif
#ifndef R_DP36
#define R_DP36 4
#endif
#ifndef R_DP78
#define R_DP78 2
#endif
#define TILES_DP(PFX, WT, LOAD, LOADT)                                                           \
    TILE_DP(PFX##_1, WT, LOAD, LOADT, 1, 1, 4)                                                    \
    TILE_DP(PFX##_2, WT, LOAD, LOADT, R_DP2, 2, 2)                                                \
    TILE_DP(PFX##_3, WT, LOAD, LOADT, R_DP36, 3, 1)                                               \
    TILE_DP(PFX##_4, WT, LOAD, LOADT, R_DP36, 4, 1)                                               \
    TILE_DP(PFX##_5, WT, LOAD, LOADT, R_DP36, 5, 1)                                               \
    TILE_DP(PFX##_6, WT, LOAD, LOADT, R_DP36, 6, 1)                                               \
    TILE_DP(PFX##_7, WT, LOAD, LOADT, R_DP78, 7, 1)                                               \
    TILE_DP(PFX##_8, WT, LOAD, LOADT, R_DP78, 8, 1)                                               \
    TILE_DP(PFX##_r2, WT, LOAD, LOADT, 1, 2, 2)                                                   \
    TILE_DP(PFX##_r3, WT, LOAD, LOADT, 1, 3, 2)                                                   \
    TILE_DP(PFX##_r4, WT, LOAD, LOADT, 1, 4, 1)                                                   \
    TILE_DP(PFX##_r5, WT, LOAD, LOADT, 1, 5, 1)                                                   \
    TILE_DP(PFX##_r6, WT, LOAD, LOADT, 1, 6, 1)                                                   \
    TILE_DP(PFX##_r7, WT, LOAD, LOADT, 1, 7, 1)                                                   \
    TILE_DP(PFX##_r8, WT, LOAD, LOADT, 1, 8, 1)

TILES_DP(dpi8, int8_t, load_w_i8, load_w_i8_tail)
TILES_DP(dpbf, uint16_t, load_w_bf16, load_w_bf16_tail)
TILE_F(fi8_1, 1, 1, 4)

typedef void (*tile_i8_fn)(TILE_ARGS(uint16_t, int8_t));
typedef void (*tile_bf_fn)(TILE_ARGS(uint16_t, uint16_t));
typedef void (*tile_f_fn)(TILE_ARGS(float, int8_t));

static const int R_DP[MAXMT + 1] = {0, 1, R_DP2, R_DP36, R_DP36, R_DP36, R_DP36, R_DP78, R_DP78};
static const int R_F[F_MAXMT + 1] = {0, 1};
static const tile_i8_fn DP_I8[2][MAXMT + 1] = {
    {0, dpi8_1, dpi8_2, dpi8_3, dpi8_4, dpi8_5, dpi8_6, dpi8_7, dpi8_8},
    {0, dpi8_1, dpi8_r2, dpi8_r3, dpi8_r4, dpi8_r5, dpi8_r6, dpi8_r7, dpi8_r8}};
static const tile_bf_fn DP_BF[2][MAXMT + 1] = {
    {0, dpbf_1, dpbf_2, dpbf_3, dpbf_4, dpbf_5, dpbf_6, dpbf_7, dpbf_8},
    {0, dpbf_1, dpbf_r2, dpbf_r3, dpbf_r4, dpbf_r5, dpbf_r6, dpbf_r7, dpbf_r8}};
static const tile_f_fn F_I8[2][F_MAXMT + 1] = {{0, fi8_1}, {0, fi8_1}};

/* ---- drivers ---- */

#define GROUP 16          /* rows of w per group */
#ifndef X_L1_BYTES
#define X_L1_BYTES 16384  /* x (the rows of a pass) is split along K to stay within this */
#endif

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

static inline __m512 load_bf16x16(const uint16_t *p, __mmask16 mask)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

/* outputs of rows [n, n + g) (g <= 16) for rows [m0, m0 + mt) of x; acc[r * mt + m] holds the
   16 partial sums of (row n + r, row m0 + m); entries of rows >= g are ignored */
static void store_group(const job_t *j, long n, int g, long m0, int mt, __m512 *acc)
{
    __mmask16 mask = (__mmask16)((1u << g) - 1);
    for (int r = g; r < 16; r++)
        for (int m = 0; m < mt; m++) acc[r * mt + m] = _mm512_setzero_ps();
    __m512 s = j->scale ? load_bf16x16(j->scale + n, mask) : _mm512_set1_ps(1.0f);
    __m512 b = j->bias ? load_bf16x16(j->bias + n, mask) : _mm512_setzero_ps();
    for (int m = 0; m < mt; m++) {
        __m512 v = hsum16(acc + m, mt);
        if (j->scale) v = _mm512_mul_ps(v, s);
        if (j->bias) v = _mm512_add_ps(v, b);
        long idx = (m0 + m) * j->N + n;
        if (j->y_f32) _mm512_mask_storeu_ps((float *)j->y + idx, mask, v);
        else _mm256_mask_storeu_epi16((uint16_t *)j->y + idx, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* rows [n, n + g) of w (g <= GROUP) against rows [m0, m0 + mt) of x, K in chunks of kc */
static void run_group(const job_t *j, long n, int g, long m0, int mt, long kc, cursor_t *pfp,
                      __m512 *acc)
{
    const long K = j->K;
    const int use_f = j->is_i8 && j->xf && m0 == j->xf_m0;
    const int R = use_f ? R_F[mt] : R_DP[mt];
    const long full = g / R * R;  /* rows done by R-row tiles; the rest one at a time */
    for (long k0 = 0; k0 < K; k0 += kc) {
        long len = K - k0 < kc ? K - k0 : kc;
        int init = (k0 == 0);
        for (int one = 0; one < 2; one++) {
            long r0 = one ? full : 0, nr = one ? g - full : full;
            if (nr == 0) continue;
            __m512 *a = acc + r0 * mt;
            if (use_f)
                F_I8[one][mt](j->xf + k0, K, (const int8_t *)j->w + (n + r0) * K + k0, K, len, nr, a, init, pfp);
            else if (j->is_i8)
                DP_I8[one][mt](j->x + m0 * K + k0, K, (const int8_t *)j->w + (n + r0) * K + k0, K, len, nr, a, init, pfp);
            else
                DP_BF[one][mt](j->x + m0 * K + k0, K, (const uint16_t *)j->w + (n + r0) * K + k0, K, len, nr, a, init, pfp);
        }
    }
    store_group(j, n, g, m0, mt, acc);
}

/* K chunk for rows [m0, m0 + mt) of x: all of K when those rows of x fit X_L1_BYTES */
static long chunk_for(const job_t *j, long m0, int mt)
{
    long xsz = (j->is_i8 && j->xf && m0 == j->xf_m0) ? 4 : 2;
    if ((long)mt * j->K * xsz <= X_L1_BYTES) return j->K;
    long kc = X_L1_BYTES / (mt * xsz) / IT_BYTES * IT_BYTES;
    return kc < IT_BYTES ? IT_BYTES : kc;
}

/* rows [n0, n1) of w against all M rows of x, in groups of GROUP rows */
static void run_rows(const job_t *j, long n0, long n1)
{
    const long K = j->K;
    const long esz = j->is_i8 ? 1 : 2;
    __m512 acc[GROUP * MAXMT];
    /* Where the prefetch cursor starts, from a group's first byte: g_pf_dist further than the
       span read at once: a row (rows read in address order), R rows side by side, or the whole
       group when K is split in chunks (the group is then read chunk by chunk). */
    int mt0 = (int)(j->M < MAXMT ? j->M : MAXMT);
    int R0 = (j->is_i8 && j->xf && j->xf_m0 == 0) ? R_F[mt0] : R_DP[mt0];
    long span = chunk_for(j, 0, mt0) < K ? GROUP : (R0 > 1 ? R0 : 0);
    long ahead = span * K * esz + g_pf_dist;
    cursor_t pf = {NULL, (const char *)j->w + n1 * K * esz};
    cursor_t *pfp = g_pf_dist > 0 ? &pf : NULL;
    if (pfp) {  /* the lines the cursor starts ahead of: requested at once, not left to demand */
        const char *p0 = (const char *)j->w + n0 * K * esz;
        long end = (n1 - n0) * K * esz < ahead ? (n1 - n0) * K * esz : ahead;
        for (long off = 0; off < end; off += 64) _mm_prefetch(p0 + off, PF_HINT);
    }
    for (long n = n0; n < n1; n += GROUP) {
        int g = (int)(n1 - n < GROUP ? n1 - n : GROUP);
        /* set per group: the tiles move it on by what they read, K tails not counted */
        pf.at = (const char *)j->w + n * K * esz + ahead;
        for (long m0 = 0; m0 < j->M; m0 += MAXMT) {
            int mt = (int)((j->M - m0) < MAXMT ? (j->M - m0) : MAXMT);
            /* later passes (M > 8) re-read the group's rows from cache: no prefetch */
            run_group(j, n, g, m0, mt, chunk_for(j, m0, mt), m0 == 0 ? pfp : NULL, acc);
        }
    }
}

static void run(job_t *j, int nthreads)
{
    if (j->M <= 0 || j->N <= 0) return;
    if (j->K <= 0) {  /* empty sums: y = bias (or 0) */
        __m512 zero[GROUP * MAXMT];
        for (long n = 0; n < j->N; n += GROUP)
            for (long m0 = 0; m0 < j->M; m0 += MAXMT) {
                int mt = (int)((j->M - m0) < MAXMT ? (j->M - m0) : MAXMT);
                for (int i = 0; i < GROUP * mt; i++) zero[i] = _mm512_setzero_ps();
                store_group(j, n, (int)(j->N - n < GROUP ? j->N - n : GROUP), m0, mt, zero);
            }
        return;
    }
    float *xf = NULL;
    long last_m0 = (j->M - 1) / MAXMT * MAXMT;
    if (j->is_i8 && j->M - last_m0 <= F_MAXMT) {
        /* the last pass's rows of x (all of x when M == 1) go the float32 way */
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

/* ---------------------------------------------------------------------------------------------
   Decode attention of a group of N queries (beams) that share a prompt and own a tail each:
       out[n, h] = softmax_t(scale * q[n, h] . k[t]) @ v[t],  t over [prompt | tail of n]
   q (N, H, D) float32 contiguous; out (N, H, D) float32. Keys/values bfloat16, d contiguous:
       prompt  pk[h * psh + t * pst + d], t < P (shared by every query; read once per block of 8)
       tail    tk[n * tsn + h * tsh + t * tst + d], t < T
   Scores, softmax and sums in float32. D must be a multiple of 16. Heads split across threads. */

static inline __m512 bf16_16(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

#define ATT_QB 8 /* queries per pass over the keys */
#define ATT_MAXD 512 /* the paged kernel's largest head_dim */

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

/* s[0 .. L) <- softmax(s), in place, float32, 16 lanes at a time */
static inline void softmax_f32(float *s, int L)
{
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < L; t += 16) {
        const __mmask16 m = L - t >= 16 ? 0xFFFF : (__mmask16)((1u << (L - t)) - 1);
        mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, s + t));
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int t = 0; t < L; t += 16) {
        const __mmask16 m = L - t >= 16 ? 0xFFFF : (__mmask16)((1u << (L - t)) - 1);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), top));
        sum = _mm512_mask_add_ps(sum, m, sum, e);
        _mm512_mask_storeu_ps(s + t, m, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int t = 0; t < L; t += 16) {
        const __mmask16 m = L - t >= 16 ? 0xFFFF : (__mmask16)((1u << (L - t)) - 1);
        _mm512_mask_storeu_ps(s + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + t), inv));
    }
}

static void attend_head(const float *q, int N, int H, int D, int h,
                        const uint16_t *pk, const uint16_t *pv, long psh, long pst, int P,
                        const uint16_t *tk, const uint16_t *tv, long tsn, long tsh, long tst, int T,
                        float *out, float scale, float *s)
{
    const int L = P + T;
    for (int n0 = 0; n0 < N; n0 += ATT_QB) {
        const int nb = N - n0 < ATT_QB ? N - n0 : ATT_QB;
        /* prompt scores: each key row read once for the block's queries */
        for (int t = 0; t < P; t++) {
            const uint16_t *kr = pk + h * psh + t * pst;
            __m512 a[ATT_QB];
            for (int i = 0; i < nb; i++) a[i] = _mm512_setzero_ps();
            for (int d = 0; d < D; d += 16) {
                __m512 kv = bf16_16(kr + d);
                for (int i = 0; i < nb; i++)
                    a[i] = _mm512_fmadd_ps(kv, _mm512_loadu_ps(q + ((long)(n0 + i) * H + h) * D + d), a[i]);
            }
            for (int i = 0; i < nb; i++) s[(long)i * L + t] = _mm512_reduce_add_ps(a[i]) * scale;
        }
        /* tail scores and the softmax, per query */
        for (int i = 0; i < nb; i++) {
            const int n = n0 + i;
            const float *qn = q + ((long)n * H + h) * D;
            float *sn = s + (long)i * L;
            for (int t = 0; t < T; t++) {
                const uint16_t *kr = tk + n * tsn + h * tsh + t * tst;
                __m512 a = _mm512_setzero_ps();
                for (int d = 0; d < D; d += 16) a = _mm512_fmadd_ps(bf16_16(kr + d), _mm512_loadu_ps(qn + d), a);
                sn[P + t] = _mm512_reduce_add_ps(a) * scale;
            }
            softmax_f32(sn, L);
            float *on = out + ((long)n * H + h) * D;
            for (int d = 0; d < D; d++) on[d] = 0.0f;
        }
        /* prompt values: each value row read once for the block's queries */
        for (int t = 0; t < P; t++) {
            const uint16_t *vr = pv + h * psh + t * pst;
            for (int d = 0; d < D; d += 16) {
                __m512 vv = bf16_16(vr + d);
                for (int i = 0; i < nb; i++) {
                    float *o = out + ((long)(n0 + i) * H + h) * D + d;
                    _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_set1_ps(s[(long)i * L + t]), vv, _mm512_loadu_ps(o)));
                }
            }
        }
        for (int i = 0; i < nb; i++) {
            const int n = n0 + i;
            float *on = out + ((long)n * H + h) * D;
            for (int t = 0; t < T; t++) {
                const uint16_t *vr = tv + n * tsn + h * tsh + t * tst;
                const __m512 p = _mm512_set1_ps(s[(long)i * L + P + t]);
                for (int d = 0; d < D; d += 16)
                    _mm512_storeu_ps(on + d, _mm512_fmadd_ps(p, bf16_16(vr + d), _mm512_loadu_ps(on + d)));
            }
        }
    }
}

int attend_group_bf16(const float *q, int N, int H, int D,
                      const uint16_t *pk, const uint16_t *pv, long psh, long pst, int P,
                      const uint16_t *tk, const uint16_t *tv, long tsn, long tsh, long tst, int T,
                      float *out, float scale, int nthreads)
{
    if (D % 16 || P + T < 1 || N < 1) return -1;
    const long L = P + T;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *s = malloc(sizeof(float) * ATT_QB * L);
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int h = 0; h < H; h++)
            if (s) attend_head(q, N, H, D, h, pk, pv, psh, pst, P, tk, tv, tsn, tsh, tst, T, out, scale, s);
        free(s);
    }
    return failed ? -2 : 0;
}

/* ---------------------------------------------------------------------------------------------
   Paged decode attention of a whole decode batch in one call (engine/attention.py, PagedBatch).
   Keys/values live in blocks: kc, vc bfloat16 (n_blocks, H, B, D) contiguous, so token t of a
   block table lies in block tab[t / B] at row t % B. Group g (a request: one sequence, or the
   beams of a beam search) has query rows row0[g] .. row0[g+1] - 1 of q (N, H, D) float32 and reads
       its shared blocks  stab[soff[g] ..]     holding slen[g] tokens (every row of the group)
       then each row n's  otab[n * omax ..]    holding olen[g] tokens (its own blocks)
   out (N, H, D) float32 = softmax(scale * q . k) @ v over those tokens. q holds bfloat16 values
   (a bfloat16 model's queries): scores are vdpbf16ps dot products (exact products, float32 sums),
   16 keys at a time with one transposed reduction; softmax (vectorized exp) and value sums in
   float32. Work items are (group, range of heads) pairs spread over threads; an item walks its
   blocks in address order, every head of a block (B x D rows each, one after another) serving
   all the group's queries while it is in cache, so the KV memory is read as a stream rather than
   one head's 2-8 KiB at a time across the whole pool. */

/* q (D float32, bfloat16 values) as D / 32 vectors of 32 bfloat16 (zeros past D) */
static inline void q_bf16(const float *q, int D, __m512bh *qb)
{
    for (int d = 0; d < D; d += 32) {
        const __m512 lo = _mm512_loadu_ps(q + d), hi = d + 16 < D ? _mm512_loadu_ps(q + d + 16) : _mm512_setzero_ps();
        qb[d / 32] = _mm512_cvtne2ps_pbh(hi, lo);
    }
}

/* dst[c] = scale * q . k[c] for the n <= 16 keys k[c] = kr + c * D: vdpbf16ps (products exact in
   float32, summed in float32), 16 independent sums, then one transposed reduction (hsum16) for all
   16 scores instead of one horizontal sum per key */
static inline void scores16(const __m512bh *qb, const uint16_t *kr, int n, int D, float scale, float *dst)
{
    __m512 a[16];
#pragma GCC unroll 16
    for (int c = 0; c < 16; c++) a[c] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 32) {
        const __mmask32 m = D - d >= 32 ? 0xFFFFFFFFu : 0xFFFFu;
#pragma GCC unroll 16 /* whole: the 16 sums stay in registers */
        for (int c = 0; c < 16; c++)
            if (c < n)
                a[c] = _mm512_dpbf16_ps(a[c], (__m512bh)_mm512_maskz_loadu_epi16(m, kr + (long)c * D + d), qb[d / 32]);
    }
    const __mmask16 m = n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
    _mm512_mask_storeu_ps(dst, m, _mm512_mul_ps(hsum16(a, 1), _mm512_set1_ps(scale)));
}

/* o[0 .. D) += sum_c p[c] * v[c] for the n value rows v[c] = rows + c * D, bfloat16 (vr) or float32
   (vf, when vr is NULL); p float32. Up to 256 of D at a time: the sums stay in registers over the
   n rows. (Inlined with a constant vr or vf: each caller gets its own loop.) */
static inline void values_acc(const float *p, const uint16_t *vr, const float *vf, int n, int D, float *o)
{
    for (int d0 = 0; d0 < D; d0 += 256) {
        const int nk = (D - d0 < 256 ? D - d0 : 256) / 16;
        __m512 acc[16];
#pragma GCC unroll 16 /* whole: the sums stay in registers */
        for (int i = 0; i < 16; i++)
            if (i < nk) acc[i] = _mm512_loadu_ps(o + d0 + i * 16);
        for (int c = 0; c < n; c++) {
            const __m512 pc = _mm512_set1_ps(p[c]);
            const long r = (long)c * D + d0;
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++)
                if (i < nk)
                    acc[i] = _mm512_fmadd_ps(pc, vr ? bf16_16(vr + r + i * 16) : _mm512_loadu_ps(vf + r + i * 16), acc[i]);
        }
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            if (i < nk) _mm512_storeu_ps(o + d0 + i * 16, acc[i]);
    }
}

/* the cache lines of [p, p + bytes) toward L1: a block's head rows one block ahead of their use
   (the blocks of a table lie anywhere in the pool: the hardware prefetchers cannot guess the next) */
static inline void prefetch_span(const uint16_t *p, long bytes)
{
    for (long o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T0);
}

/* Rows [r0, r0 + nr) of one group, heads [h0, h1): blocks are walked in address order (each block
   holds every head's rows, B x D each, one after another), every head's rows of a block serving
   all the group's queries (up to ATT_QB at a time) while they are in cache. s: ATT_QB x (h1 - h0) x L. */
static void paged_group(const float *q, int H, int D, int h0, int h1, const uint16_t *kc, const uint16_t *vc,
                        int B, int r0, int nr, const int *stab, int sl, const int *otab, int omax, int ol,
                        float *out, float scale, float *s)
{
    const long hs = (long)B * D, bs = (long)H * hs;
    const int L = sl + ol, nh = h1 - h0;
    __m512bh qb[ATT_QB][ATT_MAXD / 32];
#define QB(i) qb[i]
#define S(i, h) (s + ((long)(i) * nh + ((h) - h0)) * L)
#define Q(n, h) (q + ((long)(n) * H + (h)) * D)
#define O(n, h) (out + ((long)(n) * H + (h)) * D)
    for (int n0 = r0; n0 < r0 + nr; n0 += ATT_QB) {
        const int nb = r0 + nr - n0 < ATT_QB ? r0 + nr - n0 : ATT_QB;
        for (int j = 0; j * B < sl; j++) { /* shared blocks: scores of every query */
            const int tn = sl - j * B < B ? sl - j * B : B;
            for (int h = h0; h < h1; h++) {
                const uint16_t *kb = kc + stab[j] * bs + h * hs;
                if ((j + 1) * B < sl) prefetch_span(kc + stab[j + 1] * bs + h * hs, hs * 2);
                for (int i = 0; i < nb; i++) {
                    q_bf16(Q(n0 + i, h), D, QB(i));
                    for (int c = 0; c < tn; c += 16)
                        scores16(QB(i), kb + (long)c * D, tn - c < 16 ? tn - c : 16, D, scale, S(i, h) + j * B + c);
                }
            }
        }
        for (int i = 0; i < nb; i++) { /* each query's own blocks */
            const int n = n0 + i;
            for (int j = 0; j * B < ol; j++) {
                const int tn = ol - j * B < B ? ol - j * B : B;
                for (int h = h0; h < h1; h++) {
                    const uint16_t *kb = kc + otab[(long)n * omax + j] * bs + h * hs;
                    if ((j + 1) * B < ol) prefetch_span(kc + otab[(long)n * omax + j + 1] * bs + h * hs, hs * 2);
                    q_bf16(Q(n, h), D, QB(0));
                    for (int c = 0; c < tn; c += 16)
                        scores16(QB(0), kb + (long)c * D, tn - c < 16 ? tn - c : 16, D, scale, S(i, h) + sl + j * B + c);
                }
            }
            for (int h = h0; h < h1; h++) {
                softmax_f32(S(i, h), L);
                memset(O(n, h), 0, sizeof(float) * D);
            }
        }
        for (int j = 0; j * B < sl; j++) { /* shared values */
            const int tn = sl - j * B < B ? sl - j * B : B;
            for (int h = h0; h < h1; h++) {
                const uint16_t *vb = vc + stab[j] * bs + h * hs;
                if ((j + 1) * B < sl) prefetch_span(vc + stab[j + 1] * bs + h * hs, hs * 2);
                for (int i = 0; i < nb; i++) values_acc(S(i, h) + j * B, vb, NULL, tn, D, O(n0 + i, h));
            }
        }
        for (int i = 0; i < nb; i++) { /* own values */
            const int n = n0 + i;
            for (int j = 0; j * B < ol; j++) {
                const int tn = ol - j * B < B ? ol - j * B : B;
                for (int h = h0; h < h1; h++) {
                    if ((j + 1) * B < ol) prefetch_span(vc + otab[(long)n * omax + j + 1] * bs + h * hs, hs * 2);
                    values_acc(S(i, h) + sl + j * B, vc + otab[(long)n * omax + j] * bs + h * hs, NULL, tn, D, O(n, h));
                }
            }
        }
    }
#undef QB
#undef S
#undef Q
#undef O
}

int attend_paged_bf16(const float *q, int N, int H, int D, const uint16_t *kc, const uint16_t *vc, int B,
                      int G, const int *row0, const int *stab, const int *soff, const int *slen,
                      const int *otab, int omax, const int *olen, float *out, float scale, int nthreads)
{
    if (D % 16 || D > ATT_MAXD || G < 1 || N < 1 || B < 1 || H < 1) return -1;
    long maxL = 0;
    for (int g = 0; g < G; g++) {
        if (slen[g] + olen[g] < 1 || row0[g + 1] <= row0[g]) return -1;
        if (slen[g] + olen[g] > maxL) maxL = slen[g] + olen[g];
    }
    /* work items: (group, range of heads); a group's heads are split only as far as it takes to
       give every thread about two items (a group's heads together read each block in one sweep) */
    int parts = nthreads > 1 ? (2 * nthreads + G - 1) / G : 1;
    if (parts > H) parts = H;
    const int hper = (H + parts - 1) / parts;
    parts = (H + hper - 1) / hper;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *s = malloc(sizeof(float) * ATT_QB * hper * maxL);
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long w = 0; w < (long)G * parts; w++) {
            const int g = (int)(w / parts), h0 = (int)(w % parts) * hper;
            const int h1 = h0 + hper < H ? h0 + hper : H;
            if (s) paged_group(q, H, D, h0, h1, kc, vc, B, row0[g], row0[g + 1] - row0[g], stab + soff[g], slen[g],
                               otab, omax, olen[g], out, scale, s);
        }
        free(s);
    }
    return failed ? -2 : 0;
}

/* ---------------------------------------------------------------------------------------------
   Paged prefill attention (engine/attention.py, PagedBatch, a prompt chunk): T queries at
   positions start .. start + T - 1 of one sequence, each attending causally over positions
   0 .. its own, whose keys/values are already stored in the blocks of table tab (this chunk's
   included). One work item per (head, tile of PF_QT = 16 queries); the lanes of every vector are
   the tile's 16 queries:
   - the tile's queries are packed once as D/2 vectors of 16 pairs (q[i][2p], q[i][2p + 1]);
   - scores, 16 keys at a time: acc[c] += vdpbf16ps(packed pair p, key c's pair p broadcast), so one
     vector holds key c's scores against all 16 queries (exact bfloat16 products, float32 sums) with
     no horizontal sums; the causal mask is a lane mask on the keys past the tile's first query;
   - softmax over the keys is element-wise across those vectors (max, exp, sum) for 16 queries at once;
   - values: the probabilities are rounded to bfloat16, as HF rounds them to the values' dtype before
     its matmul, and packed in pairs of keys per query; value rows are interleaved in pairs (d-lanes),
     and out[i][d .. d + 16] += vdpbf16ps(value pair, query i's probability pair broadcast), float32.
   q bfloat16 at q[t * sq + h * D + d]; kc, vc (n_blocks, H, B, D) bfloat16, B even; out bfloat16 at
   out[t * so + h * D + d], rounded to nearest even once. */

#define PF_QT 16 /* queries per tile */

static const int16_t PAIR_IDX[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

/* 32 bfloat16 (a[0], b[0], a[1], b[1], ...) from 16 floats a and 16 floats b, each rounded once */
static inline __m512i pairs_bf16(__m512 a, __m512 b)
{
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(PAIR_IDX), (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

/* scratch per thread: st (L, 16) float scores / probabilities; pp (L / 2 + 1, 16) probability pairs;
   vp (L / 2 + 1, D) value pairs; qp (D / 2, 16) query pairs */
static void prefill_tile(const uint16_t *q, long sq, int H, int D, int h, int p0, int nq, const uint16_t *kc,
                         const uint16_t *vc, int B, const int *tab, int start, uint16_t *out, long so,
                         float scale, float *st, uint32_t *pp, uint16_t *vp, uint32_t *qp)
{
    const long hs = (long)B * D, bs = (long)H * hs;
    const int pos0 = start + p0, L = pos0 + nq, D2 = D / 2; /* keys of the tile's last query */
    for (int p = 0; p < D2; p++)
        for (int i = 0; i < PF_QT; i++)
            qp[p * PF_QT + i] = i < nq ? ((const uint32_t *)(q + (long)(p0 + i) * sq + (long)h * D))[p] : 0;
    /* scores */
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    __m512 mx = ninf;
    for (int c0 = 0; c0 < L;) {
        const int j = c0 / B, off = c0 % B;
        int n = B - off < 16 ? B - off : 16;
        if (L - c0 < n) n = L - c0;
        const uint32_t *kr = (const uint32_t *)(kc + tab[j] * bs + h * hs + (long)off * D);
        if (off == 0 && (j + 1) * B < L) prefetch_span(kc + tab[j + 1] * bs + h * hs, hs * 2);
        __m512 acc[16];
#pragma GCC unroll 16
        for (int c = 0; c < 16; c++) acc[c] = _mm512_setzero_ps();
        for (int p = 0; p < D2; p++) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(qp + p * PF_QT);
#pragma GCC unroll 16 /* whole: the 16 sums stay in registers */
            for (int c = 0; c < 16; c++)
                if (c < n) acc[c] = _mm512_dpbf16_ps(acc[c], qv, (__m512bh)_mm512_set1_epi32((int)kr[(long)c * D2 + p]));
        }
        for (int c = 0; c < n; c++) {
            const int kp = c0 + c; /* query i sees this key if kp <= pos0 + i */
            const __mmask16 seen = kp <= pos0 ? 0xFFFF : (__mmask16)(0xFFFFu << (kp - pos0));
            const __m512 sv = _mm512_mask_mul_ps(ninf, seen, acc[c], vscale);
            mx = _mm512_max_ps(mx, sv);
            _mm512_storeu_ps(st + (long)kp * PF_QT, sv);
        }
        c0 += n;
    }
    /* softmax: e^(s - max), 0 where masked; then probabilities rounded to bfloat16 in pairs of keys */
    __m512 sum = _mm512_setzero_ps();
    for (int kp = 0; kp < L; kp++) {
        const __m512 sv = _mm512_loadu_ps(st + (long)kp * PF_QT);
        const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(sv, ninf, _CMP_NEQ_UQ), exp_ps(_mm512_sub_ps(sv, mx)));
        sum = _mm512_add_ps(sum, e);
        _mm512_storeu_ps(st + (long)kp * PF_QT, e);
    }
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), sum);
    for (int kp = 0; kp < L; kp += 2) {
        const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(st + (long)kp * PF_QT), inv);
        const __m512 b = kp + 1 < L ? _mm512_mul_ps(_mm512_loadu_ps(st + (long)(kp + 1) * PF_QT), inv) : _mm512_setzero_ps();
        _mm512_storeu_si512(pp + (long)(kp / 2) * PF_QT, pairs_bf16(a, b));
    }
    /* value rows interleaved in pairs: vp[k][2d + r] = v[2k + r][d] (B even: a pair never spans blocks) */
    for (int kp = 0; kp < L; kp += 2) {
        const uint16_t *v0 = vc + tab[kp / B] * bs + h * hs + (long)(kp % B) * D;
        if (kp % B == 0 && (kp / B + 1) * B < L) prefetch_span(vc + tab[kp / B + 1] * bs + h * hs, hs * 2);
        for (int d = 0; d < D; d += 16) {
            const __m256i lo = _mm256_loadu_si256((const __m256i *)(v0 + d));
            const __m256i hi = kp + 1 < L ? _mm256_loadu_si256((const __m256i *)(v0 + D + d)) : _mm256_setzero_si256();
            _mm512_storeu_si512(vp + (long)(kp / 2) * 2 * D + 2 * d, _mm512_permutexvar_epi16(
                _mm512_loadu_si512(PAIR_IDX), _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)));
        }
    }
    /* out[i][d] = sum over pairs k of vdpbf16ps: 4 queries x 4 vectors of 16 d's at a time */
    const int npairs = (L + 1) / 2;
    for (int i0 = 0; i0 < nq; i0 += 4) {
        for (int d0 = 0; d0 < D; d0 += 64) {
            const int nd = (D - d0 < 64 ? D - d0 : 64) / 16;
            __m512 o[4][4];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
#pragma GCC unroll 4
                for (int v = 0; v < 4; v++) o[i][v] = _mm512_setzero_ps();
            for (int k = 0; k < npairs; k++) {
                const uint32_t *pk = pp + (long)k * PF_QT + i0;
                const uint16_t *vk = vp + (long)k * 2 * D + 2 * d0;
#pragma GCC unroll 4
                for (int v = 0; v < 4; v++) {
                    if (v < nd) {
                        const __m512bh vv = (__m512bh)_mm512_loadu_si512(vk + 32 * v);
#pragma GCC unroll 4
                        for (int i = 0; i < 4; i++)
                            o[i][v] = _mm512_dpbf16_ps(o[i][v], vv, (__m512bh)_mm512_set1_epi32((int)pk[i]));
                    }
                }
            }
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
#pragma GCC unroll 4
                for (int v = 0; v < 4; v++)
                    if (i0 + i < nq && v < nd)
                        _mm256_storeu_si256((__m256i *)(out + (long)(p0 + i0 + i) * so + (long)h * D + d0 + 16 * v),
                                            (__m256i)_mm512_cvtneps_pbh(o[i][v]));
        }
    }
}

int prefill_paged_bf16(const uint16_t *q, long sq, int T, int H, int D, const uint16_t *kc, const uint16_t *vc,
                       int B, const int *tab, int start, uint16_t *out, long so, float scale, int nthreads)
{
    if (D % 16 || D > ATT_MAXD || T < 1 || H < 1 || B < 2 || B % 2 || start < 0) return -1;
    const long L = (long)start + T, tiles = (T + PF_QT - 1) / PF_QT;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* st (L, 16) floats | pp (L / 2 + 1, 16) pairs | vp (L / 2 + 1, 2D) bf16 | qp (D / 2, 16) pairs */
        const long n_st = L * PF_QT, n_pp = (L / 2 + 1) * PF_QT, n_vp = (L / 2 + 1) * 2 * D;
        char *buf = malloc(sizeof(float) * n_st + sizeof(uint32_t) * n_pp + sizeof(uint16_t) * n_vp
                           + sizeof(uint32_t) * (D / 2) * PF_QT + 64);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        float *st = (float *)buf;
        uint32_t *pp = (uint32_t *)(st + n_st);
        uint16_t *vp = (uint16_t *)(pp + n_pp);
        uint32_t *qp = (uint32_t *)(vp + n_vp);
#pragma omp for schedule(dynamic, 1)
        for (long w = 0; w < (long)H * tiles; w++) {
            /* heads inside tiles: the late (long) tiles of every head first, so the threads end together */
            const int tile = (int)(tiles - 1 - w / H), h = (int)(w % H);
            const int p0 = tile * PF_QT, nq = T - p0 < PF_QT ? T - p0 : PF_QT;
            if (buf) prefill_tile(q, sq, H, D, h, p0, nq, kc, vc, B, tab, start, out, so, scale, st, pp, vp, qp);
        }
        free(buf);
    }
    return failed ? -2 : 0;
}

/* ---- A fused block's elementwise steps, bfloat16 in and out, float32 inside, rounded once ------------

   Rows may lie anywhere (a row stride each), so the kernels read q/k/v and fc_in's columns in
   place from the fused projection's output and write where the next matmul reads. Rows are
   split across threads; each element is computed alone, so results do not depend on the
   thread count. */

/* y[m, n] = gelu_tanh(x[m, n]) = x / (1 + e^(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3): the same
   function as 0.5 x (1 + tanh(u)) without its cancellation for negative x. e^(-2u) by exp_ps
   (relative error < 5e-9; below -87.3 it gives ~2^-126, so y = x; above ~88.7 it overflows to
   infinity, so y = -0, as the exact value underflows float32). */
static inline __m512 gelu16(__m512 x)
{
    const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 u = _mm512_mul_ps(_mm512_fmadd_ps(x3, _mm512_set1_ps(0.044715f), x),
                                   _mm512_set1_ps(-1.5957691216057308f)); /* -2 sqrt(2/pi) */
    const __m512 e = exp_ps(u);
    return _mm512_div_ps(x, _mm512_add_ps(e, _mm512_set1_ps(1.0f)));
}

void gelu_bf16(const uint16_t *x, long sx, uint16_t *y, long sy, long M, long N, int nthreads)
{
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * N >= 32768)
    for (long m = 0; m < M; m++) {
        const uint16_t *xr = x + m * sx;
        uint16_t *yr = y + m * sy;
        for (long n = 0; n < N; n += 16) {
            const __mmask16 k = N - n >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n)) - 1);
            const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, xr + n)), 16));
            _mm256_mask_storeu_epi16(yr + n, k, (__m256i)_mm512_cvtneps_pbh(gelu16(v)));
        }
    }
}

/* GPT-J's rotary embedding, in place, on the first R dims of nh heads of D per token:
       x[2i]   <- x[2i]   cos[2i]   - x[2i+1] sin[2i]
       x[2i+1] <- x[2i+1] cos[2i+1] + x[2i]   sin[2i+1]
   x of token t at x + t * sx (its heads one after another); sin, cos (T, R) bfloat16, each
   angle repeated for its pair (gptj.model.rotary_tables). R a multiple of 16. */
void rotary_bf16(uint16_t *x, long sx, int T, int nh, int D, int R, const uint16_t *sin, const uint16_t *cos,
                 int nthreads)
{
    const __m512 sign = _mm512_castsi512_ps(_mm512_set_epi32(0, (int)0x80000000, 0, (int)0x80000000, 0,
        (int)0x80000000, 0, (int)0x80000000, 0, (int)0x80000000, 0, (int)0x80000000, 0, (int)0x80000000, 0,
        (int)0x80000000)); /* lane 2i: -x[2i+1]; lane 2i+1: +x[2i] */
#pragma omp parallel for schedule(static) num_threads(nthreads) if ((long)T * nh * R >= 32768)
    for (int t = 0; t < T; t++) {
        for (int r = 0; r < R; r += 16) {
            const __m512 s = bf16_16(sin + (long)t * R + r), c = bf16_16(cos + (long)t * R + r);
            for (int h = 0; h < nh; h++) {
                uint16_t *p = x + t * sx + (long)h * D + r;
                const __m512 v = bf16_16(p);
                const __m512 w = _mm512_xor_ps(_mm512_permute_ps(v, 0xB1), sign); /* pairs swapped, evens negated */
                _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(w, s, _mm512_mul_ps(v, c))));
            }
        }
    }
}

/* Store N tokens' keys and values into their blocks: for token n and head h,
   kc[blk[n], h, off[n], :] = k[n * sk + h * D + :] (and v likewise). kc, vc (n_blocks, H, B, D). */
void store_kv_bf16(const uint16_t *k, long sk, const uint16_t *v, long sv, int N, int H, int D, uint16_t *kc,
                   uint16_t *vc, int B, const int64_t *blk, const int64_t *off, int nthreads)
{
    const long hs = (long)B * D, bs = (long)H * hs;
#pragma omp parallel for schedule(static) num_threads(nthreads) if ((long)N * H * D >= 32768)
    for (int n = 0; n < N; n++) {
        const long dst = blk[n] * bs + off[n] * D;
        for (int h = 0; h < H; h++) {
            memcpy(kc + dst + h * hs, k + n * sk + (long)h * D, sizeof(uint16_t) * D);
            memcpy(vc + dst + h * hs, v + n * sv + (long)h * D, sizeof(uint16_t) * D);
        }
    }
}
