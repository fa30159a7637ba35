/* float32 linear layers on CPU against a weight packed once at load: out = x @ W.T (+ bias).
 *
 * Built at first use by attention/cpu_kernels.py and called through ctypes (the GIL is
 * released); srt/layers/cpu_packed.py packs the weights and calls it.
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
 * weights once at the FMA rate, where oneDNN's packed kernel ran ~20% slower (measurements in
 * srt/layers/cpu_packed.py).
 *
 * Threads split the panels of a chunk (OpenMP, the team torch uses). Rows are taken in
 * chunks of ROW_CHUNK so that a chunk of x stays in L2 across the panels.
 *
 * Decode-sized inputs are bound by streaming the weights from memory, and a core streams at
 * ~13 GB/s (2-core Xeon, 260 MB L3: float32 weights of SmolLM2-135M do not fit). The hardware
 * prefetcher stops at every 4 KB page and the FMAs waiting on a load fill the out-of-order
 * window, so the first block of each panel (the one that reads it from memory; later blocks
 * of the same panel find it in L2) prefetches into L2 the weights PREFETCH_BYTES ahead of
 * the k-row it multiplies, running on into the thread's next panel, up to the end of the
 * thread's panels. A steady distance beat prefetching the whole next panel from the first
 * block (scratch harness over SmolLM2's 121 matrices, 2-core Xeon: 1 row 19.2 -> 17.0 ms, 4
 * rows 26.2 -> 18.8 ms, 16 rows unchanged at ~26 ms).
 *
 * With several full blocks (MB rows) per panel, the later ones prefetch the next panel
 * between them, the i-th of n every k-row with k % n == i: the memory stays busy while they
 * multiply from L2 (64 rows 67.0 -> 59.9 ms in the harness). Shorter later blocks do not:
 * their few FMAs per k-row cannot hide a prefetched row (16 rows, 12 + 4, got slower).
 * AVX2 builds leave it out: their block has half the FMAs per k-row (12, ~6 cycles), and on
 * a 2-core AMD EPYC (Zen 3, AVX2 only) the test and the division per k-row, or a prefetch
 * every k-row instead (AMD's prefetcht1 fills L1 too, over the panel being read), cost more
 * than the prefetch saved: SmolLM2's 121 matmuls at 64 rows 159.6 -> 124.7 ms without it
 * (16 rows 55.1 -> 48.8, 32 rows 97.0 -> 76.8; weights from DRAM, scratch harness); a
 * branch-free prefetch every k-row took 166.6 ms. The first block's prefetch stays (without
 * it too: 123.6 ms at 64 rows, 16 and 32 rows 2-3% slower).
 *
 * A block's accumulators are a fixed-size array (MB rows), of which it uses R: with R as the
 * array's bound, GCC made it a variable-length array on the stack, and every FMA loaded and
 * stored its accumulator (16 rows 34.5 -> 26.5 ms, 64 rows 78.0 -> 66.9 ms in the harness).
 *
 * bfloat16 (built only where the CPU has AVX512_BF16): the same panels with pairs of k
 * interleaved, packed[N_pad / 32][K / 2][32][2] (K even), and two kernels over them, both
 * summing in float32 and rounding the output to bfloat16 once, after the bias, as oneDNN
 * does:
 * - `vdpbf16ps` multiplies a broadcast pair (x[m][k], x[m][k + 1]) into a weight vector of 16
 *   columns x 2 k. Only its first block prefetches (ahead, as above): at 24+ rows
 *   `vdpbf16ps` is the bound, not the stream.
 * - The widened kernel turns each weight vector into two float32 vectors with one shift and
 *   one mask (no shuffle) and runs `block`'s float32 FMAs, on x widened to float32 once per
 *   call. On the 2-core Xeon of the measurements (avx512_bf16, no AMX) `vdpbf16ps` issues at
 *   about half the FMA rate: over SmolLM2-135M's 121 matmuls (scratch harness) the widened
 *   kernel takes 16 rows 18.7 ms against 27.9, 64 rows 69.4 against 106.3, 384 rows 391
 *   against 638 (oneDNN's bf16: 638; float32 panels: 379), and `vdpbf16ps` stays ahead only
 *   at 1-2 rows (7.8 against 8.7 ms at 1 row), where the stream is the bound. Its result is
 *   the float32 kernel's on the widened values, bit for bit.
 * Which one runs is set per machine (`packed_linear_bf16_set_widen_from`), from a measured
 * plan: attention/cpu_kernels.py times both once and keeps the choice beside the library.
 *
 * `greedy_screen_logits` (end of file) uses the widened kernel with float32 out to screen a
 * float32 LM head through its bf16 copy for greedy decoding; its comment has the bound.
 */

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

/* The panel width the packed layout uses on this build (exported for the packer). */
int packed_linear_panel(void) { return P; }

/* x [M, K] (row stride ldx), packed as above, bias [N] or NULL -> out [M, N] (row stride
 * ldo). */
void packed_linear(const float *x, int64_t ldx, const float *packed, const float *bias, int M,
                   int N, int K, float *out, int64_t ldo, int num_threads) {
    over_panels(panel_rows, sizeof(float), sizeof(float), P, x, ldx, packed, bias, M, N, K, out,
                ldo, num_threads);
}

#if defined(__AVX512BF16__)
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
 * rate (the 2-core Xeon of the measurements) this runs matmuls at the float32 rate while
 * reading half the bytes. Prefetching as `block`'s: the first block of a panel runs
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

/* Which bfloat16 kernel runs inputs of how many rows: inputs of at least this many rows run
 * the widened kernel, smaller ones `vdpbf16ps`. Set from attention/cpu_kernels.py, which
 * times both on the machine at hand (a library keeps its own copy: decode_layer.c includes
 * this file). */
static int widen_from_rows = 1;

void packed_linear_bf16_set_widen_from(int rows) { widen_from_rows = rows; }

/* The bfloat16 form of packed_linear (K even); 0 on success, 2 for an odd K, 3 when out of
 * memory. */
int packed_linear_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed,
                       const uint16_t *bias, int M, int N, int K, uint16_t *out, int64_t ldo,
                       int num_threads) {
    if (K % 2 != 0) return 2;
    if (M < widen_from_rows) {
        over_panels(panel_rows_bf16, sizeof(uint16_t), sizeof(uint16_t), 32, x, ldx, packed,
                    bias, M, N, K, out, ldo, num_threads);
        return 0;
    }
    /* The widened kernel reads x in float32: each chunk of rows is widened once, then
     * over_panels walks the panels in bf16 units (panel bytes, bias and out columns) for that
     * one chunk (rows <= ROW_CHUNK, so it never offsets x by its bf16 element size). */
    const int chunk = M < ROW_CHUNK ? M : ROW_CHUNK;
    float *wide = malloc((size_t)chunk * K * sizeof(float));
    if (wide == NULL) return 3;
    for (int r0 = 0; r0 < M; r0 += ROW_CHUNK) {
        const int rows = M - r0 < ROW_CHUNK ? M - r0 : ROW_CHUNK;
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int m = 0; m < rows; m++) {
            const uint16_t *src = x + (int64_t)(r0 + m) * ldx;
            float *dst = wide + (int64_t)m * K;
            int k = 0;
            for (; k + W <= K; k += W) store_f32(dst + k, load_bf16(src + k));
            for (; k < K; k++) dst[k] = bf16_to_f32(src[k]);
        }
        over_panels(panel_rows_widen, sizeof(uint16_t), sizeof(uint16_t), 32, wide, K, packed,
                    bias, rows, N, K, out + (int64_t)r0 * ldo, ldo, num_threads);
    }
    free(wide);
    return 0;
}

/* Greedy logits from a bfloat16 copy of a float32 LM head, exact wherever the maximum can be.
 *
 * Decoding a few rows, a float32 LM head is bound by reading its weight (SmolLM2-135M's is
 * 113 MB: 4 ms of a 35 ms step at ~27 GB/s). When the logits feed only an argmax, this reads
 * the bfloat16 panels instead (half the bytes) and then recomputes in float32 the few
 * columns that can still be the maximum:
 * 1. a[v] = h . w'[v] for every column, w' = w rounded to bfloat16, h as given (float32),
 *    through the widened kernel (float32 FMAs; unrounded float32 out).
 * 2. The float32 logit the panels would give, r[v] (one FMA chain over k from 0, exactly
 *    as `block` computes it), differs from a[v] by at most
 *        B[v] = c ||h|| ||w[v]||,  c = (2^-8 + 2.02 gamma_K) * 1.02,  gamma_K = K u / (1 - K u),
 *    u = 2^-24: |w' - w| <= 2^-8 |w| elementwise (round to nearest), each FMA chain adds
 *    gamma_K sum |h w| of rounding, and sum |h w| <= ||h|| ||w|| (Cauchy-Schwarz); the last
 *    2% covers the rounding of the norms and of the float32 comparisons below (each off by
 *    ~2^-24 (|a| + B), under 2^-15 of B for any c above).
 * 3. With L = max_v (a[v] - B[v]), every v with r[v] = max r has a[v] + B[v] >= L; the
 *    other columns have a[v] < L <= max r. Candidates (a[v] + B[v] >= L) are recomputed as
 *    r[v] and written over a[v]: the row's maximum and every position holding it are then
 *    the float32 row's, so any argmax over it (first or otherwise) picks the same id.
 * w_norms[v] = ||w[v]|| (float32, from a double sum). Rows past `max_candidates`
 * candidates, or with a non-finite value, are left for the caller: returns 1 (recompute
 * those logits in full), 0 when every row is done, 2 for an odd K. M <= ROW_CHUNK. */
int greedy_screen_logits(const float *h, int64_t ldh, const uint16_t *packed, const float *w,
                         const float *w_norms, int M, int N, int K, int max_candidates,
                         float *out, int num_threads) {
    if (K % 2 != 0) return 2;
    if (M > ROW_CHUNK) return 1;
    over_panels(panel_rows_widen_f32, sizeof(uint16_t), sizeof(float), 32, h, ldh, packed, NULL,
                M, N, K, out, N, num_threads);
    const double unit = 0x1p-24, gamma = K * unit / (1.0 - K * unit);
    const double c = (0x1p-8 + 2.02 * gamma) * 1.02;
    int incomplete = 0;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) reduction(| : incomplete)
    for (int m = 0; m < M; m++) {
        const float *x = h + (int64_t)m * ldh;
        float *row = out + (int64_t)m * N;
        double squares = 0.0;
        for (int k = 0; k < K; k++) squares += (double)x[k] * x[k];
        const float scale = (float)(c * sqrt(squares));
        /* L = max (a - B), W columns at a time; `poison` turns NaN if any a is not finite. */
        const vf sv = (vf){0} + scale;
        vf lows = (vf){0} - INFINITY, poison = {0};
        int v = 0;
        for (; v + W <= N; v += W) {
            const vf a = load_f32(row + v);
            poison += a * 0.f;
            lows = max_lanes(lows, a - sv * load_f32(w_norms + v));
        }
        float floor_max = hmax(lows), spoiled = hsum(poison);
        for (; v < N; v++) {
            spoiled += row[v] * 0.f;
            const float low = row[v] - scale * w_norms[v];
            floor_max = low > floor_max ? low : floor_max;
        }
        if (!isfinite(squares) || spoiled != 0.f) {
            incomplete = 1;
            continue;
        }
        const vf floor_v = (vf){0} + floor_max;
        int candidates = 0;
        for (v = 0; v < N; v++) {
            if (v % W == 0 && v + W <= N) { /* skip W columns at once when none can be it */
                const vi hit = load_f32(row + v) + sv * load_f32(w_norms + v) >= floor_v;
                const vi none = {0};
                if (memcmp(&hit, &none, sizeof hit) == 0) {
                    v += W - 1;
                    continue;
                }
            }
            if (row[v] + scale * w_norms[v] < floor_max) continue;
            if (++candidates > max_candidates) {
                incomplete = 1;
                break;
            }
            const float *wv = w + (int64_t)v * K;
            float acc = 0.f;
            for (int k = 0; k < K; k++) acc = fmaf(x[k], wv[k], acc);
            row[v] = acc;
        }
    }
    return incomplete;
}
#endif
