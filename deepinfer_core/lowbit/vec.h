/* Small AVX2 helpers shared by the low-bit C files (static inline: each file gets its copy). */
#ifndef DEEPINFER_LOWBIT_VEC_H
#define DEEPINFER_LOWBIT_VEC_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static inline float vec_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float vec_hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp of 8 floats: 2^n * e^r with n = round(x / ln 2), r = x - n ln 2 (in two parts), and the
 * Cephes degree-6 polynomial for e^r (about 1 ulp; a scalar expf per element cost ~10 ms per
 * 32-request step in SiLU alone). Inputs are clamped to where e^x is a finite float. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* Packed weight kinds (formats.py): 32-value blocks of q4 (16 bytes: element j in the low nibble
 * of byte j, element j + 16 in its high nibble), q5 (q4's 16 bytes, then a little-endian uint32
 * whose bit j is bit 4 of element j: ggml's Q5_0/Q5_1 bits) or q8 (32 int8). */
static inline __attribute__((always_inline)) int64_t lb_block_bytes(int kind) { return kind == 4 ? 16 : kind == 5 ? 20 : 32; }

/* A q5 block's 32 values (0..31) as int16: elements 0-15 in *lo, 16-31 in *hi. With AVX512-BW +
 * VL (the avx512vnni build) each half of the uint32 is a lane mask and one masked add puts 16 on the low bits;
 * in the AVX2 build each lane's bit is tested against a broadcast half (a compare gives all ones),
 * about 3x the instructions. The same integers either way. */
static inline __attribute__((always_inline)) void q5_widen_i16(const uint8_t *blk, __m256i *lo, __m256i *hi) {
    const __m256i both = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)blk));
    uint32_t qh;
    __builtin_memcpy(&qh, blk + 16, sizeof qh);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m256i s16 = _mm256_set1_epi16(16), l4 = _mm256_and_si256(both, _mm256_set1_epi16(0x0F)), h4 = _mm256_srli_epi16(both, 4);
    *lo = _mm256_mask_add_epi16(l4, (__mmask16)(qh & 0xFFFF), l4, s16);
    *hi = _mm256_mask_add_epi16(h4, (__mmask16)(qh >> 16), h4, s16);
#else
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, (short)0x8000);
    const __m256i h0 = _mm256_set1_epi16((short)(qh & 0xFFFF)), h1 = _mm256_set1_epi16((short)(qh >> 16)), s16 = _mm256_set1_epi16(16);
    *lo = _mm256_or_si256(_mm256_and_si256(both, _mm256_set1_epi16(0x0F)), _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h0, bit), bit), s16));
    *hi = _mm256_or_si256(_mm256_srli_epi16(both, 4), _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h1, bit), bit), s16));
#endif
}

/* Which activation kernel lowbit_gemm (kernels.c) runs for M rows: 8 (int8, opt-in for 4-bit
 * weights from int8_rows rows on; 0: never), 16 (int16, M <= int_rows) or 32 (exact float32).
 * head.c reads it too, to round its rows to int16 once when that is the choice. */
static inline int lb_act_kernel(int kind, int64_t M, int64_t int_rows, int64_t int8_rows) {
    if (kind == 4 && int8_rows > 0 && M >= int8_rows) return 8;
    return M <= int_rows ? 16 : 32;
}

/* KV cache elements (kv, a compile-time constant after inlining): KV_F32 float32; KV_F16 IEEE
 * half (F16C converts 8 at a time; round to nearest even on store, as torch's .to(torch.float16));
 * KV_I8 int8 codes of a row of n values followed, at the row's byte n, by its float32 scale
 * max|x| / 127 (symmetric: x ~ code * scale). kv_load8 / kv_load1 widen codes without the scale:
 * the callers multiply by kv_scale once per row (a key's dot product, a value's weight). Offsets
 * are in elements (bytes for KV_I8). The cache tensor of an int8 cache is int8 with a row width of
 * max(head_dim, v_head_dim) + 4, so a block's codes and scales lie together. */
#define KV_F32 0
#define KV_F16 1
#define KV_I8 2

static inline __attribute__((always_inline)) int64_t kv_esize(int kv) { return kv == KV_I8 ? 1 : kv == KV_F16 ? 2 : 4; }

/* bytes of a row of n values (the int8 row's scale included) */
static inline __attribute__((always_inline)) int64_t kv_row_bytes(int64_t n, int kv) { return kv == KV_I8 ? n + 4 : n * kv_esize(kv); }

static inline __attribute__((always_inline)) __m256 kv_load8(const void *p, int64_t i, int kv) {
    if (kv == KV_I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)p + i))));
    return kv ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))) : _mm256_loadu_ps((const float *)p + i);
}

static inline __attribute__((always_inline)) float kv_load1(const void *p, int64_t i, int kv) {
    if (kv == KV_I8) return (float)((const int8_t *)p)[i];
    return kv ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* the float32 scale of the int8 row whose codes start at element (byte) i and hold n values */
static inline __attribute__((always_inline)) float kv_scale(const void *p, int64_t i, int64_t n) {
    float s;
    __builtin_memcpy(&s, (const char *)p + i + n, sizeof s);
    return s;
}

/* n floats into a cache row of the element type kv (int8: codes, then the row's scale) */
static inline void kv_store(void *dst, const float *src, int64_t n, int kv) {
    if (kv == KV_I8) {
        float amax = 0.0f;
        for (int64_t i = 0; i < n; i++) amax = fabsf(src[i]) > amax ? fabsf(src[i]) : amax;
        const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int8_t *d = (int8_t *)dst;
        for (int64_t i = 0; i < n; i++) {
            const float c = nearbyintf(src[i] * inv);
            d[i] = (int8_t)(c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c);
        }
        __builtin_memcpy(d + n, &scale, sizeof scale);
        return;
    }
    if (!kv) {
        for (int64_t i = 0; i < n; i++) ((float *)dst)[i] = src[i];
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) d[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

/* 8 x 8 transpose of 32-bit lanes: r[c] = 8 pairs of row c -> r[p] = pair p of the 8 rows */
static inline void transpose8_epi32(__m256i *r) {
    const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    const __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
    const __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
    const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
    r[0] = _mm256_permute2x128_si256(u0, u4, 0x20); r[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
    r[2] = _mm256_permute2x128_si256(u2, u6, 0x20); r[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
    r[4] = _mm256_permute2x128_si256(u0, u4, 0x31); r[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
    r[6] = _mm256_permute2x128_si256(u2, u6, 0x31); r[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

#endif
