/* bfloat16 panel kernels of packed_linear.c (built only where the CPU has AVX512_BF16).
 *
 * The same panels as panels.h with pairs of k interleaved, packed[N_pad / 32][K / 2][32][2]
 * (K even), and two kernels over them, both summing in float32 and rounding the output to
 * bfloat16 once, after the bias, as oneDNN does:
 * - `vdpbf16ps` multiplies a broadcast pair (x[m][k], x[m][k + 1]) into a weight vector of 16
 *   columns x 2 k. Only its first block prefetches (ahead, as panels.h's): past a few dozen
 *   rows `vdpbf16ps` is the bound, not the stream.
 * - The widened kernel turns each weight vector into two float32 vectors with one shift and
 *   one mask (no shuffle) and runs `block`'s float32 FMAs, on x widened to float32 once per
 *   call. Where `vdpbf16ps` issues at about half the FMA rate (CPUs with avx512_bf16 and no
 *   AMX) it is the faster of the two except at one or two rows, where the stream is the
 *   bound. Its result is the float32 kernel's on the widened values, bit for bit.
 * Which one runs is set per machine (`packed_linear_bf16_set_widen_from`, in
 * packed_linear.c), from a plan srt/kernels/linear.py measures once and keeps beside the
 * library. */

#ifndef RADIXRT_PANELS_BF16_H
#define RADIXRT_PANELS_BF16_H

#include "panels.h"

/* Rows [0, R) of float32 accumulators (32 columns each) plus bias (bf16, or NULL) -> columns
 * [0, n) of out in bfloat16, rounded once after the bias, as oneDNN does. */
static inline __attribute__((always_inline)) void store_rows_bf16(__m512 acc[][2], const int R,
                                                                  const uint16_t *bias, int n,
                                                                  uint16_t *out, int64_t ldo) {
    float b[32] = {0};
    if (bias != NULL)
        for (int c = 0; c < n; c++) b[c] = bf16_to_f32(bias[c]);
    for (int m = 0; m < R; m++) {
        float row[32];
        vf v0, v1;
        memcpy(&v0, &acc[m][0], sizeof v0);
        memcpy(&v1, &acc[m][1], sizeof v1);
        store_f32(row, v0 + load_f32(b));
        store_f32(row + 16, v1 + load_f32(b + 16));
        if (n == 32) {
            store_bf16(out + m * ldo, load_f32(row));
            store_bf16(out + m * ldo + 16, load_f32(row + 16));
        } else {
            for (int c = 0; c < n; c++) out[m * ldo + c] = bf16_round(row[c]);
        }
    }
}

/* Rows [0, R) of x (bf16, row stride ldx) times one bf16 panel of K / 2 pairs; writes
 * columns [0, n) of out (bf16, row stride ldo), bias (bf16) added in float32 first. */
static inline __attribute__((always_inline)) void block_bf16(const uint16_t *x, int64_t ldx,
                                                             const uint16_t *panel, int K,
                                                             const uint16_t *bias, int n,
                                                             uint16_t *out, int64_t ldo,
                                                             const char *limit,
                                                             const int R) {
    __m512 acc[12][2];
    for (int m = 0; m < R; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 2) {
        if (limit != NULL) {
            const char *ahead = (const char *)(panel + (int64_t)k * 32) + PREFETCH_BYTES;
            if (ahead < limit) {
                __builtin_prefetch(ahead, 0, 2);
                __builtin_prefetch(ahead + 64, 0, 2);
            }
        }
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + (int64_t)k * 32);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + (int64_t)k * 32 + 32);
        for (int m = 0; m < R; m++) {
            int32_t pair;
            memcpy(&pair, x + m * ldx + k, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xv, w0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xv, w1);
        }
    }
    store_rows_bf16(acc, R, bias, n, out, ldo);
}

static void panel_rows_bf16(const void *xv, int64_t ldx, const void *panel, const void *limit,
                            int K, const void *bias, int n, void *outv, int64_t ldo, int rows) {
    const uint16_t *x = xv;
    uint16_t *out = outv;
    const char *ahead = limit; /* the first block prefetches; NULL after it */
    int m = 0;
    if (rows >= 8 && rows < 12) {
        block_bf16(x, ldx, panel, K, bias, n, out, ldo, ahead, 8);
        m = 8, ahead = NULL;
    }
    for (; m + 12 <= rows; m += 12, ahead = NULL)
        block_bf16(x + m * ldx, ldx, panel, K, bias, n, out + m * ldo, ldo, ahead, 12);
    for (; m + 4 <= rows; m += 4, ahead = NULL)
        block_bf16(x + m * ldx, ldx, panel, K, bias, n, out + m * ldo, ldo, ahead, 4);
    for (; m < rows; m++, ahead = NULL)
        block_bf16(x + m * ldx, ldx, panel, K, bias, n, out + m * ldo, ldo, ahead, 1);
}

/* The widened bfloat16 kernel: the same pair-interleaved panels, multiplied in float32 FMAs.
 * A 64-byte line of a panel holds 16 columns x (k, k + 1) as 32-bit pairs, k in the low half,
 * so the float32 weights of k are the pairs shifted left by 16 and those of k + 1 the pairs
 * with the low half cleared: two integer ops per vector, no shuffle. x is widened to float32
 * once per chunk of rows (`packed_linear_bf16`). Where `vdpbf16ps` issues at half the FMA
 * rate this runs matmuls at the float32 rate while reading half the bytes. Prefetching as `block`'s: the first block of a panel runs
 * PREFETCH_BYTES ahead up to `limit`; later ones fetch the next panel's k-rows in turn. */
static inline __attribute__((always_inline)) void block_widen(const float *x, int64_t ldx,
                                                              const uint16_t *panel, int K,
                                                              const uint16_t *bias, int n,
                                                              void *out, int64_t ldo,
                                                              const char *limit,
                                                              const uint16_t *next, int every,
                                                              int phase, const int R,
                                                              const int f32_out) {
    __m512 acc[12][2];
    for (int m = 0; m < R; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int k = 0; k < K; k += 2) {
        const int64_t at = (int64_t)k * 32; /* this pair of k-rows: 32 columns x 2, 128 bytes */
        if (limit != NULL) {
            const char *ahead = (const char *)(panel + at) + PREFETCH_BYTES;
            if (ahead < limit) {
                __builtin_prefetch(ahead, 0, 2);
                __builtin_prefetch(ahead + 64, 0, 2);
            }
        } else if (next != NULL && (k / 2) % every == phase) {
            __builtin_prefetch(next + at, 0, 2);
            __builtin_prefetch(next + at + 32, 0, 2);
        }
        const __m512i p0 = _mm512_loadu_si512(panel + at);
        const __m512i p1 = _mm512_loadu_si512(panel + at + 32);
        const __m512 w00 = _mm512_castsi512_ps(_mm512_slli_epi32(p0, 16));
        const __m512 w01 = _mm512_castsi512_ps(_mm512_slli_epi32(p1, 16));
        const __m512 w10 = _mm512_castsi512_ps(_mm512_and_si512(p0, high));
        const __m512 w11 = _mm512_castsi512_ps(_mm512_and_si512(p1, high));
        for (int m = 0; m < R; m++) {
            const __m512 x0 = _mm512_set1_ps(x[m * ldx + k]);
            const __m512 x1 = _mm512_set1_ps(x[m * ldx + k + 1]);
            acc[m][0] = _mm512_fmadd_ps(x0, w00, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(x0, w01, acc[m][1]);
            acc[m][0] = _mm512_fmadd_ps(x1, w10, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(x1, w11, acc[m][1]);
        }
    }
    if (!f32_out) {
        store_rows_bf16(acc, R, bias, n, out, ldo);
        return;
    }
    for (int m = 0; m < R; m++) { /* float32 out, no bias (the screen below) */
        float row[32];
        _mm512_storeu_ps(row, acc[m][0]);
        _mm512_storeu_ps(row + 16, acc[m][1]);
        memcpy((float *)out + m * ldo, row, sizeof(float) * (size_t)n);
    }
}

static inline __attribute__((always_inline)) void widen_rows(const void *xv, int64_t ldx,
                                                             const void *panel,
                                                             const void *limit, int K,
                                                             const void *bias, int n,
                                                             void *outv, int64_t ldo, int rows,
                                                             const int f32_out) {
    const float *x = xv;
    const int64_t elem = f32_out ? 4 : 2;
    char *out = outv;
    const char *ahead = limit; /* the first block prefetches ahead; NULL after it */
    const uint16_t *next = (const uint16_t *)panel + (int64_t)K * 32;
    if ((const char *)next >= (const char *)limit) next = NULL; /* the thread's last panel */
    int m = 0;
    const int later = rows / 12 - 1; /* full blocks after the first, sharing `next` */
    if (rows >= 8 && rows < 12) {
        block_widen(x, ldx, panel, K, bias, n, out, ldo, ahead, NULL, 1, 0, 8, f32_out);
        m = 8, ahead = NULL;
    }
    for (int i = -1; m + 12 <= rows; m += 12, ahead = NULL, i++)
        block_widen(x + m * ldx, ldx, panel, K, bias, n, out + m * ldo * elem, ldo, ahead, next,
                    later, i, 12, f32_out);
    for (; m + 4 <= rows; m += 4, ahead = NULL)
        block_widen(x + m * ldx, ldx, panel, K, bias, n, out + m * ldo * elem, ldo, ahead, NULL,
                    1, 0, 4, f32_out);
    for (; m < rows; m++, ahead = NULL)
        block_widen(x + m * ldx, ldx, panel, K, bias, n, out + m * ldo * elem, ldo, ahead, NULL,
                    1, 0, 1, f32_out);
}

static void panel_rows_widen(const void *x, int64_t ldx, const void *panel, const void *limit,
                             int K, const void *bias, int n, void *out, int64_t ldo, int rows) {
    widen_rows(x, ldx, panel, limit, K, bias, n, out, ldo, rows, 0);
}

/* The widened kernel writing its float32 sums unrounded (no bias): the screen's estimate. */
static void panel_rows_widen_f32(const void *x, int64_t ldx, const void *panel,
                                 const void *limit, int K, const void *bias, int n, void *out,
                                 int64_t ldo, int rows) {
    widen_rows(x, ldx, panel, limit, K, bias, n, out, ldo, rows, 1);
}

#endif
