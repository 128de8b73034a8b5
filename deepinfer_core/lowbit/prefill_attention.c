/* Causal attention for the prompt rows of a native prefill call (layer.c), a prompt at a time.
 *
 * Why not the decode kernel (attention.c): there a prompt of n tokens is n independent one-token
 * queries, each reading (and widening from half) every earlier key and value of its request
 * again, and reducing each score horizontally: ~13 GFLOP/s a thread at 128-token prompts. Here
 * the rows of one request in the call (a "run": consecutive positions, the same block table)
 * are taken QROWS at a time per KV head: the keys and values they see are gathered once into
 * float32 tiles (keys transposed), and scores and the weighted sum are small register-tiled
 * matrix products (3 query vectors x 32 positions or 32 columns), no horizontal sums.
 *
 * Where the keys and values come from (`mode`):
 *   PA_CACHE: all from the cache (float32, half, or int8 codes times their row's scale), as the
 *             decode kernel reads them;
 *   PA_CALL:  positions written by this call from the caller's float32 rows as computed, earlier
 *             positions (previous chunks, a prefix-cache hit) from the cache. With a half cache
 *             a prompt's queries then see its keys and values unrounded, as the float32 model
 *             does (they are rounded once, into the cache, for the steps after).
 * Each query's softmax runs over its own positions only (causal, and the sliding window when
 * there is one); a row's result depends on its run's rows in the call (which of its keys are
 * float32) but on no other request.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define QROWS 16  /* query rows (tokens of one run) per work item */
#define PA_CACHE 1
#define PA_CALL 2

/* Row r continues row r - 1's run: the next position of the same block table. */
static int continues(const int64_t *positions, const int32_t *tables, int64_t max_blocks, int64_t r) {
    return r > 0 && positions[r] == positions[r - 1] + 1 &&
           memcmp(tables + r * max_blocks, tables + (r - 1) * max_blocks, (size_t)max_blocks * sizeof(int32_t)) == 0;
}

/* Whether any request has more than one row in the call (else the decode kernel is the same work). */
int64_t prefill_has_runs(const int64_t *positions, const int32_t *tables, int64_t max_blocks, int64_t R) {
    for (int64_t r = 1; r < R; r++)
        if (continues(positions, tables, max_blocks, r)) return 1;
    return 0;
}

/* acc[j][v] = scale * sum_d q_j[d] * KT[d][t0 + 8v ..] for JN query vectors, TV vectors of positions */
static inline __attribute__((always_inline)) void score_tile(const float *const *qv, const int JN, const float *KT, int64_t npad,
                                                            int64_t t0, const int TV, int64_t hd, float scale, float *S, int64_t j0) {
    __m256 acc[3][4];
    for (int j = 0; j < JN; j++)
        for (int v = 0; v < TV; v++) acc[j][v] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d++) {
        __m256 kt[4];
        for (int v = 0; v < TV; v++) kt[v] = _mm256_loadu_ps(KT + d * npad + t0 + 8 * v);
        for (int j = 0; j < JN; j++) {
            const __m256 b = _mm256_broadcast_ss(qv[j] + d);
            for (int v = 0; v < TV; v++) acc[j][v] = _mm256_fmadd_ps(b, kt[v], acc[j][v]);
        }
    }
    const __m256 sc = _mm256_set1_ps(scale);
    for (int j = 0; j < JN; j++)
        for (int v = 0; v < TV; v++) _mm256_storeu_ps(S + (j0 + j) * npad + t0 + 8 * v, _mm256_mul_ps(acc[j][v], sc));
}

/* out_j[c0 .. c0 + 32) = sum_t P[j][t] * V[t][c0 ..] over t in [lo, hi] for JN query vectors */
static inline __attribute__((always_inline)) void value_tile(const float *S, int64_t npad, int64_t j0, const int JN, const float *Vb,
                                                            int64_t hd, int64_t c0, int64_t lo, int64_t hi, float *const *outs) {
    __m256 acc[3][4];
    for (int j = 0; j < JN; j++)
        for (int v = 0; v < 4; v++) acc[j][v] = _mm256_setzero_ps();
    for (int64_t t = lo; t <= hi; t++) {
        __m256 vv[4];
        for (int v = 0; v < 4; v++) vv[v] = _mm256_loadu_ps(Vb + t * hd + c0 + 8 * v);
        for (int j = 0; j < JN; j++) {
            const __m256 w = _mm256_broadcast_ss(S + (j0 + j) * npad + t);
            for (int v = 0; v < 4; v++) acc[j][v] = _mm256_fmadd_ps(w, vv[v], acc[j][v]);
        }
    }
    for (int j = 0; j < JN; j++)
        for (int v = 0; v < 4; v++) _mm256_storeu_ps(outs[j] + c0 + 8 * v, acc[j][v]);
}

typedef struct {
    const float *q, *k, *v;  /* q [R, H, hd]; k, v: row r's head h at k + r * kstride + h * hd */
    int64_t kstride, vstride;
    const void *cache;
    int64_t Hkv, num_blocks, block_size, width, H, hd;
    const int32_t *tables;
    int64_t max_blocks;
    const int64_t *positions;
    float scale;
    int64_t window;
    float *out;
    int kv, mode;
} pa_args;

/* One work item: rows r0..r1 of the run starting at row a, KV head h. */
static inline __attribute__((always_inline)) void attend_rows(const pa_args *A, int64_t a, int64_t r0, int64_t r1, int64_t h, int kv) {
    const int64_t hd = A->hd, G = A->H / A->Hkv, nq = (r1 - r0) * G;
    const int64_t p0 = A->positions[a], plast = A->positions[r1 - 1];
    const int64_t klo = A->window > 0 && A->positions[r0] - A->window + 1 > 0 ? A->positions[r0] - A->window + 1 : 0;
    const int64_t n = plast - klo + 1, npad = (n + 7) / 8 * 8;
    float *Kr = (float *)malloc((size_t)(3 * npad * hd + nq * npad) * sizeof(float) + (size_t)nq * 2 * sizeof(void *));
    float *KT = Kr + npad * hd, *Vb = KT + npad * hd, *S = Vb + npad * hd;
    const float **qv = (const float **)(S + nq * npad);
    float **outs = (float **)(qv + nq);
    const int64_t plane = A->Hkv * A->num_blocks * A->block_size * A->width, keys = h * A->num_blocks * A->block_size * A->width;
    const int32_t *table = A->tables + a * A->max_blocks;
    for (int64_t t = 0; t < n; t++) {  /* float32 rows of the positions klo..plast */
        const int64_t p = klo + t;
        if (A->mode == PA_CALL && p >= p0) {
            memcpy(Kr + t * hd, A->k + (a + p - p0) * A->kstride + h * hd, (size_t)hd * sizeof(float));
            memcpy(Vb + t * hd, A->v + (a + p - p0) * A->vstride + h * hd, (size_t)hd * sizeof(float));
        } else {
            const int64_t at = keys + ((int64_t)table[p / A->block_size] * A->block_size + p % A->block_size) * A->width;
            if (kv == KV_I8) {  /* codes times the row's scale: the float32 values the decode kernel attends over */
                const __m256 ks = _mm256_set1_ps(kv_scale(A->cache, at, hd)), vs = _mm256_set1_ps(kv_scale(A->cache, at + plane, hd));
                for (int64_t i = 0; i < hd; i += 8) {
                    _mm256_storeu_ps(Kr + t * hd + i, _mm256_mul_ps(kv_load8(A->cache, at + i, kv), ks));
                    _mm256_storeu_ps(Vb + t * hd + i, _mm256_mul_ps(kv_load8(A->cache, at + plane + i, kv), vs));
                }
            } else
                for (int64_t i = 0; i < hd; i += 8) {
                    _mm256_storeu_ps(Kr + t * hd + i, kv_load8(A->cache, at + i, kv));
                    _mm256_storeu_ps(Vb + t * hd + i, kv_load8(A->cache, at + plane + i, kv));
                }
        }
    }
    memset(Kr + n * hd, 0, (size_t)((npad - n) * hd) * sizeof(float));
    memset(Vb + n * hd, 0, (size_t)((npad - n) * hd) * sizeof(float));
    for (int64_t t = 0; t < npad; t += 8)  /* KT [hd][npad]: 8 x 8 transposes */
        for (int64_t i = 0; i < hd; i += 8) {
            __m256i r[8];
            for (int j = 0; j < 8; j++) r[j] = _mm256_castps_si256(_mm256_loadu_ps(Kr + (t + j) * hd + i));
            transpose8_epi32(r);
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(KT + (i + j) * npad + t, _mm256_castsi256_ps(r[j]));
        }
    for (int64_t j = 0; j < nq; j++) {
        const int64_t row = r0 + j / G, head = h * G + j % G;
        qv[j] = A->q + (row * A->H + head) * hd;
        outs[j] = A->out + (row * A->H + head) * hd;
    }
    for (int64_t j0 = 0; j0 < nq; j0 += 3) {
        const int jn = (int)(nq - j0 < 3 ? nq - j0 : 3);
        int64_t lo[3], hi[3], ulo = npad, uhi = 0;
        for (int j = 0; j < jn; j++) {  /* query j sees t in [lo, hi] */
            const int64_t pos = A->positions[r0 + (j0 + j) / G];
            hi[j] = pos - klo;
            lo[j] = A->window > 0 && pos - A->window + 1 - klo > 0 ? pos - A->window + 1 - klo : 0;
            ulo = lo[j] < ulo ? lo[j] : ulo;
            uhi = hi[j] > uhi ? hi[j] : uhi;
        }
        int64_t t0 = ulo / 8 * 8;
        for (; t0 + 32 <= uhi + 1; t0 += 32) {
            if (jn == 3) score_tile(qv + j0, 3, KT, npad, t0, 4, hd, A->scale, S, j0);
            else if (jn == 2) score_tile(qv + j0, 2, KT, npad, t0, 4, hd, A->scale, S, j0);
            else score_tile(qv + j0, 1, KT, npad, t0, 4, hd, A->scale, S, j0);
        }
        for (; t0 <= uhi; t0 += 8) {
            if (jn == 3) score_tile(qv + j0, 3, KT, npad, t0, 1, hd, A->scale, S, j0);
            else if (jn == 2) score_tile(qv + j0, 2, KT, npad, t0, 1, hd, A->scale, S, j0);
            else score_tile(qv + j0, 1, KT, npad, t0, 1, hd, A->scale, S, j0);
        }
        for (int j = 0; j < jn; j++) {  /* softmax over [lo, hi], zero elsewhere in [ulo, uhi] */
            float *sc = S + (j0 + j) * npad, mx = sc[lo[j]], total = 0.0f;
            for (int64_t t = lo[j] + 1; t <= hi[j]; t++) mx = sc[t] > mx ? sc[t] : mx;
            int64_t t = lo[j];
            __m256 vt = _mm256_setzero_ps();
            for (; t + 8 <= hi[j] + 1; t += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), _mm256_set1_ps(mx)));
                _mm256_storeu_ps(sc + t, e);
                vt = _mm256_add_ps(vt, e);
            }
            float part[8];
            _mm256_storeu_ps(part, vt);
            for (int i = 0; i < 8; i++) total += part[i];
            for (; t <= hi[j]; t++) { sc[t] = expf(sc[t] - mx); total += sc[t]; }
            const float inv = 1.0f / total;
            for (t = lo[j]; t <= hi[j]; t++) sc[t] *= inv;
            for (t = ulo; t < lo[j]; t++) sc[t] = 0.0f;
            for (t = hi[j] + 1; t <= uhi; t++) sc[t] = 0.0f;
        }
        for (int64_t c0 = 0; c0 < hd; c0 += 32) {
            if (jn == 3) value_tile(S, npad, j0, 3, Vb, hd, c0, ulo, uhi, outs + j0);
            else if (jn == 2) value_tile(S, npad, j0, 2, Vb, hd, c0, ulo, uhi, outs + j0);
            else value_tile(S, npad, j0, 1, Vb, hd, c0, ulo, uhi, outs + j0);
        }
    }
    free(Kr);
}

/* Attention of every row of a prefill call (rows in token order; keys and values of the call's
 * rows already in the cache). k, v: the rows' rotated keys and values in float32 (row r, KV head
 * h at k + r * kstride + h * hd); head_dim a multiple of 32 (layer.c checks). out [R, H, hd]. */
void prefill_attention(const float *q, const float *k, int64_t kstride, const float *v, int64_t vstride, const void *cache,
                       int64_t num_kv_heads, int64_t num_blocks, int64_t block_size, int64_t width, int64_t num_heads,
                       int64_t head_dim, const int32_t *block_tables, int64_t max_blocks, const int64_t *positions, int64_t R,
                       float scale, int64_t window, float *out, int nthreads, int kv, int mode) {
    const pa_args A = {q, k, v, kstride, vstride, cache, num_kv_heads, num_blocks, block_size, width, num_heads, head_dim,
                       block_tables, max_blocks, positions, scale, window, out, kv, mode};
    int64_t *items = (int64_t *)malloc((size_t)(2 * R) * sizeof(int64_t)), count = 0, a = 0;  /* (run start, first row) */
    for (int64_t r = 0; r < R; r++) {
        if (!continues(positions, block_tables, max_blocks, r)) a = r;
        if ((r - a) % QROWS == 0) { items[2 * count] = a; items[2 * count + 1] = r; count++; }
    }
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t it = 0; it < count * num_kv_heads; it++) {
        const int64_t i = count - 1 - it / num_kv_heads, h = it % num_kv_heads;  /* the longest contexts first */
        const int64_t start = items[2 * i], r0 = items[2 * i + 1];
        int64_t r1 = r0 + 1;
        while (r1 < R && r1 - r0 < QROWS && continues(positions, block_tables, max_blocks, r1)) r1++;
        if (kv == KV_I8) attend_rows(&A, start, r0, r1, h, KV_I8);
        else if (kv == KV_F16) attend_rows(&A, start, r0, r1, h, KV_F16);
        else attend_rows(&A, start, r0, r1, h, KV_F32);
    }
    free(items);
}
