/* Low-bit weight GEMMs for x86 CPUs with AVX2 + FMA (llama.cpp's arithmetic, written anew).
 *
 * Weights are stored in blocks of 32 along K, one scale per block (and one offset for the
 * 4-bit format); activations are quantized per row and per 32-block to int8 with their own
 * scale, so every block's dot product is an exact integer sum, then scaled in float:
 *
 *   q4: w = d * q + m,  q in 0..15, two per byte (element j low nibble, j+16 high nibble)
 *   q8: w = d * q,      q in -128..127
 *   y[i, n] = sum_b  d[n,b] * dx[i,b] * isum_b(q_w, q_x)  (+ m[n,b] * sum_b(x))
 *
 * Compiled at first use by deepinfer_core.lowbit.native with the system C compiler, and
 * linked against the process's OpenMP runtime (the one torch already loaded), so its threads
 * are torch's threads.
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

/* x [M, K] float -> qx [M, K] int8, dx [M, K/32] (scale), sx [M, K/32] (exact float sum). */
void quantize_rows(const float *x, int64_t M, int64_t K, int8_t *qx, float *dx, float *sx, int nthreads) {
    const int64_t nb = K / QK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K > 65536)
    for (int64_t i = 0; i < M * nb; i++) {
        const float *xb = x + i * QK;
        __m256 amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int j = 0; j < QK; j += 8) {
            __m256 v = _mm256_loadu_ps(xb + j);
            sum = _mm256_add_ps(sum, v);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float a = _mm_cvtss_f32(m4);
        const float d = a / 127.0f;
        const float id = a > 0.0f ? 127.0f / a : 0.0f;
        dx[i] = d;
        sx[i] = hsum8(sum);
        const __m256 mul = _mm256_set1_ps(id);
        __m256i q[4];
        for (int j = 0; j < 4; j++)
            q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * j), mul),
                                                      _MM_ROUND_NEAREST | _MM_FROUND_NO_EXC));
        __m256i p01 = _mm256_packs_epi32(q[0], q[1]), p23 = _mm256_packs_epi32(q[2], q[3]);
        __m256i p = _mm256_packs_epi16(p01, p23);
        /* pack works per 128-bit lane: restore element order */
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(qx + i * QK), p);
    }
}

static inline __m256i unpack_q4(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
    return _mm256_set_m128i(hi, lo);
}

#define TILE_M 4

/* y [M, N] = x @ W^T for 4-bit weights qs [N, K/32, 16], d, m [N, K/32]. */
void gemm_q4(const int8_t *qx, const float *dx, const float *sx, int64_t M, int64_t K,
             const uint8_t *qs, const float *d, const float *m, int64_t N, float *y, int nthreads) {
    const int64_t nb = K / QK;
    const __m256i ones = _mm256_set1_epi16(1);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wq = qs + n * nb * (QK / 2);
        const float *wd = d + n * nb, *wm = m + n * nb;
        for (int64_t i0 = 0; i0 < M; i0 += TILE_M) {
            const int tm = (int)(M - i0 < TILE_M ? M - i0 : TILE_M);
            __m256 acc[TILE_M];
            float off[TILE_M];
            for (int t = 0; t < TILE_M; t++) { acc[t] = _mm256_setzero_ps(); off[t] = 0.0f; }
            for (int64_t b = 0; b < nb; b++) {
                const __m256i w = unpack_q4(wq + b * (QK / 2));
                for (int t = 0; t < tm; t++) {
                    const int64_t row = (i0 + t) * nb + b;
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(qx + row * QK));
                    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(wd[b] * dx[row]), acc[t]);
                    off[t] += wm[b] * sx[row];
                }
            }
            for (int t = 0; t < tm; t++) y[(i0 + t) * N + n] = hsum8(acc[t]) + off[t];
        }
    }
}

/* y [M, N] = x @ W^T for 8-bit weights qs [N, K/32, 32], d [N, K/32]. */
void gemm_q8(const int8_t *qx, const float *dx, int64_t M, int64_t K,
             const int8_t *qs, const float *d, int64_t N, float *y, int nthreads) {
    const int64_t nb = K / QK;
    const __m256i ones = _mm256_set1_epi16(1);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wq = qs + n * nb * QK;
        const float *wd = d + n * nb;
        for (int64_t i0 = 0; i0 < M; i0 += TILE_M) {
            const int tm = (int)(M - i0 < TILE_M ? M - i0 : TILE_M);
            __m256 acc[TILE_M];
            for (int t = 0; t < TILE_M; t++) acc[t] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(wq + b * QK));
                const __m256i aw = _mm256_sign_epi8(w, w);
                for (int t = 0; t < tm; t++) {
                    const int64_t row = (i0 + t) * nb + b;
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(qx + row * QK));
                    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), ones);
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(wd[b] * dx[row]), acc[t]);
                }
            }
            for (int t = 0; t < tm; t++) y[(i0 + t) * N + n] = hsum8(acc[t]);
        }
    }
}
