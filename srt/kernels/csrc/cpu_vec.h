/* Float vectors for the CPU kernels (GCC vector extensions), shared by the csrc/ sources:
 * W lanes (one AVX-512 register, or one AVX2 one), float32 and bfloat16 loads and stores, a
 * horizontal sum (of one vector, and of W vectors at once), lane selects and maxima, and e^x for
 * x <= 0. srt/kernels/build.py hashes every header with each source, so a change here
 * rebuilds every kernel. */

#ifndef RADIXRT_CPU_VEC_H
#define RADIXRT_CPU_VEC_H

#include <stdint.h>
#include <string.h>

/* Float vectors of W lanes (GCC vector extensions): one AVX-512 register, or one AVX2 one. */
#if defined(__AVX512F__)
#define W 16
#else
#define W 8
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef uint16_t vh __attribute__((vector_size(2 * W)));
typedef uint32_t vu __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));

static inline vf load_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf load_bf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline float hsum(vf v) {
#if W == 16
    v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#else
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6});
#endif
    return v[0];
}

/* Lanes of x where `pick` is set, of y elsewhere. */
static inline vf select_lanes(vi pick, vf x, vf y) {
    vu xb, yb;
    memcpy(&xb, &x, sizeof x);
    memcpy(&yb, &y, sizeof y);
    xb = (xb & (vu)pick) | (yb & ~(vu)pick);
    memcpy(&x, &xb, sizeof x);
    return x;
}

static inline vf max_lanes(vf x, vf y) { return select_lanes(x > y, x, y); }

/* The largest lane of v. */
static inline float hmax(vf v) {
#if W == 16
    v = max_lanes(v, __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    v = max_lanes(v, __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
    v = max_lanes(v, __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
    v = max_lanes(v, __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
#else
    v = max_lanes(v, __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3}));
    v = max_lanes(v, __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5}));
    v = max_lanes(v, __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6}));
#endif
    return v[0];
}

/* Shuffle masks that interleave two vectors x, y in blocks of 2^r lanes: PAIR_LO[r] takes
 * the even blocks of each (x's block 0, y's block 0, x's block 2, y's block 2, ...),
 * PAIR_HI[r] the odd ones. */
#if W == 16
#define LOG2_W 4
static const vi PAIR_LO[4] = {
    {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
    {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
    {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
};
static const vi PAIR_HI[4] = {
    {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31},
    {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
    {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
};
#else
#define LOG2_W 3
static const vi PAIR_LO[3] = {
    {0, 8, 2, 10, 4, 12, 6, 14},
    {0, 1, 8, 9, 4, 5, 12, 13},
    {0, 1, 2, 3, 8, 9, 10, 11},
};
static const vi PAIR_HI[3] = {
    {1, 9, 3, 11, 5, 13, 7, 15},
    {2, 3, 10, 11, 6, 7, 14, 15},
    {4, 5, 6, 7, 12, 13, 14, 15},
};
#endif

/* v[0..W) -> one vector whose lane i is the sum of v[i]'s lanes: log2(W) rounds, each adding
 * two shuffles of a pair of vectors (blocks of 1, 2, 4, ... lanes from each side), so W sums
 * cost about 3 W / 2 instructions instead of W horizontal sums. Overwrites v. */
static inline __attribute__((always_inline)) vf sum_lanes(vf *v) {
#pragma GCC unroll 4
    for (int round = 0, n = W; n > 1; n /= 2, round++)
#pragma GCC unroll 8
        for (int j = 0; j < n / 2; j++)
            v[j] = __builtin_shuffle(v[2 * j], v[2 * j + 1], PAIR_LO[round]) +
                   __builtin_shuffle(v[2 * j], v[2 * j + 1], PAIR_HI[round]);
    return v[0];
}

/* Transposes the W x W matrix whose rows are v[0..W): log2(W) rounds, each exchanging the
 * off-diagonal blocks of b x b lanes (b = W/2, ..., 1) between rows i and i + b with the
 * pair's two block interleavings. */
static inline __attribute__((always_inline)) void transpose_lanes(vf *v) {
#pragma GCC unroll 4
    for (int round = LOG2_W - 1, b = W / 2; b >= 1; b /= 2, round--)
#pragma GCC unroll 16
        for (int i = 0; i < W; i++)
            if ((i & b) == 0) {
                const vf x = v[i], y = v[i + b];
                v[i] = __builtin_shuffle(x, y, PAIR_LO[round]);
                v[i + b] = __builtin_shuffle(x, y, PAIR_HI[round]);
            }
}

#if W == 16
static const vi LANES = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
static const vi LANES = {0, 1, 2, 3, 4, 5, 6, 7};
#endif

/* e^x for x <= 0 on W lanes, ~1 ulp on the range that matters: x = n ln 2 + r with
 * n = round(x log2 e), taken by truncating x log2 e - 0.5 (x <= 0), so |r| <= ln 2 / 2; e^r
 * by its degree-7 Taylor polynomial; 2^n built in the exponent bits. Below -87 the result is
 * e^-87 (~1.6e-38), which is 0 for every sum it enters. */
static inline vf exp_nonpos_v(vf x) {
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f;
    const float ln2_lo = -2.12194440e-4f;
    vi low = x < -87.0f;
    vf floor_x = (vf){0} - 87.0f;
    vu xb, fb;
    memcpy(&xb, &x, sizeof x);
    memcpy(&fb, &floor_x, sizeof x);
    xb = (xb & ~(vu)low) | (fb & (vu)low);
    memcpy(&x, &xb, sizeof x);
    vi ni = __builtin_convertvector(x * log2e - 0.5f, vi);
    vf n = __builtin_convertvector(ni, vf);
    vf r = x - n * ln2_hi;
    r = r - n * ln2_lo;
    vf p = (vf){0} + 1.f / 5040.f;
    p = p * r + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    vu scale = (vu)(ni + 127) << 23;
    vf scale_f;
    memcpy(&scale_f, &scale, sizeof scale);
    return p * scale_f;
}

/* The same for one value (a tile's rescale factor, a split's weight). */
static inline float exp_nonpos(float x) {
    return exp_nonpos_v((vf){0} + x)[0];
}

/* float32 -> bfloat16, rounded to nearest even (NaN payloads are not preserved). */
static inline uint16_t bf16_round(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline void store_f32(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline void store_bf16(uint16_t *p, vf v) {
    vu u;
    memcpy(&u, &v, sizeof v);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    vh h = __builtin_convertvector(u, vh);
    memcpy(p, &h, sizeof h);
}

/* A vector rounded to bfloat16 and widened back: what a bf16 tensor op would have stored. */
static inline vf round_bf16_v(vf v) {
    vu u;
    memcpy(&u, &v, sizeof v);
    u = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) << 16;
    memcpy(&v, &u, sizeof v);
    return v;
}

#endif
