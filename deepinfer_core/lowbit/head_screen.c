/* The greedy LM head screened in int8, exact: the same argmax as lowbit_head_argmax (head.c),
 * bit for bit, with most of the vocabulary multiplied at int8 rates.
 *
 * Why: the fused head multiplies every vocabulary row by int16 activations (gemm_i16_pre,
 * vpdpwssd: 16 products an instruction); at 32 requests it is ~9% of a run. int8 activations
 * (vpdpbusd: 32 products an instruction) move SmolLM2's logits enough to change greedy tokens
 * (benchmarks/README.md, cpu6), so here they only screen: every row's int8 logit comes with a
 * proven bound on its distance to the int16 head's float logit, and only the rows whose upper
 * bound reaches the best lower bound (a median of ~9 of 49,152 per token on SmolLM2) are
 * recomputed through the head's own kernel, whose value decides.
 *
 * The bound. Token t, weight row j (Q8_0: w = d_jb * q_jbk, 32-blocks b), x the float32 hidden
 * row, amax_b = max_k |x_bk|. The int16 head multiplies v = quantize_act16(x) (s16_b =
 * fl(amax_b / 32767), v_bk = rint(fl(x_bk * fl(32767 / amax_b)))); the screen multiplies u_bk =
 * rint(fl(x_bk * fl(127 / amax_b))) with s8_b = fl(amax_b / 127). Per element, with u = 2^-24:
 *   |x - s16 v| <= 0.5 s16 + u |x inv16| s16 + |x| |inv16 s16 - 1| <= s16 (0.5 + 32767 u) + amax 2.0001 u
 *               <= 0.506 amax / 32767,     and likewise  |x - s8 u| <= 0.501 amax / 127.
 * So the exact (real) values E16_j = sum_b d s16_b sum_k q v and E8_j = sum_b d s8_b sum_k q u obey
 *   |E16_j - E8_j| <= sum_b A_jb amax_b (0.51 / 32767 + 0.51 / 127),   A_jb = |d_jb| sum_k |q_jbk|
 * (A precomputed at load). Float rounding: each float logit (the head's L16_j, the screen's L8_j)
 * is a sum of at most 8 nb lane terms (nb blocks, 8 lanes in the head's rows layout), each made
 * by a few roundings, and |each block's term| <= A_jb amax_b (1 + 2u); so |L - E| <= (nb + 10) u
 * G_j with G_j = sum_b A_jb amax_b; forming hi_j = fl(L8_j + B_j) and lo_j = fl(L8_j - B_j) moves
 * them by at most 2.1 u G_j; B_j's own float sum under-estimates it by at most (nb + 3) u B_j.
 * Hence with
 *   B_j = sum_b A_jb e_b,   e_b = amax_b * (0.51 (1/32767 + 1/127) (1 + 2^-10) + (2 nb + 32) u)
 * plus an absolute 1e-37 for roundings of subnormal results (each at most 2^-150 off, not
 * relative), |L16_j - L8_j| + the roundings of hi_j / lo_j stay within B_j. The row with the head's
 * largest logit L16_* then has hi_* >= L16_* >= L16_i >= lo_i for every row i: it is a candidate
 * for any threshold <= max_i lo_i; every row tied with it too; a row with hi_j < max_i lo_i has
 * L16_j < L16_*, so it can neither win nor tie. The candidates' exact logits come from gemm_i16_pre
 * on the gathered packed rows with the call's M (a logit's bits depend only on its weight row,
 * its hidden row and M: head.c), the first (lowest index) of the largest wins, as torch.argmax.
 *
 * Refused (the call goes to lowbit_head_argmax, which is then the answer): a kind other than q8,
 * a row count for which the head does not take the int16 kernel, a non-finite or subnormal-scale
 * block (amax_b not 0 and not in [1e-30, 3e38]: NaN handling as head.c's), magnitudes where a
 * float sum could overflow (max_j sum_b A_jb * max_b amax_b >= 1e30), and calls whose candidates
 * cover more than a quarter of the vocabulary (a zero hidden row ties every row).
 *
 * The int8 products: with AVX512-VNNI + VL (or AVX-VNNI) vpdpbusd multiplies unsigned by signed
 * bytes, so activations go in as u + 128 (1..255) and each (row, block)'s accumulator starts at
 * -128 sum_k q_jbk (precomputed): the int32 sums are exactly sum_k q u (|.| <= 32 * 128 * 255).
 * On AVX2, vpmaddubsw's int16 pair sums would saturate with offset bytes, so it multiplies |u| by
 * q with u's sign (vpsignb; |pair| <= 2 * 127 * 127), then vpmaddwd by ones: exact for q in
 * [-127, 127] (a weight holding -128, which vpsignb cannot negate, refuses the panel there).
 *
 * Layout: the weights repacked once at load into a panel of 16-row tiles (head_screen_prepare),
 * per block: 8 k-quads x 2 vectors (rows 0-7, 8-15), each int32 lane 4 bytes of one row, then the
 * 16 rows' -128 sum q (int32), d, and A. A broadcast of a token's 4 activation bytes and one
 * vpdpbusd give 8 rows x 4 products; nothing is reduced across lanes.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

int lowbit_head_argmax(const float *x, int64_t M, int64_t K, int kind, const void *qs, const float *d, const float *m,
                       int64_t N, int64_t int_rows, int64_t int8_rows, int nthreads, int64_t *out);  /* head.c */
void quantize_act16(const float *x, int64_t M, int64_t K, int16_t *v, float *s, float *sx);  /* kernels_i16.c */
void gemm_i16_pre(const int16_t *v, const float *s, const float *sx, int64_t M, int64_t K, int kind, const void *qs, const float *d,
                  const float *m, int64_t N, float *y, int nthreads);  /* kernels_i16.c */

#define QK 32
#define SC_COLS 16                        /* weight rows per tile */
#define SC_BLOCK (16 * 32 + 3 * 16 * 4)   /* panel bytes per tile and block: weights, -128 sum q, d, A */
#define SC_SLACK_ABS 1e-37f

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SC_VNNI 1
#define DPBUSD(acc, a, b) _mm256_dpbusd_epi32((acc), (a), (b))
#elif defined(__AVXVNNI__)
#define SC_VNNI 1
#define DPBUSD(acc, a, b) _mm256_dpbusd_avx_epi32((acc), (a), (b))
#else
#define SC_VNNI 0
#endif

/* tokens per pass over a tile's block: 2 int32 sums and 4 float accumulators (L8, B) each in registers */
#ifndef SC_T
#if SC_VNNI && defined(__AVX512VL__)
#define SC_T 3
#else
#define SC_T 2
#endif
#endif

int64_t head_screen_panel_bytes(int64_t N, int64_t K) { return (N + SC_COLS - 1) / SC_COLS * (K / QK) * SC_BLOCK; }

/* Repack q8 rows qs [N, K/32, 32] (int8) and d [N, K/32] into panel (head_screen_panel_bytes,
 * 32-byte aligned). *arow: max_j sum_b A_jb. Returns 0, or -1 where the screen cannot be exact:
 * a non-finite d, or (AVX2 build) a weight of -128. */
int head_screen_prepare(const int8_t *qs, const float *d, int64_t N, int64_t K, void *panel, float *arow) {
    const int64_t nb = K / QK, tiles = (N + SC_COLS - 1) / SC_COLS;
    int bad = 0;
    double top = 0.0;
#pragma omp parallel for schedule(static) reduction(| : bad) reduction(max : top)
    for (int64_t t = 0; t < tiles; t++) {
        double rowsum[SC_COLS] = {0};
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *pb = (uint8_t *)panel + (t * nb + b) * SC_BLOCK;
            int32_t *negc = (int32_t *)(pb + 512);
            float *pd = (float *)(pb + 576), *pa = (float *)(pb + 640);
            for (int c = 0; c < SC_COLS; c++) {
                const int64_t n = t * SC_COLS + c;
                int32_t sum = 0, sabs = 0;
                float dn = 0.0f;
                if (n < N) {
                    const int8_t *q = qs + (n * nb + b) * QK;
                    dn = d[n * nb + b];
                    for (int k = 0; k < QK; k++) {
                        sum += q[k];
                        sabs += q[k] < 0 ? -q[k] : q[k];
                        bad |= !SC_VNNI && q[k] == -128;
                        /* quad p of row c: vector 2 p + c / 8, lane c % 8 */
                        pb[(2 * (k / 4) + c / 8) * 32 + (c % 8) * 4 + k % 4] = (uint8_t)q[k];
                    }
                    bad |= !isfinite(dn);
                } else {
                    for (int k = 0; k < QK; k++) pb[(2 * (k / 4) + c / 8) * 32 + (c % 8) * 4 + k % 4] = 0;
                }
                negc[c] = -128 * sum;
                pd[c] = dn;
                pa[c] = fabsf(dn) * (float)sabs;
                rowsum[c] += (double)pa[c];
            }
        }
        for (int c = 0; c < SC_COLS; c++) top = rowsum[c] > top ? rowsum[c] : top;
    }
    *arow = (float)(top * (1.0 + 1e-6));
    return bad ? -1 : 0;
}

/* Token rows rounded for the screen: a8 [M, K] (u + 128 for vpdpbusd, u for the AVX2 path), s8
 * and e (the bound's per-block weight) [M, K/32]; *amax_top the largest amax. Returns 0, or -1 for
 * a block whose amax the bound does not cover (non-finite, subnormal-ish). */
static int screen_act(const float *x, int64_t K, int8_t *a8, float *s8, float *e, float *amax_top) {
    const int64_t nb = K / QK;
    const double c = 0.51 * (1.0 / 32767.0 + 1.0 / 127.0) * (1.0 + 1.0 / 1024.0) + (2.0 * nb + 32.0) * 0x1p-24;
    const float cf = (float)(c * (1.0 + 1e-6));  /* rounded up */
    int bad = 0;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int k = 0; k < QK; k++) amax = fabsf(xb[k]) > amax || isnan(xb[k]) ? fabsf(xb[k]) : amax;
        if (!(amax == 0.0f || (amax >= 1e-30f && amax <= 3e38f))) bad = 1;
        *amax_top = amax > *amax_top ? amax : *amax_top;
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        s8[b] = amax / 127.0f;
        e[b] = amax * cf;
        for (int k = 0; k < QK; k++) {
            int u = bad ? 0 : (int)nearbyintf(xb[k] * inv);
            u = u > 127 ? 127 : u < -127 ? -127 : u;
            ((uint8_t *)a8)[b * QK + k] = (uint8_t)(SC_VNNI ? u + 128 : u);  /* AVX2: u's two's complement byte */
        }
    }
    return bad ? -1 : 0;
}

/* L8 and B of one tile's 16 rows for T tokens from i0 (T compile-time after inlining): y8, yb
 * [M, ld] at column c0. */
static inline __attribute__((always_inline)) void tile_tokens(const uint8_t *tp, int64_t nb, int64_t K, const int8_t *a8,
                                                              const float *s8, const float *e, int64_t i0, const int T,
                                                              float *y8, float *yb, int64_t ld, int64_t c0) {
    __m256 f0[SC_T], f1[SC_T], g0[SC_T], g1[SC_T];  /* L8, B */
    for (int t = 0; t < T; t++) f0[t] = f1[t] = g0[t] = g1[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = tp + b * SC_BLOCK;
        const __m256i *w = (const __m256i *)pb;
        const int32_t *xq = (const int32_t *)(a8 + i0 * K + b * QK);  /* token t's quad p: xq[t * K / 4 + p] */
        __m256i s0[SC_T], s1[SC_T];
#if SC_VNNI
        {
            const __m256i c0v = _mm256_load_si256((const __m256i *)(pb + 512)), c1v = _mm256_load_si256((const __m256i *)(pb + 544));
            for (int t = 0; t < T; t++) s0[t] = c0v, s1[t] = c1v;
        }
#pragma GCC unroll 8
        for (int p = 0; p < 8; p++) {
            const __m256i w0 = _mm256_load_si256(w + 2 * p), w1 = _mm256_load_si256(w + 2 * p + 1);
            for (int t = 0; t < T; t++) {
                const __m256i u = _mm256_set1_epi32(xq[t * (K / 4) + p]);
                s0[t] = DPBUSD(s0[t], u, w0);
                s1[t] = DPBUSD(s1[t], u, w1);
            }
        }
#else
        {
            const __m256i ones = _mm256_set1_epi16(1);
            __m256i h0[SC_T], h1[SC_T];  /* int16 pair sums (<= 2 * 127 * 127), widened at once: two would overflow */
            for (int t = 0; t < T; t++) s0[t] = s1[t] = _mm256_setzero_si256();
            for (int p = 0; p < 8; p++) {
                const __m256i w0 = _mm256_load_si256(w + 2 * p), w1 = _mm256_load_si256(w + 2 * p + 1);
                for (int t = 0; t < T; t++) {
                    const __m256i u = _mm256_set1_epi32(xq[t * (K / 4) + p]), au = _mm256_abs_epi8(u);
                    h0[t] = _mm256_maddubs_epi16(au, _mm256_sign_epi8(w0, u));
                    h1[t] = _mm256_maddubs_epi16(au, _mm256_sign_epi8(w1, u));
                    s0[t] = _mm256_add_epi32(s0[t], _mm256_madd_epi16(h0[t], ones));
                    s1[t] = _mm256_add_epi32(s1[t], _mm256_madd_epi16(h1[t], ones));
                }
            }
        }
#endif
        const __m256 d0 = _mm256_load_ps((const float *)(pb + 576)), d1 = _mm256_load_ps((const float *)(pb + 608));
        const __m256 a0 = _mm256_load_ps((const float *)(pb + 640)), a1 = _mm256_load_ps((const float *)(pb + 672));
        for (int t = 0; t < T; t++) {
            const __m256 st = _mm256_broadcast_ss(s8 + (i0 + t) * nb + b), et = _mm256_broadcast_ss(e + (i0 + t) * nb + b);
            f0[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0[t]), _mm256_mul_ps(d0, st), f0[t]);
            f1[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1[t]), _mm256_mul_ps(d1, st), f1[t]);
            g0[t] = _mm256_fmadd_ps(a0, et, g0[t]);
            g1[t] = _mm256_fmadd_ps(a1, et, g1[t]);
        }
    }
    const __m256 abs_slack = _mm256_set1_ps(SC_SLACK_ABS);
    for (int t = 0; t < T; t++) {
        _mm256_storeu_ps(y8 + (i0 + t) * ld + c0, f0[t]);
        _mm256_storeu_ps(y8 + (i0 + t) * ld + c0 + 8, f1[t]);
        _mm256_storeu_ps(yb + (i0 + t) * ld + c0, _mm256_add_ps(g0[t], abs_slack));
        _mm256_storeu_ps(yb + (i0 + t) * ld + c0 + 8, _mm256_add_ps(g1[t], abs_slack));
    }
}

#define SC_CASE(n) \
    case n:        \
        if ((n) < SC_T) tile_tokens(tp, nb, K, a8, s8, e, i0, (n) < SC_T ? (n) : 1, y8, yb, ld, c0); \
        break;

static void tile_all_tokens(const uint8_t *tp, int64_t nb, int64_t K, const int8_t *a8, const float *s8, const float *e,
                            int64_t M, float *y8, float *yb, int64_t ld, int64_t c0) {
    int64_t i0 = 0;
    for (; i0 + SC_T <= M; i0 += SC_T) tile_tokens(tp, nb, K, a8, s8, e, i0, SC_T, y8, yb, ld, c0);
    switch (M - i0) { SC_CASE(7) SC_CASE(6) SC_CASE(5) SC_CASE(4) SC_CASE(3) SC_CASE(2) SC_CASE(1) default: break; }
}

typedef struct {
    int32_t *idx;
    float *hi;
    int64_t n, cap;
} cand_t;

static void cand_push(cand_t *c, int32_t j, float hi) {
    if (c->n == c->cap) {
        c->cap = c->cap ? 2 * c->cap : 64;
        c->idx = (int32_t *)realloc(c->idx, (size_t)c->cap * sizeof(int32_t));
        c->hi = (float *)realloc(c->hi, (size_t)c->cap * sizeof(float));
    }
    c->idx[c->n] = j;
    c->hi[c->n++] = hi;
}

/* out[M]: the argmax of each row of x [M, K] @ W^T, W = N q8 rows (qs, d as lowbit_head_argmax
 * takes them; panel and arow from head_screen_prepare). Returns what lowbit_head_argmax returns
 * (0, or -1 for a NaN logit), having called it where the screen is refused (header comment).
 * stats (may be NULL): stats[0] = the candidate rows recomputed, -1 where refused. */
int lowbit_head_screen_argmax(const float *x, int64_t M, int64_t K, int kind, const void *qs, const float *d, const float *m,
                              int64_t N, int64_t int_rows, int64_t int8_rows, int nthreads, const void *panel, float arow,
                              int64_t *out, int64_t *stats) {
    const int64_t nb = K / QK, tiles = (N + SC_COLS - 1) / SC_COLS;
    if (stats) stats[0] = -1;
    if (kind != 8 || !panel || M < 1 || lb_act_kernel(kind, M, int_rows, int8_rows) != 16 || N >= INT32_MAX)
        return lowbit_head_argmax(x, M, K, kind, qs, d, m, N, int_rows, int8_rows, nthreads, out);
    int8_t *a8 = (int8_t *)aligned_alloc(32, (size_t)((M * K + 63) / 32 * 32));
    float *s8 = (float *)malloc((size_t)(2 * M * nb) * sizeof(float)), *e = s8 + M * nb;
    float amax_top = 0.0f;
    int bad = 0;
    for (int64_t r = 0; r < M; r++) bad |= screen_act(x + r * K, K, a8 + r * K, s8 + r * nb, e + r * nb, &amax_top);
    if (bad || !((double)arow * (double)amax_top < 1e30)) {
        free(a8);
        free(s8);
        return lowbit_head_argmax(x, M, K, kind, qs, d, m, N, int_rows, int8_rows, nthreads, out);
    }
    /* vocabulary chunks whose L8 and B [M, chunk] stay in L2, >= 8 chunks a thread */
    int64_t ctiles = 64 * 1024 / (M * 2 * (int64_t)sizeof(float)) / SC_COLS;
    const int64_t even = (tiles + 8 * nthreads - 1) / (8 * nthreads);
    if (ctiles > even) ctiles = even;
    if (ctiles < 1) ctiles = 1;
    const int64_t chunks = (tiles + ctiles - 1) / ctiles, ld = ctiles * SC_COLS;
    cand_t *cands = (cand_t *)calloc((size_t)(nthreads * M), sizeof(cand_t));
    float *thr = (float *)malloc((size_t)(nthreads * M) * sizeof(float));
    for (int64_t i = 0; i < nthreads * M; i++) thr[i] = -INFINITY;
#pragma omp parallel num_threads(nthreads)
    {
        const int me = omp_get_thread_num();
        cand_t *mine = cands + me * M;
        float *lim = thr + me * M;
        float *y8 = (float *)malloc((size_t)(2 * M * ld) * sizeof(float)), *yb = y8 + M * ld;
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t t0 = c * ctiles, t1 = t0 + ctiles < tiles ? t0 + ctiles : tiles;
            const int64_t n0 = t0 * SC_COLS, n = (t1 * SC_COLS < N ? t1 * SC_COLS : N) - n0;
            for (int64_t t = t0; t < t1; t++)
                tile_all_tokens((const uint8_t *)panel + t * nb * SC_BLOCK, nb, K, a8, s8, e, M, y8, yb, ld, (t - t0) * SC_COLS);
            for (int64_t r = 0; r < M; r++) {
                const float *l8 = y8 + r * ld, *bb = yb + r * ld;
                __m256 lo = _mm256_set1_ps(lim[r]);
                int64_t j = 0;
                for (; j + 8 <= n; j += 8) lo = _mm256_max_ps(lo, _mm256_sub_ps(_mm256_loadu_ps(l8 + j), _mm256_loadu_ps(bb + j)));
                float top = vec_hmax8(lo);
                for (; j < n; j++) top = l8[j] - bb[j] > top ? l8[j] - bb[j] : top;
                lim[r] = top;
                const __m256 tv = _mm256_set1_ps(top);
                j = 0;
                for (; j + 8 <= n; j += 8) {
                    const __m256 hi = _mm256_add_ps(_mm256_loadu_ps(l8 + j), _mm256_loadu_ps(bb + j));
                    int mask = _mm256_movemask_ps(_mm256_cmp_ps(hi, tv, _CMP_GE_OQ));
                    while (mask) {
                        const int k = __builtin_ctz(mask);
                        mask &= mask - 1;
                        cand_push(mine + r, (int32_t)(n0 + j + k), l8[j + k] + bb[j + k]);
                    }
                }
                for (; j < n; j++)
                    if (l8[j] + bb[j] >= top) cand_push(mine + r, (int32_t)(n0 + j), l8[j] + bb[j]);
            }
        }
        free(y8);
    }
    /* the final threshold per token: the largest lower bound of any thread's chunks */
    uint8_t *mark = (uint8_t *)calloc((size_t)N, 1);
    int64_t U = 0;
    for (int64_t r = 0; r < M; r++) {
        float top = -INFINITY;
        for (int th = 0; th < nthreads; th++) top = thr[th * M + r] > top ? thr[th * M + r] : top;
        for (int th = 0; th < nthreads; th++) {
            const cand_t *cr = cands + th * M + r;
            for (int64_t i = 0; i < cr->n; i++)
                if (cr->hi[i] >= top && !mark[cr->idx[i]]) mark[cr->idx[i]] = 1, U++;
        }
    }
    for (int64_t i = 0; i < nthreads * M; i++) free(cands[i].idx), free(cands[i].hi);
    free(cands);
    free(thr);
    free(a8);
    free(s8);
    if (U > N / 4 || U == 0) {  /* U == 0 cannot happen for finite rows; refuse rather than guess */
        free(mark);
        return lowbit_head_argmax(x, M, K, kind, qs, d, m, N, int_rows, int8_rows, nthreads, out);
    }
    /* the candidates' exact logits: their packed rows gathered in vocabulary order, the head's kernel */
    int32_t *rows = (int32_t *)malloc((size_t)U * sizeof(int32_t));
    int8_t *gq = (int8_t *)malloc((size_t)(U * K));
    float *gd = (float *)malloc((size_t)(U * nb) * sizeof(float));
    for (int64_t j = 0, u = 0; j < N; j++)
        if (mark[j]) {
            memcpy(gq + u * K, (const int8_t *)qs + j * K, (size_t)K);
            memcpy(gd + u * nb, d + j * nb, (size_t)nb * sizeof(float));
            rows[u++] = (int32_t)j;
        }
    free(mark);
    int16_t *v = (int16_t *)malloc((size_t)(M * K) * sizeof(int16_t));
    float *s = (float *)malloc((size_t)(2 * M * nb) * sizeof(float)), *sx = s + M * nb;
    float *y = (float *)malloc((size_t)(M * U) * sizeof(float));
    quantize_act16(x, M, K, v, s, sx);
    gemm_i16_pre(v, s, sx, M, K, kind, gq, gd, 0, U, y, U * M < (1 << 16) ? 1 : nthreads);  /* a few rows: no second fork and join */
    int nan = 0;
    for (int64_t r = 0; r < M; r++) {  /* rows ascending: the first maximum wins */
        const float *yr = y + r * U;
        float top = yr[0];
        int64_t at = 0;
        for (int64_t u = 0; u < U; u++) {
            nan |= isnan(yr[u]);
            if (yr[u] > top) top = yr[u], at = u;
        }
        out[r] = rows[at];
    }
    if (stats) stats[0] = U;
    free(rows);
    free(gq);
    free(gd);
    free(v);
    free(s);
    free(y);
    return nan ? -1 : 0;
}
