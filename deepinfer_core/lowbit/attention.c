/* Decode attention straight over the paged KV cache, for both the one-call decode step (layer.c)
 * and the torch path (attention.py): one implementation, so the two paths compute the same bits.
 *
 * One new query token per request; its keys and values are read where they lie (no gathered
 * copy of the context per layer, which at 32 requests moved more bytes than the arithmetic
 * read). Cache layout as the torch reference's::
 *
 *   cache [2, Hkv, num_blocks, bs, W]   plane 0 keys, plane 1 values; slot = block * bs + offset
 *
 * The cache holds float32, IEEE half or int8 elements (kv: vec.h's KV_F32 / KV_F16 / KV_I8). The
 * low-bit default keeps a float16 cache: at 32 requests of ~170 tokens the decode step read ~250 MB of float32 keys and values
 * per step and memory bandwidth bounded attention; half elements halve that, and F16C widens
 * 8 of them per instruction. Arithmetic stays float32 either way. The opt-in int8 cache halves the
 * bytes again: a row is head_dim int8 codes and its float32 scale right after them (a row's scale
 * is read with its codes, from the same cache lines, and a block copied whole carries its scales);
 * a key's dot product is taken over the widened codes and multiplied by the scale once, a value's
 * softmax weight is multiplied by its scale once, so the loops are those of the float paths.
 *
 * Work item = (request, KV head); its G = H / Hkv query heads share each key/value row loaded.
 * Each position's row offset is computed once for K and V; scores are float32 dot products,
 * softmax max-subtracted with exponentials 8 at a time (exp8), and the weighted sum of values
 * keeps a slice of the output in registers across all positions. Each request is computed
 * alone: the result never depends on the rest of the batch.
 *
 * Common shapes (G = 1-4, head width 64 or 128) run attend_fixed (attend_fixed512 in the AVX512 builds: the
 * same operations in 512-bit registers, the same bits), the same arithmetic with the
 * shape known at compile time so no accumulator leaves the registers. At 32 requests its time was
 * mostly the cache's bytes coming from memory on a Zen 3 (benchmarks/README.md, cpu13's section; on
 * the faster memory of a Zen 4 the arithmetic and L1 misses too: attn4's section), so while
 * an item's weighted sum runs from L1/L2 the thread fetches the keys and values of the next item
 * it will take (the memory would otherwise idle there).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

/* The new tokens' keys and values into their slots (k, v [T, Hkv, D] float32; cache as above). */
void paged_write_kv(const float *k, const float *v, void *cache, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                    int64_t width, int64_t head_dim, int64_t v_head_dim, const int64_t *slots, int64_t num_tokens, int kv) {
    const int64_t plane = num_kv_heads * num_blocks * block_size * width, esize = kv_esize(kv);
    for (int64_t t = 0; t < num_tokens; t++)
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t row = (h * num_blocks * block_size + slots[t]) * width;
            kv_store((char *)cache + row * esize, k + (t * num_kv_heads + h) * head_dim, head_dim, kv);
            kv_store((char *)cache + (row + plane) * esize, v + (t * num_kv_heads + h) * v_head_dim, v_head_dim, kv);
        }
}

/* 4 vectors' sums as one [4] vector: (sum a0, sum a1, sum a2, sum a3) */
static inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

#define GROUP_TILE 3  /* query heads of one KV head accumulated together (3 x 4 vectors in registers) */
#define PREFETCH_AHEAD 16  /* positions: rows lie in scattered blocks, which the hardware prefetcher does not follow */
#ifndef PREFETCH_AHEAD_I8
#define PREFETCH_AHEAD_I8 32  /* an int8 row is about half a float16 one's bytes: as many bytes ahead */
#endif
#define PREFETCH_PAD (PREFETCH_AHEAD > PREFETCH_AHEAD_I8 ? PREFETCH_AHEAD : PREFETCH_AHEAD_I8)  /* rows[] entries past n */

static inline __attribute__((always_inline)) void prefetch_row(const void *cache, int64_t at, int64_t n, int kv) {
    const char *p = (const char *)cache + at * kv_esize(kv);
    for (int64_t b = 0; b < kv_row_bytes(n, kv); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

#if defined(__AVX512F__)
/* vec.h's exp8 on 16 lanes: the same operations per lane, so the same bits */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#endif

/* softmax of n scores in place: max-subtracted, exponentials 8 at a time */
static inline void softmax_row(float *sc, int64_t n) {
    float mx = sc[0], total = 0.0f;
    int64_t t = 0;
    if (n >= 8) {  /* the maximum 8 lanes at a time (exact in any order) */
        __m256 vm = _mm256_loadu_ps(sc);
        for (t = 8; t + 8 <= n; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sc + t));
        mx = vec_hmax8(vm);
    }
    for (t = t > 0 ? t : 1; t < n; t++) mx = sc[t] > mx ? sc[t] : mx;
    t = 0;
    __m256 vt = _mm256_setzero_ps();
#if defined(__AVX512F__)
    for (; t + 16 <= n; t += 16) {  /* 16 exponentials per instruction sequence; the sums as 8-lane steps, in order */
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + t), _mm512_set1_ps(mx)));
        _mm512_storeu_ps(sc + t, e);
        vt = _mm256_add_ps(_mm256_add_ps(vt, _mm512_castps512_ps256(e)), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
#endif
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

/* The cache row (element offset in a plane) of each of n positions from `first`: one division per item, not per position */
static inline void item_rows(int64_t *rows, const int32_t *table, int64_t first, int64_t n, int64_t block_size, int64_t width) {
    int64_t b = first / block_size, o = first % block_size;
    for (int64_t s = 0; s < n; s++) {
        rows[s] = ((int64_t)table[b] * block_size + o) * width;
        if (++o == block_size) o = 0, b++;
    }
    for (int64_t s = n; s < n + PREFETCH_PAD; s++) rows[s] = rows[n - 1];
}

/* A thread's next item (next >= 0; none: next < 0), its keys and values fetched into L2 (T1) one
 * position per next_fetch_one call while the current item's weighted sum runs from L1/L2: into L1
 * (T0) they evicted the values being summed (an item's keys and values are 48 KB at 192 tokens of
 * width 64 in float16, L1 is 32 KB); 1.4x on a 32-request step from DRAM, Zen 4. */
typedef struct {
    const char *keys;       /* the next item's KV head in the key plane (values: + vplane bytes) */
    const int32_t *table;   /* its request's block table */
    int64_t n, b, o;        /* positions left to fetch; block index and offset of the next one */
    int64_t block_size, row_stride, row_bytes, vplane;
} next_fetch;

static inline __attribute__((always_inline)) next_fetch next_fetch_at(const void *cache, int64_t num_kv_heads, int64_t num_blocks,
                                                                      int64_t block_size, int64_t width, int64_t D,
                                                                      const int32_t *block_tables, int64_t max_blocks,
                                                                      const int64_t *positions, int64_t window, int64_t next,
                                                                      int64_t plane, int kv) {
    next_fetch f = {0};
    if (next < 0) return f;
    const int64_t r = next / num_kv_heads, last = positions[r];
    const int64_t first = window > 0 && last - window + 1 > 0 ? last - window + 1 : 0;
    f.keys = (const char *)cache + (next % num_kv_heads) * num_blocks * block_size * width * kv_esize(kv);
    f.table = block_tables + r * max_blocks;
    f.n = last - first + 1, f.b = first / block_size, f.o = first % block_size;
    f.block_size = block_size, f.row_stride = width * kv_esize(kv), f.row_bytes = kv_row_bytes(D, kv), f.vplane = plane * kv_esize(kv);
    return f;
}

static inline __attribute__((always_inline)) void next_fetch_one(next_fetch *f, int64_t t) {
    if (t >= f->n) return;
    const char *p = f->keys + ((int64_t)f->table[f->b] * f->block_size + f->o) * f->row_stride;
    for (int64_t b = 0; b < f->row_bytes; b += 64) {
        _mm_prefetch(p + b, _MM_HINT_T1);
        _mm_prefetch(p + f->vplane + b, _MM_HINT_T1);
    }
    if (++f->o == f->block_size) f->o = 0, f->b++;
}

/* A position's score with the lane sums in the order the 4-position path reduces (hsum4x8's pattern) */
static inline float hsum_as4(__m256 a) { return _mm_cvtss_f32(hsum4x8(a, a, a, a)); }

/* attend() for a compile-time group size G (<= 4) and head width D (a multiple of 8 * VJ): every
 * accumulator array has constant bounds, so the accumulators stay in the 16 vector registers (with
 * a runtime group tile they were spilled to the stack, a store-load chain on each FMA). Same
 * arithmetic in the same order as attend(), so the same bits: each position's score sums its 8
 * lanes as the generic path does at that position (hsum4x8's pattern below n / 4 * 4, vec_hsum8's
 * above), and each output column sums its positions in order. Keys and values of the position
 * PREFETCH_AHEAD further are prefetched during the scores, so the weighted sum reads L1/L2. */
#define KP(G) ((G) >= 4 ? 2 : (G) == 3 ? 3 : 4)      /* positions per score step: G x KP accumulators + KP keys + 1 query <= 16 */
#define VJ(G) ((G) >= 3 ? 2 : 4)      /* 8-wide output vectors per head in the weighted sum */
static inline __attribute__((always_inline)) void attend_fixed(const float *q, const void *cache, int64_t num_kv_heads, int64_t num_blocks,
                                                               int64_t block_size, int64_t width, const int64_t G, const int64_t D,
                                                               const int32_t *block_tables, int64_t max_blocks, const int64_t *positions,
                                                               float scale, int64_t window, float *out, int64_t item, int64_t next, int kv) {
    const int64_t plane = num_kv_heads * num_blocks * block_size * width, r = item / num_kv_heads, h = item % num_kv_heads;
    const int64_t last = positions[r], first = window > 0 && last - window + 1 > 0 ? last - window + 1 : 0;
    const int64_t n = last - first + 1, stride = n + 4, n4 = n / 4 * 4;
    float *scores = (float *)malloc((size_t)(G * stride) * sizeof(float) + (size_t)(n + PREFETCH_PAD) * sizeof(int64_t));
    int64_t *rows = (int64_t *)(scores + G * stride);
    const int64_t ahead = kv == KV_I8 ? PREFETCH_AHEAD_I8 : PREFETCH_AHEAD;
    const int64_t keys = h * num_blocks * block_size * width, values = keys + plane;
    item_rows(rows, block_tables + r * max_blocks, first, n, block_size, width);
    const float *qh = q + (r * num_kv_heads * G + h * G) * D;
    int64_t s = 0;
    for (; s + KP(G) <= n4; s += KP(G)) {
        for (int j = 0; j < KP(G); j++) {
            prefetch_row(cache, keys + rows[s + ahead + j], D, kv);
            prefetch_row(cache, values + rows[s + ahead + j], D, kv);
        }
        __m128 sc4 = _mm_set1_ps(scale);
        if (kv == KV_I8) {  /* each position's key scale (lanes past KP(G): rewritten later) */
            float ks[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int j = 0; j < KP(G); j++) ks[j] = kv_scale(cache, keys + rows[s + j], D);
            sc4 = _mm_mul_ps(sc4, _mm_loadu_ps(ks));
        }
        __m256 acc[4][4];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < KP(G); j++) acc[g][j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8) {
            __m256 k[4];
            for (int j = 0; j < KP(G); j++) k[j] = kv_load8(cache, keys + rows[s + j] + i, kv);
            for (int g = 0; g < G; g++) {
                const __m256 qv = _mm256_loadu_ps(qh + g * D + i);
                for (int j = 0; j < KP(G); j++) acc[g][j] = _mm256_fmadd_ps(qv, k[j], acc[g][j]);
            }
        }
        for (int g = 0; g < G; g++) {
            const __m256 z = _mm256_setzero_ps();
            const __m128 t = hsum4x8(acc[g][0], acc[g][1], KP(G) > 2 ? acc[g][2] : z, KP(G) > 3 ? acc[g][3] : z);
            _mm_storeu_ps(scores + g * stride + s, _mm_mul_ps(t, sc4));  /* lanes past KP(G): rewritten later */
        }
    }
    for (; s < n; s++) {
        prefetch_row(cache, values + rows[s + ahead], D, kv);
        const float sk = kv == KV_I8 ? scale * kv_scale(cache, keys + rows[s], D) : scale;
        for (int g = 0; g < G; g++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * D + i), kv_load8(cache, keys + rows[s] + i, kv), acc);
            scores[g * stride + s] = (s < n4 ? hsum_as4(acc) : vec_hsum8(acc)) * sk;
        }
    }
    for (int g = 0; g < G; g++) softmax_row(scores + g * stride, n);
    /* the weighted sum reads L1/L2 only: meanwhile the next item's keys and values come into L2, a
     * position per iteration of the first column pass (next_fetch) */
    next_fetch nf = next_fetch_at(cache, num_kv_heads, num_blocks, block_size, width, D, block_tables, max_blocks, positions, window,
                                  next, plane, kv);
    for (int64_t c0 = 0; c0 < D; c0 += 8 * VJ(G)) {
        __m256 a[4][4];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < VJ(G); j++) a[g][j] = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            if (c0 == 0) next_fetch_one(&nf, t);
            __m256 w[4];
            if (kv == KV_I8) {  /* the weight times the value row's scale */
                const float vs = kv_scale(cache, values + rows[t], D);
                for (int g = 0; g < G; g++) w[g] = _mm256_set1_ps(scores[g * stride + t] * vs);
            } else
                for (int g = 0; g < G; g++) w[g] = _mm256_set1_ps(scores[g * stride + t]);
            for (int j = 0; j < VJ(G); j++) {
                const __m256 v = kv_load8(cache, values + rows[t] + c0 + 8 * j, kv);
                for (int g = 0; g < G; g++) a[g][j] = _mm256_fmadd_ps(w[g], v, a[g][j]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int j = 0; j < VJ(G); j++) _mm256_storeu_ps(out + ((r * num_kv_heads + h) * G + g) * D + c0 + 8 * j, a[g][j]);
    }
    free(scores);
}

#if defined(__AVX512F__)
/* 16 elements of a cache row from element (byte) i, widened to float32 (no int8 scale) */
static inline __attribute__((always_inline)) __m512 kv_load16(const void *p, int64_t i, int kv) {
    if (kv == KV_I8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)p + i))));
    return kv ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))) : _mm512_loadu_ps((const float *)p + i);
}

/* 8 elements of row a (low half) and 8 of row b (high half), widened to float32 */
static inline __attribute__((always_inline)) __m512 kv_load8x2(const void *p, int64_t a, int64_t b, int kv) {
    if (kv == KV_I8) {
        const __m128i x = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)((const int8_t *)p + a)), _mm_loadl_epi64((const __m128i *)((const int8_t *)p + b)));
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x));
    }
    if (kv == KV_F16)
        return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + a))),
                                                       _mm_loadu_si128((const __m128i *)((const uint16_t *)p + b)), 1));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps((const float *)p + a))),
                                               _mm256_castps_pd(_mm256_loadu_ps((const float *)p + b)), 1));
}

static inline __m256 lo8(__m512 a) { return _mm512_castps512_ps256(a); }
static inline __m256 hi8(__m512 a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)); }

#define PAIRS(G) ((G) <= 2 ? 4 : 2)  /* position pairs per score step: 2 positions per 512-bit accumulator */
#define VZ(G, D) ((G) * (D) / 16 <= 24 ? (D) / 16 : 4)  /* 16-wide output vectors per head in one pass of the weighted sum */

/* attend_fixed with 512-bit vectors (the avx512 builds): the same operations in the same order
 * for every output, so the same bits as the 256-bit code. A score accumulator holds two positions'
 * 8 lanes (low half, high half), each lane the same chain of FMAs over the head's columns i, i + 8,
 * ... as one 256-bit accumulator; its halves go to hsum4x8 as before. The query is held twice
 * ([q | q], 16 lanes per 8 columns) so one FMA serves both positions. The weighted sum keeps up to
 * 24 16-wide output vectors in the 32 registers: one pass over the positions (two for 4 heads of
 * width 128), each column's sum taken over the positions in order as before. */
static inline __attribute__((always_inline)) void attend_fixed512(const float *q, const void *cache, int64_t num_kv_heads, int64_t num_blocks,
                                                                  int64_t block_size, int64_t width, const int64_t G, const int64_t D,
                                                                  const int32_t *block_tables, int64_t max_blocks, const int64_t *positions,
                                                                  float scale, int64_t window, float *out, int64_t item, int64_t next, int kv) {
    const int64_t plane = num_kv_heads * num_blocks * block_size * width, r = item / num_kv_heads, h = item % num_kv_heads;
    const int64_t last = positions[r], first = window > 0 && last - window + 1 > 0 ? last - window + 1 : 0;
    const int64_t n = last - first + 1, stride = n + 8, n4 = n / 4 * 4;
    float *scores = (float *)malloc((size_t)(G * stride) * sizeof(float) + (size_t)(n + PREFETCH_PAD) * sizeof(int64_t));
    int64_t *rows = (int64_t *)(scores + G * stride);
    const int64_t ahead = kv == KV_I8 ? PREFETCH_AHEAD_I8 : PREFETCH_AHEAD;
    const int64_t keys = h * num_blocks * block_size * width, values = keys + plane;
    item_rows(rows, block_tables + r * max_blocks, first, n, block_size, width);
    const float *qh = q + (r * num_kv_heads * G + h * G) * D;
    __m512 q2[4][128 / 8];  /* [q | q] per head and 8 columns */
    for (int g = 0; g < G; g++)
        for (int64_t c = 0; c < D / 8; c++) {
            const __m256 x = _mm256_loadu_ps(qh + g * D + 8 * c);
            q2[g][c] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(x)), _mm256_castps_pd(x), 1));
        }
    int64_t s = 0;
#define SCORE_STEP(P)                                                                                                               \
    for (; s + 2 * (P) <= n4; s += 2 * (P)) {                                                                                      \
        for (int j = 0; j < 2 * (P); j++) {                                                                                         \
            prefetch_row(cache, keys + rows[s + ahead + j], D, kv);                                                                 \
            prefetch_row(cache, values + rows[s + ahead + j], D, kv);                                                               \
        }                                                                                                                           \
        __m512 acc[4][P];                                                                                                           \
        for (int g = 0; g < G; g++)                                                                                                 \
            for (int j = 0; j < (P); j++) acc[g][j] = _mm512_setzero_ps();                                                          \
        for (int64_t c = 0; c < D / 8; c++) {                                                                                       \
            __m512 k[P];                                                                                                            \
            for (int j = 0; j < (P); j++) k[j] = kv_load8x2(cache, keys + rows[s + 2 * j] + 8 * c, keys + rows[s + 2 * j + 1] + 8 * c, kv); \
            for (int g = 0; g < G; g++)                                                                                             \
                for (int j = 0; j < (P); j++) acc[g][j] = _mm512_fmadd_ps(q2[g][c], k[j], acc[g][j]);                               \
        }                                                                                                                           \
        for (int j = 0; j < (P); j += 2) {                                                                                          \
            __m128 sc4 = _mm_set1_ps(scale);                                                                                        \
            if (kv == KV_I8)                                                                                                        \
                sc4 = _mm_mul_ps(sc4, _mm_setr_ps(kv_scale(cache, keys + rows[s + 2 * j], D), kv_scale(cache, keys + rows[s + 2 * j + 1], D), \
                                                  kv_scale(cache, keys + rows[s + 2 * j + 2], D), kv_scale(cache, keys + rows[s + 2 * j + 3], D))); \
            for (int g = 0; g < G; g++)                                                                                             \
                _mm_storeu_ps(scores + g * stride + s + 2 * j,                                                                      \
                              _mm_mul_ps(hsum4x8(lo8(acc[g][j]), hi8(acc[g][j]), lo8(acc[g][j + 1]), hi8(acc[g][j + 1])), sc4));    \
        }                                                                                                                           \
    }
    if (PAIRS(G) == 4) SCORE_STEP(4)
    SCORE_STEP(2)
#undef SCORE_STEP
    for (; s < n; s++) {  /* fewer than 4 positions, all at or past n4 */
        prefetch_row(cache, values + rows[s + ahead], D, kv);
        const float sk = kv == KV_I8 ? scale * kv_scale(cache, keys + rows[s], D) : scale;
        for (int g = 0; g < G; g++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * D + i), kv_load8(cache, keys + rows[s] + i, kv), acc);
            scores[g * stride + s] = vec_hsum8(acc) * sk;
        }
    }
    for (int g = 0; g < G; g++) softmax_row(scores + g * stride, n);
    /* the weighted sum reads L1/L2 only: meanwhile the next item's keys and values come into L2, a
     * position per iteration of the first column pass (next_fetch) */
    next_fetch nf = next_fetch_at(cache, num_kv_heads, num_blocks, block_size, width, D, block_tables, max_blocks, positions, window,
                                  next, plane, kv);
    for (int64_t c0 = 0; c0 < D; c0 += 16 * VZ(G, D)) {
        __m512 a[4][8];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < VZ(G, D); j++) a[g][j] = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            if (c0 == 0) next_fetch_one(&nf, t);
            __m512 w[4];
            if (kv == KV_I8) {  /* the weight times the value row's scale */
                const float vs = kv_scale(cache, values + rows[t], D);
                for (int g = 0; g < G; g++) w[g] = _mm512_set1_ps(scores[g * stride + t] * vs);
            } else
                for (int g = 0; g < G; g++) w[g] = _mm512_set1_ps(scores[g * stride + t]);
            for (int j = 0; j < VZ(G, D); j++) {
                const __m512 v = kv_load16(cache, values + rows[t] + c0 + 16 * j, kv);
                for (int g = 0; g < G; g++) a[g][j] = _mm512_fmadd_ps(w[g], v, a[g][j]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int j = 0; j < VZ(G, D); j++) _mm512_storeu_ps(out + ((r * num_kv_heads + h) * G + g) * D + c0 + 16 * j, a[g][j]);
    }
    free(scores);
}
#define ATTEND_FIXED attend_fixed512
#else
#define ATTEND_FIXED attend_fixed
#endif

static inline __attribute__((always_inline)) void attend(const float *q, const void *cache, int64_t num_kv_heads, int64_t num_blocks,
                                                         int64_t block_size, int64_t width, int64_t num_heads, int64_t head_dim,
                                                         int64_t v_head_dim, const int32_t *block_tables, int64_t max_blocks,
                                                         const int64_t *positions, float scale, int64_t window, float *out,
                                                         int64_t item, int kv) {
    const int64_t groups = num_heads / num_kv_heads, plane = num_kv_heads * num_blocks * block_size * width;
    const int64_t r = item / num_kv_heads, h = item % num_kv_heads;
    const int64_t last = positions[r], first = window > 0 && last - window + 1 > 0 ? last - window + 1 : 0;
    const int64_t n = last - first + 1;
    float *scores = (float *)malloc((size_t)(groups * n) * sizeof(float) + (size_t)(n + PREFETCH_PAD) * sizeof(int64_t));
    int64_t *rows = (int64_t *)(scores + groups * n);
    const int64_t keys = h * num_blocks * block_size * width, values = keys + plane;  /* element offsets */
    const int32_t *table = block_tables + r * max_blocks;
    item_rows(rows, table, first, n, block_size, width);
    const float *qh = q + (r * num_heads + h * groups) * head_dim;
    int64_t s = 0;
    if (head_dim % 8 == 0)  /* 4 positions at a time: each key vector widened once for every query head of the group */
        for (; s + 4 <= n; s += 4) {
            for (int j = 0; j < 4; j++) prefetch_row(cache, keys + rows[s + PREFETCH_AHEAD + j], head_dim, kv);
            __m128 sc4 = _mm_set1_ps(scale);
            if (kv == KV_I8)
                sc4 = _mm_mul_ps(sc4, _mm_setr_ps(kv_scale(cache, keys + rows[s], head_dim), kv_scale(cache, keys + rows[s + 1], head_dim),
                                                  kv_scale(cache, keys + rows[s + 2], head_dim), kv_scale(cache, keys + rows[s + 3], head_dim)));
            for (int64_t g0 = 0; g0 < groups; g0 += GROUP_TILE) {
                const int gt = (int)(groups - g0 < GROUP_TILE ? groups - g0 : GROUP_TILE);
                __m256 acc[GROUP_TILE][4];
                for (int g = 0; g < GROUP_TILE; g++)
                    for (int j = 0; j < 4; j++) acc[g][j] = _mm256_setzero_ps();
                for (int64_t i = 0; i < head_dim; i += 8) {
                    __m256 k[4];
                    for (int j = 0; j < 4; j++) k[j] = kv_load8(cache, keys + rows[s + j] + i, kv);
                    for (int g = 0; g < gt; g++) {
                        const __m256 qv = _mm256_loadu_ps(qh + (g0 + g) * head_dim + i);
                        for (int j = 0; j < 4; j++) acc[g][j] = _mm256_fmadd_ps(qv, k[j], acc[g][j]);
                    }
                }
                for (int g = 0; g < gt; g++)
                    _mm_storeu_ps(scores + (g0 + g) * n + s, _mm_mul_ps(hsum4x8(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), sc4));
            }
        }
    for (; s < n; s++) {
        const int64_t k = keys + rows[s];
        const float sk = kv == KV_I8 ? scale * kv_scale(cache, k, head_dim) : scale;
        for (int64_t g = 0; g < groups; g++) {
            const float *qg = qh + g * head_dim;
            __m256 acc = _mm256_setzero_ps();
            int64_t i = 0;
            for (; i + 8 <= head_dim; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), kv_load8(cache, k + i, kv), acc);
            float dot = vec_hsum8(acc);
            for (; i < head_dim; i++) dot += qg[i] * kv_load1(cache, k + i, kv);
            scores[g * n + s] = dot * sk;
        }
    }
    for (int64_t g = 0; g < groups; g++) softmax_row(scores + g * n, n);
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
                if (c0 == 0 && g0 == 0) prefetch_row(cache, values + rows[t + PREFETCH_AHEAD], v_head_dim, kv);
                __m256 vv[4];
                for (int j = 0; j < nv; j++) vv[j] = kv_load8(cache, v + 8 * j, kv);
                const float vs = kv == KV_I8 ? kv_scale(cache, values + rows[t], v_head_dim) : 1.0f;
                for (int g = 0; g < gt; g++) {
                    const __m256 w = _mm256_set1_ps(kv == KV_I8 ? scores[(g0 + g) * n + t] * vs : scores[(g0 + g) * n + t]);
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
            for (int64_t t = 0; t < n; t++)
                a += (kv == KV_I8 ? sc[t] * kv_scale(cache, values + rows[t], v_head_dim) : sc[t]) * kv_load1(cache, values + rows[t] + c, kv);
            out[(r * num_heads + h * groups + g) * v_head_dim + c] = a;
        }
    free(scores);
}

/* attend_fixed for one (G, D, kv) of the shapes it is instantiated for: G = 1-4 query heads per KV head, D = 64 or 128 */
#define FIXED(G, D, KV) ATTEND_FIXED(q, cache, num_kv_heads, num_blocks, block_size, width, G, D, block_tables, max_blocks, positions, \
                                     scale, window, out, item, next, KV)
#define FIXED_CASES(G) \
    case 6 * (G) - 6: FIXED(G, 64, KV_F32); break; case 6 * (G) - 5: FIXED(G, 64, KV_F16); break; \
    case 6 * (G) - 4: FIXED(G, 64, KV_I8); break; case 6 * (G) - 3: FIXED(G, 128, KV_F32); break; \
    case 6 * (G) - 2: FIXED(G, 128, KV_F16); break; case 6 * (G) - 1: FIXED(G, 128, KV_I8); break;

void paged_decode_attention(const float *q, const void *cache, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                            int64_t width, int64_t num_heads, int64_t head_dim, int64_t v_head_dim,
                            const int32_t *block_tables, int64_t max_blocks, const int64_t *positions, int64_t num_requests,
                            float scale, int64_t window, float *out, int nthreads, int kv) {
    const int64_t G = num_heads / num_kv_heads;
    const int fixed = G >= 1 && G <= 4 && G * num_kv_heads == num_heads && head_dim == v_head_dim && (head_dim == 64 || head_dim == 128);
    const int shape = fixed ? (int)(6 * G - 6 + 3 * (head_dim == 128) + kv) : -1;
    const int64_t items = num_requests * num_kv_heads;
    int64_t claimed = 0;  /* items handed out so far: a thread claims its next item before it computes this one */
#pragma omp parallel num_threads(nthreads)
    for (int64_t item = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED), claim; item < items; item = claim) {
        claim = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        const int64_t next = claim < items ? claim : -1;  /* warmed during this item's weighted sum */
        switch (shape) {
            FIXED_CASES(1) FIXED_CASES(2) FIXED_CASES(3) FIXED_CASES(4)
            default:
                if (kv == KV_I8)
                    attend(q, cache, num_kv_heads, num_blocks, block_size, width, num_heads, head_dim, v_head_dim, block_tables,
                           max_blocks, positions, scale, window, out, item, KV_I8);
                else if (kv == KV_F16)
                    attend(q, cache, num_kv_heads, num_blocks, block_size, width, num_heads, head_dim, v_head_dim, block_tables,
                           max_blocks, positions, scale, window, out, item, KV_F16);
                else
                    attend(q, cache, num_kv_heads, num_blocks, block_size, width, num_heads, head_dim, v_head_dim, block_tables,
                           max_blocks, positions, scale, window, out, item, KV_F32);
        }
    }
}
