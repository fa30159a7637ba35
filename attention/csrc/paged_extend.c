/* Extend (prefill) attention over the paged KV pool, read in place: many new tokens per
 * request, each seeing its request's cached prefix and the new tokens up to itself.
 *
 * Built and loaded like paged_decode.c (attention/cpu_kernels.py: gcc -O3 -fopenmp for the
 * CPU at hand, called through ctypes, OpenMP threads from torch's libgomp).
 *
 * Layouts (element strides; every tensor is contiguous in its last dimension):
 *   q            float32 [T, H, D]                   contiguous, T = sum of extend_lens
 *   k/v cache    float32 or bfloat16 [slots, Hkv, D]  row stride `slot_stride` elements
 *   req_to_token int32 [rows, r2t_stride]            position -> KV slot, per pool row
 *   pool_rows, prefix_lens, extend_lens  int64 [B]   request b's new tokens are rows
 *                                                    sum(extend_lens[:b]).. of q and out
 *   out          float32 [T, H, D]                   contiguous
 *
 * New token i of request b sits at position prefix_lens[b] + i and sees keys 0..that
 * position (bottom-right causal); its K/V are already in the pool. One work item is
 * (request, KV head, block of up to QB new tokens): its G * QB query rows (the G query heads
 * of the KV head, stacked) go over the keys the block's last token sees, KT keys at a time.
 * A key tile is copied out of the pool once per item (K transposed, both in float32), so
 * the scores and the probability-times-V products are small matrix products over
 * contiguous memory, RB query rows at a time with their accumulators in registers. The
 * softmax is online, in float32 (running max and sum per row); lanes past a row's last
 * visible key are zeroed. Items run longest first, over torch's threads.
 */

#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

#define NKV 4       /* vectors of scores per query row in a tile */
#define KT (NKV * W) /* keys per tile */
#define QB 32       /* new tokens per work item */
/* Query rows per register block: RB * NKV accumulators, NKV operands and a broadcast. The
 * most that fit the registers was fastest (AVX-512: 6 of 32 zmm; AVX2: 3 of 16 ymm). */
#if W == 16
#define RB 6
#else
#define RB 3
#endif

typedef struct {
    int b, h, q0, nq;
    int64_t num_keys; /* keys the block's last token sees */
} item_t;

static int longest_first(const void *x, const void *y) {
    const int64_t a = ((const item_t *)x)->num_keys, b = ((const item_t *)y)->num_keys;
    return (a < b) - (a > b);
}

/* Rows [0, tn) of a tile: head h of the tokens at slots[0..tn); rows past tn are zero.
 * K goes in transposed (kt[d][t]), V as is (vt[t][d]). */
static void load_tiles(const void *k_cache, const void *v_cache, int kv_bf16,
                       int64_t slot_stride, const int32_t *slots, int tn, int h, int D,
                       float *kt, float *vt) {
    for (int t = 0; t < tn; t++) {
        const int64_t base = (int64_t)slots[t] * slot_stride + (int64_t)h * D;
        float *vrow = vt + (int64_t)t * D;
        if (kv_bf16) {
            const uint16_t *k = (const uint16_t *)k_cache + base;
            const uint16_t *v = (const uint16_t *)v_cache + base;
            for (int d = 0; d < D; d++) kt[d * KT + t] = bf16_to_f32(k[d]);
            for (int c = 0; c < D; c += W) store_f32(vrow + c, load_bf16(v + c));
        } else {
            const float *k = (const float *)k_cache + base;
            const float *v = (const float *)v_cache + base;
            for (int d = 0; d < D; d++) kt[d * KT + t] = k[d];
            memcpy(vrow, v, sizeof(float) * D);
        }
    }
    for (int t = tn; t < KT; t++) {
        for (int d = 0; d < D; d++) kt[d * KT + t] = 0.f;
        memset(vt + (int64_t)t * D, 0, sizeof(float) * D);
    }
}

/* s[r][0..KT) = qs[r] . K tile, for RB rows starting at qs (row stride D). */
static inline void tile_scores(const float *qs, const float *kt, int D, float *s) {
    vf acc[RB][NKV];
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < NKV; c++) acc[r][c] = (vf){0};
    for (int d = 0; d < D; d++) {
        vf k[NKV];
        for (int c = 0; c < NKV; c++) k[c] = load_f32(kt + d * KT + c * W);
        for (int r = 0; r < RB; r++) {
            const float x = qs[(int64_t)r * D + d];
            for (int c = 0; c < NKV; c++) acc[r][c] += x * k[c];
        }
    }
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < NKV; c++) store_f32(s + r * KT + c * W, acc[r][c]);
}

/* o[r] = o[r] * alpha[r] + p[r][0..nj) . V tile, for RB rows, NKV * W columns at col. */
static inline void tile_values(float *o, const float *p, const float *alpha, const float *vt,
                               int D, int col, int nj) {
    vf acc[RB][NKV];
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < NKV; c++) acc[r][c] = load_f32(o + (int64_t)r * D + col + c * W) * alpha[r];
    for (int j = 0; j < nj; j++) {
        vf v[NKV];
        for (int c = 0; c < NKV; c++) v[c] = load_f32(vt + (int64_t)j * D + col + c * W);
        for (int r = 0; r < RB; r++) {
            const float x = p[r * KT + j];
            for (int c = 0; c < NKV; c++) acc[r][c] += x * v[c];
        }
    }
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < NKV; c++) store_f32(o + (int64_t)r * D + col + c * W, acc[r][c]);
}

/* Scratch of one thread, for items of at most `rows` (a multiple of RB) query rows. */
typedef struct {
    float *q, *o, *s, *kt, *vt, *m, *l, *alpha;
    int64_t *last_key;
    int *valid;
} scratch_t;

static int scratch_alloc(scratch_t *w, int rows, int D) {
    const size_t floats = (size_t)rows * D * 2 + (size_t)rows * KT + (size_t)D * KT * 2 +
                          (size_t)rows * 3;
    float *f = (float *)malloc(sizeof(float) * floats);
    int64_t *last = (int64_t *)malloc(sizeof(int64_t) * rows);
    int *valid = (int *)malloc(sizeof(int) * rows);
    if (f == NULL || last == NULL || valid == NULL) {
        free(f);
        free(last);
        free(valid);
        return 1;
    }
    w->q = f;
    w->o = w->q + (size_t)rows * D;
    w->s = w->o + (size_t)rows * D;
    w->kt = w->s + (size_t)rows * KT;
    w->vt = w->kt + (size_t)D * KT;
    w->m = w->vt + (size_t)KT * D;
    w->l = w->m + rows;
    w->alpha = w->l + rows;
    w->last_key = last;
    w->valid = valid;
    return 0;
}

static void scratch_free(scratch_t *w) {
    free(w->q);
    free(w->last_key);
    free(w->valid);
}

static void run_item(const item_t *it, const float *q, const void *k_cache, const void *v_cache,
                     int kv_bf16, int64_t slot_stride, const int32_t *slots, int64_t q_start,
                     int64_t prefix_len, int H, int G, int D, float scale, float *out,
                     scratch_t *w) {
    const int rows = G * it->nq;
    const int rows_pad = (rows + RB - 1) / RB * RB;
    /* Row r = g * nq + t: query head h * G + g of new token q0 + t, pre-scaled. Padding
     * rows are zero queries that see every key; they are computed and dropped. */
    for (int r = 0; r < rows_pad; r++) {
        float *dst = w->q + (int64_t)r * D;
        w->m[r] = -FLT_MAX;
        w->l[r] = 0.f;
        memset(w->o + (int64_t)r * D, 0, sizeof(float) * D);
        if (r >= rows) {
            memset(dst, 0, sizeof(float) * D);
            w->last_key[r] = it->num_keys - 1;
            continue;
        }
        const int g = r / it->nq, t = r % it->nq;
        const float *src = q + ((q_start + it->q0 + t) * H + (int64_t)it->h * G + g) * D;
        for (int d = 0; d < D; d++) dst[d] = src[d] * scale;
        w->last_key[r] = prefix_len + it->q0 + t;
    }
    for (int64_t k0 = 0; k0 < it->num_keys; k0 += KT) {
        const int tn = (int)(it->num_keys - k0 < KT ? it->num_keys - k0 : KT);
        load_tiles(k_cache, v_cache, kv_bf16, slot_stride, slots + k0, tn, it->h, D, w->kt,
                   w->vt);
        for (int r0 = 0; r0 < rows_pad; r0 += RB) {
            int64_t block_last = -1;
            for (int r = r0; r < r0 + RB; r++)
                block_last = w->last_key[r] > block_last ? w->last_key[r] : block_last;
            if (block_last >= k0) tile_scores(w->q + (int64_t)r0 * D, w->kt, D, w->s + r0 * KT);
        }
        /* Online softmax over the row's visible lanes; the others become 0. */
        for (int r = 0; r < rows_pad; r++) {
            float *s = w->s + r * KT;
            int64_t visible = w->last_key[r] - k0 + 1;
            const int nv = visible <= 0 ? 0 : (visible < tn ? (int)visible : tn);
            w->valid[r] = nv;
            if (nv == 0) {
                w->alpha[r] = 1.f;
                memset(s, 0, sizeof(float) * KT);
                continue;
            }
            float tile_max = -FLT_MAX;
            for (int j = 0; j < nv; j++) tile_max = s[j] > tile_max ? s[j] : tile_max;
            const float new_m = tile_max > w->m[r] ? tile_max : w->m[r];
            vf sum = {0};
            for (int c = 0; c < NKV; c++) {
                vf p = exp_nonpos_v(load_f32(s + c * W) - new_m);
                vi live = LANES < nv - c * W;
                vu bits;
                memcpy(&bits, &p, sizeof p);
                bits &= (vu)live;
                memcpy(&p, &bits, sizeof p);
                store_f32(s + c * W, p);
                sum += p;
            }
            w->alpha[r] = exp_nonpos(w->m[r] - new_m);
            w->l[r] = w->l[r] * w->alpha[r] + hsum(sum);
            w->m[r] = new_m;
        }
        for (int r0 = 0; r0 < rows_pad; r0 += RB) {
            int nj = 0;
            for (int r = r0; r < r0 + RB; r++) nj = w->valid[r] > nj ? w->valid[r] : nj;
            if (nj == 0) continue;
            for (int col = 0; col < D; col += KT)
                tile_values(w->o + (int64_t)r0 * D, w->s + r0 * KT, w->alpha + r0, w->vt, D,
                            col, nj);
        }
    }
    for (int r = 0; r < rows; r++) {
        const int g = r / it->nq, t = r % it->nq;
        float *dst = out + ((q_start + it->q0 + t) * H + (int64_t)it->h * G + g) * D;
        const float inv = w->l[r] > 0.f ? 1.f / w->l[r] : 0.f;
        const float *o = w->o + (int64_t)r * D;
        for (int d = 0; d < D; d++) dst[d] = o[d] * inv;
    }
}

/* Head dims that are whole multiples of a tile's columns (64 and 128 on every build). */
int paged_extend_supports(int H, int Hkv, int D) {
    if (Hkv <= 0 || H % Hkv != 0) return 0;
    return (D == 64 || D == 128) && D % KT == 0;
}

/* Returns 0 on success, 1 when scratch memory could not be allocated, 2 for a shape
 * paged_extend_supports rejects. */
int paged_extend_attention(const float *q, const void *k_cache, const void *v_cache,
                           int kv_bf16, int64_t slot_stride, const int32_t *req_to_token,
                           int64_t r2t_stride, const int64_t *pool_rows,
                           const int64_t *prefix_lens, const int64_t *extend_lens, int B, int H,
                           int Hkv, int D, float scale, float *out, int num_threads) {
    if (!paged_extend_supports(H, Hkv, D)) return 2;
    const int G = H / Hkv;
    int64_t num_items = 0;
    for (int b = 0; b < B; b++) num_items += (extend_lens[b] + QB - 1) / QB * Hkv;
    int64_t *q_starts = (int64_t *)malloc(sizeof(int64_t) * (B + 1));
    item_t *items = (item_t *)malloc(sizeof(item_t) * (num_items + 1));
    if (q_starts == NULL || items == NULL) {
        free(q_starts);
        free(items);
        return 1;
    }
    int64_t n = 0;
    q_starts[0] = 0;
    for (int b = 0; b < B; b++) {
        q_starts[b + 1] = q_starts[b] + extend_lens[b];
        for (int64_t q0 = 0; q0 < extend_lens[b]; q0 += QB) {
            const int nq = (int)(extend_lens[b] - q0 < QB ? extend_lens[b] - q0 : QB);
            for (int h = 0; h < Hkv; h++)
                items[n++] = (item_t){b, h, (int)q0, nq, prefix_lens[b] + q0 + nq};
        }
    }
    qsort(items, (size_t)num_items, sizeof(item_t), longest_first);

    const int rows_max = (G * QB + RB - 1) / RB * RB;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* Every thread meets the worksharing loop; one without scratch skips its items. */
        scratch_t w = {0};
        const int ok = scratch_alloc(&w, rows_max, D) == 0;
        failed = !ok;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; i++) {
            const item_t *it = &items[i];
            if (ok)
                run_item(it, q, k_cache, v_cache, kv_bf16, slot_stride,
                         req_to_token + pool_rows[it->b] * r2t_stride, q_starts[it->b],
                         prefix_lens[it->b], H, G, D, scale, out, &w);
        }
        if (ok) scratch_free(&w);
    }
    free(q_starts);
    free(items);
    return failed;
}
