/* Linear layers on CPU against a weight packed once at load: out = x @ W.T (+ bias), float32
 * and (where the CPU has AVX512_BF16) bfloat16, and greedy logits through a bf16 LM head.
 *
 * Built at first use by srt/kernels/build.py and called through ctypes (the GIL is
 * released); srt/layers/cpu_packed.py packs the weights (srt/kernels/linear.py's
 * `PackedLinearKernel.pack`) and calls it. The kernels are in panels.h (float32: the panel
 * layout, register blocks and prefetching) and panels_bf16.h (`vdpbf16ps` and the widened
 * kernel); this file has the entry points.
 *
 * `greedy_screen_logits` (end of file) uses the widened kernel with float32 out to screen a
 * float32 LM head through its bf16 copy for greedy decoding; its comment has the bound.
 */

#include "panels.h"

/* The panel width the packed layout uses on this build (exported for the packer). */
int packed_linear_panel(void) { return P; }

/* x [M, K] (row stride ldx), packed as panels.h lays out, bias [N] or NULL -> out [M, N]
 * (row stride ldo). */
void packed_linear(const float *x, int64_t ldx, const float *packed, const float *bias, int M,
                   int N, int K, float *out, int64_t ldo, int num_threads) {
    over_panels(panel_rows, sizeof(float), sizeof(float), P, x, ldx, packed, bias, M, N, K, out,
                ldo, num_threads);
}

#if defined(__AVX512BF16__)
#include "panels_bf16.h"

/* Which bfloat16 kernel runs inputs of how many rows: inputs of at least this many rows run
 * the widened kernel, smaller ones `vdpbf16ps`. Set from srt/kernels/linear.py, which
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
 * Decoding a few rows, a float32 LM head is bound by reading its weight (a sizeable part of
 * a small model's step). When the logits feed only an argmax, this reads
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
