/* 8-bit-activation GEMM for 4-bit weights (q4 blocks of kernels.c), for calls of many rows:
 * prefill chunks and the decode of many requests. Opt-in (DEEPINFER_LOWBIT_INT8_ROWS, ops.py):
 * about 2x the exact kernel's speed on this AVX2 CPU, but on SmolLM2 the int8 rounding moves
 * the logits by ~1.5 and greedy outputs part from the float32 model's after ~12 tokens
 * (benchmarks/README.md), no closer than llama.cpp's.
 *
 * Why: on an AVX2 CPU without VNNI a float32 GEMM does 8 multiply-adds per FMA, two FMAs per
 * cycle at best. `vpmaddubsw` multiplies 32 unsigned 8-bit weights by 32 signed 8-bit
 * activations per instruction (pairs summed into int16), so the integer products of a 32-block
 * take one instruction where float32 takes four FMAs; llama.cpp multiplies its 4-bit formats
 * this way (activations rounded to int8 per 32-block, one scale each). Weights that are already
 * 4-bit lose little more to 8-bit activations; 8-bit weights (Q8_0) keep the int16 / float32
 * activations of kernels.c, whose greedy outputs match float32 (benchmarks/README.md).
 *
 * Arithmetic per output element (weight row n, token t, blocks b):
 *
 *   y = sum_b d[n,b] * s[t,b] * sum_j q[n,b,j] * v[t,b,j]  +  sum_b m[n,b] * sx[t,b]
 *
 * v = round(x / s), s = max|x| / 127 per 32-block of the token's row; sx = the block's float sum
 * of x, so the q4 offset m never sees the rounding. The integer block sums are exact
 * (|q*v| <= 15*127, 32 of them fit int32; vpmaddubsw's int16 pair sums <= 3810 never saturate).
 *
 * vpmaddubsw's int16 pair sums of a block's 8 k-groups (4 values each) add up in int16
 * (<= 8 * 3810 < 32767), one vpmaddwd makes them int32.
 *
 * Layout (llama.cpp reduces each block horizontally instead; here nothing is reduced across
 * lanes): a tile of 8 weight rows is widened once per call into a panel where each vector holds
 * one k-group (4 bytes) of all 8 rows, so one broadcast of a token's 4 activation bytes and one
 * vpmaddubsw give 8 columns x 4 products, and the 8 columns' block sums come out as one vector;
 * 4 tokens run per pass over a block (4 int16 and 4 float accumulators in registers). Each lane
 * holds one (row, token) alone through a fixed sequence of operations: a token's result never
 * depends on the other tokens of the call or on M.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define QK 32
#define I8_CHUNK 256 /* tokens per pass over the weights: a chunk's int8 rows stay in L2 */

/* Round x [M, K] to int8 per 32-block: v [M, K], s and sx [M, K/32] (exported for the tests, so
 * a float64 reference multiplies exactly the integers the kernel does). */
void quantize_act8(const float *x, int64_t M, int64_t K, int8_t *v, float *s, float *sx) {
    const int64_t nb = K / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = 0; i < M; i++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + i * K + b * QK;
            const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8), x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
            const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x0), _mm256_andnot_ps(sign, x1)),
                                           _mm256_max_ps(_mm256_andnot_ps(sign, x2), _mm256_andnot_ps(sign, x3)));
            const float amax = vec_hmax8(a);
            sx[i * nb + b] = vec_hsum8(_mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3)));
            s[i * nb + b] = amax / 127.0f;
            const __m256 vi = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, vi)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, vi));
            const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(x2, vi)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(x3, vi));
            /* packs work per 128-bit lane: the permute puts the 4-byte groups back in element order */
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            _mm256_storeu_si256((__m256i *)(v + i * K + b * QK), _mm256_permutevar8x32_epi32(p, order));
        }
}

static inline void widen_q4_u8(const uint8_t *qs, int64_t n, int64_t nb, uint8_t *dst) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(qs + (n * nb + b) * (QK / 2)));
        _mm_storeu_si128((__m128i *)(dst + b * QK), _mm_and_si128(raw, mask));
        _mm_storeu_si128((__m128i *)(dst + b * QK + 16), _mm_and_si128(_mm_srli_epi16(raw, 4), mask));
    }
}

/* A tile of I8_COLS weight rows laid out for column-parallel products: per block b, 8 vectors
 * (k-group g = values 4g..4g+3 of the block), each holding the 4 bytes of every column side by
 * side; then the columns' d and m of the block as two float vectors. */
#define I8_COLS 8
#define PANEL_BLOCK (QK * I8_COLS + 2 * I8_COLS * 4)  /* bytes per block: 256 of weights, 64 of scales */

static void build_panel(const uint8_t *qs, const float *d, const float *m, int64_t n0, int nr, int64_t nb, int64_t K,
                        uint8_t *rows, uint8_t *panel) {
    for (int c = 0; c < I8_COLS; c++) widen_q4_u8(qs, n0 + (c < nr ? c : 0), nb, rows + c * K);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *pb = panel + b * PANEL_BLOCK;
        /* 8 x 8 transpose of 4-byte groups: row c's block (8 groups) -> group g's 8 columns */
        __m256i r[8];
        for (int c = 0; c < 8; c++) r[c] = _mm256_loadu_si256((const __m256i *)(rows + c * K + b * QK));
        transpose8_epi32(r);
        for (int j = 0; j < 8; j++) _mm256_store_si256((__m256i *)(pb + 32 * j), r[j]);
        float *sc = (float *)(pb + QK * I8_COLS);
        for (int c = 0; c < I8_COLS; c++) {
            const int64_t n = n0 + (c < nr ? c : 0);
            sc[c] = d[n * nb + b];
            sc[I8_COLS + c] = m[n * nb + b];
        }
    }
}

/* One tile's panel against T consecutive tokens from i0 (T = 4, or 1 for the tail): per token
 * and block the 8 k-groups' vpmaddubsw pair sums add up in int16 (<= 8 * 3810, no overflow),
 * one vpmaddwd makes them int32 column sums, one conversion and FMA apply d * s, one more FMA
 * the offsets m * sx. Written out per token count: left to itself the compiler computed all
 * products first and spilled them. */
#define I8_BCAST(t, g) _mm256_set1_epi32(*(const int32_t *)(xb + (t) * K + 4 * (g)))
#define I8_FINISH(t, isum, acc)                                                                                \
    do {                                                                                                       \
        const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(isum, ones));                                    \
        acc = _mm256_fmadd_ps(f, _mm256_mul_ps(dv, _mm256_broadcast_ss(s + (i0 + (t)) * nb + b)), acc);         \
        acc = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(sx + (i0 + (t)) * nb + b), acc);                          \
    } while (0)

static inline void i8_store(float *y, int64_t n0, int nr, __m256 acc) {
    if (nr == I8_COLS) {
        _mm256_storeu_ps(y + n0, acc);
    } else {
        float out[I8_COLS];
        _mm256_storeu_ps(out, acc);
        for (int c = 0; c < nr; c++) y[n0 + c] = out[c];
    }
}

static void panel_tokens4(const uint8_t *panel, int64_t nb, int64_t K, const int8_t *v, const float *s, const float *sx,
                          int64_t i0, int64_t n0, int nr, int64_t N, float *y) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = panel + b * PANEL_BLOCK;
        const int8_t *xb = v + i0 * K + b * QK;
        __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
#pragma GCC unroll 2
        for (int g = 0; g < 8; g++) {
            const __m256i w = _mm256_load_si256((const __m256i *)(pb + 32 * g));
            s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w, I8_BCAST(0, g)));
            s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w, I8_BCAST(1, g)));
            s2 = _mm256_add_epi16(s2, _mm256_maddubs_epi16(w, I8_BCAST(2, g)));
            s3 = _mm256_add_epi16(s3, _mm256_maddubs_epi16(w, I8_BCAST(3, g)));
        }
        const __m256 dv = _mm256_load_ps((const float *)(pb + QK * I8_COLS)), mv = _mm256_load_ps((const float *)(pb + QK * I8_COLS) + I8_COLS);
        I8_FINISH(0, s0, a0);
        I8_FINISH(1, s1, a1);
        I8_FINISH(2, s2, a2);
        I8_FINISH(3, s3, a3);
    }
    i8_store(y + i0 * N, n0, nr, a0);
    i8_store(y + (i0 + 1) * N, n0, nr, a1);
    i8_store(y + (i0 + 2) * N, n0, nr, a2);
    i8_store(y + (i0 + 3) * N, n0, nr, a3);
}

static void panel_tokens1(const uint8_t *panel, int64_t nb, int64_t K, const int8_t *v, const float *s, const float *sx,
                          int64_t i0, int64_t n0, int nr, int64_t N, float *y) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 a0 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = panel + b * PANEL_BLOCK;
        const int8_t *xb = v + i0 * K + b * QK;
        __m256i s0 = _mm256_setzero_si256();
        for (int g = 0; g < 8; g++)
            s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_load_si256((const __m256i *)(pb + 32 * g)), I8_BCAST(0, g)));
        const __m256 dv = _mm256_load_ps((const float *)(pb + QK * I8_COLS)), mv = _mm256_load_ps((const float *)(pb + QK * I8_COLS) + I8_COLS);
        I8_FINISH(0, s0, a0);
    }
    i8_store(y + i0 * N, n0, nr, a0);
}


/* x [M, K] float32 times a q4 weight [N, K] -> y [M, N], activations rounded to int8 per block. */
void gemm_i8_act(const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d, const float *m, int64_t N, float *y,
                 int nthreads) {
    const int64_t nb = K / QK, tiles = (N + I8_COLS - 1) / I8_COLS;
    int8_t *v = (int8_t *)malloc((size_t)(M * K));
    float *s = (float *)malloc((size_t)(M * nb) * sizeof(float)), *sx = (float *)malloc((size_t)(M * nb) * sizeof(float));
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) quantize_act8(x + i * K, 1, K, v + i * K, s + i * nb, sx + i * nb);
        uint8_t *rows = (uint8_t *)aligned_alloc(32, (size_t)(I8_COLS * K));
        uint8_t *panel = (uint8_t *)aligned_alloc(32, (size_t)(nb * PANEL_BLOCK));
        for (int64_t c0 = 0; c0 < M; c0 += I8_CHUNK) {
            const int64_t c1 = c0 + I8_CHUNK < M ? c0 + I8_CHUNK : M;
#pragma omp for schedule(static) nowait
            for (int64_t tile = 0; tile < tiles; tile++) {
                const int64_t n0 = tile * I8_COLS;
                const int nr = (int)(N - n0 < I8_COLS ? N - n0 : I8_COLS);
                build_panel(qs, d, m, n0, nr, nb, K, rows, panel);
                int64_t i0 = c0;
                for (; i0 + 4 <= c1; i0 += 4) panel_tokens4(panel, nb, K, v, s, sx, i0, n0, nr, N, y);
                for (; i0 < c1; i0++) panel_tokens1(panel, nb, K, v, s, sx, i0, n0, nr, N, y);
            }
        }
        free(rows);
        free(panel);
    }
    free(v); free(s); free(sx);
}
