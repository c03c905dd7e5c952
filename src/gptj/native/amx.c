/* int8 linear layers on AMX's tiles (Intel Sapphire Rapids on): the AVX-512 library only. Two GEMMs
   on one driver (amx_run): weight-only int8 (gemm_int8_amx, tdpbf16ps; this comment) and W8A8
   (gemm_w8a8_amx, tdpbssd; its own comment further down).

   y[m, n] = bfloat16(sum_k x[m, k] * w[n, k] * scale[n] + bias[n])

   x: (M, K) bfloat16, w: (N, K) int8 row-major (per-output-channel symmetric), scale, bias: (N,)
   bfloat16 (bias may be NULL), y: (M, N) bfloat16. K a multiple of 64. The same formula as gemv.c's
   gemv_int8: float32 sums of products of bfloat16 values, then times the scale, plus the bias, one
   rounding. Only the order of the float32 additions differs (tiles add 32 products at a time).

   Why: gemv.c's GEMV reads the weight once per 8 rows of x and multiplies with AVX-512's vdpbf16ps
   (32 products per instruction). From about 4 rows of x on, that arithmetic, not the memory, bounds
   it: bfloat16 weights through oneDNN's AMX GEMM were as fast for twice the bytes
   (docs/PERFORMANCE.md#amx-int8-gemm). One tdpbf16ps multiplies a 16 x 32
   tile by a 32 x 16 one: 8,192 products.

   The product is computed transposed, so that the weight needs no transpose: a tile of 16 output
   channels x 32 inputs (A) is 16 weight rows as they lie in memory, made bfloat16 (exact: every
   integer in [-256, 256] is one) by byte lookups, 64 inputs at a time, whose output interleaves them
   (convert64); x is rearranged once per call into B's layout (pairs of inputs side by side: [K / 2][16
   rows of x][2]) in that same order; C (16 channels x 16 rows of x, float32) is transposed on the way
   out. The lookups (vpermi2b, AVX512-VBMI: every AMX CPU has it) are faster than the float32 conversion
   (vpmovsxbd, vcvtdq2ps, vcvtne2ps2bf16; docs/PERFORMANCE.md#amx-int8-gemm).

   - OpenMP threads (static) each own a contiguous range of blocks of 32 output channels: one
     sequential stream of weight bytes per thread, as in gemv.c.
   - Up to 32 rows of x (run_block_few): 32 channels x 64 inputs converted into L1 and multiplied at
     once, C held in the tiles over all of K.
   - More rows (run_block): the 32 rows of w, converted to bfloat16 into a per-thread buffer (32 x K x
     2 bytes: 256 KiB at K = 4096, in L2), then for each pair of 16-row blocks of x, 2 x 2 C tiles
     summed over K, 32 inputs a step. Each converted weight tile serves every row of x.
   - Tiles 0-1: A (channels 0-15, 16-31 of the block), 2-3: B (two blocks of 16 rows of x), 4-7: C.
   - Rows of x past M and channels past N are zeros in B and A; their sums are not stored.
   Every output is summed by one thread in a fixed order: results do not depend on the thread count.
   The tiles need the process's permission (Linux's arch_prctl, once: amx_init). */

#define _DEFAULT_SOURCE  /* syscall() */
#include <sys/syscall.h>
#include <unistd.h>

#include "simd.h"

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define NB 32   /* output channels per block (two A tiles) */
#define KT 32   /* inputs per tile step (16 pairs) */
#define FEW 32  /* at most this many rows of x: run_block_few */
#define PF_AHEAD 512  /* bytes of a weight row prefetched ahead of its conversion (few rows) */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* the bfloat16 of every int8 value v, indexed by v's byte (0-127: v, 128-255: v - 256), as its low
   and its high bytes: int8 -> bfloat16 by byte lookups (vpermi2b) instead of through float32 */
static uint8_t bf16_lo[256] __attribute__((aligned(64))), bf16_hi[256] __attribute__((aligned(64)));

/* 0 where this process may use AMX's tiles (asks Linux for them; harmless to repeat), else -1.
   Called before the first gemm_int8_amx (native.amx_available does). */
int amx_init(void)
{
    for (int i = 0; i < 256; i++) {
        uint16_t h = f32_to_bf16((float)(int8_t)(uint8_t)i);
        bf16_lo[i] = (uint8_t)(h & 0xff);
        bf16_hi[i] = (uint8_t)(h >> 8);
    }
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

typedef struct { __m512i lo[4], hi[4]; } tables_t;

AMX_TARGET static inline void load_tables(tables_t *t)
{
    for (int i = 0; i < 4; i++) {
        t->lo[i] = _mm512_load_si512((const void *)(bf16_lo + 64 * i));
        t->hi[i] = _mm512_load_si512((const void *)(bf16_hi + 64 * i));
    }
}

/* 64 int8 weights (inputs k .. k + 63 of a row) as bfloat16, exact, into two tile rows: d0 gets
   inputs {0-7, 16-23, 32-39, 48-55} of the 64, d1 {8-15, 24-31, 40-47, 56-63} (vpunpck*bw's order,
   which x's layout follows: gemm_int8_amx) */
AMX_TARGET static inline void convert64(const int8_t *src, const tables_t *t, uint16_t *d0, uint16_t *d1)
{
    const __m512i q = _mm512_loadu_si512((const void *)src);
    const __mmask64 neg = _mm512_movepi8_mask(q);
    const __m512i lo = _mm512_mask_blend_epi8(neg, _mm512_permutex2var_epi8(t->lo[0], q, t->lo[1]),
                                              _mm512_permutex2var_epi8(t->lo[2], q, t->lo[3]));
    const __m512i hi = _mm512_mask_blend_epi8(neg, _mm512_permutex2var_epi8(t->hi[0], q, t->hi[1]),
                                              _mm512_permutex2var_epi8(t->hi[2], q, t->hi[3]));
    _mm512_store_si512((void *)d0, _mm512_unpacklo_epi8(lo, hi));
    _mm512_store_si512((void *)d1, _mm512_unpackhi_epi8(lo, hi));
}

AMX_TARGET static void tiles_on(void)
{
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* rows [n0, n0 + nc) of w (nc <= NB) as bfloat16 A tiles, zeros past nc: tile (step s, half h) is
   1 KiB at a + (2 s + h) * 512, its 16 rows (channels 16 h ...) of 32 inputs (32 s ...) 64 bytes apart,
   so that a tile load reads 16 consecutive cache lines */
AMX_TARGET static void convert_block(const int8_t *w, long n0, int nc, long K, uint16_t *a)
{
    tables_t t;
    load_tables(&t);
    for (int r = 0; r < NB; r++) {
        const int8_t *src = w + (n0 + r) * K;
        uint16_t *dst = a + (r / 16) * 512 + (r % 16) * 32;
        if (r >= nc) {
            for (long k = 0; k < K; k += KT) _mm512_store_si512((void *)(dst + k * 32), _mm512_setzero_si512());
            continue;
        }
        for (long k = 0; k < K; k += 2 * KT) convert64(src + k, &t, dst + k * 32, dst + (k + KT) * 32);
    }
}

/* the float32 sums c[channel][row of x] (NB x 32, row stride 32) of channels [n0, n0 + nc) and rows
   [m0, m0 + mc) (mc <= 32): scaled, biased, rounded, stored */
static void store_block(const float *c, const uint16_t *scale, const uint16_t *bias, uint16_t *y,
                        long N, long n0, int nc, long m0, int mc)
{
    for (int m = 0; m < mc; m++) {
        uint16_t *row = y + (m0 + m) * N + n0;
        for (int r = 0; r < nc; r++) {
            float v = c[r * 32 + m] * bf16_to_f32(scale[n0 + r]);
            if (bias) v += bf16_to_f32(bias[n0 + r]);
            row[r] = f32_to_bf16(v);
        }
    }
}

/* C tiles 4-7 (channels 0-15 / 16-31 x rows 0-15 / 16-31 of x) to zero */
AMX_TARGET static inline __attribute__((always_inline)) void tiles_zero(void)
{
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
}

/* one tile step: C += A (a0: channels 0-15, a1: 16-31, rows lda bytes apart) x B (b0: rows 0-15 of x;
   b1: rows 16-31, where `two`), by DP: tdpbf16ps (32 bfloat16 inputs) or tdpbssd (64 int8 inputs) */
#define TILES_STEP(NAME, T, DP)                                                                        \
    AMX_TARGET static inline __attribute__((always_inline)) void NAME(const T *a0, const T *a1, long lda, \
                                                                     const T *b0, const T *b1, int two) \
    {                                                                                                  \
        _tile_loadd(0, a0, lda);                                                                       \
        _tile_loadd(1, a1, lda);                                                                       \
        _tile_loadd(2, b0, 64);                                                                        \
        DP(4, 0, 2);                                                                                   \
        DP(5, 1, 2);                                                                                   \
        if (two) {                                                                                     \
            _tile_loadd(3, b1, 64);                                                                    \
            DP(6, 0, 3);                                                                               \
            DP(7, 1, 3);                                                                               \
        }                                                                                              \
    }
TILES_STEP(tiles_step, uint16_t, _tile_dpbf16ps)
TILES_STEP(itiles_step, int8_t, _tile_dpbssd)

/* C's tiles into c[channel][row of x] (NB x 32 float32; the rows-16-31 half is stale where not `two`) */
AMX_TARGET static inline __attribute__((always_inline)) void tiles_store(float *c)
{
    _tile_stored(4, c, 128);
    _tile_stored(5, c + 16 * 32, 128);
    _tile_stored(6, c + 16, 128);
    _tile_stored(7, c + 16 * 32 + 16, 128);
}

/* 64 inputs [k, k + 64) of rows [n0, n0 + nc) of w as the four A tiles at a (two steps, as above) */
AMX_TARGET static inline void convert_steps(const int8_t *w, long n0, int nc, long K, long k, const tables_t *t,
                                            uint16_t *a)
{
    for (int r = 0; r < nc; r++) {
        const int8_t *src = w + (n0 + r) * K + k;
        uint16_t *dst = a + (r / 16) * 512 + (r % 16) * 32;
        convert64(src, t, dst, dst + 1024);
        _mm_prefetch((const char *)(src + PF_AHEAD), _MM_HINT_T0);
    }
}

/* One call of either GEMM: x laid out as B once (`lay`, a block of 16 rows of x at a time), then each
   thread runs its range of blocks of NB output channels (`block`) with `scratch` bytes of its own. */
typedef struct amx_job amx_job;
struct amx_job {
    const void *x;          /* (M, K): bfloat16 (int8 weights) or uint8 q + 128 (W8A8) */
    const int8_t *w;        /* (N, K) */
    const void *scale;      /* (N,): bfloat16 (int8 weights), float32 (W8A8) */
    const uint16_t *bias;   /* (N,) bfloat16 or NULL (int8 weights) */
    void *y;                /* (M, N): bfloat16 (int8 weights), float32 (W8A8) */
    long M, N, K;
    void *xb;               /* x in B's layout: 64 bytes per 16 rows of x per B row, zeros past M */
    size_t xb_row;          /* bytes of xb per block of 16 rows of x */
    size_t scratch;         /* bytes per thread */
    void (*lay)(const amx_job *j, long m, void *dst);  /* row m of x (m < M) into its column of B */
    void (*block)(const amx_job *j, long n0, void *scratch, void *c);
};

AMX_TARGET static int amx_run(amx_job *j, int nthreads)
{
    const long mblocks = (j->M + 15) / 16;
    j->xb = aligned_alloc(64, (size_t)mblocks * j->xb_row);
    if (!j->xb) return -1;
    const long nblocks = (j->N + NB - 1) / NB;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > nblocks) nthreads = (int)nblocks;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (long mb = t; mb < mblocks; mb += nt)
            for (int i = 0; i < 16; i++) {  /* column i of block mb: 4 bytes per B row, 64 bytes apart */
                uint32_t *dst = (uint32_t *)((char *)j->xb + mb * j->xb_row) + i;
                if (mb * 16 + i < j->M)
                    j->lay(j, mb * 16 + i, dst);
                else
                    for (size_t p = 0; p < j->xb_row / 64; p++) dst[p * 16] = 0;
            }
#pragma omp barrier
        void *scratch = aligned_alloc(64, j->scratch);
        void *c = aligned_alloc(64, NB * 32 * sizeof(float));
        if (!scratch || !c) {
#pragma omp atomic write
            failed = 1;
        } else {
            tiles_on();
            const long b0 = nblocks * t / nt, b1 = nblocks * (t + 1) / nt;
            for (long b = b0; b < b1; b++) j->block(j, b * NB, scratch, c);
            _tile_release();
        }
        free(scratch);
        free(c);
    }
    free(j->xb);
    return failed ? -1 : 0;
}

/* int8 weights: row m of x as B's pairs of bfloat16 inputs, in the order convert64 gives A's rows */
static void lay_bf16(const amx_job *j, long m, void *dst)
{
    uint32_t *d = (uint32_t *)dst;
    const uint32_t *src = (const uint32_t *)((const uint16_t *)j->x + m * j->K);
    for (long p = 0; p < j->K / 2; p++)
        d[p * 16] = src[(p >> 5) * 32 + ((p & 15) >> 2) * 8 + ((p >> 4) & 1) * 4 + (p & 3)];
}

/* at most 32 rows of x: the weight converted a step at a time into L1 (A's two tiles, 2 KiB) and
   used at once, C held in the tiles over all of K */
AMX_TARGET static void run_block_few(const int8_t *w, const uint16_t *xb, const uint16_t *scale, const uint16_t *bias,
                                     uint16_t *y, long M, long N, long K, long n0, uint16_t *a, float *c)
{
    const int nc = (int)(N - n0 < NB ? N - n0 : NB);
    const int two = M > 16;
    tables_t t;
    load_tables(&t);
    if (nc < NB) memset(a, 0, NB * 2 * KT * 2);
    tiles_zero();
    for (long k = 0; k < K; k += 2 * KT) {
        convert_steps(w, n0, nc, K, k, &t, a);
        tiles_step(a, a + 512, 64, xb + k * 16, xb + K * 16 + k * 16, two);
        tiles_step(a + 1024, a + 1536, 64, xb + (k + KT) * 16, xb + K * 16 + (k + KT) * 16, two);
    }
    tiles_store(c);
    store_block(c, scale, bias, y, N, n0, nc, 0, (int)M);
}

AMX_TARGET static void run_block(const int8_t *w, const uint16_t *xb, const uint16_t *scale, const uint16_t *bias,
                                 uint16_t *y, long M, long N, long K, long n0, uint16_t *a, float *c)
{
    const int nc = (int)(N - n0 < NB ? N - n0 : NB);
    convert_block(w, n0, nc, K, a);
    const long mblocks = (M + 15) / 16;
    for (long mb = 0; mb < mblocks; mb += 2) {
        const int two = mb + 1 < mblocks;
        const uint16_t *b0 = xb + mb * K * 16, *b1 = b0 + K * 16;  /* a block of B: K / 2 rows of 64 bytes */
        tiles_zero();
        for (long k = 0; k < K; k += KT) tiles_step(a + k * 32, a + k * 32 + 512, 64, b0 + k * 16, b1 + k * 16, two);
        tiles_store(c);
        const long m0 = mb * 16;
        const int mc = (int)(M - m0 < 32 ? M - m0 : 32);
        store_block(c, scale, bias, y, N, n0, nc, m0, mc);
    }
}

AMX_TARGET static void int8_block(const amx_job *j, long n0, void *scratch, void *c)
{
    (j->M <= FEW ? run_block_few : run_block)(j->w, (const uint16_t *)j->xb, (const uint16_t *)j->scale, j->bias,
                                              (uint16_t *)j->y, j->M, j->N, j->K, n0, (uint16_t *)scratch, (float *)c);
}

/* returns 0, -1 where memory could not be had, -2 where K is not a multiple of 64 */
AMX_TARGET int gemm_int8_amx(const uint16_t *x, const int8_t *w, const uint16_t *scale, const uint16_t *bias,
                             uint16_t *y, int M, int N, int K, int nthreads)
{
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0 || K % (2 * KT)) return -2;
    amx_job j = {x, w, scale, bias, y, M, N, K, NULL, (size_t)K * 32, (size_t)NB * K * 2, lay_bf16, int8_block};
    return amx_run(&j, nthreads);
}

/* ---- W8A8 on AMX-INT8: int8 activations x int8 weights, exact int32 sums (tdpbssd) ----

   y[m, n] = float(sum_k q[m, k] * w[n, k]) * ws[n]   (float32: what oneDNN's u8 x s8 GEMM returns to
   PackedW8A8Linear's SHIFTED form, so the same numbers: the sums are exact in both)

   qu: (M, K) uint8, q + 128 (gptj.native.quantize_rows_u8's output); w: (N, K) int8 row-major; ws: (N,)
   float32; y: (M, N) float32. K a multiple of 64. No conversion: A tiles are 16 weight rows of 64
   inputs read where they lie (a block of 32 rows x K stays in L2 for every 32 rows of x), B is x laid
   out once per call as [K / 4][16 rows][4 inputs], its bytes flipped back to int8 (q = qu ^ 0x80). */

AMX_TARGET static void w8a8_block(const int8_t *w, const int8_t *xb, const float *ws, float *y, long M, long N, long K,
                                  long n0, int8_t *pad, int32_t *c)
{
    const int nc = (int)(N - n0 < NB ? N - n0 : NB);
    const int8_t *a = w + n0 * K;
    if (nc < NB) {  /* the last block: its rows, then zeros, in a buffer (never read past w) */
        memcpy(pad, a, (size_t)nc * K);
        memset(pad + (long)nc * K, 0, (size_t)(NB - nc) * K);
        a = pad;
    }
    const long mblocks = (M + 15) / 16;
    for (long mb = 0; mb < mblocks; mb += 2) {
        const int two = mb + 1 < mblocks;
        const int8_t *b0 = xb + mb * K * 16, *b1 = b0 + K * 16;  /* a block of B: K / 4 rows of 64 bytes */
        tiles_zero();
        for (long k = 0; k < K; k += 64) {
            if (mb == 0)
                for (int r = 0; r < NB; r++) _mm_prefetch((const char *)(a + r * K + k + PF_AHEAD), _MM_HINT_T0);
            itiles_step(a + k, a + 16 * K + k, K, b0 + k * 16, b1 + k * 16, two);
        }
        tiles_store((float *)c);  /* int32 sums, stored as they are */
        const long m0 = mb * 16;
        const int mc = (int)(M - m0 < 32 ? M - m0 : 32);
        for (int m = 0; m < mc; m++) {
            float *row = y + (m0 + m) * N + n0;
            for (int r = 0; r < nc; r++) row[r] = (float)c[r * 32 + m] * ws[n0 + r];
        }
    }
}

/* W8A8: row m of x as B's groups of 4 int8 inputs, q = qu ^ 0x80 */
static void lay_i8(const amx_job *j, long m, void *dst)
{
    uint32_t *d = (uint32_t *)dst;
    const uint32_t *src = (const uint32_t *)((const uint8_t *)j->x + m * j->K);
    for (long p = 0; p < j->K / 4; p++) d[p * 16] = src[p] ^ 0x80808080u;
}

AMX_TARGET static void w8a8_job_block(const amx_job *j, long n0, void *scratch, void *c)
{
    w8a8_block(j->w, (const int8_t *)j->xb, (const float *)j->scale, (float *)j->y, j->M, j->N, j->K, n0,
               (int8_t *)scratch, (int32_t *)c);
}

/* returns 0, -1 where memory could not be had, -2 where K is not a multiple of 64 */
AMX_TARGET int gemm_w8a8_amx(const uint8_t *qu, const int8_t *w, const float *ws, float *y, int M, int N, int K,
                             int nthreads)
{
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0 || K % 64) return -2;
    amx_job j = {qu, w, ws, NULL, y, M, N, K, NULL, (size_t)K * 16, (size_t)NB * K, lay_i8, w8a8_job_block};
    return amx_run(&j, nthreads);
}
