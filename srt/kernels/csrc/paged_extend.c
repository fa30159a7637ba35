/* Extend (prefill) attention over the paged KV pool, read in place: many new tokens per
 * request, each seeing its request's cached prefix and the new tokens up to itself.
 *
 * Built and loaded like paged_decode.c (srt/kernels/build.py: gcc -O3 -fopenmp for the
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
 * position (bottom-right causal), or with window > 0 (a sliding-window layer) only the last
 * `window` of them; its K/V are already in the pool. softcap > 0 (Gemma 2): scores become
 * softcap * tanh(score / softcap) before the softmax. One work item is
 * (request, KV head, block of up to QB new tokens): its G * QB query rows (the G query heads
 * of the KV head, stacked) go over the keys the block's last token sees, KT keys at a time.
 * The item's queries are stored transposed once (qt[d][row]) and each key tile is copied
 * out of the pool once (float32, as laid out), so both products are register-blocked
 * multiply-adds over contiguous memory: scores as st[key][row] (a key's element broadcast
 * against RV query rows), then probabilities times V (a probability broadcast against a V
 * row). The softmax is online, in float32, W rows at a time (running max and sum per
 * row); keys past a row's last visible one get probability 0. Items run longest first,
 * over torch's threads.
 */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

#define QB 32        /* new tokens per work item */
#define NQV 2        /* query-row vectors per register block of the scores */
#define RV (NQV * W) /* query rows per register block of the scores; rows pad to this */
/* Keys per register block of the scores (RK * NQV accumulators), query rows and vectors of
 * output columns per register block of the V product (RB * NKV accumulators), and keys per
 * tile (a multiple of RK). AVX-512 (32 zmm): 16 and 24 accumulators. AVX2 (16 ymm): 12 in
 * both, with room for the operands; fewer leave the FMA units waiting on their latency
 * (measured on one tile's products alone; a prefill of `python -m bench.bench_one_batch
 * --batch-size 1 --input-len 1024` shows it end to end). */
#if W == 16
#define RK 8
#define RB 6
#define NKV 4
#define KT 64
#else
#define RK 6
#define RB 6
#define NKV 2
#define KT 72
#endif

typedef struct {
    int b, h, q0, nq;
    int64_t num_keys; /* keys the block's last token sees */
} item_t;

static int longest_first(const void *x, const void *y) {
    const int64_t a = ((const item_t *)x)->num_keys, b = ((const item_t *)y)->num_keys;
    return (a < b) - (a > b);
}

/* Rows [0, tn) of a tile in float32: head h of the tokens at slots[0..tn), K into kb[t][d]
 * and V into vb[t][d]; rows tn..KT are zero. */
static inline __attribute__((always_inline)) void load_tiles(
    const void *k_cache, const void *v_cache, int kv_bf16, int64_t slot_stride,
    const int32_t *slots, int tn, int h, int D, float *kb, float *vb) {
    for (int t = 0; t < tn; t++) {
        const int64_t base = (int64_t)slots[t] * slot_stride + (int64_t)h * D;
        float *krow = kb + (int64_t)t * D, *vrow = vb + (int64_t)t * D;
        if (kv_bf16) {
            const uint16_t *k = (const uint16_t *)k_cache + base;
            const uint16_t *v = (const uint16_t *)v_cache + base;
            for (int c = 0; c < D; c += W) {
                store_f32(krow + c, load_bf16(k + c));
                store_f32(vrow + c, load_bf16(v + c));
            }
        } else {
            memcpy(krow, (const float *)k_cache + base, sizeof(float) * D);
            memcpy(vrow, (const float *)v_cache + base, sizeof(float) * D);
        }
    }
    memset(kb + (int64_t)tn * D, 0, sizeof(float) * (size_t)(KT - tn) * D);
    memset(vb + (int64_t)tn * D, 0, sizeof(float) * (size_t)(KT - tn) * D);
}

/* st[j][r] = K[j] . qt[.][r] for RK keys from kb (row stride D) and RV query rows of the
 * transposed queries qt (row stride rows); scores go to st (row stride rows). */
static inline __attribute__((always_inline)) void tile_scores(const float *qt, int rows,
                                                               const float *kb, int D,
                                                               float *st) {
    vf acc[RK][NQV];
    for (int j = 0; j < RK; j++)
        for (int c = 0; c < NQV; c++) acc[j][c] = (vf){0};
    for (int d = 0; d < D; d++) {
        vf q[NQV];
        for (int c = 0; c < NQV; c++) q[c] = load_f32(qt + (int64_t)d * rows + c * W);
        for (int j = 0; j < RK; j++) {
            const float x = kb[(int64_t)j * D + d];
            for (int c = 0; c < NQV; c++) acc[j][c] += x * q[c];
        }
    }
    for (int j = 0; j < RK; j++)
        for (int c = 0; c < NQV; c++) store_f32(st + (int64_t)j * rows + c * W, acc[j][c]);
}

/* o[r] = o[r] * alpha[r] + sum_j pt[j][r] vb[j], for NR rows (o row stride D, pt row stride
 * rows), over NKV * W columns from col. */
static inline __attribute__((always_inline)) void tile_values(float *o, const float *pt,
                                                              int rows, const float *alpha,
                                                              const float *vb, int D, int col,
                                                              int nj, const int NR) {
    vf acc[NR][NKV];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NKV; c++)
            acc[r][c] = load_f32(o + (int64_t)r * D + col + c * W) * alpha[r];
    for (int j = 0; j < nj; j++) {
        vf v[NKV];
        for (int c = 0; c < NKV; c++) v[c] = load_f32(vb + (int64_t)j * D + col + c * W);
        for (int r = 0; r < NR; r++) {
            const float x = pt[(int64_t)j * rows + r];
            for (int c = 0; c < NKV; c++) acc[r][c] += x * v[c];
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NKV; c++) store_f32(o + (int64_t)r * D + col + c * W, acc[r][c]);
}

/* Scratch of one thread, for items of at most `rows` (a multiple of RV) query rows. */
typedef struct {
    float *qt, *o, *st, *kb, *vb, *m, *l, *alpha;
    int32_t *first_key, *last_key; /* per row: the keys it sees */
} scratch_t;

static int scratch_alloc(scratch_t *w, int rows, int D) {
    const size_t floats = (size_t)rows * D * 2 + (size_t)rows * KT + (size_t)D * KT * 2 +
                          (size_t)rows * 3;
    float *f = (float *)malloc(sizeof(float) * floats);
    int32_t *last = (int32_t *)malloc(sizeof(int32_t) * rows * 2);
    if (f == NULL || last == NULL) {
        free(f);
        free(last);
        return 1;
    }
    w->qt = f;
    w->o = w->qt + (size_t)rows * D;
    w->st = w->o + (size_t)rows * D;
    w->kb = w->st + (size_t)rows * KT;
    w->vb = w->kb + (size_t)D * KT;
    w->m = w->vb + (size_t)KT * D;
    w->l = w->m + rows;
    w->alpha = w->l + rows;
    w->last_key = last;
    w->first_key = last + rows;
    return 0;
}

static void scratch_free(scratch_t *w) {
    free(w->qt);
    free(w->last_key);
}

static int32_t max_last_key(const int32_t *last_key, int n) {
    int32_t best = -1;
    for (int r = 0; r < n; r++) best = last_key[r] > best ? last_key[r] : best;
    return best;
}

/* One item; inlined once per head dim, so that D is a constant in the tile loops. */
static inline __attribute__((always_inline)) void run_item(
    const item_t *it, const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
    int64_t slot_stride, const int32_t *slots, int64_t q_start, int64_t prefix_len, int H, int G,
    const int D, float scale, int64_t window, float softcap, float *out, scratch_t *w) {
    const int rows = G * it->nq;
    const int rp = (rows + RV - 1) / RV * RV; /* padded rows: the row stride of qt and st */
    /* Row r = g * nq + t: query head h * G + g of new token q0 + t, pre-scaled and stored
     * transposed (qt[d][r]), W rows by W columns at a time through registers. Padding rows
     * are zero queries that see every key; they are computed and dropped. */
    for (int r0 = 0; r0 < rp; r0 += W) {
        const float *src[W];
        for (int i = 0; i < W; i++) {
            const int r = r0 + i, g = r / it->nq, t = r % it->nq;
            w->m[r] = -FLT_MAX;
            w->l[r] = 0.f;
            memset(w->o + (int64_t)r * D, 0, sizeof(float) * D);
            src[i] = r < rows ? q + ((q_start + it->q0 + t) * H + (int64_t)it->h * G + g) * D
                              : NULL;
            w->last_key[r] = (int32_t)(r < rows ? prefix_len + it->q0 + t : it->num_keys - 1);
            const int64_t first = window > 0 ? w->last_key[r] - window + 1 : 0;
            w->first_key[r] = (int32_t)(r < rows && first > 0 ? first : 0);
        }
        for (int d0 = 0; d0 < D; d0 += W) {
            vf block[W];
            for (int i = 0; i < W; i++)
                block[i] = src[i] != NULL ? load_f32(src[i] + d0) * scale : (vf){0};
            transpose_lanes(block);
            for (int i = 0; i < W; i++) store_f32(w->qt + (int64_t)(d0 + i) * rp + r0, block[i]);
        }
    }
    /* Under a window, keys before the block's first token's first visible key are skipped. */
    const int64_t key_begin = window > 0 && prefix_len + it->q0 - window + 1 > 0
                                  ? prefix_len + it->q0 - window + 1
                                  : 0;
    for (int64_t k0 = key_begin; k0 < it->num_keys; k0 += KT) {
        const int tn = (int)(it->num_keys - k0 < KT ? it->num_keys - k0 : KT);
        load_tiles(k_cache, v_cache, kv_bf16, slot_stride, slots + k0, tn, it->h, D, w->kb,
                   w->vb);
        for (int r0 = 0; r0 < rp; r0 += RV) {
            /* Key blocks past every row's last visible key are left out (masked below). */
            const int64_t seen = max_last_key(w->last_key + r0, RV) - k0 + 1;
            const int nk = seen < tn ? (int)seen : tn;
            for (int j0 = 0; j0 < nk; j0 += RK)
                tile_scores(w->qt + r0, rp, w->kb + (int64_t)j0 * D, D,
                            w->st + (int64_t)j0 * rp + r0);
        }
        /* Soft-capping (Gemma 2): cap * tanh(score / cap); the queries were pre-scaled. */
        if (softcap > 0.f)
            for (int j = 0; j < tn; j++)
                for (int r = 0; r < rp; r++) {
                    float *x = w->st + (int64_t)j * rp + r;
                    *x = softcap * tanhf(*x / softcap);
                }
        /* Online softmax, W rows at a time; keys outside a row's visible ones become 0. */
        for (int r0 = 0; r0 < rp; r0 += W) {
            vi first, last;
            memcpy(&first, w->first_key + r0, sizeof first);
            memcpy(&last, w->last_key + r0, sizeof last);
            vf m = load_f32(w->m + r0), tile_max = (vf){0} - FLT_MAX;
            for (int j = 0; j < tn; j++) {
                const vi key = (vi){0} + (int32_t)(k0 + j);
                const vi live = (key <= last) & (key >= first);
                const vf s = load_f32(w->st + (int64_t)j * rp + r0);
                tile_max = max_lanes(select_lanes(live, s, (vf){0} - FLT_MAX), tile_max);
            }
            const vf new_m = max_lanes(m, tile_max);
            vf sum = {0};
            for (int j = 0; j < tn; j++) {
                const vi key = (vi){0} + (int32_t)(k0 + j);
                const vi live = (key <= last) & (key >= first);
                float *sj = w->st + (int64_t)j * rp + r0;
                const vf p = select_lanes(live, exp_nonpos_v(load_f32(sj) - new_m), (vf){0});
                store_f32(sj, p);
                sum += p;
            }
            const vf alpha = exp_nonpos_v(m - new_m);
            store_f32(w->alpha + r0, alpha);
            store_f32(w->l + r0, load_f32(w->l + r0) * alpha + sum);
            store_f32(w->m + r0, new_m);
        }
        for (int r0 = 0; r0 < rp; r0 += RB) {
            const int nr = rp - r0 < RB ? rp - r0 : RB;
            const int64_t seen = max_last_key(w->last_key + r0, nr) - k0 + 1;
            const int nj = seen <= 0 ? 0 : (seen < tn ? (int)seen : tn);
            if (nj == 0) continue; /* alpha is 1 and every p is 0 for these rows */
            for (int col = 0; col < D; col += NKV * W) {
                float *o = w->o + (int64_t)r0 * D;
                const float *pt = w->st + r0, *alpha = w->alpha + r0;
                switch (nr) {
                    case RB: tile_values(o, pt, rp, alpha, w->vb, D, col, nj, RB); break;
                    case 1: tile_values(o, pt, rp, alpha, w->vb, D, col, nj, 1); break;
                    case 2: tile_values(o, pt, rp, alpha, w->vb, D, col, nj, 2); break;
#if RB > 3
                    case 3: tile_values(o, pt, rp, alpha, w->vb, D, col, nj, 3); break;
                    case 4: tile_values(o, pt, rp, alpha, w->vb, D, col, nj, 4); break;
                    case 5: tile_values(o, pt, rp, alpha, w->vb, D, col, nj, 5); break;
#endif
                }
            }
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
    return (D == 64 || D == 128) && D % (NKV * W) == 0;
}

/* Returns 0 on success, 1 when scratch memory could not be allocated, 2 for a shape
 * paged_extend_supports rejects. */
int paged_extend_attention(const float *q, const void *k_cache, const void *v_cache,
                           int kv_bf16, int64_t slot_stride, const int32_t *req_to_token,
                           int64_t r2t_stride, const int64_t *pool_rows,
                           const int64_t *prefix_lens, const int64_t *extend_lens, int B, int H,
                           int Hkv, int D, float scale, int64_t window, float softcap,
                           float *out, int num_threads) {
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

    const int rows_max = (G * QB + RV - 1) / RV * RV;
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
            const int32_t *slots = req_to_token + pool_rows[it->b] * r2t_stride;
            if (ok && D == 64)
                run_item(it, q, k_cache, v_cache, kv_bf16, slot_stride, slots, q_starts[it->b],
                         prefix_lens[it->b], H, G, 64, scale, window, softcap, out, &w);
            else if (ok)
                run_item(it, q, k_cache, v_cache, kv_bf16, slot_stride, slots, q_starts[it->b],
                         prefix_lens[it->b], H, G, 128, scale, window, softcap, out, &w);
        }
        if (ok) scratch_free(&w);
    }
    free(q_starts);
    free(items);
    return failed;
}
