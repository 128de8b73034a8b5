/* A whole Llama-family decode step on the low-bit CPU path in one native call.
 *
 * Why: at one request a SmolLM2-135M decode step spent ~14 of ~40 ms dispatching ~2,800 small
 * torch ops (norms, rotary, views, SiLU-mul, residual adds, the attention wrapper), each costing
 * more host time than its arithmetic. Here every decoder layer of a step where each request
 * feeds one token runs as plain loops around the GEMMs of kernels.c and the paged attention of
 * attention.c (called through their C entry points, lowbit_gemm choosing the kernel by row count as
 * ops.matmul does, so both paths share the same arithmetic):
 *
 *   embed -> L x (rmsnorm -> qkv -> rotary -> KV write + paged attention -> o -> +res
 *                 -> rmsnorm -> gate|up -> silu(gate) * up -> down -> +res) -> final rmsnorm
 *
 * Elementwise maths follows the torch path's expressions operation by operation (this file is
 * compiled with FP contraction off (the pragmas below), so a*b + c is never fused into one rounding); only the
 * reductions (rmsnorm's sum of squares) and expf may differ from torch's by an ulp. The GEMMs
 * and decode attention are the very same functions the torch path calls. Prefill and mixed steps
 * (up to llama_decode.PREFILL_MAX_CONTEXT) run here too, a row per token: a call with prompt runs
 * attends with prefill_attention.c (the call's own keys and values in float32 by default); every
 * other model family keeps the torch path (deepinfer_core.lowbit.llama_decode decides).
 */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "vec.h"

/* kernels.c's entry points (one shared object: native.py compiles both files together) */
void lowbit_gemm(const float *x, int64_t M, int64_t K, int kind, const void *qs, const float *d, const float *m,
                 int64_t N, float *y, int nthreads, int64_t int_rows, int64_t int8_rows);
void paged_decode_attention(const float *q, const void *cache, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                            int64_t width, int64_t num_heads, int64_t head_dim, int64_t v_head_dim,
                            const int32_t *block_tables, int64_t max_blocks, const int64_t *positions, int64_t num_requests,
                            float scale, int64_t window, float *out, int nthreads, int kv);
/* prefill_attention.c's */
int64_t prefill_has_runs(const int64_t *positions, const int32_t *tables, int64_t max_blocks, int64_t R);
void prefill_attention(const float *q, const float *k, int64_t kstride, const float *v, int64_t vstride, const void *cache,
                       int64_t num_kv_heads, int64_t num_blocks, int64_t block_size, int64_t width, int64_t num_heads,
                       int64_t head_dim, const int32_t *block_tables, int64_t max_blocks, const int64_t *positions, int64_t R,
                       float scale, int64_t window, float *out, int nthreads, int kv, int mode);

#define MAX_SEGMENTS 4

typedef struct {        /* one packed weight segment: rows [n, k] in 32-blocks (kinds as kernels.c's) */
    int64_t kind;       /* 4, 5 or 8 */
    const void *qs;
    const float *d, *m; /* m: NULL for 8 bits */
    int64_t n;
} lb_segment;

typedef struct {        /* y = x W^T (+ bias), W = the segments stacked by rows */
    lb_segment seg[MAX_SEGMENTS];
    int64_t nseg, k, n;
    const float *bias;  /* NULL or [n] */
    int64_t int_rows;   /* the module's: calls of <= int_rows rows take the integer kernel */
    int64_t int8_rows;  /* the module's: 4-bit calls of >= int8_rows rows take int8 activations (0: never) */
} lb_linear;

typedef struct {
    const float *input_norm, *post_norm;  /* [D] */
    lb_linear qkv, o, gate_up, down;
    void *kv_cache;                       /* [2, Hkv, num_blocks, block_size, width], float32 or half */
} lb_layer;

typedef struct {
    int64_t num_layers, hidden, intermediate, heads, kv_heads, head_dim;
    float eps, scale;
    int64_t window;                                /* 0: full attention */
    int64_t num_blocks, block_size, width;         /* the paged cache's geometry */
    const float *cos, *sin;                        /* [max_positions, head_dim] */
    const float *final_norm;                       /* [D] */
    /* token embedding: dense float rows (embed_kind 0) or a packed weight (4 / 5 / 8) */
    int64_t embed_kind;
    const void *embed_qs;
    const float *embed_d, *embed_m;
    int64_t kv_kind;                               /* the cache's elements: vec.h's KV_F32 (0), KV_F16 (1), KV_I8 (2) */
    int64_t prefill_attn;                          /* calls with prompt runs: 0 the decode attention, 1 prefill_attention
                                                      reading the cache, 2 it with the call's keys and values in float32 */
} lb_model;

/* Scratch floats per request row; the caller allocates rows * this once and reuses it. */
int64_t llama_decode_scratch_per_row(const lb_model *md) {
    const int64_t D = md->hidden, I = md->intermediate, hd = md->head_dim;
    const int64_t qkv = (md->heads + 2 * md->kv_heads) * hd, attn = md->heads * hd;
    int64_t widest = qkv > 2 * I ? qkv : 2 * I;
    widest = widest > D ? widest : D;
    return 3 * D + qkv + 2 * attn + 2 * I + I + widest + md->kv_heads * hd + 64;
}

static void embed_row(const lb_model *md, int64_t id, float *out) {
    const int64_t D = md->hidden, nb = D / 32;
    if (md->embed_kind == 0) {
        memcpy(out, (const float *)md->embed_qs + id * D, (size_t)D * sizeof(float));
        return;
    }
    for (int64_t b = 0; b < nb; b++) {
        const float d = md->embed_d[id * nb + b];
        if (md->embed_kind == 8) {
            const int8_t *q = (const int8_t *)md->embed_qs + (id * nb + b) * 32;
            for (int j = 0; j < 32; j++) out[b * 32 + j] = (float)q[j] * d;
        } else if (md->embed_kind == 5) {
            const uint8_t *q = (const uint8_t *)md->embed_qs + (id * nb + b) * 20;
            const float m = md->embed_m[id * nb + b];
            uint32_t qh;
            memcpy(&qh, q + 16, sizeof qh);
            for (int j = 0; j < 16; j++) {
                out[b * 32 + j] = (float)((q[j] & 0x0F) | (((qh >> j) & 1) << 4)) * d + m;
                out[b * 32 + 16 + j] = (float)((q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) * d + m;
            }
        } else {
            const uint8_t *q = (const uint8_t *)md->embed_qs + (id * nb + b) * 16;
            const float m = md->embed_m[id * nb + b];
            for (int j = 0; j < 16; j++) {
                out[b * 32 + j] = (float)(q[j] & 0x0F) * d + m;
                out[b * 32 + 16 + j] = (float)(q[j] >> 4) * d + m;
            }
        }
    }
}

/* torch's float32 rms_norm: x * rsqrt(mean(x^2) + eps) * w, a row at a time */
static void rmsnorm(const float *x, const float *w, float eps, int64_t R, int64_t D, float *y) {
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * D;
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= D; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
        }
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
        float ss = _mm_cvtss_f32(s4);
        for (; i < D; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t j = 0; j < D; j++) y[r * D + j] = (xr[j] * inv) * w[j];
    }
}

/* Steps of at least this many rows split their elementwise stages (residual add + rmsnorm,
 * rotary + KV write, SiLU-mul) between the threads: on two threads those stages, run by one thread, left the other
 * core idle for ~2-3% of a 32-request step; a row is computed alone either way (same bits). */
#define PAR_ROWS 8

/* h += t (t NULL: no add), then y = rmsnorm(h) * w, a row at a time */
static void add_rmsnorm(float *h, const float *t, const float *w, float eps, int64_t R, int64_t D, float *y, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R >= PAR_ROWS)
    for (int64_t r = 0; r < R; r++) {
        if (t)
            for (int64_t j = 0; j < D; j++) h[r * D + j] = h[r * D + j] + t[r * D + j];
        rmsnorm(h + r * D, w, eps, 1, D, y + r * D);
    }
}

static void linear(const lb_linear *lin, const float *x, int64_t R, float *y, float *tmp, int nthreads) {
    if (lin->nseg == 1) {
        const lb_segment *s = &lin->seg[0];
        lowbit_gemm(x, R, lin->k, (int)s->kind, s->qs, s->d, s->m, s->n, y, nthreads, lin->int_rows, lin->int8_rows);
    } else {  /* segments of different formats: each into tmp, then into its columns */
        int64_t col = 0;
        for (int64_t i = 0; i < lin->nseg; i++) {
            const lb_segment *s = &lin->seg[i];
            lowbit_gemm(x, R, lin->k, (int)s->kind, s->qs, s->d, s->m, s->n, tmp, nthreads, lin->int_rows, lin->int8_rows);
            for (int64_t r = 0; r < R; r++) memcpy(y + r * lin->n + col, tmp + r * s->n, (size_t)s->n * sizeof(float));
            col += s->n;
        }
    }
    if (lin->bias)
        for (int64_t r = 0; r < R; r++)
            for (int64_t j = 0; j < lin->n; j++) y[r * lin->n + j] += lin->bias[j];
}

/* rotate-half (NeoX) rotary of one head: x * cos + cat(-x2, x1) * sin, as the torch path */
static void rotary(const float *x, const float *c, const float *s, int64_t hd, float *y) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) y[i] = x[i] * c[i] + (-x[i + half]) * s[i];
    for (int64_t i = half; i < hd; i++) y[i] = x[i] * c[i] + x[i - half] * s[i];
}

/* act = silu(gate) * up = gate / (1 + e^-gate) * up, a row of I at a time */
static void silu_mul(const float *gate, const float *up, int64_t I, float *act) {
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), _mm256_loadu_ps(up + i)));
    }
    for (; i < I; i++) act[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* Process CPU time in ms, for the optional split of a step (benchmarks/cpu/cpu_step_profile.py). */
static double cpu_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

#define TICK(phase) do { if (phase_ms) { const double now_ = cpu_ms(); phase_ms[last_phase] += now_ - last_ms; last_ms = now_; last_phase = (phase); } } while (0)

/* h_out [R, D]: the final-normed hidden state of each request's new token. phase_ms: NULL, or
 * 3 doubles that gain the step's CPU ms in the GEMMs, the attention (rotary, KV write, paged
 * attention) and everything else (embedding, norms, residuals, SiLU-mul). */
void llama_decode_step(const lb_model *md, const lb_layer *layers, const int64_t *ids, const int64_t *positions,
                       const int64_t *slots, const int32_t *block_tables, int64_t max_blocks, int64_t R,
                       float *scratch, float *h_out, int nthreads, double *phase_ms) {
    double last_ms = phase_ms ? cpu_ms() : 0.0;
    int last_phase = 2;
    const int64_t D = md->hidden, I = md->intermediate, H = md->heads, Hkv = md->kv_heads, hd = md->head_dim;
    const int64_t nqkv = (H + 2 * Hkv) * hd, nattn = H * hd;
    float *h = scratch, *xn = h + R * D, *t = xn + R * D, *qkv = t + R * D, *q = qkv + R * nqkv;
    float *attn = q + R * nattn, *gu = attn + R * nattn, *act = gu + R * 2 * I, *tmp = act + R * I;
    const int64_t widest = nqkv > 2 * I ? (nqkv > D ? nqkv : D) : (2 * I > D ? 2 * I : D);  /* as llama_decode_scratch_per_row */
    float *kr = tmp + R * widest;  /* [R, Hkv, hd]: the rows' rotated keys in float32 */
    const int prefill = md->prefill_attn && hd % 32 == 0 && prefill_has_runs(positions, block_tables, max_blocks, R);
    for (int64_t r = 0; r < R; r++) embed_row(md, ids[r], h + r * D);
    const int64_t plane = Hkv * md->num_blocks * md->block_size * md->width;
    const int kv = (int)md->kv_kind, esize = (int)kv_esize(kv);  /* vec.h's KV_F32 / KV_F16 / KV_I8 */
    for (int64_t l = 0; l < md->num_layers; l++) {
        const lb_layer *ly = &layers[l];
        add_rmsnorm(h, l ? t : NULL, ly->input_norm, md->eps, R, D, xn, nthreads);  /* the last layer's residual, then the norm */
        TICK(0);
        linear(&ly->qkv, xn, R, qkv, tmp, nthreads);
        TICK(1);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R >= PAR_ROWS)  /* rows own their slots and kr rows */
        for (int64_t r = 0; r < R; r++) {
            const float *c = md->cos + positions[r] * hd, *s = md->sin + positions[r] * hd;
            const float *row = qkv + r * nqkv;
            for (int64_t head = 0; head < H; head++) rotary(row + head * hd, c, s, hd, q + (r * H + head) * hd);
            for (int64_t kh = 0; kh < Hkv; kh++) {  /* the new key (rotated) and value into the cache */
                const int64_t at = (kh * md->num_blocks * md->block_size + slots[r]) * md->width;
                float *key = kr + (r * Hkv + kh) * hd;
                rotary(row + (H + kh) * hd, c, s, hd, key);
                kv_store((char *)ly->kv_cache + at * esize, key, hd, kv);
                kv_store((char *)ly->kv_cache + (at + plane) * esize, row + (H + Hkv + kh) * hd, hd, kv);
            }
        }
        if (prefill)
            prefill_attention(q, kr, Hkv * hd, qkv + (H + Hkv) * hd, nqkv, ly->kv_cache, Hkv, md->num_blocks, md->block_size, md->width,
                              H, hd, block_tables, max_blocks, positions, R, md->scale, md->window, attn, nthreads, kv,
                              (int)md->prefill_attn);
        else
            paged_decode_attention(q, ly->kv_cache, Hkv, md->num_blocks, md->block_size, md->width, H, hd, hd, block_tables, max_blocks,
                                   positions, R, md->scale, md->window, attn, nthreads, kv);
        TICK(0);
        linear(&ly->o, attn, R, t, tmp, nthreads);
        TICK(2);
        add_rmsnorm(h, t, ly->post_norm, md->eps, R, D, xn, nthreads);
        TICK(0);
        linear(&ly->gate_up, xn, R, gu, tmp, nthreads);
        TICK(2);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R >= PAR_ROWS)
        for (int64_t r = 0; r < R; r++) silu_mul(gu + r * 2 * I, gu + r * 2 * I + I, I, act + r * I);
        TICK(0);
        linear(&ly->down, act, R, t, tmp, nthreads);
        TICK(2);
    }
    add_rmsnorm(h, md->num_layers ? t : NULL, md->final_norm, md->eps, R, D, h_out, nthreads);
    TICK(2);
}
