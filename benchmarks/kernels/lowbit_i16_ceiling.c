/* The multiply-add ceiling of kernels_i16.c's panel on this CPU, one thread, no memory traffic.
 *
 *     cc -O2 -mavx2 -mfma -o /tmp/ceiling benchmarks/kernels/lowbit_i16_ceiling.c && /tmp/ceiling
 *     cc -O2 -mavx2 -mfma -mavx512f -mavx512vl -mavx512vnni -o /tmp/ceiling benchmarks/kernels/lowbit_i16_ceiling.c && /tmp/ceiling
 *
 * Why: the panel's block sums are vpmaddwd products each added into an int32 accumulator (no
 * VNNI on AVX2), so the bound is the pair, not vpmaddwd alone. Prints G instructions per second
 * of thread CPU time for vpmaddwd alone, vfmadd231ps alone, vpaddd alone (12 independent
 * registers each), and vpmaddwd + the vpaddd accumulating it (6 pairs a loop); x 32 gives
 * GFLOP/s for the int16 pair (16 multiply-adds). benchmarks/README.md (cpu12) has the readings.
 * Built with AVX512-VNNI (second line), also vpdpwssd (the pair in one instruction) on ymm and on
 * zmm (12 independent accumulators), and on ymm with 8, 6, 4 and 1 accumulators: its latency
 * decides how many a kernel needs (benchmarks/README.md, cpuvnni). Then (mixes) the pair beside
 * other operations, and with its adds one iteration late (benchmarks/README.md, avx2gemm).
 */
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CLOBBER "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10", "ymm11", "ymm12", "ymm13", "ymm14", "ymm15", "cc"
#define ALONE(op) __asm__ volatile("vpxor %%ymm15, %%ymm15, %%ymm15\n1:\n" \
    op " %%ymm15, %%ymm0, %%ymm0\n" op " %%ymm15, %%ymm1, %%ymm1\n" op " %%ymm15, %%ymm2, %%ymm2\n" op " %%ymm15, %%ymm3, %%ymm3\n" \
    op " %%ymm15, %%ymm4, %%ymm4\n" op " %%ymm15, %%ymm5, %%ymm5\n" op " %%ymm15, %%ymm6, %%ymm6\n" op " %%ymm15, %%ymm7, %%ymm7\n" \
    op " %%ymm15, %%ymm8, %%ymm8\n" op " %%ymm15, %%ymm9, %%ymm9\n" op " %%ymm15, %%ymm10, %%ymm10\n" op " %%ymm15, %%ymm11, %%ymm11\n" \
    "dec %0\njnz 1b\n" : "+r"(n) : : CLOBBER)
#define PAIRS __asm__ volatile("1:\n" \
    "vpmaddwd %%ymm15, %%ymm14, %%ymm0\nvpmaddwd %%ymm15, %%ymm13, %%ymm1\nvpaddd %%ymm0, %%ymm2, %%ymm2\nvpaddd %%ymm1, %%ymm3, %%ymm3\n" \
    "vpmaddwd %%ymm15, %%ymm12, %%ymm4\nvpmaddwd %%ymm15, %%ymm11, %%ymm5\nvpaddd %%ymm4, %%ymm6, %%ymm6\nvpaddd %%ymm5, %%ymm7, %%ymm7\n" \
    "vpmaddwd %%ymm15, %%ymm10, %%ymm8\nvpmaddwd %%ymm15, %%ymm9, %%ymm0\nvpaddd %%ymm8, %%ymm2, %%ymm2\nvpaddd %%ymm0, %%ymm3, %%ymm3\n" \
    "dec %0\njnz 1b\n" : "+r"(n) : : CLOBBER)

/* What else shares the pair's pipes: 24 pairs (products into 2 scratch registers, 4 sums), then
 * the same with 12 float / integer operations on 6 other registers mixed in (time ratio to the
 * pairs alone: ~1.1 for an operation on other pipes, more where it takes the pair's); and the
 * pair with each add consuming the product of one iteration before (as software pipelining
 * would) instead of the one just made (benchmarks/README.md, avx2gemm). */
#define MIXCL "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10", "ymm11", "ymm12", "ymm13", "ymm14", "ymm15", "cc"
#define MIX(body) __asm__ volatile("1:\n" body "dec %0\njnz 1b\n" : "+r"(n) : : MIXCL)
#define PR(t, a, s) "vpmaddwd %%ymm15, %%ymm" #s ", %%ymm" #t "\nvpaddd %%ymm" #t ", %%ymm" #a ", %%ymm" #a "\n"
#define P12 PR(0, 2, 12) PR(1, 3, 13) PR(0, 4, 12) PR(1, 5, 13) PR(0, 2, 12) PR(1, 3, 13) \
            PR(0, 4, 12) PR(1, 5, 13) PR(0, 2, 12) PR(1, 3, 13) PR(0, 4, 12) PR(1, 5, 13)
#define X6(op) op " %%ymm14, %%ymm12, %%ymm6\n" op " %%ymm14, %%ymm12, %%ymm7\n" op " %%ymm14, %%ymm12, %%ymm8\n" \
               op " %%ymm14, %%ymm12, %%ymm9\n" op " %%ymm14, %%ymm12, %%ymm10\n" op " %%ymm14, %%ymm12, %%ymm11\n"
#define CV6 "vcvtdq2ps %%ymm12, %%ymm6\nvcvtdq2ps %%ymm13, %%ymm7\nvcvtdq2ps %%ymm12, %%ymm8\n" \
            "vcvtdq2ps %%ymm13, %%ymm9\nvcvtdq2ps %%ymm12, %%ymm10\nvcvtdq2ps %%ymm13, %%ymm11\n"
#define LATE(t, a) "vpaddd %%ymm" #t ", %%ymm" #a ", %%ymm" #a "\nvpmaddwd %%ymm15, %%ymm14, %%ymm" #t "\n"
#define NOW2(t, a) "vpmaddwd %%ymm15, %%ymm14, %%ymm" #t "\nvpaddd %%ymm" #t ", %%ymm" #a ", %%ymm" #a "\n"

static void mixes(long loops) {
    long n;
    double t, base;
    n = loops; t = now(); MIX(P12 P12); base = now() - t;
    printf("24 pairs %.2f G pairs/s; + 12 of: vfmadd231ps", 24 * loops / base / 1e9);
    n = loops; t = now(); MIX(P12 X6("vfmadd231ps") P12 X6("vfmadd231ps")); t = now() - t;
    printf(" x%.2f", t / base);
    n = loops; t = now(); MIX(P12 X6("vmulps") P12 X6("vmulps")); t = now() - t;
    printf(", vmulps x%.2f", t / base);
    n = loops; t = now(); MIX(P12 X6("vaddps") P12 X6("vaddps")); t = now() - t;
    printf(", vaddps x%.2f", t / base);
    n = loops; t = now(); MIX(P12 CV6 P12 CV6); t = now() - t;
    printf(", vcvtdq2ps x%.2f", t / base);
    n = loops; t = now(); MIX(P12 X6("vpaddd") P12 X6("vpaddd")); t = now() - t;
    printf(", vpaddd x%.2f | ", t / base);
    n = loops; t = now(); MIX(NOW2(0, 8) NOW2(1, 9) NOW2(2, 10) NOW2(3, 11) NOW2(4, 12) NOW2(5, 13) NOW2(6, 8) NOW2(7, 9)); t = now() - t;
    printf("pairs, add of this product %.2f G/s", 8 * loops / t / 1e9);
    n = loops; t = now(); MIX(LATE(0, 8) LATE(1, 9) LATE(2, 10) LATE(3, 11) LATE(4, 12) LATE(5, 13) LATE(6, 8) LATE(7, 9)); t = now() - t;
    printf(", of the product before %.2f G/s\n", 8 * loops / t / 1e9);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DP(r, i) "vpdpwssd %%" r "15, %%" r "14, %%" r #i "\n"
#define CHAINS(n, body) __asm__ volatile("vpxor %%xmm15, %%xmm15, %%xmm15\n1:\n" body "dec %0\njnz 1b\n" : "+r"(n) : : CLOBBER)
#define C12(r) DP(r, 0) DP(r, 1) DP(r, 2) DP(r, 3) DP(r, 4) DP(r, 5) DP(r, 6) DP(r, 7) DP(r, 8) DP(r, 9) DP(r, 10) DP(r, 11)
#define C8 DP("ymm", 0) DP("ymm", 1) DP("ymm", 2) DP("ymm", 3) DP("ymm", 4) DP("ymm", 5) DP("ymm", 6) DP("ymm", 7)
#define C6 DP("ymm", 0) DP("ymm", 1) DP("ymm", 2) DP("ymm", 3) DP("ymm", 4) DP("ymm", 5)
#define C4 DP("ymm", 0) DP("ymm", 1) DP("ymm", 2) DP("ymm", 3)
#define C1 DP("ymm", 0)

static void vnni(long loops) {
    long n;
    double t;
    n = loops; t = now(); CHAINS(n, C12("ymm")); t = now() - t;
    printf("vpdpwssd ymm %.2f G/s (%.0f GFLOP/s) | ", 12 * loops / t / 1e9, 32 * 12 * loops / t / 1e9);
    n = loops; t = now(); CHAINS(n, C12("zmm")); t = now() - t;
    printf("zmm %.2f G/s (%.0f GFLOP/s) | ymm chains:", 12 * loops / t / 1e9, 64 * 12 * loops / t / 1e9);
    n = loops; t = now(); CHAINS(n, C8 C8); t = now() - t;
    printf(" 8: %.2f", 16 * loops / t / 1e9);
    n = loops; t = now(); CHAINS(n, C6 C6); t = now() - t;
    printf(" 6: %.2f", 12 * loops / t / 1e9);
    n = loops; t = now(); CHAINS(n, C4 C4); t = now() - t;
    printf(" 4: %.2f", 8 * loops / t / 1e9);
    n = loops; t = now(); CHAINS(n, C1 C1 C1 C1); t = now() - t;
    printf(" 1: %.2f G/s\n", 4 * loops / t / 1e9);
}
#endif

int main(void) {
    const long loops = 50000000;
    for (int round = 0; round < 3; round++) {
        long n;
        double t;
        n = loops; t = now(); ALONE("vpmaddwd"); t = now() - t;
        printf("vpmaddwd alone %.2f G/s | ", 12 * loops / t / 1e9);
        n = loops; t = now(); ALONE("vfmadd231ps"); t = now() - t;
        printf("vfmadd231ps alone %.2f G/s | ", 12 * loops / t / 1e9);
        n = loops; t = now(); ALONE("vpaddd"); t = now() - t;
        printf("vpaddd alone %.2f G/s | ", 12 * loops / t / 1e9);
        n = loops; t = now(); PAIRS; t = now() - t;
        printf("vpmaddwd + vpaddd %.2f G pairs/s (%.0f GFLOP/s)\n", 6 * loops / t / 1e9, 32 * 6 * loops / t / 1e9);
        mixes(loops / 2);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        vnni(loops);
#endif
    }
    return 0;
}
