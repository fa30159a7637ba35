/* float32 panel kernels of packed_linear.c: out = x @ W.T (+ bias) against a weight packed
 * once at load, and the loop over panels and threads that the bfloat16 kernels share.
 *
 * Layout: the dense weight W [N, K] is packed into panels of P = 2 * W output columns (32
 * with AVX-512, 16 with AVX2), each panel K rows of P contiguous floats:
 * packed[N_pad / P][K][P], N_pad = N rounded up to P, the padding columns zero. One panel is
 * read from memory once per chunk of rows and stays in L2 while every block of rows of the
 * chunk multiplies it.
 *
 * A block is MB rows of x times one panel, MB * 2 accumulator vectors in registers (MB = 12
 * with AVX-512's 32 registers, 6 with AVX2's 16): per k, two weight vectors are loaded and
 * each of the MB x[m][k] is broadcast into two FMAs. Rows past the last full block go in
 * blocks of 4, then 1. At decode's row counts (one row per running request) this streams the
 * weights once at the FMA rate, where oneDNN's packed kernel is slower.
 *
 * Threads split the panels of a chunk (OpenMP, the team torch uses). Rows are taken in
 * chunks of ROW_CHUNK so that a chunk of x stays in L2 across the panels.
 *
 * Decode-sized inputs are bound by streaming the weights from memory. The hardware
 * prefetcher stops at every 4 KB page and the FMAs waiting on a load fill the out-of-order
 * window, so the first block of each panel (the one that reads it from memory; later blocks
 * of the same panel find it in L2) prefetches into L2 the weights PREFETCH_BYTES ahead of
 * the k-row it multiplies, running on into the thread's next panel, up to the end of the
 * thread's panels: a steady distance beat prefetching the whole next panel from the first
 * block.
 *
 * With several full blocks (MB rows) per panel, the later ones prefetch the next panel
 * between them, the i-th of n every k-row with k % n == i: the memory stays busy while they
 * multiply from L2. Shorter later blocks do not: their few FMAs per k-row cannot hide a
 * prefetched row. AVX2 builds leave it out: their block has half the FMAs per k-row, and on
 * an AVX2-only AMD EPYC the test and the division per k-row, or a prefetch every k-row
 * instead (AMD's prefetcht1 fills L1 too, over the panel being read), cost more than the
 * prefetch saved. The first block's prefetch stays there too.
 *
 * A block's accumulators are a fixed-size array (MB rows), of which it uses R: with R as the
 * array's bound, GCC made it a variable-length array on the stack, and every FMA loaded and
 * stored its accumulator.
 *
 * Each choice above was measured on SmolLM2-135M's matmuls, with decode steps of `python -m
 * bench.bench_one_batch --batch-size 1 4 16 32 64` (one row per request). */

#ifndef RADIXRT_PANELS_H
#define RADIXRT_PANELS_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define NB 2
#define P (NB * W)
#if W == 16
#define MB 12
#else
#define MB 6
#endif
#define ROW_CHUNK 1024
#define PREFETCH_BYTES 4096

/* Rows [0, R) of x (row stride ldx) times one panel; writes columns [0, n) of the panel's
 * part of out (row stride ldo), n <= P (the last panel may be partial), adding bias if any.
 * Prefetches, if `limit` is set, PREFETCH_BYTES ahead up to `limit`; else, if `next` is
 * set, the next panel's k-rows with k % every == phase. */
static inline __attribute__((always_inline)) void block(const float *x, int64_t ldx,
                                                        const float *panel, int K,
                                                        const float *bias, int n, float *out,
                                                        int64_t ldo, const char *limit,
                                                        const float *next, int every,
                                                        int phase, const int R) {
    vf acc[MB][NB];
    for (int m = 0; m < R; m++)
        for (int j = 0; j < NB; j++) acc[m][j] = (vf){0};
    for (int k = 0; k < K; k++) {
        vf w[NB];
        if (limit != NULL) {
            const char *ahead = (const char *)(panel + (int64_t)k * P) + PREFETCH_BYTES;
            if (ahead < limit)
                for (int j = 0; j < NB; j++) __builtin_prefetch(ahead + 4 * W * j, 0, 2);
        } else if (next != NULL && k % every == phase) {
            for (int j = 0; j < NB; j++) __builtin_prefetch(next + (int64_t)k * P + W * j, 0, 2);
        }
        for (int j = 0; j < NB; j++) w[j] = load_f32(panel + (int64_t)k * P + W * j);
        for (int m = 0; m < R; m++) {
            const float xv = x[m * ldx + k];
            for (int j = 0; j < NB; j++) acc[m][j] += xv * w[j];
        }
    }
    vf b[NB];
    for (int j = 0; j < NB; j++) b[j] = bias != NULL && n == P ? load_f32(bias + W * j) : (vf){0};
    for (int m = 0; m < R; m++) {
        if (n == P) {
            for (int j = 0; j < NB; j++) store_f32(out + m * ldo + W * j, acc[m][j] + b[j]);
        } else {
            float row[P];
            for (int j = 0; j < NB; j++) store_f32(row + W * j, acc[m][j]);
            for (int c = 0; c < n; c++) out[m * ldo + c] = row[c] + (bias != NULL ? bias[c] : 0.f);
        }
    }
}

static void panel_rows(const void *xv, int64_t ldx, const void *panel, const void *limit, int K,
                       const void *bias, int n, void *outv, int64_t ldo, int rows) {
    const float *x = xv;
    float *out = outv;
    const char *ahead = limit; /* the first block prefetches ahead; NULL after it */
#if W == 16
    const float *next = (const float *)panel + (int64_t)K * P;
    if ((const char *)next >= (const char *)limit) next = NULL; /* the thread's last panel */
#else
    const float *next = NULL; /* AVX2: later blocks do not prefetch (the header says why) */
#endif
    const int later = rows / MB - 1; /* full blocks after the first, sharing `next` */
    int m = 0;
#if W == 16
    if (rows >= 8 && rows < MB) {
        block(x, ldx, panel, K, bias, n, out, ldo, ahead, NULL, 1, 0, 8);
        m = 8, ahead = NULL;
    }
#endif
    for (int i = -1; m + MB <= rows; m += MB, ahead = NULL, i++)
        block(x + m * ldx, ldx, panel, K, bias, n, out + m * ldo, ldo, ahead, next, later, i, MB);
    for (; m + 4 <= rows; m += 4, ahead = NULL)
        block(x + m * ldx, ldx, panel, K, bias, n, out + m * ldo, ldo, ahead, NULL, 1, 0, 4);
    for (; m < rows; m++, ahead = NULL)
        block(x + m * ldx, ldx, panel, K, bias, n, out + m * ldo, ldo, ahead, NULL, 1, 0, 1);
}

/* One dtype's rows-times-panel step: rows [0, rows) of x against one panel, into out;
 * `limit` is the end of the thread's panels (it prefetches ahead up to there). */
typedef void (*PanelRows)(const void *x, int64_t ldx, const void *panel, const void *limit,
                          int K, const void *bias, int n, void *out, int64_t ldo, int rows);

/* x [M, K] -> out [M, N] through `step`, for weights, bias and x of `elem` bytes, out of
 * `out_elem` bytes and panels of `width` columns: rows in chunks of ROW_CHUNK, the panels of
 * a chunk split over the threads. */
static void over_panels(PanelRows step, int elem, int out_elem, int width, const void *x,
                        int64_t ldx, const void *packed, const void *bias, int M, int N, int K,
                        void *out, int64_t ldo, int num_threads) {
    const int panels = (N + width - 1) / width;
    const int64_t panel_bytes = (int64_t)K * width * elem, columns_bytes = (int64_t)width * elem;
    const int64_t out_columns_bytes = (int64_t)width * out_elem;
    for (int r0 = 0; r0 < M; r0 += ROW_CHUNK) {
        const int rows = M - r0 < ROW_CHUNK ? M - r0 : ROW_CHUNK;
        const char *xc = (const char *)x + (int64_t)r0 * ldx * elem;
        char *oc = (char *)out + (int64_t)r0 * ldo * out_elem;
#pragma omp parallel num_threads(num_threads)
        {
            /* schedule(static)'s split, made explicit: each thread's panels are contiguous,
             * [begin, end), so it prefetches ahead up to the end of its range. */
            const int threads = omp_get_num_threads(), t = omp_get_thread_num();
            const int per = panels / threads, extra = panels % threads;
            const int begin = t * per + (t < extra ? t : extra);
            const int end = begin + per + (t < extra);
            for (int p = begin; p < end; p++) {
                const int n = N - p * width < width ? N - p * width : width;
                const char *b = bias == NULL ? NULL : (const char *)bias + p * columns_bytes;
                const char *panel = (const char *)packed + p * panel_bytes;
                step(xc, ldx, panel, (const char *)packed + end * panel_bytes, K, b, n,
                     oc + p * out_columns_bytes, ldo, rows);
            }
        }
    }
}

#endif
