/* A decode step's expert products in one parallel region, as vLLM's CPU fused MoE runs them
 * (kit/engine/layers/expert_kernel.py builds this file with the machine's C compiler, for the
 * machine it runs on, and calls it through ctypes).
 *
 * rows [P, K] float32, sorted by expert; experts [P] int64, each row's expert; weights
 * [E, N, K] float32, or bfloat16 as its bits; out [P, N] float32:
 *     out[p] = weights[experts[p]] · rows[p]
 * An expert's rows form a group. A task is R output rows of one group, and the threads share
 * the tasks out. A task reads its R weight rows side by side (R streams for the memory system
 * to fetch at once), each once from memory and again from cache for the group's further rows:
 * a step reads each picked expert's bytes once and an expert no row picked never. Where a group
 * has several rows (a dense layer's decode batch: one group), each weight vector loaded serves
 * PT rows at once, which takes a batch of 8 from 13 to 17 GB/s on a 2-core AVX2 CPU (compute,
 * not memory, bounds it there); every sum runs in the same order as a single row's.
 *
 * bfloat16: a bf16 is the top half of a float32, so a 32-bit load of two of them gives the odd
 * one with the low half masked off and the even one shifted up; the row is multiplied in the
 * same order (each block of 2·VB elements: its VB even ones, then its VB odd ones). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifndef VB
#if defined(__AVX512F__)
#define VB 16 /* float32 lanes of the machine's vectors */
#else
#define VB 8
#endif
#endif
#define R 8   /* weight rows a task reads side by side */
#define RT 4  /* a tile's weight rows where a task multiplies several rows of its group */
#define PT 3  /* and how many rows at once: RT·PT sums and PT rows in 16 vector registers */
typedef float vf __attribute__((vector_size(VB * 4)));
typedef uint32_t vu __attribute__((vector_size(VB * 4)));

static inline vf load(const void* p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vu load_bits(const void* p) { vu v; memcpy(&v, p, sizeof v); return v; }
static inline vf as_float(vu u) { vf v; memcpy(&v, &u, sizeof v); return v; }
static inline float bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline float hsum(vf v) { float s = 0; for (int i = 0; i < VB; i++) s += v[i]; return s; }

int expert_products_lanes(void) { return VB; }

static int64_t group_starts(const int64_t* experts, int64_t P, int64_t* starts) {
    int64_t G = 0;
    for (int64_t p = 0; p < P; p++)
        if (p == 0 || experts[p] != experts[p - 1]) starts[G++] = p;
    starts[G] = P;
    return G;
}

/* One tile: nr weight rows w times np rows x, over the whole of K: out[q * N + r] for q < np,
 * r < nr (each product summed in the same order whatever the tile's shape) */
static inline __attribute__((always_inline)) void tile_f32(
        const float* w, const float* x, float* out, int nr, int np, int64_t N, int64_t K) {
    int64_t kv = K - K % VB;
    vf a[R][PT];
    _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++)
        _Pragma("GCC unroll 4") for (int q = 0; q < np; q++) a[r][q] = (vf){0};
    for (int64_t k = 0; k < kv; k += VB) {
        vf xv[PT];
        _Pragma("GCC unroll 4") for (int q = 0; q < np; q++) xv[q] = load(x + q * K + k);
        _Pragma("GCC unroll 8") for (int r = 0; r < nr; r++) {
            vf wv = load(w + r * K + k);
            _Pragma("GCC unroll 4") for (int q = 0; q < np; q++) a[r][q] += wv * xv[q];
        }
    }
    for (int r = 0; r < nr; r++)
        for (int q = 0; q < np; q++) {
            float s = hsum(a[r][q]);
            for (int64_t k = kv; k < K; k++) s += w[r * K + k] * x[q * K + k];
            out[q * N + r] = s;
        }
}

/* One task: R (or, at the end of N, nr) weight rows w times the rows x[p0..p1): PT rows at a
 * time where there are that many (a tile of RT weight rows each), then 2, then 1 */
static inline __attribute__((always_inline)) void task_f32(
        const float* w, const float* rows, float* out, int64_t p0, int64_t p1, int64_t n,
        int nr, int64_t N, int64_t K) {
    for (int64_t p = p0; p < p1;) {
        const float* x = rows + p * K;
        float* o = out + p * N + n;
        if (nr == R && p1 - p >= PT) {
            for (int h = 0; h < R; h += RT) tile_f32(w + h * K, x, o + h, RT, PT, N, K);
            p += PT;
        } else if (nr == R && p1 - p >= 2) {
            for (int h = 0; h < R; h += RT) tile_f32(w + h * K, x, o + h, RT, 2, N, K);
            p += 2;
        } else {
            tile_f32(w, x, o, nr, 1, N, K);
            p += 1;
        }
    }
}

static void tasks_f32(const void* w, const float* rows, float* out, int64_t p0, int64_t p1,
                      int64_t n, int64_t N, int64_t K) {
    if (N - n >= R) task_f32(w, rows, out, p0, p1, n, R, N, K);  /* R: unrolled */
    else task_f32(w, rows, out, p0, p1, n, N - n, N, K);
}

static inline __attribute__((always_inline)) void task_bf16(
        const uint16_t* w, const float* rows, float* out, int64_t p0, int64_t p1, int64_t n,
        int nr, int64_t N, int64_t K) {
    int64_t kv = K - K % (2 * VB);
    const vu high = (vu){0} + 0xFFFF0000u;
    for (int64_t p = p0; p < p1; p++) {
        const float* x = rows + p * K;
        vf a[R], b[R];
        for (int r = 0; r < nr; r++) a[r] = b[r] = (vf){0};
        for (int64_t k = 0; k < kv; k += 2 * VB) {
            vf even = load(x + k), odd = load(x + k + VB);
            for (int r = 0; r < nr; r++) {
                vu u = load_bits(w + r * K + k);
                a[r] += as_float(u << 16) * even;
                b[r] += as_float(u & high) * odd;
            }
        }
        for (int r = 0; r < nr; r++) {
            float s = hsum(a[r] + b[r]);
            for (int64_t k = kv; k < K; k++) s += bf16(w[r * K + k]) * x[k];
            out[p * N + n + r] = s;
        }
    }
}

static void tasks_bf16(const void* w, const float* rows, float* out, int64_t p0, int64_t p1,
                       int64_t n, int64_t N, int64_t K) {
    if (N - n >= R) task_bf16(w, rows, out, p0, p1, n, R, N, K);
    else task_bf16(w, rows, out, p0, p1, n, N - n, N, K);
}

typedef void task_fn(const void* w, const float* rows, float* out, int64_t p0, int64_t p1,
                     int64_t n, int64_t N, int64_t K);

/* Every task of every group, shared out among the threads: one parallel region. */
static void run_tasks(task_fn* task, const float* rows, const int64_t* experts,
                      const char* weights, int64_t element, float* out, int64_t P, int64_t N,
                      int64_t K) {
    int64_t starts[P + 1], G = group_starts(experts, P, starts), blocks = (N + R - 1) / R;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < G * blocks; t++) {
        int64_t g = t / blocks, n = t % blocks * R;
        task(weights + (experts[starts[g]] * N + n) * K * element, rows, out, starts[g],
             starts[g + 1], n, N, K);
    }
}

void expert_products_f32(const float* rows, const int64_t* experts, const float* weights,
                         float* out, int64_t P, int64_t N, int64_t K) {
    run_tasks(tasks_f32, rows, experts, (const char*)weights, 4, out, P, N, K);
}

void expert_products_bf16(const float* rows, const int64_t* experts, const uint16_t* weights,
                          float* out, int64_t P, int64_t N, int64_t K) {
    int64_t kv = K - K % (2 * VB);
    float* xs = malloc(sizeof(float) * (P * K + 1)); /* the rows, each block even then odd */
    for (int64_t p = 0; p < P; p++) {
        const float* x = rows + p * K;
        float* y = xs + p * K;
        for (int64_t k = 0; k < kv; k += 2 * VB)
            for (int i = 0; i < VB; i++) { y[k + i] = x[k + 2 * i]; y[k + VB + i] = x[k + 2 * i + 1]; }
        for (int64_t k = kv; k < K; k++) y[k] = x[k];
    }
    run_tasks(tasks_bf16, xs, experts, (const char*)weights, 2, out, P, N, K);
    free(xs);
}
