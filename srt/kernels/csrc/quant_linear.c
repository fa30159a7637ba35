/* Linear layers against weights that stay quantized: out = x @ W.T (+ bias), W in blocks of
 * 32 weights along K (GGUF's Q4_0, Q4_1 and Q8_0), x float32 or bfloat16.
 *
 * Built at first use by srt/kernels/build.py and called through ctypes; srt/kernels/quant.py
 * packs the weights (`QuantLinearKernel.pack`) and calls it.
 *
 * Every weight block becomes unsigned integers u with a scale d and an offset m per output
 * column: w = d u + m. Q4_1 is that already; Q4_0 is u = q, m = -8 d; Q8_0 is u = q + 128,
 * m = -128 d (both exact in float16, where GGUF keeps d). The input rows are quantized the
 * same way llama.cpp quantizes them for these weights: per row and block of 32, dx = max |x|
 * / 127, xq = round(x / dx) (ties to even), so that
 *     sum_k w_k x_k  ~  d dx (sum_k u_k xq_k) + m dx (sum_k xq_k),
 * the integer sum exact (32-bit lanes), the rest in float32. The result is exactly what the
 * dequantized W times the dequantized xq gives, up to the order of float additions
 * (`reference_linear` in srt/kernels/quant.py computes that).
 *
 * Why integers: one request at a time, a decode step is bound by streaming the weights, and
 * with 4-bit weights the float path's unpacking (widen, convert, scale per weight) made it
 * bound by arithmetic instead. Here 4 weights of a column are one 32-bit lane: one
 * `vpdpbusd` (AVX512-VNNI, AVX-VNNI) or `vpmaddubsw` + `vpmaddwd` (AVX2, AVX512BW) multiplies
 * and sums 4 weights by 4 inputs in every lane.
 *
 * Layout: panels of P = 2 * W output columns (as panels.h), each K / 32 blocks of
 *   d[P], m[P]            float16
 *   Q4: 4 groups h of P columns x 4 bytes: byte i of column c = u[4h + i] | u[16 + 4h + i] << 4
 *   Q8: 8 groups g of P columns x 4 bytes: byte i of column c = u[4g + i]
 * so one vector load gives W columns' 4 (Q8) or 2 x 4 (Q4, two nibbles) weights. The padding
 * columns of the last panel are zero (d = m = 0).
 *
 * `vpmaddubsw` adds pairs of u8 x s8 products into signed 16 bits, which 255 x 127 x 2
 * overflows: without VNNI a Q8 byte is split into its two nibbles (u = lo + 16 hi), each
 * product pair then at most 15 x 127 x 2.
 */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

#define QK 32 /* weights per block along K */
#define NB 2
#define P (NB * W)
#define ROW_CHUNK 1024

#if W == 16
#if !defined(__AVX512BW__)
#error "AVX-512 builds need AVX512BW"
#endif
typedef __m512i vint;
#define RB 8 /* rows per block: 2 x RB integer accumulators live in 32 registers */
static inline vint vload(const void *p) { return _mm512_loadu_si512(p); }
static inline vint vbcast(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
static inline vint vzero(void) { return _mm512_setzero_si512(); }
static inline vint vlow_nibbles(vint v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
static inline vint vhigh_nibbles(vint v) {
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
}
static inline vint vadd(vint a, vint b) { return _mm512_add_epi32(a, b); }
static inline vint vshl4(vint a) { return _mm512_slli_epi32(a, 4); }
static inline vf vcvt(vint a) { return (vf)_mm512_cvtepi32_ps(a); }
static inline vf load_f16(const uint16_t *p) {
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const void *)p));
}
#if defined(__AVX512VNNI__)
#define HAS_VNNI 1
static inline vint vdot(vint acc, vint u, vint x) { return _mm512_dpbusd_epi32(acc, u, x); }
#else
static inline vint vdot(vint acc, vint u, vint x) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, x),
                                                   _mm512_set1_epi16(1)));
}
#endif
#else /* AVX2 */
typedef __m256i vint;
#define RB 4
static inline vint vload(const void *p) { return _mm256_loadu_si256(p); }
static inline vint vbcast(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
static inline vint vzero(void) { return _mm256_setzero_si256(); }
static inline vint vlow_nibbles(vint v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
static inline vint vhigh_nibbles(vint v) {
    return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}
static inline vint vadd(vint a, vint b) { return _mm256_add_epi32(a, b); }
static inline vint vshl4(vint a) { return _mm256_slli_epi32(a, 4); }
static inline vf vcvt(vint a) { return (vf)_mm256_cvtepi32_ps(a); }
static inline vf load_f16(const uint16_t *p) {
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const void *)p));
}
#if defined(__AVXVNNI__)
#define HAS_VNNI 1
static inline vint vdot(vint acc, vint u, vint x) { return _mm256_dpbusd_avx_epi32(acc, u, x); }
#else
static inline vint vdot(vint acc, vint u, vint x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x),
                                                   _mm256_set1_epi16(1)));
}
#endif
#endif

/* Bytes of one block of one panel: scales and offsets, then the weights. */
static inline int64_t block_bytes(int bits) { return (int64_t)P * (4 + (bits == 4 ? 16 : 32)); }

/* The panel width of this build (exported for the packer). */
int quant_linear_panel(void) { return P; }

/* Input rows quantized per block of 32: xq [rows, K] int8, dx and sx [rows, K / 32]
 * (sx = dx * sum xq). */
typedef struct {
    const int8_t *xq;
    const float *dx, *sx;
    int64_t blocks; /* K / 32 */
} QuantRows;

/* Rows [0, R) of X times one panel (`blocks` blocks), into columns [0, n) of out. */
static inline __attribute__((always_inline)) void qblock(const QuantRows *X, int64_t row0,
                                                         const uint8_t *panel, int bits,
                                                         const float *bias, int n, float *out,
                                                         int64_t ldo, const int R) {
    const int64_t blocks = X->blocks, bb = block_bytes(bits);
    vf acc[RB][NB];
    for (int m = 0; m < R; m++)
        for (int j = 0; j < NB; j++) acc[m][j] = (vf){0};
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = panel + b * bb;
        const uint8_t *q = blk + 4 * P;
        vint ai[RB][NB];
        for (int m = 0; m < R; m++)
            for (int j = 0; j < NB; j++) ai[m][j] = vzero();
        if (bits == 4) {
            for (int h = 0; h < 4; h++) {
                vint lo[NB], hi[NB];
                for (int j = 0; j < NB; j++) {
                    const vint v = vload(q + (h * P + j * W) * 4);
                    lo[j] = vlow_nibbles(v), hi[j] = vhigh_nibbles(v);
                }
                for (int m = 0; m < R; m++) {
                    const int8_t *xm = X->xq + (row0 + m) * blocks * QK + b * QK;
                    const vint xl = vbcast(xm + 4 * h), xh = vbcast(xm + 16 + 4 * h);
                    for (int j = 0; j < NB; j++) ai[m][j] = vdot(vdot(ai[m][j], lo[j], xl), hi[j], xh);
                }
            }
        } else {
            for (int g = 0; g < 8; g++) {
#if defined(HAS_VNNI)
                vint u[NB];
                for (int j = 0; j < NB; j++) u[j] = vload(q + (g * P + j * W) * 4);
                for (int m = 0; m < R; m++) {
                    const vint xg = vbcast(X->xq + (row0 + m) * blocks * QK + b * QK + 4 * g);
                    for (int j = 0; j < NB; j++) ai[m][j] = vdot(ai[m][j], u[j], xg);
                }
#else
                vint lo[NB], hi[NB];
                for (int j = 0; j < NB; j++) {
                    const vint v = vload(q + (g * P + j * W) * 4);
                    lo[j] = vlow_nibbles(v), hi[j] = vhigh_nibbles(v);
                }
                for (int m = 0; m < R; m++) {
                    const vint xg = vbcast(X->xq + (row0 + m) * blocks * QK + b * QK + 4 * g);
                    for (int j = 0; j < NB; j++)
                        ai[m][j] = vadd(vdot(ai[m][j], lo[j], xg), vshl4(vdot(vzero(), hi[j], xg)));
                }
#endif
            }
        }
        vf d[NB], off[NB];
        for (int j = 0; j < NB; j++) {
            d[j] = load_f16((const uint16_t *)blk + j * W);
            off[j] = load_f16((const uint16_t *)blk + P + j * W);
        }
        for (int m = 0; m < R; m++) {
            const float dx = X->dx[(row0 + m) * blocks + b], sx = X->sx[(row0 + m) * blocks + b];
            for (int j = 0; j < NB; j++) acc[m][j] += vcvt(ai[m][j]) * (d[j] * dx) + off[j] * sx;
        }
    }
    vf bv[NB];
    for (int j = 0; j < NB; j++) bv[j] = bias != NULL && n == P ? load_f32(bias + W * j) : (vf){0};
    for (int m = 0; m < R; m++) {
        if (n == P) {
            for (int j = 0; j < NB; j++) store_f32(out + m * ldo + W * j, acc[m][j] + bv[j]);
        } else {
            float row[P];
            for (int j = 0; j < NB; j++) store_f32(row + W * j, acc[m][j]);
            for (int c = 0; c < n; c++) out[m * ldo + c] = row[c] + (bias != NULL ? bias[c] : 0.f);
        }
    }
}

/* The rows left after the blocks of RB, in one pass over the panel: a few rows (a decode
 * batch, a speculative verify step) read the weights once, not once per pair of rows. Each
 * case is its own constant R, so every one compiles to registers. */
static void qtail(const QuantRows *X, int64_t m, const uint8_t *panel, int bits,
                  const float *bias, int n, float *out, int64_t ldo, int rows) {
    out += m * ldo;
    switch (rows) {
#if RB > 4
    case 7: qblock(X, m, panel, bits, bias, n, out, ldo, 7); break;
    case 6: qblock(X, m, panel, bits, bias, n, out, ldo, 6); break;
    case 5: qblock(X, m, panel, bits, bias, n, out, ldo, 5); break;
    case 4: qblock(X, m, panel, bits, bias, n, out, ldo, 4); break;
#endif
    case 3: qblock(X, m, panel, bits, bias, n, out, ldo, 3); break;
    case 2: qblock(X, m, panel, bits, bias, n, out, ldo, 2); break;
    case 1: qblock(X, m, panel, bits, bias, n, out, ldo, 1); break;
    default: break;
    }
}

static void qpanel_rows(const QuantRows *X, const uint8_t *panel, int bits, const float *bias,
                        int n, float *out, int64_t ldo, int rows) {
    int m = 0;
    for (; m + RB <= rows; m += RB) qblock(X, m, panel, bits, bias, n, out + m * ldo, ldo, RB);
    qtail(X, m, panel, bits, bias, n, out, ldo, rows - m);
}

/* Row `m` of x (float32, or bfloat16 with `x_bf16`) quantized per block into X. */
static void quantize_row(const void *x, int64_t ldx, int x_bf16, int64_t m, int64_t K,
                         const QuantRows *X) {
    int8_t *xq = (int8_t *)X->xq + m * K;
    float *dxs = (float *)X->dx + m * X->blocks, *sxs = (float *)X->sx + m * X->blocks;
    float v[QK];
    for (int64_t b = 0; b < X->blocks; b++) {
        for (int i = 0; i < QK; i++) {
            const int64_t k = b * QK + i;
            v[i] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[m * ldx + k])
                          : ((const float *)x)[m * ldx + k];
        }
        float amax = 0.f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float dx = amax / 127.f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            const int q = dx > 0.f ? (int)nearbyintf(v[i] / dx) : 0;
            xq[b * QK + i] = (int8_t)q;
            sum += q;
        }
        dxs[b] = dx;
        sxs[b] = dx * (float)sum;
    }
}

/* x [M, K] (row stride ldx; float32, or bfloat16 with `x_bf16`) times a packed quantized W
 * (`bits` 4 or 8, N columns), plus bias [N] (float32) or NULL -> out [M, N] (row stride ldo;
 * x's dtype). Returns 0; 2 when K is not a multiple of 32; 3 when out of memory. */
int quant_linear(const void *x, int64_t ldx, int x_bf16, const uint8_t *packed, int bits,
                 const float *bias, int M, int N, int K, void *out, int64_t ldo,
                 int num_threads) {
    if (K % QK != 0 || (bits != 4 && bits != 8)) return 2;
    const int chunk = M < ROW_CHUNK ? M : ROW_CHUNK;
    const int64_t blocks = K / QK, panel_bytes = blocks * block_bytes(bits);
    const int panels = (N + P - 1) / P;
    int8_t *xq = malloc((size_t)chunk * K + 64);
    float *scales = malloc(2 * sizeof(float) * (size_t)chunk * blocks + 64);
    float *wide = x_bf16 ? malloc(sizeof(float) * (size_t)chunk * N) : NULL;
    if (xq == NULL || scales == NULL || (x_bf16 && wide == NULL)) {
        free(xq), free(scales), free(wide);
        return 3;
    }
    for (int r0 = 0; r0 < M; r0 += ROW_CHUNK) {
        const int rows = M - r0 < ROW_CHUNK ? M - r0 : ROW_CHUNK;
        const QuantRows X = {xq, scales, scales + (int64_t)rows * blocks, blocks};
        const char *xc = (const char *)x + (int64_t)r0 * ldx * (x_bf16 ? 2 : 4);
#pragma omp parallel num_threads(num_threads)
        {
#pragma omp for schedule(static)
            for (int m = 0; m < rows; m++) quantize_row(xc, ldx, x_bf16, m, K, &X);
            /* float32 out goes straight to `out`; bfloat16 out through `wide`, rounded after */
            float *oc = x_bf16 ? wide : (float *)out + (int64_t)r0 * ldo;
            const int64_t ldc = x_bf16 ? N : ldo;
#pragma omp for schedule(static)
            for (int p = 0; p < panels; p++) {
                const int n = N - p * P < P ? N - p * P : P;
                qpanel_rows(&X, packed + p * panel_bytes, bits, bias == NULL ? NULL : bias + p * P,
                            n, oc + p * P, ldc, rows);
            }
            if (x_bf16) {
#pragma omp for schedule(static)
                for (int m = 0; m < rows; m++) {
                    uint16_t *dst = (uint16_t *)out + (int64_t)(r0 + m) * ldo;
                    for (int c = 0; c < N; c++) dst[c] = bf16_round(wide[(int64_t)m * N + c]);
                }
            }
        }
    }
    free(xq), free(scales), free(wide);
    return 0;
}

/* Rows `ids` [n] of a packed quantized W dequantized into out [n, K] float32: an embedding
 * table kept as the LM head's panels. */
void quant_gather_rows(const uint8_t *packed, int bits, int K, const int64_t *ids, int n,
                       float *out, int num_threads) {
    const int64_t blocks = K / QK, bb = block_bytes(bits), panel_bytes = blocks * bb;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int r = 0; r < n; r++) {
        const int64_t v = ids[r], c = v % P;
        const uint8_t *panel = packed + (v / P) * panel_bytes;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *blk = panel + b * bb;
            uint16_t dh, mh;
            memcpy(&dh, blk + 2 * c, 2);
            memcpy(&mh, blk + 2 * (P + c), 2);
            const float d = (float)_cvtsh_ss(dh), m = (float)_cvtsh_ss(mh);
            const uint8_t *q = blk + 4 * P;
            float *dst = out + r * K + b * QK;
            for (int i = 0; i < QK; i++) {
                int u;
                if (bits == 4) {
                    const int h = (i % 16) / 4, byte = q[(h * P + c) * 4 + i % 4];
                    u = i < 16 ? byte & 15 : byte >> 4;
                } else {
                    u = q[((i / 4) * P + c) * 4 + i % 4];
                }
                dst[i] = d * (float)u + m;
            }
        }
    }
}
