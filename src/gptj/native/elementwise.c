#include "simd.h"

/* ---- A fused block's elementwise steps, bfloat16 in and out, float32 inside, rounded once ------------

   Rows may lie anywhere (a row stride each), so the kernels read q/k/v and fc_in's columns in
   place from the fused projection's output and write where the next matmul reads. Rows are
   split across threads; each element is computed alone, so results do not depend on the
   thread count. */

/* y[m, n] = gelu_tanh(x[m, n]) = x / (1 + e^(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3): the same
   function as 0.5 x (1 + tanh(u)) without its cancellation for negative x. e^(-2u) by vf_exp
   (relative error < 5e-9; below -87.3 it gives ~2^-126, so y = x; above 88.8 infinity, so y = -0, as
   the exact value underflows float32). */
static inline vf gelu_vf(vf x)
{
    const vf x3 = vf_mul(vf_mul(x, x), x);
    const vf u = vf_mul(vf_fmadd(x3, vf_set1(0.044715f), x), vf_set1(-1.5957691216057308f)); /* -2 sqrt(2/pi) */
    return vf_div(x, vf_add(vf_exp(u), vf_set1(1.0f)));
}

void gelu_bf16(const uint16_t *x, long sx, uint16_t *y, long sy, long M, long N, int nthreads)
{
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * N >= 32768)
    for (long m = 0; m < M; m++) {
        const uint16_t *xr = x + m * sx;
        uint16_t *yr = y + m * sy;
        for (long n = 0; n < N; n += VW) vf_store_bf16_upto(yr + n, gelu_vf(vf_load_bf16_upto(xr + n, N - n)), N - n);
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
#pragma omp parallel for schedule(static) num_threads(nthreads) if ((long)T * nh * R >= 32768)
    for (int t = 0; t < T; t++) {
        for (int r = 0; r < R; r += VW) {
            const vf s = vf_load_bf16(sin + (long)t * R + r), c = vf_load_bf16(cos + (long)t * R + r);
            for (int h = 0; h < nh; h++) {
                uint16_t *p = x + t * sx + (long)h * D + r;
                const vf v = vf_load_bf16(p);
                vf_store_bf16(p, vf_fmadd(vf_rotate_pairs(v), s, vf_mul(v, c)));
            }
        }
    }
}

/* ---- int8 rounding of rows: int8 KV (store_kv) and W8A8's activations (quantize_rows_u8) ---------- */

/* A row x of K bfloat16 values times inv_smooth[k] (float32; NULL: 1) is x'; rounded as
   gptj.quant.ops.quantize_rows_int8 rounds a row: s = max_k |x'| / 127 (at least 2^-120),
   q = round(x' / s) to nearest even, clamped to [-127, 127]. row_scale gives s (NaN where x' holds a
   NaN, infinite where it holds an infinity, as the definition's); row_round stores q + zp as bytes
   (zp 0: int8; 128: oneDNN's uint8 with zero point 128). */
static inline float row_scale(const uint16_t *x, const float *inv_smooth, long K)
{
    vf mx = vf_zero(), nf = vf_zero();
    for (long k = 0; k < K; k += VW) {
        vf v = vf_load_bf16_upto(x + k, K - k);
        if (inv_smooth) v = vf_mul(v, vf_loadu_upto(inv_smooth + k, K - k));
        absmax_add(&mx, &nf, v);
    }
    const float s = absmax_of(mx, nf) / 127.0f;
    return s >= 0x1p-120f || s != s ? s : 0x1p-120f;  /* a NaN kept */
}

static inline void row_round(const uint16_t *x, const float *inv_smooth, long K, float s, int zp, uint8_t *q)
{
    const vf vs = vf_set1(s), lo = vf_set1(-127.0f), hi = vf_set1(127.0f);
    for (long k = 0; k < K; k += VW) {
        const int n = K - k >= VW ? VW : (int)(K - k);
        vf v = vf_load_bf16_upto(x + k, n);
        if (inv_smooth) v = vf_mul(v, vf_loadu_upto(inv_smooth + k, n));
        v = vf_min(vf_max(vf_round(vf_div(v, vs)), lo), hi);
        vf_store_bytes_n(q + k, v, zp, n);
    }
}

/* Store N tokens' keys and values into their blocks: for token n and head h, block blk[n], row
   off[n] of kc, vc (n_blocks, H, B, D) gets k[n * sk + h * D + :] (and v likewise): as they are
   (bfloat16 blocks, ks = vs = NULL), or rounded to int8 per head vector (row_round) with its
   scale in ks, vs (n_blocks, H, B) float32. */
void store_kv(const uint16_t *k, long sk, const uint16_t *v, long sv, int N, int H, int D, void *kc, void *vc,
              float *ks, float *vs, int B, const int64_t *blk, const int64_t *off, int nthreads)
{
    const long hs = (long)B * D, bs = (long)H * hs;
#pragma omp parallel for schedule(static) num_threads(nthreads) if ((long)N * H * D >= 32768)
    for (int n = 0; n < N; n++) {
        const long dst = blk[n] * bs + off[n] * D;
        for (int h = 0; h < H; h++) {
            const uint16_t *kr = k + n * sk + (long)h * D, *vr = v + n * sv + (long)h * D;
            if (!ks) {
                memcpy((uint16_t *)kc + dst + h * hs, kr, sizeof(uint16_t) * D);
                memcpy((uint16_t *)vc + dst + h * hs, vr, sizeof(uint16_t) * D);
                continue;
            }
            const long at = (blk[n] * H + h) * B + off[n];
            ks[at] = row_scale(kr, NULL, D);
            vs[at] = row_scale(vr, NULL, D);
            row_round(kr, NULL, D, ks[at], 0, (uint8_t *)kc + dst + h * hs);
            row_round(vr, NULL, D, vs[at], 0, (uint8_t *)vc + dst + h * hs);
        }
    }
}

/* ---- W8A8 linears (kernels/fused.py, PackedW8A8Linear): the activations' int8 rounding before
   oneDNN's u8 x s8 GEMM, and its float32 sums back to bfloat16 after ---------------------------- */

/* Row m of x (M, K) bfloat16, at x + m * sx, rounded with inv_smooth (row_scale, row_round) into
   qu (M, K) contiguous as q + 128, its scale in scale[m]. Two passes over each row (the maximum,
   then the rounding), the row in L1 between them. */
void quantize_rows_u8(const uint16_t *x, long sx, const float *inv_smooth, uint8_t *qu, float *scale, long M,
                      long K, int nthreads)
{
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K >= 32768)
    for (long m = 0; m < M; m++) {
        scale[m] = row_scale(x + m * sx, inv_smooth, K);
        row_round(x + m * sx, inv_smooth, K, scale[m], 128, qu + m * K);
    }
}

/* y[m, n] = bfloat16(bfloat16(acc[m, n] * rs[m]) + bias[n]) (no bias: the first rounding only),
   each rounding to nearest even: W8A8Linear's `(acc * sx).to(dtype)` then `+ bias`. acc (M, N)
   float32 at acc + m * sa; y (M, N) bfloat16 at y + m * sy. */
void scale_rows_bf16(const float *acc, long sa, const float *rs, const uint16_t *bias, uint16_t *y, long sy, long M,
                     long N, int nthreads)
{
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * N >= 32768)
    for (long m = 0; m < M; m++) {
        const vf r = vf_set1(rs[m]);
        for (long n = 0; n < N; n += VW) {
            vf v = vf_mul(vf_loadu_upto(acc + m * sa + n, N - n), r);
            if (bias) v = vf_add(vf_round_bf16(v), vf_load_bf16_upto(bias + n, N - n));
            vf_store_bf16_upto(y + m * sy + n, v, N - n);
        }
    }
}

/* ---- int4 weights in torch's CPU layout, dequantized to bfloat16 (int4's many-row calls) ----------

   torch's CPU int4 layout (gptj.quant.ops._unpack_cpu_int4, probed at run time): nblocks blocks of
   `block` output rows, each block K columns of block/2 bytes; with `split` byte j of column k holds
   rows j (low nibble) and j + block/2 (high), else rows 2j and 2j + 1. Written transposed, column k of
   the weight as row k of wt (ld_wt values apart), so every column's block is one contiguous store:
       wt[k][n] = bfloat16(q[n][k] * s[n][g] + zp[n][g]),  g = k / group,  zp = bfloat16(zero - 8 s)
   with scale and zero (n, K / group) bfloat16: Int4Linear._dequant_rows' formula (q * s is exact in
   float32, so one rounding to float32 and one to bfloat16, as torch's bfloat16 addcmul). block a
   multiple of VW, at most 128. Groups split across threads (each thread lays a group's scales out by
   column first); each value is computed alone. Returns 0, or -1 if a buffer could not be had. */
int int4_dequant_t_bf16(const uint8_t *packed, long K, int nblocks, int block, int split, const uint16_t *scale,
                        const uint16_t *zero, int group, uint16_t *wt, long ld_wt, int nthreads)
{
    const int half = block / 2;
    const long n = (long)nblocks * block, groups = K / group;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (K * n >= 65536)
    {
        uint16_t *st = malloc(2 * n * sizeof(uint16_t)), *zt = st + n;
        if (st == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long g = 0; g < groups; g++) {
            if (st == NULL) continue;
            for (long r = 0; r < n; r++) {
                st[r] = scale[r * groups + g];
                const float z = bf16_to_f32(zero[r * groups + g]) - 8.0f * bf16_to_f32(st[r]);
                zt[r] = f32_to_bf16(z);
            }
            for (long k = g * group; k < (g + 1) * group; k++) {
                int8_t q[128];
                for (int b = 0; b < nblocks; b++) {
                    const uint8_t *p = packed + ((long)b * K + k) * half;
                    if (split) {
                        for (int j = 0; j < half; j++) { q[j] = (int8_t)(p[j] & 15); q[j + half] = (int8_t)(p[j] >> 4); }
                    } else {
                        for (int j = 0; j < half; j++) { q[2 * j] = (int8_t)(p[j] & 15); q[2 * j + 1] = (int8_t)(p[j] >> 4); }
                    }
                    const uint16_t *sb = st + (long)b * block, *zb = zt + (long)b * block;
                    uint16_t *o = wt + k * ld_wt + (long)b * block;
                    for (int c = 0; c < block; c += VW)
                        vf_store_bf16(o + c, vf_fmadd(vf_load_i8(q + c), vf_load_bf16(sb + c), vf_load_bf16(zb + c)));
                }
            }
        }
        free(st);
    }
    return failed ? -1 : 0;
}

/* ---- the greedy step's argmax (engine/sampler.py) ------------------------------------------------

   idx[m] = the first index of the largest of row m's N float32 values (rows sx apart), as
   torch.max(dim=-1).indices gives it: ties to the first; a NaN counts as the largest, its first one
   wins. One vector pass over blocks of ARGMAX_BLOCK values keeps the first block holding the
   maximum, and whether the row holds anything but finite values (x - x is 0 for a finite x, NaN for
   an infinity or a NaN); that block is then searched for the maximum's first index. A row with an
   infinity or a NaN is scanned again by the scalar loop that follows the definition. Rows are split
   across threads. */
#define ARGMAX_BLOCK 256

static long argmax_exact(const float *x, long N)
{
    long best = 0;
    for (long i = 0; i < N; i++) {
        if (x[i] != x[i]) return i; /* NaN */
        if (x[i] > x[best]) best = i;
    }
    return best;
}

void argmax_rows_f32(const float *x, long sx, long M, long N, int64_t *idx, int nthreads)
{
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * N >= 65536)
    for (long m = 0; m < M; m++) {
        const float *row = x + m * sx;
        vf bad = vf_zero();
        float best = -INFINITY;
        long at = 0;
        for (long b0 = 0; b0 < N; b0 += ARGMAX_BLOCK) {
            const long end = N - b0 < ARGMAX_BLOCK ? N : b0 + ARGMAX_BLOCK;
            vf mx = vf_set1(-INFINITY);
            long i = b0;
            for (; i + VW <= end; i += VW) {
                const vf v = vf_loadu(row + i);
                mx = vf_max(mx, v);
                bad = vf_add(bad, vf_sub(v, v));
            }
            if (i < end) {
                const vf v = vf_loadu_n(row + i, (int)(end - i)); /* zeros past the end: x - x = 0 there */
                mx = vf_max(mx, vf_fill_below(vf_set1(-INFINITY), (int)(end - i), v));
                bad = vf_add(bad, vf_sub(v, v));
            }
            const float top = vf_reduce_max(mx);
            if (top > best) {
                best = top;
                at = b0;
            }
        }
        const float nonfinite = vf_reduce_add(bad);
        if (nonfinite != nonfinite) at = argmax_exact(row, N);
        else
            while (row[at] != best) at++; /* the block holds it: every value is finite */
        idx[m] = at;
    }
}
