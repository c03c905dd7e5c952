/* W4A8: int4 weights times activations rounded to int8 per block of 32 inputs, on the integers (the
   arithmetic of llama.cpp's Q4_0 x Q8_0 dot products, on int4's groups and zero points). One source for
   every ISA, on simd.h's vector layer.

   The weight is int4's (gptj.quant.int4): q in [0, 16) per (output n, input k), a scale s and a zero z per
   output and group of `group` inputs, w = (q - 8) s + z. The activations are rounded at each call, per row
   m and block b of 32 inputs:  d = max |x| / 127,  xq = round(x / d) (to nearest even, in [-127, 127]; all
   0 where the block is), by the same float32 operations as gptj.quant.ops.quantize_blocks_int8:
   x * (1 / d). So the product is
     y[m, n] = sum over groups g of  s[n, g] A[m, n, g] + (z[n, g] - 8 s[n, g]) X[m, g],
     A = sum over the group's blocks b of  d[m, b] I[m, n, b],   I = sum_{k in b} xq[m, k] q[n, k] (exact int32),
     X = sum over the group's blocks of  d[m, b] sum_{k in b} xq[m, k]   (the rounded x's sum),
   each sum a float32 FMA chain in that order (per lane: every ISA's library gives the same bits), that is
   x rounded, times the int4 weight, summed in float32. y is float32.

   The packed weight (gptj.quant.ops.pack_w4a8): panels of 16 outputs; a panel holds its outputs' K inputs
   in units of 8 (64 bytes, one cache line): byte 4 c + j of unit u is q[c, 8 u + j] | q[c, 8 u + 4 + j] << 4
   (c < 16 the panel's output, j < 4). A vector of 4 VW bytes of a unit is VW outputs' 4 + 4 inputs:
   vi_nibbles splits it, vi_dot_u8x2 multiplies the nibbles by 4 + 4 bytes of xq repeated in every lane
   (two vpdpbusd with AVX512-VNNI; on AVX2 two vpmaddubsw and two int16 adds, a block's 4 units summed in int16,
   then one vpmaddwd a block: vi_block_sums): at one row of x, per 32 weights about 4 vector operations on
   AVX2 and 1.5 with VNNI (a load, the nibbles' and, shift and and, the products; x's broadcasts beside),
   where int4's GEMV on float32 x needs 15 (docs/PERFORMANCE.md#w4a8). The scales come beside it, sz:
   (N / 16, G, 2, 16) bfloat16, a panel's s then z of group g in one cache line.
   The threads round x's rows (vectors, a row per thread), then split the panels (static), each streaming
   its range of the weight; a tile is a panel and up to W4_MR rows of x. Past a GEMV's rows the rows come
   in blocks of W4_XQ_BYTES of rounded x, which a core's L2 holds while every panel passes them: each
   panel read from memory once a block, its block's later tiles finding it in L1 (at 512 rows of Llama's
   shapes 1.2-1.6x the unblocked loop's speed with the rounding scalar and on one thread before;
   docs/PERFORMANCE.md#w4a8-prefill). */

#include "simd.h"

#define W4_PANEL 16                 /* outputs a panel */
#define W4_UNIT 64                  /* bytes a unit: a panel's 8 inputs */
#define W4_BLOCK 32                 /* inputs per rounding of x */
#define W4_NV (W4_PANEL / VW)       /* vectors a unit (AVX-512: 1, AVX2: 2) */
#define W4_MR (W4_NV == 1 ? 8 : 2)  /* rows of x a tile: 3 W4_NV accumulators a row in the registers */
#define W4_PF_DIST 16384            /* software prefetch, bytes ahead in the weight */
#define W4_XQ_BYTES (256 * 1024)    /* rounded x a block of rows (below) */
_Static_assert(W4_BLOCK / 8 <= 4, "a block's sums take at most 4 vi_dot_u8x2 calls (simd.h)");

/* row m of x (float32) rounded per block: xq (K), d (K / 32), X (G); vectors of VW lanes, the same float32
   operations as the definition (max |x| is exact in any order, the rounded values' sums are integers).
   A block holding a NaN or an infinity gets d NaN or infinite, so its row's outputs are not finite, as the
   definition's are not. */
static void w4_round_row(const float *x, long K, long group, int8_t *xq, float *d, float *X)
{
    const long B = K / W4_BLOCK, G = K / group, per = group / W4_BLOCK;
    const vf lo = vf_set1(-127.0f), hi = vf_set1(127.0f);
    for (long g = 0; g < G; g++) {
        float s = 0.0f;
        for (long b = g * per; b < (g + 1) * per; b++) {
            const float *xb = x + b * W4_BLOCK;
            vf mx = vf_zero(), nf = vf_zero();
            for (int i = 0; i < W4_BLOCK; i += VW) absmax_add(&mx, &nf, vf_loadu(xb + i));
            const float db = absmax_of(mx, nf) / 127.0f, id = db > 0.0f ? 1.0f / db : 0.0f;
            const vf vid = vf_set1(id);
            vf sum = vf_zero();
            for (int i = 0; i < W4_BLOCK; i += VW) {
                const vf r = vf_min(vf_max(vf_round(vf_mul(vf_loadu(xb + i), vid)), lo), hi);
                vf_store_bytes_n((uint8_t *)xq + b * W4_BLOCK + i, r, 0, VW);
                sum = vf_add(sum, r);
            }
            d[b] = db;
            s = fmaf(vf_reduce_add(sum), db, s);
        }
        X[g] = s;
    }
}

/* one tile: panel w (its K / 8 units) times rows [0, mr) of the rounded x (xq rows K apart, d rows B apart,
   X rows G apart); y row m at y + m ldy, the panel's 16 outputs; mr a constant where inlined */
static inline __attribute__((always_inline)) void w4_tile(const uint8_t *w, const uint16_t *sz, long K, long group,
                                                          const int8_t *xq, const float *d, const float *X,
                                                          float *y, long ldy, long pf, const int mr)
{
    const long B = K / W4_BLOCK, G = K / group, per = group / W4_BLOCK;
    vf out[W4_MR][W4_NV];
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < W4_NV; v++) out[m][v] = vf_zero();
    for (long g = 0; g < G; g++) {
        vf a[W4_MR][W4_NV];
        for (int m = 0; m < mr; m++)
            for (int v = 0; v < W4_NV; v++) a[m][v] = vf_zero();
        for (long b = g * per; b < (g + 1) * per; b++) {
            vi acc[W4_MR][W4_NV];
            for (int m = 0; m < mr; m++)
                for (int v = 0; v < W4_NV; v++) acc[m][v] = vi_zero();
            _Pragma("GCC unroll 4") for (int u = 0; u < W4_BLOCK / 8; u++) {
                const long k = b * W4_BLOCK + 8 * u;
                const uint8_t *at = w + (k / 8) * W4_UNIT;
                if (pf) __builtin_prefetch(at + pf, 0, 2);
                vi lo[W4_NV], hi[W4_NV];
                for (int v = 0; v < W4_NV; v++) vi_nibbles(vi_load_bytes(at + 4 * VW * v), &lo[v], &hi[v]);
                for (int m = 0; m < mr; m++) {
                    const vi x0 = vi_bcast_quad(xq + m * K + k), x1 = vi_bcast_quad(xq + m * K + k + 4);
                    for (int v = 0; v < W4_NV; v++) acc[m][v] = vi_dot_u8x2(acc[m][v], lo[v], x0, hi[v], x1);
                }
            }
            for (int m = 0; m < mr; m++) {
                const vf db = vf_set1(d[m * B + b]);
                for (int v = 0; v < W4_NV; v++) a[m][v] = vf_fmadd(vi_to_vf(vi_block_sums(acc[m][v])), db, a[m][v]);
            }
        }
        const uint16_t *sg = sz + g * 2 * W4_PANEL;
        for (int v = 0; v < W4_NV; v++) {
            const vf s = vf_load_bf16(sg + v * VW), z = vf_load_bf16(sg + W4_PANEL + v * VW);
            const vf zc = vf_fnmadd(vf_set1(8.0f), s, z);  /* z - 8 s: 8 s exact, one rounding */
            for (int m = 0; m < mr; m++)
                out[m][v] = vf_fmadd(zc, vf_set1(X[m * G + g]), vf_fmadd(a[m][v], s, out[m][v]));
        }
    }
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < W4_NV; v++) vf_storeu(y + m * ldy + v * VW, out[m][v]);
}

static void w4_tile_rows(const uint8_t *w, const uint16_t *sz, long K, long group, const int8_t *xq, const float *d,
                         const float *X, float *y, long ldy, long pf, int mr)
{
    switch (mr) {  /* a constant row count for each tile's registers */
    case 1: w4_tile(w, sz, K, group, xq, d, X, y, ldy, pf, 1); break;
#if W4_MR >= 8
    case 2: w4_tile(w, sz, K, group, xq, d, X, y, ldy, pf, 2); break;
    case 3: w4_tile(w, sz, K, group, xq, d, X, y, ldy, pf, 3); break;
    case 4: w4_tile(w, sz, K, group, xq, d, X, y, ldy, pf, 4); break;
    case 5: w4_tile(w, sz, K, group, xq, d, X, y, ldy, pf, 5); break;
    case 6: w4_tile(w, sz, K, group, xq, d, X, y, ldy, pf, 6); break;
    case 7: w4_tile(w, sz, K, group, xq, d, X, y, ldy, pf, 7); break;
#endif
    default: w4_tile(w, sz, K, group, xq, d, X, y, ldy, pf, W4_MR); break;
    }
}

/* y (M, N) float32, rows ldy apart, = x (M, K) float32 rounded per block of 32 times the packed int4 weight
   (pack_w4a8's layout, sz its scales). Returns 0, -1 without memory, -2 where N is not a multiple of 16, or K
   not of the group, or the group not of 32. */
int gemm_w4a8(const float *x, const uint8_t *packed, const uint16_t *sz, float *y, int M, int N, int K, int group,
              long ldy, int nthreads)
{
    if (N % W4_PANEL || group <= 0 || group % W4_BLOCK || K % group) return -2;
    if (M <= 0 || N <= 0 || K <= 0) return 0;
    const long B = K / W4_BLOCK, G = K / group, panels = N / W4_PANEL;
    int8_t *xq = malloc((size_t)M * (size_t)K);
    float *d = malloc(sizeof(float) * (size_t)M * (size_t)(B + G));
    if (!xq || !d) {
        free(xq);
        free(d);
        return -1;
    }
    float *X = d + (long)M * B;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > panels) nthreads = (int)panels;
    if ((long)N * K / 2 < 65536 && M < 4) nthreads = 1;  /* gemv.c's g_min_parallel */
    const long panel_bytes = (long)K * W4_PANEL / 2;
    /* rows of x a block: their rounded bytes (MB K) stay in a core's L2 while every panel passes them, each
       panel read once a block (from memory for the block's first tile, then from L1) */
    long mb = W4_XQ_BYTES / K / W4_MR * W4_MR;
    if (mb < W4_MR) mb = W4_MR;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (long m = 0; m < M; m++) w4_round_row(x + m * K, K, group, xq + m * K, d + m * B, X + m * G);
        for (long m1 = 0; m1 < M; m1 += mb) {
            const long m2 = m1 + mb < M ? m1 + mb : M;
#pragma omp for schedule(static) nowait
            for (long p = 0; p < panels; p++) {
                const uint8_t *w = packed + p * panel_bytes;
                const uint16_t *s = sz + p * G * 2 * W4_PANEL;
                for (long m0 = m1; m0 < m2; m0 += W4_MR) {
                    const int mr = m2 - m0 < W4_MR ? (int)(m2 - m0) : W4_MR;
                    w4_tile_rows(w, s, K, group, xq + m0 * K, d + m0 * B, X + m0 * G, y + m0 * ldy + p * W4_PANEL,
                                 ldy, m0 == m1 ? W4_PF_DIST : 0, mr);
                }
            }
        }
    }
    free(xq);
    free(d);
    return 0;
}
