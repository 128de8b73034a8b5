/* The AVX2 q5 widening (vec.h q5_widen_i16) against exact alternatives, per block, in L1.

    gcc -O3 -mavx2 -mfma -mf16c benchmarks/lowbit_q5_widen.c -o /tmp/q5w && /tmp/q5w

Each variant turns a q5 block (16 nibble bytes + a uint32 of fifth bits) into the same two int16
vectors (checked against "main" on 256 blocks), then two vpmaddwd + adds use them, as the rows
layout of kernels_i16.c does at one token. Thread CPU ns per block, best of 7 passes of 20,000 x
256 blocks. "main": vec.h's AVX2 branch as of 2026-12-02 (gcc loads each half of the mask with
vpbroadcastw from memory; 13 vector operations). "bytes": all 32 elements as bytes (a vpshufb
spreads the mask's bytes, and + compare + and make the fifth bits), then two widenings. "words":
vpshufb puts the mask byte of each int16 lane in place, then main's and + compare + and.
"mullo": a vpmullw moves bit j to bit 15 of lane j, two shifts to bit 4.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
static inline __attribute__((always_inline)) void w_main(const uint8_t *blk, __m256i *lo, __m256i *hi) {
    const __m256i both = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)blk));
    uint32_t qh; __builtin_memcpy(&qh, blk + 16, sizeof qh);
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, (short)0x8000);
    const __m256i h0 = _mm256_set1_epi16((short)(qh & 0xFFFF)), h1 = _mm256_set1_epi16((short)(qh >> 16)), s16 = _mm256_set1_epi16(16);
    *lo = _mm256_or_si256(_mm256_and_si256(both, _mm256_set1_epi16(0x0F)), _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h0, bit), bit), s16));
    *hi = _mm256_or_si256(_mm256_srli_epi16(both, 4), _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h1, bit), bit), s16));
}
static inline __attribute__((always_inline)) void w_bytes(const uint8_t *blk, __m256i *lo, __m256i *hi) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)blk);
    uint32_t qh; __builtin_memcpy(&qh, blk + 16, sizeof qh);
    const __m256i which = _mm256_setr_epi8(0,0,0,0,0,0,0,0,1,1,1,1,1,1,1,1,2,2,2,2,2,2,2,2,3,3,3,3,3,3,3,3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i sel = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), which), bit);
    const __m256i fifth = _mm256_and_si256(_mm256_cmpeq_epi8(sel, bit), _mm256_set1_epi8(16));
    const __m256i nib = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1), _mm256_set1_epi8(0x0F));
    const __m256i q = _mm256_or_si256(nib, fifth);
    *lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(q)); *hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1));
}
static inline __attribute__((always_inline)) void w_words(const uint8_t *blk, __m256i *lo, __m256i *hi) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)blk);
    uint32_t qh; __builtin_memcpy(&qh, blk + 16, sizeof qh);
    const __m256i at_lo = _mm256_setr_epi8(0,-1,0,-1,0,-1,0,-1,0,-1,0,-1,0,-1,0,-1,1,-1,1,-1,1,-1,1,-1,1,-1,1,-1,1,-1,1,-1);
    const __m256i at_hi = _mm256_setr_epi8(2,-1,2,-1,2,-1,2,-1,2,-1,2,-1,2,-1,2,-1,3,-1,3,-1,3,-1,3,-1,3,-1,3,-1,3,-1,3,-1);
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i both = _mm256_cvtepu8_epi16(raw), s16 = _mm256_set1_epi16(16), all = _mm256_set1_epi32((int)qh);
    const __m256i b0 = _mm256_and_si256(_mm256_shuffle_epi8(all, at_lo), bit), b1 = _mm256_and_si256(_mm256_shuffle_epi8(all, at_hi), bit);
    *lo = _mm256_or_si256(_mm256_and_si256(both, _mm256_set1_epi16(0x0F)), _mm256_and_si256(_mm256_cmpeq_epi16(b0, bit), s16));
    *hi = _mm256_or_si256(_mm256_srli_epi16(both, 4), _mm256_and_si256(_mm256_cmpeq_epi16(b1, bit), s16));
}
/* each half's bit j moved to bit 15 of lane j by a multiply, then to bit 4 by two shifts */
static inline __attribute__((always_inline)) void w_mullo(const uint8_t *blk, __m256i *lo, __m256i *hi) {
    uint32_t qh; __builtin_memcpy(&qh, blk + 16, sizeof qh);
    const __m256i both = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)blk));
    const __m256i mul = _mm256_setr_epi16(1<<15,1<<14,1<<13,1<<12,1<<11,1<<10,1<<9,1<<8,1<<7,1<<6,1<<5,1<<4,1<<3,1<<2,1<<1,1);
    const __m256i lo16 = _mm256_set1_epi16((short)qh), hi16 = _mm256_set1_epi16((short)(qh >> 16));
    *lo = _mm256_or_si256(_mm256_and_si256(both, _mm256_set1_epi16(0x0F)), _mm256_slli_epi16(_mm256_srli_epi16(_mm256_mullo_epi16(lo16, mul), 15), 4));
    *hi = _mm256_or_si256(_mm256_srli_epi16(both, 4), _mm256_slli_epi16(_mm256_srli_epi16(_mm256_mullo_epi16(hi16, mul), 15), 4));
}
#define NB 256
static uint8_t blocks[NB * 20];
static int16_t act[32];
#define BENCH(NAME, FN) static double NAME(int reps, __m256i *out) { \
    __m256i acc = _mm256_setzero_si256(); const __m256i a0 = _mm256_loadu_si256((const __m256i*)act), a1 = _mm256_loadu_si256((const __m256i*)(act+16)); \
    struct timespec t0, t1; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0); \
    for (int r = 0; r < reps; r++) { const uint8_t *base = blocks; __asm__ volatile("" : "+r"(base)); for (int b = 0; b < NB; b++) { __m256i lo, hi; FN(base + 20 * b, &lo, &hi); \
        acc = _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(lo, a0), _mm256_madd_epi16(hi, a1))); __asm__ volatile("" : "+x"(acc)); } } \
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1); *out = acc; return ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / ((double)reps * NB); }
BENCH(b_main, w_main) BENCH(b_bytes, w_bytes) BENCH(b_words, w_words) BENCH(b_mullo, w_mullo)
int main(void) {
    for (int i = 0; i < NB * 20; i++) blocks[i] = (uint8_t)(i * 2654435761u >> 13);
    for (int i = 0; i < 32; i++) act[i] = (int16_t)(i * 1000 - 15000);
    /* check equal */
    for (int b = 0; b < NB; b++) { __m256i l[4], h[4]; w_main(blocks + 20*b, &l[0], &h[0]); w_bytes(blocks+20*b,&l[1],&h[1]); w_words(blocks+20*b,&l[2],&h[2]); w_mullo(blocks+20*b,&l[3],&h[3]);
        for (int v = 1; v < 4; v++) if (memcmp(&l[0], &l[v], 32) || memcmp(&h[0], &h[v], 32)) { printf("variant %d differs at block %d\n", v, b); } }
    __m256i o; double best[4] = {1e9,1e9,1e9,1e9};
    for (int k = 0; k < 7; k++) { double t;
        t = b_main(20000, &o); if (t < best[0]) best[0] = t;
        t = b_bytes(20000, &o); if (t < best[1]) best[1] = t;
        t = b_words(20000, &o); if (t < best[2]) best[2] = t;
        t = b_mullo(20000, &o); if (t < best[3]) best[3] = t; }
    printf("ns per block: main %.3f bytes %.3f words %.3f mullo %.3f\n", best[0], best[1], best[2], best[3]);
    return 0;
}
