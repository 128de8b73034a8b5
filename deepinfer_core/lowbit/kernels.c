/* Low-bit weight GEMMs for x86 CPUs with AVX2 + FMA.
 *
 * Weights stay in blocks of 32 along K, one scale (and for 4 bits one offset) per block:
 *
 *   q4: w = d * q + m,  q in 0..15, two per byte (element j low nibble, j+16 high nibble)
 *   q5: w = d * q + m,  q in 0..31, q4's 16 bytes for the low 4 bits, then 4 bytes of high bits
 *   q8: w = d * q,      q in -128..127
 *
 * Two ways to multiply:
 *
 * - exact (gemm_f32_act, this file): activations stay float32. One token: each weight block is
 *   widened to float in registers and used at once. Several tokens: a few weight rows are
 *   widened once into a small float panel and a register-blocked micro-kernel runs them against
 *   every token (gemm_panel). Every output element is one fixed sequence of FMAs whatever M is.
 * - integer (gemm_i16_act, kernels_i16.c): activations rounded to 16-bit integers per 32-block,
 *   exact int32 block sums by vpmaddwd, one float FMA per block for the scales. 2-3x faster than
 *   the exact kernel for one token, 1.2-1.4x from ~16 tokens on (a panel of weight rows widened
 *   to int16), about the same at 5-12. The default for every call (ops.DEFAULT_INT_ROWS).
 *   (kernels_i8.c's int8 activations are faster still, but lose the float32 model's tokens.)
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

static inline void widen_q5(const uint8_t *qs, float d, float m, __m256 *w) {
    __m256i lo, hi;
    q5_widen_i16(qs, &lo, &hi);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    const __m128i parts[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1), _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
    for (int j = 0; j < 4; j++) w[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(parts[j])), vd, vm);
}

static inline __attribute__((always_inline)) void widen_block(int kind, const void *qs, int64_t blk, float d, const float *m, int64_t b, __m256 *w) {
    if (kind == 4) widen_q4((const uint8_t *)qs + blk * 16, d, m[b], w);
    else if (kind == 5) widen_q5((const uint8_t *)qs + blk * 20, d, m[b], w);
    else widen_q8((const int8_t *)qs + blk * QK, d, 0.0f, w);
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
                widen_block(kind, qs, n * nb + b, wd[b], wm, b, w);
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
        widen_block(kind, qs, n * nb + b, wd[b], wm, b, w);
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

void gemm_i16_act(const float *x, int64_t M, int64_t K, int kind, const void *qs, const float *d, const float *m,
                  int64_t N, float *y, int nthreads);  /* kernels_i16.c */
void gemm_i8_act(const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d, const float *m, int64_t N, float *y,
                 int nthreads);  /* kernels_i8.c */

/* Which instruction set this library was compiled for (native.py's isa names): 0 AVX2, 1 AVX512-VNNI
 * (+VL), 2 AVX-VNNI; kernels_i16.c's int16 products use vpdpwssd in the last two. */
int lowbit_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return 1;
#elif defined(__AVXVNNI__)
    return 2;
#else
    return 0;
#endif
}

/* The one entry point for callers in C (layer.c): the int8 kernel for 4-bit weights from
 * int8_rows rows on (opt-in; 0: never), else the int16 kernel for M <= int_rows rows, the exact
 * float32-activation kernel otherwise (ops.kernel_for chooses the same way). */
void lowbit_gemm(const float *x, int64_t M, int64_t K, int kind, const void *qs, const float *d, const float *m,
                 int64_t N, float *y, int nthreads, int64_t int_rows, int64_t int8_rows) {
    const int act = lb_act_kernel(kind, M, int_rows, int8_rows);
    if (act == 8) gemm_i8_act(x, M, K, (const uint8_t *)qs, d, m, N, y, nthreads);
    else if (act == 16) gemm_i16_act(x, M, K, kind, qs, d, m, N, y, nthreads);
    else gemm_f32_act(x, M, K, kind, qs, d, m, N, y, nthreads);
}

/* Decode attention over the paged KV cache: attention.c (one implementation for both paths). */
