/* Low-bit weight GEMMs for x86 CPUs with AVX2 + FMA.
 *
 * Weights stay in blocks of 32 along K, one scale (and for 4 bits one offset) per block:
 *
 *   q4: w = d * q + m,  q in 0..15, two per byte (element j low nibble, j+16 high nibble)
 *   q8: w = d * q,      q in -128..127
 *
 * Each weight block is widened to float in registers once and multiplied with up to
 * FLOAT_TILE rows of float32 activations, so memory traffic is the packed weights (4-8x less
 * than float32) and the arithmetic is float32's: activations are never rounded. (Rounding them
 * to int8 per 32-block, llama.cpp's way, changed SmolLM2's greedy outputs on 15 of 16 prompts
 * against the same weights in float32; two int8 digits fixed that but cost more than this.)
 * Every output element is one fixed sequence of FMAs whatever M is: batch invariant.
 *
 * Compiled at first use by deepinfer_core.lowbit.native with the system C compiler and linked
 * against the OpenMP runtime torch already loaded, so its threads are torch's threads.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define QK 32

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

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

void gemm_f32_act(const float *x, int64_t M, int64_t K, int kind, const void *qs, const float *d, const float *m,
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
            for (int t = 0; t < tm; t++) y[(i0 + t) * N + n] = hsum8(acc[t]);
        }
    }
}
