/* gptj.native's attention kernels: decode over a shared prompt and tails (attend_group_bf16), paged
   decode of a whole batch (attend_paged) and paged causal prefill of a prompt chunk
   (prefill_paged), the paged ones over bfloat16 or int8 blocks. engine/attention/cpu_native.py says when each
   runs. */

#include "simd.h"

/* ---------------------------------------------------------------------------------------------
   Decode attention of a group of N queries (beams) that share a prompt and own a tail each:
       out[n, h] = softmax_t(scale * q[n, h] . k[t]) @ v[t],  t over [prompt | tail of n]
   q (N, H, D) float32 contiguous; out (N, H, D) float32. Keys/values bfloat16, d contiguous:
       prompt  pk[h * psh + t * pst + d], t < P (shared by every query; read once per block of 8)
       tail    tk[n * tsn + h * tsh + t * tst + d], t < T
   Scores, softmax and sums in float32. D must be a multiple of 16. Heads split across threads. */

#define ATT_QB 8 /* queries per pass over the keys */
#define ATT_MAXD 512 /* the paged kernel's largest head_dim */

/* s[0 .. L) <- softmax(s), in place, float32, VW lanes at a time */
static inline void softmax_f32(float *s, int L)
{
    vf mx = vf_set1(-INFINITY);
    int t = 0;
    for (; t + VW <= L; t += VW) mx = vf_max(mx, vf_loadu(s + t));
    if (t < L) mx = vf_max(mx, vf_fill_below(vf_set1(-INFINITY), L - t, vf_loadu_n(s + t, L - t)));
    const vf top = vf_set1(vf_reduce_max(mx));
    vf sum = vf_zero(), bad = vf_zero();  /* bad: NaN where a score is NaN or +inf (the max and exp drop NaNs) */
    for (t = 0; t < L; t += VW) {
        const int n = L - t >= VW ? VW : L - t;
        const vf v = vf_loadu_upto(s + t, n), e = vf_keep_n(vf_exp(vf_sub(v, top)), n);
        sum = vf_add(sum, e);
        bad = vf_add(bad, vf_zero_where_neginf(vf_sub(v, v), v));
        if (n == VW) vf_storeu(s + t, e);
        else vf_store_f32_n(s + t, e, n);
    }
    const vf inv = vf_set1(1.0f / (vf_reduce_add(sum) + vf_reduce_add(bad)));  /* NaN: every probability NaN */
    for (t = 0; t < L; t += VW) {
        const int n = L - t >= VW ? VW : L - t;
        if (n == VW) vf_storeu(s + t, vf_mul(vf_loadu(s + t), inv));
        else vf_store_f32_n(s + t, vf_mul(vf_loadu_n(s + t, n), inv), n);
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
            vf a[ATT_QB];
            for (int i = 0; i < nb; i++) a[i] = vf_zero();
            for (int d = 0; d < D; d += VW) {
                vf kv = vf_load_bf16(kr + d);
                for (int i = 0; i < nb; i++)
                    a[i] = vf_fmadd(kv, vf_loadu(q + ((long)(n0 + i) * H + h) * D + d), a[i]);
            }
            for (int i = 0; i < nb; i++) s[(long)i * L + t] = vf_reduce_add(a[i]) * scale;
        }
        /* tail scores and the softmax, per query */
        for (int i = 0; i < nb; i++) {
            const int n = n0 + i;
            const float *qn = q + ((long)n * H + h) * D;
            float *sn = s + (long)i * L;
            for (int t = 0; t < T; t++) {
                const uint16_t *kr = tk + n * tsn + h * tsh + t * tst;
                vf a = vf_zero();
                for (int d = 0; d < D; d += VW) a = vf_fmadd(vf_load_bf16(kr + d), vf_loadu(qn + d), a);
                sn[P + t] = vf_reduce_add(a) * scale;
            }
            softmax_f32(sn, L);
            float *on = out + ((long)n * H + h) * D;
            for (int d = 0; d < D; d++) on[d] = 0.0f;
        }
        /* prompt values: each value row read once for the block's queries */
        for (int t = 0; t < P; t++) {
            const uint16_t *vr = pv + h * psh + t * pst;
            for (int d = 0; d < D; d += VW) {
                vf vv = vf_load_bf16(vr + d);
                for (int i = 0; i < nb; i++) {
                    float *o = out + ((long)(n0 + i) * H + h) * D + d;
                    vf_storeu(o, vf_fmadd(vf_set1(s[(long)i * L + t]), vv, vf_loadu(o)));
                }
            }
        }
        for (int i = 0; i < nb; i++) {
            const int n = n0 + i;
            float *on = out + ((long)n * H + h) * D;
            for (int t = 0; t < T; t++) {
                const uint16_t *vr = tv + n * tsn + h * tsh + t * tst;
                const vf p = vf_set1(s[(long)i * L + P + t]);
                for (int d = 0; d < D; d += VW)
                    vf_storeu(on + d, vf_fmadd(p, vf_load_bf16(vr + d), vf_loadu(on + d)));
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
   Paged decode attention of a whole decode batch in one call (engine/attention/cpu_native.py).
   Keys/values live in blocks (n_blocks, KH, B, D) contiguous (KH KV heads; grouped-query attention:
   query head h of H reads KV head h / (H / KH)), so token t of a block table lies in
   block tab[t / B] at row t % B: bfloat16, or int8 with a float32 scale per (block, head, row) in
   ks, vs (n_blocks, KH, B) (engine/attention/kv_cache.py's PagedKV: the value is q * scale). Group g (a
   request: one sequence, or the beams of a beam search) has query rows row0[g] .. row0[g+1] - 1 of
   q (N, H, D) float32 and reads
       its shared blocks  stab[soff[g] ..]     holding slen[g] tokens (every row of the group)
       then each row n's  otab[n * omax ..]    holding olen[g] + i stair[g] tokens (its own blocks; i = n - row0[g];
                                               stair NULL: 0 — a beam search's rows own as many each, a
                                               speculative draft's rows one more each, its tokens in turn)
   out (N, H, D) float32 = softmax(scale * q . k) @ v over those tokens. q holds bfloat16 values
   (a bfloat16 model's queries). Scores, 16 keys at a time with one transposed reduction (hsum16):
   - bfloat16 keys: vdpbf16ps dot products (exact products, float32 sums);
   - int8 keys: q rounded per head to int16 (s_q = max |q| / 32767: a relative error of 2^-16 of the
     largest, below bfloat16's own 2^-9), vpdpwssd against the keys sign-extended to int16 (exact
     int32 sums: |sum| <= 32767 * 127 * 512 < 2^31), times s_q and each key's scale.
   Softmax (vectorized exp) and value sums in float32; an int8 value row's scale is folded into its
   probability. Work items are (group, range of heads) pairs spread over threads; an item walks its
   blocks in address order, every head of a block (B x D rows each, one after another) serving
   all the group's queries while it is in cache, so the KV memory is read as a stream rather than
   one head's 2-8 KiB at a time across the whole pool. */

typedef struct { /* one layer's paged keys and values */
    const void *k, *v;     /* (n_blocks, H, B, D): bfloat16, or int8 when ks is set */
    const float *ks, *vs;  /* (n_blocks, H, B) scales of int8 blocks; NULL for bfloat16 */
    int H, B, D;           /* H: the blocks' KV heads */
    int G;                 /* query heads per KV head (grouped-query attention; 1: one each) */
} pages_t;

/* the KV head query head h reads: h / G (query heads kh * G .. kh * G + G - 1 share KV head kh) */
static inline int kv_head(const pages_t *kv, int h)
{
    return kv->G == 1 ? h : h / kv->G;
}

/* where KV head h of block blk starts: its B rows of D keys (k) or values (v), and their scales */
static inline const void *rows_at(const pages_t *kv, const void *base, int blk, int h)
{
    return (const char *)base + ((long)blk * kv->H + h) * kv->B * kv->D * (kv->ks ? 1 : 2);
}

static inline const float *scales_at(const float *base, const pages_t *kv, int blk, int h)
{
    return base + ((long)blk * kv->H + h) * kv->B;
}

/* The key dot products, AVX512-BF16's (HAVE_DP) or the vector layer's: q_prepare puts a query in the form they want (QPREP_BYTES(D) bytes
   at `prepared`, and a scale *qs); scores_any(prepared, qs, kr, ks, n, D, scale, dst) sets
   dst[c] = scale * q . k[c] for the n <= VW keys k[c] = kr + c * D, bfloat16 (ks NULL) or int8 with
   scales ks[c]. int8 keys: q is rounded per head to int16 (s_q = max |q| / 32767: a relative error
   of 2^-16 of the largest, below bfloat16's own 2^-9) and summed against the keys sign-extended to
   int16 in int32, exactly (|sum| <= 32767 * 127 * 512 < 2^31), then times s_q and each key's scale. */
#if HAVE_DP
/* D / 32 vectors of 32 bfloat16 (vdpbf16ps), or of 32 int16 (vpdpwssd); zeros past D */
#define QPREP_BYTES(D) ((((D) + 31) / 32) * 64)
/* a query as the key dot products want it: D / 32 vectors of 32 bfloat16, or of 32 int16 with
   scale *qs (int8 keys); zeros past D */
static inline void q_prepare(const float *q, int D, int int16, void *prepared, float *qs)
{
    __m512i *qv = prepared;
    if (!int16) {
        for (int d = 0; d < D; d += 32) {
            const __m512 lo = _mm512_loadu_ps(q + d), hi = d + 16 < D ? _mm512_loadu_ps(q + d + 16) : _mm512_setzero_ps();
            qv[d / 32] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        }
        *qs = 1.0f;
        return;
    }
    vf mx = vf_zero(), nf = vf_zero();
    for (int d = 0; d < D; d += 16) absmax_add(&mx, &nf, vf_loadu(q + d));
    const float top = absmax_of(mx, nf), s = top > 0 || top != top ? top / 32767.0f : 1.0f;  /* NaN: the scores too */
    const __m512 inv = _mm512_set1_ps(1.0f / s);
    for (int d = 0; d < D; d += 32) {
        const __m256i lo = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + d), inv)));
        const __m256i hi = d + 16 < D ? _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + d + 16), inv)))
                                      : _mm256_setzero_si256();
        qv[d / 32] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    *qs = s;
}

/* dst[c] = scale * q . k[c] for the n <= 16 bfloat16 keys k[c] = kr + c * D: vdpbf16ps (products
   exact in float32, summed in float32), 16 independent sums, then one transposed reduction (hsum16)
   for all 16 scores instead of one horizontal sum per key */
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

/* scores16 for int8 keys: q as int16 (q_prepare, scale qs), vpdpwssd against the keys sign-extended
   to int16 (exact int32 sums), then times qs, scale and each key's scale ks[c] */
static inline void scores16_i8(const __m512i *qw, float qs, const int8_t *kr, const float *ks, int n, int D,
                               float scale, float *dst)
{
    __m512i ai[16];
    __m512 a[16];
#pragma GCC unroll 16
    for (int c = 0; c < 16; c++) ai[c] = _mm512_setzero_si512();
    for (int d = 0; d < D; d += 32) {
        const __mmask32 m = D - d >= 32 ? 0xFFFFFFFFu : 0xFFFFu;
#pragma GCC unroll 16
        for (int c = 0; c < 16; c++)
            if (c < n)
                ai[c] = _mm512_dpwssd_epi32(ai[c], _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, kr + (long)c * D + d)), qw[d / 32]);
    }
#pragma GCC unroll 16
    for (int c = 0; c < 16; c++) a[c] = _mm512_cvtepi32_ps(ai[c]);
    const __mmask16 m = n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
    const __m512 sums = _mm512_mul_ps(hsum16(a, 1), _mm512_set1_ps(scale * qs));
    _mm512_mask_storeu_ps(dst, m, _mm512_mul_ps(sums, _mm512_maskz_loadu_ps(m, ks)));
}

/* the n <= 16 keys of rows kr against a prepared query, either storage */
static inline void scores_any(const void *qv, float qs, const void *kr, const float *ks, int n, int D, float scale,
                              float *dst)
{
    if (ks) scores16_i8(qv, qs, kr, ks, n, D, scale, dst);
    else scores16((const __m512bh *)qv, kr, n, D, scale, dst);
}

#else /* the vector layer's: VW keys at a time */
/* D float32 (bfloat16 keys: q as it is, products exact), or D int16 (int8 keys) */
#define QPREP_BYTES(D) ((long)(D) * 4)
static inline void q_prepare(const float *q, int D, int int16, void *prepared, float *qs)
{
    if (!int16) {
        memcpy(prepared, q, sizeof(float) * D);
        *qs = 1.0f;
        return;
    }
    vf mx = vf_zero(), nf = vf_zero();
    for (int d = 0; d < D; d += VW) absmax_add(&mx, &nf, vf_loadu(q + d));
    const float top = absmax_of(mx, nf), s = top > 0 || top != top ? top / 32767.0f : 1.0f;  /* NaN: the scores too */
    const vf inv = vf_set1(1.0f / s), lo = vf_set1(-32768.0f), hi = vf_set1(32767.0f);
    for (int d = 0; d < D; d += VW) /* rounded, then saturated (as AVX-512's vpmovsdw) */
        vf_store_i16((int16_t *)prepared + d, vf_min(vf_max(vf_round(vf_mul(vf_loadu(q + d), inv)), lo), hi));
    /* zeros to a whole vector of VI16 int16 (D is a multiple of VW, not always of VI16) */
    memset((int16_t *)prepared + D, 0, sizeof(int16_t) * ((VI16 - D % VI16) % VI16));
    *qs = s;
}

/* bfloat16 keys: VW float32 FMA sums (exact products), one transposed reduction (vf_hsum) */
static inline __attribute__((always_inline)) void scores_vw(const float *qf, const uint16_t *kr, int n, int D,
                                                             float scale, float *dst)
{
    vf a[VW];
#pragma GCC unroll 16
    for (int c = 0; c < VW; c++) a[c] = vf_zero();
    for (int d = 0; d < D; d += VW) {
        const vf qv = vf_loadu(qf + d);
#pragma GCC unroll 16
        for (int c = 0; c < VW; c++)
            if (c < n) a[c] = vf_fmadd(vf_load_bf16(kr + (long)c * D + d), qv, a[c]);
    }
    vf_store_f32_n(dst, vf_mul(vf_hsum(a, 1), vf_set1(scale)), n);
}

/* int8 keys: pairs of int16 products into int32 lanes (exact), each lane to float32, one transposed
   reduction, times qs, scale and each key's scale (as AVX-512's scores16_i8). Both score functions are
   forced inline: as a call (GCC's choice for scores_any) decode at 8 sequences ran 10-25 % slower. */
static inline __attribute__((always_inline)) void scores_vw_i8(const int16_t *qw, float qs, const int8_t *kr,
                                                                const float *ks, int n, int D, float scale, float *dst)
{
    vi a[VW];
    vf f[VW];
#pragma GCC unroll 16
    for (int c = 0; c < VW; c++) a[c] = vi_zero();
    int d = 0;
    for (; d + VI16 <= D; d += VI16) {
        const vi qv = vi_load_i16(qw + d);
#pragma GCC unroll 16
        for (int c = 0; c < VW; c++)
            if (c < n) a[c] = vi_dot_i16(a[c], vi_load_i8_i16(kr + (long)c * D + d), qv);
    }
    if (d < D) { /* the last D - d < VI16 (q_prepare's zeros after D) */
        const vi qv = vi_load_i16(qw + d);
#pragma GCC unroll 16
        for (int c = 0; c < VW; c++)
            if (c < n) a[c] = vi_dot_i16(a[c], vi_load_i8_i16_n(kr + (long)c * D + d, D - d), qv);
    }
#pragma GCC unroll 16
    for (int c = 0; c < VW; c++) f[c] = vi_to_vf(a[c]);
    const vf sums = vf_mul(vf_hsum(f, 1), vf_set1(scale * qs));
    vf_store_f32_n(dst, vf_mul(sums, vf_loadu_n(ks, n)), n);
}

static inline __attribute__((always_inline)) void scores_any(const void *qv, float qs, const void *kr, const float *ks,
                                                              int n, int D, float scale, float *dst)
{
    if (ks) scores_vw_i8(qv, qs, kr, ks, n, D, scale, dst);
    else scores_vw(qv, kr, n, D, scale, dst);
}
#endif
#define VACC (VREGS / 2) /* value sums kept in registers (with the weight and the rows beside them) */

/* o[0 .. D) += sum_c p[c] * v[c] for the n value rows v[c] = vr + c * D, p float32: bfloat16 rows
   (values_acc; vs unused), or int8 rows times their scales vs[c], folded into p[c] (values_acc_i8).
   VACC x VW of D at a time: the sums stay in registers over the n rows. One body expanded for each
   storage: one function testing the storage inside cost ~7 % on bfloat16 KV. */
#define VALUES_ACC(NAME, T, WEIGHT, LOAD)                                                          \
static inline void NAME(const float *p, const T *vr, const float *vs, int n, int D, float *o)     \
{                                                                                                 \
    (void)vs;                                                                                     \
    for (int d0 = 0; d0 < D; d0 += VACC * VW) {                                                   \
        const int nk = (D - d0 < VACC * VW ? D - d0 : VACC * VW) / VW;                            \
        vf acc[VACC];                                                                             \
        _Pragma("GCC unroll 16") for (int i = 0; i < VACC; i++)                                   \
            if (i < nk) acc[i] = vf_loadu(o + d0 + i * VW);                                       \
        for (int c = 0; c < n; c++) {                                                             \
            const vf pc = vf_set1(WEIGHT);                                                        \
            const long r = (long)c * D + d0;                                                      \
            _Pragma("GCC unroll 16") for (int i = 0; i < VACC; i++)                               \
                if (i < nk) acc[i] = vf_fmadd(pc, LOAD(vr + r + i * VW), acc[i]);                 \
        }                                                                                         \
        _Pragma("GCC unroll 16") for (int i = 0; i < VACC; i++)                                   \
            if (i < nk) vf_storeu(o + d0 + i * VW, acc[i]);                                       \
    }                                                                                             \
}

VALUES_ACC(values_acc, uint16_t, p[c], vf_load_bf16)
VALUES_ACC(values_acc_i8, int8_t, p[c] * vs[c], vf_load_i8)

static inline void values_any(const float *p, const void *vr, const float *vs, int n, int D, float *o)
{
    if (vs) values_acc_i8(p, vr, vs, n, D, o);
    else values_acc(p, vr, NULL, n, D, o);
}

/* Rows [r0, r0 + nr) of one group, query heads [h0, h1) (whole groups of G query heads: KV heads
   h0 / G .. h1 / G - 1): blocks are walked in address order (each block holds every KV head's rows,
   B x D each, one after another), every KV head's rows of a block serving all the group's queries (up
   to ATT_QB at a time) of each of its G query heads while they are in cache: a KV head's rows are
   read from memory once for its G query heads (G = 1: one KV head per query head, the same loops).
   Scratch: s ATT_QB x (h1 - h0) x L scores; qv, qs the block of queries prepared (q_prepare),
   ATT_QB x (h1 - h0). G is kv->G, a constant 1 in paged_group's first expansion: one KV head per query
   head compiles to the loops of a kernel without grouping. */
static inline __attribute__((always_inline)) void paged_group_g(const float *q, const pages_t *kv, int h0, int h1,
                                                                int r0, int nr, const int *stab, int sl,
                                                                const int *otab, int omax, int ol0, int st,
                                                                float *out, float scale, float *s, char *qv, float *qs,
                                                                const int G)
{
    /* row n owns ol0 + (n - r0) st tokens; L: the most of any row (the scores' stride) */
    const int H = kv->H * G, B = kv->B, D = kv->D, L = sl + ol0 + (nr - 1) * st, nh = h1 - h0;
    const int kh0 = h0 / G, kh1 = h1 / G;
    const long head_bytes = (long)B * D * (kv->ks ? 1 : 2), row_bytes = (long)D * (kv->ks ? 1 : 2);
    const int i8 = kv->ks != NULL;
#define S(i, h) (s + ((long)(i) * nh + ((h) - h0)) * L)
#define QV(i, h) (qv + ((long)(i) * nh + ((h) - h0)) * QPREP_BYTES(D))
#define QS(i, h) qs[(long)(i) * nh + ((h) - h0)]
#define O(n, h) (out + ((long)(n) * H + (h)) * D)
#define KS(blk, kh) (i8 ? scales_at(kv->ks, kv, blk, kh) : NULL)
#define VS(blk, kh) (i8 ? scales_at(kv->vs, kv, blk, kh) : NULL)
    for (int n0 = r0; n0 < r0 + nr; n0 += ATT_QB) {
        const int nb = r0 + nr - n0 < ATT_QB ? r0 + nr - n0 : ATT_QB;
        for (int i = 0; i < nb; i++)
            for (int h = h0; h < h1; h++) q_prepare(q + ((long)(n0 + i) * H + h) * D, D, i8, QV(i, h), &QS(i, h));
        for (int j = 0; j * B < sl; j++) { /* shared blocks: scores of every query */
            const int tn = sl - j * B < B ? sl - j * B : B;
            for (int kh = kh0; kh < kh1; kh++) {
                const char *kb = rows_at(kv, kv->k, stab[j], kh);
                const float *ks = KS(stab[j], kh);
                if ((j + 1) * B < sl) prefetch_span(rows_at(kv, kv->k, stab[j + 1], kh), head_bytes);
                for (int h = kh * G; h < kh * G + G; h++)
                    for (int i = 0; i < nb; i++)
                        for (int c = 0; c < tn; c += VW)
                            scores_any(QV(i, h), QS(i, h), kb + c * row_bytes, ks ? ks + c : NULL,
                                       tn - c < VW ? tn - c : VW, D, scale, S(i, h) + j * B + c);
            }
        }
        for (int i = 0; i < nb; i++) { /* each query's own blocks */
            const int n = n0 + i, ol = ol0 + (n - r0) * st;
            for (int j = 0; j * B < ol; j++) {
                const int tn = ol - j * B < B ? ol - j * B : B, blk = otab[(long)n * omax + j];
                for (int kh = kh0; kh < kh1; kh++) {
                    const char *kb = rows_at(kv, kv->k, blk, kh);
                    const float *ks = KS(blk, kh);
                    if ((j + 1) * B < ol) prefetch_span(rows_at(kv, kv->k, otab[(long)n * omax + j + 1], kh), head_bytes);
                    for (int h = kh * G; h < kh * G + G; h++)
                        for (int c = 0; c < tn; c += VW)
                            scores_any(QV(i, h), QS(i, h), kb + c * row_bytes, ks ? ks + c : NULL,
                                       tn - c < VW ? tn - c : VW, D, scale, S(i, h) + sl + j * B + c);
                }
            }
            for (int h = h0; h < h1; h++) {
                softmax_f32(S(i, h), sl + ol);
                memset(O(n, h), 0, sizeof(float) * D);
            }
        }
        for (int j = 0; j * B < sl; j++) { /* shared values */
            const int tn = sl - j * B < B ? sl - j * B : B;
            for (int kh = kh0; kh < kh1; kh++) {
                const void *vb = rows_at(kv, kv->v, stab[j], kh);
                if ((j + 1) * B < sl) prefetch_span(rows_at(kv, kv->v, stab[j + 1], kh), head_bytes);
                for (int h = kh * G; h < kh * G + G; h++)
                    for (int i = 0; i < nb; i++) values_any(S(i, h) + j * B, vb, VS(stab[j], kh), tn, D, O(n0 + i, h));
            }
        }
        for (int i = 0; i < nb; i++) { /* own values */
            const int n = n0 + i, ol = ol0 + (n - r0) * st;
            for (int j = 0; j * B < ol; j++) {
                const int tn = ol - j * B < B ? ol - j * B : B, blk = otab[(long)n * omax + j];
                for (int kh = kh0; kh < kh1; kh++) {
                    const void *vb = rows_at(kv, kv->v, blk, kh);
                    if ((j + 1) * B < ol) prefetch_span(rows_at(kv, kv->v, otab[(long)n * omax + j + 1], kh), head_bytes);
                    for (int h = kh * G; h < kh * G + G; h++)
                        values_any(S(i, h) + sl + j * B, vb, VS(blk, kh), tn, D, O(n, h));
                }
            }
        }
    }
#undef S
#undef QV
#undef QS
#undef O
#undef KS
#undef VS
}

static void paged_group(const float *q, const pages_t *kv, int h0, int h1, int r0, int nr, const int *stab, int sl,
                        const int *otab, int omax, int ol, int st, float *out, float scale, float *s, char *qv,
                        float *qs)
{
    if (kv->G == 1) paged_group_g(q, kv, h0, h1, r0, nr, stab, sl, otab, omax, ol, st, out, scale, s, qv, qs, 1);
    else paged_group_g(q, kv, h0, h1, r0, nr, stab, sl, otab, omax, ol, st, out, scale, s, qv, qs, kv->G);
}

/* kc, vc: bfloat16 blocks (ks = vs = NULL) or int8 blocks with their scales, KH KV heads (H a multiple:
   query head h reads KV head h / (H / KH)) */
int attend_paged(const float *q, int N, int H, int KH, int D, const void *kc, const void *vc, const float *ks,
                 const float *vs, int B, int G, const int *row0, const int *stab, const int *soff, const int *slen,
                 const int *otab, int omax, const int *olen, const int *stair, float *out, float scale, int nthreads)
{
    if (D % 16 || D > ATT_MAXD || G < 1 || N < 1 || B < 1 || KH < 1 || H < KH || H % KH || (!ks != !vs)) return -1;
    long maxL = 0;
    for (int g = 0; g < G; g++) {
        const long most = (long)slen[g] + olen[g] + (stair ? (long)(row0[g + 1] - row0[g] - 1) * stair[g] : 0);
        if (slen[g] + olen[g] < 1 || row0[g + 1] <= row0[g] || (stair && stair[g] < 0)) return -1;
        if (most > maxL) maxL = most;
    }
    const int QG = H / KH; /* query heads per KV head */
    const pages_t kv = {kc, vc, ks, vs, KH, B, D, QG};
    /* work items: (group, range of KV heads with their query heads); a group's heads are split only as
       far as it takes to give every thread about two items (a group's heads together read each block in
       one sweep), never inside a KV head's query heads (they read its rows together) */
    int parts = nthreads > 1 ? (2 * nthreads + G - 1) / G : 1;
    if (parts > KH) parts = KH;
    const int hper = ((KH + parts - 1) / parts) * QG; /* query heads an item */
    parts = (H + hper - 1) / hper;
    const long nq = (long)ATT_QB * hper, sbytes = ((sizeof(float) * nq * maxL + 63) / 64) * 64;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* scores (nq x maxL floats) | prepared queries (nq x QPREP_BYTES, 64-byte aligned) | their scales */
        char *buf = aligned_alloc(64, sbytes + nq * QPREP_BYTES(D) + ((sizeof(float) * nq + 63) / 64) * 64);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        float *s = (float *)buf;
        char *qv = buf + sbytes;
        float *qs = (float *)(qv + nq * QPREP_BYTES(D));
#pragma omp for schedule(dynamic, 1)
        for (long w = 0; w < (long)G * parts; w++) {
            const int g = (int)(w / parts), h0 = (int)(w % parts) * hper;
            const int h1 = h0 + hper < H ? h0 + hper : H;
            if (buf) paged_group(q, &kv, h0, h1, row0[g], row0[g + 1] - row0[g], stab + soff[g], slen[g], otab, omax,
                                 olen[g], stair ? stair[g] : 0, out, scale, s, qv, qs);
        }
        free(buf);
    }
    return failed ? -2 : 0;
}

/* ---------------------------------------------------------------------------------------------
   Paged prefill attention (engine/attention/cpu_native.py, a prompt chunk): T queries at
   positions start .. start + T - 1 of one sequence, each attending causally over positions
   0 .. its own, whose keys/values are already stored in the blocks of table tab (this chunk's
   included). One work item per (head, tile of PF_QT = 16 queries); the lanes of every vector are
   the tile's 16 queries:
   - the tile's queries are packed once as D/2 vectors of 16 pairs (q[i][2p], q[i][2p + 1]);
   - scores, 16 keys at a time: acc[c] += vdpbf16ps(packed pair p, key c's pair p broadcast), so one
     vector holds key c's scores against all 16 queries (exact bfloat16 products, float32 sums) with
     no horizontal sums; the causal mask is a lane mask on the keys past the tile's first query;
     int8 keys are widened to bfloat16 first (exactly: every integer up to 256 is one) and their
     scale multiplies the sums;
   - softmax over the keys is element-wise across those vectors (max, exp, sum) for 16 queries at once;
   - values: the probabilities are rounded to bfloat16, as HF rounds them to the values' dtype before
     its matmul (an int8 value row's scale multiplied in first), and packed in pairs of keys per
     query; value rows are interleaved in pairs (d-lanes), int8 ones widened to bfloat16, and
     out[i][d .. d + 16] += vdpbf16ps(value pair, query i's probability pair broadcast), float32.
   q bfloat16 at q[t * sq + h * D + d]; blocks as pages_t (bfloat16, or int8 with scales), B even; query
   head h reads KV head h / (H / KH), a KV head's query heads one work item after another;
   out bfloat16 at out[t * so + h * D + d], rounded to nearest even once. */

/* Shared by both tiles, HAVE_DP's and the vector layer's (their lanes are the tile's VW queries, query i at position pos0 + i):
   tile_score stores key kp's scores sv at st[kp], -inf in the lanes of queries before the key
   (kp > pos0 + i), and keeps the running maximum; tile_softmax turns st[0 .. L) into e^(s - max),
   0 where masked, and returns 1 / their sum per query. */
static inline void tile_score(float *st, int kp, int pos0, vf sv, vf *mx)
{
    if (kp > pos0) sv = vf_fill_below(sv, kp - pos0 < VW ? kp - pos0 : VW, vf_set1(-INFINITY));
    *mx = vf_max(*mx, sv);
    vf_storeu(st + (long)kp * VW, sv);
}

static inline vf tile_softmax(float *st, int L, vf mx)
{
    vf sum = vf_zero();
    for (int kp = 0; kp < L; kp++) {
        const vf sv = vf_loadu(st + (long)kp * VW);
        const vf e = vf_zero_where_neginf(vf_exp(vf_sub(sv, mx)), sv);
        sum = vf_add(sum, e);
        vf_storeu(st + (long)kp * VW, e);
    }
    return vf_div(vf_set1(1.0f), sum);
}

#if HAVE_DP
#define PF_QT 16 /* queries per tile */

static const int16_t PAIR_IDX[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

/* 32 bfloat16 (a[0], b[0], a[1], b[1], ...) from 16 floats a and 16 floats b, each rounded once */
static inline __m512i pairs_bf16(__m512 a, __m512 b)
{
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(PAIR_IDX), (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

/* 16 values of a row as bfloat16: bfloat16 rows as stored, int8 rows widened (exact) */
static inline __m256i row16_bf16(const pages_t *kv, const void *row, int d)
{
    if (kv->ks) return (__m256i)_mm512_cvtneps_pbh(vf_load_i8((const int8_t *)row + d));
    return _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d));
}

/* scratch per thread, for up to Lmax keys: st (Lmax, 16) float scores / probabilities; pp (Lmax / 2 + 1, 16)
   probability pairs; vp (Lmax / 2 + 1, 2D) value pairs; qp (D / 2, 16) query pairs; kw (16, D) int8
   keys widened */
static long prefill_scratch_bytes(long Lmax, int D)
{
    return sizeof(float) * Lmax * PF_QT + sizeof(uint32_t) * (Lmax / 2 + 1) * PF_QT
           + sizeof(uint16_t) * (Lmax / 2 + 1) * 2 * D + sizeof(uint32_t) * (D / 2) * PF_QT
           + sizeof(uint16_t) * PF_QT * D + 64;
}

static void prefill_tile(const uint16_t *q, long sq, const pages_t *kv, int h, int p0, int nq, const int *tab,
                         int start, uint16_t *out, long so, float scale, char *buf, long Lmax)
{
    float *st = (float *)buf;
    uint32_t *pp = (uint32_t *)(st + Lmax * PF_QT);
    uint16_t *vp = (uint16_t *)(pp + (Lmax / 2 + 1) * PF_QT);
    uint32_t *qp = (uint32_t *)(vp + (Lmax / 2 + 1) * 2 * (long)kv->D);
    uint16_t *kw = (uint16_t *)(qp + (kv->D / 2) * PF_QT);
    const int B = kv->B, D = kv->D, i8 = kv->ks != NULL, kh = kv_head(kv, h); /* h: q and out; kh: the blocks */
    const long head_bytes = (long)B * D * (i8 ? 1 : 2);
    const int pos0 = start + p0, L = pos0 + nq, D2 = D / 2; /* keys of the tile's last query */
    for (int p = 0; p < D2; p++)
        for (int i = 0; i < PF_QT; i++)
            qp[p * PF_QT + i] = i < nq ? ((const uint32_t *)(q + (long)(p0 + i) * sq + (long)h * D))[p] : 0;
    /* scores */
    const __m512 vscale = _mm512_set1_ps(scale);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int c0 = 0; c0 < L;) {
        const int j = c0 / B, off = c0 % B;
        int n = B - off < 16 ? B - off : 16;
        if (L - c0 < n) n = L - c0;
        const char *rows = rows_at(kv, kv->k, tab[j], kh);
        const uint32_t *kr = (const uint32_t *)(rows + (long)off * D * (i8 ? 1 : 2));
        if (off == 0 && (j + 1) * B < L) prefetch_span(rows_at(kv, kv->k, tab[j + 1], kh), head_bytes);
        if (i8) { /* the n keys widened to bfloat16 */
            for (int c = 0; c < n; c++)
                for (int d = 0; d < D; d += 16)
                    _mm256_storeu_si256((__m256i *)(kw + (long)c * D + d), row16_bf16(kv, (const int8_t *)kr + (long)c * D, d));
            kr = (const uint32_t *)kw;
        }
        __m512 acc[16];
#pragma GCC unroll 16
        for (int c = 0; c < 16; c++) acc[c] = _mm512_setzero_ps();
        for (int p = 0; p < D2; p++) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(qp + p * PF_QT);
#pragma GCC unroll 16 /* whole: the 16 sums stay in registers */
            for (int c = 0; c < 16; c++)
                if (c < n) acc[c] = _mm512_dpbf16_ps(acc[c], qv, (__m512bh)_mm512_set1_epi32((int)kr[(long)c * D2 + p]));
        }
        const float *ks = i8 ? scales_at(kv->ks, kv, tab[j], kh) + off : NULL;
        for (int c = 0; c < n; c++)
            tile_score(st, c0 + c, pos0, _mm512_mul_ps(acc[c], ks ? _mm512_set1_ps(scale * ks[c]) : vscale), &mx);
        c0 += n;
    }
    /* softmax; then the probabilities rounded to bfloat16 in pairs of keys */
    const __m512 inv = tile_softmax(st, L, mx);
    for (int kp = 0; kp < L; kp += 2) {
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(st + (long)kp * PF_QT), inv);
        __m512 b = kp + 1 < L ? _mm512_mul_ps(_mm512_loadu_ps(st + (long)(kp + 1) * PF_QT), inv) : _mm512_setzero_ps();
        if (i8) { /* the value rows' scales (kp, kp + 1 share a block: B is even) */
            const float *vs = scales_at(kv->vs, kv, tab[kp / B], kh) + kp % B;
            a = _mm512_mul_ps(a, _mm512_set1_ps(vs[0]));
            if (kp + 1 < L) b = _mm512_mul_ps(b, _mm512_set1_ps(vs[1]));
        }
        _mm512_storeu_si512(pp + (long)(kp / 2) * PF_QT, pairs_bf16(a, b));
    }
    /* value rows interleaved in pairs: vp[k][2d + r] = v[2k + r][d] (B even: a pair never spans blocks) */
    for (int kp = 0; kp < L; kp += 2) {
        const char *v0 = (const char *)rows_at(kv, kv->v, tab[kp / B], kh) + (long)(kp % B) * D * (i8 ? 1 : 2);
        const char *v1 = v0 + (long)D * (i8 ? 1 : 2);
        if (kp % B == 0 && (kp / B + 1) * B < L) prefetch_span(rows_at(kv, kv->v, tab[kp / B + 1], kh), head_bytes);
        for (int d = 0; d < D; d += 16) {
            const __m256i lo = row16_bf16(kv, v0, d);
            const __m256i hi = kp + 1 < L ? row16_bf16(kv, v1, d) : _mm256_setzero_si256();
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

#else /* the vector layer's */
#define PF_QT VW /* queries per tile: the lanes */
#define PF_KB 8  /* keys per pass: their 8 sums stay in registers */

/* scratch per thread, for up to Lmax keys: st (Lmax, VW) float scores / probabilities; qt (D, VW) the
   tile's queries transposed; kw (PF_KB, D) keys widened to float32 */
static long prefill_scratch_bytes(long Lmax, int D)
{
    return sizeof(float) * (Lmax * PF_QT + (long)D * PF_QT + (long)PF_KB * D) + 64;
}

/* out[i][d0 .. d0 + 2 VW) (with `two`; else d0 .. d0 + VW: D's last VW where D / VW is odd) for queries
   i0 .. i0 + 3 of the tile: sum over keys of p[i][key] v[key][d], value rows widened (exact) from
   bfloat16 or int8 (their scales already in p), float32 FMAs */
static inline __attribute__((always_inline)) void prefill_values(const pages_t *kv, int kh, const int *tab, int L,
                                                                  const float *st, int i0, int d0, int i8, int two,
                                                                  vf o[4][2])
{
    const int B = kv->B, D = kv->D;
    for (int j = 0; j * B < L; j++) {
        const char *rows = rows_at(kv, kv->v, tab[j], kh);
        const int nr = L - j * B < B ? L - j * B : B;
        for (int r = 0; r < nr; r++) {
            const vf v0 = i8 ? vf_load_i8((const int8_t *)rows + (long)r * D + d0)
                             : vf_load_bf16((const uint16_t *)rows + (long)r * D + d0);
            const vf v1 = !two ? vf_zero() : i8 ? vf_load_i8((const int8_t *)rows + (long)r * D + d0 + VW)
                                               : vf_load_bf16((const uint16_t *)rows + (long)r * D + d0 + VW);
            const float *pk = st + (long)(j * B + r) * PF_QT + i0;
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                const vf p = vf_set1(pk[i]);
                o[i][0] = vf_fmadd(p, v0, o[i][0]);
                if (two) o[i][1] = vf_fmadd(p, v1, o[i][1]);
            }
        }
    }
}

/* One tile of PF_QT = VW queries, the lanes of every vector:
   - scores, PF_KB keys at a time: acc[c] += q column d (VW queries) * key c's d broadcast, float32
     FMAs on keys widened to float32 (exact products, float32 sums), then the causal mask as in the
     AVX-512 tile;
   - softmax across the keys' vectors, VW queries at once;
   - the probabilities rounded to bfloat16 (an int8 value row's scale multiplied in first), as
     the AVX-512 tile rounds them, and summed against the value rows widened to float32 (exact
     products), 4 queries x 16 values at a time, rounded once. */
static void prefill_tile(const uint16_t *q, long sq, const pages_t *kv, int h, int p0, int nq, const int *tab,
                         int start, uint16_t *out, long so, float scale, char *buf, long Lmax)
{
    const int B = kv->B, D = kv->D, i8 = kv->ks != NULL, kh = kv_head(kv, h); /* h: q and out; kh: the blocks */
    const long head_bytes = (long)B * D * (i8 ? 1 : 2);
    const int pos0 = start + p0, L = pos0 + nq; /* keys of the tile's last query */
    float *st = (float *)buf, *qt = st + Lmax * PF_QT, *kw = qt + (long)D * PF_QT;
    for (int d = 0; d < D; d++)
        for (int i = 0; i < PF_QT; i++)
            qt[(long)d * PF_QT + i] = i < nq ? bf16_to_f32(q[(long)(p0 + i) * sq + (long)h * D + d]) : 0.0f;
    /* scores */
    vf mx = vf_set1(-INFINITY);
    for (int c0 = 0; c0 < L;) {
        const int j = c0 / B, off = c0 % B;
        int n = B - off < PF_KB ? B - off : PF_KB;
        if (L - c0 < n) n = L - c0;
        const char *rows = (const char *)rows_at(kv, kv->k, tab[j], kh) + (long)off * D * (i8 ? 1 : 2);
        if (off == 0 && (j + 1) * B < L) prefetch_span(rows_at(kv, kv->k, tab[j + 1], kh), head_bytes);
        for (int c = 0; c < n; c++) /* the n keys widened to float32 (exact) */
            for (int d = 0; d < D; d += VW)
                vf_storeu(kw + (long)c * D + d, i8 ? vf_load_i8((const int8_t *)rows + (long)c * D + d)
                                                   : vf_load_bf16((const uint16_t *)rows + (long)c * D + d));
        vf acc[PF_KB];
#pragma GCC unroll 8
        for (int c = 0; c < PF_KB; c++) acc[c] = vf_zero();
        for (int d = 0; d < D; d++) {
            const vf qv = vf_loadu(qt + (long)d * PF_QT);
#pragma GCC unroll 8
            for (int c = 0; c < PF_KB; c++)
                if (c < n) acc[c] = vf_fmadd(qv, vf_set1(kw[(long)c * D + d]), acc[c]);
        }
        const float *ks = i8 ? scales_at(kv->ks, kv, tab[j], kh) + off : NULL;
        for (int c = 0; c < n; c++) tile_score(st, c0 + c, pos0, vf_mul(acc[c], vf_set1(ks ? scale * ks[c] : scale)), &mx);
        c0 += n;
    }
    /* softmax; the probabilities rounded to bfloat16 */
    const vf inv = tile_softmax(st, L, mx);
    for (int kp = 0; kp < L; kp++) {
        vf pv = vf_mul(vf_loadu(st + (long)kp * PF_QT), inv);
        if (i8) pv = vf_mul(pv, vf_set1(scales_at(kv->vs, kv, tab[kp / B], kh)[kp % B]));
        vf_storeu(st + (long)kp * PF_QT, vf_round_bf16(pv));
    }
    /* values */
    for (int i0 = 0; i0 < nq; i0 += 4) {
        for (int d0 = 0; d0 < D; d0 += 2 * VW) { /* D is a multiple of 16: of VW, not always of 2 VW */
            const int two = d0 + 2 * VW <= D;
            vf o[4][2];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) o[i][0] = o[i][1] = vf_zero();
            if (two) {
                if (i8) prefill_values(kv, kh, tab, L, st, i0, d0, 1, 1, o);
                else prefill_values(kv, kh, tab, L, st, i0, d0, 0, 1, o);
            } else {
                if (i8) prefill_values(kv, kh, tab, L, st, i0, d0, 1, 0, o);
                else prefill_values(kv, kh, tab, L, st, i0, d0, 0, 0, o);
            }
            for (int i = 0; i < 4 && i0 + i < nq; i++) {
                uint16_t *dst = out + (long)(p0 + i0 + i) * so + (long)h * D + d0;
                vf_store_bf16(dst, o[i][0]);
                if (two) vf_store_bf16(dst + VW, o[i][1]);
            }
        }
    }
}
#endif

/* kc, vc: bfloat16 blocks (ks = vs = NULL) or int8 blocks with their scales */
int prefill_paged(const uint16_t *q, long sq, int T, int H, int KH, int D, const void *kc, const void *vc,
                  const float *ks, const float *vs, int B, const int *tab, int start, uint16_t *out, long so, float scale,
                  int nthreads)
{
    if (D % 16 || D > ATT_MAXD || T < 1 || KH < 1 || H < KH || H % KH || B < 2 || B % 2 || start < 0 || (!ks != !vs))
        return -1;
    const long L = (long)start + T, tiles = (T + PF_QT - 1) / PF_QT;
    const pages_t kv = {kc, vc, ks, vs, KH, B, D, H / KH};
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        char *buf = malloc(prefill_scratch_bytes(L, D));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long w = 0; w < (long)H * tiles; w++) {
            /* heads inside tiles: the late (long) tiles of every head first, so the threads end together;
               a KV head's query heads one after another (they read its rows while they are in cache) */
            const int tile = (int)(tiles - 1 - w / H), h = (int)(w % H);
            const int p0 = tile * PF_QT, nq = T - p0 < PF_QT ? T - p0 : PF_QT;
            if (buf) prefill_tile(q, sq, &kv, h, p0, nq, tab, start, out, so, scale, buf, L);
        }
        free(buf);
    }
    return failed ? -2 : 0;
}
