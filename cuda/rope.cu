// RoPE in place on the Q and K parts of the fused QKV rows (see rope.cuh for the rotation).
//
// qkv: float32 [n, qkv_stride], each row = n_head Q heads, then n_head_kv K heads, then V (untouched),
// head_dim floats per head; cos, sin: float32 [n_ctx_slot, rope_dim / 2] (backends/rope.rope_tables);
// positions: int32 [n]; n_rot_heads = n_head + n_head_kv.
// Grid: n blocks, one per token; any block size.
// (The backend uses rope_store_* in kv_cache.cu, which fuses this with the KV-cache write.)
#include "common.cuh"
#include "rope.cuh"

extern "C" __global__ void rope_qk_f32(float* __restrict__ qkv, const float* __restrict__ cos_table,
                                       const float* __restrict__ sin_table, const int* __restrict__ positions,
                                       int qkv_stride, int n_rot_heads, int head_dim, int rope_dim) {
    const int t = blockIdx.x;
    const size_t pos = (size_t)positions[t] * (rope_dim >> 1);
    rope_row(qkv + (size_t)t * qkv_stride, cos_table + pos, sin_table + pos, n_rot_heads, head_dim, rope_dim);
}
