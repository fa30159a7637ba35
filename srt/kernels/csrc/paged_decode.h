/* paged_decode.c's entry points, for the libraries linked against it (decode_layer.c): the
 * definition includes this header too, so the two cannot drift apart. */
#ifndef RADIXRT_PAGED_DECODE_H
#define RADIXRT_PAGED_DECODE_H

#include <stdint.h>

int paged_decode_supports(int H, int Hkv, int D);

int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
                           int64_t slot_stride, const int32_t *req_to_token, int64_t r2t_stride,
                           const int64_t *pool_rows, const int64_t *seq_lens,
                           const int64_t *leaders, const int64_t *shared_lens, int B, int H,
                           int Hkv, int D, float scale, int64_t window, float softcap,
                           float *out, int num_threads);

#endif
