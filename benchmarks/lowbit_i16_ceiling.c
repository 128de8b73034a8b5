/* The multiply-add ceiling of kernels_i16.c's panel on this CPU, one thread, no memory traffic.
 *
 *     cc -O2 -mavx2 -mfma -o /tmp/ceiling benchmarks/lowbit_i16_ceiling.c && /tmp/ceiling
 *
 * Why: the panel's block sums are vpmaddwd products each added into an int32 accumulator (no
 * VNNI on AVX2), so the bound is the pair, not vpmaddwd alone. Prints G instructions per second
 * of thread CPU time for vpmaddwd alone, vfmadd231ps alone, vpaddd alone (12 independent
 * registers each), and vpmaddwd + the vpaddd accumulating it (6 pairs a loop); x 32 gives
 * GFLOP/s for the int16 pair (16 multiply-adds). benchmarks/README.md (cpu12) has the readings.
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
    }
    return 0;
}
