// What some architectures (models/architecture.py) do to a token's fused QKV row before RoPE, in place:
//   1. bias (qwen2): row[j] += bias[j] over the whole row (Q, K and V);
//   2. per-head RMSNorm (qwen3, gemma3): each Q head x[0..D) = x / sqrt(mean(x^2) + eps) * q_norm, each
//      K head the same with k_norm; V untouched. Arithmetic as backends/cpu/ref/layer_ops.rms_norm: x * (1 / sqrt(ms +
//      eps)) * w, the sum of squares by block_sum.
// qkv: float32 [n, qkv_stride], rows = n_head Q heads, n_head_kv K heads, n_head_kv V heads of head_dim;
// bias: float32 [qkv_stride] or NULL; q_norm, k_norm: float32 [head_dim], both or neither NULL.
// Grid: n blocks, one per token; block: a multiple of 32 threads, at most 1024.
#include "common.cuh"

extern "C" __global__ void qk_prep_f32(float* __restrict__ qkv, const float* __restrict__ bias,
                                       const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                                       int qkv_stride, int n_head, int n_head_kv, int head_dim, float eps) {
    __shared__ float scratch[32];
    float* row = qkv + (size_t)blockIdx.x * qkv_stride;
    if (bias != nullptr) {
        for (int j = threadIdx.x; j < qkv_stride; j += blockDim.x) row[j] += bias[j];
        __syncthreads();
    }
    if (q_norm == nullptr) return;
    for (int h = 0; h < n_head + n_head_kv; ++h) {      // every thread runs every head: block_sum syncs
        float* x = row + (size_t)h * head_dim;
        const float* w = h < n_head ? q_norm : k_norm;
        float s = 0.0f;
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) s += x[d] * x[d];
        s = block_sum(s, scratch);
        const float inv = rms_inv(s, head_dim, eps);
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) x[d] = x[d] * inv * w[d];
    }
}
