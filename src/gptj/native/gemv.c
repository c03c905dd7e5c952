/* Matrix x few-rows kernels for LLM decode on CPUs: one source for every ISA (simd.h's vector layer;
   the build defines GPTJ_ISA_AVX512, GPTJ_ISA_AVX2 or GPTJ_ISA_GENERIC).

   y[m, n] = sum_k x[m, k] * w[n, k]     (then * scale[n] for int8 weights, then + bias[n])

   x: (M, K) bfloat16, w: (N, K) row-major (int8, per-output-channel symmetric, or bfloat16),
   y: (M, N) bfloat16 (or float32 for the *_f32 variants). Accumulation is float32; x is used
   as stored (weight-only quantization: x is never quantized).

   At a few rows of x the work is reading w from memory once, so the design serves one
   sequential stream of weight bytes per thread:

   - OpenMP threads (static) each own a contiguous range of rows of w, i.e. one contiguous range
     of memory. They walk it in groups of 16 rows: in address order, row after row (or R rows
     side by side, R = 2..4 for 2..8 rows of x, so that a load of x serves R rows of w).
   - A software prefetch cursor runs g_pf_dist bytes (bfloat16: g_pf_dist_bf16) ahead of the reads, into
     L2, one line per line read, across row boundaries: rows as short as 1 KiB (K = 1024 int8) stream as well as
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
     bfloat16 (nearest even) and stored 16 outputs at a time. bfloat16 weights keep CHAINS
     accumulators at every row count, so a row's sums do not depend on the rows beside it (below);
     int8 weights take as many as the registers leave, so theirs do.
   - K tails use masked loads (zeros beyond K).
   - AVX2 and the generic build (no bfloat16 arithmetic: HAVE_DP 0): every row of x is converted to
     float32 once per call and every tile is a float32 FMA tile (TILE_F), int8 and bfloat16 weights
     alike (bfloat16 widened by a 16-bit shift, exact); 8 lanes, 16 registers, so smaller tiles.
   - Built with -fopenmp and loaded into a process that already has torch's libgomp.so.1, the
     kernels run on the same OpenMP runtime (and thread pool) as torch's own kernels.
   Every output is summed by one thread in a fixed order: results do not depend on the thread
   count.

   W8A8's GEMM (int8 x int8, exact int32 sums, at any rows: gemm_w8a8, at the end) is the other
   kind of kernel here: on its own packed weight, a register tile of rows by output channels. So are,
   on AVX512-BF16, the int8 GEMM that gemv_int8 runs from 32 rows of x and the int4 GEMM (gemm_int4) on
   torch's CPU int4 layout: one driver (gemm_panels_dp, after the GEMV) over panels each makes its way.
   Below 32 rows gemm_int4 runs an int4 GEMV of its own instead (gemv_int4_dp: the weight's integers in
   bfloat16 dot products, each group's sums scaled once).
*/

#include "simd.h"

#define MAXMT 8  /* rows of x per pass over a group of rows of w */
#define GROUP 16  /* rows of w per group */
/* bfloat16 weights: independent accumulators per (row of w, row of x), at every row count: chain c sums
   the 32-element (AVX-512 bf16 products) or VW-element (FMA) blocks of K whose index is c mod CHAINS,
   in k order, across K's chunks; the chains are added (0 + 1) only when the outputs are stored. So an
   output's float32 sum is the same whatever the rows of x beside it (1, 2 or 8 rows, any pass, any K
   chunk): batch-invariant, which speculation's verifying rows need to decode exactly as a row alone.
   (4 accumulators at one row, 2 at two and 1 from three, as int8 keeps, made a verifying step of 6 rows
   round differently from a step of one; what 2 at every count costs: docs/PERFORMANCE.md#gemv-batch-invariant) */
#define CHAINS 2
#define ROW_ALIGN 16  /* thread ranges start at multiples of this many rows (a GROUP) */

/* prefetch distances in bytes (0 turns prefetch off): g_pf_dist the int8 GEMV's (and whether the int4 GEMVs
   prefetch), g_pf_dist_bf16 the bfloat16 GEMV's. The AVX2 library runs on Zen 2 / Zen 3 here, where 1 KiB
   read one row of bfloat16 weights of 4096 inputs 1.13-1.21x faster than 8 KiB (1.00-1.08x at 14336 inputs
   and at 4 rows of x) while int8's ran up to 1.1x slower with it (docs/PERFORMANCE.md#avx2-prefetch) */
#if defined(GPTJ_ISA_AVX2)
#define PF_DIST_BF16_DEFAULT 1024
#else
#define PF_DIST_BF16_DEFAULT 8192
#endif
static long g_pf_dist = 8192, g_pf_dist_bf16 = PF_DIST_BF16_DEFAULT;
/* the int4 GEMVs' distance, in bytes of packed weights, while prefetch is on (g_pf_dist > 0) */
#define I4_PF_DIST 16384
static long g_min_parallel = 65536; /* weight bytes below which a call runs on one thread */

/* Tuning knobs (benchmarks): a negative value leaves that setting as it is. pf_dist sets every GEMV's
   prefetch distance (the bfloat16 one's too); gemv_set_prefetch_bf16 then the bfloat16 GEMV's alone. */
void gemv_set_tuning(int pf_dist, int min_parallel_bytes)
{
    if (pf_dist >= 0) g_pf_dist = g_pf_dist_bf16 = pf_dist;
    if (min_parallel_bytes >= 0) g_min_parallel = min_parallel_bytes;
}

void gemv_set_prefetch_bf16(int pf_dist)
{
    if (pf_dist >= 0) g_pf_dist_bf16 = pf_dist;
}

int gemv_get_prefetch(void) { return (int)g_pf_dist; }

int gemv_get_prefetch_bf16(void) { return (int)g_pf_dist_bf16; }

int gemv_omp_max_threads(void) { return omp_get_max_threads(); }

/* ---- weight loaders ---- */

#if HAVE_DP  /* bfloat16 dot products (vdpbf16ps; simd.h's ISA file says) */
#define F_MAXMT 1  /* int8 against at most this many rows of x (in a pass) uses float32 x */
#else
#define F_MAXMT MAXMT  /* every pass uses float32 x */
#endif

#if HAVE_DP
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

#endif /* HAVE_DP */

/* ---- tile kernels ----
   nrows (a multiple of R) consecutive rows of w (row stride ldw elements), R at a time, against
   MT rows of x (row stride ldx), over `len` elements of K. Accumulates chain c of (row r, row m)
   into accio[c * GROUP * MT + r * MT + m] (16 partial sums each; zeroed first when init). The main
   loop consumes 256 bytes (4 cache lines) of each row per iteration; CHAINS accumulators per (row of
   w, row of x), block h of an iteration into chain h mod CHAINS (an iteration and a K chunk start at a
   multiple of CHAINS blocks, so that is the block's index in K mod CHAINS); a K tail's blocks into
   chain 0 (only the last chunk has one: the same blocks at every MT).

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

/* PF_LOCALITY (__builtin_prefetch's: 2 is L2, x86's prefetcht1), X_L1_BYTES and the R_* tile sizes
   can be overridden with -D for experiments */
#ifndef PF_LOCALITY
#define PF_LOCALITY 2
#endif

#define TILE_BEGIN(R, MT, NA)                                                                  \
    const char *pf = pfp ? pfp->at : NULL, *const pf_end = pfp ? pfp->end : NULL;            \
    for (long rr = 0; rr < nrows; rr += R, w += R * ldw, accio += R * MT) {                   \
    vf acc[R][NA][MT];                                                                        \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                        \
    _Pragma("GCC unroll 8") for (int a = 0; a < NA; a++)                                       \
    _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++)                                      \
        acc[r][a][m] = init ? vf_zero() : accio[a * GROUP * MT + r * MT + m];

#define TILE_PREFETCH(R)                                                                       \
    if (pf < pf_end) {                                                                        \
        _Pragma("GCC unroll 16") for (int l = 0; l < 4 * (R); l++)                            \
            __builtin_prefetch(pf + 64 * l, 0, PF_LOCALITY);                                  \
        pf += (R) * IT_BYTES;                                                                 \
    }

#define TILE_END(R, MT, NA)                                                                    \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                        \
    _Pragma("GCC unroll 8") for (int a = 0; a < NA; a++)                                       \
    _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++)                                      \
        accio[a * GROUP * MT + r * MT + m] = acc[r][a][m];                                    \
    }                                                                                         \
    if (pfp) pfp->at = pf;

#define TILE_ARGS(XT, WT)                                                                      \
    const XT *x, long ldx, const WT *w, long ldw, long len, long nrows, vf *accio,             \
    int init, cursor_t *pfp

#if HAVE_DP
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

#endif /* HAVE_DP */

/* int8 or bfloat16 weights (widened to float32, exact) against float32 x (FMA), VW lanes */
#define TILE_F(NAME, WT, LOAD, LOADN, R, MT, NA)                                                 \
static void NAME(TILE_ARGS(float, WT))                                                        \
{                                                                                             \
    TILE_BEGIN(R, MT, NA)                                                                     \
    enum { PER_IT = IT_BYTES / (int)sizeof(WT) };                                             \
    long k = 0;                                                                               \
    for (; k + PER_IT <= len; k += PER_IT) {                                                  \
        TILE_PREFETCH(R)                                                                      \
        _Pragma("GCC unroll 32") for (int h = 0; h < PER_IT / VW; h++) {                       \
            vf wv[R];                                                                         \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) wv[r] = LOAD(w + r * ldw + k + VW * h); \
            _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                            \
                vf xv = vf_loadu(x + m * ldx + k + VW * h);                                   \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                           \
                    acc[r][h % NA][m] = vf_fmadd(wv[r], xv, acc[r][h % NA][m]);               \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (; k < len; k += VW) {                                                                \
        int n = (len - k) >= VW ? VW : (int)(len - k);                                        \
        vf wv[R];                                                                             \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                    \
            wv[r] = n == VW ? LOAD(w + r * ldw + k) : LOADN(w + r * ldw + k, n);              \
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                                \
            vf xv = n == VW ? vf_loadu(x + m * ldx + k) : vf_loadu_n(x + m * ldx + k, n);     \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                               \
                acc[r][0][m] = vf_fmadd(wv[r], xv, acc[r][0][m]);                             \
        }                                                                                     \
    }                                                                                         \
    TILE_END(R, MT, NA)                                                                       \
}

/* Tiles per rows of x (MT): R rows of w, so that R*MT*NA accumulators, R weight vectors and a vector
   of x fit the registers (AVX-512: 32, AVX2: 16); plus a one-row-of-w tile (_rMT) per MT for the rows
   left over at the end of a thread's range, with the same accumulators (store_group adds the chains
   the pass's tiles used).
   - TILES_CHAINS, bfloat16 weights: CHAINS accumulators at every MT (batch-invariant, above).
   - TILES_FEW, int8 weights: the accumulators the registers leave (4 at one row of x, 2 at two, then
     1), so 1, 2 and 3+ rows of x sum an output in different orders: each int8 weight is converted
     once per R rows of w, and fewer accumulators let more rows share it (CHAINS at every MT ran
     6-8 rows 5-17 % slower). */
#define TILES_CHAINS(TILE, PFX, WT, LOAD, LOADT, R2, R3, R46, R78)                                \
    TILE(PFX##_1, WT, LOAD, LOADT, 1, 1, CHAINS)                                                  \
    TILE(PFX##_2, WT, LOAD, LOADT, R2, 2, CHAINS)                                                 \
    TILE(PFX##_3, WT, LOAD, LOADT, R3, 3, CHAINS)                                                 \
    TILE(PFX##_4, WT, LOAD, LOADT, R46, 4, CHAINS)                                                \
    TILE(PFX##_5, WT, LOAD, LOADT, R46, 5, CHAINS)                                                \
    TILE(PFX##_6, WT, LOAD, LOADT, R46, 6, CHAINS)                                                \
    TILE(PFX##_7, WT, LOAD, LOADT, R78, 7, CHAINS)                                                \
    TILE(PFX##_8, WT, LOAD, LOADT, R78, 8, CHAINS)                                                \
    TILE(PFX##_r2, WT, LOAD, LOADT, 1, 2, CHAINS)                                                 \
    TILE(PFX##_r3, WT, LOAD, LOADT, 1, 3, CHAINS)                                                 \
    TILE(PFX##_r4, WT, LOAD, LOADT, 1, 4, CHAINS)                                                 \
    TILE(PFX##_r5, WT, LOAD, LOADT, 1, 5, CHAINS)                                                 \
    TILE(PFX##_r6, WT, LOAD, LOADT, 1, 6, CHAINS)                                                 \
    TILE(PFX##_r7, WT, LOAD, LOADT, 1, 7, CHAINS)                                                 \
    TILE(PFX##_r8, WT, LOAD, LOADT, 1, 8, CHAINS)                                                 \
    static const int PFX##_R[MAXMT + 1] = {0, 1, R2, R3, R46, R46, R46, R78, R78};
#define TILES_FEW(TILE, PFX, WT, LOAD, LOADT, R2, R36, R78)                                       \
    TILE(PFX##_1, WT, LOAD, LOADT, 1, 1, 4)                                                       \
    TILE(PFX##_2, WT, LOAD, LOADT, R2, 2, 2)                                                      \
    TILE(PFX##_3, WT, LOAD, LOADT, R36, 3, 1)                                                     \
    TILE(PFX##_4, WT, LOAD, LOADT, R36, 4, 1)                                                     \
    TILE(PFX##_5, WT, LOAD, LOADT, R36, 5, 1)                                                     \
    TILE(PFX##_6, WT, LOAD, LOADT, R36, 6, 1)                                                     \
    TILE(PFX##_7, WT, LOAD, LOADT, R78, 7, 1)                                                     \
    TILE(PFX##_8, WT, LOAD, LOADT, R78, 8, 1)                                                     \
    TILE(PFX##_r2, WT, LOAD, LOADT, 1, 2, 2)                                                      \
    TILE(PFX##_r3, WT, LOAD, LOADT, 1, 3, 1)                                                      \
    TILE(PFX##_r4, WT, LOAD, LOADT, 1, 4, 1)                                                      \
    TILE(PFX##_r5, WT, LOAD, LOADT, 1, 5, 1)                                                      \
    TILE(PFX##_r6, WT, LOAD, LOADT, 1, 6, 1)                                                      \
    TILE(PFX##_r7, WT, LOAD, LOADT, 1, 7, 1)                                                      \
    TILE(PFX##_r8, WT, LOAD, LOADT, 1, 8, 1)                                                      \
    static const int PFX##_R[MAXMT + 1] = {0, 1, R2, R36, R36, R36, R36, R78, R78};             \
    static const int PFX##_NA[MAXMT + 1] = {0, 4, 2, 1, 1, 1, 1, 1, 1};
#define TILE_TABLE(PFX)                                                                           \
    {{0, PFX##_1, PFX##_2, PFX##_3, PFX##_4, PFX##_5, PFX##_6, PFX##_7, PFX##_8},                 \
     {0, PFX##_1, PFX##_r2, PFX##_r3, PFX##_r4, PFX##_r5, PFX##_r6, PFX##_r7, PFX##_r8}}

typedef void (*tile_f_i8_fn)(TILE_ARGS(float, int8_t));
typedef void (*tile_f_bf_fn)(TILE_ARGS(float, uint16_t));

#if HAVE_DP
/* bfloat16: two rows of w share each load of x up to 6 rows of x (4 rows of w at 3-4 rows, or 3 at 4,
   ran 3-15 % slower), one from 7. int8: one row of x runs the float32 tile (fi8_1); dpi8_1 where there is
   no memory for float32 x. */
TILES_CHAINS(TILE_DP, dpbf, uint16_t, load_w_bf16, load_w_bf16_tail, 2, 2, 2, 1)
TILES_FEW(TILE_DP, dpi8, int8_t, load_w_i8, load_w_i8_tail, 2, 4, 2)
TILE_F(fi8_1, int8_t, vf_load_i8, vf_load_i8_n, 1, 1, 4)

typedef void (*tile_i8_fn)(TILE_ARGS(uint16_t, int8_t));
typedef void (*tile_bf_fn)(TILE_ARGS(uint16_t, uint16_t));

static const int R_F[F_MAXMT + 1] = {0, 1};
static const tile_i8_fn DP_I8[2][MAXMT + 1] = TILE_TABLE(dpi8);
static const tile_bf_fn DP_BF[2][MAXMT + 1] = TILE_TABLE(dpbf);
static const tile_f_i8_fn F_I8[2][F_MAXMT + 1] = {{0, fi8_1}, {0, fi8_1}};
static const tile_f_bf_fn F_BF[2][F_MAXMT + 1] = {{0, 0}, {0, 0}};  /* bfloat16 weights take DP tiles */
#else
/* Without HAVE_DP (AVX2, generic: 16 registers; every row of x in float32): bfloat16, two rows of w
   sharing each load of x at 2-3 rows of x, one from 4; int8, two up to 6 rows. */
TILES_CHAINS(TILE_F, fbf, uint16_t, vf_load_bf16, vf_load_bf16_n, 2, 2, 1, 1)
TILES_FEW(TILE_F, fi8, int8_t, vf_load_i8, vf_load_i8_n, 2, 2, 1)

static const tile_f_i8_fn F_I8[2][F_MAXMT + 1] = TILE_TABLE(fi8);
static const tile_f_bf_fn F_BF[2][F_MAXMT + 1] = TILE_TABLE(fbf);
#endif

/* ---- drivers ---- */

#ifndef X_L1_BYTES
#define X_L1_BYTES 16384  /* x (the rows of a pass) is split along K to stay within this */
#endif

/* an int4 weight in torch's CPU layout (the int4 GEMM's and GEMVs' comments say it) */
struct i4_info {
    int block, split, group;
    const uint16_t *scale, *zero;  /* (N, K / group) bfloat16 */
};

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
    long ldy;               /* y's row stride; 0: N */
    const struct i4_info *i4;  /* int4 weights (the int4 GEMM), or NULL */
} job_t;

static inline long ldy_of(const job_t *j) { return j->ldy ? j->ldy : j->N; }

/* the scales and the bias of columns [col, col + c), c <= VW (1 and 0 where the job has none) */
static inline vf scales_of(const job_t *j, long col, int c)
{
    return j->scale ? vf_load_bf16_upto(j->scale + col, c) : vf_set1(1.0f);
}
static inline vf bias_of(const job_t *j, long col, int c)
{
    return j->bias ? vf_load_bf16_upto(j->bias + col, c) : vf_zero();
}

/* c (<= VW) outputs at y's row-major index `at` from their float32 sums v: times the scales s, plus the
   bias b (where the job has them), rounded once to bfloat16 unless y is float32 */
static inline void store_out(const job_t *j, long at, vf v, vf s, vf b, int c)
{
    if (j->scale) v = vf_mul(v, s);
    if (j->bias) v = vf_add(v, b);
    if (j->y_f32) vf_store_f32_n((float *)j->y + at, v, c);
    else vf_store_bf16_n((uint16_t *)j->y + at, v, c);
}

/* outputs of rows [n, n + g) (g <= 16) for rows [m0, m0 + mt) of x; acc[c * GROUP * mt + r * mt + m]
   holds chain c's 16 partial sums of (row n + r, row m0 + m), c < chains (the tiles' accumulators);
   entries of rows >= g are ignored */
static void store_group(const job_t *j, long n, int g, long m0, int mt, vf *acc, int chains)
{
    for (int r = 0; r < GROUP; r++)
        for (int m = 0; m < mt; m++) {
            vf t = vf_zero();
            if (r < g) {  /* the chains, added in one order */
                t = acc[r * mt + m];
                for (int c = 1; c < chains; c++) t = vf_add(t, acc[c * GROUP * mt + r * mt + m]);
            }
            acc[r * mt + m] = t;
        }
    for (int h = 0; h < g; h += VW) {  /* VW outputs at a time: one pass (AVX-512), two (AVX2) */
        const int c = g - h < VW ? g - h : VW;
        const vf s = scales_of(j, n + h, c), b = bias_of(j, n + h, c);
        for (int m = 0; m < mt; m++)
            store_out(j, (m0 + m) * ldy_of(j) + n + h, vf_hsum(acc + h * mt + m, mt), s, b, c);
    }
}

/* The rows of w (R) and the accumulators per output (chains) of the tile that runs rows [m0, m0 + mt)
   of x (m0 = 0: the first pass) */
static void tile_shape(const job_t *j, long m0, int mt, int *R, int *chains)
{
#if HAVE_DP
    if (j->xf && m0 >= j->xf_m0) {  /* int8, rows of x in float32: fi8_1 */
        *R = R_F[mt];
        *chains = 4;
        return;
    }
    *R = j->is_i8 ? dpi8_R[mt] : dpbf_R[mt];
    *chains = j->is_i8 ? dpi8_NA[mt] : CHAINS;
#else
    (void)m0;
    *R = j->is_i8 ? fi8_R[mt] : fbf_R[mt];
    *chains = j->is_i8 ? fi8_NA[mt] : CHAINS;
#endif
}

/* rows [n, n + g) of w (g <= GROUP) against rows [m0, m0 + mt) of x, K in chunks of kc */
static void run_group(const job_t *j, long n, int g, long m0, int mt, long kc, cursor_t *pfp,
                      vf *acc)
{
    const long K = j->K;
    const int use_f = j->xf && m0 >= j->xf_m0;  /* this pass's rows of x in float32 */
    int R, chains;
    tile_shape(j, m0, mt, &R, &chains);
    const long full = g / R * R;  /* rows done by R-row tiles; the rest one at a time */
    for (long k0 = 0; k0 < K; k0 += kc) {
        long len = K - k0 < kc ? K - k0 : kc;
        int init = (k0 == 0);
        for (int one = 0; one < 2; one++) {
            long r0 = one ? full : 0, nr = one ? g - full : full;
            if (nr == 0) continue;
            vf *a = acc + r0 * mt;
            const float *xf = use_f ? j->xf + (m0 - j->xf_m0) * K + k0 : NULL;
            if (use_f && j->is_i8)
                F_I8[one][mt](xf, K, (const int8_t *)j->w + (n + r0) * K + k0, K, len, nr, a, init, pfp);
            else if (use_f)
                F_BF[one][mt](xf, K, (const uint16_t *)j->w + (n + r0) * K + k0, K, len, nr, a, init, pfp);
#if HAVE_DP
            else if (j->is_i8)
                DP_I8[one][mt](j->x + m0 * K + k0, K, (const int8_t *)j->w + (n + r0) * K + k0, K, len, nr, a, init, pfp);
            else
                DP_BF[one][mt](j->x + m0 * K + k0, K, (const uint16_t *)j->w + (n + r0) * K + k0, K, len, nr, a, init, pfp);
#endif
        }
    }
    store_group(j, n, g, m0, mt, acc, chains);
}

/* K chunk for rows [m0, m0 + mt) of x: all of K when those rows of x fit X_L1_BYTES */
static long chunk_for(const job_t *j, long m0, int mt)
{
    long xsz = (j->xf && m0 >= j->xf_m0) ? 4 : 2;
    if ((long)mt * j->K * xsz <= X_L1_BYTES) return j->K;
    long kc = X_L1_BYTES / (mt * xsz) / IT_BYTES * IT_BYTES;
    return kc < IT_BYTES ? IT_BYTES : kc;
}

/* The passes over a group's rows of w, each against rows [pass_start(p), pass_start(p + 1)) of x.
   AVX-512: MAXMT rows at a time. AVX2 (16 registers): M split evenly into M / 4 passes of 4-7 rows
   (one pass below 8 rows), so that the 4-6-row tiles, two rows of w sharing each load of x, do most of
   the work, faster than 8-row passes of one row of w at 8-128 rows of x
   (docs/PERFORMANCE.md#avx2-native-kernels). The passes do not change an output's sum: bfloat16 weights'
   chains are the same at every pass size; int8's, the same from 3 rows on. */
static long pass_count(long M)
{
#if HAVE_DP
    return (M + MAXMT - 1) / MAXMT;
#else
    return M >= 8 ? M / 4 : 1;
#endif
}

static long pass_start(long M, long passes, long p)
{
#if HAVE_DP
    (void)passes;
    return p * MAXMT < M ? p * MAXMT : M;
#else
    return M * p / passes;
#endif
}

/* rows [n0, n1) of w against all M rows of x, in groups of GROUP rows */
static void run_rows(const job_t *j, long n0, long n1)
{
    const long K = j->K;
    const long esz = j->is_i8 ? 1 : 2;
    vf acc[CHAINS * GROUP * MAXMT];
    /* Where the prefetch cursor starts, from a group's first byte: g_pf_dist further than the
       span read at once: a row (rows read in address order), R rows side by side, or the whole
       group when K is split in chunks (the group is then read chunk by chunk). */
    const long passes = pass_count(j->M);
    int mt0 = (int)pass_start(j->M, passes, 1);
    int R0, chains0;
    tile_shape(j, 0, mt0, &R0, &chains0);
    long span = chunk_for(j, 0, mt0) < K ? GROUP : (R0 > 1 ? R0 : 0);
    const long dist = j->is_i8 ? g_pf_dist : g_pf_dist_bf16;
    long ahead = span * K * esz + dist;
    cursor_t pf = {NULL, (const char *)j->w + n1 * K * esz};
    cursor_t *pfp = dist > 0 ? &pf : NULL;
    if (pfp) {  /* the lines the cursor starts ahead of: requested at once, not left to demand */
        const char *p0 = (const char *)j->w + n0 * K * esz;
        long end = (n1 - n0) * K * esz < ahead ? (n1 - n0) * K * esz : ahead;
        for (long off = 0; off < end; off += 64) __builtin_prefetch(p0 + off, 0, PF_LOCALITY);
    }
    for (long n = n0; n < n1; n += GROUP) {
        int g = (int)(n1 - n < GROUP ? n1 - n : GROUP);
        /* set per group: the tiles move it on by what they read, K tails not counted */
        pf.at = (const char *)j->w + n * K * esz + ahead;
        for (long p = 0; p < passes; p++) {
            const long m0 = pass_start(j->M, passes, p);
            const int mt = (int)(pass_start(j->M, passes, p + 1) - m0);
            /* later passes re-read the group's rows from cache: no prefetch */
            run_group(j, n, g, m0, mt, chunk_for(j, m0, mt), m0 == 0 ? pfp : NULL, acc);
        }
    }
}

/* 0, or -1 where the float32 copy of x could not be allocated (AVX2 has no other way) */
static int run(job_t *j, int nthreads)
{
    if (j->M <= 0 || j->N <= 0) return 0;
    if (j->K <= 0) {  /* empty sums: y = bias (or 0) */
        vf zero[CHAINS * GROUP * MAXMT];
        for (long n = 0; n < j->N; n += GROUP)
            for (long m0 = 0; m0 < j->M; m0 += MAXMT) {
                int mt = (int)((j->M - m0) < MAXMT ? (j->M - m0) : MAXMT);
                for (int i = 0; i < CHAINS * GROUP * mt; i++) zero[i] = vf_zero();
                store_group(j, n, (int)(j->N - n < GROUP ? j->N - n : GROUP), m0, mt, zero, 1);
            }
        return 0;
    }
    float *xf = NULL;
    long last_m0 = (j->M - 1) / MAXMT * MAXMT;
    /* the rows of x that go the float32 way: AVX-512, int8's last pass when it has at most F_MAXMT
       rows (all of x when M == 1); AVX2, all of x */
    long xf_m0 = HAVE_DP ? last_m0 : 0;
    if (!HAVE_DP || (j->is_i8 && j->M - last_m0 <= F_MAXMT)) {
        long cnt = (j->M - xf_m0) * j->K;
        xf = (float *)aligned_alloc(64, ((size_t)cnt * sizeof(float) + 63) / 64 * 64);
        if (xf) {
            const uint16_t *src = j->x + xf_m0 * j->K;
            long i = 0;
            for (; i + VW <= cnt; i += VW) vf_storeu(xf + i, vf_load_bf16(src + i));
            for (; i < cnt; i++) xf[i] = bf16_to_f32(src[i]);
            j->xf = xf;
            j->xf_m0 = xf_m0;
        } else if (!HAVE_DP) {
            return -1;
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
    return 0;
}

#if HAVE_DP
/* ---- int8 weights at many rows of x: a GEMM on bfloat16 dot products (AVX512-BF16) -------------------

   The GEMV above converts each weight to bfloat16 once per pass of 8 rows of x and re-reads x for every
   group of 16 weight rows, which from 32 rows on leaves it behind oneDNN's bfloat16 GEMM on bfloat16
   weights. Here each weight is converted once per call (per block of I8G_MC rows of x), and the
   arithmetic is a register tile:

   - A panel of I8G_PANEL (32) output channels, a slice of I8G_KC pairs of inputs at a time, is made
     bfloat16 (exact) into a per-thread buffer in the layout the tile reads: for each pair of inputs
     (2p, 2p + 1), the panel's channels' two weights side by side (16 weight rows converted, then
     transposed as 16 x 16 pairs).
   - The tile is up to I8G_MR (12) rows of x (a block's rows in tiles as even as they divide) by the
     panel's 2 vectors of 16 channels: 24 float32 accumulators;
     each step loads the 2 weight vectors of one pair and broadcasts that pair of each row of x to every
     lane (vdpbf16ps: lane c adds x's pair times channel c's pair). The channels lie along the lanes: no
     horizontal sums, and every output is one lane's sum over the pairs in k order, so results depend
     neither on the rows of the call nor on the threads (they differ from the GEMV's in the order of the
     float32 additions only).
   - x is copied once per call into rows an odd number of 64-byte lines apart (rows 8 KiB apart share L1
     sets), with a zero after an odd K; the sums wait in a per-thread buffer between slices.
   - The threads split the panels (static): each reads its contiguous range of weight rows once per block
     of rows of x.
   The tile (12 x 2 vectors) and the slice (I8G_KC) are among the fastest shapes tried. The conversion's
   cost puts the crossover with the GEMV at 32 rows (I8G_MIN_ROWS): below it the GEMV, which streams its
   weight with a prefetch cursor ahead, is faster in a model whose weights are cold. No layout packed at
   load time: the conversion it saves is lost in the tiles. The tiles run close to one 512-bit vdpbf16ps
   a cycle, so int8 weights at 24-64 rows run at about bfloat16 weights' speed.
   Figures and the variants tried: docs/PERFORMANCE.md#native-int8-gemm */

#ifndef I8G_NV
#define I8G_NV 2                  /* vectors of 16 channels per panel */
#endif
#define I8G_PANEL (16 * I8G_NV)   /* output channels per panel */
#ifndef I8G_MR
#define I8G_MR 12                 /* rows of x per tile */
#endif
#ifndef I8G_KC
#define I8G_KC 2048               /* pairs of inputs per slice: a panel's slice is 256 KiB of bfloat16 (L2) */
#endif
#ifndef I8G_MC
#define I8G_MC 1024               /* rows of x per block: the weight is converted once per block */
#endif
#ifndef I8G_MIN_ROWS
#define I8G_MIN_ROWS 32           /* gemv_int8 takes this GEMM from this many rows of x on */
#endif

static int g_i8g_min_rows = I8G_MIN_ROWS;

/* 16 x 16 32-bit elements: r[i] lane j -> r[j] lane i */
static inline void transpose16_epi32(__m512i r[16])
{
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) {  /* u[4g + j]: rows 4g..4g+3 of columns j, j + 4, j + 8, j + 12 */
        u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i va = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), vb = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xee);
        const __m512i wa = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44), wb = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xee);
        r[j] = _mm512_shuffle_i32x4(va, wa, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(va, wa, 0xdd);
        r[8 + j] = _mm512_shuffle_i32x4(vb, wb, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(vb, wb, 0xdd);
    }
}

/* channels [n0, n0 + I8G_PANEL) of w (zeros past N), pairs [p0, p0 + kn) (zeros past K), as bfloat16
   pairs: buf[p * I8G_PANEL + c] = (w[n0 + c, 2 (p0 + p)], w[n0 + c, 2 (p0 + p) + 1]) */
static void i8g_convert(const int8_t *w, long N, long K, long n0, long p0, long kn, uint32_t *buf)
{
    for (int v = 0; v < I8G_NV; v++)
        for (long p = 0; p < kn; p += 16) {
            __m512i r[16];
            const long k = 2 * (p0 + p), left = K - k;
            const __mmask32 mask = left >= 32 ? 0xffffffffu : (__mmask32)((1u << left) - 1);
            for (int c = 0; c < 16; c++) {
                const long n = n0 + 16 * v + c;
                r[c] = n < N ? (__m512i)load_w_i8_tail(w + n * K + k, mask) : _mm512_setzero_si512();
            }
            transpose16_epi32(r);
            const int np = kn - p < 16 ? (int)(kn - p) : 16;
            for (int q = 0; q < np; q++) _mm512_store_si512(buf + (p + q) * I8G_PANEL + 16 * v, r[q]);
        }
}

/* acc[m][v] += rows [0, mr) of x (bfloat16 pairs, rows ldx apart) times the panel's slice in buf, over
   kn pairs; mr is a constant where it is inlined */
static inline __attribute__((always_inline)) void i8g_tile(const uint16_t *x, long ldx, const uint32_t *buf, long kn,
                                                            const int mr, __m512 acc[I8G_MR][I8G_NV])
{
    __m512 a[I8G_MR][I8G_NV];
    _Pragma("GCC unroll 16") for (int m = 0; m < I8G_MR; m++)
    _Pragma("GCC unroll 4") for (int v = 0; v < I8G_NV; v++) a[m][v] = acc[m][v];
    for (long p = 0; p < kn; p++) {
        const uint32_t *wp = buf + p * I8G_PANEL;
        __m512bh wv[I8G_NV];
        _Pragma("GCC unroll 4") for (int v = 0; v < I8G_NV; v++) wv[v] = (__m512bh)_mm512_load_si512(wp + 16 * v);
        _Pragma("GCC unroll 16") for (int m = 0; m < I8G_MR; m++) {
            if (m >= mr) break;
            int32_t pair;
            memcpy(&pair, x + m * ldx + 2 * p, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            _Pragma("GCC unroll 4") for (int v = 0; v < I8G_NV; v++) a[m][v] = _mm512_dpbf16_ps(a[m][v], wv[v], xb);
        }
    }
    _Pragma("GCC unroll 16") for (int m = 0; m < I8G_MR; m++)
    _Pragma("GCC unroll 4") for (int v = 0; v < I8G_NV; v++) acc[m][v] = a[m][v];
}

/* rows [m, m + mr) of x (xp: the padded copy), the panel of channel n0 in buf, the slice [p0, p0 + kn):
   the sums so far from c (rows ldc = I8G_PANEL apart; none at the first slice), and after the last slice
   gemv_int8's scaling, bias and rounding into y; before it, the sums back into c */
static void i8g_block(const job_t *j, const uint16_t *xp, long ldx, const uint32_t *buf, float *c, long m, int mr,
                      long n0, long p0, long kn, int first, int last)
{
    __m512 acc[I8G_MR][I8G_NV];
    for (int r = 0; r < I8G_MR; r++)
        for (int v = 0; v < I8G_NV; v++)
            acc[r][v] = first || r >= mr ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * I8G_PANEL + 16 * v);
    const uint16_t *x = xp + m * ldx + 2 * p0;
    switch (mr) {  /* mr <= I8G_MR: each case a tile of its own, reading rows [m, m + mr) of x only */
#define I8G_CASE(r) case r: i8g_tile(x, ldx, buf, kn, r < I8G_MR ? r : I8G_MR, acc); break;
    I8G_CASE(1) I8G_CASE(2) I8G_CASE(3) I8G_CASE(4) I8G_CASE(5) I8G_CASE(6) I8G_CASE(7) I8G_CASE(8)
#if I8G_MR > 8
    I8G_CASE(9) I8G_CASE(10) I8G_CASE(11)
#endif
    default: i8g_tile(x, ldx, buf, kn, I8G_MR, acc); break;
#undef I8G_CASE
    }
    if (!last) {
        for (int r = 0; r < mr; r++)
            for (int v = 0; v < I8G_NV; v++) _mm512_storeu_ps(c + r * I8G_PANEL + 16 * v, acc[r][v]);
        return;
    }
    for (int v = 0; v < I8G_NV; v++) {
        const long col = n0 + 16 * v, n = j->N - col;
        if (n <= 0) break;
        const int c = n < 16 ? (int)n : 16;
        const vf s = scales_of(j, col, c), b = bias_of(j, col, c);
        for (int r = 0; r < mr; r++) store_out(j, (m + r) * ldy_of(j) + col, acc[r][v], s, b, c);
    }
}

/* makes the panel of channels [n0, n0 + I8G_PANEL), pairs [p0, p0 + kn), in buf (i8g_convert's layout) */
typedef void (*panel_fn)(const job_t *j, long n0, long p0, long kn, uint32_t *buf);

static void i8g_panel(const job_t *j, long n0, long p0, long kn, uint32_t *buf)
{
    i8g_convert((const int8_t *)j->w, j->N, j->K, n0, p0, kn, buf);
}

/* y = the panels' products with x for M rows (the int8 GEMM: gemv_int8's numbers; the int4 GEMM): 0, or
   -1 without memory */
static int gemm_panels_dp(const job_t *j, int nthreads, panel_fn make_panel)
{
    const long M = j->M, N = j->N, K = j->K, pairs = (K + 1) / 2;
    long ldx = (2 * pairs + 31) / 32 * 32;  /* bfloat16s a row: whole 64-byte lines, an odd number of them */
    if (ldx / 32 % 2 == 0) ldx += 32;
    const long kc = pairs < I8G_KC ? pairs : I8G_KC, mc = M < I8G_MC ? M : I8G_MC;
    const long panels = (N + I8G_PANEL - 1) / I8G_PANEL;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > panels) nthreads = (int)panels;
    const size_t per_thread = ((size_t)kc + (size_t)mc) * I8G_PANEL * 4;  /* a converted slice, the sums */
    uint16_t *xp = aligned_alloc(64, (size_t)M * ldx * 2);
    char *scratch = aligned_alloc(64, per_thread * (size_t)nthreads);
    if (!xp || !scratch) {
        free(xp);
        free(scratch);
        return -1;
    }
    for (long m = 0; m < M; m++) {
        memcpy(xp + m * ldx, j->x + m * K, (size_t)K * 2);
        memset(xp + m * ldx + K, 0, (size_t)(ldx - K) * 2);
    }
#pragma omp parallel num_threads(nthreads)
    {
        uint32_t *buf = (uint32_t *)(scratch + per_thread * (size_t)omp_get_thread_num());
        float *c = (float *)(buf + kc * I8G_PANEL);
#pragma omp for schedule(static)
        for (long t = 0; t < panels; t++)
            for (long m0 = 0; m0 < M; m0 += mc) {
                const long me = M - m0 < mc ? M : m0 + mc;
                for (long p0 = 0; p0 < pairs; p0 += kc) {
                    const long kn = pairs - p0 < kc ? pairs - p0 : kc;
                    make_panel(j, t * I8G_PANEL, p0, kn, buf);
                    /* the block's rows in tiles of at most I8G_MR, as even as they divide (16 rows: 8 + 8,
                       not 12 + 4: a tile of few rows spends its weight loads on few products) */
                    const long tiles = (me - m0 + I8G_MR - 1) / I8G_MR, base = (me - m0) / tiles;
                    for (long i = 0, m = m0; i < tiles; i++) {
                        const int mr = (int)(base + (i < (me - m0) % tiles));
                        i8g_block(j, xp, ldx, buf, c + (m - m0) * I8G_PANEL, m, mr, t * I8G_PANEL, p0, kn, p0 == 0,
                                  p0 + kn == pairs);
                        m += mr;
                    }
                }
            }
    }
    free(xp);
    free(scratch);
    return 0;
}

/* ---- int4 weights at many rows of x: the same GEMM on panels dequantized from torch's CPU int4 layout ----

   elementwise.c's int4_dequant_t_bf16 says the layout: blocks of `block` output rows; in a block, column
   k of the weight is block/2 bytes, with `split` byte i holding rows i (low nibble) and i + block/2 (high),
   else rows 2i and 2i + 1. A panel of 32 channels is a whole block (32) or half of one (64), so a column's
   32 values are 16 or 32 bytes side by side: the layout is already channels by column, and each pair of
   columns becomes the panel's row of pairs by interleaving bytes (no transpose, unlike int8's row-major
   weight). Each weight is dequantized as int4_dequant_t dequantizes it, bfloat16(q * s + zp) with
   zp = bfloat16(zero - 8 s): the panel holds those very bfloat16 values, so the GEMM's outputs are float32
   sums of the products of x with the weight that the dequantized matmul multiplies, rounded once. */

/* column k's 32 nibbles of the panel at row r0 of its block (bytes at col), in channel order, as bytes */
static inline __m256i i4_column(const uint8_t *col, int block, int split, int r0)
{
    const __m128i low4 = _mm_set1_epi8(15);
    if (split && block == 64) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)col);
        return _mm256_and_si256(r0 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
    }
    if (split) {  /* block 32: rows 0-15 low nibbles, rows 16-31 high */
        const __m128i v = _mm_loadu_si128((const __m128i *)col);
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low4), _mm_and_si128(v, low4));
    }
    const __m128i v = _mm_loadu_si128((const __m128i *)(col + r0 / 2));  /* rows 2i (low), 2i + 1 (high) */
    const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
    return _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
}

/* the scale and zp of channels n0 .. n0 + 31 for group g, each twice (lanes 2i, 2i + 1: channel 8 q + i) */
static inline void i4_group_scales(const struct i4_info *q, long groups, long n0, long g, __m512 sd[4], __m512 zd[4])
{
    float s[32], z[32];
    for (int c = 0; c < 32; c++) {
        const long at = (n0 + c) * groups + g;
        s[c] = bf16_to_f32(q->scale[at]);
        z[c] = bf16_to_f32(f32_to_bf16(bf16_to_f32(q->zero[at]) - 8.0f * s[c]));
    }
    const __m512i twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    for (int h = 0; h < 4; h++) {
        sd[h] = _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(_mm256_loadu_ps(s + 8 * h)));
        zd[h] = _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(_mm256_loadu_ps(z + 8 * h)));
    }
}

static void i4_panel(const job_t *j, long n0, long p0, long kn, uint32_t *buf)
{
    const struct i4_info *q = j->i4;
    const long K = j->K, groups = K / q->group, half = q->block / 2;
    const int r0 = (int)(n0 % q->block);
    const uint8_t *blk = (const uint8_t *)j->w + n0 / q->block * K * half;  /* column k at blk + k * half */
    __m512 sd[4], zd[4];
    long g_at = -1;
    for (long p = 0; p < kn; p++) {
        const long k = 2 * (p0 + p);
        if (k / q->group != g_at) {
            g_at = k / q->group;
            i4_group_scales(q, groups, n0, g_at, sd, zd);
        }
        const __m256i a = i4_column(blk + k * half, q->block, q->split, r0);
        const __m256i b = i4_column(blk + (k + 1) * half, q->block, q->split, r0);
        for (int h = 0; h < 2; h++) {  /* channels 16 h .. 16 h + 15 */
            const __m128i ah = h ? _mm256_extracti128_si256(a, 1) : _mm256_castsi256_si128(a);
            const __m128i bh = h ? _mm256_extracti128_si256(b, 1) : _mm256_castsi256_si128(b);
            const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(ah, bh))),
                                              sd[2 * h], zd[2 * h]);
            const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(ah, bh))),
                                              sd[2 * h + 1], zd[2 * h + 1]);
            _mm512_store_si512(buf + p * I8G_PANEL + 16 * h, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* ---- int4 weights at a few rows of x: a GEMV on torch's CPU int4 layout, on the integers ----

   At a few rows the GEMM above spends most of its time dequantizing (a multiply-add and a rounding a
   weight). Here a weight is used as its integer, and each group's sums are scaled once, the weights
   (q - 8) s + zero exactly:
     y[m, n] = sum over groups g of  s[n, g] A[m, n, g] + zero[n, g] X[m, g],
     A = sum_{k in g} x[m, k] (q[n, k] - 8) (vdpbf16ps: exact products, float32 sums; computed as the
       sums of x (128 + q) less 136 X, below),
     X = sum_{k in g} x[m, k] (float32, once per call),
   then rounded once to bfloat16. These are torch's int4 kernel's weights, (q - 8) s + zero in float32,
   not the bfloat16 roundings the GEMM and the dequantized matmul multiply (each within a bfloat16 rounding
   of the other).
   - 16 bytes of each column of a block are a unit of 32 channels (a block of 64 has two): their low
     nibbles one vector of 16 channels, their high nibbles another (I4V_CHANNEL says which). Per pair of
     columns, two zero-extending loads, a shift and an or make 16 lanes of (column k, column k + 1) nibble
     pairs, and a vpternlogd per vector or's each nibble into the bits of bfloat16 128: the bfloat16
     128 + q exactly, 7 instructions for 64 weights, shared by all rows of x. The group's sums are then of
     128 + q, and the correction zero - 136 s (one rounding) takes the 128 back with the 8.
   - A tile is up to I4V_MR rows of x by a block's 2 vectors (16 accumulators) or I4V_MR4 rows by its 4
     (24: with the 4 weight vectors, a broadcast and 2 constants, 31 of the 32 registers); a row's pair of
     x is broadcast to every lane. Blocks of 64 take tiles of 6 rows, faster than 4. After each group the
     tile's sums are scaled into the block's running sums (a per-thread buffer), the scales gathered
     (i4v_group_scales).
   - The threads split the blocks (static): each streams its contiguous range of the weight, with a software
     prefetch I4_PF_DIST bytes ahead (without it one row of x falls well behind torch's int4 kernel). Each
     output is one lane's sums in a fixed order: results depend neither on the other rows of the call nor
     on the threads.
   - Or'ing into 128's bits is faster than a vpermw table of bfloat16(q - 8), and units of 32 channels
     share a pass over a block of 64. The GEMM above takes over at 32 rows, where it decodes faster in a
     model. Figures and the variants tried: docs/PERFORMANCE.md#native-int4-gemv-bf16 */

#ifndef I4V_MR
#define I4V_MR 8                  /* rows of x per tile of 2 vectors */
#endif
#ifndef I4V_MR4
#define I4V_MR4 6                 /* rows of x per tile of 4 vectors (blocks of 64) */
#endif
#ifndef I4G_MIN_ROWS
#define I4G_MIN_ROWS 32           /* gemm_int4 takes the GEMM from this many rows of x on */
#endif

static int g_i4g_min_rows = I4G_MIN_ROWS;

/* the channel, in its block, of lane i of vector v (0: low nibbles, 1: high) of unit c (bytes 16c..) */
#define I4V_CHANNEL(block, split, c, v, i) ((split) ? (v) * ((block) / 2) + 16 * (c) + (i) : 32 * (c) + 2 * (i) + (v))

/* rows [0, mr) of x (pairs from x, rows ldx apart) times kp pairs of columns of a block (col: its first; columns
   half bytes apart), ns units (1 or 2: 16 bytes of a column each): acc[m][2 u + v] += lane sums of unit u's
   vector v, the weights as 128 + q */
static inline __attribute__((always_inline)) void i4v_tile(const uint8_t *col, long half, long kp, const uint16_t *x,
                                                           long ldx, int ns, int mr, long pf, __m512 acc[I4V_MR][4])
{
    const __m512i low = _mm512_set1_epi32(0x000f000f), b128 = _mm512_set1_epi32(0x43004300);
    for (long p = 0; p < kp; p++) {
        __m512bh w[4];
        _mm_prefetch((const char *)col + 2 * p * half + pf, _MM_HINT_T1);  /* the stream's line pf bytes ahead */
        _Pragma("GCC unroll 2") for (int u = 0; u < 2; u++) {
            if (u >= ns) break;
            const uint8_t *at = col + 2 * p * half + 16 * u;
            const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)at));
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(at + half)));
            const __m512i c = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));  /* word 2i: column k's byte, 2i+1: k+1's */
            /* each word's nibble or'd into bfloat16 128's bits: the bfloat16 128 + q, exactly */
            w[2 * u] = (__m512bh)_mm512_ternarylogic_epi32(c, low, b128, 0xea);  /* (c & low) | b128 */
            w[2 * u + 1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(c, 4), low, b128, 0xea);
        }
        _Pragma("GCC unroll 8") for (int m = 0; m < I4V_MR; m++) {
            if (m >= mr) break;
            int32_t pair;
            memcpy(&pair, x + m * ldx + 2 * p, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; v++) {
                if (v >= 2 * ns) break;
                acc[m][v] = _mm512_dpbf16_ps(acc[m][v], w[v], xb);
            }
        }
    }
}

/* channels (I4V_CHANNEL) of unit c, vector v, times G: where their group-0 scales are, in elements */
static inline __m512i i4v_index(int block, int split, int c, int v, long G)
{
    int32_t at[16];
    for (int i = 0; i < 16; i++) at[i] = (int32_t)(I4V_CHANNEL(block, split, c, v, i) * G);
    return _mm512_loadu_si512(at);
}

/* unit c of block b, group g: scales s (bfloat16 -> float32) and zero - 136 s (one rounding) of both vectors'
   channels. Gathered as the high halves of 32-bit words ending at each bfloat16, so no byte past the tensors'
   ends is read; the word of the tensors' first element (block 0, unit 0, group 0) would start 2 bytes
   before them, so that one is read a value at a time */
static inline void i4v_group_scales(const struct i4_info *q, long G, long b, int c, long g, const __m512i idx[2],
                                    __m512 sv[2], __m512 zv[2])
{
    const long first = b * q->block * G + g;  /* the element of channel 0 of the block, group g */
    for (int v = 0; v < 2; v++) {
        __m512 s, z;
        if (first == 0 && c == 0) {
            float sc[16], zc[16];
            for (int i = 0; i < 16; i++) {
                const long at = I4V_CHANNEL(q->block, q->split, 0, v, i) * G;
                sc[i] = bf16_to_f32(q->scale[at]);
                zc[i] = bf16_to_f32(q->zero[at]);
            }
            s = _mm512_loadu_ps(sc);
            z = _mm512_loadu_ps(zc);
        } else {
            const __m512i high = _mm512_set1_epi32((int32_t)0xffff0000);
            s = _mm512_castsi512_ps(_mm512_and_si512(
                _mm512_i32gather_epi32(idx[v], (const char *)(q->scale + first) - 2, 2), high));
            z = _mm512_castsi512_ps(_mm512_and_si512(
                _mm512_i32gather_epi32(idx[v], (const char *)(q->zero + first) - 2, 2), high));
        }
        sv[v] = s;
        zv[v] = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), s, z);
    }
}

/* one tile: rows [m0, m0 + mr) of x times group g's columns of a block (col: the group's first), the sums
   scaled into the block's running sums tot (row m at tot + 64 m; the group's first sets them) */
static inline void i4v_rows(const job_t *j, const uint8_t *col, long m0, int mr, long g, long G, long pf,
                            const float *xs, const __m512 sv[4], const __m512 zv[4], float *tot)
{
    const long K = j->K, group = j->i4->group, half = j->i4->block / 2, gp = group / 2;
    const int ns = (int)(half / 16);
    const uint16_t *x = j->x + m0 * K + g * group;
    __m512 acc[I4V_MR][4];
    for (int r = 0; r < I4V_MR; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
    /* each case a tile of its own, reading rows [m0, m0 + mr) of x only */
#define I4V_CASE(r) case r: if (ns == 1) i4v_tile(col, half, gp, x, K, 1, r, pf, acc); \
                        else i4v_tile(col, half, gp, x, K, 2, r < I4V_MR4 ? r : I4V_MR4, pf, acc); break;
    switch (mr) {
    I4V_CASE(1) I4V_CASE(2) I4V_CASE(3) I4V_CASE(4) I4V_CASE(5) I4V_CASE(6) I4V_CASE(7)
    default: i4v_tile(col, half, gp, x, K, 1, I4V_MR, pf, acc); break;
    }
#undef I4V_CASE
    for (int r = 0; r < mr; r++) {
        const __m512 xg = _mm512_set1_ps(xs[(m0 + r) * G + g]);
        for (int v = 0; v < 2 * ns; v++) {
            float *at = tot + (m0 + r) * 64 + 16 * v;
            const __m512 t0 = _mm512_fmadd_ps(acc[r][v], sv[v], g ? _mm512_loadu_ps(at) : _mm512_setzero_ps());
            _mm512_storeu_ps(at, _mm512_fmadd_ps(zv[v], xg, t0));
        }
    }
}

/* y = x times the int4 weight for M rows of x (gemm_int4 below I4G_MIN_ROWS rows): 0, or -1 without memory */
static int gemv_int4_dp(const job_t *j, int nthreads)
{
    const struct i4_info *q = j->i4;
    const long M = j->M, N = j->N, K = j->K, G = K / q->group, half = q->block / 2, blocks = N / q->block;
    const int ns = q->block / 32, nv = 2 * ns, mt = ns == 1 ? I4V_MR : I4V_MR4;  /* mt: rows a tile */
    float *xs = malloc(sizeof(float) * (size_t)(M * G));  /* X[m, g] */
    if (nthreads < 1) nthreads = 1;
    if (nthreads > blocks) nthreads = (int)blocks;
    if (N * K / 2 < g_min_parallel) nthreads = 1;
    float *tots = malloc(sizeof(float) * 64 * (size_t)M * (size_t)nthreads);
    if (!xs || !tots) {
        free(xs);
        free(tots);
        return -1;
    }
    for (long m = 0; m < M; m++)
        for (long g = 0; g < G; g++) {
            __m512 s = _mm512_setzero_ps();
            for (long k = g * q->group; k < (g + 1) * q->group; k += 16)
                s = _mm512_add_ps(s, vf_load_bf16(j->x + m * K + k));
            xs[m * G + g] = _mm512_reduce_add_ps(s);
        }
    const long ly = ldy_of(j), pf = g_pf_dist > 0 ? I4_PF_DIST : 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *tot = tots + 64 * M * omp_get_thread_num();  /* row m's sums: tot[64 m + 16 v' + lane] */
        __m512i idx[4];
        for (int v = 0; v < nv; v++) idx[v] = i4v_index(q->block, q->split, v / 2, v % 2, G);
#pragma omp for schedule(static)
        for (long b = 0; b < blocks; b++) {
            const uint8_t *cols = (const uint8_t *)j->w + b * K * half;
            for (long g = 0; g < G; g++) {
                __m512 sv[4], zv[4];  /* the scales, and zero - 136 s (the sums are of 128 + q, not q - 8) */
                for (int u = 0; u < ns; u++) i4v_group_scales(q, G, b, u, g, idx + 2 * u, sv + 2 * u, zv + 2 * u);
                const long tiles = (M + mt - 1) / mt, base = M / tiles;
                for (long t = 0, m0 = 0; t < tiles; t++) {
                    const int mr = (int)(base + (t < M % tiles));
                    i4v_rows(j, cols + g * q->group * half, m0, mr, g, G, pf, xs, sv, zv, tot);
                    m0 += mr;
                }
            }
            uint16_t *y = (uint16_t *)j->y + b * q->block;
            for (long m = 0; m < M; m++)
                for (int v = 0; v < nv; v++)
                    for (int i = 0; i < 16; i++)
                        y[m * ly + I4V_CHANNEL(q->block, q->split, v / 2, v % 2, i)] = f32_to_bf16(tot[m * 64 + 16 * v + i]);
        }
    }
    free(xs);
    free(tots);
    return 0;
}
#else /* !HAVE_DP */

/* ---- int4 weights without bfloat16 dot products (AVX2, AVX-512 without BF16, the generic build): a GEMV
   on the integers in float32 FMAs ----

   gemv_int4_dp's sums on the vector layer: the weights (q - 8) s + zero exactly, as torch's int4 kernel,
     y[m, n] = sum over groups g of  s[n, g] A[m, n, g] + (zero[n, g] - 8 s[n, g]) X[m, g],
     A = sum_{k in g} x[m, k] q[n, k]  (x widened to float32 once per call: each product exact; float32
       lane sums in k order),  X = sum_{k in g} x[m, k]  (float32, once per call),
   rounded once to bfloat16.
   - VW bytes of a column of a block are a unit: vf_load_u4 makes their low nibbles one vector of VW
     channels and their high nibbles another (I4F_CHANNEL says which), as float32: a zero-extending load, an
     and, a shift and two conversions for 2 VW weights, shared by the tile's rows of x.
   - One row of x takes all of a block's units in one tile (on AVX2 a column of a block of 32 is 2 units:
     4 accumulators), the block's running sums kept in registers from group to group (i4f_row1). Two rows
     take 2 units a tile (8 FMA chains). More rows take one unit at a time, I4F_MR rows of x a tile, so a
     unit's conversion serves that many rows (the broadcasts of x are loads). I4F_MR is 5 on AVX2: tiles
     of 6 rows (12 accumulators) leave its 16 registers one short, and the compiler spills an accumulator
     (docs/PERFORMANCE.md#avx2-int4).
   - A block's scales are transposed once, lane by lane for every group (i4f_block_scales).
   - The threads split the blocks (static), each streaming its range of the weight, a software prefetch
     I4_PF_DIST bytes ahead (gemv_int4_dp's). Each output is one lane's sums in a
     fixed order, whatever the call's other rows and the threads. */

#ifndef I4F_MR
#define I4F_MR ((VREGS - 6) / 2 < 8 ? (VREGS - 6) / 2 : 8)  /* rows of x per tile of one unit (AVX2: 5) */
#endif
#define I4F_NV (64 / VW)  /* vectors of a block of 64's column (AVX2: 8) */

/* the channel, in its block, of lane i of vector v (0: low nibbles, 1: high) of unit u (bytes VW u..) */
#define I4F_CHANNEL(block, split, u, v, i) \
    ((split) ? (v) * ((block) / 2) + VW * (u) + (i) : 2 * (VW * (u) + (i)) + (v))

/* rows [0, mr) of x (x: float32, column k's rows at x + k ldx, side by side) times kn columns (half bytes
   apart) of units [0, nu) at col: acc[m][2 u + v] += x times unit u's vector v, in k order; a prefetch pf
   bytes ahead every 64 bytes (pf 0: none) */
static inline __attribute__((always_inline)) void i4f_tile(const uint8_t *col, long half, long kn, const float *x,
                                                           long ldx, int nu, int mr, long pf, vf acc[I4F_MR][I4F_NV])
{
    const long line = 64 / half - 1;  /* columns a cache line, less 1 (2 or 4 columns: a mask) */
    for (long k = 0; k < kn; k++) {
        const uint8_t *at = col + k * half;
        if (pf && (k & line) == 0) __builtin_prefetch(at + pf, 0, 2);
        _Pragma("GCC unroll 8") for (int u = 0; u < I4F_NV / 2; u++) {
            if (u >= nu) break;
            vf lo, hi;
            vf_load_u4(at + VW * u, &lo, &hi);
            _Pragma("GCC unroll 8") for (int m = 0; m < I4F_MR; m++) {
                if (m >= mr) break;
                const vf xb = vf_set1(x[k * ldx + m]);
                acc[m][2 * u] = vf_fmadd(lo, xb, acc[m][2 * u]);
                acc[m][2 * u + 1] = vf_fmadd(hi, xb, acc[m][2 * u + 1]);
            }
        }
    }
}

/* block b's scales of every group, lane by lane, in float32 (chan: each lane's channel in the block):
   group g's at sc + g block (the scales) and zc + g block (zero - 8 s: 8 s exact, so one rounding), read by
   the tiles' vector loads. Each channel's G scales are read in a row, written far ahead of their loads: a
   gather per group (a channel's scales G apart) with narrow stores read back at once by a vector load had
   cost a third of a row of x's time (docs/PERFORMANCE.md#avx2-int4). On AVX2, 8 lanes of consecutive
   channels take 8 groups at a time through an 8 x 8 transpose of their bfloat16s. */
#if defined(GPTJ_ISA_AVX2)
/* rows r[0..8) of 8 bfloat16 each (the scales of 8 channels over 8 groups), transposed: out[g] = the 8
   channels' scales of group g, as float32 */
static inline void bf16_8x8_t(const uint16_t *const r[8], vf out[8])
{
    __m128i a[8], b[8];
    for (int i = 0; i < 8; i++) a[i] = _mm_loadu_si128((const __m128i *)r[i]);
    for (int i = 0; i < 4; i++) {  /* pairs of rows, 16-bit words interleaved */
        b[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
        b[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {  /* quads of rows, 32-bit pairs interleaved */
        a[4 * i] = _mm_unpacklo_epi32(b[4 * i], b[4 * i + 2]);
        a[4 * i + 1] = _mm_unpackhi_epi32(b[4 * i], b[4 * i + 2]);
        a[4 * i + 2] = _mm_unpacklo_epi32(b[4 * i + 1], b[4 * i + 3]);
        a[4 * i + 3] = _mm_unpackhi_epi32(b[4 * i + 1], b[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {  /* all 8 rows: groups 2i and 2i + 1 */
        const __m128i lo = _mm_unpacklo_epi64(a[i], a[i + 4]), hi = _mm_unpackhi_epi64(a[i], a[i + 4]);
        out[2 * i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16));
        out[2 * i + 1] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16));
    }
}
#endif

static void i4f_block_scales(const struct i4_info *q, const int *chan, long b, long G, float *sc, float *zc)
{
    const long block = q->block;
    for (long L = 0; L < block; L += VW) {
        long g0 = 0;
#if defined(GPTJ_ISA_AVX2)
        if (chan[L + 7] == chan[L] + 7) {  /* consecutive channels (the split layout) */
            const uint16_t *rs[8], *rz[8];
            for (; g0 + 8 <= G; g0 += 8) {
                for (int i = 0; i < 8; i++) {
                    rs[i] = q->scale + (b * block + chan[L] + i) * G + g0;
                    rz[i] = q->zero + (b * block + chan[L] + i) * G + g0;
                }
                vf s[8], z[8];
                bf16_8x8_t(rs, s);
                bf16_8x8_t(rz, z);
                for (int g = 0; g < 8; g++) {
                    vf_storeu(sc + (g0 + g) * block + L, s[g]);
                    vf_storeu(zc + (g0 + g) * block + L, vf_fnmadd(vf_set1(8.0f), s[g], z[g]));
                }
            }
        }
#endif
        for (long i = 0; i < VW; i++) {
            const long row = (b * block + chan[L + i]) * G;  /* the lane's channel's scales */
            const uint16_t *sp = q->scale + row, *zp = q->zero + row;
            for (long g = g0; g < G; g++) {
                const float s = bf16_to_f32(sp[g]);
                sc[g * block + L + i] = s;
                zc[g * block + L + i] = bf16_to_f32(zp[g]) - 8.0f * s;
            }
        }
    }
}

/* one tile: rows [m0, m0 + mr) of x (xg: group g's columns, transposed; mr a constant where inlined) times
   units [u0, u0 + nu) of group g's columns of a block (col: the group's first; nu a constant too), the sums
   scaled (sc, zc: the group's lane by lane) into the block's running sums tot (row m at tot + 64 m; the
   group's first sets them) */
static inline __attribute__((always_inline)) void i4f_unit(const struct i4_info *q, const uint8_t *col,
                                                           const float *xg, long M, long m0, long u0, long pf,
                                                           long g, const float *xs, long G, const float *sc,
                                                           const float *zc, float *tot, const int mr,
                                                           const int nu)
{
    vf acc[I4F_MR][I4F_NV];  /* rows [0, mr), vectors [0, 2 nu) */
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < 2 * nu; v++) acc[r][v] = vf_zero();
    i4f_tile(col + VW * u0, q->block / 2, q->group, xg + m0, M, nu, mr, pf, acc);
    for (int r = 0; r < mr; r++) {
        const vf xsum = vf_set1(xs[(m0 + r) * G + g]);
        for (int v = 0; v < 2 * nu; v++) {
            const long lane = (2 * u0 + v) * VW;
            float *o = tot + (m0 + r) * 64 + lane;
            const vf t0 = vf_fmadd(acc[r][v], vf_loadu(sc + lane), g ? vf_loadu(o) : vf_zero());
            vf_storeu(o, vf_fmadd(vf_loadu(zc + lane), xsum, t0));
        }
    }
}

/* i4f_unit for 1 to I4F_MR rows of one unit, or 2 rows of 2 units (nu 2: the FMA chains of 2 rows of 1 unit, 4,
   were too few), each a tile of its own (reading rows [m0, m0 + mr) only) */
static void i4f_rows(const struct i4_info *q, const uint8_t *col, const float *xg, long M, long m0, int mr, long u0,
                     int nu, long pf, long g, const float *xs, long G, const float *sc, const float *zc, float *tot)
{
    if (nu == 2 && mr == 2) {
        i4f_unit(q, col, xg, M, m0, u0, pf, g, xs, G, sc, zc, tot, 2, 2);
        return;
    }
    switch (mr) {
#define I4F_CASE(r) case r: i4f_unit(q, col, xg, M, m0, u0, pf, g, xs, G, sc, zc, tot, \
                                      (r) < I4F_MR ? (r) : I4F_MR, 1); break;  /* cases past I4F_MR: never taken */
    I4F_CASE(1) I4F_CASE(2) I4F_CASE(3) I4F_CASE(4) I4F_CASE(5) I4F_CASE(6) I4F_CASE(7)
    default: i4f_unit(q, col, xg, M, m0, u0, pf, g, xs, G, sc, zc, tot, I4F_MR, 1); break;
#undef I4F_CASE
    }
}

/* one row of x, a whole block (M = 1; nu: the block's units, a constant where inlined): each group's
   sums (2 nu vectors, all of the block's columns in one tile) scaled into the block's running sums, both
   in registers, as i4f_rows sums them (the same roundings in the same order); stored to tot at the end */
static inline __attribute__((always_inline)) void i4f_row1(const uint8_t *cols, long half, long group, long G,
                                                           const float *xf, const float *xs, long pf,
                                                           const float *sc, const float *zc, float *tot, int nu)
{
    vf run[I4F_NV];
    for (int v = 0; v < 2 * nu; v++) run[v] = vf_zero();
    for (long g = 0; g < G; g++) {
        vf acc[I4F_MR][I4F_NV];  /* i4f_tile's shape; row 0 only */
        for (int v = 0; v < 2 * nu; v++) acc[0][v] = vf_zero();
        i4f_tile(cols + g * group * half, half, group, xf + g * group, 1, nu, 1, pf, acc);
        const vf xsum = vf_set1(xs[g]);
        for (int v = 0; v < 2 * nu; v++)
            run[v] = vf_fmadd(vf_loadu(zc + g * (2 * nu * VW) + v * VW), xsum,
                              vf_fmadd(acc[0][v], vf_loadu(sc + g * (2 * nu * VW) + v * VW), run[v]));
    }
    for (int v = 0; v < 2 * nu; v++) vf_storeu(tot + v * VW, run[v]);
}

/* y = x times the int4 weight (gemm_int4 at every row count without HAVE_DP): 0, or -1 without memory */
static int gemv_int4_vf(const job_t *j, int nthreads)
{
    const struct i4_info *q = j->i4;
    const long M = j->M, N = j->N, K = j->K, group = q->group, G = K / group, half = q->block / 2;
    const long blocks = N / q->block, units = half / VW, ly = ldy_of(j), pf = g_pf_dist > 0 ? I4_PF_DIST : 0;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > blocks) nthreads = (int)blocks;
    if (N * K / 2 < g_min_parallel) nthreads = 1;
    float *xf = malloc(sizeof(float) * (size_t)(M * K + M * G));  /* x in float32, then X[m, g] */
    float *tots = malloc(sizeof(float) * 64 * (size_t)M * (size_t)nthreads);
    float *tabs = malloc(sizeof(float) * 2 * (size_t)(G * q->block) * (size_t)nthreads);  /* scale tables */
    if (!xf || !tots || !tabs) {
        free(xf);
        free(tots);
        free(tabs);
        return -1;
    }
    float *xs = xf + M * K;  /* xf: x transposed, x[m, k] at xf[k M + m] (a tile's rows of a column side by side) */
    for (long m = 0; m < M; m++)  /* K is a multiple of the group, the group of 16 */
        for (long g = 0; g < G; g++) {
            vf s = vf_zero();
            for (long k = g * group; k < (g + 1) * group; k += VW) {
                const vf v = vf_load_bf16(j->x + m * K + k);
                float f[VW];
                vf_storeu(f, v);
                for (int i = 0; i < VW; i++) xf[(k + i) * M + m] = f[i];
                s = vf_add(s, v);
            }
            xs[m * G + g] = vf_reduce_add(s);
        }
#pragma omp parallel num_threads(nthreads)
    {
        const int me = omp_get_thread_num();
        float *tot = tots + 64 * M * me;  /* row m's sums: tot[64 m + VW v' + lane] */
        float *sc = tabs + 2 * G * q->block * me, *zc = sc + G * q->block;  /* the block's i4f_block_scales */
        int chan[64];  /* lane L's channel in the block */
        for (long u = 0; u < units; u++)
            for (int v = 0; v < 2; v++)
                for (int i = 0; i < VW; i++) chan[(2 * u + v) * VW + i] = I4F_CHANNEL(q->block, q->split, u, v, i);
#pragma omp for schedule(static)
        for (long b = 0; b < blocks; b++) {
            const uint8_t *cols = (const uint8_t *)j->w + b * K * half;
            i4f_block_scales(q, chan, b, G, sc, zc);
            if (M == 1) {  /* all of a block's units a tile (1, 2 or 4: each a tile of its own) */
                if (units == 1) i4f_row1(cols, half, group, G, xf, xs, pf, sc, zc, tot, 1);
                else if (units == 2) i4f_row1(cols, half, group, G, xf, xs, pf, sc, zc, tot, 2);
                else i4f_row1(cols, half, group, G, xf, xs, pf, sc, zc, tot, 4);
            } else for (long g = 0; g < G; g++) {  /* I4F_MR rows of x a tile at most; 2 rows: 2 units a tile */
                const long tiles = (M + I4F_MR - 1) / I4F_MR, base = M / tiles;
                const int nu = M == 2 && units % 2 == 0 ? 2 : 1;
                for (long u0 = 0; u0 < units; u0 += nu)
                    for (long t = 0, m0 = 0; t < tiles; t++) {
                        const int mr = (int)(base + (t < M % tiles));
                        i4f_rows(q, cols + g * group * half, xf + g * group * M, M, m0, mr, u0, nu,
                                 u0 == 0 && t == 0 ? pf : 0, g, xs, G, sc + g * q->block, zc + g * q->block, tot);
                        m0 += mr;
                    }
            }
            uint16_t *y = (uint16_t *)j->y + b * q->block;
            for (long m = 0; m < M; m++)
                for (long u = 0; u < units; u++)
                    for (int v = 0; v < 2; v++)
                        for (int i = 0; i < VW; i++)
                            y[m * ly + I4F_CHANNEL(q->block, q->split, u, v, i)] =
                                f32_to_bf16(tot[m * 64 + (2 * u + v) * VW + i]);
        }
    }
    free(xf);
    free(tots);
    free(tabs);
    return 0;
}
#endif /* HAVE_DP */

/* ---- exported entry points ---- */

/* *at, set to rows where rows > 0: the crossover setters' body; returns the value before */
static inline int swap_min_rows(int *at, int rows)
{
    const int old = *at;
    if (rows > 0) *at = rows;
    return old;
}

/* the rows of x from which gemv_int8 takes the int8 GEMM (rows > 0 sets it: benchmarks compare the two);
   returns the value before, or 0 where the library has no such GEMM (without HAVE_DP) */
int int8_gemm_set_min_rows(int rows)
{
#if HAVE_DP
    return swap_min_rows(&g_i8g_min_rows, rows);
#else
    (void)rows;
    return 0;
#endif
}


/* each returns 0, or -1 where memory for the kernel's copy of x (AVX2: in float32; the int8 GEMM: padded)
   or its buffers could not be had */

/* int8 weights: the GEMM from g_i8g_min_rows rows of x where the library has it, else the GEMV */
static int run_int8(job_t *j, int nthreads)
{
#if HAVE_DP
    if (j->M >= g_i8g_min_rows && j->K > 0 && j->N > 0) return gemm_panels_dp(j, nthreads, i8g_panel);
#endif
    return run(j, nthreads);
}

int gemv_int8(const uint16_t *x, const int8_t *w, const uint16_t *scale, const uint16_t *bias,
              uint16_t *y, int M, int N, int K, int nthreads)
{
    job_t j = {x, w, scale, bias, y, 0, 1, M, N, K, NULL, 0};
    return run_int8(&j, nthreads);
}

int gemv_int8_f32(const uint16_t *x, const int8_t *w, const uint16_t *scale, const uint16_t *bias,
                  float *y, int M, int N, int K, int nthreads)
{
    job_t j = {x, w, scale, bias, y, 1, 1, M, N, K, NULL, 0};
    return run_int8(&j, nthreads);
}

/* int4 weights (whole blocks of torch's CPU layout, elementwise.c's int4_dequant_t_bf16 says it; block 32 or
   64; groups of a multiple of 16 inputs): y (M, N) bfloat16, rows ldy apart, = x times the weight's
   transpose, float32 sums rounded once (no bias). With HAVE_DP: below g_i4g_min_rows rows of x the GEMV (the
   weights (q - 8) s + zero exactly), from there the GEMM (their bfloat16 roundings, as int4_dequant_t makes
   them); without, the vector layer's GEMV at every row count (the exact weights). Returns 0, -1 without
   memory, -2 where the block is not 32 or 64 or the group not a multiple of 16. */
int gemm_int4(const uint16_t *x, const uint8_t *packed, const uint16_t *scale, const uint16_t *zero, uint16_t *y,
              int M, int N, int K, int block, int split, int group, long ldy, int nthreads)
{
    if ((block != 32 && block != 64) || group <= 0 || group % 16) return -2;
    if (M <= 0 || N <= 0 || K <= 0) return 0;
    const struct i4_info q = {block, split, group, scale, zero};
    job_t j = {x, packed, NULL, NULL, y, 0, 0, M, N, K, NULL, 0, ldy, &q};
#if HAVE_DP
    return M < g_i4g_min_rows ? gemv_int4_dp(&j, nthreads) : gemm_panels_dp(&j, nthreads, i4_panel);
#else
    return gemv_int4_vf(&j, nthreads);
#endif
}

/* the rows of x from which gemm_int4 takes the GEMM instead of the GEMV (rows > 0 sets it: benchmarks compare
   the two); returns the value before, or 0 where the library has no int4 GEMM (without HAVE_DP: the GEMV at
   every row count) */
int int4_gemm_set_min_rows(int rows)
{
#if HAVE_DP
    return swap_min_rows(&g_i4g_min_rows, rows);
#else
    (void)rows;
    return 0;
#endif
}

/* 1: every library has gemm_int4 (a library built before the vector layer's int4 GEMV answered 0 without
   HAVE_DP) */
int gemm_int4_available(void) { return 1; }

int gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
              int M, int N, int K, int nthreads)
{
    job_t j = {x, w, NULL, bias, y, 0, 0, M, N, K, NULL, 0};
    return run(&j, nthreads);
}

int gemv_bf16_f32(const uint16_t *x, const uint16_t *w, const uint16_t *bias, float *y,
                  int M, int N, int K, int nthreads)
{
    job_t j = {x, w, NULL, bias, y, 1, 0, M, N, K, NULL, 0};
    return run(&j, nthreads);
}

/* ---- W8A8: int8 activations x int8 weights, exact int32 sums, at any rows ---------------------------

   y[m, n] = bfloat16(bfloat16(float(sum_k q[m, k] w[n, k]) * ws[n] * sx[m]) + bias[n]) (no bias: the
   first rounding only; y_f32: float32, float(sum) * ws * sx + bias): the numbers of W8A8Linear, whose
   int32 sums are exact too. q arrives as oneDNN's uint8 form (q + 128, gptj.native's quantize_rows_u8)
   and is widened to int16 once per call; each product is at most 128 x 127, a lane's pair of them
   (vpmaddwd on AVX2, VNNI's vpdpwssd on AVX-512) adds into an int32 exactly, and so do the sums while
   |sum| < 2^31: K <= 131072.

   The weight is packed once (gptj.native.pack_w8a8) into panels of W8A8_PANEL output channels, two
   vectors of VW: panel t holds, for each pair of inputs (2p, 2p + 1), its channels' two weights side by
   side, w[t P + c, 2p + j] at ((t pairs + p) P + c) 2 + j, zeros past N and past K. One load widens VW
   channels' pairs (16 or 32 bytes); a pair of x's int16 broadcast to every lane multiplies all of them.
   So the channels lie along the lanes: no horizontal sums, and each output is its lane's own int32,
   added in k order (results do not depend on the rows or threads of the call).

   The tile is 6 rows of x by one panel: 12 int32 accumulators, 2 weight vectors and a broadcast fill
   AVX2's 16 registers, every weight load serves 6 rows and every broadcast 2 vectors. Named variables,
   not arrays: with arrays GCC spilled 9 of the 12 accumulators to the stack (half the speed, in a
   one-off build during development, as are the figures below but the last). The
   threads split the panels. An x of more than W8A8_WHOLE_BYTES (prefill's rows) goes in blocks of rows, and
   K in slices of W8A8_KC pairs, one slice of all panels at a time: the block's slice of x stays in L2,
   a panel's slice in L1 while the block's tiles pass over it, and the int32 sums wait in a buffer
   between slices (still exact; at K = 16384 unsliced panels were evicted by x's stream: 160 -> 290
   GOP/s). Returns 0; -1 for K too large; -2 without memory. */

#define W8A8_PANEL (2 * VW)  /* output channels per panel */
#define W8A8_MR 6            /* rows of x per tile */
#ifndef W8A8_KC
#define W8A8_KC 512          /* pairs of inputs per slice: a panel's slice (16 or 32 KiB) stays in L1 */
#endif
#define W8A8_PF_DIST 4096   /* bytes of the panels a tile's prefetch runs ahead (see w8a8_block) */
#ifndef W8A8_X_BYTES
#define W8A8_X_BYTES (256 * 1024)  /* int16 x per block of rows and slice: it stays in L2 */
#endif
#ifndef W8A8_WHOLE_BYTES
#define W8A8_WHOLE_BYTES (384 * 1024)  /* int16 x up to this stays in L2 whole: decode's rows */
#endif
#ifndef W8A8_PANEL_L2
#define W8A8_PANEL_L2 (128 * 1024)  /* a panel up to this stays in L2 while decode's tiles pass over it whole */
#endif

int w8a8_panel(void) { return W8A8_PANEL; }

/* acc[m][v] += the int32 sums of the first mr rows of x (int16, rows ldx apart) against one panel's
   2 vectors of channels, over `pairs` pairs of inputs; mr is a constant where it is inlined */
static inline __attribute__((always_inline)) void w8a8_tile(const int16_t *x, long ldx, const int8_t *panel,
                                                             long pairs, const int mr, vi acc[W8A8_MR][2],
                                                             const int8_t *pf)
{
    vi a00 = acc[0][0], a01 = acc[0][1], a10 = acc[1][0], a11 = acc[1][1], a20 = acc[2][0], a21 = acc[2][1];
    vi a30 = acc[3][0], a31 = acc[3][1], a40 = acc[4][0], a41 = acc[4][1], a50 = acc[5][0], a51 = acc[5][1];
    const int16_t *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx, *x5 = x + 5 * ldx;
    for (long p = 0; p < pairs; p++) {
        const int8_t *wp = panel + p * W8A8_PANEL * 2;
        if (pf && (p * W8A8_PANEL * 2) % 64 == 0) __builtin_prefetch(pf + p * W8A8_PANEL * 2, 0, 3);
        const vi w0 = vi_load_i8_i16(wp), w1 = vi_load_i8_i16(wp + VI16);
#define W8A8_ROW(m)                                                                                        \
        if (mr > m) {                                                                                      \
            const vi xb = vi_bcast_pair(x##m + 2 * p);                                                     \
            a##m##0 = vi_dot_i16(a##m##0, w0, xb);                                                         \
            a##m##1 = vi_dot_i16(a##m##1, w1, xb);                                                         \
        }
        W8A8_ROW(0) W8A8_ROW(1) W8A8_ROW(2) W8A8_ROW(3) W8A8_ROW(4) W8A8_ROW(5)
#undef W8A8_ROW
    }
    acc[0][0] = a00; acc[0][1] = a01; acc[1][0] = a10; acc[1][1] = a11; acc[2][0] = a20; acc[2][1] = a21;
    acc[3][0] = a30; acc[3][1] = a31; acc[4][0] = a40; acc[4][1] = a41; acc[5][0] = a50; acc[5][1] = a51;
}

typedef struct {
    const int16_t *xq;   /* x as int16, rows ldx apart */
    long ldx, pairs;     /* pairs of inputs in all (the panels' length) */
    const float *sx, *ws;
    const int8_t *w;     /* the panels */
    const uint16_t *bias;
    void *y;
    int y_f32, N;
    int32_t *c;          /* the sums between slices: a block's rows x the panels' channels */
    long ldc;
    int stream;          /* each panel is read from memory once, by the first tile over each of its slices */
} w8a8_job;

/* one tile: rows [m, m + mr) of block m0, panel t, over the slice [k0, k0 + kn) of the pairs: the
   sums so far from c (none at the first slice), and after the last slice W8A8Linear's scaling, bias
   and roundings into y; before it, the sums back into c */
static void w8a8_block(const w8a8_job *j, int m0, int m, int mr, int t, long k0, long kn)
{
    vi acc[W8A8_MR][2];
    const int first = k0 == 0, last = k0 + kn == j->pairs;
    int32_t *c = j->c + (long)(m - m0) * j->ldc + (long)t * W8A8_PANEL;
    for (int r = 0; r < W8A8_MR; r++)
        for (int v = 0; v < 2; v++)
            acc[r][v] = first || r >= mr ? vi_zero() : vi_load(c + r * j->ldc + v * VW);
    const int8_t *panel = j->w + ((long)t * j->pairs + k0) * W8A8_PANEL * 2;
    const int16_t *x = j->xq + (long)m * j->ldx + 2 * k0;
    /* the first tile over a panel (decode's x) reads it from memory: from 2 rows on, a cursor
       W8A8_PF_DIST bytes ahead (into the thread's next panels, which follow in memory) hides the
       latency (at 8 rows of GPT-J's 16384 x 4096: 6.6 -> 4.5 ms in a one-off sweep of distances 0-16 KiB;
       benchmarks/w8a8_gemm.py times the result); a single row streams as fast without it (the
       hardware's prefetchers keep up; with it, 4096 x 16384 took 2.3 -> 2.6 ms) */
    const int8_t *pf = mr > 1 && m == m0 && j->stream ? panel + W8A8_PF_DIST : NULL;
    switch (mr) {
    case 1: w8a8_tile(x, j->ldx, panel, kn, 1, acc, pf); break;
    case 2: w8a8_tile(x, j->ldx, panel, kn, 2, acc, pf); break;
    case 3: w8a8_tile(x, j->ldx, panel, kn, 3, acc, pf); break;
    case 4: w8a8_tile(x, j->ldx, panel, kn, 4, acc, pf); break;
    case 5: w8a8_tile(x, j->ldx, panel, kn, 5, acc, pf); break;
    default: w8a8_tile(x, j->ldx, panel, kn, 6, acc, pf); break;
    }
    if (!last) {
        for (int r = 0; r < mr; r++)
            for (int v = 0; v < 2; v++) vi_store(c + r * j->ldc + v * VW, acc[r][v]);
        return;
    }
    for (int v = 0; v < 2; v++) {
        const int col = t * W8A8_PANEL + v * VW, n = j->N - col;
        if (n <= 0) break;
        const vf s = vf_loadu_upto(j->ws + col, n), b = j->bias ? vf_load_bf16_upto(j->bias + col, n) : vf_zero();
        for (int r = 0; r < mr; r++) {
            vf f = vf_mul(vf_mul(vi_to_vf(acc[r][v]), s), vf_set1(j->sx[m + r]));
            const long at = (long)(m + r) * j->N + col;
            if (j->y_f32) {
                if (j->bias) f = vf_add(f, b);
                if (n >= VW) vf_storeu((float *)j->y + at, f);
                else vf_store_f32_n((float *)j->y + at, f, n);
            } else {
                if (j->bias) f = vf_add(vf_round_bf16(f), b);
                vf_store_bf16_upto((uint16_t *)j->y + at, f, n);
            }
        }
    }
}

int gemm_w8a8(const uint8_t *qu, const float *sx, const int8_t *w, const float *ws, const uint16_t *bias, void *y,
              int y_f32, int M, int N, int K, int nthreads)
{
    if (K > 131072) return -1;
    const long pairs = (K + 1) / 2;
    /* x's rows: int16, a zero after an odd K, each row an odd number of 64-byte lines apart (rows a
       multiple of 4 KiB apart would share an L1 set) */
    long ldx = (2 * pairs + 31) / 32 * 32;
    if (ldx / 32 % 2 == 0) ldx += 32;
    const int panels = (N + W8A8_PANEL - 1) / W8A8_PANEL;
    /* x small enough to stay in L2 whole (decode's rows): the threads split the panels, and each panel
       is read from memory in one run by its first tile; the others read it from L2 or, a panel longer
       than W8A8_PANEL_L2, from L1: such a panel goes in slices of W8A8_KC pairs, each passed over by
       every tile (the sums wait in c between slices). Else (prefill's rows) slices of W8A8_KC pairs of
       all panels at a time, in blocks of rows whose slice of x stays in L2. (A one-off sweep, 2 threads,
       AVX2 code, two runs: at 8 and 10 rows of 4096 x 16384, whose x had been just over W8A8_X_BYTES,
       6.9-7.2 and 7.6-7.9 -> 4.3-4.6 and 5.4 ms; at 32 rows of 16384 x 4096 and 50400 x 4096, 16.9-18.6
       -> 13.5-14.7 and 55.7 -> 44.7 ms; 1-24 rows of K = 4096 the same within the noise. Slices of
       every panel at 7-24 rows of K = 4096 had been 3-8 % slower than its whole 64 KiB from L2.) */
    const int whole = (long)M * ldx * 2 <= W8A8_WHOLE_BYTES;
    const int slice = !whole || (M > W8A8_MR && pairs * W8A8_PANEL * 2 > W8A8_PANEL_L2);
    const long kc = slice && pairs > W8A8_KC ? W8A8_KC : pairs;
    int mc = whole ? M : (int)(W8A8_X_BYTES / (4 * kc)) / W8A8_MR * W8A8_MR;
    if (mc > M) mc = M;
    if (mc < 1) mc = 1;
    w8a8_job j = {NULL, ldx, pairs, sx, ws, w, bias, y, y_f32, N, NULL, (long)panels * W8A8_PANEL, whole};
    int16_t *xq = aligned_alloc(64, sizeof(int16_t) * M * ldx);
    int32_t *c = pairs > kc ? aligned_alloc(64, sizeof(int32_t) * mc * j.ldc) : NULL;
    if (!xq || (pairs > kc && !c)) {
        free(xq);
        free(c);
        return -2;
    }
    for (int m = 0; m < M; m++) {
        for (int k = 0; k < K; k++) xq[(long)m * ldx + k] = (int16_t)qu[(long)m * K + k] - 128;
        if (K % 2) xq[(long)m * ldx + K] = 0;
    }
    j.xq = xq;
    j.c = c;
    if (whole) {
        /* decode: panel by panel, each slice of a panel passed over by every tile */
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int t = 0; t < panels; t++)
            for (long k0 = 0; k0 < pairs; k0 += kc) {
                const long kn = pairs - k0 < kc ? pairs - k0 : kc;
                for (int m = 0; m < M; m += W8A8_MR)
                    w8a8_block(&j, 0, m, M - m < W8A8_MR ? M - m : W8A8_MR, t, k0, kn);
            }
    } else {
        /* a block of rows, one slice of the pairs at a time (its x stays in L2), the threads splitting
           the panels (a panel's slice stays in L1 while the block's tiles pass over it) */
#pragma omp parallel num_threads(nthreads)
        for (int m0 = 0; m0 < M; m0 += mc) {
            const int me = M - m0 < mc ? M : m0 + mc;
            for (long k0 = 0; k0 < pairs; k0 += kc) {
                const long kn = pairs - k0 < kc ? pairs - k0 : kc;
#pragma omp for schedule(static)
                for (int t = 0; t < panels; t++)
                    for (int m = m0; m < me; m += W8A8_MR)
                        w8a8_block(&j, m0, m, me - m < W8A8_MR ? me - m : W8A8_MR, t, k0, kn);
            }
        }
    }
    free(xq);
    free(c);
    return 0;
}
