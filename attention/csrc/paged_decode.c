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
 * tokens with an online softmax (running max and sum, float32). Long sequences are split so
 * that there are enough items for every thread; the splits are merged at the end by their
 * maxima and sums.
 */

#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

#define TILE 128
#define MIN_SPLIT_TOKENS 256
#define PREFETCH 8

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

static inline void prefetch_row(const void *cache, int64_t slot, int row_bytes) {
    const char *p = (const char *)cache + slot * row_bytes;
    for (int off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off);
}

/* One work item: the H = Hkv * G queries q[H][D] (float32) of one request against its
 * tokens [t_begin, t_end), D = W * NV. A token's K (then V) row holds all its KV heads,
 * scattered over the pool: rows are prefetched PREFETCH tokens ahead, and each is read from
 * memory once (the G queries of a KV head reuse it from cache). Leaves the unnormalised
 * output in acc[H][D], the running max in m[H], the sum of exponentials in l[H]. Inlined
 * with constant G and NV, so a query group's accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_range(
    const float *q, const void *k_cache, const void *v_cache, int kv_bf16, int64_t slot_stride,
    const int32_t *slots, int64_t t_begin, int64_t t_end, int Hkv, const int G, const int NV,
    float scale, float *acc_out, float *m, float *l) {
    const int H = Hkv * G, D = W * NV;
    const int row_bytes = (int)(slot_stride * (kv_bf16 ? 2 : 4));
    float s[H][TILE];
    vf acc[H][NV];
    for (int j = 0; j < H; j++) {
        m[j] = -FLT_MAX;
        l[j] = 0.f;
        for (int c = 0; c < NV; c++) acc[j][c] = (vf){0};
    }
    for (int64_t t0 = t_begin; t0 < t_end; t0 += TILE) {
        const int tn = (int)(t_end - t0 < TILE ? t_end - t0 : TILE);
        for (int t = 0; t < tn; t++) {
            if (t0 + t + PREFETCH < t_end) prefetch_row(k_cache, slots[t0 + t + PREFETCH], row_bytes);
            const int64_t base = (int64_t)slots[t0 + t] * slot_stride;
            for (int h = 0; h < Hkv; h++) {
                vf k[NV];
                load_row(k_cache, kv_bf16, base + (int64_t)h * D, NV, k);
                for (int g = 0; g < G; g++) {
                    const float *qj = q + (h * G + g) * D;
                    vf dot = load_f32(qj) * k[0];
                    for (int c = 1; c < NV; c++) dot += load_f32(qj + W * c) * k[c];
                    s[h * G + g][t] = hsum(dot) * scale;
                }
            }
        }
        /* Online softmax, W scores at a time (lanes past tn count as 0): rescale what was
         * accumulated when the maximum grows. */
        const int tv = (tn + W - 1) / W;
        for (int j = 0; j < H; j++) {
            float tile_max = -FLT_MAX;
            for (int t = 0; t < tn; t++) tile_max = s[j][t] > tile_max ? s[j][t] : tile_max;
            const float new_m = tile_max > m[j] ? tile_max : m[j];
            const float alpha = exp_nonpos(m[j] - new_m);
            vf sum = {0};
            for (int i = 0; i < tv; i++) {
                vf p = exp_nonpos_v(load_f32(&s[j][W * i]) - new_m);
                vi live = LANES < tn - W * i;
                vu bits;
                memcpy(&bits, &p, sizeof p);
                bits &= (vu)live;
                memcpy(&p, &bits, sizeof p);
                memcpy(&s[j][W * i], &p, sizeof p);
                sum += p;
            }
            l[j] = l[j] * alpha + hsum(sum);
            m[j] = new_m;
            for (int c = 0; c < NV; c++) acc[j][c] *= alpha;
        }
        for (int t = 0; t < tn; t++) {
            if (t0 + t + PREFETCH < t_end) prefetch_row(v_cache, slots[t0 + t + PREFETCH], row_bytes);
            const int64_t base = (int64_t)slots[t0 + t] * slot_stride;
            for (int h = 0; h < Hkv; h++) {
                vf v[NV];
                load_row(v_cache, kv_bf16, base + (int64_t)h * D, NV, v);
                for (int g = 0; g < G; g++) {
                    const float p = s[h * G + g][t];
                    for (int c = 0; c < NV; c++) acc[h * G + g][c] += p * v[c];
                }
            }
        }
    }
    for (int j = 0; j < H; j++) memcpy(acc_out + j * D, acc[j], sizeof(float) * D);
}

/* attend_range specialised for the common query-group sizes and head dims. */
#define ATTEND_CASE(G_, D_)                                                                   \
    case (G_) * 1024 + (D_):                                                                  \
        attend_range(q, k_cache, v_cache, kv_bf16, slot_stride, slots, t_begin, t_end, Hkv,  \
                     G_, (D_) / W, scale, acc, m, l);                                         \
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
    return G >= 1 && G <= 8 && (D == 64 || D == 128);
}

/* Returns 0 on success, 1 when scratch memory could not be allocated, 2 for a shape
 * paged_decode_supports rejects. */
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
                           int64_t slot_stride, const int32_t *req_to_token, int64_t r2t_stride,
                           const int64_t *pool_rows, const int64_t *seq_lens, int B, int H,
                           int Hkv, int D, float scale, float *out, int num_threads) {
    if (!paged_decode_supports(H, Hkv, D)) return 2;
    const int G = H / Hkv;
    int64_t max_len = 0;
    for (int b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    /* Enough items to keep every thread busy, without splits shorter than MIN_SPLIT_TOKENS. */
    int64_t items_wanted = 4 * (int64_t)num_threads;
    int64_t splits = (items_wanted + B - 1) / B;
    int64_t max_splits = (max_len + MIN_SPLIT_TOKENS - 1) / MIN_SPLIT_TOKENS;
    if (splits > max_splits) splits = max_splits;
    if (splits < 1) splits = 1;
    const int64_t num_items = (int64_t)B * splits;

    /* Partial results per item: acc[H][D], then m[H], then l[H]. */
    const int64_t part_size = (int64_t)H * (D + 2);
    float *parts = NULL;
    if (splits > 1) {
        parts = (float *)malloc(sizeof(float) * (size_t)(num_items * part_size));
        if (parts == NULL) return 1;
    }

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < num_items; item++) {
        int b = (int)(item / splits);
        int64_t split = item % splits;
        int64_t n = seq_lens[b];
        int64_t chunk = (n + splits - 1) / splits;
        int64_t t_begin = split * chunk;
        int64_t t_end = t_begin + chunk < n ? t_begin + chunk : n;
        const int32_t *slots = req_to_token + pool_rows[b] * r2t_stride;
        const float *qb = q + (int64_t)b * H * D;
        float m[H], l[H];
        if (splits == 1) {
            float *acc = out + (int64_t)b * H * D;
            attend_dispatch(qb, k_cache, v_cache, kv_bf16, slot_stride, slots, t_begin, t_end,
                            Hkv, G, D, scale, acc, m, l);
            for (int j = 0; j < H; j++) {
                float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
                for (int d = 0; d < D; d++) acc[j * D + d] *= inv;
            }
        } else {
            float *part = parts + item * part_size;
            attend_dispatch(qb, k_cache, v_cache, kv_bf16, slot_stride, slots, t_begin, t_end,
                            Hkv, G, D, scale, part, m, l);
            memcpy(part + (int64_t)H * D, m, sizeof(float) * H);
            memcpy(part + (int64_t)H * D + H, l, sizeof(float) * H);
        }
    }

    if (splits > 1) {
        /* Merge the splits of each request: weigh each by e^(m_s - M). */
#pragma omp parallel for num_threads(num_threads)
        for (int b = 0; b < B; b++) {
            const float *first = parts + (int64_t)b * splits * part_size;
            for (int j = 0; j < H; j++) {
                float M = -FLT_MAX;
                for (int64_t s = 0; s < splits; s++) {
                    const float *part = first + s * part_size;
                    if (part[(int64_t)H * D + H + j] > 0.f && part[(int64_t)H * D + j] > M)
                        M = part[(int64_t)H * D + j];
                }
                float *o = out + ((int64_t)b * H + j) * D;
                for (int d = 0; d < D; d++) o[d] = 0.f;
                float L = 0.f;
                for (int64_t s = 0; s < splits; s++) {
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
        free(parts);
    }
    return 0;
}
