/* The elementwise layer ops of a decoder on CPU, one pass over memory each: RMSNorm (with the
 * residual add before it fused in), SiLU-and-mul and rotary embedding; and the greedy
 * sampler's row argmax over the logits.
 *
 * Built at first use by srt/kernels/build.py and called through ctypes (the GIL is
 * released); the model's modules reach them through srt/layers/fused_kernels.py. OpenMP
 * splits the rows over the threads torch uses; small inputs (a decode step) run on the
 * calling thread, where a fork would cost more than the work.
 *
 * Tensors are float32 or bfloat16 (`bf16` != 0), rows of contiguous elements at a row stride
 * given in elements. The math is float32. In bfloat16 every value a chain of torch ops would
 * round to bfloat16 is rounded here at the same point (see each function), so results match
 * the layers' torch code up to the order of a row's sum.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

/* Rows * elements below which one thread does everything. */
#define SERIAL_ELEMENTS (1 << 15)

static inline int team(int64_t rows, int64_t elements_per_row, int threads) {
    return rows * elements_per_row < SERIAL_ELEMENTS ? 1 : threads;
}

static inline vf load_any(const void *base, int bf16, int64_t i) {
    return bf16 ? load_bf16((const uint16_t *)base + i) : load_f32((const float *)base + i);
}

static inline float load1(const void *base, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline void store_any(void *base, int bf16, int64_t i, vf v) {
    if (bf16)
        store_bf16((uint16_t *)base + i, v);
    else
        store_f32((float *)base + i, v);
}

static inline void store1(void *base, int bf16, int64_t i, float v) {
    if (bf16)
        ((uint16_t *)base)[i] = bf16_round(v);
    else
        ((float *)base)[i] = v;
}

/* out = rmsnorm(x) * weight, row by row; with `residual`, first residual = x + residual
 * (rounded to the dtype, as a tensor add would) and the norm is taken of that sum.
 * float32: x * (1 / sqrt(mean(x^2) + eps)) * w, torch's F.rms_norm. bfloat16: the normalised
 * row is rounded to bfloat16 before the weight multiplies it, and the product rounded again
 * (the layers' `rms_norm_native`). `out` may be `x`. */
void rmsnorm_rows(void *x, int64_t x_stride, void *residual, int64_t r_stride, const void *weight,
                  void *out, int64_t out_stride, int64_t rows, int64_t hidden, int bf16, float eps,
                  int threads) {
    const int64_t vec_end = hidden - hidden % W;
#pragma omp parallel for num_threads(team(rows, hidden, threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        void *src = (char *)x + r * x_stride * (bf16 ? 2 : 4);
        void *dst = (char *)out + r * out_stride * (bf16 ? 2 : 4);
        if (residual != NULL) {
            void *res = (char *)residual + r * r_stride * (bf16 ? 2 : 4);
            for (int64_t i = 0; i < vec_end; i += W) {
                vf s = load_any(src, bf16, i) + load_any(res, bf16, i);
                store_any(res, bf16, i, s);
            }
            for (int64_t i = vec_end; i < hidden; i++)
                store1(res, bf16, i, load1(src, bf16, i) + load1(res, bf16, i));
            src = res;
        }
        vf acc = {0};
        for (int64_t i = 0; i < vec_end; i += W) {
            vf v = load_any(src, bf16, i);
            acc += v * v;
        }
        float sum = hsum(acc);
        for (int64_t i = vec_end; i < hidden; i++) {
            float v = load1(src, bf16, i);
            sum += v * v;
        }
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        for (int64_t i = 0; i < vec_end; i += W) {
            vf n = load_any(src, bf16, i) * inv;
            if (bf16) n = round_bf16_v(n);
            store_any(dst, bf16, i, n * load_any(weight, bf16, i));
        }
        for (int64_t i = vec_end; i < hidden; i++) {
            float n = load1(src, bf16, i) * inv;
            if (bf16) n = bf16_to_f32(bf16_round(n));
            store1(dst, bf16, i, n * load1(weight, bf16, i));
        }
    }
}

/* silu(g) = g / (1 + e^-g), computed from e = e^-|g| so that nothing overflows: g / (1 + e)
 * for g >= 0, g e / (1 + e) below. */
static inline vf silu_v(vf g) {
    vu bits, one_bits, e_bits;
    memcpy(&bits, &g, sizeof g);
    vf neg_abs, one = (vf){0} + 1.0f;
    vu nb = bits | 0x80000000u;
    memcpy(&neg_abs, &nb, sizeof nb);
    vf e = exp_nonpos_v(neg_abs);
    vu negative = (vu)(g < 0.0f);
    memcpy(&one_bits, &one, sizeof one);
    memcpy(&e_bits, &e, sizeof e);
    vu factor_bits = (e_bits & negative) | (one_bits & ~negative);
    vf factor;
    memcpy(&factor, &factor_bits, sizeof factor);
    return g * factor / (1.0f + e);
}

/* out[r] = silu(x[r, :inter]) * x[r, inter:]. bfloat16: silu's result is rounded before the
 * product, and the product again (F.silu(gate) * up on bfloat16 tensors). */
void silu_and_mul_rows(const void *x, int64_t x_stride, void *out, int64_t out_stride,
                       int64_t rows, int64_t inter, int bf16, int threads) {
    const int64_t vec_end = inter - inter % W;
#pragma omp parallel for num_threads(team(rows, inter, threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const void *gate = (const char *)x + r * x_stride * (bf16 ? 2 : 4);
        const void *up = (const char *)gate + inter * (bf16 ? 2 : 4);
        void *dst = (char *)out + r * out_stride * (bf16 ? 2 : 4);
        for (int64_t i = 0; i < vec_end; i += W) {
            vf s = silu_v(load_any(gate, bf16, i));
            if (bf16) s = round_bf16_v(s);
            store_any(dst, bf16, i, s * load_any(up, bf16, i));
        }
        for (int64_t i = vec_end; i < inter; i++) {
            float g = load1(gate, bf16, i);
            float s = g / (1.0f + expf(-g));
            if (bf16) s = bf16_to_f32(bf16_round(s));
            store1(dst, bf16, i, s * load1(up, bf16, i));
        }
    }
}

/* Rotates the first `rot` dims of each head of one token row in place. Neox style pairs
 * dim i with i + rot/2, GPT-J style pairs 2i with 2i + 1; cos and sin are float32 [rot/2]. */
static inline void rotate_heads(void *row, int bf16, int64_t heads, int64_t head_dim, int64_t rot,
                                int neox, const float *cos, const float *sin) {
    const int64_t half = rot / 2;
    for (int64_t h = 0; h < heads; h++) {
        const int64_t base = h * head_dim;
        if (neox && half % W == 0) {
            for (int64_t i = 0; i < half; i += W) {
                vf x1 = load_any(row, bf16, base + i), x2 = load_any(row, bf16, base + half + i);
                vf c = load_f32(cos + i), s = load_f32(sin + i);
                store_any(row, bf16, base + i, x1 * c - x2 * s);
                store_any(row, bf16, base + half + i, x2 * c + x1 * s);
            }
            continue;
        }
        for (int64_t i = 0; i < half; i++) {
            const int64_t a = neox ? base + i : base + 2 * i, b = neox ? a + half : a + 1;
            float x1 = load1(row, bf16, a), x2 = load1(row, bf16, b);
            store1(row, bf16, a, x1 * cos[i] - x2 * sin[i]);
            store1(row, bf16, b, x2 * cos[i] + x1 * sin[i]);
        }
    }
}

/* RoPE in place on q [T, q_heads * head_dim] and k [T, k_heads * head_dim] (row strides in
 * elements) for positions [T], from `cache` float32 [max_position, rot]: row p holds
 * [cos(p f) | sin(p f)]. Returns 0, or 2 (nothing written) when a position is outside
 * [0, max_position). */
int rope_rows(void *q, int64_t q_stride, int64_t q_heads, void *k, int64_t k_stride,
              int64_t k_heads, const int64_t *positions, const float *cache, int64_t max_position,
              int64_t rows, int64_t head_dim, int64_t rot, int neox, int bf16, int threads) {
    for (int64_t r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= max_position) return 2;
    const int64_t elements = (q_heads + k_heads) * rot;
#pragma omp parallel for num_threads(team(rows, elements, threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *cos = cache + positions[r] * rot, *sin = cos + rot / 2;
        rotate_heads((char *)q + r * q_stride * (bf16 ? 2 : 4), bf16, q_heads, head_dim, rot, neox,
                     cos, sin);
        rotate_heads((char *)k + r * k_stride * (bf16 ? 2 : 4), bf16, k_heads, head_dim, rot, neox,
                     cos, sin);
    }
    return 0;
}

/* out[r] = torch.argmax(x[r]) over float32 rows: the first index of the row's largest value,
 * or of its first NaN where it has one (torch ranks NaN above everything). One vector pass:
 * each lane keeps its largest value and that value's first index (a strictly greater value
 * replaces it), then the lanes meet, ties to the smaller index; a NaN seen on the way sends
 * the row to a scan for its first NaN. Several times faster than torch's own CPU argmax over
 * a large vocabulary (greedy decode steps of `python -m bench.bench_one_batch` show it). */
void argmax_rows(const float *x, int64_t x_stride, int64_t rows, int64_t cols, int64_t *out,
                 int threads) {
    const int64_t vec_end = cols - cols % W;
    vi lane;
    for (int l = 0; l < W; l++) lane[l] = l;
#pragma omp parallel for num_threads(team(rows, cols, threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * x_stride;
        float best = -INFINITY;
        int64_t best_i = 0;
        int nan = 0;
        if (vec_end > 0) {
            vf m = load_f32(row);
            vi m_i = lane, nan_lanes = (vi)(m != m);
            for (int64_t i = W; i < vec_end; i += W) {
                vf v = load_f32(row + i);
                vi greater = (vi)(v > m);
                m = select_lanes(greater, v, m);
                m_i = (greater & (lane + (int32_t)i)) | (~greater & m_i);
                nan_lanes |= (vi)(v != v);
            }
            best = m[0];
            best_i = m_i[0];
            for (int l = 0; l < W; l++) {
                nan |= nan_lanes[l] != 0;
                if (m[l] > best || (m[l] == best && m_i[l] < best_i)) {
                    best = m[l];
                    best_i = m_i[l];
                }
            }
        }
        for (int64_t i = vec_end; i < cols; i++) {
            nan |= row[i] != row[i];
            if (row[i] > best) {
                best = row[i];
                best_i = i;
            }
        }
        if (nan) {
            for (int64_t i = 0; i < cols; i++) {
                if (row[i] != row[i]) {
                    best_i = i;
                    break;
                }
            }
        }
        out[r] = best_i;
    }
}
