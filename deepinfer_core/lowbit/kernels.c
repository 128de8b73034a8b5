/* Low-bit weight GEMMs for x86 CPUs with AVX2 + FMA.
 *
 * Weights stay in blocks of 32 along K, one scale (and for 4 bits one offset) per block:
 *
 *   q4: w = d * q + m,  q in 0..15, two per byte (element j low nibble, j+16 high nibble)
 *   q8: w = d * q,      q in -128..127
 *
 * Two ways to multiply:
 *
 * - exact (gemm_f32_act): activations stay float32. One token: each weight block is widened to
 *   float in registers and used at once. Several tokens: a few weight rows are widened once into
 *   a small float panel and a register-blocked micro-kernel runs them against every token
 *   (gemm_panel). Every output element is one fixed sequence of FMAs whatever M is.
 * - integer (gemm_i16_act): each activation row is rounded once per call to 16-bit integers per
 *   32-block and multiplied by the weights widened only to int16 (vpmaddwd: exact int32 sums),
 *   one float FMA per block for the scales. 2-3x faster than the exact kernel for one token
 *   (about 13 instructions per 32 weights instead of 28), not faster from ~4-8 tokens on, where
 *   the exact panel kernel pays its widening once for all tokens. Why 16 bits and not
 *   llama.cpp's 8: rounding activations to int8 per 32-block changed SmolLM2's greedy outputs
 *   on 15 of 16 prompts against the same weights in float32 (the Q8_0 acceptance asks >= 14/16
 *   identical over 64 tokens); 16 bits keep them (benchmarks/README.md, lowbit_agreement.py).
 *   Without VNNI (this AVX2 build) an int8 dot is vpmaddubsw + vpmaddwd per 32 values; int16
 *   takes two vpmaddwd, one add and one more widening: about two instructions more per block.
 *   (AVX-VNNI's vpdpwssd would fuse the int16 multiply-add; not built here: no VNNI on the
 *   machine this was measured on, so it could not be tested.)
 *
 * lowbit_gemm picks between them by row count (the Python side: ops.matmul). Memory traffic is
 * the packed weights (4-8x less than float32) either way.
 *
 * Compiled at first use by deepinfer_core.lowbit.native with the system C compiler and linked
 * against the OpenMP runtime torch already loaded, so its threads are torch's threads.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

#define QK 32

#define FLOAT_TILE 8

static inline void widen_q8(const int8_t *q, float d, float m, __m256 *w) {
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    for (int j = 0; j < 4; j++)
        w[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * j)))), vd, vm);
}

static inline void widen_q4(const uint8_t *qs, float d, float m, __m256 *w) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));  /* elements 0..15 */
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));  /* 16..31 */
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int j = 0; j < 4; j++) w[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j])), vd, vm);
}

/* Few tokens: widen each weight block in registers and use it at once (no buffer). */
static void gemm_direct(const float *x, int64_t M, int64_t K, int kind, const void *qs, const float *d, const float *m,
                        int64_t N, float *y, int nthreads) {
    const int64_t nb = K / QK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *wd = d + n * nb, *wm = m ? m + n * nb : 0;
        for (int64_t i0 = 0; i0 < M; i0 += FLOAT_TILE) {
            const int tm = (int)(M - i0 < FLOAT_TILE ? M - i0 : FLOAT_TILE);
            __m256 acc[FLOAT_TILE];
            for (int t = 0; t < FLOAT_TILE; t++) acc[t] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                __m256 w[4];
                if (kind == 4) widen_q4((const uint8_t *)qs + (n * nb + b) * (QK / 2), wd[b], wm[b], w);
                else widen_q8((const int8_t *)qs + (n * nb + b) * QK, wd[b], 0.0f, w);
                for (int t = 0; t < tm; t++) {
                    const float *xr = x + (i0 + t) * K + b * QK;
                    acc[t] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[t]);
                    acc[t] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[t]);
                    acc[t] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[t]);
                    acc[t] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[t]);
                }
            }
            for (int t = 0; t < tm; t++) y[(i0 + t) * N + n] = vec_hsum8(acc[t]);
        }
    }
}

/* Several tokens: widen PANEL_ROWS weight rows once into a float panel (L1-sized for common K),
 * then a register-blocked micro-kernel multiplies PANEL_ROWS rows x MICRO_TOKENS tokens per pass
 * (12 accumulators: each weight vector loaded serves 3 tokens, each activation vector 4 rows),
 * so the widening is paid once per row for all M tokens and the loop is FMA-bound like a float
 * GEMM's. Each accumulator takes the same FMAs in the same order as gemm_direct's, on the
 * same widened values: results are bit-identical to it, whatever M is. */
#define PANEL_ROWS 4
#define MICRO_TOKENS 3
#define PANEL_MIN_M 2

static void widen_row(int kind, const void *qs, const float *d, const float *m, int64_t n, int64_t nb, float *dst) {
    const float *wd = d + n * nb, *wm = m ? m + n * nb : 0;
    for (int64_t b = 0; b < nb; b++) {
        __m256 w[4];
        if (kind == 4) widen_q4((const uint8_t *)qs + (n * nb + b) * (QK / 2), wd[b], wm[b], w);
        else widen_q8((const int8_t *)qs + (n * nb + b) * QK, wd[b], 0.0f, w);
        for (int j = 0; j < 4; j++) _mm256_store_ps(dst + b * QK + 8 * j, w[j]);
    }
}

static void gemm_panel(const float *x, int64_t M, int64_t K, int kind, const void *qs, const float *d, const float *m,
                       int64_t N, float *y, int nthreads) {
    const int64_t nb = K / QK, tiles = (N + PANEL_ROWS - 1) / PANEL_ROWS;
    /* Tokens in chunks whose float32 rows fit in half of a 512 KiB L2 (a multiple of the 3-token
     * micro-tile): each weight tile runs over one chunk at a time, so at prefill sizes (M in the
     * thousands) the activations come from L2, not L3 (the 1536-wide down projection at 2,048
     * tokens is 12.6 MB of activations). Each tile is widened again per chunk; the FMA sequence
     * of every output element is unchanged. */
    int64_t chunk = (int64_t)(256 * 1024 / ((size_t)K * sizeof(float))) / MICRO_TOKENS * MICRO_TOKENS;
    if (chunk < MICRO_TOKENS) chunk = MICRO_TOKENS;
#pragma omp parallel num_threads(nthreads)
    {
        float *panel = (float *)aligned_alloc(32, (size_t)(PANEL_ROWS * K) * sizeof(float));
        for (int64_t c0 = 0; c0 < M; c0 += chunk) {
            const int64_t c1 = c0 + chunk < M ? c0 + chunk : M;
#pragma omp for schedule(static) nowait
            for (int64_t tile = 0; tile < tiles; tile++) {
                const int64_t n0 = tile * PANEL_ROWS;
                const int nr = (int)(N - n0 < PANEL_ROWS ? N - n0 : PANEL_ROWS);
                for (int r = 0; r < PANEL_ROWS; r++)  /* a short last tile repeats its first row */
                    widen_row(kind, qs, d, m, n0 + (r < nr ? r : 0), nb, panel + r * K);
                const float *w0 = panel, *w1 = panel + K, *w2 = panel + 2 * K, *w3 = panel + 3 * K;
                int64_t i0 = c0;
                for (; i0 + MICRO_TOKENS <= c1; i0 += MICRO_TOKENS) {
                    const float *x0 = x + i0 * K, *x1 = x0 + K, *x2 = x1 + K;
                    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
                    __m256 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
                    for (int64_t k = 0; k < K; k += 8) {
                        const __m256 v0 = _mm256_load_ps(w0 + k), v1 = _mm256_load_ps(w1 + k);
                        const __m256 v2 = _mm256_load_ps(w2 + k), v3 = _mm256_load_ps(w3 + k);
                        __m256 u = _mm256_loadu_ps(x0 + k);
                        a00 = _mm256_fmadd_ps(v0, u, a00); a10 = _mm256_fmadd_ps(v1, u, a10);
                        a20 = _mm256_fmadd_ps(v2, u, a20); a30 = _mm256_fmadd_ps(v3, u, a30);
                        u = _mm256_loadu_ps(x1 + k);
                        a01 = _mm256_fmadd_ps(v0, u, a01); a11 = _mm256_fmadd_ps(v1, u, a11);
                        a21 = _mm256_fmadd_ps(v2, u, a21); a31 = _mm256_fmadd_ps(v3, u, a31);
                        u = _mm256_loadu_ps(x2 + k);
                        a02 = _mm256_fmadd_ps(v0, u, a02); a12 = _mm256_fmadd_ps(v1, u, a12);
                        a22 = _mm256_fmadd_ps(v2, u, a22); a32 = _mm256_fmadd_ps(v3, u, a32);
                    }
                    const __m256 acc[PANEL_ROWS][MICRO_TOKENS] = {{a00, a01, a02}, {a10, a11, a12}, {a20, a21, a22}, {a30, a31, a32}};
                    for (int r = 0; r < nr; r++)
                        for (int t = 0; t < MICRO_TOKENS; t++) y[(i0 + t) * N + n0 + r] = vec_hsum8(acc[r][t]);
                }
                for (; i0 < c1; i0++) {  /* the chunk's last tokens (< 3), one at a time */
                    const float *x0 = x + i0 * K;
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                    for (int64_t k = 0; k < K; k += 8) {
                        const __m256 u = _mm256_loadu_ps(x0 + k);
                        a0 = _mm256_fmadd_ps(_mm256_load_ps(w0 + k), u, a0);
                        a1 = _mm256_fmadd_ps(_mm256_load_ps(w1 + k), u, a1);
                        a2 = _mm256_fmadd_ps(_mm256_load_ps(w2 + k), u, a2);
                        a3 = _mm256_fmadd_ps(_mm256_load_ps(w3 + k), u, a3);
                    }
                    const __m256 acc[PANEL_ROWS] = {a0, a1, a2, a3};
                    for (int r = 0; r < nr; r++) y[i0 * N + n0 + r] = vec_hsum8(acc[r]);
                }
            }
        }
        free(panel);
    }
}

void gemm_f32_act(const float *x, int64_t M, int64_t K, int kind, const void *qs, const float *d, const float *m,
                  int64_t N, float *y, int nthreads) {
    if (M >= PANEL_MIN_M) gemm_panel(x, M, K, kind, qs, d, m, N, y, nthreads);
    else gemm_direct(x, M, K, kind, qs, d, m, N, y, nthreads);
}

static inline float dot_offsets(const float *m, const float *sx, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(m + b), _mm256_loadu_ps(sx + b), acc);
    float r = vec_hsum8(acc);
    for (; b < nb; b++) r += m[b] * sx[b];
    return r;
}

/* Integer-dot path for few tokens (decode). Each activation row is rounded once per call, per
 * 32-block, to 16-bit integers: v = round(x / s), s = max|x| / 32767 (llama.cpp rounds to 8 bits;
 * on SmolLM2 that changed the greedy output of most prompts against the same weights in float32,
 * see benchmarks/README.md). The weight block is widened only to int16 (one instruction per 16
 * values) and multiplied by `vpmaddwd`, which sums pairs into int32 exactly; one float FMA per
 * block applies d * s. A q4 block's offset m is applied to the block's float sum of x, so only
 * the d * q part sees the rounded activations. Per output element the operations do not depend
 * on M or on the other rows: each row's result is the same alone or in any batch that takes
 * this path. */
typedef struct {
    int16_t *v;  /* [M, K] */
    float *s;    /* [M, K/32] scale per block */
    float *sx;   /* [M, K/32] float sum of the block's x (for the q4 offset) */
} act16_t;

/* Round x [M, K] to act16 (exported for the tests: the kernel's own rounding, so a float64
 * reference can use exactly the integers the kernel multiplies). */
void quantize_act16(const float *x, int64_t M, int64_t K, int16_t *v, float *s, float *sx) {
    const int64_t nb = K / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < M; i++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + i * K + b * QK;
            __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8), x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
            const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x0), _mm256_andnot_ps(sign, x1)),
                                           _mm256_max_ps(_mm256_andnot_ps(sign, x2), _mm256_andnot_ps(sign, x3)));
            const float amax = vec_hmax8(a);
            sx[i * nb + b] = vec_hsum8(_mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3)));
            const float scale = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
            s[i * nb + b] = scale;
            const __m256 vi = _mm256_set1_ps(inv);
            const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, vi)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, vi));
            const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(x2, vi)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(x3, vi));
            /* packs works per 128-bit lane: reorder the 64-bit quarters back to element order */
            const __m256i p0 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
            const __m256i p1 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8);
            _mm256_storeu_si256((__m256i *)(v + i * K + b * QK), p0);
            _mm256_storeu_si256((__m256i *)(v + i * K + b * QK + 16), p1);
        }
}

static inline __attribute__((always_inline)) void widen_block_i16(int kind, const void *qs, int64_t blk, __m256i *w0, __m256i *w1) {
    if (kind == 4) {
        /* each byte widened to 16 bits holds both nibbles: the low one is element j, the high
         * one (a shift, no mask needed) element j + 16 */
        const __m256i both = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)qs + blk * (QK / 2))));
        *w0 = _mm256_and_si256(both, _mm256_set1_epi16(0x0F));
        *w1 = _mm256_srli_epi16(both, 4);
    } else {
        const int8_t *q = (const int8_t *)qs + blk * QK;
        *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
        *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
    }
}

static inline __attribute__((always_inline)) __m256 block_dot_i16(__m256i w0, __m256i w1, const int16_t *vr) {
    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)vr)),
                                       _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(vr + 16))));
    return _mm256_cvtepi32_ps(p);
}

/* One weight row n against T tokens (T a compile-time constant after inlining, so the
 * accumulators live in registers); two accumulators per token over even/odd blocks, summed in
 * a fixed order at the end. */
static inline __attribute__((always_inline)) void row_i16(const act16_t *a, int64_t i0, const int T, int64_t K, int kind,
                                                         const void *qs, const float *d, const float *m, int64_t n,
                                                         int64_t N, float *y) {
    const int64_t nb = K / QK;
    const float *wd = d + n * nb;
    __m256 acc0[4], acc1[4];
    for (int t = 0; t < T; t++) acc0[t] = acc1[t] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        __m256i w0, w1, u0, u1;
        widen_block_i16(kind, qs, n * nb + b, &w0, &w1);
        widen_block_i16(kind, qs, n * nb + b + 1, &u0, &u1);
        for (int t = 0; t < T; t++) {
            const float *st = a->s + (i0 + t) * nb + b;
            const int16_t *vr = a->v + (i0 + t) * K + b * QK;
            acc0[t] = _mm256_fmadd_ps(_mm256_mul_ps(block_dot_i16(w0, w1, vr), _mm256_broadcast_ss(wd + b)), _mm256_broadcast_ss(st), acc0[t]);
            acc1[t] = _mm256_fmadd_ps(_mm256_mul_ps(block_dot_i16(u0, u1, vr + QK), _mm256_broadcast_ss(wd + b + 1)), _mm256_broadcast_ss(st + 1), acc1[t]);
        }
    }
    if (b < nb) {
        __m256i w0, w1;
        widen_block_i16(kind, qs, n * nb + b, &w0, &w1);
        for (int t = 0; t < T; t++)
            acc0[t] = _mm256_fmadd_ps(_mm256_mul_ps(block_dot_i16(w0, w1, a->v + (i0 + t) * K + b * QK), _mm256_broadcast_ss(wd + b)),
                                      _mm256_broadcast_ss(a->s + (i0 + t) * nb + b), acc0[t]);
    }
    for (int t = 0; t < T; t++) {
        float r = vec_hsum8(_mm256_add_ps(acc0[t], acc1[t]));
        if (kind == 4) r += dot_offsets(m + n * nb, a->sx + (i0 + t) * nb, nb);
        y[(i0 + t) * N + n] = r;
    }
}

static void gemm_i16_rows(const act16_t *a, int64_t M, int64_t K, int kind, const void *qs, const float *d, const float *m,
                          int64_t N, float *y, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        int64_t i0 = 0;
        for (; i0 + 4 <= M; i0 += 4) row_i16(a, i0, 4, K, kind, qs, d, m, n, N, y);
        switch (M - i0) {
            case 3: row_i16(a, i0, 3, K, kind, qs, d, m, n, N, y); break;
            case 2: row_i16(a, i0, 2, K, kind, qs, d, m, n, N, y); break;
            case 1: row_i16(a, i0, 1, K, kind, qs, d, m, n, N, y); break;
            default: break;
        }
    }
}

/* x [M, K] float32 -> y [M, N]: activations rounded to int16 per block, integer dot products. */
void gemm_i16_act(const float *x, int64_t M, int64_t K, int kind, const void *qs, const float *d, const float *m,
                  int64_t N, float *y, int nthreads) {
    const int64_t nb = K / QK;
    act16_t a = {(int16_t *)malloc((size_t)(M * K) * sizeof(int16_t)), (float *)malloc((size_t)(M * nb) * sizeof(float)),
                 (float *)malloc((size_t)(M * nb) * sizeof(float))};
    quantize_act16(x, M, K, a.v, a.s, a.sx);
    gemm_i16_rows(&a, M, K, kind, qs, d, m, N, y, nthreads);
    free(a.v); free(a.s); free(a.sx);
}

void gemm_i8_act(const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d, const float *m, int64_t N, float *y,
                 int nthreads);  /* kernels_i8.c */

/* The one entry point for callers in C (layer.c): the int16 kernel for M <= int_rows rows, the
 * int8 kernel for 4-bit weights from int8_rows rows on (0: never), the exact float32-activation
 * kernel otherwise (ops.kernel_for chooses the same way). */
void lowbit_gemm(const float *x, int64_t M, int64_t K, int kind, const void *qs, const float *d, const float *m,
                 int64_t N, float *y, int nthreads, int64_t int_rows, int64_t int8_rows) {
    if (M <= int_rows) gemm_i16_act(x, M, K, kind, qs, d, m, N, y, nthreads);
    else if (kind == 4 && int8_rows > 0 && M >= int8_rows) gemm_i8_act(x, M, K, (const uint8_t *)qs, d, m, N, y, nthreads);
    else gemm_f32_act(x, M, K, kind, qs, d, m, N, y, nthreads);
}

/* Decode attention over the paged KV cache: attention.c (one implementation for both paths). */
