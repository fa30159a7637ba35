/* One decoder layer of a CPU decode step (Llama family, float32) in one call.
 *
 * Built at first use by attention/cpu_kernels.py and called through ctypes by
 * srt/layers/cpu_decode_layer.py, once per layer and step. The same kernels the layer's
 * modules call one by one (layer_ops.c, packed_linear.c, paged_decode.c, included below as one
 * translation unit) run here in the same order on the same inputs, so the output is the
 * modules' output bit for bit; what goes away is the Python between them (module calls,
 * tensor allocation, argument checks and ctypes marshalling: ~9 ms of a 30 ms batch-1 step for
 * SmolLM2-135M's 30 layers).
 *
 * The layer: residual += x (first layer: residual = x), h = rmsnorm(residual); qkv = h Wqkv;
 * RoPE on q and k; the new K and V written to the pool at out_cache_loc; paged decode
 * attention (shared prefixes read once, as the backend plans them); o = attn Wo; residual +=
 * o, h = rmsnorm(residual); out = (silu(h Wgate) * h Wup) Wdown. Bias vectors may be NULL.
 */

#include "layer_ops.c"
#include "packed_linear.c"
#include "paged_decode.c"

/* What a layer keeps from load to unload: weights (the packed panels of packed_linear.c),
 * shapes, the RoPE cache and this layer's K/V buffers in the pool. */
typedef struct {
    const float *input_norm, *post_norm;
    float input_eps, post_eps;
    const float *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    int64_t hidden, inter, q_heads, kv_heads, head_dim;
    const float *cos_sin;
    int64_t max_position, rot;
    int32_t neox;
    float scale;
    float *k_cache, *v_cache;
    int64_t slot_stride;
} DecodeLayer;

/* One step's batch (rows = running requests) and scratch buffers, each `rows` rows wide as
 * named: normed [hidden], qkv [(q_heads + 2 kv_heads) head_dim], q and attn [q_heads
 * head_dim], o [hidden], gate_up [2 inter], act [inter]. leaders / shared_lens may be NULL. */
typedef struct {
    int64_t rows;
    const int64_t *positions, *out_cache_loc;
    const int32_t *req_to_token;
    int64_t r2t_stride;
    const int64_t *pool_rows, *seq_lens, *leaders, *shared_lens;
    float *normed, *qkv, *q, *attn, *o, *gate_up, *act;
    int32_t threads;
} DecodeStep;

/* x [rows, hidden] (overwritten), residual [rows, hidden] or NULL for the first layer (then
 * x becomes the residual), out [rows, hidden]. Returns 0; 2 for a position outside the RoPE
 * cache or a head shape the attention kernel has no case for (nothing is written to the pool
 * in the first case); 1 when the attention's scratch could not be allocated. */
int decode_layer(const DecodeLayer *L, const DecodeStep *S, float *x, float *residual,
                 float *out) {
    const int64_t B = S->rows, hidden = L->hidden, D = L->head_dim;
    const int64_t q_dim = L->q_heads * D, kv_dim = L->kv_heads * D, n_qkv = q_dim + 2 * kv_dim;
    const int threads = S->threads;
    float *h;
    if (residual == NULL) {
        rmsnorm_rows(x, hidden, NULL, 0, L->input_norm, S->normed, hidden, B, hidden, 0,
                     L->input_eps, threads);
        residual = x;
        h = S->normed;
    } else {
        rmsnorm_rows(x, hidden, residual, hidden, L->input_norm, x, hidden, B, hidden, 0,
                     L->input_eps, threads);
        h = x;
    }
    packed_linear(h, hidden, L->qkv, L->qkv_bias, (int)B, (int)n_qkv, (int)hidden, S->qkv, n_qkv,
                  threads);
    if (rope_rows(S->qkv, n_qkv, L->q_heads, S->qkv + q_dim, n_qkv, L->kv_heads, S->positions,
                  L->cos_sin, L->max_position, B, D, L->rot, L->neox, 0, threads) != 0)
        return 2;
    for (int64_t b = 0; b < B; b++) {
        const float *row = S->qkv + b * n_qkv;
        memcpy(L->k_cache + S->out_cache_loc[b] * L->slot_stride, row + q_dim,
               sizeof(float) * (size_t)kv_dim);
        memcpy(L->v_cache + S->out_cache_loc[b] * L->slot_stride, row + q_dim + kv_dim,
               sizeof(float) * (size_t)kv_dim);
        memcpy(S->q + b * q_dim, row, sizeof(float) * (size_t)q_dim);
    }
    const int status = paged_decode_attention(
        S->q, L->k_cache, L->v_cache, 0, L->slot_stride, S->req_to_token, S->r2t_stride,
        S->pool_rows, S->seq_lens, S->leaders, S->shared_lens, (int)B, (int)L->q_heads,
        (int)L->kv_heads, (int)D, L->scale, S->attn, threads);
    if (status != 0) return status;
    packed_linear(S->attn, q_dim, L->o, L->o_bias, (int)B, (int)hidden, (int)q_dim, S->o, hidden,
                  threads);
    rmsnorm_rows(S->o, hidden, residual, hidden, L->post_norm, S->o, hidden, B, hidden, 0,
                 L->post_eps, threads);
    packed_linear(S->o, hidden, L->gate_up, L->gate_up_bias, (int)B, (int)(2 * L->inter),
                  (int)hidden, S->gate_up, 2 * L->inter, threads);
    silu_and_mul_rows(S->gate_up, 2 * L->inter, S->act, L->inter, B, L->inter, 0, threads);
    packed_linear(S->act, L->inter, L->down, L->down_bias, (int)B, (int)hidden, (int)L->inter,
                  out, hidden, threads);
    return 0;
}
