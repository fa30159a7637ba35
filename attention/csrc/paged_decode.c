/* Decode attention over the paged KV pool, read in place: one query token per request.
 *
 * Built at first use by attention/cpu_kernels.py (gcc -O3 -fopenmp, for the CPU at hand) and
 * called through ctypes, which releases the GIL for the call. OpenMP resolves to the libgomp
 * torch has already loaded (same soname), so this kernel and torch's ops share one thread
 * pool.
 *
 * Layouts (element strides; every tensor is contiguous in its last dimension):
 *   q            float32 [B, H, D]                   contiguous
 *   k/v cache    float32 or bfloat16 [slots, Hkv, D]  row stride `slot_stride` elements
 *   req_to_token int32 [rows, r2t_stride]            position -> KV slot, per pool row
 *   pool_rows    int64 [B], seq_lens int64 [B]       tokens with KV, the new one included
 *   out          float32 [B, H, D]                   contiguous
 *
 * Query head h uses KV head h / G (G = H / Hkv). One work item is (request, split): it reads
 * each of its tokens' K and V rows (all KV heads) once for all H queries, in tiles of TILE
 * tokens with an online softmax (running max and sum, float32). Each tile's rows are first
 * brought into cache by a loop that does nothing else (touch_tile), then the scores and the
 * weighted V sum read them from there. Long sequences are split so that there are enough
 * items for every thread; the splits are merged at the end by their maxima and sums.
 */

#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

/* Tokens per tile of the online softmax: touch_tile brings the tile's K and V rows into cache,
 * then the passes over them find them there. A short tile keeps them in L1 / L2 between the
 * two (64 requests x 64-576 tokens, float32, 30 layers' pools from DRAM, scratch harness on
 * the 2-core EPYC, best of 10 interleaved: 512 tokens with software prefetch and no touch
 * 109 ms a step; touched tiles of 128 tokens 85 ms, 64 tokens 77 ms, 32 tokens 71 ms). */
#define TILE 32
#define MIN_SPLIT_TOKENS 256
#define SHARED_CHUNK 256
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
 * by the arithmetic between them: ~10 GB/s for both cores, against ~19 GB/s for this loop.
 * Software prefetches in the passes instead (8 to 64 tokens ahead, into L1 or L2) were no
 * faster than none on the EPYC. */
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
 * the same order (bit-identical output). 2-core EPYC (Zen 3), 16 requests x 64-576 tokens,
 * SmolLM2's shapes, float32, pool in L3 (scratch harness): 11.9 -> 10.1-10.3 ms for 30 layers;
 * from DRAM (64 requests, 30 layers' pools) unchanged at ~120 ms, bound by the memory. AVX-512
 * builds keep whole rows (their 16-vector budget holds 4 queries of 64 or 2 of 128). */
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
    const int G, const int NV, float scale, float *acc_out, float *m, float *l) {
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
         * (in the harness of TILE: 57.7 -> 57.0 ms; one load per query before). */
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
 * dtype: a constant, so the row loads carry no branch (64 requests x 64-576 tokens from DRAM,
 * scratch harness on the EPYC, two interleaved runs: 112 -> 106 ms and 91 -> 86 ms a step;
 * within noise with the pool in L3). */
#define ATTEND_CASE(G_, D_)                                                                   \
    case (G_) * 1024 + (D_):                                                                  \
        if (kv_bf16)                                                                          \
            attend_range(q, k_cache, v_cache, 1, slot_stride, slots, t_begin, t_end, Hkv, G_, \
                         (D_) / W, scale, acc, m, l);                                         \
        else                                                                                  \
            attend_range(q, k_cache, v_cache, 0, slot_stride, slots, t_begin, t_end, Hkv, G_, \
                         (D_) / W, scale, acc, m, l);                                         \
        return;
#define ATTEND_CASES(G_) ATTEND_CASE(G_, 64) ATTEND_CASE(G_, 128)

/* Every (G, D) that paged_decode_supports accepts has a case here. */
static void attend_dispatch(const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
                           int64_t slot_stride, const int32_t *slots, int64_t t_begin,
                           int64_t t_end, int Hkv, int G, int D, float scale, float *acc,
                           float *m, float *l) {
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

/* Query-group sizes 1..8 and head dims 64 and 128: the shapes attend_dispatch has a case for.
 * Exported, so callers ask here instead of restating the rule. */
int paged_decode_supports(int H, int Hkv, int D) {
    if (Hkv <= 0 || H % Hkv != 0) return 0;
    int G = H / Hkv;
    return G >= 1 && G <= MAX_G && (D == 64 || D == 128);
}

/* Merge the parts of one request into out[H][D]: weigh each by e^(m_s - M), then divide by
 * the weighed sum. A part is acc[H][D], m[H], l[H]; parts with l = 0 saw no token. */
static void merge_parts(const float *first, int64_t num_parts, int64_t part_size, int H, int D,
                        float *out) {
    for (int j = 0; j < H; j++) {
        float M = -FLT_MAX;
        for (int64_t s = 0; s < num_parts; s++) {
            const float *part = first + s * part_size;
            if (part[(int64_t)H * D + H + j] > 0.f && part[(int64_t)H * D + j] > M)
                M = part[(int64_t)H * D + j];
        }
        float *o = out + (int64_t)j * D;
        for (int d = 0; d < D; d++) o[d] = 0.f;
        float L = 0.f;
        for (int64_t s = 0; s < num_parts; s++) {
            const float *part = first + s * part_size;
            float ls = part[(int64_t)H * D + H + j];
            if (ls <= 0.f) continue;
            float w = exp_nonpos(part[(int64_t)H * D + j] - M);
            L += ls * w;
            const float *a = part + (int64_t)j * D;
            for (int d = 0; d < D; d++) o[d] += a[d] * w;
        }
        float inv = L > 0.f ? 1.f / L : 0.f;
        for (int d = 0; d < D; d++) o[d] *= inv;
    }
}

/* Shared prefixes (the radix cache's doing: requests that matched the same cached prefix hold
 * the same KV slots for it). leaders[b] is the first request of b's group and shared_lens[b]
 * the group's common prefix in tokens (0: b shares nothing; then leaders[b] = b). A group's
 * prefix is read in chunks of SHARED_CHUNK tokens, one work item per chunk that attends every
 * member's queries to it in turn: the first member reads the chunk's K/V rows from memory,
 * the others find them in L2 (K and V of 256 tokens, 3 KV heads of 64 floats: 384 KB). Each
 * member's tokens past the prefix are its own items, split as without sharing; the parts of a
 * request are merged at the end by their maxima and sums. leaders and shared_lens may both be
 * NULL: nothing shared.
 *
 * Returns 0 on success, 1 when scratch memory could not be allocated, 2 for a shape
 * paged_decode_supports rejects. */
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
                           int64_t slot_stride, const int32_t *req_to_token, int64_t r2t_stride,
                           const int64_t *pool_rows, const int64_t *seq_lens,
                           const int64_t *leaders, const int64_t *shared_lens, int B, int H,
                           int Hkv, int D, float scale, float *out, int num_threads) {
    if (!paged_decode_supports(H, Hkv, D)) return 2;
    const int G = H / Hkv;
    /* Without a plan nothing is shared: every request its own leader, no common prefix. */
    const int planned = leaders != NULL && shared_lens != NULL;
#define LEADER(b) (planned ? leaders[b] : (int64_t)(b))
#define SHARED(b) (planned ? shared_lens[b] : (int64_t)0)
    int64_t max_own = 0, max_chunks = 0, shared_items = 0;
    for (int b = 0; b < B; b++) {
        const int64_t own = seq_lens[b] - SHARED(b);
        const int64_t chunks = (SHARED(b) + SHARED_CHUNK - 1) / SHARED_CHUNK;
        max_own = own > max_own ? own : max_own;
        max_chunks = chunks > max_chunks ? chunks : max_chunks;
        if (LEADER(b) == b) shared_items += chunks;
    }
    /* Enough items to keep every thread busy, without splits shorter than MIN_SPLIT_TOKENS. */
    int64_t items_wanted = 4 * (int64_t)num_threads;
    int64_t splits = (items_wanted + B - 1) / B;
    int64_t max_splits = (max_own + MIN_SPLIT_TOKENS - 1) / MIN_SPLIT_TOKENS;
    if (splits > max_splits) splits = max_splits;
    if (splits < 1) splits = 1;
    /* Request b's parts: its prefix chunks (parts [0, chunks)), then its own splits (parts
     * [max_chunks, max_chunks + splits)). With one part in all, items write out directly. */
    const int64_t parts_per_req = max_chunks + splits;
    const int direct = parts_per_req == 1;
    const int64_t part_size = (int64_t)H * (D + 2);
    float *parts = NULL;
    int64_t *members = NULL, *member_begin = NULL, *item_leader = NULL;
    if (!direct) {
        parts = (float *)malloc(sizeof(float) * (size_t)(B * parts_per_req * part_size));
        /* Members of each leader's group, contiguous (a counting sort by leader), and the
         * leader and chunk of each shared item. */
        members = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * B + 1 + shared_items + 1));
        if (parts == NULL || members == NULL) {
            free(parts);
            free(members);
            return 1;
        }
        member_begin = members + B;
        item_leader = member_begin + B + 1;
        for (int b = 0; b <= B; b++) member_begin[b] = 0;
        for (int b = 0; b < B; b++)
            if (SHARED(b) > 0) member_begin[LEADER(b) + 1]++;
        for (int b = 0; b < B; b++) member_begin[b + 1] += member_begin[b];
        int64_t fill[B];
        for (int b = 0; b < B; b++) fill[b] = member_begin[b];
        for (int b = 0; b < B; b++)
            if (SHARED(b) > 0) members[fill[LEADER(b)]++] = b;
        int64_t i = 0;
        for (int b = 0; b < B; b++)
            if (LEADER(b) == b && SHARED(b) > 0)
                for (int64_t c = 0; c * SHARED_CHUNK < SHARED(b); c++)
                    item_leader[i++] = b * max_chunks + c;
        /* A request's unused prefix-chunk parts saw no token. */
        for (int b = 0; b < B; b++)
            for (int64_t c = (SHARED(b) + SHARED_CHUNK - 1) / SHARED_CHUNK; c < max_chunks;
                 c++) {
                float *part = parts + (b * parts_per_req + c) * part_size;
                for (int j = 0; j < H; j++) part[(int64_t)H * D + H + j] = 0.f;
            }
    }
    const int64_t num_items = shared_items + (int64_t)B * splits;

    /* Shared items first: they are the longest (every member of a group). */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < num_items; item++) {
        float m[H], l[H];
        if (item < shared_items) {
            const int64_t g = item_leader[item] / max_chunks, c = item_leader[item] % max_chunks;
            const int64_t t_begin = c * SHARED_CHUNK;
            const int64_t t_end =
                t_begin + SHARED_CHUNK < SHARED(g) ? t_begin + SHARED_CHUNK : SHARED(g);
            for (int64_t i = member_begin[g]; i < member_begin[g + 1]; i++) {
                const int64_t b = members[i];
                float *part = parts + (b * parts_per_req + c) * part_size;
                attend_dispatch(q + b * H * D, k_cache, v_cache, kv_bf16, slot_stride,
                                req_to_token + pool_rows[b] * r2t_stride, t_begin, t_end, Hkv, G,
                                D, scale, part, m, l);
                memcpy(part + (int64_t)H * D, m, sizeof(float) * H);
                memcpy(part + (int64_t)H * D + H, l, sizeof(float) * H);
            }
            continue;
        }
        const int64_t b = (item - shared_items) / splits, split = (item - shared_items) % splits;
        const int64_t own_begin = SHARED(b), n = seq_lens[b];
        const int64_t chunk = (n - own_begin + splits - 1) / splits;
        const int64_t t_begin = own_begin + split * chunk;
        const int64_t t_end = t_begin + chunk < n ? t_begin + chunk : n;
        const int32_t *slots = req_to_token + pool_rows[b] * r2t_stride;
        const float *qb = q + b * H * D;
        if (direct) {
            float *acc = out + b * H * D;
            attend_dispatch(qb, k_cache, v_cache, kv_bf16, slot_stride, slots, t_begin, t_end,
                            Hkv, G, D, scale, acc, m, l);
            for (int j = 0; j < H; j++) {
                float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
                for (int d = 0; d < D; d++) acc[j * D + d] *= inv;
            }
        } else {
            float *part = parts + (b * parts_per_req + max_chunks + split) * part_size;
            attend_dispatch(qb, k_cache, v_cache, kv_bf16, slot_stride, slots, t_begin, t_end,
                            Hkv, G, D, scale, part, m, l);
            memcpy(part + (int64_t)H * D, m, sizeof(float) * H);
            memcpy(part + (int64_t)H * D + H, l, sizeof(float) * H);
        }
    }

    if (!direct) {
#pragma omp parallel for num_threads(num_threads)
        for (int b = 0; b < B; b++)
            merge_parts(parts + b * parts_per_req * part_size, parts_per_req, part_size, H, D,
                        out + (int64_t)b * H * D);
        free(parts);
        free(members);
    }
#undef LEADER
#undef SHARED
    return 0;
}
