/* Decode attention over the paged KV pool, read in place: one query token per request.
 *
 * Built at first use by srt/kernels/build.py (gcc -O3 -fopenmp, for the CPU at hand) and
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
 * window > 0 (a sliding-window layer): request b attends to its last `window` tokens only,
 * and nothing is read as a shared prefix. softcap > 0 (Gemma 2): scores become
 * softcap * tanh(score / softcap) before the softmax.
 *
 * Query head h uses KV head h / G (G = H / Hkv). One work item is (request, split): it reads
 * each of its tokens' K and V rows (all KV heads) once for all H queries, in tiles of TILE
 * tokens with an online softmax (running max and sum, float32). Each tile's rows are first
 * brought into cache by a loop that does nothing else (touch_tile), then the scores and the
 * weighted V sum read them from there. A request's own tokens are split into pieces of at
 * most MIN_SPLIT_TOKENS, by their count alone, so long sequences give every thread work and
 * a request sums in the same order whatever batch it is in; the splits are merged at the end
 * by their maxima and sums.
 *
 * The work item (attend_range, attend_dispatch) is in decode_attend.h; this file plans the
 * batch: splits, shared prefixes, and the merge of a request's parts.
 */

#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_attend.h"
#include "paged_decode.h"

#define MIN_SPLIT_TOKENS 256
#define SHARED_CHUNK 256

/* Query-group sizes 1..8 and head dims 64 and 128: the shapes attend_dispatch has a case for.
 * Exported, so callers ask here instead of restating the rule. */
int paged_decode_supports(int H, int Hkv, int D) {
    if (Hkv <= 0 || H % Hkv != 0) return 0;
    int G = H / Hkv;
    return G >= 1 && G <= MAX_G && (D == 64 || D == 128);
}

/* Merge the parts of one request into out[H][D]: weigh each by e^(m_s - M), then divide by
 * the weighed sum. A part is acc[H][D], m[H], l[H]; parts with l = 0 saw no token. */
/* Pieces of at most MIN_SPLIT_TOKENS that `own` tokens are split into (at least one). */
static inline int64_t own_splits(int64_t own) {
    const int64_t n = (own + MIN_SPLIT_TOKENS - 1) / MIN_SPLIT_TOKENS;
    return n > 1 ? n : 1;
}

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
                           int Hkv, int D, float scale, int64_t window, float softcap,
                           float *out, int num_threads) {
    if (!paged_decode_supports(H, Hkv, D)) return 2;
    const int G = H / Hkv;
    /* Without a plan (or under a window) nothing is shared: every request its own leader, no
     * common prefix. */
    const int planned = leaders != NULL && shared_lens != NULL && window <= 0;
#define LEADER(b) (planned ? leaders[b] : (int64_t)(b))
#define SHARED(b) (planned ? shared_lens[b] : (int64_t)0)
/* A request's first token of its own: past the shared prefix, or the window's first. */
#define OWN_BEGIN(b) \
    (window > 0 && seq_lens[b] > window ? seq_lens[b] - window : SHARED(b))
/* A request's own tokens are split by their count alone, never by the batch around it, so
 * its attention sums in the same order in any batch (a speculative verify step's rows give
 * the decode step's result to the bit). */
#define SPLITS(b) own_splits(seq_lens[b] - OWN_BEGIN(b))
    int64_t max_chunks = 0, shared_items = 0, max_splits = 1, own_items = 0;
    for (int b = 0; b < B; b++) {
        const int64_t chunks = (SHARED(b) + SHARED_CHUNK - 1) / SHARED_CHUNK;
        max_chunks = chunks > max_chunks ? chunks : max_chunks;
        max_splits = SPLITS(b) > max_splits ? SPLITS(b) : max_splits;
        own_items += SPLITS(b);
        if (LEADER(b) == b) shared_items += chunks;
    }
    /* Request b's parts: its prefix chunks (parts [0, chunks)), then its own splits (parts
     * [max_chunks, max_chunks + splits)). A request with one part in all writes out
     * directly, whatever the rest of the batch does. */
    const int64_t parts_per_req = max_chunks + max_splits;
#define DIRECT(b) (SPLITS(b) == 1 && SHARED(b) == 0)
    int direct = 1;
    for (int b = 0; b < B; b++) direct &= DIRECT(b);
    const int64_t part_size = (int64_t)H * (D + 2);
    float *parts = NULL;
    int64_t *members = NULL, *member_begin = NULL, *item_leader = NULL, *item_row = NULL;
    if (!direct) {
        parts = (float *)malloc(sizeof(float) * (size_t)(B * parts_per_req * part_size));
        /* Members of each leader's group, contiguous (a counting sort by leader), the leader
         * and chunk of each shared item, and the request and split of each own item. */
        members = (int64_t *)malloc(
            sizeof(int64_t) * (size_t)(2 * B + 1 + shared_items + 1 + own_items));
        if (parts == NULL || members == NULL) {
            free(parts);
            free(members);
            return 1;
        }
        member_begin = members + B;
        item_leader = member_begin + B + 1;
        item_row = item_leader + shared_items + 1;
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
        /* A request's unused parts (prefix chunks past its prefix, splits past its own) saw
         * no token. */
        for (int b = 0; b < B; b++) {
            for (int64_t c = (SHARED(b) + SHARED_CHUNK - 1) / SHARED_CHUNK; c < max_chunks; c++) {
                float *part = parts + (b * parts_per_req + c) * part_size;
                for (int j = 0; j < H; j++) part[(int64_t)H * D + H + j] = 0.f;
            }
            for (int64_t c = max_chunks + SPLITS(b); c < parts_per_req; c++) {
                float *part = parts + (b * parts_per_req + c) * part_size;
                for (int j = 0; j < H; j++) part[(int64_t)H * D + H + j] = 0.f;
            }
        }
        i = 0;
        for (int b = 0; b < B; b++)
            for (int64_t k = 0; k < SPLITS(b); k++) item_row[i++] = b * max_splits + k;
    }
    const int64_t num_items = shared_items + own_items;

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
                                D, scale, softcap, part, m, l);
                memcpy(part + (int64_t)H * D, m, sizeof(float) * H);
                memcpy(part + (int64_t)H * D + H, l, sizeof(float) * H);
            }
            continue;
        }
        /* With every request direct, item i is request i's only split. */
        const int64_t own_item = direct ? item * max_splits : item_row[item - shared_items];
        const int64_t b = own_item / max_splits, split = own_item % max_splits;
        const int64_t own_begin = OWN_BEGIN(b), n = seq_lens[b], splits = SPLITS(b);
        const int64_t chunk = (n - own_begin + splits - 1) / splits;
        const int64_t t_begin = own_begin + split * chunk;
        const int64_t t_end = t_begin + chunk < n ? t_begin + chunk : n;
        const int32_t *slots = req_to_token + pool_rows[b] * r2t_stride;
        const float *qb = q + b * H * D;
        if (DIRECT(b)) {
            float *acc = out + b * H * D;
            attend_dispatch(qb, k_cache, v_cache, kv_bf16, slot_stride, slots, t_begin, t_end,
                            Hkv, G, D, scale, softcap, acc, m, l);
            for (int j = 0; j < H; j++) {
                float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
                for (int d = 0; d < D; d++) acc[j * D + d] *= inv;
            }
        } else {
            float *part = parts + (b * parts_per_req + max_chunks + split) * part_size;
            attend_dispatch(qb, k_cache, v_cache, kv_bf16, slot_stride, slots, t_begin, t_end,
                            Hkv, G, D, scale, softcap, part, m, l);
            memcpy(part + (int64_t)H * D, m, sizeof(float) * H);
            memcpy(part + (int64_t)H * D + H, l, sizeof(float) * H);
        }
    }

    if (!direct) {
#pragma omp parallel for num_threads(num_threads)
        for (int b = 0; b < B; b++)
            if (!DIRECT(b))
                merge_parts(parts + b * parts_per_req * part_size, parts_per_req, part_size, H,
                            D, out + (int64_t)b * H * D);
        free(parts);
        free(members);
    }
#undef LEADER
#undef SHARED
#undef OWN_BEGIN
#undef SPLITS
#undef DIRECT
    return 0;
}
