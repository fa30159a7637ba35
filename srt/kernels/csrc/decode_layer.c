/* One decoder layer of a CPU decode step (Llama family, float32 or bfloat16) in one call.
 *
 * Built at first use by srt/kernels/build.py and called through ctypes by
 * srt/model_executor/cpu_decode_layer_runner.py, once per layer and step (its C structures
 * are mirrored in srt/kernels/decode_layer.py). The same kernels the layer's
 * modules call one by one run here in the same order on the same inputs, so the output is the
 * modules' output bit for bit; what goes away is the Python between them (module calls,
 * tensor allocation, argument checks and ctypes marshalling: a large part of a small model's
 * batch-1 step). layer_ops.c, packed_linear.c and quant_linear.c are included below as one
 * translation unit; the attention is paged_decode.c's library itself, which this one is linked
 * against (`LINKED` in srt/kernels/build.py): its many specialised cases are most of a
 * compile, and compiled once they serve both.
 *
 * The layer: residual += x (first layer: residual = x), h = rmsnorm(residual); qkv = h Wqkv;
 * RoPE on q and k; the new K and V written to the pool at out_cache_loc; paged decode
 * attention (shared prefixes read once, as the backend plans them); o = attn Wo; residual +=
 * o, h = rmsnorm(residual); out = (silu(h Wgate) * h Wup) Wdown. Bias vectors may be NULL.
 */

#include "layer_ops.c"
#include "packed_linear.c"
#include "quant_linear.c"
#include "paged_decode.h"

/* What a layer keeps from load to unload: weights (the packed panels of packed_linear.c, or
 * of quant_linear.c for a weight whose `*_bits` is 4 or 8, its bias then float32), shapes,
 * the RoPE cache and this layer's K/V buffers in the pool. Dense weights, activations and
 * the pool are float32, or bfloat16 with `bf16` set (where the panels exist: AVX512_BF16). */
typedef struct {
    const void *input_norm, *post_norm;
    float input_eps, post_eps;
    const void *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    int64_t hidden, inter, q_heads, kv_heads, head_dim;
    const float *cos_sin;
    int64_t max_position, rot;
    int32_t neox;
    float scale;
    void *k_cache, *v_cache;
    int64_t slot_stride;
    int32_t bf16;
    int32_t qkv_bits, o_bits, gate_up_bits, down_bits;
} DecodeLayer;

/* One step's batch (rows = running requests) and scratch buffers, each `rows` rows wide as
 * named: normed [hidden], qkv [(q_heads + 2 kv_heads) head_dim], o [hidden], gate_up
 * [2 inter], act [inter] and attn_act [q_heads head_dim] in the activation dtype; q and attn
 * [q_heads head_dim] float32 (the attention kernel's input and output). leaders /
 * shared_lens may be NULL. */
typedef struct {
    int64_t rows;
    const int64_t *positions, *out_cache_loc;
    const int32_t *req_to_token;
    int64_t r2t_stride;
    const int64_t *pool_rows, *seq_lens, *leaders, *shared_lens;
    void *normed, *qkv, *o, *gate_up, *act, *attn_act;
    float *q, *attn;
    int32_t threads;
} DecodeStep;

/* out = x W (+ bias) in the layer's dtype, W quantized when `bits` is set; 0, or 2 (bf16 with
 * an odd K, no bf16 kernel, or a quantized K off its blocks), 3 when out of memory. */
static int linear(const DecodeLayer *L, const void *x, int64_t K, const void *w,
                  const void *bias, int bits, int64_t B, int64_t N, void *out, int threads) {
    if (bits)
        return quant_linear(x, K, L->bf16, w, bits, bias, (int)B, (int)N, (int)K, out, N,
                            threads);
    if (!L->bf16) {
        packed_linear(x, K, w, bias, (int)B, (int)N, (int)K, out, N, threads);
        return 0;
    }
#if defined(__AVX512BF16__)
    return packed_linear_bf16(x, K, w, bias, (int)B, (int)N, (int)K, out, N, threads);
#else
    return 2;
#endif
}

/* x [rows, hidden] (overwritten), residual [rows, hidden] or NULL for the first layer (then
 * x becomes the residual), out [rows, hidden]. Returns 0; 2 for a position outside the RoPE
 * cache (nothing is written to the pool), a head shape the attention kernel has no case for,
 * a bfloat16 matmul this build cannot run, or a quantized K off its blocks; 1 when the
 * attention's scratch could not be allocated, 3 when a quantized matmul's could not. In bfloat16 the values are rounded where the modules round them: q is widened
 * to float32 for the attention kernel and its output rounded back. */
int decode_layer(const DecodeLayer *L, const DecodeStep *S, void *x, void *residual,
                 void *out) {
    const int64_t B = S->rows, hidden = L->hidden, D = L->head_dim;
    const int64_t q_dim = L->q_heads * D, kv_dim = L->kv_heads * D, n_qkv = q_dim + 2 * kv_dim;
    const int threads = S->threads, bf16 = L->bf16;
    const size_t elem = bf16 ? 2 : 4;
    void *h;
    if (residual == NULL) {
        rmsnorm_rows(x, hidden, NULL, 0, L->input_norm, S->normed, hidden, B, hidden, bf16,
                     L->input_eps, threads);
        residual = x;
        h = S->normed;
    } else {
        rmsnorm_rows(x, hidden, residual, hidden, L->input_norm, x, hidden, B, hidden, bf16,
                     L->input_eps, threads);
        h = x;
    }
    int status =
        linear(L, h, hidden, L->qkv, L->qkv_bias, L->qkv_bits, B, n_qkv, S->qkv, threads);
    if (status != 0) return status;
    char *qkv = S->qkv;
    if (rope_rows(qkv, n_qkv, L->q_heads, qkv + q_dim * elem, n_qkv, L->kv_heads, S->positions,
                  L->cos_sin, L->max_position, B, D, L->rot, L->neox, bf16, threads) != 0)
        return 2;
    for (int64_t b = 0; b < B; b++) {
        const char *row = qkv + b * n_qkv * elem;
        memcpy((char *)L->k_cache + S->out_cache_loc[b] * L->slot_stride * elem,
               row + q_dim * elem, elem * (size_t)kv_dim);
        memcpy((char *)L->v_cache + S->out_cache_loc[b] * L->slot_stride * elem,
               row + (q_dim + kv_dim) * elem, elem * (size_t)kv_dim);
        float *q = S->q + b * q_dim;
        if (bf16)
            for (int64_t i = 0; i < q_dim; i++) q[i] = bf16_to_f32(((const uint16_t *)row)[i]);
        else
            memcpy(q, row, sizeof(float) * (size_t)q_dim);
    }
    status = paged_decode_attention(
        S->q, L->k_cache, L->v_cache, bf16, L->slot_stride, S->req_to_token, S->r2t_stride,
        S->pool_rows, S->seq_lens, S->leaders, S->shared_lens, (int)B, (int)L->q_heads,
        (int)L->kv_heads, (int)D, L->scale,
        /* no sliding window or soft-capping: such layers never fuse */ 0, 0.f, S->attn, threads);
    if (status != 0) return status;
    const void *attn = S->attn;
    if (bf16) {
        uint16_t *rounded = S->attn_act;
        for (int64_t i = 0; i < B * q_dim; i++) rounded[i] = bf16_round(S->attn[i]);
        attn = rounded;
    }
    status = linear(L, attn, q_dim, L->o, L->o_bias, L->o_bits, B, hidden, S->o, threads);
    if (status != 0) return status;
    rmsnorm_rows(S->o, hidden, residual, hidden, L->post_norm, S->o, hidden, B, hidden, bf16,
                 L->post_eps, threads);
    status = linear(L, S->o, hidden, L->gate_up, L->gate_up_bias, L->gate_up_bits, B,
                    2 * L->inter, S->gate_up, threads);
    if (status != 0) return status;
    silu_and_mul_rows(S->gate_up, 2 * L->inter, S->act, L->inter, B, L->inter, bf16, threads);
    return linear(L, S->act, L->inter, L->down, L->down_bias, L->down_bits, B, hidden, out,
                  threads);
}
