// KV-cache write: the K and V heads of each token's fused QKV row go to its slot's row `pos` in one
// layer's cache. rope_store_* first applies RoPE to the Q and K heads in place (rope.cuh), then
// writes: one launch instead of two per layer.
//
// qkv: float32 [n, qkv_stride] (rows: n_head Q heads, n_head_kv K heads, n_head_kv V heads);
// k_cache, v_cache: [n_slots, n_ctx_slot, n_head_kv, head_dim] in the cache's storage type;
// slots, positions: int32 [n]; cos, sin: float32 [n_ctx_slot, rope_dim / 2]. Rows past a slot's
// length are stale and never read (see fastserve/backends/base.py), so nothing else is cleared.
// Grid: n blocks, one per token; any block size.
#include "common.cuh"
#include "rope.cuh"

template <typename T>
__device__ __forceinline__ void kv_store(const float* __restrict__ qkv, T* __restrict__ k_cache,
                                         T* __restrict__ v_cache, const int* __restrict__ slots,
                                         const int* __restrict__ positions, int qkv_stride, int n_head,
                                         int n_head_kv, int head_dim, int n_ctx_slot) {
    const int t = blockIdx.x;
    const int kv_dim = n_head_kv * head_dim;
    const float* k = qkv + (size_t)t * qkv_stride + (size_t)n_head * head_dim;
    const float* v = k + kv_dim;
    const size_t base = ((size_t)slots[t] * n_ctx_slot + positions[t]) * kv_dim;
    for (int j = threadIdx.x; j < kv_dim; j += blockDim.x) {
        k_cache[base + j] = from_float<T>(k[j]);
        v_cache[base + j] = from_float<T>(v[j]);
    }
}

template <typename T>
__device__ __forceinline__ void rope_store(float* __restrict__ qkv, const float* __restrict__ cos_table,
                                           const float* __restrict__ sin_table, T* __restrict__ k_cache,
                                           T* __restrict__ v_cache, const int* __restrict__ slots,
                                           const int* __restrict__ positions, int qkv_stride, int n_head,
                                           int n_head_kv, int head_dim, int rope_dim, int n_ctx_slot) {
    const int t = blockIdx.x;
    const size_t pos = (size_t)positions[t] * (rope_dim >> 1);
    rope_row(qkv + (size_t)t * qkv_stride, cos_table + pos, sin_table + pos, n_head + n_head_kv, head_dim, rope_dim);
    __syncthreads();     // the rotated K is read below by other threads of the block
    kv_store(qkv, k_cache, v_cache, slots, positions, qkv_stride, n_head, n_head_kv, head_dim, n_ctx_slot);
}

#define KV_STORE(NAME, T)                                                                                 \
    extern "C" __global__ void NAME(const float* qkv, T* k_cache, T* v_cache, const int* slots,            \
                                    const int* positions, int qkv_stride, int n_head, int n_head_kv,       \
                                    int head_dim, int n_ctx_slot) {                                        \
        kv_store(qkv, k_cache, v_cache, slots, positions, qkv_stride, n_head, n_head_kv, head_dim, n_ctx_slot); \
    }

#define ROPE_STORE(NAME, T)                                                                               \
    extern "C" __global__ void NAME(float* qkv, const float* cos_table, const float* sin_table, T* k_cache, \
                                    T* v_cache, const int* slots, const int* positions, int qkv_stride,    \
                                    int n_head, int n_head_kv, int head_dim, int rope_dim, int n_ctx_slot) { \
        rope_store(qkv, cos_table, sin_table, k_cache, v_cache, slots, positions, qkv_stride, n_head,     \
                   n_head_kv, head_dim, rope_dim, n_ctx_slot);                                            \
    }

KV_STORE(kv_store_f16, f16)
KV_STORE(kv_store_bf16, bf16)
KV_STORE(kv_store_f32, float)
ROPE_STORE(rope_store_f16, f16)
ROPE_STORE(rope_store_bf16, bf16)
ROPE_STORE(rope_store_f32, float)
