/* 16-bit-integer-activation GEMMs for the packed 4/5/8-bit weights of kernels.c.
 *
 * Why: on this AVX2 CPU without VNNI a float32 GEMM does 8 multiply-adds per FMA, and the exact
 * kernels of kernels.c already run near that rate. `vpmaddwd` multiplies 16 int16 pairs per
 * instruction and sums each pair exactly into int32: weights' 4/5/8-bit integers widen to int16
 * exactly, and activations rounded to int16 per 32-value block (scale = max|x| / 32767) keep
 * ~15 bits, so the products are much closer to float32 than llama.cpp's int8 activations
 * (kernels_i8.c), whose rounding changes SmolLM2's greedy outputs (benchmarks/README.md).
 *
 * Arithmetic per output element (weight row n, token t, blocks b), as kernels_i8.c's:
 *
 *   y = sum_b d[n,b] * s[t,b] * sum_j q[n,b,j] * v[t,b,j]  +  sum_b m[n,b] * sx[t,b]
 *
 * v = round(x / s), s = max|x| / 32767; sx = the block's float sum of x, so the q4 offset m
 * never sees the rounding (q8 has no offset). Integer block sums are exact: |q * v| <= 128 *
 * 32767, 32 of them fit int32.
 *
 * Two layouts:
 * - rows (few tokens, decode of 1-4 requests): each weight block widened in registers and
 *   multiplied against each token's block at once; per-lane partial sums, one horizontal sum
 *   per output at the end.
 * - panel (more tokens: decode of many requests, prefill): a tile of 16 weight rows is widened
 *   to int16 once per call (and token chunk) into a panel where each vector holds one k-pair of
 *   8 rows side by side, so one broadcast of a token's activation pair and one vpmaddwd give 8
 *   columns x 2 products into an int32 lane per column: no horizontal reductions, and each
 *   weight vector loaded serves 3 tokens (5 in the VNNI build: P16_T), each broadcast 2 vectors.
 *   Per block: 16 vpmaddwd and 15 adds per token and 8 columns (16 vpdpwssd with VNNI), then
 *   one conversion and two FMAs (the scales, the offset).
 *
 * Where the CPU has AVX512-VNNI + VL (or AVX-VNNI), native.py builds this file with those flags
 * and DPWSSD below is one vpdpwssd: the same int32 sums, so the same bits as the AVX2 build.
 * With AVX512-F/BW + VNNI (the avx512vnni build) the panel pass is 512 bits wide (P16_ZMM): a
 * pair's 16 columns in one zmm, 8 tokens a pass read from a token-interleaved copy of the rounded
 * rows, the next tile prefetched a few lines a block; each lane does the 256-bit pass's
 * operations in the same order, so again the same bits (benchmarks/README.md, gemm4).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

#define QK 32

/* acc + the pair sums of a * b, int32 lanes (wrap-around either way, so the same bits): one
 * vpdpwssd where the library is built for VNNI (native.py picks the build from the CPU), else
 * vpmaddwd + vpaddd. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPWSSD(acc, a, b) _mm256_dpwssd_epi32((acc), (a), (b))
#elif defined(__AVXVNNI__)
#define DPWSSD(acc, a, b) _mm256_dpwssd_avx_epi32((acc), (a), (b))
#else
#define DPWSSD(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#endif

static inline float dot_offsets(const float *m, const float *sx, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(m + b), _mm256_loadu_ps(sx + b), acc);
    float r = vec_hsum8(acc);
    for (; b < nb; b++) r += m[b] * sx[b];
    return r;
}

/* Each activation row rounded once per call, per 32-block (quantize_act16). Within each layout
 * a row's result does not depend on M or on the other rows (the rows layout for M < P16_MIN_M,
 * the panel from there on); the two layouts sum the same exact block integers but round the
 * float part in another order (per lane then across lanes, or per block), so a row's result
 * alone and in a batch of >= P16_MIN_M rows differ by float32 rounding. */
typedef struct {
    int16_t *v;  /* [M, K] */
    float *s;    /* [M, K/32] scale per block */
    float *sx;   /* [M, K/32] float sum of the block's x (for the q4 offset) */
    /* The zmm panel pass's copy (P16_ZMM; else NULL): tokens in groups of P16_T, per group and
     * block the 16 pairs of each token side by side (pair p of token t at [p][t], int32), then
     * per group and block the tokens' s and sx: one pointer and constant offsets address a
     * block's every operand (the [M, K] rows needed a register per token and spilled them). A
     * short last group holds zeros after its tokens. */
    int32_t *xz; /* [groups, K/32, 16, P16_T] */
    float *sz;   /* [groups, K/32, P16_T] */
    float *sxz;  /* [groups, K/32, P16_T] */
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

/* ---- rows layout (few tokens) ---- */

static inline __attribute__((always_inline)) void widen_block_i16(int kind, const void *qs, int64_t blk, __m256i *w0, __m256i *w1) {
    if (kind == 4) {
        /* each byte widened to 16 bits holds both nibbles: the low one is element j, the high
         * one (a shift, no mask needed) element j + 16 */
        const __m256i both = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)qs + blk * (QK / 2))));
        *w0 = _mm256_and_si256(both, _mm256_set1_epi16(0x0F));
        *w1 = _mm256_srli_epi16(both, 4);
    } else if (kind == 5) {
        q5_widen_i16((const uint8_t *)qs + blk * 20, w0, w1);
    } else {
        const int8_t *q = (const int8_t *)qs + blk * QK;
        *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
        *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
    }
}

static inline __attribute__((always_inline)) __m256 block_dot_i16(__m256i w0, __m256i w1, const int16_t *vr) {
    const __m256i p = DPWSSD(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)vr)), w1,
                             _mm256_loadu_si256((const __m256i *)(vr + 16)));
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
        if (kind != 8) r += dot_offsets(m + n * nb, a->sx + (i0 + t) * nb, nb);
        y[(i0 + t) * N + n] = r;
    }
}

/* The rows pass in 512-bit vectors (ROWS_ZMM: the avx512vnni build). A zmm holds two blocks'
 * halves: Wa = [w0 of block b | w0 of b + 1], Wb = [w1 of b | w1 of b + 1] (q4: one 32-byte load
 * widened gives both, a mask and a shift split them), against the token's activations re-laid
 * once per call in the same order (rows_z_t). Lane for lane it is the 256-bit pass above: the low
 * half does block b's operations into acc0, the high half block b + 1's into acc1 (the same
 * int32 pair sums, then (p * d) * s fused-added), and the end sums acc0 + acc1 the same way: the
 * same bits with about a third of the instructions per token (2-4 rows: speculative verify
 * steps, small batches). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(ROWS_NO_ZMM)
#define ROWS_ZMM 1

typedef struct {
    int16_t *v; /* [M, nb / 2, 64]: per block pair v0 of b, v0 of b + 1, v1 of b, v1 of b + 1 */
    float *s;   /* [M, nb / 2, 16]: s of b 8 times, s of b + 1 8 times */
} rows_z_t;

static void rows_z_layout(const act16_t *a, int64_t M, int64_t K, rows_z_t *z) {
    const int64_t nb = K / QK, np = nb / 2;
    for (int64_t i = 0; i < M; i++)
        for (int64_t p = 0; p < np; p++) {
            const int16_t *src = a->v + i * K + 2 * p * QK;
            int16_t *dst = z->v + (i * np + p) * 2 * QK;
            __builtin_memcpy(dst, src, 32);
            __builtin_memcpy(dst + 16, src + 32, 32);
            __builtin_memcpy(dst + 32, src + 16, 32);
            __builtin_memcpy(dst + 48, src + 48, 32);
            float *sd = z->s + (i * np + p) * 16;
            for (int j = 0; j < 8; j++) {
                sd[j] = a->s[i * nb + 2 * p];
                sd[8 + j] = a->s[i * nb + 2 * p + 1];
            }
        }
}

static inline __attribute__((always_inline)) void widen_pair_z(int kind, const void *qs, int64_t blk, __m512i *wa, __m512i *wb) {
    if (kind == 4) {
        const __m512i both = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)((const uint8_t *)qs + blk * (QK / 2))));
        *wa = _mm512_and_si512(both, _mm512_set1_epi16(0x0F));
        *wb = _mm512_srli_epi16(both, 4);
    } else if (kind == 5) {
        __m256i l0, h0, l1, h1;
        q5_widen_i16((const uint8_t *)qs + blk * 20, &l0, &h0);
        q5_widen_i16((const uint8_t *)qs + (blk + 1) * 20, &l1, &h1);
        *wa = _mm512_inserti64x4(_mm512_castsi256_si512(l0), l1, 1);
        *wb = _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1);
    } else {
        const int8_t *q = (const int8_t *)qs + blk * QK;
        const __m256i a8 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)q)),
                                                   _mm_loadu_si128((const __m128i *)(q + QK)), 1);
        const __m256i b8 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(q + 16))),
                                                   _mm_loadu_si128((const __m128i *)(q + QK + 16)), 1);
        *wa = _mm512_cvtepi8_epi16(a8);
        *wb = _mm512_cvtepi8_epi16(b8);
    }
}

static inline __attribute__((always_inline)) void row_i16_z(const act16_t *a, const rows_z_t *z, int64_t i0, const int T,
                                                           int64_t K, int kind, const void *qs, const float *d,
                                                           const float *m, int64_t n, int64_t N, float *y) {
    const int64_t nb = K / QK, np = nb / 2;
    const float *wd = d + n * nb;
    const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc[4];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        __m512i wa, wb;
        widen_pair_z(kind, qs, n * nb + 2 * p, &wa, &wb);
        const __m512 dv = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(wd + 2 * p)))));
        for (int t = 0; t < T; t++) {
            const int16_t *vr = z->v + ((i0 + t) * np + p) * 2 * QK;
            const __m512i q = _mm512_dpwssd_epi32(_mm512_madd_epi16(wa, _mm512_loadu_si512(vr)), wb, _mm512_loadu_si512(vr + QK));
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), dv), _mm512_loadu_ps(z->s + ((i0 + t) * np + p) * 16), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) {
        __m256 lo = _mm512_castps512_ps256(acc[t]);
        const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[t]), 1));
        if (nb & 1) {  /* the last block alone, as the 256-bit pass does it (into acc0) */
            const int64_t b = nb - 1;
            __m256i w0, w1;
            widen_block_i16(kind, qs, n * nb + b, &w0, &w1);
            lo = _mm256_fmadd_ps(_mm256_mul_ps(block_dot_i16(w0, w1, a->v + (i0 + t) * K + b * QK), _mm256_broadcast_ss(wd + b)),
                                 _mm256_broadcast_ss(a->s + (i0 + t) * nb + b), lo);
        }
        float r = vec_hsum8(_mm256_add_ps(lo, hi));
        if (kind != 8) r += dot_offsets(m + n * nb, a->sx + (i0 + t) * nb, nb);
        y[(i0 + t) * N + n] = r;
    }
}
#endif

static void gemm_i16_rows(const act16_t *a, int64_t M, int64_t K, int kind, const void *qs, const float *d, const float *m,
                          int64_t N, float *y, int nthreads) {
#if defined(ROWS_ZMM)
    const int64_t np = K / QK / 2;
    rows_z_t z = {(int16_t *)malloc((size_t)(M * np * 2 * QK + 32) * sizeof(int16_t)),
                  (float *)malloc((size_t)(M * np * 16 + 16) * sizeof(float))};
    rows_z_layout(a, M, K, &z);
#define ROW_PASS(T) row_i16_z(a, &z, i0, (T), K, kind, qs, d, m, n, N, y)
#else
#define ROW_PASS(T) row_i16(a, i0, (T), K, kind, qs, d, m, n, N, y)
#endif
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        int64_t i0 = 0;
        for (; i0 + 4 <= M; i0 += 4) ROW_PASS(4);
        switch (M - i0) {
            case 3: ROW_PASS(3); break;
            case 2: ROW_PASS(2); break;
            case 1: ROW_PASS(1); break;
            default: break;
        }
    }
#undef ROW_PASS
#if defined(ROWS_ZMM)
    free(z.v);
    free(z.s);
#endif
}


/* ---- panel layout ---- */

#define P16_COLS 16                                   /* weight rows per tile: two vectors of 8 */
#define P16_PAIRS (QK / 2)                            /* k-pairs per block */
#define P16_BLOCK (P16_PAIRS * 2 * 32 + 4 * 32)       /* bytes per block: 1,024 of weights, d and m of 16 rows */
#define P16_MIN_M 5                                   /* fewer rows: the rows layout */
/* Tokens per pass over a panel slice: 2 T int32 sums and 2 T float accumulators in registers.
 * AVX2's 16 registers hold T = 3. With VNNI one vpdpwssd adds into a sum where AVX2 needs two
 * instructions, and its 4-cycle latency then bounds 6 chains at 1.5 a cycle on Zen 4 (2 a cycle
 * takes 8; benchmarks/kernels/lowbit_i16_ceiling.c); AVX512-VL's 32 ymm registers hold more tokens:
 * T = 4 and 5 ran 1.1-1.25x the AVX2 build per matrix, 5 a little ahead at 512 rows, 6 and 8
 * no faster than AVX2 (registers spill) (benchmarks/README.md, cpuvnni). -DP16_T=n overrides. */
/* With AVX512-F/BW + VNNI (the avx512vnni build) the pass is 512 bits wide (P16_ZMM): the 16
 * columns of a pair are one zmm (the panel's vectors 2p and 2p + 1 lie side by side), so a token
 * takes one int32 sum and one float accumulator and P16_T tokens share each weight load. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(P16_NO_ZMM)
#define P16_ZMM 1
#endif
#ifndef P16_T
#if defined(P16_ZMM)
#define P16_T 8
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define P16_T 5
#else
#define P16_T 3
#endif
#endif

/* 8 x 8 transposes of 16-bit units, one per 128-bit lane: r[c] = units 0-7 of row c -> r[u] =
 * unit u of rows 0-7 (each lane its own 8 rows) */
static inline void transpose8x2_epi16(__m256i *r) {
    const __m256i a0 = _mm256_unpacklo_epi16(r[0], r[1]), a1 = _mm256_unpackhi_epi16(r[0], r[1]);
    const __m256i a2 = _mm256_unpacklo_epi16(r[2], r[3]), a3 = _mm256_unpackhi_epi16(r[2], r[3]);
    const __m256i a4 = _mm256_unpacklo_epi16(r[4], r[5]), a5 = _mm256_unpackhi_epi16(r[4], r[5]);
    const __m256i a6 = _mm256_unpacklo_epi16(r[6], r[7]), a7 = _mm256_unpackhi_epi16(r[6], r[7]);
    const __m256i b0 = _mm256_unpacklo_epi32(a0, a2), b1 = _mm256_unpackhi_epi32(a0, a2);
    const __m256i b2 = _mm256_unpacklo_epi32(a1, a3), b3 = _mm256_unpackhi_epi32(a1, a3);
    const __m256i b4 = _mm256_unpacklo_epi32(a4, a6), b5 = _mm256_unpackhi_epi32(a4, a6);
    const __m256i b6 = _mm256_unpacklo_epi32(a5, a7), b7 = _mm256_unpackhi_epi32(a5, a7);
    r[0] = _mm256_unpacklo_epi64(b0, b4); r[1] = _mm256_unpackhi_epi64(b0, b4);
    r[2] = _mm256_unpacklo_epi64(b1, b5); r[3] = _mm256_unpackhi_epi64(b1, b5);
    r[4] = _mm256_unpacklo_epi64(b2, b6); r[5] = _mm256_unpackhi_epi64(b2, b6);
    r[6] = _mm256_unpacklo_epi64(b3, b7); r[7] = _mm256_unpackhi_epi64(b3, b7);
}

/* 8 x 8 transpose of floats: r[c] = elements 0-7 of row c -> r[j] = element j of rows 0-7 */
static inline void transpose8_ps(__m256 *r) {
    const __m256 a0 = _mm256_unpacklo_ps(r[0], r[1]), a1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 a2 = _mm256_unpacklo_ps(r[2], r[3]), a3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 a4 = _mm256_unpacklo_ps(r[4], r[5]), a5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 a6 = _mm256_unpacklo_ps(r[6], r[7]), a7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
    const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
    const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
    const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
    r[0] = _mm256_permute2f128_ps(b0, b4, 0x20); r[1] = _mm256_permute2f128_ps(b1, b5, 0x20);
    r[2] = _mm256_permute2f128_ps(b2, b6, 0x20); r[3] = _mm256_permute2f128_ps(b3, b7, 0x20);
    r[4] = _mm256_permute2f128_ps(b0, b4, 0x31); r[5] = _mm256_permute2f128_ps(b1, b5, 0x31);
    r[6] = _mm256_permute2f128_ps(b2, b6, 0x31); r[7] = _mm256_permute2f128_ps(b3, b7, 0x31);
}

/* The tile's per-block scales (src = d, at 0) or offsets (src = m, at P16_COLS; NULL: zeros)
 * into each block's slot of the panel: src is [N, nb] by rows, so 8 blocks of 8 rows go through
 * one 8 x 8 transpose, 4 vector loads and stores a block where copying each value took 32
 * scalar loads and 32 stores. The same floats either way. */
static void panel_scales(const float *src, int64_t n0, int nr, int64_t nb, __m256i *panel, int at) {
    float *sc0 = (float *)(panel + 2 * P16_PAIRS) + at;  /* block b's: sc0 + b * P16_BLOCK / 4 */
    if (!src) {
        for (int64_t b = 0; b < nb; b++) {
            _mm256_store_ps(sc0 + b * (P16_BLOCK / 4), _mm256_setzero_ps());
            _mm256_store_ps(sc0 + b * (P16_BLOCK / 4) + 8, _mm256_setzero_ps());
        }
        return;
    }
    const float *rows[P16_COLS];
    for (int c = 0; c < P16_COLS; c++) rows[c] = src + (n0 + (c < nr ? c : 0)) * nb;
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8)
        for (int h = 0; h < 2; h++) {
            __m256 r[8];
            for (int c = 0; c < 8; c++) r[c] = _mm256_loadu_ps(rows[8 * h + c] + b);
            transpose8_ps(r);
            for (int j = 0; j < 8; j++) _mm256_store_ps(sc0 + (b + j) * (P16_BLOCK / 4) + 8 * h, r[j]);
        }
    for (; b < nb; b++)
        for (int c = 0; c < P16_COLS; c++) sc0[b * (P16_BLOCK / 4) + c] = rows[c][b];
}

/* The panel of weight rows n0.. (nr of them; a short tile repeats its first row), per block:
 * pair p of rows 0-7 at vector 2p, of rows 8-15 at 2p + 1; then d of the 16 rows, then m.
 * Built from the packed bytes: a k-pair is one 16-bit unit of the packed block (q4: unit p's
 * low nibbles are elements 2p, 2p + 1, its high nibbles 2p + 16, 2p + 17; q8: unit p is
 * elements 2p, 2p + 1), so 8 x 8 transposes of 16-bit units give each unit of 8 rows side by
 * side, and widening to int16 puts each row's pair in its own 32-bit lane (q4: a mask and a
 * shift then split the two pairs). The 16 rows go through one transpose in 256-bit registers,
 * rows 0-3 and 8-11 in the low lane, 4-7 and 12-15 in the high one, so that widening each
 * lane's low 8 bytes (unpacklo with zero, in-lane) gives rows 0-7 in order and its high 8
 * bytes rows 8-15: half the transposes' shuffles of two 128-bit transposes, no lane-crossing
 * widening; with the scales copied by transposes (panel_scales), a tile's build from L1 took
 * 0.77x (q4) to 0.8x (q5, q8) the time of the 128-bit build (cpu12's, which had half the
 * shuffles of widening row by row into an int16 scratch; benchmarks/README.md, avx2gemm). The 16 rows
 * are one contiguous span of the packed weight read a block of each row at a time, which the
 * hardware prefetcher does not follow: the span is prefetched while the tile before runs
 * (ahead_t). The panel's contents are the same integers either way, so every result keeps its
 * bits. */
#if defined(P16_ZMM)
/* The 16 rows' 16-byte spans at rp[c] + off as 8 16-bit units each -> o[k]: units 2k (low 256
 * bits) and 2k + 1 (high) of rows 0-15 side by side. Four zmm of 4 rows each, two rounds of
 * vpermt2w (rows 0-7 and 8-15 apart, then together): 8 permutes where the 256-bit transposes
 * take 24 unpacks and then 16 more to widen. */
static inline __attribute__((always_inline)) void units16x8(const uint8_t *const *rp, int64_t off, __m512i *o) {
    static const uint16_t idx_h[2][32] = {  /* round 1: word u * 8 + r <- row r's unit u (+ 4 for the second) */
        {0, 8, 16, 24, 32, 40, 48, 56, 1, 9, 17, 25, 33, 41, 49, 57, 2, 10, 18, 26, 34, 42, 50, 58, 3, 11, 19, 27, 35, 43, 51, 59},
        {4, 12, 20, 28, 36, 44, 52, 60, 5, 13, 21, 29, 37, 45, 53, 61, 6, 14, 22, 30, 38, 46, 54, 62, 7, 15, 23, 31, 39, 47, 55, 63}};
    static const uint16_t idx_r[2][32] = {  /* round 2: word h * 16 + r <- unit 2k + h of row r (rows 8-15 from the second) */
        {0, 1, 2, 3, 4, 5, 6, 7, 32, 33, 34, 35, 36, 37, 38, 39, 8, 9, 10, 11, 12, 13, 14, 15, 40, 41, 42, 43, 44, 45, 46, 47},
        {16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51, 52, 53, 54, 55, 24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63}};
    __m512i z[4];
    for (int j = 0; j < 4; j++) {
        z[j] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rp[4 * j] + off)));
        z[j] = _mm512_inserti32x4(z[j], _mm_loadu_si128((const __m128i *)(rp[4 * j + 1] + off)), 1);
        z[j] = _mm512_inserti32x4(z[j], _mm_loadu_si128((const __m128i *)(rp[4 * j + 2] + off)), 2);
        z[j] = _mm512_inserti32x4(z[j], _mm_loadu_si128((const __m128i *)(rp[4 * j + 3] + off)), 3);
    }
    const __m512i h0 = _mm512_loadu_si512(idx_h[0]), h1 = _mm512_loadu_si512(idx_h[1]);
    const __m512i r0 = _mm512_loadu_si512(idx_r[0]), r1 = _mm512_loadu_si512(idx_r[1]);
    const __m512i a0 = _mm512_permutex2var_epi16(z[0], h0, z[1]), a1 = _mm512_permutex2var_epi16(z[0], h1, z[1]);  /* rows 0-7 */
    const __m512i b0 = _mm512_permutex2var_epi16(z[2], h0, z[3]), b1 = _mm512_permutex2var_epi16(z[2], h1, z[3]);  /* rows 8-15 */
    o[0] = _mm512_permutex2var_epi16(a0, r0, b0);
    o[1] = _mm512_permutex2var_epi16(a0, r1, b0);
    o[2] = _mm512_permutex2var_epi16(a1, r0, b1);
    o[3] = _mm512_permutex2var_epi16(a1, r1, b1);
}
#endif

static void build_panel16(int kind, const void *qs, const float *d, const float *m, int64_t n0, int nr, int64_t nb,
                          __m256i *panel) {
    static const int lane_rows[2][8] = {{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}};
    const int64_t row_bytes = nb * lb_block_bytes(kind);
    const uint8_t *base = (const uint8_t *)qs;
    const uint8_t *lo[8], *hi[8], *rp[P16_COLS];  /* lo / hi: the rows of lane 0 / 1 of transpose input c */
    for (int c = 0; c < P16_COLS; c++) rp[c] = base + (n0 + (c < nr ? c : 0)) * row_bytes;
    for (int c = 0; c < 8; c++) {
        lo[c] = rp[lane_rows[0][c]];
        hi[c] = rp[lane_rows[1][c]];
    }
    const __m256i low = _mm256_set1_epi16(0x0F), zero = _mm256_setzero_si256();
    for (int64_t b = 0; b < nb; b++) {
        __m256i *pb = panel + b * (P16_BLOCK / 32);
#if defined(P16_ZMM)
        /* q4 from units16x8: unit p of the 16 rows widened to int16 is pair p's zmm (its low
         * nibbles; pair p + 8 its high ones). q8 this way (two halves, the sign-extended bytes)
         * measured 0.96x on the head: it keeps the 256-bit transposes. */
        if (kind == 4) {
            __m512i *pz = (__m512i *)pb;
            for (int half = 0; half < (kind == 8 ? 2 : 1); half++) {
                __m512i o[4];
                units16x8(rp, kind == 4 ? b * (QK / 2) : b * QK + 16 * half, o);
                for (int k = 0; k < 4; k++)
                    for (int h = 0; h < 2; h++) {
                        const __m256i u = h ? _mm512_extracti64x4_epi64(o[k], 1) : _mm512_castsi512_si256(o[k]);
                        const int p = 2 * k + h;
                        if (kind == 4) {
                            const __m512i w = _mm512_cvtepu8_epi16(u);
                            _mm512_store_si512(pz + p, _mm512_and_si512(w, _mm512_set1_epi16(0x0F)));
                            _mm512_store_si512(pz + p + 8, _mm512_srli_epi16(w, 4));
                        } else {
                            _mm512_store_si512(pz + p + 8 * half, _mm512_cvtepi8_epi16(u));
                        }
                    }
            }
            continue;
        }
#endif
        if (kind == 4 || kind == 5) {
            const int64_t off = b * (kind == 4 ? QK / 2 : 20);
            __m256i u[8];
            for (int c = 0; c < 8; c++) u[c] = _mm256_loadu2_m128i((const __m128i *)(hi[c] + off), (const __m128i *)(lo[c] + off));
            transpose8x2_epi16(u);
            if (kind == 4) {
                for (int p = 0; p < 8; p++) {
                    const __m256i r0 = _mm256_unpacklo_epi8(u[p], zero), r1 = _mm256_unpackhi_epi8(u[p], zero);
                    _mm256_store_si256(pb + 2 * p, _mm256_and_si256(r0, low));
                    _mm256_store_si256(pb + 2 * p + 1, _mm256_and_si256(r1, low));
                    _mm256_store_si256(pb + 2 * (p + 8), _mm256_srli_epi16(r0, 4));
                    _mm256_store_si256(pb + 2 * (p + 8) + 1, _mm256_srli_epi16(r1, 4));
                }
            } else {
                /* q4's nibbles, then each pair's two high bits from the rows' uint32s (one
                 * 32-bit lane per row, rows 0-7 and 8-15): element 2p's bit to bit 4 of the
                 * lane's low int16, element 2p + 1's to bit 4 of its high int16 (elements
                 * 2p + 16, 2p + 17 alike) */
                uint32_t hb[P16_COLS];
                for (int c = 0; c < P16_COLS; c++) __builtin_memcpy(&hb[c], rp[c] + off + 16, sizeof hb[c]);
                const __m256i qh[2] = {_mm256_loadu_si256((const __m256i *)hb), _mm256_loadu_si256((const __m256i *)(hb + 8))};
                const __m256i lo4 = _mm256_set1_epi32(0x10), hi4 = _mm256_set1_epi32(0x100000);
                for (int p = 0; p < 8; p++) {
                    const __m256i r[2] = {_mm256_unpacklo_epi8(u[p], zero), _mm256_unpackhi_epi8(u[p], zero)};
                    for (int h = 0; h < 2; h++) {
                        const __m256i e0 = _mm256_srl_epi32(qh[h], _mm_cvtsi32_si128(2 * p)), e1 = _mm256_srl_epi32(qh[h], _mm_cvtsi32_si128(2 * p + 16));
                        const __m256i h0 = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(e0, 4), lo4), _mm256_and_si256(_mm256_slli_epi32(e0, 19), hi4));
                        const __m256i h1 = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(e1, 4), lo4), _mm256_and_si256(_mm256_slli_epi32(e1, 19), hi4));
                        _mm256_store_si256(pb + 2 * p + h, _mm256_or_si256(_mm256_and_si256(r[h], low), h0));
                        _mm256_store_si256(pb + 2 * (p + 8) + h, _mm256_or_si256(_mm256_srli_epi16(r[h], 4), h1));
                    }
                }
            }
        } else {
            /* q8: the block's two 16-byte halves (elements 0-15, 16-31), each transposed; a
             * byte widened with its sign by unpacking it into the high half and shifting back */
            for (int half = 0; half < 2; half++) {
                const int64_t off = b * QK + 16 * half;
                __m256i u[8];
                for (int c = 0; c < 8; c++) u[c] = _mm256_loadu2_m128i((const __m128i *)(hi[c] + off), (const __m128i *)(lo[c] + off));
                transpose8x2_epi16(u);
                for (int p = 0; p < 8; p++) {
                    _mm256_store_si256(pb + 2 * (p + 8 * half), _mm256_srai_epi16(_mm256_unpacklo_epi8(zero, u[p]), 8));
                    _mm256_store_si256(pb + 2 * (p + 8 * half) + 1, _mm256_srai_epi16(_mm256_unpackhi_epi8(zero, u[p]), 8));
                }
            }
        }
    }
    panel_scales(d, n0, nr, nb, panel, 0);
    panel_scales(m, n0, nr, nb, panel, P16_COLS);
}

/* The next tile's packed rows, scales and offsets, prefetched a few lines before each pass of
 * this tile's tokens, spread over the tile's work: all ~110 lines at the tile's start measured
 * worse (a 32-row step's GEMMs with weights from memory still ran ~15% below the same calls
 * with one matrix in cache; spread, about as fast), and q8 rows (the head) copied front to
 * back, the other way tried, lost 1.2-1.3x to this on the head. */
typedef struct {
    const char *p[3];
    int64_t left[3];  /* bytes still to prefetch per span */
    int64_t per_pass; /* lines per pass */
} ahead_t;

static ahead_t next_tile(int kind, const void *qs, const float *d, const float *m, int64_t n1, int64_t N, int64_t nb, int64_t passes) {
    ahead_t pf = {{0, 0, 0}, {0, 0, 0}, 0};
    if (n1 >= N) return pf;
    const int64_t rows = N - n1 < P16_COLS ? N - n1 : P16_COLS, row_bytes = nb * lb_block_bytes(kind);
    pf.p[0] = (const char *)qs + n1 * row_bytes;
    pf.left[0] = rows * row_bytes;
    pf.p[1] = (const char *)(d + n1 * nb);
    pf.left[1] = rows * nb * (int64_t)sizeof(float);
    if (m) {
        pf.p[2] = (const char *)(m + n1 * nb);
        pf.left[2] = pf.left[1];
    }
    const int64_t lines = (pf.left[0] + pf.left[1] + pf.left[2]) / 64 + 3;
    pf.per_pass = (lines + passes - 1) / passes;
    return pf;
}

static inline void ahead_some(ahead_t *pf) {
    int64_t n = pf->per_pass;
    for (int k = 0; k < 3 && n > 0; k++)
        for (; pf->left[k] > 0 && n > 0; n--, pf->p[k] += 64, pf->left[k] -= 64) _mm_prefetch(pf->p[k], _MM_HINT_T0);
}

/* y = the tile's sums over the first K slice, y += them over the next ones */
static inline void store16(float *y, int nr, __m256 a0, __m256 a1, int first) {
    if (nr == P16_COLS) {
        if (!first) {
            a0 = _mm256_add_ps(_mm256_loadu_ps(y), a0);
            a1 = _mm256_add_ps(_mm256_loadu_ps(y + 8), a1);
        }
        _mm256_storeu_ps(y, a0);
        _mm256_storeu_ps(y + 8, a1);
    } else {
        float out[P16_COLS];
        _mm256_storeu_ps(out, a0);
        _mm256_storeu_ps(out + 8, a1);
        for (int c = 0; c < nr; c++) y[c] = first ? out[c] : y[c] + out[c];
    }
}

/* One tile's panel against T (1 to P16_T) consecutive tokens from i0; T and offs compile-time after
 * inlining. Per block: the int32 column sums of 16 pairs, then acc += f * (d * s) (+ m * sx). */
static inline __attribute__((always_inline)) void panel16_tokens(const __m256i *panel, int64_t b0, int64_t b1, int64_t nb, int64_t K, const act16_t *a,
                                                                int64_t i0, const int T, const int offs, int64_t n0, int nr,
                                                                int64_t N, float *y) {
    __m256 f0[P16_T], f1[P16_T];
    for (int t = 0; t < T; t++) f0[t] = f1[t] = _mm256_setzero_ps();
    for (int64_t b = b0; b < b1; b++) {
        const __m256i *pb = panel + b * (P16_BLOCK / 32);
        const int32_t *x0 = (const int32_t *)(a->v + i0 * K + b * QK);  /* token t's pair p: x0[t * K / 2 + p] */
        __m256i s0[P16_T], s1[P16_T];
        {   /* pair 0 starts the sums: no add into zero */
            const __m256i w0 = _mm256_load_si256(pb), w1 = _mm256_load_si256(pb + 1);
            for (int t = 0; t < T; t++) {
                const __m256i u = _mm256_set1_epi32(x0[t * (K / 2)]);
                s0[t] = _mm256_madd_epi16(w0, u);
                s1[t] = _mm256_madd_epi16(w1, u);
            }
        }
#pragma GCC unroll 4
        for (int p = 1; p < P16_PAIRS; p++) {
            const __m256i w0 = _mm256_load_si256(pb + 2 * p), w1 = _mm256_load_si256(pb + 2 * p + 1);
            for (int t = 0; t < T; t++) {
                const __m256i u = _mm256_set1_epi32(x0[t * (K / 2) + p]);
                s0[t] = DPWSSD(s0[t], w0, u);
                s1[t] = DPWSSD(s1[t], w1, u);
            }
        }
        const float *sc = (const float *)(pb + 2 * P16_PAIRS);
        const __m256 d0 = _mm256_load_ps(sc), d1 = _mm256_load_ps(sc + 8);
        for (int t = 0; t < T; t++) {
            const __m256 st = _mm256_broadcast_ss(a->s + (i0 + t) * nb + b);
            f0[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0[t]), _mm256_mul_ps(d0, st), f0[t]);
            f1[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1[t]), _mm256_mul_ps(d1, st), f1[t]);
            if (offs) {
                const __m256 xt = _mm256_broadcast_ss(a->sx + (i0 + t) * nb + b);
                f0[t] = _mm256_fmadd_ps(_mm256_load_ps(sc + 16), xt, f0[t]);
                f1[t] = _mm256_fmadd_ps(_mm256_load_ps(sc + 24), xt, f1[t]);
            }
        }
    }
    for (int t = 0; t < T; t++) store16(y + (i0 + t) * N + n0, nr, f0[t], f1[t], b0 == 0);
}

#if defined(P16_ZMM)
/* panel16_tokens in 512-bit vectors: lane c of a zmm is column c, and each lane takes the same
 * operations in the same order as the 256-bit pass's (int32 sums are exact; then per block
 * fma(float(sum), d * s, acc) and fma(m, sx, acc)), so every output keeps its bits. i0 is a
 * multiple of P16_T (chunks are): the tokens are group i0 / P16_T of the act16_t copy. */
static inline __attribute__((always_inline)) void panel16_tokens_z(const __m256i *panel, int64_t b0, int64_t b1, int64_t nb, int64_t K, const act16_t *a,
                                                                  int64_t i0, const int T, const int offs, int64_t n0, int nr,
                                                                  int64_t N, float *y, ahead_t *pf) {
    (void)K;
    __m512 f[P16_T];
    for (int t = 0; t < T; t++) f[t] = _mm512_setzero_ps();
    const int64_t g = i0 / P16_T;
    const int32_t *xg = a->xz + (g * nb + b0) * (P16_PAIRS * P16_T);
    const float *sg = a->sz + (g * nb + b0) * P16_T, *sxg = a->sxz + (g * nb + b0) * P16_T;
    for (int64_t b = b0; b < b1; b++, xg += P16_PAIRS * P16_T, sg += P16_T, sxg += P16_T) {
        const __m512i *pb = (const __m512i *)(panel + b * (P16_BLOCK / 32));
        ahead_some(pf);  /* a few lines a block: a pass of 8 tokens is long, and its ~30 lines at once stalled the loads */
        __m512i s[P16_T];
        {
            const __m512i w = _mm512_load_si512(pb);
            for (int t = 0; t < T; t++) s[t] = _mm512_madd_epi16(w, _mm512_set1_epi32(xg[t]));
        }
#pragma GCC unroll 15
        for (int p = 1; p < P16_PAIRS; p++) {
            const __m512i w = _mm512_load_si512(pb + p);
            for (int t = 0; t < T; t++) s[t] = _mm512_dpwssd_epi32(s[t], w, _mm512_set1_epi32(xg[p * P16_T + t]));
        }
        const float *sc = (const float *)(pb + P16_PAIRS);
        const __m512 dd = _mm512_load_ps(sc);
        for (int t = 0; t < T; t++) {
            f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]), _mm512_mul_ps(dd, _mm512_set1_ps(sg[t])), f[t]);
            if (offs) f[t] = _mm512_fmadd_ps(_mm512_load_ps(sc + 16), _mm512_set1_ps(sxg[t]), f[t]);
        }
    }
    const __mmask16 k = (__mmask16)((1u << nr) - 1);
    for (int t = 0; t < T; t++) {
        float *yt = y + (i0 + t) * N + n0;
        __m512 r = f[t];
        if (b0 != 0) r = _mm512_add_ps(_mm512_maskz_loadu_ps(k, yt), r);
        _mm512_mask_storeu_ps(yt, k, r);
    }
}

/* Group g's tokens of a into the copy (act16_t.xz, sz, sxz). */
static void act16_group(act16_t *a, int64_t M, int64_t K, int64_t g) {
    const int64_t nb = K / QK;
    for (int t = 0; t < P16_T; t++) {
        const int64_t i = g * P16_T + t;
        for (int64_t b = 0; b < nb; b++) {
            const int32_t *src = (const int32_t *)(a->v + i * K + b * QK);
            int32_t *dst = a->xz + (g * nb + b) * (P16_PAIRS * P16_T) + t;
            for (int p = 0; p < P16_PAIRS; p++) dst[p * P16_T] = i < M ? src[p] : 0;
            a->sz[(g * nb + b) * P16_T + t] = i < M ? a->s[i * nb + b] : 0.0f;
            a->sxz[(g * nb + b) * P16_T + t] = i < M ? a->sx[i * nb + b] : 0.0f;
        }
    }
}
#define P16_PASS(T, OFFS) panel16_tokens_z(panel, b0, b1, nb, K, a, i0, T, OFFS, n0, nr, N, y, pf)
#define P16_PF_UNITS(slices, step) ((slices) * (step))  /* prefetch portions per token pass: one a block */
#else
#define P16_PASS(T, OFFS) (ahead_some(pf), panel16_tokens(panel, b0, b1, nb, K, a, i0, T, OFFS, n0, nr, N, y))
#define P16_PF_UNITS(slices, step) (slices)
#endif

/* Tokens c0..c1 against the tile, K in equal slices of at most P16_SLICE blocks: a slice of the
 * panel (<= 22 KiB) stays in L1 while every token of the chunk passes over it (a whole panel of
 * K = 1,536, 54 KiB, was read from L2 for each 3 tokens: the down projection at 4,096 rows ran
 * at 0.94x the exact kernel, 1.23x sliced). Slice boundaries depend on K only, so a row's result
 * still does not depend on M. */
#define P16_SLICE 20

#define P16_CASE(n, OFFS) \
    case n:                \
        if ((n) < P16_T) P16_PASS((n) < P16_T ? (n) : 1, OFFS); \
        break;
#define P16_TOKENS(OFFS)                                                      \
    do {                                                                      \
        for (; i0 + P16_T <= c1; i0 += P16_T) P16_PASS(P16_T, OFFS);          \
        switch (c1 - i0) { P16_CASE(15, OFFS) P16_CASE(14, OFFS) P16_CASE(13, OFFS) P16_CASE(12, OFFS) \
                           P16_CASE(11, OFFS) P16_CASE(10, OFFS) P16_CASE(9, OFFS) P16_CASE(8, OFFS) \
                           P16_CASE(7, OFFS) P16_CASE(6, OFFS) P16_CASE(5, OFFS) P16_CASE(4, OFFS) \
                           P16_CASE(3, OFFS) P16_CASE(2, OFFS) P16_CASE(1, OFFS) default: break; } \
    } while (0)

static void panel16_range(const __m256i *panel, int64_t nb, int64_t K, const act16_t *a, int64_t c0, int64_t c1, int offs,
                          int64_t n0, int nr, int64_t N, float *y, ahead_t *pf) {
    const int64_t slices = (nb + P16_SLICE - 1) / P16_SLICE, step = (nb + slices - 1) / slices;
    for (int64_t b0 = 0; b0 < nb; b0 += step) {
        const int64_t b1 = b0 + step < nb ? b0 + step : nb;
        int64_t i0 = c0;
        if (offs) P16_TOKENS(1);
        else P16_TOKENS(0);
    }
}

/* Many rows: the activations rounded (rows split between the threads), then tiles of 16 weight
 * rows over token chunks whose int16 rows fit in half of L2; one parallel region per call (each
 * region costs a fork and a join, waits on a busy machine). */
static void gemm_i16_act_panel(const float *x, act16_t *a, int64_t M, int64_t K, int kind, const void *qs, const float *d,
                               const float *m, int64_t N, float *y, int nthreads) {
    const int64_t nb = K / QK, tiles = (N + P16_COLS - 1) / P16_COLS;
    int64_t chunk = (int64_t)(256 * 1024 / ((size_t)K * sizeof(int16_t))) / P16_T * P16_T;
    if (chunk < P16_T) chunk = P16_T;
    const int offs = kind != 8;
    const int64_t slices = (nb + P16_SLICE - 1) / P16_SLICE, step = (nb + slices - 1) / slices;
    const int64_t passes = P16_PF_UNITS(slices, step) * ((chunk < M ? chunk : M) + P16_T - 1) / P16_T;
#if defined(P16_ZMM)
    const int64_t groups = (M + P16_T - 1) / P16_T;
    act16_t az = *a;
    az.xz = (int32_t *)malloc((size_t)(groups * nb * P16_PAIRS * P16_T) * sizeof(int32_t));
    az.sz = (float *)malloc((size_t)(2 * groups * nb * P16_T) * sizeof(float));
    az.sxz = az.sz + groups * nb * P16_T;
    a = &az;
#endif
#pragma omp parallel num_threads(nthreads)
    {
        if (x) {  /* x NULL: a already holds the rounded rows (gemm_i16_pre) */
#pragma omp for schedule(static)
            for (int64_t i = 0; i < M; i++) quantize_act16(x + i * K, 1, K, a->v + i * K, a->s + i * nb, a->sx + i * nb);
        }
#if defined(P16_ZMM)
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) act16_group(&az, M, K, g);
#endif
        __m256i *panel = (__m256i *)aligned_alloc(64, (size_t)(nb * P16_BLOCK));  /* 64: the zmm pass loads a pair's 16 columns aligned */
        for (int64_t c0 = 0; c0 < M; c0 += chunk) {
            const int64_t c1 = c0 + chunk < M ? c0 + chunk : M;
#pragma omp for schedule(static) nowait
            for (int64_t tile = 0; tile < tiles; tile++) {
                const int64_t n0 = tile * P16_COLS;
                const int nr = (int)(N - n0 < P16_COLS ? N - n0 : P16_COLS);
                ahead_t pf = next_tile(kind, qs, d, m, n0 + P16_COLS, N, nb, passes);
                build_panel16(kind, qs, d, m, n0, nr, nb, panel);
                panel16_range(panel, nb, K, a, c0, c1, offs, n0, nr, N, y, &pf);
            }
        }
        free(panel);
    }
#if defined(P16_ZMM)
    free(az.xz);
    free(az.sz);
#endif
}

/* x [M, K] float32 -> y [M, N]: activations rounded to int16 per block, integer dot products. */
void gemm_i16_act(const float *x, int64_t M, int64_t K, int kind, const void *qs, const float *d, const float *m,
                  int64_t N, float *y, int nthreads) {
    const int64_t nb = K / QK;
    act16_t a = {(int16_t *)malloc((size_t)(M * K) * sizeof(int16_t)), (float *)malloc((size_t)(M * nb) * sizeof(float)),
                 (float *)malloc((size_t)(M * nb) * sizeof(float))};
    if (M < P16_MIN_M) {
        quantize_act16(x, M, K, a.v, a.s, a.sx);
        gemm_i16_rows(&a, M, K, kind, qs, d, m, N, y, nthreads);
    } else {
        gemm_i16_act_panel(x, &a, M, K, kind, qs, d, m, N, y, nthreads);
    }
    free(a.v); free(a.s); free(a.sx);
}

/* The same GEMM on rows quantize_act16 already rounded (v [M, K], s and sx [M, K/32]): the fused
 * LM head (head.c) rounds its rows once per call instead of once per vocabulary chunk. The same
 * integers and scales reach the same code, so every output keeps gemm_i16_act's bits. */
void gemm_i16_pre(const int16_t *v, const float *s, const float *sx, int64_t M, int64_t K, int kind, const void *qs, const float *d,
                  const float *m, int64_t N, float *y, int nthreads) {
    act16_t a = {(int16_t *)v, (float *)s, (float *)sx};
    if (M < P16_MIN_M) gemm_i16_rows(&a, M, K, kind, qs, d, m, N, y, nthreads);
    else gemm_i16_act_panel(0, &a, M, K, kind, qs, d, m, N, y, nthreads);
}
