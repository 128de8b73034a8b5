/* Decode attention straight over the paged KV cache, for both the one-call decode step (layer.c)
 * and the torch path (attention.py): one implementation, so the two paths compute the same bits.
 *
 * One new query token per request; its keys and values are read where they lie (no gathered
 * copy of the context per layer, which at 32 requests moved more bytes than the arithmetic
 * read). Cache layout as the torch reference's::
 *
 *   cache [2, Hkv, num_blocks, bs, W]   plane 0 keys, plane 1 values; slot = block * bs + offset
 *
 * The cache holds float32 or IEEE half elements (f16 != 0). The low-bit default keeps a float16
 * cache: at 32 requests of ~170 tokens the decode step read ~250 MB of float32 keys and values
 * per step and memory bandwidth bounded attention; half elements halve that, and F16C widens
 * 8 of them per instruction. Arithmetic stays float32 either way.
 *
 * Work item = (request, KV head); its G = H / Hkv query heads share each key/value row loaded.
 * Each position's row offset is computed once for K and V; scores are float32 dot products,
 * softmax max-subtracted with exponentials 8 at a time (exp8), and the weighted sum of values
 * keeps a 64-wide slice of the output in registers across all positions. Each request is
 * computed alone: the result never depends on the rest of the batch.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

/* The new tokens' keys and values into their slots (k, v [T, Hkv, D] float32; cache as above). */
void paged_write_kv(const float *k, const float *v, void *cache, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                    int64_t width, int64_t head_dim, int64_t v_head_dim, const int64_t *slots, int64_t num_tokens, int f16) {
    const int64_t plane = num_kv_heads * num_blocks * block_size * width, esize = f16 ? 2 : 4;
    for (int64_t t = 0; t < num_tokens; t++)
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t row = (h * num_blocks * block_size + slots[t]) * width;
            kv_store((char *)cache + row * esize, k + (t * num_kv_heads + h) * head_dim, head_dim, f16);
            kv_store((char *)cache + (row + plane) * esize, v + (t * num_kv_heads + h) * v_head_dim, v_head_dim, f16);
        }
}

/* 4 vectors' sums as one [4] vector: (sum a0, sum a1, sum a2, sum a3) */
static inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

#define GROUP_TILE 3  /* query heads of one KV head accumulated together (3 x 4 vectors in registers) */
#define PREFETCH_AHEAD 16  /* positions: rows lie in scattered blocks, which the hardware prefetcher does not follow */

static inline __attribute__((always_inline)) void prefetch_row(const void *cache, int64_t at, int64_t n, int f16) {
    const char *p = (const char *)cache + at * (f16 ? 2 : 4);
    for (int64_t b = 0; b < n * (f16 ? 2 : 4); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

static inline __attribute__((always_inline)) void attend(const float *q, const void *cache, int64_t num_kv_heads, int64_t num_blocks,
                                                         int64_t block_size, int64_t width, int64_t num_heads, int64_t head_dim,
                                                         int64_t v_head_dim, const int32_t *block_tables, int64_t max_blocks,
                                                         const int64_t *positions, float scale, int64_t window, float *out,
                                                         int64_t item, int f16) {
    const int64_t groups = num_heads / num_kv_heads, plane = num_kv_heads * num_blocks * block_size * width;
    const int64_t r = item / num_kv_heads, h = item % num_kv_heads;
    const int64_t last = positions[r], first = window > 0 && last - window + 1 > 0 ? last - window + 1 : 0;
    const int64_t n = last - first + 1;
    float *scores = (float *)malloc((size_t)(groups * n) * sizeof(float) + (size_t)(n + PREFETCH_AHEAD) * sizeof(int64_t));
    int64_t *rows = (int64_t *)(scores + groups * n);
    const int64_t keys = h * num_blocks * block_size * width, values = keys + plane;  /* element offsets */
    const int32_t *table = block_tables + r * max_blocks;
    for (int64_t s = 0; s < n; s++) {
        const int64_t p = first + s;
        rows[s] = ((int64_t)table[p / block_size] * block_size + p % block_size) * width;
    }
    for (int64_t s = n; s < n + PREFETCH_AHEAD; s++) rows[s] = rows[n - 1];
    const float *qh = q + (r * num_heads + h * groups) * head_dim;
    int64_t s = 0;
    if (head_dim % 8 == 0)  /* 4 positions at a time: each key vector widened once for every query head of the group */
        for (; s + 4 <= n; s += 4) {
            for (int j = 0; j < 4; j++) prefetch_row(cache, keys + rows[s + PREFETCH_AHEAD + j], head_dim, f16);
            for (int64_t g0 = 0; g0 < groups; g0 += GROUP_TILE) {
                const int gt = (int)(groups - g0 < GROUP_TILE ? groups - g0 : GROUP_TILE);
                __m256 acc[GROUP_TILE][4];
                for (int g = 0; g < GROUP_TILE; g++)
                    for (int j = 0; j < 4; j++) acc[g][j] = _mm256_setzero_ps();
                for (int64_t i = 0; i < head_dim; i += 8) {
                    __m256 k[4];
                    for (int j = 0; j < 4; j++) k[j] = kv_load8(cache, keys + rows[s + j] + i, f16);
                    for (int g = 0; g < gt; g++) {
                        const __m256 qv = _mm256_loadu_ps(qh + (g0 + g) * head_dim + i);
                        for (int j = 0; j < 4; j++) acc[g][j] = _mm256_fmadd_ps(qv, k[j], acc[g][j]);
                    }
                }
                for (int g = 0; g < gt; g++)
                    _mm_storeu_ps(scores + (g0 + g) * n + s, _mm_mul_ps(hsum4x8(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), _mm_set1_ps(scale)));
            }
        }
    for (; s < n; s++) {
        const int64_t k = keys + rows[s];
        for (int64_t g = 0; g < groups; g++) {
            const float *qg = qh + g * head_dim;
            __m256 acc = _mm256_setzero_ps();
            int64_t i = 0;
            for (; i + 8 <= head_dim; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), kv_load8(cache, k + i, f16), acc);
            float dot = vec_hsum8(acc);
            for (; i < head_dim; i++) dot += qg[i] * kv_load1(cache, k + i, f16);
            scores[g * n + s] = dot * scale;
        }
    }
    for (int64_t g = 0; g < groups; g++) {  /* softmax of each query head's scores, in place */
        float *sc = scores + g * n, mx = sc[0], total = 0.0f;
        for (int64_t t = 1; t < n; t++) mx = sc[t] > mx ? sc[t] : mx;
        int64_t t = 0;
        __m256 vt = _mm256_setzero_ps();
        for (; t + 8 <= n; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), _mm256_set1_ps(mx)));
            _mm256_storeu_ps(sc + t, e);
            vt = _mm256_add_ps(vt, e);
        }
        float part[8];
        _mm256_storeu_ps(part, vt);
        for (int j = 0; j < 8; j++) total += part[j];
        for (; t < n; t++) { sc[t] = expf(sc[t] - mx); total += sc[t]; }
        const float inv = 1.0f / total;
        for (t = 0; t < n; t++) sc[t] *= inv;
    }
    /* weighted sum of values: 32 output columns of up to GROUP_TILE query heads in registers across
     * all positions, so each value vector is widened once for all heads of the tile */
    const int64_t vec_end = v_head_dim / 8 * 8;
    for (int64_t g0 = 0; g0 < groups; g0 += GROUP_TILE) {
        const int gt = (int)(groups - g0 < GROUP_TILE ? groups - g0 : GROUP_TILE);
        for (int64_t c0 = 0; c0 < vec_end; c0 += 32) {
            const int nv = (int)((vec_end - c0) / 8 < 4 ? (vec_end - c0) / 8 : 4);
            __m256 a[GROUP_TILE][4];
            for (int g = 0; g < GROUP_TILE; g++)
                for (int j = 0; j < 4; j++) a[g][j] = _mm256_setzero_ps();
            for (int64_t t = 0; t < n; t++) {
                const int64_t v = values + rows[t] + c0;
                if (c0 == 0 && g0 == 0) prefetch_row(cache, values + rows[t + PREFETCH_AHEAD], v_head_dim, f16);
                __m256 vv[4];
                for (int j = 0; j < nv; j++) vv[j] = kv_load8(cache, v + 8 * j, f16);
                for (int g = 0; g < gt; g++) {
                    const __m256 w = _mm256_set1_ps(scores[(g0 + g) * n + t]);
                    for (int j = 0; j < nv; j++) a[g][j] = _mm256_fmadd_ps(w, vv[j], a[g][j]);
                }
            }
            for (int g = 0; g < gt; g++)
                for (int j = 0; j < nv; j++) _mm256_storeu_ps(out + (r * num_heads + h * groups + g0 + g) * v_head_dim + c0 + 8 * j, a[g][j]);
        }
    }
    for (int64_t g = 0; g < groups; g++)  /* a width not a multiple of 8: the rest one by one */
        for (int64_t c = vec_end; c < v_head_dim; c++) {
            const float *sc = scores + g * n;
            float a = 0.0f;
            for (int64_t t = 0; t < n; t++) a += sc[t] * kv_load1(cache, values + rows[t] + c, f16);
            out[(r * num_heads + h * groups + g) * v_head_dim + c] = a;
        }
    free(scores);
}

void paged_decode_attention(const float *q, const void *cache, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                            int64_t width, int64_t num_heads, int64_t head_dim, int64_t v_head_dim,
                            const int32_t *block_tables, int64_t max_blocks, const int64_t *positions, int64_t num_requests,
                            float scale, int64_t window, float *out, int nthreads, int f16) {
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t item = 0; item < num_requests * num_kv_heads; item++) {
        if (f16)
            attend(q, cache, num_kv_heads, num_blocks, block_size, width, num_heads, head_dim, v_head_dim, block_tables, max_blocks,
                   positions, scale, window, out, item, 1);
        else
            attend(q, cache, num_kv_heads, num_blocks, block_size, width, num_heads, head_dim, v_head_dim, block_tables, max_blocks,
                   positions, scale, window, out, item, 0);
    }
}
