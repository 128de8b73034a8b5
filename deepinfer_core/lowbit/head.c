/* The low-bit LM head fused with greedy sampling: for each hidden row, the index of its largest
 * logit, without the [M, V] logits tensor.
 *
 * Why: at 32 requests SmolLM2's tied head (Q8_0, 49,152 x 576) wrote 6.3 MB of float32 logits a
 * step that torch.argmax then read back (2.5 ms of one thread a step, ~2% of a whole run). Here
 * the vocabulary goes in chunks whose logits stay in L2: each thread multiplies its chunks
 * through the very kernel the head would take (lowbit_gemm, same row count M, so the same
 * layout: every logit is bit-for-bit the one the full head computes; a logit depends only on its
 * weight row, its hidden row and M) and keeps a running maximum per row. The chunks' winners are
 * merged in vocabulary order with a strict comparison, so ties go to the lowest index, as
 * torch.argmax. A NaN logit makes the call report failure (torch.argmax would return the NaN's
 * index; the caller falls back to the full head and the sampler).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

void lowbit_gemm(const float *x, int64_t M, int64_t K, int kind, const void *qs, const float *d, const float *m,
                 int64_t N, float *y, int nthreads, int64_t int_rows, int64_t int8_rows);  /* kernels.c */
void quantize_act16(const float *x, int64_t M, int64_t K, int16_t *v, float *s, float *sx);  /* kernels_i16.c */
void gemm_i16_pre(const int16_t *v, const float *s, const float *sx, int64_t M, int64_t K, int kind, const void *qs, const float *d,
                  const float *m, int64_t N, float *y, int nthreads);  /* kernels_i16.c */

#define HEAD_CHUNK_BYTES (128 * 1024)  /* a chunk's logits [M, n] stay within a quarter of L2 */

/* The first index of the largest of y[0..n) (n >= 1); *nan set when any is NaN. */
static int64_t first_max(const float *y, int64_t n, int *nan) {
    __m256 mx = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(y + j);
        un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, v);
    }
    float top = vec_hmax8(mx);
    int bad = _mm256_movemask_ps(un) != 0;
    for (; j < n; j++) {
        bad |= isnan(y[j]);
        top = y[j] > top ? y[j] : top;
    }
    *nan |= bad;
    for (j = 0; j < n; j++)
        if (y[j] == top) return j;
    return 0;
}

/* out[M]: the argmax of each row of x [M, K] @ W^T, W = N packed rows (kind 4, 5 or 8, 32-blocks).
 * Returns 0, or -1 when a logit was NaN (out then undefined). */
int lowbit_head_argmax(const float *x, int64_t M, int64_t K, int kind, const void *qs, const float *d, const float *m,
                       int64_t N, int64_t int_rows, int64_t int8_rows, int nthreads, int64_t *out) {
    const int64_t nb = K / 32, row_bytes = nb * lb_block_bytes(kind);
    int64_t chunk = HEAD_CHUNK_BYTES / (M * (int64_t)sizeof(float)) / 16 * 16;
    const int64_t even = (N + 8 * nthreads - 1) / (8 * nthreads);  /* >= 8 chunks a thread, so few rows still split evenly */
    if (chunk > even) chunk = (even + 15) / 16 * 16;
    if (chunk < 16) chunk = 16;
    const int64_t chunks = (N + chunk - 1) / chunk;
    float *best = (float *)malloc((size_t)(chunks * M) * sizeof(float));
    int64_t *where = (int64_t *)malloc((size_t)(chunks * M) * sizeof(int64_t));
    int nan = 0;
    /* The int16 kernel (lowbit_gemm's choice for these M, kind and thresholds) rounds the rows
     * once here, not in each chunk's call (48 roundings of 32 rows a step at 32 requests):
     * gemm_i16_pre then multiplies the very integers gemm_i16_act would have made. */
    const int i16 = lb_act_kernel(kind, M, int_rows, int8_rows) == 16;
    int16_t *v = i16 ? (int16_t *)malloc((size_t)(M * K) * sizeof(int16_t)) : 0;
    float *s = i16 ? (float *)malloc((size_t)(2 * M * nb) * sizeof(float)) : 0, *sx = i16 ? s + M * nb : 0;
#pragma omp parallel num_threads(nthreads) reduction(| : nan)
    {
        if (i16) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++) quantize_act16(x + r * K, 1, K, v + r * K, s + r * nb, sx + r * nb);
        }
        float *y = (float *)malloc((size_t)(M * chunk) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n0 = c * chunk, n = N - n0 < chunk ? N - n0 : chunk;
            const void *wq = (const char *)qs + n0 * row_bytes;
            const float *wd = d + n0 * nb, *wm = m ? m + n0 * nb : 0;
            if (i16) gemm_i16_pre(v, s, sx, M, K, kind, wq, wd, wm, n, y, 1);
            else lowbit_gemm(x, M, K, kind, wq, wd, wm, n, y, 1, int_rows, int8_rows);
            for (int64_t r = 0; r < M; r++) {
                const int64_t at = first_max(y + r * n, n, &nan);
                best[c * M + r] = y[r * n + at];
                where[c * M + r] = n0 + at;
            }
        }
        free(y);
    }
    for (int64_t r = 0; r < M; r++) {  /* chunks in vocabulary order: the first maximum wins */
        float top = best[r];
        int64_t at = where[r];
        for (int64_t c = 1; c < chunks; c++)
            if (best[c * M + r] > top) { top = best[c * M + r]; at = where[c * M + r]; }
        out[r] = at;
    }
    free(best);
    free(where);
    free(v);
    free(s);
    return nan ? -1 : 0;
}
