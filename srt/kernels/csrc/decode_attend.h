/* The work item of paged_decode.c: one request's queries against a range of its tokens,
 * in tiles with an online softmax, specialised by query group and head dim (attend_dispatch).
 * Kept apart from the batch planning of paged_decode.c, which includes it; decode_layer.c
 * gets it through paged_decode.c. The tile and register choices below were measured with
 * decode steps of `python -m bench.bench_one_batch --batch-size 16 64 --input-len 512`. */

#ifndef RADIXRT_DECODE_ATTEND_H
#define RADIXRT_DECODE_ATTEND_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

/* Tokens per tile of the online softmax: touch_tile brings the tile's K and V rows into cache,
 * then the passes over them find them there. A short tile keeps them in L1 / L2 between the
 * two, where a long one with software prefetch and no touch was much slower. */
#define TILE 32
/* Fixed bounds for the register arrays: a head dim of at most 128 (NV = D / W vectors), at
 * most MAX_GB queries per V pass. Sized by constants, not by NV (a variable-length array
 * lives on the stack, and every access to it is a load or a store), they stay in registers
 * once the loops over NV are unrolled. */
#define MAX_NV (128 / W)
#define MAX_GB 4
#define MAX_G 8 /* the largest query group paged_decode_supports accepts */

/* One head's row of D = W * NV elements as float32 vectors. */
static inline __attribute__((always_inline)) void load_row(const void *cache, int kv_bf16,
                                                           int64_t base, const int NV,
                                                           vf *row) {
    if (kv_bf16) {
        const uint16_t *src = (const uint16_t *)cache + base;
        for (int c = 0; c < NV; c++) row[c] = load_bf16(src + W * c);
    } else {
        const float *src = (const float *)cache + base;
        for (int c = 0; c < NV; c++) row[c] = load_f32(src + W * c);
    }
}

/* Loads one word of every cache line of the K and V rows of tokens [t0, t0 + tn) and nothing
 * else, so the core keeps as many misses in flight as it can track; the tile's passes then
 * read the rows from cache. Reading them where they are used left one thread's misses bound
 * by the arithmetic between them, at about half this loop's bandwidth; software prefetches
 * in the passes instead (8 to 64 tokens ahead, into L1 or L2) gained nothing. */
static inline __attribute__((always_inline)) void touch_tile(const void *k_cache,
                                                             const void *v_cache,
                                                             const int32_t *slots, int64_t t0,
                                                             int tn, int row_bytes) {
    int k_sum = 0, v_sum = 0;
    for (int t = 0; t < tn; t++) {
        const char *k = (const char *)k_cache + (int64_t)slots[t0 + t] * row_bytes;
        const char *v = (const char *)v_cache + (int64_t)slots[t0 + t] * row_bytes;
        for (int off = 0; off < row_bytes; off += 64) {
            int kw, vw;
            memcpy(&kw, k + off, sizeof kw);
            memcpy(&vw, v + off, sizeof vw);
            k_sum += kw;
            v_sum += vw;
            /* One scalar load per line: keeps the compiler from widening this into gathers. */
            __asm__ volatile("" : "+r"(k_sum), "+r"(v_sum));
        }
    }
    __asm__ volatile("" : : "r"(k_sum), "r"(v_sum));
}

/* One work item: the H = Hkv * G queries q[H][D] (float32) of one request against its
 * tokens [t_begin, t_end), D = W * NV, in tiles of TILE tokens. A token's K (then V) row
 * holds all its KV heads, scattered over the pool: rows are read from memory once per tile
 * (touch_tile) and from cache by the queries and heads. Leaves the
 * unnormalised output in acc_out[H][D], the running max in m[H], the sum of exponentials in
 * l[H]. Inlined with constant G and NV.
 *
 * The output accumulators (H * NV vectors: 36 for SmolLM2's 9 heads of 64) do not all fit in
 * registers, so the V pass runs one KV head and GB of its queries at a time over the tile's
 * tokens, their GB * NV accumulators in registers, and stores them once per tile. (Looping
 * tokens outside and heads inside kept them on the stack, one store-to-load round trip per
 * token and query: the kernel's hottest line.)
 *
 * With AVX2 a whole row of 64 is 8 of the 16 registers, so whole rows allowed one query a
 * pass: the tile's V rows were read G times per head. A pass now takes half rows (or less)
 * when that lets it hold several queries: AVX2, D = 64, G = 3 runs 2 passes of 3 queries x 4
 * vectors (12 accumulators) per head instead of 3 of 1 x 8, each output element summed in
 * the same order (bit-identical output): faster with the pool in cache, the same from DRAM,
 * where the memory is the bound. AVX-512 builds keep whole rows (their 16-vector budget holds
 * 4 queries of 64 or 2 of 128). */
#if W == 16
#define ACC_VECTORS 16
#else
#define ACC_VECTORS 12
#endif
/* Queries g0 .. g0 + GN of KV head h, columns [W * c0, W * (c0 + NC)) of their rows (GN and
 * NC constants, so their GN * NC accumulators stay in registers): acc_out rescaled by alphas,
 * plus the tile's tn probabilities s[j][t] times each token's V row. */
static inline __attribute__((always_inline)) void accumulate_v(
    const void *v_cache, const int kv_bf16, int64_t slot_stride, const int32_t *slots,
    int64_t t0, int tn, int h, const int G, int g0, const int NV, const int GN, const int c0,
    const int NC, const float *s, const float *alphas, float *acc_out) {
    const int D = W * NV;
    float *out = acc_out + (int64_t)(h * G + g0) * D + W * c0;
    const float *p = s + (int64_t)(h * G + g0) * TILE;
    vf a[MAX_GB][MAX_NV];
#pragma GCC unroll 8
    for (int g = 0; g < GN; g++)
#pragma GCC unroll 16
        for (int c = 0; c < NC; c++)
            a[g][c] = load_f32(out + g * D + W * c) * alphas[h * G + g0 + g];
    for (int t = 0; t < tn; t++) {
        vf v[MAX_NV];
        load_row(v_cache, kv_bf16, (int64_t)slots[t0 + t] * slot_stride + h * D + W * c0, NC, v);
#pragma GCC unroll 8
        for (int g = 0; g < GN; g++) {
            const float pt = p[g * TILE + t];
#pragma GCC unroll 16
            for (int c = 0; c < NC; c++) a[g][c] += pt * v[c];
        }
    }
#pragma GCC unroll 8
    for (int g = 0; g < GN; g++)
#pragma GCC unroll 16
        for (int c = 0; c < NC; c++) store_f32(out + g * D + W * c, a[g][c]);
}

/* The V pass of KV head h: queries in groups of GB, each group's rows in column chunks of NC
 * vectors (GB, NC as attend_range picks them). */
static inline __attribute__((always_inline)) void v_pass(
    const void *v_cache, const int kv_bf16, int64_t slot_stride, const int32_t *slots,
    int64_t t0, int tn, int h, const int G, const int NV, const int GB, const int NC,
    const float *s, const float *alphas, float *acc_out) {
    int g0 = 0;
    for (; g0 + GB <= G; g0 += GB)
        for (int c0 = 0; c0 < NV; c0 += NC)
            accumulate_v(v_cache, kv_bf16, slot_stride, slots, t0, tn, h, G, g0, NV, GB, c0, NC,
                         s, alphas, acc_out);
    for (int c0 = 0; c0 < NV; c0 += NC) {
        switch (G - g0) { /* the last, partial group of queries: a constant count each */
        case 3:
            accumulate_v(v_cache, kv_bf16, slot_stride, slots, t0, tn, h, G, g0, NV, 3, c0, NC,
                         s, alphas, acc_out);
            break;
        case 2:
            accumulate_v(v_cache, kv_bf16, slot_stride, slots, t0, tn, h, G, g0, NV, 2, c0, NC,
                         s, alphas, acc_out);
            break;
        case 1:
            accumulate_v(v_cache, kv_bf16, slot_stride, slots, t0, tn, h, G, g0, NV, 1, c0, NC,
                         s, alphas, acc_out);
            break;
        }
    }
}

static inline __attribute__((always_inline)) void attend_range(
    const float *q, const void *k_cache, const void *v_cache, const int kv_bf16,
    int64_t slot_stride, const int32_t *slots, int64_t t_begin, int64_t t_end, int Hkv,
    const int G, const int NV, float scale, float softcap, float *acc_out, float *m, float *l) {
    const int H = Hkv * G, D = W * NV;
    /* A V pass holds GB queries x NC vectors of their rows in registers: whole rows, unless
     * that leaves one query a pass in a group of several; then half rows (or less). */
    int NC = NV;
    while (NC > 1 && G > 1 && ACC_VECTORS / NC < 2) NC /= 2;
    const int GB = ACC_VECTORS / NC < 1 ? 1 : ACC_VECTORS / NC > MAX_GB ? MAX_GB : ACC_VECTORS / NC;
    const int row_bytes = (int)(slot_stride * (kv_bf16 ? 2 : 4));
    float s[H][TILE];
    for (int j = 0; j < H; j++) {
        m[j] = -FLT_MAX;
        l[j] = 0.f;
        for (int d = 0; d < D; d++) acc_out[j * D + d] = 0.f;
    }
    for (int64_t t0 = t_begin; t0 < t_end; t0 += TILE) {
        const int tn = (int)(t_end - t0 < TILE ? t_end - t0 : TILE);
        touch_tile(k_cache, v_cache, slots, t0, tn, row_bytes);
        /* Scores W tokens at a time: one partial-product vector per token, then W of them
         * summed across lanes at once (sum_lanes), instead of one horizontal sum per score.
         * Each K row of the block is loaded once per KV head, for all G queries of the head
         * (not once per query). */
        for (int tb = 0; tb < tn; tb += W) {
            const int bn = tn - tb < W ? tn - tb : W;
            int64_t base[W];
            for (int t = 0; t < bn; t++) {
                base[t] = (int64_t)slots[t0 + tb + t] * slot_stride;
            }
            for (int h = 0; h < Hkv; h++) {
                /* Each token's K row of head h is loaded once for the G queries of the head:
                 * their partial-product vectors go to dots[g][t], summed across lanes after. */
                vf dots[MAX_G][W];
                vf qv[MAX_G][MAX_NV];
                for (int g = 0; g < G; g++)
                    for (int c = 0; c < NV; c++) qv[g][c] = load_f32(q + (h * G + g) * D + W * c);
                for (int t = 0; t < W; t++) {
                    if (t < bn) {
                        vf k[MAX_NV];
                        load_row(k_cache, kv_bf16, base[t] + (int64_t)h * D, NV, k);
                        for (int g = 0; g < G; g++) {
                            vf dot = qv[g][0] * k[0];
                            for (int c = 1; c < NV; c++) dot += qv[g][c] * k[c];
                            dots[g][t] = dot;
                        }
                    } else {
                        for (int g = 0; g < G; g++) dots[g][t] = (vf){0};
                    }
                }
                for (int g = 0; g < G; g++)
                    store_f32(&s[h * G + g][tb], sum_lanes(dots[g]) * scale);
            }
        }
        /* Soft-capping (Gemma 2): cap * tanh(score / cap) on the scaled scores. */
        if (softcap > 0.f)
            for (int j = 0; j < H; j++)
                for (int t = 0; t < tn; t++) s[j][t] = softcap * tanhf(s[j][t] / softcap);
        /* Online softmax, W scores at a time (lanes past tn count as 0): rescale what was
         * accumulated when the maximum grows. */
        const int tv = (tn + W - 1) / W;
        float alphas[H];
        for (int j = 0; j < H; j++) {
            vf lanes_max = (vf){0} - FLT_MAX;
            for (int i = 0; i < tv; i++)
                lanes_max = max_lanes(lanes_max, select_lanes(LANES < tn - W * i,
                                                              load_f32(&s[j][W * i]),
                                                              (vf){0} - FLT_MAX));
            const float tile_max = hmax(lanes_max);
            const float new_m = tile_max > m[j] ? tile_max : m[j];
            const float alpha = exp_nonpos(m[j] - new_m);
            vf sum = {0};
            for (int i = 0; i < tv; i++) {
                const vf p = select_lanes(LANES < tn - W * i,
                                          exp_nonpos_v(load_f32(&s[j][W * i]) - new_m), (vf){0});
                store_f32(&s[j][W * i], p);
                sum += p;
            }
            l[j] = l[j] * alpha + hsum(sum);
            m[j] = new_m;
            alphas[j] = alpha;
        }
        for (int h = 0; h < Hkv; h++)
            v_pass(v_cache, kv_bf16, slot_stride, slots, t0, tn, h, G, NV, GB, NC, &s[0][0],
                   alphas, acc_out);
    }
}

/* attend_range specialised for the common query-group sizes and head dims, and for the pool's
 * dtype: a constant, so the row loads carry no branch (a gain when the pool is read from
 * DRAM; within noise with the pool in cache). */
#define ATTEND_CASE(G_, D_)                                                                   \
    case (G_) * 1024 + (D_):                                                                  \
        if (kv_bf16)                                                                          \
            attend_range(q, k_cache, v_cache, 1, slot_stride, slots, t_begin, t_end, Hkv, G_, \
                         (D_) / W, scale, softcap, acc, m, l);                                \
        else                                                                                  \
            attend_range(q, k_cache, v_cache, 0, slot_stride, slots, t_begin, t_end, Hkv, G_, \
                         (D_) / W, scale, softcap, acc, m, l);                                \
        return;
#define ATTEND_CASES(G_) ATTEND_CASE(G_, 64) ATTEND_CASE(G_, 128)

/* Every (G, D) that paged_decode_supports accepts has a case here. */
static void attend_dispatch(const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
                           int64_t slot_stride, const int32_t *slots, int64_t t_begin,
                           int64_t t_end, int Hkv, int G, int D, float scale, float softcap,
                           float *acc, float *m, float *l) {
    switch (G * 1024 + D) {
        ATTEND_CASES(1)
        ATTEND_CASES(2)
        ATTEND_CASES(3)
        ATTEND_CASES(4)
        ATTEND_CASES(5)
        ATTEND_CASES(6)
        ATTEND_CASES(7)
        ATTEND_CASES(8)
    }
}

#endif
