/* Low-bit weight GEMMs for x86 CPUs with AVX2 + FMA.
 *
 * Weights stay in blocks of 32 along K, one scale (and for 4 bits one offset) per block:
 *
 *   q4: w = d * q + m,  q in 0..15, two per byte (element j low nibble, j+16 high nibble)
 *   q8: w = d * q,      q in -128..127
 *
 * One token: each weight block is widened to float in registers and used at once. Several
 * tokens: a few weight rows are widened once into a small float panel and a register-blocked
 * micro-kernel runs them against every token (gemm_panel). Either way memory traffic is the
 * packed weights (4-8x less than float32) and the arithmetic is float32's: activations are
 * never rounded. (Rounding them
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
#include <stdlib.h>

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
            for (int t = 0; t < tm; t++) y[(i0 + t) * N + n] = hsum8(acc[t]);
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
#pragma omp parallel num_threads(nthreads)
    {
        float *panel = (float *)aligned_alloc(32, (size_t)(PANEL_ROWS * K) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t n0 = tile * PANEL_ROWS;
            const int nr = (int)(N - n0 < PANEL_ROWS ? N - n0 : PANEL_ROWS);
            for (int r = 0; r < PANEL_ROWS; r++)  /* a short last tile repeats its first row */
                widen_row(kind, qs, d, m, n0 + (r < nr ? r : 0), nb, panel + r * K);
            const float *w0 = panel, *w1 = panel + K, *w2 = panel + 2 * K, *w3 = panel + 3 * K;
            int64_t i0 = 0;
            for (; i0 + MICRO_TOKENS <= M; i0 += MICRO_TOKENS) {
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
                    for (int t = 0; t < MICRO_TOKENS; t++) y[(i0 + t) * N + n0 + r] = hsum8(acc[r][t]);
            }
            for (; i0 < M; i0++) {  /* the last M % 3 tokens, one at a time */
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
                for (int r = 0; r < nr; r++) y[i0 * N + n0 + r] = hsum8(acc[r]);
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

/* Decode attention straight over the paged KV cache: one new query token per request, its keys
 * and values read where they lie (no gathered copy of the context per layer, which at 32
 * requests moved more bytes than the arithmetic read). Cache layout as the torch reference's::
 *
 *   cache [2, Hkv, num_blocks, bs, W]   plane 0 keys, plane 1 values; slot = block * bs + offset
 *
 * Work item = (request, KV head); its G = H / Hkv query heads share each key/value row loaded.
 * Scores and softmax in float32 (max-subtracted, expf), then the weighted sum of values. Each
 * request is computed alone: the result never depends on the rest of the batch. */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy_f32(float alpha, const float *x, float *y, int64_t n) {
    const __m256 va = _mm256_set1_ps(alpha);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += alpha * x[i];
}

/* The new tokens' keys and values into their slots first (k, v [R, Hkv, D]; cache as below). */
void paged_write_kv(const float *k, const float *v, float *cache, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                    int64_t width, int64_t head_dim, int64_t v_head_dim, const int64_t *slots, int64_t num_tokens) {
    const int64_t plane = num_kv_heads * num_blocks * block_size * width;
    for (int64_t t = 0; t < num_tokens; t++)
        for (int64_t h = 0; h < num_kv_heads; h++) {
            float *row = cache + (h * num_blocks * block_size + slots[t]) * width;
            for (int64_t c = 0; c < head_dim; c++) row[c] = k[(t * num_kv_heads + h) * head_dim + c];
            for (int64_t c = 0; c < v_head_dim; c++) row[plane + c] = v[(t * num_kv_heads + h) * v_head_dim + c];
        }
}

void paged_decode_attention(const float *q, const float *cache, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                            int64_t width, int64_t num_heads, int64_t head_dim, int64_t v_head_dim,
                            const int32_t *block_tables, int64_t max_blocks, const int64_t *positions, int64_t num_requests,
                            float scale, int64_t window, float *out, int nthreads) {
    const int64_t groups = num_heads / num_kv_heads, plane = num_kv_heads * num_blocks * block_size * width;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t item = 0; item < num_requests * num_kv_heads; item++) {
        const int64_t r = item / num_kv_heads, h = item % num_kv_heads;
        const int64_t last = positions[r], first = window > 0 && last - window + 1 > 0 ? last - window + 1 : 0;
        const int64_t n = last - first + 1;
        float *scores = (float *)malloc((size_t)(groups * n) * sizeof(float));
        const float *keys = cache + h * num_blocks * block_size * width;
        const float *values = keys + plane;
        const int32_t *table = block_tables + r * max_blocks;
        for (int64_t s = 0; s < n; s++) {
            const int64_t p = first + s;
            const float *k = keys + ((int64_t)table[p / block_size] * block_size + p % block_size) * width;
            for (int64_t g = 0; g < groups; g++)
                scores[g * n + s] = dot_f32(q + (r * num_heads + h * groups + g) * head_dim, k, head_dim) * scale;
        }
        for (int64_t g = 0; g < groups; g++) {
            float *sc = scores + g * n, mx = sc[0], total = 0.0f;
            for (int64_t s = 1; s < n; s++) mx = sc[s] > mx ? sc[s] : mx;
            for (int64_t s = 0; s < n; s++) { sc[s] = expf(sc[s] - mx); total += sc[s]; }
            const float inv = 1.0f / total;
            for (int64_t s = 0; s < n; s++) sc[s] *= inv;
            float *o = out + (r * num_heads + h * groups + g) * v_head_dim;
            for (int64_t c = 0; c < v_head_dim; c++) o[c] = 0.0f;
        }
        for (int64_t s = 0; s < n; s++) {
            const int64_t p = first + s;
            const float *v = values + ((int64_t)table[p / block_size] * block_size + p % block_size) * width;
            for (int64_t g = 0; g < groups; g++)
                axpy_f32(scores[g * n + s], v, out + (r * num_heads + h * groups + g) * v_head_dim, v_head_dim);
        }
        free(scores);
    }
}
