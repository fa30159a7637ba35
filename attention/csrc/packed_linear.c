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
 */

#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

#define NB 2
#define P (NB * W)
#if W == 16
#define MB 12
#else
#define MB 6
#endif
#define ROW_CHUNK 1024

/* Rows [0, R) of x (row stride ldx) times one panel; writes columns [0, n) of the panel's
 * part of out (row stride ldo), n <= P (the last panel may be partial), adding bias if any. */
static inline __attribute__((always_inline)) void block(const float *x, int64_t ldx,
                                                        const float *panel, int K,
                                                        const float *bias, int n, float *out,
                                                        int64_t ldo, const int R) {
    vf acc[R][NB];
    for (int m = 0; m < R; m++)
        for (int j = 0; j < NB; j++) acc[m][j] = (vf){0};
    for (int k = 0; k < K; k++) {
        vf w[NB];
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

static void panel_rows(const float *x, int64_t ldx, const float *panel, int K, const float *bias,
                       int n, float *out, int64_t ldo, int rows) {
    int m = 0;
    for (; m + MB <= rows; m += MB) block(x + m * ldx, ldx, panel, K, bias, n, out + m * ldo, ldo, MB);
    for (; m + 4 <= rows; m += 4) block(x + m * ldx, ldx, panel, K, bias, n, out + m * ldo, ldo, 4);
    for (; m < rows; m++) block(x + m * ldx, ldx, panel, K, bias, n, out + m * ldo, ldo, 1);
}

/* The panel width the packed layout uses on this build (exported for the packer). */
int packed_linear_panel(void) { return P; }

/* x [M, K] (row stride ldx), packed as above, bias [N] or NULL -> out [M, N] (row stride
 * ldo). */
void packed_linear(const float *x, int64_t ldx, const float *packed, const float *bias, int M,
                   int N, int K, float *out, int64_t ldo, int num_threads) {
    const int panels = (N + P - 1) / P;
    for (int r0 = 0; r0 < M; r0 += ROW_CHUNK) {
        const int rows = M - r0 < ROW_CHUNK ? M - r0 : ROW_CHUNK;
        const float *xc = x + (int64_t)r0 * ldx;
        float *oc = out + (int64_t)r0 * ldo;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int p = 0; p < panels; p++) {
            const int n = N - p * P < P ? N - p * P : P;
            panel_rows(xc, ldx, packed + (int64_t)p * K * P, K, bias == NULL ? NULL : bias + p * P,
                       n, oc + p * P, ldo, rows);
        }
    }
}
